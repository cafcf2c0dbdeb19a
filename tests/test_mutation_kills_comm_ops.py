"""Kills of hspmd_sdk/core/comm_ops.py's mutants (issue 49): ring volumes and steps, the transfers each operator
lists, apply's reference semantics (numpy and torch), its shape-check messages, and the describe() text -- every
expected value written out by hand from the formulas in the docstrings."""
from __future__ import annotations

import numpy as np
import pytest

from hspmd_sdk.core.comm_ops import (CollectiveGroup, CollectiveOp, IdentityOp, Message, OpKind, PointToPointOp,
                                     SliceCollective, SplitCollectiveOp, merge_p2p, ring_numel, ring_transfers)

AR, RS, AG, A2A = OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_TO_ALL


# ---- OpKind --------------------------------------------------------------------------------------------------
def test_opkind_reads_the_snake_spellings_and_refuses_others_with_valueerror():
    assert OpKind("all_reduce") is AR and OpKind("reduce_scatter") is RS
    assert OpKind("all_gather") is AG and OpKind("all_to_all") is A2A
    assert OpKind("AllReduce") is AR
    with pytest.raises(ValueError, match="is not a valid OpKind"):
        OpKind("allreduce")
    with pytest.raises(ValueError, match="is not a valid OpKind"):
        OpKind(["all_reduce"])  # not a str: _missing_ answers None (no lookup of an unhashable value)


def test_ring_bytes_and_steps():
    """AllReduce: 2(g-1)/g of the buffer in 2(g-1) steps; ReduceScatter/AllGather: (g-1)/g in g-1; a group of one
    (or none) sends nothing in no step."""
    assert AR.ring(4, 100) == (150.0, 6)
    assert AR.ring(2, 100) == (100.0, 2)
    assert RS.ring(4, 100) == (75.0, 3)
    assert AG.ring(2, 100) == (50.0, 1)
    assert AG.ring(5, 100) == (80.0, 4)
    for k in (AR, RS, AG):
        assert k.ring(1, 100) == (0.0, 0) and k.ring(0, 100) == (0.0, 0)
    with pytest.raises(ValueError, match=r"^AllToAll is not a ring collective \(AllReduce, ReduceScatter, "):
        A2A.ring(2, 10)


def test_kind_given_as_a_plain_name_reads_back_typed():
    for op in (CollectiveOp("AllReduce", (), 4), PointToPointOp("BSR", (), (), (), ()),
               SplitCollectiveOp("SplitAllGather", 0, 1, (), (), (), 4), IdentityOp("Identity")):
        assert type(op.kind) is OpKind
    assert CollectiveOp("all_gather", (), 4).kind is AG
    assert IdentityOp().kind is OpKind.IDENTITY


def test_ring_numel_reads_the_first_box_or_sums_a_gather():
    a, b = ((0, 2), (0, 3)), ((0, 4), (0, 3))
    assert ring_numel(AR, (a, b)) == 6 and ring_numel(RS, (b, a)) == 12
    assert ring_numel(AR, (a,)) == 6
    assert ring_numel(AG, (a, b)) == 18


def test_ring_transfers():
    assert ring_transfers((5,), 7, 1) == []
    assert ring_transfers((1, 2), 0, 1) == []
    assert ring_transfers((1, 2), 1, 3) == [(1, 2, 1, 3), (2, 1, 1, 3)]
    assert ring_transfers((4, 6, 8), 5, 2) == [(4, 6, 5, 2), (6, 8, 5, 2), (8, 4, 5, 2)]


# ---- CollectiveOp ----------------------------------------------------------------------------------------------
def _grp(ranks, ins, outs):
    return CollectiveGroup(tuple(ranks), tuple(ins), tuple(outs))


