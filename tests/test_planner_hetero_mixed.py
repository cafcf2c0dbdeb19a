"""``plan_hetero`` with mixed-kind TP groups (issue 28 item 3, SPEC §12): on a host of several device kinds it
simulates TP groups that mix them with HAP's ratios beside its plans of single-kind groups, keeps the faster and
says why in the strategy's name.  The independent references: the simulator run here on the same strategies, and
``plan_ratios`` (the ratio LP) for the group's ratios."""
from __future__ import annotations

import pytest

from hspmd_sdk import Cluster, LlamaConfig, Strategy
from hspmd_sdk.core.strategy import Stage
from hspmd_sdk.planner import plan_hetero, simulate
from hspmd_sdk.planner.hetero import PlanContext
from hspmd_sdk.planner.hetero_mixed import _shares, host_groups, mixed_strategies
from hspmd_sdk.planner.ratios import plan_ratios

MODEL = LlamaConfig.preset("llama-7b")
SEQ = 4096
#: an H800 and an H20 in one box (two nodes of one host), over PCIe
BOX = Cluster.load({"nodes": [{"host": "box", "kind": "H800", "ranks": [0]},
                              {"host": "box", "kind": "H20", "ranks": [1]}], "inter_bandwidth_gbs": 64})


def _time(strategy: Strategy, batch: int) -> float:
    r = simulate(MODEL, strategy, BOX, global_batch=batch, seq_len=SEQ)
    assert not r.oom
    return r.step_time


def test_a_mixed_group_wins_where_it_is_faster_and_the_name_says_so() -> None:
    got = plan_hetero(MODEL, BOX, global_batch=1, seq_len=SEQ)
    plain = plan_hetero(MODEL, BOX, global_batch=1, seq_len=SEQ, mixed_groups=False)
    (stage,), = [p.stages for p in got.pipelines]
    want = plan_ratios(MODEL, BOX, Stage(devices=[0, 1], layers=[0, MODEL.num_layers - 1]), seq_len=SEQ)
    assert stage.devices == [0, 1] and tuple(stage.ratios) == want.ratios and want.ratios[0] > want.ratios[1]
    assert all(st.ratios is None for p in plain.pipelines for st in p.stages)
    t_mixed, t_plain = _time(got, 1), _time(plain, 1)
    assert t_mixed < t_plain
    assert "mixed-kind TP groups with ratios 21:11" in got.name and f"{t_mixed:.3g} s against {t_plain:.3g}" in \
        got.name, got.name
    assert "mixed-kind" in got.summary()


@pytest.mark.parametrize("batch", [2, 8])
def test_single_kind_groups_are_kept_where_they_are_faster(batch: int) -> None:
    got = plan_hetero(MODEL, BOX, global_batch=batch, seq_len=SEQ)
    assert all(st.ratios is None for p in got.pipelines for st in p.stages)
    ctx = PlanContext(MODEL, BOX, global_batch=batch, seq_len=SEQ)
    fitting = [t for t in (simulate(MODEL, s, BOX, global_batch=batch, seq_len=SEQ) for s in
                           mixed_strategies(ctx, [0, 1], degrees=[2])) if not t.oom]
    assert fitting and _time(got, batch) <= min(r.step_time for r in fitting)
    assert got.name.startswith(f"plan_hetero: {MODEL.name} on 2 devices (single-kind groups: est.")


def test_hosts_are_dealt_into_groups_of_each_kind() -> None:
    two = Cluster.load({"nodes": [{"host": "a", "kind": "H800", "ranks": [0, 1]},
                                  {"host": "a", "kind": "H20", "ranks": [2, 3]},
                                  {"host": "b", "kind": "H20", "ranks": [4, 5]},
                                  {"host": "b", "kind": "A100", "ranks": [6, 7]}]})
    ctx = PlanContext(MODEL, two, global_batch=8, seq_len=SEQ)
    assert host_groups(ctx, range(8), 2) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert host_groups(ctx, range(8), 1) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert host_groups(ctx, range(8), 3) is None           # 2 devices a kind: 3 groups cannot share them
    assert host_groups(ctx, range(7), 1) == [(0, 1, 2, 3), (4, 5, 6)]  # host b: 2 H20 and 1 A100 in one group
    assert host_groups(ctx, range(7), 2) is None           # host b's one A100 cannot go to two groups
    paper = Cluster.mixed({"H800": 8, "H20": 8})          # one kind a host: no mixed group, no candidate
    assert mixed_strategies(PlanContext(MODEL, paper, global_batch=16, seq_len=SEQ), range(16),
                            degrees=[1, 2, 4, 8]) == []
    assert host_groups(PlanContext(MODEL, paper, global_batch=16, seq_len=SEQ), range(16), 1) is None


