"""HSPMD sharding annotations (paper §4; SPEC.md §1): ``DS`` (bottom tier) and ``Annotation`` (two tiers).

This module is the single definition of what an annotation means.  :func:`local_view` says, for a rank, which box
of the global tensor it holds and which summand of a partial value; resolution, the runtime and the viz all use it.

Compact notation (what ``str()`` prints and ``parse`` reads):

* ``DS``: space-separated tokens in ``order``: ``P<n>`` Partial of degree n, ``D<n>`` Duplicate of degree n,
  ``S<d>x<n>`` Split of tensor dim d into n chunks.  ``R`` is the empty DS (one device, whole tensor).
  ``DS("D2 S0x2") == DS({-1: 2, 0: 2})``; ``DS("S0x2 D2")`` has order ``[0, -1]``.
* ``Annotation``: subgroups separated by ``|``, each ``[ranks] DS``; ranks are a comma list with ranges
  (``[0-3,8]``); then optionally ``; hdim=<d>`` and ``ratios=a:b:...``.
  ``Annotation("[0,3] S1x2 | [5,6] S1x2 ; hdim=0")``.

``repr()`` of both is the constructor call with this notation, so it can be typed back in.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from typing import Any, Iterator, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import ShapeError


class DSKey(IntEnum):
    """The two keys of a distributed state that are not a tensor dim (paper §4; SPEC §1).

    A DS maps each key to its degree: :attr:`PARTIAL` (``-2``) -- the devices hold summands of the value;
    :attr:`DUPLICATE` (``-1``) -- each holds all of it; a tensor dim ``d >= 0`` -- Split along ``d`` (see
    :func:`is_split`).  An Annotation's HDim takes the same keys, one tier up.

    Members are ints: they compare and hash equal to ``-2``/``-1``, so ``DS({DSKey.PARTIAL: 2}) ==
    DS({-2: 2})``, and ``DS``/``Annotation`` store, print and serialise the plain integers.
    """

    PARTIAL = -2
    DUPLICATE = -1

    __str__ = int.__repr__  # "-2", as an int prints (Python 3.10's Enum.__str__ would print "DSKey.PARTIAL")


#: Module-level names of the two keys (the same objects as the :class:`DSKey` members).
PARTIAL = DSKey.PARTIAL
DUPLICATE = DSKey.DUPLICATE


def is_split(key: int) -> bool:
    """Whether a DS key or an HDim names a Split along a tensor dim (``key >= 0``), not Partial or Duplicate."""
    return key >= 0


__all__ = ["DS", "Annotation", "LocalView", "local_view", "local_views", "SubgroupViews", "subgroup_views", "DSKey",
           "PARTIAL", "DUPLICATE", "is_split", "parse_ranks", "format_ranks"]


def _key_token(key: int, degree: int) -> str:
    if key == PARTIAL:
        return f"P{degree}"
    if key == DUPLICATE:
        return f"D{degree}"
    return f"S{key}x{degree}"


_TOKEN = re.compile(r"^(?:P(?P<p>\d+)|D(?P<d>\d+)|S(?P<dim>\d+)x(?P<n>\d+))$")


def _parse_ds_text(text: str) -> tuple[dict[int, int], list[int]]:
    states: dict[int, int] = {}
    order: list[int] = []
    tokens = text.split()
    if tokens == ["R"] or not tokens:
        return {}, []
    for tok in tokens:
        m = _TOKEN.match(tok)
        if not m:
            raise ValueError(f"cannot read DS token {tok!r} (expected P<n>, D<n>, S<dim>x<n> or R)")
        if m["p"] is not None:
            key, deg = PARTIAL, int(m["p"])
        elif m["d"] is not None:
            key, deg = DUPLICATE, int(m["d"])
        else:
            key, deg = int(m["dim"]), int(m["n"])
        if key in states:
            raise ValueError(f"DS token {tok!r} repeats a key already given")
        states[key] = deg
        order.append(key)
    return states, order


class DS(BaseModel):
    """Distributed states of one sharding subgroup (the bottom tier).

    ``states`` maps a key to its degree: ``-2`` Partial, ``-1`` Duplicate, ``d >= 0`` Split along dim ``d``.
    ``order`` lists the keys (of degree > 1) as mixed-radix digits of a device's position, the last varying
    fastest.  Degree-1 entries are dropped; the default order is the keys sorted ascending.

    >>> DS({-1: 2, 0: 2}).coords(1)
    {-1: 0, 0: 1}
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    states: dict[int, int] = Field(default_factory=dict)
    order: list[int] = Field(default_factory=list)

    def __init__(self, states: Any = None, order: Sequence[int] | None = None, /, **data: Any) -> None:
        if states is not None:
            data["states"] = states
        if order is not None:
            data["order"] = order
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if isinstance(data, str):
            states, order = _parse_ds_text(data)
            return {"states": states, "order": order}
        if not isinstance(data, dict):
            return data
        states = data.get("states", {})
        if isinstance(states, str):
            states, order = _parse_ds_text(states)
            if data.get("order") is None:
                data = {**data, "order": order}
        if not isinstance(states, dict):
            raise ValueError("states must be a mapping {key: degree}")
        clean: dict[int, int] = {}
        for k, v in states.items():
            try:
                ki = int(k)
            except (TypeError, ValueError):
                raise ValueError(f"key {k!r} is not an integer (-2 Partial, -1 Duplicate, d>=0 Split)") from None
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"degree of key {ki} must be an integer, got {v!r}")
            if ki < PARTIAL:
                raise ValueError(f"key {ki} is invalid (-2 Partial, -1 Duplicate, d>=0 Split along dim d)")
            if v < 1:
                raise ValueError(f"degree of key {ki} is {v}; degrees must be >= 1")
            if v > 1:
                clean[ki] = v
        order = data.get("order")
        if order is None:
            order = sorted(clean)
        else:
            if not isinstance(order, (list, tuple)) or not all(isinstance(o, int) and not isinstance(o, bool)
                                                               for o in order):
                raise ValueError("order must be a list of integer keys")
            given = {int(k) for k in states}
            order = [o for o in order if o in clean or o not in given]  # drop degree-1 keys
            if sorted(order) != sorted(clean) or len(set(order)) != len(order):
                raise ValueError(f"order {list(order)} must be a permutation of the keys of degree > 1 "
                                 f"{sorted(clean)}")
        return {"states": dict(sorted(clean.items())), "order": list(order)}

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def device_num(self) -> int:
        """Number of devices this DS spans: the product of the degrees."""
        return math.prod(self.states.values())

    def degree(self, key: int) -> int:
        """Degree of ``key`` (1 when absent)."""
        return self.states.get(key, 1)

    @property
    def partial(self) -> int:
        return self.degree(PARTIAL)

    @property
    def duplicate(self) -> int:
        return self.degree(DUPLICATE)

    @property
    def split_dims(self) -> list[int]:
        return [k for k in self.states if is_split(k)]

    def coords(self, position: int) -> dict[int, int]:
        """Coordinates (key -> index) of the device at ``position`` of its group; last key of ``order`` fastest."""
        if not 0 <= position < self.device_num:
            raise IndexError(f"position {position} outside a DS of {self.device_num} devices")
        out: dict[int, int] = {}
        for key in reversed(self.order):
            n = self.states[key]
            out[key] = position % n
            position //= n
        return {k: out[k] for k in self.order}

    def position(self, coords: dict[int, int]) -> int:
        """Inverse of :meth:`coords` (missing keys count as 0)."""
        pos = 0
        for key in self.order:
            pos = pos * self.states[key] + coords.get(key, 0)
        return pos

    def check_shape(self, shape: Sequence[int], where: str = "") -> None:
        """Raise ``ShapeError`` if a split dim is out of range or not divisible."""
        for d in self.split_dims:
            if d >= len(shape):
                raise ShapeError(f"{where}DS {self} splits dim {d} but the tensor has {len(shape)} dims {tuple(shape)}")
            if shape[d] % self.states[d]:
                raise ShapeError(f"{where}DS {self} splits dim {d} of size {shape[d]} into {self.states[d]} "
                                 f"chunks, which does not divide it (HSPMD never pads)")

    # ---- notation ------------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "DS":
        """Read the compact notation, e.g. ``"P2 D2 S0x4"``."""
        return cls(text)

    def __str__(self) -> str:
        return " ".join(_key_token(k, self.states[k]) for k in self.order) or "R"

    def __repr__(self) -> str:
        return f"DS({str(self)!r})"

    def __hash__(self) -> int:
        return hash((tuple(self.states.items()), tuple(self.order)))


