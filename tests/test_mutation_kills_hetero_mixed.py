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


def test_even_layers_extra_ones_in_the_middle_then_the_last_never_the_first() -> None:
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


# ---- with stand-ins for the ratio ILP and the layout: what each step hands the next ----------------------------------
import pytest  # noqa: E402

from hspmd_sdk import LlamaConfig  # noqa: E402
from hspmd_sdk.errors import HSPMDError  # noqa: E402
from hspmd_sdk.planner import hetero_mixed  # noqa: E402
from hspmd_sdk.planner.hetero_mixed import PipelineLayout, mixed_strategies, pipeline_layout  # noqa: E402

TINY = LlamaConfig.preset("tiny")


def test_ratios_asks_the_ratio_ilp_once_per_kinds_layer_count_micro_batch_and_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """plan_ratios gets the stage (the group's ranks, its layers), the micro-batch, the run's sequence length and
    cost model, and the ends it holds; groups of the same kinds with as many layers share its answer, groups of
    other kinds or other ends do not; a refusal (an HSPMDError) is None, and is remembered too."""
    calls: list = []

    def fake(model, cluster, stage, *, micro_batch, seq_len, first, last, cost):  # type: ignore[no-untyped-def]
        calls.append((model is TINY, cluster is TWO_HOSTS, stage.devices, stage.layers, micro_batch, seq_len, first,
                      last, cost))
        if stage.devices == [1, 3]:
            raise HSPMDError("no")
        return SimpleNamespace(n=len(calls))

    monkeypatch.setattr(hetero_mixed, "plan_ratios", fake)
    ctx = SimpleNamespace(model=TINY, cluster=TWO_HOSTS, seq_len=64, cost="cost")
    cache: dict = {}
    r1 = hetero_mixed._ratios(ctx, (0, 2), (0, 1), 2, True, False, cache)
    assert calls == [(True, True, [0, 2], [0, 1], 2, 64, True, False, "cost")]
    assert hetero_mixed._ratios(ctx, (4, 6), (0, 1), 2, True, False, cache) is r1   # same kinds: shared
    assert hetero_mixed._ratios(ctx, (0, 2), (2, 3), 2, True, False, cache) is r1   # as many layers: shared
    r3 = hetero_mixed._ratios(ctx, (0, 1), (0, 1), 2, True, False, cache)           # two H800: asked
    r4 = hetero_mixed._ratios(ctx, (0, 2), (0, 1), 2, False, True, cache)           # other ends: asked
    r5 = hetero_mixed._ratios(ctx, (0, 2), (0, 2), 1, True, False, cache)           # 3 layers at 1: asked
    assert [r.n for r in (r1, r3, r4, r5)] == [1, 2, 3, 4]
    assert calls[1:] == [(True, True, [0, 1], [0, 1], 2, 64, True, False, "cost"),
                         (True, True, [0, 2], [0, 1], 2, 64, False, True, "cost"),
                         (True, True, [0, 2], [0, 2], 1, 64, True, False, "cost")]
    assert hetero_mixed._ratios(ctx, (1, 3), (0, 0), 1, False, False, cache) is None
    assert hetero_mixed._ratios(ctx, (1, 3), (0, 0), 1, False, False, cache) is None and len(calls) == 5


def _fake_ratios(calls: list, times: dict, refuse: tuple = ()):  # type: ignore[no-untyped-def]
    def fake(ctx, g, layers, b, first, last, cache):  # type: ignore[no-untyped-def]
        calls.append((g, layers, b, first, last, cache))
        if (g, layers) in refuse:
            return None
        return SimpleNamespace(step_time=times[g] * (layers[1] - layers[0] + 1) * b, ratios=(g[0] + 1, 1))
    return fake


def test_pipeline_layout_splits_mixed_stages_by_their_speed_per_layer_and_alike_ones_evenly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stages of different kinds: each group's time for one layer at micro-batch 1 (no ends) decides the split
    (_shares); then each stage's ratios for its own layers at the micro-batch, the first with the embedding and the
    last with the head, consecutive layers; one cache for all of it.  Alike stages: _even_layers, no per-layer
    question.  None where a per-layer or a stage's answer is None."""
    kinds = {0: "H800", 1: "H800", 2: "H800", 10: "H20", 11: "H20", 12: "H20"}
    ctx = SimpleNamespace(model=SimpleNamespace(num_layers=7), cluster=SimpleNamespace(kind=kinds.__getitem__))
    calls: list = []
    times = {(0, 10): 1.0, (11, 12): 2.5, (1, 11): 1.0, (2, 12): 1.0}
    monkeypatch.setattr(hetero_mixed, "_ratios", _fake_ratios(calls, times))
    cache: dict = {}
    got = pipeline_layout(ctx, [(0, 10), (11, 12)], 2, cache)
    assert got == PipelineLayout(((0, 4), (5, 6)), ((1, 1), (12, 1)), (10.0, 10.0))
    assert [c[:5] for c in calls] == [((0, 10), (0, 0), 1, False, False), ((11, 12), (0, 0), 1, False, False),
                                      ((0, 10), (0, 4), 2, True, False), ((11, 12), (5, 6), 2, False, True)]
    assert all(c[5] is cache for c in calls)
    calls.clear()
    alike = pipeline_layout(ctx, [(0, 10), (1, 11), (2, 12)], 1)                 # 7 layers: 2, 3, 2
    assert alike == PipelineLayout(((0, 1), (2, 4), (5, 6)), ((1, 1), (2, 1), (3, 1)), (2.0, 3.0, 2.0))
    assert [c[:5] for c in calls] == [((0, 10), (0, 1), 1, True, False), ((1, 11), (2, 4), 1, False, False),
                                      ((2, 12), (5, 6), 1, False, True)]
    assert isinstance(calls[0][5], dict) and all(c[5] is calls[0][5] for c in calls)
    monkeypatch.setattr(hetero_mixed, "_ratios", _fake_ratios([], times, refuse=(((11, 12), (0, 0)),)))
    assert pipeline_layout(ctx, [(0, 10), (11, 12)], 2) is None
    monkeypatch.setattr(hetero_mixed, "_ratios", _fake_ratios([], times, refuse=(((1, 11), (2, 4)),)))
    assert pipeline_layout(ctx, [(0, 10), (1, 11), (2, 12)], 1) is None


