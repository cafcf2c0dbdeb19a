"""Growing a running job in memory (issue 25 item 4, SPEC §10 ``job.grow``), against the single-device reference.

A job trains on 2 local ranks; after step 1, ``job.grow(Cluster.local(4), ...)`` starts two new workers; at the
next step boundary all four meet in a larger world and one fused BSR gives the newcomers their parameters and Adam
moments.  The losses of every step (before, at and after the grow) equal the single-device run's; the running
workers are the same processes; nothing is left behind.  With ZeRO-1 on and off, to the planner's own plan, and a
grown job that then loses a worker (``elastic=True``) and recovers.
"""
from __future__ import annotations

import os
import signal

import pytest

torch = pytest.importorskip("torch")

from _equivalence import final_state_matches  # noqa: E402
from _procs import assert_no_workers_left, wait_for  # noqa: E402
from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime.control.controller import SwitchError  # noqa: E402
from hspmd_sdk.runtime.control.train import launch, reference_training  # noqa: E402

SEQ, SEED, LR, STEPS = 16, 5, 1e-3, 6
TOL = 1e-5
#: every step of the running ranks emulated 4x slower, step 2 200x (a few seconds): the grow, requested after
#: step 1, is planned (the planner's own plan takes ~2 s on a loaded machine) while the job still runs
STRETCH = [(0, 4.0), (2, 200.0), (3, 4.0)]


def _pipe(stages, mbs: int, n: int) -> dict:
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": mbs,
            "num_micro_batches": n}


DP2 = {"pipelines": [_pipe([([0], [0, 3])], 4, 1), _pipe([([1], [0, 3])], 4, 1)]}
DP4 = {"pipelines": [_pipe([([r], [0, 3])], 2, 1) for r in range(4)]}
#: two pipelines of TP2 over the four ranks: the newcomers hold halves of every matrix
TP2_DP2 = {"pipelines": [_pipe([([0, 2], [0, 3])], 4, 1), _pipe([([1, 3], [0, 3])], 4, 1)]}


def _program(model, data: dict, cluster: Cluster, zero1: bool = False):
    strategy = Strategy.load({**data, "zero1": zero1})
    return specialize(model, plan_from_strategy(model, strategy, cluster), cluster, bindings={"B": 8, "S": SEQ})


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference() -> object:
    return reference_training(LlamaConfig.preset("tiny"), steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)


def _grow_run(reference, grown: dict | None, *, zero1: bool = False, elastic: bool = False, kill_after: bool = False,
              **options):
    model, small, big = LlamaConfig.preset("tiny"), Cluster.local(2), Cluster.local(4)
    job = launch(_program(model, DP2, small, zero1), small, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR,
                          timeout_s=60, heartbeat_s=0.5, elastic=elastic, **options,
                          slowdown={r: STRETCH for r in small.ranks})
    old = job.pids()
    wait_for(lambda: job.metrics.last_step() >= 1)
    event = job.grow(big, None if grown is None else _program(model, grown, big, zero1))
    wait_for(lambda: event.done or job.status.value != "running")
    assert event.done and event.reason == "grow", event
    assert event.ranks == {0: 0, 1: 1, 2: 2, 3: 3} and event.step >= 2
    pids = job.pids()
    assert {r: pids[r] for r in old} == old and set(pids) == {0, 1, 2, 3}  # the running workers stay
    if kill_after:
        wait_for(lambda: job.metrics.last_step() >= event.step)
        os.kill(pids[3], signal.SIGKILL)
    result = job.wait(timeout=150)
    assert len(result.losses) == STEPS and _close(result.losses, reference.losses) <= TOL, \
        (result.losses, reference.losses)
    assert job.cluster.num_ranks == (3 if kill_after else 4)
    # the newcomers trained the steps from the grow on (every rank reports every step's global loss; a reload
    # from a checkpoint redoes some)
    for r in (2, 3) if not kill_after else (2,):
        steps = [m.step for m in job.metrics.rank(r) if m.loss is not None]
        assert sorted(set(steps)) == list(range(event.step, STEPS)), (r, steps)
    assert_no_workers_left(list(pids.values()), within=10)
    return job, result, event


