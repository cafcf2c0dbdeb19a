"""The per-step interface of scenario (c): dispatch (every sequence exactly once, padded micro-batches within the
window, the cheapest candidate, clear errors), the cost of a padded micro-batch (against a hand count), the mixed
simulator (against the step simulator, and per micro-batch shape), the switch estimate (by hand) and the HotSPa
baseline."""
from __future__ import annotations

import math
import pickle
import random

import pytest

from hspmd_sdk import LlamaConfig, Strategy
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.planner import (Dispatcher, dispatch, plan_hotspa, plan_mixed, simulate, simulate_dispatch,
                               simulate_hotspa, simulate_shapes, switch_estimate)
from hspmd_sdk.planner.cost import CostModel
from hspmd_sdk.planner.mixed import MixedEntry, MixedPlan, sample_batch, sample_lengths
from hspmd_sdk.planner.mixed_cost import StageCost
from hspmd_sdk.planner.mixed_sim import pack
from hspmd_sdk.planner.simulator import _stage_cost

MODEL = LlamaConfig.preset("llama-7b")
CLUSTER = Cluster.mixed({"H800": 8, "H20": 8})
CONTEXT = 8192
TOKENS = 65536


@pytest.fixture(scope="module")
def lengths() -> list[int]:
    return sample_lengths(2000, CONTEXT, seed=2, median=600)


@pytest.fixture(scope="module")
def plan(lengths: list[int]) -> MixedPlan:
    return plan_mixed(MODEL, CLUSTER, lengths, tokens_per_batch=TOKENS, context_len=CONTEXT)


@pytest.fixture(scope="module")
def dispatcher(plan: MixedPlan) -> Dispatcher:
    return Dispatcher(plan, MODEL, CLUSTER)


def _stage(devices: list[int], layers: tuple[int, int]) -> Strategy:
    return Strategy.load({"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1, "stages": [
        {"devices": devices, "layers": list(layers)}]}]})


# ---- the cost of one padded micro-batch ---------------------------------------------------------------------------
def test_a_micro_batch_costs_its_padded_shape_with_attention_quadratic() -> None:
    cost = CostModel(comm_scale=0.0, include_embedding=False)
    st = _stage([8, 9, 10, 11], (0, 9)).pipelines[0].stages[0]  # 10 layers, TP4 on H20
    sc = StageCost(MODEL, st, False, False, CLUSTER, cost)
    assert sc.exact
    h, kv, f = MODEL.hidden_size, MODEL.kv_dim, MODEL.ffn_hidden_size
    rate = CLUSTER.devices["H20"].bf16_tflops * 1e12 * cost.default_mfu
    for rows, length in [(1, 8192), (3, 1000), (16, 128), (2, 4097)]:
        tokens = rows * length
        flops = 2 * tokens * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * tokens * length * h  # per row: length^2
        fwd = 10 * flops / 4 / rate
        got_f, got_b = sc.times(rows, length)
        assert got_f == pytest.approx(fwd, rel=1e-9) and got_b == pytest.approx(2 * fwd, rel=1e-9)
    # padding is paid for: two rows padded to 4000 cost more than the 4000- and 100-token sequences apart
    assert sc.time(2, 4000) > sc.time(1, 4000) + sc.time(1, 100)


class _CubicLlama(LlamaConfig):
    """A model whose layer FLOPs are not affine in (tokens, tokens x length): the fitted lines must not be used."""

    def layer_flops(self, tokens: int, seq_len: int | None = None) -> int:
        s = self.max_seq_len if seq_len is None else seq_len
        return super().layer_flops(tokens, seq_len) + tokens * s * s


def test_stage_cost_falls_back_to_the_cost_model_when_not_affine() -> None:
    model = _CubicLlama(**LlamaConfig.preset("llama-7b").model_dump())
    st = _stage([0, 1], (0, 3)).pipelines[0].stages[0]
    sc = StageCost(model, st, True, False, CLUSTER, CostModel())
    assert not sc.exact
    ref = _stage_cost(model, st, True, False, CLUSTER, 3, 5000, CostModel())
    assert sc.times(3, 5000) == (ref.fwd, ref.bwd) and sc.memory(3, 5000) == (ref.act_per_mb, ref.transient)


