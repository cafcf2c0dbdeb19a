"""Annotation deduction (§6.1, Table 2, Figure 13) and symbolic shapes (Appendix A.2)."""
from __future__ import annotations

import pytest

from hspmd_sdk.core import ops
from hspmd_sdk.core.annotation import DS, Annotation
from hspmd_sdk.core.deduction import deduce, refine_axes, weight_grad_annotation
from hspmd_sdk.core.graph import GraphBuilder
from hspmd_sdk.core.symbolic import dim_div, evaluate_dim, sym
from hspmd_sdk.errors import ShapeError, SpecializationError


def dot_graph(x_shape=("B", 4, 8), w_shape=(8, 6)):
    g = GraphBuilder("dot")
    x = g.placeholder("X", x_shape)
    w = g.parameter("W", w_shape)
    ops.dot(x, w, name="Y")
    return g.build()


def deduce_y(x: str, w: str) -> Annotation:
    return deduce(dot_graph(), {"X": Annotation(x), "W": Annotation(w)})["Y"]


# ---- Figure 13: Dot -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("x, w, y", [
    ("[0,1] S0x2", "[0,1] D2", "[0,1] S0x2"),            # batch split x duplicate -> batch split
    ("[0,1] S1x2", "[0,1] D2", "[0,1] S1x2"),            # sequence split passes
    ("[0,1] S2x2", "[0,1] S0x2", "[0,1] P2"),            # contracted dim split on both -> Partial
    ("[0,1] D2", "[0,1] S1x2", "[0,1] S2x2"),            # column parallel -> last dim split
    ("[0,1] P2", "[0,1] D2", "[0,1] P2"),                # partial passes through a linear op
    ("[0-3] S0x2 D2", "[0-3] D2 S1x2", "[0-3] S0x2 S2x2"),  # DP2 x TP2 (column)
    ("[0-3] S0x2 S2x2", "[0-3] D2 S0x2", "[0-3] S0x2 P2"),  # DP2 x TP2 (row)
    ("[0-3] D4", "[0-3] S1x4", "[0-3] S2x4"),
    ("[0-3] S2x4", "[0-3] S0x4", "[0-3] P4"),
    ("[0-3] S0x2 S1x2", "[0-3] D4", "[0-3] S0x2 S1x2"),  # refinement: D4 faces two axes of 2
])
def test_dot_bottom_tier(x: str, w: str, y: str) -> None:
    assert deduce_y(x, w) == Annotation(y)


def test_dot_top_tier_hdim_and_ratios() -> None:
    # Figure 13 right: X HDim 0, W HDim -1 -> Y HDim 0 (heterogeneous top-tier split kept), ratios kept
    y = deduce_y("[0,3] S2x2 | [1] R ; hdim=0 ratios=1:3", "[0,3] S0x2 | [1] R")
    assert y == Annotation("[0,3] P2 | [1] R ; hdim=0 ratios=1:3")
    y = deduce_y("[0,3] D2 | [1] R ; hdim=2", "[0,3] S1x2 | [1] R ; hdim=0")
    assert y.hdim == -2  # contracted dim split across subgroups -> top-tier Partial


def test_dot_unsupported_combination_names_the_op_and_inputs() -> None:
    with pytest.raises(SpecializationError, match=r"op 'Y' \(dot\).*'X'.*'W'"):
        deduce_y("[0,1] S0x2", "[0,1] S1x2")  # batch split x column split on one axis: not a layout


def test_dg_union_mismatch_without_reshard_names_both_tensors() -> None:
    with pytest.raises(SpecializationError, match=r"input 'X'.*\[0,1\].*input 'W'.*\[2,3\].*insert a Reshard"):
        deduce_y("[0,1] D2", "[2,3] D2")
    with pytest.raises(SpecializationError, match="HSize 2"):
        deduce_y("[0,1] D2 | [2] R ; hdim=0", "[0,1] D2")


def test_reshard_fixes_the_mismatch_and_defaults_to_identity() -> None:
    g = GraphBuilder("r")
    x = g.placeholder("X", (4, 8))
    w = g.parameter("W", (8, 6))
    ops.dot(g.reshard(x, "X'"), w, name="Y")
    graph = g.build()
    anns = deduce(graph, {"X": Annotation("[0,1] D2"), "W": Annotation("[2,3] S1x2"),
                          "X'": Annotation("[2,3] D2")})
    assert anns["Y"] == Annotation("[2,3] S1x2")
    anns = deduce(graph, {"X": Annotation("[2,3] D2"), "W": Annotation("[2,3] S1x2")})
    assert anns["X'"] == anns["X"]


def test_missing_leaf_annotation_is_an_error() -> None:
    with pytest.raises(SpecializationError, match=r"parameter 'W' has no annotation.*plan.annotations\['W'\]"):
        deduce(dot_graph(), {"X": Annotation("[0] R")})


# ---- other custom rules ------------------------------------------------------------------------------------
def one_op(build, x_ann: str, shape=(4, 6, 8)):
    g = GraphBuilder("t")
    x = g.placeholder("X", shape)
    build(x)
    graph = g.build()
    return deduce(graph, {"X": Annotation(x_ann)})


def test_sum_split_reduced_dim_becomes_partial() -> None:
    anns = one_op(lambda x: ops.sum(x, 1, name="Z"), "[0,1] S1x2 | [2,3] S0x2 ; hdim=2")
    assert anns["Z"] == Annotation("[0,1] P2 | [2,3] S0x2 ; hdim=1")
    anns = one_op(lambda x: ops.sum(x, (0, 1), keepdim=True, name="Z"), "[0,1] S2x2")
    assert anns["Z"] == Annotation("[0,1] S2x2")


