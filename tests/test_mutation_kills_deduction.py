"""Kills for the mutants of ``hspmd_sdk/core/deduction.py`` that ``test_graph_deduction.py`` and
``test_specialize.py`` let live (``scripts/mutation.sh deduction``; issue 29).  Most lived because deduction is
memoised: a test that asks for a layout another test deduced before reads the cache, never the code; every test
here starts from empty caches.  The rest are the errors' texts (which tensor, dim, subgroup and DS), shapes with a
dimension fewer than the layout names, subgroups that repeat, and inputs with no device axes.  Expected values are
worked out by hand."""
from __future__ import annotations

import pytest

from hspmd_sdk.core import deduction, ops
from hspmd_sdk.core.annotation import DS, Annotation
from hspmd_sdk.core.deduction import deduce, deduce_ds, local_constraints, local_shape, refine_axes
from hspmd_sdk.core.graph import GraphBuilder
from hspmd_sdk.core.symbolic import sym
from hspmd_sdk.errors import ShapeError, SpecializationError


@pytest.fixture(autouse=True)
def cold() -> None:
    deduction.clear_caches()


def _dot(x: str, w: str) -> dict[str, Annotation]:
    g = GraphBuilder("dot")
    ops.dot(g.placeholder("X", ("B", 4, 8)), g.parameter("W", (8, 6)), name="Y")
    return deduce(g.build(), {"X": Annotation(x), "W": Annotation(w)})


def test_cold_deduction_of_both_tiers() -> None:
    assert _dot("[0-3] S0x2 D2", "[0-3] D2 S1x2")["Y"] == Annotation("[0-3] S0x2 S2x2")
    y = _dot("[0,3] S2x2 | [1] R ; hdim=0 ratios=1:3", "[0,3] S0x2 | [1] R")["Y"]
    assert y == Annotation("[0,3] P2 | [1] R ; hdim=0 ratios=1:3")
    assert _dot("[0,3] D2 | [1] R ; hdim=2", "[0,3] S1x2 | [1] R ; hdim=0")["Y"].hdim == -2


def test_inputs_with_no_device_axes_give_whole_outputs() -> None:
    assert deduce_ds(ops.op_def("dot"), [DS({}), DS({})], [(2, 4, 8), (8, 6)], {}) == [DS({})]
    assert _dot("[0] R", "[0] R")["Y"] == Annotation("[0] R")


def test_refinement_keeps_integer_degrees_and_takes_empty_states() -> None:
    axes = refine_axes([DS("S0x4"), DS("S0x2 S1x2")])
    assert axes == [((0, 0), 2), ((0, 1), 2)] and all(type(d) is int for _, d in axes)
    assert refine_axes([DS({}), DS({})]) == []


def test_only_leaves_and_reshards_may_be_annotated() -> None:
    g = GraphBuilder("dot")
    ops.dot(g.placeholder("X", ("B", 4, 8)), g.parameter("W", (8, 6)), name="Y")
    with pytest.raises(SpecializationError, match=r"neither leaves nor Reshards: \['Y'\]"):
        deduce(g.build(), {"X": Annotation("[0] R"), "W": Annotation("[0] R"), "Y": Annotation("[0] R")})


def test_errors_name_the_op_the_dg_unions_and_every_input() -> None:
    with pytest.raises(SpecializationError) as e:
        _dot("[0,1] D2", "[2,3] D2")
    assert "input 'X' lives on DG Union [[0,1]] (HSize 1) but input 'W' on [[2,3]] (HSize 1)" in str(e.value)
    with pytest.raises(SpecializationError) as e:
        _dot("[0,1] D2 | [2] R ; hdim=0", "[0,1] D2")
    assert "DG Union [[0,1], [2]] (HSize 2) but input 'W' on [[0,1]] (HSize 1)" in str(e.value)
    with pytest.raises(SpecializationError) as e:
        _dot("[0,1] S0x2", "[0,1] S1x2")
    assert str(e.value).endswith("Inputs: 'X': [0,1] S0x2; 'W': [0,1] S1x2")


def test_a_shard_that_does_not_divide_is_named_by_tensor_dim_subgroup_and_layout() -> None:
    with pytest.raises(ShapeError) as e:
        local_shape(Annotation("[0,1] S0x2"), (3, 4), 0, "w")
    assert str(e.value).startswith("tensor 'w' dim 0: size 3 is not divisible by 2 (subgroup 0 (0,1) DS S0x2); ")
    with pytest.raises(ShapeError) as e:
        local_shape(Annotation("[0,1] S0x2"), (3, 4), 0)
    assert str(e.value).startswith("tensor '' dim 0: ")
    with pytest.raises(ShapeError) as e:
        local_shape(Annotation("[0] R | [1] R ; hdim=0"), (3,), 0, "w")
    assert str(e.value).startswith("tensor 'w' dim 0: size 3 is not divisible by 2 (HDim split in ratios [1, 1], "
                                   "subgroup 0 (0)); ")


def test_a_layout_naming_a_dim_the_tensor_lacks_is_refused() -> None:
    with pytest.raises(ShapeError, match=r"^tensor 'w': HDim 1 but the tensor has 1 dims$"):
        local_shape(Annotation("[0] R | [1] R ; hdim=1"), (4,), 0, "w")
    with pytest.raises(ShapeError, match=r"^tensor 'w': subgroup 0 \(0,1\) DS S1x2 splits dim 1 but the tensor has 1 "):
        local_shape(Annotation("[0,1] S1x2"), (4,), 0, "w")


def test_constraints_of_every_distinct_subgroup_name_tensor_dim_and_subgroup() -> None:
    B = sym("B")
    got = local_constraints(Annotation("[0,1] S0x2 | [2,3] S0x2 | [4,5,6,7] S0x4"), (B, 4), "x")
    assert [(c.tensor, c.dim, str(c.expr), c.where) for c in got] == [
        ("x", 0, "B/2", "local shard of subgroup 0 (0,1)"), ("x", 0, "B/4", "local shard of subgroup 2 (4-7)")]
    got = local_constraints(Annotation("[0,1] S0x2 | [2] R ; hdim=0 ratios=1:3"), (B, 4), "x")
    assert [str(c.expr) for c in got] == ["B/8", "3*B/4"]
    with pytest.raises(ShapeError, match=r"^tensor 'x' dim 0: size 3"):
        local_constraints(Annotation("[0,1] S0x2"), (3, 4), "x")
