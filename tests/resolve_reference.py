"""The independent reference for resolution tests: per-rank inputs and expected outputs from a global tensor,
and the random annotation-pair generators both resolution test files draw from.

The reference is the layout oracle (``layout_oracle``: the paper's §4 written again in numpy, importing nothing
from ``hspmd_sdk``) -- never the SDK's own ``local_view`` and never a plan.  :func:`plain` is the one adapter: it
reads the public fields of an ``Annotation`` (DG Union, each DS's ``states`` and ``order``, ``hdim``,
``hratios``) into the oracle's plain values and calls no SDK layout function.

The generators take ``rng``: anything with ``choice(seq)``, ``randint(a, b)`` (inclusive) and ``sample(seq, k)``
-- a seeded ``random.Random`` (``test_runtime_comm``) or an adapter over hypothesis' ``draw``
(``test_resolve_property``), so both files test the same distribution of pairs.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

import layout_oracle as oracle
from hspmd_sdk.core.annotation import DS, Annotation

#: Subgroup sizes drawn for a DG Union (6 and 8 give DS with three keys, e.g. 2 x 2 x 2).
SUBGROUP_SIZES = [1, 2, 2, 3, 4, 4, 6, 8]


# ---- generators ----------------------------------------------------------------------------------------------
def factorization(rng: Any, n: int) -> list[int]:
    """A random multiplicative partition of ``n`` into factors >= 2."""
    out, left = [], n
    while left > 1:
        d = rng.choice([d for d in range(2, left + 1) if left % d == 0])
        out.append(d)
        left //= d
    return out


def ds_of(rng: Any, n: int, ndim: int) -> DS:
    """A random DS over ``n`` devices: degrees on distinct keys among Partial, Duplicate and the split dims."""
    keys = [-2, -1] + list(range(ndim))
    for _ in range(20):
        factors = factorization(rng, n)
        if len(factors) <= len(keys):
            break
    else:  # pragma: no cover
        factors = [n]
    chosen = rng.sample(keys, len(factors))
    states = dict(zip(chosen, factors))
    return DS(states, rng.sample(sorted(states), len(states)))


def dg_union_of(rng: Any, ranks: Sequence[int], hsize: int) -> list[list[int]]:
    """``hsize`` (at most) disjoint subgroups of ``ranks``, sizes from :data:`SUBGROUP_SIZES`, some unsorted."""
    sizes = [rng.choice(SUBGROUP_SIZES) for _ in range(hsize)]
    while sum(sizes) > len(ranks):
        sizes[sizes.index(max(sizes))] -= 1
    chosen = rng.sample(list(ranks), len(ranks))
    out, at = [], 0
    for s in (s for s in sizes if s > 0):
        group = list(chosen[at:at + s])
        out.append(sorted(group) if rng.randint(0, 1) else group)
        at += s
    return out


def hdim_of(rng: Any, hsize: int, ndim: int, other_than: int | None = None) -> tuple[int, list[int] | None]:
    """A random HDim (not ``other_than``) and, for a split HDim, sometimes random hratios."""
    hdim = rng.choice([h for h in [-2, -1] + list(range(ndim)) if h != other_than])
    ratios = None
    if hdim >= 0 and hsize > 1 and rng.randint(0, 1):
        ratios = [rng.randint(1, 3) for _ in range(hsize)]
    return hdim, ratios


def annotation_of(rng: Any, ranks: Sequence[int], ndim: int, min_hsize: int = 1) -> Annotation:
    dg = dg_union_of(rng, ranks, rng.randint(min_hsize, 4))
    ds = [ds_of(rng, len(g), ndim) for g in dg]
    hdim, ratios = hdim_of(rng, len(dg), ndim)
    return Annotation(dg, ds, hdim, ratios)


def fitting_shape(anns: Sequence[Annotation], ndim: int, mult: Sequence[int]) -> tuple[int, ...]:
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


def random_pair(rng: Any, relation: str, ranks: Sequence[int],
                max_elems: int) -> tuple[Annotation, Annotation, tuple[int, ...]]:
    """A (src, dst, shape) case on ``ranks``; ``relation`` biases it toward a tier of §5: ``"bottom"`` (same DG
    Union (mostly) and HDim, new DS per subgroup), ``"top"`` (same DG Union, new HDim, sometimes new DS) or
    ``"random"``.  The shape is the smallest that fits both (times 1 or 2 per dim, unless that exceeds
    ``max_elems`` elements)."""
    ndim = rng.randint(1, 3)
    src = annotation_of(rng, ranks, ndim, 2 if relation == "top" else 1)
    if relation == "bottom":
        dg = src.dg_union if rng.randint(0, 3) else dg_union_of(rng, ranks, src.hsize)
        if len(dg) != src.hsize or any(len(a) != len(b) for a, b in zip(dg, src.dg_union)):
            dg = src.dg_union
        ds = [ds_of(rng, len(g), ndim) if rng.randint(0, 3) else src.ds_union[k] for k, g in enumerate(dg)]
        dst = Annotation(dg, ds, src.hdim, src.hratios)
    elif relation == "top":
        hdim, ratios = hdim_of(rng, src.hsize, ndim, other_than=src.hdim)
        ds = [ds_of(rng, len(g), ndim) if rng.randint(0, 2) == 0 else src.ds_union[k]
              for k, g in enumerate(src.dg_union)]
        dst = Annotation(src.dg_union, ds, hdim, ratios)
    else:
        dst = annotation_of(rng, ranks, ndim)
    shape = fitting_shape([src, dst], ndim, [rng.choice([1, 1, 2]) for _ in range(ndim)])
    if math.prod(shape) > max_elems:
        shape = fitting_shape([src, dst], ndim, [1] * ndim)
    return src, dst, shape


# ---- the reference -------------------------------------------------------------------------------------------
def plain(ann: Annotation) -> dict[str, Any]:
    """The oracle's plain annotation, read from ``ann``'s public fields only."""
    return oracle.annotation([list(map(int, g)) for g in ann.dg_union],
                             [({int(k): int(n) for k, n in ds.states.items()}, [int(k) for k in ds.order])
                              for ds in ann.ds_union],
                             int(ann.hdim), None if ann.hratios is None else list(ann.hratios))


def boxes(ann: Annotation, shape: Sequence[int]) -> dict[int, tuple[tuple[int, int], ...]]:
    """rank -> the box the oracle says it holds."""
    return {r: h.box for r, h in oracle.layout(plain(ann), shape).items()}


def source_inputs(src: Annotation, shape: tuple[int, ...], value: np.ndarray,
                  rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Every source rank's local tensor, by the oracle: its box of ``value`` or, for Partial, of a random summand
    (copies of one summand identical, each family adding up to ``value``)."""
    return oracle.materialize(plain(src), shape, value, rng=rng)


def check_destination(dst: Annotation, shape: tuple[int, ...], value: np.ndarray,
                      out: dict[int, np.ndarray], exact: bool = False) -> None:
    """Every destination rank holds, by the oracle, its box of ``value`` or, for Partial, summands that add up to
    it (any decomposition)."""
    oracle.check_local_arrays(plain(dst), shape, value, {r: np.asarray(x) for r, x in out.items()}, exact=exact)
