"""Growing a running job in memory (issue 25 item 4, SPEC §10 ``job.grow``), against the single-device reference.

A job trains on 2 local ranks; held at the start of step 2 (``hold_at=``), ``job.grow(Cluster.local(4), ...)``
starts two new workers; once they are ready and both running ranks heard the grow's switch the hold is released,
and at the boundary before step 3 all four meet in a larger world and one fused BSR gives the newcomers their
parameters and Adam moments.  The losses of every step (before, at and after the grow) equal the single-device
run's; the running workers are the same processes; nothing is left behind.  With ZeRO-1 on and off, to the
planner's own plan, and a grown job that then loses a worker (``elastic=True``) and recovers.
"""
from __future__ import annotations

import os
import signal
import time

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


def _pipe(stages, mbs: int, n: int) -> dict:
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": mbs,
            "num_micro_batches": n}


DP2 = {"pipelines": [_pipe([([0], [0, 3])], 4, 1), _pipe([([1], [0, 3])], 4, 1)]}
DP4 = {"pipelines": [_pipe([([r], [0, 3])], 2, 1) for r in range(4)]}
#: two pipelines of TP2 over the four ranks: the newcomers hold halves of every matrix
TP2_DP2 = {"pipelines": [_pipe([([0, 2], [0, 3])], 4, 1), _pipe([([1, 3], [0, 3])], 4, 1)]}


def _program(model, data: dict, cluster: Cluster, zero1: bool | int = False):
    strategy = Strategy.load({**data, "zero": int(zero1)})  # zero1: True is level 1; or a level
    return specialize(model, plan_from_strategy(model, strategy, cluster), cluster, bindings={"B": 8, "S": SEQ})


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference() -> object:
    return reference_training(LlamaConfig.preset("tiny"), steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)


