"""ZeRO-2 (``Strategy.zero = 2``, SPEC §15): gradients sharded over each layer's data-parallel replicas as well as the
optimizer states, under DP, uneven DP shares, DP x TP and heterogeneous pipelines, against the single-device model.

One 4-rank job trains the tiny GPT-2 (tied embeddings) under each plan for 4 steps with clipping active, a warmup +
cosine schedule and weight decay (the recipe of ``test_training_recipe.py``); the losses (1e-5 relative), the global
norms before clipping (1e-6) and the final parameters and Adam moments (assembled from the shards) equal the
reference's.  The memory: with small bucket caps (several buckets), what the gradient synchronisation of a DP2 rank
holds, measured from its tensors (:meth:`GradBuckets.held_bytes`) at every event of the last backward, with ZeRO 0, 1
and 2: ZeRO-2's gradients Adam reads are the rank's shard, which is the estimate's gradient bytes (at fp32), its
peak is below ZeRO-1's, and nothing of the gradients is left between steps.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import Cluster, GPTConfig, launch  # noqa: E402
from hspmd_sdk.core.memory import BF16_BYTES  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.errors import PlanValidationError  # noqa: E402
from hspmd_sdk.runtime.control.train import start_runs, reference_training, training_run  # noqa: E402

from test_training_recipe import (RECIPE, _pipe, _program, _rel, _state_matches, gpt, reference,  # noqa: E402,F401
                                  train_plans)

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "hspmd_sdk" / "examples"
SEED, SEQ, LR = 1, 16, 1e-2  # the recipe test's: its fixtures and helpers are shared
_HETERO = {k: v for k, v in json.loads((EXAMPLES / "example_hetero_tiny.json").read_text()).items() if k != "zero1"}

PLANS = {
    "dp2_zero2": {"pipelines": [_pipe([([0], [0, 3])], 2, 2), _pipe([([1], [0, 3])], 2, 2)], "zero": 2},
    "dp3_zero2_uneven": {"pipelines": [_pipe([([0], [0, 3])], 4, 1), _pipe([([1], [0, 3])], 2, 1),
                                       _pipe([([2], [0, 3])], 2, 1)], "zero": 2},
    "dp2xtp2_zero2": {"pipelines": [_pipe([([0, 1], [0, 3])], 2, 2), _pipe([([2, 3], [0, 3])], 2, 2)], "zero": 2},
    "hetero_zero2": {**_HETERO, "zero": 2},
    # uneven shares (SPEC §15): pipeline 0's rank holds 3/4 of every sharded tensor, pipeline 1's 1/4
    "dp2_zero2_share3to1": {"pipelines": [{**_pipe([([0], [0, 3])], 2, 2), "zero_share": 3.0},
                                          _pipe([([1], [0, 3])], 2, 2)], "zero": 2},
}


@pytest.fixture(scope="module")
def trained(gpt: GPTConfig, tmp_path_factory: pytest.TempPathFactory) -> dict:
    got = train_plans(gpt, PLANS, tmp_path_factory.mktemp("zero2"))
    results = got["results"]
    return {**got, "by_rank": {n: {r: results[r]["runs"][i] for r in results} for i, n in enumerate(PLANS)}}


@pytest.mark.parametrize("name", list(PLANS))
def test_zero2_trains_equal_to_the_single_device_reference(name: str, trained: dict, reference: Any) -> None:
    run = trained["runs"][name]
    assert _rel(run["losses"], reference.losses) <= 1e-5
    assert _rel(run["grad_norms"], reference.grad_norms) <= 1e-6, (run["grad_norms"], reference.grad_norms)
    _state_matches(trained["out"], reference, list(PLANS).index(name))


def test_zero_levels_and_the_zero1_alias() -> None:
    base = PLANS["dp2_zero2"]
    pipes = {"pipelines": base["pipelines"]}
    assert Strategy.load({**pipes, "zero1": True}).zero == 1
    two = Strategy.load(base)
    assert (two.zero, two.zero1, two.name) == (2, True, "dp2-zero2")
    assert Strategy.load(json.loads(two.to_json())) == two
    assert "zero" not in json.loads(Strategy.load({**pipes, "zero1": True}).to_json())  # levels 0-1: JSON unchanged
    # a copy that changes the level is validated: the field given wins, the other follows
    assert [(c.zero, c.zero1) for c in (two.model_copy(update={"zero1": False}), two.model_copy(update={"zero1": True}),
                                        Strategy.load(pipes).model_copy(update={"zero": 2}))] == \
        [(0, False), (1, True), (2, True)]
    for bad, words in (({"zero": 2, "zero1": False}, "zero1: False contradicts zero: 2"),
                       ({"zero": True}, "not True"), ({"zero": 4}, "zero")):
        with pytest.raises(PlanValidationError, match=words):
            Strategy.load({**pipes, **bad})


def test_a_workers_part_carries_the_level(gpt: GPTConfig) -> None:
    """A worker launched with its part (SPEC §16) reads the level from it: it decides whether the buckets let go."""
    from hspmd_sdk.core.specialize import ProgramPart

    program = _program(gpt, PLANS["hetero_zero2"], Cluster.local(4))
    for rank in program.ranks:
        part = ProgramPart.from_json(program.part(rank).to_json())
        assert (part.plan.settings.zero, part.plan.settings.zero1) == (2, True)


def test_uneven_zero_shares_hold_the_state_in_proportion(gpt: GPTConfig, trained: dict) -> None:
    """``zero_share`` 3 : 1: rank 0 holds three times rank 1's fp32 masters and Adam moments (measured from the
    tensors each holds), each within 5% of the estimate's optimizer bytes (12 a parameter: master + m + v); the
    training equals the reference (above)."""
    est = Strategy.load(PLANS["dp2_zero2_share3to1"]).device_memory(gpt)
    held = {r: trained["by_rank"]["dp2_zero2_share3to1"][r] for r in (0, 1)}
    state = {r: held[r]["param_bytes"] + held[r]["optimizer_bytes"] for r in (0, 1)}  # fp32: 4 + 8 a parameter
    assert 2.8 <= state[0] / state[1] <= 3.2, state
    for r in (0, 1):
        assert abs(est[r].optimizer - state[r]) <= 0.05 * state[r], (r, est[r].optimizer, state[r])
    assert est[0].grads == pytest.approx(3 * est[1].grads)
    assert ", ZeRO share 3\n" in Strategy.load(PLANS["dp2_zero2_share3to1"]).summary()


def test_zero_share_errors_name_the_pipeline() -> None:
    pipes = PLANS["dp2_zero2_share3to1"]["pipelines"]
    for bad, words in (({"pipelines": pipes}, r"pipelines\[0\].zero_share: .*needs ZeRO"),
                       ({"pipelines": [{**pipes[0], "zero_share": 0}, pipes[1]], "zero": 1}, "greater than 0"),
                       ({"pipelines": [{**pipes[0], "zero_share": True}, pipes[1]], "zero": 1}, "expected a number"),
                       ({"pipelines": [{**pipes[0], "stages": [{"devices": [0, 2], "layers": [0, 3], "ratios": [3, 1]}]},
                                       pipes[1]], "zero": 1}, "uneven TP ratios")):
        with pytest.raises(PlanValidationError, match=words):
            Strategy.load(bad)
    assert "zero_share" not in json.loads(Strategy.load(PLANS["dp2_zero2"]).to_json())["pipelines"][0]


# ---- memory ------------------------------------------------------------------------------------------------------
#: one micro-batch a step: with several, every full gradient accumulates until the step's last backward (ZeRO-2
#: here reduces once a step, not once a micro-batch), so the peak would be the full gradient whatever the level
MEMORY = {f"dp2_zero{z}": {"pipelines": [_pipe([([0], [0, 3])], 4, 1), _pipe([([1], [0, 3])], 4, 1)], "zero": z}
          for z in (0, 1, 2)}


def measure(gpt: GPTConfig, plans: dict[str, dict], **options: Any) -> dict:
    """Train ``plans`` (name -> DP2 strategy) for 2 steps each in one 2-rank job whose workers measure what they hold
    (``zero_entry``; ``options``: more of its payload); every rank's report (shared with test_zero3.py)."""
    cluster = Cluster.local(2)
    runs = {n: training_run(_program(gpt, s, cluster), steps=2, seed=SEED, seq_len=SEQ, lr=LR, cluster=cluster)
            for n, s in plans.items()}
    payload = {"runs": runs, "bucket_bytes": 64 * 1024, "first_bucket_bytes": 16 * 1024, **options}
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), old])  # the workers import zero_entry from here
    try:
        result = launch(None, cluster, steps=1, entry="zero_entry:entry", payload=payload, timeout_s=180).wait()
    finally:
        os.environ["PYTHONPATH"] = old
    return result.results


