"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/resolve.py.

Seeded pairs of random annotations (the generators of ``resolve_reference``, as the property tests draw them, but
a fixed sample so that a mutant meets the same cases every time) are resolved and the plan simulated on source
shards from the independent layout oracle; the destination must be the oracle's layout of the same global
tensor.  Also checked against values worked out by hand: every message's bytes, the bytes each rank receives (never
more than the box it ends up with), and the tier and operator §5 prescribes for a one-key DS change and for each
HDim change.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from hspmd_sdk.core.annotation import Annotation
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.comm_ops import PointToPointOp
from hspmd_sdk.core.resolve import itemsize_of, resolve, split_kind
from hspmd_sdk.errors import ResolutionError, ShapeError

from resolve_reference import boxes, check_destination, random_pair, source_inputs

CASES = 60  # per relation: ~1 s each on one core


def _cluster(rng: random.Random, n: int) -> Cluster:
    nodes, at = [], 0
    while at < n:
        size = rng.randint(1, 8)
        nodes.append({"host": f"n{len(nodes)}", "kind": "cpu", "ranks": list(range(at, min(n, at + size)))})
        at += size
    return Cluster.load({"nodes": nodes})


def _numel(box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


@pytest.mark.parametrize("relation", ["bottom", "top", "random"])
def test_seeded_pairs_simulate_to_the_oracles_destination(relation: str) -> None:
    rng = random.Random(f"mutation-kills-{relation}")
    for i in range(CASES):
        n = rng.randint(2, 16)
        src, dst, shape = random_pair(rng, relation, range(n), 4096)
        cluster = _cluster(rng, n)
        dtype = rng.choice(["float32", "bfloat16", "float64"])
        plan = resolve(src, dst, shape, dtype, cluster=cluster)
        assert plan.itemsize == {"float32": 4, "bfloat16": 2, "float64": 8}[dtype]
        nrng = np.random.default_rng(i)
        value = nrng.standard_normal(shape)
        out = plan.simulate(source_inputs(src, shape, value, nrng))
        check_destination(dst, shape, value, out)
        if relation == "bottom":
            assert not any(k.startswith("Split") for k in plan.kinds), (src, dst, plan.kinds)
        if relation == "top" and src.ds_union == dst.ds_union and split_kind(src.hdim, dst.hdim):
            assert plan.kinds == [split_kind(src.hdim, dst.hdim)], (src, dst, plan.kinds)
        dst_boxes = boxes(dst, shape)
        for j, op in enumerate(plan.ops):
            if not isinstance(op, PointToPointOp):
                continue
            outb = dict(op.out_boxes)
            if j == len(plan.ops) - 1:
                assert {r: b for r, b in outb.items() if r in dst_boxes} == \
                    {r: dst_boxes[r] for r in outb if r in dst_boxes}
            received: dict[int, int] = {}
            for m in op.messages:
                assert m.nbytes == _numel(m.box) * plan.itemsize, m
                if m.src != m.dst:
                    received[m.dst] = received.get(m.dst, 0) + m.nbytes
            for r, nbytes in received.items():
                assert nbytes <= _numel(outb[r]) * plan.itemsize, (src, dst, op.kind, r)


def test_split_kind_is_the_papers_table() -> None:
    # §5.2: -2 -> -1 SplitAllReduce, -2 -> d SplitReduceScatter, d -> -1 SplitAllGather, nothing else
    P, D = -2, -1
    assert split_kind(P, D) == "SplitAllReduce"
    assert split_kind(P, 0) == "SplitReduceScatter" and split_kind(P, 2) == "SplitReduceScatter"
    assert split_kind(0, D) == "SplitAllGather" and split_kind(1, D) == "SplitAllGather"
    for a, b in [(D, P), (D, 0), (0, P), (0, 1), (1, 0), (P, P), (D, D), (0, 0)]:
        assert split_kind(a, b) is None, (a, b)


def test_itemsize_of_names_and_dtypes() -> None:
    assert [itemsize_of(n) for n in ("float64", "float32", "bfloat16", "float16", "int8", "bool", "double", "half")] \
        == [8, 4, 2, 2, 1, 1, 8, 2]
    assert itemsize_of(np.dtype("int16")) == 2 and itemsize_of(np.dtype("float64")) == 8
    assert itemsize_of("torch.bfloat16") == 2
    with pytest.raises(ValueError):
        itemsize_of("float7")


@pytest.mark.parametrize("src,dst,kind", [
    ("[0,1,2,3] P4", "[0,1,2,3] D4", "AllReduce"),
    ("[0,1,2,3] P4", "[0,1,2,3] S0x4", "ReduceScatter"),
    ("[0,1,2,3] S0x4", "[0,1,2,3] D4", "AllGather"),
    ("[0,1,2,3] S0x4", "[0,1,2,3] S1x4", "AllToAll"),
    ("[0,1] D2", "[0,1] S0x2", "LocalSplit"),
    ("[0,1] S0x2", "[2,3] S0x2", "SendRecv"),
    ("[0,1] P2 | [2,3] P2 ; hdim=-2", "[0,1] P2 | [2,3] P2", "SplitAllReduce"),
    ("[0,1] D2 | [2,3] D2 ; hdim=-2", "[0,1] D2 | [2,3] D2 ; hdim=0", "SplitReduceScatter"),
    ("[0,1] D2 | [2,3] D2 ; hdim=0", "[0,1] D2 | [2,3] D2", "SplitAllGather"),
    ("[0-3] S0x2 P2", "[0-3] S0x4", "ReduceScatter"),  # P loses 2, S0 gains 2: the inner digit is the summand
    ("[0-3] D2 S1x2", "[0-3] S0x2 S1x2", "LocalSplit"),
])
def test_one_change_is_one_operator(src: str, dst: str, kind: str) -> None:
    """§5.1/§5.2: a DS change in one key (same DG) or an HDim change alone is one collective; the data is right."""
    s, d = Annotation.parse(src), Annotation.parse(dst)
    shape = (8, 8)
    plan = resolve(s, d, shape)
    assert plan.kinds == [kind], plan.kinds
    if kind.startswith("Split"):  # the operator records the HDim change it makes
        assert (plan.ops[0].src_hdim, plan.ops[0].dst_hdim) == (s.hdim, d.hdim)
    rng = np.random.default_rng(0)
    value = rng.standard_normal(shape)
    check_destination(d, shape, value, plan.simulate(source_inputs(s, shape, value, rng)))


@pytest.mark.parametrize("src,dst,kinds", [
    # Figure 10 and its mirror: of "DS first, then HDim" and "HDim first, then DS" the plan takes the one that
    # moves fewer bytes -- reduce the halves, then gather (not gather, then reduce the whole) ...
    ("[0,1] S0x2 | [2,3] S0x2 ; hdim=-2", "[0,1] D2 | [2,3] D2", ["SplitAllReduce", "AllGather"]),
    # ... and split locally for free, then reduce the halves (not reduce the whole, then split)
    ("[0,1] D2 | [2,3] D2 ; hdim=-2", "[0,1] S0x2 | [2,3] S0x2", ["LocalSplit", "SplitAllReduce"]),
])
def test_top_tier_takes_the_cheaper_order(src: str, dst: str, kinds: list[str]) -> None:
    s, d = Annotation.parse(src), Annotation.parse(dst)
    shape = (8, 4)
    plan = resolve(s, d, shape)
    assert plan.kinds == kinds
    rng = np.random.default_rng(1)
    value = rng.standard_normal(shape)
    check_destination(d, shape, value, plan.simulate(source_inputs(s, shape, value, rng)))


@pytest.mark.parametrize("src,dst", [
    ("[0,1] S0x2 | [2,3] D2 ; hdim=0 ratios=1:3", "[0,1] D2 | [2,3] D2"),
    ("[0,1] D2 | [2,3] S0x2 ; hdim=0 ratios=3:1", "[0,1] S1x2 | [2,3] D2"),
    ("[0,1] P2 | [2,3] P2 ; hdim=-2", "[0,1] S1x2 | [2,3] D2 ; hdim=0 ratios=1:3"),
    ("[0,1] D2 | [2,3] D2 ; hdim=-2", "[0,1] S0x2 | [2,3] S1x2 ; hdim=0 ratios=3:1"),
])
def test_top_tier_with_ratios_and_new_ds(src: str, dst: str) -> None:
    """An HDim change with HDim ratios and a DS change: the intermediate layout keeps the ratios."""
    s, d = Annotation.parse(src), Annotation.parse(dst)
    shape = (16, 4)
    plan = resolve(s, d, shape)
    assert "BSR" not in plan.kinds and any(k.startswith("Split") for k in plan.kinds), plan.kinds
    rng = np.random.default_rng(2)
    value = rng.standard_normal(shape)
    check_destination(d, shape, value, plan.simulate(source_inputs(s, shape, value, rng)))


def test_operator_fields_a_runtime_reads() -> None:
    """Fields the simulation does not need but a runtime does: an AllGather's ranks in source-chunk order (the
    order the gathered chunks are concatenated in), the ranks a BSR zero-fills, the HDims of a SplitAllReduce."""
    ag = resolve(Annotation.parse("[3,1,2,0] S0x4"), Annotation.parse("[3,1,2,0] D4"), (8,))
    assert ag.kinds == ["AllGather"] and [g.ranks for g in ag.ops[0].groups] == [(3, 1, 2, 0)]
    z = resolve(Annotation.parse("[0,1] D2"), Annotation.parse("[2,3] P2"), (4,))
    assert z.kinds == ["BSR"] and z.ops[-1].zero_fill == (3,)
    p = resolve(Annotation.parse("[0,1] P2 | [2,3] P2 ; hdim=-2"), Annotation.parse("[4,5] S0x2"), (4,))
    assert p.kinds == ["AllReduce", "SplitAllReduce", "BSR"]
    assert (p.ops[1].src_hdim, p.ops[1].dst_hdim) == (-2, -1)
    rng = np.random.default_rng(3)
    value = rng.standard_normal((4,))
    src = Annotation.parse("[0,1] P2 | [2,3] P2 ; hdim=-2")
    check_destination(Annotation.parse("[4,5] S0x2"), (4,), value, p.simulate(source_inputs(src, (4,), value, rng)))


# ---- issue 49: the survivors of the second run, each pinned through resolve() -----------------------------------
def _total_bytes(plan) -> int:
    return sum(t[2] for op in plan.ops for t in op.transfers())


def test_itemsize_of_reads_a_dtypes_own_itemsize() -> None:
    """A numpy/torch dtype answers with its own ``itemsize``, also for dtypes the name table does not list."""
    assert itemsize_of(np.dtype("complex128")) == 16
    assert itemsize_of(np.dtype("uint16")) == 2


def test_resolve_errors_name_the_annotation_and_the_rank() -> None:
    """What a user reads: which annotation does not fit the shape, and which ranks the cluster lacks (a rank equal
    to the number of ranks is already outside)."""
    with pytest.raises(ShapeError, match=r"the source annotation does not fit shape \(3,\)"):
        resolve(Annotation.parse("[0,1] S0x2"), Annotation.parse("[0,1] D2"), (3,))
    with pytest.raises(ShapeError, match=r"the destination annotation does not fit shape \(3,\)"):
        resolve(Annotation.parse("[0,1] D2"), Annotation.parse("[0,1] S0x2"), (3,))
    two = Cluster.load({"nodes": [{"host": "n0", "kind": "cpu", "ranks": [0, 1]}]})
    with pytest.raises(ResolutionError, match=r"rank\(s\) \[2\] are not in"):
        resolve(Annotation.parse("[0,1] D2"), Annotation.parse("[1,2] D2"), (4,), cluster=two)


def test_plan_records_shape_dtype_and_every_operators_itemsize() -> None:
    """The plan keeps the shape as a tuple and the dtype's name; every operator carries the element size, a
    LocalSplit too (it sends nothing, but a runtime and the JSON form read the field)."""
    plan = resolve(Annotation.parse("[0,1] D2"), Annotation.parse("[0,1] S0x2"), [4], np.dtype("float64"))
    assert plan.kinds == ["LocalSplit"]
    assert (plan.shape, plan.dtype, plan.itemsize, plan.ops[0].itemsize) == ((4,), "float64", 8, 8)


@pytest.mark.parametrize("src,dst", [
    # no top-tier Partial: the same subgroups hold the summands (here a permuted DG, same boxes and summands)
    ("[0-3] P2 D2", "[1,0,3,2] P2 D2"),
    # top-tier Partial on both sides, permuted subgroups
    ("[0,1] D2 | [2,3] D2 ; hdim=-2", "[1,0] D2 | [3,2] D2 ; hdim=-2"),
    # only the subgroups that hold summands must match: [2,3] D2 and [2] R | [3] R hold the same
    ("[0,1] P2 | [2,3] D2", "[0,1] P2 | [2] R | [3] R"),
])
def test_same_views_are_identity(src: str, dst: str) -> None:
    """§5: when every rank holds the same box and summand and the summands add up within the same ranks, the
    Reshard moves nothing (not a SendRecv among permuted ranks, not a BSR)."""
    plan = resolve(Annotation.parse(src), Annotation.parse(dst), (4,))
    assert plan.kinds == ["Identity"], plan.kinds


def test_same_views_but_other_summand_families_move() -> None:
    """Two P2 subgroups (each with its own decomposition) and one D2 P2 group (the two copies of a summand
    agree): the same boxes and summand indices, but the destination's copies must agree, so data moves; the
    oracle's check of the destination (copies of a summand agree) fails on an Identity."""
    s, d = Annotation.parse("[0,1] P2 | [2,3] P2"), Annotation.parse("[0-3] D2 P2")
    plan = resolve(s, d, (4,))
    assert plan.kinds == ["AllReduce", "BSR"]
    rng = np.random.default_rng(4)
    value = rng.standard_normal((4,))
    check_destination(d, (4,), value, plan.simulate(source_inputs(s, (4,), value, rng)))


def test_same_states_other_order_is_not_a_local_split() -> None:
    """P2 D2 -> D2 P2 on the same devices: every box is kept, but rank 1 changes summand, so it cannot slice
    locally (nor is it one collective): AllReduce, then BSR; the data is right."""
    s, d = Annotation.parse("[0-3] P2 D2"), Annotation.parse("[0-3] D2 P2")
    plan = resolve(s, d, (4,))
    assert plan.kinds == ["AllReduce", "BSR"]
    rng = np.random.default_rng(5)
    value = rng.standard_normal((4,))
    check_destination(d, (4,), value, plan.simulate(source_inputs(s, (4,), value, rng)))


@pytest.mark.parametrize("src,dst,kind,dim,src_dim", [
    ("[0-3] S0x4", "[0-3] S1x4", "AllToAll", 1, 0),  # splits dim 1, un-splits dim 0
    ("[0-3] S0x4", "[0-3] D4", "AllGather", 0, None),  # gathers along dim 0
    ("[0-3] P4", "[0-3] S0x4", "ReduceScatter", 0, None),  # scatters along dim 0
    ("[0-3] P4", "[0-3] D4", "AllReduce", None, None),
    # two subgroups: the merged operator keeps the dims
    ("[0,1] S0x2 | [2,3] S0x2", "[0,1] S1x2 | [2,3] S1x2", "AllToAll", 1, 0),
])
def test_bottom_collective_dims(src: str, dst: str, kind: str, dim, src_dim) -> None:
    """The dims a runtime's collective needs (SPEC §2): ``dim`` the gathered / scattered dim, ``src_dim`` the dim
    an AllToAll un-splits; None where the operator has none."""
    plan = resolve(Annotation.parse(src), Annotation.parse(dst), (8, 8))
    assert plan.kinds == [kind]
    assert (plan.ops[0].dim, plan.ops[0].src_dim) == (dim, src_dim)


def test_unchanged_subgroup_adds_no_operator() -> None:
    """A subgroup whose DS and DG stay the same contributes nothing: only the other subgroup's AllToAll runs
    (no empty SendRecv beside it)."""
    plan = resolve(Annotation.parse("[0,1] S0x2 | [2,3] S0x2"), Annotation.parse("[0,1] S0x2 | [2,3] S1x2"), (4, 4))
    assert plan.kinds == ["AllToAll"]
    assert [g.ranks for g in plan.ops[0].groups] == [(2, 3)]


def test_partial_allreduce_sums_in_summand_order() -> None:
    """An AllReduce group lists its ranks by summand (the DG order [3,2,1,0], not by rank number), and the sum
    runs in that order: s0 + s1 + s2 + s3 left to right.  With s = (1e16, 1, -1e16, 1) that is exactly 1.0 (in
    rank order, s3 + s2 + s1 + s0, it would be 0.0)."""
    s, d = Annotation.parse("[3,2,1,0] P4"), Annotation.parse("[0,1,2,3] S0x4")
    plan = resolve(s, d, (4,), "float64")
    assert plan.kinds == ["AllReduce", "BSR"]
    assert [g.ranks for g in plan.ops[0].groups] == [(3, 2, 1, 0)]
    summand = {3: 1e16, 2: 1.0, 1: -1e16, 0: 1.0}  # DG position i holds summand i
    out = plan.simulate({r: np.full((4,), x) for r, x in summand.items()})
    assert all(out[r].tolist() == [1.0] for r in range(4)), out


def test_bsr_messages_and_copies_in_rank_order() -> None:
    """A BSR lists its messages by (sender, receiver, box) and its local copies by (rank, box): the order the
    runtime posts them in, the same on every rank."""
    plan = resolve(Annotation.parse("[5,1,10,0] S0x2 S1x2"), Annotation.parse("[5,1,10,0] D4"), (2, 4))
    op = plan.ops[-1]
    assert op.kind == "BSR" and len(op.messages) > 1 and len(op.copies) > 1
    assert list(op.messages) == sorted(op.messages, key=lambda m: (m.src, m.dst, m.box))
    assert list(op.copies) == sorted(op.copies)


def test_split_collective_slices_in_box_order() -> None:
    """A top-tier operator lists its slices by box (rows 0-2 before rows 2-4), whoever receives them."""
    plan = resolve(Annotation.parse("[1] R | [0] R ; hdim=-2"), Annotation.parse("[1] R | [0] R ; hdim=0"), (4, 1))
    assert plan.kinds == ["SplitReduceScatter"]
    assert [(sl.box, sl.receivers) for sl in plan.ops[0].slices] == [(((0, 2), (0, 1)), (1,)), (((2, 4), (0, 1)), (0,))]


def test_top_tier_can_change_the_hdim_first() -> None:
    """Reduce-scatter the halves across subgroups first (-2 -> 0, keeping S1x2), then gather inside each subgroup:
    the "HDim first" intermediate has the destination's HDim."""
    s = Annotation.parse("[0,1] S1x2 | [2,3] S1x2 ; hdim=-2")
    d = Annotation.parse("[0,1] D2 | [2,3] D2 ; hdim=0")
    plan = resolve(s, d, (4, 4))
    assert plan.kinds == ["SplitReduceScatter", "AllGather"]
    rng = np.random.default_rng(6)
    value = rng.standard_normal((4, 4))
    check_destination(d, (4, 4), value, plan.simulate(source_inputs(s, (4, 4), value, rng)))


def test_top_tier_order_is_chosen_by_bytes() -> None:
    """Of "DS first" and "HDim first" the plan is the one that moves fewer bytes (not the one with fewer steps):
    its bytes are the minimum of going through either intermediate layout with two resolve() calls."""
    s = Annotation.parse("[3,4,0] P3 | [7,1,6] S2x3 | [2,8,5] S2x3 ; hdim=-2")
    d = Annotation.parse("[3,4,0] P3 | [7,1,6] S2x3 | [2,8,5] S0x3 ; hdim=2 ratios=1:2:2")
    shape = (3, 1, 15)
    plan = resolve(s, d, shape)
    ds_first = Annotation(s.dg_union, d.ds_union, s.hdim, s.hratios)
    hdim_first = Annotation(s.dg_union, s.ds_union, d.hdim, d.hratios)
    via = [_total_bytes(resolve(s, m, shape)) + _total_bytes(resolve(m, d, shape)) for m in (ds_first, hdim_first)]
    assert via[0] != via[1]
    assert _total_bytes(plan) == min(via)


@pytest.mark.parametrize("src,dst,kinds,groups", [
    # AllGather: each group in source chunk order (rank 1 holds rows 0-2, rank 4 rows 2-4), whatever the
    # destination's Duplicate digits are (rank 4 is D-digit 4, rank 1 D-digit 1)
    ("[0-5] S0x2 D3", "[0-5] D6", ["AllGather"], [(0, 3), (1, 4), (2, 5)]),
    # an AllGather whose destination D digits are not the source's D digit times 2: still one AllGather
    ("[0-3] S0x2 D2", "[0-3] D4", ["AllGather"], [(0, 2), (1, 3)]),
    # AllReduce: each group in the destination's chunk order (the D digit mod 2: rank 4 is 0, rank 1 is 1)
    ("[0-5] P2 D3", "[0-5] D6", ["AllReduce"], [(0, 3), (4, 1), (2, 5)]),
    # P outer, S0 inner -> S0x4: rank 1 would need rows 2-4 of the sum but holds rows 4-8 of a summand: not a
    # ReduceScatter (the outer S0 digit of the destination is not the source's S0 digit) -- AllReduce, then BSR
    ("[0-3] P2 S0x2", "[0-3] S0x4", ["AllReduce", "BSR"], [(0, 2), (1, 3)]),
    # S0 loses 3 -> 2, a factor that is not an integer: no single collective, a BSR
    ("[0-5] S0x3 S1x2", "[0-5] S0x2 S1x3", ["BSR"], None),
])
def test_bottom_collective_groups(src: str, dst: str, kinds: list[str], groups) -> None:
    """§5.1: which one-key DS changes are one collective, and the rank order in each group (the order a runtime's
    ring and the gathered concatenation use); the data is right."""
    s, d = Annotation.parse(src), Annotation.parse(dst)
    shape = (12, 12)
    plan = resolve(s, d, shape)
    assert plan.kinds == kinds
    if groups is not None:
        assert [g.ranks for g in plan.ops[0].groups] == groups
    rng = np.random.default_rng(7)
    value = rng.standard_normal(shape)
    check_destination(d, shape, value, plan.simulate(source_inputs(s, shape, value, rng)))


# ---- the per-rank mappings of issue 45's faster resolve ----------------------------------------------------------
def test_the_views_count_each_subgroups_summands_for_its_ranks() -> None:
    """``_Views.partial_count``: every rank of a subgroup gets that subgroup's number of summands (3 for the P3
    subgroup's three ranks, 1 for the lone replica), not the subgroup's size nor the first subgroup's count."""
    from hspmd_sdk.core.annotation import Annotation
    from hspmd_sdk.core.resolve import _views

    views = _views(Annotation("[0,1,2] P3 | [3] R"), (4,))
    assert views.partial_count == {0: 3, 1: 3, 2: 3, 3: 1}
    views = _views(Annotation("[0] R | [1,2] P2 | [3] R"), (4,))
    assert views.partial_count == {0: 1, 1: 2, 2: 2, 3: 1}


def test_a_top_tier_partial_is_not_the_same_layout_as_a_bottom_tier_one() -> None:
    """The same boxes and summand numbers, but the sums go over the hierarchy's other tier: ``_same_views`` says
    they differ (the top tiers' Partial differs) and the plan moves data; so does one whose ranks differ."""
    from hspmd_sdk.core.annotation import Annotation
    from hspmd_sdk.core.resolve import resolve

    top, bottom = Annotation("[0] R | [1] R ; hdim=-2"), Annotation("[0,1] P2")
    assert [k.value for k in resolve(top, bottom, (4,), "float32").kinds] == ["SplitAllReduce", "BSR"]
    assert [k.value for k in resolve(bottom, top, (4,), "float32").kinds] == ["AllReduce", "BSR"]
