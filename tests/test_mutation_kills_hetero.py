"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of planner/hetero.py.

Figures are worked out by hand from the formulas the module's docstrings state, on tiny inputs (a handful of
groups, hand-made :class:`PipelinePlan` stage times), so that every test runs in well under a second.
"""
from __future__ import annotations

import math

import pytest

from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.planner.hetero import (Candidate, PipelinePlan, PlanContext, StageProfile, TPGroup, _stage_parts,
                                      _static_bytes, make_groups, solve_layers, solve_micro_batches, split_node,
                                      tp_degrees)

pytest.importorskip("pulp")
pytest.importorskip("pyomo")


def test_split_node_cuts_a_remainder_into_the_largest_allowed_sizes() -> None:
    """5 ranks at degree 8 (larger than the node): 4 + 1 from the allowed sizes no larger than the degree."""
    assert split_node([10, 11, 12, 13, 14], 8, [1, 2, 4, 8]) == [[10, 11, 12, 13], [14]]
    assert split_node([0, 1, 2], 2, [8, 2, 1]) == [[0, 1], [2]]


def _prof(**kw: float) -> StageProfile:
    base = dict(layer_time=1.0, emb_time=0.5, head_time=0.25, layer_static=10.0, layer_act=2.0, layer_transient=7.0,
                emb_static=100.0, emb_act=3.0, head_static=200.0, head_act=5.0, head_transient=9.0, capacity=1e6)
    base.update(kw)
    return StageProfile(**base)


def test_stage_parts_first_last_middle_by_hand() -> None:
    """(fixed seconds, fixed bytes, bytes per layer, transient) of a stage holding 4 micro-batches."""
    p = _prof()
    assert _stage_parts(p, True, True, 4) == (0.75, 100 + 12 + 200 + 20, 10 + 8, 9.0)
    assert _stage_parts(p, True, False, 4) == (0.5, 112.0, 18.0, 7.0)
    assert _stage_parts(p, False, True, 4) == (0.25, 220.0, 18.0, 9.0)
    assert _stage_parts(p, False, False, 4) == (0.0, 0.0, 18.0, 7.0)
    assert _stage_parts(_prof(head_transient=3.0), False, True, 1)[3] == 7.0  # the larger transient of the two


def test_static_bytes_is_bf16_params_and_grads_plus_fp32_states_over_zero_shards() -> None:
    """2 * 2 bytes of parameter and gradient, 3 * 4 bytes of optimizer states divided by the shards (at least 1)."""
    assert _static_bytes(10.0, 1) == 10 * (4 + 12)
    assert _static_bytes(10.0, 4) == 10 * (4 + 3)
    assert _static_bytes(10.0, 0) == 10 * (4 + 12)
    assert _static_bytes(10.0, 0.5) == 10 * (4 + 12)


def test_pipeline_plan_time_fill_drain_and_bottleneck() -> None:
    """sum of stage times + (m - 1) * bottleneck + p2p; no micro-batches: 0."""
    g = TPGroup((0,), "H20", 0)
    p = PipelinePlan((g, g, g), (1, 2, 1), (1.0, 3.0, 2.0), 0.5)
    assert p.bottleneck == 3.0
    assert p.time(1) == 6.5 and p.time(4) == 6.0 + 9.0 + 0.5
    assert p.time(0) == 0.0 and p.time(-1) == 0.0
    assert TPGroup((3, 4, 5), "H20", 0).tp == 3


def test_candidate_describe_names_every_field() -> None:
    c = Candidate({"H800": 4, "H20": 2}, 3, 2, 1.0, estimate=1.23456)
    assert c.describe() == "D=3 bs2 H800:TP4,H20:TP2 slow_first: est 1.235 s"


def test_micro_batch_ilp_refuses_fewer_micro_batches_than_pipelines() -> None:
    g = TPGroup((0,), "H20", 0)
    pipes = [PipelinePlan((g,), (1,), (1.0,), 0.0)] * 3
    assert solve_micro_batches(pipes, 2) is None
    counts, span = solve_micro_batches(pipes, 3)
    assert counts == [1, 1, 1] and span == 1.0


def test_micro_batch_ilp_spreads_a_class_within_one_and_adds_extra() -> None:
    """Three identical pipelines, 7 micro-batches: 3, 2, 2 (the class's extra ones go to its first members); with
    10 s of extra on the third, it keeps one micro-batch and the makespan is its time plus the 10 s."""
    g = TPGroup((0,), "H20", 0)
    pipes = [PipelinePlan((g, g), (1, 1), (1.0, 2.0), 0.5)] * 3
    counts, span = solve_micro_batches(pipes, 7)
    assert counts == [3, 2, 2] and span == pytest.approx(3.0 + 2 * 2.0 + 0.5)
    counts, span = solve_micro_batches(pipes, 7, extra=[0.0, 0.0, 10.0])
    assert counts == [3, 3, 1] and span == pytest.approx(3.0 + 0.5 + 10.0)


def test_micro_batch_ilp_balances_unlike_pipelines() -> None:
    """A pipeline twice as slow gets about half the micro-batches: 10 over (bottleneck 1) and (bottleneck 2)."""
    g = TPGroup((0,), "H20", 0)
    fast, slow = PipelinePlan((g,), (1,), (1.0,), 0.0), PipelinePlan((g,), (1,), (2.0,), 0.0)
    counts, span = solve_micro_batches([fast, slow], 9)
    assert counts == [6, 3] and span == 6.0


def test_tp_degrees_keep_one_and_stop_at_the_maximum() -> None:
    """Degree 1 always; powers of two up to and including max_degree; a degree the heads refuse is skipped."""
    m = LlamaConfig(vocab_size=64, hidden_size=24, num_layers=2, num_heads=6, ffn_hidden_size=48)
    assert tp_degrees(m, 8) == [1, 2]
    assert tp_degrees(m, 1) == [1]
    assert tp_degrees(m, 0) == []
    big = LlamaConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=8, ffn_hidden_size=128)
    assert tp_degrees(big, 4) == [1, 2, 4]


def test_make_groups_takes_only_the_given_ranks_node_by_node() -> None:
    """Groups per kind, in node order, each with its node index; a node with none of the ranks is skipped."""
    cl = Cluster.mixed({"H800": 8, "H20": 8})
    got = make_groups(cl, [9, 10, 11, 12, 13, 0, 1], {"H800": 2, "H20": 4}, [1, 2, 4])
    assert got == {"H800": [TPGroup((0, 1), "H800", 0)],
                   "H20": [TPGroup((9, 10, 11, 12), "H20", 1), TPGroup((13,), "H20", 1)]}
    assert make_groups(cl, [9], {"H20": 2}, [1, 2]) == {"H20": [TPGroup((9,), "H20", 1)]}


def _small() -> tuple[LlamaConfig, Cluster]:
    model = LlamaConfig(vocab_size=32000, hidden_size=4096, num_layers=4, num_heads=32, ffn_hidden_size=11008)
    return model, Cluster.mixed({"H800": 8, "H20": 8})


def test_zero_shards_in_flight_and_link_cache() -> None:
    """ZeRO-1 shards over the pipelines (1 without it); in-flight micro-batches as the schedule says; a link is
    asked of the cluster once."""
    from hspmd_sdk.core.schedule import in_flight

    model, cl = _small()
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128)
    assert ctx.zero_shards(3) == 3
    assert PlanContext(model, cl, global_batch=8, seq_len=128, zero1=False).zero_shards(3) == 1
    assert [ctx.in_flight(4, s, 8) for s in range(4)] == [in_flight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert ctx.link(0, 9) is ctx.link(0, 9) and ctx.link(0, 9) == cl.link(0, 9)
    assert ctx.schedule == "1f1b" and ctx.global_batch == 8 and ctx.seq_len == 128


def test_p2p_time_is_one_bf16_activation_over_the_slowest_link() -> None:
    """b * s * hidden * 2 bytes over the slowest pair's link (here the network between the two nodes)."""
    model, cl = _small()
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128)
    a, b = TPGroup((6, 7), "H800", 0), TPGroup((7, 8), "H20", 1)
    want = ctx.cost.p2p_time(2 * 128 * 4096 * 2, cl.link(6, 7) if cl.link(6, 7).bandwidth < cl.link(7, 8).bandwidth
                             else cl.link(7, 8))
    assert ctx.p2p_time(a, b, 2) == want
    assert cl.link(7, 8).bandwidth < cl.link(6, 7).bandwidth


