"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of planner/elastic.py.

Clusters, strategies and cost models small enough that every expected value is written out by hand: the ranks a
survivor cluster keeps and their new numbers, the device kinds and scaled figures of a slowed cluster, the ratios
an uneven stage passes on.
"""
from __future__ import annotations


import pytest

from hspmd_sdk.core.cluster import Cluster, DeviceSpec
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.planner.cost import ComputeFit, CostModel, OperatorProfile
from hspmd_sdk.planner.elastic import renumber, slowed_cluster, survivor_cluster

pytest.importorskip("pulp")
pytest.importorskip("pyomo")


def _cluster() -> Cluster:
    return Cluster.load({"nodes": [{"host": "a", "kind": "H20", "ranks": [0, 1]},
                                   {"host": "b", "kind": "H20", "ranks": [2, 3]},
                                   {"host": "c", "kind": "H20", "ranks": [4]}]})


# ---- survivor_cluster and renumber ------------------------------------------------------------------------------
def test_survivor_cluster_renumbers_in_order_and_drops_empty_nodes() -> None:
    """Ranks 1, 2 and 3 lost: node b is gone, node a keeps 0, node c's 4 becomes 1; host and kind kept."""
    c, mapping = survivor_cluster(_cluster(), [1, 2, 3])
    assert mapping == {0: 0, 4: 1}
    assert [(n.host, n.kind, n.ranks) for n in c.nodes] == [("a", "H20", [0]), ("c", "H20", [1])]
    assert c.inter_bandwidth_gbs == _cluster().inter_bandwidth_gbs


def test_survivor_cluster_without_failures_is_the_same_cluster() -> None:
    """Nothing lost: every rank keeps its number."""
    c, mapping = survivor_cluster(_cluster(), [])
    assert mapping == {r: r for r in range(5)}
    assert [n.ranks for n in c.nodes] == [[0, 1], [2, 3], [4]]


def test_renumber_replaces_every_rank() -> None:
    """Each stage's devices mapped, in order."""
    s = Strategy.load({"pipelines": [{"stages": [{"devices": [4, 2], "layers": [0, 1]},
                                                 {"devices": [0], "layers": [2, 3]}],
                                      "micro_batch_size": 1, "num_micro_batches": 2}]})
    got = renumber(s, {4: 0, 2: 1, 0: 2})
    assert [st.devices for st in got.pipelines[0].stages] == [[0, 1], [2]]


# ---- slowed_cluster ---------------------------------------------------------------------------------------------
def _profile() -> OperatorProfile:
    def fit(a: float, b: float) -> ComputeFit:
        return ComputeFit(a=a, b=b)

    return OperatorProfile(layer_fwd=fit(1.0, 2.0), layer_bwd=fit(3.0, 4.0), head_fwd=fit(5.0, 6.0),
                           head_bwd=fit(7.0, 8.0), embed=fit(9.0, 10.0), optimizer_s_per_param=0.5)


def test_slowed_cluster_moves_each_slow_rank_to_a_node_of_a_scaled_kind() -> None:
    """Rank 1 at 2x and rank 4 at 1.5x: each on its own node on the same host, of kind ``H20/2`` and ``H20/1.5``
    whose peak FLOPS are divided by the factor (memory and intra bandwidth kept); the other ranks keep their
    nodes (node c, emptied, is gone); the moved nodes come after the others, in the order met."""
    base = _cluster()
    c, cost = slowed_cluster(base, {4: 1.5, 1: 2.0})
    assert [(n.host, n.kind, n.ranks) for n in c.nodes] == [
        ("a", "H20", [0]), ("b", "H20", [2, 3]), ("a", "H20/2", [1]), ("c", "H20/1.5", [4])]
    h20 = base.devices["H20"]
    for kind, k in (("H20/2", 2.0), ("H20/1.5", 1.5)):
        d = c.devices[kind]
        assert d == DeviceSpec(kind=kind, memory_mb=h20.memory_mb, bf16_tflops=h20.bf16_tflops / k,
                               intra_bandwidth_gbs=h20.intra_bandwidth_gbs)
    assert c.devices["H20"] == h20
    assert cost == CostModel()  # nothing profiled: nothing to scale


def test_slowed_cluster_names_the_kind_with_three_significant_digits() -> None:
    """A factor of 1.23456 makes kind ``H20/1.23``."""
    c, _ = slowed_cluster(_cluster(), {0: 1.23456})
    assert c.kind(0) == "H20/1.23"


