"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/ownership.py.

Every expected answer is worked out by hand from the rule the module states (an element is owned by the lowest
rank whose box holds it): the boxes each rank holds under the annotation, then the lowest holder of each part.
Every test's name says ``owned_boxes`` (the mutation config selects the pure ownership tests by that name).
"""
from __future__ import annotations

import pytest

from hspmd_sdk import Annotation
from hspmd_sdk.core.ownership import owned_boxes, owned_boxes_by_rank


def test_owned_boxes_one_box_held_by_several_or_by_one() -> None:
    """Duplicated: the lowest rank owns the whole box, the other none; a single holder owns all of it."""
    assert owned_boxes_by_rank(Annotation("[1,0] D2"), (4, 2)) == {0: (((0, 4), (0, 2)),), 1: ()}
    assert owned_boxes_by_rank(Annotation("[0,1] D2"), (4, 2)) == {0: (((0, 4), (0, 2)),), 1: ()}
    assert owned_boxes_by_rank(Annotation("[0,2] D2 | [1] R"), (4, 2)) == {0: (((0, 4), (0, 2)),), 1: (), 2: ()}
    assert owned_boxes_by_rank(Annotation("[5] R"), (3,)) == {5: (((0, 3),),)}
    assert owned_boxes(Annotation("[1,0] D2"), (4, 2), 1) == ()
    assert owned_boxes(Annotation("[5] R"), (3,), 5) == (((0, 3),),)


def test_owned_boxes_a_replica_owns_what_lower_ranks_do_not_hold() -> None:
    """Rows 0-2 / 2-4 / 4-6 on ranks 2, 0, 3 and the whole tensor on rank 1: rank 0 owns its rows, rank 1 the
    rest (two boxes, in row order), ranks 2 and 3 nothing."""
    ann = Annotation("[2,0,3] S0x3 | [1] R")
    assert owned_boxes_by_rank(ann, (6, 2)) == {0: (((2, 4), (0, 2)),), 1: (((0, 2), (0, 2)), ((4, 6), (0, 2))),
                                                 2: (), 3: ()}
    assert owned_boxes(ann, (6, 2), 0) == (((0, 2), (0, 2)),)  # rows 2-4, relative to rank 0's rows 2-4
    assert owned_boxes(ann, (6, 2), 1) == (((0, 2), (0, 2)), ((4, 6), (0, 2)))
    assert owned_boxes(ann, (6, 2), 3) == ()


def test_owned_boxes_parts_of_one_owner_merge() -> None:
    """Rank 1 holds everything, rank 0 the first third: rank 1 owns rows 2-6 as one box."""
    ann = Annotation("[0,2,3] S0x3 | [1] R")
    assert owned_boxes_by_rank(ann, (6, 2)) == {0: (((0, 2), (0, 2)),), 1: (((2, 6), (0, 2)),), 2: (), 3: ()}


def test_owned_boxes_are_relative_to_the_owners_tensor() -> None:
    """Rank 2 holds rows 2-4 and owns them: locally rows 0-2; a rank outside the layout holds and owns nothing."""
    ann = Annotation("[1,2] S0x2 | [3] R")
    assert owned_boxes_by_rank(ann, (4, 2)) == {1: (((0, 2), (0, 2)),), 2: (((2, 4), (0, 2)),), 3: ()}
    assert owned_boxes(ann, (4, 2), 2) == (((0, 2), (0, 2)),)
    assert owned_boxes(ann, (4, 2), 7) == ()
    cols = Annotation("[3,0] S1x2 | [1] R")  # rank 0 holds columns 2-4, rank 1 everything
    assert owned_boxes_by_rank(cols, (2, 4)) == {0: (((0, 2), (2, 4)),), 1: (((0, 2), (0, 2)),), 3: ()}
    assert owned_boxes(cols, (2, 4), 0) == (((0, 2), (0, 2)),)


def test_owned_boxes_of_a_partial_layout_are_refused_naming_its_ranks() -> None:
    with pytest.raises(ValueError) as e:
        owned_boxes_by_rank(Annotation("[0,1] P2"), (4, 4))
    assert "is Partial on ranks [0, 1]: its ranks hold summands, not elements, so no rank owns an element" \
        in str(e.value)


def test_owned_boxes_of_two_boxes_each_held_once() -> None:
    """Two distinct boxes (an even split): each holder owns its own box."""
    assert owned_boxes_by_rank(Annotation("[1,0] S0x2"), (4, 2)) == {1: (((0, 2), (0, 2)),), 0: (((2, 4), (0, 2)),)}
    assert owned_boxes(Annotation("[1,0] S0x2"), (4, 2), 0) == (((0, 2), (0, 2)),)
