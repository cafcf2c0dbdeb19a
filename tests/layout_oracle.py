"""An independent layout oracle: what an HSPMD annotation means, written again from the paper (§4) and SPEC §1.

This module imports nothing from ``hspmd_sdk``: it takes an annotation as plain Python values and answers, with
numpy alone, which box of the global tensor every rank holds, whether that is a summand of a partial value (and
which one), and each rank's local array.  The tests use it for the inputs they give the SDK and for the outputs
they expect back, so that a layout bug in the SDK cannot hide behind a shared definition.

Plain values
------------
* a DS is ``(states, order)``: ``states`` maps a key to its degree (``-2`` Partial, ``-1`` Duplicate, ``d >= 0``
  Split along tensor dim ``d``); ``order`` lists the keys of degree > 1, or is ``None`` for the default order;
* an annotation is a mapping ``{"dg_union": [[rank, ...], ...], "ds_union": [DS, ...], "hdim": int,
  "hratios": [int, ...] | None}``; :func:`annotation` builds one (``hdim`` defaults to -1).

The meaning (paper §4.1, §4.2; SPEC §1; where the paper is silent the SDK's documented convention)
---------------------------------------------------------------------------------------------------
* Bottom tier (§4.1): a DG is an ordered list of devices; a DS an *ordered* dictionary of degrees.  A device's
  coordinates are the digits of its position in the DG written in the mixed radix of the DS's degrees, in the DS
  order, the last key varying fastest (an odometer: ``itertools.product`` over the keys in order).  Keys of degree
  1 are no axis at all; the default order is the keys ascending (-2, -1, 0, 1, ...).  The split coordinate ``c``
  of degree ``n`` along dim ``d`` holds the ``c``-th of ``n`` equal contiguous chunks of that dim (a size that
  ``n`` does not divide is an error: no padding); the duplicate coordinate is a replica number (no effect on the
  data); the partial coordinate ``p`` says the device holds the ``p``-th summand.
* Top tier (§4.2): HSize = the number of (DG, DS) pairs.  Subgroup ``k`` holds ``T_k``: for HDim ``d >= 0`` the
  ``k``-th chunk of ``T`` along ``d``, chunk sizes proportional to the HDim ratios (all 1 when absent; every
  boundary must be an integer); for HDim -1 ``T`` itself; for HDim -2 the ``k``-th of HSize summands.
  ``T_k`` is laid over ``dg_union[k]`` by ``ds_union[k]`` as above.  With HSize 1 the HDim has no effect.
* Partial summands: the ranks whose summands add up together form a *family*.  HDim -2 (HSize > 1): one family,
  ``"all"``, of ``sum_k p_k`` summands (``T`` = sum over subgroups ``k`` of the sum of ``T_k``'s ``p_k`` bottom-tier
  summands), numbered subgroup by subgroup; else each subgroup ``k`` is its own family of ``p_k`` summands, which
  add up to ``T_k`` on its region.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Sequence

import numpy as np

PARTIAL, DUPLICATE = -2, -1
ALL = "all"  #: the family of every summand when HDim is -2

Box = tuple[tuple[int, int], ...]


class LayoutError(ValueError):
    """The annotation does not fit the tensor (or is not a valid annotation)."""


# ---- plain values --------------------------------------------------------------------------------------------
def annotation(dg_union: Sequence[Sequence[int]], ds_union: Sequence[Any], hdim: int = DUPLICATE,
               hratios: Sequence[int] | None = None) -> dict[str, Any]:
    """A plain annotation; each DS is a ``states`` dict or a ``(states, order)`` pair."""
    ds = [(dict(d), None) if isinstance(d, Mapping) else (dict(d[0]), None if d[1] is None else list(d[1]))
          for d in ds_union]
    return {"dg_union": [list(g) for g in dg_union], "ds_union": ds, "hdim": int(hdim),
            "hratios": None if hratios is None else [int(r) for r in hratios]}


def axes(states: Mapping[int, int], order: Sequence[int] | None) -> list[tuple[int, int]]:
    """The DS's mixed-radix axes ``[(key, degree), ...]``, slowest first (degree-1 keys are no axis)."""
    for k, n in states.items():
        if int(k) < PARTIAL or int(n) < 1:
            raise LayoutError(f"bad DS entry {k}: {n}")
    given = {int(k): int(n) for k, n in states.items()}
    real = {k: n for k, n in given.items() if n > 1}
    if order is None:
        keys = sorted(real)
    else:
        if any(int(k) not in given for k in order):
            raise LayoutError(f"order {list(order)} names a key that is not in the states {given}")
        keys = [int(k) for k in order if int(k) in real]
        if sorted(keys) != sorted(real) or len(set(keys)) != len(keys):
            raise LayoutError(f"order {list(order)} is not a permutation of the keys {sorted(real)}")
    return [(k, real[k]) for k in keys]


