"""Graph switching (paper §7): move every parameter from one annotation plan to another by (fused) BSR.

``plan_switch(src_plan, dst_plan, cluster)`` builds one BSR table over all tensors and one scheme, so that the
heuristics (:mod:`.bsr`) balance the send load across every GPU, and packs all slices a sender sends a
receiver into one buffer (one message per pair; the packing is recorded in :class:`PackedMessage`).
``fused=False`` plans one BSR per tensor (the paper's "unfused", its load balanced within the tensor only);
``heuristics=False`` takes every slice from its lowest-rank surviving owner (the paper's baseline).

A *plan* here is either

* a mapping ``{name: (Annotation, shape)}``, or ``{name: Annotation}`` with ``shapes={name: shape}``, or
* an object with ``.annotations: dict[str, Annotation]`` (e.g. an ``AnnotationPlan``) and ``shapes=...``.

Only tensors of ``dst_plan`` move; each must exist in ``src_plan`` with the same shape.  The fused table is
scanned tensor by tensor in ``dst_plan`` order, slices in box order, so the cumulative send load of earlier
tensors steers the choice of senders for later ones.
"""
from __future__ import annotations

import dataclasses
import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from ..errors import ResolutionError
from .annotation import PARTIAL, Annotation, local_views
from .bsr import Assignment, BSREntry, LinkModel, bsr_scheme, bsr_table
from .comm_ops import OpKind
from .comm_plan import pick_unit, time_of, volume_by_rank, volume_table
from .gc_pause import gc_paused
from .resolve import itemsize_of
from .slices import Box, box_numel, box_shape, coalesce, relative, zeros

if TYPE_CHECKING:
    from .cluster import Cluster

__all__ = ["plan_switch", "SwitchPlan", "SwitchStep", "PackedMessage", "PackedItem", "TensorMove", "switch_table"]


@dataclass(frozen=True)
class PackedItem:
    """One slice inside a packed buffer: ``nbytes`` bytes at byte ``offset``."""

    tensor: str
    box: Box
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PackedMessage:
    """Everything ``src`` sends ``dst`` in one step, as one buffer of ``nbytes`` bytes."""

    src: int
    dst: int
    items: tuple[PackedItem, ...]
    nbytes: int
    #: its tag on the wire: its index in its step's messages (``None``: its position there; a rank's part of a
    #: plan, :meth:`SwitchPlan.part`, keeps only some messages and gives each its index in the whole step)
    tag: int | None = None


@dataclass(frozen=True)
class SwitchStep:
    """One BSR operator: packed messages, local copies ``(tensor, rank, box)``, zero-filled ``(tensor, rank)``."""

    messages: tuple[PackedMessage, ...]
    copies: tuple[tuple[str, int, Box], ...]
    zero_fill: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class TensorMove:
    """One tensor's source and destination layout."""

    name: str
    src: Annotation
    dst: Annotation
    shape: tuple[int, ...]
    itemsize: int


