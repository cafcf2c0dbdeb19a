"""Which rank writes which box of a checkpoint, and which bytes a rank of another Program reads back.

Both are functions of layouts only (``Program.state_layouts()``: every parameter and Adam moment with its
annotation and full shape), with the box logic the BSR table uses (:func:`~hspmd_sdk.core.annotation.local_view`,
:mod:`hspmd_sdk.core.slices`):

* :func:`write_plan` — saving is a BSR *to storage*: the owners of a tensor are the ranks' local views, the one
  receiver is the whole tensor.  :func:`~hspmd_sdk.core.bsr.bsr_table` cuts it into finest-grained slices with
  their owner sets, and :func:`~hspmd_sdk.core.bsr.bsr_scheme` (no cluster: every link equal) gives each slice to
  its least-loaded owner, the load shared by every tensor.  So every element of every tensor is written exactly
  once (among the replicas of a box one rank writes it; a box that overlaps a coarser one on another subgroup —
  TP2 beside TP1 — is not written twice), and the write bytes are balanced over the ranks holding them.
* :func:`read_plan` — what one rank of a (new) Program needs: its local view of every tensor it holds,
  intersected with the stored pieces (:func:`~hspmd_sdk.core.slices.box_intersect`).  A rank reads exactly
  those intersections, nothing else.
* :func:`tiling_problems` — that the stored pieces of a tensor cover it exactly once (what makes a read plan
  complete).

Pure Python (no torch): the launcher checks a checkpoint against a Program with these before any worker starts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from ...core.annotation import Annotation, local_view
from ...core.bsr import LinkModel, bsr_scheme, bsr_table
from ...core.slices import Box, box_intersect, box_numel, coalesce, format_box

if TYPE_CHECKING:
    from ...core.specialize import Program

__all__ = ["Layout", "layouts_of", "write_plan", "read_plan", "tiling_problems", "ReadItem", "DTYPE_BYTES"]

#: Bytes per element of the dtypes a checkpoint holds.
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1}

#: The pseudo-rank of the storage in the write plan's BSR table (no real rank is negative).
_STORAGE = -1


@dataclass(frozen=True)
class Layout:
    """What the plans need of a tensor of training state: its annotation, full shape and dtype."""

    name: str
    annotation: Annotation
    shape: tuple[int, ...]
    dtype: str


def layouts_of(program: "Program") -> dict[str, Layout]:
    """:class:`Layout` of every tensor in ``program.state_layouts()`` (parameters and Adam moments)."""
    return {n: Layout(n, l.annotation, tuple(int(d) for d in l.shape), l.dtype)
            for n, l in program.state_layouts().items()}


def _itemsize(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"checkpoints hold {sorted(DTYPE_BYTES)}, not dtype {dtype!r}") from None


def _views(layout: Layout) -> list[tuple[int, Box]]:
    """``(rank, box)`` of every rank holding part of ``layout`` (training state is never Partial)."""
    out = []
    for r in layout.annotation.ranks:
        view = local_view(layout.annotation, layout.shape, r)
        assert view is not None
        if view.partial_count != 1:
            raise ValueError(f"tensor {layout.name!r} is Partial under {layout.annotation}: training state must be "
                             "whole on every rank (a Partial parameter cannot be checkpointed)")
        out.append((r, view.box))
    return out


def write_plan(layouts: Mapping[str, Layout]) -> dict[str, list[tuple[int, Box]]]:
    """Tensor name -> ``(writer rank, box)`` pieces that tile it: every element written once, by a rank holding
    it, the bytes balanced across ranks (see the module docstring).  Identical on every rank (a pure function of
    the layouts, in their order)."""
    load: dict[int, int] = {}
    links = LinkModel(None)
    out: dict[str, list[tuple[int, Box]]] = {}
    for name, layout in layouts.items():
        whole: Box = tuple((0, d) for d in layout.shape)
        table = bsr_table(_views(layout), [(_STORAGE, whole)], layout.shape, _itemsize(layout.dtype), key=name)
        assigned = bsr_scheme(table, links, load)
        out[name] = [(r, box) for r, box in coalesce([(a.src, a.box) for a in assigned])]
    return out


@dataclass(frozen=True)
class ReadItem:
    """One read of a rank: the part ``box`` (global coordinates) of stored piece ``piece`` of tensor ``name``."""

    name: str
    piece: int
    box: Box
    nbytes: int


def read_plan(layouts: Mapping[str, Layout], stored: Mapping[str, Sequence[Box]], rank: int
              ) -> dict[str, tuple[Box, list[ReadItem]]]:
    """For each tensor ``rank`` holds under ``layouts``: ``(its box, the reads that fill it)``.

    ``stored``: tensor name -> the boxes of its stored pieces (in the manifest's order; a read names its piece
    by that index).  Raises ``ValueError`` naming the tensor when the pieces do not cover the rank's box."""
    out: dict[str, tuple[Box, list[ReadItem]]] = {}
    for name, layout in layouts.items():
        view = local_view(layout.annotation, layout.shape, rank)
        if view is None:
            continue
        items, covered = [], 0
        for i, piece in enumerate(stored.get(name, ())):
            inter = box_intersect(piece, view.box)
            if inter is None:
                continue
            n = box_numel(inter)
            covered += n
            items.append(ReadItem(name, i, inter, n * _itemsize(layout.dtype)))
        if covered != box_numel(view.box):
            raise ValueError(f"tensor {name!r}: the stored pieces cover {covered} of the {box_numel(view.box)} "
                             f"elements of rank {rank}'s box {format_box(view.box)}")
        out[name] = (view.box, items)
    return out


def tiling_problems(name: str, shape: Sequence[int], boxes: Iterable[Box]) -> list[str]:
    """Why ``boxes`` do not tile a tensor of ``shape`` exactly once (empty: they do)."""
    boxes = list(boxes)
    problems = []
    for b in boxes:
        if len(b) != len(shape) or any(not (0 <= lo < hi <= d) for (lo, hi), d in zip(b, shape)):
            problems.append(f"tensor {name!r}: piece {format_box(b)} is not inside its shape {tuple(shape)}")
    if problems:
        return problems
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if box_intersect(a, b) is not None:
                problems.append(f"tensor {name!r}: pieces {format_box(a)} and {format_box(b)} overlap")
    total = sum(box_numel(b) for b in boxes)
    if not problems and total != math.prod(shape):
        problems.append(f"tensor {name!r}: its pieces hold {total} of its {math.prod(shape)} elements")
    return problems