def _grow_run(reference, grown: dict | None, *, zero1: bool = False, elastic: bool = False, kill_after: bool = False,
              **options):
    """Grow DP2 onto four ranks, requested while both ranks are held at the start of step 2 (the planner's own plan,
    ``grown=None``, takes seconds on a loaded machine: the hold waits for it, whatever the load); released once both
    heard the grow's switch, it lands at the boundary before step 3.  ``kill_after``: newcomer 3 is SIGKILLed while
    the four are held at the start of step 4 (after the first grown step), and released once the survivors
    recovered."""
    model, small, big = LlamaConfig.preset("tiny"), Cluster.local(2), Cluster.local(4)
    job = launch(_program(model, DP2, small, zero1), small, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR,
                          timeout_s=60, heartbeat_s=0.5, elastic=elastic, **options,
                          hold_at=[2, 4] if kill_after else [2])
    old = job.pids()
    assert job.wait_held(2) == [0, 1]
    event = job.grow(big, None if grown is None else _program(model, grown, big, zero1))
    job.wait_held(2, heard=event)  # the newcomers are ready and both running ranks heard the grow's switch
    assert job.metrics.last_step() == 1 and not event.done
    job.release(2)
    wait_for(lambda: event.done or job.status.value != "running")
    assert event.done and event.reason == "grow", event
    assert event.ranks == {0: 0, 1: 1, 2: 2, 3: 3} and event.step == 3, str(event)
    pids = job.pids()
    assert {r: pids[r] for r in old} == old and set(pids) == {0, 1, 2, 3}  # the running workers stay
    if kill_after:
        assert job.wait_held(4) == [0, 1, 2, 3]  # the first grown step (3) committed on all four
        os.kill(pids[3], signal.SIGKILL)  # heard by the held survivors: they recover, then hold at step 4 again
        wait_for(lambda: len(job.events) == 2 and job.events[1].done or job.status.value != "running")
        assert job.wait_held(4) == [0, 1, 2]
        job.release(4)
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
@pytest.mark.parametrize("zero1", [False, True, 3])
def test_a_job_grows_from_two_to_four_ranks_in_memory(reference, zero1: bool | int, tmp_path) -> None:
    """DP2 -> TP2 x DP2 onto two new workers (ZeRO-1 off and on, and ZeRO-3: the newcomers make the gathers'
    groups of their own like the running workers): equal losses, the same two processes go on, and
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
    """DP2 grows to DP4 at the boundary before step 3 (requested while the job is held at the start of step 2,
    released once both running ranks heard the grow's switch); newcomer 3 SIGKILLs itself in the forward of step 3
    (an injected fault), once every worker switched, inside the first grown step, which so never commits.  The
    original ranks still keep the state from before the grow, the surviving newcomer holds only the grown one (the
    job failed here: "the survivors disagree on their state"); every survivor completed the grow's switch, so the
    job recovers from the grown state onto the three survivors, newcomer included.  The failure event names the
    newcomer (it named nobody: found by the chaos soak's reproduction), and the losses stay equal."""
    model, small, big = LlamaConfig.preset("tiny"), Cluster.local(2), Cluster.local(4)
    job = launch(_program(model, DP2, small), small, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                          heartbeat_s=0.3, elastic=True, hold_at=[2])
    assert job.wait_held(2) == [0, 1]
    with job._lock:  # the newcomers start with the job's spec: newcomer 3's fault goes in it (launch checks a fault
        runs = [dict(run) for run in job.spec.payload["runs"]]  # of a rank it does not start at "switch" only)
        runs[0]["faults"] = [*runs[0].get("faults", ()), {"rank": 3, "step": 3, "at": "forward"}]
        job.spec = job.spec.model_copy(update={"payload": {**job.spec.payload, "runs": runs}})
    event = job.grow(big, _program(model, DP4, big))
    job.wait_held(2, heard=event)
    job.release(2)
    result = job.wait(timeout=150)
    assert len(result.losses) == STEPS and _close(result.losses, reference.losses) <= TOL
    assert [(e.reason, e.failed_ranks) for e in result.events] == [("grow", []), ("failure", [3])], \
        [str(e) for e in result.events]
    assert sorted(result.events[1].ranks) == [0, 1, 2] and result.events[1].source == "memory"
    assert [e.step for e in result.events] == [3, 3], [str(e) for e in result.events]  # step 3 never committed


@pytest.mark.timeout(240)
def test_the_job_trains_on_while_its_newcomers_start(reference) -> None:
    """The newcomers are fresh processes (no fork server: seconds of imports, as on an SSH host or a Slurm node);
    the grow is requested while the two running ranks are held at the start of step 1 and the hold is released at
    once: the running ranks do not wait for the newcomers at the next step boundary but train on, and reach the
    hold at the start of step 5 (steps 1-4 take a fraction of a second, the newcomers' imports seconds) before
    either newcomer is built.  Released there once both heard the grow's switch, the grow lands at the boundary
    before step 6; the losses equal the single-device run's."""
    from hspmd_sdk.runtime.transports.transport import LocalTransport

    model, small, big = LlamaConfig.preset("tiny"), Cluster.local(2), Cluster.local(4)
    job = launch(_program(model, DP2, small), small, steps=STEPS + 2, seed=SEED, seq_len=SEQ, lr=LR,
                          timeout_s=120, heartbeat_s=0.5, transport=LocalTransport(fork=False), hold_at=[1, 5])
    try:
        assert job.wait_held(1, timeout=120) == [0, 1]
        event = job.grow(big, _program(model, DP4, big))
        job.release(1)
        assert job.wait_held(5) == [0, 1]  # steps 1-4 done on the two running ranks
        reached = time.monotonic()
        job.wait_held(5, heard=event)  # the newcomers are ready and both running ranks heard the grow's switch
        job.release(5)
        wait_for(lambda: event.done or event.superseded or job.status.value != "running", timeout=150)
        result = job.wait(timeout=150)
    finally:
        job.cancel()
    assert event.done and not event.superseded, [str(e) for e in job.events]
    with job._lock:
        built = {r: job._ranks[r].phases.get("built") for r in (2, 3)}
    # steps 1..4 ran on the two original ranks after the grow was asked for, while the newcomers were starting
    assert all(b is not None and b > reached for b in built.values()), (reached, built)
    assert event.step == 6, str(event)
    started = [m.step for m in job.metrics.rank(0) if m.loss is not None]
    assert sorted(set(started)) == list(range(STEPS + 2)) and len(result.losses) == STEPS + 2
    longer = reference_training(model, steps=STEPS + 2, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    assert _close(result.losses, longer.losses) <= TOL


@pytest.mark.timeout(240)
def test_a_newcomer_lost_while_it_starts_gives_the_grow_up_and_the_job_goes_on(reference) -> None:
    """A newcomer (a fresh process, seconds of imports) is SIGKILLed before it is ready, while the running ranks
    are held at the start of step 2: the grow is given up (its event ``superseded``, the other newcomer stopped, a
    note says why) and the running job, which was never told of the grow, is released and trains on untouched to
    the end, with no failure event and the single-device losses."""
    from hspmd_sdk.runtime.transports.transport import LocalTransport

    model, small, big = LlamaConfig.preset("tiny"), Cluster.local(2), Cluster.local(4)
    job = launch(_program(model, DP2, small), small, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR,
                          timeout_s=120, heartbeat_s=0.5, elastic=True, transport=LocalTransport(fork=False),
                          hold_at=[2])
    try:
        assert job.wait_held(2, timeout=120) == [0, 1]
        old = job.pids()
        event = job.grow(big, _program(model, DP4, big))
        wait_for(lambda: len(job.pids()) == 4, timeout=30)
        with job._lock:
            assert "built" not in job._ranks[3].phases  # still importing
        os.kill(job.pids()[3], signal.SIGKILL)
        wait_for(lambda: event.superseded or event.done or job.status.value != "running", timeout=60)
        assert job.held(2) == [0, 1] and job.metrics.last_step() == 1  # given up while the job waited at step 2
        job.release(2)
        result = job.wait(timeout=150)
    finally:
        job.cancel()
    assert event.superseded and not event.done
    assert [e.reason for e in result.events] == ["grow"] and job.cluster.num_ranks == 2
    assert any("given up" in n and "[2, 3]" in n for n in job.notes), job.notes
    assert [f.rank for f in result.failures] == [3]
    assert len(result.losses) == STEPS and _close(result.losses, reference.losses) <= TOL
    assert_no_workers_left(list(old.values()) + [job._ranks[r].pid for r in (2, 3) if job._ranks[r].pid], within=10)


def test_grow_refuses_a_cluster_that_is_not_the_running_one_plus_new_ranks() -> None:
    """Bad input is refused before any worker starts: a smaller cluster, a cluster whose first ranks are other
    devices, something that is not a Cluster."""
    model, small = LlamaConfig.preset("tiny"), Cluster.local(2)
    job = launch(_program(model, DP2, small), small, steps=2, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                          hold_at=[1])  # never released: the job runs while grow is refused, then is cancelled
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
    """DP2 grows to DP4 (requested while the job is held at the start of step 2, released once both running ranks
    heard the grow's switch: it comes at the boundary before step 3), and a rank is SIGKILLed inside the grow's
    switch, after the grown world formed and before its BSR: original rank 1 (the newcomer it was to send to never
    gets its shards: it holds nothing, the others may have completed the switch) or newcomer 3 (the originals'
    sends to it fail: they still hold the state from before the grow, newcomer 2 maybe the grown one).  The
    survivors agree on a state they hold (the newcomers that hold nothing of it only receive: they stay in the job)
    and the losses stay equal."""
    model, small, big = LlamaConfig.preset("tiny"), Cluster.local(2), Cluster.local(4)
    job = launch(_program(model, DP2, small), small, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                          heartbeat_s=0.3, elastic=True, hold_at=[2],
                          fault_injection=[{"rank": killed, "at": "switch"}])
    assert job.wait_held(2) == [0, 1]
    event = job.grow(big, _program(model, DP4, big))
    job.wait_held(2, heard=event)
    job.release(2)
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
    """``grow_back=True``: a rank of a DP4 job is SIGKILLed while the job is held at the start of step 1; the job
    recovers on three ranks (held there again), then (this machine can take workers again at once) grows back onto
    four by itself; released once the three heard the grow's switch, it lands at the boundary before step 2: a
    ``failure`` then a ``grow`` event, the job ends on the cluster it was launched on, and the losses equal the
    single-device run's throughout."""
    from hspmd_sdk.runtime.control.growback import GrowBack

    model, big = LlamaConfig.preset("tiny"), Cluster.local(4)
    job = launch(_program(model, DP4, big), big, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                          heartbeat_s=0.3, elastic=True, grow_back=GrowBack(after_s=0.2), hold_at=[1])
    assert job.wait_held(1) == [0, 1, 2, 3]
    os.kill(job.pids()[2], signal.SIGKILL)
    wait_for(lambda: len(job.events) == 2 or job.status.value != "running")  # recovered, and growing back
    assert [e.reason for e in job.events] == ["failure", "grow"], (job.status_text, [str(e) for e in job.events])
    job.wait_held(1, heard=job.events[1])
    assert job.metrics.last_step() == 0
    job.release(1)
    result = job.wait(timeout=150)
    assert len(result.losses) == STEPS and _close(result.losses, reference.losses) <= TOL
    assert [(e.reason, e.failed_ranks) for e in result.events] == [("failure", [2]), ("grow", [])], \
        [str(e) for e in result.events]
    assert all(e.done for e in result.events) and job.cluster.num_ranks == 4
    assert [e.step for e in result.events] == [1, 2], [str(e) for e in result.events]
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
