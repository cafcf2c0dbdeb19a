"""Every communication operator type answers ``ranks()``, ``collective_groups()`` and ``p2p_edges()`` itself (issue
23: op kinds as types, no ``hasattr`` probing), checked on hand-built operators whose answers are read off their
definition, and on a resolved plan against the pipeline builder's view of it."""
from __future__ import annotations

from hspmd_sdk.core.comm_ops import (CollectiveGroup, CollectiveOp, IdentityOp, Message, PointToPointOp,
                                     SliceCollective, SplitCollectiveOp)
from hspmd_sdk.core.pipelines import collective_groups, op_ranks, p2p_edges, rank_kinds

ROW0, ROW1, ALL = ((0, 2), (0, 4)), ((2, 4), (0, 4)), ((0, 4), (0, 4))


def test_a_collective_names_its_groups_and_no_messages() -> None:
    op = CollectiveOp("AllGather", (CollectiveGroup((0, 1), (ROW0, ROW1), (ALL, ALL)),
                                    CollectiveGroup((5,), (ALL,), (ALL,))), itemsize=4, dim=0)
    assert op.ranks() == {0, 1, 5}
    assert op.collective_groups() == ((0, 1),)  # a group of one rank runs nothing
    assert op.p2p_edges() == ()
    split = CollectiveOp("LocalSplit", (CollectiveGroup((3,), (ALL,), (ROW0,)),), itemsize=4)
    assert split.ranks() == {3} and split.collective_groups() == ()


def test_a_split_collective_counts_zero_filled_receivers() -> None:
    s = SliceCollective(ROW0, ranks=(1, 2), contributors=(1, 2), receivers=(1, 2))
    lone = SliceCollective(ROW1, ranks=(4,), contributors=(4,), receivers=(4,))
    op = SplitCollectiveOp("SplitAllReduce", -2, -1, (s, lone), in_boxes=((1, ALL), (2, ALL), (4, ALL)),
                           out_boxes=((1, ALL), (2, ALL), (4, ALL), (7, ALL)), itemsize=2)
    assert op.ranks() == {1, 2, 4, 7}  # 7 receives no slice: it holds zeros
    assert op.collective_groups() == ((1, 2),)
    assert op.p2p_edges() == ()


def test_point_to_point_names_its_messages_copies_and_zeros() -> None:
    op = PointToPointOp("BSR", (Message(0, 3, ROW0, 32), Message(1, 1, ROW1, 32), Message(2, 3, ROW1, 32)),
                        copies=((5, ROW0),), in_boxes=((0, ROW0), (1, ROW1), (2, ROW1), (5, ROW0)),
                        out_boxes=((3, ALL), (1, ROW1), (5, ROW0), (6, ALL)), zero_fill=(6,))
    assert op.ranks() == {0, 1, 2, 3, 5, 6}
    assert op.p2p_edges() == ((0, 3), (2, 3))  # a rank's message to itself is a local copy, not an edge
    assert op.collective_groups() == ()
    assert [t[:2] for t in op.transfers()] == [(0, 3), (2, 3)]


def test_identity_takes_no_rank() -> None:
    op = IdentityOp()
    assert op.ranks() == frozenset() and op.collective_groups() == () and op.p2p_edges() == ()


def test_the_pipeline_builder_reads_a_plan_through_the_types() -> None:
    class Plan:
        ops = (CollectiveOp("AllReduce", (CollectiveGroup((0, 1), (ALL, ALL), (ALL, ALL)),), itemsize=4),
               PointToPointOp("SendRecv", (Message(1, 2, ALL, 64),), (), ((1, ALL),), ((2, ALL),)), IdentityOp())

    assert list(collective_groups(Plan)) == [(0, 1)]
    assert list(p2p_edges(Plan)) == [(1, 2)]
    assert rank_kinds(Plan, 1) == ("AllReduce", "SendRecv") and rank_kinds(Plan, 3) == ()
    assert op_ranks(Plan.ops[1]) == {1, 2}
