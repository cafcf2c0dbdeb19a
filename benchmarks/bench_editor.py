"""Responsiveness of the plan editor: seconds from one edit to a validated, redrawn editor, for the paper's
largest setup (48 GPUs: 16 H800 + 32 H20, the 32B model, Table 9's strategy).

Budget: 0.3 s a change.  Peer: a *naive* editor that runs the whole pipeline on every change in the callback --
``Strategy.check`` + ``plan_from_strategy`` + ``specialize`` + ``simulate`` -- timed in the same run.
The ``PlanEditor`` runs the same core calls but resolves communication (``plan_from_strategy`` + ``specialize``) on a
background thread, so the hot path is the strategy check, the simulator and the redraw; the time until the
resolved communication is shown is reported too.  Each repeat moves a stage boundary (one invalid, then one valid edit giving
a plan not seen before), moves a device into another stage (invalid) and undoes it (valid, resolution cached).

Run: ``python benchmarks/bench_editor.py`` (builds the widgets; no browser needed).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.planner import simulate
from hspmd_sdk.viz import PlanEditor

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"
BUDGET_S = 0.3
REPEATS = 5


def naive_change(model: LlamaConfig, strategy: Strategy, cluster: Cluster) -> float:
    """The peer: everything on the hot path."""
    t0 = time.perf_counter()
    strategy.check(model=model, cluster=cluster, global_batch=64)
    plan = plan_from_strategy(model, strategy, cluster)
    specialize(model, plan, cluster)
    simulate(model, strategy, cluster, global_batch=64, seq_len=4096)
    return time.perf_counter() - t0


def timed(editor: PlanEditor, edit: Callable[[], None]) -> tuple[float, float]:
    """(hot path seconds, seconds until background resolution finished) of one edit."""
    t0 = time.perf_counter()
    edit()
    hot = time.perf_counter() - t0
    editor.wait()
    return hot, time.perf_counter() - t0


def main() -> None:
    cluster = Cluster.load(EXAMPLES / "paper_16h800_32h20.json")
    model = LlamaConfig.preset("llama-32b")
    strategy = Strategy.load(EXAMPLES / "table9_32b_16h800_32h20.json")
    t0 = time.perf_counter()
    editor = PlanEditor(cluster, model, strategy, global_batch=64, seq_len=4096)
    _ = editor.widget
    editor.wait()
    print(f"editor + widgets built in {time.perf_counter() - t0:.2f} s (the first widget imports anywidget)")
    rows: dict[str, list[tuple[float, float]]] = {}
    per_change: list[float] = []
    for k in range(REPEATS):  # a new boundary each time, so no cached resolution is reused
        edits: list[tuple[str, Callable[[], None]]] = [
            ("shorten stage 0 (gap: invalid)", lambda: editor.set_layers(0, 0, 0, 9 - k)),
            ("move stage 1 start (valid, new plan)", lambda: editor.set_layers(0, 1, 10 - k, 21)),
            ("click: device to other stage (invalid)", lambda: (editor.select_stage(0, 0), editor.click_device(20))),
            ("undo (valid, cached plan)", lambda: editor.undo()),
        ]
        for name, edit in edits:
            hot, full = timed(editor, edit)
            rows.setdefault(name, []).append((hot, full))
            per_change.append(hot)
        editor.undo()
        editor.undo()
    naive = [naive_change(model, Strategy.load(EXAMPLES / "table9_32b_16h800_32h20.json"), cluster)
             for _ in range(REPEATS)]
    print(f"\n48 GPUs (16 H800 + 32 H20), llama-32b, Table 9 strategy; {REPEATS} repeats; budget {BUDGET_S} s/change")
    print(f"{'edit':40s} {'hot path s':>11s} {'until resolved s':>17s}")
    for name, vals in rows.items():
        print(f"{name:40s} {statistics.median(v[0] for v in vals):11.3f} {statistics.median(v[1] for v in vals):17.3f}")
    med, worst = statistics.median(per_change), max(per_change)
    print(f"{'PlanEditor, any change':40s} {med:11.3f}  (worst {worst:.3f})")
    print(f"{'peer: naive editor (all on hot path)':40s} {statistics.median(naive):11.3f}")
    print(f"\nverdict: median {med:.3f} s, worst {worst:.3f} s per change -> "
          f"{'within' if worst < BUDGET_S else 'OVER'} the {BUDGET_S} s budget; the naive editor needs "
          f"{statistics.median(naive):.3f} s")
    editor.close()


if __name__ == "__main__":
    main()
