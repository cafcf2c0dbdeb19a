"""The pipeline Gantt chart of a simulated step: one row per device, one bar per ``SimResult.timeline`` event
(``F``/``B`` of a micro-batch, ``comm``, gradient ``sync``, ``optim``, ``idle``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import plotly.graph_objects as go

from ._style import EVENT_COLOURS

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..planner.simulator import SimResult

__all__ = ["gantt_figure"]

_NAMES = {"F": "forward", "B": "backward", "comm": "ZeRO gather / comm", "sync": "gradient sync",
          "optim": "optimizer", "idle": "idle"}


def gantt_figure(result: "SimResult", *, devices: Sequence[int] | None = None, cluster: "Cluster | None" = None,
                 show_idle: bool = True, title: str = "") -> go.Figure:
    """One horizontal bar per event of ``result.timeline`` (all devices, or ``devices``), one trace per event
    kind; forward/backward bars are labelled with their micro-batch.  Row labels name the device kind when
    ``cluster`` is given."""
    devs = list(devices) if devices is not None else sorted(result.timeline)
    label = {d: f"R{d}" + (f" {cluster.kind(d)}" if cluster is not None else "") for d in devs}
    fig = go.Figure()
    for kind in ("F", "B", "comm", "sync", "optim", "idle"):
        if kind == "idle" and not show_idle:
            continue
        evs = [(d, e) for d in devs for e in result.timeline[d] if e.kind == kind]
        if not evs:
            continue
        fig.add_trace(go.Bar(
            orientation="h", name=_NAMES[kind], y=[label[d] for d, _ in evs], base=[e.start for _, e in evs],
            x=[e.duration for _, e in evs], marker=dict(color=EVENT_COLOURS[kind], line=dict(width=0.3,
                                                                                           color="white")),
            text=[str(e.micro_batch) if e.micro_batch is not None else "" for _, e in evs],
            textposition="inside", insidetextanchor="middle", textangle=0, textfont=dict(size=9),
            customdata=[[d, e.micro_batch if e.micro_batch is not None else -1] for d, e in evs],
            hovertemplate=f"{_NAMES[kind]}" + " mb %{customdata[1]} on R%{customdata[0]}: %{base:.3f}–"
                          "%{x:.3f} s<extra></extra>" if kind in "FB" else
                          f"{_NAMES[kind]} on R" + "%{customdata[0]}: %{x:.3f} s from %{base:.3f} s<extra></extra>"))
    fig.update_layout(
        barmode="overlay", bargap=0.15, plot_bgcolor="white", uniformtext=dict(mode="hide", minsize=7),
        title=dict(text=title or f"{result.label + ': ' if result.label else ''}step {result.step_time:.3f} s, "
                                 f"bubble {result.bubble_fraction:.1%}", font=dict(size=14)),
        xaxis=dict(title="time (s)", range=[0, result.step_time], gridcolor="#eee"),
        yaxis=dict(autorange="reversed", categoryorder="array", categoryarray=[label[d] for d in devs]),
        height=max(240, 16 * len(devs) + 120), legend=dict(orientation="h", y=1.02, x=0, yanchor="bottom"),
        margin=dict(l=70, r=10, t=70, b=40))
    return fig