def test_slowed_cluster_scales_the_profiled_costs_of_the_kind() -> None:
    """Every compute line of the profile (both coefficients), the compute fit and Adam's seconds per parameter
    are k times longer under the new kind; the MFU is copied; the original kind's figures are unchanged; another
    kind's are not copied."""
    prof = _profile()
    cost = CostModel(profiles={"H20": prof, "A100": prof}, compute_fits={"H20": ComputeFit(a=1.0, b=2.0)},
                     mfu={"H20": 0.3, "A100": 0.9})
    _, got = slowed_cluster(_cluster(), {3: 2.0}, cost)
    new = got.profiles["H20/2"]
    for name, (a, b) in {"layer_fwd": (1, 2), "layer_bwd": (3, 4), "head_fwd": (5, 6), "head_bwd": (7, 8),
                         "embed": (9, 10)}.items():
        line = getattr(new, name)
        assert (line.a, line.b) == (2.0 * a, 2.0 * b), name
    assert new.optimizer_s_per_param == 1.0
    assert (got.compute_fits["H20/2"].a, got.compute_fits["H20/2"].b) == (2.0, 4.0)
    assert got.mfu["H20/2"] == 0.3
    assert got.profiles["H20"] == prof and got.compute_fits["H20"].a == 1.0
    assert set(got.profiles) == {"H20", "A100", "H20/2"} and set(got.mfu) == {"H20", "A100", "H20/2"}
    assert cost.profiles.keys() == {"H20", "A100"}  # the caller's model is not changed


def test_slowed_cluster_without_profiles_or_mfu_adds_none() -> None:
    """A kind with only a compute fit: the fit is scaled, no profile or MFU appears."""
    cost = CostModel(compute_fits={"H20": ComputeFit(a=1.0, b=2.0)})
    _, got = slowed_cluster(_cluster(), {0: 3.0}, cost)
    assert (got.compute_fits["H20/3"].a, got.compute_fits["H20/3"].b) == (3.0, 6.0)
    assert "H20/3" not in got.profiles and "H20/3" not in got.mfu


# ---- replan_elastic and replan_straggler: names, errors --------------------------------------------------------
C1 = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 8, "stages": [
    {"devices": [0, 1], "layers": [0, 15]}, {"devices": [2, 3], "layers": [16, 31]}]}]}


def test_replan_elastic_names_the_plan_after_the_loss() -> None:
    """The default name says the model, the survivors and the ranks lost (sorted); a given name is kept."""
    from hspmd_sdk.planner.elastic import replan_elastic

    c = Cluster.homogeneous("H20", 4)
    got = replan_elastic("llama-7b", c, C1, [3], seq_len=2048, simulate_top=1, refine=False)
    assert got.name == "replan_elastic: llama-7b on 3 devices (lost [3])"
    assert got.ranks == [0, 1, 2]
    mine = replan_elastic("llama-7b", c, C1, (3,), seq_len=2048, simulate_top=1, refine=False, name="mine")
    assert mine.name == "mine"


def test_replan_elastic_without_a_candidate_says_so() -> None:
    """More pipelines asked for than three survivors of a one-pipeline plan can hold: the error names the model
    and the number of survivors, under ``invalid elastic plan``."""
    from hspmd_sdk.errors import PlanValidationError
    from hspmd_sdk.planner.elastic import replan_elastic

    with pytest.raises(PlanValidationError) as e:
        replan_elastic("llama-7b", Cluster.homogeneous("H20", 4), C1, [3], seq_len=2048, min_pipelines=5)
    assert str(e.value) == "invalid elastic plan: failed: no strategy for llama-7b fits the 3 surviving devices"


def test_replan_straggler_names_each_slow_rank_with_its_factor() -> None:
    """``replan_straggler: <model>, ranks <r> x<factor>, ...`` in the order given, factors to two decimals; no rank
    is dropped."""
    from hspmd_sdk.planner.elastic import replan_straggler

    got = replan_straggler("llama-7b", Cluster.homogeneous("H20", 4), C1, {2: 2.0, 0: 1.5}, seq_len=2048)
    assert got.name == "replan_straggler: llama-7b, ranks 2 x2.00, 0 x1.50"
    assert got.ranks == [0, 1, 2, 3]



