"""The step simulator and the cost model (§8), checked against pipeline theory and hand arithmetic."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.planner import CostModel, simulate
from hspmd_sdk.runtime.control.profile import profile_device
from hspmd_sdk.planner.cost import ComputeFit

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"
NO_COMM = CostModel(comm_scale=0.0, include_embedding=False)


def _uniform(p: int, m: int, *, tp: int = 1, layers_per_stage: int = 2, pipelines: int = 1, mbs: int = 1,
             schedule: str = "1f1b", zero1: bool = False, recompute: bool = False) -> Strategy:
    pipes = []
    for i in range(pipelines):
        base = i * p * tp
        pipes.append({"micro_batch_size": mbs, "num_micro_batches": m, "stages": [
            {"devices": list(range(base + s * tp, base + (s + 1) * tp)),
             "layers": [s * layers_per_stage, (s + 1) * layers_per_stage - 1], "recompute": recompute}
            for s in range(p)]})
    return Strategy.load({"pipelines": pipes, "schedule": schedule, "zero1": zero1})


def _model(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=32000, hidden_size=4096, num_layers=layers, num_heads=32,
                       ffn_hidden_size=11008, max_seq_len=4096)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (3, 12), (1, 4)])
def test_bubble_fraction_matches_pipeline_theory(schedule: str, p: int, m: int) -> None:
    model, tp, seq = _model(2 * p), 2, 2048
    cluster = Cluster.homogeneous("H800", p * tp)
    res = simulate(model, _uniform(p, m, tp=tp, schedule=schedule), cluster, seq_len=seq, cost=NO_COMM)
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    # independent reference: 2 layers a stage, FLOPs / TP / (peak x MFU), backward = 2 forwards
    f = 2 * model.layer_flops(seq, seq) / tp / (990e12 * 0.45)
    assert res.pipeline_end[0] == pytest.approx((m + p - 1) * 3 * f, rel=1e-9)


def test_timeline_is_a_partition_of_the_step() -> None:
    model = _model(8)
    res = simulate(model, _uniform(4, 6, tp=2, pipelines=2, zero1=True), Cluster.homogeneous("H20", 16),
                   seq_len=1024)
    for dev, events in res.timeline.items():
        assert events[0].start == 0.0 and events[-1].end == pytest.approx(res.step_time)
        for a, b in zip(events, events[1:]):
            assert a.end == pytest.approx(b.start)
        assert sorted(e.micro_batch for e in events if e.kind == "F") == list(range(6))
        assert [e.kind for e in events if e.kind in ("sync", "optim")][-1] == "optim"
    assert res.step_time > max(res.pipeline_end)


def test_communication_costs_time() -> None:
    model, cluster = _model(8), Cluster.homogeneous("H800", 16)
    strategy = _uniform(4, 8, tp=2, pipelines=2, zero1=True)
    free = simulate(model, strategy, cluster, seq_len=2048, cost=CostModel(comm_scale=0.0))
    paid = simulate(model, strategy, cluster, seq_len=2048)
    assert paid.step_time > free.step_time
    assert all(t.end > t.start for t in paid.transfers)
    assert len(paid.transfers) == 2 * 2 * 3 * 8  # pipelines x (F and B) x stage boundaries x micro-batches


def test_memory_of_tiny_model_matches_param_and_optimizer_bytes() -> None:
    model = LlamaConfig.preset("tiny")  # 4 layers
    cluster = Cluster.local(4)
    h, v, f = model.hidden_size, model.vocab_size, model.ffn_hidden_size
    layer = 4 * h * h + 3 * h * f + 2 * h  # MHA: q, k, v, o; SwiGLU; two norms
    emb, head = v * h, h * v + h
    for zero1 in (False, True):
        strat = _uniform(2, 2, layers_per_stage=2, pipelines=2, zero1=zero1)
        res = simulate(model, strat, cluster, seq_len=16)
        shards = 2 if zero1 else 1
        for dev, stage_params in ((0, 2 * layer + emb), (1, 2 * layer + head), (2, 2 * layer + emb),
                                  (3, 2 * layer + head)):
            mem = res.memory[dev]
            assert mem["params"] == pytest.approx(2 * stage_params)
            assert mem["grads"] == pytest.approx(2 * stage_params)
            assert mem["optimizer"] == pytest.approx(12 * stage_params / shards)


def test_memory_tp_and_schedule_and_recompute() -> None:
    model, cluster = _model(8), Cluster.homogeneous("H800", 8)
    cost = CostModel(include_embedding=False)
    one = simulate(model, _uniform(4, 8, tp=2), cluster, seq_len=4096, cost=cost)
    gp = simulate(model, _uniform(4, 8, tp=2, schedule="gpipe"), cluster, seq_len=4096, cost=cost)
    rc = simulate(model, _uniform(4, 8, tp=2, recompute=True), cluster, seq_len=4096, cost=cost)
    # 1F1B stage 0 holds 4 micro-batches, GPipe 8; the last 1F1B stage holds one
    act = one.memory[0]["activations"]
    per_mb = 2 * model.layer_activation_bytes(4096) / 2  # 2 layers, sequence parallel over TP 2
    assert act == pytest.approx(4 * per_mb)
    assert gp.memory[0]["activations"] == pytest.approx(8 * per_mb)
    assert one.memory[6]["activations"] == pytest.approx(per_mb)
    assert rc.memory[0]["activations"] < act / 4
    assert rc.step_time > one.step_time
    # TP halves parameters per device
    assert one.memory[2]["params"] == pytest.approx(2 * 2 * model.layer_param_count() / 2)


def test_oom_is_reported() -> None:
    model = LlamaConfig.preset("llama-70b")
    strat = Strategy.load({"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 4, "stages": [
        {"devices": [0], "layers": [0, 39]}, {"devices": [1], "layers": [40, 79]}]}]})
    res = simulate(model, strat, Cluster.homogeneous("H20", 2), seq_len=4096)
    assert res.oom == [0, 1]
    assert "OOM" in res.summary()


def test_global_batch_must_match() -> None:
    with pytest.raises(PlanValidationError, match="global batch"):
        simulate(_model(8), _uniform(4, 8), Cluster.homogeneous("H800", 4), seq_len=128, global_batch=64)


def test_uneven_pipelines_run_their_own_micro_batches() -> None:
    data = json.loads((EXAMPLES / "table11_c2.json").read_text())
    res = simulate(LlamaConfig.preset("llama-32b"), Strategy.load(data), Cluster.load(EXAMPLES / "h20_31.json"),
                   seq_len=4096, global_batch=64)
    for dev in (0, 16, 30):
        n = 33 if dev < 16 else 31
        assert sum(1 for e in res.timeline[dev] if e.kind == "B") == n
    assert not res.oom


def test_cost_model_profile_and_round_trip(tmp_path: Path) -> None:
    # a wide FLOP range (0.5 MFLOP to 2.1 GFLOP) so that the slope stays positive even on a loaded machine (with
    # 268 MFLOP at the top, a millisecond of thread wake-up on every call once flattened the fit to a = 0)
    cost = profile_device("cpu", shapes=[(64, 64, 64), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024)],
                          repeats=3)
    fit = cost.compute_fits["cpu"]
    # A live fit's slope is this machine's timing: under load it can come out flat (clamped to 0), so only its form
    # is checked on the live profile; the fitting itself is checked on known points, against numpy's least squares.
    assert fit.a >= 0 and fit.b >= 0 and fit.device == "cpu" and fit.tflops > 0
    from hspmd_sdk.planner.cost import fit_line

    xs = [2.0 * m ** 3 for m in (64, 256, 512, 1024)]
    ys = [3e-11 * x + 2e-4 + e for x, e in zip(xs, (1e-6, -2e-6, 1.5e-6, -0.5e-6))]
    slope, intercept = np.polyfit(xs, ys, 1)
    known = fit_line(xs, ys)
    assert known.a == pytest.approx(slope, rel=1e-9) and known.b == pytest.approx(intercept, rel=1e-6)
    assert math.isfinite(known.tflops) and known.tflops == pytest.approx(1e-12 / 3e-11, rel=1e-3)
    cost.save(tmp_path / "cost.json")
    assert CostModel.load(tmp_path / "cost.json") == cost
    spec = Cluster.local(1).spec(0)
    assert cost.compute_time(1e9, spec) == pytest.approx(fit.a * 1e9 + fit.b)
    fitted = CostModel(compute_fits={"cpu": ComputeFit(a=1e-9, b=0.5)})
    assert fitted.compute_time(2e9, spec) == pytest.approx(2.5)


def test_profile_model_round_trip_and_use(tmp_path: Path) -> None:
    from hspmd_sdk.planner.cost import LinkOverride, OperatorProfile, layer_cost
    from hspmd_sdk.runtime.control.profile import profile_model

    model = LlamaConfig.preset("tiny")
    # medians of 3 sweeps: one sweep on a loaded machine can time a phase (a difference of two timings) at ~0
    cost = profile_model(model, "cpu", threads=1, shapes=[(16, 16), (64, 16)], repeats=3)
    prof = cost.profiles["cpu"]
    cost.save(tmp_path / "cost.json")
    assert CostModel.load(tmp_path / "cost.json") == cost
    for fit in (prof.layer_fwd, prof.layer_bwd, prof.head_fwd, prof.head_bwd, prof.embed):
        small, large = fit.a * 1e6 + fit.b, fit.a * 1e9 + fit.b
        assert fit.a >= 0 and fit.b >= 0 and 0 < small <= large  # positive, monotonic
    assert prof.optimizer_s_per_param > 0 and prof.shapes == [(16, 16), (64, 16)]
    # the profiled lines are the layer's compute; cores scales compute under oversubscription
    c = CostModel(profiles={"cpu": OperatorProfile(layer_fwd=ComputeFit(a=1e-9, b=0.0),
                                                   layer_bwd=ComputeFit(a=3e-9, b=0.0),
                                                   head_fwd=ComputeFit(a=0.0, b=0.0),
                                                   head_bwd=ComputeFit(a=0.0, b=0.0))},
                  include_embedding=False)
    cl = Cluster.local(4)
    lc = layer_cost(model, cl.spec(0), 1, cl.link(0, 0), 1, 16, c)
    assert lc.fwd_compute == pytest.approx(1e-9 * model.layer_flops(16, 16))
    assert lc.bwd_compute == pytest.approx(3 * lc.fwd_compute)
    strat = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1, "stages": [
        {"devices": [0], "layers": [0, model.num_layers - 1]}]}, {"micro_batch_size": 1, "num_micro_batches": 1,
        "stages": [{"devices": [1], "layers": [0, model.num_layers - 1]}]}]}
    base = simulate(model, strat, Cluster.local(2), seq_len=16, cost=c.model_copy(update={"comm_scale": 0.0}))
    shared = simulate(model, strat, Cluster.local(2), seq_len=16,
                      cost=c.model_copy(update={"comm_scale": 0.0, "cores": 1}))
    assert shared.step_time == pytest.approx(2 * base.step_time)
    # processor sharing: ranks slow each other only while both compute (a pipeline's stages with one micro-batch
    # never do: the forward and backward of rank 0 bracket rank 1's); the optimizer left out (it would overlap)
    quiet = c.model_copy(update={"comm_scale": 0.0, "optimizer_bytes_per_param": 0.0})
    pp = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1, "stages": [
        {"devices": [0], "layers": [0, 0]}, {"devices": [1], "layers": [1, model.num_layers - 1]}]}]}
    alone = simulate(model, pp, Cluster.local(2), seq_len=16, cost=quiet)
    one_core = simulate(model, pp, Cluster.local(2), seq_len=16, cost=quiet.model_copy(update={"cores": 1}))
    spans = lambda r: [(e.kind, pytest.approx(e.duration)) for d in (0, 1) for e in r.timeline[d]
                       if e.kind in ("F", "B")]  # noqa: E731
    assert spans(one_core) == spans(alone)
    # DP2 with one pipeline of twice the work on 1 core: the short one computes beside the long one all its time
    # (slowed 2x); the long one's first part is shared, the rest alone: with x its own compute time, the short
    # one ends at 2 * x / 2 = x, by when the long one has done x / 2; the other 3x / 4... so 1.5x in all
    uneven = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1, "stages": [
        {"devices": [0], "layers": [0, model.num_layers - 1]}]}, {"micro_batch_size": 1, "num_micro_batches": 2,
        "stages": [{"devices": [1], "layers": [0, model.num_layers - 1]}]}]}
    free = simulate(model, uneven, Cluster.local(2), seq_len=16, cost=quiet)
    sharing = simulate(model, uneven, Cluster.local(2), seq_len=16, cost=quiet.model_copy(update={"cores": 1}))
    work = lambda r, d: sum(e.duration for e in r.timeline[d] if e.kind in ("F", "B"))  # noqa: E731
    assert work(sharing, 0) == pytest.approx(2 * work(free, 0), rel=1e-2)
    assert work(sharing, 1) == pytest.approx(1.5 * work(free, 1), rel=1e-2)
    # link overrides replace the cluster's figures for that link class
    slow = c.model_copy(update={"link_overrides": {"intra": LinkOverride(latency=1e-3, bandwidth=1e9)}})
    link = cl.link(0, 1)
    assert slow.p2p_time(1e6, link) == pytest.approx(1e-3 + 1e-3)
    assert slow.collective_time("all_reduce", 1e6, 2, link) == pytest.approx(2 * 1e-3 + 1e6 / 1e9)


def test_ring_collective_formula() -> None:
    link = Cluster.homogeneous("H800", 8).link(0, 1)
    cost = CostModel(collective_efficiency=1.0)
    nbytes = 1e9
    ar = cost.collective_time("all_reduce", nbytes, 4, link)
    assert ar == pytest.approx(2 * 3 / 4 * nbytes / link.bandwidth + 6 * link.latency)
    rs = cost.collective_time("reduce_scatter", nbytes, 4, link)
    assert rs == pytest.approx(3 / 4 * nbytes / link.bandwidth + 3 * link.latency)


def _fixture(name: str) -> tuple[LlamaConfig, Strategy, Cluster, int]:
    meta = json.loads((EXAMPLES / "index.json").read_text())["strategies"][name]
    return (LlamaConfig.preset(meta["model"]), Strategy.load(EXAMPLES / name), Cluster.load(EXAMPLES / meta["cluster"]),
            meta["global_batch"])


def test_table9_32b_beats_megatron_on_16_h800_16_h20() -> None:
    """Figure 15: HSPMD's heterogeneous strategy (Table 9) is faster than Megatron's DP2TP4PP4 (Table 8)."""
    out = {}
    for name in ("table9_32b_16h800_16h20.json", "megatron_32b_16h800_16h20.json"):
        model, strat, cluster, gb = _fixture(name)
        out[name] = simulate(model, strat, cluster, seq_len=4096, global_batch=gb)
        assert not out[name].oom, out[name].summary()
    hspmd, megatron = out.values()
    print(f"\nHSPMD {hspmd.step_time:.2f} s, Megatron {megatron.step_time:.2f} s, "
          f"speed-up {megatron.step_time / hspmd.step_time:.2f}x")
    assert hspmd.step_time < megatron.step_time


def test_call_latency_and_tp_collectives_counted_by_hand() -> None:
    """Issue 17: a blocking collective pays ``call_latency`` once on top of its ring steps; a TP layer without
    sequence parallelism adds ``1 - 1/tp`` of its replicated norms/residuals; the embedding all-gathers its output
    and the head all-gathers the logits (forward) and all-reduces its input gradient (backward)."""
    from hspmd_sdk.planner.cost import (BF16, LinkOverride, OperatorProfile, embedding_cost, fit_link, head_cost,
                                        layer_cost)

    lk = LinkOverride(latency=1e-4, bandwidth=1e9, collective_latency=2e-4, collective_bandwidth=5e8,
                      call_latency=1e-3)
    line = ComputeFit(a=1e-9, b=0.0)
    prof = OperatorProfile(layer_fwd=line, layer_bwd=line, head_fwd=line, head_bwd=line,
                           layer_replicated_fwd=ComputeFit(a=2e-9, b=0.0),
                           layer_replicated_bwd=ComputeFit(a=3e-9, b=0.0))
    c = CostModel(profiles={"cpu": prof}, link_overrides={"intra": lk}, comm_bytes_factor=2.0)
    cl = Cluster.local(4)
    link, spec = cl.link(0, 1), cl.spec(0)
    for n in (2, 4):
        assert c.collective_time("all_reduce", 1e6, n, link) == pytest.approx(
            1e-3 + 2 * (n - 1) * 2e-4 + 2 * (n - 1) / n * 2e6 / 5e8)
        assert c.collective_time("all_gather", 1e6, n, link) == pytest.approx(
            1e-3 + (n - 1) * 2e-4 + (n - 1) / n * 2e6 / 5e8)
    assert c.collective_time("all_reduce", 1e6, 1, link) == 0.0  # no call, no latency
    m = LlamaConfig.preset("tiny")
    tokens, ar = 2 * 16, c.collective_time("all_reduce", 2 * 16 * m.hidden_size * BF16, 2, link)
    sp = layer_cost(m, spec, 2, link, 2, 16, c)
    full = layer_cost(m, spec, 2, link, 2, 16, c.model_copy(update={"sequence_parallel": False}))
    assert sp.fwd_compute == pytest.approx(1e-9 * m.layer_flops(tokens, 16) / 2)
    assert full.fwd_compute - sp.fwd_compute == pytest.approx(0.5 * 2e-9 * tokens * m.hidden_size)
    assert full.bwd_compute - sp.bwd_compute == pytest.approx(0.5 * 3e-9 * tokens * m.hidden_size)
    assert (full.fwd_comm, full.bwd_comm) == pytest.approx((2 * ar, 2 * ar))
    emb = embedding_cost(m, spec, 2, link, 2, 16, c)
    assert emb.fwd_comm == pytest.approx(c.collective_time("all_gather", tokens * m.hidden_size * BF16, 2, link))
    head = head_cost(m, spec, 2, link, 2, 16, c)
    assert head.fwd_comm == pytest.approx(c.collective_time("all_gather", tokens * m.vocab_size * BF16, 2, link))
    assert head.bwd_comm == pytest.approx(ar)
    assert head_cost(m, spec, 1, cl.link(0, 0), 2, 16, c).fwd_comm == 0.0
    # fit_link: lines through hand-made points come back exactly
    sizes = [1e4, 1e5, 1e6]
    got = fit_link(sizes, [5e-5 + s / 2e9 for s in sizes], [4e-4 + s / 1e9 for s in sizes],
                   [1.5e-3 + s / 4e8 for s in sizes])
    assert (got.latency, got.bandwidth) == pytest.approx((5e-5, 2e9))
    assert (got.collective_latency, got.call_latency, got.collective_bandwidth) == pytest.approx((2e-4, 1.1e-3, 4e8))
    back = fit_link(sizes, [5e-5 + s / 2e9 for s in sizes], [4e-4 + s / 1e9 for s in sizes])
    assert (back.call_latency, back.collective_bandwidth) == pytest.approx((0.0, 1e9))
    # the skew: after 2 ms of compute a call waits 0.2 ms more than its floor + call latency, after 8 ms 0.8 ms
    skewed = fit_link(sizes, [5e-5 + s / 2e9 for s in sizes], [4e-4 + s / 1e9 for s in sizes],
                      [4e-4 + 7e-4 + 0.1 * 2e-3 + s / 4e8 for s in sizes], compute_s=(2e-3, 8e-3),
                      in_context_long=[4e-4 + 7e-4 + 0.1 * 8e-3 + s / 4e8 for s in sizes])
    assert (skewed.skew, skewed.call_latency, skewed.collective_bandwidth) == pytest.approx((0.1, 7e-4, 4e8))
    with pytest.raises(ValueError, match="compute_s"):
        fit_link(sizes, [1e-4] * 3, [1e-4] * 3, [1e-4] * 3, in_context_long=[1e-4] * 3)
    with pytest.raises(ValueError, match="in_context"):
        fit_link(sizes, [1e-4] * 3, [1e-4] * 3, in_context_long=[1e-4] * 3, compute_s=(1e-3, 4e-3))


def test_skew_is_paid_after_the_compute_before_each_blocking_tp_collective() -> None:
    """``LinkOverride.skew``: a TP group's blocking collectives wait ``skew`` seconds per second of compute before
    them (the layer's forward before its two forward all-reduces, its backward before the backward ones, the head
    before the logits' gather and its input-gradient all-reduce); nothing without TP or with ``skew`` 0."""
    from hspmd_sdk.planner.cost import LinkOverride, OperatorProfile, head_cost, layer_cost

    line = ComputeFit(a=1e-9, b=1e-5)
    prof = OperatorProfile(layer_fwd=line, layer_bwd=line, head_fwd=line, head_bwd=line)
    base = LinkOverride(latency=1e-4, bandwidth=1e9, collective_latency=2e-4, collective_bandwidth=5e8,
                        call_latency=1e-3)
    plain = CostModel(profiles={"cpu": prof}, link_overrides={"intra": base})
    skewed = plain.model_copy(update={"link_overrides": {"intra": base.model_copy(update={"skew": 0.25})}})
    cl, m = Cluster.local(2), LlamaConfig.preset("tiny")
    link, spec = cl.link(0, 1), cl.spec(0)
    assert skewed.collective_skew(2, link) == 0.25 and skewed.collective_skew(1, link) == 0.0
    assert skewed.collective_skew(2, cl.link(0, 0)) == 0.0 and plain.collective_skew(2, link) == 0.0
    for recompute in (False, True):
        a = layer_cost(m, spec, 2, link, 2, 16, plain, recompute=recompute)
        b = layer_cost(m, spec, 2, link, 2, 16, skewed, recompute=recompute)
        assert (b.fwd_compute, b.bwd_compute) == (a.fwd_compute, a.bwd_compute)
        assert b.fwd_comm - a.fwd_comm == pytest.approx(0.25 * a.fwd_compute)
        assert b.bwd_comm - a.bwd_comm == pytest.approx(0.25 * a.bwd_compute)  # the recomputed forward included
    ha, hb = head_cost(m, spec, 2, link, 2, 16, plain), head_cost(m, spec, 2, link, 2, 16, skewed)
    assert (hb.fwd_comm - ha.fwd_comm, hb.bwd_comm - ha.bwd_comm) == pytest.approx(
        (0.25 * ha.fwd_compute, 0.25 * ha.bwd_compute))
    one = layer_cost(m, spec, 1, cl.link(0, 0), 2, 16, skewed)
    assert one.fwd_comm == one.bwd_comm == 0.0
    strat = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, m.num_layers - 1]}],
                                          "micro_batch_size": 2, "num_micro_batches": 2}]})
    assert simulate(m, strat, cl, seq_len=16, cost=skewed).step_time > simulate(m, strat, cl, seq_len=16,
                                                                                cost=plain).step_time


