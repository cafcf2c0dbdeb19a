"""Scenario (c), mixed-length data: planning time, per-step dispatch time, and the simulated step time of HSPMD's
candidate set against the two baselines of the paper's §9 (c), all in one run under one cost model.

* **ours**: ``plan_mixed`` candidates (``MixedPlan.programs`` specializes them), one ``Dispatcher`` for the job;
  per step the step's sequences are dispatched (``current=`` the previous step's choice, so a switch is priced) and
  the result simulated per micro-batch shape (``simulate_dispatch``); the switch estimate is added when the choice
  changes (the paper's per-step times include reconfiguration too);
* **packed (Megatron/DeepSpeed)**: the step's sequences packed into 32K windows, the fastest symmetric strategy for
  that very step (generous to the baseline: a real job fixes one), ``packed_baseline``;
* **HotSPa**: buckets 0-4K, 4K-16K, 16K-32K (Table 14), one symmetric strategy per bucket chosen on 8 sample steps,
  the buckets of a step run in turn with a switch between them (``plan_hotspa`` / ``simulate_hotspa``).

Workload: Llama 32B, 32K context, 200K tokens a step (the paper's), steps drawn from a long-tailed length sample
(``sample_lengths``: lognormal around 1K plus 1% near the context, ~97% under 8K as in Figure 18).  Clusters: the
paper's 32 H20 (its scenario-(c) testbed), 16 H800 + 16 H20 and 16 H800 + 32 H20.  The "prediction" column is the
dispatcher's own estimate, the figure the runtime reports beside a measured step; "sim" is the mixed simulator.

Paper's figures for this scenario (Table 5): offline planning of the plans 24.1-26.8 s, per-step selection
1.5-2.1 s (overlapped with training), specialization 14.8-16.2 s, switching 0.8-1.3 s (BF16 parameters).  Speed-ups:
the paper's Figure 17 gives them only as a plot (not in the text we have); Hydraulis reports 1.32-2.66x over
packed SPMD baselines.

Run: ``python benchmarks/bench_mixed_planner.py [--steps N] [--json FILE]`` (about 3 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.planner import (Dispatcher, packed_baseline, plan_hotspa, plan_mixed, simulate_dispatch,
                               simulate_hotspa)
from hspmd_sdk.planner.mixed import sample_batch, sample_lengths

CONTEXT = 32768
TOKENS = 200_000
CLUSTERS = {"32 H20": {"H20": 32}, "16 H800 + 16 H20": {"H800": 16, "H20": 16},
            "16 H800 + 32 H20": {"H800": 16, "H20": 32}}


def _load() -> float:
    return os.getloadavg()[0]


def run_cluster(name: str, counts: dict[str, int], lengths: list[int], steps: int) -> dict:
    model, cluster = LlamaConfig.preset("llama-32b"), Cluster.mixed(counts)
    row: dict = {"cluster": name, "load_start": _load()}
    t0, c0 = time.perf_counter(), time.process_time()
    plan = plan_mixed(model, cluster, lengths, tokens_per_batch=TOKENS, context_len=CONTEXT)
    row["plan_s"], row["plan_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    programs = plan.programs(model, cluster)
    row["specialize_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dispatcher = Dispatcher(programs, model, cluster)
    row["dispatcher_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    hotspa = plan_hotspa(model, cluster, lengths, tokens_per_batch=TOKENS, context_len=CONTEXT)
    row["hotspa_plan_s"] = time.perf_counter() - t0
    row["plan"] = plan.summary()
    row["hotspa"] = hotspa.summary()
    ours, pred, packed, hot, pick, pick_cpu, switches, chosen = [], [], [], [], [], [], 0, []
    current = None
    for k in range(steps):
        batch = sample_batch(lengths, TOKENS, seed=1000 + k)
        t0, c0 = time.perf_counter(), time.process_time()
        d = dispatcher(batch, current=current)
        pick.append(time.perf_counter() - t0)
        pick_cpu.append(time.process_time() - c0)
        sim = simulate_dispatch(model, cluster, d)
        assert not sim.oom, f"{name}: step {k} out of memory on {sim.oom}"
        switch = d.switch[d.choice]
        switches += switch > 0
        ours.append(sim.step_time + switch)
        pred.append(d.estimate + switch)
        chosen.append(d.choice)
        current = d.choice
        packed.append(packed_baseline(model, cluster, batch, context_len=CONTEXT)[1])
        hot.append(simulate_hotspa(model, cluster, hotspa, batch).step_time)
    row.update(steps=steps, ours=ours, prediction=pred, packed=packed, hotspa_steps=hot, chosen=chosen,
               switches=switches, dispatch_ms_mean=1e3 * statistics.mean(pick), dispatch_ms_max=1e3 * max(pick),
               dispatch_cpu_ms_mean=1e3 * statistics.mean(pick_cpu),
               load_end=_load())
    return row


def _ratios(base: list[float], ours: list[float]) -> tuple[float, float, float]:
    per = [b / o for b, o in zip(base, ours)]
    return sum(base) / sum(ours), min(per), max(per)


def report(rows: list[dict]) -> None:
    print(f"\n{'cluster':<18} {'plan s':>7} {'cpu s':>6} {'spec s':>7} {'HotSPa plan s':>13} {'dispatch ms':>16} "
          f"{'ours s':>7} {'pred err':>8} {'packed s':>8} {'HotSPa s':>8} {'x packed':>16} {'x HotSPa':>16} "
          f"{'switches':>8} {'load':>9}")
    for r in rows:
        err = statistics.mean(abs(p - o) / o for p, o in zip(r["prediction"], r["ours"]))
        xp, xh = _ratios(r["packed"], r["ours"]), _ratios(r["hotspa_steps"], r["ours"])
        print(f"{r['cluster']:<18} {r['plan_s']:7.2f} {r['plan_cpu_s']:6.2f} {r['specialize_s']:7.2f} "
              f"{r['hotspa_plan_s']:13.2f} "
              f"{r['dispatch_ms_mean']:7.1f} / {r['dispatch_ms_max']:6.1f} {statistics.mean(r['ours']):7.2f} "
              f"{err:8.1%} {statistics.mean(r['packed']):8.2f} {statistics.mean(r['hotspa_steps']):8.2f} "
              f"{xp[0]:5.2f} ({xp[1]:.2f}-{xp[2]:.2f}) {xh[0]:5.2f} ({xh[1]:.2f}-{xh[2]:.2f}) "
              f"{r['switches']:>4}/{r['steps']:<3} {r['load_start']:4.1f}-{r['load_end']:.1f}")
    print("\nplan s: wall (cpu s: this process's CPU time); dispatch ms: mean / max wall per step.  "
          "x packed / x HotSPa: total baseline time over ours (per-step min-max); ours includes switch estimates.")
    print("Paper (Table 5): planning 24.1-26.8 s offline, selection 1.5-2.1 s per step, switch 0.8-1.3 s; "
          "Hydraulis: 1.32-2.66x over packed baselines.")
    for r in rows:
        print(f"\n{r['cluster']}:\n{r['plan']}\n{r['hotspa']}\nchoices per step: {r['chosen']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "mixed_planner.json")
    args = ap.parse_args()
    lengths = sample_lengths(4000, CONTEXT, seed=0)
    print(f"machine: {os.cpu_count()} CPUs, load average {_load():.1f} (times are wall clock); sample "
          f"{len(lengths)} sequences, {sum(x < 8192 for x in lengths) / len(lengths):.1%} under 8K")
    LlamaConfig.preset("llama-32b")  # imports before any timing
    rows = []
    for name, counts in CLUSTERS.items():
        rows.append(run_cluster(name, counts, lengths, args.steps))
        print(f"  {name}: done (plan {rows[-1]['plan_s']:.2f} s)", flush=True)
    report(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
