"""Property tests of communication resolution (§5): every plan, simulated, reproduces the destination layout.

Pairs of random annotations (up to 16 ranks on a random node layout, HSize 1-4, DS with Partial / Duplicate /
Split on up to 3 dims, random HDim and hratios) on random shapes built to fit both.  The expected destination
tensors are computed here from the global tensor and ``local_view`` alone, never from the plan.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hspmd_sdk.core.annotation import DS, Annotation, local_views
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.resolve import resolve

from resolve_reference import check_destination, source_inputs

MAX_RANKS = 16
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ---- generators --------------------------------------------------------------------------------------------
@st.composite
def factorization(draw: st.DrawFn, n: int) -> list[int]:
    """A random multiplicative partition of ``n`` into factors >= 2."""
    out, left = [], n
    while left > 1:
        divs = [d for d in range(2, left + 1) if left % d == 0]
        d = draw(st.sampled_from(divs))
        out.append(d)
        left //= d
    return out


@st.composite
def ds_of(draw: st.DrawFn, n: int, ndim: int) -> DS:
    """A random DS over ``n`` devices: degrees on distinct keys among Partial, Duplicate and the split dims."""
    keys = [-2, -1] + list(range(ndim))
    for _ in range(20):
        factors = draw(factorization(n))
        if len(factors) <= len(keys):
            break
    else:  # pragma: no cover
        factors = [n]
    chosen = draw(st.permutations(keys))[:len(factors)]
    states = dict(zip(chosen, factors))
    order = draw(st.permutations(sorted(states)))
    return DS(states, list(order))


@st.composite
def dg_union_of(draw: st.DrawFn, ranks: list[int], hsize: int) -> list[list[int]]:
    sizes = [draw(st.sampled_from([1, 2, 2, 3, 4, 4])) for _ in range(hsize)]
    while sum(sizes) > len(ranks):
        i = sizes.index(max(sizes))
        sizes[i] -= 1
    sizes = [s for s in sizes if s > 0]
    chosen = draw(st.permutations(ranks))
    out, at = [], 0
    for s in sizes:
        out.append(sorted(chosen[at:at + s]) if draw(st.booleans()) else list(chosen[at:at + s]))
        at += s
    return out


@st.composite
def hdim_of(draw: st.DrawFn, hsize: int, ndim: int) -> tuple[int, list[int] | None]:
    hdim = draw(st.sampled_from([-2, -1] + list(range(ndim))))
    ratios = None
    if hdim >= 0 and hsize > 1 and draw(st.booleans()):
        ratios = [draw(st.integers(1, 3)) for _ in range(hsize)]
    return hdim, ratios


@st.composite
def annotation_of(draw: st.DrawFn, ranks: list[int], ndim: int, min_hsize: int = 1) -> Annotation:
    hsize = draw(st.integers(min_hsize, 4))
    dg = draw(dg_union_of(ranks, hsize))
    ds = [draw(ds_of(len(g), ndim)) for g in dg]
    hdim, ratios = draw(hdim_of(len(dg), ndim))
    return Annotation(dg, ds, hdim, ratios)


def fitting_shape(anns: list[Annotation], ndim: int, mult: list[int]) -> tuple[int, ...]:
    """The smallest shape (times ``mult``) that every annotation divides."""
    shape = []
    for d in range(ndim):
        n = 1
        for a in anns:
            lcm_deg = math.lcm(*[ds.degree(d) for ds in a.ds_union])
            if a.hdim == d and a.hsize > 1:
                n = math.lcm(n, lcm_deg * sum(a.hratios or [1] * a.hsize))
            else:
                n = math.lcm(n, lcm_deg)
        shape.append(n * mult[d])
    return tuple(shape)


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
    ranks = list(range(n))
    ndim = draw(st.integers(1, 3))
    src = draw(annotation_of(ranks, ndim, 2 if relation == "top" else 1))
    if relation == "bottom":  # same DG Union (mostly) and HDim, new DS per subgroup
        same_dg = draw(st.integers(0, 3)) > 0
        dg = src.dg_union if same_dg else draw(dg_union_of(ranks, src.hsize))
        if len(dg) != src.hsize or any(len(a) != len(b) for a, b in zip(dg, src.dg_union)):
            dg = src.dg_union
        ds = [draw(ds_of(len(g), ndim)) if draw(st.integers(0, 3)) else src.ds_union[k] for k, g in enumerate(dg)]
        dst = Annotation(dg, ds, src.hdim, src.hratios)
        assume(dst != src)
    elif relation == "top":  # same DG Union, new HDim, sometimes new DS
        hdim, ratios = draw(hdim_of(src.hsize, ndim).filter(lambda h: h[0] != src.hdim))
        ds = [draw(ds_of(len(g), ndim)) if draw(st.integers(0, 2)) == 0 else src.ds_union[k]
              for k, g in enumerate(src.dg_union)]
        dst = Annotation(src.dg_union, ds, hdim, ratios)
    else:
        dst = draw(annotation_of(ranks, ndim))
    mult = [draw(st.sampled_from([1, 1, 2])) for _ in range(ndim)]
    shape = fitting_shape([src, dst], ndim, mult)
    if math.prod(shape) > 4096:
        shape = fitting_shape([src, dst], ndim, [1] * ndim)
    return src, dst, shape, draw(cluster_of(n))


def check_pair(src: Annotation, dst: Annotation, shape: tuple[int, ...], cluster: Cluster, seed: int = 0) -> list[str]:
    plan = resolve(src, dst, shape, cluster=cluster)
    rng = np.random.default_rng(seed)
    value = rng.standard_normal(shape)
    out = plan.simulate(source_inputs(src, shape, value, rng))
    check_destination(dst, shape, value, out)
    vol = plan.volume()
    assert all(v["intra"] >= 0 and v["inter"] >= 0 for v in vol.values())
    assert plan.estimated_time(cluster) >= 0.0
    if plan.kinds == ["Identity"]:
        assert not any(v["intra"] or v["inter"] for v in vol.values())
    return plan.kinds


# ---- the properties ----------------------------------------------------------------------------------------
@settings(max_examples=800, **SETTINGS)
@given(pair("bottom"))
def test_bottom_tier_pairs(case) -> None:
    src, dst, shape, cluster = case
    kinds = check_pair(src, dst, shape, cluster)
    assert not any(k.startswith("Split") for k in kinds) or src.hdim == -2, kinds


@settings(max_examples=800, **SETTINGS)
@given(pair("top"))
def test_top_tier_pairs(case) -> None:
    check_pair(*case)


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
