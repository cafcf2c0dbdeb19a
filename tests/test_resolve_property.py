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