@pytest.fixture(scope="module")
def measured(gpt: GPTConfig) -> dict:
    return measure(gpt, MEMORY)


def test_zero2_holds_the_gradient_shard_and_less_at_its_peak(gpt: GPTConfig, measured: dict) -> None:
    full = 4 * gpt.param_count()  # fp32 bytes of every gradient
    for rank in (0, 1):
        none, one, two = (measured[rank][f"dp2_zero{z}"] for z in (0, 1, 2))
        assert none["losses"] == one["losses"] == two["losses"]  # the same training (fp32, the same sums)
        # what Adam reads: the whole gradient without ZeRO, the rank's shard with ZeRO-1 and -2
        assert none["synced"] == full
        shard = 4 * sum(two["params"].values())
        assert one["synced"] == two["synced"] == shard and shard < 0.6 * full
        # ZeRO-1 and no ZeRO keep their bucket buffers (the whole gradient) for the next step; ZeRO-2 nothing
        assert none["after"] == one["after"] == full and two["after"] == 0
        # at the peak: ZeRO-1 holds every full gradient and the buckets; ZeRO-2 lets each bucket's go once filled
        # (measured: 2.15 and 0.70 of the full gradient; ZeRO-2's is its shard, the tied embedding's full gradient
        # held from the LM head's backward to the embedding's, and at most two buckets in flight)
        assert one["peak"] >= 2 * full and shard < two["peak"] <= 0.75 * full, (one["peak"], two["peak"], full)