# ---- dispatch -------------------------------------------------------------------------------------------------------
def test_every_sequence_is_dispatched_exactly_once(dispatcher: Dispatcher, lengths: list[int]) -> None:
    for seed in range(6):
        batch = sample_batch(lengths, TOKENS, seed=seed)
        d = dispatcher(batch)
        assert d.lengths == tuple(batch)
        assert sorted(i for pipe in d.micro_batches for mb in pipe for i in mb) == list(range(len(batch)))
        assert len(d.micro_batches) == d.strategy.dp_degree == len(d.windows) == len(d.pipeline_estimates)
        for pipe, w, shapes in zip(d.micro_batches, d.windows, d.shapes()):
            for mb, (rows, longest) in zip(pipe, shapes):
                assert rows == len(mb) >= 1 and longest == max(batch[i] for i in mb)
                assert rows * longest <= w  # a padded [rows, longest] tensor within the pipeline's token budget
        longest = max(batch)
        for i, (c, e) in enumerate(zip(dispatcher.candidates, d.estimates)):
            assert math.isinf(e) == (c.max_seq_len < longest)
        assert d.max_seq_len >= longest and d.estimate == min(d.estimates)
        assert d.switch == (0.0,) * len(d.estimates)
        for pipe, est, shapes in zip(dispatcher.candidates[d.choice].pipes, d.pipeline_estimates, d.shapes()):
            assert est == pytest.approx(pipe.time(shapes), rel=1e-9)
        assert 0.0 <= d.padding_fraction() < 0.2


def test_dispatch_is_deterministic(plan: MixedPlan, lengths: list[int]) -> None:
    batch = sample_batch(lengths, TOKENS, seed=11)
    first = dispatch(plan, MODEL, CLUSTER, batch)
    assert dispatch(plan, MODEL, CLUSTER, list(batch)) == first
    built = Dispatcher(plan, MODEL, CLUSTER)
    assert built(batch) == first
    assert pickle.loads(pickle.dumps(built))(batch) == first  # a planner process can hold its own Dispatcher
    assert pickle.loads(pickle.dumps(first)) == first


def test_any_model_family_plans_and_dispatches() -> None:
    from hspmd_sdk.models.gpt import GPTConfig

    gpt = GPTConfig.preset("gpt2")  # tied embeddings: the LM head shares the first stage's weight
    plan = plan_mixed(gpt, CLUSTER, [300] * 90 + [1024] * 10, tokens_per_batch=16384, context_len=1024)
    programs = plan.programs(gpt, CLUSTER)
    d = dispatch(programs, gpt, CLUSTER, [1024, 100, 500, 1000])
    assert sorted(i for pipe in d.micro_batches for mb in pipe for i in mb) == [0, 1, 2, 3]
    r = simulate_dispatch(gpt, CLUSTER, d)
    # A 4-sequence step on one 4-stage pipeline (CP2 stages: GPT's vocab-parallel head all-reduces its logits, which
    # the cost model reads off the Program, so TP2 is the dearer way to split): here the estimate is high, not low
    # (simulated / estimated 0.967, deterministic; the tail -- ZeRO-1 gather, sync, optimizer -- agrees exactly):
    # the estimate prices the fill and the drain both at the largest micro-batch, while the replay drains the last
    # one, the shortest (100 tokens; micro-batches run longest first), and with 4 micro-batches on 4 stages the
    # fill and drain are most of the step.  The bounds keep ~3% either side of the figure, so a change of the
    # pipeline or tail cost by 5% or more fails.
    assert not r.oom and 0.94 <= r.step_time / d.estimate <= 0.995


def test_dispatch_balances_identical_pipelines_within_the_lpt_bound() -> None:
    ranks = list(range(8))  # four TP2 pipelines on the H800 node
    strategy = Strategy.load({"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1, "stages": [
        {"devices": ranks[2 * p:2 * p + 2], "layers": [0, MODEL.num_layers - 1]}]} for p in range(4)]})
    entry = MixedEntry(max_seq_len=4096, windows=[4096] * 4, methods=["H800 TP2PP1"] * 4, strategy=strategy)
    d_of = Dispatcher([entry], MODEL, CLUSTER)
    pipe = d_of.candidates[0].pipes[0]
    rng = random.Random(0)
    for _ in range(5):
        batch = [rng.choice([64, 200, 700, 1500, 4096]) for _ in range(rng.randint(5, 40))]
        d = d_of(batch)
        singles = [pipe.time([(1, x)]) for x in batch]
        bound = max(sum(singles) / 4, max(singles))  # no assignment of the sequences can beat this
        assert max(d.pipeline_estimates) <= 4 / 3 * bound + 1e-9


