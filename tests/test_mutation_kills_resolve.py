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
