"""What a job is and returns: its status (:class:`JobStatus`), its result (:class:`JobResult`), the exception of a
cancelled job (:class:`JobCancelled`) and where its start-up went (:class:`StartupTimes` over
:data:`STARTUP_PHASES`).  Plain values; :mod:`.job` re-exports each of them."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import RuntimeFailure
from .faults import Failure
from ..metrics import StepMetrics

__all__ = ["JobStatus", "JobCancelled", "JobResult", "STARTUP_PHASES", "StartupTimes"]


class JobStatus(str, enum.Enum):
    """Where a job is.  ``STOPPED``: :meth:`Job.stop` ended it early, gracefully, at a step boundary (its result has
    the losses of the steps done, ``JobResult.stopped_at`` of them; :attr:`Job.status_text` says ``stopped at step
    N``); a stop that came too late to end it early leaves it ``SUCCEEDED``."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    STOPPED = "stopped"
    FAILED = "failed"
    CANCELLED = "cancelled"


class JobCancelled(RuntimeFailure):
    """The job was cancelled (``Job.cancel()`` or an interrupt) before it finished."""


@dataclass
class JobResult:
    """What a finished job returns.

    ``losses``: per-step losses of the loss rank, ordered by step; ``grad_norms`` and ``lrs``: per step, the
    gradient's global norm before clipping and the learning rate (training jobs); ``val_losses``: step -> the
    validation loss at its end (``eval_every``); ``results``: each rank's entry return value;
    ``metrics``: every rank's step metrics; ``emulation``: ranks whose speed was emulated (rank -> factor);
    ``failures``: failures the job's policy let it survive (empty under the default policy); ``events``: every
    reconfiguration (``Job.switch``, an elastic recovery, a straggler, a length switch; SPEC §6).
    """

    job_id: str
    results: dict[int, dict[str, Any]]
    losses: list[float]
    metrics: dict[int, list[StepMetrics]]
    wall_time: float
    log_dir: Path
    emulation: dict[int, float] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    stopped_at: int | None = None  # the steps done when ``Job.stop()`` ended the job early
    grad_norms: list[float] = field(default_factory=list)  # per step: the gradient's global norm before clipping
    lrs: list[float] = field(default_factory=list)          # per step: the learning rate of its update
    val_losses: dict[int, float] = field(default_factory=dict)  # validation step -> validation loss

    def step_times(self, rank: int) -> list[float]:
        return [m.step_time for m in self.metrics.get(rank, []) if m.step_time is not None]



#: The start-up of a worker, in order: (phase, the milestone that ends it).  ``spawned``: the launcher started the
#: process; ``hello``: its first line (Python and the worker module loaded); ``imported``: torch and the entry's
#: modules imported; ``ready``: the process group formed (rendezvous); ``built``: a training run's Program,
#: executor and state built; ``first_step``: its first step's metrics arrived.
STARTUP_PHASES = (("processes", "hello"), ("imports", "imported"), ("rendezvous", "ready"),
                  ("build", "built"), ("first step", "first_step"))


@dataclass
class StartupTimes:
    """Where the time from ``launch()`` to the first step went (:meth:`Job.startup`), as the launcher saw it
    (receipt times of the workers' messages: no other host's clock is trusted).

    ``prepare_s``: the launcher's own work before any process started (option checks, specialization, resource
    preflight; ``None`` when the job was started without it); ``phases``: seconds of each phase of
    :data:`STARTUP_PHASES` on the job's critical path (until the last rank reached the milestone ending it;
    ``None`` for a milestone no rank reported yet); ``per_rank``: each rank's seconds from its spawn to each
    milestone it reached; ``total_s``: ``prepare_s`` plus every phase measured."""

    prepare_s: float | None
    phases: dict[str, float | None]
    per_rank: dict[int, dict[str, float]]

    @property
    def total_s(self) -> float:
        return (self.prepare_s or 0.0) + sum(v for v in self.phases.values() if v is not None)

    def __str__(self) -> str:
        parts = ([f"prepare {self.prepare_s:.2f} s"] if self.prepare_s is not None else []) + [
            f"{name} {sec:.2f} s" for name, sec in self.phases.items() if sec is not None]
        return f"launch to first step {self.total_s:.2f} s: " + ", ".join(parts)
