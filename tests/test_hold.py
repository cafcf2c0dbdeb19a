"""Holds at step boundaries (``hold_at=``, ``Job.wait_held`` / ``Job.release``): the test hook with which a test races
a request against a running job at a known step instead of stretching compute and hoping.

* Held at step ``s``: every rank waits at its start (no rank has reported step ``s``, the job runs); released, it
  goes on; a stop made while held ends the job after step ``s`` exactly, with the single-device losses.
* A hold nobody releases fails the job after its ``timeout_s``, with a message naming the hold and what to do.
* The same for a mixed-length job (its session subclasses the one-Program session; the hold is in their shared
  step loop).
* ``hold_at`` is checked like every launch option, before any worker starts; the hold is a marked wait (a held rank
  is never taken for a hung one); ``release`` and ``wait_held`` refuse a step the job does not hold at.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from _procs import assert_no_workers_left  # noqa: E402
from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import PlanValidationError, RuntimeFailure  # noqa: E402
from hspmd_sdk.runtime.control.train import launch, reference_training  # noqa: E402

SEQ, SEED, LR, STEPS = 16, 3, 1e-3, 4
TOL = 1e-5
DP2 = {"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 4, "num_micro_batches": 1}
                     for r in (0, 1)]}


def _program(model, cluster: Cluster):
    return specialize(model, plan_from_strategy(model, Strategy.load(DP2), cluster), cluster,
                      bindings={"B": 8, "S": SEQ})


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _reported(job, step: int) -> list[int]:
    """Ranks that reported ``step``'s metrics."""
    return sorted(r for r in (0, 1) if any(m.step == step for m in job.metrics.rank(r)))


@pytest.mark.timeout(90)
def test_every_rank_waits_at_a_held_step_until_released_and_a_stop_made_there_lands_after_it() -> None:
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    job = launch(_program(model, cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                 heartbeat_s=0.3, hold_at=[1, 2])
    pids = job.pids()
    try:
        assert job.wait_held(1) == [0, 1]
        assert job.held(1) == [0, 1] and _reported(job, 0) == [0, 1] and _reported(job, 1) == []
        assert job.status.value == "running"
        job.release(1)
        assert job.held(1) == []
        assert job.wait_held(2) == [0, 1]
        assert _reported(job, 1) == [0, 1] and _reported(job, 2) == []  # step 1 done, step 2 not begun
        job.stop()  # heard by both ranks at step 2's commit: the job ends after step 2, not later
        job.release(2)
        result = job.wait(timeout=60)
    finally:
        job.cancel()
    assert result.stopped_at == 3 and job.status_text == "stopped at step 3"
    ref = reference_training(model, steps=3, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    assert len(result.losses) == 3 and _close(result.losses, ref.losses) <= TOL, (result.losses, ref.losses)
    assert result.failures == []
    assert_no_workers_left(list(pids.values()), within=10)


@pytest.mark.timeout(90)
def test_a_hold_nobody_releases_fails_the_job_after_its_timeout_naming_it() -> None:
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    job = launch(_program(model, cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=8,
                 heartbeat_s=0.3, hold_at=[1])
    pids = job.pids()
    try:
        job.wait_held(1, timeout=60)
        held = time.monotonic()
        with pytest.raises(RuntimeFailure, match=r"held at the start of step 1 \(hold_at=.*not released within "
                                                 r"the job's timeout_s=8 s: call job.release\(1\)"):
            job.wait(timeout=60)
        waited = time.monotonic() - held
    finally:
        job.cancel()
    # the job's timeout_s after the hold began (a loaded machine: some slack); the held ranks were never taken for
    # silent ones (heartbeat_s=0.3: a rank not heard for 3 s would have failed the job as hung instead)
    assert 6.0 <= waited <= 30.0, waited
    assert _reported(job, 1) == []
    assert_no_workers_left(list(pids.values()), within=10)


@pytest.mark.timeout(180)
def test_a_mixed_length_job_holds_too() -> None:
    """Candidates DP2 and TP2 on two ranks, documents of many lengths: held at step 1, stopped there, released; the
    job ends after step 1 with the single-device losses of the same sequences."""
    from hspmd_sdk.runtime.control.mixed import reference_mixed

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_mixed_runtime import BUDGET, CONTEXT, DOCS, _strategy

    model, two = LlamaConfig.preset("tiny"), Cluster.local(2)
    dp2 = _strategy([[([0], [0, 3])], [([1], [0, 3])]], "dp2")
    tp2 = _strategy([[([0, 1], [0, 3])]], "tp2")
    programs = [specialize(model, plan_from_strategy(model, s, two), two) for s in (dp2, tp2)]
    job = launch(programs, two, steps=3, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT,
                 timeout_s=60, hold_at=[1])
    try:
        assert job.wait_held(1) == [0, 1] and _reported(job, 1) == []
        job.stop()
        job.release(1)
        result = job.wait(timeout=90)
    finally:
        job.cancel()
    ref = reference_mixed(model, steps=2, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert result.stopped_at == 2 and len(result.losses) == 2 and _close(result.losses, ref.losses) <= TOL


def test_hold_at_is_checked_before_any_worker_starts_and_the_hold_is_a_marked_wait() -> None:
    from hspmd_sdk.runtime.workers.liveness import _WAITING_CODES
    from hspmd_sdk.runtime.workers.session import TrainSession

    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    for bad, said in ((5, r"hold_at: must be a list of steps"), ([4], r"hold_at: must be steps of this run "
                                                                    r"\(0..3\), not 4"),
                      ([-1], r"hold_at\[0\]: must be a list"), ([1.0], r"hold_at\[0\]: must be a list")):
        with pytest.raises(PlanValidationError, match=said):
            launch(_program(model, cluster), cluster, steps=STEPS, seq_len=SEQ, hold_at=bad)
    assert TrainSession._hold.__code__ in _WAITING_CODES  # stall detection counts a held rank with the waiters


@pytest.mark.timeout(60)
def test_release_and_wait_held_refuse_a_step_the_job_does_not_hold_at() -> None:
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    job = launch(_program(model, cluster), cluster, steps=2, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                 hold_at=[1])
    try:
        for call in (job.release, job.wait_held, job.held):
            with pytest.raises(ValueError, match=r"holds at steps \[1\] \(hold_at=\), not at 0"):
                call(0)
        job.release(1)  # before any rank got there: none waits
        job.wait(timeout=50)
    finally:
        job.cancel()
    with pytest.raises(RuntimeFailure, match="released already"):
        job.wait_held(1)
