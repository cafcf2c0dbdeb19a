"""Pipeline schedules as data (§6.3, Appendix A.2, Figure 21).

Each device runs its executable graph split into four kinds of executable subgraphs: ``PRE`` (pre-processing:
precision casts, ZeRO parameter gathering), ``F`` and ``B`` (forward / backward of one micro-batch) and ``POST``
(gradient accumulation, gradient synchronization, optimizer update).  A *schedule* is the order in which one
stage of one pipeline runs them, written out as a list of :class:`Action`, together with the point-to-point
transfers between neighbouring stages:

* ``RECV_F`` (activation from stage ``s-1``) before ``F`` on every stage but the first,
* ``SEND_F`` (activation to stage ``s+1``) after ``F`` on every stage but the last,
* ``RECV_B`` (gradient from stage ``s+1``) before ``B`` on every stage but the last,
* ``SEND_B`` (gradient to stage ``s-1``) after ``B`` on every stage but the first.

Transfer semantics, as the executors use them (``torch.distributed.isend``/``batch_isend_irecv``, the same as
``torch.distributed.pipelining``): a *send* is posted asynchronously and does not block its stage; a *receive*
blocks until the matching send has been posted.  :func:`replay` runs all stages' lists together under exactly
these semantics and proves a set of schedules free of deadlock and of mismatched transfers.

Because pipelines (HSPMD's heterogeneous pipelines, each with its own micro-batch count and size) only meet in
``PRE``/``POST`` collectives, a stage's schedule depends only on its own pipeline's ``(kind, num_stages, stage,
num_micro_batches)``.
"""
from __future__ import annotations

import functools
import re

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Literal, Mapping, Sequence

from ..errors import HSPMDError

__all__ = ["Action", "ActionKind", "ScheduleKind", "SCHEDULE_KINDS", "build_schedule", "compute_order",
           "warmup_count", "in_flight", "replay", "ReplayResult", "ScheduleError", "format_schedule"]