def test_order_puts_slow_kinds_first_or_last_larger_groups_first() -> None:
    """slow_first: H20 stages before H800; fast_first: the reverse; within a kind larger TP first, then ranks."""
    model, cl = _small()
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128)
    from hspmd_sdk.planner.hetero import _order

    g = [TPGroup((0,), "H800", 0), TPGroup((10, 11), "H20", 1), TPGroup((8,), "H20", 1), TPGroup((9,), "H20", 1),
         TPGroup((2, 3), "H800", 0)]
    assert _order(ctx, g, "slow_first") == [g[1], g[2], g[3], g[4], g[0]]
    assert _order(ctx, g, "fast_first") == [g[4], g[0], g[1], g[2], g[3]]


def test_solve_layers_refuses_more_stages_than_layers() -> None:
    model, cl = _small()
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128)
    groups = [TPGroup((r,), "H800", 0) for r in range(5)]
    assert solve_layers(ctx, groups, 1, 4, 1) is None
    plan = solve_layers(ctx, groups[:4], 1, 4, 1)
    assert plan is not None and plan.layers == (1, 1, 1, 1) and plan.groups == tuple(groups[:4])
    assert plan.p2p == pytest.approx(2 * 3 * ctx.p2p_time(groups[0], groups[1], 1))


def test_classes_count_groups_by_kind_degree_and_link_class() -> None:
    """Two TP2 groups inside a node are one class (count 2); a TP2 group across two nodes is another (its ring
    runs over the network); a TP1 group a third.  The representative is the first group of its class."""
    from hspmd_sdk.planner.hetero import _classes

    cl = Cluster.mixed({"H20": 16})
    ctx = PlanContext(LlamaConfig.preset("llama-7b"), cl, global_batch=8, seq_len=128)
    a, b, c, d = (TPGroup((0, 1), "H20", 0), TPGroup((2, 3), "H20", 0), TPGroup((7, 8), "H20", 0),
                  TPGroup((9,), "H20", 1))
    assert _classes(ctx, {"H20": [a, b, c, d]}) == [(a, 2), (c, 1), (d, 1)]
    h800 = TPGroup((4, 5), "H800", 0)
    assert _classes(ctx, {"H20": [a], "H800": [h800]}) == [(a, 1), (h800, 1)]


class _QuickCtx(PlanContext):
    """A context whose group profiles are given by hand: plain (layer 2 s, 10 B of activations) or with
    recomputation (layer 3 s, 1 B); capacity 100 B a device."""

    def __init__(self, global_batch: int) -> None:
        model = LlamaConfig(vocab_size=64, hidden_size=64, num_layers=4, num_heads=8, ffn_hidden_size=128)
        super().__init__(model, Cluster.mixed({"H20": 8}), global_batch=global_batch, seq_len=16)
        self.asked: list[tuple] = []

    def profile(self, group, micro_batch, zero_shards, recompute=False):
        self.asked.append((group.ranks, micro_batch, zero_shards, recompute))
        return _prof(layer_time=3.0 if recompute else 2.0, layer_act=1.0 if recompute else 10.0, capacity=100.0)


@pytest.mark.parametrize("static,want", [(400.0, 10 * 4 / 1.5), (440.0, 10 * 4 / 1.5), (500.0, 10 * 4 / 1.0),
                                         (584.0, 10 * 4 / 1.0), (585.0, math.inf)])
def test_quick_bound_by_hand(monkeypatch, static: float, want: float) -> None:
    """3 TP2 groups, one pipeline, 8 micro-batches of 1: S = 3 stages, capacity 3 / 2 s layers a second, memory
    3 x 100 x 2 = 600 B against the model states plus L x act x tp x (S + 1) / 2 of activations (160 B plain,
    16 B recomputing): (8 + 3 - 1) x 4 / capacity where plain fits, else priced recomputing, else inf."""
    from hspmd_sdk.planner import hetero

    monkeypatch.setattr(hetero, "_model_static_total", lambda ctx, z: static)
    ctx = _QuickCtx(8)
    g = TPGroup((0, 1), "H20", 0)
    assert hetero._quick_bound(ctx, [(g, 3)], 1, 1) == pytest.approx(want)
    assert ctx.asked[0] == ((0, 1), 1, 1, False)


