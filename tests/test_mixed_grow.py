"""``job.grow`` of a mixed-length job (SPEC §9, §10): the job launched on two ranks grows onto four, in memory, at a
step boundary; from there the dispatch chooses among the candidates given for the larger cluster, the newcomers get
their shards by the grow's fused BSR, and the run trains exactly the single-device reference on the same sequences
(the global batch and the data order stay) -- also with a running worker SIGKILLed in the grow's switch
(``elastic=True``).  A grow that cannot run is refused before any worker starts.

The grow is requested while both ranks are held at the start of a step whose dispatch was sent (``lookahead=0``:
the launcher dispatches nothing further meanwhile); the ranks are released once the grow's dispatch went out (the
newcomers were ready), so it lands at the boundary after the held step whatever the machine's load.  Tolerances as in
``test_mixed_runtime.py`` (fp32).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hspmd_sdk import Cluster, LlamaConfig, launch, specialize
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.runtime.control.controller import SwitchError
from hspmd_sdk.runtime.control.mixed import reference_mixed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import assert_no_workers_left  # noqa: E402
from test_mixed_candidates import _check_state  # noqa: E402
from test_mixed_runtime import BUDGET, CONTEXT, DOCS, SEED, TOL, _rel, _strategy  # noqa: E402
from test_mixed_switch import PP2X2, TP2X2, _trained_once, _wait  # noqa: E402

HOLD = 1  # both ranks wait at the start of this step; the grow lands at the boundary before HOLD + 1
SMALL, BIG = Cluster.local(2), Cluster.local(4)
#: the two-rank job's candidates: two pipelines of one rank (each tensor on both), and one TP2 pipeline
DP2 = _strategy([[([0], [0, 3])], [([1], [0, 3])]], "dp2")
TP2 = _strategy([[([0, 1], [0, 3])]], "tp2")


def _small(model: Any, strategies: tuple[Any, ...]) -> list[Any]:
    return [specialize(model, plan_from_strategy(model, s, SMALL), SMALL) for s in strategies]


def _launch(model: Any, steps: int, tmp: Path, strategies: tuple[Any, ...] = (DP2, TP2), **kw: Any) -> Any:
    return launch(_small(model, strategies), SMALL, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT,
                  capture_dir=tmp, timeout_s=120, lookahead=0, hold_at=[HOLD], **kw)


def _grow_at_hold(job: Any, candidates: Any) -> Any:
    """Grow ``job`` (held at ``HOLD``, its dispatch sent) onto ``BIG``; release it once the grow's dispatch is out."""
    assert job.wait_held(HOLD, timeout=60) == [0, 1]
    _wait(lambda: job.length_planner.next_step() == HOLD + 1, job)
    event = job.grow(BIG, candidates)
    assert event.reason == "grow" and not event.done
    _wait(lambda: job.length_planner.next_step() == HOLD + 2 or event.superseded, job, timeout=120)
    assert not event.superseded, job.notes
    job.release(HOLD)
    return event