def test_replan_straggler_gives_a_slow_replica_fewer_micro_batches() -> None:
    """Two TP2 replicas of 8 micro-batches each, the second running 3x slower: the 16 micro-batches are split so
    that both finish together, 12 : 4 (12 x 1 = 4 x 3); the templates (devices, layers) are kept."""
    from hspmd_sdk.planner.elastic import replan_straggler

    one = {"micro_batch_size": 1, "num_micro_batches": 8}
    dp2 = {"pipelines": [{**one, "stages": [{"devices": [0, 1], "layers": [0, 31]}]},
                         {**one, "stages": [{"devices": [2, 3], "layers": [0, 31]}]}]}
    got = replan_straggler("llama-7b", Cluster.homogeneous("H20", 4), dp2, {2: 3.0, 3: 3.0}, seq_len=2048)
    assert [(p.micro_batch_size, p.num_micro_batches) for p in got.pipelines] == [(1, 12), (1, 4)]
    assert [[s.devices for s in p.stages] for p in got.pipelines] == [[[0, 1]], [[2, 3]]]


def test_replan_straggler_checks_the_strategy_against_the_cluster() -> None:
    """A running strategy on a rank the cluster lacks (rank 9 of 4) is refused up front, naming the rank."""
    from hspmd_sdk.errors import PlanValidationError
    from hspmd_sdk.planner.elastic import replan_straggler

    bad = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 8, "stages": [
        {"devices": [0, 1], "layers": [0, 15]}, {"devices": [2, 9], "layers": [16, 31]}]}]}
    with pytest.raises(PlanValidationError, match="9"):
        replan_straggler("llama-7b", Cluster.homogeneous("H20", 4), bad, {2: 2.0}, seq_len=2048)


# ---- the pieces of the replanner: templates kept, regrouping, ratios inherited ------------------------------------
from types import SimpleNamespace  # noqa: E402

from hspmd_sdk import LlamaConfig  # noqa: E402
from hspmd_sdk.planner import elastic  # noqa: E402
from hspmd_sdk.planner.hetero import PipelinePlan, PlanContext, TPGroup, sync_estimates  # noqa: E402

TINY = LlamaConfig.preset("tiny")
TWO_NODES = Cluster.load({"nodes": [{"host": "a", "kind": "H20", "ranks": [0, 1, 2, 3]},
                                    {"host": "b", "kind": "H20", "ranks": [4, 5, 6, 7]}]})
_ONE = {"micro_batch_size": 1, "num_micro_batches": 4}
#: two pipelines of two TP2 stages each, the first with uneven layers (1 + 3), ZeRO-1
DP2_PP2 = {"pipelines": [{**_ONE, "stages": [{"devices": [0, 1], "layers": [0, 0]},
                                             {"devices": [2, 3], "layers": [1, 3]}]},
                         {**_ONE, "stages": [{"devices": [4, 5], "layers": [0, 1]},
                                             {"devices": [6, 7], "layers": [2, 3]}]}],
           "zero1": True}


def _ctx(global_batch: int = 8) -> PlanContext:
    return PlanContext(TINY, TWO_NODES, global_batch=global_batch, seq_len=64, zero1=True)


def test_group_names_the_kind_and_node_of_its_first_rank() -> None:
    assert elastic._group(_ctx(), [6, 7]) == TPGroup((6, 7), "H20", 1)
    assert elastic._group(_ctx(), (1,)) == TPGroup((1,), "H20", 0)


def test_kept_plan_times_each_stage_from_its_profile_with_the_ends_on_the_first_and_last() -> None:
    """Stage s of S: layers x the layer time, plus the embedding's seconds on the first stage and the head's on the
    last (the profile at the micro-batch, ZeRO shards and recomputation given); the boundary transfers twice (each
    way) summed over the neighbouring pairs; the recomputation flag kept."""
    calls: list = []

    def profile(g, b, z, recompute=False):  # type: ignore[no-untyped-def]
        calls.append((g.ranks, b, z, recompute))
        r = g.ranks[0]
        return SimpleNamespace(layer_time=1.0 + r, emb_time=0.5, head_time=0.25, emb_static=64.0, emb_act=8.0,
                               head_static=32.0, head_act=4.0, layer_static=16.0, layer_act=2.0,
                               layer_transient=1.0, head_transient=0.125)

    def p2p_time(a, c, b):  # type: ignore[no-untyped-def]
        return {(0, 2): 0.125, (2, 4): 0.0625}[(a.ranks[0], c.ranks[0])] * b

    ctx = SimpleNamespace(profile=profile, p2p_time=p2p_time)
    groups = [TPGroup((0, 1), "H20", 0), TPGroup((2, 3), "H20", 0), TPGroup((4,), "H20", 1)]
    got = elastic._kept_plan(ctx, groups, [1, 2, 3], 2, 3, True)
    assert calls == [((0, 1), 2, 3, True), ((2, 3), 2, 3, True), ((4,), 2, 3, True)]
    assert got == PipelinePlan(tuple(groups), (1, 2, 3), (1 * 1.0 + 0.5, 2 * 3.0, 3 * 5.0 + 0.25),
                               2 * (0.25 + 0.125), True)
    one = elastic._kept_plan(ctx, groups[:1], [4], 1, 1, False)
    assert one == PipelinePlan(tuple(groups[:1]), (4,), (4 * 1.0 + 0.5 + 0.25,), 0, False)


