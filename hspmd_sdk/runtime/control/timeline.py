"""Each rank's measured step beside the step the simulator predicts for the same Program (``job.timeline()``).

The measured side is a step recorded with ``launch(..., profile=[s])`` (:mod:`.trace`): per rank, its schedule's
actions by phase -- ``F``/``B`` of each micro-batch, ``comm`` (stage-boundary sends and receives, ``PRE``'s
gathers), ``sync`` (gradient synchronisation) and ``optim`` (Adam) -- from the start of the step.  The predicted
side is :func:`hspmd_sdk.planner.simulate` of the Program that ran that step (the one a switch or a recovery put
in place, if any), on its cluster, with the job's cost model (the launch's ``cost=``, else the analytic defaults:
on emulated CPU devices the gap is then mostly the cost model's).  ``gaps`` gives, per rank and phase, measured
seconds, predicted seconds and their difference.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..._palette import EVENT_COLOURS
from ..trace import PHASES, measured_phases, phase_totals
from ...core.strategy_plan import strategy_of

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from ...planner.simulator import SimResult

Phases = list[tuple[str, float, float, str]]


@dataclass
class Timeline:
    """One recorded step: ``measured`` (program rank -> ``(phase, start s, end s, label)``), ``predicted`` (the
    simulator's :class:`~hspmd_sdk.planner.simulator.SimResult`, ``None`` with ``why`` when it cannot run)."""

    step: int
    measured: dict[int, Phases]
    predicted: "SimResult | None"
    labels: dict[int, str] = field(default_factory=dict)
    why: str = ""

    @property
    def gaps(self) -> list[dict[str, Any]]:
        """Per rank and phase: ``measured_s``, ``predicted_s`` (``None`` without a prediction), ``gap_s``."""
        rows = []
        for r in sorted(self.measured):
            got = phase_totals(self.measured[r])
            want = self._predicted_totals(r)
            for phase in PHASES:
                p = want.get(phase) if want is not None else None
                rows.append({"rank": r, "phase": phase, "measured_s": got[phase], "predicted_s": p,
                             "gap_s": None if p is None else got[phase] - p})
        return rows

    def _predicted_totals(self, rank: int) -> dict[str, float] | None:
        if self.predicted is None or rank not in self.predicted.timeline:
            return None
        out = dict.fromkeys(PHASES, 0.0)
        for e in self.predicted.timeline[rank]:
            if e.kind in out:
                out[e.kind] += e.duration
        return out

    def table(self) -> str:
        """The gaps as text: a row per rank, measured / predicted ms per phase."""
        head = f"step {self.step}: measured / predicted ms per phase" + (f" ({self.why})" if self.why else "")
        lines = [head, "rank   " + "".join(f"{p:>17}" for p in PHASES)]
        by = {(g["rank"], g["phase"]): g for g in self.gaps}
        for r in sorted(self.measured):
            cells = []
            for p in PHASES:
                g = by[(r, p)]
                want = "-" if g["predicted_s"] is None else f"{g['predicted_s'] * 1e3:.1f}"
                cells.append(f"{g['measured_s'] * 1e3:.1f} / {want}".rjust(17))
            lines.append(f"R{r:<5} " + "".join(cells))
        return "\n".join(lines)

    def figure(self) -> "go.Figure":
        """Two rows per rank, ``measured`` above ``planned``, a bar per phase span (the simulator's colours)."""
        import plotly.graph_objects as go

        fig = go.Figure()
        rows: list[str] = []
        bars: dict[str, list[tuple[str, float, float, str]]] = {p: [] for p in PHASES}
        for r in sorted(self.measured):
            label = self.labels.get(r, f"R{r}")
            rows += [f"{label} measured", f"{label} planned"]
            for phase, start, end, name in self.measured[r]:
                bars[phase].append((f"{label} measured", start, end, name))
            if self.predicted is not None:
                for e in self.predicted.timeline.get(r, []):
                    if e.kind in bars:
                        mb = "" if e.micro_batch is None else f" mb{e.micro_batch}"
                        bars[e.kind].append((f"{label} planned", e.start, e.end, f"{e.kind}{mb} (planned)"))
        for phase in PHASES:
            got = bars[phase]
            if got:
                fig.add_trace(go.Bar(orientation="h", name=phase, y=[b[0] for b in got], base=[b[1] for b in got],
                                     x=[b[2] - b[1] for b in got], text=[b[3] for b in got], textposition="none",
                                     marker=dict(color=EVENT_COLOURS[phase]),
                                     hovertemplate="%{text}: %{x:.4f} s from %{base:.4f} s<extra></extra>"))
        fig.update_layout(barmode="overlay", title=f"step {self.step}: measured beside planned" +
                          (f" ({self.why})" if self.why else ""), xaxis_title="seconds from the step's start",
                          yaxis=dict(categoryorder="array", categoryarray=rows[::-1]),
                          height=120 + 40 * len(rows), margin=dict(l=140, r=20, t=50, b=40))
        return fig

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.figure())
        print(self.table())


def build_timeline(recorded: dict[int, dict[int, dict[str, Any]]], controller: Any, step: int | None,
                   labels: dict[int, str]) -> Timeline:
    """The :class:`Timeline` of ``step`` (default: the last recorded) from the job's recorded steps (launch rank ->
    step -> ``{"rank", "version", "spans"}``) and its training controller (the Program of each version)."""
    steps = sorted({s for per in recorded.values() for s in per})
    if not steps:
        raise ValueError("no step was recorded: launch with profile=[step, ...] (steps to record)")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise ValueError(f"step {step} was not recorded; recorded steps: {steps}")
    measured: dict[int, Phases] = {}
    names: dict[int, str] = {}
    versions = set()
    for launch_rank, per in recorded.items():
        got = per.get(step)
        if got is None:
            continue
        r = int(got["rank"])
        measured[r] = measured_phases(got["spans"])
        names[r] = labels.get(launch_rank, f"R{r}")
        versions.add(tuple(got.get("version") or (0, 0)))
    predicted, why = None, ""
    if controller is None:
        why = "no Program to simulate: not a training job"
    elif len(versions) != 1:
        why = f"the ranks ran different versions of the plan in step {step}"
    else:
        predicted, why = _simulate(controller, versions.pop())
    return Timeline(step, measured, predicted, names, why)


def _simulate(controller: Any, version: tuple[int, int]) -> "tuple[SimResult | None, str]":
    from ...planner.simulator import simulate  # lazy: planner, loaded only to simulate a timeline

    numbering = controller._versions.get(version)
    if numbering is None:
        return None, f"the Program of version {version} is not known to the launcher"
    strategy = strategy_of(numbering.program)
    if strategy is None:
        return None, "the Program was not specialized from a Strategy: the simulator has nothing to run"
    result = simulate(numbering.program.model, strategy, numbering.cluster, global_batch=controller.global_batch,
                      seq_len=controller.seq_len, cost=controller.cost)
    return result, ""
