"""Planning time and plan quality of the three scenario planners (§8, Appendix A.1, Table 5).

Peers, in the same run and the same simulator / cost model:

* scenario (a): the paper's own HSPMD strategies (Table 9 fixtures) and Megatron's optimal homogeneous ones
  (Table 8 fixtures) on 16 H800 + 16/24/32 H20, 32B and 70B, 4K context, global batch 64;
* scenario (b): the paper's Table 11 strategies C2 (31 H20) and C3 (24 H20) after failures in C1;
* scenario (c): the best single homogeneous strategy over sequences packed into the context window (what
  Megatron / DeepSpeed do), on 32 H20 with 32K context and 200K tokens a batch.

Planning times exclude the one-off import of PuLP and Pyomo (about 1.5 s, done first).  Paper's figures
(Table 5): offline heterogeneous planning on 48 GPUs 6.4-18.2 s, elastic re-planning 0.05-1.2 s, mixed-length
per-batch selection 1.5-2.1 s; our goal for 1024 GPUs: under 60 s.

Run: ``python benchmarks/bench_planner.py`` (about a minute).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.planner import CostModel, simulate
from hspmd_sdk.planner.elastic import replan_elastic
from hspmd_sdk.planner.hetero import plan_hetero
from hspmd_sdk.planner.mixed import dispatch, packed_baseline, plan_mixed, sample_batch, sample_lengths, \
    simulate_mixed

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"
SEQ = 4096


def warm_up() -> None:
    """Import the solvers once (not part of any planning time)."""
    import pulp  # noqa: F401
    import pyomo.environ  # noqa: F401
    from pyomo.contrib import appsi  # noqa: F401


def hetero_table(cost: CostModel, title: str) -> None:
    print(f"\n{title}")
    print(f"{'config':<18} {'plan s':>7} {'ours s':>8} {'Table 9 s':>10} {'Megatron s':>11} {'ours/T9':>8} "
          f"{'Megatron/ours':>14}  strategy")
    for size in ("32b", "70b"):
        model = LlamaConfig.preset(f"llama-{size}")
        for h20 in (16, 24, 32):
            cluster = Cluster.mixed({"H800": 16, "H20": h20})
            t0 = time.perf_counter()
            ours = plan_hetero(model, cluster, global_batch=64, seq_len=SEQ, cost=cost)
            dt = time.perf_counter() - t0
            tag = f"{size}_16h800_{h20}h20.json"
            sim = lambda s: simulate(model, s, cluster, global_batch=64, seq_len=SEQ, cost=cost)  # noqa: E731
            o, p, m = sim(ours), sim(EXAMPLES / f"table9_{tag}"), sim(EXAMPLES / f"megatron_{tag}")
            flag = " OOM" if o.oom else ""
            print(f"{size} 16H800+{h20}H20  {dt:7.2f} {o.step_time:8.2f} {p.step_time:10.2f} {m.step_time:11.2f} "
                  f"{o.step_time / p.step_time:8.3f} {m.step_time / o.step_time:13.2f}x  {_short(ours)}{flag}")


def _short(s: Strategy) -> str:
    return " || ".join(f"{p.num_micro_batches}x" + "|".join(f"TP{st.tp_degree}:{st.num_layers}" for st in p.stages)
                       for p in s.pipelines)


def elastic_section() -> None:
    print("\nScenario (b): elastic re-planning from the paper's C1 (2 x TP4PP4 on 32 H20, no ZeRO-1)")
    model = LlamaConfig.preset("llama-32b")
    cluster = Cluster.load(EXAMPLES / "h20_32.json")
    c1 = Strategy.load(EXAMPLES / "table11_c1.json")
    for failed, ref, ref_cluster, label in (([31], "table11_c2.json", "h20_31.json", "GPU 31 lost (C2)"),
                                            (list(range(24, 32)), "table11_c3.json", "h20_24.json",
                                             "node 24-31 lost (C3)")):
        t0 = time.perf_counter()
        new = replan_elastic(model, cluster, c1, failed, seq_len=SEQ)
        dt = time.perf_counter() - t0
        ours = simulate(model, new, cluster, global_batch=64, seq_len=SEQ).step_time
        paper = simulate(model, EXAMPLES / ref, Cluster.load(EXAMPLES / ref_cluster), global_batch=64,
                         seq_len=SEQ).step_time
        print(f"  {label:<22} replan {dt:5.2f} s, {new.num_ranks} GPUs; ours {ours:.2f} s vs paper {paper:.2f} s "
              f"({ours / paper:.3f}); {_short(new)}")
    # heterogeneous: our own offline plan without ZeRO-1 on 16 H800 + 32 H20, then one H800 node lost
    hcl = Cluster.mixed({"H800": 16, "H20": 32})
    offline = plan_hetero(model, hcl, global_batch=64, seq_len=SEQ, zero1=False, min_pipelines=2)
    for failed, label in (([15], "H800 GPU 15 lost"), (list(range(40, 48)), "H20 node 40-47 lost")):
        t0 = time.perf_counter()
        new = replan_elastic(model, hcl, offline, failed, seq_len=SEQ)
        dt = time.perf_counter() - t0
        ours = simulate(model, new, hcl, global_batch=64, seq_len=SEQ)
        print(f"  48 GPUs, {label:<18} replan {dt:5.2f} s, {new.num_ranks} GPUs; {ours.step_time:.2f} s"
              f"{' OOM' if ours.oom else ''}; {_short(new)}")


def mixed_section() -> None:
    print("\nScenario (c): mixed-length data, 32B on 32 H20, 32K context, 200K tokens a batch")
    model, cluster = LlamaConfig.preset("llama-32b"), Cluster.homogeneous("H20", 32)
    lengths = sample_lengths(4000, 32768, seed=0)
    short = sum(x < 8192 for x in lengths) / len(lengths)
    t0 = time.perf_counter()
    plan = plan_mixed(model, cluster, lengths, tokens_per_batch=200_000, context_len=32768)
    print(f"  sample: {len(lengths)} sequences, {short:.1%} under 8K; offline plan_mixed "
          f"{time.perf_counter() - t0:.2f} s, {len(plan.entries)} strategies")
    per_batch, ours, base = [], [], []
    for seed in range(10):
        batch = sample_batch(lengths, 200_000, seed=seed)
        t0 = time.perf_counter()
        d = dispatch(plan, model, cluster, batch)
        per_batch.append(time.perf_counter() - t0)
        ours.append(simulate_mixed(model, cluster, d)[0])
        base.append(packed_baseline(model, cluster, batch, context_len=32768)[1])
    print(f"  per-batch dispatch + strategy selection: mean {statistics.mean(per_batch) * 1e3:.1f} ms, "
          f"max {max(per_batch) * 1e3:.1f} ms")
    print(f"  simulated step: strategy set {statistics.mean(ours):.2f} s vs packed homogeneous "
          f"{statistics.mean(base):.2f} s: {sum(base) / sum(ours):.2f}x "
          f"(per batch {min(b / o for b, o in zip(base, ours)):.2f}x-{max(b / o for b, o in zip(base, ours)):.2f}x)")


def scale_section() -> None:
    print("\nOffline planning at scale (70B, 4K, global batch 1024)")
    model = LlamaConfig.preset("llama-70b")
    for counts in ({"H800": 512, "H20": 512}, {"H800": 256, "H20": 768}):
        cluster = Cluster.mixed(counts)
        t0 = time.perf_counter()
        s = plan_hetero(model, cluster, global_batch=1024, seq_len=SEQ)
        dt = time.perf_counter() - t0
        r = simulate(model, s, cluster, global_batch=1024, seq_len=SEQ)
        print(f"  {counts}: planned in {dt:.1f} s; {s.dp_degree} pipelines, step {r.step_time:.2f} s"
              f"{' OOM' if r.oom else ''}")


def main() -> None:
    import os

    warm_up()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (planning times are wall clock)")
    hetero_table(CostModel(), "Scenario (a), analytic cost model (MFU 0.45 on every kind):")
    hetero_table(CostModel(mfu={"H800": 0.40, "H20": 0.80}),
                 "Scenario (a), sensitivity: MFU H800 0.40 / H20 0.80 (closer to the paper's H800:H20 speed ratio):")
    elastic_section()
    mixed_section()
    scale_section()


if __name__ == "__main__":
    main()