@dataclass(frozen=True)
class SwitchPlan:
    """The communication of a graph switch: one fused BSR step, or one BSR step per tensor (unfused)."""

    tensors: tuple[TensorMove, ...]
    steps: tuple[SwitchStep, ...]
    fused: bool
    heuristics: bool
    failed: tuple[int, ...]
    cluster: "Cluster | None"
    empty: tuple[int, ...] = ()  # ranks that hold nothing of the source (whatever it places there): receivers only

    @property
    def kinds(self) -> list[str]:
        return [OpKind.BSR] * len(self.steps)

    def part(self, rank: int, *, index: "Sequence[Sequence[Mapping[int, Sequence[int]]]] | None" = None
             ) -> "SwitchPlan":
        """What rank ``rank`` executes of this plan (SPEC §16: a switch sends each worker its part): each step's
        messages that ``rank`` sends or receives, its local copies and zero fills; the tensors' layouts and
        everything else as they are.  The runtime's :func:`~hspmd_sdk.runtime.workers.switch_exec.execute_switch`
        on ``rank`` does the same with the part as with the whole plan (each message keeps its tag).  ``index``:
        per step, rank -> the indices of its messages, of its copies and of its zero fills
        (:func:`~.program_part.switch_index`), for a launcher that writes every rank's part (looked up, not
        scanned: the same part)."""
        def mine(s: SwitchStep) -> SwitchStep:
            return SwitchStep(tuple(dataclasses.replace(m, tag=i) for i, m in enumerate(s.messages)
                                    if rank in (m.src, m.dst)),
                              tuple(c for c in s.copies if c[1] == rank), tuple(z for z in s.zero_fill if z[1] == rank))

        def looked_up(s: SwitchStep, by: Sequence[Mapping[int, Sequence[int]]]) -> SwitchStep:
            return SwitchStep(tuple(dataclasses.replace(s.messages[i], tag=i) for i in by[0].get(rank, ())),
                              tuple(s.copies[i] for i in by[1].get(rank, ())),
                              tuple(s.zero_fill[i] for i in by[2].get(rank, ())))

        if index is not None:
            return dataclasses.replace(self, steps=tuple(looked_up(s, by) for s, by in zip(self.steps, index)))
        return dataclasses.replace(self, steps=tuple(mine(s) for s in self.steps))

    def transfers(self) -> list[list[tuple[int, int, int, int]]]:
        """Per step, ``(sender, receiver, bytes, 1)`` for each packed message."""
        return [[(m.src, m.dst, m.nbytes, 1) for m in s.messages] for s in self.steps]

    def volume(self, cluster: "Cluster | None" = None) -> dict[int, dict[str, int]]:
        """Bytes each rank sends, ``{"intra": ..., "inter": ...}``."""
        ranks = sorted({r for t in self.tensors for r in t.src.ranks + t.dst.ranks})
        return volume_by_rank((x for s in self.transfers() for x in s), cluster or self.cluster, ranks)

    def estimated_time(self, cluster: "Cluster | None" = None) -> float:
        """Seconds: steps in sequence, each as long as its slowest sender (bytes / bandwidth + latency a message)."""
        cluster = cluster or self.cluster
        if cluster is None:
            raise ValueError("estimated_time needs a cluster")
        return time_of(self.transfers(), cluster)

    def simulate(self, inputs: Mapping[str, Mapping[int, Any]]) -> dict[str, dict[int, Any]]:
        """Run the switch in one process: ``inputs[name][rank]`` -> ``outputs[name][rank]`` (numpy or torch).

        Failed ranks' inputs are dropped before anything runs (their state is lost).  Messages are packed into
        one byte buffer per (sender, receiver) and unpacked on arrival, as the runtime does.
        """
        dead = set(self.failed)
        src: dict[str, dict[int, Any]] = {}
        for t in self.tensors:
            if t.name not in inputs:
                raise ValueError(f"simulate: no inputs for tensor {t.name!r}")
            src[t.name] = {r: x for r, x in inputs[t.name].items() if r not in dead}
            for r, x in src[t.name].items():
                if x.itemsize != t.itemsize:  # numpy and torch (>= 2.1) arrays both say it
                    raise ValueError(f"simulate: tensor {t.name!r} was planned with {t.itemsize}-byte elements but "
                                     f"rank {r}'s input is {x.dtype}; plan_switch(..., dtype=...) must match")
        sboxes = {t.name: {v.rank: v.box for v in local_views(t.src, t.shape)} for t in self.tensors}
        dboxes = {t.name: {v.rank: v.box for v in local_views(t.dst, t.shape)} for t in self.tensors}
        out: dict[str, dict[int, Any]] = {}
        for t in self.tensors:
            like = next(iter(src[t.name].values()))
            out[t.name] = {r: zeros(like, box_shape(b)) for r, b in dboxes[t.name].items()}
        for step in self.steps:
            for name, r, box in step.copies:
                out[name][r][relative(box, dboxes[name][r])] = src[name][r][relative(box, sboxes[name][r])]
            for m in step.messages:
                buf = _pack([src[i.tensor][m.src][relative(i.box, sboxes[i.tensor][m.src])] for i in m.items])
                for i in m.items:
                    like = src[i.tensor][m.src]
                    piece = _unpack(buf, i.offset, i.nbytes, like, box_shape(i.box))
                    out[i.tensor][m.dst][relative(i.box, dboxes[i.tensor][m.dst])] = piece
        return out

    def render(self) -> str:
        return switch_table(self)

    def __str__(self) -> str:
        return self.render()

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.render())}</pre>"


