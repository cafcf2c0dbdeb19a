"""Tests that kill the surviving mutants of :mod:`hspmd_sdk.planner.hetero_mixed` (issue 49, mutation testing): the
dealing of hosts into mixed groups, their arrangement into alike pipelines, the layer and micro-batch splits."""
from __future__ import annotations

from types import SimpleNamespace

from hspmd_sdk import Cluster, Strategy
from hspmd_sdk.planner.hetero_mixed import (_even_layers, _shares, arrangement, arrangement_strategies, host_groups,
                                            mixed_arrangements, recomputing)

TWO_HOSTS = Cluster.load({"nodes": [{"host": "a", "kind": "H800", "ranks": [0, 1]},
                                    {"host": "a", "kind": "H20", "ranks": [2, 3]},
                                    {"host": "b", "kind": "H800", "ranks": [4, 5]},
                                    {"host": "b", "kind": "H20", "ranks": [6, 7]}]})
CTX = SimpleNamespace(cluster=TWO_HOSTS)


def test_arrangement_deals_round_robin_else_consecutive_else_none() -> None:
    """Round-robin where every pipeline's j-th stage has the same kinds; consecutive groups where only that is
    alike; None where neither is, or the stages do not divide the groups (or are fewer than one)."""
    g = host_groups(CTX, range(8), 2)
    assert g == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert arrangement(CTX, g, 2) == [[(0, 2), (4, 6)], [(1, 3), (5, 7)]]
    assert arrangement(CTX, g, 1) == [[(0, 2)], [(1, 3)], [(4, 6)], [(5, 7)]]
    assert arrangement(CTX, g, 4) == [[(0, 2), (1, 3), (4, 6), (5, 7)]]
    assert arrangement(CTX, g, 3) is None and arrangement(CTX, g, 0) is None
    xyxy = Cluster.load({"nodes": [{"host": h, "kind": k, "ranks": [r]} for h, k, r in (
        ("a", "H800", 0), ("a", "H20", 1), ("b", "H20", 2), ("b", "A100", 3),
        ("c", "H800", 4), ("c", "H20", 5), ("d", "H20", 6), ("d", "A100", 7))]})
    ctx = SimpleNamespace(cluster=xyxy)
    groups = host_groups(ctx, range(8), 1)
    assert groups == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert arrangement(ctx, groups, 2) == [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]   # round-robin is not alike
    assert arrangement(ctx, groups, 1) is None


def test_mixed_arrangements_every_group_count_and_stage_count_within_the_bounds() -> None:
    assert mixed_arrangements(CTX, range(8)) == [
        [[(0, 1, 2, 3)], [(4, 5, 6, 7)]], [[(0, 1, 2, 3), (4, 5, 6, 7)]],
        [[(0, 2)], [(1, 3)], [(4, 6)], [(5, 7)]], [[(0, 2), (4, 6)], [(1, 3), (5, 7)]],
        [[(0, 2), (1, 3), (4, 6), (5, 7)]]]
    assert mixed_arrangements(CTX, range(8), degrees=[2], min_pipelines=2, max_pipelines=2) == [
        [[(0, 2), (4, 6)], [(1, 3), (5, 7)]]]
    assert mixed_arrangements(CTX, range(8), min_pipelines=4) == [[[(0, 2)], [(1, 3)], [(4, 6)], [(5, 7)]]]
    assert mixed_arrangements(CTX, range(8), degrees=[4], max_pipelines=1) == [[[(0, 1, 2, 3), (4, 5, 6, 7)]]]


def test_even_layers_extra_ones_in_the_middle_then_last_then_first() -> None:
    assert _even_layers(9, 4) == [2, 3, 2, 2] and _even_layers(11, 4) == [2, 3, 3, 3]
    assert _even_layers(5, 2) == [2, 3] and _even_layers(3, 1) == [3] and _even_layers(4, 4) == [1, 1, 1, 1]


def test_shares_ties_go_to_the_slower_then_the_first() -> None:
    """Each job to the worker that would finish it first; on equal finish times the slower, then the first."""
    assert _shares(4, [1.0, 1.5]) == [2, 2]
    assert _shares(4, [1.0, 1.0, 1.0]) == [2, 1, 1] and _shares(3, [2.0, 1.0]) == [1, 2]
    assert _shares(2, [1.0, 1.0]) == [1, 1] and _shares(0, []) == []


def test_recomputing_sets_recompute_on_every_stage_only() -> None:
    s = Strategy.load({"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]},
                                                 {"devices": [1], "layers": [2, 3], "recompute": True}],
                                      "micro_batch_size": 1, "num_micro_batches": 3},
                                     {"stages": [{"devices": [2], "layers": [0, 3]}], "micro_batch_size": 1, "num_micro_batches": 3}],
                       "name": "x"})
    r = recomputing(s)
    assert [[st.recompute for st in p.stages] for p in r.pipelines] == [[True, True], [True]]
    want = s.model_dump()
    for p in want["pipelines"]:
        for st in p["stages"]:
            st["recompute"] = True
    assert r.model_dump() == want and not s.pipelines[0].stages[0].recompute


def test_arrangement_strategies_need_equal_micro_batches_per_pipeline() -> None:
    """``[]`` where the global batch does not split into equal micro-batches over the pipelines."""
    ctx = SimpleNamespace(cluster=TWO_HOSTS, global_batch=6)
    pipes = [[(0, 2)], [(1, 3)], [(4, 6)], [(5, 7)]]
    assert arrangement_strategies(ctx, pipes, 4) == []       # 6 rows are no whole number of 4-row micro-batches
    assert arrangement_strategies(ctx, pipes, 2) == []       # 3 micro-batches over 4 pipelines
    assert arrangement_strategies(ctx, pipes, 3) == []       # 2 micro-batches over 4 pipelines