@pytest.mark.timeout(300)
def test_a_mixed_length_job_grows_onto_new_candidates_and_trains_like_the_reference(tmp_path: Path) -> None:
    model = LlamaConfig.preset("tiny")
    steps = 5
    job = _launch(model, steps, tmp_path)
    old = job.pids()
    new = [specialize(model, plan_from_strategy(model, TP2X2, BIG), BIG), PP2X2]  # a Program and a Strategy
    event = _grow_at_hold(job, new)
    result = job.wait(timeout=240)
    ref = reference_mixed(model, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert len(result.losses) == steps and _rel(result.losses, ref.losses) < TOL, (result.losses, ref.losses)
    _check_state(tmp_path, ref)  # every rank of the grown job saved its shards: the single-device parameters
    _trained_once(result, range(steps))
    assert event.done and not event.superseded and event.step == HOLD + 1, str(event)
    assert event.bytes["intra"] > 0  # the newcomers' shards moved by the BSR
    assert event.ranks == {0: 0, 1: 1, 2: 2, 3: 3} and [e for e in result.events if e.reason == "grow"] == [event]
    assert job.cluster.num_ranks == 4 and {r: job.pids()[r] for r in old} == old  # the running workers stay
    planner = job.length_planner
    assert planner.base == 2 and len(planner.programs) == 2 and planner.cluster.num_ranks == 4
    assert [r["step"] for r in planner.records] == list(range(steps))
    for launch_rank, r in result.results.items():  # every worker took part from the grow's boundary on
        moves = [s for s in r["runs"][0]["length_switches"] if s["what"] == "grow"]
        assert [(s["step"], s["to"] >= 2) for s in moves] == [(HOLD + 1, True)], (launch_rank, moves)
    for r in (2, 3):  # the newcomers trained the steps from the grow on
        got = sorted({m.step for m in job.metrics.rank(r) if m.loss is not None})
        assert got == list(range(HOLD + 1, steps)), (r, got)
    after = [e for e in result.events if e.reason == "length" and e.step > HOLD + 1]
    assert all(e.strategy.name in ("tp2x2", "pp2x2") for e in after), after
    assert_no_workers_left(list(job.pids().values()), within=10)


@pytest.mark.timeout(300)
def test_a_running_worker_killed_in_the_grows_switch_is_survived_with_the_references_losses(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed in the grow's fused BSR (after the four met in the larger world): the survivors -- rank
    0 with the state from before the grow, the newcomers holding nothing -- recover from that state onto the three
    of them, and the run goes on with the reference's losses and parameters.  The job runs DP2 alone before the
    grow, so rank 0 holds a copy of everything."""
    model = LlamaConfig.preset("tiny")
    steps = 5
    job = _launch(model, steps, tmp_path, (DP2,), elastic=True,
                  fault_injection=[{"rank": 1, "step": HOLD + 1, "at": "switch"}])
    event = _grow_at_hold(job, [specialize(model, plan_from_strategy(model, TP2X2, BIG), BIG), PP2X2])
    result = job.wait(timeout=240)
    ref = reference_mixed(model, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert len(result.losses) == steps and _rel(result.losses, ref.losses) < TOL, (result.losses, ref.losses)
    failures = [e for e in result.events if e.reason == "failure"]
    assert len(failures) == 1 and failures[0].failed_ranks == [1] and failures[0].done, result.events
    assert failures[0].source == "memory" and failures[0].step == HOLD + 1
    assert event.superseded != event.done, str(event)
    assert sorted(job.controller.current.to_launch.values()) == [0, 2, 3]
    _trained_once(result, range(HOLD + 1, steps))
    _check_state(tmp_path, ref)


def test_a_grow_that_cannot_run_is_refused_and_the_job_goes_on_unchanged(tmp_path: Path) -> None:
    model = LlamaConfig.preset("tiny")
    job = _launch(model, 3, tmp_path)
    try:
        assert job.wait_held(HOLD, timeout=60) == [0, 1]
        with pytest.raises(SwitchError, match="list of candidates"):
            job.grow(BIG, PP2X2)  # one Strategy: a mixed-length job grows onto candidates
        with pytest.raises(SwitchError, match=r"candidates\[0\]|ranks"):
            job.grow(BIG, [_strategy([[([0], [0, 3])], [([5], [0, 3])]], "outside")])  # rank 5: not in the cluster
        with pytest.raises(SwitchError, match="larger cluster"):
            job.grow(SMALL, [DP2])
        assert len(job.pids()) == 2 and not job.events  # no worker started, nothing changed
    finally:
        job.release(HOLD)
    result = job.wait(timeout=120)
    assert len(result.losses) == 3 and not [e for e in result.events if e.reason == "grow"]


def test_the_planners_candidates_for_the_larger_cluster_by_default(tmp_path: Path) -> None:
    """``job.grow(cluster)`` with no candidates: the mixed-length planner plans them for the larger cluster on the
    job's data; the grow lands and the run keeps the reference's losses."""
    model = LlamaConfig.preset("tiny")
    steps = 4
    t0 = time.monotonic()
    job = _launch(model, steps, tmp_path)
    event = _grow_at_hold(job, None)
    result = job.wait(timeout=240)
    ref = reference_mixed(model, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert event.done and _rel(result.losses, ref.losses) < TOL, (str(event), result.losses, ref.losses)
    assert job.length_planner.cluster.num_ranks == 4 and time.monotonic() - t0 < 280


@pytest.mark.timeout(300)
def test_an_elastic_mixed_length_job_grows_back_by_itself_after_it_recovered(tmp_path: Path) -> None:
    """``grow_back``: rank 1 of a DP2 job is SIGKILLed while the job is held at the start of ``HOLD``; rank 0
    recovers alone (held there again), then the job grows back onto two ranks by itself, onto candidates the
    mixed-length planner plans for them; released once the grow's dispatch is out, it lands at the boundary before
    ``HOLD + 1``, and the losses equal the single-device run's throughout."""
    from hspmd_sdk.runtime.control.growback import GrowBack

    model = LlamaConfig.preset("tiny")
    steps = 4
    job = _launch(model, steps, tmp_path, (DP2,), elastic=True, grow_back=GrowBack(after_s=0.2), heartbeat_s=0.3)
    assert job.wait_held(HOLD, timeout=60) == [0, 1]
    os.kill(job.pids()[1], signal.SIGKILL)
    _wait(lambda: len(job.events) == 2 and job.length_planner.next_step() == HOLD + 2 or job.ended, job, timeout=120)
    assert [e.reason for e in job.events] == ["failure", "grow"], (job.status_text, job.notes)
    job.release(HOLD)
    result = job.wait(timeout=150)
    ref = reference_mixed(model, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert len(result.losses) == steps and _rel(result.losses, ref.losses) < TOL, (result.losses, ref.losses)
    assert [(e.reason, e.failed_ranks, e.step, e.done) for e in result.events] == [
        ("failure", [1], HOLD, True), ("grow", [], HOLD + 1, True)], [str(e) for e in result.events]
    assert sorted(result.events[1].ranks) == [0, 2] and job.cluster.num_ranks == 2  # newcomer: launch rank 2
    _check_state(tmp_path, ref)