def switch_table(plan: SwitchPlan) -> str:
    """The per-rank send volume of a switch, ``R<rank>: <NVLink/intra MB> | <IB/inter MB>`` (Table 4 style;
    bytes instead of MB when every rank sends less than a megabyte)."""
    vol = plan.volume()
    intra = sum(v["intra"] for v in vol.values())
    inter = sum(v["inter"] for v in vol.values())
    name = ("Fused" if plan.fused else "Unfused") + " BSR " + ("with" if plan.heuristics else "w/o") + " heuristics"
    label, unit = pick_unit(vol)
    head = (f"{name}: {len(plan.tensors)} tensors, {sum(len(s.messages) for s in plan.steps)} messages in "
            f"{len(plan.steps)} step(s); total {intra / unit:.0f} {label} intra-node + {inter / unit:.0f} {label} "
            "inter-node")
    if plan.failed:
        head += f"; failed ranks {list(plan.failed)}"
    if plan.cluster is not None:
        head += f"; est. {plan.estimated_time():.3f} s"
    return head + f"\nSender: intra {label} | inter {label}\n" + volume_table(vol)  # in the same unit


# ---- planning ----------------------------------------------------------------------------------------------
def _layouts(plan: Any, shapes: Mapping[str, Sequence[int]] | None, what: str) -> dict[str, tuple[Annotation, tuple[int, ...]]]:
    items = plan.annotations if hasattr(plan, "annotations") else plan
    if not isinstance(items, Mapping):
        raise TypeError(f"{what}: expected a mapping name -> (Annotation, shape), or an object with .annotations")
    out = {}
    for name, val in items.items():
        if isinstance(val, Annotation):
            if shapes is None or name not in shapes:
                raise ResolutionError(f"{what}: tensor {name!r} has an annotation but no shape; pass "
                                      "shapes={name: shape} or give (Annotation, shape) pairs")
            ann, shape = val, shapes[name]
        else:
            ann, shape = val
        out[name] = (ann, tuple(int(n) for n in shape))
    return out


@gc_paused
def plan_switch(src_plan: Any, dst_plan: Any, cluster: "Cluster | None" = None, *,
                shapes: Mapping[str, Sequence[int]] | None = None, dtype: Any = "float32", fused: bool = True,
                heuristics: bool = True, failed: Iterable[int] = (), empty: Iterable[int] = ()) -> SwitchPlan:
    """Plan the (fused) BSR that moves every tensor of ``dst_plan`` from its layout in ``src_plan`` (§7).

    ``dtype``: one dtype, or a mapping name -> dtype.  ``failed``: ranks whose state is lost; they never send,
    and a slice only they held raises :class:`ResolutionError` naming the tensor and the slice.  ``empty``: ranks that
    hold nothing of ``src_plan``'s tensors (whatever it places on them) and take part as receivers only.
    """
    src, dst = _layouts(src_plan, shapes, "src_plan"), _layouts(dst_plan, shapes, "dst_plan")
    dead = tuple(sorted(set(failed)))
    silent = tuple(sorted({*dead, *empty}))  # ranks that never send
    moves, tables, zeros = [], [], []
    # tensors of one shape laid out alike both sides (the same layer kind on the same stages) have one table
    same: dict[tuple[Annotation, Annotation, tuple[int, ...], int], tuple[list[BSREntry], list[int]]] = {}
    for name, (dann, shape) in dst.items():
        if name not in src:
            raise ResolutionError(f"plan_switch: tensor {name!r} of dst_plan is not in src_plan")
        sann, sshape = src[name]
        if sshape != shape:
            raise ResolutionError(f"plan_switch: tensor {name!r} has shape {sshape} in src_plan but {shape} in "
                                  "dst_plan")
        dt = dtype[name] if isinstance(dtype, Mapping) else dtype
        move = TensorMove(name, sann, dann, shape, itemsize_of(dt))
        got = same.get((sann, dann, tuple(shape), move.itemsize))
        if got is None:
            for ann in (sann, dann):
                ann.check_shape(shape, name)
            if any(ds.partial > 1 for ds in sann.ds_union) or sann.hdim == PARTIAL:  # (HSize 1 is never PARTIAL)
                raise ResolutionError(f"plan_switch: tensor {name!r} is Partial in src_plan ({sann}); switching "
                                      "moves parameters, reduce it first (resolve() handles Partial Reshards)")
            lost = sorted(set(dead) & set(dann.ranks))
            if lost:
                raise ResolutionError(f"plan_switch: tensor {name!r} is placed on failed rank(s) {lost} in "
                                      f"dst_plan ({dann}); plan around the failed ranks")
            owners = [(v.rank, v.box) for v in local_views(sann, shape)]
            dviews = list(local_views(dann, shape))
            receivers = [(v.rank, v.box) for v in dviews if v.partial_index == 0]
            got = same[(sann, dann, tuple(shape), move.itemsize)] = (
                bsr_table(owners, receivers, shape, move.itemsize),
                [v.rank for v in dviews if v.partial_index != 0])
        table, zero_ranks = got
        moves.append(move)
        zeros.extend((name, r) for r in zero_ranks)
        tables.append([BSREntry(name, e.box, e.owners, e.receivers, e.nbytes) for e in table])
    links = LinkModel(cluster)
    itemsizes = {m.name: m.itemsize for m in moves}
    if fused:
        load: dict[int, int] = {}
        assigns = bsr_scheme([e for t in tables for e in t], links, load, heuristics=heuristics, failed=silent)
        steps = [_step(assigns, zeros, itemsizes)]
    else:
        steps = [_step(bsr_scheme(t, links, {}, heuristics=heuristics, failed=silent),
                       [z for z in zeros if z[0] == m.name], itemsizes) for t, m in zip(tables, moves)]
    return SwitchPlan(tuple(moves), tuple(steps), fused, heuristics, dead, cluster, tuple(sorted(set(empty))))


