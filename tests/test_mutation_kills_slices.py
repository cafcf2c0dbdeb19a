"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/slices.py.

Every expected box, index and string is worked out by hand from the module's docstrings: boxes are per-dim
``(start, stop)`` in global coordinates, a grid's cuts are every box boundary plus the tensor's ends, and
``coalesce`` merges same-key boxes one dim at a time, last dim first, returning each key's boxes sorted (keys in
first-seen order, or sorted by ``order``).
"""
from __future__ import annotations

import numpy as np
import pytest

from hspmd_sdk.core.slices import (Grid, box_contains, box_intersect, box_numel, box_shape, coalesce, format_box,
                                   relative, zeros)


def test_numel_and_shape_of_an_offset_box() -> None:
    """Sizes are stop - start per dim, multiplied: an offset box is not measured from 0."""
    box = ((2, 5), (10, 14), (1, 2))
    assert box_numel(box) == 3 * 4 * 1
    assert box_shape(box) == (3, 4, 1)
    assert box_numel(()) == 1 and box_shape(()) == ()


def test_zeros_keeps_the_library_and_dtype_of_like() -> None:
    """numpy: zeros of the given shape in like's dtype; torch: like.new_zeros (same dtype and device)."""
    z = zeros(np.ones((1,), dtype=np.int32), (2, 3))
    assert isinstance(z, np.ndarray) and z.shape == (2, 3) and z.dtype == np.int32 and not z.any()
    torch = pytest.importorskip("torch")
    t = zeros(torch.ones(1, dtype=torch.float16), (3, 2))
    assert isinstance(t, torch.Tensor) and tuple(t.shape) == (3, 2) and t.dtype == torch.float16
    assert not t.any()


def test_contains_includes_equal_edges_and_checks_every_dim() -> None:
    """A box contains itself and boxes sharing an edge; one dim sticking out on either side is enough to fail."""
    outer = ((0, 4), (2, 8))
    assert box_contains(outer, outer)
    assert box_contains(outer, ((0, 1), (7, 8)))
    assert box_contains(outer, ((3, 4), (2, 3)))
    assert not box_contains(outer, ((0, 5), (2, 8)))
    assert not box_contains(outer, ((0, 4), (1, 8)))
    assert not box_contains(outer, ((0, 4), (2, 9)))
    assert not box_contains(outer, ((-1, 4), (2, 8)))


def test_intersect_exact_and_empty_on_touching() -> None:
    """The overlap of two boxes per dim (max of starts, min of stops); boxes that only touch, or miss in any one
    dim, have none."""
    assert box_intersect(((0, 4), (2, 8)), ((1, 6), (0, 5))) == ((1, 4), (2, 5))
    assert box_intersect(((1, 6), (0, 5)), ((0, 4), (2, 8))) == ((1, 4), (2, 5))
    assert box_intersect(((0, 4), (2, 8)), ((4, 6), (2, 8))) is None  # touching along dim 0
    assert box_intersect(((0, 4), (2, 8)), ((0, 4), (8, 9))) is None  # touching along dim 1 (the last)
    assert box_intersect(((0, 4), (2, 8)), ((5, 6), (0, 9))) is None
    assert box_intersect(((0, 4),), ((3, 9),)) == ((3, 4),)


def test_relative_index_of_an_inner_box() -> None:
    """The inner box's slices are its bounds minus the outer box's starts, per dim."""
    assert relative(((3, 5), (12, 14)), ((2, 6), (10, 20))) == (slice(1, 3), slice(2, 4))
    a = np.arange(40).reshape(4, 10)
    assert a[relative(((3, 5), (12, 14)), ((2, 6), (10, 20)))].tolist() == [[12, 13], [22, 23]]


def test_format_box_text() -> None:
    """The text users read in messages: ``[start:stop, ...]``."""
    assert format_box(((0, 4), (2, 8))) == "[0:4, 2:8]"
    assert format_box(((3, 5),)) == "[3:5]"
    assert format_box(()) == "[]"


