"""A mixed-length job's switch to another candidate set (``Job.switch([...])``, SPEC §9), a policy of the job's
controller (:mod:`.controller`).

A mixed-length job chooses its Program per step among candidates (:mod:`.mixed`).  ``job.switch([c1, c2, ...])``
gives it another list, as ``launch`` takes one (Programs of the job's model and Strategies), in steps:

* **check and specialize** (:meth:`CandidateSwitch.switch`): the ranks of what is given, then the candidates
  specialized on the job's cluster and their dispatcher (:meth:`~.mixed.LengthPlanner.check_candidates`: one
  model, no ZeRO-3, the longest takes the data's context), before anything changes;
* **register**: the candidates become versions of the running world, after the world's earlier sets
  (:class:`CandidateSets`), so that an elastic recovery finds the Program a survivor holds and replans the set it
  belongs to (:meth:`~.recovery.Recovery.replan_candidates`);
* **plan and send** (:meth:`~.mixed.LengthPlanner.switch_candidates`): the first step not dispatched yet is
  dispatched among the new candidates, its message carrying them and the fused BSR from the running candidate;
  every worker switches there, at the step boundary (:class:`~..workers.mixed_worker.MixedSession`).

A grow of a mixed-length job (``Job.grow(cluster, [...])``, :mod:`.grow`) is such a switch onto candidates on the
larger cluster (:meth:`CandidateSwitch.grow`): the grow's dispatch also carries the grown world's rendezvous, and
the newcomers join there.

Versions and acknowledgements are those of any switch: the event (``reason="user"``) is ``done`` once every
worker switched, and its version ``(world, candidate)`` is then the newest every worker applied.  A failure before
the first step under the new candidates committed recovers from the state held before the switch, as for one
Program (the event is then ``superseded`` unless every survivor had switched).
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from ...errors import SwitchError
from .state import ControlState, Event
from .versions import Numbering, Version, Versions

if TYPE_CHECKING:
    from ...core.specialize import Program
    from ...core.strategy import Strategy
    from ...planner.mixed import Dispatcher
    from .stragglers import StragglerPolicy

__all__ = ["CandidateSets", "CandidateSwitch", "CandidateHost"]


class CandidateSets:
    """The candidate sets a mixed-length job's switches of candidates added to its worlds.

    A mixed-length job's versions are ``(world, candidate)``.  A world's first set (the launch's, or an elastic
    recovery's replanned on the survivors) is :class:`~.versions.Versions`' ``(world, 0..n-1)``; a switch appends
    its set after the world's earlier ones, ``(world, base..base+m-1)``, kept here."""

    def __init__(self) -> None:
        self.added: dict[int, list[tuple[int, list[Numbering]]]] = {}  #: world -> [(base, its candidates)]

    def add(self, world: int, first: int, numberings: Sequence[Numbering]) -> int:
        """Add a set to ``world`` (whose first set has ``first`` candidates); returns its ``base``."""
        sets = self.added.setdefault(world, [])
        base = sets[-1][0] + len(sets[-1][1]) if sets else first
        sets.append((base, list(numberings)))
        return base

    def get(self, version: Version) -> Numbering | None:
        """The Program and numbering of an added candidate, or ``None``."""
        world, j = version
        for base, numberings in self.added.get(world, ()):
            if base <= j < base + len(numberings):
                return numberings[j - base]
        return None

    def members(self, version: Version, first: int) -> list[Version]:
        """The versions of the set ``version`` belongs to (``first``: how many candidates its world's first set
        has); ``[]`` for none."""
        world, j = version
        if 0 <= j < first:
            return [(world, i) for i in range(first)]
        for base, numberings in self.added.get(world, ()):
            if base <= j < base + len(numberings):
                return [(world, base + i) for i in range(len(numberings))]
        return []


class CandidateHost(Protocol):
    """What the switch of candidates reads of its controller."""

    state: ControlState
    versions: Versions
    stragglers: "StragglerPolicy"
    mixed: bool
    length_planner: Any

    @property
    def current(self) -> Numbering: ...

    def acquire_quiet(self, what: str, outer: threading.Lock | None = None) -> None: ...


class CandidateSwitch:
    """A mixed-length job's switches to other candidates (see the module docstring), over its controller."""

    def __init__(self, host: CandidateHost) -> None:
        self.host = host
        self.sets = CandidateSets()  #: the sets added to the job's worlds

    def switch(self, candidates: Sequence["Program | Strategy"]) -> Event:
        """From the first step not dispatched yet, the dispatch chooses among ``candidates`` and the workers
        switch to the chosen one by one fused BSR at that step boundary; returns the :class:`~.state.Event`
        (``reason="user"``).  :class:`~hspmd_sdk.errors.SwitchError` before anything changes for a job that
        trains one Program, and for a list that cannot run: empty, an entry that is not a Program or Strategy,
        another model, ranks the job does not run or lost, ZeRO-3, a longest window below the data's context, or
        no step left to switch at."""
        host, planner = self.host, self.host.length_planner
        if not host.mixed or planner is None:
            raise SwitchError("a list of candidates is for a job that trains on mixed-length data; this job trains "
                              "one Program: pass one Program or Strategy")
        t0 = time.perf_counter()
        candidates = list(candidates)
        with host.state.lock:
            cur = host.current
            # the ranks of what is given (Programs, Strategies), before anything is specialized
            self.check_ranks({i: c for i, c in enumerate(candidates) if hasattr(c, "ranks")}, cur)
        programs, dispatcher = planner.check_candidates(candidates, cur.cluster)
        t1 = time.perf_counter()
        host.acquire_quiet("switch", outer=planner.sending)  # no dispatch sent meanwhile, no recovery under way
        try:
            cur, world = host.current, host.versions.world
            if world != planner.generation:
                raise SwitchError("the job reconfigured after a failure meanwhile: switch again, with candidates "
                                  "on job.cluster")
            self.check_ranks(dict(enumerate(programs)), cur)  # none lost since
            planner.boundary()  # a step is left to switch at
            base = self.sets.add(world, host.versions.candidate_count(world),
                                 [Numbering(p, cur.cluster, dict(cur.to_launch)) for p in programs])
            event = planner.switch_candidates(programs, dispatcher, base=base,
                                              seconds={"plan": 0.0, "specialize": t1 - t0})
            host.stragglers.reset()
        finally:
            host.state.lock.release()
            planner.sending.release()
        return event

    def grow(self, event: Event, programs: Sequence["Program"], dispatcher: "Dispatcher", grown: Numbering,
             grow: Mapping[str, Any]) -> None:
        """Send an announced grow of a mixed-length job (``Job.grow``, :mod:`.grow`; the caller holds the
        dispatch's :attr:`~.mixed.LengthPlanner.sending` and the controller's lock, and checked that the world did
        not change): ``programs`` (on ``grown``'s cluster and numbering: the running ranks keep their numbers, the
        newcomers follow) become a candidate set of the running world and the job's current numbering, and the
        first step not dispatched yet is dispatched among them, its message carrying them, the grown world's
        rendezvous (``grow``) and the fused BSR from the running candidate; every worker, the newcomers too,
        switches there.  ``event`` (``reason="grow"``) is ``done`` once every worker switched."""
        host, planner = self.host, self.host.length_planner
        world = host.versions.world
        if world != planner.generation:
            raise SwitchError("the job reconfigured after a failure while the newcomers started: grow it again "
                              "onto job.cluster plus new ranks")
        planner.boundary()  # a step is left to grow at
        base = self.sets.add(world, host.versions.candidate_count(world),
                             [Numbering(p, grown.cluster, dict(grown.to_launch)) for p in programs])
        host.versions.current = Numbering(programs[0], grown.cluster, dict(grown.to_launch))  # alive: all of them
        planner.switch_candidates(programs, dispatcher, base=base, seconds=event.seconds, cluster=grown.cluster,
                                  grow=grow, event=event)
        host.stragglers.reset()

    def check_ranks(self, candidates: Mapping[int, "Program | Strategy"], cur: Numbering) -> None:
        """Each of the new candidates (by its index in the list: a Program or a Strategy) runs on the job's ranks
        now, none of them lost."""
        for i, c in candidates.items():
            outside = sorted(set(c.ranks) - set(cur.to_launch))
            dead = sorted(r for r in c.ranks if r in cur.to_launch and cur.to_launch[r] in self.host.state.dead)
            why = (f"uses ranks {outside} that the job does not run (its ranks now: {sorted(cur.to_launch)}); "
                   "give candidates for job.cluster") if outside else f"uses ranks {dead}, which failed" if dead else ""
            if why:
                raise SwitchError(f"invalid switch of a mixed-length job's candidates: candidates[{i}]: {why}")
