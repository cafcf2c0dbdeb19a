"""Elastic training on a real Slurm cluster (issue 25 items 3 and 4 over :class:`~hspmd_sdk.runtime.SlurmTransport`):
a node is lost mid-run, the survivors replan and switch in memory; the node comes back and the job grows onto it.

The cluster is :class:`hspmd_sdk.testing.slurm.LocalSlurm`: munged, slurmctld and one slurmd per node, each node in
a network namespace of its own; one H800 node and two H20 nodes, one GPU (a GRES backed by a fake device file)
each; the workers compute on the CPU with gloo.  Faults are real: ``kill_node`` SIGKILLs the node's slurmd and every
process of its namespace (the worker and its slurmstepd); ``cut_node`` takes the node's link down.  Slurm is
configured to mark a silent node ``DOWN`` only after two minutes (``SlurmdTimeout=120``), so a recovery that
happens while the node is not ``DOWN`` was the SDK's own doing (its heartbeats and its peers' communication errors).

The references are independent of the transport and of the job: the single-device model's losses, the node list
the test configured, Slurm's own job and step lists (``squeue``) and every node's process list
(``ip netns pids``)."""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.testing.slurm import LocalSlurm, SlurmNode, slurm_unavailable  # noqa: E402
from _needs import skip_or_fail  # noqa: E402
from test_slurm import assert_nothing_left  # noqa: E402

NODES = [SlurmNode("n1", "H800", gpus=1, cpus=2, memory_mb=4000),
         SlurmNode("n2", "H20", gpus=1, cpus=2, memory_mb=4000),
         SlurmNode("n3", "H20", gpus=1, cpus=2, memory_mb=4000)]
SEQ, SEED, LR, STEPS = 16, 5, 1e-3, 8
TOL = 1e-5
#: heterogeneous: the H800 trains 6 of the 8 samples alone; the two H20s share a 2-stage pipeline for the other 2
HETERO = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 3]}], "micro_batch_size": 2,
                         "num_micro_batches": 3},
                        {"stages": [{"devices": [1], "layers": [0, 1]}, {"devices": [2], "layers": [2, 3]}],
                         "micro_batch_size": 2, "num_micro_batches": 1}]}
#: every rank waits at the start of this step (``hold_at=``) until the test releases it: the node is lost while the
#: three are held there, the survivors recover and hold there again, and the node's restart, the newcomer's start on
#: it (a fresh worker's imports take 5-8 s under load) and the grow all happen before any later step runs
HOLD = 2


@pytest.fixture(scope="module")
def slurm():  # type: ignore[no-untyped-def]
    skip_or_fail(slurm_unavailable(), "the Slurm tests (a local Slurm: root, slurm-wlm, munge)")
    with LocalSlurm(NODES, slurmd_timeout_s=120) as lab:
        yield lab


@pytest.fixture
def on_slurm(slurm: LocalSlurm, monkeypatch: pytest.MonkeyPatch) -> LocalSlurm:
    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    yield slurm
    for n in slurm.nodes:  # a test that failed half-way leaves no node dead or cut for the next one
        slurm.restore_node(n.name)
        if not any("slurmd" in _comm(p) for p in slurm.node_pids(n.name)):
            slurm.restart_node(n.name)
    assert_nothing_left(slurm, within=30.0)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def reference() -> object:
    from hspmd_sdk.runtime.control.train import reference_training

    return reference_training(LlamaConfig.preset("tiny"), steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)


def _program(cluster: Cluster, data: dict):
    model = LlamaConfig.preset("tiny")
    return specialize(model, plan_from_strategy(model, Strategy.load(data), cluster), cluster,
                      bindings={"B": 8, "S": SEQ})


def _launch(cluster: Cluster, **options):
    from hspmd_sdk.runtime import SlurmTransport
    from hspmd_sdk.runtime.control.train import launch

    transport = SlurmTransport()
    job = launch(_program(cluster, HETERO), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR,
                          transport=transport, device="cpu", timeout_s=60, heartbeat_s=0.5, elastic=True,
                          progress=False, hold_at=[HOLD],
                          **{"grow_back": False, **options})  # (these tests grow back themselves, but one)
    return job, transport


