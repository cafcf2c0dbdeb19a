"""Each rank's measured step beside the step the simulator predicts for the same Program (``job.timeline()``).

The measured side is a step recorded with ``launch(..., profile=[s])`` (:mod:`.trace`): per rank, its schedule's
actions by phase -- ``F``/``B`` of each micro-batch, ``comm`` (stage-boundary sends and receives, ``PRE``), ``sync``
(gradient synchronisation) and ``optim`` (Adam) -- from the rank's first action of the plan (what comes before it
in the step, reading the batch and setting the learning rate, is not simulated: ``Timeline.lead``).

The planned side is :func:`hspmd_sdk.planner.simulate` of the Program that ran that step (the one a switch or a
recovery put in place, if any), on its cluster, priced by device figures that ``Timeline.calibration`` names:

* **measured by this job** (the default when two steps or more were recorded): :func:`hspmd_sdk.planner.calibrate.
  calibrate` fits this machine's figures -- per device kind, forward and backward seconds per FLOP and per
  operator and Adam's seconds per parameter; per link class, seconds per collective call, per byte and per send
  posted -- to the median, over the *other* recorded steps of the same Program, of each rank's seconds per phase.
  The step shown is never one the figures were fitted on, and the waits for a peer (the pipeline's bubbles, a
  collective's last holder) are not fitted: they follow from the schedule;
* **the launch's cost model** (``launch(..., cost=...)``, e.g. :func:`~hspmd_sdk.runtime.profile_model`'s) or
  **nominal device figures** (the analytic defaults: a device kind's peak FLOPS and a link's bandwidth): with
  ``calibrate=False``, or when only one step was recorded.  On emulated CPU devices nominal figures are 100-1000x
  too fast, and the planned bars are slivers: ``Timeline.nominal`` keeps this prediction beside the calibrated one.

The simulator's ranks do not block on a receive or a collective: they sit ``idle`` until the data or the last
holder arrives.  The executor's ``RECV_*`` and ``sync`` spans include that wait, so the planned side counts an
``idle`` stretch as the phase of the event it waits for (:func:`hspmd_sdk.planner.calibrate.as_recorded`).
``gaps`` and :meth:`Timeline.by_phase` give measured and planned seconds and their ratio, per rank and phase and
summed over the ranks.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..._palette import EVENT_COLOURS
from ..trace import PHASES, measured_phases, phase_totals
from ...core.strategy_plan import strategy_of

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from ...planner.cost import CostModel
    from ...planner.simulator import Event, SimResult

Phases = list[tuple[str, float, float, str]]


def planned_phases(events: "list[Event]") -> Phases:
    """A simulated rank's events as the executor's spans record them (:func:`hspmd_sdk.planner.calibrate.
    as_recorded`: an idle stretch counts as the phase of the receive or collective that waits), labelled planned."""
    from ...planner.calibrate import as_recorded  # lazy: planner

    return [(phase, a, b, f"{label} (planned)") for phase, a, b, label in as_recorded(events)]


def _ratio(planned: float | None, measured: float) -> float | None:
    """planned / measured; ``None`` when either is nothing (a phase the plan has no work in, e.g. ``sync`` without
    replicas, where the executor's span is its own bookkeeping)."""
    return None if not planned or measured <= 0 else planned / measured


@dataclass
class Timeline:
    """One recorded step: ``measured`` (program rank -> ``(phase, start s, end s, label)`` from the rank's first
    action; ``lead``: per rank, the seconds of its step before it, not simulated), ``predicted`` (the simulator's
    :class:`~hspmd_sdk.planner.simulator.SimResult`, ``None`` with ``why`` when it cannot run) priced by ``cost``
    (a :class:`~hspmd_sdk.planner.CostModel`) whose figures ``calibration`` names (``"figures measured by this job
    (steps 1, 2, 3: ...; not step 4)"``, ``"nominal device figures (...)"``, ``"the launch's cost model
    (cost=)"``; ``figures``: the fitted ones by name), and ``nominal``: the prediction before calibration, priced
    by what ``nominal_calibration`` names (``None`` when ``predicted`` is not calibrated)."""

    step: int
    measured: dict[int, Phases]
    predicted: "SimResult | None"
    labels: dict[int, str] = field(default_factory=dict)
    why: str = ""
    calibration: str = ""
    cost: "CostModel | None" = None
    nominal: "SimResult | None" = None
    figures: dict[str, float] = field(default_factory=dict)
    lead: dict[int, float] = field(default_factory=dict)
    nominal_calibration: str = ""

    @property
    def gaps(self) -> list[dict[str, Any]]:
        """Per rank and phase: ``measured_s``, ``predicted_s`` (``None`` without a prediction), ``gap_s``
        (measured less predicted), ``ratio`` (predicted / measured; ``None`` when nothing was measured or
        planned) and ``nominal_s`` (before calibration; ``None`` when not calibrated)."""
        rows = []
        for r in sorted(self.measured):
            got = phase_totals(self.measured[r])
            want, before = _totals(self.predicted, r), _totals(self.nominal, r)
            for phase in PHASES:
                p = want.get(phase) if want is not None else None
                rows.append({"rank": r, "phase": phase, "measured_s": got[phase], "predicted_s": p,
                             "gap_s": None if p is None else got[phase] - p, "ratio": _ratio(p, got[phase]),
                             "nominal_s": before.get(phase) if before is not None else None})
        return rows

    def by_phase(self) -> list[dict[str, Any]]:
        """Per phase, summed over the ranks: ``measured_s``, ``predicted_s``, ``ratio`` (predicted / measured),
        ``nominal_s`` and ``nominal_ratio`` (before calibration; ``None`` when not calibrated)."""
        out, gaps = [], self.gaps
        for phase in PHASES:
            rows = [g for g in gaps if g["phase"] == phase]
            m = sum(g["measured_s"] for g in rows)
            p = None if self.predicted is None else sum(g["predicted_s"] or 0.0 for g in rows)
            n = None if self.nominal is None else sum(g["nominal_s"] or 0.0 for g in rows)
            out.append({"phase": phase, "measured_s": m, "predicted_s": p, "ratio": _ratio(p, m), "nominal_s": n,
                        "nominal_ratio": _ratio(n, m)})
        return out

    def table(self) -> str:
        """The gaps as text: a row per rank, measured / predicted ms per phase; then the sums over the ranks and
        the ratio planned / measured per phase (after and before calibration), and what priced the plan."""
        head = f"step {self.step}: measured / predicted ms per phase" + (f" ({self.why})" if self.why else "")
        lines = [head, "rank   " + "".join(f"{p:>17}" for p in PHASES)]
        by = {(g["rank"], g["phase"]): g for g in self.gaps}
        ms = (lambda v: "-" if v is None else f"{v * 1e3:.1f}")
        for r in sorted(self.measured):
            lines.append(f"R{r:<5} " + "".join(f"{ms(by[(r, p)]['measured_s'])} / {ms(by[(r, p)]['predicted_s'])}"
                                               .rjust(17) for p in PHASES))
        if self.predicted is not None:
            sums = self.by_phase()
            x = (lambda v: "-" if v is None else f"{v:.2f}x")
            lines.append("all    " + "".join(f"{ms(g['measured_s'])} / {ms(g['predicted_s'])}".rjust(17)
                                            for g in sums))
            lines.append("ratio  " + "".join(x(g["ratio"]).rjust(17) for g in sums)
                         + "   planned / measured (-: nothing planned)")
            if self.nominal is not None:
                lines.append("before " + "".join(x(g["nominal_ratio"]).rjust(17) for g in sums)
                             + f"   uncalibrated: {self.nominal_calibration}")
            lines.append(f"planned with {self.calibration}")
            if self.figures:
                lines.append("  fitted: " + _describe(self.figures))
        if self.lead:
            lines.append("before the first action (the batch, the learning rate; not simulated): "
                         + ", ".join(f"R{r} {v * 1e3:.0f} ms" for r, v in sorted(self.lead.items())))
        return "\n".join(lines)

    def figure(self) -> "go.Figure":
        """Two rows per rank, ``measured`` above ``planned``, a bar per phase span (the simulator's colours; a
        planned wait in its phase's colour); the title names the figures that priced the plan and the ratio
        planned / measured per phase."""
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
                for phase, start, end, name in planned_phases(self.predicted.timeline.get(r, [])):
                    bars[phase].append((f"{label} planned", start, end, name))
        for phase in PHASES:
            got = bars[phase]
            if got:
                fig.add_trace(go.Bar(orientation="h", name=phase, y=[b[0] for b in got], base=[b[1] for b in got],
                                     x=[b[2] - b[1] for b in got], text=[b[3] for b in got], textposition="none",
                                     marker=dict(color=EVENT_COLOURS[phase]),
                                     hovertemplate="%{text}: %{x:.4f} s from %{base:.4f} s<extra></extra>"))
        title = f"step {self.step}: measured beside planned" + (f" ({self.why})" if self.why else "")
        if self.predicted is not None:
            ratios = ", ".join(f"{g['phase']} {g['ratio']:.2f}x" for g in self.by_phase() if g["ratio"] is not None)
            title += f"<br><sup>planned with {self.calibration}<br>planned / measured: {ratios}</sup>"
        fig.update_layout(barmode="overlay", title=title, xaxis_title="seconds from the rank's first action",
                          yaxis=dict(categoryorder="array", categoryarray=rows[::-1]),
                          height=150 + 40 * len(rows), margin=dict(l=140, r=20, t=90, b=40))
        return fig

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.figure())
        print(self.table())


