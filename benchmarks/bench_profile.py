"""What recording a step costs (issue 27: "profiling off costs nothing and on costs under 5% of a step").

One job per model size on 4 local ranks (two TP2 stages in a pipeline of 4 micro-batches), ``steps`` steps with
``profile=[a few]``; from the same job's metrics: each rank's step time of the recorded steps against the median of
its unrecorded steps (the profiler on: the executor's named ranges and the profiler's own op recording), and after
the step, the profiler's stop and the extraction of the spans (``collect_s``, reported by the worker).  Off: every
range the executor opens costs one check of whether a profiler records; measured here as calls per step (counted
in the recorded step's spans) times the cost of one unrecorded ``span()`` (timed in this process), against the step.
The peer is the same job's unrecorded steps (and the unrecorded job for the losses, which must be equal).

Run: ``python benchmarks/bench_profile.py`` (about 2 min on 2 cores).  Figures: ``benchmarks/results/profile.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime import launch  # noqa: E402
from hspmd_sdk.runtime.trace import span  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STRATEGY = {"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 1]}, {"devices": [2, 3], "layers": [2, 3]}],
                           "micro_batch_size": 2, "num_micro_batches": 4}]}
MODELS = {"tiny": LlamaConfig.preset("tiny"),
          "6M": LlamaConfig(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8,
                            ffn_hidden_size=1024, max_seq_len=128)}


def off_cost_s(n: int = 200_000) -> float:
    """Seconds one unrecorded ``span()`` costs (enter and exit, no profiler running)."""
    t0 = time.perf_counter()
    for _ in range(n):
        with span("F mb0"):
            pass
    return (time.perf_counter() - t0) / n


def one(name: str, steps: int, recorded: list[int], seq: int) -> dict[str, Any]:
    model, cluster = MODELS[name], Cluster.local(4)
    prog = specialize(model, plan_from_strategy(model, Strategy.load(STRATEGY), cluster), cluster)
    job = launch(prog, cluster, steps=steps, seq_len=seq, profile=recorded, progress=False)
    result = job.wait(timeout=600)
    plain = launch(prog, cluster, steps=steps, seq_len=seq, progress=False).wait(timeout=600)
    per_rank = {}
    for r in job.metrics.ranks():
        times = {m.step: m.step_time for m in job.metrics.rank(r) if m.step_time is not None}
        base = statistics.median(t for s, t in times.items() if s not in recorded and s > 0)
        on = statistics.median(times[s] for s in recorded)
        collect = statistics.median(float(job._recorded[r][s]["collect_s"]) for s in recorded)
        ranges = statistics.median(sum(1 for x in job._recorded[r][s]["spans"] if x["name"].startswith("hspmd:"))
                                   for s in recorded)
        per_rank[r] = {"unrecorded_step_s": base, "recorded_step_s": on, "in_step": on / base - 1.0,
                       "collect_s": collect, "after_step": collect / base, "ranges_per_step": ranges}
    off = off_cost_s()
    worst_base = min(v["unrecorded_step_s"] for v in per_rank.values())
    most = max(v["ranges_per_step"] for v in per_rank.values())
    return {"model": name, "steps": steps, "recorded": recorded, "ranks": per_rank,
            "off_span_s": off, "off_share": off * most / worst_base,
            "in_step_median": statistics.median(v["in_step"] for v in per_rank.values()),
            "in_step_worst": max(v["in_step"] for v in per_rank.values()),
            "after_step_worst": max(v["after_step"] for v in per_rank.values()),
            "losses_equal": result.losses == plain.losses}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--json", default=str(RESULTS / "profile.json"))
    args = p.parse_args(argv)
    recorded = [5, 10, 14]
    out = {name: one(name, args.steps, recorded, args.seq) for name in MODELS}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print("model  unrecorded step  in-step cost (median, worst)  after-step (worst)  off (per step)  losses equal")
    for name, o in out.items():
        base = statistics.median(v["unrecorded_step_s"] for v in o["ranks"].values())
        print(f"{name:<6} {base * 1e3:10.1f} ms   {o['in_step_median']:+8.1%}, {o['in_step_worst']:+7.1%}"
              f"      {o['after_step_worst']:8.1%}        {o['off_share']:8.4%}     {o['losses_equal']}")
    return out


if __name__ == "__main__":
    main()
