"""Reading a running job for the screen: a snapshot of its public state, and a thread that polls it.

Only the job's public API is read, and only what it has: ``status`` (and ``status_text``), ``job_id``, ``spec``
(``steps``, ``ranks``), ``metrics`` (``last_step()``, ``losses()``, ``ranks()``, ``rank(r)``: step time, tokens,
memory), ``pids()``, ``failures`` (every failure, absorbed by an elastic job or not), ``first_failure()``, ``events``
(reconfigurations: ``step``, ``reason``, ``failed_ranks``, ``strategy``, ``seconds``, ``bytes``, ``ranks``: launch
rank -> rank in the new world, ``done``), ``program`` (the plan it runs now, and the model it trains),
``controller`` (global batch and sequence length: the tokens of a step; its cost model), ``cluster``, ``spec.backend``
(``nccl``: GPU workers), ``elapsed_s``, ``log_dir`` and ``switch``.

What the dashboard draws is :meth:`JobSnapshot.to_view`: each rank of the job's *current world* with its state
(running, done, dead with the reason and the step it died in, stopped), the ranks an elastic job removed when it
shrank, every failure and reconfiguration in the order they happened, elapsed time, ETA and tokens/s, and the plan
the job runs now (in launch ranks).

Each rank's memory is shown as measured beside the one estimate (:func:`memory_estimates`:
:func:`hspmd_sdk.core.memory.device_memory`, the figure ``hspmd show``, ``Strategy.summary`` and the plan editor
show), the part of it that the measurement holds: a CPU worker's peak RSS holds everything (the process baseline
too), a GPU worker's peak CUDA allocated bytes the tensors only.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ..core.memory import device_memory
from ..core.strategy import Strategy
from ..runtime.control.progress import step_rates, step_tokens
from ._units import fmt_bytes, fmt_memory

__all__ = ["JobSnapshot", "JobEvent", "JobFailure", "RankView", "snapshot", "JobWatcher", "can_switch",
           "SWITCH_NEEDS", "memory_estimates"]

#: Why "Apply to running job" is disabled for a job without ``switch``.
SWITCH_NEEDS = ("switching needs a job launched from an SDK version with Job.switch (graph switching in a running "
                "job); this job has no switch()")
_RUNNING = {"starting", "running"}
#: Ended with every rank done: ran all its steps, or stopped gracefully at a step boundary (``Job.stop()``).
_DONE = {"succeeded", "stopped"}
#: The stop button's tooltip, by whether it stops the job gracefully (a training job) or at once (any other).
STOP_HINTS = {True: "stop this job gracefully: every worker finishes the step it is in, then the job ends there "
                    "(job.stop()); its result keeps the losses so far",
              False: "stop every worker of this job now (job.cancel())"}


def _get(obj: Any) -> Callable[..., Any]:
    return (lambda k, d=None: obj.get(k, d)) if isinstance(obj, dict) else (lambda k, d=None: getattr(obj, k, d))


@dataclass(frozen=True)
class JobEvent:
    """One reconfiguration of a job, as the screen shows it (``ranks``: launch rank -> rank in the new world)."""

    step: int | None
    reason: str
    failed_ranks: tuple[int, ...]
    strategy: Any
    seconds: dict[str, float]
    bytes: dict[str, int]
    ranks: dict[int, int] = field(default_factory=dict)
    done: bool = True

    def describe(self) -> str:
        parts = [f"step {self.step}" if self.step is not None else "", self.reason]
        if self.failed_ranks:
            parts.append(f"failed ranks {', '.join(map(str, self.failed_ranks))}")
        if "total" in self.seconds:
            parts.append(f"{self.seconds['total']:.2f} s")
        moved = sum(self.bytes.values())
        if moved:
            parts.append(f"moved {fmt_bytes(moved)}")
        if self.ranks and self.reason == "failure":
            parts.append(f"world now {len(self.ranks)} ranks")
        if not self.done:
            parts.append("in progress")
        return " · ".join(p for p in parts if p)


@dataclass(frozen=True)
class JobFailure:
    """One failure the job detected: ``rank`` (``ranks``: every rank concerned), ``kind`` (``exited``, ``hung``,
    ``connection lost``, ``error``), the message, ``step`` (the step its rank was in: the one after its last
    report) and ``consequence`` (it followed the failure that stopped the job)."""

    rank: int
    ranks: tuple[int, ...]
    kind: str
    message: str
    step: int | None
    consequence: bool = False
    time: float = field(default=0.0, compare=False)

    def describe(self) -> str:
        head = f"step {self.step}" if self.step is not None else ""
        tail = " (after the first failure: most likely a consequence)" if self.consequence else ""
        return " · ".join(p for p in (head, self.message.splitlines()[0] if self.message else self.kind) if p) + tail


@dataclass(frozen=True)
class RankView:
    """One launch rank as the dashboard draws it.

    ``state``: ``starting``, ``running``, ``done``, ``dead`` (it failed: killed, exited, hung, lost, raised),
    ``stopped`` (the job ended without it finishing: stopped after another rank's failure or cancelled) or
    ``removed`` (an elastic job left it out of its current world).  ``why``: for a dead or removed rank, what
    happened; ``died_step``: the step it was in."""

    rank: int
    state: str
    step_time: float | None = None
    last_step: int = -1
    memory_mb: float | None = None
    why: str = ""
    died_step: int | None = None
    memory_estimate_mb: float | None = None  #: the estimate comparable with ``memory_mb`` (:func:`memory_estimates`)


@dataclass(frozen=True)
class JobSnapshot:
    """What a job shows now: status, progress, losses, each rank's last step time, events; each rank's state,
    failures, the current world, rates and the plan it runs (see the module docstring)."""

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
    ranks: tuple[RankView, ...] = ()
    failures: tuple[JobFailure, ...] = ()
    world: tuple[int, ...] = ()
    tokens_per_s: float | None = None
    step_s: float | None = None
    plan: dict[str, Any] | None = None
    log_dir: str = ""
    can_stop: bool = False
    stopped_by_user: bool = False
    starting: str = ""  #: while no step is done: what the workers are at (``Job.startup_text()``, when it has one)
    # the clock moves on its own: not a reason to redraw (the front end ticks it between snapshots)
    elapsed_s: float | None = field(default=None, compare=False)
    eta_s: float | None = field(default=None, compare=False)
    status_text: str = ""  #: the status for people (``Job.status_text``: ``stopped at step N``); "" = ``status``
    graceful_stop: bool = False  #: the stop button ends the job at a step boundary (``job.stop()``), not at once
    val_losses: tuple[tuple[int, float], ...] = ()  #: (step, validation loss) of the validation steps so far
    lr: float | None = None         #: the learning rate of the last step
    grad_norm: float | None = None  #: the gradient's global norm of the last step, before clipping
    data: str = ""  #: what the job trains on (``Job.data``: ``"stdlib source (bytes)"``, ``"synthetic random ..."``)
    memory_note: str = ""  #: what the measured and the estimated memory of a rank are (:func:`memory_estimates`)

    @property
    def running(self) -> bool:
        return self.status in _RUNNING

    @property
    def dead(self) -> list[int]:
        """Launch ranks that failed (killed, exited, hung, lost, raised), removed from the world or not."""
        return [r.rank for r in self.ranks if r.state == "dead" or (r.state == "removed" and r.died_step is not None)]

    @property
    def removed(self) -> list[int]:
        """Launch ranks an elastic job left out of its current world."""
        return [r.rank for r in self.ranks if r.state == "removed"]

    def timeline(self) -> list[dict[str, Any]]:
        """Failures and reconfigurations in the order they happened: each failure before the reconfiguration it
        caused; failures nothing reconfigured after (a job that stopped, a recovery under way) last."""
        out: list[dict[str, Any]] = []
        left = list(self.failures)
        for e in self.events:
            caused = [f for f in left if set(f.ranks) & set(e.failed_ranks)] if e.reason == "failure" else []
            for f in caused:
                out.append(_failure_item(f))
                left.remove(f)
            out.append({"text": e.describe(), "reason": e.reason, "step": e.step, "failed": list(e.failed_ranks)})
        out.extend(_failure_item(f) for f in sorted(left, key=lambda f: f.consequence))  # (the cause first)
        if self.stopped_by_user:
            out.append({"text": f"step {self.step} · stopped from the dashboard", "reason": "stopped",
                        "step": self.step, "failed": []})
        return out

    def to_view(self) -> dict[str, Any]:
        """The JSON the dashboard draws."""
        times = self.step_times
        live = {r.rank for r in self.ranks if r.state not in ("dead", "removed")} if self.ranks else set(times)
        shown = {r: t for r, t in times.items() if r in live}
        slow = max(shown, key=shown.get) if len(shown) > 1 else None
        return {"job_id": self.job_id, "status": self.status, "status_text": self.status_text or self.status,
                "step": self.step, "steps": self.steps,
                "losses": [round(x, 6) for x in self.losses],
                "val_losses": [[k, round(v, 6)] for k, v in self.val_losses], "lr": self.lr,
                "grad_norm": None if self.grad_norm is None else round(self.grad_norm, 6),
                "step_times": [[r, round(t, 4)] for r, t in sorted(times.items())], "slowest": slow,
                "ranks": [{"rank": r.rank, "state": r.state, "time": None if r.step_time is None
                           else round(r.step_time, 4), "step": r.last_step, "memory_mb": r.memory_mb,
                           "memory_estimate_mb": r.memory_estimate_mb,
                           "why": r.why, "died_step": r.died_step} for r in self.ranks],
                "world": list(self.world), "removed": self.removed,
                "events": self.timeline(),
                "can_switch": self.can_switch, "error": self.error, "running": self.running,
                "elapsed_s": None if self.elapsed_s is None else round(self.elapsed_s, 2),
                "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
                "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 1),
                "step_s": None if self.step_s is None else round(self.step_s, 4),
                "plan": self.plan, "log_dir": self.log_dir, "can_stop": self.can_stop and self.running,
                "stopped_by_user": self.stopped_by_user, "starting": self.starting, "data": self.data,
                "stop_hint": STOP_HINTS[self.graceful_stop], "memory_note": self.memory_note}


def _failure_item(f: JobFailure) -> dict[str, Any]:
    return {"text": f.describe(), "reason": "consequence" if f.consequence else "failure", "step": f.step,
            "failed": list(f.ranks), "kind": f.kind, "detail": f.message[:2000]}


def can_switch(job: Any) -> bool:
    return callable(getattr(job, "switch", None)) and getattr(job, "controller", True) is not None


def _event(e: Any) -> JobEvent:
    get = _get(e)
    step = get("step")
    return JobEvent(int(step) if step is not None else None, str(get("reason", "") or ""),
                    tuple(int(r) for r in (get("failed_ranks") or ())), get("strategy"),
                    {str(k): float(v) for k, v in dict(get("seconds") or {}).items()},
                    {str(k): int(v) for k, v in dict(get("bytes") or {}).items()},
                    {int(k): int(v) for k, v in dict(get("ranks") or {}).items()},
                    bool(get("done", True)) or bool(get("superseded", False)))


def _failures(job: Any, status: str, last: dict[int, int]) -> tuple[JobFailure, ...]:
    try:
        found = list(getattr(job, "failures", None) or ())
    except Exception:  # noqa: BLE001 - a job being torn down
        found = []
    first = getattr(job, "first_failure", None)
    cause = first() if callable(first) and status == "failed" else None
    out = []
    for f in found:
        get = _get(f)
        rank = int(get("rank", 0))
        ranks = tuple(int(r) for r in (get("ranks") or (rank,)))
        # in a failed job: what came with or after the failure that stopped it (not what an elastic job survived
        # before it), and a peer's error that looks like its consequence (a killed rank's exit is noticed after
        # the connection errors of its peers)
        consequence = cause is not None and f is not cause and (
            float(get("time", 0.0) or 0.0) >= float(getattr(cause, "time", 0.0) or 0.0)
            or (bool(get("collateral", False)) and not bool(getattr(cause, "collateral", False))))
        out.append(JobFailure(rank, ranks, str(get("kind", "error")), str(get("message", "")),
                              last.get(rank, -1) + 1, consequence, float(get("time", 0.0) or 0.0)))
    return tuple(out)


def _world(job: Any, events: tuple[JobEvent, ...], launch: list[int]) -> tuple[tuple[int, ...], dict[int, int]]:
    """The launch ranks of the job's current world, and its ranks' numbering (its rank -> launch rank)."""
    for e in reversed(events):
        if e.ranks:
            return tuple(sorted(e.ranks)), {n: l for l, n in e.ranks.items()}
    return tuple(launch), {r: r for r in launch}


def _running(job: Any) -> tuple[Any, "Strategy | None"]:
    """The Program the job runs now and the Strategy it realises (``None`` where it has none)."""
    try:
        program = getattr(job, "program", None)
    except Exception:  # noqa: BLE001
        program = None
    settings = getattr(getattr(program, "plan", None), "settings", None)
    strategy = None
    if getattr(settings, "strategy", None):
        try:
            strategy = Strategy.load(settings.strategy)
        except Exception:  # noqa: BLE001 - drawn without layers, no memory estimate
            strategy = None
    return program, strategy


def _plan(program: Any, strategy: "Strategy | None", events: tuple[JobEvent, ...],
          to_launch: dict[int, int]) -> dict[str, Any] | None:
    """The plan the job runs now, in launch ranks: pipelines of stages (ranks, layers), micro-batching."""
    pipelines = getattr(program, "pipelines", None)
    if not pipelines:
        return None
    layers = ([[f"{s.layers[0]}-{s.layers[1]}" for s in p.stages] for p in strategy.pipelines]
              if strategy is not None else [])
    micro = list(getattr(program, "micro_batches", ()) or ())
    sizes = list(getattr(program, "micro_batch_sizes", ()) or ())
    out = []
    for i, stages in enumerate(pipelines):
        row = {"stages": [{"ranks": [to_launch.get(r, r) for r in ranks],
                           "layers": layers[i][j] if i < len(layers) and j < len(layers[i]) else ""}
                          for j, ranks in enumerate(stages)]}
        if i < len(micro) and i < len(sizes):
            row["micro"] = f"{micro[i]} × bs{sizes[i]}"
        out.append(row)
    since = next((e for e in reversed(events) if e.ranks or e.strategy is not None), None)
    return {"pipelines": out, "since": ("the start" if since is None else f"step {since.step} ({since.reason})"),
            "text": str(strategy) if strategy is not None else ""}


def memory_estimates(job: Any, program: Any = None, strategy: "Strategy | None" = None,
                     to_launch: dict[int, int] | None = None) -> tuple[dict[int, float], str]:
    """``({launch rank: MiB}, note)``: the one estimate (:func:`hspmd_sdk.core.memory.device_memory`) of the plan
    the job runs now, for the model it trains at its sequence length, with its controller's cost model (its runtime
    parts), on the device its workers use (``spec.backend`` ``nccl``: GPUs, else CPU processes) -- the part that
    the rank's measured figure holds (:meth:`~hspmd_sdk.core.memory.DeviceMemory.comparable`); and a note that says
    what both are.  ``({}, "")`` for a job without a plan, a model or a sequence length (not a training job)."""
    if program is None and strategy is None:
        program, strategy = _running(job)
    model = getattr(program, "model", None)
    controller = getattr(job, "controller", None)
    seq_len = getattr(controller, "seq_len", None)
    if strategy is None or model is None or not isinstance(seq_len, int):
        return {}, ""
    gpu = str(getattr(getattr(job, "spec", None), "backend", "") or "") == "nccl"
    options = getattr(getattr(controller, "cost", None), "memory_options", None)
    try:
        est = device_memory(strategy, model, getattr(job, "cluster", None), seq_len=seq_len,
                            device="cuda" if gpu else "cpu", **(options() if callable(options) else {}))
    except Exception:  # noqa: BLE001 - a display must not fail on an estimate it cannot make
        return {}, ""
    to_launch = to_launch or {}
    out = {to_launch.get(r, r): round(m.comparable(measured_on_gpu=gpu) / 2**20, 1) for r, m in est.items()}
    any_rank = next(iter(est.values()), None)
    runtime = fmt_memory(any_rank.runtime) if any_rank is not None else ""
    note = ("measured: each worker's peak CUDA memory allocated by torch (tensors only: the CUDA context is not in "
            f"torch's count); estimated: the plan's tensors (Strategy.device_memory, seq_len {seq_len}; the "
            f"{runtime} CUDA context reserve it adds on top is not measured)" if gpu else
            "measured: each worker process's peak resident memory (RSS: Python, torch, gloo and the tensors); "
            f"estimated: Strategy.device_memory at seq_len {seq_len}, the plan's tensors plus the {runtime} "
            "process baseline of a CPU worker")
    return out, note


def _rates(job: Any, metrics: Any, ranks: list[int], step: int, steps: int | None) -> tuple[float | None, ...]:
    """(seconds a step takes, tokens/s, ETA): the job's pace as every display computes it
    (:func:`~hspmd_sdk.runtime.control.progress.step_rates`: the median over the newest steps of each step's slowest
    rank; tokens per step from the training run, global batch × sequence length, else what the loss rank reports)."""
    step_s, tps = step_rates(metrics, ranks, step_tokens(getattr(job, "controller", None)))
    if step_s is None:
        return None, None, None
    eta = max(0, steps - step) * step_s if steps is not None else None
    return step_s, tps, eta


def snapshot(job: Any, *, stopped_by_user: bool = False) -> JobSnapshot:
    """Read ``job``'s public state now."""
    status = getattr(job, "status", "unknown")
    status = str(getattr(status, "value", status))
    metrics = job.metrics
    spec = getattr(job, "spec", None)
    steps = getattr(spec, "steps", None)
    steps = int(steps) if steps is not None else None
    times: dict[int, float] = {}
    last: dict[int, int] = {}
    memory: dict[int, float] = {}
    for r in metrics.ranks():
        reports = metrics.rank(r)
        done = [m for m in reports if m.step_time is not None]
        if done:
            times[r] = float(done[-1].step_time)
        if reports:
            last[r] = max(m.step for m in reports)
        mem = [m.memory_mb for m in reports if getattr(m, "memory_mb", None) is not None]
        if mem:
            memory[r] = float(mem[-1])
    error = ""
    if status == "failed":
        first = getattr(job, "first_failure", None)
        f = first() if callable(first) else None
        error = f"rank {f.rank}: {f.message}" if f is not None else "failed"
    try:
        pids = dict(job.pids())
    except Exception:  # noqa: BLE001 - a finished job may have no process table left
        pids = {}
    try:
        raw_events = list(getattr(job, "events", None) or ())
    except Exception:  # noqa: BLE001
        raw_events = []
    events = tuple(_event(e) for e in raw_events)
    launch = [int(r) for r in (getattr(spec, "ranks", None) or ())] or sorted(set(metrics.ranks()) | set(pids))
    failures = _failures(job, status, last)
    world, to_launch = _world(job, events, launch)
    program, strategy = _running(job)
    estimates, memory_note = memory_estimates(job, program, strategy, to_launch)
    dead: dict[int, JobFailure] = {}
    for f in failures:
        if not f.consequence:
            for r in f.ranks:
                dead.setdefault(r, f)
    ranks = []
    for r in launch:
        f = dead.get(r)
        state, why = _rank_state(r, f, world=world, status=status, reported=r in last, failures=failures,
                                 stopped_by_user=stopped_by_user)
        ranks.append(RankView(r, state, times.get(r), last.get(r, -1), memory.get(r), why,
                              f.step if f is not None else None, estimates.get(r) if r in world else None))
    step = metrics.last_step() + 1
    step_s, tps, eta = _rates(job, metrics, [r for r in world if r not in dead], step, steps)
    elapsed = getattr(job, "elapsed_s", None)
    starting = ""
    phase = getattr(job, "startup_text", None)
    if status in _RUNNING and step == 0 and callable(phase):
        try:
            starting = str(phase() or "")
        except Exception:  # noqa: BLE001 - a display must not fail on it
            starting = ""
    log_dir = getattr(job, "log_dir", None)
    try:
        status_text = str(getattr(job, "status_text", "") or "")
    except Exception:  # noqa: BLE001 - a display must not fail on it
        status_text = ""
    graceful = callable(getattr(job, "stop", None)) and getattr(job, "controller", None) is not None
    return JobSnapshot(str(getattr(job, "job_id", "")), status, step, steps, tuple(metrics.losses()), times,
                       events, can_switch(job), error, pids, tuple(ranks), failures, world, tps, step_s,
                       _plan(program, strategy, events, to_launch), str(log_dir) if log_dir else "",
                       callable(getattr(job, "cancel", None)), stopped_by_user, starting,
                       float(elapsed) if isinstance(elapsed, (int, float)) else None,
                       eta if status in _RUNNING else None, status_text, graceful, *_recipe(metrics),
                       data=_data_of(job), memory_note=memory_note if estimates else "")


