"""What the plan editor says about the draft shown: the verdict, the problems where they belong, each stage's
memory, and the resolved communication (plain text for ``editor.summary()``; the canvas shows the same).

Each function reads the state of ``ed``, the :class:`~hspmd_sdk.viz.editor.PlanEditor` (typed ``Any``: this module
sits below the editor, which uses it)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.annotation import format_ranks
from ._tp_grid import ratios_text
from ._units import fmt_memory, fmt_seconds

if TYPE_CHECKING:
    from .draft import Problem

__all__ = ["verdict", "summary_lines", "stage_messages", "general_problems", "stage_memory", "kinds_text",
           "comm_state"]


def stage_messages(ed: Any, pipeline: int, stage: int | None) -> list["Problem"]:
    """Problems that belong to one stage (``stage=None``: to the pipeline itself)."""
    return [p for p in ed._problems if p.pipeline == pipeline and p.stage == stage and not p.tensor]


def general_problems(ed: Any) -> list["Problem"]:
    """Problems that belong to no stage or pipeline: the strategy as a whole, or a tensor."""
    return [p for p in ed._problems if p.pipeline is None or p.tensor]


def kinds_text(ed: Any, ranks: list[int]) -> str:
    counts: dict[str, int] = {}
    for r in ranks:
        if 0 <= r < ed.cluster.num_ranks:
            k = ed.cluster.kind(r)
            counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{n}×{k}" for k, n in counts.items())


def stage_memory(ed: Any, ranks: list[int]) -> tuple[float, float] | None:
    """``(bytes needed, capacity)`` of the fullest device of a stage of the draft shown, or ``None``."""
    known = [r for r in ranks if r in ed._memory]
    if not known:
        return None
    worst = max(known, key=lambda r: ed._memory[r] / (ed.cluster.spec(r).memory_mb * 2.0**20))
    return ed._memory[worst], ed.cluster.spec(worst).memory_mb * 2.0**20


def comm_state(ed: Any) -> str:
    """``"ready"`` (the canvas shows the draft's communication), ``"resolving"``, or ``"none"`` (the draft has
    errors: nothing to resolve)."""
    if ed._current is None:
        return "none"
    if ed._valid is not None and ed._valid.strategy == ed._current:
        return "ready"
    return "resolving" if ed.resolving else "none"


def verdict(ed: Any) -> tuple[str, str]:
    """``(level, text)``: ``"error"`` (Save, Launch and Apply blocked), ``"warning"`` (valid, with named
    warnings) or ``"ok"``."""
    errors = [p for p in ed._problems if p.level == "error"]
    warnings = [p for p in ed._problems if p.level == "warning"]
    if errors:
        kept = (f"; editor.strategy keeps the last valid plan (step {fmt_seconds(ed._valid.sim.step_time)})"
                if ed._valid else "")
        return "error", f"✗ {len(errors)} error(s): Save, Launch and Apply are blocked{kept}"
    if ed._current is None or ed._sim is None:
        return "error", "✗ no plan yet"
    sim, s = ed._sim, ed._current
    step = f"simulated step {fmt_seconds(sim.step_time)}"
    prev = ed._previous_step
    if prev is not None and fmt_seconds(prev) != fmt_seconds(sim.step_time):
        step += f" (was {fmt_seconds(prev)})"
    head = (f"valid: {step}, bubble {sim.bubble_fraction:.1%}, {s.num_ranks}/{ed.cluster.num_ranks} devices, "
            f"global batch {ed.global_batch} (pinned: {ed.batch_source})")
    if warnings:
        return "warning", f"⚠ {head}; {len(warnings)} warning(s)"
    return "ok", "✓ " + head


def summary_lines(ed: Any) -> list[str]:
    """The summary as text lines: verdict, problems, each stage of the draft, resolved communication."""
    _, head = verdict(ed)
    lines = [head]
    lines += [f"  {'✗ error' if p.level == 'error' else '⚠ warning'} at {p}" for p in ed._problems]
    kind = "simulated" if ed._memory_kind == "simulated" else "estimate, not simulated"
    for i, p in enumerate(ed._draft.pipelines):
        lines.append(f"  pipeline {i}: {p.num_micro_batches} × bs{p.micro_batch_size} = "
                     f"{p.num_micro_batches * p.micro_batch_size} samples")
        for j, st in enumerate(p.stages):
            ranks = format_ranks(st.devices) if st.devices else "no devices"
            mem = stage_memory(ed, st.devices)
            mtext = f": memory {fmt_memory(mem[0])} of {fmt_memory(mem[1])} ({mem[0] / mem[1]:.0%}, {kind})" \
                if mem else ""
            ratios = f" ratios {ratios_text(st.ratios)}" if st.ratios is not None else ""
            lines.append(f"    S{j}: ranks {ranks} ({kinds_text(ed, st.devices) or '-'}) {st.parallel_text}{ratios} "
                         f"layers {st.layers[0]}–{st.layers[1]}{' recompute' if st.recompute else ''}{mtext}")
    state = comm_state(ed)
    if state == "resolving":
        lines.append("  communication: resolving (plan_from_strategy + specialize) …")
    elif state == "none":
        lines.append("  communication: not resolved (the plan shown has errors)")
    else:
        comm = ed._valid.comm
        for a in comm.arrows:
            lines.append(f"  P{a.pipeline} S{a.src_stage} → S{a.dst_stage} {a.reshard}: {a.label()}"
                         + (f" ({a.redundancy:.0f}× redundant)" if a.redundant else ""))
        if comm.grad_sync:
            lines.append("  gradient sync: " + ", ".join(f"{n}× {k}" for k, n in comm.grad_sync))
        if comm.busiest is not None:
            lines.append("  " + comm.busiest.describe())
    if ed._message:
        lines.append(f"  note: {ed._message}")
    return lines
