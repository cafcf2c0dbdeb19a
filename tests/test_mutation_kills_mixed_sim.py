"""Tests that kill the surviving mutants of :mod:`hspmd_sdk.planner.mixed_sim` (issue 49, mutation testing): the
packing, the HotSPa buckets, plan and step, on the tiny model (fast simulations)."""
from __future__ import annotations

import pytest

from hspmd_sdk import Cluster, LlamaConfig, Strategy
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.planner import mixed_sim
from hspmd_sdk.planner.mixed_sim import HotSPaPlan, _bucketed, _default_buckets, pack, plan_hotspa

TINY = LlamaConfig.preset("tiny")
TWO = Cluster.local(2)


def test_pack_refuses_a_sequence_longer_than_the_window() -> None:
    """The error a user reads names the sequence and the window."""
    with pytest.raises(ValueError, match=r"^a sequence of 9 tokens does not fit a window of 8$"):
        pack([3, 9], 8)


def test_default_buckets_are_table_14s() -> None:
    """4K and 16K below the context, then the context, increasing."""
    assert _default_buckets(32768) == [4096, 16384, 32768]
    assert _default_buckets(8192) == [4096, 8192]
    assert _default_buckets(16384) == [4096, 16384]
    assert _default_buckets(4096) == [4096]
    assert _default_buckets(1000) == [1000]


def test_bucketed_puts_each_length_in_the_first_bucket_that_holds_it_cut_to_the_last() -> None:
    """A length goes to the first bucket at least as long (the last when none), clipped to the last bucket."""
    got = _bucketed([25, 5, 10, 11, 35, 30], [10, 20, 30])
    assert got == [[5, 10], [11], [25, 30, 30]]
    assert _bucketed([7.0], [10]) == [[7]] and isinstance(_bucketed([7.0], [10])[0][0], int)


def test_hotspa_plan_summary_lists_each_bucket_interval_and_its_strategy() -> None:
    hp = plan_hotspa(TINY, TWO, [16, 40, 64], tokens_per_batch=128, context_len=64, buckets=[32, 64], steps=1)
    names = [s.name for s in hp.strategies]
    assert hp.summary() == f"HotSPa plan:\n  (0, 32]: {names[0]}\n  (32, 64]: {names[1]}"
    assert HotSPaPlan(buckets=[8], strategies=hp.strategies[:1]).summary() == f"HotSPa plan:\n  (0, 8]: {names[0]}"


def test_hotspa_plan_refuses_buckets_that_do_not_end_at_the_context() -> None:
    """The message a user reads: the context and the (sorted) buckets given."""
    with pytest.raises(PlanValidationError) as e:
        plan_hotspa(TINY, TWO, [16], tokens_per_batch=64, context_len=64, buckets=[48, 16, 32])
    assert e.value.problems == [("buckets", "the last bucket must end at the context (64); got [16, 32, 48]")]
    assert e.value.what == "HotSPa plan"