def test_micro_batches_follow_the_groups_speeds() -> None:
    assert _shares(8, [1.0, 1.0]) == [4, 4]
    assert _shares(8, [1.0, 3.0]) == [6, 2]                 # three times slower: a quarter of the work
    assert _shares(7, [1.0, 2.0, 2.0]) == [3, 2, 2]
    assert _shares(2, [1.0, 10.0]) == [1, 1]                # every group takes one (the candidate uses every rank)
    assert _shares(1, [1.0, 1.0]) is None                   # fewer micro-batches than groups
    assert sum(_shares(13, [0.7, 1.1, 2.9]) or []) == 13


def test_a_host_with_unequal_numbers_of_each_kind_gets_mixed_groups_too() -> None:
    """One H800 and three H20 in a box: one TP4 group of all four, the H800 taking the largest share (ratios from
    the ratio LP); the planner simulates it beside its single-kind plans and keeps the faster."""
    box = Cluster.load({"nodes": [{"host": "box", "kind": "H800", "ranks": [0]},
                                  {"host": "box", "kind": "H20", "ranks": [1, 2, 3]}], "inter_bandwidth_gbs": 64})
    ctx = PlanContext(MODEL, box, global_batch=1, seq_len=SEQ)
    assert host_groups(ctx, range(4), 1) == [(0, 1, 2, 3)]
    assert host_groups(ctx, range(4), 3) is None
    found = mixed_strategies(ctx, range(4), degrees=[1, 2, 4])
    assert found, "no mixed candidate for the 1 + 3 box"
    ratios = found[0].pipelines[0].stages[0].ratios
    assert ratios is not None and ratios[0] > max(ratios[1:]), ratios
    plan = plan_ratios(MODEL, box, Stage(devices=[0, 1, 2, 3], layers=[0, MODEL.num_layers - 1]), seq_len=SEQ)
    assert list(plan.ratios) == list(ratios)
    got = plan_hetero(MODEL, box, global_batch=1, seq_len=SEQ)
    best_mixed = min(simulate(MODEL, s, box, global_batch=1, seq_len=SEQ).step_time for s in found
                     if not simulate(MODEL, s, box, global_batch=1, seq_len=SEQ).oom)
    assert simulate(MODEL, got, box, global_batch=1, seq_len=SEQ).step_time <= best_mixed * (1 + 1e-9)


def test_a_pipeline_that_fits_only_with_recompute_is_in_the_search() -> None:
    """At batch 8 on the H800 + H20 box the best plan is a whole replica per device, the batch shared 7:1 -- which
    the H800 holds only with ZeRO-1 and recomputation.  The first level used to price every pipeline without
    recomputation, found a replica on the H800 too large and kept a 2-stage pipeline (7.68 s); it now weighs
    recompute where the plain pipeline does not fit, as the layer ILPs do."""
    got = plan_hetero(MODEL, BOX, global_batch=8, seq_len=SEQ, mixed_groups=False)
    assert sorted(len(p.stages) for p in got.pipelines) == [1, 1], got
    by_rank = {p.stages[0].devices[0]: p for p in got.pipelines}
    assert by_rank[0].num_micro_batches > by_rank[1].num_micro_batches and by_rank[0].stages[0].recompute
    one_pipeline = Strategy.load({"zero1": True, "pipelines": [{"stages": [
        {"devices": [0], "layers": [0, 15]}, {"devices": [1], "layers": [16, 31]}],
        "micro_batch_size": 1, "num_micro_batches": 8}]})
    assert _time(got, 8) < 0.7 * _time(one_pipeline, 8)