def _totals(result: "SimResult | None", rank: int) -> dict[str, float] | None:
    """A simulated rank's seconds per phase as the executor records them (:func:`planned_phases`)."""
    if result is None or rank not in result.timeline:
        return None
    return phase_totals(planned_phases(result.timeline[rank]))


def _describe(figures: dict[str, float]) -> str:
    from ...planner.calibrate import describe_figures  # lazy: planner

    return describe_figures(figures)


def build_timeline(recorded: dict[int, dict[int, dict[str, Any]]], controller: Any, step: int | None,
                   labels: dict[int, str], *, calibrate: bool = True) -> Timeline:
    """The :class:`Timeline` of ``step`` (default: the last recorded) from the job's recorded steps (launch rank ->
    step -> ``{"rank", "version", "spans"}``) and its training controller (the Program of each version).
    ``calibrate``: price the plan with figures fitted to the other recorded steps of the same Program (see the
    module); ``False``: with the launch's cost model (or the nominal defaults)."""
    steps = sorted({s for per in recorded.values() for s in per})
    if not steps:
        raise ValueError("no step was recorded: launch with profile=[step, ...] (steps to record)")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise ValueError(f"step {step} was not recorded; recorded steps: {steps}")
    measured: dict[int, Phases] = {}
    names: dict[int, str] = {}
    lead: dict[int, float] = {}
    versions = set()
    for launch_rank, per in recorded.items():
        got = per.get(step)
        if got is None:
            continue
        r = int(got["rank"])
        measured[r], lead[r] = _from_first_action(measured_phases(got["spans"]))
        names[r] = labels.get(launch_rank, f"R{r}")
        versions.add(tuple(got.get("version") or (0, 0)))
    tl = Timeline(step, measured, None, names, lead=lead)
    if controller is None:
        tl.why = "no Program to simulate: not a training job"
    elif len(versions) != 1:
        tl.why = f"the ranks ran different versions of the plan in step {step}"
    else:
        version = versions.pop()
        _predict(tl, controller, version, _calibration_steps(recorded, step, version) if calibrate else None)
    return tl


