"""Executing resolved communication with ``torch.distributed`` (paper §5; SPEC §2).

``resolve`` plans, the runtime executes: every function here is driven only by the operators of a
:class:`~hspmd_sdk.core.comm_plan.CommPlan` -- their groups (in collective order), boxes (global coordinates),
slices and messages -- and re-derives nothing.  The one-process reference of each operator is its ``apply``
(:mod:`hspmd_sdk.core.comm_ops`); :func:`execute` does the same on real ranks:

=====================  ===============================================================================
operator               what every member rank does
=====================  ===============================================================================
``Identity``           nothing
``LocalSplit``         slices its output box out of its input
``AllReduce``          ``all_reduce`` on the group, then keeps its output box of the sum
``ReduceScatter``      ``reduce_scatter_tensor`` of a flat buffer laid out as the members' output boxes in the
                       process group's rank order (so the plan's group order decides who gets which chunk)
``AllGather``          ``all_gather_into_tensor`` of its flat input; each member's piece is written at the
                       intersection of that member's input box with its own output box
``AllToAll``           ``all_to_all_single`` with per-peer splits = the intersections of its input box with
                       each peer's output box (and of each peer's input box with its own output box)
``Split*`` (top tier)  per slice, in plan order: ``broadcast`` from the single contributor, or ``all_reduce``
                       over the slice's ranks (non-contributors add zeros); receivers write the slice's box.
                       Slices over the same ranks and contributors travel as one flat buffer (one call per
                       batch); batches run in the order of their first slice, the same order on every rank.
``SendRecv`` / ``BSR``  one ``batch_isend_irecv`` for all of a rank's messages, local copies, zero fill
=====================  ===============================================================================

Ranks that hold nothing before (pure receivers) pass ``None``; ranks outside the destination get ``None`` back.
Process groups come from a *group lookup*: a :class:`~hspmd_sdk.runtime.workers.worker.WorkerState` (its ``group``), a
callable ``ranks -> ProcessGroup`` or a mapping from the sorted rank tuple.  Create every group the plans need up
front, on every rank, with :func:`comm_groups`::

    state.create_groups(comm_groups(plans))

Autograd: :func:`reshard` runs a plan forward and another plan on the gradient backward; the gradient-layout
convention is the core's (:mod:`hspmd_sdk.core.gradients`).  Graph switching:
:func:`hspmd_sdk.runtime.workers.switch_exec.execute_switch`.

Overlap: :func:`execute_async` starts a top-tier plan and returns a :class:`Pending` (ZeRO-1's parameter gather
runs while the first forward computes); :mod:`.sends` has the split-phase form of a point-to-point operator
(pipeline stages post receives early).  Gradient buckets: :mod:`.buckets`.
Precision: plans are resolved at the graph's dtype; :func:`with_dtype` gives the same plan for bf16 tensors.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from ...core.gradients import backward_plan_for, gradient_layout
from ...core.comm_ops import CollectiveOp, IdentityOp, OpKind, PointToPointOp, SplitCollectiveOp
from ...core.slices import Box, box_intersect, box_numel, box_shape, format_box, relative
from ...errors import HSPMDError
from ..trace import communicating, span

if TYPE_CHECKING:
    from ...core.comm_ops import CommOp, SliceCollective
    from ...core.comm_plan import CommPlan

__all__ = ["CommExecutionError", "Pending", "comm_groups", "execute", "execute_async", "execute_op", "reshard",
           "backward_plan_for", "gradient_layout", "group_lookup", "torch_dtype", "with_dtype", "default_device",
           "ExecContext", "post_slice_collective"]

GroupLookup = Callable[[Sequence[int]], Any]

if TYPE_CHECKING:
    class GroupHolder(Protocol):
        """What has a ``group(ranks)`` method: the :class:`~.worker.WorkerState` (or a stand-in for one)."""

        def group(self, ranks: Sequence[int]) -> dist.ProcessGroup: ...

    #: What a ``groups`` argument may be (:func:`group_lookup`): the WorkerState (its ``group``), a callable
    #: ``ranks -> group`` or a mapping ``{sorted ranks: group}``.
    Groups = GroupHolder | GroupLookup | Mapping[tuple[int, ...], Any]


class CommExecutionError(HSPMDError):
    """A plan could not be executed on this rank (wrong local tensor, missing group, ...)."""


# ---- groups ------------------------------------------------------------------------------------------------
def comm_groups(plans: Iterable["CommPlan"]) -> list[tuple[int, ...]]:
    """Every rank set (sorted tuple, >= 2 ranks) that an operator of ``plans`` runs a collective on, sorted.

    Call ``state.create_groups(comm_groups(plans))`` on every rank with the same plans before :func:`execute`.
    Point-to-point operators need no group.
    """
    sets: set[tuple[int, ...]] = set()
    for plan in plans:
        for op in plan.ops:
            if isinstance(op, CollectiveOp) and op.kind is not OpKind.LOCAL_SPLIT:
                sets.update(tuple(sorted(g.ranks)) for g in op.groups if len(g.ranks) >= 2)
            elif isinstance(op, SplitCollectiveOp):
                sets.update(tuple(sorted(s.ranks)) for s in op.slices if len(s.ranks) >= 2)
    return sorted(sets)


def group_lookup(groups: "Groups | None") -> GroupLookup:
    """A ``ranks -> ProcessGroup`` function from a WorkerState (``.group``), a callable or a mapping."""
    if hasattr(groups, "group") and callable(groups.group):
        return groups.group
    if callable(groups):
        return groups
    if isinstance(groups, Mapping):
        return lambda ranks: groups[tuple(sorted(ranks))]
    if groups is None:
        raise CommExecutionError("no process groups given: pass the WorkerState, a callable ranks -> group or a "
                                 "mapping {sorted ranks: group}")
    raise TypeError(f"cannot look process groups up in a {type(groups).__name__}")


def _group(lookup: GroupLookup, ranks: Sequence[int], rank: int, what: str) -> tuple[dist.ProcessGroup, list[int]]:
    """The process group of ``ranks`` and its members in group-rank order (the order collectives use)."""
    try:
        g = lookup(ranks)
    except KeyError as e:
        raise CommExecutionError(f"rank {rank}, {what}: no process group for ranks {sorted(ranks)} ({e}); create "
                                 "comm_groups(plans) on every rank first") from None
    order = dist.get_process_group_ranks(g)
    if sorted(order) != sorted(ranks):
        raise CommExecutionError(f"rank {rank}, {what}: the group for {sorted(ranks)} has ranks {order}")
    return g, list(order)


# ---- small helpers -----------------------------------------------------------------------------------------
def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a plan's dtype name (``"float32"``, ``"torch.bfloat16"``) or a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise CommExecutionError(f"plan dtype {name!r} is not a torch dtype")
    return dt


def with_dtype(plan: "CommPlan", dtype: str | torch.dtype) -> "CommPlan":
    """``plan`` for tensors of ``dtype``: the same operators, groups, boxes and messages, byte counts at the new
    item size.  The core resolves communication at the graph's dtype (fp32); a bf16 run sends bf16 (SPEC §8) with
    the very same plans, so only the element type changes (``plan`` itself when it already has ``dtype``)."""
    name = str(torch_dtype(dtype)).removeprefix("torch.")
    if plan.dtype == name:
        return plan
    n = torch_dtype(name).itemsize
    return replace(plan, dtype=name, itemsize=n, ops=tuple(_op_itemsize(op, n) for op in plan.ops))


def _op_itemsize(op: "CommOp", n: int) -> "CommOp":
    if isinstance(op, (CollectiveOp, SplitCollectiveOp)):
        return replace(op, itemsize=n)
    if isinstance(op, PointToPointOp):
        return replace(op, messages=tuple(replace(m, nbytes=box_numel(m.box) * n) for m in op.messages))
    return op


class Pending:
    """A communication in flight on this rank: :meth:`wait` waits for its collectives or messages and returns
    this rank's result (a tensor or ``None``), computed once.  ``what`` names it in an error."""

    def __init__(self, works: Sequence[dist.Work], finish: Callable[[], torch.Tensor | None], what: str = "",
                 rank: int = -1) -> None:
        self._works, self._finish, self.what, self.rank = list(works), finish, what, rank
        self._done, self._value = False, None

    @classmethod
    def done(cls, value: torch.Tensor | None) -> "Pending":
        """An already completed communication whose result is ``value``."""
        p = cls((), lambda: value)
        p.wait()
        return p

    def wait(self) -> torch.Tensor | None:
        if not self._done:
            try:
                for w in self._works:
                    w.wait()
            except RuntimeError as e:  # a collective failed or timed out: say where
                raise CommExecutionError(f"rank {self.rank}, {self.what}: {e}") from e
            self._value, self._done, self._works = self._finish(), True, []
        return self._value




