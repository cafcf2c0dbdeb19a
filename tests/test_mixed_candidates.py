"""Mixed-length training from any candidates (SPEC §9): a hand-made list of Programs and Strategies of one model --
not :meth:`MixedPlan.programs` -- is a valid candidate set; a candidate that says nothing of its longest sequence
takes what its memory holds (:func:`~hspmd_sdk.planner.mixed.memory_windows`).  The runs train exactly the
single-device reference on the same sequences (:func:`reference_mixed`), also from ``init=`` weights.

Tolerances as in ``test_mixed_runtime.py`` (fp32): losses within 1e-5 (relative), parameters after the run within
1e-4 (absolute; Adam turns fp32 summation noise of a zero gradient into an update of up to ``lr``).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, launch, specialize
from hspmd_sdk.core.cluster import DeviceSpec
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.models.hf import to_hf
from hspmd_sdk.planner import CostModel
from hspmd_sdk.planner.mixed import Dispatcher, memory_windows
from hspmd_sdk.planner.mixed_cost import PipelineCost
from hspmd_sdk.runtime.control.mixed import reference_mixed
from hspmd_sdk.runtime.control.train import assemble, load_captured

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_mixed_runtime import BUDGET, CONTEXT, DOCS, SEED, STATE_TOL, TOL, _rel, _strategy  # noqa: E402

STEPS = 4
CLUSTER = Cluster.local(4)
DP4 = _strategy([[([r], [0, 3])] for r in range(4)], "dp4", zero1=True)
TP2PP2 = _strategy([[([0, 1], [0, 1]), ([2, 3], [2, 3])]], "tp2pp2")
TP2_PP2 = _strategy([[([0, 1], [0, 3])], [([2], [0, 1]), ([3], [2, 3])]], "tp2+pp2")


def _program(model: Any, strategy: Strategy) -> Any:
    return specialize(model, plan_from_strategy(model, strategy, CLUSTER), CLUSTER)


def _cluster_of(memory_mb: int) -> Cluster:
    """4 ranks on one node of devices with ``memory_mb`` MiB each."""
    return Cluster.load({"devices": {"cpu": DeviceSpec(kind="cpu", memory_mb=memory_mb, bf16_tflops=1.0,
                                                       intra_bandwidth_gbs=5.0)},
                         "nodes": [{"kind": "cpu", "ranks": [0, 1, 2, 3], "host": "localhost"}]})


def _check_state(tmp: Path, ref: Any) -> None:
    shapes = {k: tuple(v.shape) for k, v in ref.params.items()}
    full, worst = assemble(load_captured(tmp), "params", shapes)
    assert worst == 0.0  # replicas agree exactly
    err = max(float((full[k] - ref.params[k]).abs().max()) for k in ref.params)
    assert err < STATE_TOL, err


def test_memory_windows_are_the_longest_micro_batch_every_stage_holds() -> None:
    """Against the stage memory model directly: the window fits, one token more does not (a device small enough
    that the window lies below the model's max_seq_len), and the window never exceeds max_seq_len."""
    model = LlamaConfig.preset("tiny").model_copy(update={"max_seq_len": 4096})
    cost = CostModel(memory_reserve_mb=0.0, cpu_baseline_mb=0.0)  # tensors only: no CUDA context, no process
    big = Cluster.local(4)
    assert memory_windows(model, TP2_PP2, big, cost) == [4096, 4096]
    small = _cluster_of(4)
    windows = memory_windows(model, TP2_PP2, small, cost)
    for k, (w, pipe) in enumerate(zip(windows, TP2_PP2.pipelines)):
        pc = PipelineCost.of(model, pipe, small, cost)
        S = len(pipe.stages)
        from hspmd_sdk.core.schedule import in_flight

        def fits(t: int) -> bool:
            return all(sc.fits(t, in_flight(TP2_PP2.schedule, S, s, S), 1, 4 * 2.0**20)
                       for s, sc in enumerate(pc.stages))
        assert 1 <= w < 4096, (k, w)
        assert fits(w) and not fits(w + 1), (k, w)
    # TP2 halves the activations of a stage: the TP pipeline holds longer micro-batches than PP on single ranks
    assert windows[0] > windows[1]
    with pytest.raises(PlanValidationError, match=r"pipelines\[0\].*one token"):
        memory_windows(model, TP2_PP2, _cluster_of(1), cost)


def test_the_dispatcher_takes_strategies_and_plain_programs() -> None:
    model = LlamaConfig.preset("tiny")
    d = Dispatcher([DP4, _program(model, TP2PP2)], model, CLUSTER)
    assert d.max_seq_len == model.max_seq_len
    assert [c.windows for c in d.candidates] == [[model.max_seq_len] * 4, [model.max_seq_len]]
    got = d([40, 7, 5, 3, 9, 12])
    assert sorted(i for p in got.micro_batches for mb in p for i in mb) == list(range(6))


@pytest.mark.timeout(240)
def test_a_hand_made_list_of_programs_and_strategies_trains_like_the_reference(tmp_path: Path) -> None:
    model = GPTConfig.preset("tiny")
    # the third states its longest sequence (40 tokens; its memory holds the whole context): a step with a longer
    # sequence must go to another candidate, and the job switches by length
    plan = plan_from_strategy(model, TP2_PP2, CLUSTER)
    short = specialize(model, plan.model_copy(update={"settings": plan.settings.model_copy(
        update={"max_seq_len": 40})}), CLUSTER)
    candidates = [_program(model, DP4), TP2PP2, short]
    job = launch(candidates, CLUSTER, steps=STEPS, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT,
                 capture_dir=tmp_path, timeout_s=120)
    result = job.wait()
    ref = reference_mixed(model, steps=STEPS, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert len(result.losses) == STEPS and _rel(result.losses, ref.losses) < TOL
    _check_state(tmp_path, ref)
    choices = [rec["choice"] for rec in job.length_planner.records]
    assert all(0 <= c < 3 for c in choices) and len(choices) == STEPS
    switched = [k for k in range(1, STEPS) if choices[k] != choices[k - 1]]
    assert switched and len(set(choices)) >= 2, choices  # a length switch between hand-made candidates
    longest = [max(rec["lengths"]) for rec in job.length_planner.records]
    assert any(n > 40 for n in longest) and all(c != 2 for c, n in zip(choices, longest) if n > 40), (choices, longest)
    assert [e.step for e in result.events] == switched and all(e.reason == "length" for e in result.events)


@pytest.mark.timeout(240)
def test_mixed_length_training_starts_from_init_weights(tmp_path: Path) -> None:
    model = LlamaConfig.preset("tiny")
    start = model.build_reference(11)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in start.parameters():  # every parameter off its seeded init, so each one matters
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    state = {k: v.detach().clone() for k, v in start.state_dict().items()}
    hf = tmp_path / "hf"
    to_hf(model, state, hf)
    cap = tmp_path / "cap"
    job = launch([DP4, _program(model, TP2_PP2)], CLUSTER, steps=STEPS, seed=SEED, data=DOCS,
                 tokens_per_step=BUDGET, context=CONTEXT, capture_dir=cap, init=hf, timeout_s=120)
    result = job.wait()
    ref = reference_mixed(model, steps=STEPS, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT,
                          init=state)
    plain = reference_mixed(model, steps=STEPS, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert _rel(result.losses, ref.losses) < TOL
    assert _rel(result.losses, plain.losses) > 1e-3  # the weights were used: not the seeded start
    _check_state(cap, ref)


def test_candidates_without_a_model_or_a_strategy_are_refused_before_any_worker_starts() -> None:
    model = LlamaConfig.preset("tiny")
    kw = dict(steps=2, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    with pytest.raises(PlanValidationError, match="all Strategies"):
        launch([DP4, TP2PP2], CLUSTER, **kw)
    made = plan_from_strategy(model, DP4, CLUSTER)
    bare = specialize(model, made.model_copy(update={"settings": made.settings.model_copy(update={"strategy": None})}),
                      CLUSTER)
    with pytest.raises(PlanValidationError, match=r"candidates\[1\].*neither a Strategy nor a Program"):
        launch([_program(model, DP4), bare], CLUSTER, **kw)
    with pytest.raises(PlanValidationError, match=r"programs\[1\].*str"):
        launch([_program(model, DP4), "dp4"], CLUSTER, **kw)
    five = _strategy([[([r], [0, 3])] for r in range(5)], "dp5")
    with pytest.raises(PlanValidationError, match=r"programs\[1\].*does not specialize"):
        launch([_program(model, DP4), five], CLUSTER, **kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("at", ["forward", "switch"])
def test_a_killed_worker_in_a_mixed_length_run_is_survived_and_the_losses_stay_the_references(
        tmp_path: Path, at: str) -> None:
    """``elastic=True`` with candidates: rank 3 is SIGKILLed (in a step's forward, or inside a length switch's
    BSR); every candidate is replanned on the 3 survivors and the dispatch goes on among them from the interrupted
    step.  Every step's loss and the final parameters equal the single-device reference on the same sequences."""
    from test_mixed_runtime import ENTRIES, _programs

    model = LlamaConfig.preset("tiny")
    steps = 5
    # candidates whose every tensor has a replica on another rank (ZeRO-1 off), so the state survives in memory;
    # the dispatch switches between them at steps 1 and 4 on this data
    dp4 = ENTRIES[1].model_copy(update={"strategy": ENTRIES[1].strategy.model_copy(update={"zero1": False})})
    programs = _programs(model, [ENTRIES[0], dp4])
    if at == "switch":  # the first length switch (from the dispatch the launcher will make)
        d = Dispatcher(programs, model, CLUSTER, packing=True)
        from hspmd_sdk.runtime.data import Documents, LengthBatches

        b = LengthBatches(Documents(DOCS), context=CONTEXT, tokens_per_step=BUDGET, seed=SEED)
        choices, cur = [], None
        for s in range(steps):
            cur = d(b.step_lengths(s), current=cur).choice
            choices.append(cur)
        kill_step = next(s for s in range(1, steps) if choices[s] != choices[s - 1])
    else:
        kill_step = 2
    job = launch(programs, CLUSTER, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT,
                 capture_dir=tmp_path, timeout_s=60, elastic=True,
                 fault_injection=[{"rank": 3, "step": kill_step, "at": at}])
    result = job.wait()
    ref = reference_mixed(model, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert len(result.losses) == steps and _rel(result.losses, ref.losses) < TOL, (result.losses, ref.losses)
    failures = [e for e in result.events if e.reason == "failure"]
    assert len(failures) == 1 and failures[0].failed_ranks == [3] and failures[0].done, result.events
    assert failures[0].step == kill_step and failures[0].source == "memory"
    assert 3 not in job.controller.current.to_launch.values()
    # the dispatch went on among candidates of the survivors: every step after the failure dispatched once
    assert [r["step"] for r in job.length_planner.records] == list(range(steps))
    _check_state(tmp_path, ref)


@pytest.mark.timeout(300)
def test_cp_candidates_in_an_elastic_mixed_length_run_with_a_lost_cp_rank(tmp_path: Path) -> None:
    """Context parallelism × mixed length × elastic: the candidates are two CP2 pipelines and one CP4 pipeline
    (balanced layouts, packed rows whose documents cross the ranks' chunks), rank 3 -- in both candidates' CP
    groups -- is SIGKILLed in step 2's forward; the survivors replan every candidate and go on.  Every loss and
    the final parameters equal the single-device reference on the same sequences."""
    model = LlamaConfig.preset("tiny")
    steps = 4
    cp2x2 = Strategy.load({"pipelines": [{"stages": [{"devices": d, "layers": [0, 3], "cp": 2}],
                                          "micro_batch_size": 1, "num_micro_batches": 1} for d in ([0, 1], [2, 3])],
                           "name": "cp2x2"})
    cp4 = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1, 2, 3], "layers": [0, 3], "cp": 4}],
                                        "micro_batch_size": 1, "num_micro_batches": 1}], "name": "cp4"})
    programs = [_program(model, cp2x2), _program(model, cp4)]
    assert [p.pipelines for p in programs] == [[[[0, 1]], [[2, 3]]], [[[0, 1, 2, 3]]]]
    job = launch(programs, CLUSTER, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT,
                 capture_dir=tmp_path, timeout_s=60, elastic=True,
                 fault_injection=[{"rank": 3, "step": 2, "at": "forward"}])
    result = job.wait()
    ref = reference_mixed(model, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert len(result.losses) == steps and _rel(result.losses, ref.losses) < TOL, (result.losses, ref.losses)
    failures = [e for e in result.events if e.reason == "failure"]
    assert len(failures) == 1 and failures[0].failed_ranks == [3] and failures[0].done, result.events
    assert [r["step"] for r in job.length_planner.records] == list(range(steps))
    # before the loss, every sequence of a step is reported trained once: one rank per pipeline, not per CP rank
    from hspmd_sdk.runtime.data import Documents, LengthBatches

    batches = LengthBatches(Documents(DOCS), context=CONTEXT, tokens_per_step=BUDGET, seed=SEED)
    for step in range(2):  # rank 3, lost, reports nothing; it was no pipeline's lowest loss rank
        got = sorted(i for r in result.results.values() if "runs" in r
                     for i in r["runs"][0]["trained"].get(str(step), []))
        assert got == sorted(batches.step_indices(step)), step
    _check_state(tmp_path, ref)


@pytest.mark.timeout(240)
def test_a_straggler_in_a_mixed_length_run_gets_fewer_sequences_and_the_losses_stay_the_references() -> None:
    """``straggler=`` with candidates (SPEC §9: every option works with both forms): rank 1 turns 4x slower at
    step 3 (emulated); its compute, measured against what the dispatch estimated for it in each step, stays high,
    and the dispatch is priced from then on with rank 1 slower (``reason="straggler"``, done at once: nothing
    moves).  At even speeds the dispatch runs every step on the TP2 candidate; priced so, it switches to the DP2
    candidate and gives rank 1's pipeline under a third of each step's tokens; every step's loss equals the
    single-device reference on the same sequences."""
    from hspmd_sdk.runtime.control.controller import StragglerWatch

    model, two = LlamaConfig.preset("tiny"), Cluster.local(2)
    dp2 = _strategy([[([0], [0, 3])], [([1], [0, 3])]], "dp2")
    tp2 = _strategy([[([0, 1], [0, 3])]], "tp2")
    steps = 18  # room after the slow-down for detection (warm-up 2 + 3 steps) and the dispatch ahead (2)
    first = specialize(model, plan_from_strategy(model, dp2, two), two)
    job = launch([first, tp2], two, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT,
                 timeout_s=60, slowdown={1: [(3, 4.0)]}, straggler=StragglerWatch(margin=2.0, steps=3, warmup=2))
    result = job.wait(timeout=200)
    ref = reference_mixed(model, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert len(result.losses) == steps and _rel(result.losses, ref.losses) < TOL, (result.losses, ref.losses)
    stragglers = [e for e in result.events if e.reason == "straggler"]
    assert stragglers and all(e.done for e in stragglers) and stragglers[0].step < steps - 2, result.events
    # every repricing names rank 1.  A second one may follow when a loaded machine's timing makes rank 1 measure
    # slower again than the repriced dispatch estimated (it compounds: rank 1 only gets fewer tokens; on CI in
    # stop 38, once in ~20 runs under load: a 4.4x factor from steps 14-16, after rank 0 ran 3x slow for a while)
    assert job.controller._slow and set(job.controller._slow) == {1}
    records = job.length_planner.records

    def share(rec: dict) -> float:  # rank 1's pipeline's part of the step's tokens under dp2
        tokens = [sum(rec["lengths"][i] for mb in pipe for i in mb) for pipe in rec["micro_batches"]]
        return tokens[1] / sum(tokens)

    before = [r for r in records if r["pricing"] == 0]
    after = [r for r in records if r["pricing"] >= 1]
    assert before and after and after[0]["step"] == stragglers[0].step, [(r["step"], r["choice"], r["pricing"])
                                                                          for r in records]
    # at even speeds the dispatch runs tp2; priced with rank 1 slower, dp2 with most of the tokens on rank 0
    assert {r["choice"] for r in before} == {1}, [r["choice"] for r in before]
    # the launcher tells the dispatcher what each finished step measured against its estimate (Dispatcher.observe):
    # one candidate run, so its error is the machine's and the factors stay 1
    assert len(job.length_planner.dispatcher._ratios) >= 1 and all(r["factors"] == [1.0, 1.0] for r in before)
    assert {r["choice"] for r in after} == {0} and max(share(r) for r in after) < 0.35, [share(r) for r in after]
    assert any(e.reason == "length" and e.step >= stragglers[0].step for e in result.events)


@pytest.mark.timeout(300)
def test_a_mixed_length_run_with_a_straggler_then_a_killed_worker_equals_the_reference() -> None:
    """Straggler × failure × mixed length: rank 1 turns 4x slower at step 2 and the dispatch is repriced; later rank
    3 is SIGKILLed (``elastic=True``): every candidate is replanned on the 3 survivors, the dispatch restarts
    priced for them as launched (the straggler is measured afresh), and every step's loss equals the reference."""
    from hspmd_sdk.runtime.control.controller import StragglerWatch

    model = LlamaConfig.preset("tiny")
    dp4 = _strategy([[([r], [0, 3])] for r in range(4)], "dp4")
    tp2x2 = _strategy([[([0, 1], [0, 3])], [([2, 3], [0, 3])]], "tp2x2")
    steps, kill = 16, 12
    job = launch([_program(model, tp2x2), dp4], CLUSTER, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET,
                 context=CONTEXT, timeout_s=60, elastic=True, slowdown={1: [(2, 4.0)]},
                 straggler=StragglerWatch(margin=2.0, steps=3, warmup=2),
                 fault_injection=[{"rank": 3, "step": kill, "at": "forward"}])
    result = job.wait(timeout=280)
    ref = reference_mixed(model, steps=steps, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    assert len(result.losses) == steps and _rel(result.losses, ref.losses) < TOL, (result.losses, ref.losses)
    reasons = [(e.reason, e.step) for e in result.events if e.reason != "length"]
    assert [r for r, _ in reasons][:1] == ["straggler"] and ("failure", kill) in reasons, reasons
    assert all(e.done for e in result.events), [str(e) for e in result.events]
    assert [r["step"] for r in job.length_planner.records] == list(range(steps))
    assert 3 not in job.controller.current.to_launch.values()
