"""ZeRO-3 (``Strategy.zero = 3``, SPEC §15): parameters gathered around each use as well as gradients and optimizer
states sharded over each layer's data-parallel replicas, against the single-device model.

One 4-rank job trains the tiny GPT-2 (tied embeddings) under each plan with the recipe of ``test_training_recipe.py``
(clipping active, warmup + cosine, weight decay, validation every 2 steps): DP2 with two micro-batches, uneven DP3,
DP2 x TP2, pipelines of different shapes under GPipe (a TP2 stage then a TP1 stage beside a one-rank pipeline; also
with 3 micro-batches beside 1, the one-rank pipeline joining the others' extra gathers), two two-stage pipelines
under 1F1B, 3 : 1 shares, and recomputation (DP2, two two-stage pipelines under 1F1B, 3 micro-batches beside 1
under GPipe: the recomputed forward gathers its layers again inside the backward).  The losses (1e-5 relative), global norms (1e-6), parameters
and Adam moments equal the reference's.  ZeRO-3 changes when a gathered parameter is held, not a number: its runs
are ZeRO-2's bit for bit (fp32, bf16, CP), while the gathered bytes a rank holds at its peak fall (measured from
the tensors it holds).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import Cluster, GPTConfig, launch, specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import PlanValidationError  # noqa: E402
from hspmd_sdk.runtime.control.train import start_runs, reference_training, training_run  # noqa: E402

from test_training_recipe import (RECIPE, _pipe, _program, _rel, _state_matches, gpt, reference,  # noqa: E402,F401
                                  train_plans)

TESTS = Path(__file__).resolve().parent
SEED, SEQ, LR = 1, 16, 1e-2  # the recipe test's: its fixtures and helpers are shared
_GPIPE_HETERO = {"pipelines": [_pipe([([0, 1], [0, 1]), ([2], [2, 3])], 2, 2), _pipe([([3], [0, 3])], 2, 2)],
                 "schedule": "gpipe"}

PLANS = {
    "dp2_zero3": {"pipelines": [_pipe([([0], [0, 3])], 2, 2), _pipe([([1], [0, 3])], 2, 2)], "zero": 3},
    "dp3_zero3_uneven": {"pipelines": [_pipe([([0], [0, 3])], 4, 1), _pipe([([1], [0, 3])], 2, 1),
                                       _pipe([([2], [0, 3])], 2, 1)], "zero": 3},
    "dp2xtp2_zero3": {"pipelines": [_pipe([([0, 1], [0, 3])], 2, 2), _pipe([([2, 3], [0, 3])], 2, 2)], "zero": 3},
    "hetero_gpipe_zero3": {**_GPIPE_HETERO, "zero": 3},
    "pp2_dp2_1f1b_zero3": {"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 2, 2),
                                         _pipe([([2], [0, 1]), ([3], [2, 3])], 2, 2)], "zero": 3},
    "dp2_zero3_share3to1": {"pipelines": [{**_pipe([([0], [0, 3])], 2, 2), "zero_share": 3.0},
                                          _pipe([([1], [0, 3])], 2, 2)], "zero": 3},
    # recomputation: a stage's layers gathered again inside its backward (its forward rerun), alike in every replica
    "dp2_zero3_recompute": {"pipelines": [_pipe([([r], [0, 3], {"recompute": True})], 2, 2) for r in (0, 1)],
                            "zero": 3},
    "pp2_dp2_1f1b_zero3_recompute": {"pipelines": [_pipe([([a], [0, 1], {"recompute": True}), ([b], [2, 3])], 2, 2)
                                                   for a, b in ((0, 1), (2, 3))], "zero": 3},
    # under GPipe, 3 micro-batches beside 1 and every stage recomputing: the fewer joins the others' regathers too
    "dp2_3v1_gpipe_zero3_recompute": {"pipelines": [_pipe([([0], [0, 3], {"recompute": True})], 2, 3),
                                                    _pipe([([1], [0, 3], {"recompute": True})], 2, 1)],
                                      "schedule": "gpipe", "zero": 3},
    # the tutorial's plan under GPipe: 3 micro-batches beside 1, the one-rank pipeline joining the others' gathers
    "hetero_3v1_gpipe_zero3": {"pipelines": [_pipe([([0, 1], [0, 1]), ([2], [2, 3])], 2, 3),
                                             _pipe([([3], [0, 3])], 2, 1)], "schedule": "gpipe", "zero": 3},
}


@pytest.fixture(scope="module")
def trained(gpt: GPTConfig, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return train_plans(gpt, PLANS, tmp_path_factory.mktemp("zero3"))


@pytest.mark.parametrize("name", list(PLANS))
def test_zero3_trains_equal_to_the_single_device_reference(name: str, trained: dict, reference: Any) -> None:
    run = trained["runs"][name]
    assert _rel(run["losses"], reference.losses) <= 1e-5
    assert _rel(run["grad_norms"], reference.grad_norms) <= 1e-6, (run["grad_norms"], reference.grad_norms)
    _state_matches(trained["out"], reference, list(PLANS).index(name))


def test_zero3_refuses_what_would_gather_out_of_order() -> None:
    """Every replica of a layer must gather its parameters in the same order: under 1F1B as many micro-batches and
    the same stages (GPipe takes pipelines of any shapes and micro-batch counts); with recomputation, the same stages
    recomputing alike in every pipeline (under GPipe too); the errors name the field."""
    two = _pipe([([0], [0, 1]), ([1], [2, 3])], 2, 2)
    for bad, words in (
            ({"pipelines": [_pipe([([0], [0, 3])], 2, 3), _pipe([([1], [0, 3])], 2, 1)], "zero": 3},
             r"pipelines\[1\].num_micro_batches: under 1F1B, ZeRO-3 .* pipelines\[0\] runs 3, pipelines\[1\] 1; "
             r"use schedule: gpipe"),
            ({"pipelines": _GPIPE_HETERO["pipelines"], "zero": 3},
             r"pipelines\[1\].stages: under 1F1B, ZeRO-3 .* \[\[0, 1\], \[2, 3\]\], pipelines\[1\]: \[\[0, 3\]\]"),
            ({"pipelines": [{**two, "stages": [{**two["stages"][0], "recompute": True}, two["stages"][1]]},
                            _pipe([([2], [0, 1]), ([3], [2, 3])], 2, 2)], "zero": 3},
             r"pipelines\[1\].stages\[0\].recompute: activation recomputation under ZeRO-3 .* recompute the same "
             r"ones \(pipelines\[0\]: \[\[0, 1, 'recompute'\], \[2, 3\]\], pipelines\[1\]: \[\[0, 1\], \[2, 3\]\]\)"),
            ({"pipelines": [_pipe([([0, 1], [0, 1], {"recompute": True}), ([2], [2, 3], {"recompute": True})], 2, 2),
                            _pipe([([3], [0, 3], {"recompute": True})], 2, 2)], "schedule": "gpipe", "zero": 3},
             r"pipelines\[1\].stages\[0\].recompute: .* the same stages")):
        with pytest.raises(PlanValidationError, match=words):
            Strategy.load(bad)
    assert Strategy.load(PLANS["hetero_gpipe_zero3"]).zero == 3
    assert Strategy.load(PLANS["hetero_3v1_gpipe_zero3"]).zero == 3
    assert Strategy.load(PLANS["dp2_zero3"]).name == "dp2-zero3"


def test_a_mixed_length_job_refuses_zero3(gpt: GPTConfig) -> None:
    """Mixed-length data changes each pipeline's micro-batches step by step: refused before any worker starts."""
    from hspmd_sdk.runtime.control.mixed_checks import candidate_programs

    cluster = Cluster.local(2)
    with pytest.raises(PlanValidationError, match=r"programs\[0\]: is at ZeRO-3 .* use zero: 2"):
        candidate_programs([_program(gpt, PLANS["dp2_zero3"], cluster)], cluster, "mixed-length launch")


