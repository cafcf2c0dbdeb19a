"""Figures (plotly) and the plan editor (ipywidgets) for HSPMD plans.

Names are imported lazily: ``import hspmd_sdk.viz`` is cheap; plotly and ipywidgets load on first use.

* :func:`cluster_figure` -- nodes, devices, a strategy and one tensor's annotation (shard grids);
* :func:`comm_figure`, :func:`volume_table_figure`, :func:`volume_table_html` -- a ``CommPlan``/``SwitchPlan``;
* :func:`switch_heatmap` -- sender x receiver traffic of a graph switch (BSR);
* :func:`gantt_figure` -- the pipeline timeline of a ``SimResult``;
* :class:`PlanEditor` -- build and edit a strategy on the cluster canvas (drag devices onto stages), validated
  live by the core; attach a running job and switch it;
* :class:`JobDashboard` -- a running job's step, loss curve, per-rank step times and events.
"""
from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "cluster_figure": ".cluster_fig",
    "annotation_overlay": ".cluster_fig",
    "tile_style": ".cluster_fig",
    "comm_figure": ".comm_fig",
    "volume_table_figure": ".comm_fig",
    "volume_table_html": ".comm_fig",
    "switch_heatmap": ".comm_fig",
    "traffic_matrix": ".comm_fig",
    "gantt_figure": ".gantt",
    "PlanEditor": ".editor",
    "training_runtime": ".editor",
    "JobDashboard": ".dashboard",
    "Draft": ".draft",
    "Problem": ".draft",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