def test_the_switch_cost_enters_the_choice(dispatcher: Dispatcher, lengths: list[int]) -> None:
    batch = sample_batch(lengths, TOKENS, seed=4)
    free = dispatcher(batch)
    for current in range(len(dispatcher.candidates)):
        d = dispatcher(batch, current=current)
        assert d.estimates == free.estimates and d.switch[current] == 0.0
        assert all(s >= 0 for s in d.switch)
        total = [e + s for e, s in zip(d.estimates, d.switch)]
        assert total[d.choice] == min(total)
    assert dispatcher(batch, current=free.choice).choice == free.choice


def test_dispatch_refuses_what_the_data_layer_must_cut(dispatcher: Dispatcher) -> None:
    with pytest.raises(PlanValidationError, match=r"lengths\[2\]: 9000 tokens is longer than the largest "
                                                  r"candidate's context \(8192\).*chunks"):
        dispatcher([100, 200, 9000])
    with pytest.raises(PlanValidationError, match="at least one sequence"):
        dispatcher([])
    with pytest.raises(PlanValidationError, match=r"lengths\[1\]: 0 tokens"):
        dispatcher([5, 0])
    with pytest.raises(PlanValidationError, match="current: 99 is not a candidate"):
        dispatcher([5], current=99)
    entry = MixedEntry(max_seq_len=4096, windows=[2048], strategy=_stage([0, 1], (0, MODEL.num_layers - 1)))
    with pytest.raises(PlanValidationError, match=r"candidates\[0\]\.windows: \[2048\] for 1 pipelines.*4096"):
        Dispatcher([entry], MODEL, CLUSTER)


# ---- the mixed simulator --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule, zero1", [("1f1b", True), ("gpipe", False)])
def test_uniform_shapes_simulate_as_the_step_simulator(schedule: str, zero1: bool) -> None:
    strategy = Strategy.load({"schedule": schedule, "zero1": zero1, "pipelines": [
        {"micro_batch_size": 2, "num_micro_batches": 5, "stages": [
            {"devices": [0, 1, 2, 3], "layers": [0, 13]}, {"devices": [4, 5], "layers": [14, 31]}]},
        {"micro_batch_size": 2, "num_micro_batches": 3, "stages": [
            {"devices": [8, 9, 10, 11], "layers": [0, 9]}, {"devices": [12, 13], "layers": [10, 20]},
            {"devices": [14, 15], "layers": [21, 31], "recompute": True}]}]})
    ref = simulate(MODEL, strategy, CLUSTER, seq_len=1024)
    got = simulate_shapes(MODEL, strategy, CLUSTER, [[(2, 1024)] * 5, [(2, 1024)] * 3])
    assert got.step_time == pytest.approx(ref.step_time, rel=1e-9)
    assert got.pipeline_end == pytest.approx(ref.pipeline_end, rel=1e-9)
    assert got.peak_memory == pytest.approx(ref.peak_memory, rel=1e-9)
    assert got.sync_time == pytest.approx(ref.sync_time, rel=1e-9) and got.oom == ref.oom


def test_each_micro_batch_is_simulated_at_its_own_shape() -> None:
    strategy = _stage([0, 1], (0, MODEL.num_layers - 1))
    shapes = [(1, 8000), (2, 3000), (7, 500), (1, 60)]
    r = simulate_shapes(MODEL, strategy, CLUSTER, [shapes])
    st = strategy.pipelines[0].stages[0]
    expected = 0.0
    for rows, length in shapes:
        sc = _stage_cost(MODEL, st, True, True, CLUSTER, rows, length, CostModel())
        expected += sc.fwd + sc.bwd
    assert r.pipeline_end[0] == pytest.approx(expected, rel=1e-9)
    assert [e.micro_batch for e in r.timeline[0] if e.kind == "F"] == [0, 1, 2, 3]


def test_the_dispatcher_estimate_predicts_the_simulated_step(dispatcher: Dispatcher, lengths: list[int]) -> None:
    for seed in range(3):
        d = dispatcher(sample_batch(lengths, TOKENS, seed=20 + seed))
        r = simulate_dispatch(MODEL, CLUSTER, d)
        assert not r.oom
        # The estimate (sum of the bottleneck stage per micro-batch plus one fill and drain) leaves out the 1F1B
        # replay's stalls where successive micro-batches differ in shape: it is low, never high, on these
        # long-tailed steps (measured simulated / estimated 1.041, 1.036, 1.071; deterministic).  Upper bound 1.1:
        # the stalls stay under 10%.  A pipeline cost 8% too high gives 0.96-0.99 and fails the lower bound.
        assert 1.0 - 1e-9 <= r.step_time / d.estimate <= 1.1