def _piece(t: torch.Tensor, inner: Box, outer: Box) -> torch.Tensor:
    """The part ``inner`` of a local tensor that holds ``outer``, flattened and contiguous."""
    return t[relative(inner, outer)].reshape(-1)


class ExecContext:
    """What executing one plan on one rank needs: the rank, the group lookup, dtype and device of buffers."""

    def __init__(self, rank: int, lookup: GroupLookup, dtype: torch.dtype, device: torch.device) -> None:
        self.rank, self.lookup, self.dtype, self.device = rank, lookup, dtype, device

    def zeros(self, box: Box) -> torch.Tensor:
        return torch.zeros(box_shape(box), dtype=self.dtype, device=self.device)

    def empty(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=self.dtype, device=self.device)

    def check(self, t: torch.Tensor | None, box: Box, what: str) -> torch.Tensor:
        if t is None:
            raise CommExecutionError(f"rank {self.rank}, {what}: the plan expects this rank to hold "
                                     f"{format_box(box)} but it holds nothing (None)")
        if tuple(t.shape) != box_shape(box):
            raise CommExecutionError(f"rank {self.rank}, {what}: holds a tensor of shape {tuple(t.shape)} but the "
                                     f"plan expects the box {format_box(box)} of shape {box_shape(box)}")
        return t