@pytest.mark.timeout(180)
@pytest.mark.parametrize("zero1", [False, True])
def test_a_job_grows_from_two_to_four_ranks_in_memory(reference, zero1: bool, tmp_path) -> None:
    """DP2 -> TP2 x DP2 onto two new workers (ZeRO-1 off and on): equal losses, the same two processes go on, and
    the final parameters and Adam moments of all four ranks are the single-device run's (the losses alone would
    not show a moment lost in the move: Adam's next steps hardly change)."""
    _, result, event = _grow_run(reference, TP2_DP2, zero1=zero1, capture_dir=tmp_path)
    assert event.bytes["intra"] > 0  # the newcomers' shards moved by the BSR (not recomputed, not reloaded)
    assert [e.reason for e in result.events] == ["grow"]
    final_state_matches(tmp_path, reference, ranks=4)  # every rank of the grown job saved its shards


@pytest.mark.timeout(180)
def test_a_grown_job_to_the_planners_plan_then_loses_a_newcomer(reference, tmp_path) -> None:
    """``job.grow(cluster)`` without a program takes the planner's plan for the four ranks (on this cluster a
    pipeline with no data-parallel replica); then a newcomer is SIGKILLed (``elastic=True``): its layers have no
    surviving copy, so the three survivors reload them from the newest checkpoint, written under the grown plan.
    Losses equal throughout."""
    _, result, _ = _grow_run(reference, None, elastic=True, kill_after=True, checkpoint_dir=tmp_path / "ck",
                             checkpoint_every=1, keep=STEPS)
    assert [e.reason for e in result.events] == ["grow", "failure"]
    assert all(e.done for e in result.events)
    assert result.events[1].source == "checkpoint" and result.events[1].checkpoint_step >= result.events[0].step


@pytest.mark.timeout(180)
def test_a_newcomer_lost_in_the_first_step_after_the_grow_is_named_by_the_failure(reference) -> None:
    """DP2 grows to DP4; a newcomer is SIGKILLed as soon as every worker switched, inside the first grown step.  The
    original ranks still keep the state from before the grow, the surviving newcomer holds only the grown one (the
    job failed here: "the survivors disagree on their state"); every survivor completed the grow's switch, so the
    job recovers from the grown state onto the three survivors, newcomer included.  The failure event names the
    newcomer (it named nobody: found by the chaos soak's reproduction), and the losses stay equal."""
    model, small, big = LlamaConfig.preset("tiny"), Cluster.local(2), Cluster.local(4)
    grown = _program(model, DP4, big)  # made before the job starts: the grow lands steps before the last one
    # steps from 2 on stretched 20x (~0.5 s): the grow, requested after step 1 and ready ~0.5 s later, lands by
    # step 3 or 4, and the kill after its switch lands inside a step (at 6x, steps of 0.14 s, it was late: the
    # grow landed on the last step and the job could end before the kill)
    job = launch(_program(model, DP2, small), small, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                          heartbeat_s=0.3, elastic=True, slowdown={r: [(0, 6.0), (2, 20.0)] for r in small.ranks})
    wait_for(lambda: job.metrics.last_step() >= 1)
    with job._lock:  # the newcomers' steps are stretched like the others' (emulation), so the kill lands mid-step
        job.spec = job.spec.model_copy(update={"slowdown": {**job.spec.slowdown, 2: 20.0, 3: 20.0}})
    event = job.grow(big, grown)
    wait_for(lambda: event.done or job.status.value != "running")
    os.kill(job.pids()[3], signal.SIGKILL)
    result = job.wait(timeout=150)
    assert len(result.losses) == STEPS and _close(result.losses, reference.losses) <= TOL
    assert [(e.reason, e.failed_ranks) for e in result.events] == [("grow", []), ("failure", [3])], \
        [str(e) for e in result.events]
    assert sorted(result.events[1].ranks) == [0, 1, 2] and result.events[1].source == "memory"