def test_an_idle_pipeline_still_synchronises() -> None:
    strategy = Strategy.load({"pipelines": [
        {"micro_batch_size": 1, "num_micro_batches": 1, "stages": [{"devices": [0, 1], "layers": [0, 31]}]},
        {"micro_batch_size": 1, "num_micro_batches": 1, "stages": [{"devices": [2, 3], "layers": [0, 31]}]}]})
    r = simulate_shapes(MODEL, strategy, CLUSTER, [[(1, 2048), (1, 1024)], []])
    assert r.pipeline_end[1] < r.pipeline_end[0]
    assert any(e.kind == "sync" for e in r.timeline[2]) and not any(e.kind == "F" for e in r.timeline[2])


# ---- switching and HotSPa --------------------------------------------------------------------------------------------
def test_switch_estimate_counts_the_bf16_bytes_a_device_lacks() -> None:
    cl = Cluster.local(4, kind="H800")
    tp2 = _stage([0, 1], (0, MODEL.num_layers - 1))
    tp1 = _stage([0], (0, MODEL.num_layers - 1))
    moved = _stage([2, 3], (0, MODEL.num_layers - 1))
    total = MODEL.num_layers * MODEL.layer_param_count() + MODEL.embedding_param_count() + MODEL.head_param_count()
    cost = CostModel()
    link = cl.link(0, 3)
    assert switch_estimate(MODEL, cl, tp2, tp2, cost) == 0.0
    assert switch_estimate(MODEL, cl, tp2, tp1, cost) == pytest.approx(cost.p2p_time(total / 2 * 2, link))
    assert switch_estimate(MODEL, cl, tp2, moved, cost) == pytest.approx(cost.p2p_time(total / 2 * 2, link))
    assert switch_estimate(MODEL, cl, tp1, tp2, cost) == pytest.approx(cost.p2p_time(total / 2 * 2, link))


def test_hotspa_runs_its_buckets_in_turn_and_switches_between_them(lengths: list[int]) -> None:
    cl = Cluster.homogeneous("H20", 16)
    hp = plan_hotspa(MODEL, cl, lengths, tokens_per_batch=TOKENS, context_len=CONTEXT, buckets=[2048, CONTEXT],
                     steps=2)
    assert hp.buckets == [2048, CONTEXT] and len(hp.strategies) == 2
    batch = [100, 1500, 2048, 3000, 8192, 700]
    step = simulate_hotspa(MODEL, cl, hp, batch)
    expected = []
    for k, seqs in enumerate(([100, 1500, 2048, 700], [3000, 8192])):
        s = hp.strategies[k]
        per = math.ceil(len(pack(seqs, hp.buckets[k])) / s.dp_degree)
        s = s.model_copy(update={"pipelines": [p.model_copy(update={"num_micro_batches": per})
                                               for p in s.pipelines]})
        r = simulate(MODEL, s, cl, seq_len=hp.buckets[k])
        expected.append(r.step_time - r.sync_time)
    assert step.compute == pytest.approx(tuple(expected), rel=1e-9)
    sw = switch_estimate(MODEL, cl, hp.strategies[0], hp.strategies[1]) + \
        switch_estimate(MODEL, cl, hp.strategies[1], hp.strategies[0])
    assert step.switch == pytest.approx(sw) and step.step_time == pytest.approx(sum(expected) + sw + step.sync)
    short = simulate_hotspa(MODEL, cl, hp, [100, 200, 300])
    assert len(short.compute) == 1 and short.switch == 0.0


# ---- shared cores (CostModel.cores: local CPU workers) --------------------------------------------------------------
LOCAL = Cluster.local(4)
TINY = LlamaConfig.preset("tiny")
SHARED = CostModel(cores=2)


