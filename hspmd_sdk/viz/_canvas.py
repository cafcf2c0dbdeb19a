"""The plan editor's cluster canvas: an anywidget whose front end is ``static/plan_canvas.js`` (a plain ES module,
edited in place and shipped as package data: no npm, no bundler, no build step; ``static/job_dashboard.js`` is the
dashboard's).

Traits: ``cluster`` (nodes and devices, :func:`._canvas_view.cluster_view`, sent once), ``view`` (the draft shown,
:func:`._canvas_view.canvas_view`, after every change) and ``tensors`` (the tensor picker's groups).  The front end
sends every user action as a message ``{"op": ...}``; :class:`._editor_ui.EditorUI` turns it into a
``PlanEditor`` call.
"""
from __future__ import annotations

from pathlib import Path

import anywidget
import traitlets

__all__ = ["PlanCanvas", "STATIC"]

STATIC = Path(__file__).resolve().parent / "static"


class PlanCanvas(anywidget.AnyWidget):
    """The cluster canvas widget (drawn by ``static/plan_canvas.js``)."""

    _esm = STATIC / "plan_canvas.js"
    _css = STATIC / "plan_canvas.css"
    cluster = traitlets.Dict().tag(sync=True)
    view = traitlets.Dict().tag(sync=True)
    tensors = traitlets.List().tag(sync=True)
