"""``plan_hetero`` with mixed-kind TP groups (issue 28 item 3, SPEC §12): on a host of several device kinds it
simulates TP groups that mix them with HAP's ratios beside its plans of single-kind groups, keeps the faster and
says why in the strategy's name.  The independent references: the simulator run here on the same strategies, and
``plan_ratios`` (the ratio LP) for the group's ratios."""
from __future__ import annotations

import pytest

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize
from hspmd_sdk.core.strategy import Stage
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.planner import plan_hetero, simulate
from hspmd_sdk.planner.hetero import PlanContext, _best_mixed
from hspmd_sdk.planner.hetero_mixed import _even_layers, _shares, host_groups, mixed_strategies
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


# ---- pipelined mixed groups, groups of any size the ratios can cut, candidates the strategy accepts ---------------
BIG = LlamaConfig.preset("llama-32b")
#: four hosts of 2 H800 + 2 H20 each (352 GB a host): a 32B model's weights, gradients and Adam states alone are
#: about 514 GB, so no host's devices hold it whole
HOSTS = Cluster.load({"nodes": [{"host": f"h{h}", "kind": kind, "ranks": [4 * h + o, 4 * h + o + 1]}
                                for h in range(4) for kind, o in (("H800", 0), ("H20", 2))]})
#: an H800 and two H20 in one box: three devices, which an even split of 32 heads cannot use
TRIO = Cluster.load({"nodes": [{"host": "box", "kind": "H800", "ranks": [0]},
                               {"host": "box", "kind": "H20", "ranks": [1, 2]}], "inter_bandwidth_gbs": 64})


def test_a_model_no_mixed_group_holds_runs_on_pipelines_of_mixed_groups() -> None:
    """Every mixed group used to be one pipeline of one stage holding every layer, so this cluster got no mixed
    candidate at all; now the groups are stages of pipelines, each with its own layers and ratios."""
    with pytest.raises(PlanValidationError):  # one host's group cannot hold every layer: no one-stage candidate
        plan_ratios(BIG, HOSTS, Stage(devices=[0, 1, 2, 3], layers=[0, BIG.num_layers - 1]), seq_len=SEQ)
    ctx = PlanContext(BIG, HOSTS, global_batch=8, seq_len=SEQ)
    found = mixed_strategies(ctx, range(16))
    assert found and all(len(p.stages) >= 2 for s in found for p in s.pipelines)
    best, t = _best_mixed(ctx, range(16), (1, 2, 4), 1, None, "mixed")
    r = simulate(BIG, best, HOSTS, global_batch=8, seq_len=SEQ)
    assert not r.oom and r.step_time == pytest.approx(t)
    Strategy.load(best.model_dump(), model=BIG, cluster=HOSTS, global_batch=8)  # the strategy's own checks
    assert len(best.pipelines[0].stages) >= 2
    for p in best.pipelines:
        assert [st.layers[0] for st in p.stages] == [0] + [st.layers[1] + 1 for st in p.stages[:-1]]
        assert p.stages[-1].layers[1] == BIG.num_layers - 1          # every layer once, in order
        for st in p.stages:
            assert len({HOSTS.kind(d) for d in st.devices}) == 2 and st.tp_ratios is not None
            assert BIG.num_heads % sum(st.tp_ratios) == 0            # whole heads on every device
    got = plan_hetero(BIG, HOSTS, global_batch=8, seq_len=SEQ)     # weighed beside the single-kind plan
    assert "mixed-kind TP groups with ratios" in got.name and f"{t:.3g} s" in got.name, got.name


def test_three_devices_share_32_heads_by_their_ratios() -> None:
    """No even TP3 of 32 heads exists (the TP degrees offered were divisors of the heads), but the ratio ILP cuts
    them whole over an H800 and two H20; the strategy validates, specializes with each rank holding its heads,
    and the planner keeps it where the simulator finds it faster than every single-kind plan."""
    assert MODEL.tp_problems(3)
    ctx = PlanContext(MODEL, TRIO, global_batch=1, seq_len=SEQ)
    found = mixed_strategies(ctx, range(3))
    assert found
    stage = found[0].pipelines[0].stages[0]
    ratios = stage.tp_ratios
    assert stage.devices == [0, 1, 2] and stage.layers == [0, MODEL.num_layers - 1] and ratios is not None
    assert MODEL.num_heads % sum(ratios) == 0 and ratios[0] > max(ratios[1:]), ratios
    strategy = Strategy.load(found[0].model_dump(), model=MODEL, cluster=TRIO, global_batch=1)
    shapes = {"B": 1, "S": SEQ}
    prog = specialize(MODEL, plan_from_strategy(MODEL, strategy, TRIO), TRIO, bindings=shapes)
    heads = [prog.local_shape("layers.0.attn.q_heads", r, shapes)[2] for r in range(3)]
    assert heads == [MODEL.num_heads * x // sum(ratios) for x in ratios] and sum(heads) == MODEL.num_heads
    got = plan_hetero(MODEL, TRIO, global_batch=1, seq_len=SEQ)
    plain = plan_hetero(MODEL, TRIO, global_batch=1, seq_len=SEQ, mixed_groups=False)
    assert [st.devices for p in got.pipelines for st in p.stages] == [[0, 1, 2]], got
    assert simulate(MODEL, got, TRIO, global_batch=1, seq_len=SEQ).step_time < \
        simulate(MODEL, plain, TRIO, global_batch=1, seq_len=SEQ).step_time


@pytest.mark.parametrize("nodes,batch", [
    ([("a", "H800", [0, 1, 2]), ("a", "H20", [3, 4, 5])], 4),          # 3 groups, 4 micro-batches
    ([("a", "H800", [0, 1]), ("a", "H20", [2, 3]), ("b", "H20", [4, 5]), ("b", "A100", [6, 7])], 8),  # unlike hosts
], ids=["unequal-micro-batches", "hosts-of-other-kinds"])
def test_every_mixed_candidate_is_one_the_strategy_accepts(nodes: list, batch: int) -> None:
    """Pipelines with uneven stages must split each layer alike and take equal micro-batches (the two-tier
    annotation); candidates that did not used to make ``plan_hetero`` raise.  Now every candidate validates,
    pipelines alike, and the planner returns a plan."""
    cluster = Cluster.load({"nodes": [{"host": h, "kind": k, "ranks": r} for h, k, r in nodes]})
    ctx = PlanContext(MODEL, cluster, global_batch=batch, seq_len=SEQ)
    found = mixed_strategies(ctx, range(cluster.num_ranks))
    assert found
    for s in found:
        Strategy.load(s.model_dump(), model=MODEL, cluster=cluster, global_batch=batch)
        assert len({(p.micro_batch_size, p.num_micro_batches) for p in s.pipelines}) == 1
    assert plan_hetero(MODEL, cluster, global_batch=batch, seq_len=SEQ).num_ranks == cluster.num_ranks


def test_alike_stages_take_even_layers_the_rest_in_the_middle() -> None:
    assert _even_layers(60, 8) == [7, 8, 8, 8, 8, 7, 7, 7]    # not on the first (embedding, most in flight)
    assert _even_layers(32, 4) == [8, 8, 8, 8]
    assert _even_layers(7, 2) == [3, 4] and _even_layers(8, 3) == [2, 3, 3]
    assert _even_layers(2, 3) is None