def test_hotspa_plan_samples_steps_with_consecutive_seeds_from_the_positive_lengths(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults: 8 steps drawn with seeds 0..7 from the lengths above zero (cut to the context); buckets of Table 14
    (here the context only); ZeRO-1 and 1F1B strategies; three buckets, the last check on the last of them."""
    seen: list = []
    real = mixed_sim.sample_batch

    def spy(lengths, tokens, *, seed=0):  # type: ignore[no-untyped-def]
        seen.append((list(lengths), tokens, seed))
        return real(lengths, tokens, seed=seed)

    monkeypatch.setattr(mixed_sim, "sample_batch", spy)
    hp = plan_hotspa(TINY, TWO, [0, 1, 2, 50, 99], tokens_per_batch=100, context_len=64)
    assert hp.buckets == [64]
    assert seen == [([1, 2, 50, 64], 100, k) for k in range(8)]
    assert all(s.zero1 and s.schedule == "1f1b" for s in hp.strategies)
    seen.clear()
    hp = plan_hotspa(TINY, TWO, [5, 30], tokens_per_batch=60, context_len=64, buckets=[16, 32, 64], steps=2, seed=3,
                     zero1=False)
    assert [s for _, _, s in seen] == [3, 4] and hp.buckets == [16, 32, 64] and len(hp.strategies) == 3
    assert not any(s.zero1 for s in hp.strategies)


def test_hotspa_bucket_strategies_are_named_by_bucket_and_take_one_micro_batch_per_window() -> None:
    """A bucket no step fills is planned for one window; each strategy's name says its bucket."""
    one = Cluster.local(1)
    hp = plan_hotspa(TINY, one, [40], tokens_per_batch=40, context_len=64, buckets=[16, 64], steps=1)
    assert [s.name for s in hp.strategies] == ["HotSPa bucket 0 DP1TP1PP1 on 1 cpu at 16",
                                               "HotSPa bucket 1 DP1TP1PP1 on 1 cpu at 64"]
    assert [[p.num_micro_batches for p in s.pipelines] for s in hp.strategies] == [[1], [1]]


def _strategy(name: str, ranks: list[int], tp: int) -> "object":
    return mixed_sim._homogeneous_strategy(TINY, ranks, tp, 1, False, 1, schedule="1f1b", zero1=True, name=name)


def test_hotspa_step_runs_the_filled_buckets_in_turn_and_prices_the_switches_between_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """simulate_hotspa with the simulator and the switch estimate replaced by stand-ins that record their calls:
    an empty bucket is skipped (later buckets still run), each filled bucket is simulated at its window with one
    micro-batch count per pipeline from its packed windows and the caller's cost model; compute is each step time
    less its sync, sync the last bucket's, the OOM ranks the union of every bucket's, sorted; a switch is priced
    between consecutive filled buckets and back to the first, with the caller's cost model."""
    from types import SimpleNamespace

    from hspmd_sdk.planner.cost import CostModel

    sims: list = []
    results = iter([SimpleNamespace(step_time=5.0, sync_time=1.0, oom=[3, 1]),
                    SimpleNamespace(step_time=9.0, sync_time=2.0, oom=[0, 1])])

    def fake_simulate(model, s, cluster, *, seq_len, cost):  # type: ignore[no-untyped-def]
        sims.append((s.name, [p.num_micro_batches for p in s.pipelines], seq_len, cost))
        return next(results)

    switches: list = []

    def fake_switch(model, cluster, a, b, cost):  # type: ignore[no-untyped-def]
        switches.append((a.name, b.name, cost))
        return {"B": 0.5, "C": 0.25}[a.name]

    monkeypatch.setattr(mixed_sim, "simulate", fake_simulate)
    monkeypatch.setattr(mixed_sim, "switch_estimate", fake_switch)
    plan = HotSPaPlan(buckets=[16, 32, 64], strategies=[_strategy("A", [0, 1], 1), _strategy("B", [0, 1], 2),
                                                         _strategy("C", [0, 1], 1)])
    cost = CostModel()
    step = mixed_sim.simulate_hotspa(TINY, TWO, plan, [20, 30, 40, 64, 100], cost=cost)
    assert sims == [("B", [2], 32, cost), ("C", [2, 2], 64, cost)]     # windows [30], [20]; [64], [64], [40]
    assert step == mixed_sim.HotSPaStep((4.0, 7.0), 0.75, 2.0, (0, 1, 3))
    assert switches == [("B", "C", cost), ("C", "B", cost)]
    assert step.step_time == 4.0 + 7.0 + 0.75 + 2.0

    switches.clear()
    results = iter([SimpleNamespace(step_time=3.0, sync_time=0.5, oom=[])])
    one = mixed_sim.simulate_hotspa(TINY, TWO, plan, [10, 12])
    assert one == mixed_sim.HotSPaStep((2.5,), 0, 0.5, ()) and switches == []   # one bucket: no switch
    assert sims[-1] == ("A", [1, 1], 16, None)

    empty = mixed_sim.simulate_hotspa(TINY, TWO, plan, [])
    assert empty == mixed_sim.HotSPaStep((), 0, 0.0, ()) and empty.sync == 0.0 and empty.oom == ()


def test_pack_is_best_fit_decreasing_with_ties_to_the_first_window() -> None:
    """Longest first, each into the window it fills most tightly (the earliest of equal rooms), else a new one; a
    sequence of exactly the window fits."""
    assert pack([5, 4, 3, 3, 2, 1], 8) == [[5, 3], [4, 3, 1], [2]]
    assert pack([4, 4, 2, 1], 6) == [[4, 2], [4, 1]]
    assert pack([1, 8, 7], 8) == [[8], [7, 1]] and pack([], 8) == []


def test_sample_batch_draws_with_the_seed_until_the_tokens_are_reached() -> None:
    """numpy's default_rng(seed) picks indices; drawing stops at the first sum reaching the tokens."""
    assert mixed_sim.sample_batch([5, 17, 40, 3], 100, seed=7) == [3, 40, 40, 3, 40]
    assert mixed_sim.sample_batch([5, 17, 40, 3], 100) == [3, 40, 40, 17]
    assert mixed_sim.sample_batch([5, 17, 40, 3], 0) == [] and mixed_sim.sample_batch([10], 20) == [10, 10]


def test_homogeneous_shapes_on_all_devices_and_on_each_kind() -> None:
    """TP a power of two dividing every node used, PP up to the layers (tiny: 4), the ranks a multiple of TP x PP;
    each with and without recomputation; all devices first, then each kind's."""
    six = Cluster.mixed({"H800": 4, "H20": 2}, per_node=2)
    got = mixed_sim._homogeneous(TINY, six)
    allr, h800, h20 = [0, 1, 2, 3, 4, 5], [0, 1, 2, 3], [4, 5]
    want = [(r, t, p, rc) for r, tps in ((allr, [(1, 1), (1, 2), (2, 1)]),
                                        (h800, [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)]),
                                        (h20, [(1, 1), (1, 2), (2, 1)])) for t, p in tps for rc in (False, True)]
    assert got == want
    assert sorted({(t, p) for _, t, p, _ in mixed_sim._homogeneous(TINY, Cluster.local(8))}) == [
        (1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]
    uneven = Cluster.load({"nodes": [{"host": "a", "kind": "H800", "ranks": [0, 1, 2, 3]},
                                     {"host": "b", "kind": "H20", "ranks": [4, 5]}]})
    assert [(len(r), t, p) for r, t, p, rc in mixed_sim._homogeneous(TINY, uneven) if not rc] == [
        (6, 1, 1), (6, 1, 2), (6, 2, 1), (4, 1, 1), (4, 1, 2), (4, 1, 4), (4, 2, 1), (4, 2, 2), (4, 4, 1),
        (2, 1, 1), (2, 1, 2), (2, 2, 1)]
    assert mixed_sim._homogeneous(TINY, Cluster.local(1)) == [([0], 1, 1, False), ([0], 1, 1, True)]


def test_homogeneous_strategy_spreads_layers_the_extra_ones_first() -> None:
    """DP pipelines of PP stages of TP consecutive ranks; the layers left over go to the first stages."""
    from types import SimpleNamespace

    s = mixed_sim._homogeneous_strategy(SimpleNamespace(num_layers=7), list(range(10, 22)), 2, 3, True, 5,
                                        schedule="gpipe", zero1=False, name="n")
    stages = lambda base: [{"devices": [base, base + 1], "layers": [0, 2], "recompute": True},  # noqa: E731
                           {"devices": [base + 2, base + 3], "layers": [3, 4], "recompute": True},
                           {"devices": [base + 4, base + 5], "layers": [5, 6], "recompute": True}]
    assert s.model_dump() == {"pipelines": [
        {"stages": stages(10), "micro_batch_size": 1, "num_micro_batches": 5},
        {"stages": stages(16), "micro_batch_size": 1, "num_micro_batches": 5}],
        "schedule": "gpipe", "zero1": False, "name": "n"}
    t = mixed_sim._homogeneous_strategy(SimpleNamespace(num_layers=5), [0, 1, 2, 3], 1, 4, False, 1,
                                        schedule="1f1b", zero1=True, name="m")
    assert [st.layers for st in t.pipelines[0].stages] == [[0, 1], [2, 2], [3, 3], [4, 4]]


def test_simulate_shapes_wants_one_list_of_shapes_per_pipeline() -> None:
    """The message a user reads when the shapes do not match the strategy's pipelines."""
    s = _strategy("A", [0, 1], 1)
    with pytest.raises(ValueError) as e:
        mixed_sim.simulate_shapes(TINY, s, TWO, [[(1, 16)]])
    assert str(e.value) == "shapes has 1 pipelines; the strategy has 2"


def test_packed_baseline_picks_the_fastest_symmetric_strategy_for_the_steps_windows() -> None:
    """The step's sequences cut to the context and packed (5 -> 4 windows: 64, 64, 60, 20+10), spread over DP2;
    the time returned is the simulator's for that strategy; ZeRO-1 and 1F1B by default."""
    from hspmd_sdk.planner import simulate

    s, t = mixed_sim.packed_baseline(TINY, TWO, [10, 20, 60, 64, 100], context_len=64)
    assert s.name == "packed baseline DP2TP1PP1 on 2 cpu at 64"
    assert (s.schedule, s.zero1, [p.num_micro_batches for p in s.pipelines]) == ("1f1b", True, [2, 2])
    assert t == simulate(TINY, s, TWO, seq_len=64).step_time
    g, _ = mixed_sim.packed_baseline("tiny", TWO, [64] * 5, context_len=64, schedule="gpipe", zero1=False)
    assert (g.schedule, g.zero1) == ("gpipe", False)


def test_packed_baseline_that_nothing_fits_says_so() -> None:
    """The message a user reads: the model, the device count and the window."""
    with pytest.raises(PlanValidationError) as e:
        mixed_sim.packed_baseline("tiny", Cluster.local(1, kind="H100"), [2**26], context_len=2**26)
    assert e.value.problems == [("context_len", "no homogeneous strategy of tiny on 1 devices fits 67108864-token "
                                                "windows")]
    assert e.value.what == "baseline"


def test_best_homogeneous_keeps_the_first_least_mean_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the simulator replaced by a stand-in (seconds = a per-name figure x micro-batches): each candidate is
    named by its label, shape, recomputation (+AC), device count, kinds (sorted, joined by +) and window; it is
    simulated with the caller's cost model at the window; one out of memory at the most micro-batches is skipped;
    the mean over the steps' windows decides, the first of equal means kept; the winner comes with the first
    step's micro-batches and its mean."""
    from types import SimpleNamespace

    from hspmd_sdk.planner.cost import CostModel

    six = Cluster.mixed({"H800": 4, "H20": 2}, per_node=2)
    base = {"L DP6TP1PP1 on 6 H20+H800 at 64": 1.0, "L DP6TP1PP1+AC on 6 H20+H800 at 64": 1.0,
            "L DP4TP1PP1 on 4 H800 at 64": 0.1}
    calls: list = []

    def fake_simulate(model, s, cluster, *, seq_len, cost):  # type: ignore[no-untyped-def]
        per = s.pipelines[0].num_micro_batches
        calls.append((s.name, per, seq_len, cost))
        return SimpleNamespace(oom=[0] if s.name == "L DP4TP1PP1 on 4 H800 at 64" else [],
                               step_time=base.get(s.name, 10.0) * per)

    monkeypatch.setattr(mixed_sim, "simulate", fake_simulate)
    cost = CostModel()
    best = mixed_sim._best_homogeneous(TINY, six, [6, 12], 64, cost, schedule="1f1b", zero1=True, label="L")
    assert best is not None
    s, mean = best
    assert s.name == "L DP6TP1PP1 on 6 H20+H800 at 64" and mean == 1.5          # (1 + 2) / 2
    assert [p.num_micro_batches for p in s.pipelines] == [1] * 6 and not s.pipelines[0].stages[0].recompute
    assert all(c[2] == 64 and c[3] is cost for c in calls)
    assert ("L DP6TP1PP1+AC on 6 H20+H800 at 64", 2, 64, cost) in calls
    assert ("L DP2TP1PP1 on 2 H20 at 64", 6, 64, cost) in calls


def test_homogeneous_pipelines_go_up_to_eight_stages() -> None:
    """PP up to 8 where the model has the layers (llama-7b: 32) and the devices divide."""
    from hspmd_sdk.models.registry import load_model_spec

    got = {(t, p) for _, t, p, _ in mixed_sim._homogeneous(load_model_spec("llama-7b"), Cluster.local(8))}
    assert (1, 8) in got and max(p for _, p in got) == 8


def test_sample_batch_draws_at_least_one_for_a_positive_token_count() -> None:
    assert mixed_sim.sample_batch([10], 1) == [10] and mixed_sim.sample_batch([10], 10) == [10]


def test_the_baselines_plan_with_the_callers_cost_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """packed_baseline and plan_hotspa hand the caller's cost model (not the default) to the search of symmetric
    strategies, with the windows, the window length, the schedule, ZeRO-1 and the label; plan_hotspa per bucket,
    each bucket's window counts at least one."""
    from hspmd_sdk.planner.cost import CostModel

    calls: list = []
    strategy = _strategy("S", [0, 1], 1)

    def spy(model, cluster, windows, window, cost, *, schedule, zero1, label):  # type: ignore[no-untyped-def]
        calls.append((list(windows), window, cost, schedule, zero1, label))
        return strategy, 2.5

    monkeypatch.setattr(mixed_sim, "_best_homogeneous", spy)
    cost = CostModel()
    assert mixed_sim.packed_baseline(TINY, TWO, [10, 20, 60, 64, 100], context_len=64, cost=cost,
                                     schedule="gpipe", zero1=False) == (strategy, 2.5)
    assert calls == [([4], 64, cost, "gpipe", False, "packed baseline")] and calls[0][2] is cost
    calls.clear()
    hp = plan_hotspa(TINY, TWO, [40], tokens_per_batch=40, context_len=64, buckets=[16, 64], steps=1, cost=cost)
    assert calls == [([1], 16, cost, "1f1b", True, "HotSPa bucket 0"), ([1], 64, cost, "1f1b", True, "HotSPa bucket 1")]
    assert all(c[2] is cost for c in calls) and hp.strategies == [strategy, strategy]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulate_shapes_transfers_are_the_simulators_at_fixed_shapes_and_sized_by_each_micro_batch(
        schedule: str) -> None:
    """Every point-to-point transfer (pipeline, stages, direction, micro-batch, start, end, bytes): at one fixed
    shape those of the fixed-shape simulator (a slow link, so a send waits for the one before it on its channel);
    with micro-batches of their own shapes, each sized rows x length x hidden x 2 bytes and lasting the link's time
    for those bytes, one after another on each channel."""
    from hspmd_sdk.planner import simulate
    from hspmd_sdk.planner.cost import CostModel

    slow = Cluster.load({"nodes": [{"host": "a", "kind": "H20", "ranks": [0]},
                                   {"host": "b", "kind": "H20", "ranks": [1]}],
                         "inter_bandwidth_gbs": 0.001})
    s = Strategy.load({"pipelines": [{"micro_batch_size": 2, "num_micro_batches": 3, "stages": [
        {"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}]}], "schedule": schedule})
    want = simulate(TINY, s, slow, seq_len=16).transfers
    got = mixed_sim.simulate_shapes(TINY, s, slow, [[(2, 16)] * 3]).transfers
    assert [(t.pipeline, t.src_stage, t.dst_stage, t.kind, t.micro_batch, t.nbytes) for t in got] == \
        [(t.pipeline, t.src_stage, t.dst_stage, t.kind, t.micro_batch, t.nbytes) for t in want]
    assert sorted((t.kind, t.micro_batch) for t in got) == [("B", 0), ("B", 1), ("B", 2), ("F", 0), ("F", 1), ("F", 2)]
    assert all(g.start == pytest.approx(w.start, rel=1e-9, abs=1e-15) and g.end == pytest.approx(w.end, rel=1e-9)
               for g, w in zip(got, want))
    shapes = [(2, 16), (1, 8), (4, 16)]
    got = mixed_sim.simulate_shapes(TINY, s, slow, [shapes]).transfers
    link = slow.link(0, 1)
    assert {(t.kind, t.micro_batch): t.nbytes for t in got} == {
        (k, mb): shapes[mb][0] * shapes[mb][1] * 64 * 2 for k in "FB" for mb in range(3)}
    assert all(t.end - t.start == pytest.approx(CostModel().p2p_time(t.nbytes, link), rel=1e-12) for t in got)
    for src in (0, 1):
        chan = [t for t in got if t.src_stage == src]
        assert all(b.start >= a.end for a, b in zip(chan, chan[1:])) and chan[0].dst_stage == 1 - src


def test_simulate_shapes_pipelines_without_micro_batches_hold_no_activations_and_the_label_is_kept() -> None:
    """A pipeline given no micro-batches computes nothing and holds no activations (its devices: the static state
    only); every pipeline empty still simulates (the gradient sync and optimizer).  The result's label is the
    caller's, by default the strategy's name."""
    s = _strategy("A", [0, 1], 1)
    one = mixed_sim.simulate_shapes(TINY, s, TWO, [[], [(2, 16)]], label="step 3")
    assert one.label == "step 3" and one.memory[0]["activations"] == 0.0 and one.memory[1]["activations"] > 0
    assert one.timeline[0] == [] or all(e.kind not in ("F", "B") for e in one.timeline[0])
    none = mixed_sim.simulate_shapes(TINY, s, TWO, [[], []])
    assert none.label == "A" and [none.memory[d]["activations"] for d in (0, 1)] == [0.0, 0.0]
    assert none.step_time >= none.sync_time > 0


def test_simulate_shapes_keeps_stage_costs_in_the_callers_cache() -> None:
    """``cache``: the stage costs are kept there (a dispatcher simulates every step with one), and a second call
    gives the same result from them."""
    s = _strategy("A", [0, 1], 1)
    cache: dict = {}
    first = mixed_sim.simulate_shapes(TINY, s, TWO, [[(2, 16)], [(1, 32)]], cache=cache)
    assert cache and len(cache) == 1                      # both pipelines' one stage: the same kind, link and layers
    kept = dict(cache)
    again = mixed_sim.simulate_shapes(TINY, s, TWO, [[(2, 16)], [(1, 32)]], cache=cache)
    assert again.step_time == first.step_time and cache == kept and all(cache[k] is kept[k] for k in kept)


def test_simulate_shapes_counts_an_uneven_stages_activations_at_its_micro_batches_shapes() -> None:
    """An uneven TP stage (3:1): each device's activations at the pipeline's largest micro-batch, as the fixed-shape
    simulator counts them at that shape (this was each device's share of one row of the longest length: 4 rows
    of 16 tokens counted as 1); a pipeline without micro-batches holds none."""
    from hspmd_sdk.planner import simulate

    three = Cluster.local(4)
    pipe = {"micro_batch_size": 4, "num_micro_batches": 2, "stages": [{"devices": [0, 1], "layers": [0, 3],
                                                                       "ratios": [3, 1]}]}
    s = Strategy.load({"pipelines": [pipe]}, model=TINY)
    want = simulate(TINY, s, three, seq_len=16).memory
    got = mixed_sim.simulate_shapes(TINY, s, three, [[(4, 16), (1, 8)]]).memory
    assert [got[d]["activations"] for d in (0, 1)] == [want[d]["activations"] for d in (0, 1)]
    assert got[0]["activations"] > got[1]["activations"] > 0
    two = Strategy.load({"pipelines": [pipe, {**pipe, "stages": [{**pipe["stages"][0], "devices": [2, 3]}]}]},
                        model=TINY)
    got = mixed_sim.simulate_shapes(TINY, two, three, [[], [(4, 16)]]).memory
    assert [got[d]["activations"] for d in (0, 1)] == [0.0, 0.0]
    assert [got[d]["activations"] for d in (2, 3)] == [want[d]["activations"] for d in (0, 1)]
