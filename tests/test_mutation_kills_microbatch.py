"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/microbatch.py.

A step-level plan of hand-built operators (one of each kind of the IR) whose boxes are worked out by hand: the
pipeline's batch chunk ``[2, 6)`` along dim 1 becomes ``[0, size)``, every other interval stays, a box straddling
the chunk is refused with the message a user reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from hspmd_sdk.core.comm_ops import (CollectiveGroup, CollectiveOp, IdentityOp, Message, OpKind, PointToPointOp,
                                     SliceCollective, SplitCollectiveOp)
from hspmd_sdk.core.microbatch import MicroBatchError, batch_dim, micro_batch_plan
from hspmd_sdk.core.symbolic import sym


@dataclass(frozen=True)
class Plan:
    """The two fields micro_batch_plan reads of a CommPlan (a dataclass, so it is rebuilt with replace)."""
    ops: tuple
    itemsize: int
    name: str = "p"


MINE, OTHER = ((0, 4), (2, 6), (0, 8)), ((0, 4), (6, 8), (0, 8))  # dim 1: this pipeline's chunk, another's


def _small(box: tuple) -> tuple:
    return box[:1] + ((0, 3),) + box[2:] if box[1] == (2, 6) else box


def test_batch_dim_is_the_dim_named_by_the_symbol() -> None:
    """The first dim whose symbol is exactly the batch symbol; ints and other expressions are not."""
    B, S = sym("B"), sym("S")
    assert batch_dim((B, S, 8)) == 0
    assert batch_dim((S, B)) == 1
    assert batch_dim((8, 2 * B, S)) is None
    assert batch_dim((8, 4)) is None and batch_dim(()) is None
    assert batch_dim((B, S), symbol="S") == 1


def test_every_operator_kind_gets_the_micro_batch_rows() -> None:
    """Collective, split collective and point-to-point boxes of this pipeline's chunk become [0, 3); other
    pipelines' boxes stay; identities pass as they are; message bytes are the new box's elements * itemsize."""
    ident = IdentityOp()
    coll = CollectiveOp(OpKind.ALL_REDUCE, (CollectiveGroup((0, 1), (MINE, MINE), (MINE, OTHER)),), 4)
    split = SplitCollectiveOp(OpKind.SPLIT_ALL_REDUCE, 0, 0, (SliceCollective(MINE, (0, 1), (0,), (1,)),
                                                              SliceCollective(OTHER, (2,), (2,), (2,))),
                              ((0, MINE), (2, OTHER)), ((1, MINE), (3, OTHER)), 4)
    p2p = PointToPointOp(OpKind.SEND_RECV, (Message(0, 1, MINE, 4 * 4 * 4 * 8), Message(2, 3, OTHER, 4 * 4 * 2 * 8)),
                         ((0, MINE), (2, OTHER)), ((0, MINE), (2, OTHER)), ((1, MINE), (3, OTHER)), zero_fill=(5,))
    plan = Plan((ident, coll, split, p2p), 4)
    out = micro_batch_plan(plan, 1, (2, 6), 3)
    assert out.name == "p" and out.itemsize == 4 and out.ops[0] is ident
    s = _small(MINE)
    assert s == ((0, 4), (0, 3), (0, 8))
    assert out.ops[1] == CollectiveOp(OpKind.ALL_REDUCE, (CollectiveGroup((0, 1), (s, s), (s, OTHER)),), 4)
    assert out.ops[2] == SplitCollectiveOp(OpKind.SPLIT_ALL_REDUCE, 0, 0,
                                           (SliceCollective(s, (0, 1), (0,), (1,)),
                                            SliceCollective(OTHER, (2,), (2,), (2,))),
                                           ((0, s), (2, OTHER)), ((1, s), (3, OTHER)), 4)
    assert out.ops[3] == PointToPointOp(OpKind.SEND_RECV, (Message(0, 1, s, 4 * 3 * 8 * 4),
                                                           Message(2, 3, OTHER, 4 * 2 * 8 * 4)),
                                        ((0, s), (2, OTHER)), ((0, s), (2, OTHER)), ((1, s), (3, OTHER)),
                                        zero_fill=(5,))
    assert plan.ops[3].messages[0].box == MINE  # the step-level plan is left as it was


def test_the_whole_chunk_and_one_row_fit_but_no_more_or_less() -> None:
    """size may be 1 .. b - a; anything else is refused naming the size and the chunk."""
    plan = Plan((PointToPointOp(OpKind.SEND_RECV, (Message(0, 1, MINE, 0),), (), (), ()),), 2)
    assert micro_batch_plan(plan, 1, (2, 6), 4).ops[0].messages[0] == Message(0, 1, ((0, 4), (0, 4), (0, 8)),
                                                                              4 * 4 * 8 * 2)
    assert micro_batch_plan(plan, 1, (2, 6), 1).ops[0].messages[0].box == ((0, 4), (0, 1), (0, 8))
    for bad in (5, 0, -1):
        with pytest.raises(MicroBatchError) as e:
            micro_batch_plan(plan, 1, (2, 6), bad)
        assert str(e.value) == f"micro-batch of {bad} rows does not fit the pipeline's chunk [2, 6)"


def test_boxes_beside_the_chunk_stay_and_boxes_across_it_are_refused() -> None:
    """Intervals that end at the chunk's start or begin at its end are another pipeline's; one that overlaps the
    chunk without being it is refused, with the box, the chunk and the dim named."""
    before, after = ((0, 2),), ((6, 9),)
    plan = Plan((PointToPointOp(OpKind.SEND_RECV, (), ((0, before), (1, after)), (), ()),), 4)
    assert micro_batch_plan(plan, 0, (2, 6), 2).ops[0].copies == ((0, before), (1, after))
    for box in (((1, 3),), ((5, 7),), ((3, 5),), ((2, 5),), ((0, 9),)):
        bad = Plan((PointToPointOp(OpKind.SEND_RECV, (), ((0, box),), (), ()),), 4)
        with pytest.raises(MicroBatchError) as e:
            micro_batch_plan(bad, 0, (2, 6), 2)
        assert str(e.value) == (f"box {box} covers part of the pipeline's batch chunk [2, 6) along dim 0: a plan "
                                "that splits the batch inside a pipeline cannot be micro-batched")