# ---- execute -----------------------------------------------------------------------------------------------
def execute(plan: "CommPlan", local: torch.Tensor | None, groups: "Groups", *, rank: int | None = None,
            device: torch.device | str | None = None, tag_base: int = 0) -> torch.Tensor | None:
    """Run ``plan`` on this rank with real collectives; returns this rank's destination tensor, or ``None``.

    Every rank of ``plan.src.ranks`` and ``plan.dst.ranks`` must call it (with the same plan, in the same order
    as other plans).  ``local``: this rank's source tensor (its summand for a Partial source), ``None`` when it
    holds nothing before.  ``groups``: see :func:`group_lookup`.  ``rank`` defaults to the process rank.
    ``tag_base``: point-to-point message ``i`` of an operator is tagged ``tag_base + i`` (the training executor
    passes its micro-batch tag so that a peer posting the same messages itself, with that tag, matches).
    """
    rank = dist.get_rank() if rank is None else int(rank)
    dtype = torch_dtype(plan.dtype)
    if local is not None and local.dtype != dtype:
        raise CommExecutionError(f"rank {rank}: the local tensor is {local.dtype} but the plan was resolved for "
                                 f"{plan.dtype}; resolve(..., dtype={str(local.dtype).removeprefix('torch.')!r})")
    dev = torch.device(device) if device is not None else (local.device if local is not None else
                                                             default_device(groups))
    ctx = ExecContext(rank, group_lookup(groups), dtype, dev)
    cur = local
    with communicating():
        for i, op in enumerate(plan.ops):
            what = f"op {i} ({op.kind}) of {plan.src} -> {plan.dst}"
            try:
                cur = _run_op(op, cur, ctx, what, tag_base)
            except RuntimeError as e:  # a collective failed or timed out: say where
                raise CommExecutionError(f"rank {rank}, {what}: {e}") from e
    return cur if rank in plan.dst.ranks else None


def execute_op(plan: "CommPlan", index: int, local: torch.Tensor | None, groups: "Groups", *, rank: int,
               device: torch.device) -> torch.Tensor | None:
    """Run operator ``index`` of ``plan`` alone on this rank; a rank it does not write keeps ``local``."""
    ctx = ExecContext(rank, group_lookup(groups), torch_dtype(plan.dtype), device)
    op = plan.ops[index]
    what = f"op {index} ({op.kind}) of {plan.src} -> {plan.dst}"
    try:
        with communicating():
            out = _run_op(op, local, ctx, what)
    except RuntimeError as e:
        raise CommExecutionError(f"rank {rank}, {what}: {e}") from e
    return out if out is not None else local


