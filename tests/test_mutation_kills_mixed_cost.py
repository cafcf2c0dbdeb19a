"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of planner/mixed_cost.py.

References: a brute-force search over every split of the layers (``split_layers``), the 1F1B formula of the
module docstring worked out by hand over stand-in stages with known time lines (``PipelineCost``), the analytic
FLOP count of a Llama layer (``StageCost``, as in test_planner_mixed_dispatch but with memory and the affine
coefficients themselves), and the BF16 bytes each device lacks counted by hand (``switch_estimate``).
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from hspmd_sdk import LlamaConfig, Strategy
from hspmd_sdk.core.cluster import Cluster, Link
from hspmd_sdk.planner.cost import CostModel, static_memory
from hspmd_sdk.planner.mixed_cost import PipelineCost, StageCost, split_layers, switch_estimate

close = pytest.approx


def _brute(num_layers: int, t, f) -> float:
    best = float("inf")
    S = len(t)
    for cut in itertools.combinations(range(1, num_layers), S - 1):
        counts = [b - a for a, b in zip((0,) + cut, cut + (num_layers,))]
        best = min(best, max(f[s] + counts[s] * t[s] for s in range(S)))
    return best


def test_split_layers_is_optimal_by_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(80):
        S = rng.randint(1, 4)
        L = rng.randint(S, 9)
        t = [rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(S)]
        f = [rng.choice([0.0, 0.5, 1.0, 4.0]) for _ in range(S)]
        counts = split_layers(L, t, f)
        assert len(counts) == S and sum(counts) == L and min(counts) >= 1
        assert max(f[s] + counts[s] * t[s] for s in range(S)) == close(_brute(L, t, f)), (L, t, f, counts)
    assert split_layers(4, [1.0, 1.0], [0.0, 0.0]) == [2, 2]
    assert split_layers(6, [1.0, 2.0], [0.0, 0.0]) == [4, 2]
    assert split_layers(3, [1.0, 1.0, 1.0], [9.0, 0.0, 0.0]) == [1, 1, 1]


class _Stage:
    """A stage whose forward + backward time is ``c0 + c1 * rows * length + c2 * attention``."""

    def __init__(self, c0: float, c1: float, c2: float, exact: bool = True) -> None:
        self.c, self.exact = (c0, c1, c2), exact

    def time(self, rows: int, length: int, sq: float | None = None) -> float:
        q = rows * length * length if sq is None else sq
        return self.c[0] + self.c[1] * rows * length + self.c[2] * q

    def time_line(self):
        return self.c if self.exact else None


@pytest.mark.parametrize("exact", [True, False])
def test_pipeline_cost_is_the_bottleneck_per_micro_batch_plus_one_fill(exact: bool) -> None:
    stages = [_Stage(1.0, 0.01, 0.0, exact), _Stage(0.5, 0.02, 1e-5, exact), _Stage(2.0, 0.0, 0.0, exact)]
    link = Link("inter", 1000.0, 0.25)
    cost = CostModel(p2p_efficiency=0.5)
    pc = PipelineCost(stages, [link, link], 4, cost)
    shapes = [(1, 100), (2, 50), (1, 400)]

    def parts(r, s, sq=None):
        ts = [st.time(r, s, sq) for st in stages]
        p2p = 2 * 2 * (0.25 + r * s * 4 * 2 / 500.0)  # both directions over 2 boundaries, bf16 activations
        return max(ts), sum(ts) - max(ts) + p2p

    for r, s in shapes:
        assert pc.parts(r, s) == (close(parts(r, s)[0]), close(parts(r, s)[1]))
    assert pc.parts(1, 100, 5000.0) == (close(parts(1, 100, 5000.0)[0]), close(parts(1, 100, 5000.0)[1]))
    want = sum(parts(r, s)[0] for r, s in shapes) + max(parts(r, s)[1] for r, s in shapes)
    assert pc.time(shapes) == close(want)
    assert pc.time([]) == 0.0
    rows, lengths = [r for r, _ in shapes], [s for _, s in shapes]
    total, top, fill = pc.totals(rows, lengths)
    b = [parts(r, s)[0] for r, s in shapes]
    k = int(np.argmax([r * s for r, s in shapes]))  # the largest micro-batch's fill, and every other stage
    rest = max(sum(st.time(r, s) for st in stages) - parts(r, s)[0] for r, s in shapes)
    assert (total, top, fill) == (close(sum(b)), close(max(b)), close(max(rest, parts(*shapes[k])[1])))
    sq = [1e4, 2e4, 3e4]
    total, top, fill = pc.totals([1, 1, 1], [100, 100, 400], sq)
    b = [parts(1, s, q)[0] for s, q in zip([100, 100, 400], sq)]
    assert (total, top) == (close(sum(b)), close(max(b)))
    assert fill == close(parts(1, 400, 3e4)[1])
    assert pc.totals([], []) == (0.0, 0.0, 0.0)