def test_quick_bound_shapes(monkeypatch) -> None:
    """More pipelines than groups or than micro-batches: inf; S = ceil(groups / D) stages (at most the layers);
    M = global batch // micro-batch size; ZeRO-1 shards over D; several classes add capacity and memory."""
    from hspmd_sdk.planner import hetero

    monkeypatch.setattr(hetero, "_model_static_total", lambda ctx, z: 10.0)
    g, h = TPGroup((0, 1), "H20", 0), TPGroup((2,), "H20", 0)
    assert hetero._quick_bound(_QuickCtx(8), [(g, 3)], 4, 1) == math.inf  # D > groups
    assert hetero._quick_bound(_QuickCtx(2), [(g, 3)], 3, 1) == math.inf  # D > M
    ctx = _QuickCtx(8)
    assert hetero._quick_bound(ctx, [(g, 3)], 2, 1) == pytest.approx((4 + 2 - 1) * 4 / 0.75)
    assert ctx.asked[0][2] == 2
    assert hetero._quick_bound(_QuickCtx(8), [(g, 3)], 3, 1) == pytest.approx((3 + 1 - 1) * 4 / 0.5)
    assert hetero._quick_bound(_QuickCtx(8), [(g, 4)], 1, 1) == pytest.approx((8 + 4 - 1) * 4 / 2.0)  # S == L
    assert hetero._quick_bound(_QuickCtx(8), [(g, 5)], 1, 1) == math.inf  # S > L
    assert hetero._quick_bound(_QuickCtx(9), [(g, 2)], 1, 2) == pytest.approx((4 + 2 - 1) * 4 / 1.0)  # M = 4
    assert hetero._quick_bound(_QuickCtx(8), [(g, 2), (h, 1)], 1, 1) == pytest.approx((8 + 3 - 1) * 4 / 1.5)
    # memory per pipeline: 3 x 100 x 2 / 3 = 200 B; 150 + 80 plain does not fit, 150 + 8 recomputing does
    monkeypatch.setattr(hetero, "_model_static_total", lambda ctx, z: 150.0)
    assert hetero._quick_bound(_QuickCtx(8), [(g, 3)], 3, 1) == pytest.approx((3 + 1 - 1) * 4 / (1 / 3))


def test_model_static_total_counts_every_parameter() -> None:
    from hspmd_sdk.planner.hetero import _model_static_total

    model, cl = _small()
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128)
    params = 4 * model.layer_param_count() + model.embedding_param_count() + model.head_param_count()
    assert _model_static_total(ctx, 2) == params * (2 * 2 + 3 * 4 / 2)