def test_collective_transfers_every_group_after_a_group_of_one():
    """A group of one is skipped, the later groups still count; each ring adds its own transfers."""
    full = ((0, 4),)
    op = CollectiveOp(AR, (_grp([9], [full], [full]), _grp([0, 1], [full] * 2, [full] * 2),
                           _grp([2, 3], [full] * 2, [full] * 2)), 2)
    # buffer 4 elements * 2 bytes = 8 B; AllReduce g=2: 2*1*8/2 = 8 B in 2 steps
    assert op.transfers() == [(0, 1, 8, 2), (1, 0, 8, 2), (2, 3, 8, 2), (3, 2, 8, 2)]
    ag = CollectiveOp(AG, (_grp([0, 1, 2], [((0, 1),), ((1, 3),), ((3, 6),)], [((0, 6),)] * 3),), 1)
    # gathered buffer 6 B, g=3: 2/3 of it = 4 B in 2 steps
    assert ag.transfers() == [(0, 1, 4, 2), (1, 2, 4, 2), (2, 0, 4, 2)]


def test_all_to_all_sends_each_peer_its_part_once():
    # member i holds rows [2i, 2i+2) of all 4 columns, keeps columns [2i, 2i+2) of all rows afterwards
    ins = [((0, 2), (0, 4)), ((2, 4), (0, 4))]
    outs = [((0, 4), (0, 2)), ((0, 4), (2, 4))]
    op = CollectiveOp(A2A, (_grp([3, 5], ins, outs),), 4, dim=1, src_dim=0)
    assert op.transfers() == [(3, 5, 16, 1), (5, 3, 16, 1)]
    x = np.arange(16.0).reshape(4, 4)
    got = op.apply({3: x[0:2], 5: x[2:4]})
    np.testing.assert_array_equal(got[3], x[:, 0:2])
    np.testing.assert_array_equal(got[5], x[:, 2:4])


def test_collective_apply_single_member_groups_and_reduce_scatter():
    """Groups of one rank copy their own tensor (AllReduce, AllGather); ReduceScatter hands out the summed chunks."""
    full = ((0, 4),)
    a = np.array([1.0, 2.0, 3.0, 4.0])
    one = CollectiveOp(AR, (_grp([0], [full], [full]),), 8).apply({0: a})
    np.testing.assert_array_equal(one[0], a)
    assert one[0] is not a
    gat = CollectiveOp(AG, (_grp([0], [((0, 2),)], [full]),), 8).apply({0: a[:2]})
    np.testing.assert_array_equal(gat[0], [1.0, 2.0, 0.0, 0.0])
    rs = CollectiveOp(RS, (_grp([0, 1], [full, full], [((0, 2),), ((2, 4),)]),), 8, dim=0)
    got = rs.apply({0: a, 1: 10 * a})
    np.testing.assert_array_equal(got[0], [11.0, 22.0])
    np.testing.assert_array_equal(got[1], [33.0, 44.0])


def test_collective_apply_on_torch_tensors():
    torch = pytest.importorskip("torch")
    full = ((0, 3),)
    a = torch.tensor([1.0, 2.0, 3.0])
    op = CollectiveOp(AR, (_grp([0, 1], [full, full], [full, full]),), 4)
    got = op.apply({0: a, 1: a})
    assert torch.equal(got[0], torch.tensor([2.0, 4.0, 6.0])) and torch.equal(got[1], got[0])
    one = CollectiveOp(AR, (_grp([0], [full], [full]),), 4).apply({0: a})
    assert torch.equal(one[0], a) and one[0] is not a


def test_collective_apply_names_the_kind_and_rank_of_a_wrong_shape():
    full = ((0, 4),)
    op = CollectiveOp(AR, (_grp([0, 1], [full, full], [full, full]),), 4)
    with pytest.raises(ValueError, match=r"^AllReduce: rank 1 holds a tensor of shape \(3,\) but the plan expects the "
                                         r"box \[0:4\] of shape \(4,\)$"):
        op.apply({0: np.zeros(4), 1: np.zeros(3)})