def _same_ds(a: list[DS], b: list[DS]) -> bool:
    """``a == b``, comparing each distinct pair of DS objects once: the subgroups of a large annotation share a few
    DS objects, and two equal annotations made apart (a deduced one and a planned one) hold equal, not the same,
    objects."""
    if len(a) != len(b):
        return False
    equal: set[tuple[int, int]] = set()  # ids of pairs found equal (both lists keep their objects alive)
    for x, y in zip(a, b):
        if x is not y and (id(x), id(y)) not in equal:
            if x != y:
                return False
            equal.add((id(x), id(y)))
    return True


#: The largest rank number the notation accepts (the cluster bound: :data:`hspmd_sdk.core.cluster.MAX_RANKS`).
MAX_RANK = (1 << 17) - 1


def parse_ranks(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]`` (ranks 0..``MAX_RANK``)."""
    out: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        a, dash, b = part.partition("-")
        if len(a) > 7 or len(b) > 7:
            raise ValueError(f"rank {part[:40]!r} is out of range (0..{MAX_RANK})")
        try:
            lo = int(a)
            hi = int(b) if dash else lo
        except ValueError:
            raise ValueError(f"cannot read rank {part!r}: write a rank as 5, a range as 0-3") from None
        if hi < lo:
            raise ValueError(f"rank range {part!r} is empty")
        if hi > MAX_RANK or len(out) + hi - lo >= MAX_RANK + 1:  # a and b have no sign: lo >= 0
            raise ValueError(f"rank {part!r} is out of range (0..{MAX_RANK}, at most {MAX_RANK + 1} ranks)")
        out.extend(range(lo, hi + 1))
    return out


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (ascending runs of length >= 3 become ranges)."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
            i = j + 1
        else:
            parts.append(str(ranks[i]))
            i += 1
    return ",".join(parts)


_SUB = re.compile(r"^\s*\[(?P<ranks>[^\]]*)\]\s*(?P<ds>.*?)\s*$")


def _parse_annotation_text(text: str) -> dict[str, Any]:
    body, _, opts = text.partition(";")
    dg_union: list[list[int]] = []
    ds_union: list[dict[str, Any]] = []
    for sub in body.split("|"):
        m = _SUB.match(sub)
        if not m:
            raise ValueError(f"cannot read subgroup {sub.strip()!r}: expected '[ranks] DS', e.g. '[0,3] S1x2'")
        dg_union.append(parse_ranks(m["ranks"]))
        states, order = _parse_ds_text(m["ds"])
        ds_union.append({"states": states, "order": order})
    out: dict[str, Any] = {"dg_union": dg_union, "ds_union": ds_union}
    for opt in opts.split():
        key, _, val = opt.partition("=")
        if key not in ("hdim", "ratios"):
            raise ValueError(f"unknown annotation option {opt!r} (expected hdim=<d> or ratios=a:b)")
        try:
            if key == "hdim":
                out["hdim"] = int(val)
            else:
                out["hratios"] = [int(v) for v in val.split(":")]
        except ValueError:
            raise ValueError(f"cannot read annotation option {opt!r}: expected hdim=<d> or ratios=a:b") from None
    return out


class Annotation(BaseModel):
    """Two-tier HSPMD annotation: a DG Union and a DS Union (HSize subgroups), and HDim across them.

    Subgroup ``k`` holds ``T_k``: for ``hdim = d >= 0`` the k-th chunk of ``T`` along ``d`` (equal, or
    proportional to ``hratios``); for ``hdim = -1`` all of ``T``; for ``hdim = -2`` the k-th of HSize summands.
    Inside subgroup ``k``, ``T_k`` is laid over ``dg_union[k]`` by ``ds_union[k]``.  With HSize 1 the HDim is
    irrelevant and normalised to -1 (plain SPMD).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dg_union: list[list[int]]
    ds_union: list[DS]
    hdim: int = Field(default=DUPLICATE, validate_default=True)  # validated: stored as the plain int -1
    hratios: list[int] | None = None

    def __init__(self, dg_union: Any = None, ds_union: Any = None, hdim: int | None = None,
                 hratios: list[int] | None = None, /, **data: Any) -> None:
        if isinstance(dg_union, str) and ds_union is None:
            data.update(_parse_annotation_text(dg_union))
        else:
            if dg_union is not None:
                data["dg_union"] = dg_union
            if ds_union is not None:
                data["ds_union"] = ds_union
        if hdim is not None:
            data["hdim"] = hdim
        if hratios is not None:
            data["hratios"] = hratios
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        if isinstance(data, str):
            return _parse_annotation_text(data)
        return data

    @model_validator(mode="after")
    def _check(self) -> "Annotation":
        h = len(self.dg_union)
        if h == 0:
            raise ValueError("dg_union is empty: an annotation needs at least one device group")
        if len(self.ds_union) != h:
            raise ValueError(f"dg_union has {h} groups but ds_union has {len(self.ds_union)} entries "
                             "(HSize must agree)")
        for k, (dg, ds) in enumerate(zip(self.dg_union, self.ds_union)):
            if not dg:
                raise ValueError(f"dg_union[{k}] is empty")
            if len(dg) != ds.device_num:
                raise ValueError(f"dg_union[{k}] has {len(dg)} devices but ds_union[{k}] = {ds} spans "
                                 f"{ds.device_num}")
        flat = [r for dg in self.dg_union for r in dg]
        if min(flat) < 0:  # the common case costs a min and a set; then find the culprit
            k, r = next((k, r) for k, dg in enumerate(self.dg_union) for r in dg if r < 0)
            raise ValueError(f"dg_union[{k}] has negative rank {r}")
        if len(set(flat)) != len(flat):
            seen: dict[int, int] = {}
            for k, dg in enumerate(self.dg_union):
                for r in dg:
                    if r in seen:
                        raise ValueError(f"rank {r} appears in dg_union[{seen[r]}] and dg_union[{k}]; "
                                         "device groups must be disjoint")
                    seen[r] = k
        if self.hdim < PARTIAL:
            raise ValueError(f"hdim {self.hdim} is invalid (-2 Partial, -1 Duplicate, d>=0 Split)")
        if h == 1:
            object.__setattr__(self, "hdim", int(DUPLICATE))
            object.__setattr__(self, "hratios", None)
        if self.hratios is not None:
            if not is_split(self.hdim):
                raise ValueError(f"hratios are only meaningful with a split hdim (>= 0), not hdim={self.hdim}")
            if len(self.hratios) != h:
                raise ValueError(f"hratios has {len(self.hratios)} entries but HSize is {h}")
            if any(r < 1 for r in self.hratios):
                raise ValueError(f"hratios {self.hratios} must be positive integers")
            if len(set(self.hratios)) == 1:
                object.__setattr__(self, "hratios", None)
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _checked_once(cls, data: Any, handler: Any) -> Any:
        """An Annotation given where one is expected (a field of another model) was checked when it was made and
        is frozen: pydantic would run :meth:`_check` again, in time linear in its ranks (defined after
        :meth:`_check`, so it wraps it)."""
        if isinstance(data, Annotation):
            return data
        return handler(data)

    # ---- structure -----------------------------------------------------------------------------------------
    @property
    def hsize(self) -> int:
        """HSize: the number of sharding subgroups."""
        return len(self.dg_union)

    # Derived data, computed once per (frozen) annotation and kept in the instance ``__dict__`` like any
    # ``cached_property``; never pickled or copied (see ``__getstate__``, ``model_copy``).  They make
    # :meth:`locate`, :meth:`subgroup_box` and hashing O(1), so that :func:`local_views` is linear in the ranks.
    _DERIVED = ("partial_offsets", "_rank_index", "_ratio_offsets", "_hash")

    @cached_property
    def _rank_index(self) -> dict[int, int]:
        """rank -> its subgroup, for every rank of the DG Union (positions are found inside the small
        subgroup; an index of ``(subgroup, position)`` pairs would cost ~4x the memory at 10k ranks)."""
        return {r: k for k, dg in enumerate(self.dg_union) for r in dg}

    @cached_property
    def _ratio_offsets(self) -> tuple[int, ...]:
        """Prefix sums of the HDim ratios (all ones without ``hratios``): subgroup ``k`` starts at
        ``offsets[k] / offsets[-1]`` of the HDim."""
        out = [0]
        for r in self.hratios or [1] * self.hsize:
            out.append(out[-1] + r)
        return tuple(out)

    @cached_property
    def _hash(self) -> int:
        return hash((tuple(map(tuple, self.dg_union)), tuple(self.ds_union), self.hdim,
                     tuple(self.hratios or ())))

    @cached_property
    def partial_offsets(self) -> tuple[int, ...]:
        """For ``hdim == -2``: the number of summands held by subgroups before ``k`` (then the total)."""
        out = [0]
        for ds in self.ds_union:
            out.append(out[-1] + ds.partial)
        return tuple(out)

    @property
    def ranks(self) -> list[int]:
        """Every rank of the DG Union, subgroup by subgroup."""
        return [r for dg in self.dg_union for r in dg]

    def locate(self, rank: int) -> tuple[int, int] | None:
        """``(subgroup k, position in dg_union[k])`` of ``rank``, or ``None`` if it holds nothing."""
        k = self._rank_index.get(rank)
        return None if k is None else (k, self.dg_union[k].index(rank))

    @classmethod
    def spmd(cls, ranks: Sequence[int], ds: DS | str | dict[int, int] | None = None) -> "Annotation":
        """Plain SPMD (HSize 1): one device group, one DS."""
        ds_obj = ds if isinstance(ds, DS) else DS(ds if ds is not None else {DUPLICATE: len(ranks)})
        return cls([list(ranks)], [ds_obj])

    # ---- shapes --------------------------------------------------------------------------------------------
    def subgroup_box(self, shape: Sequence[int], k: int) -> tuple[tuple[int, int], ...]:
        """The box ``T_k`` of the global tensor held by subgroup ``k`` (whole tensor unless hdim >= 0)."""
        box = [(0, n) for n in shape]
        if is_split(self.hdim):  # (HSize 1 has hdim -1)
            d = self.hdim
            if d >= len(shape):
                raise ShapeError(f"annotation {self} has hdim={d} but the tensor has {len(shape)} dims "
                                 f"{tuple(shape)}")
            offsets = self._ratio_offsets
            total, ratio = offsets[-1], offsets[k + 1] - offsets[k]
            if (shape[d] * ratio) % total:
                ratios = [offsets[i + 1] - offsets[i] for i in range(self.hsize)]
                raise ShapeError(f"annotation {self}: dim {d} of size {shape[d]} cannot be split in ratios "
                                 f"{ratios} into integral chunks")
            start = shape[d] * offsets[k] // total
            box[d] = (start, start + shape[d] * ratio // total)
        return tuple(box)

    def check_shape(self, shape: Sequence[int], name: str = "") -> None:
        """Raise ``ShapeError`` (naming ``name``) if ``shape`` does not fit this annotation."""
        self.subgroup_boxes(shape, name)

    def subgroup_boxes(self, shape: Sequence[int], name: str = "") -> list[tuple[tuple[int, int], ...]]:
        """Every subgroup's box (:meth:`subgroup_box`), once ``shape`` is checked to fit: raises ``ShapeError``
        (naming ``name``) for the first subgroup it does not fit.  Linear in HSize, not in the ranks: subgroups
        that share a DS object and an extent are checked once."""
        where = f"tensor {name!r}: " if name else ""
        whole = tuple((0, n) for n in shape)
        split = is_split(self.hdim)  # otherwise every subgroup holds the whole tensor
        fits: set[tuple[int, tuple[int, ...]]] = set()  # (id of a DS of this annotation, extent) checked
        out = []
        for k, ds in enumerate(self.ds_union):
            try:
                box = self.subgroup_box(shape, k) if split else whole
            except ShapeError as e:
                raise ShapeError(where + str(e)) from None
            extent = tuple(b - a for a, b in box) if split else tuple(shape)
            if (id(ds), extent) not in fits:
                try:
                    ds.check_shape(extent)
                except ShapeError as e:
                    raise ShapeError(f"{where}subgroup {k} ({format_ranks(self.dg_union[k])}): {e}") from None
                fits.add((id(ds), extent))
            out.append(box)
        return out

    # ---- notation ------------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "Annotation":
        """Read the compact notation, e.g. ``"[0,3] S1x2 | [5,6] S1x2 ; hdim=0 ratios=1:2"``."""
        return cls(text)

    def __str__(self) -> str:
        subs = " | ".join(f"[{format_ranks(dg)}] {ds}" for dg, ds in zip(self.dg_union, self.ds_union))
        opts = []
        if self.hdim != DUPLICATE:  # (HSize 1 has hdim -1)
            opts.append(f"hdim={self.hdim}")
        if self.hratios is not None:
            opts.append("ratios=" + ":".join(map(str, self.hratios)))
        return subs + (" ; " + " ".join(opts) if opts else "")

    def __repr__(self) -> str:
        return f"Annotation({str(self)!r})"

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Annotation):
            return NotImplemented
        return (self._hash == other._hash and self.hdim == other.hdim and self.hratios == other.hratios
                and _same_ds(self.ds_union, other.ds_union) and self.dg_union == other.dg_union)

    def __getstate__(self) -> dict[Any, Any]:
        state = super().__getstate__()
        state["__dict__"] = {k: v for k, v in state["__dict__"].items() if k not in self._DERIVED}
        return state

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> "Annotation":
        """A copy (validated again when ``update`` changes fields); derived caches are not carried over."""
        data = {"dg_union": [list(g) for g in self.dg_union], "ds_union": list(self.ds_union), "hdim": self.hdim,
                "hratios": list(self.hratios) if self.hratios is not None else None, **(update or {})}
        return Annotation(**data)


_Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LocalView:
    """What one rank holds of a global tensor under an annotation.

    ``box``: per-dim ``(start, stop)`` of the global tensor.  The local tensor is a summand of the box's values:
    summand ``partial_index`` of ``partial_count`` (``0`` of ``1`` when nothing is partial).  Summands are
    numbered over every subgroup that shares the box's sum (all subgroups when ``hdim == -2``).
    """

    rank: int
    subgroup: int
    position: int
    box: tuple[tuple[int, int], ...]
    partial_index: int = 0
    partial_count: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.box)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def local_view(annotation: Annotation, shape: Sequence[int], rank: int) -> LocalView | None:
    """The box and partial summand ``rank`` holds of a tensor of ``shape`` under ``annotation``.

    Returns ``None`` for a rank outside the DG Union.  Raises ``ShapeError`` when the shape does not fit.
    """
    loc = annotation.locate(rank)
    if loc is None:
        return None
    k, pos = loc
    ds = annotation.ds_union[k]
    sub = annotation.subgroup_box(shape, k)
    ds.check_shape([b - a for a, b in sub], where=f"subgroup {k}: ")
    box, p_index = _position_box(ds, sub, pos)
    return _view(annotation, rank, k, pos, box, p_index)


def _position_box(ds: DS, sub: tuple[tuple[int, int], ...], pos: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """The box and bottom-tier partial index of position ``pos`` of a subgroup laid out by ``ds`` over the
    subgroup box ``sub`` (already checked to fit)."""
    coords = ds.coords(pos)
    box = list(sub)
    for d in ds.split_dims:
        chunk = (sub[d][1] - sub[d][0]) // ds.states[d]
        start = sub[d][0] + coords[d] * chunk
        box[d] = (start, start + chunk)
    return tuple(box), coords.get(PARTIAL, 0)


def _summands(annotation: Annotation, k: int) -> tuple[int, int]:
    """How subgroup ``k`` numbers its summands: ``(offset, count)``, a position's bottom-tier partial index plus
    ``offset`` of ``count`` (the top tier numbers them across subgroups when HDim is -2)."""
    if annotation.hdim == PARTIAL:
        offsets = annotation.partial_offsets
        return offsets[k], offsets[-1]
    return 0, annotation.ds_union[k].partial


def _view(annotation: Annotation, rank: int, k: int, pos: int, box: tuple[tuple[int, int], ...],
          p_index: int) -> LocalView:
    """A rank's view from its bottom-tier box and partial index."""
    offset, p_count = _summands(annotation, k)
    return LocalView(rank, k, pos, box, offset + p_index, p_count)


@dataclass(frozen=True)
class SubgroupViews:
    """The local views of an annotation's ranks, subgroup by subgroup (:func:`local_views` without an object per
    rank): position ``i`` of subgroup ``k`` (rank ``dg_union[k][i]``) holds ``boxes[k][i]``, summand
    ``partial_indices[k][i]`` of ``partial_counts[k]`` (as :class:`LocalView` says), inside the subgroup's box
    ``subgroup_boxes[k]`` (:meth:`Annotation.subgroup_box`).  Subgroups of one layout share their lists: read them,
    never change them."""

    subgroup_boxes: list[_Box]
    boxes: list[list[_Box]]
    partial_indices: list[list[int]]
    partial_counts: list[int]


def subgroup_views(annotation: Annotation, shape: Sequence[int]) -> SubgroupViews:
    """The local views of every subgroup of ``annotation`` (:class:`SubgroupViews`).

    The boxes of a subgroup's positions are worked out once per distinct DS and subgroup extent and offset to each
    subgroup's box; subgroups with the same DS and subgroup box (the replicas of a parameter across pipelines)
    share them.  Raises ``ShapeError`` when the shape does not fit."""
    subs = annotation.subgroup_boxes(shape)
    layouts: dict[tuple[int, tuple[int, ...]], tuple[list[_Box], list[int]]] = {}  # (id of a DS, extent) -> at 0
    placed: dict[tuple[int, _Box], tuple[list[_Box], list[int]]] = {}  # (id of a DS, subgroup box) -> placed
    out = SubgroupViews(subs, [], [], [])
    for k, (ds, sub) in enumerate(zip(annotation.ds_union, subs)):
        got = placed.get((id(ds), sub))
        if got is None:
            extent = tuple(b - a for a, b in sub)
            layout = layouts.get((id(ds), extent))
            if layout is None:
                origin = tuple((0, n) for n in extent)
                per_pos = [_position_box(ds, origin, pos) for pos in range(ds.device_num)]
                layout = layouts[(id(ds), extent)] = ([b for b, _ in per_pos], [p for _, p in per_pos])
            boxes, indices = layout
            for d, (o, _) in enumerate(sub):  # offset to the subgroup's box (along a split HDim)
                if o:
                    boxes = [box[:d] + ((box[d][0] + o, box[d][1] + o),) + box[d + 1:] for box in boxes]
            got = placed[(id(ds), sub)] = (boxes, indices)
        offset, count = _summands(annotation, k)
        out.boxes.append(got[0])
        out.partial_indices.append([p + offset for p in got[1]] if offset else got[1])
        out.partial_counts.append(count)
    return out


def local_views(annotation: Annotation, shape: Sequence[int]) -> Iterator[LocalView]:
    """``local_view`` of every rank of the DG Union, in DG Union order (from :func:`subgroup_views`)."""
    views = subgroup_views(annotation, shape)
    for k, dg in enumerate(annotation.dg_union):
        boxes, indices, count = views.boxes[k], views.partial_indices[k], views.partial_counts[k]
        for pos, r in enumerate(dg):
            yield LocalView(r, k, pos, boxes[pos], indices[pos], count)