def _pipe(ranks: tuple[int, ...], layers: tuple[int, ...]) -> PipelinePlan:
    return PipelinePlan(tuple(TPGroup((r,), "H20", r // 8) for r in ranks), layers, (1.0,) * len(ranks), 0.0)


@pytest.mark.parametrize("zero1", [True, False])
def test_sync_estimate_is_the_slowest_stage_to_the_holders_of_its_first_layer(zero1: bool) -> None:
    """Pipeline 0's stages hold layers 0 and 1-3; pipeline 1's first layer 0 is on rank 2 (NVLink from rank 0),
    its layer 1 on rank 9 (the network from rank 1): the estimate is the 3-layer stage's reduce-scatter and
    all-gather (ZeRO-1) or all-reduce over two replicas on the network link."""
    from hspmd_sdk.core.comm_ops import OpKind
    from hspmd_sdk.planner.hetero import _sync_estimate

    model = LlamaConfig(vocab_size=32000, hidden_size=4096, num_layers=4, num_heads=32, ffn_hidden_size=11008)
    cl = Cluster.mixed({"H20": 16})
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128, zero1=zero1)
    pipes = [_pipe((0, 1), (1, 3)), _pipe((2, 9), (1, 3))]
    ops = (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER) if zero1 else (OpKind.ALL_REDUCE,)
    size = 3 * model.layer_param_count() * 2
    want = sum(ctx.cost.collective_time(op, size, 2, cl.link(1, 9)) for op in ops)
    assert _sync_estimate(ctx, 0, pipes) == pytest.approx(want, rel=1e-12)
    assert want > sum(ctx.cost.collective_time(op, size, 2, cl.link(1, 2)) for op in ops)
    assert _sync_estimate(ctx, 0, pipes[:1]) == 0.0
    # pipeline 0 holds layers 0-2 and 3; pipeline 1's layer 0 is on rank 2 (NVLink), its layer 3 on rank 9
    t = lambda n, link: sum(ctx.cost.collective_time(op, n * model.layer_param_count() * 2, 2, link)  # noqa: E731
                            for op in ops)
    other = [_pipe((0, 1), (3, 1)), _pipe((2, 9), (1, 3))]
    assert _sync_estimate(ctx, 0, other) == pytest.approx(max(t(3, cl.link(0, 2)), t(1, cl.link(1, 9))), rel=1e-12)
    assert t(3, cl.link(0, 9)) > max(t(3, cl.link(0, 2)), t(1, cl.link(1, 9)))


def test_sync_estimate_tp2_three_replicas_takes_the_slowest_peer() -> None:
    """Three pipelines of TP2 stages (layers 0 and 1-3): the 3-layer stage on ranks 2-3 syncs with ranks 6 (same
    node, NVLink) and 10 (the network): the slowest peer's link prices 3 layers' parameters over
    TP 2 (bf16), reduce-scatter and all-gather over 3 replicas."""
    from hspmd_sdk.core.comm_ops import OpKind
    from hspmd_sdk.planner.hetero import _sync_estimate

    model = LlamaConfig(vocab_size=32000, hidden_size=4096, num_layers=4, num_heads=32, ffn_hidden_size=11008)
    cl = Cluster.mixed({"H20": 24})
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128)
    def pipe(a: int, b: int) -> PipelinePlan:
        return PipelinePlan((TPGroup((a, a + 1), "H20", a // 8), TPGroup((b, b + 1), "H20", b // 8)), (1, 3),
                            (1.0, 1.0), 0.0)

    pipes = [pipe(0, 2), pipe(4, 6), pipe(8, 10)]
    t = lambda n, link: sum(ctx.cost.collective_time(op, n * model.layer_param_count() / 2 * 2, 3, link)  # noqa: E731
                            for op in (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER))
    assert _sync_estimate(ctx, 0, pipes) == pytest.approx(t(3, cl.link(2, 10)), rel=1e-12)
    assert t(3, cl.link(2, 6)) < t(3, cl.link(2, 10))


def test_sync_estimate_finds_the_holder_past_the_second_stage() -> None:
    """Pipeline 0's third stage starts at layer 2 (2 layers); pipeline 1 holds one layer a stage, layer 2 on rank 9
    (the network from rank 2), its last stage on rank 5: the estimate is 2 layers over the network."""
    from hspmd_sdk.core.comm_ops import OpKind
    from hspmd_sdk.planner.hetero import _sync_estimate

    model = LlamaConfig(vocab_size=32000, hidden_size=4096, num_layers=4, num_heads=32, ffn_hidden_size=11008)
    cl = Cluster.mixed({"H20": 16})
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128)
    pipes = [_pipe((0, 1, 2), (1, 1, 2)), _pipe((3, 4, 9, 5), (1, 1, 1, 1))]
    t = lambda n, link: sum(ctx.cost.collective_time(op, n * model.layer_param_count() * 2, 2, link)  # noqa: E731
                            for op in (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER))
    assert _sync_estimate(ctx, 0, pipes) == pytest.approx(t(2, cl.link(2, 9)), rel=1e-12)
    assert t(2, cl.link(2, 5)) < t(2, cl.link(2, 9))


@pytest.mark.parametrize("zero1", [True, False])
def test_sync_estimate_counts_each_collective_call(zero1: bool) -> None:
    """Where a collective call costs a fixed latency (a measured link override), ZeRO-1's reduce-scatter and
    all-gather are two calls, the all-reduce one."""
    from hspmd_sdk.planner.cost import CostModel, LinkOverride
    from hspmd_sdk.planner.hetero import _sync_estimate

    model = LlamaConfig(vocab_size=32000, hidden_size=4096, num_layers=4, num_heads=32, ffn_hidden_size=11008)
    cl = Cluster.mixed({"H20": 16})
    cost = CostModel(link_overrides={"inter": LinkOverride(latency=0.0, bandwidth=1e30, call_latency=1.0)})
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128, cost=cost, zero1=zero1)
    pipes = [_pipe((0,), (4,)), _pipe((9,), (4,))]
    assert cl.link(0, 9).cls == "inter"
    assert _sync_estimate(ctx, 0, pipes) == pytest.approx(2.0 if zero1 else 1.0)


def test_build_strategy_defaults_and_stages() -> None:
    """Stages hold consecutive layers [first, first + n - 1] with the pipeline's recomputation; each pipeline the
    candidate's micro-batch size and its count; defaults 1F1B and ZeRO-1."""
    from hspmd_sdk.planner.hetero import build_strategy

    g = lambda *r: TPGroup(r, "H20", 0)  # noqa: E731
    pipes = [PipelinePlan((g(0, 1), g(2, 3)), (1, 3), (1.0, 1.0), 0.0, True),
             PipelinePlan((g(4, 5),), (4,), (1.0,), 0.0)]
    c = Candidate({"H20": 2}, 2, 2, 1.0, pipes=pipes, counts=[3, 1])
    s = build_strategy(c)
    assert s.schedule == "1f1b" and s.zero1 is True and s.name == "hetero(tp2+tp2 | tp2)-zero1"  # a derived name
    assert [[(st.devices, list(st.layers), st.recompute) for st in p.stages] for p in s.pipelines] == [
        [([0, 1], [0, 0], True), ([2, 3], [1, 3], True)], [([4, 5], [0, 3], False)]]
    assert [(p.micro_batch_size, p.num_micro_batches) for p in s.pipelines] == [(2, 3), (2, 1)]
    o = build_strategy(c, schedule="gpipe", zero1=False, name="n")
    assert (o.schedule, o.zero1, o.name) == ("gpipe", False, "n")


def test_tp_degrees_refuse_two_where_the_heads_are_odd() -> None:
    """3 heads: no TP degree but 1 divides them."""
    m = LlamaConfig(vocab_size=64, hidden_size=24, num_layers=2, num_heads=3, ffn_hidden_size=48)
    assert m.tp_problems(2) and tp_degrees(m, 8) == [1]


# ---- the layer ILP on hand-made profiles (issue 49, second round) -------------------------------------------------
class _LayerCtx(PlanContext):
    """A context whose group profiles are given by hand (by the group's first rank), with a fixed boundary time
    of 0.25 s; the model has ``layers`` decoder layers."""

    def __init__(self, layers: int, profiles: dict[int, StageProfile]) -> None:
        model = LlamaConfig(vocab_size=64, hidden_size=64, num_layers=layers, num_heads=8, ffn_hidden_size=128)
        super().__init__(model, Cluster.mixed({"H20": 8}), global_batch=8, seq_len=16)
        self.profiles = profiles
        self.asked: list[tuple] = []

    def profile(self, group, micro_batch, zero_shards, recompute=False):
        self.asked.append((group.ranks, micro_batch, zero_shards, recompute))
        return self.profiles[group.ranks[0]]

    def p2p_time(self, a, b, micro_batch):
        return 0.25


def _flat(**kw: float) -> StageProfile:
    """No embedding or head time, no memory but what ``kw`` says; 1 GB of capacity."""
    base = dict(layer_time=1.0, emb_time=0.0, head_time=0.0, layer_static=0.0, layer_act=0.0, layer_transient=0.0,
                emb_static=0.0, emb_act=0.0, head_static=0.0, head_act=0.0, head_transient=0.0, capacity=1e9)
    base.update(kw)
    return StageProfile(**base)


_G0, _G1 = TPGroup((0,), "H20", 0), TPGroup((1,), "H20", 0)


def test_solve_layers_one_micro_batch_minimises_the_sum_of_stage_times() -> None:
    """m = 1 (also for 0 micro-batches): the objective is the sum of the stage times alone, so the faster stage
    takes all layers but one (3 + 1 at 1.0 s and 1.1 s a layer: 4.1 s; 2 + 2 would be 4.2 s).  With 8
    micro-batches the bottleneck counts 7 more times: 2 + 2 (tau 2.2 s) beats 3 + 1 (tau 3 s)."""
    ctx = _LayerCtx(4, {0: _flat(layer_time=1.0), 1: _flat(layer_time=1.1)})
    for m in (1, 0):
        plan = solve_layers(ctx, [_G0, _G1], 2, m, 1, recompute=True)
        assert plan == PipelinePlan((_G0, _G1), (3, 1), (3.0, 1.1), 0.5, True)
    assert ctx.asked == [((0,), 2, 1, True), ((1,), 2, 1, True)] * 2
    assert solve_layers(ctx, [_G0, _G1], 2, 8, 1).layers == (2, 2)
    slow_first = _LayerCtx(4, {0: _flat(layer_time=1.1), 1: _flat(layer_time=1.0)})
    assert solve_layers(slow_first, [_G0, _G1], 2, 1, 1).layers == (1, 3)  # the sum, not a layer bound, decides


def test_solve_layers_adds_the_embedding_time_to_the_first_stage() -> None:
    """Stage 0 also runs the embedding (2 s); 6 layers at 1 s each over 8 micro-batches: 2 + 4 layers (stage
    times 4 s and 4 s), not 4 + 2."""
    ctx = _LayerCtx(6, {0: _flat(emb_time=2.0), 1: _flat(emb_time=2.0)})
    plan = solve_layers(ctx, [_G0, _G1], 1, 8, 1)
    assert plan.layers == (2, 4) and plan.stage_times == (4.0, 4.0)


def test_solve_layers_memory_bound_subtracts_the_transient() -> None:
    """Stage 0 is ten times faster but holds 30 B: 5 B of transient leave 25 B, two layers of 10 B; so 2 + 2."""
    ctx = _LayerCtx(4, {0: _flat(layer_time=0.1, layer_static=10.0, layer_transient=5.0, capacity=30.0),
                        1: _flat()})
    assert solve_layers(ctx, [_G0, _G1], 1, 1, 1).layers == (2, 2)
    roomy = _LayerCtx(4, {0: _flat(layer_time=0.1, layer_static=10.0, layer_transient=5.0, capacity=35.0),
                          1: _flat()})
    assert solve_layers(roomy, [_G0, _G1], 1, 1, 1).layers == (3, 1)


def test_solve_layers_memory_bound_is_a_floor_division() -> None:
    """1 B of room at 0.1 B a layer: 1.0 // 0.1 is 9 layers (1.0 / 0.1 rounds to 10.0), below 1 B a layer too."""
    ctx = _LayerCtx(12, {0: _flat(layer_time=0.1, layer_static=0.1, capacity=1.0), 1: _flat()})
    assert solve_layers(ctx, [_G0, _G1], 1, 1, 1).layers == (9, 3)
    small = _LayerCtx(4, {0: _flat(layer_time=0.1, layer_static=0.5, capacity=1.0), 1: _flat()})
    assert solve_layers(small, [_G0, _G1], 1, 1, 1).layers == (2, 2)


def test_solve_layers_without_bytes_per_layer_has_no_memory_bound() -> None:
    """A stage with no bytes per layer is bounded by the layers only (no division by zero)."""
    ctx = _LayerCtx(4, {0: _flat(layer_time=0.1), 1: _flat()})
    assert solve_layers(ctx, [_G0, _G1], 1, 1, 1).layers == (3, 1)


def test_stage_parts_middle_stage_transient_is_the_layers_own() -> None:
    assert _stage_parts(_prof(layer_transient=0.25, head_transient=9.0), False, False, 1)[3] == 0.25
    assert _stage_parts(_prof(layer_transient=0.25, head_transient=0.5), True, True, 1)[3] == 0.5


def test_the_ilps_are_quiet(capfd) -> None:
    """CBC runs without printing (its log would flood a notebook)."""
    ctx = _LayerCtx(4, {0: _flat(), 1: _flat()})
    capfd.readouterr()
    assert solve_layers(ctx, [_G0, _G1], 1, 2, 1) is not None
    g = TPGroup((0,), "H20", 0)
    assert solve_micro_batches([PipelinePlan((g,), (1,), (1.0,), 0.0)] * 2, 4) is not None
    out, err = capfd.readouterr()
    assert out == "" and err == ""


# ---- the micro-batch ILP: boundary time, extras of a class, small times ------------------------------------------
def test_micro_batch_ilp_counts_the_boundary_time() -> None:
    """A pipeline with 5 s of boundary transfers beside one without (1 s a micro-batch each), 4 micro-batches:
    1 and 3 (6 s and 3 s), not 2 and 2 (7 s)."""
    g = TPGroup((0,), "H20", 0)
    slow, fast = PipelinePlan((g,), (1,), (1.0,), 5.0), PipelinePlan((g,), (1,), (1.0,), 0.0)
    counts, span = solve_micro_batches([slow, fast], 4)
    assert counts == [1, 3] and span == 6.0


def test_micro_batch_ilp_prices_a_class_extra_as_a_whole_bottleneck() -> None:
    """Three alike pipelines (1 s a micro-batch) and one at 0.6 s, 6 micro-batches: 1, 1, 1 and 3 (1.8 s);
    giving one of the three a second micro-batch costs it a whole second (2 s), not a third of one."""
    g = TPGroup((0,), "H20", 0)
    alike, quick = PipelinePlan((g,), (1,), (1.0,), 0.0), PipelinePlan((g,), (1,), (0.6,), 0.0)
    counts, span = solve_micro_batches([alike, alike, alike, quick], 6)
    assert counts == [1, 1, 1, 3] and span == pytest.approx(1.8)


def test_micro_batch_ilp_balances_times_below_a_second() -> None:
    """Stage times of 10 and 30 ms, 8 micro-batches: 6 and 2 (60 ms each); the makespan has no floor."""
    g = TPGroup((0,), "H20", 0)
    fast, slow = PipelinePlan((g,), (1,), (0.01,), 0.0), PipelinePlan((g,), (1,), (0.03,), 0.0)
    counts, span = solve_micro_batches([fast, slow], 8)
    assert counts == [6, 2] and span == pytest.approx(0.06)


# ---- a group's profile: the slowest link of its ring, the embedding and head times, the capacity --------------------
def test_profile_prices_a_group_over_the_slowest_link_of_its_ring() -> None:
    """A group across two nodes is priced over the network whichever of its ranks crosses; a two-rank group on one
    node over NVLink; a one-rank group over its own device's link."""
    model, cl = _small()
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128)
    net, nvl, own = cl.link(0, 8), cl.link(0, 1), cl.link(0, 0)
    assert net.cls != nvl.cls and nvl.cls != own.cls and net.bandwidth < nvl.bandwidth

    def want(g: TPGroup, link) -> StageProfile:
        return ctx._make_profile(g.kind, ctx._operator_costs(g, link, 1, False), 1)

    for ranks, link in (((0, 8), net), ((0, 1, 2, 8), net), ((0, 8, 1, 2), net), ((0, 1), nvl), ((3,), own)):
        g = TPGroup(ranks, "H800", 0)
        assert ctx.profile(g, 1, 1) == want(g, link), ranks


