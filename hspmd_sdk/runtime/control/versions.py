"""The plan versions a running job's workers may hold, and which of them every worker applied (paper §7, §9 (b)).

Every plan change of a running job starts from a layout the workers really hold, never from one merely requested
(:mod:`.controller`).  Each state is a *version* ``(reconfiguration, switch)``, ordered as they were made
(lexicographically): a user switch or a grow opens ``(world, switch + 1)`` on the running world, an elastic
recovery opens the world ``world + 1`` and with it ``(world + 1, switch)`` (its *switch floor*: the workers skip
the switches requested before it).  A mixed-length job's versions are ``(reconfiguration, candidate)``: a worker
holds the state of the candidate it last switched to, and every candidate of a world is a version of it.

:class:`Versions` keeps them, with no threads and no I/O (the controller calls it under its lock):

* :meth:`Versions.open_switch` / :meth:`Versions.open_reconfiguration` make the newest version the job's
  ``current`` one;
* :meth:`Versions.applied` records that every worker applied a version from a step on, and :meth:`Versions.prune`
  drops the versions no worker can offer any more once a step under it committed;
* :func:`common_previous` and :func:`version_for_all` read the survivors' ``halted`` reports after a failure:
  which version they can all recover from, and what each offers of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ...errors import HSPMDError

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.specialize import Program

__all__ = ["Version", "Numbering", "Versions", "common_previous", "version_for_all", "with_newcomers"]

Version = tuple[int, int]
"""``(reconfiguration id, switch id)``, or ``(reconfiguration id, candidate)`` in a mixed-length job."""


@dataclass
class Numbering:
    """A Program, its cluster and how its ranks map to launch ranks (the processes the launcher started, whose
    numbers never change)."""

    program: "Program"
    cluster: "Cluster"
    to_launch: dict[int, int]  # program rank -> launch rank

    @property
    def of_launch(self) -> dict[int, int]:
        """Launch rank -> program rank."""
        return {l: r for r, l in self.to_launch.items()}


class Versions:
    """Every version the workers of one job may still hold (see the module docstring).

    ``current``: the newest version requested (a user switch is planned from it: the workers apply every switch in
    order); ``world``: the id of the newest reconfiguration after a failure (0: none yet); ``switches``: the number
    of switches and grows opened so far; ``acked``: the newest version every worker applied and its first step."""

    def __init__(self, first: Numbering) -> None:
        self.current = first
        self.world = 0
        self.switches = 0
        self.acked: tuple[Version, int] | None = None
        self._held: dict[Version, Numbering] = {(0, 0): first}
        self._candidates: dict[int, int] = {}  # mixed: reconfiguration id -> how many candidates it has

    def get(self, version: Version) -> Numbering | None:
        """The Program and numbering of ``version``; ``None`` once pruned, or never made."""
        return self._held.get(version)

    def __contains__(self, version: object) -> bool:
        return version in self._held

    def held(self) -> list[Version]:
        """The versions kept, oldest first."""
        return sorted(self._held)

    def use_candidates(self, programs: Sequence["Program"], first: int) -> None:
        """Make this a mixed-length job's: the world's versions are ``(0, i)`` for each of ``programs`` on the
        current numbering, and ``(0, first)`` is current."""
        cur = self.current
        self._held = {(0, i): Numbering(p, cur.cluster, dict(cur.to_launch)) for i, p in enumerate(programs)}
        self._candidates = {0: len(programs)}
        self.current = self._held[(0, first)]

    def candidate_count(self, world: int) -> int:
        """How many candidates the mixed-length world ``world`` has (0: none known)."""
        return self._candidates.get(world, 0)

    def open_switch(self, numbering: Numbering) -> tuple[int, Version]:
        """A new switch (or grow) onto ``numbering``, the current version from now on: its switch id and version
        ``(world, id)``."""
        self.switches += 1
        self.current = numbering
        version = (self.world, self.switches)
        self._held[version] = numbering
        return self.switches, version

    def open_reconfiguration(self, numbering: Numbering, candidates: Sequence["Program"] | None = None
                             ) -> tuple[int, int, Version | None]:
        """A new world after a failure, running ``numbering``: its reconfiguration id, the switch floor (the
        switches requested before it, which the workers skip) and its version ``(id, floor)``.  For a mixed-length
        job, ``candidates`` (the world's Programs, on ``numbering``'s cluster and ranks) are its versions ``(id,
        j)`` instead, and the returned version is ``None`` (the dispatch chooses which runs)."""
        self.world += 1
        self.current = numbering
        if candidates is not None:
            for j, p in enumerate(candidates):
                self._held[(self.world, j)] = Numbering(p, numbering.cluster, dict(numbering.to_launch))
            self._candidates[self.world] = len(candidates)
            return self.world, self.switches, None
        version = (self.world, self.switches)
        self._held[version] = numbering
        return self.world, self.switches, version

    def applied(self, version: Version | None, step: int) -> None:
        """Every worker applied ``version`` (``None``: a change with no version of its own), running it from
        ``step``; an older version than the newest applied changes nothing."""
        if version is not None and (self.acked is None or version > self.acked[0]):
            self.acked = (version, step)

    def prune(self, step: int) -> None:
        """``step`` committed: once it is a step of the newest version every worker applied, nobody holds (or keeps
        as ``previous``) anything older, which is dropped."""
        if self.acked is None or step < self.acked[1]:
            return
        newest = self.acked[0]
        for key in [k for k in self._held if k < newest]:
            del self._held[key]

    def for_all(self, halted: Mapping[int, Mapping[str, Any]]) -> tuple[Version, dict[int, str]] | None:
        """:func:`version_for_all` among the versions kept."""
        return version_for_all(halted, self._held)


def _version(value: Sequence[Any]) -> Version:
    a, b = value
    return int(a), int(b)


def common_previous(halted: Mapping[int, Mapping[str, Any]]) -> Version | None:
    """``halted``: launch rank -> its ``halted`` report (each has ``step``, ``source`` and ``held``).  The version every survivor can still offer from before the last switch, when the survivors report the
    running state (``live``, from inside the first commit after the switch, with ``previous_held``) and the state
    from before it (``previous``) at one step; ``None`` when some survivor has only its running state (it completed
    that commit: the others must finish it)."""
    versions: set[Version] = set()
    for m in halted.values():
        kept = m.get("held") if m.get("source") == "previous" else m.get("previous_held")
        if kept is None:
            return None
        versions.add(_version(kept))
    steps = {int(m["step"]) for m in halted.values()}
    return versions.pop() if len(versions) == 1 and len(steps) == 1 else None


def with_newcomers(src: Numbering, grown: Numbering) -> Numbering:
    """``src``'s Program on the ``grown`` cluster and numbering (a grow keeps the running ranks' numbers and adds
    new ones): the source of a reconfiguration in which the grow's newcomers take part holding nothing."""
    if any(grown.to_launch.get(r) != l for r, l in src.to_launch.items()):
        raise HSPMDError(f"the survivors hold the state of a plan whose ranks {src.to_launch} are not the first "
                         f"ranks of the newest one {grown.to_launch}: its newcomers cannot join a switch from it")
    return Numbering(src.program, grown.cluster, dict(grown.to_launch))


