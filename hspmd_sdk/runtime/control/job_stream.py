"""What the workers' lines do to a job (:class:`JobStream`, a part of :class:`~.job.Job`): the transport's reader
threads deliver every line to ``_on_line``, which keeps each rank's lines, metrics, start-up phases, holds and
profiled spans, and drives the progress line (the start-up phases, then the steps' loss and pace)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..metrics import MetricsHistory, StepMetrics
from .job_result import STARTUP_PHASES, StartupTimes
from .progress import Progress, format_rate, step_rates, step_tokens
from .watchdog import Liveness
from ..protocol import decode
from ..spec import LaunchSpec

if TYPE_CHECKING:
    from .faults import Failure
    from .job_logs import JobLogs

__all__ = ["JobStream", "RankRecord", "TAIL_LINES"]


#: How many stderr lines of a rank that died without a traceback are quoted in the error.
TAIL_LINES = 30


@dataclass
class RankRecord(Liveness):
    """What the job keeps of a rank: its lines, result, start-up phases, and its life (:class:`~.watchdog.Liveness`:
    what the watchdog reads)."""

    lines: list[str] = field(default_factory=list)
    stderr_tail: list[str] = field(default_factory=list)
    pid: int | None = None
    host: str | None = None
    result: dict[str, Any] | None = None
    phases: dict[str, float] = field(default_factory=dict)  # start-up milestone -> monotonic receipt time


class JobStream:
    """The job's handling of its workers' streams and its progress line; the state it keeps is the job's own
    (:class:`~.job.Job` sets every attribute below).  Errors and exits go to the job's failure handling
    (:class:`~.job_failures.JobFailures`)."""

    spec: LaunchSpec
    metrics: MetricsHistory
    controller: Any
    prepared_s: float | None
    _lock: threading.RLock
    _ranks: dict[int, "RankRecord"]
    _logs: "JobLogs"
    _echo: Callable[[str], None] | None
    _progress: Progress | None
    _data_label: str | None
    _observers: dict[str, list[Callable[[int, dict[str, Any]], None]]]
    _held: dict[int, dict[int, dict[str, Any]]]
    _newcomers: set[int]
    _recorded: dict[int, dict[int, dict[str, Any]]]
    _failures: list["Failure"]
    _absorbed: list["Failure"]

    # ---- stream handling (reader threads) ------------------------------------------------------------------
    def _on_line(self, rank: int, stream: str, line: str) -> None:
        now = time.monotonic()
        rec = self._ranks[rank]
        rec.heard = now
        msg = decode(line) if stream == "out" else None
        if msg is None:
            self._append(rank, line, stderr=(stream == "err"))
            return
        kind = msg.get("t")
        if kind == "beat":
            with self._lock:
                rec.beat, rec.beat_at = msg, now
        elif kind == "log":
            self._append(rank, str(msg.get("text", "")), stderr=msg.get("stream") == "stderr")
        elif kind == "metric":
            rec.progress_at = now
            rec.phases.setdefault("first_step", now)
            self._on_metric(StepMetrics.from_message(msg | {"rank": rank}))
        elif kind == "hello":
            with self._lock:
                rec.pid, rec.host = msg.get("pid"), msg.get("host")
                rec.phases.setdefault("hello", now)
            self._show_startup()
        elif kind == "phase":
            with self._lock:
                rec.phases.setdefault(str(msg.get("name")), now)
            self._show_startup()
        elif kind == "ready":
            with self._lock:
                rec.ready, rec.progress_at = True, now
                rec.phases.setdefault("ready", now)
            self._show_startup()
        elif kind == "result":
            with self._lock:
                rec.result = dict(msg.get("value") or {})
        elif kind == "error":
            self._on_error(rank, msg)
        elif kind == "held":  # hold_at=: the rank waits at the start of a step (and what it heard meanwhile)
            with self._lock:
                self._held.setdefault(int(msg.get("step", -1)), {})[rank] = msg
        elif kind == "unheld":  # it left the hold without a release (a peer died)
            with self._lock:
                self._held.get(int(msg.get("step", -1)), {}).pop(rank, None)
        elif kind == "switched":
            with self._lock:
                self._newcomers.discard(rank)  # a newcomer is in the world once it switched into it
        elif kind == "trace":
            with self._lock:
                self._recorded.setdefault(rank, {})[int(msg.get("step", -1))] = {
                    "rank": msg.get("program_rank", rank), "version": msg.get("version"),
                    "spans": msg.get("spans") or [], "collect_s": msg.get("collect_s")}
        for fn in self._observers.get(str(kind), ()):
            try:
                fn(rank, msg)
            except Exception as e:  # noqa: BLE001 - an observer's bug must not kill the reader thread
                self._append(rank, f"(a message observer raised {type(e).__name__}: {e})", stderr=True)

    def _append(self, rank: int, text: str, *, stderr: bool = False) -> None:
        with self._lock:
            rec = self._ranks[rank]
            rec.lines.append(text)
            if stderr:
                rec.stderr_tail = (rec.stderr_tail + [text])[-TAIL_LINES:]
                if rec.capture is not None:
                    rec.capture.append(text)
            self._logs.write(rank, text)
        if self._echo is not None:
            self._echo(f"[rank {rank}] {text}")

    def _on_metric(self, m: StepMetrics) -> None:
        self.metrics.add(m)
        self._logs.metric(m.to_message() | {"rank": m.rank})
        self._append(m.rank, "metric: " + m.describe())
        if self._progress is not None and m.rank == self.metrics.loss_rank(self.spec.loss_rank):
            self._progress.update(m.step + 1, self._progress_text(m))

    def startup(self) -> StartupTimes:
        """Where the time from ``launch()`` to the first step went: :class:`StartupTimes` (the launcher's
        preparation, then processes, imports, rendezvous, build and the first step, on the critical path and per
        rank).  Phases not reached yet are ``None``."""
        with self._lock:
            per = {r: dict(rec.phases) for r, rec in self._ranks.items()}
        spawned = [p["spawned"] for p in per.values() if "spawned" in p]
        phases: dict[str, float | None] = {}
        before = min(spawned) if spawned else None
        for name, milestone in STARTUP_PHASES:
            got = [p[milestone] for p in per.values() if milestone in p]
            if before is None or len(got) < len(per):
                phases[name] = None
                continue
            phases[name] = max(0.0, max(got) - before)
            before = max(got)
        per_rank = {r: {m: round(t - p["spawned"], 6) for m, t in p.items() if m != "spawned"}
                    for r, p in per.items() if "spawned" in p}
        return StartupTimes(self.prepared_s, phases, per_rank)

    def startup_text(self) -> str | None:
        """``"starting 4 workers: rendezvous 2/4"`` while the workers start (the phase the slowest rank is in and
        how many ranks finished it), ``None`` once every rank reported a step (or for an empty job)."""
        with self._lock:
            per = [dict(rec.phases) for rec in self._ranks.values()]
        n = len(per)
        if not n or all("first_step" in p for p in per):
            return None
        for name, milestone in STARTUP_PHASES:
            done = sum(milestone in p for p in per)
            if done < n:
                return f"starting {n} workers: {name} {done}/{n}"
        return None

    def _show_startup(self) -> None:
        if self._progress is None or self.metrics.last_step() >= 0:
            return
        text = self.startup_text()
        if text is not None:
            self._progress.update(0, text)

    def _progress_text(self, m: StepMetrics) -> str:
        """``loss 2.4130, 0.21 s/step, 985 tok/s``: the loss rank's loss, and the job's pace as the dashboard computes
        it (:func:`.progress.step_rates` over the ranks still in the job: every step's tokens over its slowest rank's
        time, not one rank's own tokens over its own time)."""
        with self._lock:
            failed = {r for f in (*self._absorbed, *self._failures) for r in f.ranks}
            ranks = [r for r, rec in self._ranks.items() if rec.returncode in (None, 0) and r not in failed]
        step_s, tps = step_rates(self.metrics, ranks, step_tokens(self.controller))
        parts = ([f"loss {m.loss:.4f}"] if m.loss is not None else []) + (
            [f"{step_s:.2f} s/step"] if step_s is not None else []) + ([format_rate(tps)] if tps else [])
        text = ", ".join(parts)
        if self._data_label:
            text += f" | {self._data_label}"
        if self.spec.slowdown:
            text += " | EMULATED slowdown " + ", ".join(
                f"rank {r}: {k:g}x" if isinstance(k, (int, float)) else f"rank {r}: " + ", ".join(
                    f"{f:g}x from step {s}" for s, f in k) for r, k in self.spec.slowdown.items())
        return text