MODEL = LlamaConfig.preset("llama-7b")
CLUSTER = Cluster.mixed({"H800": 8, "H20": 8})


def _strategy(devices, layers, stages_per=None) -> Strategy:
    return Strategy.load({"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1, "stages": [
        {"devices": d, "layers": list(l)} for d, l in zip(devices, layers)]}]})


def test_stage_cost_lines_are_the_analytic_flops() -> None:
    cost = CostModel(comm_scale=0.0, include_embedding=False)
    st = _strategy([[8, 9]], [(0, 3)]).pipelines[0].stages[0]  # 4 layers, TP2 on H20
    sc = StageCost(MODEL, st, False, False, CLUSTER, cost)
    assert sc.exact
    h, kv, f = MODEL.hidden_size, MODEL.kv_dim, MODEL.ffn_hidden_size
    rate = CLUSTER.devices["H20"].bf16_tflops * 1e12 * cost.default_mfu
    per_token = 2 * (2 * h * h + 2 * h * kv + 3 * h * f) * 4 / 2 / rate  # forward seconds per token
    per_sq = 4 * h * 4 / 2 / rate  # forward seconds per rows * length^2
    c0, c1, c2 = sc.time_line()
    assert c0 == close(0.0, abs=1e-12) and c1 == close(3 * per_token, rel=1e-6) and c2 == close(3 * per_sq, rel=1e-6)
    f1, b1 = sc.times(2, 300)
    assert f1 == close(per_token * 600 + per_sq * 2 * 300 * 300, rel=1e-9) and b1 == close(2 * f1, rel=1e-9)
    assert sc.time(2, 300) == close(3 * f1, rel=1e-9)
    packed = sc.times(1, 600, 300 * 300 * 2)  # two 300-token documents in one row: attention per document
    assert packed[0] == close(f1, rel=1e-9)
    act, transient = sc.memory(2, 300)
    assert act == close(4 * MODEL.layer_activation_bytes(600) / 2, rel=1e-6) and transient == close(0.0, abs=1e-3)
    assert sc.params == close(4 * MODEL.layer_param_count() / 2)
    static = sum(static_memory(sc.params, 1).values())
    held = 3
    need = static + held * sc.memory(1, 4096)[0] + sc.memory(1, 4096)[1]
    assert sc.fits(4096, held, 1, need * 1.0001) and not sc.fits(4096, held, 1, need * 0.9999)
    assert sc.fits(4096, held, 2, need * 0.9999)  # ZeRO-1 over 2 halves the optimizer state


def test_pipeline_cost_of_a_strategy_and_its_shared_stage_cache() -> None:
    cost = CostModel()
    s = _strategy([[0, 1], [2, 3], [8, 9]], [(0, 9), (10, 19), (20, 31)])
    cache: dict = {}
    pc = PipelineCost.of(MODEL, s.pipelines[0], CLUSTER, cost, cache)
    assert len(pc.stages) == 3 and len(cache) == 3
    assert [cl.cls for cl in pc._links] == ["intra", "inter"]
    # boundary links: the slowest link between the stages' devices
    assert pc._links[1].bandwidth == min(CLUSTER.link(a, b).bandwidth for a, b in zip([2, 3], [8, 9]))
    again = PipelineCost.of(MODEL, s.pipelines[0], CLUSTER, cost, cache)
    assert [a is b for a, b in zip(again.stages, pc.stages)] == [True, True, True]
    first = pc.stages[0]
    assert first.params > pc.stages[1].params  # the embedding is held by the first stage
    assert pc.stages[2].params == close(12 * MODEL.layer_param_count() / 2 + MODEL.head_param_count() / 2)
    alone = PipelineCost.of(MODEL, s.pipelines[0], CLUSTER, cost)
    assert pc.time([(1, 512)]) == close(alone.time([(1, 512)]))