def _step(assigns: list[Assignment], zeros: list[tuple[str, int]], itemsize: Mapping[str, int]) -> SwitchStep:
    """Group the scheme's decisions into one packed message per (sender, receiver) and local copies
    (``itemsize``: bytes an element of each tensor).  A tensor's boxes between two ranks are coalesced; items
    and copies keep the order of their first decision."""
    copies: dict[tuple[str, int], list[Box]] = {}
    per_pair: dict[tuple[int, int], dict[str, list[Box]]] = {}
    for a in assigns:
        if a.src == a.dst:
            copies.setdefault((a.key, a.dst), []).append(a.box)
        else:
            per_pair.setdefault((a.src, a.dst), {}).setdefault(a.key, []).append(a.box)
    numel: dict[Box, int] = {}  # the same boxes recur for every tensor of a layout
    msgs = []
    for (s, d), by_name in sorted(per_pair.items()):
        packed, off = [], 0
        for name, boxes in by_name.items():
            for box in _merged(boxes):
                n = numel.get(box)
                if n is None:
                    n = numel[box] = box_numel(box)
                n *= itemsize[name]
                packed.append(PackedItem(name, box, off, n))
                off += n
        msgs.append(PackedMessage(s, d, tuple(packed), off))
    cps = tuple((name, r, box) for (name, r), boxes in copies.items() for box in _merged(boxes))
    return SwitchStep(tuple(msgs), cps, tuple(zeros))


def _merged(boxes: list[Box]) -> list[Box]:
    """``boxes`` (of one tensor, between two ranks) coalesced, sorted."""
    return boxes if len(boxes) == 1 else [b for _, b in coalesce([(0, b) for b in boxes])]


# ---- array helpers -----------------------------------------------------------------------------------------






def _pack(pieces: list[Any]) -> Any:
    if pieces and hasattr(pieces[0], "new_zeros"):
        import torch

        return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in pieces])
    import numpy as np

    return np.concatenate([np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in pieces])


def _unpack(buf: Any, offset: int, nbytes: int, like: Any, shape: tuple[int, ...]) -> Any:
    raw = buf[offset:offset + nbytes]
    if hasattr(raw, "clone"):
        return raw.clone().view(like.dtype).reshape(shape)
    return raw.copy().view(like.dtype).reshape(shape)
