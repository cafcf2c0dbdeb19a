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

The job is put together from parts, each in a module of its own: what it is and returns (:mod:`.job_result`), its
log files (:mod:`.job_logs`), its workers' streams and the progress line (:mod:`.job_stream`), failures and the
policy (:mod:`.job_failures`), holds at step boundaries (:mod:`.job_holds`), the training side -- switch, grow and
the controller's view (:mod:`.job_training`) -- and the measured timelines (:mod:`.job_traces`).  This module keeps
the job's state and its life (start, wait, cancel, stop, the end), the launcher -> worker channel, and every name
it had (re-exported from the parts).
"""
from __future__ import annotations

import atexit
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from .faults import Failure, FailurePolicy, StopOnFailure
from ..metrics import MetricsHistory
from .job_failures import JobFailures
from .job_holds import JobHolds
from .job_logs import FLUSH_S, OPEN_RANK_LOGS, JobLogs, LogDirError  # noqa: F401 - re-exported
from .job_result import STARTUP_PHASES, JobCancelled, JobResult, JobStatus, StartupTimes  # noqa: F401 - re-exported
from .job_stream import TAIL_LINES, JobStream, RankRecord  # noqa: F401 - re-exported
from .job_traces import JobTraces, TraceFile  # noqa: F401 - re-exported
from .job_training import JobTraining
from .progress import Progress, in_notebook, make_progress
from .watchdog import Watchdog
from ..protocol import message_text
from ..spec import LaunchSpec
from ..transports.transport import Transport, WorkerGroup

__all__ = ["Job", "JobResult", "JobStatus", "JobCancelled", "Failure", "LogDirError"]

#: :class:`~.job_logs.JobLogs` under the name it had here (still imported from here).
_Logs = JobLogs


class Job(JobStream, JobFailures, JobHolds, JobTraining, JobTraces):
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
        self._logs = JobLogs(self.log_dir, spec.ranks, spec.job_id)
        self.metrics = MetricsHistory()
        self._hosts = hosts
        self._echo = echo
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._status = JobStatus.STARTING
        self._ranks = {r: RankRecord() for r in spec.ranks}
        self._failures: list[Failure] = []  # what fails the job: the failure that stopped it and what followed
        self._absorbed: list[Failure] = []  # what the policy let the job survive
        self._lost_hosts: set[str] = set()
        self._stopping = False
        self._cancelled = False
        self._groups: list[WorkerGroup] = []
        self._groups_indexed: tuple[int, dict[int, WorkerGroup]] = (0, {})  # (len(_groups), rank -> group)
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
        text = message_text(msg)  # not JSON-able: the caller hears it now, not a worker later; encoded once
        group_of = self._groups_by_rank()
        targets = sorted(group_of) if ranks is None else sorted({int(r) for r in ranks})
        unknown = [r for r in targets if r not in group_of and r not in self._ranks]
        if unknown:
            raise KeyError(f"ranks {unknown} are not in job {self.job_id} (ranks 0..{self.spec.world_size - 1})")
        mine: dict[int, tuple[WorkerGroup, list[int]]] = {}  # per group, its ranks among the targets
        for r in targets:
            g = group_of.get(r)
            if g is not None:
                mine.setdefault(id(g), (g, []))[1].append(r)
        for g, rs in mine.values():
            g.send_control(msg, rs, text=text)

    def _groups_by_rank(self) -> dict[int, WorkerGroup]:
        """Launch rank -> the group of workers it runs in (made again when a group was added): a message to one
        rank finds its group at once, not by scanning every group (a switch sends each of 10,000 ranks its own)."""
        groups = list(self._groups)
        if self._groups_indexed[0] != len(groups):
            self._groups_indexed = (len(groups), {r: g for g in groups for r in g.ranks})
        return self._groups_indexed[1]

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
                self._ranks[r] = RankRecord(started=now)
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
