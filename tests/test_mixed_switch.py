"""``job.switch([...])`` of a mixed-length job (SPEC §9): the running job moves to another candidate set at a step
boundary, the dispatcher then chooses among the new candidates, and the run trains exactly the single-device
reference on the same sequences (the global batch and the data order stay) -- also with a worker SIGKILLed during
or right after the switch (``elastic=True``).  A candidate list that cannot run is refused before anything
changes, and the job goes on as if nothing was asked.

Every switch is requested while every rank is held at the start of a step (``hold_at=``) and the step's dispatch
was sent (``lookahead=0``: the launcher dispatches no further while the job is held), so the switch lands at the
boundary after the held step whatever the machine's load.  Tolerances as in ``test_mixed_runtime.py`` (fp32).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, launch, specialize
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.core.strategy_plan import plan_from_strategy, strategy_of
from hspmd_sdk.runtime.control.controller import SwitchError, TrainingController
from hspmd_sdk.runtime.control.mixed import reference_mixed
from hspmd_sdk.runtime.data import Documents, LengthBatches

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_mixed_candidates import CLUSTER, _check_state, _program  # noqa: E402
from test_mixed_runtime import BUDGET, CONTEXT, DOCS, ENTRIES, SEED, TOL, _programs, _rel, _strategy  # noqa: E402

HOLD = 2  # every rank waits at the start of this step; the switch lands at the boundary before HOLD + 1
#: the new candidates: two TP2 pipelines (a Program) and two PP2 pipelines (a Strategy); each tensor has a replica
#: in the other pipeline, so a lost rank's state survives in memory
TP2X2 = _strategy([[([0, 1], [0, 3])], [([2, 3], [0, 3])]], "tp2x2")
PP2X2 = _strategy([[([0], [0, 1]), ([1], [2, 3])], [([2], [0, 1]), ([3], [2, 3])]], "pp2x2")


def _wait(cond: Callable[[], bool], job: Any, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert job.status.value == "running", job.status_text
        if time.monotonic() > end:
            raise TimeoutError("condition not met in time")
        time.sleep(0.01)


def _hold_dispatched(job: Any, step: int) -> None:
    """Every rank waits at the start of ``step`` and the launcher has dispatched it (and nothing after it)."""
    assert job.wait_held(step, timeout=60) == [0, 1, 2, 3]
    _wait(lambda: job.length_planner.next_step() == step + 1, job)


def _trained_once(result: Any, steps: Iterable[int]) -> None:
    """Every sequence of each of ``steps`` trained exactly once (the data order stays), over the ranks' reports."""
    batches = LengthBatches(Documents(DOCS), context=CONTEXT, tokens_per_step=BUDGET, seed=SEED)
    for step in steps:
        got = sorted(i for r in result.results.values() if "runs" in r
                     for i in r["runs"][0]["trained"].get(str(step), []))
        assert got == sorted(batches.step_indices(step)), step