def test_switch_estimate_by_hand() -> None:
    cl = Cluster.local(4, kind="H800")
    L = MODEL.num_layers
    lp, ep, hp = MODEL.layer_param_count(), MODEL.embedding_param_count(), MODEL.head_param_count()
    whole = L * lp + ep + hp
    tp2 = _strategy([[0, 1]], [(0, L - 1)])
    tp1 = _strategy([[0]], [(0, L - 1)])
    pp = _strategy([[0], [1]], [(0, L // 2 - 1), (L // 2, L - 1)])
    link = cl.link(0, 3)
    cost = CostModel()
    assert switch_estimate(MODEL, cl, tp2, tp2) == 0.0
    # TP2 -> TP1: device 0 holds half of everything and needs the other half
    assert switch_estimate(MODEL, cl, tp2, tp1, cost) == close(cost.p2p_time(whole / 2 * 2, link))
    # TP1 -> TP2: device 1 lacks its whole half; device 0 already has its half
    assert switch_estimate(MODEL, cl, tp1, tp2, cost) == close(cost.p2p_time(whole / 2 * 2, link))
    # TP1 -> PP2: device 1 lacks the second half of the layers and the head
    assert switch_estimate(MODEL, cl, tp1, pp, cost) == close(cost.p2p_time((L // 2 * lp + hp) * 2, link))
    # PP2 -> TP2: device 0 has layers 0..L/2-1 and the embedding whole; it needs half of every unit
    need0 = (L - L // 2) * lp / 2 + hp / 2
    need1 = (L // 2) * lp / 2 + ep / 2
    assert switch_estimate(MODEL, cl, pp, tp2, cost) == close(cost.p2p_time(max(need0, need1) * 2, link))
    assert switch_estimate(MODEL, Cluster.local(1, kind="H800"), _strategy([[0]], [(0, L - 1)]),
                           _strategy([[0]], [(0, L - 2)])) == 0.0
    moved = _strategy([[2, 3]], [(0, L - 1)])
    assert switch_estimate(MODEL, cl, tp2, moved) == close(CostModel().p2p_time(whole / 2 * 2, link))


@pytest.mark.parametrize("recompute", [False, True])
def test_a_cp_stage_is_lines_plus_the_rings_exposed_part(recompute: bool) -> None:
    """A CP2 stage's cost is affine in the shape's features plus ``max(0, gap)`` of the ring (its transfers less the
    attention compute they overlap, forward and backward; the backward pays the forward's again when it
    recomputes): the fitted lines with the maxima reproduce the simulator's stage cost at shapes where the gap
    is positive (short sequences on a slow link) and negative (long ones), scalar and vectorised; no single line
    (``time_line`` is ``None``)."""
    from hspmd_sdk.planner.cost import LinkOverride
    from hspmd_sdk.planner.simulator import _stage_cost

    cost = CostModel(link_overrides={"intra": LinkOverride(latency=1e-4, bandwidth=2e10)})
    st = Strategy.load({"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1, "stages": [
        {"devices": [8, 9], "layers": [0, 3], "cp": 2, "recompute": recompute}]}]}).pipelines[0].stages[0]
    sc = StageCost(MODEL, st, True, True, CLUSTER, cost, balanced=True)
    assert sc.exact and sc.time_line() is None
    gaps = []
    for rows, length in [(1, 256), (2, 1000), (1, 2048), (3, 3000), (1, 8192), (1, 32768)]:
        d = _stage_cost(MODEL, st, True, True, CLUSTER, rows, length, cost, balanced=True)
        gaps.append(d.ring_gap_fwd)
        assert sc.times(rows, length) == (close(d.fwd, rel=1e-9), close(d.bwd, rel=1e-9))
        assert sc.memory(rows, length) == (close(d.act_per_mb, rel=1e-9), close(d.transient, rel=1e-9, abs=1e-6))
        vec = sc.time_vec(np.array([rows * length], dtype=float), np.array([rows * length * length], dtype=float))
        assert vec[0] == close(d.fwd + d.bwd, rel=1e-9)
    assert min(gaps) < 0 < max(gaps)
    one = PipelineCost([sc], [], MODEL.hidden_size, cost)  # the vectorised totals take the same figures
    total, top, fill = one.totals([1, 2, 1], [256, 1000, 32768])
    assert total == close(sum(sc.time(r, s) for r, s in [(1, 256), (2, 1000), (1, 32768)]), rel=1e-9)


def test_fits_is_static_plus_held_activations_plus_transient_at_most_capacity() -> None:
    # the last stage holds the head: its logits are a transient of hundreds of MB (not ~0 as in a middle stage)
    st = _strategy([[8, 9]], [(0, 3)]).pipelines[0].stages[0]
    sc = StageCost(MODEL, st, False, True, CLUSTER, CostModel())
    act, transient = sc.memory(1, 4096)
    assert transient > 1e8
    static = sum(static_memory(sc.params, 1).values())
    need = static + act * 3 + transient
    assert sc.fits(4096, 3, 1, need)                  # at most capacity: equal fits
    assert not sc.fits(4096, 3, 1, need - 1.0)
    assert not sc.fits(4096, 3, 1, static + act * 3)  # without room for the transient


def test_a_shared_stage_cache_keeps_first_middle_and_last_stages_apart() -> None:
    # four equal stages (TP2 on H20, 8 layers each): the first holds the embedding, the last the head, the middle
    # two neither; a cache shared by stage shape must give each the cost it gets without a cache
    s = _strategy([[8, 9], [10, 11], [12, 13], [14, 15]], [(0, 7), (8, 15), (16, 23), (24, 31)])
    cost = CostModel()
    cache: dict = {}
    shared = PipelineCost.of(MODEL, s.pipelines[0], CLUSTER, cost, cache)
    alone = [StageCost(MODEL, st, j == 0, j == 3, CLUSTER, cost) for j, st in enumerate(s.pipelines[0].stages)]
    assert [sc.params for sc in shared.stages] == [sc.params for sc in alone]
    assert [sc.time(1, 512) for sc in shared.stages] == [sc.time(1, 512) for sc in alone]
    assert shared.stages[1] is shared.stages[2] and len(cache) == 3
    mid = alone[1].params
    assert alone[0].params == close(mid + MODEL.embedding_param_count() / 2)
    assert alone[3].params == close(mid + MODEL.head_param_count() / 2)


def test_a_context_parallel_pipeline_is_priced_in_the_balanced_order() -> None:
    from hspmd_sdk.planner.cost import LinkOverride

    cost = CostModel(link_overrides={"intra": LinkOverride(latency=1e-4, bandwidth=2e10)})
    s = Strategy.load({"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1, "stages": [
        {"devices": [8, 9], "layers": [0, 15], "cp": 2}, {"devices": [10, 11], "layers": [16, 31], "cp": 2}]}]})
    p = s.pipelines[0]
    assert p.cp_balance == 2
    pc = PipelineCost.of(MODEL, p, CLUSTER, cost)
    balanced = StageCost(MODEL, p.stages[0], True, False, CLUSTER, cost, balanced=True)
    contiguous = StageCost(MODEL, p.stages[0], True, False, CLUSTER, cost, balanced=False)
    assert balanced.time(1, 4096) != contiguous.time(1, 4096)   # the causal work splits evenly only when balanced
    assert pc.stages[0].time(1, 4096) == balanced.time(1, 4096)


class _Units:
    """A model of 2 layers of 100 parameters, an embedding of 10 and a head of 20 (what _holdings reads)."""

    num_layers = 2

    def layer_param_count(self) -> int:
        return 100

    def embedding_param_count(self) -> int:
        return 10

    def head_param_count(self) -> int:
        return 20


def test_switch_estimate_by_hand_on_a_small_model() -> None:
    model, cost = _Units(), CostModel()
    cl = Cluster.mixed({"H800": 3}, per_node=2)                 # ranks 0, 1 on one node, rank 2 on another
    assert cl.node_index(0) == cl.node_index(1) != cl.node_index(2)
    inter = cl.link(0, 2)                                        # the last rank is on the other node
    tp2 = _strategy([[0, 1]], [(0, 1)])
    # TP2 on ranks 0, 1 -> everything on rank 1: rank 1 keeps its half [1/2, 1) of each unit, needs the other
    # half of 230 parameters: 115 x 2 bytes
    on1 = _strategy([[1]], [(0, 1)])
    assert switch_estimate(model, cl, tp2, on1, cost) == close(cost.p2p_time(115 * 2, inter))
    # nothing moves when only the micro-batching changes
    more = Strategy.load({"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 4, "stages": [
        {"devices": [0, 1], "layers": [0, 1]}]}]})
    assert switch_estimate(model, cl, tp2, more, cost) == 0.0
    # one parameter to move (a 1-parameter embedding on a new first stage) still costs a transfer
    tiny = _Units()
    tiny.embedding_param_count = lambda: 1               # type: ignore[method-assign]
    tiny.layer_param_count = lambda: 0                   # type: ignore[method-assign]
    tiny.head_param_count = lambda: 0                    # type: ignore[method-assign]
    a, b = _strategy([[0]], [(0, 1)]), _strategy([[2]], [(0, 1)])
    assert switch_estimate(tiny, cl, a, b, cost) == close(cost.p2p_time(1 * 2, inter)) and cost.p2p_time(2, inter) > 0
    # two ranks: still a switch (rank 1 needs rank 0's layers)
    two = Cluster.local(2, kind="H800")
    assert switch_estimate(model, two, _strategy([[0]], [(0, 1)]), _strategy([[1]], [(0, 1)]), cost) == \
        close(cost.p2p_time(230 * 2, two.link(0, 1)))


