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