@pytest.mark.timeout(300)
def test_switching_to_another_candidate_list_trains_like_the_reference(tmp_path: Path) -> None:
    model = LlamaConfig.preset("tiny")
    steps = 6
    old = _programs(model)
    new = [_program(model, TP2X2), PP2X2]  # a Program and a Strategy, as launch takes them
    job = launch(old, CLUSTER, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT,
                 capture_dir=tmp_path, timeout_s=120, lookahead=0, hold_at=[HOLD])
    _hold_dispatched(job, HOLD)
    event = job.switch(new)
    assert event.reason == "user" and event.step == HOLD + 1 and not event.done
    job.release(HOLD)
    result = job.wait(timeout=240)
    ref = reference_mixed(model, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert len(result.losses) == steps and _rel(result.losses, ref.losses) < TOL, (result.losses, ref.losses)
    _check_state(tmp_path, ref)
    _trained_once(result, range(steps))
    assert event.done and not event.superseded and event.seconds["switch"] > 0, str(event)
    assert [e for e in result.events if e.reason == "user"] == [event]
    # the dispatch chose among the new candidates from the switch on: they follow the old ones (base 3)
    planner = job.length_planner
    assert planner.base == len(old) and len(planner.programs) == 2
    assert planner.programs[0] is new[0] and strategy_of(planner.programs[1]).name == "pp2x2"
    assert [r["step"] for r in planner.records] == list(range(steps))
    assert event.strategy == strategy_of(planner.programs[planner.records[HOLD + 1]["choice"]])
    for r in result.results.values():  # every worker switched at that boundary, to a new candidate
        moves = [s for s in r["runs"][0]["length_switches"] if s["what"] == "candidates"]
        assert [(s["step"], s["to"] >= len(old)) for s in moves] == [(HOLD + 1, True)], moves
    # length switches after it are among the new candidates only
    after = [e for e in result.events if e.reason == "length" and e.step > HOLD + 1]
    assert all(e.strategy.name in ("tp2x2", "pp2x2") for e in after), after


@pytest.mark.timeout(300)
@pytest.mark.parametrize("at,after", [("switch", 0), ("forward", 0), ("forward", 1)])
def test_a_worker_killed_in_or_right_after_the_switch_is_survived_with_the_references_losses(
        tmp_path: Path, at: str, after: int) -> None:
    """Rank 3 is SIGKILLed in the switch's fused BSR or in the forward of the first step under the new candidates
    (``after=0``): the survivors recover from the state they held before the switch (as for one Program), every
    candidate of its set is replanned on them, and the run goes on.  Or in the forward of the step after
    (``after=1``): the first step under the new candidates committed, the survivors recover from the new
    candidate they run, and every candidate of the new set is replanned.  The losses and the final parameters
    equal the single-device reference's."""
    model = LlamaConfig.preset("tiny")
    steps = 5
    dp4 = ENTRIES[1].model_copy(update={"strategy": ENTRIES[1].strategy.model_copy(update={"zero1": False})})
    old = _programs(model, [ENTRIES[0], dp4])  # every tensor with a replica on another rank (no ZeRO-1)
    job = launch(old, CLUSTER, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT,
                 capture_dir=tmp_path, timeout_s=60, lookahead=0, hold_at=[HOLD], elastic=True,
                 fault_injection=[{"rank": 3, "step": HOLD + 1 + after, "at": at}])
    _hold_dispatched(job, HOLD)
    event = job.switch([_program(model, TP2X2), PP2X2])
    assert event.step == HOLD + 1
    job.release(HOLD)
    result = job.wait(timeout=240)
    ref = reference_mixed(model, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert len(result.losses) == steps and _rel(result.losses, ref.losses) < TOL, (result.losses, ref.losses)
    failures = [e for e in result.events if e.reason == "failure"]
    assert len(failures) == 1 and failures[0].failed_ranks == [3] and failures[0].done, result.events
    assert failures[0].step == HOLD + 1 + after and failures[0].source == "memory"
    assert 3 not in job.controller.current.to_launch.values()
    # the dispatch went on among the survivors' candidates: every step dispatched once
    planner = job.length_planner
    assert [r["step"] for r in planner.records] == list(range(steps))
    assert planner.base == 0 and planner.generation == 1  # the recovery's world, its candidates from 0
    survivors = [r for launch_rank, r in result.results.items() if launch_rank != 3 and "runs" in r]
    switched = [any(s["what"] == "candidates" and s["step"] == HOLD + 1 for s in r["runs"][0]["length_switches"])
                for r in survivors]
    assert len(survivors) == 3 and (at == "switch" or all(switched)), switched  # killed after it: all switched
    # the version the survivors recovered from (their ``halted`` reports): (world 0, candidate); the new set's
    # candidates follow the old ones (base len(old))
    held = {tuple(m["held"]) for r, m in job.controller.state.halted.items() if r != 3}
    assert len(held) == 1, held
    world, candidate = held.pop()
    assert world == 0
    if after:  # the first step under the new candidates committed: the new set was replanned on the survivors
        assert candidate >= len(old) and event.done and not event.superseded, (candidate, str(event))
        assert job.controller.numbering_of((0, candidate)).program is not None
        assert len(job.controller.candidate_versions((0, candidate))) == 2
    else:  # no step committed under them: back to the state from before the switch, the old set replanned
        assert candidate < len(old), candidate
        # the switch ends one way or the other: done when every survivor reported it before the recovery, else
        # superseded by the recovery
        assert event.done != event.superseded, str(event)
    assert 1 <= len(planner.programs) == job.controller.versions.candidate_count(1) <= 2
    _trained_once(result, range(HOLD + 1 + after, steps))  # (a lost rank's reports of earlier steps are lost)
    _check_state(tmp_path, ref)


@pytest.mark.timeout(300)
def test_candidate_lists_that_cannot_run_are_refused_and_the_job_goes_on_unchanged() -> None:
    model = LlamaConfig.preset("tiny")
    steps = 4
    old = _programs(model, [ENTRIES[0], ENTRIES[1]])
    gpt = GPTConfig.preset("tiny")
    five = Cluster.local(5)
    on_five = specialize(model, plan_from_strategy(model, _strategy([[([4], [0, 3])]], "on4"), five), five)
    short = _programs(model, [ENTRIES[0]])  # takes sequences of up to 32 tokens; the data's context is 64
    zero3 = Strategy.load({**{k: v for k, v in TP2X2.model_dump().items() if k != "zero1"}, "zero": 3})
    refused = [
        ([], r"candidates: is empty"),
        ([_program(model, TP2X2), "pp2x2"], r"candidates\[1\]: is a str"),
        ([PP2X2, _program(gpt, TP2X2)], r"candidates\[1\]: trains .*gpt.*the job .*llama.*same model"),
        ([_program(model, TP2X2), on_five], r"candidates\[1\]: uses ranks \[4\] that the job does not run"),
        ([PP2X2, _strategy([[([r], [0, 3])] for r in range(5)], "dp5")], r"candidates\[1\]: uses ranks \[4\]"),
        ([zero3], r"candidates\[0\]: is at ZeRO-3"),
        ([_strategy([[([0, 1, 2, 3], [0, 9])]], "ten")], r"candidates\[0\]: the strategy does not specialize on "
                                                         r"the job's cluster"),
        (short, r"longest takes sequences of 32 tokens, the job's data has sequences of up to 64"),
    ]
    job = launch(old, CLUSTER, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT,
                 timeout_s=120, lookahead=0, hold_at=[1, steps - 1])
    _hold_dispatched(job, 1)
    for candidates, message in refused:
        with pytest.raises(SwitchError, match=message):
            job.switch(candidates)
    with pytest.raises(SwitchError, match="mixed-length data.*pass a list"):
        job.switch(_program(model, TP2X2))  # one Program for a mixed-length job: a list is asked for
    assert job.length_planner.programs == old and job.length_planner.base == 0
    assert job.controller.candidate_switch.sets.added == {} and job.controller.state.open == {}
    job.release(1)
    # at the last step, every step is dispatched: no boundary is left to switch at
    _hold_dispatched(job, steps - 1)
    with pytest.raises(SwitchError, match="every remaining step of the job .* is dispatched already"):
        job.switch([_program(model, TP2X2)])
    assert job.controller.candidate_switch.sets.added == {} and job.controller.state.open == {}
    job.release(steps - 1)
    result = job.wait(timeout=240)
    ref = reference_mixed(model, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert len(result.losses) == steps and _rel(result.losses, ref.losses) < TOL, (result.losses, ref.losses)
    assert all(e.reason == "length" for e in result.events), result.events
    assert job.length_planner.programs == old


def test_a_list_of_candidates_is_refused_for_a_job_that_trains_one_program() -> None:
    model = LlamaConfig.preset("tiny")
    program = _program(model, TP2X2)
    controller = TrainingController(program, CLUSTER, global_batch=4, seq_len=CONTEXT)
    with pytest.raises(SwitchError, match="trains one Program: pass one Program or Strategy"):
        controller.switch_candidates([program])
