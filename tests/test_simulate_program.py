"""``simulate(program)``: the step of a specialized Program, its gradient synchronisation, ZeRO-1 gathers and
pipeline sends priced from the Program's own plans at the Program's dtype (issue 47 item 5).

Two kinds of proof: the Program form against hand-worked figures (ring volumes of the model's own parameter count
at 4 or 2 bytes a value, the messages a boundary between stages of different TP degrees carries), and the two
forms against each other -- ``simulate(program)`` equals ``simulate(model, strategy)`` at one dtype over DP, TP,
PP, CP, ZeRO-1, uneven ratios and the heterogeneous pipelines of ``hspmd_sdk/examples``, so the planners' fast
formula path (no specialization inside a search) prices what the Program runs.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hspmd_sdk import GPTConfig
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.specialize import specialize
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.models.registry import load_model_spec
from hspmd_sdk.planner import simulate
from hspmd_sdk.planner.cost import CostModel, LinkOverride

EXAMPLES = Path(__file__).resolve().parents[1] / "hspmd_sdk" / "examples"
TINY = load_model_spec("tiny")
GPT = GPTConfig.preset("tiny")
SEQ = 32


def _pipe(stages: list, mbs: int = 1, nmb: int = 2) -> dict:
    return {"micro_batch_size": mbs, "num_micro_batches": nmb,
            "stages": [{"devices": d, "layers": l, **kw} for d, l, kw in stages]}


def _program(model, strategy, cluster):  # type: ignore[no-untyped-def]
    s = Strategy.load(strategy, model=model, cluster=cluster)
    return s, specialize(model, plan_from_strategy(model, s, cluster), cluster)


MIXED = Cluster.mixed({"H800": 4, "H20": 4})
CASES = {
    "dp2": (TINY, {"pipelines": [_pipe([([0], [0, 3], {})]), _pipe([([1], [0, 3], {})])]}, Cluster.local(2)),
    "tp2 dp2 zero1": (TINY, {"zero1": True, "pipelines": [_pipe([([0, 1], [0, 3], {})]),
                                                          _pipe([([2, 3], [0, 3], {})])]}, Cluster.local(4)),
    "pp2 gpipe recompute": (TINY, {"schedule": "gpipe", "pipelines": [
        _pipe([([0], [0, 1], {"recompute": True}), ([1], [2, 3], {})], 1, 4)]}, Cluster.local(2)),
    "tp1 -> tp4": (TINY, {"pipelines": [_pipe([([0], [0, 1], {}), ([1, 2, 3, 4], [2, 3], {})], 1, 4)]},
                   Cluster.local(5)),
    "cp2 pp2": (TINY, {"pipelines": [_pipe([([0, 1], [0, 1], {"cp": 2}), ([2, 3], [2, 3], {"cp": 2})])]},
                Cluster.local(4)),
    "cp2 dp2 zero1": (TINY, {"zero1": True, "pipelines": [_pipe([([0, 1], [0, 3], {"cp": 2})]),
                                                          _pipe([([2, 3], [0, 3], {"cp": 2})])]}, Cluster.local(4)),
    "cp2 beside cp1": (TINY, {"pipelines": [_pipe([([0, 1], [0, 3], {"cp": 2})]), _pipe([([2], [0, 3], {})])]},
                       Cluster.local(3)),
    "uneven 3:1 dp2, mixed kinds": (TINY, {"pipelines": [
        _pipe([([0, 4], [0, 1], {"ratios": [3, 1]}), ([1], [2, 3], {})], 1, 4),
        _pipe([([2, 5], [0, 1], {"ratios": [3, 1]}), ([3], [2, 3], {})], 1, 4)]}, MIXED),
    "uneven 3:1 zero1": (TINY, {"zero1": True, "pipelines": [_pipe([([0, 1], [0, 3], {"ratios": [3, 1]})]),
                                                             _pipe([([2, 3], [0, 3], {"ratios": [3, 1]})])]},
                         Cluster.local(4)),
    "hetero tp4 -> tp2 beside 2 x tp1, two kinds": (TINY, {"pipelines": [
        _pipe([([0, 1, 2, 3], [0, 1], {}), ([4, 5], [2, 3], {})], 1, 4),
        _pipe([([6], [0, 1], {}), ([7], [2, 3], {})], 1, 2)]}, MIXED),
    "example_hetero_tiny": (TINY, EXAMPLES / "example_hetero_tiny.json", Cluster.load(EXAMPLES / "local_4.json")),
    "gpt dp2 pp2 tp2 (tied weights)": (GPT, {"pipelines": [_pipe([([0, 1], [0, 1], {}), ([2, 3], [2, 3], {})]),
                                                           _pipe([([4, 5], [0, 1], {}), ([6, 7], [2, 3], {})])]},
                                       Cluster.local(8)),
    "gpt hetero (tied weights)": (GPT, {"pipelines": [_pipe([([0, 1], [0, 1], {}), ([2], [2, 3], {})], 2, 3),
                                                      _pipe([([3], [0, 3], {})], 2, 1)]}, Cluster.local(4)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_program_and_its_strategy_give_the_same_step(case: str, dtype: str) -> None:
    """At one dtype, every event of every device, every transfer (its bytes too) and the memory are the same
    whether the step is read off the Program or derived from the strategy."""
    model, strategy, cluster = CASES[case]
    s, program = _program(model, strategy, cluster)
    got = simulate(program, seq_len=SEQ, dtype=dtype)
    want = simulate(model, s, cluster, seq_len=SEQ, dtype=dtype)
    assert got.timeline == want.timeline
    assert got.transfers == want.transfers
    assert (got.step_time, got.sync_time, got.memory) == (want.step_time, want.sync_time, want.memory)


#: Known gaps (issue 47): with GPT-2's tied embedding at a ZeRO level the Program gathers the sharded weight a second
#: time for the head on its home stage (``wte.weight.head`` in ``PRE``: the runtime really does) and all-reduces the
#: head's gradient of it apart on another stage, where the formula counts neither / merges it into the stage's
#: reduce-scatter.  Strict: the day the two agree (either side fixed) this fails and the case moves to CASES.
TIED_ZERO = {
    "gpt dp2 zero1 (tied, one stage)": {"zero1": True, "pipelines": [_pipe([([0], [0, 3], {})]),
                                                                     _pipe([([1], [0, 3], {})])]},
    "gpt pp2 dp2 zero1 (tied, two stages)": {"zero1": True, "pipelines": [
        _pipe([([0], [0, 1], {}), ([1], [2, 3], {})]), _pipe([([2], [0, 1], {}), ([3], [2, 3], {})])]},
}


@pytest.mark.xfail(strict=True, reason="the formula does not yet price a tied weight's second gather / separate "
                                       "gradient all-reduce at a ZeRO level as the Program has them")
@pytest.mark.parametrize("case", sorted(TIED_ZERO))
def test_a_tied_weight_at_a_zero_level_is_priced_alike(case: str) -> None:
    strategy = TIED_ZERO[case]
    cluster = Cluster.local(2 * len(strategy["pipelines"][0]["stages"]))
    s, program = _program(GPT, strategy, cluster)
    got, want = simulate(program, seq_len=SEQ), simulate(GPT, s, cluster, seq_len=SEQ)
    assert got.timeline == want.timeline and got.step_time == want.step_time


@pytest.mark.parametrize("name", ["table9_32b_16h800_32h20.json", "table11_c2.json"])
def test_the_papers_heterogeneous_strategies_agree_at_both_dtypes(name: str) -> None:
    """The paper's Table 9 layout (32B on 16 H800 + 32 H20, TP4, 3 stages a pipeline) and Table 11's C2 (31 H20,
    TP 1, 2 and 4, 4-5 stages): the same step from the Program and from the strategy, at fp32 and at bf16."""
    meta = json.loads((EXAMPLES / "index.json").read_text())["strategies"][name]
    model, cluster = load_model_spec(meta["model"]), Cluster.load(EXAMPLES / meta["cluster"])
    s, program = _program(model, EXAMPLES / name, cluster)
    for dtype in ("float32", "bfloat16"):
        got = simulate(program, seq_len=4096, dtype=dtype)
        want = simulate(model, s, cluster, seq_len=4096, dtype=dtype)
        assert (got.timeline, got.transfers) == (want.timeline, want.transfers)


# Measured-style overrides that make a collective's seconds its bytes on the wire / 2 B/s and a send's its bytes
# / 1 B/s (no latency, no efficiency factors): the figures below are bytes counted by hand.
WIRE = CostModel(link_overrides={"intra": LinkOverride(latency=0.0, bandwidth=1.0, collective_bandwidth=2.0)})


def _seconds(result, kind: str, device: int = 0) -> float:  # type: ignore[no-untyped-def]
    return sum(e.duration for e in result.timeline[device] if e.kind == kind)


def test_the_programs_gradient_sync_moves_its_parameters_at_its_dtype() -> None:
    """DP2 of the tiny Llama: one all-reduce of every parameter (the model's own count, summed from its shapes),
    2(n-1)/n = 1 x the buffer on the wire: 4 bytes a value for the Program's float32, 2 for bf16 on the wire."""
    model, strategy, cluster = CASES["dp2"]
    _, program = _program(model, strategy, cluster)
    values = sum(math.prod(shape) for shape in model.param_shapes().values())
    assert _seconds(simulate(program, seq_len=SEQ, cost=WIRE), "sync") == pytest.approx(values * 4 / 2.0)
    assert _seconds(simulate(program, seq_len=SEQ, cost=WIRE, dtype="bfloat16"), "sync") == \
        pytest.approx(values * 2 / 2.0)
    assert program.graph.tensors["embed.weight"].dtype == "float32"


def test_the_cost_models_own_count_is_bf16_times_its_wire_factor() -> None:
    """The strategy form without a dtype counts bf16 times ``comm_bytes_factor`` (the planners' convention): the
    Program's bf16 at 1, its own float32 at 2 -- the calibration's cost model (the runtime sends fp32; 4 ranks on
    2 cores, so processor sharing replays the step too)."""
    model, strategy, cluster = CASES["example_hetero_tiny"]
    s, program = _program(model, strategy, cluster)
    assert simulate(model, s, cluster, seq_len=SEQ).timeline == \
        simulate(program, seq_len=SEQ, dtype="bfloat16").timeline
    fp32_wire = CostModel(comm_bytes_factor=2.0, cores=2)
    assert simulate(model, s, cluster, seq_len=SEQ, cost=fp32_wire).timeline == \
        simulate(program, seq_len=SEQ, cost=fp32_wire).timeline


def test_a_stage_feeding_a_wider_tp_group_sends_each_receiver_a_copy() -> None:
    """TP1 -> TP2: the activation is duplicated on the TP2 stage, so rank 0 sends it twice (its BSR has two
    messages) and the forward transfer takes twice the bytes of one; back, each TP2 rank holds the gradient and
    one of them sends it.  One micro-batch: 2 rows x 32 tokens x hidden 64 values, 4 bytes each, at 1 B/s."""
    cluster = Cluster.local(3)
    s, program = _program(TINY, {"pipelines": [_pipe([([0], [0, 1], {}), ([1, 2], [2, 3], {})], 2, 1)]}, cluster)
    one = 2 * SEQ * TINY.hidden_size * 4
    r = simulate(program, seq_len=SEQ, cost=WIRE)
    [fwd] = [t for t in r.transfers if t.kind == "F"]
    [bwd] = [t for t in r.transfers if t.kind == "B"]
    assert (fwd.nbytes, fwd.end - fwd.start) == (2 * one, pytest.approx(2 * one / 1.0))
    assert (bwd.nbytes, bwd.end - bwd.start) == (one, pytest.approx(one / 1.0))
    assert r.transfers == simulate(TINY, s, cluster, seq_len=SEQ, cost=WIRE, dtype="float32").transfers


def test_seq_len_defaults_to_the_programs_representative_length() -> None:
    model, strategy, cluster = CASES["pp2 gpipe recompute"]
    _, program = _program(model, strategy, cluster)
    assert simulate(program).timeline == simulate(program, seq_len=program.bindings["S"]).timeline


def test_what_cannot_be_simulated_says_why() -> None:
    """The Program alone, or a model with its strategy, cluster and seq_len; a rank's part, a Program without a
    strategy behind it: errors that say what to pass instead."""
    model, strategy, cluster = CASES["dp2"]
    s, program = _program(model, strategy, cluster)
    with pytest.raises(TypeError, match="takes the Program alone"):
        simulate(program, s, cluster)
    with pytest.raises(TypeError, match="needs a strategy, a cluster and seq_len"):
        simulate(model, s, cluster)
    with pytest.raises(PlanValidationError, match="rank 1's part of a Program"):
        simulate(program.part(1))
    bare = plan_from_strategy(model, s, cluster)
    bare = bare.model_copy(update={"settings": bare.settings.model_copy(update={"strategy": None})})
    with pytest.raises(PlanValidationError, match="plan.settings.strategy"):
        simulate(specialize(model, bare, cluster))