def execute_async(plan: "CommPlan", local: torch.Tensor | None, groups: "Groups", *, rank: int,
                  device: torch.device | str | None = None, tag_base: int = 0) -> Pending:
    """Start ``plan`` on this rank and return at once; ``.wait()`` gives what :func:`execute` returns.

    A plan of one top-tier operator (``SplitAllGather`` of ZeRO-1 parameters, ``SplitAllReduce``...) posts its
    slice collectives asynchronously (``async_op=True``), so the caller computes while they travel; any other plan
    runs synchronously here (its result is ready; ``tag_base`` as in :func:`execute`).  Collectives are issued now,
    in plan order, so the global order of collectives per group is the order of the calls, as with :func:`execute`."""
    if not (len(plan.ops) == 1 and isinstance(plan.ops[0], SplitCollectiveOp)):
        return Pending.done(execute(plan, local, groups, rank=rank, device=device, tag_base=tag_base))
    dtype = torch_dtype(plan.dtype)
    dev = torch.device(device) if device is not None else (local.device if local is not None else
                                                             default_device(groups))
    ctx = ExecContext(int(rank), group_lookup(groups), dtype, dev)
    what = f"op 0 ({plan.ops[0].kind}) of {plan.src} -> {plan.dst}"
    try:
        started = _start_split(plan.ops[0], local, ctx, what)
    except RuntimeError as e:
        raise CommExecutionError(f"rank {rank}, {what}: {e}") from e
    inside = int(rank) in plan.dst.ranks

    def finish() -> torch.Tensor | None:
        got = started.wait()
        return got if inside else None

    return Pending((), finish, what, int(rank))


def default_device(groups: "Groups | None" = None) -> torch.device:
    """Where buffers of a rank that holds nothing go: the WorkerState's device if it has one, else the CPU."""
    dev = getattr(groups, "device", None)
    return torch.device(dev) if dev is not None else torch.device("cpu")


def _run_op(op: "CommOp", cur: torch.Tensor | None, ctx: ExecContext, what: str,
            tag_base: int = 0) -> torch.Tensor | None:
    if isinstance(op, IdentityOp):
        return cur
    with span(f"comm {op.kind}"):  # the operator's SPEC name in a profiled step (:mod:`.trace`)
        return _run_op_now(op, cur, ctx, what, tag_base)


def _run_op_now(op: "CommOp", cur: torch.Tensor | None, ctx: ExecContext, what: str,
                tag_base: int) -> torch.Tensor | None:
    if isinstance(op, CollectiveOp):
        return _run_collective(op, cur, ctx, what)
    if isinstance(op, SplitCollectiveOp):
        return _run_split(op, cur, ctx, what)
    if isinstance(op, PointToPointOp):
        return _run_p2p(op, cur, ctx, what, tag_base)
    raise CommExecutionError(f"rank {ctx.rank}, {what}: unknown operator {type(op).__name__}")


# ---- bottom tier -------------------------------------------------------------------------------------------
def _run_collective(op: CollectiveOp, cur: torch.Tensor | None, ctx: ExecContext, what: str) -> torch.Tensor | None:
    grp = next((g for g in op.groups if ctx.rank in g.ranks), None)
    if grp is None:
        return cur
    i = grp.ranks.index(ctx.rank)
    x = ctx.check(cur, grp.in_boxes[i], what)
    inb, outb = dict(zip(grp.ranks, grp.in_boxes)), dict(zip(grp.ranks, grp.out_boxes))
    if op.kind is OpKind.LOCAL_SPLIT or len(grp.ranks) == 1:  # local slicing, or a collective of one rank
        return x[relative(outb[ctx.rank], inb[ctx.rank])].clone()
    run = _COLLECTIVES.get(op.kind)
    if run is None:
        raise CommExecutionError(f"rank {ctx.rank}, {what}: unknown collective kind {op.kind!r}")
    pg, order = _group(ctx.lookup, grp.ranks, ctx.rank, what)
    return run(x, inb, outb, order, pg, ctx, what)


