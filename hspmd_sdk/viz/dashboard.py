"""``JobDashboard``: a running job in a notebook -- step, elapsed time, ETA and tokens/s, the loss curve, each rank
of the job's current world with its last step time and memory (a dead rank marked with what happened, ranks an
elastic job removed listed apart), every failure and reconfiguration as it happens, the plan the job runs now, a
stop button and each rank's log one click away.  The same view the plan editor shows for an attached job
(``PlanEditor(..., job=job)``).

It reads only the job's public API (:mod:`._job`) on a daemon thread every ``interval`` seconds and stops after
the job finished.  The front end (``static/job_dashboard.js``) sends two messages: ``{"type": "stop"}`` (the stop
button, confirmed by a second click: :meth:`JobDashboard.stop`) and ``{"type": "logs", "rank": r}`` (a click on a
rank: :meth:`JobDashboard.show_logs`).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import anywidget
import traitlets

from ._canvas import STATIC
from ._job import JobSnapshot, JobWatcher

__all__ = ["JobDashboard"]

#: Lines of a rank's log the dashboard shows (the whole log is in its file).
LOG_LINES = 200


class JobDashboard(anywidget.AnyWidget):
    """Display ``JobDashboard(job)`` in a notebook to follow ``job``.

    ``interval``: seconds between polls; ``watch=False``: poll only when :meth:`refresh` is called (scripts and
    tests); ``on_update``: also called with every new :class:`._job.JobSnapshot` (the plan editor uses it to
    follow the job's reconfigurations).
    """

    _esm = STATIC / "job_dashboard.js"
    _css = STATIC / "job_dashboard.css"
    state = traitlets.Dict().tag(sync=True)
    #: the log shown under the dashboard: ``{"rank", "path", "text", "lines"}`` (empty: none shown)
    log = traitlets.Dict().tag(sync=True)

    def __init__(self, job: Any, *, interval: float = 0.5, watch: bool = True,
                 on_update: Callable[[JobSnapshot], None] | None = None) -> None:
        super().__init__()
        self.job = job
        self._on_update = on_update
        self._watcher = JobWatcher(job, self._show, interval)
        self._stopper: threading.Thread | None = None
        self.on_msg(self._on_front_end)
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

    def stop(self, *, wait: bool = True) -> None:
        """Stop the job: a training job gracefully (``job.stop()``: every worker finishes its step, the job ends
        there, ``job.wait()`` returns the losses so far); any other job at once (``job.cancel()``, ``job.wait()``
        raises ``JobCancelled``).  The dashboard lists it as stopped from here.  ``wait=False``: on a thread (the
        stop button: the kernel stays responsive while the workers stop)."""
        graceful = getattr(self.job, "stop", None)
        cancel = graceful if callable(graceful) else getattr(self.job, "cancel", None)
        if not callable(cancel) or not self._watcher.last or not self._watcher.last.running:
            return
        self._watcher.stopped_by_user = True
        if wait:
            cancel()
            self.refresh()
            return
        if self._stopper is None:
            def run() -> None:
                cancel()
                self.refresh()
            self._stopper = threading.Thread(target=run, name="hspmd-dashboard-stop", daemon=True)
            self._stopper.start()

    def show_logs(self, rank: int | None) -> dict[str, Any]:
        """Show the newest :data:`LOG_LINES` lines of ``rank``'s log under the dashboard (``None``: hide it);
        returns what is shown.  The whole log is the file ``path`` (``job.log_dir/rank{R}.log``)."""
        if rank is None:
            self.log = {}
            return {}
        rank = int(rank)
        try:
            text = self.job.logs(rank)
        except Exception as e:  # noqa: BLE001 - an unknown rank, a job without logs: say so where the log would be
            text = f"(no log for rank {rank}: {e})"
        lines = text.splitlines()
        log_dir = getattr(self.job, "log_dir", None)
        self.log = {"rank": rank, "path": str(log_dir / f"rank{rank}.log") if log_dir else "",
                    "text": "\n".join(lines[-LOG_LINES:]), "lines": len(lines)}
        return self.log

    def _on_front_end(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if not isinstance(content, dict):
            return
        kind = content.get("type")
        if kind == "stop":
            self.stop(wait=False)
        elif kind == "logs":
            self.show_logs(content.get("rank"))

    def _show(self, snap: JobSnapshot) -> None:
        self.state = snap.to_view()
        if self.log:
            self.show_logs(self.log.get("rank"))  # the log shown follows the job
        if self._on_update is not None:
            self._on_update(snap)

    def close(self) -> None:
        self._watcher.stop()
        super().close()
