"""Property tests of communication resolution (§5): every plan, simulated, reproduces the destination layout.

Pairs of random annotations (up to 16 ranks on a random node layout, HSize 1-4, DS with Partial / Duplicate /
Split on up to 3 dims, random HDim and hratios; the generators of ``resolve_reference``) on random shapes built
to fit both.  The source shards and the expected destination tensors come from the independent layout oracle
(``layout_oracle``, via ``resolve_reference``) and the global tensor alone: never from the plan, never from the
SDK's own ``local_view``.  Also checked: the tier (a bottom-tier pair uses no top-tier operator; a top-tier pair with
equal DS Unions is the one top-tier collective of its HDim change, §5.2(I)) and that no rank receives more bytes in
a point-to-point operator than the box it holds after it.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hspmd_sdk.core.annotation import Annotation
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.comm_ops import PointToPointOp
from hspmd_sdk.core.resolve import resolve, split_kind

from resolve_reference import boxes, check_destination, random_pair, source_inputs

MAX_RANKS = 16
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ---- generators (shared with test_runtime_comm: resolve_reference) -------------------------------------------
class _Draws:
    """``random.Random``'s ``choice`` / ``randint`` / ``sample`` over hypothesis' ``draw`` (so it can shrink)."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw

    def choice(self, seq: Sequence[Any]) -> Any:
        return self.draw(st.sampled_from(list(seq)))

    def randint(self, a: int, b: int) -> int:
        return self.draw(st.integers(a, b))

    def sample(self, seq: Sequence[Any], k: int) -> list[Any]:
        return list(self.draw(st.permutations(list(seq))))[:k]


@st.composite
def cluster_of(draw: st.DrawFn, n: int) -> Cluster:
    nodes, at = [], 0
    while at < n:
        size = draw(st.integers(1, 8))
        nodes.append({"host": f"n{len(nodes)}", "kind": "cpu", "ranks": list(range(at, min(n, at + size)))})
        at += size
    return Cluster.load({"nodes": nodes})


@st.composite
def pair(draw: st.DrawFn, relation: str) -> tuple[Annotation, Annotation, tuple[int, ...], Cluster]:
    """A (src, dst, shape, cluster) case; ``relation`` biases the pair toward a tier of §5."""
    n = draw(st.integers(2, MAX_RANKS))
    src, dst, shape = random_pair(_Draws(draw), relation, range(n), 4096)
    if relation == "bottom":
        assume(dst != src)
    return src, dst, shape, draw(cluster_of(n))


def check_pair(src: Annotation, dst: Annotation, shape: tuple[int, ...], cluster: Cluster, seed: int = 0) -> list[str]:
    plan = resolve(src, dst, shape, cluster=cluster)
    rng = np.random.default_rng(seed)
    value = rng.standard_normal(shape)
    out = plan.simulate(source_inputs(src, shape, value, rng))
    check_destination(dst, shape, value, out)
    vol = plan.volume()
    plan.estimated_time(cluster)  # must not raise
    if plan.kinds == ["Identity"]:
        assert not any(v["intra"] or v["inter"] for v in vol.values())
    dst_boxes = boxes(dst, shape)  # the oracle's
    for i, op in enumerate(plan.ops):
        if not isinstance(op, PointToPointOp):
            continue
        outb = dict(op.out_boxes)
        if i == len(plan.ops) - 1:  # the last operator writes the destination layout
            assert {r: b for r, b in outb.items() if r in dst_boxes} == \
                {r: dst_boxes[r] for r in outb if r in dst_boxes}, (i, op.kind)
        received: dict[int, int] = {}
        for m in op.messages:
            assert m.nbytes == _numel(m.box) * plan.itemsize, m
            if m.src != m.dst:
                received[m.dst] = received.get(m.dst, 0) + m.nbytes
        for r, nbytes in received.items():  # nothing received twice: at most the box the rank ends up with
            assert nbytes <= _numel(outb[r]) * plan.itemsize, (i, op.kind, r, nbytes, outb[r])
    return plan.kinds


def _numel(box: Sequence[tuple[int, int]]) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


# ---- the properties ----------------------------------------------------------------------------------------
@settings(max_examples=800, **SETTINGS)
@given(pair("bottom"))
def test_bottom_tier_pairs(case) -> None:
    src, dst, shape, cluster = case
    kinds = check_pair(src, dst, shape, cluster)
    assert not any(k.startswith("Split") for k in kinds), kinds


@settings(max_examples=800, **SETTINGS)
@given(pair("top"))
def test_top_tier_pairs(case) -> None:
    src, dst, shape, cluster = case
    kinds = check_pair(*case)
    kind = split_kind(src.hdim, dst.hdim)
    if kind is not None and src.ds_union == dst.ds_union:  # §5.2(I): one top-tier collective does the HDim change
        assert kinds == [kind], (src, dst, shape, kinds)


@settings(max_examples=800, **SETTINGS)
@given(pair("random"))
def test_random_pairs(case) -> None:
    check_pair(*case)


@pytest.mark.slow
def test_many_pairs_slow(pytestconfig: pytest.Config) -> None:
    """5000 more pairs of every relation; runs only when selected with ``-m slow``."""
    if "slow" not in (pytestconfig.getoption("markexpr") or ""):
        pytest.skip("slow property test: run with -m slow")

    @settings(max_examples=5000, **SETTINGS)
    @given(st.sampled_from(["bottom", "top", "random"]).flatmap(pair))
    def run(case) -> None:
        check_pair(*case)

    run()