@pytest.mark.timeout(120)
def test_profile_link_measures_gloo_between_two_processes() -> None:
    """A real 2-process gloo run: positive latencies and bandwidths; in context a call costs at least what it costs
    back to back (``call_latency >= 0``), and the profiled override is used by the cost model."""
    from hspmd_sdk.runtime.control.profile import profile_link

    lk = profile_link(sizes=(4096, 262144), repeats=2, compute_s=5e-4)
    assert lk.backend == "gloo" and lk.bandwidth > 0 and lk.collective_bandwidth > 0
    assert lk.latency >= 0 and lk.collective_latency >= 0 and lk.call_latency >= 0 and lk.skew >= 0
    with pytest.raises(ValueError, match="skew_compute_s"):
        profile_link(compute_s=1e-2, skew_compute_s=5e-3)  # refused before any process starts
    no_skew = profile_link(sizes=(4096, 262144), repeats=2, compute_s=5e-4, skew_compute_s=0)
    assert no_skew.skew == 0.0 and no_skew.call_latency >= 0
    floor = profile_link(sizes=(4096, 262144), repeats=2, compute_s=0.0)  # back to back only
    assert floor.call_latency == 0.0 and floor.skew == 0.0
    c = CostModel(link_overrides={"intra": lk})
    link = Cluster.local(2).link(0, 1)
    assert c.collective_time("all_reduce", 262144, 2, link) >= lk.call_latency + 2 * lk.collective_latency


