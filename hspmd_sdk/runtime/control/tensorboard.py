"""A running job's figures in TensorBoard (``launch(..., tensorboard=DIR)``), written by the launcher as the
workers report them: no worker writes anything, and a job without TensorBoard pays nothing.

Scalars, by step: ``loss`` (the step's loss, once; with it ``grad_norm`` — the global norm before clipping —,
``lr`` and, on validation steps, ``val_loss``), ``tokens_per_s`` (the step's tokens over its slowest rank's
time: a training job's global batch times its sequence length, or the lengths dispatched), ``step_time/rank<r>``
and ``memory_mb/rank<r>`` (each rank's step time and peak memory); text ``events``: every failure and
reconfiguration (``Job.failures``, ``Job.events``) as it is known; text ``job``: the job at its start, and its
outcome at its end (``Job.status_text``: ``succeeded``, ``stopped at step N``, ...).  Read them with
``tensorboard --logdir DIR`` or :class:`tensorboard.backend.event_processing.event_accumulator.EventAccumulator`.
Needs the ``tensorboard`` package (``pip install tensorboard``); without it, ``launch`` refuses the option before
any worker starts.
"""
from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import HSPMDError
from ..metrics import StepMetrics

if TYPE_CHECKING:
    from .job import Job

__all__ = ["TensorBoardLogger", "check_tensorboard", "check_tensorboard_dir"]


def check_tensorboard() -> None:
    """Raise :class:`~hspmd_sdk.errors.HSPMDError` naming the package when TensorBoard's writer cannot load."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        raise HSPMDError(f"tensorboard=: TensorBoard's writer does not load ({e}); pip install tensorboard") from None


def check_tensorboard_dir(path: str | Path) -> Path:
    """The folder ``launch(..., tensorboard=path)`` writes to, created if need be and proven writable (a file
    written and removed there); else :class:`~hspmd_sdk.errors.HSPMDError` naming ``tensorboard``, before any worker
    starts (TensorBoard's writer would fail only once the workers run, with a bare ``FileNotFoundError``)."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hspmd-write-check-"):
            pass
    except OSError as e:
        raise HSPMDError(f"tensorboard={str(path)!r}: cannot write TensorBoard's files there "
                         f"({e.strerror or type(e).__name__}: {e.filename or folder}); pass tensorboard= a writable "
                         "folder. Nothing was started.") from None
    return folder


class TensorBoardLogger:
    """Writes ``job``'s metrics and events under ``log_dir`` (see the module docstring); closes with the job."""

    def __init__(self, job: "Job", log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.job, self.log_dir = job, Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self._lock = threading.Lock()
        self._slowest: dict[int, float] = {}  # step -> its slowest rank's time so far
        self._reporters: dict[int, set[int]] = {}  # step -> the ranks whose step time arrived
        self._rated: set[int] = set()          # steps whose tokens/s is written
        self._losses: set[int] = set()         # steps whose loss is written
        self._told = 0  # events and failures written so far
        self._closed = False
        self.writer.add_text("job", f"job {job.job_id}: {job.spec.world_size} ranks, {job.spec.steps} steps; logs in "
                                    f"{job.log_dir}", 0)
        self._seen: set[tuple[int, int]] = set()  # (rank, step) written
        job.on_message("metric", self._on_metric)
        for rank in job.spec.ranks:  # what arrived before this logger was attached
            for m in job.metrics.rank(rank):
                self._on_metric(rank, m.to_message())
        job.on_finish(lambda _job: self.close())

    def _on_metric(self, rank: int, msg: dict[str, Any]) -> None:
        m = StepMetrics.from_message(msg | {"rank": rank})
        with self._lock:
            if self._closed or (rank, m.step) in self._seen:
                return
            self._seen.add((rank, m.step))
            w = self.writer
            if m.step_time is not None:
                w.add_scalar(f"step_time/rank{rank}", m.step_time, m.step)
                self._slowest[m.step] = max(self._slowest.get(m.step, 0.0), float(m.step_time))
                self._reporters.setdefault(m.step, set()).add(rank)
            if m.memory_mb is not None:
                w.add_scalar(f"memory_mb/rank{rank}", m.memory_mb, m.step)
            want = self.job.spec.loss_rank  # by default every rank reports the step's agreed loss: the first one
            if m.loss is not None and m.step not in self._losses and (want is None or rank == want):
                self._losses.add(m.step)
                w.add_scalar("loss", m.loss, m.step)
                for tag, value in (("grad_norm", m.grad_norm), ("lr", m.lr), ("val_loss", m.val_loss)):
                    if value is not None:  # what every rank reports alike, written with the step's loss
                        w.add_scalar(tag, value, m.step)
            self._write_throughput(complete=True)
            self._write_events(m.step)

    def _step_tokens(self, step: int) -> int | None:
        """The tokens of one step of a training job: its global batch times the sequence length, or (mixed-length
        data) the lengths the launcher dispatched for it; ``None`` for another entry."""
        planner = getattr(self.job, "length_planner", None)
        if planner is not None:
            return next((sum(r["lengths"]) for r in planner.records if r["step"] == step), None)
        ctl = getattr(self.job, "controller", None)
        return ctl.global_batch * ctl.seq_len if ctl is not None else None

    def _awaited(self, step: int) -> set[int]:
        """The ranks whose time of ``step`` must arrive before its tokens/s is written: those that reported the step
        before (every rank of the job for the first), less the ranks the job no longer runs (lost or retired).
        Each rank's reports arrive in order, but not in step with the other ranks'."""
        before = self._reporters.get(step - 1)
        ranks = set(before) if before is not None else set(self.job.spec.ranks)
        alive = getattr(getattr(self.job, "controller", None), "alive", None)
        return ranks & set(alive) if alive is not None else ranks

    def _write_throughput(self, complete: bool = False) -> None:
        """Write tokens/s of the steps not yet rated, in step order; ``complete``: only while each step's awaited
        ranks have all reported (the job's end writes the rest with what arrived)."""
        for step in sorted(k for k in self._slowest if k not in self._rated):
            if complete and not self._awaited(step) <= self._reporters.get(step, set()):
                return  # later steps wait too: a step's awaited ranks are its predecessor's
            tokens = self._step_tokens(step)
            if tokens and self._slowest[step] > 0:
                self.writer.add_scalar("tokens_per_s", tokens / self._slowest[step], step)
            self._rated.add(step)

    def _write_events(self, step: int) -> None:
        happened = [f"failure: {f}" for f in self.job.failures] + [f"reconfiguration: {e}" for e in self.job.events]
        for text in happened[self._told:]:
            self.writer.add_text("events", text, step)
        self._told = max(self._told, len(happened))

    def close(self) -> None:
        """Write what is left (the events of the job's end) and close the files.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._write_throughput()
            last = max(self._slowest, default=0)
            self._write_events(last)
            status = getattr(self.job, "status_text", None)  # "succeeded", "stopped at step N", ...
            if status is not None:
                self.writer.add_text("job", f"job {self.job.job_id}: {status}", last)
            self._closed = True
            self.writer.close()