def test_keep_templates_keeps_untouched_pipelines_and_drops_those_that_lost_every_rank() -> None:
    """No rank lost: both pipelines as they are (the first's 1 + 3 layers too); a whole pipeline lost: one pipeline
    of all the micro-batches.  The candidate: TP degree per kind from the running stages, its groups as the
    compositions, order ``kept``, the micro-batch ILP's counts and makespan as bound and estimate."""
    ctx = _ctx()
    s = Strategy.load(DP2_PP2, model=TINY, cluster=TWO_NODES)
    allowed = [1, 2, 4]
    c = elastic._keep_templates(ctx, s, set(), 1, allowed)
    assert [[g.ranks for g in p.groups] for p in c.pipes] == [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    assert [p.layers for p in c.pipes] == [(1, 3), (2, 2)]
    assert [g.node for p in c.pipes for g in p.groups] == [0, 0, 1, 1]
    assert (c.degree, c.num_pipelines, c.micro_batch, c.order) == ({"H20": 2}, 2, 1, "kept")
    assert c.compositions == [list(p.groups) for p in c.pipes] and sum(c.counts) == 8
    assert c.bound == c.estimate and c.estimate > 0
    one = elastic._keep_templates(ctx, s, {4, 5, 6, 7}, 1, allowed)
    assert [[g.ranks for g in p.groups] for p in one.pipes] == [[(0, 1), (2, 3)]] and one.counts == [8]
    assert one.num_pipelines == 1 and [p.layers for p in one.pipes] == [(1, 3)]
    assert elastic._keep_templates(ctx, s, set(range(8)), 1, allowed) is None


def test_keep_templates_resolves_an_affected_pipeline_with_recompute_when_it_does_not_fit_without(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An affected pipeline's layer ILP gets the pipeline's share of the micro-batches (at least one; an integer),
    the ZeRO shards of the kept pipelines and no recomputation; only when that fits nowhere, recomputation.  The
    micro-batch ILP gets every pipeline's gradient-sync estimate."""
    real_layers, real_mb = elastic.solve_layers, elastic.solve_micro_batches
    calls: list = []
    refuse = [True]

    def layers(ctx, groups, b, m, z, *, recompute=False):  # type: ignore[no-untyped-def]
        calls.append((ctx is seen_ctx, [g.ranks for g in groups], b, m, type(m), z, recompute))
        if refuse[0] and not recompute:
            return None
        return real_layers(ctx, groups, b, m, z, recompute=recompute)

    extras: list = []

    def micro(pipes, total, *, extra=None):  # type: ignore[no-untyped-def]
        extras.append((total, type(total), extra, sync_estimates(seen_ctx, pipes)))
        return real_mb(pipes, total, extra=extra)

    monkeypatch.setattr(elastic, "solve_layers", layers)
    monkeypatch.setattr(elastic, "solve_micro_batches", micro)
    s = Strategy.load(DP2_PP2, model=TINY, cluster=TWO_NODES)
    for gb, m in ((2, 1), (4, 2)):                      # gb micro-batches of 1 over 2 pipelines: m each
        calls.clear(), extras.clear()
        seen_ctx = _ctx(global_batch=gb)
        c = elastic._keep_templates(seen_ctx, s, {7}, 1, [1, 2, 4])
        assert calls == [(True, [(4, 5), (6,)], 1, m, int, 2, False), (True, [(4, 5), (6,)], 1, m, int, 2, True)]
        assert [p.recompute for p in c.pipes] == [False, True]
        (total, kind, extra, want), = extras
        assert (total, kind) == (gb, int) and extra == want and len(want) == 2
    calls.clear()
    refuse[0] = False
    seen_ctx = _ctx(global_batch=16)
    c = elastic._keep_templates(seen_ctx, s, {7}, 2, [1, 2, 4])
    assert calls == [(True, [(4, 5), (6,)], 2, 4, int, 2, False)] and [p.recompute for p in c.pipes] == [False, False]


def test_regroup_takes_the_largest_tp_degree_per_kind_and_bounds_the_pipelines(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TP degree per kind: the largest of the running stages of that kind (at least 1); a surviving kind the running
    strategy does not use: the largest allowed.  D pipelines only for 1 <= D <= the groups and D <= the micro-batches;
    the candidate handed to the second level has bound 0."""
    three = Cluster.load({"nodes": [{"host": "a", "kind": "H20", "ranks": [0, 1, 2, 3]},
                                    {"host": "b", "kind": "H800", "ranks": [4, 5]},
                                    {"host": "c", "kind": "A100", "ranks": [6, 7]}]})
    s = Strategy.load({"pipelines": [{**_ONE, "stages": [{"devices": [0, 1], "layers": [0, 1]},
                                                         {"devices": [4], "layers": [2, 3]}]},
                                     {**_ONE, "stages": [{"devices": [2], "layers": [0, 1]},
                                                         {"devices": [5], "layers": [2, 3]}]}]})
    ctx = PlanContext(TINY, three, global_batch=8, seq_len=64)
    made, configured, solved = [], [], []
    count = [3]

    def make_groups(cluster, survivors, degree, allowed):  # type: ignore[no-untyped-def]
        made.append((cluster is three, list(survivors), dict(degree), list(allowed)))
        return {"H20": [TPGroup((0, 1), "H20", 0)] * (count[0] - 1), "H800": [TPGroup((4,), "H800", 1)]}

    def configure(ctx_, groups, D, b):  # type: ignore[no-untyped-def]
        configured.append(D)
        return [["comp"]]

    def solve(ctx_, cand):  # type: ignore[no-untyped-def]
        solved.append(cand)
        return ["solved"]

    monkeypatch.setattr(elastic, "make_groups", make_groups)
    monkeypatch.setattr(elastic, "configure_pipelines", configure)
    monkeypatch.setattr(elastic, "solve_candidate", solve)
    survivors = [0, 1, 2, 4, 5, 6, 7]
    assert elastic._regroup(ctx, s, survivors, 1, 2, [1, 2]) == ["solved"]
    assert made == [(True, survivors, {"H20": 2, "H800": 1, "A100": 2}, [1, 2])]
    (cand,) = solved
    assert (cand.degree, cand.num_pipelines, cand.micro_batch, cand.compositions) == (
        {"H20": 2, "H800": 1, "A100": 2}, 1, 2, [["comp"]])
    assert cand.bound == 0.0 and isinstance(cand.bound, float)
    # 3 groups, 8 / 2 = 4 micro-batches
    got = {D: elastic._regroup(ctx, s, survivors, D, 2, [1, 2]) for D in (0, 1, 3, 4)}
    assert got == {0: [], 1: ["solved"], 3: ["solved"], 4: []}
    count[0] = 6                                        # 6 groups, 4 micro-batches
    got = {D: elastic._regroup(ctx, s, survivors, D, 2, [1, 2]) for D in (4, 5)}
    assert got == {4: ["solved"], 5: []}
    assert configured == [1, 1, 3, 4]


def test_regroup_without_a_configuration_has_no_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic, "configure_pipelines", lambda *a: None)
    s = Strategy.load(DP2_PP2, model=TINY, cluster=TWO_NODES)
    assert elastic._regroup(_ctx(), s, list(range(7)), 1, 1, [1, 2, 4]) == []


# ---- replan_elastic / replan_straggler: what they hand the search ---------------------------------------------------
def _fake_candidate(ranks: list, D: int, estimate: float) -> SimpleNamespace:
    return SimpleNamespace(num_pipelines=D, estimate=estimate,
                           pipes=[SimpleNamespace(groups=[SimpleNamespace(ranks=tuple(ranks))])])


def _three_pipelines(mbs: int, **extra: object) -> dict:
    return {"pipelines": [{"micro_batch_size": mbs, "num_micro_batches": 4, "stages": [
        {"devices": [2 * i, 2 * i + 1], "layers": [0, 3]}]} for i in range(3)], **extra}


def test_replan_elastic_hands_the_search_its_context_sizes_and_pipeline_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The context: the caller's cost model, the running strategy's schedule and ZeRO-1, the global batch.  Micro-
    batch sizes: 1 and the running one, where they divide the global batch (of 1, 2, 4).  Pipeline counts regrouped:
    the running one and one fewer, at least ``min(running, 2)``.  Candidates with too few pipelines or not exactly
    the survivors are dropped; the rest go to ``pick`` by estimate, with ``simulate_top`` 4 and ``refine`` by
    default."""
    from hspmd_sdk.planner.cost import CostModel

    six = Cluster.homogeneous("H20", 6)
    cost = CostModel(mfu={"H20": 0.25})
    keeps, regroups, picks = [], [], []
    good = [0, 1, 2, 3, 4]

    def keep(ctx, strategy, failed, b, allowed):  # type: ignore[no-untyped-def]
        keeps.append((ctx, failed, b, list(allowed)))
        return _fake_candidate(good, 1, 0.5)            # one pipeline: below the floor of 2

    def regroup(ctx, strategy, survivors, D, b, allowed):  # type: ignore[no-untyped-def]
        regroups.append((b, D, list(survivors)))
        return [_fake_candidate(good, D, 3.0 - D + b), _fake_candidate([0, 1, 2, 3, 5], D, 0.1)]

    def pick(ctx, cands, *, simulate_top, refine, name, adjust):  # type: ignore[no-untyped-def]
        picks.append(([c.estimate for c in cands], simulate_top, refine, name, adjust))
        return "picked"

    monkeypatch.setattr(elastic, "_keep_templates", keep)
    monkeypatch.setattr(elastic, "_regroup", regroup)
    monkeypatch.setattr(elastic, "pick", pick)
    got = elastic.replan_elastic(TINY, six, _three_pipelines(2, schedule="gpipe"), [5], seq_len=64, global_batch=24,
                                 cost=cost)
    assert got == "picked"
    ctx = keeps[0][0]
    assert ctx.cost is cost and ctx.schedule == "gpipe" and ctx.zero1 is False and ctx.global_batch == 24
    assert ctx.seq_len == 64 and ctx.cluster is six
    assert [(f, b, a) for _, f, b, a in keeps] == [({5}, 1, [1, 2, 4]), ({5}, 2, [1, 2, 4])]
    assert regroups == [(1, 2, good), (1, 3, good), (2, 2, good), (2, 3, good)]
    assert picks == [([1.0, 2.0, 2.0, 3.0], 4, True, "replan_elastic: tiny on 5 devices (lost [5])", None)]
    picks.clear(), keeps.clear(), regroups.clear()
    elastic.replan_elastic(TINY, six, _three_pipelines(4, zero1=True), [5], seq_len=64, global_batch=8,
                           simulate_top=2, refine=False, min_pipelines=3, name="n")
    assert [b for _, _, b, _ in keeps] == [1, 4] and keeps[0][0].schedule == "1f1b" and keeps[0][0].zero1 is True
    assert keeps[0][0].cost == CostModel() and keeps[0][0].global_batch == 8
    assert regroups == [(1, 3, good), (4, 3, good)]
    assert picks == [([1.0, 4.0], 2, False, "n", None)]


def test_replan_elastic_checks_the_running_strategy_against_the_model_and_the_cluster() -> None:
    """Before any planning: layers that miss one of the model's and a rank outside the cluster are refused."""
    from hspmd_sdk.errors import PlanValidationError
    from hspmd_sdk.planner.elastic import replan_elastic

    short = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 8, "stages": [
        {"devices": [0, 1], "layers": [0, 15]}, {"devices": [2, 3], "layers": [16, 30]}]}]}
    with pytest.raises(PlanValidationError) as e:
        replan_elastic("llama-7b", Cluster.homogeneous("H20", 4), short, [3], seq_len=2048)
    assert str(e.value) == "invalid strategy: pipelines[0]: layers cover 0..30 but the model has 32 layers (0..31)"
    bad = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 8, "stages": [
        {"devices": [0, 1], "layers": [0, 15]}, {"devices": [2, 9], "layers": [16, 31]}]}]}
    with pytest.raises(PlanValidationError) as e:
        replan_elastic("llama-7b", Cluster.homogeneous("H20", 4), bad, [3], seq_len=2048)
    assert str(e.value) == ("invalid strategy: pipelines[0].stages[1].devices: rank 9 is not in the cluster "
                            "(4 ranks: 0..3)")