# ---- what a rank holds ---------------------------------------------------------------------------------------------
MEMORY = {f"dp2_zero{z}": {"pipelines": [_pipe([([0], [0, 3])], 2, 2), _pipe([([1], [0, 3])], 2, 2)], "zero": z}
          for z in (2, 3)}


@pytest.fixture(scope="module")
def measured(gpt: GPTConfig) -> dict:
    from test_zero2 import measure

    # a unit per layer (no merging up to ZERO3_UNIT_BYTES: the whole tiny model would be one unit)
    return measure(gpt, MEMORY, zero3_unit_bytes=0)


def test_zero3_holds_a_few_gathered_parameters_at_a_time(gpt: GPTConfig, measured: dict) -> None:
    """DP2, two micro-batches a step.  ZeRO-2 holds every gathered parameter for the whole step (the rank's share of
    the model and the other rank's); ZeRO-3 gathers each one for every forward and backward of a micro-batch and
    holds a few at once, by units of one layer each (the unit read, the next one prefetched): measured 0.30 of
    ZeRO-2's, the embedding's unit (the tied ``wte`` and ``wpe``, the largest) with the first layer's.  The losses
    are ZeRO-2's exactly."""
    for rank in (0, 1):
        two, three = measured[rank]["dp2_zero2"], measured[rank]["dp2_zero3"]
        assert two["losses"] == three["losses"]
        sharded = 4 * gpt.param_count() - 4 * sum(two["params"].values())  # the fp32 bytes gathered a step
        assert two["gathered_peak"] >= 0.9 * sharded, (two["gathered_peak"], sharded)
        assert 0 < three["gathered_peak"] <= 0.35 * two["gathered_peak"], (three["gathered_peak"],
                                                                           two["gathered_peak"])
        # two micro-batches: each unit (the embedding, 4 layers, the final norm) gathered for both forwards and
        # both backwards
        assert three["gathers"] == 4 * 6, three["gathers"]
        assert two["gathers"] == 0


