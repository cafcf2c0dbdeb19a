"""Hierarchical communication resolution (paper §5, Figures 7-11; SPEC §2).

``resolve(src, dst, shape)`` classifies a Reshard and plans its communication:

* **Bottom tier** (same HSize, HDim and subgroup boxes): each sharding subgroup on its own --
  equal DS: ``Identity`` (same DG) or position-aligned ``SendRecv``; same DG, DS differing in one key (one key
  loses a factor ``f`` that another key gains, the other coordinates unchanged): ``AllReduce`` (P->D),
  ``ReduceScatter`` (P->S), ``AllGather`` (S->D), ``AllToAll`` (S_i->S_j), ``LocalSplit`` (every destination
  box inside the rank's source box); otherwise a per-subgroup ``BSR``.  Collective groups are the devices that
  differ only in the changing coordinates.
* **Top tier** (same HSize, different HDim, identical DG Unions): ``SplitAllReduce`` (-2 -> -1),
  ``SplitReduceScatter`` (-2 -> d), ``SplitAllGather`` (d -> -1): one collective per finest-grained slice over
  the ranks that hold or need it (any TP degrees and duplicate counts).  When the DS Unions differ, a
  bottom-tier step aligns them first (Figure 10) -- or, when cheaper, right after the top-tier step.
* **BSR** for everything else (§5.3, :mod:`.bsr`).  A Partial source is reduced first: ``AllReduce`` inside
  each partial group, then ``SplitAllReduce`` across subgroups when HDim is -2.  A Partial destination gets
  the value on summand 0 and zeros on the other summands.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import ResolutionError, ShapeError
from .annotation import PARTIAL, DUPLICATE, DS, Annotation, SubgroupViews, is_split, subgroup_views
from .bsr import LinkModel, bsr_scheme, bsr_table
from .comm_plan import CommPlan
from .comm_ops import (CollectiveGroup, CollectiveOp, CommOp, IdentityOp, Message, OpKind, PointToPointOp,
                       SliceCollective, SplitCollectiveOp, merge_p2p)
from .slices import Box, Grid, box_numel, coalesce

if TYPE_CHECKING:
    from .cluster import Cluster

__all__ = ["resolve", "itemsize_of", "split_kind"]

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "float8_e4m3fn": 1,
             "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
             "double": 8, "float": 4, "half": 2}


def itemsize_of(dtype: Any) -> int:
    """Bytes per element of ``dtype``: a name (``"bfloat16"``) or a numpy/torch dtype."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_ITEMSIZE))} or a numpy/torch dtype")
    return _ITEMSIZE[name]


def split_kind(src_hdim: int, dst_hdim: int) -> OpKind | None:
    """The top-tier operator for an HDim change (§5.2), or ``None`` when there is none."""
    if src_hdim == PARTIAL and dst_hdim == DUPLICATE:
        return OpKind.SPLIT_ALL_REDUCE
    if src_hdim == PARTIAL and is_split(dst_hdim):
        return OpKind.SPLIT_REDUCE_SCATTER
    if is_split(src_hdim) and dst_hdim == DUPLICATE:
        return OpKind.SPLIT_ALL_GATHER
    return None


@dataclass(frozen=True)
class _Ctx:
    shape: tuple[int, ...]
    itemsize: int
    links: LinkModel


