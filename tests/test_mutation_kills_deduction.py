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


# ---- issue 49: the survivors of the run that included the memoised (decorated) functions ----------------------
def test_partial_becomes_duplicate_on_both_tiers_merging_adjacent_duplicates() -> None:
    """The gradient layout of a Partial tensor (every summand gets the whole gradient): P2 next to D2 merges into
    one D4 axis *after* the two split axes (16 devices: 2*2*4); a Partial HDim becomes Duplicate; a split HDim keeps
    its ratios; a DS with no axes stays empty."""
    ann = Annotation("[0-15] S0x2 S1x2 P2 D2")
    assert deduction.partial_as_duplicate(ann) == Annotation("[0-15] S0x2 S1x2 D4")
    assert deduction.partial_as_duplicate(Annotation("[0-3] P2 D2")) == Annotation("[0-3] D4")
    assert deduction.partial_as_duplicate(Annotation("[0,1] P2 | [2,3] S0x2 ; hdim=-2")) \
        == Annotation("[0,1] D2 | [2,3] S0x2 ; hdim=-1")
    got = deduction.partial_as_duplicate(Annotation("[0,1] S1x2 | [2] R ; hdim=0 ratios=1:3"))
    assert got == Annotation("[0,1] S1x2 | [2] R ; hdim=0 ratios=1:3") and got.hratios == [1, 3]


def test_assembled_axes_multiply_into_the_last_axis_of_their_key() -> None:
    """_assemble merges a run of one key into the axis just before it (degrees multiply, as ints), never into an
    earlier axis, and refuses a key that comes back after another one."""
    got = deduction._assemble([(0, 2), (1, 2), (-1, 2), (-1, 3)])
    assert got == DS({0: 2, 1: 2, -1: 6}, [0, 1, -1]) and all(type(d) is int for d in got.states.values())
    assert deduction._assemble([]) == DS({})
    with pytest.raises(Exception, match="key 0 on two non-adjacent device axes"):
        deduction._assemble([(0, 2), (1, 2), (0, 2)])


def test_weight_gradient_keeps_a_split_hdim_and_its_ratios() -> None:
    """A weight split across subgroups along its contracted dim (X's K split 1:3, W's K split 1:3) gets a
    gradient split the same way, ratios included; an HSize-1 weight's gradient has a Duplicate HDim."""
    x = Annotation("[0] R | [1] R ; hdim=2 ratios=1:3")
    w = Annotation("[0] R | [1] R ; hdim=0 ratios=1:3")
    got = deduction.weight_grad_annotation("dot", x, w, (2, 4, 8), (8, 6))
    assert got == Annotation("[0] R | [1] R ; hdim=0 ratios=1:3") and got.hratios == [1, 3]
    got = deduction.weight_grad_annotation("dot", Annotation("[0,1] S0x2"), Annotation("[0,1] D2"), (2, 4, 8), (8, 6))
    assert got == Annotation("[0,1] P2") and got.hdim == -1


def test_activation_gradient_of_a_column_parallel_dot_is_partial() -> None:
    """Megatron's "f": a Duplicate activation meeting a column-split weight gets a Partial gradient, on the
    bottom tier (W S1x2 -> P2) and on the top tier (W HDim 1 -> HDim -2); a row split (W S0x2, facing X's
    split K) leaves X's layout."""
    shapes = [(2, 4, 8), (8, 6)]
    grad = deduction.activation_grad_annotation
    assert grad("dot", [Annotation("[0,1] D2"), Annotation("[0,1] S1x2")], shapes, 0) == Annotation("[0,1] P2")
    assert grad("dot", [Annotation("[0,1] S2x2"), Annotation("[0,1] S0x2")], shapes, 0) == Annotation("[0,1] S2x2")
    top = grad("dot", [Annotation("[0] R | [1] R"), Annotation("[0] R | [1] R ; hdim=1")], shapes, 0)
    assert top == Annotation("[0] R | [1] R ; hdim=-2")
    # linear's weight is [N, K]: its column split is dim 0
    assert grad("linear", [Annotation("[0,1] D2"), Annotation("[0,1] S0x2")], [(2, 4, 8), (6, 8)], 0) \
        == Annotation("[0,1] P2")


def test_activation_gradient_keeps_a_split_hdims_ratios() -> None:
    """X split across subgroups 1:3 along its batch dim: its gradient is split the same way, ratios included."""
    got = deduction.activation_grad_annotation(
        "dot", [Annotation("[0] R | [1] R ; hdim=0 ratios=1:3"), Annotation("[0] R | [1] R")], [(4, 4, 8), (8, 6)], 0)
    assert got == Annotation("[0] R | [1] R ; hdim=0 ratios=1:3") and got.hratios == [1, 3]