def _all_reduce(x: torch.Tensor, inb: dict[int, Box], outb: dict[int, Box], order: list[int], pg: dist.ProcessGroup,
                ctx: ExecContext, what: str) -> torch.Tensor:
    total = x.contiguous().clone()
    dist.all_reduce(total, group=pg)
    return total[relative(outb[ctx.rank], inb[ctx.rank])].clone()


def _reduce_scatter(x: torch.Tensor, inb: dict[int, Box], outb: dict[int, Box], order: list[int], pg: dist.ProcessGroup,
                    ctx: ExecContext, what: str) -> torch.Tensor:
    """Chunk ``j`` of the flat input is member ``order[j]``'s output box: whoever the plan gives a box gets it."""
    me = inb[ctx.rank]
    sizes = {box_numel(outb[q]) for q in order}
    if len(sizes) != 1:
        raise CommExecutionError(f"rank {ctx.rank}, ReduceScatter: unequal output boxes {sorted(sizes)}")
    flat = torch.cat([_piece(x, outb[q], me) for q in order])
    out = ctx.empty(sizes.pop())
    dist.reduce_scatter_tensor(out, flat, group=pg)
    return out.reshape(box_shape(outb[ctx.rank]))


def _all_gather(x: torch.Tensor, inb: dict[int, Box], outb: dict[int, Box], order: list[int], pg: dist.ProcessGroup,
                ctx: ExecContext, what: str) -> torch.Tensor:
    """Gather the members' flat inputs in group-rank order; place each at its box inside the output box."""
    n = x.numel()
    if any(box_numel(inb[q]) != n for q in order):
        raise CommExecutionError(f"rank {ctx.rank}, {what}: AllGather members hold boxes of different sizes")
    flat = ctx.empty(n * len(order))
    dist.all_gather_into_tensor(flat, x.contiguous().reshape(-1), group=pg)
    mine = outb[ctx.rank]
    out = ctx.zeros(mine)
    for j, q in enumerate(order):
        part = box_intersect(inb[q], mine)
        if part is not None:
            src = flat[j * n:(j + 1) * n].reshape(box_shape(inb[q]))
            out[relative(part, mine)] = src[relative(part, inb[q])]
    return out


def _all_to_all(x: torch.Tensor, inb: dict[int, Box], outb: dict[int, Box], order: list[int], pg: dist.ProcessGroup,
                ctx: ExecContext, what: str) -> torch.Tensor:
    """Send each peer the part of the input inside its output box; receive the parts of the own output box."""
    me_in, me_out = inb[ctx.rank], outb[ctx.rank]
    send_parts = [box_intersect(me_in, outb[q]) for q in order]
    recv_parts = [box_intersect(inb[q], me_out) for q in order]
    send_sizes = [box_numel(p) if p is not None else 0 for p in send_parts]
    recv_sizes = [box_numel(p) if p is not None else 0 for p in recv_parts]
    pieces = [_piece(x, p, me_in) for p in send_parts if p is not None]
    send = torch.cat(pieces) if pieces else ctx.empty(0)
    recv = ctx.empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=pg)
    out = ctx.zeros(me_out)
    at = 0
    for part, n in zip(recv_parts, recv_sizes):
        if part is not None:
            out[relative(part, me_out)] = recv[at:at + n].reshape(box_shape(part))
            at += n
    return out


#: The bottom-tier collectives: one function each, ``(input, in boxes, out boxes, group order, group, ctx, what)``.
_COLLECTIVES: dict[OpKind, Callable[..., torch.Tensor]] = {
    OpKind.ALL_REDUCE: _all_reduce, OpKind.REDUCE_SCATTER: _reduce_scatter, OpKind.ALL_GATHER: _all_gather,
    OpKind.ALL_TO_ALL: _all_to_all}


# ---- top tier ----------------------------------------------------------------------------------------------
def _slice_batches(op: SplitCollectiveOp) -> list[tuple[tuple[int, ...], int | None, list["SliceCollective"]]]:
    """Slices batched by rank set and operation: ``(ranks, root, slices)``, ``root`` the single contributor of a
    broadcast batch or ``None`` for a summing batch (whose slices may have different contributors).

    Batches are ordered by their first slice in plan order.  That is a function of the plan alone, the same on
    every rank, so every rank issues its collectives in one global order and overlapping groups cannot deadlock.
    """
    batches: dict[tuple[tuple[int, ...], int | None], list[Any]] = {}
    for s in op.slices:
        root = s.contributors[0] if len(s.contributors) == 1 else None
        batches.setdefault((tuple(s.ranks), root), []).append(s)
    return [(r, root, ss) for (r, root), ss in batches.items()]


