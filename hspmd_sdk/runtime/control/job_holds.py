"""Holds at step boundaries (``hold_at=``, a test hook; :class:`JobHolds`, a part of :class:`~.job.Job`): every
worker waits at the start of the held steps until released, so that a test can race a request (``switch``,
``grow``, ``stop``) against a running job at a known step."""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ...errors import RuntimeFailure
from ..spec import LaunchSpec

if TYPE_CHECKING:
    from .job_stream import RankRecord
    from .state import Event

__all__ = ["JobHolds"]


class JobHolds:
    """The job's holds; the state it keeps is the job's own (:class:`~.job.Job` sets every attribute below, the
    reader threads record the holds the workers report)."""

    spec: LaunchSpec
    controller: Any
    notes: list[str]
    _lock: threading.RLock
    _done: threading.Event
    _ranks: dict[int, "RankRecord"]
    _held: dict[int, dict[int, dict[str, Any]]]
    _released: set[int]
    _newcomers: set[int]

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