def test_attention_flops_get_their_own_rate_when_the_profile_spans_lengths() -> None:
    """``fit_plane`` recovers ``a * matmul + c * attention + b`` exactly; ``layer_cost`` prices the attention part
    of ``layer_flops`` at ``c``; a profile at one sequence length keeps ``c = None`` (one rate)."""
    from hspmd_sdk.planner.cost import OperatorProfile, fit_plane, layer_cost
    from hspmd_sdk.runtime.control.profile import profile_model

    model = LlamaConfig.preset("tiny")
    shapes = [(16, 16), (64, 16), (64, 32), (64, 64), (128, 64)]
    mm = [float(model.layer_flops(t, 0)) for t, _ in shapes]
    att = [float(model.layer_flops(t, s) - model.layer_flops(t, 0)) for t, s in shapes]
    fit = fit_plane(mm, att, [2e-10 * m + 5e-11 * a + 1e-4 for m, a in zip(mm, att)])
    assert (fit.a, fit.c, fit.b) == pytest.approx((2e-10, 5e-11, 1e-4), rel=1e-6)
    line = ComputeFit(a=0.0, b=0.0)
    c = CostModel(profiles={"cpu": OperatorProfile(layer_fwd=fit, layer_bwd=fit, head_fwd=line, head_bwd=line)},
                  include_embedding=False)
    cl = Cluster.local(1)
    lc = layer_cost(model, cl.spec(0), 1, cl.link(0, 0), 2, 64, c)
    tokens = 128
    want = 2e-10 * model.layer_flops(tokens, 0) + 5e-11 * (model.layer_flops(tokens, 64)
                                                          - model.layer_flops(tokens, 0)) + 1e-4
    assert lc.fwd_compute == pytest.approx(want)
    single = profile_model(model, "cpu", threads=1, shapes=[(16, 16), (64, 16)], repeats=1, executor=False)
    assert single.profiles["cpu"].layer_fwd.c is None
    spanning = profile_model(model, "cpu", threads=1, shapes=[(64, 16), (64, 32), (128, 64)], repeats=1,
                             executor=False)
    assert spanning.profiles["cpu"].layer_fwd.c is not None  # fitted (possibly 0 if attention costs nothing here)


