"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of planner/cost.py.

Every figure is worked out by hand from the formulas the module's docstrings state (§8, Appendix A.1): a tiny
fake model whose FLOPs, activations and parameter counts are simple linear functions, a device whose peak
throughput makes one FLOP one millisecond, links with round latencies and bandwidths.  Nothing is compared with
another output of the cost model.
"""
from __future__ import annotations

import math

import pytest

from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.cluster import DeviceSpec, Link
from hspmd_sdk.planner.cost import (ComputeFit, CostModel, LayerCost, LinkOverride, OperatorProfile, fit_line,
                                    fit_plane, activation_memory, embedding_cost, fit_link, head_cost, layer_cost,
                                    ring_factor, static_memory)

H, V = 8, 32  # hidden, vocab


class Fake(LlamaConfig):
    """A Llama of hidden 8 and vocab 32, whose graph gives the TP collectives (two all-reduces of the hidden state a
    layer each way, the embedding's gather, the logits' gather and the head input's all-reduce), with FLOPs,
    activations and parameters by hand: layer FLOPs 100/token + 10/token/position; head 50/token; activations
    40 B/token."""
    name: str = "fake"
    hidden_size: int = H
    vocab_size: int = V
    num_layers: int = 3
    num_heads: int = 2
    ffn_hidden_size: int = 16

    def layer_flops(self, tokens: int, seq_len: int | None = None) -> int:
        return 100 * tokens + 10 * tokens * (64 if seq_len is None else seq_len)  # None: the model's max length

    def head_flops(self, tokens: int) -> int:
        return 50 * tokens

    def layer_activation_bytes(self, tokens: int, dtype_bytes: int = 2) -> int:
        return 40 * tokens

    def layer_param_count(self) -> int:
        return 1000

    def embedding_param_count(self) -> int:
        return 256

    def head_param_count(self) -> int:
        return 384


SPEC = DeviceSpec(kind="k", memory_mb=1024, bf16_tflops=1e-9, intra_bandwidth_gbs=1)  # 1000 FLOP/s at mfu 1
LINK = Link("intra", 64.0, 0.01)
close = pytest.approx


def _cm(**kw) -> CostModel:
    return CostModel(**{"default_mfu": 1.0, "collective_efficiency": 0.5, **kw})


def test_compute_time_analytic_fitted_and_empty() -> None:
    spec = DeviceSpec(kind="k", memory_mb=1024, bf16_tflops=2.0, intra_bandwidth_gbs=1)
    assert CostModel(default_mfu=0.5).compute_time(1e12, spec) == close(1.0)
    assert CostModel(default_mfu=0.5, mfu={"k": 0.25}).compute_time(1e12, spec) == close(2.0)
    assert CostModel(mfu={"other": 0.25}, default_mfu=0.5).compute_time(1e12, spec) == close(1.0)
    fits = {"k": ComputeFit(a=1e-9, b=0.5)}
    assert CostModel(compute_fits=fits).compute_time(1e9, spec) == close(1.5)
    assert CostModel(compute_fits=fits).compute_time(0, spec) == 0.0
    assert CostModel().compute_time(-5, spec) == 0.0


def test_p2p_time_by_hand() -> None:
    link = Link("inter", 100.0, 1.0)
    cm = CostModel(p2p_efficiency=0.5, comm_scale=2.0, comm_bytes_factor=2.0)
    assert cm.p2p_time(50, link) == close(2 * (1 + 100 / 50))
    assert cm.p2p_time(0, link) == 0.0 and cm.p2p_time(50, Link("self", 1.0, 1.0)) == 0.0
    o = CostModel(comm_scale=2.0, comm_bytes_factor=2.0, link_overrides={"inter": LinkOverride(latency=0.5, bandwidth=10)})
    assert o.p2p_time(50, link) == close(2 * (0.5 + 100 / 10))  # no p2p efficiency on a measured link
    assert o.p2p_time(50, Link("intra", 100.0, 1.0)) == close(2 * (1 + 100 / 80))


def test_collective_time_ring_steps_and_volume() -> None:
    link = Link("inter", 100.0, 0.1)
    cm = CostModel(collective_efficiency=0.5)
    # all-reduce over 4: 2(n-1) = 6 steps, 2(n-1)/n * 80 = 120 bytes at 50 B/s
    assert cm.collective_time("all_reduce", 80, 4, link) == close(6 * 0.1 + 120 / 50)
    assert cm.collective_time("reduce_scatter", 80, 4, link) == close(3 * 0.1 + 60 / 50)
    assert cm.collective_time("all_gather", 80, 4, link) == close(3 * 0.1 + 60 / 50)
    assert CostModel(collective_efficiency=0.5, comm_scale=3.0, comm_bytes_factor=2.0).collective_time(
        "all_gather", 80, 4, link) == close(3 * (3 * 0.1 + 120 / 50))
    assert cm.collective_time("all_reduce", 80, 1, link) == 0.0
    assert cm.collective_time("all_reduce", 0, 4, link) == 0.0
    assert cm.collective_time("all_reduce", 80, 4, Link("self", 1.0, 1.0)) == 0.0
    full = LinkOverride(latency=1, bandwidth=10, collective_latency=0.2, collective_bandwidth=40, call_latency=0.05)
    assert CostModel(link_overrides={"inter": full}).collective_time("all_reduce", 80, 4, link) == \
        close(0.05 + 6 * 0.2 + 120 / 40)
    p2p_only = LinkOverride(latency=1, bandwidth=10)
    assert CostModel(link_overrides={"inter": p2p_only}, comm_scale=2.0).collective_time(
        "reduce_scatter", 80, 4, link) == close(2 * (3 * 1 + 60 / 10))


def test_collective_skew_and_core_share() -> None:
    link = Link("inter", 100.0, 0.1)
    assert CostModel().collective_skew(4, link) == 0.0
    cm = CostModel(comm_scale=2.0, link_overrides={"inter": LinkOverride(latency=1, bandwidth=1, skew=0.3),
                                                   "self": LinkOverride(latency=1, bandwidth=1, skew=0.3)})
    assert cm.collective_skew(4, link) == close(0.6)
    assert cm.collective_skew(1, link) == 0.0
    assert cm.collective_skew(4, Link("self", 1.0, 1.0)) == 0.0
    assert CostModel().core_share(64) == 1.0
    assert [CostModel(cores=4).core_share(n) for n in (1, 2, 4, 6, 8)] == [1.0, 1.0, 1.0, 1.5, 2.0]


def test_optimizer_time_per_parameter_or_memory_bound() -> None:
    line = ComputeFit(a=0.0, b=0.0)
    prof = OperatorProfile(layer_fwd=line, layer_bwd=line, head_fwd=line, head_bwd=line, optimizer_s_per_param=1e-6)
    assert CostModel(profiles={"k": prof}).optimizer_time(1e6, SPEC) == close(1.0)
    idle = prof.model_copy(update={"optimizer_s_per_param": 0.0})
    cm = CostModel(profiles={"k": idle}, hbm_gbs={"k": 100.0}, hbm_efficiency=0.5, optimizer_bytes_per_param=28)
    assert cm.optimizer_time(1e9, SPEC) == close(1e9 * 28 / (100e9 * 0.5))
    cm = CostModel(hbm_gbs={}, default_hbm_gbs=50.0, hbm_efficiency=0.5, optimizer_bytes_per_param=10)
    assert cm.optimizer_time(1e9, SPEC) == close(1e9 * 10 / (50e9 * 0.5))


def test_ring_factor() -> None:
    assert ring_factor("all_reduce", 4) == close(1.5)
    assert ring_factor("reduce_scatter", 4) == close(0.75) and ring_factor("all_gather", 5) == close(0.8)
    assert ring_factor("all_reduce", 1) == 0.0 and ring_factor("all_gather", 0) == 0.0
    with pytest.raises(ValueError):
        ring_factor("broadcast", 4)


def _ar(nbytes: float, n: int, link: Link = LINK, eff: float = 0.5) -> float:
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / (link.bandwidth * eff)


def _ag(nbytes: float, n: int, link: Link = LINK, eff: float = 0.5) -> float:
    return (n - 1) * link.latency + (n - 1) / n * nbytes / (link.bandwidth * eff)


def test_layer_cost_analytic() -> None:
    m = Fake()
    # micro-batch 2 x 4 tokens = 8 tokens; flops (100*8 + 10*8*4) / tp 2 = 560 -> 0.56 s at 1000 FLOP/s
    c = layer_cost(m, SPEC, 2, LINK, 2, 4, _cm())
    ar = _ar(8 * H * 2, 2)
    assert (c.fwd_compute, c.bwd_compute) == (close(0.56), close(1.12))
    assert (c.fwd_comm, c.bwd_comm) == (close(2 * ar), close(2 * ar))
    assert c.act_bytes == close(40 * 8 / 2) and c.transient_bytes == 0.0 and c.params == close(500)
    assert c.fwd == close(0.56 + 2 * ar) and c.bwd == close(1.12 + 2 * ar)
    r = layer_cost(m, SPEC, 2, LINK, 2, 4, _cm(), recompute=True)
    assert r.bwd_compute == close(1.12 + 0.56) and r.bwd_comm == close(4 * ar) and r.fwd_comm == close(2 * ar)
    assert r.act_bytes == close(8 * H * 2 / 2) and r.transient_bytes == close(40 * 8 / 2)
    nsp = layer_cost(m, SPEC, 2, LINK, 2, 4, _cm(sequence_parallel=False, backward_factor=3.0))
    replicated = 8 * 4 * H * 2  # 4 * hidden bf16 values per token stay whole
    assert nsp.act_bytes == close(replicated + (40 * 8 - replicated) / 2) and nsp.bwd_compute == close(3 * 0.56)
    nr = layer_cost(m, SPEC, 2, LINK, 2, 4, _cm(sequence_parallel=False), recompute=True)
    assert nr.act_bytes == close(8 * H * 2) and nr.transient_bytes == close(replicated + (40 * 8 - replicated) / 2)
    solo = layer_cost(m, SPEC, 1, LINK, 2, 4, _cm())
    assert solo.fwd_comm == 0.0 and solo.fwd_compute == close(1.12) and solo.params == close(1000)


def test_layer_cost_measured_lines_with_skew_and_replicated_norms() -> None:
    m = Fake()
    prof = OperatorProfile(layer_fwd=ComputeFit(a=1e-3, b=0.1, c=2e-3), layer_bwd=ComputeFit(a=2e-3, b=0.2),
                           head_fwd=ComputeFit(a=0, b=0), head_bwd=ComputeFit(a=0, b=0),
                           layer_replicated_fwd=ComputeFit(a=1e-2, b=0.05),
                           layer_replicated_bwd=ComputeFit(a=2e-2, b=0.1))
    o = LinkOverride(latency=0.01, bandwidth=64.0, skew=0.1)
    cm = _cm(profiles={"k": prof}, link_overrides={"intra": o})
    # matmul FLOPs 800/2 = 400, attention 320/2 = 160
    c = layer_cost(m, SPEC, 2, LINK, 2, 4, cm)
    fwd, bwd = 1e-3 * 400 + 2e-3 * 160 + 0.1, 2e-3 * 400 + 2e-3 * 160 + 0.2
    ar = 0.0 + 2 * 0.01 + 128 / 64.0
    assert (c.fwd_compute, c.bwd_compute) == (close(fwd), close(bwd))
    assert c.fwd_comm == close(2 * ar + 0.1 * fwd) and c.bwd_comm == close(2 * ar + 0.1 * bwd)
    n = layer_cost(m, SPEC, 2, LINK, 2, 4, _cm(profiles={"k": prof}, sequence_parallel=False))
    x = 8 * H
    assert n.fwd_compute == close(fwd + 0.5 * (1e-2 * x + 0.05))
    assert n.bwd_compute == close(bwd + 0.5 * (2e-2 * x + 0.1))
    one = layer_cost(m, SPEC, 1, LINK, 2, 4, _cm(profiles={"k": prof}, sequence_parallel=False))
    assert one.fwd_compute == close(1e-3 * 800 + 2e-3 * 320 + 0.1)
    assert layer_cost(m, SPEC, 2, LINK, 0, 4, cm).fwd_compute == 0.0  # no tokens: no intercept


def test_embedding_and_head_cost() -> None:
    m = Fake()
    assert embedding_cost(m, SPEC, 2, LINK, 2, 4, _cm(include_embedding=False)) == LayerCost()
    assert head_cost(m, SPEC, 2, LINK, 2, 4, _cm(include_embedding=False)) == LayerCost()
    e = embedding_cost(m, SPEC, 2, LINK, 2, 4, _cm())
    assert e.fwd_comm == close(_ag(8 * H * 2, 2)) and e.bwd_compute == 0.0 and e.params == close(128)
    assert e.fwd_compute == 0.0 and e.bwd_comm == 0.0
    line = ComputeFit(a=0.0, b=0.0)
    prof = OperatorProfile(layer_fwd=line, layer_bwd=line, head_fwd=ComputeFit(a=1e-3, b=0.5),
                           head_bwd=ComputeFit(a=3e-3, b=0.25), embed=ComputeFit(a=1e-2, b=0.125))
    pe = embedding_cost(m, SPEC, 2, LINK, 2, 4, _cm(profiles={"k": prof}))
    assert pe.bwd_compute == close(1e-2 * 8 * H / 2 + 0.125)
    h = head_cost(m, SPEC, 2, LINK, 2, 4, _cm())
    assert (h.fwd_compute, h.bwd_compute) == (close(0.2), close(0.4))  # 50*8/2 FLOPs
    assert h.fwd_comm == close(_ag(8 * V * 2, 2)) and h.bwd_comm == close(_ar(8 * H * 2, 2))
    assert h.act_bytes == close(8 * H * 2) and h.transient_bytes == close(2 * 8 * V * 4 / 2)
    assert h.params == close(384 / 2)
    o = LinkOverride(latency=0.01, bandwidth=64.0, skew=0.5)
    ph = head_cost(m, SPEC, 2, LINK, 2, 4, _cm(profiles={"k": prof}, link_overrides={"intra": o}))
    fwd, bwd = 1e-3 * 200 + 0.5, 3e-3 * 200 + 0.25
    assert (ph.fwd_compute, ph.bwd_compute) == (close(fwd), close(bwd))
    assert ph.fwd_comm == close(0.01 + (8 * V * 2) / 2 / 64.0 + 0.5 * fwd)
    assert ph.bwd_comm == close(2 * 0.01 + (8 * H * 2) / 64.0 + 0.5 * bwd)


def test_static_and_activation_memory() -> None:
    assert static_memory(1000, 4) == {"params": 2000, "grads": 2000, "optimizer": close(3000)}
    assert static_memory(1000, 0.5)["optimizer"] == close(12000)
    assert activation_memory(10, 3, 5) == 35


def test_fit_line_cases() -> None:
    f = fit_line([1, 2, 3, 4], [5, 7, 9, 11])
    assert (f.a, f.b, f.r2) == (close(2), close(3), close(1))
    g = fit_line([1, 2, 3], [1, 3, 5])  # y = 2x - 1: intercept clamped to 0, slope refit through the origin
    assert g.b == 0.0 and g.a == close(22 / 14)
    assert g.r2 == close(1 - sum((y - 22 / 14 * x) ** 2 for x, y in [(1, 1), (2, 3), (3, 5)]) / 8)
    d = fit_line([1, 2, 3], [9, 8, 7])  # falling: a flat line at the mean
    assert d.a == 0.0 and d.b == close(8)
    c = fit_line([2, 2, 2], [4, 4, 4])
    assert c.a == 0.0 and c.b == close(4) and c.r2 is None
    n = fit_line([1, 2, 3, 4], [2.1, 3.9, 6.2, 7.8])
    assert n.a == close(1.94) and n.b == close(0.15)  # sxy 9.7 / sxx 5; 5 - 1.94 * 2.5 and 0.99 < n.r2 < 1


def test_fit_plane_cases() -> None:
    x1, x2 = [1, 2, 3, 1, 5], [0, 1, 5, 2, 2]
    p = fit_plane(x1, x2, [2 * a + 3 * b + 1 for a, b in zip(x1, x2)])
    assert (p.a, p.c, p.b) == (close(2), close(3), close(1)) and p.r2 == close(1)
    q = fit_plane([1, 2, 3], [1, 2, 3], [4, 7, 10])  # x2 = x1: one line over x1 + x2
    assert q.c is None and q.a == close(1.5) and q.b == close(1)
    r = fit_plane(x1, x2, [2 * a - 1 * b + 4 for a, b in zip(x1, x2)])  # c < 0: dropped, the rest refit
    assert r.c == 0.0 and r.a > 0 and r.b >= 0


def test_fit_link_by_hand() -> None:
    sizes = [0, 100, 200, 400]
    lo = fit_link(sizes, [1 + s / 50 for s in sizes], [2 + s / 25 for s in sizes], backend="gloo")
    assert (lo.latency, lo.bandwidth) == (close(1), close(50))
    assert (lo.collective_latency, lo.collective_bandwidth, lo.call_latency, lo.skew) == (close(1), close(25), 0, 0)
    assert lo.backend == "gloo"
    ctx = fit_link(sizes, [1 + s / 50 for s in sizes], [2 + s / 25 for s in sizes], [3 + s / 20 for s in sizes])
    assert ctx.call_latency == close(1) and ctx.collective_bandwidth == close(20)
    sk = fit_link(sizes, [1 + s / 50 for s in sizes], [2 + s / 25 for s in sizes], [3 + s / 20 for s in sizes],
                  in_context_long=[5 + s / 20 for s in sizes], compute_s=(1.0, 3.0))
    assert sk.skew == close(1.0) and sk.call_latency == close(0.0)
    sk2 = fit_link(sizes, [1 + s / 50 for s in sizes], [2 + s / 25 for s in sizes], [4 + s / 20 for s in sizes],
                   in_context_long=[4.5 + s / 20 for s in sizes], compute_s=(1.0, 2.0))
    assert sk2.skew == close(0.5) and sk2.call_latency == close(4 - 2 - 0.5 * 1.0)
    flat = fit_link(sizes, [1.0] * 4, [2.0] * 4, [2.5] * 4)
    assert flat.bandwidth == 1e12 and flat.collective_bandwidth == 1e12 and flat.call_latency == close(0.5)
    with pytest.raises(ValueError):
        fit_link(sizes, [1.0] * 4, [2.0] * 4, in_context_long=[3.0] * 4, compute_s=(1.0, 2.0))
    with pytest.raises(ValueError):
        fit_link(sizes, [1.0] * 4, [2.0] * 4, [2.0] * 4, in_context_long=[3.0] * 4, compute_s=(2.0, 2.0))
    with pytest.raises(ValueError):
        fit_link(sizes, [1.0] * 4, [2.0] * 4, [2.0] * 4, in_context_long=[3.0] * 4)


def test_compute_fit_throughput() -> None:
    assert ComputeFit(a=1e-15, b=0).tflops == close(1000.0)
    assert math.isinf(ComputeFit(a=0, b=0).tflops)


def test_small_operands_still_cost() -> None:
    from hspmd_sdk.planner.cost import _layer_line

    spec = DeviceSpec(kind="k", memory_mb=1024, bf16_tflops=2.0, intra_bandwidth_gbs=1)
    assert CostModel(default_mfu=0.5).compute_time(1.0, spec) == close(1e-12, abs=0)  # one FLOP is not free
    assert CostModel(p2p_efficiency=0.5).p2p_time(1, Link("inter", 100.0, 0.1)) == close(0.1 + 1 / 50)
    link = Link("inter", 100.0, 0.1)
    assert CostModel(collective_efficiency=0.5).collective_time("all_reduce", 1, 4, link) == close(0.6 + 1.5 / 50)
    assert _layer_line(ComputeFit(a=1.0, b=0.5), 0.25, 0.25) == close(1.0)


def test_fits_report_r2_and_refit_without_negative_coefficients() -> None:
    import numpy as np

    small = fit_line([1, 2, 3], [0.1, 0.2, 0.35])  # total variance below 1 still gets an r2
    ys = np.array([0.1, 0.2, 0.35])
    res = ((ys - (small.a * np.array([1, 2, 3]) + small.b)) ** 2).sum()
    assert small.r2 == close(1 - res / ((ys - ys.mean()) ** 2).sum())
    x1, x2 = np.array([1.0, 2, 3, 1, 5, 4]), np.array([0.0, 1, 5, 2, 2, 3])
    y = 2 * x1 - x2 + 4 + np.array([0.1, -0.2, 0.05, 0.0, 0.1, -0.05])
    p = fit_plane(x1, x2, y)
    # the x2 coefficient comes out negative: dropped, and a, b refit by least squares on [x1, 1] alone
    full = np.linalg.lstsq(np.column_stack([x1, x2, np.ones(6)]), y, rcond=None)[0]
    assert full[1] < 0
    a, b = np.linalg.lstsq(np.column_stack([x1, np.ones(6)]), y, rcond=None)[0]
    assert (p.a, p.c, p.b) == (close(a), 0.0, close(b))
    r2 = 1 - ((a * x1 + b - y) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    assert p.r2 == close(r2)
    flat = fit_plane([1, 2, 3, 4], [4, 1, 3, 2], [5.0] * 4)
    assert flat.r2 is None and flat.b == close(5.0) and flat.a == close(0.0, abs=1e-9)


def test_cost_model_file_round_trip(tmp_path) -> None:
    cm = CostModel(default_mfu=0.3, mfu={"k": 0.2}, link_overrides={"inter": LinkOverride(latency=1, bandwidth=2)},
                   cores=3)
    cm.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == cm
    assert '"default_mfu": 0.3' in (tmp_path / "c.json").read_text()


# ---- the survivors of the run of 2026-12-04 (cost.py with send_time, runtime_bytes) -------------------------------
def test_runtime_bytes_reads_both_of_the_models_runtime_figures() -> None:
    """Pins CostModel.runtime_bytes: a GPU kind holds ``memory_reserve_mb``, the CPU kind ``cpu_baseline_mb`` (both
    in MiB), each the cost model's own figure rather than the core's default; no kind: nothing."""
    cm = CostModel(memory_reserve_mb=100.0, cpu_baseline_mb=30.0)
    assert cm.runtime_bytes("H100") == 100.0 * 2**20
    assert cm.runtime_bytes("cpu") == 30.0 * 2**20
    assert cm.runtime_bytes("") == 0.0


def test_send_time_is_the_measured_send_overhead_on_an_overridden_link() -> None:
    """Pins CostModel.send_time: the sender is busy ``comm_scale * send_overhead`` on a link class with a measured
    override, and 0 without one or on a rank's link to itself (even with a "self" override)."""
    o = LinkOverride(latency=1.0, bandwidth=1.0, send_overhead=0.25)
    cm = CostModel(comm_scale=2.0, link_overrides={"inter": o, "self": o})
    assert cm.send_time(Link("inter", 100.0, 0.1)) == 0.5
    assert cm.send_time(Link("intra", 100.0, 0.1)) == 0.0  # no override of that class
    assert cm.send_time(Link("self", 100.0, 0.1)) == 0.0
    assert CostModel().send_time(Link("inter", 100.0, 0.1)) == 0.0


def test_cp_ring_bytes_use_the_key_value_width() -> None:
    """Pins cp_ring_bytes: grouped-query attention rings its keys and values, ``kv_dim`` wide (not ``hidden``); a
    model without ``kv_dim`` (GPT) rings ``hidden``."""
    from hspmd_sdk import GPTConfig
    from hspmd_sdk.planner.cost import cp_ring_bytes

    gqa = LlamaConfig.preset("tiny").model_copy(update={"num_kv_heads": 1})  # hidden 64, kv_dim 16
    assert gqa.kv_dim == 16
    block = 2 * 2 * (8 / 2) * 16 / 1 * 2  # K and V, 2 rows x 4 tokens, kv_dim 16, bf16
    assert cp_ring_bytes(gqa, 2, 8, 1, 2) == (block, 3 * block)
    gpt = GPTConfig.preset("tiny")
    assert not hasattr(gpt, "kv_dim")
    assert cp_ring_bytes(gpt, 2, 8, 1, 2)[0] == 2 * 2 * 4 * gpt.hidden_size * 2


def test_layer_cost_balanced_cp_halves_the_attention_of_the_busiest_rank() -> None:
    """Pins layer_cost's ``balanced``: CP 2 contiguous, the last rank computes 3/4 of the causal attention; balanced,
    every rank 1/2.  Fake: 8 tokens, linear 800/2 = 400 FLOPs a rank, attention 320 x 3/4 or 1/2, at 1000 FLOP/s."""
    m = Fake()
    contiguous = layer_cost(m, SPEC, 1, LINK, 2, 4, _cm(), cp=2)
    balanced = layer_cost(m, SPEC, 1, LINK, 2, 4, _cm(), cp=2, balanced=True)
    assert contiguous.fwd_compute == close((400 + 240) / 1000)
    assert balanced.fwd_compute == close((400 + 160) / 1000)


def test_layer_cost_measured_cp_ring_gap_is_the_ring_less_the_attention_seconds() -> None:
    """Pins the profiled attention seconds layer_cost gives the CP ring to hide behind: the layer line's
    ``c * attention FLOPs`` (its ``a * matmul + b`` taken off), forward and backward; the gap is the ring's
    point-to-point seconds less them.  Fake at CP 2: matmul 400, attention 240 FLOPs; the ring: one hop of 128 bytes
    forward, three backward, 0.01 + 128 / (64 x 0.8) s a hop."""
    m = Fake()
    prof = OperatorProfile(layer_fwd=ComputeFit(a=1e-3, b=0.1, c=2e-3), layer_bwd=ComputeFit(a=2e-3, b=0.2),
                           head_fwd=ComputeFit(a=0, b=0), head_bwd=ComputeFit(a=0, b=0))
    c = layer_cost(m, SPEC, 1, LINK, 2, 4, _cm(profiles={"k": prof}), cp=2, cp_link=LINK)
    hop = 0.01 + 128 / (64.0 * 0.8)
    att_f, att_b = 2e-3 * 240, 2e-3 * 240  # the backward line has no c: attention at a
    assert c.fwd_compute == close(1e-3 * 400 + 2e-3 * 240 + 0.1)
    assert (c.ring_gap_fwd, c.ring_gap_bwd) == (close(hop - att_f), close(3 * hop - att_b))
    assert c.fwd_comm == close(hop - att_f) and c.bwd_comm == close(3 * hop - att_b)
    hidden = layer_cost(m, SPEC, 1, Link("intra", 1e9, 0.0), 2, 4, _cm(profiles={"k": prof}), cp=2,
                        cp_link=Link("intra", 1e9, 0.0))
    assert hidden.ring_gap_fwd == close(128 / 0.8e9 - att_f) and hidden.fwd_comm == 0.0  # fully overlapped


def test_measured_lines_cost_nothing_without_work_and_their_intercept_with_any() -> None:
    """Pins _line (the profiled embedding, head and replicated-norm lines): no tokens cost 0 (not the intercept),
    the least work costs ``a x + b``; through head_cost and embedding_cost with zero tokens."""
    from hspmd_sdk.planner.cost import _line

    assert _line(ComputeFit(a=1.0, b=0.5), 0.5) == 1.0
    assert _line(ComputeFit(a=1.0, b=0.5), 0.0) == 0.0
    line = ComputeFit(a=1e-3, b=0.5)
    prof = OperatorProfile(layer_fwd=line, layer_bwd=line, head_fwd=line, head_bwd=line, embed=line,
                           layer_replicated_fwd=line, layer_replicated_bwd=line)
    cm = _cm(profiles={"k": prof}, sequence_parallel=False)
    h = head_cost(Fake(), SPEC, 2, LINK, 0, 4, cm)
    assert (h.fwd_compute, h.bwd_compute) == (0.0, 0.0)
    assert embedding_cost(Fake(), SPEC, 2, LINK, 0, 4, cm).bwd_compute == 0.0
    assert layer_cost(Fake(), SPEC, 2, LINK, 0, 4, cm).fwd_compute == 0.0  # nor the replicated norms' line


def test_embedding_cost_under_cp_gathers_each_ranks_share_of_the_tokens() -> None:
    """Pins embedding_cost's ``cp``: each rank of a CP 2 group embeds and gathers 8 / 2 = 4 tokens."""
    e = embedding_cost(Fake(), SPEC, 2, LINK, 2, 4, _cm(), cp=2)
    assert e.fwd_comm == close(_ag(4 * H * 2, 2))


def test_embedding_cost_prices_the_embeddings_backward_collectives(monkeypatch) -> None:
    """Pins embedding_cost's backward communication: whatever collectives the Program's embedding runs in the
    backward (none for the shipped Llama and GPT: a stub of the reader gives it an all-reduce of the hidden state)
    are priced on the stage's TP link for its tokens."""
    import hspmd_sdk.planner.cost as cost_mod
    from hspmd_sdk.core.comm_ops import OpKind
    from hspmd_sdk.planner.tp_comm import Collective, UnitCollectives

    ar = (Collective(OpKind.ALL_REDUCE, 2, float(H)),)
    monkeypatch.setattr(cost_mod, "unit_collectives",
                        lambda model, tp, ratios=None: UnitCollectives((), ar, (), (), (), ()))
    e = embedding_cost(Fake(), SPEC, 2, LINK, 2, 4, _cm(), cp=2)
    assert e.bwd_comm == close(_ar(4 * H * 2, 2)) and e.fwd_comm == 0.0


def test_embedding_and_head_of_an_uneven_group_read_its_ratios() -> None:
    """Pins embedding_cost's and head_cost's ``ratios``: tiny Llama (4 heads) in a TP 3 group split 2:1:1 has the
    gathers of a 3-rank group; without the ratios TP 3 cannot split 4 heads at all."""
    from hspmd_sdk.planner.tp_comm import TPCommError

    m = LlamaConfig.preset("tiny")
    e = embedding_cost(m, SPEC, 3, LINK, 2, 4, _cm(), ratios=[2, 1, 1])
    h = head_cost(m, SPEC, 3, LINK, 2, 4, _cm(), ratios=[2, 1, 1])
    assert e.fwd_comm == close(_ag(8 * 64 * 2, 3))
    assert h.fwd_comm == close(_ag(8 * 256 * 2, 3)) and h.bwd_comm == close(_ar(8 * 64 * 2, 3))
    with pytest.raises(TPCommError):
        embedding_cost(m, SPEC, 3, LINK, 2, 4, _cm())
    with pytest.raises(TPCommError):
        head_cost(m, SPEC, 3, LINK, 2, 4, _cm())


def test_fit_line_is_centred_small_spread_flat_and_clamped() -> None:
    """Pins fit_line: the slope from centred sums (sizes far from 0 with a small spread still give the line,
    where uncentred sums lose every digit); x with a spread below 1; x that does not vary gives a flat line at the
    mean with slope exactly 0 (not rounding noise), all-zero x too, at 0 for a mean below 0; a negative intercept
    under a slope below 1 is clamped to 0 and the slope refit through the origin."""
    xs = [3e9 + i for i in range(4)]  # y = 0.3 x + 5
    far = fit_line(xs, [0.3 * x + 5 for x in xs])
    assert far.a == close(0.3, rel=1e-9) and far.b == close(5.0, rel=1e-6)
    small = fit_line([0.1, 0.2, 0.3], [1.0, 2.0, 3.0])
    assert small.a == close(10.0) and small.b == close(0.0, abs=1e-12)
    flat = fit_line([3.0] * 4, [0.1, 0.7, 0.2, 0.9])
    assert (flat.a, flat.b) == (0.0, close(0.475))
    zero = fit_line([0.0, 0.0], [1.0, 2.0])
    assert (zero.a, zero.b) == (0.0, 1.5)
    assert (fit_line([0.0, 0.0], [-1.0, -2.0]).b, fit_line([2.0, 2.0], [-1.0, -2.0]).b) == (0.0, 0.0)  # below 0
    g = fit_line([2, 4, 6], [0.0, 1.1, 2.0])  # y ~ 0.5x - 0.97: through the origin, 16.4 / 56
    assert g.b == 0.0 and g.a == close(16.4 / 56)
    h = fit_line([1, 2, 3], [1.5, 2.5, 3.6])  # y ~ 1.05x + 0.43: a small slope with its intercept kept
    assert h.a == close(1.05) and h.b == close(2.5333333333333 - 1.05 * 2)
    k = fit_line([1, 2, 3], [0.5, 0.9, 1.2])  # a slope of 0.35 and an intercept of 0.17, both kept
    assert k.a == close(0.35) and k.b == close(0.8666666666666667 - 0.7)


def test_fit_plane_drops_the_most_negative_coefficient_first() -> None:
    """Pins fit_plane's order of refits: y = -0.5 x1 - 2 x2 + 12 with x2 falling as x1 rises: the x2 term (the
    most negative) goes first, after which y rises with x1 alone (the intercept then goes too); dropping x1 first
    would leave a flat line."""
    import numpy as np

    x1, x2 = [1.0, 2, 3, 4, 5, 6], [6.0, 4, 5, 2, 3, 1]
    ys = [-0.5 * a - 2 * b + 12 for a, b in zip(x1, x2)]
    p = fit_plane(x1, x2, ys)
    a = float(np.dot(x1, ys) / np.dot(x1, x1))
    assert (p.a, p.c, p.b) == (close(a), 0.0, 0.0) and a > 0.9


def test_fit_plane_of_negative_measurements_is_the_zero_plane() -> None:
    """Pins fit_plane when every coefficient comes out negative in turn: all are dropped and the fit is 0."""
    p = fit_plane([1.0, 2, 3, 4], [4.0, 1, 3, 2], [-1.0] * 4)
    assert (p.a, p.c, p.b, p.r2) == (0.0, 0.0, 0.0, None)


def test_fit_plane_of_seconds_reports_r2_and_computes_in_float64() -> None:
    """Pins fit_plane's r2 for measurements in seconds (total variance far below 1), and that float32 inputs are
    fitted in float64: the same fit as the same values given as Python floats."""
    import numpy as np

    x1, x2 = np.array([1.0, 2, 3, 1, 5, 4]), np.array([0.0, 1, 5, 2, 2, 3])
    y = 2e-3 * x1 + 5e-4 * x2 + 4e-3 + np.array([1e-4, -2e-4, 5e-5, 0.0, 1e-4, -5e-5])
    p = fit_plane(x1, x2, y)
    X = np.column_stack([x1, x2, np.ones(6)])
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    assert p.r2 == close(1 - ((X @ coef - y) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    y32 = y.astype(np.float32)
    assert fit_plane(x1.astype(np.float32), x2.astype(np.float32), y32) == \
        fit_plane(list(map(float, x1)), list(map(float, x2)), [float(v) for v in y32])


def test_fit_link_defaults_backend_and_flat_all_reduce() -> None:
    """Pins fit_link: no backend named gives ``""``; an all-reduce that does not grow with size (and no in-context
    sweep) gives the 1e12 bytes/s sentinel for the collective bandwidth, as for p2p."""
    sizes = [0, 100, 200, 400]
    lo = fit_link(sizes, [1 + s / 50 for s in sizes], [2.0] * 4)
    assert lo.backend == "" and lo.collective_bandwidth == 1e12 and lo.collective_latency == 1.0


def test_cost_model_file_is_two_space_indented_json(tmp_path) -> None:
    """Pins CostModel.save's file: the model's JSON indented by two spaces (as the calibration files hold it)."""
    cm = CostModel(default_mfu=0.3)
    cm.save(tmp_path / "c.json")
    assert (tmp_path / "c.json").read_text() == cm.model_dump_json(indent=2)
    assert '\n  "default_mfu": 0.3,' in (tmp_path / "c.json").read_text()


def test_fit_line_of_an_exact_line_through_the_origin_keeps_its_slope() -> None:
    """Pins fit_line at an intercept of exactly 0: the centred least-squares slope stands (1 ns a byte, exactly);
    refitting it through the origin (sum x y / sum x x) would round it to 1.0000000000000003e-09."""
    sizes = [41.0, 46e6]
    f = fit_line(sizes, [s * 1e-9 for s in sizes])
    assert (f.a, f.b) == (1e-9, 0.0)


def test_optimizer_time_memory_bound_exactly() -> None:
    """Pins CostModel.optimizer_time's memory-bound figure to the bit: params x bytes / (GB/s x 1e9 x efficiency)."""
    cm = CostModel(hbm_gbs={"k": 100.0}, hbm_efficiency=0.5, optimizer_bytes_per_param=28.0)
    assert cm.optimizer_time(1e9, SPEC) == 1e9 * 28.0 / (100.0 * 1e9 * 0.5)


def test_cp_attention_share_is_contiguous_by_default() -> None:
    """Pins cp_attention_share's default layout: contiguous chunks, the last rank's (2cp - 1) / cp**2."""
    from hspmd_sdk.planner.cost import cp_attention_share

    assert (cp_attention_share(2), cp_attention_share(2, True), cp_attention_share(1)) == (0.75, 0.5, 1.0)


def test_layer_cost_of_an_uneven_group_reads_its_ratios_and_leaves_a_share_to_the_caller() -> None:
    """Pins layer_cost's ``ratios`` and _collectives: tiny Llama (4 heads) in a TP 3 group split 2:1:1 has two
    all-reduces of the hidden state each way over 3 ranks (without the ratios 4 heads cannot split 3 ways); a
    device's compute share (degree 4 / 2 = 2.0, not the group's 3 ranks) carries no collectives: the simulator
    prices those at the group's degree."""
    from hspmd_sdk.planner.tp_comm import TPCommError

    m = LlamaConfig.preset("tiny")
    c = layer_cost(m, SPEC, 3, LINK, 2, 4, _cm(), ratios=[2, 1, 1])
    assert (c.fwd_comm, c.bwd_comm) == (close(2 * _ar(8 * 64 * 2, 3)), close(2 * _ar(8 * 64 * 2, 3)))
    with pytest.raises(TPCommError):
        layer_cost(m, SPEC, 3, LINK, 2, 4, _cm())
    share = layer_cost(m, SPEC, 2.0, LINK, 2, 4, _cm(), ratios=[2, 1, 1])
    assert (share.fwd_comm, share.bwd_comm) == (0.0, 0.0) and share.params == close(m.layer_param_count() / 2)


def test_layer_cost_cp_ring_hops_recompute_and_no_ring_at_cp1() -> None:
    """Pins layer_cost's CP ring (analytic Fake, 1000 FLOP/s): CP 3 over 12 tokens rings 2 forward hops of one
    128-byte block each (0.01 + 128 / 51.2 s a hop) against 400 x ... attention FLOPs; with recompute the backward
    pays the forward's ring again; at CP 1 a given link carries no ring."""
    m = Fake()
    hop = 0.01 + 128 / (64.0 * 0.8)
    c3 = layer_cost(m, SPEC, 1, LINK, 2, 6, _cm(), cp=3, cp_link=LINK)
    att = 10 * 12 * 6 * 5 / 9  # the last of 3 chunks: 5/9 of the causal attention
    assert c3.ring_gap_fwd == close(2 * hop - att / 1000) and c3.ring_gap_bwd == close(5 * hop - 2 * att / 1000)
    m2 = layer_cost(m, SPEC, 1, LINK, 2, 4, _cm(), cp=2, cp_link=LINK)
    r2 = layer_cost(m, SPEC, 1, LINK, 2, 4, _cm(), cp=2, cp_link=LINK, recompute=True)
    assert m2.bwd_comm == close(3 * hop - 2 * 0.24) and r2.bwd_comm == close(3 * hop - 2 * 0.24 + hop - 0.24)
    one = layer_cost(m, SPEC, 1, LINK, 2, 4, _cm(), cp=1, cp_link=LINK)
    assert (one.ring_gap_fwd, one.ring_gap_bwd, one.fwd_comm) == (0.0, 0.0, 0.0)


# ---- counts of values priced at their dtype (wire_bytes, p2p_seconds, collective_seconds; issue 47, item 5) -------
def test_values_are_priced_at_their_dtype_or_at_bf16_times_the_factor() -> None:
    """``wire_bytes``: 4 a value at float32, 2 at bfloat16, and without a dtype the model's count (bf16) times
    ``comm_bytes_factor``; ``p2p_seconds`` / ``collective_seconds`` are ``p2p_time`` / ``collective_time`` of those
    bytes (which apply the factor themselves), and nothing for no values, one device or a rank's own link."""
    link, own = Link("inter", 100.0, 1.0), Link("self", 1.0, 1.0)
    cm = CostModel(p2p_efficiency=0.5, comm_scale=2.0, comm_bytes_factor=3.0)
    assert cm.wire_bytes(10) == 60 and cm.wire_bytes(10, "float32") == 40 and cm.wire_bytes(10, "bfloat16") == 20
    assert cm.p2p_seconds(10, link) == close(cm.p2p_time(20, link))  # the factor applied once
    assert cm.p2p_seconds(10, link, "float32") == close(cm.p2p_time(40 / 3, link))
    assert cm.p2p_seconds(1, link, "float32") > 0
    assert cm.p2p_seconds(0, link) == 0.0 and cm.p2p_seconds(5, own) == 0.0
    for op in ("AllReduce", "AllGather"):
        assert cm.collective_seconds(op, 10, 4, link, "float32") == close(cm.collective_time(op, 40 / 3, 4, link))
        assert cm.collective_seconds(op, 10, 4, link) == close(cm.collective_time(op, 20, 4, link))
    assert cm.collective_seconds("AllReduce", 1, 2, link) > 0
    assert cm.collective_seconds("AllReduce", 0, 2, link) == 0.0
    assert cm.collective_seconds("AllReduce", 5, 1, link) == 0.0
    assert cm.collective_seconds("AllReduce", 5, 2, own) == 0.0


def test_the_operators_comm_is_priced_at_the_dtype_given() -> None:
    """The TP collectives of a layer, the embedding and the head, and a CP ring over a slow link, cost more at
    float32 than at bfloat16 (twice the bytes; the same latency), their compute unchanged."""
    model, cm = Fake(), _cm()
    slow = Link("inter", 1e-6, 1e-6)
    for fn in (layer_cost, embedding_cost, head_cost):
        f32, b16 = (fn(model, SPEC, 2, LINK, 2, 16, cm, dtype=d) for d in ("float32", "bfloat16"))
        assert f32.fwd_comm > 0 or f32.bwd_comm > 0, fn.__name__
        for a, b in ((f32.fwd_comm, b16.fwd_comm), (f32.bwd_comm, b16.bwd_comm)):
            assert a > b or a == b == 0, fn.__name__
        assert f32.fwd_compute == b16.fwd_compute and f32.bwd_compute == b16.bwd_compute
    f32, b16 = (layer_cost(model, SPEC, 1, LINK, 2, 16, cm, cp=2, cp_link=slow, dtype=d)
                for d in ("float32", "bfloat16"))
    assert f32.ring_gap_fwd > b16.ring_gap_fwd > 0 and f32.ring_gap_bwd > b16.ring_gap_bwd > 0
