"""The job's log files (:class:`JobLogs`): ``log_dir/rank{R}.log`` per rank, ``log_dir/job.log`` with every line
prefixed by its rank, ``log_dir/metrics.jsonl``.  Writing them is a convenience: when the disk fails (full,
read-only) the logs warn once and stay in memory only (``Job.logs(rank)``)."""
from __future__ import annotations

import json
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any, Sequence

from ...errors import HSPMDError

__all__ = ["JobLogs", "LogDirError", "OPEN_RANK_LOGS", "FLUSH_S"]


class LogDirError(HSPMDError):
    """The job's log folder cannot be created or written; nothing was started."""


#: Rank log files a job keeps open at once, and how often a rank's lines are written to its file (:class:`JobLogs`).
OPEN_RANK_LOGS = 64
FLUSH_S = 0.5


class JobLogs:
    """The job's log files; a failed write (disk full, read-only) warns once and the logs stay in memory.

    Every rank has its file (``rank<r>.log``, made at the start).  A rank's lines are written to it in batches,
    every :data:`FLUSH_S` seconds (by a thread of its own) and when the logs close, and at most
    :data:`OPEN_RANK_LOGS` rank files are open at once (the most recently written; another is reopened to
    append): a job of thousands of ranks holds a bounded number of file descriptors (with one open file a rank,
    1,024 ranks put the launcher's descriptors past what ``select()`` takes, which the planners' solvers use while
    a recovery replans) and opens each file at most once a batch, not once a line.  ``job.log`` is written at once.

    Reader threads of every rank write here at once: one lock, so a failure closing the files never meets a
    write in progress (and warns once)."""

    def __init__(self, log_dir: Path, ranks: Sequence[int], job_id: str) -> None:
        self.dir, self.job_id = log_dir, job_id
        self.broken: str | None = None
        self._files: dict[int | str | None, IO[str]] = {}
        self._open: OrderedDict[int, IO[str]] = OrderedDict()  # the rank logs open now, least recent first
        self._pending: dict[int, list[str]] = {}  # rank -> lines not written to its file yet
        self._lock = threading.RLock()
        self._closed = threading.Event()
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            self._files[None] = open(log_dir / "job.log", "w", buffering=1)
            self._create(ranks)
        except OSError as e:
            self.close()
            raise LogDirError(f"cannot write the job's logs in {log_dir}: {e.strerror or e}; pass log_dir= (CLI: "
                              "--log-dir) a writable folder. Nothing was started.") from None
        threading.Thread(target=self._flusher, name=f"hspmd-logs-{job_id}", daemon=True).start()

    def _create(self, ranks: Sequence[int]) -> None:
        for r in ranks:
            (self.dir / f"rank{r}.log").write_text("")

    def add(self, ranks: Sequence[int]) -> None:
        """Log files for ranks that joined the job (``Job.grow``)."""
        with self._lock:
            if self.broken is not None or not self._files:
                return
            try:
                self._create(ranks)
            except OSError as e:
                self._fail(e)

    def write(self, rank: int | None, text: str) -> None:
        """A line of ``rank``'s log (and the job's); ``rank=None``: the job's own line, in job.log only."""
        with self._lock:
            if self.broken is not None or not self._files:
                return
            try:
                if rank is None:
                    self._files[None].write(f"[job] {text}\n")
                    return
                self._pending.setdefault(rank, []).append(text + "\n")
                self._files[None].write(f"[rank {rank}] {text}\n")
            except (OSError, ValueError) as e:  # ValueError: written after close
                self._fail(e)

    def flush(self) -> None:
        """Write every rank's pending lines to its file."""
        with self._lock:
            pending, self._pending = self._pending, {}
            if self.broken is not None or not self._files:
                return
            try:
                for rank, lines in pending.items():
                    f = self._rank_file(rank)
                    f.write("".join(lines))
                    f.flush()  # on disk now (a full disk fails here, not silently at close)
            except (OSError, ValueError) as e:
                self._fail(e)

    def _rank_file(self, rank: int) -> IO[str]:
        f = self._open.get(rank)
        if f is not None:
            self._open.move_to_end(rank)
            return f
        if len(self._open) >= OPEN_RANK_LOGS:
            self._open.popitem(last=False)[1].close()
        f = self._open[rank] = open(self.dir / f"rank{rank}.log", "a")
        return f

    def _flusher(self) -> None:
        while not self._closed.wait(FLUSH_S):
            self.flush()

    def metric(self, record: dict[str, Any]) -> None:
        """One step's metrics of one rank as a line of ``metrics.jsonl`` (every job keeps one)."""
        with self._lock:
            if self.broken is not None or not self._files:
                return
            try:
                if "metrics" not in self._files:
                    self._files["metrics"] = open(self.dir / "metrics.jsonl", "w", buffering=1)
                self._files["metrics"].write(json.dumps(record) + "\n")
            except (OSError, ValueError) as e:
                self._fail(e)

    def _fail(self, e: BaseException) -> None:
        self.broken = getattr(e, "strerror", None) or str(e)
        warnings.warn(f"job {self.job_id}: cannot write its logs in {self.dir} ({self.broken}); from now on the "
                      "logs are kept in memory only (job.logs(rank)); the job goes on", RuntimeWarning,
                      stacklevel=2)
        self.close()

    def close(self) -> None:
        self.flush()
        self._closed.set()
        with self._lock:
            files, self._files = [*self._files.values(), *self._open.values()], {}
            self._open.clear()
        for f in files:
            try:
                f.close()
            except OSError:
                pass  # the last buffered line could not be written: the disk is full; the job is not affected
