"""Each element of a laid-out tensor counted once: which parts of its box a rank *owns*.

A tensor laid out by an :class:`~hspmd_sdk.core.annotation.Annotation` may be held by several ranks at once
(Duplicate inside a device group, replicas across the top tier, overlapping boxes of uneven splits).  A sum over
the tensor's elements computed from the ranks' local tensors -- the squared L2 norm of a gradient for clipping by
global norm -- must count every element once, whatever the layout.  The rule here: an element is *owned* by the
lowest rank whose box holds it.  :func:`owned_boxes` gives the parts of one rank's box it owns, as boxes local to
that rank's tensor; the owned parts of all ranks tile the tensor exactly (each element in one rank's part).

This relies on what the layout promises for a non-partial tensor: every holder of an element holds the same value
(replicas agree).  A Partial layout (summands) has no owner per element and is refused.

Pure Python; no torch.
"""
from __future__ import annotations

from typing import Sequence

from .annotation import Annotation, local_views
from .slices import Box, Grid, coalesce, relative

__all__ = ["owned_boxes", "owned_boxes_by_rank"]


def owned_boxes_by_rank(annotation: Annotation, shape: Sequence[int]) -> dict[int, tuple[Box, ...]]:
    """Rank -> the boxes (in *global* coordinates) of the elements that rank owns: the lowest rank holding an
    element owns it.  Ranks that own nothing map to ``()``; the boxes of all ranks tile the tensor exactly.

    Raises ``ValueError`` for a Partial layout (its ranks hold summands, not elements)."""
    views = list(local_views(annotation, shape))
    partial = [v.rank for v in views if v.partial_count > 1]
    if partial:
        raise ValueError(f"annotation {annotation!r} is Partial on ranks {partial[:4]}: its ranks hold summands, "
                         "not elements, so no rank owns an element")
    lowest: dict[Box, int] = {}  # each distinct box: the lowest rank holding it
    for v in views:
        lowest[v.box] = min(v.rank, lowest.get(v.box, v.rank))
    out: dict[int, tuple[Box, ...]] = {v.rank: () for v in views}
    if len(lowest) == 1:  # one box (replicated, or a single holder): its lowest rank owns all of it
        ((box, r),) = lowest.items()
        out[r] = (box,)
        return out
    grid = Grid(tuple(shape), lowest)
    owner: dict[tuple[int, ...], int] = {}
    for box, r in sorted(lowest.items(), key=lambda kv: kv[1]):  # lowest rank first: it keeps each cell it holds
        for cell in grid.cells_of(box):
            owner.setdefault(cell, r)
    cells: dict[int, list[tuple[int, Box]]] = {}
    for cell, r in owner.items():
        cells.setdefault(r, []).append((r, grid.box(cell)))
    for r, items in cells.items():
        out[r] = tuple(b for _, b in coalesce(items))
    return out


def owned_boxes(annotation: Annotation, shape: Sequence[int], rank: int) -> tuple[Box, ...]:
    """The parts of ``rank``'s box that ``rank`` owns (:func:`owned_boxes_by_rank`), each as a box *relative to
    the rank's local tensor* (``local[tuple(slice(a, b) for a, b in box)]``); ``()`` when it owns nothing or holds
    nothing."""
    mine = owned_boxes_by_rank(annotation, shape).get(rank)  # None: rank holds nothing
    if not mine:
        return ()
    held = next(v.box for v in local_views(annotation, shape) if v.rank == rank)
    return tuple(tuple((s.start, s.stop) for s in relative(b, held)) for b in mine)