def coordinates(states: Mapping[int, int], order: Sequence[int] | None) -> list[dict[int, int]]:
    """Coordinates of every position of the DG, in position order: an odometer over the axes, last fastest."""
    ax = axes(states, order)
    return [dict(zip([k for k, _ in ax], digits)) for digits in itertools.product(*[range(n) for _, n in ax])]


def _split(lo: int, hi: int, n: int, c: int, what: str) -> tuple[int, int]:
    size = hi - lo
    if size % n:
        raise LayoutError(f"{what}: {size} elements do not split into {n} equal chunks")
    step = size // n
    return (lo + c * step, lo + (c + 1) * step)


def subgroup_boxes(ann: Mapping[str, Any], shape: Sequence[int]) -> list[Box]:
    """``T_k``'s box for every subgroup ``k`` (the top tier, §4.2)."""
    hsize, hdim = len(ann["dg_union"]), int(ann["hdim"])
    whole = tuple((0, int(n)) for n in shape)
    if hsize == 1 or hdim < 0:
        return [whole] * hsize
    if hdim >= len(shape):
        raise LayoutError(f"HDim {hdim} but the tensor has {len(shape)} dims")
    weights = list(ann.get("hratios") or [1] * hsize)
    if len(weights) != hsize or min(weights) < 1:
        raise LayoutError(f"HDim ratios {weights} do not fit HSize {hsize}")
    total, out, acc = sum(weights), [], 0
    for w in weights:
        lo, hi = Fraction(shape[hdim] * acc, total), Fraction(shape[hdim] * (acc + w), total)
        acc += w
        if lo.denominator != 1 or hi.denominator != 1:
            raise LayoutError(f"dim {hdim} of size {shape[hdim]} is not integral in ratios {weights}")
        box = list(whole)
        box[hdim] = (int(lo), int(hi))
        out.append(tuple(box))
    return out


# ---- what each rank holds ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Held:
    """What ``rank`` holds: the ``box`` of the global tensor; when ``count > 1`` the ``index``-th of ``count``
    summands of family ``family`` (a subgroup number, or :data:`ALL`), which add up to the value on ``region``."""

    rank: int
    subgroup: int
    position: int
    box: Box
    family: Any = None
    index: int = 0
    count: int = 1
    region: Box = ()

    @property
    def partial(self) -> bool:
        return self.count > 1

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.box)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)


def layout(ann: Mapping[str, Any], shape: Sequence[int]) -> dict[int, Held]:
    """Rank -> :class:`Held`, for every rank of the DG Union (in DG Union order)."""
    dgs, dss = ann["dg_union"], ann["ds_union"]
    if not dgs or len(dgs) != len(dss):
        raise LayoutError(f"DG Union of {len(dgs)} groups, DS Union of {len(dss)}")
    flat = [int(r) for g in dgs for r in g]
    if len(set(flat)) != len(flat) or min(flat) < 0:
        raise LayoutError(f"DG Union {dgs}: ranks must be distinct and >= 0")
    hsize, hdim = len(dgs), int(ann["hdim"])
    subs = subgroup_boxes(ann, shape)
    coords = [coordinates(*ds) for ds in dss]
    for k, (g, cs) in enumerate(zip(dgs, coords)):
        if len(g) != len(cs):
            raise LayoutError(f"subgroup {k}: {len(g)} devices but its DS spans {len(cs)}")
    partials = [dict(axes(*ds)).get(PARTIAL, 1) for ds in dss]
    one_family = hdim == PARTIAL and hsize > 1
    out: dict[int, Held] = {}
    for k, (g, cs) in enumerate(zip(dgs, coords)):
        sub, degree = subs[k], dict(axes(*dss[k]))
        for pos, (rank, c) in enumerate(zip(g, cs)):
            box = list(sub)
            for key, idx in c.items():
                if key >= 0:
                    if key >= len(shape):
                        raise LayoutError(f"subgroup {k} splits dim {key} of a {len(shape)}-dim tensor")
                    box[key] = _split(*sub[key], degree[key], idx, f"subgroup {k} dim {key}")
            p = c.get(PARTIAL, 0)
            if one_family:
                held = Held(int(rank), k, pos, tuple(box), ALL, sum(partials[:k]) + p, sum(partials),
                            tuple((0, int(n)) for n in shape))
            elif partials[k] > 1:
                held = Held(int(rank), k, pos, tuple(box), k, p, partials[k], sub)
            else:
                held = Held(int(rank), k, pos, tuple(box), None, 0, 1, sub)
            out[int(rank)] = held
    return out


