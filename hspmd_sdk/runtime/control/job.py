"""A running job: its workers' streams, logs, metrics, fault detection and result.

Background threads (the transport's) deliver every worker line to :meth:`Job._on_line`; the job keeps per-rank
logs (in memory and in ``log_dir/rank{R}.log``, plus ``log_dir/job.log`` with every line prefixed by its rank),
metrics and results.  Writing the log files is a convenience: when the disk fails (full, read-only) the job warns
once and keeps the logs in memory, and its outcome is the true one.

A watchdog thread (:mod:`.watchdog`) turns silence into failures (:mod:`.faults`): a rank not heard for
``spec.silent_s`` seconds (stopped, frozen), a rank that stayed out of communication for ``spec.stall_s`` seconds
while peers waited in communication for it (both ``hung``, with the rank's stack from faulthandler), a host whose
agent or connection went quiet (``connection lost``, with the ranks it carried).  Each failure goes to the job's
policy; the default stops every worker at once and :meth:`Job.wait` raises :class:`~hspmd_sdk.errors.RuntimeFailure`
for the *first* failing rank: a genuine error wins over the connection errors its peers raise afterwards, then the
earliest.

The launcher -> worker direction is a channel too: :meth:`Job.send_control` queues a JSON message for all or some
ranks (``WorkerState.poll_control()`` on the worker side), relayed by the agent over SSH.

What the launcher's other modules use of a job is public (issue 47): :attr:`Job.ended` / :meth:`Job.wait_ended`,
:meth:`Job.note`, :meth:`Job.send_control`, :meth:`Job.report_failure`, and :meth:`Job.use_controller` to hand a
training job its controller (and a mixed-length job its dispatch).
"""
from __future__ import annotations

import atexit
import enum
import json
import sys
import tempfile
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Sequence

from ...errors import HSPMDError, RuntimeFailure, SwitchError
from .faults import Failure, FailurePolicy, Reaction, StopOnFailure, describe_returncode
from ..metrics import MetricsHistory, StepMetrics
from .progress import Progress, format_rate, in_notebook, make_progress, step_rates, step_tokens
from .watchdog import Liveness, Watchdog
from ..protocol import decode
from ..spec import LaunchSpec
from ..transports.transport import Transport, WorkerGroup
from ..trace import merge

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.specialize import Program
    from ...core.strategy import Strategy
    from .state import Event
    from .timeline import Timeline

__all__ = ["Job", "JobResult", "JobStatus", "JobCancelled", "Failure", "LogDirError"]

#: How many stderr lines of a rank that died without a traceback are quoted in the error.
TAIL_LINES = 30


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


class LogDirError(HSPMDError):
    """The job's log folder cannot be created or written; nothing was started."""


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


@dataclass
class _Rank(Liveness):
    """What the job keeps of a rank: its lines, result, start-up phases, and its life (:class:`~.watchdog.Liveness`:
    what the watchdog reads)."""

    lines: list[str] = field(default_factory=list)
    stderr_tail: list[str] = field(default_factory=list)
    pid: int | None = None
    host: str | None = None
    result: dict[str, Any] | None = None
    phases: dict[str, float] = field(default_factory=dict)  # start-up milestone -> monotonic receipt time


#: Rank log files a job keeps open at once, and how often a rank's lines are written to its file (:class:`_Logs`).
OPEN_RANK_LOGS = 64
FLUSH_S = 0.5


class _Logs:
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


