"""What the plan editor says: the validation summary (plain text and HTML) and per-stage messages."""
from __future__ import annotations

import html
from typing import TYPE_CHECKING

from ..core.annotation import format_ranks
from ._style import ERROR, stage_colour

if TYPE_CHECKING:
    from .draft import Problem
    from .editor import PlanEditor

__all__ = ["summary_lines", "summary_html", "stage_messages", "general_problems"]

_OK, _WARN = "#1a7f37", "#9a6700"


def _shown(ed: "PlanEditor"):  # type: ignore[no-untyped-def]
    """The strategy and simulation the summary describes: the draft's when it is valid, else the last valid."""
    if ed._current is not None and ed._sim is not None:
        return ed._current, ed._sim, True
    if ed._valid is not None:
        return ed._valid.strategy, ed._valid.sim, False
    return None, None, False


def _pending(ed: "PlanEditor") -> bool:
    """Whether the draft's communication is still being resolved on the background thread."""
    return ed._resolving


def stage_messages(ed: "PlanEditor", pipeline: int, stage: int | None) -> list["Problem"]:
    """Problems that belong to one stage (``stage=None``: to the pipeline itself)."""
    return [p for p in ed._problems if p.pipeline == pipeline and p.stage == stage and not p.tensor]


def general_problems(ed: "PlanEditor") -> list["Problem"]:
    """Problems that belong to no stage or pipeline: the strategy as a whole, or a tensor."""
    return [p for p in ed._problems if p.pipeline is None or p.tensor]


def _headline(ed: "PlanEditor") -> tuple[str, str]:
    errors = [p for p in ed._problems if p.level == "error"]
    strategy, sim, current = _shown(ed)
    if errors:
        kept = f"; keeping the last valid plan (step {ed._valid.sim.step_time:.3f} s)" if ed._valid else ""
        return f"✗ {len(errors)} problem(s) in this plan{kept}", ERROR
    if ed._current is None:
        return "no plan yet", ERROR
    head = f"✓ valid: simulated step {sim.step_time:.3f} s, bubble {sim.bubble_fraction:.1%}"
    head += f", global batch {strategy.global_batch}, {strategy.num_ranks}/{ed.cluster.num_ranks} devices used"
    warnings = [p for p in ed._problems if p.level == "warning"]
    return head + (f"; {len(warnings)} warning(s)" if warnings else ""), _WARN if warnings else _OK


def _memory_rows(ed: "PlanEditor") -> list[tuple[int, int, str, str, str, float, float, int]]:
    strategy, sim, _ = _shown(ed)
    rows = []
    if strategy is None:
        return rows
    for i, p in enumerate(strategy.pipelines):
        for j, s in enumerate(p.stages):
            worst = max(s.devices, key=lambda r: sim.peak_memory[r] / sim.capacity[r])
            kinds = ", ".join(sorted({ed.cluster.kind(r) for r in s.devices}))
            rows.append((i, j, format_ranks(s.devices), kinds, f"{s.layers[0]}–{s.layers[1]}",
                         sim.peak_memory[worst], sim.capacity[worst], s.tp_degree))
    return rows


def _comm_lines(ed: "PlanEditor") -> list[str]:
    if _pending(ed):
        return ["communication: resolving (AnnotationPlan.from_strategy + specialize) …"]
    if ed._valid is None or ed._valid.program is None or (ed._current is not None
                                                          and ed._valid.strategy != ed._current):
        return []
    out = [f"stage boundary {name}: {' → '.join(kinds)}" for name, kinds in ed.boundary_reshards()]
    sync = ed.grad_sync_kinds()
    if sync:
        out.append("gradient sync: " + ", ".join(f"{n}× {k}" for k, n in sync.most_common()))
    return out


def summary_lines(ed: "PlanEditor") -> list[str]:
    """The summary as text lines: headline, problems, memory per stage, resolved communication."""
    head, _ = _headline(ed)
    lines = [head]
    lines += [f"  {'⚠' if p.level == 'warning' else '✗'} {p}" for p in ed._problems]
    rows = _memory_rows(ed)
    if rows and _shown(ed)[2] is False:
        lines.append("  last valid plan:")
    for i, j, ranks, kinds, layers, peak, cap, tp in rows:
        lines.append(f"  P{i} S{j}: ranks {ranks} ({kinds}) TP{tp} layers {layers}: memory "
                     f"{peak / 2**30:.1f}/{cap / 2**30:.1f} GiB ({peak / cap:.0%})")
    lines += ["  " + x for x in _comm_lines(ed)]
    if ed._message:
        lines.append(f"  note: {ed._message}")
    return lines


def _bar(frac: float) -> str:
    colour = ERROR if frac > 1 else "#d4a72c" if frac > 0.9 else "#2da44e"
    w = min(frac, 1.0) * 100
    return (f"<div style='width:90px;height:9px;background:#eaeef2;display:inline-block;vertical-align:middle'>"
            f"<div style='width:{w:.0f}%;height:9px;background:{colour}'></div></div>")


def summary_html(ed: "PlanEditor") -> str:
    """The summary panel: headline, problems (at their stage/tensor), memory vs capacity, communication."""
    head, colour = _headline(ed)
    parts = [f"<div class='hspmd-summary' data-valid='{str(ed._current is not None).lower()}'>"
             f"<b style='color:{colour}'>{html.escape(head)}</b>"]
    if ed._problems:
        parts.append("<ul class='hspmd-problems' style='margin:4px 0'>" + "".join(
            f"<li style='color:{ERROR if p.level == 'error' else _WARN}'><b>{html.escape(p.where)}</b>: "
            f"{html.escape(p.message)}</li>" for p in ed._problems) + "</ul>")
    rows = _memory_rows(ed)
    if rows:
        strategy, _, current = _shown(ed)
        cap = "" if current else " (last valid plan)"
        parts.append(f"<table style='font-size:12px;border-collapse:collapse'><tr><th align=left>stage{cap}</th>"
                     "<th align=left>ranks</th><th>TP</th><th>layers</th><th align=left>memory / capacity</th></tr>")
        for i, j, ranks, kinds, layers, peak, capb, tp in rows:
            sw = stage_colour(i, j, strategy.pipelines[i].num_stages)
            parts.append(f"<tr><td><span style='background:{sw};padding:0 6px'>&nbsp;</span> P{i} S{j}</td>"
                         f"<td>{ranks} <small>{kinds}</small></td><td align=center>{tp}</td>"
                         f"<td align=center>{layers}</td><td>{_bar(peak / capb)} {peak / 2**30:.1f}/"
                         f"{capb / 2**30:.0f} GiB</td></tr>")
        parts.append("</table>")
    comm = _comm_lines(ed)
    if comm:
        parts.append("<div style='font-size:12px;margin-top:4px'>" + "<br>".join(html.escape(c) for c in comm)
                     + "</div>")
    if ed._message:
        parts.append(f"<div style='color:{_WARN}'>{html.escape(ed._message)}</div>")
    return "".join(parts) + "</div>"
