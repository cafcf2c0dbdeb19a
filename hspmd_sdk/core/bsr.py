"""Batched-send-receive (BSR, paper §5.3): the BSR table and the BSR scheme.

*Table*: the finest-grained slices of every owner box and receiver box (:class:`~.slices.Grid`), each with the
ranks that own it and the ranks that need it; cells with the same owners and receivers are merged back into
larger slices.  *Scheme*: one scan of the table; for each (slice, receiver):

(i) the receiver already owns the slice -> a local copy, no traffic;
(ii) otherwise the owner over the highest-bandwidth link (``Cluster.link``: a node's own link, the link between
     the nodes of one host where the cluster gives one, the inter-node network);
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
        nodes = cluster.nodes if cluster is not None else ()  # (a cluster has a node at least)
        self._node: dict[int, int] = {r: i for i, n in enumerate(nodes) for r in n.ranks}
        hosts: dict[str, list[int]] = {}
        for i, n in enumerate(nodes):
            hosts.setdefault(n.host, []).append(i)
        # without a cluster: one node (0), of no kind, on one host (0); hosts in order of first appearance
        self._kind: list[str] = [n.kind for n in nodes] or [""]
        self._host_nodes: list[list[int]] = list(hosts.values()) or [[0]]
        self._host: dict[int, int] = {i: h for h, on in enumerate(self._host_nodes) for i in on}
        self._bw: dict[tuple[str, str, bool, bool], float] = {}
        self._pair_bw: dict[tuple[int, int], float] = {}  # by (node, node): the same figure, looked up once
        self._placement: dict[tuple[int, ...], tuple[dict[int, int], dict[int, str], dict[int, int]]] = {}

    def node_kind(self, node: int) -> str:
        """Device kind of node ``node`` (``""`` without a cluster)."""
        return self._kind[node]

    def node_host(self, node: int) -> int:
        """Index (in order of first appearance) of the host of node ``node`` (0 without a cluster)."""
        return self._host[node]

    def host_nodes(self, host: int) -> list[int]:
        """The nodes of host ``host`` (``[0]`` without a cluster)."""
        return self._host_nodes[host]

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

        ``Cluster.link`` depends only on the two nodes' device kinds, whether the nodes are the same and whether
        they are on the same host, so it is asked once per such key.
        """
        if self.cluster is None:
            return 1.0
        return self.node_bandwidth(self.node(src), self.node(dst), src, dst)

    def node_bandwidth(self, a: int, b: int, src: int, dst: int) -> float:
        """:meth:`bandwidth` of ``src`` on node ``a`` to ``dst`` on node ``b`` (their nodes already known)."""
        bw = self._pair_bw.get((a, b))
        if bw is None:
            if self.cluster is None:
                return 1.0
            key = (self._kind[a], self._kind[b], a == b, self._host[a] == self._host[b])
            bw = self._bw.get(key)
            if bw is None:
                bw = self._bw[key] = self.cluster.link(src, dst).bandwidth
            self._pair_bw[(a, b)] = bw
        return bw

    def placement(self, ranks: tuple[int, ...]) -> tuple[dict[int, int], dict[int, str], dict[int, int]]:
        """Node, device kind and host of each of ``ranks``, worked out once per tuple of ranks (the owners of
        every slice of a layout are the same tuple)."""
        got = self._placement.get(ranks)
        if got is None:
            node = {r: self.node(r) for r in ranks}
            got = self._placement[ranks] = (node, {r: self._kind[n] for r, n in node.items()},
                                            {r: self._host[n] for r, n in node.items()})
        return got


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
            for (o, rs), box in sorted(coalesce(sig), key=lambda kb: kb[1])]  # in box order


def bsr_scheme(entries: Iterable[BSREntry], links: LinkModel, load: dict[int, int], *, heuristics: bool = True,
               failed: Iterable[int] = ()) -> list[Assignment]:
    """The BSR scheme: one owner per (slice, receiver), in one scan of the table (heuristics above).

    ``load`` (rank -> bytes sent so far) is updated in place.  Raises :class:`ResolutionError` for a slice that
    only failed ranks (or no rank) hold.

    Complexity O(p·(o + q·(h + k)·(c + log o))) for p entries, o owners and q receivers per entry, at most h nodes
    on one host, k device kinds among the owners and at most c owners on one host: a receiver's candidates are the
    least-loaded owner on each node of its host and, per device kind, the least-loaded owner on the other hosts
    (each such group of owners is over one link), so the scan no longer visits every owning node -- the paper's
    O(p·q) when, as in a data-parallel layout at 10k ranks, a slice has an owner on every one of 1,280 nodes.
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
        pool: _OwnerPool | None = None
        for r in e.receivers:
            if r in owner_set:
                out.append(Assignment(e.key, e.box, r, r, e.nbytes))
                continue
            if not heuristics:
                src = min(alive)
            else:
                if pool is None:
                    pool = _OwnerPool(alive, links, load)
                src = pool.take(r, e.nbytes)
            load[src] = load.get(src, 0) + e.nbytes
            out.append(Assignment(e.key, e.box, src, r, e.nbytes))
    return out


class _OwnerPool:
    """The owners of one slice, for rule (ii)/(iii): heaps of ``(load, rank)`` per node and per device kind.

    Entries are invalidated lazily: an owner's entry is current when its load equals ``self.load``; taking an
    owner pushes its new entry on both of its heaps."""

    def __init__(self, owners: Sequence[int], links: LinkModel, load: dict[int, int]) -> None:
        self.links = links
        self.load = {o: load.get(o, 0) for o in owners}
        self.node_of, self.kind_of, self.host_of = links.placement(tuple(owners))
        self.by_node: dict[int, list[tuple[int, int]]] = {}
        self.by_kind: dict[str, list[tuple[int, int]]] = {}
        for o in owners:
            self.by_node.setdefault(self.node_of[o], []).append((self.load[o], o))
            self.by_kind.setdefault(self.kind_of[o], []).append((self.load[o], o))
        for h in list(self.by_node.values()) + list(self.by_kind.values()):
            heapq.heapify(h)

    def _top(self, heap: list[tuple[int, int]], skip_host: int | None = None) -> tuple[int, int] | None:
        """The least ``(load, rank)`` of ``heap`` that is current and not on host ``skip_host``."""
        held = []
        top = None
        while heap:
            load, o = heap[0]
            if load != self.load[o]:
                heapq.heappop(heap)  # stale
            elif self.host_of[o] == skip_host:
                held.append(heapq.heappop(heap))
            else:
                top = heap[0]
                break
        for item in held:
            heapq.heappush(heap, item)
        return top

    def take(self, receiver: int, nbytes: int) -> int:
        """The owner the scheme picks for ``receiver`` (highest bandwidth, then least load, then lowest rank);
        its load grows by ``nbytes``."""
        links, by_node, node_of = self.links, self.by_node, self.node_of
        rnode = links.node(receiver)
        host = links.node_host(rnode)
        tops = [self._top(by_node[n]) for n in links.host_nodes(host) if n in by_node]
        tops += [self._top(heap, skip_host=host) for heap in self.by_kind.values()]
        bandwidth = links.node_bandwidth  # (a top of None: a heap with no owner to offer)
        load, src = min([(-bandwidth(node_of[t[1]], rnode, t[1], receiver), t[0], t[1])
                         for t in tops if t is not None])[1:]
        self.load[src] = load + nbytes
        entry = (load + nbytes, src)
        heapq.heappush(self.by_node[self.node_of[src]], entry)
        heapq.heappush(self.by_kind[self.kind_of[src]], entry)
        return src