def test_the_fit_check_is_relative_1e6_of_the_cost_model() -> None:
    from hspmd_sdk.planner.mixed_cost import _close

    assert _close((0.02 + 1.9e-8,), (0.02,)) and not _close((0.02 + 1e-7,), (0.02,))    # 1e-6 x 0.02 = 2e-8
    assert _close((1e9 + 999.0,), (1e9,)) and not _close((1e9 + 1001.0,), (1e9,))
    assert _close((0.0,), (0.0,)) and not _close((1e-9,), (0.0,))                     # no absolute slack to speak of
    assert not _close((1.0, 2.0), (1.0, 2.1))
    tol = 1e-6 * 1e-12 + 1e-15
    assert _close((tol,), (0.0,))                                                      # at most the tolerance


def test_a_packed_rows_fill_uses_its_own_attention_term() -> None:
    # two stand-in stages, no boundary link: A = tokens + 1e-3 attention, B = 2 tokens + 1e-3 attention.  One row
    # packing two 300-token documents: attention 2 x 300^2 = 180000 (not 600^2): A = 780, B = 1380 (the bottleneck),
    # so the fill and drain is A's 780 (with 600^2 it would be 960)
    pc = PipelineCost([_Stage(0.0, 1.0, 1e-3), _Stage(0.0, 2.0, 1e-3)], [], 4, CostModel())
    assert pc.totals([1], [600], [180000.0]) == (close(1380.0), close(1380.0), close(780.0))
    assert pc.totals([1], [600]) == (close(1560.0), close(1560.0), close(960.0))