def _from_first_action(phases: Phases) -> tuple[Phases, float]:
    """``phases`` from the first one's start, and that start (seconds of the step before the plan's actions)."""
    t0 = min((p[1] for p in phases), default=0.0)
    return [(ph, a - t0, b - t0, name) for ph, a, b, name in phases], t0


def _calibration_steps(recorded: dict[int, dict[int, dict[str, Any]]], step: int,
                       version: tuple) -> dict[int, dict[int, dict[str, float]]]:
    """The recorded steps other than ``step`` that every rank ran under ``version``: step -> program rank ->
    seconds per phase."""
    out: dict[int, dict[int, dict[str, float]]] = {}
    for s in sorted({s for per in recorded.values() for s in per} - {step}):
        got = [per[s] for per in recorded.values() if s in per]
        if len(got) != len(recorded) or any(tuple(g.get("version") or (0, 0)) != version for g in got):
            continue
        out[s] = {int(g["rank"]): phase_totals(measured_phases(g["spans"])) for g in got}
    return out


def _predict(tl: Timeline, controller: Any, version: tuple, calibration: dict | None) -> None:
    """Fill ``tl``'s prediction: the simulator on the Program of ``version``, with figures fitted to
    ``calibration`` (step -> rank -> seconds per phase) when it has a step, else the launch's cost model."""
    from ...planner.simulator import simulate  # lazy: planner, loaded only to simulate a timeline

    numbering = controller.versions.get(version)
    if numbering is None:
        tl.why = f"the Program of version {version} is not known to the launcher"
        return
    strategy = strategy_of(numbering.program)
    if strategy is None:
        tl.why = "the Program was not specialized from a Strategy: the simulator has nothing to run"
        return
    model, cluster = numbering.program.model, numbering.cluster
    kw = dict(global_batch=controller.global_batch, seq_len=controller.seq_len)
    base = controller.cost
    named = "the launch's cost model (cost=)" if base is not None else \
        "nominal device figures (the analytic CostModel defaults and the cluster's device specs)"
    nominal = simulate(model, strategy, cluster, cost=base, **kw)
    tl.predicted, tl.cost, tl.calibration = nominal, base, named
    if calibration is None:
        return
    if not calibration:
        tl.calibration += "; record two steps or more (profile=[1, 2, 3]) to calibrate from the job's own"
        return
    from ...planner.calibrate import FITTED_PHASES, calibrate  # lazy: planner

    ranks = sorted({r for per in calibration.values() for r in per})
    median = {r: {p: statistics.median(per[r][p] for per in calibration.values() if r in per)
                  for p in FITTED_PHASES} for r in ranks}
    try:
        fit = calibrate(model, strategy, cluster, median, base=base, **kw)
    except ValueError as e:  # nothing the simulator prices was measured
        tl.calibration += f" (not calibrated: {e})"
        return
    tl.predicted, tl.nominal, tl.cost, tl.figures = simulate(model, strategy, cluster, cost=fit.cost, **kw), \
        nominal, fit.cost, fit.figures
    tl.nominal_calibration = named
    tl.calibration = (f"figures measured by this job (steps {', '.join(map(str, calibration))}: the median per rank "
                      f"and phase, fitted by planner.calibrate; not step {tl.step})")
