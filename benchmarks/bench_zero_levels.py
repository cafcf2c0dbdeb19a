"""ZeRO levels at the paper's scale, in the simulator (issue 46): Llama-70B on H800 + H20 clusters.

For each cluster, ``plan_hetero`` at ZeRO-1, ZeRO-2 and ZeRO-3 (each with ZeRO shares by free memory where the
devices' memory differs), the simulated step time and the fullest device's fraction of its memory of each level's
plan, and the plan ``plan_hetero`` returns with the level left to it (which plans the higher levels where ZeRO-1
does not fit or its memory binds).  The paper's cluster is 16 H800 + 32 H20 (global batch 64, 4K tokens); the
smaller ones are where memory binds.  Planner and simulator only: no devices.

Run: ``python benchmarks/bench_zero_levels.py`` (about a minute).  Figures: ``benchmarks/results/zero_levels.json``;
the table is in ``benchmarks/RESULTS.md`` (§37).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hspmd_sdk import Cluster  # noqa: E402
from hspmd_sdk.errors import PlanValidationError  # noqa: E402
from hspmd_sdk.models.registry import load_model_spec  # noqa: E402
from hspmd_sdk.planner.cost import CostModel  # noqa: E402
from hspmd_sdk.planner.hetero import plan_hetero  # noqa: E402
from hspmd_sdk.planner.simulator import simulate  # noqa: E402
from hspmd_sdk.planner.zero_shares import peak_fraction  # noqa: E402

CLUSTERS = [{"H800": 16, "H20": 32}, {"H800": 16, "H20": 16}, {"H800": 8, "H20": 24}, {"H800": 8, "H20": 16},
            {"H800": 8, "H20": 8}]
GLOBAL_BATCH, SEQ = 64, 4096


def row(model, counts: dict, level: int | None, cost: CostModel) -> dict:
    cluster = Cluster.mixed(counts)
    t0 = time.perf_counter()
    try:
        s = plan_hetero(model, cluster, global_batch=GLOBAL_BATCH, seq_len=SEQ, zero=level, cost=cost)
    except PlanValidationError as e:
        return {"level": level, "fits": False, "why": str(e)[:200], "plan_s": time.perf_counter() - t0}
    plan_s = time.perf_counter() - t0
    r = simulate(model, s, cluster, seq_len=SEQ, cost=cost)
    peak, rank = peak_fraction(s, model, cluster, seq_len=SEQ, cost=cost)
    return {"level": level, "fits": not r.oom, "zero": s.zero, "step_s": r.step_time, "peak": peak,
            "peak_rank": rank, "pipelines": len(s.pipelines), "shares": s.zero_shares(), "schedule": s.schedule,
            "recompute": any(st.recompute for p in s.pipelines for st in p.stages), "name": s.name, "plan_s": plan_s}


def main() -> dict:
    model, cost = load_model_spec("llama-70b"), CostModel()
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "model": "llama-70b", "global_batch": GLOBAL_BATCH,
           "seq_len": SEQ, "clusters": []}
    print("| cluster | ZeRO-1 | ZeRO-2 | ZeRO-3 | plan_hetero's choice |")
    print("|---|---|---|---|---|")
    for counts in CLUSTERS:
        rows = {str(z): row(model, counts, z, cost) for z in (1, 2, 3)}
        auto = row(model, counts, None, cost)
        out["clusters"].append({"counts": counts, "levels": rows, "auto": auto})

        def cell(r: dict) -> str:
            if not r["fits"]:
                return "no plan fits"
            shares = "" if r["shares"] is None else ", shares " + ":".join(f"{x:g}" for x in r["shares"])
            plural = "s" if r["pipelines"] > 1 else ""
            return (f"{r['step_s']:.1f} s ({r['pipelines']} pipeline{plural}{', recompute' if r['recompute'] else ''}"
                    f"{shares}; peak {r['peak']:.0%})")
        name = " + ".join(f"{n} {k}" for k, n in counts.items())
        choice = f"ZeRO-{auto['zero']}, {auto['step_s']:.1f} s" if auto["fits"] else "none"
        print(f"| {name} | {cell(rows['1'])} | {cell(rows['2'])} | {cell(rows['3'])} | {choice} |", flush=True)
    path = REPO / "benchmarks" / "results" / "zero_levels.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"figures in {path}")
    return out


if __name__ == "__main__":
    main()
