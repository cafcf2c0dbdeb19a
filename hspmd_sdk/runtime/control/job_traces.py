"""A job's measured timelines (``launch(..., profile=[steps])``; :class:`JobTraces`, a part of
:class:`~.job.Job`): the profiled steps of every rank as one Chrome/Perfetto trace (:meth:`JobTraces.trace`, a
:class:`TraceFile`) and beside the simulator's prediction (:meth:`JobTraces.timeline`)."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..trace import merge

if TYPE_CHECKING:
    from .job_stream import RankRecord
    from .timeline import Timeline

__all__ = ["JobTraces", "TraceFile"]


class TraceFile(type(Path())):  # type: ignore[misc]
    """The path :meth:`Job.trace` wrote (a :class:`~pathlib.Path`), whose repr says how to open it."""

    HOW = "open it in https://ui.perfetto.dev (Open trace file) or in Chrome at chrome://tracing (Load)"

    @classmethod
    def written(cls, path: Path) -> "TraceFile":
        out = cls(path)
        out._written = True
        return out

    def __repr__(self) -> str:  # only the written file itself: a path derived from it is a plain path
        base = f"{type(Path()).__name__}({str(self)!r})"
        return f"{base}  # {self.HOW}" if getattr(self, "_written", False) else base


class JobTraces:
    """The job's profiled steps; the state it keeps is the job's own (:class:`~.job.Job` sets every attribute
    below, the reader threads record the spans the workers report)."""

    log_dir: Path
    controller: Any
    _lock: threading.RLock
    _ranks: dict[int, "RankRecord"]
    _recorded: dict[int, dict[int, dict[str, Any]]]

    # ---- measured timelines (launch(..., profile=[steps])) ---------------------------------------------------
    def trace(self, path: str | Path | None = None) -> Path:
        """Write the profiled steps of every rank as one Chrome/Perfetto trace (a track per rank; the plan's
        actions, its communication operators by their SPEC names and the process group's collectives; see
        :mod:`.trace`) to ``path`` (default ``<log_dir>/trace.json``) and return the path, whose repr says how to
        open it: in https://ui.perfetto.dev ("Open trace file") or in Chrome at ``chrome://tracing`` ("Load").
        Raises ``ValueError`` when no step was recorded."""

        with self._lock:
            recorded = {r: {s: list(v["spans"]) for s, v in per.items()} for r, per in self._recorded.items()}
        if not recorded:
            raise ValueError("no step was recorded: launch with profile=[step, ...] (steps to record)")
        out = Path(path) if path is not None else self.log_dir / "trace.json"
        out.write_text(json.dumps(merge(recorded, self._rank_labels())))
        return TraceFile.written(out)

    def timeline(self, step: int | None = None, *, calibrate: bool = True) -> "Timeline":
        """Each rank's measured phases of a profiled ``step`` (default: the last recorded) beside the simulator's
        prediction for the Program that ran it: a :class:`~.timeline.Timeline` (``figure()``, ``gaps``,
        ``by_phase()``, ``table()``; a notebook shows both).  ``calibrate`` (default): the prediction is priced
        with this machine's figures, fitted to the job's other recorded steps (record a few: ``profile=[1, 2, 3,
        4]``); ``False``: with the launch's ``cost=`` or the nominal defaults.  ``Timeline.calibration`` says which."""
        from .timeline import build_timeline  # lazy: core (timeline): the launcher imports job without loading core

        with self._lock:
            recorded = {r: dict(per) for r, per in self._recorded.items()}
        return build_timeline(recorded, self.controller, step, self._rank_labels(), calibrate=calibrate)

    def _rank_labels(self) -> dict[int, str]:
        with self._lock:
            return {r: f"rank {r}" + (f" ({rec.host})" if rec.host else "") for r, rec in self._ranks.items()}
