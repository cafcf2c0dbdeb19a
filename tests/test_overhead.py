"""The executor's fixed cost per micro-batch: measured on a one-rank executor, folded into the profile's intercepts,
and seen by the dispatcher (which then forms fewer, larger micro-batches)."""
from __future__ import annotations

import time

import pytest

from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.models.gpt import GPTConfig
from hspmd_sdk.planner import dispatch
from hspmd_sdk.planner.cost import ComputeFit, CostModel, OperatorProfile
from hspmd_sdk.planner.mixed import MixedEntry
from hspmd_sdk.runtime.control.overhead import ExecutorOverhead, executor_overhead, with_executor_overhead

LLAMA = LlamaConfig(name="tiny-overhead", vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                    ffn_hidden_size=64, max_seq_len=64)
GPT = GPTConfig(name="tiny-gpt-overhead", vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=128,
                max_seq_len=64)


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["llama", "gpt2"])
def test_executor_overhead_is_measured_on_the_executor(model) -> None:
    t0 = time.perf_counter()
    o = executor_overhead(model, repeats=5)
    elapsed = time.perf_counter() - t0
    total = o.layer_fwd + o.layer_bwd + o.rest_fwd + o.rest_bwd  # a micro-batch's fixed cost (parts clamped at 0)
    # Bounded by the time measured here, not by an absolute time (which a loaded machine exceeds): each per-micro-
    # batch figure is (median T8 - median T2) / 6 over 5 timed steps of 8 and of 2 micro-batches, so at least 3
    # timed 8-micro-batch steps of each probed model (1 and 2 layers) took >= 6 x its figure, all inside this call;
    # and the parts sum to at most the two models' figures.  A wrong unit or scale (per step, ms) fails here.
    assert 18 * total <= elapsed, (o, elapsed)
    assert total > 0  # never free: 6 extra micro-batches (milliseconds) against medians of interleaved runs
    assert (o.rows, o.seq) == (1, 8)


def _profile(b: float = 0.0) -> OperatorProfile:
    line = ComputeFit(a=1e-10, b=b)
    return OperatorProfile(layer_fwd=line, layer_bwd=line, head_fwd=line, head_bwd=line)


def test_intercepts_are_the_measured_fixed_cost_less_the_flop_term() -> None:
    cost = CostModel(profiles={"cpu": _profile()})
    o = ExecutorOverhead(layer_fwd=2e-3, layer_bwd=3e-3, rest_fwd=1e-3, rest_bwd=1.5e-3, rows=1, seq=8)
    got = with_executor_overhead(cost, LLAMA, "cpu", overhead=o).profiles["cpu"]
    lflops, hflops = LLAMA.layer_flops(8, 8), LLAMA.head_flops(8)
    assert got.layer_fwd.b == pytest.approx(2e-3 - 1e-10 * lflops)
    assert got.layer_bwd.b == pytest.approx(3e-3 - 1e-10 * lflops)
    assert got.head_fwd.b == pytest.approx(1e-3 - 1e-10 * hflops)
    assert got.head_bwd.b == pytest.approx(1.5e-3 - 1e-10 * hflops)  # the embedding line is zero here
    assert got.layer_fwd.a == 1e-10 and got.executor_overhead["layer_bwd"] == 3e-3
    with pytest.raises(ValueError, match="no profile of 'H20'"):
        with_executor_overhead(cost, LLAMA, "H20", overhead=o)


def test_a_fixed_cost_per_micro_batch_makes_the_dispatcher_pack_more_rows() -> None:
    """The same step on one pipeline: with free micro-batches the dispatcher opens one per length to avoid
    padding; when each costs milliseconds it packs short sequences into fewer, padded micro-batches."""
    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]}],
                                             "micro_batch_size": 1, "num_micro_batches": 1}], "name": "one"})
    entry = MixedEntry(max_seq_len=64, windows=[256], strategy=strategy)
    lengths = [60, 50, 41, 33, 30, 22, 17, 12, 9, 5, 3]
    counts = []
    for b in (0.0, 5e-3):
        d = dispatch([entry], LLAMA, Cluster.local(1), lengths, cost=CostModel(profiles={"cpu": _profile(b)}))
        assert sorted(i for mb in d.micro_batches[0] for i in mb) == list(range(len(lengths)))
        counts.append(len(d.micro_batches[0]))
    assert counts[1] < counts[0], counts
