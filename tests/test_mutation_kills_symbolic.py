"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/symbolic.py.

Every value and message is worked out by hand from the module's docstrings: a symbolic dim is ``coef * s1 * s2``
with a rational coefficient, a non-integral coefficient is a divisibility constraint, and errors name the tensor,
the dim and the constraint.
"""
from __future__ import annotations

from fractions import Fraction

import pytest

from hspmd_sdk.core.symbolic import (Constraint, Sym, dim_div, dim_frac, dim_mul, dim_prod, dims_equal, divides,
                                     evaluate_dim, evaluate_shape, representative_value, shape_str, sym, symbols_of)
from hspmd_sdk.errors import ShapeError

B, S = sym("B"), sym("S")


def test_sym_is_a_unit_monomial_and_names_must_be_identifiers() -> None:
    """sym(name) is 1 * name; an empty name or one that is not an identifier is refused."""
    for name in ("S", "seq_len", "_b2"):
        got = sym(name)
        assert got == Sym(Fraction(1), (name,)) and isinstance(got.coef, Fraction) and got.coef == 1
    assert S.is_integral
    for bad in ("", "1a", "a b"):
        with pytest.raises(ValueError, match="must be an identifier"):
            sym(bad)


def test_products_sort_factors_and_multiply_coefficients() -> None:
    """a * b multiplies the coefficients and keeps the factors sorted (repeats kept); int * int stays an int."""
    assert dim_mul(3, 4) == 12 and isinstance(dim_mul(3, 4), int)
    assert S * B == Sym(Fraction(1), ("B", "S")) and B * S == S * B
    assert S * S == Sym(Fraction(1), ("S", "S"))
    assert 3 * S == Sym(Fraction(3), ("S",)) and S * 3 == 3 * S
    assert dim_mul(3, S / 2) == Sym(Fraction(3, 2), ("S",))
    assert dim_mul(S / 2, B / 3) == Sym(Fraction(1, 6), ("B", "S"))
    assert dim_prod([2, 3, 5]) == 30 and dim_prod([]) == 1
    assert dim_prod([2, S, B]) == Sym(Fraction(2), ("B", "S"))


def test_a_factorless_sym_comes_back_as_an_int_or_is_refused() -> None:
    """A product with no symbols left is an int; a hand-built factorless Sym of a non-integral coefficient is
    refused with the message naming the value."""
    got = dim_mul(Sym(Fraction(3), ()), 2)
    assert got == 6 and isinstance(got, int)
    with pytest.raises(ShapeError, match=r"^dimension 1/2 is not an integer$"):
        dim_mul(Sym(Fraction(1, 2), ()), 1)


def test_division_by_positive_ints_only() -> None:
    """S / n scales the coefficient by 1/n (// is the same); n must be a positive int (1 is allowed)."""
    assert S / 2 == Sym(Fraction(1, 2), ("S",)) and S // 2 == S / 2
    assert (6 * S) / 4 == Sym(Fraction(3, 2), ("S",))
    assert S / 1 == S
    for bad in (0, -2, 2.0, "2"):
        with pytest.raises(TypeError, match="divided by a positive int"):
            S / bad  # type: ignore[operator]


def test_text_of_syms_and_constraints() -> None:
    """str shows coefficient numerator, factors and denominator; the constraint text is what evaluate_dim reports;
    an integral dim has none."""
    assert str(S) == "S" and str(S / 2) == "S/2" and str(3 * S) == "3*S" and str(3 * B * S / 4) == "3*B*S/4"
    assert repr(S / 2) == "Sym('S/2')"
    assert (S / 2).constraint_text() == "S ≡ 0 (mod 2)"
    assert (3 * S / 4).constraint_text() == "3*S ≡ 0 (mod 4)"
    assert (B * S / 4).constraint_text() == "B*S ≡ 0 (mod 4)"
    assert S.constraint_text() == "" and (4 * S).constraint_text() == ""
    assert (S / 6).modulus == 6 and S.modulus == 1
    assert not (S / 2).is_integral and (2 * S).is_integral
    assert shape_str([B, S / 2, 8]) == "[B, S/2, 8]" and shape_str([]) == "[]"


def test_dim_div_exact_for_ints_and_constrained_for_syms() -> None:
    """Ints divide exactly (an int result), symbols get a coefficient; dividing by 1 returns the dim itself."""
    got = dim_div(12, 4)
    assert got == 3 and isinstance(got, int)
    assert dim_div(7, 1) == 7 and dim_div(S, 1) == S and dim_div(S, 3) == S / 3
    with pytest.raises(ShapeError) as e:
        dim_div(10, 4, tensor="w", dim=1, why="split 4 ways")
    assert str(e.value) == ("tensor 'w' dim 1: size 10 is not divisible by 4 (split 4 ways); HSPMD never pads — "
                            "change the sharding degree or the shape")
    with pytest.raises(ShapeError) as e:
        dim_div(10, 3, tensor="w", dim=0)
    assert str(e.value) == ("tensor 'w' dim 0: size 10 is not divisible by 3; HSPMD never pads — change the "
                            "sharding degree or the shape")
    with pytest.raises(ShapeError) as e:
        dim_div(10, 3)  # no tensor named: the message says so with an empty name
    assert str(e.value).startswith("tensor '' dim None: size 10 is not divisible by 3;")


def test_dim_frac_scales_by_num_over_den() -> None:
    """a * num / den: exact for ints (with dim_div's message), a coefficient for symbols."""
    assert dim_frac(6, 2, 3) == 4 and isinstance(dim_frac(6, 2, 3), int)
    assert dim_frac(S, 2, 4) == S / 2 and dim_frac(3 * S, 1, 3) == S
    with pytest.raises(ShapeError, match=r"^tensor 'x' dim 2: size 7 is not divisible by 3"):
        dim_frac(7, 1, 3, tensor="x", dim=2)


def test_dims_equal_compares_values_across_int_and_sym() -> None:
    assert dims_equal(4, 4) and not dims_equal(4, 5)
    assert dims_equal(Sym(Fraction(4), ()), 4)
    assert dims_equal(S * B, B * S) and not dims_equal(S, 2 * S) and not dims_equal(S, B)


def test_divides_certain_multiples_only() -> None:
    """big is a certain multiple of small: small's factors all in big's (with repeats) and an integral quotient of
    coefficients, or symbols left over to absorb the coefficient."""
    assert divides(2, 6) and not divides(4, 6)
    assert divides(S, B * S) and not divides(B, S) and not divides(B * S, S)
    assert not divides(S * S, S) and divides(S, S * S)
    assert divides(S, 2 * S) and not divides(2 * S, S)
    assert divides(2 * S, B * S)  # B is left over: B * S is a multiple of 2 * S only when B is even, but allowed
    assert divides(S / 2, S) and not divides(S, S / 2)
    assert divides(0, 5)  # a zero coefficient: no division by zero


def test_symbols_of() -> None:
    assert symbols_of(B * S * S) == {"B", "S"} and symbols_of(4) == set()


def test_evaluate_dim_values() -> None:
    """Ints come back as they are; symbols multiply by their bound values and divide exactly (an int)."""
    assert evaluate_dim(5, {}) == 5
    assert evaluate_dim(3 * B * S / 4, {"B": 2, "S": 6}) == 9 and isinstance(evaluate_dim(S / 2, {"S": 4}), int)
    assert evaluate_dim(S * S / 8, {"S": 4}) == 2
    assert evaluate_dim(S, {"S": 1}) == 1  # 1 is a positive int


def test_evaluate_dim_messages() -> None:
    """The messages a user reads: where the dim is, the unbound symbol, a bad value, an unmet constraint (each
    symbol's value listed once, in factor order)."""
    with pytest.raises(ShapeError) as e:
        evaluate_dim(B * S, {"B": 2}, tensor="x", dim=1, where="global shape")
    assert str(e.value) == "tensor 'x' dim 1 (global shape) = B*S: symbol 'S' is not bound; give bind({'S': ...})"
    for bad in (0, -3, True, 2.0, "4"):
        with pytest.raises(ShapeError) as e:
            evaluate_dim(S, {"S": bad}, dim=0)
        assert str(e.value) == f"dim 0: symbol 'S' must be bound to a positive int, got {bad!r}"
    with pytest.raises(ShapeError) as e:
        evaluate_dim(B * S * S / 8, {"B": 3, "S": 2})
    assert str(e.value) == ("dim = B*S*S/8 requires B*S*S ≡ 0 (mod 8), but B=3, S=2 gives 3/2; choose values that "
                            "satisfy the constraint")
    with pytest.raises(ShapeError) as e:
        evaluate_dim(S / 4, {"S": 6}, tensor="t")
    assert str(e.value).startswith("tensor 't' dim None = S/4 requires S ≡ 0 (mod 4), but S=6 gives 3/2;")
    with pytest.raises(ShapeError) as e:
        evaluate_dim(S / 4, {"S": 6}, where="w")
    assert str(e.value).startswith("dim (w) = S/4 requires")


def test_evaluate_shape_numbers_each_dim() -> None:
    """Each dim is evaluated with its own index in the messages, and the tensor and where passed on."""
    assert evaluate_shape([B, S / 2, 8], {"B": 2, "S": 6}) == (2, 3, 8)
    with pytest.raises(ShapeError) as e:
        evaluate_shape([B, S / 4], {"B": 1, "S": 6}, tensor="h", where="local")
    assert str(e.value).startswith("tensor 'h' dim 1 (local) = S/4 requires S ≡ 0 (mod 4)")
    with pytest.raises(ShapeError) as e:
        evaluate_shape([B, S / 4], {"B": 1, "S": 6})  # no tensor, no where: only the dim
    assert str(e.value).startswith("dim 1 = S/4 requires S ≡ 0 (mod 4)")


def test_constraint_check_names_tensor_dim_and_where() -> None:
    c = Constraint("act", 2, S / 3, "local shard")
    c.check({"S": 9})
    with pytest.raises(ShapeError) as e:
        c.check({"S": 8})
    assert str(e.value).startswith("tensor 'act' dim 2 (local shard) = S/3 requires S ≡ 0 (mod 3), but S=8 gives")
    assert Constraint("t", 0, S / 2).where == ""


def test_representative_value() -> None:
    """The lcm of the moduli of name's own single-symbol constraints (other symbols' and products' ignored); a hint
    that satisfies them as is, else the largest multiple of the lcm not above it, but at least the lcm."""
    cons = [S / 2, 3 * S / 4, S / 3, B / 5, B * S / 7, 2 * S]
    assert representative_value("S", cons) == 12
    assert representative_value("S", [S / 3]) == 3
    assert representative_value("B", cons) == 5
    assert representative_value("S", []) == 1 and representative_value("S", [], hint=7) == 7
    assert representative_value("S", cons, hint=36) == 36
    assert representative_value("S", cons, hint=40) == 36
    assert representative_value("S", cons, hint=5) == 12
    assert representative_value("S", [S / 2], hint=1) == 2
    assert representative_value("S", [S / 2], hint=2) == 2 and representative_value("S", [S / 2], hint=3) == 2
    assert representative_value("S", [S / 2], hint=0) == 2  # a hint that is no positive value is not taken
    assert representative_value("S", [S / 2], hint=-4) == 2