def resolve(src: Annotation, dst: Annotation, shape: Sequence[int], dtype: Any = "float32",
            cluster: "Cluster | None" = None) -> "CommPlan":
    """Plan the communication of a Reshard of a tensor of ``shape`` from ``src`` to ``dst`` (§5).

    ``cluster`` (optional) steers the BSR scheme toward high-bandwidth links and classifies bytes as intra-/inter-
    node in :meth:`CommPlan.volume`.  Raises :class:`ShapeError` when the shape does not fit an annotation and
    :class:`ResolutionError` when the Reshard cannot be planned.
    """
    shape = tuple(int(n) for n in shape)
    views = []
    for which, ann in (("source", src), ("destination", dst)):
        try:
            views.append(_views(ann, shape))
        except ShapeError as e:
            raise ShapeError(f"resolve({src} -> {dst}): the {which} annotation does not fit shape {shape}: {e}") \
                from None
    if cluster is not None and max(max(src.ranks), max(dst.ranks)) >= cluster.num_ranks:
        bad = sorted(r for r in set(src.ranks) | set(dst.ranks) if r >= cluster.num_ranks)
        if bad:
            raise ResolutionError(f"resolve({src} -> {dst}): rank(s) {bad} are not in {cluster}")
    ctx = _Ctx(shape, itemsize_of(dtype), LinkModel(cluster))
    ops = _classify(src, dst, views[0], views[1], ctx)
    return CommPlan(src=src, dst=dst, shape=shape, dtype=str(dtype), itemsize=ctx.itemsize, ops=tuple(ops),
                    cluster=cluster)


# ---- classification ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Views:
    """An annotation's local views (:class:`~.annotation.LocalView`) from :func:`~.annotation.subgroup_views`,
    without an object per rank: one mapping rank -> field per field, each in DG Union order."""

    ann: Annotation
    of_subgroups: SubgroupViews
    box: dict[int, Box]
    partial_index: dict[int, int]

    @cached_property
    def partial_count(self) -> dict[int, int]:
        sizes = map(len, self.ann.dg_union)
        return dict(zip(self.ann.ranks, chain.from_iterable(map(repeat, self.of_subgroups.partial_counts, sizes))))

    @cached_property
    def subgroup(self) -> dict[int, int]:
        return {r: k for k, g in enumerate(self.ann.dg_union) for r in g}


def _views(ann: Annotation, shape: tuple[int, ...]) -> _Views:
    """The local views of ``ann`` (``ShapeError`` when ``shape`` does not fit it)."""
    views = subgroup_views(ann, shape)
    ranks = ann.ranks
    return _Views(ann, views, dict(zip(ranks, chain.from_iterable(views.boxes))),
                  dict(zip(ranks, chain.from_iterable(views.partial_indices))))


def _classify(src: Annotation, dst: Annotation, sv: _Views, dv: _Views, ctx: _Ctx) -> list[CommOp]:
    if _same_views(src, dst, sv, dv):
        return [IdentityOp()]
    if src.hsize == dst.hsize and src.hdim == dst.hdim and \
            sv.of_subgroups.subgroup_boxes == dv.of_subgroups.subgroup_boxes:
        return _bottom_tier(src, dst, sv, dv, ctx) or [IdentityOp()]
    if src.hsize == dst.hsize and src.dg_union == dst.dg_union and split_kind(src.hdim, dst.hdim):
        ops = _top_tier(src, dst, sv, dv, ctx)
        if ops is not None:
            return ops
    return _bsr_whole(src, sv, dv, ctx)


def _same_views(src: Annotation, dst: Annotation, sv: _Views, dv: _Views) -> bool:
    """Whether every rank holds the same box and summand under both: then nothing moves.  With Partial, the summands
    must also add up within the same ranks: the same top-tier Partial or none, and without it the same subgroups
    holding summands (each subgroup's summands add up to the value on their own)."""
    if sv.box.keys() != dv.box.keys() or (src.hdim == PARTIAL) != (dst.hdim == PARTIAL):
        return False
    if src.hdim != PARTIAL and {frozenset(g) for g, d in zip(src.dg_union, src.ds_union) if d.partial > 1} \
            != {frozenset(g) for g, d in zip(dst.dg_union, dst.ds_union) if d.partial > 1}:
        return False
    return sv.box == dv.box and sv.partial_index == dv.partial_index and sv.partial_count == dv.partial_count


def _bottom_partial(ds: DS, position: int) -> int:
    return ds.coords(position).get(PARTIAL, 0)