def test_collective_describe_dims_and_more_than_eight_groups():
    b = ((0, 2), (0, 4))
    plain = CollectiveOp(AR, (_grp([0, 1], [b, b], [b, b]),), 4)
    assert plain.describe() == ["AllReduce: 1 group(s)", "    ranks [0, 1]  in [0:2, 0:4] -> out [0:2, 0:4]"]
    rs = CollectiveOp(RS, (_grp([0, 1], [b, b], [((0, 1), (0, 4)), ((1, 2), (0, 4))]),), 4, dim=0)
    assert rs.describe() == ["ReduceScatter dim=0: 1 group(s)",
                             "    ranks [0, 1]  in [0:2, 0:4] -> out [0:1, 0:4], [1:2, 0:4]"]
    a2a = CollectiveOp(A2A, (), 4, dim=1, src_dim=0)
    assert a2a.describe() == ["AllToAll dim 0->1: 0 group(s)"]

    def many(n):
        return CollectiveOp(AR, tuple(_grp([2 * i, 2 * i + 1], [b, b], [b, b]) for i in range(n)), 4).describe()
    assert len(many(8)) == 9 and many(8)[-1] == "    ranks [14, 15]  in [0:2, 0:4] -> out [0:2, 0:4]"
    nine = many(9)
    assert len(nine) == 10 and nine[-1] == "    ... 1 more" and nine[-2].startswith("    ranks [14, 15]")
    assert many(11)[-1] == "    ... 3 more"


# ---- SliceCollective / SplitCollectiveOp ------------------------------------------------------------------------
def test_slice_broadcast_is_a_chain_from_the_contributor():
    s = SliceCollective(((0, 3),), (1, 4, 6), (4,), (1, 4, 6))
    # 3 elements * 2 bytes; chain 4 -> 1 -> 6 (the contributor is left out of the receivers)
    assert s.transfers(2) == [(4, 1, 6, 1), (1, 6, 6, 1)]
    assert SliceCollective(((0, 3),), (2, 5), (5,), (2,)).transfers(4) == [(5, 2, 12, 1)]


def test_slice_reduction_to_every_member_is_a_ring_all_reduce():
    s = SliceCollective(((0, 5),), (0, 1, 2), (0, 1, 2), (2, 0, 1))
    # b = 5 B, g = 3: 2*2*5 // 3 = 6 B in 4 steps
    assert s.transfers(1) == [(0, 1, 6, 4), (1, 2, 6, 4), (2, 0, 6, 4)]
    two = SliceCollective(((0, 5),), (0, 1, 2), (0, 1), (0, 1, 2))
    assert two.transfers(1) == [(0, 1, 6, 4), (1, 2, 6, 4), (2, 0, 6, 4)]


def test_slice_reduction_to_some_members_is_a_reduce_scatter_then_chunks():
    s = SliceCollective(((0, 5),), (0, 1, 2), (0, 1, 2), (0, 1))
    # ring reduce-scatter: 2*5 // 3 = 3 B in 2 steps; then each member sends b // g = 1 B to each other receiver
    assert s.transfers(1) == [(0, 1, 3, 2), (1, 2, 3, 2), (2, 0, 3, 2),
                              (0, 1, 1, 1), (1, 0, 1, 1), (2, 0, 1, 1), (2, 1, 1, 1)]


def _split(n_slices: int) -> SplitCollectiveOp:
    sl = tuple(SliceCollective(((i, i + 1),), (0, 1), (0, 1), (0, 1)) for i in range(n_slices))
    box = ((0, n_slices),)
    return SplitCollectiveOp(OpKind.SPLIT_ALL_REDUCE, 0, 1, sl, ((0, box), (1, box)), ((0, box), (1, box)), 4)


def test_split_collective_describe():
    assert _split(1).describe() == ["SplitAllReduce hdim 0->1: 1 slice collective(s)",
                                    "    slice [0:1] over [0, 1]: sum of [0, 1] -> [0, 1]"]
    eight = _split(8).describe()
    assert len(eight) == 9 and eight[-1] == "    slice [7:8] over [0, 1]: sum of [0, 1] -> [0, 1]"
    nine = _split(9).describe()
    assert len(nine) == 10 and nine[-1] == "    ... 1 more" and nine[-2].startswith("    slice [7:8]")
    assert _split(12).describe()[-1] == "    ... 4 more"