def test_make_profile_sums_forward_and_backward_and_takes_the_runtime_off() -> None:
    """With a profile of the kind (so that the embedding's backward costs something), each time of a stage
    profile is its operator's forward plus backward; the capacity is the device's memory less the runtime's."""
    from hspmd_sdk.planner.cost import (ComputeFit, CostModel, OperatorProfile, embedding_cost, head_cost,
                                        layer_cost)

    model, cl = _small()
    fit = ComputeFit(a=1e-12, b=1e-4)
    cost = CostModel(profiles={"H20": OperatorProfile(layer_fwd=fit, layer_bwd=fit, head_fwd=fit, head_bwd=fit,
                                                      embed=fit)})
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128, cost=cost)
    g = TPGroup((8, 9), "H20", 1)
    spec, link = cl.devices["H20"], cl.link(8, 9)
    lay = layer_cost(model, spec, 2, link, 2, 128, cost)
    emb, head = embedding_cost(model, spec, 2, link, 2, 128, cost), head_cost(model, spec, 2, link, 2, 128, cost)
    p = ctx.profile(g, 2, 3)
    assert emb.bwd > 0 and head.bwd > 0 and cost.runtime_bytes("H20") > 0
    assert p.layer_time == lay.fwd + lay.bwd and p.emb_time == emb.fwd + emb.bwd and p.head_time == head.fwd + head.bwd
    assert p.capacity == spec.memory_mb * 2.0**20 - cost.runtime_bytes("H20")
    assert p.layer_static == _static_bytes(lay.params, 3) and p.head_transient == head.transient_bytes


