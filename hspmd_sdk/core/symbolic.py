"""Symbolic shapes (paper Appendix A.2, "Symbolic shape extension").

Dimensions such as the batch ``B`` and the sequence length ``S`` stay symbols in the defined graph and in the
executable graphs; they are resolved to numbers only when concrete inputs arrive (:func:`bind`).  A dimension is
either an ``int`` or a :class:`Sym`: a monomial ``coef * s1 * s2 * ...`` with a rational coefficient, so that
``S / 2`` (a split of the sequence in two) and ``B * S`` (a flatten) are both representable.

A non-integral coefficient is a divisibility constraint: ``S / 2`` is only legal when ``S ≡ 0 (mod 2)``.  It is
checked at specialization where the value is known (concrete dims, or representative values) and again by
:func:`evaluate_dim` when the symbols are bound, which raises :class:`~hspmd_sdk.errors.ShapeError` naming the
tensor, the dim and the constraint; nothing is ever rounded silently.

>>> B, S = sym("B"), sym("S")
>>> str(S / 2), str(B * S), evaluate_dim(S / 2, {"S": 64})
('S/2', 'B*S', 32)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, Sequence, Union

from ..errors import ShapeError

__all__ = ["Sym", "Dim", "Shape", "sym", "dim_mul", "dim_div", "dim_prod", "dims_equal", "evaluate_dim",
           "evaluate_shape", "shape_str", "divides", "symbols_of", "Constraint", "dim_frac", "representative_value"]


@dataclass(frozen=True)
class Sym:
    """A symbolic dimension ``coef * prod(factors)`` (``factors`` sorted symbol names, repeats allowed)."""

    coef: Fraction
    factors: tuple[str, ...]

    # ---- arithmetic ----------------------------------------------------------------------------------------
    def __mul__(self, other: "Dim") -> "Dim":
        return dim_mul(self, other)

    __rmul__ = __mul__

    def __truediv__(self, n: int) -> "Sym":
        if not isinstance(n, int) or n < 1:
            raise TypeError(f"a symbolic dim can only be divided by a positive int, not {n!r}")
        return Sym(self.coef / n, self.factors)

    __floordiv__ = __truediv__

    @property
    def is_integral(self) -> bool:
        """True when the coefficient is an integer (no divisibility constraint)."""
        return self.coef.denominator == 1

    @property
    def modulus(self) -> int:
        """The divisibility constraint: ``prod(factors) * coef.numerator ≡ 0 (mod modulus)``."""
        return self.coef.denominator

    def constraint_text(self) -> str:
        """``"S ≡ 0 (mod 2)"`` for ``S/2``; ``""`` when integral."""
        if self.is_integral:
            return ""
        body = "*".join(self.factors)
        if self.coef.numerator != 1:
            body = f"{self.coef.numerator}*{body}"
        return f"{body} ≡ 0 (mod {self.modulus})"

    def __str__(self) -> str:
        body = "*".join(self.factors)
        if self.coef.numerator != 1:
            body = f"{self.coef.numerator}*{body}"
        if self.coef.denominator != 1:
            body = f"{body}/{self.coef.denominator}"
        return body

    def __repr__(self) -> str:
        return f"Sym({str(self)!r})"


Dim = Union[int, Sym]
Shape = tuple  # tuple[Dim, ...]


@dataclass(frozen=True)
class Constraint:
    """A divisibility constraint on a local or global dim: ``expr`` must come out integral."""

    tensor: str
    dim: int
    expr: Sym
    where: str = ""

    def check(self, bindings: Mapping[str, int]) -> None:
        evaluate_dim(self.expr, bindings, tensor=self.tensor, dim=self.dim, where=self.where)


def sym(name: str) -> Sym:
    """A named symbol (``sym("S")``)."""
    if not name or not name.isidentifier():
        raise ValueError(f"symbol name {name!r} must be an identifier")
    return Sym(Fraction(1), (name,))


def _as_sym(d: Dim) -> Sym:
    return d if isinstance(d, Sym) else Sym(Fraction(d), ())


def _norm(s: Sym) -> Dim:
    if not s.factors:
        if s.coef.denominator != 1:
            raise ShapeError(f"dimension {s.coef} is not an integer")
        return int(s.coef)
    return s


def dim_mul(a: Dim, b: Dim) -> Dim:
    """``a * b`` for ints and symbols."""
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    sa, sb = _as_sym(a), _as_sym(b)
    return _norm(Sym(sa.coef * sb.coef, tuple(sorted(sa.factors + sb.factors))))


def dim_prod(dims: Sequence[Dim]) -> Dim:
    out: Dim = 1
    for d in dims:
        out = dim_mul(out, d)
    return out


def dim_div(a: Dim, n: int, *, tensor: str = "", dim: int | None = None, why: str = "") -> Dim:
    """``a / n``: exact for ints (``ShapeError`` naming ``tensor``/``dim`` when ``n`` does not divide), a
    constrained symbol otherwise."""
    if n == 1:
        return a
    if isinstance(a, int):
        if a % n:
            raise ShapeError(f"tensor {tensor!r} dim {dim}: size {a} is not divisible by {n}"
                             + (f" ({why})" if why else "") + "; HSPMD never pads — change the sharding degree "
                             "or the shape")
        return a // n
    return a / n


def dim_frac(a: Dim, num: int, den: int, **kw: object) -> Dim:
    """``a * num / den`` (used for hratios)."""
    if isinstance(a, int):
        return dim_div(a * num, den, **kw)  # type: ignore[arg-type]
    return Sym(a.coef * Fraction(num, den), a.factors)


def dims_equal(a: Dim, b: Dim) -> bool:
    return _as_sym(a) == _as_sym(b)


def divides(small: Dim, big: Dim) -> bool:
    """True when ``big`` is certainly a multiple of ``small`` (used to group reshape dims)."""
    sa, sb = _as_sym(small), _as_sym(big)
    rest = list(sb.factors)
    for f in sa.factors:
        if f not in rest:
            return False
        rest.remove(f)
    return not sa.coef or (sb.coef / sa.coef).denominator == 1 or bool(rest)


def symbols_of(d: Dim) -> set[str]:
    return set(d.factors) if isinstance(d, Sym) else set()


def evaluate_dim(d: Dim, bindings: Mapping[str, int], *, tensor: str = "", dim: int | None = None,
                 where: str = "") -> int:
    """The value of ``d`` under ``bindings``; ``ShapeError`` naming the tensor, dim and constraint if a symbol is
    unbound or the value is not integral."""
    if isinstance(d, int):
        return d
    num, den = d.coef.numerator, d.coef.denominator  # integers: Fraction arithmetic is slow on this hot path
    for f in d.factors:
        if f not in bindings:
            raise ShapeError(f"{_loc(tensor, dim, where)} = {d}: symbol {f!r} is not bound; give "
                             f"bind({{{f!r}: ...}})")
        v = bindings[f]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ShapeError(f"{_loc(tensor, dim, where)}: symbol {f!r} must be bound to a positive int, got {v!r}")
        num *= v
    if num % den:
        vals = ", ".join(f"{f}={bindings[f]}" for f in dict.fromkeys(d.factors))
        raise ShapeError(f"{_loc(tensor, dim, where)} = {d} requires {d.constraint_text()}, but {vals} gives "
                         f"{Fraction(num, den)}; choose values that satisfy the constraint")
    return num // den


def _loc(tensor: str, dim: int | None, where: str) -> str:
    loc = f"tensor {tensor!r} dim {dim}" if tensor else f"dim {dim}" if dim is not None else "dim"
    return f"{loc} ({where})" if where else loc


def evaluate_shape(shape: Sequence[Dim], bindings: Mapping[str, int], *, tensor: str = "",
                   where: str = "") -> tuple[int, ...]:
    return tuple(evaluate_dim(d, bindings, tensor=tensor, dim=i, where=where) for i, d in enumerate(shape))


def shape_str(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def representative_value(name: str, constraints: Sequence[Sym], hint: int | None = None) -> int:
    """A value for symbol ``name`` that satisfies every single-symbol constraint in ``constraints``: ``hint`` when
    it does, else the largest multiple of the least common multiple of the moduli not above ``hint`` but at least
    that lcm (without a hint: the lcm; with no constraint it is 1).  A constraint ``coef * name`` is integral
    exactly when ``name`` is a multiple of ``coef``'s denominator (a ``Fraction`` is in lowest terms): its modulus."""
    lcm = math.lcm(*(c.modulus for c in constraints if c.factors == (name,) and not c.is_integral))
    return lcm if hint is None else max(lcm, hint // lcm * lcm)
