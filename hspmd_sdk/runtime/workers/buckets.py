"""Gradient synchronisation in buckets, overlapped with backward (what DDP's reducer does, for HSPMD's plans).

A rank synchronises one *item* per ``GradSync`` operator of its executable graph (``Program.grad_syncs``: a
parameter's gradient is the SUM over its GradSyncs — a tied weight used on two stages has two).  An item's local
input is the sum of the gradients of the parameter's *uses* (the tensors the forward read: the parameter leaf, a
ZeRO-1 gather's output, a tied weight's copy on another stage) that this rank holds; its plan moves that sum onto
the parameter's layout.

**Buckets.**  The slice collectives of every item whose plan is one top-tier operator (``SplitAllReduce``,
``SplitReduceScatter``) are coalesced by (rank set, broadcast root) into flat buffers, DDP's layout: items in
*reverse* Program order (the last layers' parameters, whose gradients backward finishes first, come first), the
first bucket of each rank set at most ``first_bucket_bytes``, the others ``bucket_bytes``.  The bucket list is a
function of the Program alone and every rank posts its buckets strictly in list order, so each process group sees
its collectives in one order on all its members.

**When.**  Autograd's post-accumulate-grad hooks on the uses' tensors.  A use is *final* when its hook fires
during the step's last backward (the executor says which one: the schedule's last ``B``) or when that backward
returns; an item is ready when all its uses are, a bucket when all its items are.  The next buckets in order that
are ready are posted asynchronously at once (``async_op=True``) while autograd goes on with earlier layers.  Items
of other plans (the ``SendRecv`` that brings a tied weight's gradient back to its stage, BSR, ...) run after
backward, one by one in Program order, after every bucket has been posted — the same order on every rank.

**Parameter gathers.**  ZeRO-1's gathers (``PRE``'s top-tier Reshards of the sharded parameters) are coalesced the
same way by :class:`GatherBuckets`, run forwards: items in Program order (the first layers' parameters first, the
first bucket of each rank set small so the first forward can start), every bucket posted at once in ``PRE``, and
each parameter waited for where the forward first reads it -- one broadcast per bucket and owner instead of one per
parameter and owner (on gloo, 160 small broadcasts a step cost a 4-layer Llama's DP4 step 70%).

**ZeRO-2** (``release=True``, the Program's ``settings.zero >= 2``).  Once a bucket is filled, the full-size
gradients of the items whose last slice it carries are let go (the use tensors' ``.grad``, their fp32 sums), a
bucket's buffer lives only until its collective is waited for (it is not kept for the next step), and each item
keeps only its own slices, copied out of the buffer: between steps a rank holds just its gradient shards.
:meth:`GradBuckets.held_bytes` counts what the gradient synchronisation holds at a moment (tests measure with it).

**Precision.**  Each use's gradient (bf16 in a bf16 run) is accumulated over the micro-batches in fp32; the sums
travel in the wire dtype (the run's precision), and come back as fp32: the master weights' gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch

from ...core.comm_ops import SplitCollectiveOp
from ...core.slices import box_numel, box_shape, relative
from .comm import CommExecutionError, Pending, post_slice_collective, ExecContext, execute, group_lookup

if TYPE_CHECKING:
    from ...core.comm_ops import SliceCollective
    from ...core.comm_plan import CommPlan
    from .comm import Groups

__all__ = ["SyncItem", "Bucket", "GradBuckets", "GatherBuckets", "plan_buckets", "bucketable", "BUCKET_BYTES",
           "FIRST_BUCKET_BYTES"]

#: Largest flat buffer of one bucket (DDP's ``bucket_cap_mb`` default, 25 MiB).
BUCKET_BYTES = 25 * 2**20
#: The first bucket of each rank set (DDP's first bucket, 1 MiB): small, so that it is posted early in backward.
FIRST_BUCKET_BYTES = 2**20

Trace = Callable[..., None]


@dataclass(frozen=True)
class SyncItem:
    """One ``GradSync`` of this rank: the parameter, its plan at the wire dtype (``None``: the plan leaves this
    rank's sum where it is) and the names of the parameter's uses it sums."""

    param: str
    plan: "CommPlan | None"
    uses: tuple[str, ...]


def bucketable(plan: "CommPlan | None") -> bool:
    """Whether ``plan`` is one top-tier operator, whose slices can share buffers with other plans'."""
    return plan is not None and len(plan.ops) == 1 and isinstance(plan.ops[0], SplitCollectiveOp)


@dataclass
class Bucket:
    """A flat buffer of slices over one rank set: ``members`` are ``(item index, slice)`` in buffer order."""

    ranks: tuple[int, ...]
    root: int | None
    members: list[tuple[int, Any]] = field(default_factory=list)
    nbytes: int = 0
    items: list[int] = field(default_factory=list)   #: the items it holds slices of, ascending


def plan_buckets(plans: Sequence[tuple[int, "CommPlan"]], rank: int, *, bucket_bytes: int = BUCKET_BYTES,
                 first_bucket_bytes: int | None = FIRST_BUCKET_BYTES) -> list[Bucket]:
    """This rank's buckets of ``plans`` (``(item index, plan)`` in bucket order; only bucketable plans), in the
    order of their first slice.  A bucket never grows past its cap unless one slice alone is larger."""
    open_: dict[tuple[tuple[int, ...], int | None], Bucket] = {}
    count: dict[tuple[tuple[int, ...], int | None], int] = {}
    out: list[Bucket] = []
    for i, plan in plans:
        op = plan.ops[0]
        for s in op.slices:
            if rank not in s.ranks:
                continue
            root = s.contributors[0] if len(s.contributors) == 1 else None
            key = (tuple(s.ranks), root)
            nbytes = box_numel(s.box) * op.itemsize
            b = open_.get(key)
            first = count.get(key, 0) <= 1 and first_bucket_bytes is not None
            cap = min(first_bucket_bytes, bucket_bytes) if first else bucket_bytes  # type: ignore[type-var]
            if b is None or b.members and b.nbytes + nbytes > cap:
                b = open_[key] = Bucket(key[0], root)
                count[key] = count.get(key, 0) + 1
                out.append(b)
            b.members.append((i, s))
            b.nbytes += nbytes
    for b in out:
        b.items = sorted({i for i, _ in b.members})
    return out


#: ZeRO-2: the most gradient buckets in flight at once (each posted one beyond waits for the oldest)
IN_FLIGHT = 2
_SPENT = torch.empty(0)  # a landed ZeRO-2 bucket's buffer, let go

#: how one member slice of a bucket is filled on this rank: (item, the input box this rank holds -- ``None`` when
#: it contributes nothing --, that box's shape, where the slice lies in it -- ``None``: the whole box --, numel)
FillStep = tuple[int, Any, "tuple[int, ...] | None", Any, int]


def _fill_plan(b: Bucket, ops: Sequence[SplitCollectiveOp], rank: int) -> list[FillStep]:
    """How ``rank`` fills bucket ``b``'s flat buffer, worked out once (the boxes are a function of the Program)."""
    out: list[FillStep] = []
    for i, s in b.members:
        n = box_numel(s.box)
        if rank in s.contributors:
            inb = dict(ops[i].in_boxes)[rank]
            out.append((i, inb, box_shape(inb), None if s.box == inb else relative(s.box, inb), n))
        else:
            out.append((i, None, None, None, n))
    return out


def _fill(plan: Sequence[FillStep], local: Callable[[int], torch.Tensor | None], ctx: ExecContext,
          what: Callable[[int], str], buf: torch.Tensor | None) -> torch.Tensor:
    """A bucket's flat buffer (``buf`` reused when it fits) by its :func:`_fill_plan`: per member slice, this
    rank's part of item ``i``'s input (``local(i)``, the box the operator expects) where it contributes, else
    zeros."""
    parts = []
    for i, inb, shape, where, n in plan:  # views of the inputs (or zeros where this rank adds nothing): one copy
        if inb is None:
            parts.append(torch.zeros(n, dtype=ctx.dtype, device=ctx.device))
            continue
        t = local(i)
        if t is None or t.shape != shape:
            ctx.check(t, inb, what(i))  # raises, naming the item and the boxes
        parts.append((t if where is None else t[where]).reshape(-1))  # type: ignore[index, union-attr]
    n = sum(step[4] for step in plan)
    if buf is None or buf.numel() != n or buf.dtype != ctx.dtype:
        buf = torch.empty(n, dtype=ctx.dtype, device=ctx.device)
    torch.cat(parts, out=buf)  # the parts are flat
    return buf


class GradBuckets:
    """This rank's gradient synchronisation, step after step (see the module docstring).

    Per step: :meth:`begin` (the uses this rank holds), :meth:`watch` each use's tensor as it appears,
    :meth:`last_backward` around the step's last backward, :meth:`backward_done` after it, then :meth:`finish`
    -> ``{param: fp32 gradient}`` of the parameters this rank holds.  ``tag_base``: the point-to-point tags of
    the items run after backward (:func:`~.comm.execute`).  ``trace(event, **info)`` (tests) hears
    ``grad_final`` (a use's gradient is final) and ``bucket_start`` (a bucket's collective is posted)."""

    def __init__(self, items: Sequence[SyncItem], groups: "Groups", *, rank: int, device: torch.device,
                 dtype: torch.dtype, bucket_bytes: int = BUCKET_BYTES,
                 first_bucket_bytes: int | None = FIRST_BUCKET_BYTES, trace: Trace | None = None,
                 tag_base: int = 0, release: bool = False) -> None:
        self.items, self.rank, self.dtype, self.tag_base = list(items), int(rank), dtype, int(tag_base)
        self.release = bool(release)
        self.ctx = ExecContext(self.rank, group_lookup(groups), dtype, torch.device(device))
        self.trace = trace
        order = [(i, it.plan) for i, it in reversed(list(enumerate(self.items))) if bucketable(it.plan)]
        self.bucketed = {i for i, _ in order}
        self._ops = [it.plan.ops[0] if i in self.bucketed else None for i, it in enumerate(self.items)]
        self.buckets = plan_buckets(order, self.rank, bucket_bytes=bucket_bytes,
                                    first_bucket_bytes=first_bucket_bytes)
        self._fills = [_fill_plan(b, self._ops, self.rank) for b in self.buckets]  # type: ignore[arg-type]
        # one flat buffer per bucket, kept across steps (DDP keeps its buckets too): a fresh multi-MB tensor a
        # step is fresh pages from the OS to fault in, every step
        self._buffers: dict[int, torch.Tensor] = {}
        self._kept: dict[int, tuple[torch.Tensor, Any]] = {}  # id -> a tensor watched step after step, its hook
        # readiness by counting (a hook's check is O(its use's items), not a scan of the next bucket's items)
        self._items_of_use: dict[str, list[int]] = {}
        for i, it in enumerate(self.items):
            for u in dict.fromkeys(it.uses):
                self._items_of_use.setdefault(u, []).append(i)
        self._buckets_of_item: dict[int, list[int]] = {}
        for k, b in enumerate(self.buckets):
            for i in b.items:
                self._buckets_of_item.setdefault(i, []).append(k)
        # ZeRO-2: per bucket, the items whose last slice it carries (their local sums can go once it is filled)
        self._done_at: list[list[int]] = [[] for _ in self.buckets]
        for i, ks in self._buckets_of_item.items():
            self._done_at[max(ks)].append(i)
        # per bucket, where each slice this rank receives lands: (item, offset, numel, shape, None when the slice
        # is the item's whole output on this rank, else (that output's box, the slice's place in it))
        self._unpack: list[list[tuple[int, int, int, tuple[int, ...], Any]]] = []
        for b in self.buckets:
            at, places = 0, []
            for i, sl in b.members:
                n = box_numel(sl.box)
                if self.rank in sl.receivers:
                    mine = dict(self._ops[i].out_boxes)[self.rank]  # type: ignore[union-attr]
                    places.append((i, at, n, box_shape(sl.box),
                                   None if sl.box == mine else (mine, relative(sl.box, mine))))
                at += n
            self._unpack.append(places)
        self._reset()

    # ---- per step ---------------------------------------------------------------------------------------------
    def _reset(self) -> None:
        for h in getattr(self, "_handles", ()):
            h.remove()
        self._handles: list[Any] = []
        self._tensor: dict[str, torch.Tensor] = {}      # use -> its tensor
        self._grad: dict[int, torch.Tensor] = {}         # id(tensor) -> fp32 sum of its gradients
        self._names: dict[int, list[str]] = {}           # id(tensor) -> its use names
        self._held: set[str] = set()
        self._final: set[str] = set()
        self._waiting = [0] * len(self.items)      # per item: its held uses not final yet
        self._unready = [0] * len(self.buckets)    # per bucket: its items with a use waiting
        self._all_final = False
        self._last = False
        self._next = 0
        self._posted: list[tuple[Any, torch.Tensor]] = []
        self._wire: dict[int, torch.Tensor | None] = {}
        self._sent: set[int] = set()               # ZeRO-2: items whose every slice is in a posted bucket
        self._landed = 0                           # buckets waited for, their slices in _out
        self._out: dict[int, torch.Tensor | None] = {}  # bucketed item -> this rank's synchronised slices

    def begin(self, held: Iterable[str]) -> None:
        """A new step: ``held`` are the use tensors this rank holds (they will be :meth:`watch` ed)."""
        self._reset()
        for use in held:
            self._hold(use)

    def _hold(self, use: str) -> None:
        """``use`` is held by this rank: its items wait for it until it is final."""
        if use in self._held:
            return
        self._held.add(use)
        if use in self._final:
            return
        for i in self._items_of_use.get(use, ()):
            self._waiting[i] += 1
            if self._waiting[i] == 1:
                for k in self._buckets_of_item.get(i, ()):
                    self._unready[k] += 1

    def _finalize(self, use: str) -> None:
        """``use``'s gradient is final: its items wait for it no more."""
        if use in self._final:
            return
        self._final.add(use)
        if use not in self._held:
            return
        for i in self._items_of_use.get(use, ()):
            self._waiting[i] -= 1
            if self._waiting[i] == 0:
                for k in self._buckets_of_item.get(i, ()):
                    self._unready[k] -= 1

    def watch(self, use: str, tensor: torch.Tensor, *, keep: bool = False) -> None:
        """Collect the gradients of ``tensor`` (the use ``use``, a leaf) in this step.  ``keep``: the same
        tensor is watched again in the next steps (a parameter's leaf): its hook stays registered."""
        key = id(tensor)
        self._tensor[use] = tensor
        self._hold(use)
        if key in self._names:  # one tensor under two names: autograd already sums its uses
            self._names[key].append(use)
            return
        self._names[key] = [use]
        if keep:  # holding the tensor keeps its id unique
            kept = self._kept.get(key)
            if kept is None or kept[0] is not tensor:
                self._kept[key] = (tensor, tensor.register_post_accumulate_grad_hook(partial(self._on_grad, key)))
            return
        self._handles.append(tensor.register_post_accumulate_grad_hook(partial(self._on_grad, key)))

    def remember(self) -> None:
        """The uses watched so far this step are watched the same way every step (kept leaves only, no gathered
        tensor): :meth:`rewatch` starts the next steps with them at once."""
        if self._handles:
            raise RuntimeError("GradBuckets.remember: a tensor of this step is not kept across steps")
        self._remembered = (dict(self._tensor), {k: tuple(v) for k, v in self._names.items()}, frozenset(self._held),
                            tuple(self._waiting), tuple(self._unready))

    def rewatch(self) -> None:
        """A new step that holds and watches exactly what the step of :meth:`remember` had watched by then:
        :meth:`begin` plus every :meth:`watch`, without redoing them one by one."""
        self._reset()
        tensors, names, held, waiting, unready = self._remembered
        self._tensor, self._held = dict(tensors), set(held)
        self._names = {k: list(v) for k, v in names.items()}
        self._waiting, self._unready = list(waiting), list(unready)

    def last_backward(self, flag: bool) -> None:
        """Whether the backward about to run (or running) is the step's last: its hooks finalise the uses."""
        self._last = bool(flag)

    def _on_grad(self, key: int, tensor: torch.Tensor) -> None:
        names = self._names.get(key)
        if names is None:  # a kept tensor that this step does not watch
            return
        g = tensor.grad
        if g is not None:
            if g.dtype == torch.float32:  # autograd sums the micro-batches into .grad itself, in place
                self._grad[key] = g
            else:  # bf16: the micro-batches are summed in an fp32 buffer of ours
                tensor.grad = None
                acc = self._grad.get(key)
                self._grad[key] = g.float() if acc is None else acc.add_(g)
        if self._last:
            for name in names:
                self._finalize(name)
            if self.trace is not None:
                self.trace("grad_final", uses=list(names))
            self._post_ready()

    def backward_done(self) -> None:
        """Every gradient is final: post every bucket not yet posted."""
        self._last = False
        self._all_final = True
        self._post_ready()

    # ---- buckets ----------------------------------------------------------------------------------------------
    def _post_ready(self) -> None:
        """Post the next buckets in order whose items are ready: every use of theirs this rank holds is final."""
        while self._next < len(self.buckets) and (self._all_final or not self._unready[self._next]):
            self._post(self.buckets[self._next])
            self._next += 1

    def _local(self, i: int) -> torch.Tensor | None:
        """Item ``i``'s local sum (fp32): the gradients of the uses this rank holds (zeros if none got one);
        ``None`` if it holds none."""
        uses = self.items[i].uses
        if len(uses) == 1:  # the common case: one use, its tensor's gradient as it is
            t = self._tensor.get(uses[0])
            if t is None:
                return None
            g = self._grad.get(id(t))
            return g if g is not None else torch.zeros(t.shape, dtype=torch.float32, device=t.device)
        total, held = None, None
        seen: set[int] = set()
        for u in uses:
            t = self._tensor.get(u)
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            held = t
            g = self._grad.get(id(t))
            if g is not None:
                total = g if total is None else total + g
        if total is None and held is not None:
            return torch.zeros(held.shape, dtype=torch.float32, device=held.device)
        return total

    def _wire_input(self, i: int) -> torch.Tensor | None:
        if i not in self._wire:
            local = self._local(i)
            self._wire[i] = None if local is None else local.to(self.dtype)
        return self._wire[i]

    def _post(self, b: Bucket) -> None:
        ctx, k = self.ctx, len(self._posted)
        buf = _fill(self._fills[k], self._wire_input, ctx, lambda i: f"gradient of {self.items[i].param!r}",
                    None if self.release else self._buffers.get(k))
        if not self.release:  # kept for the next step (fresh pages a step cost time); ZeRO-2 lets it go after use
            self._buffers[k] = buf
        what = f"a gradient bucket of {len(b.members)} slices over {list(b.ranks)}"
        work = post_slice_collective(buf, b.ranks, b.root, ctx, what) if len(b.ranks) > 1 else None
        self._posted.append((work, buf))
        if self.release:  # at most IN_FLIGHT buckets' buffers at once: wait for the older ones, keep their slices
            self._let_go(k)
            self._land(k + 1 - IN_FLIGHT)
        if self.trace is not None:
            self.trace("bucket_start", index=k, ranks=list(b.ranks),
                       params=[self.items[i].param for i in b.items], bytes=b.nbytes)

    def _let_go(self, k: int) -> None:
        """ZeRO-2: bucket ``k`` is filled; the full-size gradients no item still needs go (a use tensor's ``.grad``
        and fp32 sum once every item reading it is in a posted bucket; items synchronised after backward, outside
        the buckets, keep theirs)."""
        for i in self._done_at[k]:
            self._sent.add(i)
            self._wire.pop(i, None)
            for u in self.items[i].uses:
                t = self._tensor.get(u)
                if t is None or id(t) not in self._grad:
                    continue
                readers = (j for name in self._names.get(id(t), (u,)) for j in self._items_of_use.get(name, ()))
                if all(j in self._sent for j in readers):
                    t.grad = None
                    del self._grad[id(t)]

    def _land(self, upto: int) -> None:
        """Wait for the posted buckets before index ``upto`` not waited for yet, and place the slices this rank
        receives into :attr:`_out` (item -> its destination tensor).  ZeRO-2 copies them out and drops the buffer."""
        ctx, me = self.ctx, self.rank
        out = self._out
        while self._landed < upto:
            k = self._landed
            work, buf = self._posted[k]
            if work is not None:
                try:
                    work.wait()
                except RuntimeError as e:  # a peer failed or timed out: say which collective
                    raise CommExecutionError(f"rank {me}, gradient bucket {k} over {list(self.buckets[k].ranks)}: "
                                             f"{e}") from e
            for i, at, n, shape, part in self._unpack[k]:
                piece = buf[at:at + n].view(shape)
                if part is None:  # the slice is this rank's whole gradient: a view of the bucket, no copy
                    out[i] = piece.clone() if self.release else piece  # ZeRO-2: the buffer goes
                else:
                    mine, where = part
                    if out.get(i) is None:
                        out[i] = ctx.zeros(mine)
                    out[i][where] = piece  # type: ignore[index]
            if self.release:
                self._posted[k] = (None, _SPENT)
            self._landed += 1

    def held_bytes(self) -> int:
        """Bytes of the distinct storages the gradient synchronisation holds now: the uses' gradients and fp32
        sums, the items' wire inputs, the buckets' buffers (posted this step, or kept from the last)."""
        seen: dict[int, int] = {}
        tensors = [*self._grad.values(), *(w for w in self._wire.values() if w is not None),
                   *(buf for _, buf in self._posted), *self._buffers.values(),
                   *(t for t in self._out.values() if t is not None),
                   *(t.grad for t in self._tensor.values() if t.grad is not None)]
        for t in tensors:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    # ---- the end of the step ----------------------------------------------------------------------------------
    def finish(self) -> dict[str, torch.Tensor]:
        """Wait for the buckets, run the other items (Program order), and return each held parameter's gradient:
        the fp32 sum over its items."""
        self.backward_done()
        ctx, me = self.ctx, self.rank
        self._land(len(self._posted))
        out = self._out
        for i in self.bucketed:
            if out.get(i) is None:  # no slice for this rank: zeros of its box (or it holds no destination)
                outb = dict(self.items[i].plan.ops[0].out_boxes)
                out[i] = ctx.zeros(outb[me]) if me in outb else None
        synced: dict[str, torch.Tensor] = {}
        for i, item in enumerate(self.items):
            if item.plan is None:
                got = self._local(i)
            elif i in self.bucketed:
                got = out[i] if me in item.plan.dst.ranks else None
            else:
                got = execute(item.plan, self._wire_input(i), self.ctx.lookup, rank=me, device=ctx.device,
                              tag_base=self.tag_base)
            if got is not None:
                if got.dtype != torch.float32:
                    got = got.float()
                synced[item.param] = got if item.param not in synced else synced[item.param] + got
        self._reset()
        return synced


class GatherBuckets:
    """Top-tier plans started together (``PRE``: ZeRO-1's parameter gathers), their slices coalesced into flat
    buffers by :func:`plan_buckets` in item order (see the module docstring).

    ``plans``: one bucketable plan per item (:func:`bucketable`), at the wire dtype, in Program order -- the same
    list on every rank (a rank keeps only the slices it is in).  :meth:`start` ``(inputs)`` posts every bucket
    (``async_op=True``) and returns one :class:`~.comm.Pending` per item; its ``wait()`` waits for the buckets that
    hold the item's slices and gives what :func:`~.comm.execute` would: the rank's destination tensor (zeros
    where it receives no slice), ``None`` outside the destination.  ``names`` name the items in errors and in the
    ``trace`` event ``gather_start`` (a bucket posted).  The flat buffers are kept for the next :meth:`start`
    unless ``keep_buffers=False`` (ZeRO-3's units: they go once the values are unpacked)."""

    def __init__(self, plans: Sequence["CommPlan"], names: Sequence[str], groups: "Groups", *, rank: int,
                 device: torch.device, dtype: torch.dtype, bucket_bytes: int = BUCKET_BYTES,
                 first_bucket_bytes: int | None = FIRST_BUCKET_BYTES, trace: Trace | None = None,
                 keep_buffers: bool = True) -> None:
        if not all(bucketable(p) for p in plans):
            raise ValueError("GatherBuckets takes plans of one top-tier operator each")
        self.plans, self.names, self.rank, self.trace = list(plans), list(names), int(rank), trace
        self.keep_buffers = bool(keep_buffers)  # ZeRO-3 gathers again and again: its buffers go with the values
        self.ops: list[SplitCollectiveOp] = [p.ops[0] for p in self.plans]
        self.ctx = ExecContext(self.rank, group_lookup(groups), dtype, torch.device(device))
        self.buckets = plan_buckets(list(enumerate(self.plans)), self.rank, bucket_bytes=bucket_bytes,
                                    first_bucket_bytes=first_bucket_bytes)
        self._fills = [_fill_plan(b, self.ops, self.rank) for b in self.buckets]
        self._where: dict[int, list[tuple[int, int, Any]]] = {}  # item -> (bucket, offset, slice) of its slices
        for k, b in enumerate(self.buckets):
            at = 0
            for i, s in b.members:
                self._where.setdefault(i, []).append((k, at, s))
                at += box_numel(s.box)
        self._buffers: dict[int, torch.Tensor] = {}

    def _what(self, i: int) -> str:
        return f"the gather of {self.names[i]!r}"

    def start(self, inputs: Sequence[torch.Tensor | None]) -> list[Pending]:
        """Post every bucket now, in bucket order; one :class:`~.comm.Pending` per item."""
        ctx = self.ctx
        works: list[Any] = []
        bufs: dict[int, torch.Tensor] = {}
        for k, b in enumerate(self.buckets):
            buf = bufs[k] = _fill(self._fills[k], inputs.__getitem__, ctx, self._what, self._buffers.get(k))
            if self.keep_buffers:
                self._buffers[k] = buf
            what = f"a parameter-gather bucket of {len(b.members)} slices over {list(b.ranks)}"
            try:
                works.append(post_slice_collective(buf, b.ranks, b.root, ctx, what) if len(b.ranks) > 1 else None)
            except RuntimeError as e:
                raise CommExecutionError(f"rank {self.rank}, {what}: {e}") from e
            if self.trace is not None:
                self.trace("gather_start", index=k, ranks=list(b.ranks), root=b.root,
                           params=[self.names[i] for i in b.items], bytes=b.nbytes)
        out = []
        for i in range(len(self.plans)):
            mine = self._where.get(i, [])
            held = [works[k] for k in sorted({k for k, _, _ in mine}) if works[k] is not None]
            out.append(Pending(held, partial(self._unpack, i, mine, bufs, inputs[i]), self._what(i), self.rank))
        return out

    def _unpack(self, i: int, mine: list[tuple[int, int, "SliceCollective"]], bufs: dict[int, torch.Tensor],
                local: torch.Tensor | None) -> torch.Tensor | None:
        if self.rank not in self.plans[i].dst.ranks:
            return None
        outb = dict(self.ops[i].out_boxes).get(self.rank)
        if outb is None:  # in the destination without an output box of this operator: it keeps what it holds
            return local
        out = self.ctx.zeros(outb)
        for k, at, s in mine:
            if self.rank in s.receivers:
                out[relative(s.box, outb)] = bufs[k][at:at + box_numel(s.box)].view(box_shape(s.box))
        return out