def test_grid_cuts_cells_and_boxes() -> None:
    """Cuts are the sorted box bounds plus 0 and each dim's size; cells_of lists the cells a box covers (in
    row-major order), and box gives back a cell's bounds."""
    g = Grid((8, 6), [((2, 5), (0, 3)), ((0, 8), (3, 6))])
    assert g.cuts == [[0, 2, 5, 8], [0, 3, 6]]
    assert list(g.cells_of(((2, 5), (0, 3)))) == [(1, 0)]
    assert list(g.cells_of(((0, 8), (3, 6)))) == [(0, 1), (1, 1), (2, 1)]
    assert list(g.cells_of(((0, 5), (0, 6)))) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert g.box((1, 0)) == ((2, 5), (0, 3))
    assert g.box((2, 1)) == ((5, 8), (3, 6))
    assert [g.box(c) for c in g.cells_of(((0, 2), (0, 6)))] == [((0, 2), (0, 3)), ((0, 2), (3, 6))]
    # no boxes: one cell, the whole tensor; a box starting at 1 adds a cut at 1 (not 0 itself)
    assert Grid((4,), []).cuts == [[0, 4]]
    assert Grid((4,), [((1, 4),)]).cuts == [[0, 1, 4]]


def test_coalesce_merges_last_dim_first() -> None:
    """An L of three unit cells: the last dim merges first (row 0 into one box), so the column is not merged."""
    cells = [("k", ((1, 2), (0, 1))), ("k", ((0, 1), (1, 2))), ("k", ((0, 1), (0, 1)))]
    assert coalesce(cells) == [("k", ((0, 1), (0, 2))), ("k", ((1, 2), (0, 1)))]


def test_coalesce_sorts_by_the_other_dims_before_merging() -> None:
    """Four cells in two columns with a gap between: the first-dim pass groups cells by their last-dim bounds
    (not lexicographically), so each column merges; cells given in reverse order still merge."""
    a, b, c, d = ((0, 1), (0, 1)), ((0, 1), (2, 3)), ((1, 2), (0, 1)), ((1, 2), (2, 3))
    assert coalesce([("k", x) for x in (d, c, b, a)]) == [("k", ((0, 2), (0, 1))), ("k", ((0, 2), (2, 3)))]
    assert coalesce([("k", x) for x in (a, b, c, d)]) == [("k", ((0, 2), (0, 1))), ("k", ((0, 2), (2, 3)))]


def test_coalesce_merges_only_adjacent_equal_faced_boxes() -> None:
    """A full 2x3 tiling collapses into one box; a gap, or a neighbour of another extent, stays apart."""
    tiles = [("k", ((i, i + 1), (j, j + 2))) for i in (1, 0) for j in (4, 2, 0)]
    assert coalesce(tiles) == [("k", ((0, 2), (0, 6)))]
    assert coalesce([("k", ((0, 2),)), ("k", ((3, 5),))]) == [("k", ((0, 2),)), ("k", ((3, 5),))]
    assert coalesce([("k", ((0, 1), (0, 2))), ("k", ((1, 2), (0, 3)))]) == [("k", ((0, 1), (0, 2))),
                                                                           ("k", ((1, 2), (0, 3)))]
    # three in a row along dim 0, out of order
    assert coalesce([("k", ((4, 6),)), ("k", ((0, 2),)), ("k", ((2, 4),))]) == [("k", ((0, 6),))]


def test_coalesce_keeps_keys_apart_in_first_seen_order() -> None:
    """Boxes of different keys never merge; keys come out in the order first seen, each key's boxes sorted."""
    items = [("b", ((2, 4),)), ("a", ((0, 2),)), ("b", ((0, 2),)), ("a", ((2, 3),)), ("c", ((5, 6),)),
             ("a", ((7, 9),))]
    assert coalesce(items) == [("b", ((0, 4),)), ("a", ((0, 3),)), ("a", ((7, 9),)), ("c", ((5, 6),))]


def test_coalesce_with_order_sorts_by_key_then_box() -> None:
    """With ``order``: the pieces sorted by order(key), then by box."""
    items = [("b", ((2, 4),)), ("a", ((6, 8),)), ("b", ((9, 10),)), ("a", ((0, 2),))]
    assert coalesce(items, order=lambda k: k) == [("a", ((0, 2),)), ("a", ((6, 8),)), ("b", ((2, 4),)),
                                                  ("b", ((9, 10),))]
    assert coalesce(items, order=lambda k: -ord(k)) == [("b", ((2, 4),)), ("b", ((9, 10),)), ("a", ((0, 2),)),
                                                        ("a", ((6, 8),))]
    # a single box of a key is returned as is
    assert coalesce([(3, ((1, 2), (5, 7)))]) == [(3, ((1, 2), (5, 7)))]
    assert coalesce([]) == []
