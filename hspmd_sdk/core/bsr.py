"""Batched-send-receive (BSR, paper §5.3): the BSR table and the BSR scheme.

*Table*: the finest-grained slices of every owner box and receiver box (:class:`~.slices.Grid`), each with the
ranks that own it and the ranks that need it; cells with the same owners and receivers are merged back into
larger slices.  *Scheme*: one scan of the table; for each (slice, receiver):

(i) the receiver already owns the slice -> a local copy, no traffic;
(ii) otherwise the owner over the highest-bandwidth link (``Cluster.link``: same node beats another node --
     topology, not host names);
(iii) at equal bandwidth, the owner with the least cumulative send bytes so far (``load``, shared by every
      table scanned with it: that is how the fused BSR of §7 balances all GPUs); ties go to the lowest rank.

With ``heuristics=False`` every slice a receiver does not own comes from its lowest-rank (surviving) owner --
the paper's baseline ("minimal rank IDs"); local copies (i) still apply.
Without a cluster every link is equal, so (ii) never decides.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Iterable, Sequence

from ..errors import ResolutionError
from .slices import Box, Grid, box_numel, coalesce, format_box

if TYPE_CHECKING:
    from .cluster import Cluster

__all__ = ["BSREntry", "Assignment", "LinkModel", "bsr_table", "bsr_scheme"]


@dataclass(frozen=True)
class BSREntry:
    """One row of a BSR table: a slice of tensor ``key``, who owns it, who needs it, its size in bytes."""

    key: Hashable
    box: Box
    owners: tuple[int, ...]
    receivers: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Assignment:
    """The scheme's decision for one (slice, receiver): ``src == dst`` is a local copy."""

    key: Hashable
    box: Box
    src: int
    dst: int
    nbytes: int


class LinkModel:
    """Bandwidth between ranks from a :class:`Cluster` (cached); all links equal without one."""

    def __init__(self, cluster: "Cluster | None") -> None:
        self.cluster = cluster
        self._node: dict[int, int] = {}
        self._kind: list[str] = []
        if cluster is not None:
            self._node = {r: i for i, n in enumerate(cluster.nodes) for r in n.ranks}
            self._kind = [n.kind for n in cluster.nodes]
        self._bw: dict[tuple[str, str, bool], float] = {}

    def node(self, rank: int) -> int:
        """Index of the node holding ``rank`` (0 without a cluster)."""
        if self.cluster is None:
            return 0
        try:
            return self._node[rank]
        except KeyError:
            raise ResolutionError(f"rank {rank} is not in {self.cluster}") from None

    def bandwidth(self, src: int, dst: int) -> float:
        """Bytes/s from ``src`` to ``dst`` (two different ranks).

        ``Cluster.link`` depends only on the two nodes' device kinds and whether the nodes are the same, so it is
        asked once per such key.
        """
        if self.cluster is None:
            return 1.0
        a, b = self.node(src), self.node(dst)
        key = (self._kind[a], self._kind[b], a == b)
        bw = self._bw.get(key)
        if bw is None:
            bw = self._bw[key] = self.cluster.link(src, dst).bandwidth
        return bw


def bsr_table(owners: Sequence[tuple[int, Box]], receivers: Sequence[tuple[int, Box]], shape: Sequence[int],
              itemsize: int, key: Hashable = None) -> list[BSREntry]:
    """The BSR table of one tensor: every slice some receiver needs, with its owners and receivers.

    ``owners``/``receivers``: ``(rank, box)``.  A slice nobody owns gets an entry with no owners; the scheme
    reports it.  Cost: linear in the number of (box, covered cell) pairs.
    """
    grid = Grid(shape, [b for _, b in owners] + [b for _, b in receivers])
    own: dict[tuple[int, ...], list[int]] = {}
    need: dict[tuple[int, ...], list[int]] = {}
    for r, box in sorted(owners):
        for cell in grid.cells_of(box):
            own.setdefault(cell, []).append(r)
    for r, box in sorted(receivers):
        for cell in grid.cells_of(box):
            need.setdefault(cell, []).append(r)
    sig = [((tuple(own.get(c, ())), tuple(rs)), grid.box(c)) for c, rs in need.items()]
    return [BSREntry(key, box, o, rs, box_numel(box) * itemsize)
            for (o, rs), box in coalesce(sig, order=lambda s: 0)]


def bsr_scheme(entries: Iterable[BSREntry], links: LinkModel, load: dict[int, int], *, heuristics: bool = True,
               failed: Iterable[int] = ()) -> list[Assignment]:
    """The BSR scheme: one owner per (slice, receiver), in one scan of the table (heuristics above).

    Complexity O(p·(o + q·(n + log o))) for p entries, at most o owners spread over n nodes and q receivers per
    entry -- the paper's O(p·q) when owners per slice are bounded, as they are: p does not grow with the cluster.
    ``load`` (rank -> bytes sent so far) is updated in place.  Raises :class:`ResolutionError` for a slice that
    only failed ranks (or no rank) hold.
    """
    dead = frozenset(failed)
    out: list[Assignment] = []
    for e in entries:
        alive = [o for o in e.owners if o not in dead]
        if not alive:
            held = f"held only by failed rank(s) {list(e.owners)}" if e.owners else "held by no source rank"
            raise ResolutionError(f"slice {format_box(e.box)} of tensor {e.key!r} is {held}; receivers "
                                  f"{list(e.receivers)} cannot get it. Keep a replica on a surviving rank or "
                                  "restore it from a checkpoint.")
        owner_set = set(alive)
        heaps: dict[int, list[tuple[int, int]]] | None = None
        for r in e.receivers:
            if r in owner_set:
                out.append(Assignment(e.key, e.box, r, r, e.nbytes))
                continue
            if not heuristics:
                src = min(alive)
            else:
                if heaps is None:
                    heaps = {}
                    for o in alive:
                        heaps.setdefault(links.node(o), []).append((load.get(o, 0), o))
                    for h in heaps.values():
                        heapq.heapify(h)
                best: tuple[float, int, int] | None = None  # (-bandwidth, load, rank)
                best_node = -1
                for node, h in heaps.items():
                    cand = (-links.bandwidth(h[0][1], r), h[0][0], h[0][1])
                    if best is None or cand < best:
                        best, best_node = cand, node
                assert best is not None
                src = best[2]
                heapq.heapreplace(heaps[best_node], (best[1] + e.nbytes, src))
            load[src] = load.get(src, 0) + e.nbytes
            out.append(Assignment(e.key, e.box, src, r, e.nbytes))
    return out
