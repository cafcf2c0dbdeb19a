"""Simulated step time of HSPMD's heterogeneous strategies (paper Table 9) against Megatron's (Table 8).

Peer: Megatron's optimal homogeneous strategy for the same model and cluster (the ``megatron_*.json`` fixtures:
DP x TP x PP with an even layer split, ranks in Megatron order), simulated by the same simulator and cost model.
Both use the paper's setup: 4K context, global batch 64, 1F1B, ZeRO-1.

Also prints the simulator's own wall time per strategy (the planner evaluates many candidates, so it must be
cheap), and the same comparison under a second cost model with per-kind MFU (H800 0.40, H20 0.80) to show how
the figures move with the efficiencies.

Run: ``python benchmarks/bench_simulator.py``.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.planner import CostModel, SimResult, simulate

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"
CONFIGS = ["32b_16h800_16h20", "32b_16h800_24h20", "32b_16h800_32h20",
           "70b_16h800_16h20", "70b_16h800_24h20", "70b_16h800_32h20"]
SEQ_LEN = 4096


def run(name: str, cost: CostModel) -> tuple[SimResult, float]:
    """Simulate fixture ``name`` under ``cost``; return the result and the simulation's wall time."""
    meta = json.loads((EXAMPLES / "index.json").read_text())["strategies"][name]
    model, cluster = LlamaConfig.preset(meta["model"]), Cluster.load(EXAMPLES / meta["cluster"])
    strategy = Strategy.load(EXAMPLES / name)
    t0 = time.perf_counter()
    res = simulate(model, strategy, cluster, seq_len=SEQ_LEN, global_batch=meta["global_batch"], cost=cost)
    return res, time.perf_counter() - t0


def table(cost: CostModel, title: str) -> None:
    print(f"\n{title}")
    print(f"{'config':<20} {'HSPMD s':>8} {'bubble':>7} {'Megatron s':>11} {'bubble':>7} {'speed-up':>9} "
          f"{'peak GiB H/M':>13} {'sim ms H/M':>11}")
    for cfg in CONFIGS:
        h, th = run(f"table9_{cfg}.json", cost)
        m, tm = run(f"megatron_{cfg}.json", cost)
        oom = " OOM" if h.oom or m.oom else ""
        print(f"{cfg:<20} {h.step_time:8.2f} {h.bubble_fraction:7.1%} {m.step_time:11.2f} "
              f"{m.bubble_fraction:7.1%} {m.step_time / h.step_time:8.2f}x "
              f"{max(h.peak_memory.values()) / 2**30:6.1f}/{max(m.peak_memory.values()) / 2**30:<6.1f} "
              f"{th * 1e3:5.0f}/{tm * 1e3:<5.0f}{oom}")


def main() -> None:
    table(CostModel(), "Analytic cost model, defaults (MFU 0.45 on every kind):")
    table(CostModel(mfu={"H800": 0.40, "H20": 0.80}),
          "Analytic cost model, MFU H800 0.40 / H20 0.80 (sensitivity):")
    print("\nPaper reference point (App. C.3): HSPMD 32B on 16 H800 + 32 H20, Table 9 strategy: 6.05 s/step.")


if __name__ == "__main__":
    main()
