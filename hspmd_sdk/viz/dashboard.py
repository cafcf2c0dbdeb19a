"""``JobDashboard``: a running job's progress in a notebook -- step, loss curve, each rank's last step time and
the job's events (switches and failures) as they happen.  The same view the plan editor shows for an attached
job (``PlanEditor(..., job=job)``).

It reads only the job's public API (:mod:`._job`) on a daemon thread every ``interval`` seconds and stops after
the job finished.
"""
from __future__ import annotations

from typing import Any, Callable

import anywidget
import traitlets

from ._canvas import STATIC
from ._job import JobSnapshot, JobWatcher

__all__ = ["JobDashboard"]


class JobDashboard(anywidget.AnyWidget):
    """Display ``JobDashboard(job)`` in a notebook to follow ``job``.

    ``interval``: seconds between polls; ``watch=False``: poll only when :meth:`refresh` is called (scripts and
    tests); ``on_update``: also called with every new :class:`._job.JobSnapshot` (the plan editor uses it to
    follow the job's reconfigurations).
    """

    _esm = STATIC / "job_dashboard.js"
    _css = STATIC / "job_dashboard.css"
    state = traitlets.Dict().tag(sync=True)

    def __init__(self, job: Any, *, interval: float = 0.5, watch: bool = True,
                 on_update: Callable[[JobSnapshot], None] | None = None) -> None:
        super().__init__()
        self.job = job
        self._on_update = on_update
        self._watcher = JobWatcher(job, self._show, interval)
        self._watcher.poll()
        if watch:
            self._watcher.start()

    @property
    def snapshot(self) -> JobSnapshot | None:
        """What the dashboard shows now."""
        return self._watcher.last

    def refresh(self) -> JobSnapshot:
        """Read the job now and redraw."""
        return self._watcher.poll()

    def _show(self, snap: JobSnapshot) -> None:
        self.state = snap.to_view()
        if self._on_update is not None:
            self._on_update(snap)

    def close(self) -> None:
        self._watcher.stop()
        super().close()