def test_the_ilps_pass_their_time_limit_to_cbc(monkeypatch) -> None:
    """Each ILP runs PuLP's CBC with the caller's time limit, 10 s unless given."""
    from hspmd_sdk.planner import hetero

    asked: list[float] = []
    real = hetero._cbc
    monkeypatch.setattr(hetero, "_cbc", lambda limit: asked.append(limit) or real(limit))
    ctx = _LayerCtx(4, {0: _flat(), 1: _flat()})
    g = TPGroup((0,), "H20", 0)
    pipes = [PipelinePlan((g,), (1,), (1.0,), 0.0)] * 2
    assert solve_layers(ctx, [_G0, _G1], 1, 2, 1) is not None
    assert solve_layers(ctx, [_G0, _G1], 1, 2, 1, time_limit=3.5) is not None
    assert solve_micro_batches(pipes, 4) is not None and solve_micro_batches(pipes, 4, time_limit=2.5) is not None
    assert asked == [10.0, 3.5, 10.0, 2.5]


def test_profile_cache_tells_a_host_link_from_nvlink() -> None:
    """Two nodes of H20 in one box (16 GB/s between them, 900 GB/s NVLink inside each): a TP2 group across the two
    nodes and one inside a node both have an ``intra`` link, but the one across is priced at 16 GB/s whichever
    was profiled first (the cache used to key by the link's class only and gave it the NVLink group's costs)."""
    cl = Cluster.load({"nodes": [{"host": "box", "kind": "H20", "ranks": [0, 1]},
                                 {"host": "box", "kind": "H20", "ranks": [2, 3]}], "host_bandwidth_gbs": 16})
    model = LlamaConfig(vocab_size=32000, hidden_size=4096, num_layers=4, num_heads=32, ffn_hidden_size=11008)
    inside, across = TPGroup((0, 1), "H20", 0), TPGroup((1, 2), "H20", 0)
    assert cl.link(0, 1).cls == cl.link(1, 2).cls == "intra" and cl.link(1, 2).bandwidth == 16e9
    alone = PlanContext(model, cl, global_batch=8, seq_len=128)
    want = alone._make_profile("H20", alone._operator_costs(across, cl.link(1, 2), 1, False), 1)
    assert alone.profile(across, 1, 1) == want
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128)
    first = ctx.profile(inside, 1, 1)
    assert ctx.profile(across, 1, 1) == want and want.layer_time > first.layer_time
    assert ctx.profile(inside, 1, 1) is first  # cached


def test_split_node_takes_the_degree_even_where_it_is_not_an_allowed_size() -> None:
    """A degree outside ``allowed`` (an elastic replan keeps a stage's TP3, say): whole groups of that degree, also
    when exactly one group's worth is left; only a smaller remainder is cut into allowed sizes."""
    assert split_node([0, 1, 2, 3, 4, 5], 4, [1, 2]) == [[0, 1, 2, 3], [4, 5]]
    assert split_node([0, 1, 2, 3], 4, [1, 2]) == [[0, 1, 2, 3]]
    assert split_node([0, 1, 2, 3, 4, 5, 6], 3, [1, 2, 4]) == [[0, 1, 2], [3, 4, 5], [6]]