def _rank_state(r: int, failure: JobFailure | None, *, world: tuple[int, ...], status: str, reported: bool,
                failures: tuple[JobFailure, ...], stopped_by_user: bool) -> tuple[str, str]:
    """Launch rank ``r``'s :attr:`RankView.state` and why: ``removed`` (out of the job's ``world``), ``dead`` (its
    own ``failure``, one that no other failure caused), ``running`` (``starting`` until it has ``reported`` a
    step), ``done``, else ``stopped`` (by the user, a cancellation, another rank's failure or the launcher)."""
    if r not in world:
        return "removed", (f"{_kind(failure)} at step {failure.step}; the job went on without it"
                           if failure is not None else "left out of the job's world")
    if failure is not None:
        return "dead", _kind(failure)
    if status in _RUNNING:
        return ("running" if reported else "starting"), ""
    if status in _DONE:
        return "done", ""
    consequence = next((g for g in failures if r in g.ranks), None)
    return "stopped", ("stopped from the dashboard" if stopped_by_user and status == "cancelled" else
                       "cancelled" if status == "cancelled" else
                       "failed after the first failure" if consequence is not None else "stopped by the launcher")


def _data_of(job: Any) -> str:
    """``Job.data`` (what the job trains on), ``""`` where the job says nothing."""
    try:
        return str(getattr(job, "data", None) or "")
    except Exception:  # noqa: BLE001 - a display must not fail on it
        return ""