def test_zero3_runs_bit_for_bit_like_zero2(gpt: GPTConfig) -> None:
    """The same gathers of the same shards, the same kernels: a ZeRO-3 run's losses and gradient norms are ZeRO-2's
    exactly, under CP beside a CP1 pipeline (GPipe) and under bf16 (the gathers refill the storage in bf16)."""
    cluster = Cluster.local(4)
    pairs = {"cp2_beside_cp1": ({"pipelines": [_pipe([([0, 1], [0, 1], {"cp": 2}), ([2], [2, 3])], 2, 2),
                                               _pipe([([3], [0, 3])], 2, 2)], "schedule": "gpipe"}, "fp32"),
             "hetero_gpipe_bf16": (_GPIPE_HETERO, "bf16")}
    runs = [training_run(_program(gpt, {**s, "zero": z}, cluster), steps=3, seed=SEED, seq_len=SEQ, lr=LR,
                         cluster=cluster, precision=precision, **RECIPE)
            for s, precision in pairs.values() for z in (2, 3)]
    got = start_runs(runs, cluster, timeout_s=120).wait().results[0]["runs"]
    for k, name in enumerate(pairs):
        two, three = got[2 * k], got[2 * k + 1]
        assert two["losses"] == three["losses"] and two["grad_norms"] == three["grad_norms"], name


# ---- switching between levels in a running job --------------------------------------------------------------------
def test_switching_to_and_from_zero3_equals_the_run_that_never_switched(gpt: GPTConfig, tmp_path: Path) -> None:
    """ZeRO-3 -> GPipe pipelines of different shapes and micro-batch counts (3 and 1) at ZeRO-3 -> DP4 ZeRO-1 -> DP2
    ZeRO-2 -> DP2 ZeRO-3 with 3 : 1 shares, in one job: each switch lands at the held step boundary; the losses and the final parameters and Adam
    moments equal the single-device run's."""
    from test_switching import LR as SLR, SEED as SSEED, SEQ as SSEQ, TOL, _close, _state_ok, switch_at_holds

    tour = [PLANS["dp2_zero3"], PLANS["hetero_3v1_gpipe_zero3"],
            {"pipelines": [_pipe([([r], [0, 3])], 2, 1) for r in range(4)], "zero": 1},
            {**PLANS["dp2_zero3"], "zero": 2}, PLANS["dp2_zero3_share3to1"]]
    cluster = Cluster.local(4)
    programs = [_program(gpt, s, cluster) for s in tour]
    steps = 2 * len(tour) + 1
    holds = [2 * k - 1 for k in range(1, len(tour))]
    job = launch(programs[0], cluster, steps=steps, seed=SSEED, seq_len=SSEQ, lr=SLR, capture_dir=tmp_path,
                 timeout_s=60, hold_at=holds)
    switch_at_holds(job, holds, programs[1:])
    result = job.wait(timeout=120)
    assert [e.strategy.zero for e in result.events] == [3, 1, 2, 3]
    ref = reference_training(gpt, steps=steps, seed=SSEED, global_batch=8, seq_len=SSEQ, lr=SLR)
    assert _close(result.losses, ref.losses) <= TOL, (result.losses, ref.losses)
    _state_ok(tmp_path, gpt, ref)