# ---- uneven TP stages (HAP ratios, SPEC §12): the layouts plan_from_strategy gives them ------------------------
@st.composite
def _uneven_layout(draw: st.DrawFn, pipes: list[list[int]], ratios: list[int], ndim: int) -> Annotation:
    """One layout of a tensor on ``pipes`` (each pipeline's TP ranks of one stage): the uneven form (subgroup k =
    the k-th TP rank of every pipeline, HDim split in ``ratios`` / Duplicate / Partial, the pipelines in the DS:
    a batch split, duplicates, summands or a ZeRO-1 split) or the even form (a subgroup per pipeline, TP in the DS,
    the batch split across pipelines in random ratios)."""
    from hspmd_sdk.core.annotation import DS

    npipe, tp = len(pipes), len(pipes[0])
    dims = list(range(ndim))
    if draw(st.booleans()):
        groups = [[p[k] for p in pipes] for k in range(tp)]
        key = draw(st.sampled_from([-2, -1] + dims))
        hdim = draw(st.sampled_from([-2, -1] + dims))
        if hdim >= 0 and key == hdim and draw(st.booleans()):
            key = -1
        return Annotation(groups, [DS({key: npipe})] * tp, hdim, ratios if hdim >= 0 else None)
    key = draw(st.sampled_from([-2, -1] + dims))
    hdim = draw(st.sampled_from([-1, 0] if npipe > 1 else [-1]))
    batch = [draw(st.integers(1, 3)) for _ in pipes] if hdim == 0 else None
    if hdim == 0 and key == 0:
        key = -1
    return Annotation([list(p) for p in pipes], [DS({key: tp})] * npipe, hdim, batch)


def _needs(ann: Annotation, d: int) -> int:
    """A divisor dim ``d`` of a tensor must have for ``ann`` to fit (HDim chunks, then the DS split inside)."""
    n = 1
    if ann.hdim == d:
        n = sum(ann.hratios) if ann.hratios else ann.hsize
    deg = max(ds.states.get(d, 1) for ds in ann.ds_union)
    return n * deg


@st.composite
def uneven_pair(draw: st.DrawFn) -> tuple[Annotation, Annotation, tuple[int, ...], Cluster]:
    import math

    tp, npipe = draw(st.integers(2, 3)), draw(st.integers(1, 2))
    n = draw(st.integers(tp * npipe, min(MAX_RANKS, 2 * tp * npipe)))
    perm = draw(st.permutations(list(range(n))))
    ratios = [draw(st.integers(1, 3)) for _ in range(tp)]
    assume(len(set(ratios)) > 1)
    ndim = draw(st.integers(1, 2))
    src_pipes = [list(perm[i * tp:(i + 1) * tp]) for i in range(npipe)]
    if draw(st.booleans()):  # the same ranks (a switch on place, a Reshard inside a stage) or others
        dst_pipes = src_pipes
    else:
        other = draw(st.permutations(list(range(n))))
        dst_pipes = [list(other[i * tp:(i + 1) * tp]) for i in range(npipe)]
    dst_ratios = ratios if draw(st.booleans()) else [draw(st.integers(1, 3)) for _ in range(tp)]
    src = draw(_uneven_layout(src_pipes, ratios, ndim))
    dst = draw(_uneven_layout(dst_pipes, dst_ratios, ndim))
    shape = tuple(math.lcm(_needs(src, d), _needs(dst, d)) * draw(st.integers(1, 2)) for d in range(ndim))
    assume(math.prod(shape) <= 20000)
    return src, dst, shape, draw(cluster_of(n))


@settings(max_examples=300, **SETTINGS)
@given(uneven_pair())
def test_uneven_tp_layouts(case) -> None:
    """Between the layouts of uneven TP stages (and even ones): BSR or the tier's collectives reproduce the
    destination; an HDim change on the same DG and DS Unions is the one top-tier collective, uneven or not."""
    src, dst, shape, cluster = case
    kinds = check_pair(*case)
    kind = split_kind(src.hdim, dst.hdim)
    if kind is not None and src.dg_union == dst.dg_union and src.ds_union == dst.ds_union:
        assert kinds == [kind], (src, dst, shape, kinds)


def test_uneven_tp_layouts_named_cases() -> None:
    """The Reshards of an uneven TP2 3:1 stage (single pipeline and two pipelines with ZeRO-1)."""
    cluster = Cluster.local(4)
    shape = (8, 16)
    cases = [  # (src, dst, kinds)
        ("[0] R | [1] R ; hdim=-2", "[0] R | [1] R", ["SplitAllReduce"]),                 # row-parallel output
        ("[0] R | [1] R ; hdim=1 ratios=3:1", "[0] R | [1] R", ["SplitAllGather"]),       # uneven gather
        ("[0] R | [1] R ; hdim=-2", "[0] R | [1] R ; hdim=1 ratios=3:1", ["SplitReduceScatter"]),
        ("[0,1] S1x2", "[0] R | [1] R ; hdim=1 ratios=3:1", ["BSR"]),                     # even -> uneven
        ("[0,3] S0x2 | [1,2] S0x2 ; hdim=1 ratios=3:1", "[0,3] D2 | [1,2] D2 ; hdim=1 ratios=3:1",
         ["AllGather"]),                                                                     # ZeRO-1 gather
        ("[0,3] P2 | [1,2] P2 ; hdim=1 ratios=3:1", "[0,3] S0x2 | [1,2] S0x2 ; hdim=1 ratios=3:1",
         ["ReduceScatter"]),                                                                 # ZeRO-1 grad sync
    ]
    for src, dst, want in cases:
        assert check_pair(Annotation(src), Annotation(dst), shape, cluster) == want, (src, dst)