def _recipe(metrics: Any) -> tuple[tuple[tuple[int, float], ...], float | None, float | None]:
    """The validation losses so far, and the last step's learning rate and gradient norm, where the job's metrics
    have them (a training job's ranks report them; others do not)."""
    series = getattr(metrics, "series", None)
    if not callable(series):
        return (), None, None
    val, lrs, norms = series("val_loss"), series("lr"), series("grad_norm")
    last = max(lrs, default=None)
    return (tuple(val.items()), lrs[last] if last is not None else None,
            norms.get(last) if last is not None else None)


def _kind(f: JobFailure) -> str:
    """``killed (SIGKILL)``, ``exited with status 7``, ``hung``, ``connection lost``, ``raised an error``."""
    msg = f.message
    if f.kind == "exited":
        if "killed by " in msg:
            return "killed (" + msg.split("killed by ", 1)[1].split(")", 1)[0] + ")"
        return "exited" + (" with status " + msg.split("status ", 1)[1].split()[0] if "status " in msg else "")
    return {"hung": "hung", "connection lost": "connection lost", "error": "raised an error"}.get(f.kind, f.kind)


class JobWatcher:
    """Polls a job every ``interval`` seconds on a daemon thread and calls ``on_change(snapshot)`` when what it
    shows changed; stops after the job finished (one last call)."""

    def __init__(self, job: Any, on_change: Callable[[JobSnapshot], None], interval: float = 0.5) -> None:
        self.job = job
        self.on_change = on_change
        self.interval = interval
        self.last: JobSnapshot | None = None
        self.stopped_by_user = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def poll(self) -> JobSnapshot:
        """Read the job now; call ``on_change`` if the snapshot differs from the last one."""
        with self._lock:
            snap = snapshot(self.job, stopped_by_user=self.stopped_by_user)
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