def _run_split(op: SplitCollectiveOp, cur: torch.Tensor | None, ctx: ExecContext, what: str) -> torch.Tensor | None:
    return _start_split(op, cur, ctx, what).wait()


def _start_split(op: SplitCollectiveOp, cur: torch.Tensor | None, ctx: ExecContext, what: str) -> Pending:
    """Post the slice collectives of ``op`` (asynchronously, batch by batch in :func:`_slice_batches` order);
    waiting writes the received slices into this rank's output box."""
    inb, outb = dict(op.in_boxes), dict(op.out_boxes)
    x = ctx.check(cur, inb[ctx.rank], what) if ctx.rank in inb else None
    out = ctx.zeros(outb[ctx.rank]) if ctx.rank in outb else None
    works, bufs = [], []
    for ranks, root, slices in _slice_batches(op):
        if ctx.rank not in ranks:
            continue
        buf = _split_buffer(slices, x, inb, ctx)
        if len(ranks) > 1:
            works.append(post_slice_collective(buf, ranks, root, ctx, what))
        bufs.append((buf, slices))

    def finish() -> torch.Tensor | None:
        for buf, slices in bufs:
            _split_unpack(buf, slices, out, outb, ctx)
        return out if out is not None else cur

    return Pending(works, finish, what, ctx.rank)


def post_slice_collective(buf: torch.Tensor, ranks: Sequence[int], root: int | None, ctx: ExecContext,
                          what: str) -> dist.Work:
    """Post the slice batch collective on ``ranks``: a broadcast from ``root``, or a summing all-reduce."""
    pg, _ = _group(ctx.lookup, ranks, ctx.rank, what)
    if root is not None:
        return dist.broadcast(buf, src=root, group=pg, async_op=True)
    return dist.all_reduce(buf, group=pg, async_op=True)


def _split_buffer(slices: list["SliceCollective"], x: torch.Tensor | None, inb: dict[int, Box],
                  ctx: ExecContext) -> torch.Tensor:
    """The flat buffer of a batch: per slice, this rank's part if it contributes to that slice, else zeros."""
    parts = []
    for s in slices:
        if ctx.rank in s.contributors:
            assert x is not None
            parts.append(_piece(x, s.box, inb[ctx.rank]))
        else:
            parts.append(torch.zeros(box_numel(s.box), dtype=ctx.dtype, device=ctx.device))
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def _split_unpack(buf: torch.Tensor, slices: list["SliceCollective"], out: torch.Tensor | None, outb: dict[int, Box],
                  ctx: ExecContext) -> None:
    at = 0
    for s in slices:
        n = box_numel(s.box)
        if ctx.rank in s.receivers:
            assert out is not None
            out[relative(s.box, outb[ctx.rank])] = buf[at:at + n].reshape(box_shape(s.box))
        at += n


# ---- point to point ----------------------------------------------------------------------------------------
def _run_p2p(op: PointToPointOp, cur: torch.Tensor | None, ctx: ExecContext, what: str,
             tag_base: int = 0) -> torch.Tensor | None:
    """This rank's messages of ``op``; message ``i`` is tagged ``tag_base + i``."""
    inb, outb = dict(op.in_boxes), dict(op.out_boxes)
    x = ctx.check(cur, inb[ctx.rank], what) if ctx.rank in inb else None
    out = ctx.zeros(outb[ctx.rank]) if ctx.rank in outb else None
    for r, box in op.copies:
        if r == ctx.rank:
            out[relative(box, outb[r])] = x[relative(box, inb[r])]  # type: ignore[index]
    ops, recvs = [], []
    for i, m in enumerate(op.messages):
        tag = tag_base + i
        if m.src == m.dst == ctx.rank:
            out[relative(m.box, outb[m.dst])] = x[relative(m.box, inb[m.src])]  # type: ignore[index]
        elif m.src == ctx.rank:
            piece = _piece(x, m.box, inb[m.src]).contiguous()  # type: ignore[arg-type]
            ops.append(dist.P2POp(dist.isend, piece, m.dst, tag=tag))
        elif m.dst == ctx.rank:
            buf = ctx.empty(box_numel(m.box))
            ops.append(dist.P2POp(dist.irecv, buf, m.src, tag=tag))
            recvs.append((m.box, buf))
    _wait_all(ops, ctx.rank, what)
    for box, buf in recvs:
        out[relative(box, outb[ctx.rank])] = buf.reshape(box_shape(box))  # type: ignore[index]
    return out if out is not None else cur


