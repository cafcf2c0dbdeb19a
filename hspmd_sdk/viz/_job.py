"""Reading a running job for the screen: a snapshot of its public state, and a thread that polls it.

Only the job's public API is read: ``status``, ``job_id``, ``spec.steps``, ``metrics`` (``last_step()``,
``losses()``, ``ranks()``, ``rank(r)``), ``pids()`` and, when the job has them, ``events`` (reconfigurations:
``step``, ``reason``, ``failed_ranks``, ``strategy``, ``seconds``, ``bytes``) and ``switch``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["JobSnapshot", "JobEvent", "snapshot", "JobWatcher", "can_switch", "SWITCH_NEEDS"]

#: Why "Apply to running job" is disabled for a job without ``switch``.
SWITCH_NEEDS = ("switching needs a job launched from an SDK version with Job.switch (graph switching in a running "
                "job); this job has no switch()")
_RUNNING = {"starting", "running"}


@dataclass(frozen=True)
class JobEvent:
    """One reconfiguration of a job, as the screen shows it."""

    step: int | None
    reason: str
    failed_ranks: tuple[int, ...]
    strategy: Any
    seconds: dict[str, float]
    bytes: dict[str, int]

    def describe(self) -> str:
        parts = [f"step {self.step}" if self.step is not None else "", self.reason]
        if self.failed_ranks:
            parts.append(f"failed ranks {', '.join(map(str, self.failed_ranks))}")
        if "total" in self.seconds:
            parts.append(f"{self.seconds['total']:.2f} s")
        moved = sum(self.bytes.values())
        if moved:
            from ._units import fmt_bytes

            parts.append(f"moved {fmt_bytes(moved)}")
        return " · ".join(p for p in parts if p)


def _event(e: Any) -> JobEvent:
    get = (lambda k, d=None: e.get(k, d)) if isinstance(e, dict) else (lambda k, d=None: getattr(e, k, d))
    step = get("step")
    return JobEvent(int(step) if step is not None else None, str(get("reason", "") or ""),
                    tuple(int(r) for r in (get("failed_ranks") or ())), get("strategy"),
                    {str(k): float(v) for k, v in dict(get("seconds") or {}).items()},
                    {str(k): int(v) for k, v in dict(get("bytes") or {}).items()})


@dataclass(frozen=True)
class JobSnapshot:
    """What a job shows now: status, progress, losses, each rank's last step time, events."""

    job_id: str
    status: str
    step: int
    steps: int | None
    losses: tuple[float, ...]
    step_times: dict[int, float]
    events: tuple[JobEvent, ...] = ()
    can_switch: bool = False
    error: str = ""
    pids: dict[int, int] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.status in _RUNNING

    def to_view(self) -> dict[str, Any]:
        """The JSON the dashboard draws."""
        times = self.step_times
        slow = max(times, key=times.get) if times else None
        return {"job_id": self.job_id, "status": self.status, "step": self.step, "steps": self.steps,
                "losses": [round(x, 6) for x in self.losses],
                "step_times": [[r, round(t, 4)] for r, t in sorted(times.items())], "slowest": slow,
                "events": [{"text": e.describe(), "reason": e.reason, "step": e.step,
                            "failed": list(e.failed_ranks)} for e in self.events],
                "can_switch": self.can_switch, "error": self.error, "running": self.running}


def can_switch(job: Any) -> bool:
    return callable(getattr(job, "switch", None)) and getattr(job, "controller", True) is not None


def snapshot(job: Any) -> JobSnapshot:
    """Read ``job``'s public state now."""
    status = getattr(job, "status", "unknown")
    status = str(getattr(status, "value", status))
    metrics = job.metrics
    times: dict[int, float] = {}
    for r in metrics.ranks():
        done = [m for m in metrics.rank(r) if m.step_time is not None]
        if done:
            times[r] = float(done[-1].step_time)
    spec = getattr(job, "spec", None)
    steps = getattr(spec, "steps", None)
    error = ""
    if status == "failed":
        first = getattr(job, "first_failure", None)
        f = first() if callable(first) else None
        error = f"rank {f.rank}: {f.message}" if f is not None else "failed"
    try:
        pids = dict(job.pids())
    except Exception:  # noqa: BLE001 - a finished job may have no process table left
        pids = {}
    return JobSnapshot(str(getattr(job, "job_id", "")), status, metrics.last_step() + 1,
                       int(steps) if steps is not None else None, tuple(metrics.losses()), times,
                       tuple(_event(e) for e in list(getattr(job, "events", None) or ())), can_switch(job), error,
                       pids)


class JobWatcher:
    """Polls a job every ``interval`` seconds on a daemon thread and calls ``on_change(snapshot)`` when what it
    shows changed; stops after the job finished (one last call)."""

    def __init__(self, job: Any, on_change: Callable[[JobSnapshot], None], interval: float = 0.5) -> None:
        self.job = job
        self.on_change = on_change
        self.interval = interval
        self.last: JobSnapshot | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> JobSnapshot:
        """Read the job now; call ``on_change`` if the snapshot differs from the last one."""
        snap = snapshot(self.job)
        if snap != self.last:
            self.last = snap
            self.on_change(snap)
        return snap

    def start(self) -> "JobWatcher":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hspmd-job-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                snap = self.poll()
            except Exception:  # noqa: BLE001 - a job being torn down; try again, then give up when it is done
                snap = None
            if snap is not None and not snap.running:
                break
            self._stop.wait(self.interval)