ActionKind = Literal["PRE", "F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "POST"]
ScheduleKind = Literal["gpipe", "1f1b"]
SCHEDULE_KINDS: tuple[str, ...] = ("gpipe", "1f1b")
_COMPUTE = ("F", "B")
_SENDS = {"SEND_F": "RECV_F", "SEND_B": "RECV_B"}
_SHORT = {"PRE": "Pre", "POST": "Post", "F": "F", "B": "B", "SEND_F": "sF", "RECV_F": "rF", "SEND_B": "sB",
          "RECV_B": "rB"}
_LONG = {v: k for k, v in _SHORT.items()}
_ACTION_RE = re.compile(r"(?P<kind>Pre|Post|[sr]?[FB])(?P<mb>\d+)?(?:@(?P<peer>\d+))?")


class ScheduleError(HSPMDError, ValueError):
    """A schedule cannot be built (bad arguments) or a replay found a deadlock or a mismatched transfer."""


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule.

    ``kind``: ``PRE``/``POST`` (once each), ``F``/``B`` (compute of ``micro_batch``), or a transfer
    ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` of ``micro_batch`` with stage ``peer`` of the same pipeline.
    """

    kind: ActionKind
    micro_batch: int | None = None
    peer: int | None = None

    def __str__(self) -> str:
        s = _SHORT[self.kind]
        if self.micro_batch is not None:
            s += str(self.micro_batch)
        if self.peer is not None:
            s += f"@{self.peer}"
        return s

    @classmethod
    def from_str(cls, text: str) -> "Action":
        """The action ``str(action)`` printed: ``Pre``, ``Post``, ``F3``, ``B0``, ``sF2@1``, ``rB0@2``, ...
        (``Action.from_str(str(a)) == a``; torch pipelining's ``_Action.from_str`` is the model).  A text of no
        action is a :class:`ScheduleError` naming it."""
        m = _ACTION_RE.fullmatch(text.strip())
        if m is None:  # (every kind the pattern matches is one of _LONG's)
            raise ScheduleError(f"{text!r} is not a schedule action (one of Pre, Post, F<mb>, B<mb>, "
                                "sF<mb>@<peer>, rF<mb>@<peer>, sB<mb>@<peer>, rB<mb>@<peer>)")
        mb, peer = m.group("mb"), m.group("peer")
        return cls(_LONG[m.group("kind")], int(mb) if mb else None, int(peer) if peer else None)

    @property
    def is_compute(self) -> bool:
        return self.kind in _COMPUTE


def _check_args(kind: str, num_stages: int, stage: int, num_micro_batches: int) -> None:
    if kind not in SCHEDULE_KINDS:
        raise ScheduleError(f"schedule: unknown kind {kind!r}; use one of {', '.join(SCHEDULE_KINDS)}")
    if num_stages < 1:
        raise ScheduleError(f"num_stages: {num_stages} must be >= 1")
    if not 0 <= stage < num_stages:
        raise ScheduleError(f"stage: {stage} is not in 0..{num_stages - 1}")
    if num_micro_batches < 1:
        raise ScheduleError(f"num_micro_batches: {num_micro_batches} must be >= 1")


def warmup_count(kind: str, num_stages: int, stage: int, num_micro_batches: int) -> int:
    """Forwards a stage runs before its first backward: ``m`` for GPipe, ``min(m, stages - s - 1)`` for 1F1B."""
    _check_args(kind, num_stages, stage, num_micro_batches)
    if kind == "gpipe":
        return num_micro_batches
    return min(num_micro_batches, num_stages - stage - 1)


def in_flight(kind: str, num_stages: int, stage: int, num_micro_batches: int) -> int:
    """Most micro-batches whose activations a stage holds at once: ``m`` (GPipe), ``min(m, stages - s)`` (1F1B)."""
    _check_args(kind, num_stages, stage, num_micro_batches)
    if kind == "gpipe":
        return num_micro_batches
    return min(num_micro_batches, num_stages - stage)


def compute_order(kind: str, num_stages: int, stage: int, num_micro_batches: int) -> list[tuple[str, int]]:
    """The order of ``("F", mb)``/``("B", mb)`` on one stage.

    GPipe: every forward, then every backward (in micro-batch order).  1F1B: ``warmup_count`` forwards, then
    alternately one forward and one backward (oldest first) until every forward ran, then the remaining
    backwards (cool-down).
    """
    m = num_micro_batches
    w = warmup_count(kind, num_stages, stage, m)
    order: list[tuple[str, int]] = [("F", i) for i in range(w)]
    next_b = 0
    for i in range(w, m):
        order.append(("F", i))
        order.append(("B", next_b))
        next_b += 1
    order.extend(("B", j) for j in range(next_b, m))
    return order


def build_schedule(kind: str, num_stages: int, stage: int, num_micro_batches: int) -> list[Action]:
    """The schedule of stage ``stage`` of a pipeline of ``num_stages`` stages running ``num_micro_batches``.

    ``PRE``, then :func:`compute_order` with each ``F`` wrapped by ``RECV_F``/``SEND_F`` and each ``B`` by
    ``RECV_B``/``SEND_B`` (where a neighbour exists), then ``POST``.

    >>> [str(a) for a in build_schedule("1f1b", 2, 0, 2)]
    ['Pre', 'F0', 'sF0@1', 'F1', 'sF1@1', 'rB0@1', 'B0', 'rB1@1', 'B1', 'Post']
    """
    return list(_built(kind, num_stages, stage, num_micro_batches))


@functools.lru_cache(maxsize=4096)
def _built(kind: str, num_stages: int, stage: int, num_micro_batches: int) -> tuple[Action, ...]:
    """:func:`build_schedule`'s actions, built once per argument tuple (a simulation asks for every stage of every
    pipeline; the editor and the planners simulate many plans of the same shapes)."""
    first, last = stage == 0, stage == num_stages - 1
    actions = [Action("PRE")]
    for op, mb in compute_order(kind, num_stages, stage, num_micro_batches):
        if op == "F":
            if not first:
                actions.append(Action("RECV_F", mb, stage - 1))
            actions.append(Action("F", mb))
            if not last:
                actions.append(Action("SEND_F", mb, stage + 1))
        else:
            if not last:
                actions.append(Action("RECV_B", mb, stage + 1))
            actions.append(Action("B", mb))
            if not first:
                actions.append(Action("SEND_B", mb, stage - 1))
    actions.append(Action("POST"))
    return tuple(actions)


def format_schedule(actions: Iterable[Action], *, compute_only: bool = True) -> str:
    """A compact string such as ``Pre F0 F1 B0 F2 B1 B2 Post`` (transfers dropped unless ``compute_only=False``)."""
    return " ".join(str(a) for a in actions if not compute_only or a.kind in ("PRE", "POST", "F", "B"))


# ---- replay ---------------------------------------------------------------------------------------------------
@dataclass
class ReplayResult:
    """What :func:`replay` found: the global order in which actions ran, and the busiest channel's backlog."""

    order: list[tuple[Hashable, Action]] = field(default_factory=list)
    max_pending: int = 0

    def steps(self, stage_key: Hashable) -> list[Action]:
        """The actions one stage ran, in its order."""
        return [a for k, a in self.order if k == stage_key]


def _stage_key(key: Hashable, peer: int) -> Hashable:
    """The key of stage ``peer`` in the same pipeline as ``key`` (keys are ``(pipeline, stage)``)."""
    if isinstance(key, tuple) and len(key) == 2:
        return (key[0], peer)
    return peer


def _check_local_order(key: Hashable, actions: Sequence[Action]) -> None:
    """Each micro-batch's F runs once, before its B which runs once; PRE first and POST last."""
    seen_f: set[int] = set()
    seen_b: set[int] = set()
    for i, a in enumerate(actions):
        if a.kind == "PRE" and i != 0 or a.kind == "POST" and i != len(actions) - 1:
            raise ScheduleError(f"stage {key}: {a.kind} at position {i}; it must come "
                                f"{'first' if a.kind == 'PRE' else 'last'}")
        if a.kind == "F":
            if a.micro_batch in seen_f:
                raise ScheduleError(f"stage {key}: F{a.micro_batch} runs twice")
            seen_f.add(a.micro_batch)  # type: ignore[arg-type]
        elif a.kind == "B":
            if a.micro_batch not in seen_f:
                raise ScheduleError(f"stage {key}: B{a.micro_batch} runs before F{a.micro_batch}")
            if a.micro_batch in seen_b:
                raise ScheduleError(f"stage {key}: B{a.micro_batch} runs twice")
            seen_b.add(a.micro_batch)  # type: ignore[arg-type]
    if seen_f != seen_b:
        raise ScheduleError(f"stage {key}: micro-batches {sorted(seen_f - seen_b)} run F but never B")


def replay(schedules: Mapping[Hashable, Sequence[Action]],
           execute: Callable[[Hashable, Action, Any], Any] | None = None) -> ReplayResult:
    """Run every stage's schedule together and prove it completes.

    ``schedules`` maps ``(pipeline, stage)`` (or a bare stage index for one pipeline) to that stage's actions.
    Sends are posted without blocking; a receive blocks until the send with the same kind, micro-batch and
    peers has been posted; each (sender, receiver, kind) channel delivers in order, so a receive that finds a
    different micro-batch at the head of its channel is a mismatch.  Raises :class:`ScheduleError` naming the
    stages on a deadlock (every unfinished stage blocked on a receive), on a mismatched or unknown peer, or on
    sends nobody receives.  Also checks each stage's local order (F before B for every micro-batch).

    ``execute(stage_key, action, payload)``, if given, is called for every action as it runs: a send's return
    value travels with the message and is the ``payload`` of the matching receive (``None`` otherwise).  The
    simulator uses this to time the same replay.
    """
    for key, actions in schedules.items():
        _check_local_order(key, actions)
    pos = {k: 0 for k in schedules}
    channels: dict[tuple[Hashable, Hashable, str], deque[tuple[int | None, Any]]] = {}
    result = ReplayResult()
    progressed = True
    while progressed:
        progressed = False
        for key, actions in schedules.items():
            while pos[key] < len(actions):
                a = actions[pos[key]]
                if a.kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
                    peer = _stage_key(key, a.peer)  # type: ignore[arg-type]
                    if peer not in schedules:
                        raise ScheduleError(f"stage {key}: {a} names stage {peer}, which has no schedule")
                    if a.kind in _SENDS:
                        q = channels.setdefault((key, peer, _SENDS[a.kind]), deque())
                        q.append((a.micro_batch, execute(key, a, None) if execute else None))
                        result.max_pending = max(result.max_pending, len(q))
                    else:
                        q = channels.setdefault((peer, key, a.kind), deque())
                        if not q:
                            break  # blocked: the matching send is not posted yet
                        got, payload = q.popleft()
                        if got != a.micro_batch:
                            raise ScheduleError(f"stage {key}: {a} received micro-batch {got} from stage {peer}; "
                                                "sends and receives are out of order")
                        if execute:
                            execute(key, a, payload)
                elif execute:
                    execute(key, a, None)
                result.order.append((key, a))
                pos[key] += 1
                progressed = True
    blocked = {k: actions[pos[k]] for k, actions in schedules.items() if pos[k] < len(actions)}
    if blocked:
        waits = ", ".join(f"stage {k} waits at {a}" for k, a in blocked.items())
        raise ScheduleError(f"deadlock: {waits}")
    leftover = {c: [mb for mb, _ in q] for c, q in channels.items() if q}
    if leftover:
        desc = ", ".join(f"{src}->{dst} {kind[-1]}{mbs}" for (src, dst, kind), mbs in leftover.items())
        raise ScheduleError(f"unmatched sends (never received): {desc}")
    return result