# ---- bottom tier (§5.1) ------------------------------------------------------------------------------------
def _bottom_tier(src: Annotation, dst: Annotation, sv: _Views, dv: _Views,
                 ctx: _Ctx) -> list[CommOp]:
    """Each subgroup's own operators, merged stage by stage (final transfers aligned to the last stage)."""
    per_subgroup = [_bottom_subgroup(k, src, dst, sv, dv, ctx) for k in range(src.hsize)]
    return _merge_stages(per_subgroup)


def _merge_stages(per_subgroup: list[list[CollectiveOp | PointToPointOp]]) -> list[CommOp]:
    """One operator per kind and stage; ``per_subgroup`` has a list for each of the HSize >= 1 subgroups (the
    shorter ones aligned to the last stage)."""
    n = max(len(ops) for ops in per_subgroup)
    out: list[CommOp] = []
    for i in range(n):
        stage = [ops[i - (n - len(ops))] for ops in per_subgroup if i >= n - len(ops)]
        collectives: dict[tuple[Any, ...], list[CollectiveOp]] = {}
        p2p: list[PointToPointOp] = []
        for op in stage:
            if isinstance(op, CollectiveOp):
                collectives.setdefault((op.kind, op.dim, op.src_dim), []).append(op)
            else:
                p2p.append(op)
        for (kind, dim, src_dim), ops in collectives.items():
            out.append(CollectiveOp(kind, tuple(g for o in ops for g in o.groups), ops[0].itemsize, dim, src_dim))
        if p2p:
            out.append(merge_p2p(p2p))
    return out


def _bottom_subgroup(k: int, src: Annotation, dst: Annotation, sv: _Views, dv: _Views,
                     ctx: _Ctx) -> list[CollectiveOp | PointToPointOp]:
    s, t = src.ds_union[k], dst.ds_union[k]
    a, b = src.dg_union[k], dst.dg_union[k]
    if s == t:
        return [] if a == b else [_send_recv(a, b, sv, dv, ctx.itemsize)]
    if a == b:
        if all((sv.box[r], _bottom_partial(s, i)) == (dv.box[r], _bottom_partial(t, i)) for i, r in enumerate(a)):
            return []
        op = _local_split(s, t, a, sv, dv, ctx) or _bottom_collective(s, t, a, sv, dv, ctx)
        if op is not None:
            return [op]
    ops: list[CollectiveOp | PointToPointOp] = []
    if s.partial > 1:
        ops.append(_partial_allreduce([(s, a)], sv, ctx))
    receivers = [(r, dv.box[r]) for i, r in enumerate(b) if _bottom_partial(t, i) == 0]
    zeros = [(r, dv.box[r]) for i, r in enumerate(b) if _bottom_partial(t, i) != 0]
    ops.append(_bsr_op([(r, sv.box[r]) for r in a], receivers, zeros, ctx))
    return ops


def _send_recv(a: list[int], b: list[int], sv: _Views, dv: _Views,
               itemsize: int) -> PointToPointOp:
    """Same DS, different DG: position ``i`` of the source group sends its shard to position ``i`` of the
    destination group."""
    msgs, copies = [], []
    for r, q in zip(a, b):
        box = sv.box[r]
        if r == q:
            copies.append((r, box))
        else:
            msgs.append(Message(r, q, box, box_numel(box) * itemsize))
    return PointToPointOp(OpKind.SEND_RECV, tuple(msgs), tuple(copies), tuple((r, sv.box[r]) for r in a),
                          tuple((q, dv.box[q]) for q in b))