def test_a_stage_time_line_is_its_time() -> None:
    # TP2 with the cost model's collectives: the line has a constant term (latencies), forward and backward
    st = _strategy([[8, 9]], [(0, 3)]).pipelines[0].stages[0]
    sc = StageCost(MODEL, st, False, False, CLUSTER, CostModel())
    c0, c1, c2 = sc.time_line()
    assert c0 > 0
    for r, s in [(1, 512), (2, 3000), (4, 128)]:
        assert c0 + c1 * r * s + c2 * r * s * s == close(sc.time(r, s), rel=1e-9)


def test_a_pipeline_of_mixed_context_parallelism_is_priced_contiguous() -> None:
    from hspmd_sdk.planner.cost import LinkOverride

    cost = CostModel(link_overrides={"intra": LinkOverride(latency=1e-4, bandwidth=2e10)})
    p = Strategy.load({"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1, "stages": [
        {"devices": [8, 9], "layers": [0, 15], "cp": 2}, {"devices": [10], "layers": [16, 31]}]}]}).pipelines[0]
    assert p.cp_balance == 1                            # not every stage splits the sequence alike
    contiguous = StageCost(MODEL, p.stages[0], True, False, CLUSTER, cost, balanced=False)
    assert StageCost(MODEL, p.stages[0], True, False, CLUSTER, cost).time(1, 4096) == contiguous.time(1, 4096)
    assert PipelineCost.of(MODEL, p, CLUSTER, cost).stages[0].time(1, 4096) == contiguous.time(1, 4096)
    assert contiguous.time(1, 4096) != StageCost(MODEL, p.stages[0], True, False, CLUSTER, cost, balanced=True).time(
        1, 4096)