def test_the_estimate_of_zero2_gradients_is_the_measured_shard(gpt: GPTConfig, measured: dict) -> None:
    """``device_memory``'s gradient bytes (bf16 in the estimate: 2 a parameter) with ZeRO-2 are the rank's shard:
    measured at fp32, twice them.  Within 5%: the estimate counts parameters by model unit, evenly split."""
    est = Strategy.load(MEMORY["dp2_zero2"]).device_memory(gpt)
    est0 = Strategy.load(MEMORY["dp2_zero0"]).device_memory(gpt)
    for rank in (0, 1):
        measured_grads = measured[rank]["dp2_zero2"]["synced"] * BF16_BYTES / 4
        assert abs(est[rank].grads - measured_grads) <= 0.05 * measured_grads, (est[rank].grads, measured_grads)
        assert est[rank].grads == pytest.approx(est0[rank].grads / 2)


# ---- switching between levels in a running job --------------------------------------------------------------------
def test_switching_between_zero_levels_equals_the_run_that_never_switched(gpt: GPTConfig, tmp_path: Path) -> None:
    """ZeRO-2 -> heterogeneous ZeRO-2 -> DP4 ZeRO-1 -> DP2 without ZeRO -> DP3 ZeRO-2 -> ZeRO-2 with 3 : 1 shares,
    in one job: each switch
    lands at the step boundary after it was heard (every rank held until then), the losses and the final parameters
    and Adam moments equal the single-device run's."""
    from test_switching import LR as SLR, SEED as SSEED, SEQ as SSEQ, TOL, _close, _state_ok, switch_at_holds

    tour = [PLANS["dp2_zero2"], PLANS["hetero_zero2"],
            {"pipelines": [_pipe([([r], [0, 3])], 2, 1) for r in range(4)], "zero": 1},
            {"pipelines": PLANS["dp2_zero2"]["pipelines"]}, PLANS["dp3_zero2_uneven"], PLANS["dp2_zero2_share3to1"]]
    cluster = Cluster.local(4)
    programs = [_program(gpt, s, cluster) for s in tour]
    steps = 2 * len(tour) + 1
    holds = [2 * k - 1 for k in range(1, len(tour))]
    job = launch(programs[0], cluster, steps=steps, seed=SSEED, seq_len=SSEQ, lr=SLR, capture_dir=tmp_path,
                 timeout_s=60, hold_at=holds)
    switch_at_holds(job, holds, programs[1:])
    result = job.wait(timeout=120)
    assert [e.strategy.zero for e in result.events] == [2, 1, 0, 2, 2]
    ref = reference_training(gpt, steps=steps, seed=SSEED, global_batch=8, seq_len=SSEQ, lr=SLR)
    assert _close(result.losses, ref.losses) <= TOL, (result.losses, ref.losses)
    _state_ok(tmp_path, gpt, ref)


# ---- the planner ---------------------------------------------------------------------------------------------------
def test_plan_hetero_shards_gradients_when_zero1_does_not_fit() -> None:
    """Llama-7B on 8 devices of 32 GiB as 8 replicas: with ZeRO-1 no plan fits (each rank holds the bf16 weights and
    gradients whole, 28 GB of them); ``plan_hetero`` plans again with ZeRO-2, says so in the name, and the plan it
    returns fits by the estimate while the same plan at ZeRO-1 does not.  Where ZeRO-1 fits it stays the choice."""
    from hspmd_sdk import Cluster as C, LlamaConfig
    from hspmd_sdk.planner.hetero import plan_hetero

    devices = {"G32": {"kind": "G32", "memory_mb": 32768, "bf16_tflops": 300, "intra_bandwidth_gbs": 300}}
    cluster = C.load({"devices": devices, "nodes": [{"host": "n0", "kind": "G32", "ranks": list(range(8))}]})
    model = LlamaConfig.preset("llama-7b")
    with pytest.raises(PlanValidationError, match="no strategy for llama-7b fits 8 devices"):
        plan_hetero(model, cluster, global_batch=16, seq_len=2048, zero=1, min_pipelines=8, mixed_groups=False)
    chosen = plan_hetero(model, cluster, global_batch=16, seq_len=2048, min_pipelines=8, mixed_groups=False)
    assert chosen.zero == 2 and chosen.name.endswith(" (ZeRO-2: with ZeRO-1, no strategy for llama-7b fits 8 devices "
                                                     "at global batch 16, seq_len 2048)"), chosen.name
    capacity = 32768 * 2**20
    two = chosen.device_memory(model, cluster, seq_len=2048)
    one = chosen.model_copy(update={"zero": 1}).device_memory(model, cluster, seq_len=2048)
    assert max(m.total for m in two.values()) <= capacity < max(m.total for m in one.values())
    roomy = C.mixed({"H800": 8})
    assert plan_hetero(model, roomy, global_batch=16, seq_len=2048, min_pipelines=8, mixed_groups=False).zero == 1


