"""Colours of the simulator's event kinds, shared by every step timeline: the viz's Gantt chart of a simulated step
and the runtime's measured-beside-planned timeline (``job.timeline()``), so a phase has one colour everywhere.
Plain constants: importing this pulls in nothing (the runtime imports nothing of the viz)."""
from __future__ import annotations

#: Bar colours by simulator event kind (``F``/``B`` compute, ``comm``, ``sync``, ``optim``, ``idle``).
EVENT_COLOURS = {"F": "#4c78a8", "B": "#f58518", "comm": "#b279a2", "sync": "#e45756", "optim": "#9d755d",
                 "idle": "#e8e8e8"}
