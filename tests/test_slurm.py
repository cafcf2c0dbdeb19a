"""Launching on a real Slurm cluster (SlurmTransport) brought up by the test: munged, slurmctld on a bridge
address, and two slurmd nodes in network namespaces of their own (:class:`hspmd_sdk.testing.slurm.LocalSlurm`),
one of H800 and one of H20 "GPUs" (GRES backed by fake device files; the workers compute on the CPU with gloo).

The references are independent of the transport: the single-device model's losses, the node configuration the
test wrote, and the process lists of every node's namespace (``ip netns pids``) and of this machine."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _needs import skip_or_fail

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.errors import PlanValidationError, RuntimeFailure
from hspmd_sdk.testing.slurm import LocalSlurm, SlurmNode, slurm_unavailable

TESTS = Path(__file__).resolve().parent
HETERO = json.loads((TESTS.parent / "hspmd_sdk" / "examples" / "example_hetero_tiny.json").read_text())
NODES = [SlurmNode("n1", "H800", gpus=2, cpus=4, memory_mb=4000),
         SlurmNode("n2", "H20", gpus=2, cpus=4, memory_mb=4000)]
#: one rank on each node, one GPU each: two such jobs fit on the cluster at once
ONE_EACH = {"nodes": [{"host": "n1", "kind": "H800", "ranks": [0]}, {"host": "n2", "kind": "H20", "ranks": [1]}]}


def where_am_i(state: Any, spec: Any) -> dict[str, Any]:
    """A worker entry (imported by the workers from this file): where it runs, as the node sees it."""
    state.report(0, loss=float(state.rank))
    return {"host": socket.gethostname(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "job": os.environ.get("SLURM_JOB_ID"), "step": os.environ.get("SLURM_STEP_ID"), "pid": os.getpid(),
            "master": f"{spec.master_addr}:{spec.master_port}"}


@pytest.fixture(scope="module")
def slurm():  # type: ignore[no-untyped-def]
    skip_or_fail(slurm_unavailable(), "the Slurm tests (a local Slurm: root, slurm-wlm, munge)")
    with LocalSlurm(NODES) as lab:
        yield lab


@pytest.fixture
def on_slurm(slurm: LocalSlurm, monkeypatch: pytest.MonkeyPatch) -> LocalSlurm:
    """The cluster's client settings and this folder on the workers' PYTHONPATH (for :func:`where_am_i`)."""
    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    yield slurm
    assert_nothing_left(slurm)


def srun_clients() -> list[str]:
    """``srun`` processes on this machine (the launcher side of job steps)."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if cmd and cmd[0].endswith(b"srun") and state != "Z":
            out.append(b" ".join(cmd).decode(errors="replace"))
    return out


def active_jobs() -> list[str]:
    r = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\n")[:-1]


def assert_nothing_left(slurm: LocalSlurm, within: float = 15.0) -> None:
    """No task on any node (every namespace's process list), no srun client here, no active Slurm job."""
    def left() -> dict[str, Any]:
        found: dict[str, Any] = {n.name: slurm.task_pids(n.name) for n in slurm.nodes}
        found = {k: v for k, v in found.items() if v}
        if srun_clients():
            found["srun"] = srun_clients()
        if active_jobs():
            found["squeue"] = active_jobs()
        return found
    deadline = time.monotonic() + within
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    rest = left()
    assert rest == {}, f"left behind after {within:g} s: {rest}"


@pytest.mark.timeout(80)
def test_from_slurm_reads_the_configured_nodes(on_slurm: LocalSlurm) -> None:
    cluster = Cluster.from_slurm()
    assert [(n.host, n.kind, n.ranks) for n in cluster.nodes] == [("n1", "H800", [0, 1]), ("n2", "H20", [2, 3])]


@pytest.mark.slow  # ~70 s on a loaded 2-core machine (4 workers importing torch)
@pytest.mark.timeout(240)
def test_heterogeneous_plan_on_slurm_trains_like_the_single_device_model(on_slurm: LocalSlurm) -> None:
    pytest.importorskip("torch")
    from hspmd_sdk import LlamaConfig, Strategy, specialize
    from hspmd_sdk.core.strategy_plan import plan_from_strategy
    from hspmd_sdk.runtime import SlurmTransport
    from hspmd_sdk.runtime.control.train import launch, reference_training

    cluster = Cluster.from_slurm()  # TP2 on the H800 node, then one H20; beside it a 1-rank pipeline on the other H20
    model = LlamaConfig.preset("tiny")
    program = specialize(model, plan_from_strategy(model, Strategy.load(HETERO), cluster), cluster,
                         bindings={"B": 8, "S": 16})
    transport = SlurmTransport(time="10:00")
    job = launch(program, cluster, steps=2, seed=1, seq_len=16, lr=1e-3, transport=transport,
                          device="cpu", timeout_s=90, progress=False)
    assert sorted(transport.allocations) == ["n1", "n2"]
    result = job.wait(timeout=130)
    reference = reference_training(model, steps=2, seed=1, global_batch=8, seq_len=16, lr=1e-3)
    assert result.losses == pytest.approx(reference.losses, rel=1e-5, abs=0)
    assert transport.allocations == {}