class Job:
    """Workers running one :class:`LaunchSpec`; create with :func:`hspmd_sdk.runtime.launch_spec`.

    ``status``, ``logs(rank)``, ``metrics``, ``log_dir``, ``failures``, ``wait(timeout)``, ``cancel()``,
    ``stop_ranks(ranks)``; for tests that race a request against the running job, ``wait_held(step)`` and
    ``release(step)`` (``hold_at=``: every worker waits at the start of those steps until released).  Usable as a
    context manager: leaving the block cancels a job that is still running.
    ``policy``: what to do about a failure (:mod:`.faults`; default :class:`~.faults.StopOnFailure`).
    """

    def __init__(self, spec: LaunchSpec, hosts: dict[str, list[int]], transport: Transport, *,
                 log_dir: str | Path | None = None, progress: bool | None = None,
                 echo: Callable[[str], None] | None = None, policy: FailurePolicy | None = None) -> None:
        self.spec = spec
        self._data_label = self.data  # named on every progress line: random tokens must not pass for a trainer
        self.transport = transport
        self.policy: FailurePolicy = policy or StopOnFailure()
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"hspmd-{spec.job_id}-"))
        self._logs = _Logs(self.log_dir, spec.ranks, spec.job_id)
        self.metrics = MetricsHistory()
        self._hosts = hosts
        self._echo = echo
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._status = JobStatus.STARTING
        self._ranks = {r: _Rank() for r in spec.ranks}
        self._failures: list[Failure] = []  # what fails the job: the failure that stopped it and what followed
        self._absorbed: list[Failure] = []  # what the policy let the job survive
        self._lost_hosts: set[str] = set()
        self._stopping = False
        self._cancelled = False
        self._groups: list[WorkerGroup] = []
        self._t0 = time.monotonic()
        self._t1: float | None = None
        if progress is None:  # by default where someone watches: a notebook, or a terminal
            progress = in_notebook() or bool(getattr(sys.stderr, "isatty", lambda: False)())
        self._progress: Progress | None = make_progress(spec.steps, f"job {spec.job_id}") if progress else None
        self.prepared_s: float | None = None  #: the launcher's seconds before the workers started (:meth:`startup`)
        self._observers: dict[str, list[Callable[[int, dict[str, Any]], None]]] = {}
        self._recorded: dict[int, dict[int, dict[str, Any]]] = {}  # launch rank -> step -> profiled spans (.trace)
        self._finish_hooks: list[Callable[["Job"], None]] | None = []  # None once they ran (on_finish)
        self.notes: list[str] = []  #: the job's own messages (reconfigurations), also in job.log
        self.controller: Any = None  #: the :class:`~.controller.TrainingController` of a training job
        self.length_planner: Any = None  #: the :class:`~.mixed.LengthPlanner` of a mixed-length job (its dispatch)
        # holds at step boundaries (hold_at=, a test hook): step -> launch rank -> what it reported heard there
        self._held: dict[int, dict[int, dict[str, Any]]] = {}
        self._released: set[int] = set()
        self._newcomers: set[int] = set()  # started by a grow, not in the world yet (until they report switched)
        self._watchdog = Watchdog(lambda: self.spec, self._ranks, self._lock, self._groups, ended=self._done,
                                  stopping=lambda: self._stopping, host_lost=self._host_lost, hung=self._hung)
        self._atexit = self._kill_at_exit
        atexit.register(self._atexit)

    # ---- public --------------------------------------------------------------------------------------------
    @property
    def status(self) -> JobStatus:
        return self._status

    @property
    def status_text(self) -> str:
        """The status for people: its value (``running``, ``succeeded``, ...), ``stopped at step N`` for a job that
        :meth:`stop` ended after its N-th step."""
        if self._status is JobStatus.STOPPED:
            return f"stopped at step {self._stopped_at()}"
        return self._status.value

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def started_at(self) -> float:
        """When the job started (``time.monotonic()``'s clock)."""
        return self._t0

    @property
    def elapsed_s(self) -> float:
        """Seconds since the job started, up to its end once it ended (read-only; for displays)."""
        return (self._t1 if self._t1 is not None else time.monotonic()) - self._t0

    @property
    def failures(self) -> list[Failure]:
        """Every failure detected so far (those the policy let the job survive, then those that failed it)."""
        with self._lock:
            return [*self._absorbed, *self._failures]

    @property
    def ended(self) -> bool:
        """Whether the job has ended: every worker exited and its outcome is decided (:meth:`wait` returns at
        once)."""
        return self._done.is_set()

    def wait_ended(self, timeout: float | None = None) -> bool:
        """Block until the job ends or ``timeout`` seconds pass; returns :attr:`ended`.  Unlike :meth:`wait` it
        neither raises nor cancels: for the launcher's own threads that pace themselves on the job."""
        return self._done.wait(timeout)

    def note(self, text: str) -> None:
        """A line of the job's own (a reconfiguration, a grow back): ``job.log``, :attr:`notes`, the echo and the
        progress line."""
        self._note(text)

    def report_failure(self, failure: Failure) -> None:
        """A failure found by the launcher's own machinery (the mixed-length dispatch, an elastic recovery): it
        goes to the job's policy as one the job detected itself."""
        self._fail(failure)

    def use_controller(self, controller: Any, *, length_planner: Any = None) -> None:
        """Hand a training job its :class:`~.controller.TrainingController` (and a mixed-length job its
        :class:`~.mixed.LengthPlanner`), once, right after its workers started; the controller attaches itself
        to the job's messages (``controller.attach(job)``).  ``RuntimeError`` for a second controller."""
        if self.controller is not None:
            raise RuntimeError(f"job {self.job_id} has a controller already")
        self.controller, self.length_planner = controller, length_planner
        controller.attach(self)

    def logs(self, rank: int) -> str:
        """Everything rank ``rank`` printed or logged so far, one line a line."""
        if rank not in self._ranks:
            raise KeyError(f"rank {rank} is not in job {self.job_id} (ranks 0..{self.spec.world_size - 1})")
        with self._lock:
            return "\n".join(self._ranks[rank].lines)

    def pids(self, *, include_lost: bool = False) -> dict[int, int]:
        """Rank -> process id on its host (as the transport started it), for the ranks whose process runs or ran to
        its end: a rank lost on the way (killed, crashed, stopped as hung) is not listed unless ``include_lost``."""
        out: dict[int, int] = {}
        for g in list(self._groups):
            out.update(g.pids())
        if include_lost:
            return out
        with self._lock:
            lost = {r for r, rec in self._ranks.items() if rec.returncode not in (None, 0)}
        return {r: p for r, p in out.items() if r not in lost}

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

    def stop(self) -> None:
        """End a training job gracefully: every worker finishes the step it is in, the job ends after the first
        step whose commit carries the request (all ranks at once; the step's checkpoint, if any, is the last),
        and ``wait()`` returns the losses of the steps done (``JobResult.stopped_at``: how many).  A job that
        runs some other entry (no step boundary to stop at) is cancelled instead (:meth:`cancel`)."""
        with self._lock:
            if self._done.is_set():
                return
            ranks = [r for r, rec in self._ranks.items() if rec.returncode is None]
        if self.controller is None:
            self.cancel()
            return
        self._note("stop requested: the job ends after the step in progress")
        self._send_control({"type": "stop"}, ranks)

    # ---- holds at step boundaries (hold_at=, a test hook) -----------------------------------------------------
    def release(self, step: int) -> None:
        """End the hold at the start of job step ``step`` (``hold_at=[step, ...]``, a test hook): every worker
        waiting there goes on, and a worker that reaches ``step`` later (a newcomer, or again after a recovery)
        does not wait there.  A request made while every rank was held (``switch``, ``grow`` once
        :meth:`wait_held` ``(heard=event)`` returned, ``stop``; in the order they were made, each before this call)
        is heard by every rank at step ``step``'s commit: a switch or grow then lands at the boundary before step
        ``step + 1``, a stop ends the job after step ``step``.  Idempotent; never blocks.  ``ValueError`` for a step
        the job does not hold at."""
        step = self._hold_step(step)
        with self._lock:
            self._released.add(step)
            ranks = [r for r, rec in self._ranks.items() if rec.returncode is None]
        self._send_control({"type": "release", "step": step}, ranks)

    def held(self, step: int) -> list[int]:
        """The launch ranks waiting now at the start of job step ``step`` (``hold_at=``; empty once released)."""
        step = self._hold_step(step)
        with self._lock:
            if step in self._released:
                return []
            return sorted(r for r in self._held.get(step, {}) if self._ranks[r].returncode is None)

    def wait_held(self, step: int, timeout: float | None = None, *, heard: "Event | None" = None) -> list[int]:
        """Block until every rank of the running world (the job's current world less its lost ranks and the
        newcomers of a grow that have not joined it yet) waits at the start of job step ``step`` (``hold_at=``);
        returns those launch ranks.  ``heard``: an :class:`~.controller.Event` of ``switch`` or ``grow``: wait also
        until every one of them has received its switch message (a grow sends it once its newcomers are ready).

        ``timeout`` seconds (default: the job's ``timeout_s``): ``TimeoutError`` naming the ranks not held.
        :class:`~hspmd_sdk.errors.RuntimeFailure` when the job ends first, the hold was already released, or the
        event was given up (``superseded``; :attr:`notes` says why)."""
        step = self._hold_step(step)
        limit = float(self.spec.timeout_s if timeout is None else timeout)
        deadline = time.monotonic() + limit
        while True:
            if heard is not None and heard.superseded:
                raise RuntimeFailure(f"job {self.job_id}: the {heard.reason} awaited at step {step} was given up: "
                                     + "; ".join(self.notes[-2:]))
            ident = None if heard is None or heard.version is None else int(heard.version[1])
            world = self._world()
            with self._lock:
                got = dict(self._held.get(step, {}))
                released = step in self._released
            waiting = [r for r in world if r not in got or (heard is not None and (
                ident is None or int(got[r].get("switch", 0)) < ident))]
            if world and not waiting:
                return world
            if released:
                raise RuntimeFailure(f"job {self.job_id}: the hold at step {step} was released already")
            if self._done.is_set():
                raise RuntimeFailure(f"job {self.job_id} ended ({self.status_text}) before every rank was held at "
                                     f"step {step} (ranks {waiting} were not); logs in {self.log_dir}")
            if time.monotonic() > deadline:
                what = "" if heard is None else f" having heard the {heard.reason} of step {heard.step}"
                raise TimeoutError(f"job {self.job_id}: ranks {waiting} were not held at step {step}{what} within "
                                   f"{limit:g} s (held: {sorted(got)})")
            time.sleep(0.01)

    def _hold_step(self, step: int) -> int:
        """``step`` if the job holds at it (``hold_at=``), else ``ValueError``."""
        holds = {int(s) for run in self.spec.payload.get("runs") or () if isinstance(run, dict)
                 for s in run.get("holds") or ()}
        if isinstance(step, bool) or not isinstance(step, int) or step not in holds:
            raise ValueError(f"job {self.job_id} holds at steps {sorted(holds)} (hold_at=), not at {step!r}")
        return step

    def _world(self) -> list[int]:
        """The launch ranks that run the job's steps now: the controller's current world less its lost ranks
        (without a controller: every running rank), less the newcomers of a grow that have not joined yet."""
        alive = set(self.controller.alive) if self.controller is not None else None
        with self._lock:
            running = {r for r, rec in self._ranks.items() if rec.returncode is None}
            return sorted((running if alive is None else running & alive) - self._newcomers)

    def stop_ranks(self, ranks: Sequence[int], grace_s: float = 0.5) -> None:
        """Stop the workers of ``ranks`` only (for a policy that lets the others go on); their exits are not
        failures."""
        wanted = {int(r) for r in ranks}
        for g in list(self._groups):
            mine = [r for r in g.ranks if r in wanted]
            if mine:
                g.kill(grace_s, ranks=mine)

    # ---- graph switching (a training job's controller) -----------------------------------------------------
    def switch(self, program_or_strategy: "Program | Strategy | Sequence[Program | Strategy]") -> "Event":
        """Move the running job to a Program or a Strategy at the next step boundary (SPEC §6, §9): every
        parameter and Adam moment moves by one fused BSR, no process restarts, training goes on at the same step.

        A :class:`~hspmd_sdk.core.specialize.Program` trains the same model on ranks the job runs
        (``job.cluster``).  A :class:`~hspmd_sdk.core.strategy.Strategy` is specialized here for the job's model
        on its current cluster (``job.cluster``: after an elastic recovery, the survivors' numbering) with the
        running Program's bindings (the global batch stays).  Anything else raises
        :class:`~.controller.SwitchError` naming its type.  Called while the job reconfigures itself after a
        failure, it waits for that to finish first.  Returns the :class:`~.controller.Event`; it is ``done`` once
        every worker switched.

        A job training on mixed-length data (launched with a list of candidates) takes a list, as ``launch``
        does: ``job.switch([program_or_strategy, ...])`` (SPEC §9).  From the first step not dispatched yet
        (the launcher dispatches up to ``lookahead`` steps ahead of the workers) the dispatcher chooses among the
        new candidates, and the workers move from the running candidate to the chosen one by one fused BSR at that
        step boundary (``Event.reason == "user"``); the global batch and the data order stay, so the losses stay
        the single-device reference's.  The list is checked before anything changes: a
        :class:`~.controller.SwitchError` names an empty list, an entry that is not a Program or Strategy,
        another model, ranks the job does not run (or lost), a ZeRO-3 candidate, candidates whose longest
        sequence is shorter than the data's context, and a job whose every remaining step is dispatched already.
        A single Program or Strategy is refused for a mixed-length job (pass a one-element list), and a list for
        a job that trains one Program.  With ``elastic=True``, a failure before the first step under the new
        candidates committed recovers from the state held before the switch (as for one Program: the event is
        then ``superseded`` unless every survivor had switched)."""
        # lazy: core, loaded only to switch (the launcher imports job without loading core)
        from ...core.specialize import Program, specialize
        from ...core.strategy import Strategy
        from ...core.strategy_plan import plan_from_strategy

        if self.controller is None:
            raise RuntimeFailure(f"job {self.job_id} runs an entry that cannot switch plans (only training jobs "
                                 "launched with hspmd_sdk.launch can)")
        if self._done.is_set():
            raise RuntimeFailure(f"job {self.job_id} has finished ({self.status.value}); there is nothing to switch")
        target = program_or_strategy
        if isinstance(target, (list, tuple)):  # a mixed-length job's new candidates
            return self.controller.switch_candidates(list(target))
        if not isinstance(target, (Program, Strategy)):
            raise SwitchError(f"job.switch takes a Program or a Strategy, not {type(target).__name__} "
                              f"({target!r:.80}); specialize(model, plan, cluster) gives a Program, "
                              "Strategy.load(...) a Strategy")
        if isinstance(target, Strategy) and not getattr(self.controller, "mixed", False):
            running, cluster = self.controller.program, self.controller.cluster
            model = running.model
            target = specialize(model, plan_from_strategy(model, target, cluster), cluster,
                                bindings=dict(running.bindings))
        return self.controller.switch(target)

    def grow(self, cluster: "Cluster", program: "Program | Strategy | None" = None) -> "Event":
        """Grow the running job onto ``cluster`` in memory (SPEC §10): ``cluster`` is ``job.cluster`` (the ranks
        it runs on now, in the same order) plus new ranks; one worker is started per new rank, the job trains on
        while they start, and at the first step boundary after every one is ready all workers meet in the larger
        world and the job switches to ``program`` (a Program on
        ``cluster`` or a Strategy; default: the planner's plan for ``cluster``) by one fused BSR that gives the
        new workers their parameters and Adam moments.  Training goes on at the same step with the same losses.
        Returns the :class:`~.controller.Event` (``reason="grow"``) at once; it is ``done`` once every worker
        switched, ``superseded`` if the grow was given up (a newcomer lost while starting, the job reconfigured or
        ended first: :attr:`notes` says why).  Not for mixed-length jobs yet (:mod:`.grow`)."""
        from .grow import grow_job  # lazy: core (grow): the launcher imports job without loading core

        return grow_job(self, cluster, program)

    def launch_ranks(self) -> list[int]:
        """Every launch rank the job has started a worker for (live or not), ascending."""
        with self._lock:
            return sorted(self._ranks)

    def reached(self, ranks: Sequence[int], phase: str) -> bool:
        """Whether every worker of ``ranks`` (launch ranks) has reported start-up ``phase`` (``"built"``...)."""
        with self._lock:
            return all(phase in self._ranks[r].phases for r in ranks)

    def exited(self, ranks: Sequence[int]) -> bool:
        """Whether the worker process of every one of ``ranks`` (launch ranks) has exited."""
        with self._lock:
            return all(self._ranks[r].returncode is not None for r in ranks)

    def suspects(self) -> set[int]:
        """The launch ranks the watchdog is reporting as silent now (its ``suspect`` state)."""
        with self._lock:
            return {r for r, rec in self._ranks.items() if rec.suspect}

    def add_workers(self, spec: LaunchSpec, joiners: dict[int, int]) -> None:
        """Start a newcomer per launch rank in ``joiners.values()`` (``spec``: the grown job's spec)."""
        new = sorted(joiners.values())
        hosts: dict[str, list[int]] = {}
        for r in new:
            hosts.setdefault(spec.hosts[r], []).append(r)
        with self._lock:
            self.spec = spec
            now = time.monotonic()
            for r in new:
                self._ranks[r] = _Rank(started=now)
                self._ranks[r].phases["spawned"] = now
                self._hosts.setdefault(spec.hosts[r], []).append(r)
            self._logs.add(new)
            self._newcomers.update(new)
            released = sorted(self._released)
        joining = spec.model_copy(update={"joining": True})
        for host, ranks in hosts.items():
            group = self.transport.start(host, ranks, joining, self._on_line, self._on_exit)
            with self._lock:
                self._groups.append(group)
        for step in released:  # the holds released before they came: a newcomer never waits at one
            self._send_control({"type": "release", "step": step}, new)

    @property
    def events(self) -> list["Event"]:
        """Every reconfiguration so far (:class:`~.controller.Event`; live)."""
        return list(self.controller.events) if self.controller is not None else []

    @property
    def program(self) -> "Program | None":
        """The Program the job runs now (``None`` for a job that does not train one)."""
        return self.controller.program if self.controller is not None else None

    @property
    def cluster(self) -> "Cluster | None":
        """The cluster the job runs on now (after an elastic recovery: the survivors, renumbered)."""
        return self.controller.cluster if self.controller is not None else None

    @property
    def data(self) -> str | None:
        """What the job trains on, in a few words (``"stdlib source (bytes)"``, ``"synthetic random tokens ..."``,
        ``"corpus NAME"``): shown by the progress line and the dashboard; ``None`` for a job that does not train."""
        runs = [r for r in self.spec.payload.get("runs") or () if isinstance(r, dict) and "data" in r]
        if not runs:
            return None
        from ..data import describe_data  # lazy: numpy/torch (data); the launcher imports job without them

        return describe_data(runs[0]["data"])

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

    def dashboard(self, **kwargs: Any) -> Any:
        """Gone: the runtime draws no widgets.  The dashboard is ``hspmd_sdk.viz.JobDashboard(job)``."""
        raise AttributeError("Job.dashboard() is gone (the runtime imports nothing of the notebook widgets): "
                             "use `from hspmd_sdk.viz import JobDashboard` and `JobDashboard(job)`")

    def on_message(self, kind: str, fn: Callable[[int, dict[str, Any]], None]) -> None:
        """Call ``fn(rank, message)`` for every worker protocol message of ``kind`` (after the job's own handling;
        on the reader thread: keep it short)."""
        self._observers.setdefault(kind, []).append(fn)

    def on_finish(self, fn: Callable[["Job"], None]) -> None:
        """Call ``fn(job)`` once when the job ends — succeeded, failed or cancelled — before ``wait()`` returns
        (at once if it has ended already); e.g. to release what the launcher holds for it (checkpoint locks)."""
        with self._lock:
            if self._finish_hooks is not None:
                self._finish_hooks.append(fn)
                return
        fn(self)

    def _note(self, text: str) -> None:
        """A line of the job's own (a reconfiguration): job.log, ``job.notes`` and the echo."""
        with self._lock:
            self.notes.append(text)
            self._logs.write(None, text)
        if self._echo is not None:
            self._echo(f"[job] {text}")
        if self._progress is not None:
            try:
                self._progress.note(text)
            except Exception:  # noqa: BLE001 - a broken terminal must not break the job
                pass

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()

    def __repr__(self) -> str:
        return (f"Job({self.job_id}: {self.spec.world_size} ranks, {self.status_text}, "
                f"step {self.metrics.last_step() + 1}/{self.spec.steps}, logs in {self.log_dir})")

    # ---- the launcher -> worker channel --------------------------------------------------------------------
    def send_control(self, msg: dict[str, Any], ranks: Sequence[int] | None = None) -> None:
        """Queue the JSON object ``msg`` for ``ranks`` (default: every rank); each worker receives it, in the
        order sent, from ``state.poll_control()``.  Never blocks; ranks that exited are skipped.  ``TypeError``
        for a message that is not a dict, ``KeyError`` for a rank not in the job."""
        self._send_control(msg, ranks)

    def _send_control(self, msg: dict[str, Any], ranks: Sequence[int] | None = None) -> None:
        """:meth:`send_control` (every message of the job goes through here: the job's own, the controller's)."""
        if not isinstance(msg, dict):
            raise TypeError(f"a control message is a dict (a JSON object), not {type(msg).__name__}")
        json.dumps(msg)  # not JSON-able: the caller hears it now, not a worker later
        targets = set(self.spec.ranks) if ranks is None else {int(r) for r in ranks}
        unknown = sorted(targets - set(self.spec.ranks))
        if unknown:
            raise KeyError(f"ranks {unknown} are not in job {self.job_id} (ranks 0..{self.spec.world_size - 1})")
        for g in list(self._groups):
            mine = [r for r in g.ranks if r in targets]
            if mine:
                g.send_control(msg, mine)

    # ---- start ---------------------------------------------------------------------------------------------
    def start(self) -> "Job":
        """Start the workers on every host (called by ``launch_spec``)."""
        try:
            for host, ranks in self._hosts.items():
                now = time.monotonic()
                with self._lock:
                    for r in ranks:
                        self._ranks[r].started = now
                        self._ranks[r].phases["spawned"] = now
                self._show_startup()
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
        self._watchdog.start()
        return self

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

    def _on_error(self, rank: int, msg: dict[str, Any]) -> None:
        tb = str(msg.get("traceback", ""))
        self._append(rank, tb.rstrip("\n") or str(msg.get("message")), stderr=True)
        self._fail(Failure(rank, str(msg.get("message", "error")), tb, bool(msg.get("collateral", False)),
                           float(msg.get("time", time.time())), host=self._ranks[rank].host))

    def _on_exit(self, rank: int, returncode: int) -> None:
        if self._done.is_set():
            return  # a late report (e.g. of a host whose start failed): the outcome is already decided
        group = self._group_of(rank)
        lost = group.lost(rank) if group is not None else None
        with self._lock:
            rec = self._ranks[rank]
            rec.returncode = returncode
            reported = rec.suspect or any(rank in f.ranks for f in self.failures)  # suspect: being reported
            killed = group is not None and group.stopped_by_kill(rank, returncode)
        if lost is not None:
            self._append(rank, f"exit status unknown: {lost}")
            if group is not None:
                self._host_lost(group, lost)
        else:
            self._append(rank, f"exited with status {describe_returncode(returncode)}"
                         + (" (stopped by the launcher)" if killed else ""))
            if not reported and not killed and (returncode != 0 or rec.result is None):
                why = (f"exited with status {describe_returncode(returncode)}" if returncode != 0
                       else "exited without reporting a result")
                self._fail(Failure(rank, f"rank {rank} {why}", "\n".join(rec.stderr_tail), False, time.time(),
                                   kind="exited", host=rec.host, returncode=returncode))
        self._maybe_finish()

    # ---- failures and the policy ---------------------------------------------------------------------------
    def _fail(self, failure: Failure) -> None:
        with self._lock:
            if self._done.is_set() or (self._cancelled and not self._failures):
                return  # a consequence of cancel(): a peer saw a stopped rank's connection close
            if self._stopping:  # already stopping: a consequence, recorded for the report
                self._failures.append(failure)
                return
        try:
            reaction = self.policy.on_failure(self, failure)
        except Exception as e:  # noqa: BLE001 - a broken policy must not leave the job running unnoticed
            failure.message += f" (and the failure policy raised {type(e).__name__}: {e})"
            reaction = Reaction.STOP
        with self._lock:
            if reaction is Reaction.CONTINUE and not self._stopping:
                self._absorbed.append(failure)
                return
            self._failures.append(failure)
        threading.Thread(target=self._stop_all, name="hspmd-stop", daemon=True).start()

    def _stop_all(self) -> None:
        with self._lock:
            self._stopping = True
            groups = list(self._groups)
        threads = [threading.Thread(target=g.kill, name=f"hspmd-kill-{g.host}", daemon=True) for g in groups]
        for t in threads:  # in parallel: a host that does not answer must not delay stopping the others
            t.start()
        for t in threads:
            t.join()

    def _group_of(self, rank: int) -> WorkerGroup | None:
        for g in list(self._groups):
            if rank in g.ranks:
                return g
        return None

    def _host_lost(self, group: WorkerGroup, why: str) -> None:
        """One ``connection lost`` failure per host, naming the ranks it carried."""
        with self._lock:
            if group.host in self._lost_hosts:
                return
            self._lost_hosts.add(group.host)
            ranks = [r for r in group.ranks if self._ranks[r].returncode is None or group.lost(r) is not None]
        ranks = ranks or list(group.ranks)
        self._fail(Failure(min(ranks), f"host {group.host}: connection lost: {why}; it carried ranks {ranks}",
                           kind="connection lost", ranks=tuple(ranks), host=group.host))

    # ---- what the watchdog reports (:mod:`.watchdog`) ------------------------------------------------------
    def _hung(self, rank: int, why: str, stack: str) -> None:
        """A rank the watchdog found hung, with its stack (or why there is none)."""
        self._append(rank, why)
        self._fail(Failure(rank, why, stack, False, time.time(), kind="hung", host=self._ranks[rank].host))

    # ---- the end -------------------------------------------------------------------------------------------
    def _maybe_finish(self) -> None:
        with self._lock:
            if self._done.is_set() or any(rec.returncode is None for rec in self._ranks.values()):
                return
            self._status = (JobStatus.FAILED if self._failures else JobStatus.CANCELLED if self._cancelled
                            else JobStatus.STOPPED if self._stopped_at() is not None else JobStatus.SUCCEEDED)
            self._t1 = time.monotonic()
            self._logs.close()
        if self._progress is not None:
            try:
                self._progress.close(self.status_text)
            except Exception:  # noqa: BLE001 - a broken terminal must not keep the job open
                pass
        atexit.unregister(self._atexit)
        try:
            self.transport.close()
        finally:
            with self._lock:
                hooks, self._finish_hooks = self._finish_hooks or [], None
            for fn in hooks:
                try:
                    fn(self)
                except Exception as e:  # noqa: BLE001 - a broken hook must not keep the job open
                    warnings.warn(f"job {self.job_id}: a finish hook raised {type(e).__name__}: {e}", stacklevel=1)
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
                         emulation={int(r): (float(k) if isinstance(k, (int, float)) else max(f for _, f in k))
                                    for r, k in self.spec.slowdown.items()},
                         failures=list(self._absorbed), events=self.events, stopped_at=self._stopped_at(),
                         grad_norms=list(self.metrics.series("grad_norm", self.spec.loss_rank).values()),
                         lrs=list(self.metrics.series("lr", self.spec.loss_rank).values()),
                         val_losses=self.metrics.series("val_loss", self.spec.loss_rank))

    def _stopped_at(self) -> int | None:
        """Steps done when ``stop()`` ended the job early (from the workers' results; ``None``: it was not)."""
        runs = self.spec.payload.get("runs") or ()
        for rec in self._ranks.values():
            for i, run in enumerate((rec.result or {}).get("runs") or ()):
                if isinstance(run, dict) and run.get("stopped_at") is not None:
                    return int(run["stopped_at"]) + sum(int(r.get("steps", 0)) for r in runs[:i])
        return None

    def first_failure(self) -> Failure | None:
        """The failure that caused the others: a genuine error before connection errors, then the earliest."""
        with self._lock:
            return min(self._failures, key=Failure.sort_key, default=None)

    def _failure_error(self) -> RuntimeFailure:
        f = self.first_failure()
        assert f is not None
        others = sorted({r for g in self._failures for r in g.ranks} - set(f.ranks))
        host = f.host or self._ranks[f.rank].host
        where = (f"rank {f.rank}" + (f" on {host}" if host else "")) if f.kind != "connection lost" \
            else f"ranks {list(f.ranks)}"
        logs = "" if self._logs.broken is None else f" (log files incomplete: {self._logs.broken})"
        text = (f"job {self.job_id} failed: {where}: {f.message}"
                + (f"\n(ranks {others} failed afterwards, most likely as a consequence)" if others else "")
                + f"\nAll workers were stopped. Full logs: {self.log_dir}/rank{f.rank}.log{logs}"
                + (f"\n--- {f.evidence_title()} of rank {f.rank} ---\n{f.traceback.rstrip()}" if f.traceback
                   else ""))
        return RuntimeFailure(text, rank=f.rank, traceback=f.traceback)

    def _kill_at_exit(self) -> None:
        if not self._done.is_set():
            self._stop_all()