@pytest.mark.parametrize("pipelines", [
    [[[0], [1]], [[2], [3]]],            # DP2 x PP2: a bubble frees a core for the other pipeline
    [[[0, 1], [2, 3]]],                  # TP2 x PP2: the TP collectives are not stretched
    [[[0]], [[1]], [[2]], [[3]]],        # DP4: every rank computes at once, the bound is exact
])
def test_shared_cores_simulate_shapes_as_the_step_simulator(pipelines: list[list[list[int]]]) -> None:
    layers = TINY.num_layers
    strategy = Strategy.load({"zero1": False, "pipelines": [
        {"micro_batch_size": 2, "num_micro_batches": 3, "stages": [
            {"devices": devs, "layers": [j * layers // len(p), (j + 1) * layers // len(p) - 1]}
            for j, devs in enumerate(p)]} for p in pipelines]})
    ref = simulate(TINY, strategy, LOCAL, seq_len=64, cost=SHARED)
    got = simulate_shapes(TINY, strategy, LOCAL, [[(2, 64)] * 3] * len(pipelines), cost=SHARED)
    assert got.step_time == pytest.approx(ref.step_time, rel=1e-9)
    assert got.pipeline_end == pytest.approx(ref.pipeline_end, rel=1e-9)
    bound = simulate_shapes(TINY, strategy, LOCAL, [[(2, 64)] * 3] * len(pipelines), cost=CostModel())
    if len(pipelines[0]) > 1:  # processor sharing: faster than every rank at the shared rate all the time ...
        assert got.step_time < 2 * bound.step_time * (1 - 1e-3)
    assert got.step_time >= bound.step_time * (1 - 1e-9)  # ... and never faster than a core each


def test_shared_cores_dispatch_prices_each_candidate_by_its_simulated_step() -> None:
    entries, lengths = _two_entries(), LENGTHS
    for packing in (False, True):
        d = Dispatcher(entries, TINY, LOCAL, cost=SHARED, packing=packing)(lengths)
        for i, e in enumerate(entries):
            alone = Dispatcher([e], TINY, LOCAL, cost=SHARED, packing=packing)(lengths)
            sim = simulate_dispatch(TINY, LOCAL, alone, cost=SHARED).step_time
            assert d.estimates[i] == pytest.approx(sim, rel=1e-12)
        assert d.choice == min(range(2), key=lambda i: d.estimates[i])
    # without cores the estimate is the cost lines' (bottleneck sum plus fill): not the simulation's replay
    lines = Dispatcher(entries, TINY, LOCAL, cost=CostModel())(lengths)
    assert lines.estimate == pytest.approx(max(lines.pipeline_estimates) + _tail(entries[lines.choice]), rel=1e-9)


def test_packed_dispatch_prices_the_fewest_rows_beside_the_greedy() -> None:
    """Packed rows: beside :func:`_assign` (a row opened wherever a dedicated device's bubble says so) the dispatcher
    prices the fewest rows the windows allow (best fit) and keeps the cheaper.  Under shared cores a DP2 x PP2
    pipeline's bubble is the other pipeline's compute: the short workload's fewest rows (2 of 512 tokens a
    pipeline where the greedy opened 5-6) measured 0.155 / 0.188 s a step against packed DP2 x PP2's 0.164 / 0.208."""
    from hspmd_sdk.planner.mixed import _assign, _cost_shapes, _fewest_rows

    pp = _two_entries()[1]
    rng, wins = random.Random(3), set()
    for trial in range(20):
        lengths = [rng.choice([rng.randint(1, 40), rng.randint(30, 64)]) for _ in range(rng.randint(3, 30))]
        window = rng.choice([64, 96, 128, 256])
        entry = pp.model_copy(update={"windows": [window, window]})
        d = Dispatcher([entry], TINY, LOCAL, cost=SHARED, packing=True)
        c = d.candidates[0]
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        fewest, _ = _fewest_rows(c.pipes, c.windows, order, lengths)
        # every sequence once, every row within its window, a row opened only where no row of the pipeline held it
        assert sorted(i for p in fewest for mb in p for i in mb) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in mb) <= window for p in fewest for mb in p)
        assert all(len(p) <= -(-sum(lengths[i] for mb in p for i in mb) // (window // 2)) + 1 for p in fewest)
        greedy, _ = _assign(c.pipes, c.windows, order, lengths, packed=True)
        priced = [simulate_shapes(TINY, pp.strategy, LOCAL, _cost_shapes(m, lengths, True), cost=SHARED).step_time
                  for m in (greedy, fewest)]
        got = d(lengths)
        assert got.estimate == pytest.approx(min(priced), rel=1e-12)
        assert [list(map(list, p)) for p in got.micro_batches] == (greedy if priced[0] <= priced[1] else fewest)
        wins.add(int(priced[1] < priced[0]))
    assert wins == {0, 1}, wins  # each way wins some steps


def _tail(e: MixedEntry) -> float:
    from hspmd_sdk.planner.mixed import _overhead

    return _overhead(simulate_shapes(TINY, e.strategy, LOCAL, [[(1, w)] for w in e.windows], cost=CostModel()))


def test_measured_steps_weigh_each_candidates_estimate() -> None:
    d = Dispatcher(_two_entries(), TINY, LOCAL)
    first = d(LENGTHS)
    assert first.factors == (1.0, 1.0)
    cheap, other = first.choice, 1 - first.choice
    gap = first.estimates[other] / first.estimates[cheap]
    d.observe(cheap, first.estimates[cheap], 3 * gap * first.estimates[cheap])  # 3x slower than the other's estimate
    alone = d(LENGTHS)  # one candidate measured: its error is the machine's, not its own; the choice stands
    assert alone.factors == (1.0, 1.0) and alone.choice == cheap
    d.observe(other, first.estimates[other], first.estimates[other])  # the other measures as estimated
    moved = d(LENGTHS)
    assert moved.factors[cheap] / moved.factors[other] == pytest.approx(3 * gap)
    assert moved.choice == other and moved.estimates == first.estimates  # the estimates are the cost model's
    for _ in range(3):  # the median of the last five: three steps as estimated outweigh the slow one
        d.observe(cheap, 1.0, 1.0)
    back = d(LENGTHS)
    assert back.choice == cheap and back.factors == (1.0, 1.0)
    d.observe(cheap, 0.0, 1.0)  # nothing to learn from a zero estimate
    assert d(LENGTHS).factors == (1.0, 1.0)


def _two_entries() -> list[MixedEntry]:
    dp4 = Strategy.load({"zero1": False, "pipelines": [
        {"micro_batch_size": 1, "num_micro_batches": 1, "stages": [{"devices": [r], "layers": [0, 3]}]}
        for r in range(4)]})
    pp = Strategy.load({"zero1": False, "pipelines": [
        {"micro_batch_size": 1, "num_micro_batches": 1, "stages": [
            {"devices": [2 * i], "layers": [0, 1]}, {"devices": [2 * i + 1], "layers": [2, 3]}]} for i in range(2)]})
    return [MixedEntry(max_seq_len=64, windows=[256] * s.dp_degree, strategy=s, methods=["x"] * s.dp_degree)
            for s in (dp4, pp)]


LENGTHS = [64, 60, 33, 17, 9, 9, 40, 51, 64, 2, 30, 12]


def test_shared_cores_plan_keeps_the_variant_that_simulates_fastest() -> None:
    from hspmd_sdk.planner.mixed import Dispatcher as D, _variants, _default_methods

    model = TINY.model_copy(update={"max_seq_len": 128})
    lengths = sample_lengths(400, 128, seed=3, median=24)
    plan = plan_mixed(model, LOCAL, lengths, tokens_per_batch=512, context_len=128, cost=SHARED, packing=True,
                      boundaries=[32, 64, 128])
    steps = [sample_batch([x for x in lengths if x <= 128], 512, seed=k) for k in range(3)]
    chosen = plan.entries[-1]
    mean = sum(D([chosen], model, LOCAL, cost=SHARED, packing=True)(x).estimate for x in steps) / len(steps)
    # every method set's plan of the longest interval, held to one strategy, simulates no faster than the choice
    for ms in _variants(_default_methods(model, LOCAL, None), True):
        alt = plan_mixed(model, LOCAL, lengths, tokens_per_batch=512, context_len=128, cost=SHARED, packing=True,
                         boundaries=[32, 64, 128], max_seq_lens=[128], methods=ms)
        got = sum(D(alt.entries[-1:], model, LOCAL, cost=SHARED, packing=True)(x).estimate for x in steps) / len(steps)
        assert got >= mean * 0.97, (ms[0] if ms else None, got, mean)
    # consecutive candidates differ: one that runs the next one's strategy at its windows is dropped
    for a, b in zip(plan.entries, plan.entries[1:]):
        assert a.windows != b.windows or a.strategy.model_copy(update={"name": ""}) != \
            b.strategy.model_copy(update={"name": ""})