@pytest.mark.timeout(90)
def test_each_rank_is_a_step_on_its_node_with_its_own_gpu_and_nothing_is_left(on_slurm: LocalSlurm) -> None:
    from hspmd_sdk.runtime import SlurmTransport, launch

    cluster = Cluster.from_slurm()
    transport = SlurmTransport()
    result = launch(None, cluster, entry="test_slurm:where_am_i", steps=1, backend="gloo", transport=transport,
                    timeout_s=60, progress=False).wait(timeout=80)
    got = result.results
    assert [got[r]["host"] for r in range(4)] == ["n1", "n1", "n2", "n2"]
    assert {got[0]["cuda"], got[1]["cuda"]} == {"0", "1"} and {got[2]["cuda"], got[3]["cuda"]} == {"0", "1"}
    assert got[0]["job"] == got[1]["job"] != got[2]["job"] == got[3]["job"]  # one allocation per node
    assert len({(got[r]["job"], got[r]["step"]) for r in range(4)}) == 4  # one step per rank
    assert {got[r]["master"] for r in range(4)} == {got[0]["master"]}
    assert got[0]["master"].startswith(on_slurm.address("n1") + ":")  # rank 0's node, across the bridge


@pytest.mark.slow  # ~40 s on a loaded 2-core machine
@pytest.mark.timeout(150)
def test_two_jobs_at_once_then_cancel_leaves_nothing_on_any_node(on_slurm: LocalSlurm) -> None:
    from hspmd_sdk.runtime import JobCancelled, SlurmTransport, launch

    cluster = Cluster.load(ONE_EACH)
    first = launch(None, cluster, entry="hspmd_sdk.testing.entries:sleep_forever", steps=1, backend="gloo",
                   transport=SlurmTransport(), payload={"child": True}, timeout_s=60, progress=False)
    try:
        deadline = time.monotonic() + 60
        while not all("child pid" in first.logs(r) for r in (0, 1)):  # both workers are in their entry
            assert time.monotonic() < deadline, [first.logs(r) for r in (0, 1)]
            time.sleep(0.1)
        second = launch(None, cluster, entry="test_slurm:where_am_i", steps=1, backend="gloo",
                        transport=SlurmTransport(), timeout_s=60, progress=False)
        got = second.wait(timeout=80).results
        assert first.status.value == "running"  # the first job ran all along
        assert [got[r]["host"] for r in range(2)] == ["n1", "n2"]
        running = [line for line in active_jobs() if line.endswith("RUNNING")]
        assert len(running) == 2  # the first job's two allocations; the second's are gone
        assert all(on_slurm.task_pids(n) for n in ("n1", "n2"))  # the first job's workers (and children) run
    finally:
        first.cancel()
    with pytest.raises(JobCancelled):
        first.wait(timeout=30)


@pytest.mark.timeout(120)
def test_a_sigkilled_launcher_leaves_nothing_on_any_node(on_slurm: LocalSlurm, tmp_path: Path) -> None:
    """The launcher -- a Python process running a job whose workers sleep (one with a child) -- is SIGKILLed:
    it cannot cancel anything, yet its reaper (a session of its own) cancels the allocations it held, which ends
    the steps, their tasks and the srun clients: nothing is left on any node or here."""
    script = tmp_path / "launcher.py"
    script.write_text(f"""
import time
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.runtime import SlurmTransport, launch
job = launch(None, Cluster.load({ONE_EACH!r}), entry="hspmd_sdk.testing.entries:sleep_forever", steps=1,
             backend="gloo", transport=SlurmTransport(), payload={{"child": True}}, timeout_s=60, progress=False)
while not all("child pid" in job.logs(r) for r in (0, 1)):
    time.sleep(0.1)
print("running", flush=True)
time.sleep(600)
""")
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout.readline().strip() == "running"
        assert len([line for line in active_jobs() if line.endswith("RUNNING")]) == 2
        assert all(on_slurm.task_pids(n) for n in ("n1", "n2")) and srun_clients()
    finally:
        launcher.kill()
        launcher.wait()
    assert_nothing_left(on_slurm, within=45.0)


@pytest.mark.timeout(90)
def test_a_failing_rank_fails_the_job_and_leaves_nothing(on_slurm: LocalSlurm) -> None:
    from hspmd_sdk.runtime import SlurmTransport, launch

    job = launch(None, Cluster.load(ONE_EACH), entry="hspmd_sdk.testing.entries:fail_on_rank", steps=3,
                 backend="gloo", transport=SlurmTransport(), payload={"rank": 1, "step": 1}, timeout_s=60,
                 progress=False)
    with pytest.raises(RuntimeFailure, match="rank 1") as err:
        job.wait(timeout=80)
    assert "deliberate failure on rank 1" in str(err.value) + err.value.traceback


@pytest.mark.timeout(60)
def test_preflight_refuses_a_node_slurm_does_not_have_and_too_many_gpus(on_slurm: LocalSlurm) -> None:
    from hspmd_sdk.runtime import SlurmTransport, launch

    ghost = Cluster.load({"nodes": [{"host": "n1", "kind": "H800", "ranks": [0]},
                                    {"host": "n9", "kind": "H20", "ranks": [1]}]})
    with pytest.raises(PlanValidationError, match="Slurm has no node n9"):
        launch(None, ghost, entry="test_slurm:where_am_i", steps=1, backend="gloo", transport=SlurmTransport())
    greedy = Cluster.load({"nodes": [{"host": "n1", "kind": "H800", "ranks": [0, 1, 2]}]})
    with pytest.raises(PlanValidationError, match=r"nodes\.n1: 3 H800 ranks but Slurm gives the node 2 GPUs"):
        launch(None, greedy, entry="test_slurm:where_am_i", steps=1, backend="gloo", transport=SlurmTransport())