def version_for_all(halted: Mapping[int, Mapping[str, Any]], versions: Mapping[Version, Numbering]
                    ) -> tuple[Version, dict[int, str]] | None:
    """A plan version to recover from when the survivors (at one step) hold different ones, and what each offers
    of it (``"live"``: its running state, ``"previous"``: the state it kept from before the last switch,
    ``"nothing"``: it is not among that version's ranks, and takes part holding nothing).  Every survivor among the
    version's ranks must offer it; the one fewest survivors give up their state for wins, then the older one.
    ``None`` when there is none."""
    offers: dict[int, dict[Version, str]] = {}
    for r, m in halted.items():
        mine: dict[Version, str] = {}
        held = _version(m["held"])
        whole = m.get("whole")
        if m.get("source") == "previous":
            mine[held] = "previous"
            if whole is not None:
                mine[_version(whole)] = "live"
        else:
            if whole is not None and _version(whole) == held:
                mine[held] = "live"
            if m.get("previous_held") is not None:
                mine[_version(m["previous_held"])] = "previous"
        offers[r] = mine
    best: tuple[int, Version, dict[int, str]] | None = None
    for v in sorted({v for mine in offers.values() for v in mine}):
        numbering = versions.get(v)
        if numbering is None:
            continue
        members = set(numbering.to_launch.values())
        if any(v not in offers[r] for r in halted if r in members) or not any(r in members for r in halted):
            continue
        offer = {r: offers[r].get(v, "nothing") for r in halted}
        given_up = sum(kind == "nothing" for kind in offer.values())
        if best is None or given_up < best[0]:
            best = (given_up, v, offer)
    return None if best is None else (best[1], best[2])