def _local_split(s: DS, t: DS, ranks: list[int], sv: _Views, dv: _Views,
                 ctx: _Ctx) -> CollectiveOp | None:
    """Dup -> split on the same devices: every destination box lies in the rank's source box, and every rank keeps
    its summand (so the Partial degrees agree too: each digit value occurs at some position)."""
    for i, r in enumerate(ranks):
        if _bottom_partial(s, i) != _bottom_partial(t, i):
            return None
        sb, db = sv.box[r], dv.box[r]
        if not all(a <= c and d <= e for (a, e), (c, d) in zip(sb, db)):
            return None
    groups = tuple(CollectiveGroup((r,), (sv.box[r],), (dv.box[r],)) for r in ranks)
    return CollectiveOp(OpKind.LOCAL_SPLIT, groups, ctx.itemsize)


def _bottom_collective(s: DS, t: DS, ranks: list[int], sv: _Views, dv: _Views,
                       ctx: _Ctx) -> CollectiveOp | None:
    """A single-key transition: key ``a`` loses a factor ``f`` that key ``b`` gains, other coordinates equal.

    The groups are the positions that share every other coordinate, the outer digit of ``a`` and the source
    digit of ``b``; inside a group the inner digit of ``a`` (source) and of ``b`` (destination) run over ``f``.
    """
    keys = set(s.states) | set(t.states)
    diff = [k for k in keys if s.degree(k) != t.degree(k)]
    if len(diff) != 2:
        return None
    # The same devices: s.degree(a) * s.degree(b) == t.degree(a) * t.degree(b), so one key loses and the other gains.
    a = next(k for k in diff if s.degree(k) > t.degree(k))
    b = next(k for k in diff if t.degree(k) > s.degree(k))
    # When t.degree(a) does not divide s.degree(a), the position whose a-digit is the last, s.degree(a) - 1 >=
    # t.degree(a) * f, fails the digit check below: no other test of divisibility is needed.
    f = s.degree(a) // t.degree(a)
    if a == PARTIAL and b == DUPLICATE:
        kind = OpKind.ALL_REDUCE
    elif a == PARTIAL and is_split(b):
        kind = OpKind.REDUCE_SCATTER
    elif is_split(a) and b == DUPLICATE:
        kind = OpKind.ALL_GATHER
    elif is_split(a) and is_split(b):
        kind = OpKind.ALL_TO_ALL
    else:
        return None
    others = sorted(keys - {a, b})
    groups: dict[tuple[Any, ...], list[tuple[int, int, int]]] = {}
    for pos, r in enumerate(ranks):
        cs, ct = s.coords(pos), t.coords(pos)  # a is a key of s, b of t, and the others (degree > 1) of both
        a_outer, a_inner = divmod(cs[a], f)
        b_outer, b_inner = divmod(ct[b], f)
        if any(cs[k] != ct[k] for k in others):
            return None
        if a_outer != ct.get(a, 0):
            return None
        if b != DUPLICATE and b_outer != cs.get(b, 0):
            return None
        groups.setdefault((tuple(cs[k] for k in others), a_outer, cs.get(b)), []).append((r, a_inner, b_inner))
    # Each group is keyed by every source digit but a's inner one: f members, one for each inner digit of a; and for a
    # split b (b's outer digit checked above) one for each inner digit of b, as their destination digits all differ.
    out = []
    for members in groups.values():
        order = 1 if kind is OpKind.ALL_GATHER else 2  # AG: source chunk order; RS/A2A/AR: destination chunk order
        members.sort(key=lambda m: m[order])
        rs = tuple(m[0] for m in members)
        out.append(CollectiveGroup(rs, tuple(sv.box[r] for r in rs), tuple(dv.box[r] for r in rs)))
    dim = a if kind is OpKind.ALL_GATHER else (b if is_split(b) else None)
    return CollectiveOp(kind, tuple(out), ctx.itemsize, dim, a if kind is OpKind.ALL_TO_ALL else None)