# ---- context parallelism (SPEC §11) priced: compute, ring volume, activation memory, by hand ------------------------
def _causal_share(seq: int, cp: int, balanced: bool) -> float:
    """The busiest rank's causal token pairs (query, key not after it) over the whole sequence's, counted token by
    token over its numpy chunks (independent of the runtime's layout): what a causal kernel computes."""
    n = 2 * cp if balanced else cp
    chunks = np.array_split(np.arange(seq), n)
    mine = [[r, n - 1 - r] if balanced else [r] for r in range(cp)]
    worst = max(sum(int(i) + 1 for q in own for i in chunks[q]) for own in mine)
    return worst / (seq * (seq + 1) / 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("balanced", [False, True])
def test_cp_attention_share_counts_the_visible_blocks(cp: int, balanced: bool) -> None:
    from hspmd_sdk.planner.cost import cp_attention_share

    want = 1.0 if cp == 1 else _causal_share(240, cp, balanced)
    assert cp_attention_share(cp, balanced) == pytest.approx(want, rel=1e-2)  # 240 tokens: the diagonal's share


@pytest.mark.timeout(30)
def test_cp_ring_volume_compute_and_activations_by_hand() -> None:
    """A CP2 (and CP2 x TP2) decoder layer of the tiny Llama, analytic cost model, by hand: keys and values of
    ``B x S/cp`` tokens (``2 x kv_dim`` bf16 each, ``/ tp``) go ``cp - 1`` hops forward and ``2cp - 1`` backward
    (blocks again, then the gradient accumulators home); compute is the linear FLOPs of ``S/cp`` tokens plus three
    quarters of the attention count (the last rank's causal share, contiguous); activations those of ``B x S/cp`` tokens; the ring is paid
    only where it outlasts the attention compute (a slow link: all but that)."""
    from hspmd_sdk.planner.cost import BF16, LinkOverride, cp_ring_bytes, layer_cost, embedding_cost, head_cost

    m = LlamaConfig.preset("tiny")
    h, kv, f = m.hidden_size, m.kv_dim, m.ffn_hidden_size
    B, S = 2, 1024
    for tp in (1, 2):
        block = 2 * B * (S / 2) * kv / tp * 2  # k and v of one rank's chunk, bf16
        assert cp_ring_bytes(m, B, S, tp, 2) == pytest.approx((block, 3 * block))
    assert cp_ring_bytes(m, B, S, 1, 3) == pytest.approx((2 * (2 * B * S / 3 * kv * 2), 5 * (2 * B * S / 3 * kv * 2)))
    assert cp_ring_bytes(m, B, S, 1, 1) == (0.0, 0.0)

    cl = Cluster.local(2)
    link, spec = cl.link(0, 1), cl.spec(0)
    peak = spec.bf16_tflops * 1e12 * 0.45
    cost = CostModel()
    got = layer_cost(m, spec, 1, cl.link(0, 0), B, S, cost, cp=2, cp_link=link)
    T = B * S / 2
    matmul = 2 * T * (2 * h * h + 2 * h * kv + 3 * h * f)
    attention = 4 * (B * S) * S * h * 3 / 4  # the last rank's causal share, contiguous CP2
    assert got.fwd_compute == pytest.approx((matmul + attention) / peak)
    assert got.bwd_compute == pytest.approx(2 * (matmul + attention) / peak)
    assert got.act_bytes == pytest.approx(T * (6 * h + 2 * kv + 3 * f) * 2)
    assert got.params == m.layer_param_count()  # duplicated over the CP group
    # a slow link: the ring's exposed seconds are the transfers less the attention compute they overlap
    slow = CostModel(link_overrides={"intra": LinkOverride(latency=1e-3, bandwidth=1e6)})
    s = layer_cost(m, spec, 1, cl.link(0, 0), B, S, slow, cp=2, cp_link=link)
    share = attention / (matmul + attention)
    assert s.fwd_comm == pytest.approx(1e-3 + block_bytes(m, B, S) / 1e6 - share * s.fwd_compute)
    assert s.bwd_comm == pytest.approx(3 * (1e-3 + block_bytes(m, B, S) / 1e6) - share * s.bwd_compute)
    # a fast one: hidden behind the attention
    assert got.fwd_comm == 0.0 and got.bwd_comm == 0.0
    # the embedding and the head on S/cp tokens
    assert head_cost(m, spec, 1, cl.link(0, 0), B, S, cost, cp=2).act_bytes == pytest.approx(T * h * BF16)
    assert head_cost(m, spec, 1, cl.link(0, 0), B, S, cost, cp=2).fwd_compute == pytest.approx(
        2 * T * h * m.vocab_size / peak)
    assert embedding_cost(m, spec, 1, cl.link(0, 0), B, S, cost, cp=2).params == m.embedding_param_count()


def block_bytes(m: LlamaConfig, B: int, S: int) -> float:
    return 2 * B * (S / 2) * m.kv_dim * 2


@pytest.mark.timeout(30)
def test_simulate_prices_a_cp_stage_memory_and_gradient_sync_by_hand() -> None:
    """``simulate`` takes a CP stage (it refused them before): per rank, activations of ``S/cp`` tokens of each
    in-flight micro-batch plus the transient logits, the whole parameters (duplicated), and a gradient all-reduce
    over the CP group even with one pipeline."""
    from hspmd_sdk.planner.cost import BF16, FP32

    m = LlamaConfig.preset("tiny")
    h, kv, f, V = m.hidden_size, m.kv_dim, m.ffn_hidden_size, m.vocab_size
    S, cl = 2048, Cluster.local(2)
    st = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 2,
                         "stages": [{"devices": [0, 1], "layers": [0, 3], "cp": 2}]}]}
    r = simulate(m, st, cl, seq_len=S)
    T = S / 2
    layers = m.num_layers * T * (6 * h + 2 * kv + 3 * f) * BF16
    head = T * h * BF16
    transient = 2 * T * V * FP32
    for d in (0, 1):
        assert r.memory[d]["activations"] == pytest.approx(layers + head + transient)  # 1F1B, one stage: 1 in flight
        assert r.memory[d]["params"] == pytest.approx(m.param_count() * BF16)
    sync = [e for e in r.timeline[0] if e.kind == "sync"]
    assert sync and sum(e.duration for e in sync) == pytest.approx(
        CostModel().collective_time("all_reduce", m.param_count() * BF16, 2, cl.link(0, 1)), rel=1e-6)
    one = simulate(m, {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 2,
                                      "stages": [{"devices": [0], "layers": [0, 3]}]}]}, Cluster.local(1), seq_len=S)
    assert one.memory[0]["activations"] == pytest.approx(2 * (layers + head) + 2 * transient)