@pytest.mark.timeout(240)
def test_the_job_trains_on_while_its_newcomers_start() -> None:
    """The newcomers are fresh processes (no fork server: seconds of imports, as on an SSH host or a Slurm node);
    the running ranks do not wait for them at the next step boundary but train on, and the switch comes at the
    first boundary after both are ready.  Then the job is stopped; its losses equal the single-device run's."""
    from hspmd_sdk.runtime.transports.transport import LocalTransport

    model, small, big = LlamaConfig.preset("tiny"), Cluster.local(2), Cluster.local(4)
    job = launch(_program(model, DP2, small), small, steps=5000, seed=SEED, seq_len=SEQ, lr=LR,
                          timeout_s=120, heartbeat_s=0.5, transport=LocalTransport(fork=False),
                          slowdown={r: 20.0 for r in small.ranks})  # ~0.5 s a step: tens of steps, not hundreds
    try:
        wait_for(lambda: job.metrics.last_step() >= 1, timeout=120)
        asked = job.metrics.last_step()
        event = job.grow(big, _program(model, DP4, big))
        wait_for(lambda: event.done or event.superseded or job.status.value != "running", timeout=150)
        job.stop()
        result = job.wait(timeout=150)
    finally:
        job.cancel()
    assert event.done and not event.superseded, [str(e) for e in job.events]
    with job._lock:
        built = {r: job._ranks[r].phases.get("built") for r in (2, 3)}
    started = [m.step for m in job.metrics.rank(0) if m.loss is not None]
    # steps 0..event.step-1 ran on the two original ranks, many of them while the newcomers were starting
    assert event.step >= asked + 3 and all(built.values()), (asked, event.step, built)
    assert sorted(set(started)) == list(range(len(result.losses)))
    reference = reference_training(model, steps=len(result.losses), seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    assert _close(result.losses, reference.losses) <= TOL


@pytest.mark.timeout(240)
def test_a_newcomer_lost_while_it_starts_gives_the_grow_up_and_the_job_goes_on() -> None:
    """A newcomer (a fresh process, seconds of imports) is SIGKILLed before it is ready: the grow is given up
    (its event ``superseded``, the other newcomer stopped, a note says why) and the running job, which was never
    told of the grow, trains on untouched to the end, with no failure event and the single-device losses."""
    from hspmd_sdk.runtime.transports.transport import LocalTransport

    model, small, big = LlamaConfig.preset("tiny"), Cluster.local(2), Cluster.local(4)
    steps = 24
    job = launch(_program(model, DP2, small), small, steps=steps, seed=SEED, seq_len=SEQ, lr=LR,
                          timeout_s=120, heartbeat_s=0.5, elastic=True, transport=LocalTransport(fork=False),
                          slowdown={r: 20.0 for r in small.ranks})
    try:
        wait_for(lambda: job.metrics.last_step() >= 1, timeout=120)
        old = job.pids()
        event = job.grow(big, _program(model, DP4, big))
        wait_for(lambda: len(job.pids()) == 4, timeout=30)
        with job._lock:
            assert "built" not in job._ranks[3].phases  # still importing
        os.kill(job.pids()[3], signal.SIGKILL)
        result = job.wait(timeout=150)
    finally:
        job.cancel()
    assert event.superseded and not event.done
    assert [e.reason for e in result.events] == ["grow"] and job.cluster.num_ranks == 2
    assert any("given up" in n and "[2, 3]" in n for n in job.notes), job.notes
    assert [f.rank for f in result.failures] == [3]
    reference = reference_training(model, steps=steps, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    assert len(result.losses) == steps and _close(result.losses, reference.losses) <= TOL
    assert_no_workers_left(list(old.values()) + [job._ranks[r].pid for r in (2, 3) if job._ranks[r].pid], within=10)


def test_grow_refuses_a_cluster_that_is_not_the_running_one_plus_new_ranks() -> None:
    """Bad input is refused before any worker starts: a smaller cluster, a cluster whose first ranks are other
    devices, something that is not a Cluster."""
    model, small = LlamaConfig.preset("tiny"), Cluster.local(2)
    job = launch(_program(model, DP2, small), small, steps=2, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                          slowdown={0: [(0, 1.0), (1, 200.0)], 1: [(0, 1.0), (1, 200.0)]})
    try:
        with pytest.raises(SwitchError, match="larger cluster"):
            job.grow(Cluster.local(2))
        with pytest.raises(SwitchError, match="rank 0 of the grown cluster is a H800"):
            job.grow(Cluster.mixed({"H800": 1, "cpu": 3}, per_node=4))
        with pytest.raises(SwitchError, match="takes the larger Cluster"):
            job.grow("4 ranks")
        assert sorted(job.pids()) == [0, 1]
    finally:
        job.cancel()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("killed", [1, 3], ids=["original", "newcomer"])
def test_a_rank_lost_during_the_grows_switch(reference, killed: int) -> None:
    """DP2 grows to DP4, and a rank is SIGKILLed inside the grow's switch, after the grown world formed and before
    its BSR: original rank 1 (the newcomer it was to send to never gets its shards: it holds nothing, the others
    may have completed the switch) or newcomer 3 (the originals' sends to it fail: they still hold the state from
    before the grow, newcomer 2 maybe the grown one).  The survivors agree on a state they hold (the newcomers that
    hold nothing of it only receive: they stay in the job) and the losses stay equal."""
    model, small, big = LlamaConfig.preset("tiny"), Cluster.local(2), Cluster.local(4)
    job = launch(_program(model, DP2, small), small, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                          heartbeat_s=0.3, elastic=True, slowdown={r: STRETCH for r in small.ranks},
                          fault_injection=[{"rank": killed, "at": "switch"}])
    wait_for(lambda: job.metrics.last_step() >= 1)
    job.grow(big, _program(model, DP4, big))
    result = job.wait(timeout=150)
    assert len(result.losses) == STEPS and _close(result.losses, reference.losses) <= TOL
    assert [(e.reason, e.failed_ranks) for e in result.events] == [("grow", []), ("failure", [killed])], \
        [str(e) for e in result.events]
    assert sorted(result.events[1].ranks) == sorted({0, 1, 2, 3} - {killed})  # every survivor goes on


@pytest.mark.timeout(180)
def test_a_rank_lost_while_the_grow_waits_for_its_boundary(reference) -> None:
    """DP2 grows to DP4, requested while the running ranks are held at the start of step 2: once the newcomers are
    ready the launcher sends them and the running ranks the grow's switch (every running rank has heard it, none
    has reached the boundary where it applies it), and the newcomers go to wait for the grown world, whose host
    (rank 0) comes only at that boundary; original rank 1 is SIGKILLed there.  Rank 0 halts, the newcomers give the
    grown world's rendezvous up on the launcher's halt (they hold nothing), and the survivors recover instead of
    waiting out the rendezvous: the job finishes with the losses of the single-device run."""
    model, small, big = LlamaConfig.preset("tiny"), Cluster.local(2), Cluster.local(4)
    job = launch(_program(model, DP2, small), small, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                          heartbeat_s=0.3, elastic=True, hold_at=[2])
    assert job.wait_held(2) == [0, 1]
    pids = job.pids()
    event = job.grow(big, _program(model, DP4, big))
    job.wait_held(2, heard=event)  # the grow's switch is out: the newcomers head for the grown world's rendezvous
    assert job.metrics.last_step() == 1 and not event.done
    os.kill(pids[1], signal.SIGKILL)
    job.release(2)  # rank 0 halts at once (it heard of the death) or in step 2's first collective
    result = job.wait(timeout=150)
    assert len(result.losses) == STEPS and _close(result.losses, reference.losses) <= TOL
    failures = [e for e in result.events if e.reason == "failure"]
    assert len(failures) == 1 and failures[0].failed_ranks == [1] and failures[0].done, \
        [str(e) for e in result.events]
    assert 1 not in job.pids()


@pytest.mark.timeout(180)
def test_an_elastic_job_grows_back_by_itself_after_it_recovered(reference) -> None:
    """``grow_back=True``: a rank of a DP4 job is SIGKILLed; the job recovers on three ranks, then (this machine can
    take workers again at once) grows back onto four by itself: a ``failure`` then a ``grow`` event, the job ends on
    the cluster it was launched on, and the losses equal the single-device run's throughout."""
    from hspmd_sdk.runtime.control.growback import GrowBack

    model, big = LlamaConfig.preset("tiny"), Cluster.local(4)
    job = launch(_program(model, DP4, big), big, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                          heartbeat_s=0.3, elastic=True, grow_back=GrowBack(after_s=0.2),
                          slowdown={r: STRETCH for r in big.ranks})
    wait_for(lambda: job.metrics.last_step() >= 0)
    os.kill(job.pids()[2], signal.SIGKILL)
    result = job.wait(timeout=150)
    assert len(result.losses) == STEPS and _close(result.losses, reference.losses) <= TOL
    assert [(e.reason, e.failed_ranks) for e in result.events] == [("failure", [2]), ("grow", [])], \
        [str(e) for e in result.events]
    assert all(e.done for e in result.events) and job.cluster.num_ranks == 4
    assert sorted(result.events[1].ranks) == [0, 1, 3, 4]  # the newcomer is launch rank 4, on the lost capacity


def test_grow_back_is_refused_without_elastic_and_for_a_bad_value() -> None:
    from hspmd_sdk.errors import PlanValidationError

    model, small = LlamaConfig.preset("tiny"), Cluster.local(2)
    for bad, said in ((True, "needs elastic=True"), ("yes", "must be True, False, None or a GrowBack")):
        with pytest.raises(PlanValidationError, match=said):
            launch(_program(model, DP2, small), small, steps=2, seed=SEED, seq_len=SEQ, lr=LR,
                            elastic=bad is not True, grow_back=bad)


def test_plan_back_returns_to_the_launch_plan_and_plans_around_what_is_still_missing() -> None:
    """Growing back (``grow_back``) goes back to the plan the job was launched with, its devices matched host by
    host to the grown cluster's numbering; with a device still missing, that plan replanned around it."""
    from types import SimpleNamespace

    from hspmd_sdk.planner.elastic import survivor_cluster
    from hspmd_sdk.runtime.control.grow import extend_cluster
    from hspmd_sdk.core.strategy_plan import strategy_of
    from hspmd_sdk.runtime.control.growback import lost_capacity, plan_back

    model, launched = LlamaConfig.preset("tiny"), Cluster.local(4)
    launch = _program(model, TP2_DP2, launched)
    ctl = SimpleNamespace(launch_program=launch, seq_len=SEQ, global_batch=8, cost=None,
                          current=SimpleNamespace(to_launch={0: 0, 1: 2}))
    now, _ = survivor_cluster(launched, [1, 3])          # the job runs on launch ranks 0 and 2
    whole = extend_cluster(now, lost_capacity(launched, now))
    back = plan_back(ctl, launched, whole)
    assert back.bindings == launch.bindings and back.cluster == whole
    # every stage keeps its TP2 shape: launch ranks (0, 2) and (1, 3) -> grown ranks (0, 2) and (1, 3)
    stages = sorted(sorted(s.devices) for p in strategy_of(back).pipelines for s in p.stages)
    assert stages == [[0, 1], [2, 3]], stages
    lost = lost_capacity(launched, now)
    one = Cluster.load({**lost.model_dump(), "nodes": [{**lost.nodes[0].model_dump(), "ranks": [0]}]})
    part = extend_cluster(now, one)
    partly = plan_back(ctl, launched, part)
    assert part.num_ranks == 3 and sorted(partly.ranks) == [0, 1, 2]  # one still missing: replanned around it