# ---- the plan editor -----------------------------------------------------------------------------------------------
def test_the_editor_keeps_the_level_and_the_shares() -> None:
    """A ZeRO-2 strategy with a ZeRO share loaded into the plan editor comes back out the same (level and shares
    are not lost on the way through the draft); ``set_zero`` / ``set_zero1`` change the level, and a strategy at
    ZeRO-1 whose stage runs out of memory is offered ZeRO-2 among its fixes."""
    from hspmd_sdk.viz import PlanEditor
    from hspmd_sdk.viz._checks import _changes

    shared = PLANS["dp2_zero2_share3to1"]
    ed = PlanEditor(Cluster.local(2), "tiny", shared, seq_len=16, background=False)
    assert ed.is_valid and ed.strategy == Strategy.load(shared).model_copy(update={"name": ed.strategy.name})
    assert ed.strategy.zero == 2 and ed.strategy.pipelines[0].zero_share == 3.0
    ed.set_zero1(False)  # a share without sharding: the editor names it, the draft keeps both
    assert not ed.is_valid and [p.path for p in ed.problems] == ["pipelines[0].zero_share"], ed.problems
    assert (ed.draft.zero, ed.draft.zero1, ed.draft.pipelines[0].zero_share) == (0, False, 3.0)
    ed.set_zero(2)
    assert ed.strategy.zero == 2
    ed.set_zero(1)
    one = ed.strategy
    assert one.zero == 1 and "zero" not in json.loads(ed.to_json())
    kinds = [kind for kind, _ in _changes(one, 0, 0, GPTConfig.preset("tiny"), None)]
    assert "zero2" in kinds and "zero1" not in kinds


def test_an_elastic_replan_keeps_the_level() -> None:
    """A ZeRO-2 job that loses a rank is replanned at ZeRO-2 (the controller's ``replan_elastic``)."""
    from hspmd_sdk.planner.elastic import replan_elastic

    dp4 = {"pipelines": [_pipe([([r], [0, 3])], 2, 1) for r in range(4)], "zero": 2}
    assert replan_elastic("tiny", Cluster.local(4), Strategy.load(dp4), [3], seq_len=16).zero == 2


# ---- ZeRO-2 changes what a rank keeps, not a number ----------------------------------------------------------------
#: plan classes run at ZeRO-1 and ZeRO-2 side by side: context parallelism beside a CP1 pipeline, and bf16
PAIRS = {
    "cp2_beside_cp1": ({"pipelines": [_pipe([([0, 1], [0, 1], {"cp": 2}), ([2], [2, 3])], 2, 2),
                                      _pipe([([3], [0, 3])], 2, 2)]}, "fp32"),
    "hetero_bf16": ({k: v for k, v in _HETERO.items() if k != "name"}, "bf16"),
}


def test_zero2_runs_bit_for_bit_like_zero1(gpt: GPTConfig) -> None:
    """The same collectives on the same buffers in the same order: a ZeRO-2 run's losses and gradient norms are
    ZeRO-1's exactly, under CP beside a CP1 pipeline and under bf16 (where each gradient's fp32 sum is the one let
    go)."""
    cluster = Cluster.local(4)
    runs = [training_run(_program(gpt, {**s, "zero": z}, cluster), steps=3, seed=SEED, seq_len=SEQ, lr=LR,
                         cluster=cluster, precision=precision, **RECIPE)
            for s, precision in PAIRS.values() for z in (1, 2)]
    got = start_runs(runs, cluster, timeout_s=120).wait().results[0]["runs"]
    for k, name in enumerate(PAIRS):
        one, two = got[2 * k], got[2 * k + 1]
        assert one["losses"] == two["losses"] and one["grad_norms"] == two["grad_norms"], name
