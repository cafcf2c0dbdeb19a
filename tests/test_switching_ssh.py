"""Elastic training over the SSH transport (real sshd "hosts" on loopback addresses): a killed remote worker and
a whole lost host (its agent and its workers) are survived; the losses equal the single-device reference; the
survivors keep their processes; nothing is left behind."""
from __future__ import annotations

import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime.transports.ssh import SSHTransport  # noqa: E402
from hspmd_sdk.testing.sshd import LoopbackHosts, sshd_available  # noqa: E402
from hspmd_sdk.runtime.control.train import launch, reference_training  # noqa: E402

pytestmark = pytest.mark.skipif(not sshd_available() and not os.environ.get("CI"),
                                reason="needs /usr/sbin/sshd (apt-get install openssh-server); required in CI")

SEQ, SEED, STEPS = 16, 5, 6
#: one pipeline per host (host A: ranks 0, 1; host B: ranks 2, 3): either host is a replica of the other
PER_HOST = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}],
                           "micro_batch_size": 2, "num_micro_batches": 2},
                          {"stages": [{"devices": [2], "layers": [0, 1]}, {"devices": [3], "layers": [2, 3]}],
                           "micro_batch_size": 2, "num_micro_batches": 2}]}


@pytest.fixture(scope="module")
def lab():
    with LoopbackHosts(2, ranks_per_host=2) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def reference() -> object:
    return reference_training(LlamaConfig.preset("tiny"), steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ)


