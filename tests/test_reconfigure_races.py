"""Reconfigurations that meet each other (issue 24): what users combine, each against the single-device reference.

* A worker SIGKILLed while a user switch is pending (requested, not applied yet): the recovery starts from what
  the survivors hold, the user's switch is superseded, the losses equal the run without either.
* Two or three ``job.switch`` calls back to back (DP2 -> TP2 -> PP2 before a step boundary): applied in order, as
  planned, with and without ``elastic``.
* A worker SIGKILLed during a synchronous checkpoint: rank 0, waiting for the dead rank's record, halts with the
  others (it is not taken for a hung rank), recovery takes a fraction of a second, ``job.pids()`` tells the truth.
* The n-th failure of a job is detected as fast as the first.
* A worker that halts on an error no failure explains gets a clear end of the job, not a 120 s silence.

Every job is bounded in time (well under 60 s each on 2 cores); nothing waits for a 120 s timeout.  A request raced
against the running job is made while every worker is held at a known step (``hold_at=``, ``Job.wait_held``,
``Job.release``), never during a step stretched in the hope that it lands inside it.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from _procs import assert_no_workers_left, wait_for  # noqa: E402
from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime.control.train import launch, reference_training  # noqa: E402

SEQ, SEED, LR, STEPS = 16, 3, 1e-3, 6
TOL = 1e-5


def _pipe(stages, mbs: int, n: int) -> dict:
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": mbs,
            "num_micro_batches": n}


#: 4 local ranks, global batch 8
DP2 = {"pipelines": [_pipe([([0], [0, 3])], 4, 1), _pipe([([1], [0, 3])], 4, 1)]}
TP2 = {"pipelines": [_pipe([([0, 1], [0, 3])], 4, 2)]}
PP2 = {"pipelines": [_pipe([([2], [0, 1]), ([3], [2, 3])], 2, 4)], "schedule": "gpipe"}
DP4 = {"pipelines": [_pipe([([r], [0, 3])], 2, 1) for r in range(4)]}
#: two pipelines of three stages on 6 ranks: every parameter has a replica in the other pipeline
SIX = {"pipelines": [_pipe([([0], [0, 0]), ([1], [1, 2]), ([2], [3, 3])], 2, 2),
                     _pipe([([3], [0, 1]), ([4], [2, 2]), ([5], [3, 3])], 2, 2)]}
#: the same ranks as one pipeline per three ranks, other layer cuts
SIX_B = {"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 2]), ([2], [3, 3])], 2, 2),
                       _pipe([([3], [0, 0]), ([4], [1, 2]), ([5], [3, 3])], 2, 2)]}


def _program(model, data: dict, cluster: Cluster):
    return specialize(model, plan_from_strategy(model, Strategy.load(data), cluster), cluster,
                      bindings={"B": 8, "S": SEQ})


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference() -> object:
    return reference_training(LlamaConfig.preset("tiny"), steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)


def _check(job, result, ref, pids: dict[int, int], dead: set[int]) -> None:
    assert len(result.losses) == STEPS and _close(result.losses, ref.losses) <= TOL, (result.losses, ref.losses)
    lost = set().union(*(set(e.failed_ranks) for e in result.events if e.reason == "failure")) if dead else set()
    assert lost == dead, (lost, dead)
    survivors = {r: p for r, p in pids.items() if r not in dead}
    assert job.pids() == survivors  # the same processes, and only the survivors
    assert {r for r, res in result.results.items() if res} == set(survivors)
    assert_no_workers_left(list(pids.values()), within=10)  # nothing left behind


@pytest.mark.timeout(60)
def test_a_worker_killed_while_a_user_switch_is_pending(tmp_path: Path, reference) -> None:
    """``job.switch(SIX_B)`` is requested while every worker is held at the start of step 2 (every one has heard
    it, none has agreed it at a commit yet), then rank 4 is SIGKILLed and the hold released: no worker applied the
    switch.  The recovery plans from SIX (what the survivors hold), the pending switch is superseded, and the job
    trains on to the failure-free losses."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(6)
    job = launch(_program(model, SIX, cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR,
                          elastic=True, timeout_s=60, heartbeat_s=0.5, hold_at=[2])
    pids = job.pids()
    job.wait_held(2)
    switch = job.switch(_program(model, SIX_B, cluster))
    job.wait_held(2, heard=switch)  # pending on every rank: heard, not applied
    os.kill(pids[4], signal.SIGKILL)
    job.release(2)
    result = job.wait(timeout=50)
    assert switch.superseded and not switch.done
    failure = [e for e in result.events if e.reason == "failure"]
    assert len(failure) == 1 and failure[0].done and failure[0].failed_ranks == [4]
    _check(job, result, reference, pids, {4})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("elastic", [False, True])
def test_switches_requested_back_to_back_are_applied_in_order(elastic: bool, reference) -> None:
    """DP2 -> TP2 -> PP2 -> DP4 requested within one step (every worker held at the start of step 1): each was
    planned from the one before it; the workers apply all three at the next boundary (before step 2), in order
    (none is dropped, none planned from a layout nobody holds)."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(4)
    job = launch(_program(model, DP2, cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR,
                          elastic=elastic, timeout_s=60, heartbeat_s=0.5, hold_at=[1])
    pids = job.pids()
    job.wait_held(1)
    events = [job.switch(_program(model, d, cluster)) for d in (TP2, PP2, DP4)]
    job.release(1)
    result = job.wait(timeout=50)
    assert all(e.done and not e.superseded for e in events), events
    assert [e.step for e in events] == [2, 2, 2]  # one step boundary: the one after the step they were made in
    assert [e.strategy.model_dump() for e in events] == [Strategy.load(d).model_dump() for d in (TP2, PP2, DP4)]
    _check(job, result, reference, pids, set())


@pytest.mark.timeout(60)
def test_a_worker_killed_during_a_synchronous_checkpoint(tmp_path: Path, reference) -> None:
    """Rank 4 dies writing its shard of step 2's synchronous checkpoint while rank 0 waits for the records: rank 0
    halts with the others (the launcher tells it a peer died), nobody healthy is blamed or killed, the recovery
    takes well under the 30 s stall limit, and ``job.pids()`` lists exactly the survivors."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(6)
    job = launch(_program(model, SIX, cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR,
                          elastic=True, timeout_s=60, heartbeat_s=0.5, stall_s=8.0,
                          checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1, keep=STEPS, checkpoint_async=False,
                          fault_injection=[{"rank": 4, "step": 2, "at": "shard-partial"}])
    pids = job.pids()
    result = job.wait(timeout=50)
    failures = [e for e in result.events if e.reason == "failure"]
    assert [e.failed_ranks for e in failures] == [[4]], [str(e) for e in result.events]
    assert failures[0].done and failures[0].seconds["total"] < 8.0, str(failures[0])
    _check(job, result, reference, pids, {4})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_checkpoint_a_failure_interrupted_is_retaken_after_the_next_step(tmp_path: Path, reference,
                                                                          asynchronous: bool) -> None:
    """``checkpoint_every=3``: rank 4 dies writing its shard of step 3's checkpoint, which can then never be
    committed.  The survivors save after their next step (step 4) instead of leaving the job without a checkpoint
    until step 6; the retaken checkpoint is complete (verified) and of the survivors' plan, and the losses are the
    single-device model's."""
    from hspmd_sdk.runtime.checkpoints.checkpoint import list_checkpoints, load_checkpoint

    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(6)
    root = tmp_path / "ckpt"
    job = launch(_program(model, SIX, cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR,
                          elastic=True, timeout_s=60, heartbeat_s=0.5, stall_s=8.0, checkpoint_dir=root,
                          checkpoint_every=3, keep=STEPS, checkpoint_async=asynchronous,
                          fault_injection=[{"rank": 4, "step": 3, "at": "shard-partial"}])
    pids = job.pids()
    result = job.wait(timeout=50)
    assert [e.failed_ranks for e in result.events if e.reason == "failure"] == [[4]]
    assert [s for s, _ in list_checkpoints(root)] == [4, 6]
    retaken = load_checkpoint(root / "step-00000004")
    assert retaken.manifest.world_size == 5, retaken.manifest  # saved under the five survivors' plan
    _check(job, result, reference, pids, {4})


@pytest.mark.timeout(60)
def test_the_nth_failure_is_detected_as_fast_as_the_first(tmp_path: Path, reference) -> None:
    """Three ranks killed one after another (steps 1, 2, 3): each failure's ``detect`` (its first evidence to the
    start of replanning: the debounce that gathers a host's ranks, 0.3 s, plus the survivors' halts) is of the
    same size, not the time since the first failure."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(6)
    faults = [{"rank": 4, "step": 1, "at": "backward"}, {"rank": 1, "step": 2, "at": "forward"},
              {"rank": 5, "step": 3, "at": "optimizer"}]
    job = launch(_program(model, SIX, cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR,
                          elastic=True, timeout_s=60, heartbeat_s=0.5, fault_injection=faults)
    pids = job.pids()
    result = job.wait(timeout=50)
    failures = [e for e in result.events if e.reason == "failure" and e.done]
    assert len(failures) == 3 and set().union(*(e.failed_ranks for e in failures)) == {1, 4, 5}, \
        [str(e) for e in result.events]
    detect = [e.seconds["detect"] for e in failures]
    assert all(d < 2.0 for d in detect), detect
    _check(job, result, reference, pids, {1, 4, 5})


def test_a_halt_no_failure_explains_ends_the_job_with_its_reason() -> None:
    """A worker that halts (an error it took for a peer's failure) while no worker died is answered: after the
    time the launcher needs to notice a silent worker, the job fails with that worker's own error."""
    import threading
    from types import SimpleNamespace

    from hspmd_sdk.runtime.control.controller import TrainingController

    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(4)
    controller = TrainingController(_program(model, DP4, cluster), cluster, global_batch=8, seq_len=SEQ,
                                    elastic=True)
    failed: list = []
    done = threading.Event()

    class StandIn(SimpleNamespace):  # the job's public interface the controller uses (Job.ended, ...)
        ended = property(lambda self: done.is_set())

    job = StandIn(spec=SimpleNamespace(silent_s=0.3, job_id="j"), wait_ended=done.wait,
                  report_failure=failed.append, note=lambda text: None, on_message=lambda kind, fn: None,
                  on_finish=lambda fn: None, metrics=None)
    controller.attach(job)
    controller._on_halted(2, {"after": 0, "step": 1, "source": "live", "held": [0, 0],
                              "error": "CommExecutionError: a broken plan"})
    wait_for(lambda: failed, 5)
    assert failed[0].rank == 2 and failed[0].kind == "error"
    assert "no worker died" in failed[0].message and "a broken plan" in failed[0].message
    # a halt that a failure explains is answered by the recovery, not by this
    answering = [t for t in threading.enumerate() if t.name == "hspmd-halt"]
    for t in answering:  # the first halt's answer has ended the job; nothing of it is left running
        t.join(10)
    failed.clear()
    controller._pending_dead.add(3)
    controller._on_halted(1, {"after": 0, "step": 1, "source": "live", "held": [0, 0], "error": "peer died"})
    # answered by the recovery: no answer of its own was started (the call starts it before it returns, if at all)
    assert not [t for t in threading.enumerate() if t.name == "hspmd-halt"]
    assert failed == []


#: the 6 ranks as a 2-stage pipeline on ranks 5, 4 beside a TP2 pipeline on 0, 2: ranks 1 and 3 hold nothing
SPARE = {"pipelines": [_pipe([([5], [0, 1]), ([4], [2, 3])], 2, 2), _pipe([([0, 2], [0, 3])], 4, 1)],
         "schedule": "gpipe"}


@pytest.mark.timeout(60)
def test_a_failure_in_the_first_step_after_a_switch_that_leaves_ranks_without_state(reference) -> None:
    """A switch to a plan where ranks 1 and 3 hold nothing is applied at step 2's boundary (it is requested while
    every worker is held at the start of step 1); rank 4 dies in step 2's forward.  Ranks 1 and 3, with no work, are
    already inside step 2's commit when the others halt: they hold the new (empty) state and the one from before
    the switch, the others only the latter.  Nobody completed the commit, so everyone recovers from the state from
    before the switch (a recovery that once failed with "the survivors disagree on their state")."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(6)
    job = launch(_program(model, SIX, cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR,
                          elastic=True, timeout_s=60, heartbeat_s=0.5, hold_at=[1],
                          fault_injection=[{"rank": 4, "step": 2, "at": "forward"}])
    pids = job.pids()
    job.wait_held(1)
    switch = job.switch(_program(model, SPARE, cluster))
    job.release(1)
    result = job.wait(timeout=50)
    failure = [e for e in result.events if e.reason == "failure"]
    assert switch.step == 2 and len(failure) == 1 and failure[0].done, [str(e) for e in result.events]
    _check(job, result, reference, pids, {4})


_WARM = """
import sys, threading
from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.runtime.control.controller import TrainingController
model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
data = {"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 4, "num_micro_batches": 1}
                      for r in range(2)]}
program = specialize(model, plan_from_strategy(model, Strategy.load(data), cluster), cluster, bindings={"B": 8, "S": 16})
c = TrainingController(program, cluster, global_batch=8, seq_len=16, elastic=sys.argv[1] == "elastic")
before = "pyomo.environ" in sys.modules
c._on_metric(0, {"step": 0, "extra": {}})
for t in threading.enumerate():
    if t.name == "hspmd-warm-planners":
        t.join(60)
print(before, "pyomo.environ" in sys.modules, "pulp" in sys.modules)
"""


@pytest.mark.parametrize("mode,loaded", [("elastic", "False True True"), ("plain", "False False False")])
def test_an_elastic_job_loads_its_planners_once_it_trains(mode: str, loaded: str) -> None:
    """The first replan after a failure used to spend ~1 s importing the planners' solvers (Pyomo, PuLP): an
    elastic (or straggler-watching) job's launcher imports them at its first step instead; a plain job does not."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _WARM, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == loaded
