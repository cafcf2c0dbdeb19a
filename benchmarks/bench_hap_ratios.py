"""Uneven TP sharding ratios (HAP, SPEC §12) on local workers with one rank emulated slower (issue 28).

Two local ranks; rank 1 emulates a device ``k`` times slower (``slowdown={1: k}``, k = 2 and 3).  In one process,
one after the other on the same machine, each for ``--steps`` steps (median step time after 2 warm-up steps):

* **even TP2**: the group runs at the slow rank's pace;
* **uneven TP2** with the ratio planner's ratios (:func:`hspmd_sdk.planner.ratios.solve_ratios` over the speeds
  measured in the even run: each rank's compute seconds for the same work), over the model's 8 heads;
* **separate pipelines** (DP2), batch shares in proportion to the speeds (the best plan without mixed groups on
  2 ranks that each hold the whole model);
* the ideal ``1 / sum(speeds)`` from the even run's measured compute (what a perfectly balanced split would take,
  communication excluded) and the ratio planner's own estimate of the uneven / even gain.

Run: ``python benchmarks/bench_hap_ratios.py`` (about 3 min on 2 idle cores).  Figures:
``benchmarks/results/hap_ratios.json``.  Timings on a loaded machine are noisy: the JSON records the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.planner.ratios import solve_ratios, split_units  # noqa: E402
from hspmd_sdk.runtime.control.train import launch  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
#: matmuls dominate on a CPU core (fp32): 4 layers, hidden 256, 8 heads, ffn 768, seq 128
MODEL = LlamaConfig(name="bench", vocab_size=256, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8,
                    ffn_hidden_size=768, max_seq_len=128)
SEQ, BATCH = 128, 8


def _tp(ratios: list[int] | None) -> dict:
    stage = {"devices": [0, 1], "layers": [0, MODEL.num_layers - 1], **({"ratios": ratios} if ratios else {})}
    return {"pipelines": [{"stages": [stage], "micro_batch_size": BATCH // 2, "num_micro_batches": 2}]}


def _dp(shares: list[int]) -> dict:
    return {"pipelines": [{"stages": [{"devices": [r], "layers": [0, MODEL.num_layers - 1]}],
                           "micro_batch_size": 1, "num_micro_batches": n} for r, n in enumerate(shares)]}


def _run(data: dict, slow: float, steps: int) -> dict:
    cluster = Cluster.local(2)
    program = specialize(MODEL, plan_from_strategy(MODEL, Strategy.load(data), cluster), cluster)
    job = launch(program, cluster, steps=steps, seed=0, seq_len=SEQ, timeout_s=120, slowdown={1: slow})
    job.wait(timeout=600)
    step = [m.step_time for m in job.metrics.rank(0)[2:]]
    compute = {r: statistics.median(m.extra["compute_s"] for m in job.metrics.rank(r)[2:]) for r in (0, 1)}
    return {"step_s": statistics.median(step), "compute_s": compute}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--slowdowns", default="2,3")
    args = ap.parse_args()
    units = split_units(MODEL, Strategy.load(_tp(None)).pipelines[0].stages[0], first=True, last=True)
    out = {"model": MODEL.model_dump(mode="json"), "batch": BATCH, "seq": SEQ, "load": os.getloadavg(),
           "cases": []}
    for slow in (float(s) for s in args.slowdowns.split(",")):
        even = _run(_tp(None), slow, args.steps)
        speeds = [1 / even["compute_s"][0], 1 / even["compute_s"][1]]   # equal work per rank
        plan = solve_ratios(speeds, units=units)
        uneven = _run(_tp(list(plan.ratios)), slow, args.steps)
        share0 = max(1, min(BATCH - 1, round(BATCH * speeds[0] / sum(speeds))))
        separate = _run(_dp([share0, BATCH - share0]), slow, args.steps)
        ideal = 2 / sum(1 / c for c in even["compute_s"].values())  # the whole work at the summed speeds
        case = {"slowdown": slow, "measured_speed_ratio": speeds[0] / speeds[1], "ratios": plan.ratios,
                "even_s": even["step_s"], "uneven_s": uneven["step_s"], "separate_s": separate["step_s"],
                "separate_shares": [share0, BATCH - share0], "ideal_compute_s": ideal,
                "planner_gain": plan.speedup, "measured_gain": even["step_s"] / uneven["step_s"]}
        out["cases"].append(case)
        print(json.dumps(case))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "hap_ratios.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
