"""Boxes of a global tensor and their finest-grained slices (paper §5.2, §5.3).

A *box* is a tuple of per-dim ``(start, stop)`` in global coordinates, the way :class:`LocalView` states what a
rank holds.  The *finest-grained slices* of a set of boxes are the cells of the grid spanned by every box
boundary: each box is an exact union of cells, and two cells are either equal or disjoint.
"""
from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from typing import Callable, Hashable, Iterable, Iterator, Sequence, TypeVar

Box = tuple[tuple[int, int], ...]
K = TypeVar("K", bound=Hashable)

__all__ = ["Box", "Grid", "box_numel", "box_shape", "zeros", "box_contains", "box_intersect", "relative", "coalesce", "format_box"]


def box_numel(box: Box) -> int:
    """Number of elements in ``box``."""
    return math.prod(b - a for a, b in box)


def box_shape(box: Box) -> tuple[int, ...]:
    """Shape of the local tensor that holds ``box``."""
    return tuple(b - a for a, b in box)


def zeros(like: object, shape: tuple[int, ...]) -> object:
    """Zeros of ``shape`` in the array library and dtype of ``like`` (a torch tensor or a numpy array)."""
    if hasattr(like, "new_zeros"):  # torch
        return like.new_zeros(shape)
    import numpy as np

    return np.zeros(shape, dtype=like.dtype)  # type: ignore[attr-defined]


def box_contains(outer: Box, inner: Box) -> bool:
    """Whether ``inner`` lies inside ``outer``."""
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def box_intersect(x: Box, y: Box) -> Box | None:
    """The intersection of two boxes, or ``None`` when it is empty."""
    out = []
    for (a, b), (c, d) in zip(x, y):
        lo, hi = max(a, c), min(b, d)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Index of ``inner`` inside a local tensor that holds ``outer`` (``inner`` must lie in ``outer``)."""
    return tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(outer, inner))


def format_box(box: Box) -> str:
    """``((0, 4), (2, 8))`` -> ``[0:4, 2:8]``."""
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


class Grid:
    """The grid of finest-grained slices spanned by a collection of boxes.

    Cells are named by their per-dim interval indices; :meth:`cells_of` lists the cells a box covers (the box is
    exactly their union when it was one of the boxes the grid was built from).
    """

    def __init__(self, shape: Sequence[int], boxes: Iterable[Box]) -> None:
        cuts: list[set[int]] = [{0, n} for n in shape]
        for box in boxes:
            for d, (a, b) in enumerate(box):
                cuts[d].add(a)
                cuts[d].add(b)
        self.cuts: list[list[int]] = [sorted(c) for c in cuts]

    def cells_of(self, box: Box) -> Iterator[tuple[int, ...]]:
        """Indices of the cells inside ``box``."""
        ranges = []
        for d, (a, b) in enumerate(box):
            cut = self.cuts[d]
            ranges.append(range(bisect_left(cut, a), bisect_left(cut, b)))
        return itertools.product(*ranges)

    def box(self, cell: tuple[int, ...]) -> Box:
        """The box of a cell."""
        return tuple((self.cuts[d][i], self.cuts[d][i + 1]) for d, i in enumerate(cell))


def coalesce(items: Iterable[tuple[K, Box]], order: Callable[[K], object] | None = None) -> list[tuple[K, Box]]:
    """Merge boxes with the same key that are adjacent along one dim and form a box together.

    One pass per dim, last dim first: grid cells that tile a box collapse into that box.  Used to turn
    finest-grained cells back into as few slices (messages, collectives) as the scheme allows.
    """
    by_key: dict[K, list[Box]] = {}
    for key, box in items:
        by_key.setdefault(key, []).append(box)
    out: list[tuple[K, Box]] = []
    for key, boxes in by_key.items():
        if len(boxes) == 1:  # nothing to merge (most keys of a switch's messages)
            out.append((key, boxes[0]))
            continue
        ndim = len(boxes[0])
        for d in reversed(range(ndim)):
            off = [i for i in range(ndim) if i != d]
            boxes.sort(key=lambda bx: ([bx[i] for i in off], bx[d]))
            merged: list[Box] = []
            for bx in boxes:
                if merged:
                    last = merged[-1]
                    if last[d][1] == bx[d][0] and all(last[i] == bx[i] for i in off):
                        merged[-1] = tuple((lo, hi) for (lo, _), (_, hi) in zip(last, bx))  # equal off dim d
                        continue
                merged.append(bx)
            boxes = merged
        boxes.sort()
        out.extend((key, bx) for bx in boxes)
    if order is not None:
        out.sort(key=lambda kb: (order(kb[0]), kb[1]))  # type: ignore[arg-type,return-value]
    return out
