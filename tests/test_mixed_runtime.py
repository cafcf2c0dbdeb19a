"""Mixed-length training on real worker processes (SPEC §7): ``launch(programs, ...)`` dispatches each step's
sequences to the pipelines of the cheapest candidate, switches between candidates by fused BSR (``reason=
"length"``) and trains exactly the single-device reference on the same sequences with the same normalisation --
with packed micro-batches (the default: several sequences in one row, kept apart by the kernels) and padded ones.

The candidates (4 CPU ranks) are chosen so that the cost model switches several times on this data: ``tp2+pp2``
takes steps whose longest sequence is at most 32 tokens, ``dp4`` (ZeRO-1) and ``tp2pp2`` (one pipeline, TP2 in
each of its two stages) take up to 64; the tied GPT-2 embedding crosses stages in ``tp2+pp2`` and ``tp2pp2``.
Tolerances (fp32): losses within 1e-5 (relative); the synchronised gradients of step 0 within 1e-5 of the largest
gradient; parameters after 6 Adam steps within 1e-4 (absolute).  The parameters' margin is wider because Adam
normalises each element by its own gradient history: a gradient that is zero in exact arithmetic (GPT-2's key bias,
which softmax ignores) is fp32 summation noise, of another sign under another summation order, and Adam turns it
into an update of up to ``lr`` (1e-3) a step either way.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, launch, specialize
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.planner.mixed import MixedEntry, MixedPlan
from hspmd_sdk.runtime.control.controller import SwitchError
from hspmd_sdk.runtime.data import Documents, LengthBatches
from hspmd_sdk.runtime.control.mixed import planning_summary, reference_mixed, same_layouts
from hspmd_sdk.runtime.control.train import assemble, load_captured

sys.path.insert(0, str(Path(__file__).resolve().parent))
from user_model import MLPLM  # noqa: E402

STEPS, SEED, CONTEXT, BUDGET = 6, 3, 64, 128
TOL, STATE_TOL = 1e-5, 1e-4


def _strategy(pipes: list, name: str, zero1: bool = False) -> Strategy:
    return Strategy.load({"pipelines": [{"stages": [{"devices": d, "layers": l} for d, l in p],
                                         "micro_batch_size": 1, "num_micro_batches": 1} for p in pipes],
                          "name": name, "zero1": zero1})


ENTRIES = [
    MixedEntry(max_seq_len=32, windows=[32, 32],
               strategy=_strategy([[([0, 1], [0, 3])], [([2], [0, 1]), ([3], [2, 3])]], "tp2+pp2")),
    MixedEntry(max_seq_len=64, windows=[64] * 4,
               strategy=_strategy([[([r], [0, 3])] for r in range(4)], "dp4", zero1=True)),
    MixedEntry(max_seq_len=64, windows=[128],
               strategy=_strategy([[([0, 1], [0, 1]), ([2, 3], [2, 3])]], "tp2pp2")),
]


def _programs(model: Any, entries: list[MixedEntry] = ENTRIES) -> list[Any]:
    return MixedPlan(context_len=CONTEXT, tokens_per_batch=BUDGET, entries=entries).programs(model, Cluster.local(4))


def _documents(seed: int = 0) -> list[np.ndarray]:
    """Mostly short documents (lognormal around 7 tokens), a few long ones (40-120: cut at the context)."""
    rng = np.random.default_rng(seed)
    long = rng.random(80) < 0.03
    lens = np.where(long, rng.integers(40, 120, 80), np.clip(np.exp(rng.normal(np.log(7), 0.7, 80)), 2, 30))
    return [rng.integers(0, 256, int(n)) for n in lens]


DOCS = _documents()


def _run(model: Any, programs: list[Any], tmp: Path, **kw: Any) -> tuple[Any, Any]:
    job = launch(programs, Cluster.local(4), steps=STEPS, seed=SEED, data=DOCS, tokens_per_step=BUDGET,
                 context=CONTEXT, capture_dir=tmp, timeout_s=120, **kw)
    with pytest.raises(SwitchError, match="mixed-length"):
        job.switch(programs[0])  # the job chooses its plan per step itself
    return job, job.wait()


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _check(model: Any, job: Any, result: Any, tmp: Path, ref: Any, packed: bool = True) -> None:
    assert len(result.losses) == STEPS and _rel(result.losses, ref.losses) < TOL
    # packed: every micro-batch one row, and rows do hold several sequences (kept apart by the kernels)
    records = job.length_planner.records
    assert all(rec["packed"] == packed for rec in records)
    if packed:
        assert all(rows == 1 for rec in records for pipe in rec["shapes"] for rows, _ in pipe)
        assert max(len(mb) for rec in records for pipe in rec["micro_batches"] for mb in pipe) > 1
    else:
        assert any(rec["padding"] > 0 for rec in records)
    shapes = {k: tuple(v.shape) for k, v in ref.params.items()}
    captured = load_captured(tmp)
    grads, _ = assemble([{**c, "boxes": c["grad_boxes"]} for c in captured], "grads", shapes)  # step 0's plan
    scale = max(float(g.abs().max()) for g in ref.grads.values())
    assert max(float((grads[k] - ref.grads[k]).abs().max()) for k in shapes) < TOL * scale
    full, worst = assemble(captured, "params", shapes)
    assert worst == 0.0  # replicas agree exactly
    err = max(float((full[k] - ref.params[k]).abs().max()) for k in ref.params)
    assert err < STATE_TOL, err
    # every sequence of every step trained exactly once (the loss ranks' sequences, across pipelines)
    batches = LengthBatches(Documents(DOCS), context=CONTEXT, tokens_per_step=BUDGET, seed=SEED)
    for step in range(STEPS):
        got = sorted(i for r in result.results.values() for i in r["runs"][0]["trained"].get(str(step), []))
        assert got == sorted(batches.step_indices(step)), step
    # the launcher's choices, the switches the workers made, and the events agree
    choices = [rec["choice"] for rec in job.length_planner.records]
    switched = [s for s in range(1, STEPS) if choices[s] != choices[s - 1]]
    assert len(switched) >= 2 and len(set(choices)) >= 2, choices
    assert [e.step for e in result.events] == switched
    assert all(e.reason == "length" and e.done and e.seconds["switch"] > 0 for e in result.events)
    for r in result.results.values():
        assert [s["step"] for s in r["runs"][0]["length_switches"]] == switched
    summary = planning_summary(job, result)
    assert summary["choices"] == choices and len(summary["wait_s"]) == len(summary["step_s"]) == STEPS
    assert 0.0 <= summary["hidden"] <= 1.0 and all(p > 0 for p in summary["plan_s"])


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path, Any]:
    model = LlamaConfig.preset("tiny")
    tmp = tmp_path_factory.mktemp("mixed-llama")
    job, result = _run(model, _programs(model), tmp)
    ref = reference_mixed(model, steps=STEPS, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    return job, result, tmp, ref


@pytest.mark.timeout(240)
def test_llama_switching_by_length_equals_the_single_device_reference(llama_run: tuple) -> None:
    job, result, tmp, ref = llama_run
    _check(LlamaConfig.preset("tiny"), job, result, tmp, ref)


@pytest.mark.timeout(240)
def test_gpt2_switching_by_length_equals_the_single_device_reference(tmp_path: Path) -> None:
    model = GPTConfig.preset("tiny")
    job, result = _run(model, _programs(model), tmp_path)
    ref = reference_mixed(model, steps=STEPS, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    _check(model, job, result, tmp_path, ref)


@pytest.mark.timeout(240)
def test_padded_micro_batches_train_the_same(llama_run: tuple, tmp_path: Path) -> None:
    model = LlamaConfig.preset("tiny")
    job, result = _run(model, _programs(model), tmp_path, packing=False)
    _check(model, job, result, tmp_path, llama_run[3], packed=False)


@pytest.mark.timeout(240)
def test_packed_rows_with_recomputation_train_the_same(llama_run: tuple) -> None:
    """Activation recomputation re-runs a packed micro-batch's forward inside its backward, after other
    micro-batches ran: it must see that micro-batch's sequences again (the 1F1B pipeline holds several)."""
    model = LlamaConfig.preset("tiny")
    pp = Strategy.load({"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1], "recompute": True},
                                                  {"devices": [1], "layers": [2, 3], "recompute": True}],
                                       "micro_batch_size": 1, "num_micro_batches": 1}], "name": "pp2+AC"})
    programs = MixedPlan(context_len=CONTEXT, tokens_per_batch=BUDGET, entries=[
        MixedEntry(max_seq_len=64, windows=[64], strategy=pp)]).programs(model, Cluster.local(2))
    job = launch(programs, Cluster.local(2), steps=STEPS, seed=SEED, data=DOCS, tokens_per_step=BUDGET,
                 context=CONTEXT, timeout_s=120)
    result = job.wait()
    assert max(len(p) for rec in job.length_planner.records for p in rec["micro_batches"]) > 1
    assert _rel(result.losses, llama_run[3].losses) < TOL