def test_activation_gradient_without_a_rule_or_of_a_weight_is_laid_out_like_the_input() -> None:
    """Only input 0 of an op with an input_grad rule gets a rule's gradient.  Input 1 of a dot (its weight), and
    every input of an op without a rule (add), get their own layout with Partial read as Duplicate."""
    x, w = Annotation("[0,1] D2"), Annotation("[0,1] S1x2")
    shapes = [(2, 4, 8), (8, 6)]
    assert deduction.activation_grad_annotation("dot", [x, w], shapes, 1) == Annotation("[0,1] S1x2")
    p = Annotation("[0,1] P2")
    assert deduction.activation_grad_annotation("dot", [x, p], shapes, 1) == Annotation("[0,1] D2")
    assert deduction.activation_grad_annotation("add", [p, x], [(2, 4), (2, 4)], 0) == Annotation("[0,1] D2")
    assert deduction.activation_grad_annotation("add", [x, p], [(2, 4), (2, 4)], 1) == Annotation("[0,1] D2")


def test_a_rule_that_sums_a_split_activations_gradient_drops_its_ratios(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user op (register_op) whose input_grad rule turns every key into Partial: an activation split across
    subgroups 1:3 gets an HDim -2 gradient, which has no ratios (only a split HDim carries them)."""
    from dataclasses import replace

    from hspmd_sdk.core.annotation import PARTIAL
    from hspmd_sdk.core.op_registry import OPS

    odd = replace(OPS["dot"], kind="sum_grad_dot", input_grad=lambda xk, wk: PARTIAL)
    monkeypatch.setitem(OPS, "sum_grad_dot", odd)
    got = deduction.activation_grad_annotation(
        "sum_grad_dot", [Annotation("[0] R | [1] R ; hdim=0 ratios=1:3"), Annotation("[0] R | [1] R")],
        [(4, 4, 8), (8, 6)], 0)
    assert got == Annotation("[0] R | [1] R ; hdim=-2") and got.hratios is None


def _add(a: str, b: str) -> Annotation:
    g = GraphBuilder("add")
    ops.add(g.placeholder("A", (8, 4)), g.placeholder("B", (8, 4)), name="C")
    return deduce(g.build(), {"A": Annotation(a), "B": Annotation(b)})["C"]


def test_inputs_split_across_subgroups_in_different_ratios_are_refused() -> None:
    """Subgroup k computes on the k-th HDim chunk of every input: an add of A split evenly (4+4 rows) and B split
    1:3 (2+6 rows) has no layout, and the error names both ratios in input order; equal ratios pass on."""
    with pytest.raises(SpecializationError) as e:
        _add("[0] R | [1] R ; hdim=0", "[0] R | [1] R ; hdim=0 ratios=1:3")
    assert str(e.value) == (
        "op 'C' (add) cannot be deduced: the inputs split across subgroups (HDim) are split in different ratios "
        "(even, 1:3); give them the same hratios or insert a Reshard. Inputs: 'A': [0] R | [1] R ; hdim=0; "
        "'B': [0] R | [1] R ; hdim=0 ratios=1:3")
    with pytest.raises(SpecializationError, match=r"different ratios \(1:3, 3:1\)"):
        _add("[0] R | [1] R ; hdim=0 ratios=1:3", "[0] R | [1] R ; hdim=0 ratios=3:1")
    got = _add("[0] R | [1] R ; hdim=0 ratios=1:3", "[0] R | [1] R ; hdim=0 ratios=1:3")
    assert got == Annotation("[0] R | [1] R ; hdim=0 ratios=1:3") and got.hratios == [1, 3]
    assert _add("[0] R | [1] R ; hdim=0 ratios=2:2", "[0] R | [1] R ; hdim=0").hratios is None  # 2:2 is even


def test_a_partial_output_of_inputs_split_in_ratios_has_no_ratios() -> None:
    """X's K split 1:3 across subgroups meets W's K split 1:3: Y is a top-tier Partial (HDim -2), which carries
    no ratios."""
    y = _dot("[0] R | [1] R ; hdim=2 ratios=1:3", "[0] R | [1] R ; hdim=0 ratios=1:3")["Y"]
    assert y == Annotation("[0] R | [1] R ; hdim=-2") and y.hratios is None


def test_refinement_errors_name_the_ds_and_the_degrees() -> None:
    """refine_axes refuses DS over different device counts and axes that do not nest (2 against 3), naming
    them; a degree-4 axis facing 2 x 2 splits into two axes of its key, slowest first."""
    from hspmd_sdk.core.op_registry import RuleError

    with pytest.raises(RuleError, match=r"^DS S0x2, S0x4 span different numbers of devices$"):
        refine_axes([DS("S0x2"), DS("S0x4")])
    with pytest.raises(RuleError, match=r"^DS S0x4, S0x2 span different numbers of devices$"):
        refine_axes([DS("S0x4"), DS("S0x2")])
    with pytest.raises(RuleError, match=r"^DS S0x2 D3, D3 S0x2 have device axes that do not nest "
                                        r"\(degrees \[2, 3\]\); align them with a Reshard$"):
        refine_axes([DS({0: 2, -1: 3}, [0, -1]), DS({0: 2, -1: 3}, [-1, 0])])
    assert refine_axes([DS("S1x2 S0x4"), DS("D2 S0x2 P2")]) == [((1, -1), 2), ((0, 0), 2), ((0, -2), 2)]
