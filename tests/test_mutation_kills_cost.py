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
from hspmd_sdk.planner.cost import (ComputeFit, CostModel, LayerCost, LinkOverride, OperatorProfile, _fit_line,
                                    _fit_plane, activation_memory, embedding_cost, fit_link, head_cost, layer_cost,
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
    f = _fit_line([1, 2, 3, 4], [5, 7, 9, 11])
    assert (f.a, f.b, f.r2) == (close(2), close(3), close(1))
    g = _fit_line([1, 2, 3], [1, 3, 5])  # y = 2x - 1: intercept clamped to 0, slope refit through the origin
    assert g.b == 0.0 and g.a == close(22 / 14)
    assert g.r2 == close(1 - sum((y - 22 / 14 * x) ** 2 for x, y in [(1, 1), (2, 3), (3, 5)]) / 8)
    d = _fit_line([1, 2, 3], [9, 8, 7])  # falling: a flat line at the mean
    assert d.a == 0.0 and d.b == close(8)
    c = _fit_line([2, 2, 2], [4, 4, 4])
    assert c.a == 0.0 and c.b == close(4) and c.r2 is None
    n = _fit_line([1, 2, 3, 4], [2.1, 3.9, 6.2, 7.8])
    assert n.a == close(1.94) and n.b == close(0.15)  # sxy 9.7 / sxx 5; 5 - 1.94 * 2.5 and 0.99 < n.r2 < 1


def test_fit_plane_cases() -> None:
    x1, x2 = [1, 2, 3, 1, 5], [0, 1, 5, 2, 2]
    p = _fit_plane(x1, x2, [2 * a + 3 * b + 1 for a, b in zip(x1, x2)])
    assert (p.a, p.c, p.b) == (close(2), close(3), close(1)) and p.r2 == close(1)
    q = _fit_plane([1, 2, 3], [1, 2, 3], [4, 7, 10])  # x2 = x1: one line over x1 + x2
    assert q.c is None and q.a == close(1.5) and q.b == close(1)
    r = _fit_plane(x1, x2, [2 * a - 1 * b + 4 for a, b in zip(x1, x2)])  # c < 0: dropped, the rest refit
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

    small = _fit_line([1, 2, 3], [0.1, 0.2, 0.35])  # total variance below 1 still gets an r2
    ys = np.array([0.1, 0.2, 0.35])
    res = ((ys - (small.a * np.array([1, 2, 3]) + small.b)) ** 2).sum()
    assert small.r2 == close(1 - res / ((ys - ys.mean()) ** 2).sum())
    x1, x2 = np.array([1.0, 2, 3, 1, 5, 4]), np.array([0.0, 1, 5, 2, 2, 3])
    y = 2 * x1 - x2 + 4 + np.array([0.1, -0.2, 0.05, 0.0, 0.1, -0.05])
    p = _fit_plane(x1, x2, y)
    # the x2 coefficient comes out negative: dropped, and a, b refit by least squares on [x1, 1] alone
    full = np.linalg.lstsq(np.column_stack([x1, x2, np.ones(6)]), y, rcond=None)[0]
    assert full[1] < 0
    a, b = np.linalg.lstsq(np.column_stack([x1, np.ones(6)]), y, rcond=None)[0]
    assert (p.a, p.c, p.b) == (close(a), 0.0, close(b))
    r2 = 1 - ((a * x1 + b - y) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    assert p.r2 == close(r2)
    flat = _fit_plane([1, 2, 3, 4], [4, 1, 3, 2], [5.0] * 4)
    assert flat.r2 is None and flat.b == close(5.0) and flat.a == close(0.0, abs=1e-9)


def test_cost_model_file_round_trip(tmp_path) -> None:
    cm = CostModel(default_mfu=0.3, mfu={"k": 0.2}, link_overrides={"inter": LinkOverride(latency=1, bandwidth=2)},
                   cores=3)
    cm.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == cm
    assert '"default_mfu": 0.3' in (tmp_path / "c.json").read_text()