def test_the_stage_cache_keeps_nodes_of_different_occupancy_apart() -> None:
    # one core per node: rank 0 shares its node with rank 1 (compute at half speed), rank 2 is alone on its node
    cl = Cluster.mixed({"cpu": 3}, per_node=2)
    tiny = LlamaConfig.preset("tiny")
    cost = CostModel(cores=1)
    s = Strategy.load({"pipelines": [
        {"micro_batch_size": 1, "num_micro_batches": 1, "stages": [{"devices": [0], "layers": [0, 1]}]},
        {"micro_batch_size": 1, "num_micro_batches": 1, "stages": [{"devices": [2], "layers": [0, 1]}]}]})
    cache: dict = {}
    shared = [PipelineCost.of(tiny, p, cl, cost, cache).stages[0].time(1, 64) for p in s.pipelines]
    alone = [StageCost(tiny, p.stages[0], True, True, cl, cost).time(1, 64) for p in s.pipelines]
    assert shared == alone and alone[0] > alone[1] and len(cache) == 2


# ---- stand-in cost models: StageCost over a stage cost of a known form ------------------------------------------
def _fake_stage_cost(monkeypatch, *, fwd=None, bwd=None, act=None, transient=None, gap_f=None, gap_b=None,
                     comm_f=None, comm_b=None):
    """Replace the simulator's stage cost (what StageCost samples) by one whose quantities are the given functions of
    ``(tokens, rows * length**2)`` (default 0; the forward and backward seconds include ``max(0, gap)`` as the
    simulator's do).  Returns a middle stage of 4 layers (TP2 on H20) to build a StageCost of."""
    from hspmd_sdk.planner import mixed_cost
    from hspmd_sdk.planner.simulator import _StageCost

    zero = lambda x1, x2: 0.0  # noqa: E731
    fwd, bwd, act, transient = fwd or zero, bwd or zero, act or zero, transient or zero
    gap_f, gap_b, comm_f, comm_b = gap_f or zero, gap_b or zero, comm_f or zero, comm_b or zero

    def stage_cost(model, stage, first, last, cluster, rows, length, cost, share=None, *, balanced=False):
        x1, x2 = float(rows * length), float(rows) * length * length
        gf, gb = gap_f(x1, x2), gap_b(x1, x2)
        return _StageCost(fwd=fwd(x1, x2) + max(0.0, gf), bwd=bwd(x1, x2) + max(0.0, gb), act_per_mb=act(x1, x2),
                          transient=transient(x1, x2), units=((("layer", 0), 100.0),), fwd_comm=comm_f(x1, x2),
                          bwd_comm=comm_b(x1, x2), ring_gap_fwd=gf, ring_gap_bwd=gb, recompute=False)

    monkeypatch.setattr(mixed_cost, "_stage_cost", stage_cost)
    return _strategy([[8, 9]], [(0, 3)]).pipelines[0].stages[0]