# ---- a user's model whose weight is read through views ---------------------------------------------------------------
def test_a_fused_weight_split_into_views_trains_like_the_reference_at_zero3(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """FusedMLPLM's ``w1`` is ``split`` into two halves, views of the gathered storage: ZeRO-3 keeps it until the
    halves' last reader (an alias) and refills it for their backward; two pipelines of different shapes (GPipe)."""
    from _equivalence import captured_close_to_reference

    sys.path.insert(0, str(TESTS))
    import user_model

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    model = user_model.FusedMLPLM()
    cluster = Cluster.local(3)
    strategy = Strategy.load({"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 2, 2), _pipe([([2], [0, 3])], 2, 2)],
                              "schedule": "gpipe", "zero": 3})
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
    result = launch(program, cluster, steps=3, seq_len=16, seed=2, capture_dir=tmp_path).wait()
    ref = reference_training(model, steps=3, seed=2, global_batch=8, seq_len=16)
    captured_close_to_reference(tmp_path, result.losses, model, ref, seed=2, steps=3, lr=1e-3)


def test_the_estimate_at_zero3_shards_the_parameters_and_bounds_what_is_gathered(gpt: GPTConfig,
                                                                                 measured: dict) -> None:
    """``device_memory`` at ZeRO-3: the parameter bytes are the rank's shard (ZeRO-2's divided by the replicas) plus
    what is gathered at once (``zero3_gathered``: units merged up to ``ZERO3_UNIT_BYTES``, the unit read and the
    next prefetched; the tiny model's sharded part is under 4 MiB: one unit, all of it); the gathered bytes
    measured at the peak with a unit per layer (fp32 here, bf16 in the estimate) stay under that, and under the
    per-layer bound (two of the largest unit)."""
    from hspmd_sdk.core.memory import BF16_BYTES, zero3_gathered
    from hspmd_sdk.core.plan import ZERO3_UNIT_BYTES

    assert zero3_gathered(10.0, 100.0) == 100.0  # one unit: all
    assert zero3_gathered(3.0, ZERO3_UNIT_BYTES * 4.0) == 2 * (3.0 + ZERO3_UNIT_BYTES)  # read + prefetched
    two, three = (Strategy.load(MEMORY[f"dp2_zero{z}"]).device_memory(gpt) for z in (2, 3))
    for rank in (0, 1):
        assert three[rank].grads == two[rank].grads and three[rank].optimizer == two[rank].optimizer
        sharded = two[rank].params  # every unit is sharded over DP2: its bf16 bytes whole
        assert three[rank].params == pytest.approx(two[rank].params / 2 + sharded)
        largest = max(gpt.layer_param_count(), gpt.embedding_param_count(), gpt.head_param_count()) * BF16_BYTES
        gathered_bf16 = measured[rank]["dp2_zero3"]["gathered_peak"] * BF16_BYTES / 4
        assert gathered_bf16 <= min(2 * largest, sharded), (gathered_bf16, largest, sharded)


def test_the_simulator_prices_a_gather_before_every_forward_and_backward_at_zero3(gpt: GPTConfig) -> None:
    """``simulate`` at ZeRO-3: no gather in ``PRE``; each F and B of a stage first pays the gather of its parameters
    (a ``comm`` event of the step's ZeRO-2 gather time, the prefetch's overlap not counted), so the step is longer
    by ``2 m - 1`` gathers with ``m`` micro-batches; a recomputing stage's B pays two."""
    from hspmd_sdk.planner.simulator import simulate

    cluster = Cluster.local(2)
    two, three = (simulate(gpt, Strategy.load(MEMORY[f"dp2_zero{z}"]), cluster, seq_len=SEQ) for z in (2, 3))
    pre = [e for e in two.timeline[0] if e.kind == "comm" and e.start == 0.0]
    assert len(pre) == 1
    gathers = [e for e in three.timeline[0] if e.kind == "comm"]
    computes = [e for e in three.timeline[0] if e.kind in ("F", "B")]
    assert len(gathers) == len(computes) == 4
    assert all(g.end == pytest.approx(c.start) for g, c in zip(gathers, computes))
    assert sum(g.duration for g in gathers) == pytest.approx(4 * pre[0].duration)
    assert three.step_time == pytest.approx(two.step_time + 3 * pre[0].duration, rel=1e-6)
    # recomputing: each B gathers twice (the forward rerun, then the operators' backward), as the runtime does
    again = simulate(gpt, Strategy.load(PLANS["dp2_zero3_recompute"]), cluster, seq_len=SEQ)
    gathers = [e.duration for e in again.timeline[0] if e.kind == "comm"]
    assert gathers == pytest.approx([g.duration * (2 if c.kind == "B" else 1) for g, c in zip(
        [e for e in three.timeline[0] if e.kind == "comm"], computes)])


def test_the_planners_plan_zero3_as_it_can_run() -> None:
    """An elastic replan of a ZeRO-3 job under 1F1B keeps the level; where the survivors' pipelines differ in
    micro-batch count (8 samples over 3 pipelines) or stages, it schedules them by GPipe instead of refusing (1F1B
    needs them equal at ZeRO-3).  Recomputation at ZeRO-3 (``recomputing``) takes pipelines of the same stages."""
    from hspmd_sdk.planner.elastic import replan_elastic
    from hspmd_sdk.planner.hetero_mixed import recomputing

    dp4 = Strategy.load({"pipelines": [_pipe([([r], [0, 3])], 2, 1) for r in range(4)], "zero": 3})
    got = replan_elastic("tiny", Cluster.local(4), dp4, [3], seq_len=16)
    assert (got.zero, got.schedule) == (3, "gpipe")
    assert sorted(p.num_micro_batches for p in got.pipelines) == [1, 1, 2]
    six = {"pipelines": [_pipe([([0], [0, 0]), ([1], [1, 2]), ([2], [3, 3])], 2, 2),
                         _pipe([([3], [0, 0]), ([4], [1, 2]), ([5], [3, 3])], 2, 2)], "zero": 3}
    got = replan_elastic("tiny", Cluster.local(6), Strategy.load(six), [2], seq_len=16)
    assert (got.zero, got.schedule) == (3, "gpipe")
    assert all(st.recompute for p in recomputing(Strategy.load(six)).pipelines for st in p.stages)  # alike: runs
    with pytest.raises(PlanValidationError, match="recomputation under ZeRO-3 .* the same stages"):
        recomputing(got)  # the survivors' pipelines split the layers differently


def test_the_editor_offers_zero3_where_zero2_runs_out_of_memory() -> None:
    """A ZeRO-2 strategy's out-of-memory stage is offered ZeRO-3 among its fixes (under GPipe where its 1F1B
    pipelines differ, as ZeRO-3 needs), and a ZeRO-3 strategy is not offered recomputation (not supported there);
    ``set_zero(3)`` takes the editor to level 3."""
    from hspmd_sdk.viz import PlanEditor
    from hspmd_sdk.viz._checks import _changes

    tiny = GPTConfig.preset("tiny")
    two = Strategy.load({**PLANS["dp2_zero3"], "zero": 2})
    offered = dict(_changes(two, 0, 0, tiny, None))
    assert [(w, s.zero, s.schedule) for w, s, _ in offered["zero3"]] == [("ZeRO-3", 3, "1f1b")]
    uneven = Strategy.load({"pipelines": PLANS["hetero_3v1_gpipe_zero3"]["pipelines"], "zero": 2})
    offered = dict(_changes(uneven, 0, 0, tiny, None))
    assert [(w, s.zero, s.schedule) for w, s, _ in offered["zero3"]] == [("ZeRO-3 under GPipe", 3, "gpipe")]
    assert "recompute" not in dict(_changes(Strategy.load(PLANS["dp2_zero3"]), 0, 0, tiny, None))
    ed = PlanEditor(Cluster.local(2), "tiny", {**PLANS["dp2_zero3"], "zero": 2}, seq_len=16, background=False)
    ed.set_zero(3)
    assert ed.is_valid and ed.strategy.zero == 3
