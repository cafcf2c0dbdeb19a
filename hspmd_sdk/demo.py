"""The main job (``hspmd demo``, ``scripts/main.sh``): train the example heterogeneous plan of the tiny Llama on 4
local worker processes and print its loss curve next to the single-device model's.  No cluster needed."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Sequence

from .core.cluster import Cluster
from .core.specialize import specialize
from .core.strategy import Strategy
from .core.strategy_plan import plan_from_strategy
from .models.llama.config import LlamaConfig

__all__ = ["run_demo"]


def run_demo(steps: int = 10, *, seed: int = 0, data: str = "stdlib", lr: float = 3e-3, progress: bool = False,
             echo: bool = False) -> dict[str, list[float]]:
    """Train the example heterogeneous plan (``examples/example_hetero_tiny.json``: a TP2 -> TP1 pipeline with 3
    micro-batches beside a 1-rank pipeline with 1) on 4 local processes, train the single-device reference on the
    same data, and print both loss curves side by side.  Returns ``{"hspmd": [...], "reference": [...]}``."""
    from .runtime.control.progress import TICK_S, Phase

    examples = Path(__file__).resolve().parent / "examples"
    config = LlamaConfig.preset("tiny")
    strategy = Strategy.load(examples / "example_hetero_tiny.json")
    cluster = Cluster.local(4)
    program = specialize(config, plan_from_strategy(config, strategy, cluster), cluster)
    print(program.describe(), flush=True)
    print(f"training on {len(program.ranks)} local worker processes ...", flush=True)
    with Phase("loading PyTorch", stream=sys.stdout, tick_s=TICK_S if progress else None):
        from .runtime.control.train import launch, reference_training  # lazy: torch (train)
    t0 = time.perf_counter()
    result = launch(program, cluster, steps=steps, seed=seed, data=data, lr=lr, progress=progress,
                    echo=echo).wait()
    wall = time.perf_counter() - t0
    with Phase("computing the single-device reference (one process, the same data)", stream=sys.stdout,
               tick_s=TICK_S if progress else None):
        ref = reference_training(config, steps=steps, seed=seed, global_batch=program.bindings["B"], data=data,
                                 lr=lr)
    print(f"\n{len(program.ranks)} worker processes, {wall:.1f} s; single-device reference on the same data")
    print(f"{'step':>4}  {'HSPMD (4 ranks)':>16}  {'single device':>14}  {'rel. diff':>9}")
    for i, (a, b) in enumerate(zip(result.losses, ref.losses)):
        print(f"{i:>4}  {a:>16.6f}  {b:>14.6f}  {abs(a - b) / abs(b):>9.1e}")
    print("\n" + _sparkline(result.losses, ref.losses))
    return {"hspmd": list(result.losses), "reference": ref.losses}


def _sparkline(a: Sequence[float], b: Sequence[float], width: int = 40, height: int = 8) -> str:
    """A small text plot of two curves (``*``: HSPMD, ``o``: reference, ``@``: both)."""
    lo, hi = min(list(a) + list(b)), max(list(a) + list(b))
    span = (hi - lo) or 1.0
    n = max(len(a), len(b))
    cols = min(width, n)
    grid = [[" "] * cols for _ in range(height)]
    for series, mark in ((b, "o"), (a, "*")):
        for i, v in enumerate(series):
            c = i * (cols - 1) // max(1, n - 1)
            r = int(round((hi - v) / span * (height - 1)))
            grid[r][c] = "@" if grid[r][c] not in (" ", mark) else mark
    lines = [f"{hi:8.3f} |" + "".join(grid[0])] + ["         |" + "".join(r) for r in grid[1:-1]]
    lines.append(f"{lo:8.3f} |" + "".join(grid[-1]))
    lines.append("          loss per step   * HSPMD   o single device   @ both")
    return "\n".join(lines)
