"""The plan editor's cluster canvas: an anywidget whose front end is ``static/plan_canvas.js`` (``static/job_dashboard.js``
is the dashboard's).  Both are generated: their sources are ES modules in ``widgets/src`` of the repository, unit
tested with Node's test runner, and bundled by esbuild (``npm run build`` in ``widgets/``) into one ES module each,
shipped as package data; users need no Node.  Never edit the bundles: ``tests/test_widgets.py`` fails when they are
not the build of the sources.

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