def _partial_allreduce(subgroups: list[tuple[DS, list[int]]], sv: _Views, ctx: _Ctx) -> CollectiveOp:
    """``AllReduce`` over each partial group: the devices that differ only in the Partial coordinate."""
    groups = []
    for ds, ranks in subgroups:
        by_rest: dict[tuple[tuple[int, int], ...], list[tuple[int, int]]] = {}
        for pos, r in enumerate(ranks):
            c = ds.coords(pos)
            rest = tuple(sorted((k, v) for k, v in c.items() if k != PARTIAL))
            by_rest.setdefault(rest, []).append((c[PARTIAL], r))  # ds.partial > 1: a digit of every position
        for members in by_rest.values():
            rs = tuple(r for _, r in sorted(members))
            groups.append(CollectiveGroup(rs, tuple(sv.box[r] for r in rs), tuple(sv.box[r] for r in rs)))
    return CollectiveOp(OpKind.ALL_REDUCE, tuple(groups), ctx.itemsize)


# ---- BSR (§5.3) --------------------------------------------------------------------------------------------
def _bsr_op(owners: list[tuple[int, Box]], receivers: list[tuple[int, Box]], zeros: list[tuple[int, Box]],
            ctx: _Ctx, *, kind: OpKind = OpKind.BSR) -> PointToPointOp:
    """A BSR operator from owner and receiver boxes: table, scheme, messages merged per sender/receiver."""
    entries = bsr_table(owners, receivers, ctx.shape, ctx.itemsize)
    assigns = bsr_scheme(entries, ctx.links, {})
    copies = [(a.dst, a.box) for a in assigns if a.src == a.dst]
    moves = [((a.src, a.dst), a.box) for a in assigns if a.src != a.dst]
    msgs = tuple(Message(s, d, box, box_numel(box) * ctx.itemsize)
                 for (s, d), box in coalesce(moves, order=lambda sd: sd))
    cps = tuple((r, box) for r, box in coalesce(copies, order=lambda r: r))
    return PointToPointOp(kind, msgs, cps, tuple(owners), tuple(receivers) + tuple(zeros),
                          tuple(r for r, _ in zeros))


def _bsr_whole(src: Annotation, sv: _Views, dv: _Views, ctx: _Ctx) -> list[CommOp]:
    """BSR over the whole tensor, after reducing a Partial source (bottom AllReduce, then SplitAllReduce)."""
    ops: list[CommOp] = []
    partial = [(ds, dg) for ds, dg in zip(src.ds_union, src.dg_union) if ds.partial > 1]
    if partial:
        ops.append(_partial_allreduce(partial, sv, ctx))
    if src.hdim == PARTIAL:  # (HSize > 1: with one subgroup the HDim is Duplicate)
        held = list(zip(sv.box, sv.box.values(), sv.subgroup.values()))
        ops.append(_split_op(OpKind.SPLIT_ALL_REDUCE, PARTIAL, DUPLICATE, held, list(sv.box.items()), [], ctx))
    receivers = [(r, box) for r, box in dv.box.items() if dv.partial_index[r] == 0]
    zeros = [(r, box) for r, box in dv.box.items() if dv.partial_index[r] != 0]
    ops.append(_bsr_op(list(sv.box.items()), receivers, zeros, ctx))
    return ops


# ---- top tier (§5.2) ---------------------------------------------------------------------------------------
#: a holder of a top-tier collective's input: (rank, box, the index of the summand it holds)
_Held = tuple[int, Box, int]


def _contributors(holders: list[tuple[int, int]]) -> tuple[int, ...]:
    """Ranks whose parts sum to the slice's value: the first holder (by rank) of each summand; ``holders``:
    ``(rank, summand)`` by rank.  The holders of a slice hold every summand: with HDim -2 every subgroup holds the
    whole tensor, each summand of the Partial (the subgroups' bottom summands, or after a bottom AllReduce the
    subgroups themselves) somewhere; with a split HDim (SplitAllGather) the slice lies in one subgroup's part, where
    the subgroup's DS covers it."""
    pick: dict[int, int] = {}
    for rank, pidx in holders:
        pick.setdefault(pidx, rank)
    return tuple(sorted(pick.values()))