def test_replan_straggler_hands_the_search_the_slowed_cluster_and_its_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slowed cluster is built with the caller's cost model, and the context prices with its scaled costs; the
    running strategy's schedule and ZeRO-1; TP degrees allowed up to the largest node; sizes 1 and the running
    micro-batch; nothing failed; ``pick`` with simulate_top 4 and refinement."""
    from hspmd_sdk.planner.cost import CostModel

    four = Cluster.homogeneous("H20", 4)
    cost = CostModel(compute_fits={"H20": ComputeFit(a=1.0, b=2.0)})
    slowed, keeps, picks = [], [], []
    real = elastic.slowed_cluster

    def slow(cluster, speeds, cost_):  # type: ignore[no-untyped-def]
        slowed.append((cluster is four, dict(speeds), cost_))
        slowed.append(real(cluster, speeds, cost_))
        return slowed[-1]

    def keep(ctx, strategy, failed, b, allowed):  # type: ignore[no-untyped-def]
        keeps.append((ctx, failed, b, allowed))
        return _fake_candidate([0, 1, 2, 3], 1, float(b))

    def pick(ctx, cands, *, simulate_top, refine, name, adjust):  # type: ignore[no-untyped-def]
        picks.append(([c.estimate for c in cands], simulate_top, refine, name))
        return "picked"

    monkeypatch.setattr(elastic, "slowed_cluster", slow)
    monkeypatch.setattr(elastic, "_keep_templates", keep)
    monkeypatch.setattr(elastic, "pick", pick)
    two = {"pipelines": [{"micro_batch_size": 2, "num_micro_batches": 4, "stages": [
        {"devices": [0, 1], "layers": [0, 31]}]}, {"micro_batch_size": 2, "num_micro_batches": 4, "stages": [
            {"devices": [2, 3], "layers": [0, 31]}]}], "schedule": "gpipe"}
    assert elastic.replan_straggler("llama-7b", four, two, {3: 2.0}, seq_len=2048, cost=cost) == "picked"
    assert slowed[0] == (True, {3: 2.0}, cost) and slowed[0][2] is cost
    slow_cluster, slow_cost = slowed[1]
    ctx = keeps[0][0]
    assert ctx.cost is slow_cost and ctx.cluster is slow_cluster and "H20/2" in slow_cost.compute_fits
    assert ctx.schedule == "gpipe" and ctx.zero1 is False and ctx.global_batch == 16
    assert [(f, b, a) for _, f, b, a in keeps] == [(set(), 1, [1, 2, 4]), (set(), 2, [1, 2, 4])]
    assert picks == [([1.0, 2.0], 4, True, "replan_straggler: llama-7b, ranks 3 x2.00")]
    keeps.clear()
    four_mb = {**two, "pipelines": [{**p, "micro_batch_size": 4, "num_micro_batches": 2} for p in two["pipelines"]]}
    elastic.replan_straggler("llama-7b", four, four_mb, {3: 2.0}, seq_len=2048)
    assert [b for _, _, b, _ in keeps] == [1, 4]


def test_replan_straggler_checks_the_running_strategy_against_the_model() -> None:
    from hspmd_sdk.errors import PlanValidationError
    from hspmd_sdk.planner.elastic import replan_straggler

    short = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 8, "stages": [
        {"devices": [0, 1], "layers": [0, 15]}, {"devices": [2, 3], "layers": [16, 30]}]}]}
    with pytest.raises(PlanValidationError) as e:
        replan_straggler("llama-7b", Cluster.homogeneous("H20", 4), short, {2: 2.0}, seq_len=2048)
    assert str(e.value) == "invalid strategy: pipelines[0]: layers cover 0..30 but the model has 32 layers (0..31)"


# ---- _inherit_ratios ----------------------------------------------------------------------------------------------
_BASE = TINY.model_dump()
#: 3 heads, sizes all multiples of 3 (so every stage's split is in thirds: feasible ratios 2:1 and 1:1:1)
THREE_HEADS = LlamaConfig(**{**_BASE, "name": "t3", "num_heads": 3, "num_kv_heads": 3, "hidden_size": 48,
                             "ffn_hidden_size": 96, "vocab_size": 252})
#: 2 heads: every split in halves (two ranks can only split it 1:1)
TWO_HEADS = LlamaConfig(**{**_BASE, "name": "t2", "num_heads": 2, "num_kv_heads": 2})


def _strategy(*pipes: list) -> Strategy:
    return Strategy.load({"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 4, "stages": [
        {"devices": d, "layers": lay, **({"ratios": r} if r else {})} for d, lay, r in p]} for p in pipes]})


def _ratios(s: Strategy) -> list:
    return [(st.devices, st.ratios) for p in s.pipelines for st in p.stages]


#: a TP3 2:1:1 stage, then a TP2 3:1 stage
OLD = _strategy([([0, 1, 2], [0, 1], [2, 1, 1]), ([3, 4], [2, 3], [3, 1])])


def test_inherit_ratios_goes_on_past_stages_it_leaves_even_and_prices_each_at_its_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stage of a pipeline is looked at: one of ranks no uneven stage owned (even), one of survivors whose
    ratios were equal (even) do not stop the next from inheriting; each stage's whole parts are those of its own
    place (first: the embedding, last: the head)."""
    real = elastic.split_units
    seen: list = []

    def spy(model, stage, *, first=False, last=False):  # type: ignore[no-untyped-def]
        seen.append((list(stage.devices), first, last))
        return real(model, stage, first=first, last=last)

    monkeypatch.setattr(elastic, "split_units", spy)
    new = _strategy([([5, 6], [0, 0], None), ([0, 1], [1, 2], None), ([3, 4], [3, 3], None)])
    assert _ratios(elastic._inherit_ratios(TINY, OLD, new)) == [([5, 6], None), ([0, 1], [3, 1]), ([3, 4], [3, 1])]
    assert seen == [([0, 1], False, False), ([3, 4], False, True)]
    seen.clear()
    new = _strategy([([0, 1], [0, 1], None), ([3, 4], [2, 3], None)])
    assert _ratios(elastic._inherit_ratios(TINY, OLD, new)) == [([0, 1], [3, 1]), ([3, 4], [3, 1])]
    assert seen == [([0, 1], True, False), ([3, 4], False, True)]
    new = _strategy([([1, 2], [0, 1], None), ([3, 4], [2, 3], None)])        # 1:1 survivors, then 3:1
    assert _ratios(elastic._inherit_ratios(TINY, OLD, new)) == [([1, 2], None), ([3, 4], [3, 1])]


