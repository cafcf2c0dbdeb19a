"""Measured timelines: chosen steps recorded with the torch profiler on every rank, merged into one trace.

``launch(program, cluster, steps=..., profile=[3, 7])`` records steps 3 and 7 on every rank with
:class:`torch.profiler.profile` (CPU activity).  The executor names its work as the plan names it (:func:`span`):
each schedule action (``F mb0``, ``B mb0``, ``SEND_F mb0``, ``RECV_B mb1``, ``PRE``, ``POST``), the gradient
synchronisation (``sync``) and Adam (``optim``) inside ``POST``, and every communication operator by its SPEC name
(``comm BSR``, ``comm SplitAllReduce``, ...); the process group's own collectives (``c10d::``/``gloo:``) are kept
beside them.  Each rank sends its spans of a recorded step to the launcher as a ``trace`` message (so it works on
every transport); :meth:`Job.trace <hspmd_sdk.runtime.control.job.Job.trace>` merges them into one Chrome/Perfetto trace,
a track (``pid``) per rank, and :meth:`Job.timeline <hspmd_sdk.runtime.control.job.Job.timeline>` draws each rank's
measured phases beside the simulator's prediction for the same Program (:mod:`.timeline`).

Off (no step chosen), :func:`span` is one check of whether a profiler records: the step runs as before.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

if TYPE_CHECKING:
    import torch

PREFIX = "hspmd:"
#: the simulator's phase of each action span (``SimResult.timeline`` event kinds); ``POST`` counts by its parts
PHASE = {"F": "F", "B": "B", "SEND_F": "comm", "RECV_F": "comm", "SEND_B": "comm", "RECV_B": "comm",
         "PRE": "comm", "sync": "sync", "optim": "optim"}
PHASES = ("F", "B", "comm", "sync", "optim")
_OFF = contextlib.nullcontext()


class _CommClock:
    """Seconds this process spent communicating (:func:`communicating`), outermost calls only."""

    depth = 0
    seconds = 0.0


_CLOCK = _CommClock()


@contextlib.contextmanager
def communicating() -> Iterator[None]:
    """Count the time inside as communication (:func:`comm_seconds`): the communication executor and the
    context-parallel ring wrap their collectives and waits in it, so that a compute measurement that encloses
    them (autograd's backward runs the Reshards' backward plans) can take them out (:meth:`StepExecutor._timed`:
    ``compute_s`` and the emulated slowdown count kernels, never waiting for a peer)."""
    if _CLOCK.depth:
        yield
        return
    _CLOCK.depth += 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _CLOCK.seconds += time.perf_counter() - t0
        _CLOCK.depth -= 1


def comm_seconds() -> float:
    """Total seconds this process spent in :func:`communicating` so far."""
    return _CLOCK.seconds


def span(name: str) -> contextlib.AbstractContextManager[object]:
    """A range named ``hspmd:<name>`` in the torch profiler's trace while one records; else nothing."""
    import torch

    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(PREFIX + name)
    return _OFF


def _kept(name: str) -> bool:
    return name.startswith(PREFIX) or name.startswith("c10d::") or name.startswith("gloo:") \
        or name.startswith("nccl:")


class StepRecorder:
    """The worker's side: which steps to record, and the recording of one (``with recorder.step(s) as out``)."""

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps = frozenset(int(s) for s in steps)
        self.collect_s = 0.0
        if self.steps:
            self._warm()

    @staticmethod
    def _warm() -> None:
        """The profiler's first start costs seconds (its libraries load): pay it before the first step."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]):
            pass

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[list[dict[str, Any]]]:
        """Record ``step`` if chosen: the list yielded is filled with its spans when the block ends."""
        out: list[dict[str, Any]] = []
        if step not in self.steps:
            yield out
            return
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with span(f"step {step}"):
                yield out
            stop = time.perf_counter()
        out.extend(spans_of(prof))
        self.collect_s = time.perf_counter() - stop  # the profiler's stop and the spans' extraction, after the step


def spans_of(prof: "torch.profiler.profile") -> list[dict[str, Any]]:
    """The kept ranges of a finished profile: ``name``, ``ts`` (µs since the epoch), ``dur`` (µs), ``tid``.

    Read from the profiler's raw events: ``prof.events()`` would first build Python objects and a parent tree for
    every operator of the step (seconds for ten thousand of them); only a few hundred ranges are kept."""
    out = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if _kept(name):
            out.append({"name": name, "ts": round(e.start_ns() / 1e3, 3),
                        "dur": round(max(0, e.duration_ns()) / 1e3, 3), "tid": int(e.start_thread_id())})
    return sorted(out, key=lambda s: (s["ts"], -s["dur"]))


# ---- the launcher's side: pure --------------------------------------------------------------------------------
def phase_of(name: str) -> str | None:
    """The simulator's phase of a span (``hspmd:F mb0`` -> ``F``, ``hspmd:RECV_B mb1`` -> ``comm``); ``None`` for
    the step, ``POST`` (counted by its parts) and the operators inside an action."""
    if not name.startswith(PREFIX):
        return None
    return PHASE.get(name[len(PREFIX):].split(" ", 1)[0])


def merge(traces: Mapping[int, Mapping[int, Sequence[Mapping[str, Any]]]],
          labels: Mapping[int, str] | None = None) -> dict[str, Any]:
    """One Chrome/Perfetto trace of ``traces`` (rank -> step -> spans): a process track per rank (named by
    ``labels``), time from the earliest span, communication (``comm ...`` and the process group's collectives) in
    category ``comm``, the plan's actions in ``hspmd``."""
    spans = [(r, s) for r, steps in traces.items() for ss in steps.values() for s in ss]
    t0 = min((s["ts"] for _, s in spans), default=0.0)
    events: list[dict[str, Any]] = []
    for r in sorted(traces):
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": (labels or {}).get(r,
                                                                                          f"rank {r}")}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
    for r, s in spans:
        name = s["name"][len(PREFIX):] if s["name"].startswith(PREFIX) else s["name"]
        comm = name.startswith("comm ") or not s["name"].startswith(PREFIX)
        events.append({"ph": "X", "name": name, "cat": "comm" if comm else "hspmd", "pid": r, "tid": s["tid"],
                       "ts": round(s["ts"] - t0, 3), "dur": s["dur"]})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def measured_phases(spans: Sequence[Mapping[str, Any]]) -> list[tuple[str, float, float, str]]:
    """A rank's recorded step as ``(phase, start s, end s, label)`` from the step's start, in order."""
    step = next((s for s in spans if s["name"].startswith(PREFIX + "step ")), None)
    t0 = step["ts"] if step is not None else min((s["ts"] for s in spans), default=0.0)
    out = []
    for s in spans:
        phase = phase_of(s["name"])
        if phase is not None:
            start = (s["ts"] - t0) / 1e6
            out.append((phase, start, start + s["dur"] / 1e6, s["name"][len(PREFIX):]))
    return sorted(out, key=lambda p: p[1])


def phase_totals(phases: Sequence[tuple[str, float, float, str]]) -> dict[str, float]:
    """Seconds per phase (:data:`PHASES`)."""
    out = dict.fromkeys(PHASES, 0.0)
    for phase, start, end, _ in phases:
        out[phase] += end - start
    return out