def test_profile_prices_a_group_over_every_link_of_its_ring() -> None:
    """A TP4 group over three nodes, (4, 0, 1, 2): nodes 0 and 1 share a box whose link (10 GB/s) is slower than
    the network (25 GB/s) to node 2.  The ring 4-0-1-2-4 crosses the box link between ranks 1 and 2, so the group
    is priced over it -- not over the links of its first rank alone (4-0 and 4-2, both the network)."""
    cl = Cluster.load({"nodes": [{"host": "box", "kind": "H20", "ranks": [0, 1]},
                                 {"host": "box", "kind": "H20", "ranks": [2, 3]},
                                 {"host": "other", "kind": "H20", "ranks": [4, 5]}],
                       "host_bandwidth_gbs": 10, "inter_bandwidth_gbs": 25})
    model = LlamaConfig(vocab_size=32000, hidden_size=4096, num_layers=4, num_heads=32, ffn_hidden_size=11008)
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128)
    g = TPGroup((4, 0, 1, 2), "H20", 2)
    box = cl.link(1, 2)
    assert box.bandwidth == 10e9 and cl.link(4, 0).bandwidth == cl.link(4, 2).bandwidth == 25e9
    assert ctx.profile(g, 1, 1) == ctx._make_profile("H20", ctx._operator_costs(g, box, 1, False), 1)
    assert ctx._group_links[g.ranks] == box


def test_solve_layers_a_stage_that_holds_one_layer_takes_one() -> None:
    """15 B of room at 10 B a layer: the first stage fits exactly one layer (a plan, not a refusal); 9 B: none."""
    ctx = _LayerCtx(4, {0: _flat(layer_time=0.1, layer_static=10.0, capacity=15.0), 1: _flat()})
    assert solve_layers(ctx, [_G0, _G1], 1, 1, 1).layers == (1, 3)
    none = _LayerCtx(4, {0: _flat(layer_static=10.0, capacity=9.0), 1: _flat()})
    assert solve_layers(none, [_G0, _G1], 1, 1, 1) is None


# ---- ZeRO levels (SPEC §15): the states each level shards, the context's level and shares, build_strategy ---------
def _param_total(model: LlamaConfig) -> int:
    """Every parameter of the model, counted from its shapes (not from the per-part counts the planner uses)."""
    return sum(math.prod(s) for s in model.param_shapes().values())


def test_static_bytes_from_zero_two_shards_the_gradients_and_from_three_the_weights() -> None:
    """ZeRO-2: bf16 weights whole, bf16 gradients and 12 B of fp32 states over the shards; ZeRO-3 the weights
    too; ZeRO-1 shards the fp32 states only."""
    assert _static_bytes(10.0, 4, 2) == 10 * (2 + 2 / 4 + 12 / 4)
    assert _static_bytes(10.0, 4, 3) == 10 * (2 / 4 + 2 / 4 + 12 / 4)
    assert _static_bytes(10.0, 4, 1) == 10 * (2 + 2 + 12 / 4)
    assert _static_bytes(10.0, 4, 0) == 10 * (2 + 2 + 12 / 4)  # the shards are the caller's (1 without ZeRO)


@pytest.mark.parametrize("zero, unsharded, sharded", [(0, 16, 0), (1, 4, 12), (2, 2, 14), (3, 0, 16)])
def test_state_bytes_split_the_model_state_by_what_zero_shards(zero: int, unsharded: int, sharded: int) -> None:
    """16 B of model state a parameter (bf16 weight and gradient, fp32 master and two moments): ZeRO-1 shards the
    12 fp32 bytes, ZeRO-2 the gradient's 2 more, ZeRO-3 the weight's 2 more (all of it), no ZeRO nothing; over
    every parameter of the model."""
    model, cl = _small()
    ctx = PlanContext(model, cl, global_batch=8, seq_len=128, zero=zero)
    n = _param_total(model)
    assert ctx.state_bytes() == (n * unsharded, n * sharded)


def test_plan_context_zero_level_and_its_alias() -> None:
    """zero given wins over zero1 (its alias for levels 0 and 1); zero1 follows the level; ZeRO shares only when
    asked for, and only with ZeRO (level 1 or more); by default none.  Recomputation is the layer ILPs' fallback
    below ZeRO-3 only (ZeRO-3 does not recompute yet)."""
    model, cl = _small()

    def ctx(**kw: object) -> PlanContext:
        return PlanContext(model, cl, global_batch=8, seq_len=128, **kw)  # type: ignore[arg-type]

    assert (ctx().zero, ctx().zero1, bool(ctx().zero_shares)) == (1, True, False)
    assert (ctx(zero1=False).zero, ctx(zero1=False).zero1) == (0, False)
    assert (ctx(zero=2).zero, ctx(zero=2).zero1) == (2, True)
    assert (ctx(zero1=False, zero=2).zero, ctx(zero1=True, zero=0).zero, ctx(zero1=True, zero=0).zero1) == (2, 0, False)
    assert [bool(ctx(zero=z, zero_shares=True).zero_shares) for z in (0, 1, 2, 3)] == [False, True, True, True]
    assert [tuple(ctx(zero=z).recompute_options) for z in (0, 1, 2, 3)] == [(False, True)] * 3 + [(False,)]
    assert not ctx(zero=1).zero_shares and not ctx(zero=2, zero_shares=False).zero_shares


def test_profile_and_model_total_price_the_states_at_the_context_level() -> None:
    """At ZeRO-2 the static bytes of a layer, the embedding and the head (and of the whole model) shard the bf16
    gradients as well: over 4 shards (2 + 2/4 + 12/4) / (2 + 2 + 12/4) = 5.5 / 7 of ZeRO-1's; at ZeRO-3 the
    weights too: (2/4 + 2/4 + 12/4) / 7 = 4 / 7.  ZeRO-3 adds two gathered units (the largest of layer, embedding
    and head, bf16) to the layer's and the head's transient; below it nothing."""
    from hspmd_sdk.planner.cost import embedding_cost, head_cost, layer_cost
    from hspmd_sdk.planner.hetero import _model_static_total

    model, cl = _small()
    one, two, three = (PlanContext(model, cl, global_batch=8, seq_len=128, zero=z) for z in (1, 2, 3))
    g = TPGroup((8, 9), "H20", 1)
    p1, p2, p3 = one.profile(g, 2, 4), two.profile(g, 2, 4), three.profile(g, 2, 4)
    for part in ("layer_static", "emb_static", "head_static"):
        assert getattr(p1, part) > 0 and getattr(p2, part) == pytest.approx(getattr(p1, part) * 5.5 / 7, rel=1e-12)
        assert getattr(p3, part) == pytest.approx(getattr(p1, part) * 4 / 7, rel=1e-12)
    assert _model_static_total(two, 4) == pytest.approx(_param_total(model) * 5.5, rel=1e-12)
    assert _model_static_total(three, 4) == pytest.approx(_param_total(model) * 4, rel=1e-12)
    spec, link = cl.devices["H20"], cl.link(8, 9)
    largest = max(f(model, spec, 2, link, 2, 128, one.cost).params for f in (layer_cost, embedding_cost, head_cost))
    assert (p2.layer_transient, p2.head_transient) == (p1.layer_transient, p1.head_transient)
    assert p3.layer_transient == pytest.approx(p1.layer_transient + 2 * 2 * largest, rel=1e-12)
    assert p3.head_transient == pytest.approx(p1.head_transient + 2 * 2 * largest, rel=1e-12)
    assert p3.emb_act == p1.emb_act and p3.capacity == p1.capacity


