"""A job's watchdog (launcher side): a thread that turns silence into failures (:mod:`.faults`).

Every tick it looks for a host whose agent or connection went quiet for ``spec.silent_s`` seconds (``connection
lost``, with the ranks it carried), a rank not heard for ``spec.silent_s`` seconds (:data:`START_GRACE_S` before its
first line: stopped, frozen, starved of CPU) and a rank that stayed out of communication for ``spec.stall_s`` seconds
while peers waited in communication for it (both ``hung``).  A hung rank is asked for its stack (faulthandler), and
the stderr lines that follow are its evidence.

The watchdog reads what the job records of each rank's life (:class:`Liveness`, kept by the job's reader threads
under the job's lock) and the worker groups; it reports through the two callbacks the job gives it
(``host_lost``, ``hung``), whose failures go to the job's policy.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..spec import LaunchSpec
from ..transports.transport import WorkerGroup

__all__ = ["Liveness", "Watchdog", "START_GRACE_S", "DUMP_WAIT_S"]

#: Seconds a rank may take to send its first line (Python start-up, imports on a loaded machine).
START_GRACE_S = 60.0
#: Seconds to wait for a hung rank's stack after asking for it.
DUMP_WAIT_S = 3.0


@dataclass
class Liveness:
    """A rank's life as the launcher saw it (monotonic receipt times: no clock of another host is trusted).

    ``started``: when its process was started; ``heard``: its last line of any kind; ``ready``: it joined the
    process group; ``beat``/``beat_at``: its last heartbeat and when it came; ``progress_at``: its last step (or
    readiness); ``returncode``: ``None`` while it runs; ``suspect``: the watchdog is reporting it; ``capture``: its
    stderr lines since its stack was asked for (``None`` when not asked)."""

    started: float = 0.0
    heard: float | None = None
    ready: bool = False
    beat: dict[str, Any] = field(default_factory=dict)
    beat_at: float = 0.0
    progress_at: float = 0.0
    returncode: int | None = None
    suspect: bool = False
    capture: list[str] | None = None

    def last_word(self) -> float:
        """When the rank was last heard (its start while it has said nothing)."""
        return self.heard if self.heard is not None else self.started


class Watchdog:
    """The watchdog thread of one job (see the module docstring).

    ``spec``: the job's launch spec now (``heartbeat_s``, ``silent_s``, ``stall_s``, ``job_id``); ``ranks``: launch
    rank -> :class:`Liveness` (the job's records, which the job may add to), read and written under ``lock``;
    ``groups``: the job's worker groups (a list the job appends to); ``ended``: set once the job ended;
    ``stopping``: whether the job is stopping every worker (nothing more is reported then); ``host_lost(group,
    why)`` and ``hung(rank, why, stack)``: report a failure to the job."""

    def __init__(self, spec: Callable[[], LaunchSpec], ranks: Mapping[int, Liveness], lock: threading.RLock,
                 groups: Sequence[WorkerGroup], *, ended: threading.Event, stopping: Callable[[], bool],
                 host_lost: Callable[[WorkerGroup, str], None], hung: Callable[[int, str, str], None]) -> None:
        self._spec, self._ranks, self._lock, self._groups = spec, ranks, lock, groups
        self._ended, self._stopping, self._host_lost, self._hung = ended, stopping, host_lost, hung
        self._thread = threading.Thread(target=self._run, name=f"hspmd-watch-{spec().job_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        """Every tick: hosts gone quiet, ranks gone quiet, ranks that others wait for in communication."""
        spec = self._spec()
        tick = min(0.25, spec.heartbeat_s / 2)
        while not self._ended.wait(tick):
            if self._stopping():
                continue
            spec, now = self._spec(), time.monotonic()
            for g in list(self._groups):
                if g.link_silence() > spec.silent_s and self._running(g.ranks):
                    self._host_lost(g, f"no word from its agent for {g.link_silence():.1f} s (network "
                                       "partition, host down, or agent frozen)")
            for r in self._silent_ranks(now):
                self._investigate([r], f"rank {r} hung: no heartbeat for {now - self._ranks[r].last_word():.1f} s "
                                       "(the process is stopped, frozen or starved of CPU)")
            if spec.stall_s is not None:
                self._check_stall(now, spec.stall_s)

    def _running(self, ranks: Sequence[int]) -> list[int]:
        with self._lock:
            return [r for r in ranks if self._ranks[r].returncode is None]

    def _group_of(self, rank: int) -> WorkerGroup | None:
        for g in list(self._groups):
            if rank in g.ranks:
                return g
        return None

    def _silent_ranks(self, now: float) -> list[int]:
        spec = self._spec()
        out = []
        quiet_links = {r for g in list(self._groups) if g.link_silence() > spec.heartbeat_s * 2
                       for r in g.ranks}  # the host link is quiet: that is the host's failure, not the rank's
        with self._lock:
            for r, rec in self._ranks.items():
                if rec.returncode is not None or rec.suspect or r in quiet_links or self._group_of(r) is None:
                    continue
                limit = spec.silent_s if rec.heard is not None else max(spec.silent_s, START_GRACE_S)
                if now - rec.last_word() > limit:
                    out.append(r)
        return out

    def _check_stall(self, now: float, stall: float) -> None:
        """Ranks continuously out of communication for ``stall`` seconds while peers waited in it as long, and no
        rank reported a step meanwhile: the ones out of communication hang."""
        with self._lock:
            live = {r: rec for r, rec in self._ranks.items() if rec.returncode is None}
            if not live or not all(rec.ready and rec.beat for rec in live.values()):
                return
            if any(rec.suspect for rec in live.values()):
                return
            if now - max(rec.progress_at for rec in self._ranks.values()) < stall:
                return

            def held(rec: Liveness, key: str) -> float:
                value = rec.beat.get(key)
                return -1.0 if value is None else float(value) + (now - rec.beat_at)
            waiting = {r: held(rec, "comm_s") for r, rec in live.items() if held(rec, "comm_s") >= 0}
            busy = {r: held(rec, "busy_s") for r, rec in live.items() if held(rec, "busy_s") >= stall}
        if busy and waiting and max(waiting.values()) >= stall:
            for r in sorted(busy):
                self._investigate([r], f"rank {r} hung: it has not entered communication for {busy[r]:.1f} s "
                                       f"while ranks {sorted(waiting)} have waited in communication for "
                                       f"{max(waiting.values()):.1f} s (stall_s={stall:g})")

    def _investigate(self, ranks: list[int], why: str) -> None:
        """Ask the hung ranks for their stacks, then report them (on a thread: the watchdog goes on)."""
        with self._lock:
            for r in ranks:
                self._ranks[r].suspect = True
                self._ranks[r].capture = []
        threading.Thread(target=self._report_hung, args=(ranks, why), name="hspmd-hung", daemon=True).start()

    def _report_hung(self, ranks: list[int], why: str) -> None:
        for r in ranks:
            g = self._group_of(r)
            if g is not None:
                try:
                    g.dump_stack(r)
                except Exception:  # noqa: BLE001 - no stack is no reason not to report the rank
                    pass
        stacks = {r: self._collect_stack(r) for r in ranks}
        for r in ranks:
            self._hung(r, why, stacks[r] or "(no stack arrived within {:g} s)".format(DUMP_WAIT_S))

    def _collect_stack(self, rank: int) -> str:
        """The stderr lines the rank wrote after the dump request: until 0.3 s pass without one."""
        rec = self._ranks[rank]
        deadline, last_len, last_change = time.monotonic() + DUMP_WAIT_S, 0, time.monotonic()
        while time.monotonic() < deadline and not self._ended.is_set():
            time.sleep(0.05)
            with self._lock:
                n = len(rec.capture or [])
            if n != last_len:
                last_len, last_change = n, time.monotonic()
            elif n and time.monotonic() - last_change > 0.3:
                break
        with self._lock:
            lines, rec.capture = rec.capture or [], None
        return "\n".join(lines)