def test_reshape_keeps_leading_split_and_rejects_inner_split() -> None:
    anns = one_op(lambda x: ops.reshape(x, (4, 6, 2, 4), name="Z"), "[0,1] S2x2")
    assert anns["Z"] == Annotation("[0,1] S2x2")
    anns = one_op(lambda x: ops.reshape(x, (24, 8), name="Z"), "[0,1] S0x2")
    assert anns["Z"] == Annotation("[0,1] S0x2")
    with pytest.raises(SpecializationError, match="Reshape"):
        one_op(lambda x: ops.reshape(x, (24, 8), name="Z"), "[0,1] S1x2")


def test_propagating_ops_and_partial_through_nonlinear() -> None:
    anns = one_op(lambda x: ops.gelu(x, name="Z"), "[0,1] S1x2 | [2] R ; hdim=0")
    assert anns["Z"] == Annotation("[0,1] S1x2 | [2] R ; hdim=0")
    with pytest.raises(SpecializationError, match="Partial"):
        one_op(lambda x: ops.gelu(x, name="Z"), "[0,1] P2")
    with pytest.raises(SpecializationError, match="RMSNorm"):
        g = GraphBuilder("n")
        x = g.placeholder("X", (4, 8))
        ops.rmsnorm(x, g.parameter("w", (8,)), name="Z")
        deduce(g.build(), {"X": Annotation("[0,1] S1x2"), "w": Annotation("[0,1] D2")})


def test_cross_entropy_of_batch_split_is_partial() -> None:
    g = GraphBuilder("ce")
    lg = g.placeholder("logits", ("B", 4, 10))
    t = g.placeholder("t", ("B", 4), "int64")
    ops.cross_entropy(lg, t, name="loss")
    anns = deduce(g.build(), {"logits": Annotation("[0,1] S0x2 | [2] R ; hdim=0"),
                              "t": Annotation("[0,1] S0x2 | [2] R ; hdim=0")})
    assert anns["loss"] == Annotation("[0,1] P2 | [2] R ; hdim=-2")


def test_weight_gradient_of_data_parallel_weight_is_partial() -> None:
    x, w = Annotation("[0,1] S0x2 | [2,3] D2 ; hdim=0"), Annotation("[0,1] D2 | [2,3] S1x2")
    g = weight_grad_annotation("dot", x, w, (8, 4), (4, 6))
    assert g == Annotation("[0,1] P2 | [2,3] S1x2 ; hdim=-2")


def test_refine_axes() -> None:
    axes = refine_axes([DS("D4"), DS("S0x2 D2")])
    assert axes == [((-1, 0), 2), ((-1, -1), 2)]


# ---- symbolic shapes (Appendix A.2) ------------------------------------------------------------------------
def test_symbolic_split_constraint_checked_at_bind() -> None:
    g = GraphBuilder("sym")
    x = g.placeholder("X", ("B", "S", 8))
    a, b = ops.split(x, 1, 2, name="halves")
    ops.concat([a, b], 1, name="whole")
    graph = g.build()
    assert str(graph.tensors["halves.0"].shape[1]) == "S/2"
    assert graph.tensors["whole"].shape[1] == sym("S")
    assert graph.bind({"B": 2, "S": 64})["halves.1"] == (2, 32, 8)
    with pytest.raises(ShapeError, match=r"tensor 'halves.0' dim 1 = S/2 requires S ≡ 0 \(mod 2\).*S=63"):
        graph.bind({"B": 2, "S": 63})
    with pytest.raises(ShapeError, match="symbol 'S' is not bound"):
        graph.bind({"B": 2})
    assert graph.infer_bindings({"X": (3, 10, 8)}) == {"B": 3, "S": 10}


def test_concrete_split_that_does_not_divide_fails_at_graph_build() -> None:
    g = GraphBuilder("c")
    x = g.placeholder("X", (4, 7))
    with pytest.raises(ShapeError, match="not divisible by 2"):
        ops.split(x, 1, 2, name="h")


def test_shape_rules_reject_mismatches() -> None:
    g = GraphBuilder("s")
    x = g.placeholder("X", ("B", 8))
    with pytest.raises(ShapeError, match="contracted dims differ"):
        ops.dot(x, g.parameter("W", (6, 4)), name="Y")
    with pytest.raises(ShapeError, match="element counts differ"):
        ops.reshape(x, ("B", 3, 3), name="R")


def test_symbolic_arithmetic() -> None:
    B, S = sym("B"), sym("S")
    assert str(B * S) == "B*S" and str(dim_div(S, 4)) == "S/4"
    assert evaluate_dim(dim_div(B * S, 4), {"B": 2, "S": 6}) == 3
    with pytest.raises(ShapeError, match=r"B\*S ≡ 0 \(mod 4\)"):
        evaluate_dim(dim_div(B * S, 4), {"B": 1, "S": 6}, tensor="t", dim=0)


def test_symbolic_local_shape_agrees_with_local_view() -> None:
    """``deduction.local_shape`` (symbolic, used by specialization) must give the concrete shapes of
    ``local_view`` (the single definition of a layout) for every subgroup of random annotations."""
    import random

    from hspmd_sdk.core.annotation import local_view
    from hspmd_sdk.core.deduction import local_shape

    from resolve_reference import annotation_of, fitting_shape

    rng = random.Random(20261129)
    checked = 0
    for _ in range(400):
        ndim = rng.randint(1, 3)
        ranks = rng.sample(range(16), rng.randint(1, 16))
        ann = annotation_of(rng, ranks, ndim)
        shape = fitting_shape([ann], ndim, [rng.randint(1, 3) for _ in range(ndim)])
        for k, dg in enumerate(ann.dg_union):
            want = local_view(ann, shape, dg[0]).shape
            assert tuple(local_shape(ann, shape, k)) == want, (str(ann), shape, k)
            checked += 1
    assert checked > 400