def test_arrangement_strategies_build_one_strategy_per_recompute_checked_against_the_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pipeline takes the first pipeline's layout, the micro-batch and an equal share of the micro-batches;
    the run's schedule, ZeRO-1 and name; the layout with the caller's cache.  Ratios the model cannot take (2:1 of
    4 heads): None, also when only one strategy is asked for."""
    seen: list = []
    layout = PipelineLayout(((0, 1), (2, 3)), ((3, 1), (1, 3)), (1.0, 1.0))

    def fake_layout(ctx, pipe, b, cache=None):  # type: ignore[no-untyped-def]
        seen.append((pipe, b, cache))
        return layout

    monkeypatch.setattr(hetero_mixed, "pipeline_layout", fake_layout)
    ctx = SimpleNamespace(cluster=TWO_HOSTS, model=TINY, global_batch=8, schedule="gpipe", zero1=True, zero=1)
    pipes = [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    cache: dict = {}
    got = arrangement_strategies(ctx, pipes, 2, name="n", cache=cache)
    assert seen == [([(0, 1), (2, 3)], 2, cache)] and seen[0][2] is cache

    def stages(p: list, rc: bool) -> list:
        return [{"devices": list(g), "layers": list(lay), "recompute": rc, "ratios": list(r)}
                for g, lay, r in zip(p, layout.layers, layout.ratios)]

    assert [s.model_dump() for s in got] == [
        {"pipelines": [{"stages": stages(p, rc), "micro_batch_size": 2, "num_micro_batches": 2} for p in pipes],
         "schedule": "gpipe", "zero1": True, "name": "n"} for rc in (False, True)]
    layout = PipelineLayout(((0, 1), (2, 3)), ((2, 1), (1, 1)), (1.0, 1.0))
    assert arrangement_strategies(ctx, pipes, 2, recompute=(False,)) is None
    assert arrangement_strategies(ctx, pipes, 2) is None


def test_mixed_strategies_tries_each_arrangement_at_increasing_micro_batches_until_one_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The arrangements of the ranks within the caller's bounds; per arrangement the micro-batch sizes in increasing
    order until one gives None (a larger one will not fit either), then the next arrangement; one cache for the run;
    the recompute choices and the name passed on."""
    arrangements: list = []
    asked: list = []

    def fake_arrangements(ctx, ranks, *, degrees, min_pipelines, max_pipelines):  # type: ignore[no-untyped-def]
        arrangements.append((list(ranks), degrees, min_pipelines, max_pipelines))
        return ["A", "B"]

    def fake_strategies(ctx, pipes, b, *, recompute, name, cache):  # type: ignore[no-untyped-def]
        asked.append((pipes, b, recompute, name, cache))
        return None if (pipes, b) == ("A", 2) else [f"{pipes}{b}"]

    monkeypatch.setattr(hetero_mixed, "mixed_arrangements", fake_arrangements)
    monkeypatch.setattr(hetero_mixed, "arrangement_strategies", fake_strategies)
    got = mixed_strategies(None, [0, 1], degrees=[2], micro_batches=(4, 1, 2), min_pipelines=2, max_pipelines=3,
                           recompute=(True,), name="n")
    assert got == ["A1", "B1", "B2", "B4"]
    assert arrangements == [([0, 1], [2], 2, 3)]
    assert [(p, b, rc, n) for p, b, rc, n, _ in asked] == [
        ("A", 1, (True,), "n"), ("A", 2, (True,), "n"), ("B", 1, (True,), "n"), ("B", 2, (True,), "n"),
        ("B", 4, (True,), "n")]
    assert isinstance(asked[0][4], dict) and all(c[4] is asked[0][4] for c in asked)
    arrangements.clear(), asked.clear()
    assert mixed_strategies(None, [0, 1]) == ["A1", "B1", "B2", "B4"]
    assert arrangements == [([0, 1], None, 1, None)]
    assert {(rc, n) for _, _, rc, n, _ in asked} == {((False, True), None)}