def _launch(lab: LoopbackHosts, **kw):
    model = LlamaConfig.preset("tiny")
    program = specialize(model, plan_from_strategy(model, Strategy.load(PER_HOST), lab.cluster), lab.cluster,
                         bindings={"B": 8, "S": SEQ})
    transport = SSHTransport(lab.hosts, kill_timeout_s=2.0, **lab.ssh_options)
    return launch(program, lab.cluster, steps=STEPS, seed=SEED, seq_len=SEQ, elastic=True,
                           transport=transport, timeout_s=60, heartbeat_s=0.5, **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _wait(cond, timeout: float = 90.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


@pytest.mark.timeout(180)
def test_a_killed_remote_worker_is_survived(lab: LoopbackHosts, reference) -> None:
    job = _launch(lab, fault_injection=[{"rank": 3, "step": 2, "at": "backward"}])
    pids = job.pids()
    result = job.wait(timeout=150)
    assert result.losses == pytest.approx(reference.losses, rel=1e-5, abs=0)
    (event,) = result.events
    assert event.reason == "failure" and event.failed_ranks == [3] and event.done
    assert {r: p for r, p in job.pids().items() if r != 3} == {r: p for r, p in pids.items() if r != 3}
    _wait(lambda: not any(_alive(p) for p in pids.values()), 20)


@pytest.mark.timeout(180)
def test_a_lost_host_with_its_agent_and_workers_is_survived(lab: LoopbackHosts, reference) -> None:
    job = _launch(lab)
    pids = job.pids()
    _wait(lambda: job.metrics.last_step() >= 1)
    host_b = next(g for g in job.transport.groups if g.host == lab.servers[1].address)
    for pgid in [host_b.agent_pgid] + [pids[r] for r in host_b.ranks]:  # the whole host goes down at once
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    result = job.wait(timeout=150)
    assert result.losses == pytest.approx(reference.losses, rel=1e-5, abs=0)
    failures = [e for e in result.events if e.reason == "failure"]
    assert failures and set().union(*(set(e.failed_ranks) for e in failures)) == {2, 3} and failures[-1].done
    assert any(f.kind == "connection lost" or f.rank in (2, 3) for f in result.failures)
    assert {r: job.pids()[r] for r in (0, 1)} == {r: pids[r] for r in (0, 1)}
    _wait(lambda: not any(_alive(p) for p in pids.values()), 20)


@pytest.mark.slow  # default-suite budget: the API over SSH keeps test_a_killed_remote_worker_is_survived
@pytest.mark.timeout(180)
def test_hspmd_launch_elastic_survives_a_killed_remote_worker(lab: LoopbackHosts, reference, tmp_path,
                                                             monkeypatch, capsys) -> None:
    """``hspmd launch STRATEGY --elastic`` over SSH: a remote worker SIGKILLed from outside mid-run; the command
    exits 0, prints the single-device losses and the reconfiguration."""
    import json
    import threading

    from hspmd_sdk.cli import main
    from hspmd_sdk.runtime.control import train

    jobs = []
    real = train._launch_training
    monkeypatch.setattr(train, "_launch_training", lambda *a, **k: jobs.append(real(*a, **k)) or jobs[-1])
    (tmp_path / "hosts.txt").write_text("".join(f"{s.address} slots=2\n" for s in lab.servers))
    (tmp_path / "ssh.json").write_text(json.dumps(lab.hosts))
    (tmp_path / "s.json").write_text(json.dumps(PER_HOST))
    codes = []
    cli = threading.Thread(target=lambda: codes.append(main([
        "launch", str(tmp_path / "s.json"), "--hostfile", str(tmp_path / "hosts.txt"), "--ssh-hosts",
        str(tmp_path / "ssh.json"), "-i", str(lab.client_key), "--known-hosts", str(lab.known_hosts), "--elastic",
        "--steps", str(STEPS), "--seed", str(SEED), "--seq-len", str(SEQ), "--quiet", "--timeout", "60",
        "--heartbeat", "0.5"])))
    cli.start()
    _wait(lambda: jobs and jobs[0].metrics.last_step() >= 1)
    os.kill(jobs[0].pids()[3], signal.SIGKILL)
    cli.join(timeout=150)
    out = capsys.readouterr().out
    assert codes == [0], out
    losses = [float(x) for x in out.split("losses: ")[1].split("\n")[0].split()]
    assert losses == pytest.approx(reference.losses, rel=1e-5, abs=0)
    assert "reconfigured at step" in out and "failure, lost ranks [3]" in out, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("zero1", [False, True], ids=["zero1-off", "zero1-on"])
def test_a_job_on_one_host_grows_onto_a_second_host_over_ssh(lab: LoopbackHosts, reference, zero1: bool) -> None:
    """A DP2 job on host A (ranks 0, 1) grows onto host B (a new loopback sshd host, two new ranks): the SSH agent
    of B starts the newcomers, every worker meets at a fresh rendezvous on A, and one fused BSR gives the newcomers
    their shards (with ZeRO-1, Adam moments sharded over the replicas).  The grow is requested while the running
    workers are held at the start of step 2 and they are released once its switch reached them (the newcomers are
    ready): it lands at the boundary before step 3, whatever the machine's load.  The losses equal the
    single-device run's; the running workers keep their processes; nothing is left behind."""
    from hspmd_sdk import Cluster
    from hspmd_sdk.runtime.control.grow import extend_cluster

    model = LlamaConfig.preset("tiny")
    full = lab.cluster
    data = full.model_dump()
    host_a = Cluster.load({**data, "nodes": [data["nodes"][0]]})
    host_b = Cluster.load({**data, "nodes": [{**data["nodes"][1], "ranks": [0, 1]}]})
    dp2 = Strategy.load({"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 4,
                                        "num_micro_batches": 1} for r in (0, 1)], "zero1": zero1})
    program = specialize(model, plan_from_strategy(model, dp2, host_a), host_a, bindings={"B": 8, "S": SEQ})
    transport = SSHTransport(lab.hosts, kill_timeout_s=2.0, **lab.ssh_options)
    job = launch(program, host_a, steps=STEPS, seed=SEED, seq_len=SEQ, transport=transport, timeout_s=60,
                          heartbeat_s=0.5, hold_at=[2])
    pids = job.pids()
    grown = extend_cluster(job.cluster, host_b)
    dp4 = Strategy.load({"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 2,
                                        "num_micro_batches": 1} for r in range(4)], "zero1": zero1})
    bigger = specialize(model, plan_from_strategy(model, dp4, grown), grown, bindings={"B": 8, "S": SEQ})
    assert job.wait_held(2) == [0, 1]
    event = job.grow(grown, bigger)
    job.wait_held(2, heard=event)  # the newcomers are ready and the grow's switch reached both running workers
    job.release(2)
    result = job.wait(timeout=150)
    assert result.losses == pytest.approx(reference.losses, rel=1e-5, abs=0)
    assert [e.reason for e in result.events] == ["grow"] and event.done and event.bytes["inter"] > 0, job.notes
    assert event.step == 3, str(event)
    assert {r: job.pids()[r] for r in (0, 1)} == pids
    assert {g.host for g in job.transport.groups} == {s.address for s in lab.servers}
    every = job.pids()
    _wait(lambda: not any(_alive(p) for p in every.values()), 20)