def test_inherit_ratios_leaves_a_stage_even_where_the_nearest_feasible_ratios_are_equal() -> None:
    """2:1:1 survivors over a model split in thirds: the nearest feasible ratios are 1:1:1, so that stage stays
    even, and the next still inherits (3:1 -> 2:1).  Over a model split in halves: 2:1 -> 1:1 and three ranks
    (no feasible split) stay even; nothing changed, the strategy is the one given."""
    new = _strategy([([0, 1, 2], [0, 1], None), ([3, 4], [2, 3], None)])
    assert _ratios(elastic._inherit_ratios(THREE_HEADS, OLD, new)) == [([0, 1, 2], None), ([3, 4], [2, 1])]
    assert elastic._inherit_ratios(TWO_HEADS, OLD, new) is new
    halves = _strategy([([0, 1], [0, 1], None), ([3, 4], [2, 3], None)])
    assert elastic._inherit_ratios(TWO_HEADS, OLD, halves) is halves


def test_inherit_ratios_does_not_unbalance_survivors_of_equal_ratios() -> None:
    """Survivors whose ratios were equal (2:2 of a 2:2:1 stage) get none, even where the model cannot be split
    evenly over them (3 heads over two ranks): the strategy stays as it was built."""
    old = _strategy([([0, 1, 2], [0, 1], [2, 2, 1]), ([3, 4], [2, 3], [3, 1])])
    new = _strategy([([0, 1], [0, 1], None), ([3, 4], [2, 3], None)])
    assert elastic._inherit_ratios(THREE_HEADS, old, new) is new


