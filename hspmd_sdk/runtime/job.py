"""A running job: its workers' streams, logs, metrics, failure handling and result.

Background threads (the transport's) deliver every worker line to :meth:`Job._on_line`; the job keeps per-rank
logs (in memory and in ``log_dir/rank{R}.log``, plus ``log_dir/job.log`` with every line prefixed by its rank),
metrics and results.  When a worker fails, the job stops every worker at once and :meth:`Job.wait` raises
:class:`~hspmd_sdk.errors.RuntimeFailure` for the *first* failing rank: a genuine error wins over the connection
errors its peers raise afterwards, then the earliest.
"""
from __future__ import annotations

import atexit
import enum
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from ..errors import RuntimeFailure
from .metrics import MetricsHistory, StepMetrics
from .progress import Progress, make_progress
from .protocol import decode
from .spec import LaunchSpec
from .transport import Transport, WorkerGroup

#: How many stderr lines of a rank that died without a traceback are quoted in the error.
TAIL_LINES = 30


class JobStatus(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class JobCancelled(RuntimeFailure):
    """The job was cancelled (``Job.cancel()`` or an interrupt) before it finished."""


@dataclass
class Failure:
    """One rank's failure as the launcher saw it."""

    rank: int
    message: str
    traceback: str
    collateral: bool
    time: float

    def sort_key(self) -> tuple[bool, float, int]:
        return (self.collateral, self.time, self.rank)


@dataclass
class JobResult:
    """What a finished job returns.

    ``losses``: per-step losses of the loss rank, ordered by step; ``results``: each rank's entry return value;
    ``metrics``: every rank's step metrics; ``emulation``: ranks whose speed was emulated (rank -> factor).
    """

    job_id: str
    results: dict[int, dict[str, Any]]
    losses: list[float]
    metrics: dict[int, list[StepMetrics]]
    wall_time: float
    log_dir: Path
    emulation: dict[int, float] = field(default_factory=dict)

    def step_times(self, rank: int) -> list[float]:
        return [m.step_time for m in self.metrics.get(rank, []) if m.step_time is not None]


@dataclass
class _Rank:
    log: IO[str]
    lines: list[str] = field(default_factory=list)
    stderr_tail: list[str] = field(default_factory=list)
    pid: int | None = None
    host: str | None = None
    result: dict[str, Any] | None = None
    returncode: int | None = None


class Job:
    """Workers running one :class:`LaunchSpec`; create with :func:`hspmd_sdk.runtime.launch_spec`.

    ``status``, ``logs(rank)``, ``metrics``, ``log_dir``, ``wait(timeout)``, ``cancel()``.  Usable as a context
    manager: leaving the block cancels a job that is still running.
    """

    def __init__(self, spec: LaunchSpec, hosts: dict[str, list[int]], transport: Transport, *,
                 log_dir: str | Path | None = None, progress: bool = False,
                 echo: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.transport = transport
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"hspmd-{spec.job_id}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsHistory()
        self._hosts = hosts
        self._echo = echo
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._status = JobStatus.STARTING
        self._ranks = {r: _Rank(log=open(self.log_dir / f"rank{r}.log", "w", buffering=1)) for r in spec.ranks}
        self._joblog = open(self.log_dir / "job.log", "w", buffering=1)
        self._failures: list[Failure] = []
        self._stopping = False
        self._cancelled = False
        self._groups: list[WorkerGroup] = []
        self._t0 = time.monotonic()
        self._t1: float | None = None
        self._progress: Progress | None = make_progress(spec.steps, f"job {spec.job_id}") if progress else None
        self._atexit = self._kill_at_exit
        atexit.register(self._atexit)

    # ---- public --------------------------------------------------------------------------------------------
    @property
    def status(self) -> JobStatus:
        return self._status

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    def logs(self, rank: int) -> str:
        """Everything rank ``rank`` printed or logged so far, one line a line."""
        if rank not in self._ranks:
            raise KeyError(f"rank {rank} is not in job {self.job_id} (ranks 0..{self.spec.world_size - 1})")
        with self._lock:
            return "\n".join(self._ranks[rank].lines)

    def pids(self) -> dict[int, int]:
        """Rank -> process id on its host (as the transport started it)."""
        out: dict[int, int] = {}
        for g in self._groups:
            out.update(g.pids())
        return out

    def wait(self, timeout: float | None = None) -> JobResult:
        """Block until every worker exited; the result, or ``RuntimeFailure`` for the first failing rank.

        ``timeout`` seconds: raise ``TimeoutError`` (the job keeps running; ``cancel()`` it if needed).
        An interrupt (Ctrl-C, the notebook's stop button) cancels the job, then propagates.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._done.wait(0.05):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {self.job_id} still running after {timeout} s "
                                       f"(status {self.status.value}); call job.cancel() to stop it")
        except KeyboardInterrupt:
            self.cancel()
            raise
        return self._outcome()

    def cancel(self) -> None:
        """Stop every worker now (idempotent); ``wait()`` then raises ``JobCancelled``."""
        with self._lock:
            if self._done.is_set():
                return
            self._cancelled = True
        self._stop_all()
        self._done.wait(10.0)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()

    def __repr__(self) -> str:
        return (f"Job({self.job_id}: {self.spec.world_size} ranks, {self.status.value}, "
                f"step {self.metrics.last_step() + 1}/{self.spec.steps}, logs in {self.log_dir})")

    # ---- start ---------------------------------------------------------------------------------------------
    def start(self) -> "Job":
        """Start the workers on every host (called by ``launch_spec``)."""
        try:
            for host, ranks in self._hosts.items():
                group = self.transport.start(host, ranks, self.spec, self._on_line, self._on_exit)
                with self._lock:
                    self._groups.append(group)
                    stopping = self._stopping
                if stopping:  # a worker already failed (or cancel() ran) while we were starting this host
                    group.kill()
        except BaseException:
            self._cancelled = True
            started = {r for g in self._groups for r in g.ranks}
            with self._lock:  # ranks that never started will never exit: count them as exited
                for r in set(self._ranks) - started:
                    self._ranks[r].returncode = -1
            self._stop_all()
            self._maybe_finish()
            raise
        with self._lock:
            if self._status is JobStatus.STARTING:
                self._status = JobStatus.RUNNING
        return self

    # ---- stream handling (reader threads) ------------------------------------------------------------------
    def _on_line(self, rank: int, stream: str, line: str) -> None:
        msg = decode(line) if stream == "out" else None
        if msg is None:
            self._append(rank, line, stderr=(stream == "err"))
            return
        kind = msg.get("t")
        if kind == "log":
            self._append(rank, str(msg.get("text", "")), stderr=msg.get("stream") == "stderr")
        elif kind == "metric":
            self._on_metric(StepMetrics.from_message(msg | {"rank": rank}))
        elif kind == "hello":
            with self._lock:
                self._ranks[rank].pid, self._ranks[rank].host = msg.get("pid"), msg.get("host")
        elif kind == "result":
            with self._lock:
                self._ranks[rank].result = dict(msg.get("value") or {})
        elif kind == "error":
            self._on_error(rank, msg)

    def _append(self, rank: int, text: str, *, stderr: bool = False) -> None:
        with self._lock:
            rec = self._ranks[rank]
            rec.lines.append(text)
            if stderr:
                rec.stderr_tail = (rec.stderr_tail + [text])[-TAIL_LINES:]
            rec.log.write(text + "\n")
            self._joblog.write(f"[rank {rank}] {text}\n")
        if self._echo is not None:
            self._echo(f"[rank {rank}] {text}")

    def _on_metric(self, m: StepMetrics) -> None:
        self.metrics.add(m)
        self._append(m.rank, "metric: " + m.describe())
        if self._progress is not None and m.rank == self.metrics.loss_rank(self.spec.loss_rank):
            self._progress.update(m.step + 1, self._progress_text(m))

    def _progress_text(self, m: StepMetrics) -> str:
        text = m.describe().partition(": ")[2].split(" (emulated")[0]
        if self.spec.slowdown:
            text += " | EMULATED slowdown " + ", ".join(f"rank {r}: {k:g}x" for r, k in self.spec.slowdown.items())
        return text

    def _on_error(self, rank: int, msg: dict[str, Any]) -> None:
        tb = str(msg.get("traceback", ""))
        self._append(rank, tb.rstrip("\n") or str(msg.get("message")), stderr=True)
        self._fail(Failure(rank, str(msg.get("message", "error")), tb, bool(msg.get("collateral", False)),
                           float(msg.get("time", time.time()))))

    def _on_exit(self, rank: int, returncode: int) -> None:
        with self._lock:
            rec = self._ranks[rank]
            rec.returncode = returncode
            reported = any(f.rank == rank for f in self._failures)
            killed = any(g.stopped_by_kill(rank, returncode) for g in self._groups if rank in g.ranks)
        self._append(rank, f"exited with status {_describe_rc(returncode)}" + (" (stopped by the launcher)"
                                                                                 if killed else ""))
        if not reported and not killed and (returncode != 0 or rec.result is None):
            why = (f"exited with status {_describe_rc(returncode)}" if returncode != 0
                   else "exited without reporting a result")
            self._fail(Failure(rank, f"rank {rank} {why}", "\n".join(rec.stderr_tail), False, time.time()))
        self._maybe_finish()

    def _fail(self, failure: Failure) -> None:
        with self._lock:
            if self._cancelled and not self._failures:
                return  # a consequence of cancel(): a peer saw a stopped rank's connection close
            self._failures.append(failure)
        threading.Thread(target=self._stop_all, name="hspmd-stop", daemon=True).start()

    def _stop_all(self) -> None:
        with self._lock:
            self._stopping = True
        for g in list(self._groups):
            g.kill()

    def _maybe_finish(self) -> None:
        with self._lock:
            if self._done.is_set() or any(rec.returncode is None for rec in self._ranks.values()):
                return
            self._status = (JobStatus.FAILED if self._failures else JobStatus.CANCELLED if self._cancelled
                            else JobStatus.SUCCEEDED)
            self._t1 = time.monotonic()
            for rec in self._ranks.values():
                rec.log.close()
            self._joblog.close()
        if self._progress is not None:
            self._progress.close(self._status.value)
        atexit.unregister(self._atexit)
        self.transport.close()
        self._done.set()

    # ---- outcome -------------------------------------------------------------------------------------------
    def _outcome(self) -> JobResult:
        if self._status is JobStatus.FAILED:
            raise self._failure_error()
        if self._status is JobStatus.CANCELLED:
            raise JobCancelled(f"job {self.job_id} was cancelled; logs in {self.log_dir}")
        return JobResult(job_id=self.job_id, results={r: rec.result or {} for r, rec in self._ranks.items()},
                         losses=self.metrics.losses(self.spec.loss_rank),
                         metrics={r: self.metrics.rank(r) for r in self.spec.ranks},
                         wall_time=(self._t1 or time.monotonic()) - self._t0, log_dir=self.log_dir,
                         emulation={int(r): float(k) for r, k in self.spec.slowdown.items()})

    def first_failure(self) -> Failure | None:
        """The failure that caused the others: a genuine error before connection errors, then the earliest."""
        with self._lock:
            return min(self._failures, key=Failure.sort_key, default=None)

    def _failure_error(self) -> RuntimeFailure:
        f = self.first_failure()
        assert f is not None
        others = sorted({g.rank for g in self._failures} - {f.rank})
        host = self._ranks[f.rank].host
        where = f"rank {f.rank}" + (f" on {host}" if host else "")
        text = (f"job {self.job_id} failed: {where}: {f.message}"
                + (f"\n(ranks {others} failed afterwards, most likely as a consequence)" if others else "")
                + f"\nAll workers were stopped. Full logs: {self.log_dir}/rank{f.rank}.log"
                + (f"\n--- traceback of rank {f.rank} ---\n{f.traceback.rstrip()}" if f.traceback else ""))
        return RuntimeFailure(text, rank=f.rank, traceback=f.traceback)

    def _kill_at_exit(self) -> None:
        if not self._done.is_set():
            self._stop_all()


def _describe_rc(rc: int) -> str:
    if rc < 0:
        try:
            return f"{rc} (killed by {signal.Signals(-rc).name})"
        except ValueError:
            return f"{rc} (killed by signal {-rc})"
    return str(rc)