def _split_op(kind: OpKind, src_hdim: int, dst_hdim: int, held: list[_Held], targets: list[tuple[int, Box]],
              zeros: list[tuple[int, Box]], ctx: _Ctx) -> SplitCollectiveOp:
    """One collective per finest-grained slice (in the order of the slices' boxes): the contributors' parts summed,
    written to every receiver."""
    grid = Grid(ctx.shape, {box for _, box, _ in held} | {box for _, box in targets})
    cells: dict[Box, list[tuple[int, ...]]] = {}  # the cells of each distinct box (ranks share a few boxes)
    holders: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for r, box, pidx in sorted(held):  # (by rank: ranks are distinct)
        if box not in cells:
            cells[box] = list(grid.cells_of(box))
        for cell in cells[box]:
            holders.setdefault(cell, []).append((r, pidx))
    need: dict[tuple[int, ...], list[int]] = {}
    for r, box in sorted(targets):
        if box not in cells:
            cells[box] = list(grid.cells_of(box))
        for cell in cells[box]:
            need.setdefault(cell, []).append(r)
    sig = [((_contributors(holders[cell]), tuple(recv)), grid.box(cell)) for cell, recv in need.items()]
    slices = tuple(SliceCollective(box, tuple(sorted(set(c) | set(rs))), c, rs)
                   for (c, rs), box in sorted(coalesce(sig), key=lambda kb: kb[1]))
    return SplitCollectiveOp(kind, int(src_hdim), int(dst_hdim), slices, tuple((r, box) for r, box, _ in held),
                             tuple(targets) + tuple(zeros), ctx.itemsize)


def _top_op(a: Annotation, b: Annotation, ctx: _Ctx, av: _Views, bv: _Views) -> SplitCollectiveOp:
    """The top-tier collective from ``a`` to ``b`` (the same DS Union), given both annotations' local views."""
    kind = split_kind(a.hdim, b.hdim)
    assert kind is not None
    held = list(zip(av.box, av.box.values(), av.partial_index.values()))
    targets = [(r, box) for r, box in bv.box.items() if bv.partial_index[r] == 0]
    zeros = [(r, box) for r, box in bv.box.items() if bv.partial_index[r] != 0]
    return _split_op(kind, a.hdim, b.hdim, held, targets, zeros, ctx)


def _fitting(dg: list[list[int]], ds: list[DS], hdim: int, hratios: list[int] | None,
             shape: tuple[int, ...]) -> _Views | None:
    """The views of the annotation ``(dg, ds, hdim, hratios)``, or ``None`` when it is not one or does not fit."""
    try:
        return _views(Annotation(dg, ds, hdim, hratios), shape)
    except (ValueError, ShapeError):
        return None


def _top_tier(src: Annotation, dst: Annotation, sv: _Views, dv: _Views,
              ctx: _Ctx) -> list[CommOp] | None:
    """Top-tier collectives; a bottom-tier step aligns differing DS Unions before (or after) them."""
    if src.ds_union == dst.ds_union:
        return [_top_op(src, dst, ctx, sv, dv)]
    candidates: list[list[CommOp]] = []
    mv = _fitting(src.dg_union, dst.ds_union, src.hdim, src.hratios, ctx.shape)
    if mv is not None:  # Figure 10: align the DS Union, then the HDim
        candidates.append(_bottom_tier(src, mv.ann, sv, mv, ctx) + [_top_op(mv.ann, dst, ctx, mv, dv)])
    mv = _fitting(src.dg_union, src.ds_union, dst.hdim, dst.hratios, ctx.shape)
    if mv is not None:  # align the HDim first, then each subgroup's DS
        candidates.append([_top_op(src, mv.ann, ctx, sv, mv)] + _bottom_tier(mv.ann, dst, mv, dv, ctx))
    candidates = [c for c in candidates if not any(op.kind is OpKind.BSR for op in c)]
    if not candidates:
        return None
    return min(candidates, key=lambda ops: sum(t[2] for op in ops for t in op.transfers()))