def _wait(cond, timeout: float = 120.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def _close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _lose_then_grow(lab: LocalSlurm, reference, lost: str, fault: str = "kill"):
    """Train HETERO on n1-n3; while the three are held at the start of step 2 lose ``lost`` (``kill``: its slurmd
    and every process on it SIGKILLed; ``cut``: its link down, restored once the job recovered); once the survivors
    switched (held there again), restart the node and grow the job back onto it; release the hold once the
    survivors heard the grow's switch: the recovery lands at step 2, the grow at the boundary before step 3.
    Checks what every variant shares; returns the job, transport, result and the allocations before the loss."""
    from hspmd_sdk.runtime.control.grow import extend_cluster

    cluster = Cluster.from_slurm()
    assert [(n.host, n.kind, n.ranks) for n in cluster.nodes] == [("n1", "H800", [0]), ("n2", "H20", [1]),
                                                                  ("n3", "H20", [2])]
    job, transport = _launch(cluster)
    try:
        assert job.wait_held(HOLD) == [0, 1, 2]
        before, pids = transport.allocations, job.pids()
        lost_rank = next(r for r in cluster.ranks if cluster.node_of(r).host == lost)
        (lab.kill_node if fault == "kill" else lab.cut_node)(lost)
        _wait(lambda: (job.events and job.events[0].done) or job.status.value != "running", what="the recovery")
        assert job.status.value == "running", job.wait(1)
        assert "DOWN" not in lab.node_states()[lost]  # recovered before Slurm even marked the node down
        (failure,) = job.events
        assert failure.reason == "failure" and failure.failed_ranks == [lost_rank] and failure.source == "memory"
        assert failure.step == HOLD and job.metrics.last_step() == HOLD - 1, str(failure)
        assert [n.host for n in job.cluster.nodes] == [h for h in ("n1", "n2", "n3") if h != lost]
        assert lost not in transport.allocations  # released: a node that returns gets a fresh allocation
        if fault == "cut":
            lab.restore_node(lost)
        lab.restart_node(lost)
        grown = extend_cluster(job.cluster, Cluster.from_slurm(nodes=lost))
        target = None if lost == "n1" else _program(grown, HETERO)  # n1 back last: the planner's plan
        event = job.grow(grown, target)
        job.wait_held(HOLD, heard=event)  # the newcomer is ready and both survivors heard the grow's switch
        assert job.metrics.last_step() == HOLD - 1
        job.release(HOLD)
        _wait(lambda: event.done or job.status.value != "running", what="the grow")
        groups = [(g.host, list(g.ranks), g.job_id) for g in transport.groups]
        result = job.wait(timeout=240)
    except BaseException:
        job.cancel()
        raise
    assert _close(result.losses, reference.losses) <= TOL, (result.losses, reference.losses)
    assert [e.reason for e in result.events] == ["failure", "grow"] and all(e.done for e in result.events)
    assert event.step == HOLD + 1 and job.cluster.num_ranks == 3, str(event)
    now = job.pids()
    assert {r: now[r] for r in pids if r != lost_rank} == {r: p for r, p in pids.items() if r != lost_rank}
    # the newcomer: a step of a fresh allocation on the returning node, which trained every step from the grow on
    newcomer = max(now)
    assert [(h, j) for h, ranks, j in groups if newcomer in ranks] == [(lost, groups[-1][2])]
    assert groups[-1][2] not in before.values()
    steps = sorted({m.step for m in job.metrics.rank(newcomer) if m.loss is not None})
    assert steps == list(range(event.step, STEPS)), steps
    return job, transport, result, before


@pytest.mark.timeout(300)
def test_a_killed_node_is_survived_in_memory_and_the_job_grows_back_onto_it(on_slurm: LocalSlurm,
                                                                             reference) -> None:
    """The H20 node holding the last pipeline stage dies (slurmd, slurmstepd and the worker SIGKILLed): the other two
    ranks replan to two full replicas (the lost stage's layers come from the H800's copy by the fused BSR), redo the
    interrupted step; the node restarts and ``job.grow`` puts the original heterogeneous plan back on three nodes.
    Every loss equals the single-device model's; the survivors are the same processes; nothing is left."""
    _lose_then_grow(on_slurm, reference, "n3")


@pytest.mark.slow  # ~100 s on a loaded 2-core machine
@pytest.mark.timeout(300)
def test_losing_rank_0s_node_moves_the_rendezvous_and_grows_back_to_the_planners_plan(on_slurm: LocalSlurm,
                                                                                      reference) -> None:
    """The H800 node (rank 0, the host of the world's rendezvous store) dies: the H20 pipeline's two ranks become
    two replicas meeting on n2; n1 returns as rank 2 of the grown cluster and the planner chooses the plan.
    Losses equal the single-device model's."""
    job, transport, result, _ = _lose_then_grow(on_slurm, reference, "n1")
    failure, grow = result.events
    assert failure.ranks == {1: 0, 2: 1}  # launch ranks 1 and 2 are the new world's 0 and 1
    assert [n.host for n in job.cluster.nodes] == ["n2", "n3", "n1"]


@pytest.mark.slow  # the launcher notices the cut node only by its silence
@pytest.mark.timeout(300)
def test_a_cut_off_node_is_survived_and_grows_back(on_slurm: LocalSlurm, reference) -> None:
    """The node's link goes down (its worker runs on, cut off, and leaves once it hears nothing from the launcher);
    the survivors go on without it; the link comes back, Slurm ends the leftover step, the job grows back onto it.
    Losses equal the single-device model's."""
    _lose_then_grow(on_slurm, reference, "n3", fault="cut")  # the node answers slurmctld again after its restart


@pytest.mark.timeout(300)
def test_grow_back_takes_a_restarted_node_back_by_itself(on_slurm: LocalSlurm, reference) -> None:
    """An elastic job on Slurm grows back by itself (the default there, SPEC §10): the H20 node of the last stage
    dies while the job is held at the start of step 2; the job recovers in memory on two nodes (held there again),
    and grows back onto the node once Slurm has it again (the transport asks: the node answers and no job holds
    it) -- no ``job.grow`` call; released once the survivors heard the grow's switch.  Losses equal the
    single-device model's; nothing is left."""
    cluster = Cluster.from_slurm()
    job, transport = _launch(cluster, grow_back=None)
    try:
        assert job.wait_held(HOLD) == [0, 1, 2]
        on_slurm.kill_node("n3")
        _wait(lambda: (job.events and job.events[0].done) or job.status.value != "running", what="the recovery")
        assert not transport.available("n3")  # dead to Slurm's eyes (or still held): nothing is grown yet
        assert [e.reason for e in job.events] == ["failure"]
        on_slurm.restart_node("n3")
        _wait(lambda: len(job.events) == 2 or job.status.value != "running", what="the grow back")
        assert [e.reason for e in job.events] == ["failure", "grow"], (job.status_text, job.notes[-2:])
        job.wait_held(HOLD, heard=job.events[1])
        assert job.metrics.last_step() == HOLD - 1
        job.release(HOLD)
        result = job.wait(timeout=240)
    except BaseException:
        job.cancel()
        raise
    assert _close(result.losses, reference.losses) <= TOL, (result.losses, reference.losses)
    assert [(e.reason, e.failed_ranks) for e in result.events] == [("failure", [2]), ("grow", [])]
    assert [e.step for e in result.events] == [HOLD, HOLD + 1], [str(e) for e in result.events]
    assert all(e.done for e in result.events) and [n.host for n in job.cluster.nodes] == ["n1", "n2", "n3"]