def test_inherit_ratios_returns_the_strategy_given_when_nothing_or_nothing_valid_changes() -> None:
    """No stage of ranks an uneven stage owned: ``new`` itself.  Ratios that give no valid strategy for the model
    (here ``new`` misses the model's last layer): ``new`` itself."""
    none_owned = _strategy([([5, 6], [0, 1], None), ([7], [2, 3], None)])
    assert elastic._inherit_ratios(TINY, OLD, none_owned) is none_owned
    short = _strategy([([0, 1], [0, 1], None), ([3, 4], [2, 2], None)])
    assert elastic._inherit_ratios(TINY, OLD, short) is short
    even = _strategy([([0, 1, 2], [0, 1], None), ([3, 4], [2, 3], None)])
    assert elastic._inherit_ratios(TINY, even, OLD) is OLD


def test_replan_straggler_refuses_ratios_the_model_cannot_take_up_front() -> None:
    """A running 2:1 stage over the tiny model's 4 heads is refused with the model's message, not replanned into
    the nearest feasible ratios (which the search would otherwise find)."""
    from hspmd_sdk.errors import PlanValidationError
    from hspmd_sdk.planner.elastic import replan_straggler

    bad = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 4, "stages": [
        {"devices": [0, 1], "layers": [0, 3], "ratios": [2, 1]}]}]}
    with pytest.raises(PlanValidationError) as e:
        replan_straggler(TINY, Cluster.homogeneous("H20", 2), bad, {1: 2.0}, seq_len=64)
    assert str(e.value).startswith("invalid strategy: pipelines[0].stages[0].ratios: ratios 2:1 split tensor ")
    assert str(e.value).endswith("nearest feasible ratios: 3:1")