@pytest.mark.timeout(240)
def test_the_same_seed_gives_the_same_sequences_and_losses_whatever_the_candidates(llama_run: tuple,
                                                                                   tmp_path: Path) -> None:
    _, first, _, ref = llama_run
    model = LlamaConfig.preset("tiny")
    job = launch(_programs(model, [ENTRIES[2]]), Cluster.local(4), steps=STEPS, seed=SEED, data=DOCS,
                 tokens_per_step=BUDGET, context=CONTEXT, timeout_s=120)
    other = job.wait()
    assert not other.events and {rec["choice"] for rec in job.length_planner.records} == {0}
    assert _rel(other.losses, first.losses) < TOL and _rel(other.losses, ref.losses) < TOL
    for step in range(STEPS):
        mine = sorted(i for r in other.results.values() for i in r["runs"][0]["trained"].get(str(step), []))
        theirs = sorted(i for r in first.results.values() for i in r["runs"][0]["trained"].get(str(step), []))
        assert mine == theirs


def test_bad_input_is_refused_before_any_worker_starts() -> None:
    llama, gpt = LlamaConfig.preset("tiny"), GPTConfig.preset("tiny")
    progs = _programs(llama)
    kw = dict(steps=2, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    with pytest.raises(PlanValidationError, match=r"programs\[1\].*same model"):
        launch([progs[0], _programs(gpt)[1]], Cluster.local(4), **kw)
    with pytest.raises(PlanValidationError, match="nothing to train"):
        launch(progs, Cluster.local(4), **{**kw, "data": [np.array([1]), np.array([], dtype=np.int64)]})
    with pytest.raises(PlanValidationError, match="smaller than one chunk"):
        launch(progs, Cluster.local(4), **{**kw, "tokens_per_step": CONTEXT - 1})
    with pytest.raises(PlanValidationError, match="longest candidate takes sequences of 32"):
        launch(progs[:1], Cluster.local(4), **kw)
    made = plan_from_strategy(llama, ENTRIES[1].strategy, Cluster.local(4))
    plain = specialize(llama, made.model_copy(update={"settings": made.settings.model_copy(
        update={"strategy": None})}), Cluster.local(4))  # a hand-written plan: no strategy to dispatch to
    with pytest.raises(PlanValidationError, match="neither a Strategy nor a Program made from one"):
        launch([plain], Cluster.local(4), **kw)
    with pytest.raises(PlanValidationError, match="straggler"):
        launch(progs, Cluster.local(4), straggler="often", **kw)  # straggler= works with candidates; a bad value not
    with pytest.raises(PlanValidationError, match=r"grow_back.*needs elastic=True"):
        launch(progs, Cluster.local(4), grow_back=True, **kw)  # grow_back works with candidates, with elastic=True
    with pytest.raises(PlanValidationError, match="no candidate"):
        launch([], Cluster.local(4), **kw)
    with pytest.raises(PlanValidationError, match="steps"):
        launch(progs, Cluster.local(4), **{**kw, "steps": 0})
    user = MLPLM(max_seq_len=CONTEXT)  # its square_relu kernel declares no packing rule
    with pytest.raises(PlanValidationError, match=r"packing.*'square_relu'.*packing=False"):
        launch(_programs(user), Cluster.local(4), packing=True, **kw)
    assert math.isfinite(reference_mixed(llama, steps=1, seed=0, data=DOCS, tokens_per_step=BUDGET,
                                         context=CONTEXT).losses[0])


def test_candidates_that_differ_only_in_windows_run_one_program() -> None:
    model = LlamaConfig.preset("tiny")
    wide = ENTRIES[1].model_copy(update={"max_seq_len": 48, "windows": [48] * 4})
    progs = _programs(model, [wide, *ENTRIES])
    assert same_layouts(progs) == [0, 1, 0, 2]  # dp4 at 48 and at 64: the same Program, nothing to switch
    # plan_mixed names each candidate after its maximum length: a name is not a layout
    named = wide.model_copy(update={"strategy": wide.strategy.model_copy(update={"name": "mixed: max_seq_len <= 48"})})
    assert same_layouts(_programs(model, [named, *ENTRIES])) == [0, 1, 0, 2]