def families(ann: Mapping[str, Any], shape: Sequence[int]) -> dict[Any, tuple[int, Box]]:
    """Partial family -> (number of summands, the region they add up on)."""
    out: dict[Any, tuple[int, Box]] = {}
    for h in layout(ann, shape).values():
        if h.partial:
            out[h.family] = (h.count, h.region)
    return out


# ---- local arrays --------------------------------------------------------------------------------------------
def random_summands(ann: Mapping[str, Any], shape: Sequence[int], value: np.ndarray,
                    rng: np.random.Generator) -> dict[Any, list[np.ndarray]]:
    """For each partial family, random full-shape summands that add up to ``value`` (the last is the rest)."""
    out = {}
    for fam, (count, _) in families(ann, shape).items():
        parts = [rng.standard_normal(value.shape).astype(value.dtype) for _ in range(count - 1)]
        out[fam] = parts + [value - sum(parts, np.zeros_like(value))]
    return out


def materialize(ann: Mapping[str, Any], shape: Sequence[int], value: np.ndarray | None = None, *,
                summands: Mapping[Any, Sequence[np.ndarray]] | None = None,
                rng: np.random.Generator | None = None) -> dict[int, np.ndarray]:
    """Every rank's local array: its box of ``value``, or for a partial rank its box of its summand (from
    ``summands[family]``, or drawn with ``rng`` so that each family adds up to ``value``)."""
    held = layout(ann, shape)
    if summands is None and any(h.partial for h in held.values()):
        if value is None or rng is None:
            raise ValueError("a partial layout needs summands, or a value and an rng to draw them")
        summands = random_summands(ann, shape, value, rng)
    out = {}
    for r, h in held.items():
        src = summands[h.family][h.index] if h.partial else value
        out[r] = np.array(src[h.slices], copy=True)
    return out


def check_local_arrays(ann: Mapping[str, Any], shape: Sequence[int], value: np.ndarray,
                       out: Mapping[int, Any], *, exact: bool = False, tol: float = 1e-9) -> None:
    """Assert that ``out`` (rank -> local array) is ``value`` laid out by ``ann``: every rank of the DG Union and
    no other; a whole rank holds exactly its box; the copies of one summand agree, each summand covers its
    family's region, and the summands add up to ``value`` there (any decomposition is right)."""
    held = layout(ann, shape)
    assert set(out) == set(held), f"ranks {sorted(out)} but the layout places {sorted(held)}"
    compare = np.testing.assert_array_equal if exact else \
        (lambda a, b, err_msg="": np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=err_msg))
    acc: dict[Any, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for r, h in held.items():
        got = np.asarray(out[r])
        assert got.shape == h.shape, f"rank {r}: local shape {got.shape}, the layout says box {h.box}"
        if not h.partial:
            compare(got, value[h.slices], err_msg=f"rank {r} box {h.box}")
            continue
        total, seen = acc.setdefault(h.family, {}).setdefault(
            h.index, (np.zeros(value.shape), np.zeros(value.shape, dtype=bool)))
        overlap = seen[h.slices]
        compare(got[overlap], total[h.slices][overlap],
                err_msg=f"rank {r}: copies of summand {h.index} of family {h.family} disagree")
        total[h.slices] = got
        seen[h.slices] = True
    for fam, (count, region) in families(ann, shape).items():
        parts = acc.get(fam, {})
        assert len(parts) == count, f"family {fam}: {len(parts)} of {count} summands present"
        reg = tuple(slice(a, b) for a, b in region)
        whole = np.zeros(value.shape)
        for i, (total, seen) in parts.items():
            assert seen[reg].all(), f"family {fam}: summand {i} does not cover its region {region}"
            whole += total
        np.testing.assert_allclose(whole[reg], value[reg], rtol=tol, atol=tol,
                                   err_msg=f"family {fam}: the summands do not add up on {region}")
