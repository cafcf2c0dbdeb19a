"""Calibration of the simulator against the runtime on this machine (issue 6).

The cost model is profiled on this CPU (:func:`hspmd_sdk.planner.profile_device`, fp32 matmuls, with the one
torch thread each worker runs with), and :func:`hspmd_sdk.planner.simulate` predicts the step time of four
strategies, which the runtime then trains on local worker processes (gloo), all strategies of one world size
in one job, stepped in turn (one step each per round, so background load hits all alike); a step is timed
between two ``dist.barrier()`` calls (the slowest rank).  Reported: measured / simulated per strategy (goal:
within 20%, i.e. 0.8-1.2).

A 1-rank run (no communication, one thread like every worker) shows the compute model's own error.

Strategies (the bench model: 4 layers, hidden 256, ffn 768, seq 128, global batch 8, so matmuls dominate):
DP2, PP2 1F1B (4 micro-batches), TP2 on 2 ranks; the ``example_hetero_tiny`` layout (a TP2 -> TP1 pipeline with 3
micro-batches of 2 beside a 1-rank pipeline with 1) on 4 ranks.

Two predictions per strategy: ``sim`` (the profiled line as is) and ``sim/core-share`` (the line scaled by
``ranks / cores`` when the job has more worker processes than the machine has cores: 4 ranks on 2 cores each
get half a core, which the simulator does not know).  What the simulator does not model on a CPU is said in
``benchmarks/RESULTS.md``.

Representative profiling (``profiled`` columns): :func:`hspmd_sdk.planner.cost.profile_model` times one decoder
layer of the reference Llama (forward and backward), the embedding, the final norm + LM head + loss and the Adam
step at the bench model's shapes (1 thread), and the gloo link between two local processes
(:func:`hspmd_sdk.planner.cost.profile_link`, stored as ``link_overrides["intra"]`` with fp32 wire bytes); the
``profiled + cores`` column also sets ``CostModel.cores`` to this machine's core count.  The profile is saved as
``results/cpu_profile.json``.

Run: ``python benchmarks/bench_calibration.py`` (about 2 min); ``--quick`` for a smoke run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_runtime import (BENCH_MODEL, RESULTS, SEED, SEQ, LR, load, median, pipe,  # noqa: E402
                                      profiled_cost, program_of, strategy)
from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk.runtime.launcher import launch  # noqa: E402
from hspmd_sdk.runtime.train import training_run  # noqa: E402
from hspmd_sdk.runtime.transport import LocalTransport  # noqa: E402

L = BENCH_MODEL.num_layers - 1
STRATEGIES = {
    1: {"single": strategy([pipe([([0], [0, L])], 8, 1)], "single (1 rank)")},
    2: {"dp2": strategy([pipe([([0], [0, L])], 4, 1), pipe([([1], [0, L])], 4, 1)], "dp2"),
        "pp2_1f1b": strategy([pipe([([0], [0, 1]), ([1], [2, L])], 2, 4)], "pp2-1f1b"),
        "tp2": strategy([pipe([([0, 1], [0, L])], 8, 1)], "tp2")},
    4: {"hetero_tiny_layout": strategy([pipe([([0, 1], [0, 1]), ([2], [2, L])], 2, 3), pipe([([3], [0, L])], 2, 1)],
                                       "example_hetero_tiny layout")},
}


def measure(world: int, strats: dict[str, Any], args: argparse.Namespace) -> dict[str, list[float]]:
    cluster = Cluster.local(world)
    runs = [training_run(program_of(BENCH_MODEL, s, cluster), steps=1, seed=SEED, seq_len=SEQ, lr=LR,
                         cluster=cluster) for s in strats.values()]
    payload = {"runs": runs, "factors": {}, "rounds": args.rounds, "warmup": args.warmup, "threads": 1}
    res = launch(None, cluster, steps=1, entry="benchmarks._peers:emulated_entry", payload=payload, timeout_s=900,
                 transport=LocalTransport(cwd=str(REPO))).wait()
    return {n: r["times"] for n, r in zip(strats, res.results[0]["runs"])}


def main(argv: list[str] | None = None) -> dict:
    from hspmd_sdk.planner import simulate

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=str(RESULTS / "calibration.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup = 3, 1
    cores = os.cpu_count() or 1
    cost = profiled_cost({})
    fit = cost.compute_fits["cpu"]
    from hspmd_sdk.planner.cost import profile_model

    prof_cost = profile_model(BENCH_MODEL, "cpu", threads=1, link=True, base=cost)
    prof_cost.save(Path(args.json).parent / "cpu_profile.json")
    prof_cores = prof_cost.model_copy(update={"cores": cores})
    prof, lk = prof_cost.profiles["cpu"], prof_cost.link_overrides["intra"]
    print(f"bench_calibration: {BENCH_MODEL}, seq {SEQ}, {cores} cores, load {load()}")
    print(f"profiled cpu fit (1 thread): {fit.tflops * 1e3:.1f} GFLOP/s, b = {fit.b * 1e6:.1f} us, r2 = {fit.r2:.3f}")
    print(f"profiled layer: fwd {1e-9 / prof.layer_fwd.a:.1f} GFLOP/s + {prof.layer_fwd.b * 1e6:.0f} us, bwd "
          f"{1e-9 / max(prof.layer_bwd.a, 1e-30):.1f} GFLOP/s + {prof.layer_bwd.b * 1e6:.0f} us; Adam "
          f"{prof.optimizer_s_per_param * 1e9:.2f} ns/param; gloo p2p {lk.latency * 1e6:.0f} us + "
          f"{lk.bandwidth / 1e9:.2f} GB/s, all_reduce step {lk.collective_latency * 1e6:.0f} us + "
          f"{lk.collective_bandwidth / 1e9:.2f} GB/s")
    rows = []
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cores": cores, "load_start": load(),
                           "fit": fit.model_dump(), "profile": json.loads(prof_cost.model_dump_json()),
                           "rows": rows}
    print(f"{'strategy':<22} {'ranks':>5} {'measured ms':>12} {'sim ms':>8} {'meas/sim':>9} "
          f"{'sim/core-share ms':>18} {'meas/sim':>9} {'profiled ms':>12} {'meas/prof':>9} "
          f"{'prof+cores ms':>14} {'meas/p+c':>9}  load")
    for world, strats in STRATEGIES.items():
        before = load()
        times = measure(world, strats, args)
        share = max(1.0, world / cores)
        shared = cost.model_copy(update={"compute_fits": {"cpu": fit.model_copy(update={"a": fit.a * share,
                                                                                       "b": fit.b * share})}})
        cluster = Cluster.local(world)
        for name, strat in strats.items():
            m = median(times[name])
            sim = simulate(BENCH_MODEL, strat, cluster, seq_len=SEQ, cost=cost)
            sim2 = simulate(BENCH_MODEL, strat, cluster, seq_len=SEQ, cost=shared)
            sim3 = simulate(BENCH_MODEL, strat, cluster, seq_len=SEQ, cost=prof_cost)
            sim4 = simulate(BENCH_MODEL, strat, cluster, seq_len=SEQ, cost=prof_cores)
            row = {"strategy": name, "ranks": world, "measured_s": m, "min_s": min(times[name]),
                   "simulated_s": sim.step_time, "ratio": m / sim.step_time,
                   "simulated_core_share_s": sim2.step_time, "ratio_core_share": m / sim2.step_time,
                   "simulated_profiled_s": sim3.step_time, "ratio_profiled": m / sim3.step_time,
                   "simulated_profiled_cores_s": sim4.step_time, "ratio_profiled_cores": m / sim4.step_time,
                   "sim_profiled_sync_s": sim4.sync_time, "sim_profiled_bubble": sim4.bubble_fraction,
                   "sim_sync_s": sim.sync_time, "sim_bubble": sim.bubble_fraction, "times": times[name],
                   "load": f"{before} -> {load()}"}
            rows.append(row)
            print(f"{strat.name:<22} {world:>5} {m * 1e3:12.1f} {sim.step_time * 1e3:8.1f} {row['ratio']:9.2f} "
                  f"{sim2.step_time * 1e3:18.1f} {row['ratio_core_share']:9.2f} {sim3.step_time * 1e3:12.1f} "
                  f"{row['ratio_profiled']:9.2f} {sim4.step_time * 1e3:14.1f} {row['ratio_profiled_cores']:9.2f}  "
                  f"{row['load']}", flush=True)
    out["load_end"] = load()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"figures in {args.json}")
    return out


if __name__ == "__main__":
    main()
