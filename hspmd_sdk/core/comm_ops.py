"""The communication IR: the operators a :class:`CommPlan` is made of (paper §5, SPEC §2).

Every operator says exactly what the runtime does, in global coordinates, so nothing is re-derived later:

* :class:`CollectiveOp` -- a bottom-tier collective (``AllReduce``, ``ReduceScatter``, ``AllGather``,
  ``AllToAll``) or the local ``LocalSplit``: ordered rank groups, and per rank the box it holds before (``in``)
  and after (``out``).  Group order is the collective's rank order: ``AllGather`` concatenates along ``dim`` in
  group order, ``ReduceScatter`` hands chunk ``i`` along ``dim`` to member ``i``, ``AllToAll`` sends member
  ``j`` the part of its input inside ``out_boxes[j]`` and concatenates what it receives along ``src_dim``.
* :class:`SplitCollectiveOp` -- a top-tier collective (``SplitAllReduce``, ``SplitReduceScatter``,
  ``SplitAllGather``): one :class:`SliceCollective` per finest-grained slice, over the ranks that hold or need
  it.  The contributors' parts of the slice are summed (one contributor: a broadcast) and written to every
  receiver.
* :class:`PointToPointOp` -- ``SendRecv`` and ``BSR``: messages ``(src, dst, box)``, local copies, and ranks
  whose output is zeros (the non-zero-index summands of a Partial destination: the decomposition used for a
  partial destination is "summand 0 holds the value, the others hold zeros").
* :class:`IdentityOp` -- nothing moves.

Every operator type answers the same questions the same way: ``ranks()`` (who takes part),
``collective_groups()`` (the rank groups that run a collective together), ``p2p_edges()`` (point-to-point
``(src, dst)`` pairs), ``transfers()`` (bytes sent, for pricing), ``apply`` and ``describe``.

Each operator reads the per-rank tensors as they were *before* it and writes the ranks in ``out_boxes``; ranks
it does not write keep their tensor.  ``apply`` executes that on numpy arrays or torch tensors in one process
(the reference semantics of the runtime), ``transfers`` lists the bytes each rank sends under the ring
algorithms (see :func:`ring_transfers`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Iterable, Mapping

from .slices import Box, box_intersect, box_numel, box_shape, format_box, relative, zeros

__all__ = ["OpKind", "Transfer", "Message", "CollectiveGroup", "CollectiveOp", "SliceCollective", "SplitCollectiveOp",
           "PointToPointOp", "IdentityOp", "CommOp", "ring_transfers", "ring_numel"]

#: ``(sender, receiver, bytes, steps)``: bytes one rank sends to another inside one operator, in ``steps``
#: messages (each step pays the link latency once).
Transfer = tuple[int, int, int, int]


class OpKind(StrEnum):
    """The kind of a communication operator, by its SPEC name (a ``str``: ``OpKind.ALL_REDUCE == "AllReduce"``, so
    a Program's JSON and its printed plans carry the plain names).  The one vocabulary of communication: the
    resolver builds operators of these kinds, the runtime dispatches on them, and the cost model prices ring
    collectives by :meth:`ring` -- the formula :meth:`CollectiveOp.transfers` uses.  The cost model's older
    spellings (``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``) read back as the same members."""

    ALL_REDUCE = "AllReduce"
    REDUCE_SCATTER = "ReduceScatter"
    ALL_GATHER = "AllGather"
    ALL_TO_ALL = "AllToAll"
    LOCAL_SPLIT = "LocalSplit"
    SPLIT_ALL_REDUCE = "SplitAllReduce"
    SPLIT_REDUCE_SCATTER = "SplitReduceScatter"
    SPLIT_ALL_GATHER = "SplitAllGather"
    SEND_RECV = "SendRecv"
    BSR = "BSR"
    IDENTITY = "Identity"

    @classmethod
    def _missing_(cls, value: object) -> "OpKind | None":
        return _SNAKE.get(value) if isinstance(value, str) else None

    def ring(self, members: int, nbytes: float) -> tuple[float, int]:
        """``(bytes, steps)`` each of ``members`` ranks sends its ring successor in this ring collective over a
        buffer of ``nbytes`` per rank -- the *whole* tensor for ``AllReduce``/``ReduceScatter``, the *gathered*
        one for ``AllGather``: ``2(g-1)/g`` of it in ``2(g-1)`` steps for ``AllReduce``, ``(g-1)/g`` of it in
        ``g-1`` steps for the other two; nothing for a group of one.  Raises ``ValueError`` for a kind that is
        not a ring collective."""
        if self not in (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER):
            raise ValueError(f"{self.value} is not a ring collective (AllReduce, ReduceScatter, AllGather)")
        if members <= 1:
            return 0.0, 0
        if self is OpKind.ALL_REDUCE:
            return 2 * (members - 1) * nbytes / members, 2 * (members - 1)
        return (members - 1) * nbytes / members, members - 1


_SNAKE = {"all_reduce": OpKind.ALL_REDUCE, "reduce_scatter": OpKind.REDUCE_SCATTER, "all_gather": OpKind.ALL_GATHER,
          "all_to_all": OpKind.ALL_TO_ALL}


class _Kinded:
    """An operator's ``kind`` is an :class:`OpKind`: a plain name (a Program's JSON) reads back typed."""

    kind: OpKind

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OpKind(self.kind))  # a member reads back as itself


def ring_numel(kind: OpKind, in_boxes: "tuple[Box, ...]") -> int:
    """Elements of a ring collective's buffer, from its members' input boxes: the tensor reduced (a member's box)
    for ``AllReduce``/``ReduceScatter``, the one gathered (every member's part, uneven parts too) for
    ``AllGather`` -- the ``nbytes`` of :meth:`OpKind.ring` in elements."""
    return sum(box_numel(b) for b in in_boxes) if kind is OpKind.ALL_GATHER else box_numel(in_boxes[0])


# ---- array helpers (numpy or torch, imported by the caller) ------------------------------------------------


def _clone(t: Any) -> Any:
    return t.clone() if hasattr(t, "clone") else t.copy()




def _check_local(rank: int, t: Any, box: Box, what: str) -> None:
    if tuple(t.shape) != box_shape(box):
        raise ValueError(f"{what}: rank {rank} holds a tensor of shape {tuple(t.shape)} but the plan expects the "
                         f"box {format_box(box)} of shape {box_shape(box)}")


def ring_transfers(ranks: tuple[int, ...], nbytes: int, steps: int) -> list[Transfer]:
    """Each member of a ring sends ``nbytes`` to its successor (``ranks[i] -> ranks[i+1]``, cyclic)."""
    g = len(ranks)
    if g < 2 or nbytes == 0:
        return []
    return [(ranks[i], ranks[(i + 1) % g], nbytes, steps) for i in range(g)]


# ---- operators ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    """One point-to-point transfer: ``src`` sends its part ``box`` (global coordinates) to ``dst``."""

    src: int
    dst: int
    box: Box
    nbytes: int


@dataclass(frozen=True)
class CollectiveGroup:
    """One collective call: its ranks in collective order and each one's box before and after."""

    ranks: tuple[int, ...]
    in_boxes: tuple[Box, ...]
    out_boxes: tuple[Box, ...]


@dataclass(frozen=True)
class CollectiveOp(_Kinded):
    """A bottom-tier collective, or ``LocalSplit`` (local slicing, one single-rank group per rank).

    Volumes (bytes a member sends to its ring successor, :meth:`OpKind.ring`; ``B`` = bytes of the ring's buffer:
    the input tensor, or for ``AllGather`` the gathered one, every member's part; ``g`` = group size):
    ``AllReduce`` 2(g-1)/g·B in 2(g-1) steps; ``ReduceScatter`` and ``AllGather`` (g-1)/g·B in g-1 steps (an even
    ``AllGather``: (g-1) times a member's part); ``AllToAll`` sends each peer the part of its input that peer keeps,
    one step each.
    """

    kind: OpKind
    groups: tuple[CollectiveGroup, ...]
    itemsize: int
    dim: int | None = None
    src_dim: int | None = None

    def ranks(self) -> frozenset[int]:
        """Every rank that takes part (``LocalSplit``: every rank that slices)."""
        return frozenset(r for g in self.groups for r in g.ranks)

    def collective_groups(self) -> tuple[tuple[int, ...], ...]:
        """The rank groups that run a collective together (groups of one rank run nothing)."""
        return tuple(g.ranks for g in self.groups if len(g.ranks) > 1)

    def p2p_edges(self) -> tuple[tuple[int, int], ...]:
        return ()

    def transfers(self) -> list[Transfer]:
        out: list[Transfer] = []
        for grp in self.groups:
            g = len(grp.ranks)
            if g < 2:
                continue
            if self.kind in (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER):
                nbytes, steps = self.kind.ring(g, ring_numel(self.kind, grp.in_boxes) * self.itemsize)
                out += ring_transfers(grp.ranks, int(nbytes), steps)
            elif self.kind is OpKind.ALL_TO_ALL:
                for i, src in enumerate(grp.ranks):
                    for j, dst in enumerate(grp.ranks):
                        part = box_intersect(grp.in_boxes[i], grp.out_boxes[j])
                        if i != j and part is not None:
                            out.append((src, dst, box_numel(part) * self.itemsize, 1))
        return out

    def apply(self, state: Mapping[int, Any]) -> dict[int, Any]:
        new: dict[int, Any] = {}
        for grp in self.groups:
            ins = []
            for r, box in zip(grp.ranks, grp.in_boxes):
                _check_local(r, state[r], box, self.kind)
                ins.append(state[r])
            if self.kind in (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER):
                total = _clone(ins[0])
                for t in ins[1:]:
                    total = total + t
                for r, box in zip(grp.ranks, grp.out_boxes):
                    new[r] = _clone(total[relative(box, grp.in_boxes[0])])
            elif self.kind is OpKind.LOCAL_SPLIT:
                for r, ib, ob in zip(grp.ranks, grp.in_boxes, grp.out_boxes):
                    new[r] = _clone(state[r][relative(ob, ib)])
            elif self.kind in (OpKind.ALL_GATHER, OpKind.ALL_TO_ALL):
                for r, ob in zip(grp.ranks, grp.out_boxes):
                    buf = zeros(ins[0], box_shape(ob))
                    for t, ib in zip(ins, grp.in_boxes):
                        part = box_intersect(ib, ob)
                        if part is not None:
                            buf[relative(part, ob)] = t[relative(part, ib)]
                    new[r] = buf
            else:  # pragma: no cover - construction guarantees the kinds above
                raise ValueError(f"unknown collective kind {self.kind!r}")
        return new

    def describe(self) -> list[str]:
        dims = f" dim={self.dim}" if self.dim is not None else ""
        if self.src_dim is not None:
            dims = f" dim {self.src_dim}->{self.dim}"
        lines = [f"{self.kind}{dims}: {len(self.groups)} group(s)"]
        for grp in self.groups[:8]:
            lines.append(f"    ranks {list(grp.ranks)}  in {format_box(grp.in_boxes[0])} -> out "
                         + ", ".join(format_box(b) for b in dict.fromkeys(grp.out_boxes)))
        if len(self.groups) > 8:
            lines.append(f"    ... {len(self.groups) - 8} more")
        return lines


@dataclass(frozen=True)
class SliceCollective:
    """One top-tier collective over one finest-grained slice ``box``.

    ``ranks``: every participant, ascending.  The ``contributors``' parts of ``box`` are summed (a single
    contributor makes it a broadcast) and the sum is written into every receiver's output at ``box``.
    """

    box: Box
    ranks: tuple[int, ...]
    contributors: tuple[int, ...]
    receivers: tuple[int, ...]

    def transfers(self, itemsize: int) -> list[Transfer]:
        """Broadcast: a chain contributor -> receivers, each link carries B.  Reduction: ring reduce-scatter
        over ``ranks`` ((g-1)/g·B each), then each member sends its reduced B/g chunk to each other receiver
        (a ring all-reduce, 2(g-1)/g·B each, when every member receives)."""
        b = box_numel(self.box) * itemsize
        if len(self.contributors) == 1:
            chain = list(self.contributors) + [r for r in self.receivers if r != self.contributors[0]]
            return [(chain[i], chain[i + 1], b, 1) for i in range(len(chain) - 1)]
        g = len(self.ranks)
        if set(self.receivers) == set(self.ranks):
            return ring_transfers(self.ranks, 2 * (g - 1) * b // g, 2 * (g - 1))
        out = ring_transfers(self.ranks, (g - 1) * b // g, g - 1)
        for r in self.ranks:
            for q in self.receivers:
                if q != r:
                    out.append((r, q, b // g, 1))
        return out


@dataclass(frozen=True)
class SplitCollectiveOp(_Kinded):
    """A top-tier collective across sharding subgroups (§5.2): one :class:`SliceCollective` per slice.

    ``in_boxes``/``out_boxes``: ``(rank, box)`` held before/after.  A rank in ``out_boxes`` that receives no
    slice holds zeros (a non-zero-index summand of a Partial destination).
    """

    kind: OpKind
    src_hdim: int
    dst_hdim: int
    slices: tuple[SliceCollective, ...]
    in_boxes: tuple[tuple[int, Box], ...]
    out_boxes: tuple[tuple[int, Box], ...]
    itemsize: int

    def ranks(self) -> frozenset[int]:
        """Every rank of a slice collective, and the ranks that only receive zeros."""
        return frozenset(r for s in self.slices for r in s.ranks) | frozenset(r for r, _ in self.out_boxes)

    def collective_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(s.ranks for s in self.slices if len(s.ranks) > 1)

    def p2p_edges(self) -> tuple[tuple[int, int], ...]:
        return ()

    def transfers(self) -> list[Transfer]:
        return [t for s in self.slices for t in s.transfers(self.itemsize)]

    def apply(self, state: Mapping[int, Any]) -> dict[int, Any]:
        inb = dict(self.in_boxes)
        for r, box in self.in_boxes:
            _check_local(r, state[r], box, self.kind)
        like = state[self.in_boxes[0][0]]
        new = {r: zeros(like, box_shape(box)) for r, box in self.out_boxes}
        outb = dict(self.out_boxes)
        for s in self.slices:
            c0 = s.contributors[0]
            total = _clone(state[c0][relative(s.box, inb[c0])])
            for c in s.contributors[1:]:
                total = total + state[c][relative(s.box, inb[c])]
            for r in s.receivers:
                new[r][relative(s.box, outb[r])] = total
        return new

    def describe(self) -> list[str]:
        lines = [f"{self.kind} hdim {self.src_hdim}->{self.dst_hdim}: {len(self.slices)} slice collective(s)"]
        for s in self.slices[:8]:
            lines.append(f"    slice {format_box(s.box)} over {list(s.ranks)}: sum of {list(s.contributors)} "
                         f"-> {list(s.receivers)}")
        if len(self.slices) > 8:
            lines.append(f"    ... {len(self.slices) - 8} more")
        return lines


@dataclass(frozen=True)
class PointToPointOp(_Kinded):
    """``SendRecv`` or ``BSR``: messages, local copies ``(rank, box)`` and zero-filled outputs.

    ``in_boxes``: what senders and copiers hold before; ``out_boxes``: what every writing rank holds after.  The
    output of a rank is assembled from its local copies and the messages it receives; ranks in ``zero_fill``
    hold zeros.  Each message is one transfer of its bytes, one step.
    """

    kind: OpKind
    messages: tuple[Message, ...]
    copies: tuple[tuple[int, Box], ...]
    in_boxes: tuple[tuple[int, Box], ...]
    out_boxes: tuple[tuple[int, Box], ...]
    zero_fill: tuple[int, ...] = ()

    def ranks(self) -> frozenset[int]:
        """Senders, receivers, ranks that copy locally or are zero-filled, and every rank that writes."""
        return (frozenset(r for m in self.messages for r in (m.src, m.dst)) | frozenset(r for r, _ in self.copies)
                | frozenset(self.zero_fill) | frozenset(r for r, _ in self.out_boxes))

    def collective_groups(self) -> tuple[tuple[int, ...], ...]:
        return ()

    def p2p_edges(self) -> tuple[tuple[int, int], ...]:
        """``(src, dst)`` of each message between different ranks."""
        return tuple((m.src, m.dst) for m in self.messages if m.src != m.dst)

    def transfers(self) -> list[Transfer]:
        return [(m.src, m.dst, m.nbytes, 1) for m in self.messages if m.src != m.dst]

    def apply(self, state: Mapping[int, Any]) -> dict[int, Any]:
        inb = dict(self.in_boxes)
        for r, box in self.in_boxes:
            _check_local(r, state[r], box, self.kind)
        like = state[self.in_boxes[0][0]] if self.in_boxes else next(iter(state.values()))
        new = {r: zeros(like, box_shape(box)) for r, box in self.out_boxes}
        outb = dict(self.out_boxes)
        for r, box in self.copies:
            new[r][relative(box, outb[r])] = state[r][relative(box, inb[r])]
        for m in self.messages:
            new[m.dst][relative(m.box, outb[m.dst])] = state[m.src][relative(m.box, inb[m.src])]
        return new

    def describe(self) -> list[str]:
        lines = [f"{self.kind}: {len(self.messages)} message(s), {len(self.copies)} local cop(ies)"
                 + (f", zeros on {list(self.zero_fill)}" if self.zero_fill else "")]
        for m in self.messages[:12]:
            lines.append(f"    {m.src} -> {m.dst}  {format_box(m.box)}  {m.nbytes} B")
        if len(self.messages) > 12:
            lines.append(f"    ... {len(self.messages) - 12} more")
        return lines


@dataclass(frozen=True)
class IdentityOp(_Kinded):
    """Nothing moves: source and destination layouts agree on every rank."""

    kind: OpKind = field(default=OpKind.IDENTITY)

    def ranks(self) -> frozenset[int]:
        return frozenset()

    def collective_groups(self) -> tuple[tuple[int, ...], ...]:
        return ()

    def p2p_edges(self) -> tuple[tuple[int, int], ...]:
        return ()

    def transfers(self) -> list[Transfer]:
        return []

    def apply(self, state: Mapping[int, Any]) -> dict[int, Any]:
        return {}

    def describe(self) -> list[str]:
        return ["Identity: nothing moves"]


CommOp = CollectiveOp | SplitCollectiveOp | PointToPointOp | IdentityOp


def merge_p2p(ops: Iterable[PointToPointOp]) -> PointToPointOp:
    """One point-to-point operator from several on disjoint outputs (``BSR`` unless all are ``SendRecv``)."""
    ops = list(ops)
    kind = OpKind.SEND_RECV if all(o.kind is OpKind.SEND_RECV for o in ops) else OpKind.BSR
    return PointToPointOp(kind, tuple(m for o in ops for m in o.messages), tuple(c for o in ops for c in o.copies),
                          tuple(dict(b for o in ops for b in o.in_boxes).items()),
                          tuple(b for o in ops for b in o.out_boxes), tuple(z for o in ops for z in o.zero_fill))