def test_a_forward_only_ring_gap_makes_the_stage_no_single_line(monkeypatch) -> None:
    """Pins StageCost._gaps over BOTH ring gaps: a stage whose forward ring gap is a non-zero line and whose backward
    gap is 0 is still lines plus a maximum, so time_line() is None (a line would miss max(0, gap))."""
    st = _fake_stage_cost(monkeypatch, fwd=lambda x1, x2: 1e-6 * x1, bwd=lambda x1, x2: 2e-6 * x1,
                          gap_f=lambda x1, x2: 1e-3 - 1e-6 * x1)
    sc = StageCost(MODEL, st, False, False, CLUSTER, CostModel())
    assert sc.exact and sc.time_line() is None
    for r, s in [(1, 256), (1, 4096)]:                   # gap 0.744e-3 > 0, then -3.1e-3 < 0
        x1 = r * s
        assert sc.time(r, s) == close(3e-6 * x1 + max(0.0, 1e-3 - 1e-6 * x1), rel=1e-9)


_COMM_F = lambda x1, x2: 1e-4 + 1e-8 * x1 + 1e-11 * x2   # noqa: E731  an affine collective with an attention term
_COMM_B = lambda x1, x2: 2 * _COMM_F(x1, x2)             # noqa: E731  the backward's: twice the forward's


def test_comm_of_a_packed_row_uses_its_attention_term(monkeypatch) -> None:
    """Pins StageCost.comm on an exact stage: the collectives' lines (forward and backward checked each against its
    own figure) evaluated with a packed row's ``sq`` -- not the padded row's cost (attention over the whole row)."""
    st = _fake_stage_cost(monkeypatch, fwd=lambda x1, x2: 1e-6 * x1 + 1e-9 * x2, comm_f=_COMM_F, comm_b=_COMM_B)
    sc = StageCost(MODEL, st, False, False, CLUSTER, CostModel())
    assert sc.exact
    sq = 2 * 300.0 ** 2                                       # two 300-token documents in one 600-token row
    assert sc.comm(1, 600, sq) == (close(_COMM_F(600, sq), rel=1e-9), close(_COMM_B(600, sq), rel=1e-9))
    assert sc.comm(1, 600) == (close(_COMM_F(600, 360000.0), rel=1e-9), close(_COMM_B(600, 360000.0), rel=1e-9))
    assert sc.comm(1, 600, sq)[0] < sc.comm(1, 600)[0] * 0.99  # the two differ by far more than the tolerance


def test_comm_of_a_stage_whose_collectives_are_no_line_is_evaluated_per_shape(monkeypatch) -> None:
    """Pins StageCost.comm's fallback: collectives that are not affine (here ~ sqrt(tokens)) are the cost model's
    own figures at each shape, not the fitted line."""
    import math

    st = _fake_stage_cost(monkeypatch, fwd=lambda x1, x2: 1e-6 * x1, comm_f=lambda x1, x2: 1e-4 * math.sqrt(x1),
                          comm_b=lambda x1, x2: 3e-4 * math.sqrt(x1))
    sc = StageCost(MODEL, st, False, False, CLUSTER, CostModel())
    assert sc.exact                                           # the times are lines; the collectives are not
    assert sc.comm(3, 1000) == (close(1e-4 * math.sqrt(3000), rel=1e-12), close(3e-4 * math.sqrt(3000), rel=1e-12))


def test_comm_of_a_stage_whose_times_are_no_line_is_evaluated_per_shape(monkeypatch) -> None:
    """Pins that the collectives' lines are used only when the times' lines are exact too: with non-affine times
    (~ tokens**1.5) but affine collectives, a packed row's comm is the padded row's evaluated cost (as its times)."""
    st = _fake_stage_cost(monkeypatch, fwd=lambda x1, x2: 1e-9 * x1 ** 1.5, comm_f=_COMM_F, comm_b=_COMM_B)
    sc = StageCost(MODEL, st, False, False, CLUSTER, CostModel())
    assert not sc.exact
    sq = 2 * 300.0 ** 2
    assert sc.comm(1, 600, sq) == (close(_COMM_F(600, 360000.0), rel=1e-12), close(_COMM_B(600, 360000.0), rel=1e-12))


