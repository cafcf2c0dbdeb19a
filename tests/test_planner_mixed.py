"""plan_mixed / dispatch (scenario (c)): on a long-tailed length distribution the strategy set beats one
homogeneous strategy over packed sequences, both simulated."""
from __future__ import annotations

import math

import pytest

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk import LlamaConfig
from hspmd_sdk.planner import dispatch, packed_baseline, plan_mixed, simulate_mixed
from hspmd_sdk.planner.mixed import MixedPlan, pack, sample_batch, sample_lengths

MODEL = LlamaConfig.preset("llama-32b")
CLUSTER = Cluster.homogeneous("H20", 32)
CONTEXT = 32768
TOKENS = 200_000


@pytest.fixture(scope="module")
def lengths() -> list[int]:
    return sample_lengths(4000, CONTEXT, seed=0)


@pytest.fixture(scope="module")
def plan(lengths: list[int]) -> MixedPlan:
    return plan_mixed(MODEL, CLUSTER, lengths, tokens_per_batch=TOKENS, context_len=CONTEXT)


def test_the_sample_is_long_tailed(lengths: list[int]) -> None:
    short = sum(x < 8192 for x in lengths) / len(lengths)
    assert 0.9 < short < 0.99 and max(lengths) == CONTEXT  # like Figure 18: ~97% under 8K


@pytest.mark.parametrize("window", [1024, 4096, 32768])
def test_pack_places_every_sequence_once(lengths: list[int], window: int) -> None:
    seqs = [x for x in lengths[:500] if x <= window]
    bins = pack(seqs, window)
    assert sorted(x for b in bins for x in b) == sorted(seqs)
    assert all(sum(b) <= window for b in bins)
    assert len(bins) >= math.ceil(sum(seqs) / window)
    assert sum(1 for b in bins if sum(b) <= window // 2) <= 1  # best fit leaves at most one half-empty bin


def test_plan_entries_are_valid_and_cover_the_context(plan: MixedPlan) -> None:
    caps = [e.max_seq_len for e in plan.entries]
    assert caps == sorted(caps) and caps[-1] == CONTEXT
    for e in plan.entries:
        e.strategy.check(model=MODEL, cluster=CLUSTER)
        assert len(e.windows) == e.strategy.dp_degree and max(e.windows) == e.max_seq_len
    assert MixedPlan.model_validate_json(plan.to_json()) == plan


def test_dispatch_assigns_every_sequence_to_a_window_that_holds_it(plan: MixedPlan, lengths: list[int]) -> None:
    batch = sample_batch(lengths, TOKENS, seed=3)
    d = dispatch(plan, MODEL, CLUSTER, batch)
    assert d.max_seq_len >= max(batch)
    assert sorted(x for p in d.packed for w in p for x in w) == sorted(batch)
    for p, (w, packed) in enumerate(zip(d.windows, d.packed)):
        assert all(sum(win) <= w for win in packed)
        assert d.strategy.pipelines[p].num_micro_batches == max(1, len(packed))
    assert d.estimate == min(d.estimates.values())


def test_mixed_beats_packed_homogeneous(plan: MixedPlan, lengths: list[int]) -> None:
    ours, base = [], []
    for seed in range(8):
        batch = sample_batch(lengths, TOKENS, seed=seed)
        d = dispatch(plan, MODEL, CLUSTER, batch)
        t, oom = simulate_mixed(MODEL, CLUSTER, d)
        assert not oom
        assert t == pytest.approx(d.estimate, rel=0.05)  # the dispatcher's cost model agrees with the simulator
        ours.append(t)
        base.append(packed_baseline(MODEL, CLUSTER, batch, context_len=CONTEXT)[1])
        assert ours[-1] <= base[-1] * 1.001
    speedup = sum(base) / sum(ours)
    print(f"mixed-length: strategy set {sum(ours) / 8:.2f} s/step vs packed homogeneous {sum(base) / 8:.2f} s/step, "
          f"speed-up {speedup:.2f}x")
    assert speedup > 1.15