def _zero3_candidate(recompute: bool | tuple[bool, ...], counts: list[int], layers: tuple[tuple[int, ...], ...]
                     ) -> Candidate:
    g = lambda *r: TPGroup(r, "H20", 0)  # noqa: E731
    flags = recompute if isinstance(recompute, tuple) else (recompute,) * len(layers)
    pipes = [PipelinePlan(tuple(g(2 * (2 * i + j)) for j in range(len(lay))), lay, (1.0,) * len(lay), 0.0, rc)
             for i, (lay, rc) in enumerate(zip(layers, flags))]
    return Candidate({"H20": 1}, len(pipes), 1, 1.0, pipes=pipes, counts=counts)


def test_build_strategy_at_a_zero_level() -> None:
    """zero given: the strategy's level (zero1 left to follow it); not given: zero1."""
    from hspmd_sdk.planner.hetero import build_strategy

    c = _zero3_candidate(False, [2, 2], ((2, 2), (2, 2)))
    assert (build_strategy(c, zero=2).zero, build_strategy(c, zero=2).zero1) == (2, True)
    assert build_strategy(c, zero=0, zero1=True).zero == 0
    assert build_strategy(c, zero1=False).zero == 0 and build_strategy(c).zero == 1


def _own_name(s: "Strategy") -> str:
    """The name a strategy like ``s`` gives itself when none is given."""
    from hspmd_sdk.core.strategy import Strategy

    return Strategy.load({k: v for k, v in s.model_dump().items() if k != "name"}).name


def test_build_strategy_plans_zero3_as_zero3_can_run() -> None:
    """At ZeRO-3: a candidate whose pipelines recompute unalike (one does, one does not; or alike over different
    stages) is planned at ZeRO-2; pipelines recomputing alike stay at ZeRO-3; pipelines unequal in micro-batches or
    stages under 1F1B are scheduled by GPipe; equal ones, or GPipe asked for, stay as they are; a name given says what
    changed, none stays none."""
    from hspmd_sdk.planner.hetero import build_strategy

    equal = _zero3_candidate(False, [2, 2], ((2, 2), (2, 2)))
    s = build_strategy(equal, zero=3, name="n")
    assert (s.zero, s.schedule, s.name) == (3, "1f1b", "n")
    alike = build_strategy(_zero3_candidate(True, [2, 2], ((2, 2), (2, 2))), zero=3, name="n")
    assert (alike.zero, alike.schedule, alike.name) == (3, "1f1b", "n")
    assert all(st.recompute for p in alike.pipelines for st in p.stages)
    for recomputes in (_zero3_candidate((True, False), [2, 2], ((2, 2), (2, 2))),
                       _zero3_candidate(True, [2, 2], ((1, 3), (2, 2)))):
        s = build_strategy(recomputes, zero=3, name="n")
        assert (s.zero, s.name) == (2, "n (ZeRO-2: ZeRO-3 recomputes only alike in every pipeline)")
        assert build_strategy(recomputes, zero=3).name == _own_name(s)
    for counts, layers in (([3, 1], ((2, 2), (2, 2))), ([2, 2], ((1, 3), (2, 2)))):
        unequal = _zero3_candidate(False, counts, layers)
        s = build_strategy(unequal, zero=3, name="n")
        assert (s.zero, s.schedule, s.name) == (3, "gpipe", "n (GPipe: under 1F1B, ZeRO-3 needs equal pipelines)")
        assert build_strategy(unequal, zero=3).name == _own_name(s)
        s = build_strategy(unequal, zero=3, schedule="gpipe", name="n")
        assert (s.zero, s.schedule, s.name) == (3, "gpipe", "n")


def test_zero3_gathers_the_largest_unit_whichever_it_is() -> None:
    """ZeRO-3's gathered weights at once are two of the largest unit of layer, embedding and head (bf16): for a
    Llama with a wide vocabulary and a narrow hidden size the head (the embedding's size plus the final norm), for
    a GPT-2 of a wide vocabulary (its head tied to the embedding: only the final norm of its own) the embedding
    with its positions."""
    from hspmd_sdk import GPTConfig
    from hspmd_sdk.planner.cost import embedding_cost, head_cost, layer_cost

    wide = LlamaConfig(vocab_size=32000, hidden_size=256, num_layers=2, num_heads=4, ffn_hidden_size=512)
    cl = Cluster.mixed({"H800": 8, "H20": 8})
    spec, link, g = cl.devices["H20"], cl.link(8, 9), TPGroup((8, 9), "H20", 1)
    gpt = GPTConfig.preset("tiny").model_copy(update={"vocab_size": 32000})
    for model, largest_is in ((wide, "head"), (gpt, "embedding")):
        one, three = (PlanContext(model, cl, global_batch=8, seq_len=128, zero=z) for z in (1, 3))
        params = {name: f(model, spec, 2, link, 2, 128, one.cost).params
                  for name, f in (("layer", layer_cost), ("embedding", embedding_cost), ("head", head_cost))}
        assert max(params, key=params.__getitem__) == largest_is
        p1, p3 = one.profile(g, 2, 4), three.profile(g, 2, 4)
        assert p3.layer_transient == pytest.approx(p1.layer_transient + 2 * 2 * max(params.values()), rel=1e-12)
        assert p3.head_transient == pytest.approx(p1.head_transient + 2 * 2 * max(params.values()), rel=1e-12)