def test_memory_and_time_of_a_packed_row_use_its_attention_term(monkeypatch) -> None:
    """Pins that StageCost.memory and StageCost.time pass a packed row's ``sq`` on: with kept bytes that grow with
    the attention term (scores kept, as without flash attention) and times with an attention term, a row packing
    two 300-token documents costs the sum of its documents' attention, not 600**2."""
    st = _fake_stage_cost(monkeypatch, fwd=lambda x1, x2: 1e-6 * x1 + 1e-9 * x2, bwd=lambda x1, x2: 2e-9 * x2,
                          act=lambda x1, x2: 1000.0 * x1 + 2.0 * x2, transient=lambda x1, x2: 5.0 * x2)
    sc = StageCost(MODEL, st, False, False, CLUSTER, CostModel())
    assert sc.exact
    sq = 2 * 300.0 ** 2
    act, transient = sc.memory(1, 600, sq)
    assert act == close(1000.0 * 600 + 2.0 * sq, rel=1e-9) and transient == close(5.0 * sq, rel=1e-9)
    assert sc.memory(1, 600)[0] == close(1000.0 * 600 + 2.0 * 360000, rel=1e-9)
    assert sc.time(1, 600, sq) == close(1e-6 * 600 + 3e-9 * sq, rel=1e-9)
    assert sc.time(1, 600, sq) == close(sum(sc.times(1, 600, sq)), rel=1e-12)
    assert sc.time(1, 600) == close(1e-6 * 600 + 3e-9 * 360000, rel=1e-9)


class _Counting(_Stage):
    """A stand-in stage that counts its per-shape evaluations (``time``); ``vec``: it also has ``time_vec`` (a
    CP stage: no single line, but vectorised lines plus maxima -- here the same line)."""

    def __init__(self, c0: float, c1: float, c2: float, exact: bool, vec: bool) -> None:
        super().__init__(c0, c1, c2, exact)
        self.calls = 0
        if vec:
            self.time_vec = lambda tokens, attention: self.c[0] + self.c[1] * tokens + self.c[2] * attention

    def time(self, rows: int, length: int, sq: float | None = None) -> float:
        self.calls += 1
        return super().time(rows, length, sq)


@pytest.mark.parametrize("exact, vec", [(True, False), (False, True)])
def test_totals_are_vectorised_over_the_micro_batches(exact: bool, vec: bool) -> None:
    """Pins PipelineCost.totals' vectorised paths: stages with time lines (stacked once), or with time_vec (CP
    stages), are evaluated for all micro-batches at once -- each stage's per-shape ``time`` runs only for the one
    fill micro-batch (through ``parts``), not once per micro-batch as for stages with neither -- and the figures
    are the per-shape ones."""
    stages = [_Counting(1.0, 0.01, 1e-5, exact, vec), _Counting(0.5, 0.02, 0.0, exact, vec)]
    pc = PipelineCost(stages, [], 4, CostModel())
    rows, lengths = [1, 2, 1, 3, 1], [100, 50, 400, 30, 10]
    want = [max(st.c[0] + st.c[1] * r * s + st.c[2] * r * s * s for st in stages) for r, s in zip(rows, lengths)]
    total, top, _ = pc.totals(rows, lengths)
    assert (total, top) == (close(sum(want)), close(max(want)))
    assert [st.calls for st in stages] == [1, 1]
    plain = [_Counting(1.0, 0.01, 1e-5, False, False), _Counting(0.5, 0.02, 0.0, False, False)]
    assert PipelineCost(plain, [], 4, CostModel()).totals(rows, lengths)[:2] == (close(sum(want)), close(max(want)))
    assert [st.calls for st in plain] == [len(rows) + 1] * 2     # the fallback: every shape, and the fill