def _wait_all(ops: list[dist.P2POp], rank: int, what: str) -> None:
    """One ``batch_isend_irecv`` for all of this rank's sends and receives, then wait for each."""
    if not ops:
        return
    try:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    except RuntimeError as e:
        raise CommExecutionError(f"rank {rank}, {what}: batched send/receive failed: {e}") from e


# ---- autograd ----------------------------------------------------------------------------------------------
class _Reshard(torch.autograd.Function):
    """Forward: execute ``plan``; backward: execute ``backward_plan`` on the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, holds: bool, plan: "CommPlan", backward_plan: "CommPlan",
                groups: "Groups", rank: int, tags: tuple[int, int] = (0, 0)) -> torch.Tensor:  # type: ignore[override]
        ctx.plan, ctx.backward_plan, ctx.groups, ctx.rank, ctx.holds = plan, backward_plan, groups, rank, holds
        ctx.dtype, ctx.device, ctx.backward_tag = x.dtype, x.device, tags[1]
        out = execute(plan, x if holds else None, groups, rank=rank, device=x.device, tag_base=tags[0])
        if out is None:
            return x.new_empty((0,))
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        bp = ctx.backward_plan
        g_in = grad.contiguous() if ctx.rank in bp.src.ranks else None
        g = execute(bp, g_in, ctx.groups, rank=ctx.rank, device=ctx.device, tag_base=ctx.backward_tag)
        if not ctx.holds:
            return None, None, None, None, None, None, None
        if g is None:
            raise CommExecutionError(f"rank {ctx.rank}: the backward plan {bp.src} -> {bp.dst} gives this rank no "
                                     "gradient, but it holds the Reshard's input")
        return g, None, None, None, None, None, None


def reshard(x: torch.Tensor | None, plan: "CommPlan", backward_plan: "CommPlan | None" = None,
            groups: "Groups | None" = None, *, rank: int | None = None, dtype: str | torch.dtype | None = None,
            device: torch.device | str | None = None,
            tag_base: int = 0, backward_tag_base: int | None = None) -> torch.Tensor:
    """A differentiable Reshard: forward executes ``plan``, backward executes ``backward_plan`` on the gradient.

    ``backward_plan`` defaults to :func:`backward_plan_for` (``plan``).  Every rank of both plans calls it, and
    every one of them must later run the backward (the collectives inside need all their members):

    * a rank that holds no input passes ``x=None``; a placeholder that requires grad is used so the output still
      joins the autograd graph;
    * a rank outside the destination gets a zero-element tensor; drive its backward with
      ``out.backward(out.new_empty(0))`` (or add ``out.sum()`` to its loss).

    ``tag_base`` / ``backward_tag_base`` (default: ``tag_base``): the point-to-point tag bases of the forward and
    backward plans (see :func:`execute`).
    """
    rank = dist.get_rank() if rank is None else int(rank)
    bp = backward_plan if backward_plan is not None else backward_plan_for(plan)
    if bp.shape != plan.shape:
        raise CommExecutionError(f"rank {rank}: backward plan shape {bp.shape} differs from the plan's {plan.shape}")
    holds = x is not None
    if x is None:
        dev = torch.device(device) if device is not None else default_device(groups)
        x = torch.empty(0, dtype=torch_dtype(dtype or plan.dtype), device=dev, requires_grad=True)
    tags = (int(tag_base), int(tag_base if backward_tag_base is None else backward_tag_base))
    return _Reshard.apply(x, holds, plan, bp, groups, rank, tags)