def test_split_collective_apply_one_holder_and_the_shape_message():
    """A single holder broadcasts its slice; the output keeps the holder's dtype; a wrong shape names kind and rank."""
    box = ((0, 2),)
    op = SplitCollectiveOp(OpKind.SPLIT_ALL_GATHER, 0, 1, (SliceCollective(box, (0, 3), (0,), (0, 3)),),
                           ((0, box),), ((0, box), (3, ((0, 4),))), 2)
    got = op.apply({0: np.array([5, 6], dtype=np.int16), 3: np.zeros(9)})
    np.testing.assert_array_equal(got[3], [5, 6, 0, 0])
    assert got[3].dtype == np.int16
    with pytest.raises(ValueError, match=r"^SplitAllGather: rank 0 holds a tensor of shape \(3,\) but the plan "
                                         r"expects the box \[0:2\] of shape \(2,\)$"):
        op.apply({0: np.zeros(3)})


# ---- PointToPointOp -----------------------------------------------------------------------------------------
def test_p2p_ranks_is_the_union_of_all_its_parts():
    """Senders and receivers, copiers, zero-filled ranks and every rank in out_boxes, each counted on its own."""
    b = ((0, 1),)
    op = PointToPointOp(OpKind.BSR, (Message(0, 1, b, 4),), ((2, b),), ((0, b), (2, b)), ((1, b), (4, b)), (3,))
    assert op.ranks() == frozenset({0, 1, 2, 3, 4})


def test_p2p_apply_output_dtype_from_the_first_holder_and_zero_only_ops():
    b = ((0, 2),)
    op = PointToPointOp(OpKind.SEND_RECV, (Message(1, 2, b, 8),), (), ((1, b),), ((2, b),))
    got = op.apply({0: np.zeros(2, dtype=np.float32), 1: np.array([7.0, 8.0]), 2: np.zeros(2, dtype=np.float32)})
    np.testing.assert_array_equal(got[2], [7.0, 8.0])
    assert got[2].dtype == np.float64  # the sender's dtype, not the first tensor of the state
    zero = PointToPointOp(OpKind.BSR, (), (), (), ((5, ((0, 3),)),), (5,))
    z = zero.apply({5: np.ones(1, dtype=np.int32)})
    np.testing.assert_array_equal(z[5], [0, 0, 0])
    assert z[5].dtype == np.int32
    with pytest.raises(ValueError, match=r"^SendRecv: rank 1 holds a tensor of shape \(1,\) but the plan expects the "
                                         r"box \[0:2\] of shape \(2,\)$"):
        op.apply({1: np.zeros(1)})


def _p2p(n_messages: int, zero_fill=()) -> PointToPointOp:
    return PointToPointOp(OpKind.BSR, tuple(Message(0, i + 1, ((i, i + 1),), 4) for i in range(n_messages)),
                          ((0, ((0, 1),)),), (), (), tuple(zero_fill))


def test_p2p_describe():
    assert _p2p(1).describe() == ["BSR: 1 message(s), 1 local cop(ies)", "    0 -> 1  [0:1]  4 B"]
    assert _p2p(0, (2, 3)).describe() == ["BSR: 0 message(s), 1 local cop(ies), zeros on [2, 3]"]
    twelve = _p2p(12).describe()
    assert len(twelve) == 13 and twelve[-1] == "    0 -> 12  [11:12]  4 B"
    thirteen = _p2p(13).describe()
    assert len(thirteen) == 14 and thirteen[-1] == "    ... 1 more" and thirteen[-2] == "    0 -> 12  [11:12]  4 B"
    assert _p2p(15).describe()[-1] == "    ... 3 more"


def test_identity_describe_and_merge_keeps_zero_fill():
    assert IdentityOp().describe() == ["Identity: nothing moves"]
    b = ((0, 1),)
    a = PointToPointOp(OpKind.SEND_RECV, (Message(0, 1, b, 4),), (), ((0, b),), ((1, b),), (2,))
    c = PointToPointOp(OpKind.BSR, (), ((3, b),), ((3, b),), ((3, b), (4, b)), (4,))
    m = merge_p2p([a, c])
    assert m.kind is OpKind.BSR and m.zero_fill == (2, 4)
    assert merge_p2p([a]).kind is OpKind.SEND_RECV and merge_p2p([a]).zero_fill == (2,)
