"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/op_registry.py.

Each test pins one behaviour of an operator kind's shape rule, axis rule (paper §6.1, Table 2: which DS key comes out
of which input keys on one device axis) or error text, worked out by hand from the rule as the module's docstrings
state it; nothing is compared with another output of the registry.
"""
from __future__ import annotations

from fractions import Fraction

import pytest

from hspmd_sdk.core import op_registry as R
from hspmd_sdk.core.annotation import DUPLICATE as D, PARTIAL as P
from hspmd_sdk.core.symbolic import Sym, sym
from hspmd_sdk.errors import ShapeError, SpecializationError

RuleError = R.RuleError
S, T = sym("S"), sym("T")


def _rule_error(rule, keys, shapes, attrs=None) -> str:
    with pytest.raises(RuleError) as e:
        rule(keys, shapes, attrs or {})
    return str(e.value)


def _shape_error(rule, shapes, attrs=None, node="n") -> str:
    with pytest.raises(ShapeError) as e:
        rule(shapes, attrs or {}, node)
    return str(e.value)


# ---- key names in messages ---------------------------------------------------------------------------------------
def test_key_names():
    """Partial, Duplicate and Split(dim d) spell the keys of every rule error; a list joins them with ', '."""
    assert R._key(P) == "Partial"
    assert R._key(D) == "Duplicate"
    assert R._key(3) == "Split(dim 3)"
    assert R._keys((P, D, 0)) == "Partial, Duplicate, Split(dim 0)"


# ---- elementwise rules -------------------------------------------------------------------------------------------
def test_same_rule_passes_equal_keys_and_refuses_partial():
    """Nonlinear elementwise: equal keys pass unchanged; differing keys and Partial are refused with their texts."""
    assert R._same((1, 1), [], {}) == (1,)
    assert R._same((1,), [], {}) == (1,)  # gelu: one input
    assert _rule_error(R._same, (P,), []) == ("a Partial input cannot pass a nonlinear op; Reshard it (e.g. "
                                              "all-reduce) first")
    assert R._same((D, D, D), [], {}) == (D,)
    assert _rule_error(R._same, (0, 1), []) == ("inputs are sharded differently (Split(dim 0), Split(dim 1)); they "
                                                "must match")
    assert _rule_error(R._same, (0, 0, D), []) == ("inputs are sharded differently (Split(dim 0), Split(dim 0), "
                                                   "Duplicate); they must match")
    assert _rule_error(R._same, (P, P), []) == ("a Partial input cannot pass a nonlinear op; Reshard it (e.g. "
                                                "all-reduce) first")


def test_linear_same_rule_lets_partial_pass():
    """Linear elementwise: Partial + Partial gives Partial; differing keys are refused with the Partial hint."""
    assert R._linear_same((P, P), [], {}) == (P,)
    assert R._linear_same((2,), [], {}) == (2,)
    assert R._linear_same((2, 2, 2), [], {}) == (2,)
    assert _rule_error(R._linear_same, (P, D), []) == (
        "inputs are sharded differently (Partial, Duplicate); they must match (Partial + Partial is fine, Partial + "
        "Duplicate is not)")


def test_mul_rule():
    """mul: equal non-Partial keys pass; Partial x Duplicate (either order) is Partial; the rest is refused."""
    assert R._mul_rule((0, 0), [], {}) == (0,)
    assert R._mul_rule((D, D), [], {}) == (D,)
    assert R._mul_rule((P, D), [], {}) == (P,)
    assert R._mul_rule((D, P), [], {}) == (P,)
    assert _rule_error(R._mul_rule, (P, P), []) == "cannot multiply inputs sharded as Partial, Partial"
    assert _rule_error(R._mul_rule, (0, 1), []) == "cannot multiply inputs sharded as Split(dim 0), Split(dim 1)"
    assert _rule_error(R._mul_rule, (P, 0), []) == "cannot multiply inputs sharded as Partial, Split(dim 0)"


def test_positions_rule():
    """positions keep any key but Partial."""
    assert R._positions_rule((1,), [], {}) == (1,)
    assert R._positions_rule((D,), [], {}) == (D,)
    assert _rule_error(R._positions_rule, (P,), []) == "positions of a Partial tensor are undefined"


# ---- Dot, Linear, Embedding ----------------------------------------------------------------------------------------
X3 = [(2, 4, 8), (8, 16)]  # X[B, S, K] @ W[K, N]
DOT_MSG = ("Dot cannot combine X {} with W {} on one device axis (supported: batch split x Duplicate, contracted "
           "split x row split -> Partial, Duplicate x column split)")


def test_dot_rule_figure_13():
    """Figure 13 on X[B, S, K] @ W[K, N]: batch dims split x Duplicate keep the split; K split on both sides gives
    Partial; Duplicate x column split splits the output's last dim; Partial x Duplicate either way is Partial."""
    assert R._dot_rule((D, D), X3, {}) == (D,)
    assert R._dot_rule((0, D), X3, {}) == (0,)
    assert R._dot_rule((1, D), X3, {}) == (1,)
    assert R._dot_rule((2, 0), X3, {}) == (P,)
    assert R._dot_rule((D, 1), X3, {}) == (2,)
    assert R._dot_rule((D, 1), [(3, 8), (8, 16)], {}) == (1,)
    assert R._dot_rule((P, D), X3, {}) == (P,)
    assert R._dot_rule((D, P), X3, {}) == (P,)


@pytest.mark.parametrize("keys", [(2, D), (1, 0), (0, 0), (D, 0), (P, P), (P, 1), (0, 1), (3, D)])
def test_dot_rule_refuses_other_pairs(keys):
    """Every other pair is refused, naming both keys: the contracted dim split against a Duplicate weight, a
    batch split against a row split, Partial x Partial, ..."""
    xk, wk = keys
    assert _rule_error(R._dot_rule, keys, X3) == DOT_MSG.format(R._key(xk), R._key(wk))


def test_dot_rule_error_text():
    assert _rule_error(R._dot_rule, (2, D), X3) == (
        "Dot cannot combine X Split(dim 2) with W Duplicate on one device axis (supported: batch split x Duplicate, "
        "contracted split x row split -> Partial, Duplicate x column split)")


def test_linear_rule_swaps_the_weight_dims():
    """Linear (W[N, K]): Dot's rule with W's split dims 0 and 1 swapped; Partial and Duplicate unchanged."""
    xw = [(2, 4, 8), (16, 8)]
    assert R._linear_rule((D, 0), xw, {}) == (2,)
    assert R._linear_rule((2, 1), xw, {}) == (P,)
    assert R._linear_rule((1, D), xw, {}) == (1,)
    assert R._linear_rule((D, P), xw, {}) == (P,)
    assert R._linear_rule((D, D), xw, {}) == (D,)
    assert _rule_error(R._linear_rule, (2, 0), xw) == DOT_MSG.format("Split(dim 2)", "Split(dim 1)")
    assert _rule_error(R._linear_rule, (D, 2), xw) == DOT_MSG.format("Duplicate", "Split(dim 2)")


def test_input_grads_of_dot_and_linear():
    """Megatron's f: a Duplicate activation meeting an output-split (or Partial) weight gets a Partial gradient; a
    Partial activation's gradient is Duplicate; otherwise the gradient is laid out like the input."""
    assert R._dot_input_grad(D, 1) == P
    assert R._dot_input_grad(D, P) == P
    assert R._dot_input_grad(D, 0) == D
    assert R._dot_input_grad(D, D) == D
    assert R._dot_input_grad(P, D) == D
    assert R._dot_input_grad(P, 1) == D
    assert R._dot_input_grad(0, 1) == 0
    assert R._linear_input_grad(D, 0) == P
    assert R._linear_input_grad(D, P) == P
    assert R._linear_input_grad(D, 1) == D
    assert R._linear_input_grad(D, D) == D
    assert R._linear_input_grad(P, 0) == D
    assert R._linear_input_grad(1, 0) == 1


def test_embedding_rule():
    """Embedding of tokens[B, S] by W[V, H]: a token split passes (every dim of the tokens, not beyond); a hidden
    split of W splits the output's new last dim; a vocab split of W gives Partial."""
    tw = [(2, 4), (32, 8)]
    assert R._embedding_rule((D, D), tw, {}) == (D,)
    assert R._embedding_rule((0, D), tw, {}) == (0,)
    assert R._embedding_rule((1, D), tw, {}) == (1,)
    assert R._embedding_rule((D, 1), tw, {}) == (2,)
    assert R._embedding_rule((D, 1), [(2, 4, 3), (32, 8)], {}) == (3,)
    assert R._embedding_rule((D, 0), tw, {}) == (P,)
    assert _rule_error(R._embedding_rule, (2, D), tw) == "Embedding cannot combine tokens Split(dim 2) with weight " \
                                                         "Duplicate"
    assert _rule_error(R._embedding_rule, (0, 0), tw) == "Embedding cannot combine tokens Split(dim 0) with weight " \
                                                         "Split(dim 0)"
    assert _rule_error(R._embedding_rule, (P, D), tw) == "Embedding cannot combine tokens Partial with weight " \
                                                         "Duplicate"
    assert _rule_error(R._embedding_rule, (D, P), tw) == "Embedding cannot combine tokens Duplicate with weight " \
                                                         "Partial"


# ---- norms, bias, rope, attention ------------------------------------------------------------------------------------
def test_rmsnorm_rule():
    """RMSNorm: the weight Duplicate, the last dim whole, no Partial input; anything else passes."""
    xw = [(2, 4, 8), (8,)]
    assert R._rmsnorm_rule((0, D), xw, {}) == (0,)
    assert R._rmsnorm_rule((1, D), xw, {}) == (1,)
    assert R._rmsnorm_rule((D, D), xw, {}) == (D,)
    assert _rule_error(R._rmsnorm_rule, (0, 0), xw) == "RMSNorm weight must be Duplicate, not Split(dim 0)"
    assert _rule_error(R._rmsnorm_rule, (D, P), xw) == "RMSNorm weight must be Duplicate, not Partial"
    assert _rule_error(R._rmsnorm_rule, (2, D), xw) == ("RMSNorm normalises the last dim, which is split here; "
                                                        "Reshard it to Duplicate first")
    assert _rule_error(R._rmsnorm_rule, (P, D), xw) == ("RMSNorm is nonlinear; a Partial input must be reduced "
                                                        "(Reshard) first")


def test_norm_rule():
    """LayerNorm: every weight Duplicate (all named in the error), the last dim whole, no Partial input."""
    xwb = [(2, 4, 8), (8,), (8,)]
    assert R._norm_rule((1, D, D), xwb, {}) == (1,)
    assert R._norm_rule((D, D, D), xwb, {}) == (D,)
    assert _rule_error(R._norm_rule, (0, D, 0), xwb) == "norm weights must be Duplicate, not Duplicate, Split(dim 0)"
    assert _rule_error(R._norm_rule, (0, P, D), xwb) == "norm weights must be Duplicate, not Partial, Duplicate"
    assert _rule_error(R._norm_rule, (2, D, D), xwb) == ("a norm normalises the last dim, which is split here; "
                                                         "Reshard it to Duplicate first")
    assert _rule_error(R._norm_rule, (P, D, D), xwb) == ("a norm is nonlinear; a Partial input must be reduced "
                                                         "(Reshard) first")


def test_bias_rule():
    """X[..., N] + b[N]: a Duplicate bias passes X's key unless X is Partial or split on its last dim; a bias
    split on dim 0 goes with X split on its last dim; Partial X has its own text."""
    xb = [(2, 4, 8), (8,)]
    assert R._bias_rule((0, D), xb, {}) == (0,)
    assert R._bias_rule((1, D), xb, {}) == (1,)
    assert R._bias_rule((D, D), xb, {}) == (D,)
    assert R._bias_rule((2, 0), xb, {}) == (2,)
    assert R._bias_rule((1, 0), [(2, 8), (8,)], {}) == (1,)
    partial = ("a bias cannot be added to a Partial input (each summand would add it); Reshard the input "
               "(all-reduce) first")
    assert _rule_error(R._bias_rule, (P, D), xb) == partial
    assert _rule_error(R._bias_rule, (P, 0), xb) == partial
    assert _rule_error(R._bias_rule, (2, D), xb) == ("BiasAdd cannot combine X Split(dim 2) with bias Duplicate "
                                                     "(bias split must match X's last dim)")
    assert _rule_error(R._bias_rule, (1, 0), xb) == ("BiasAdd cannot combine X Split(dim 1) with bias Split(dim 0) "
                                                     "(bias split must match X's last dim)")
    assert _rule_error(R._bias_rule, (D, 0), xb) == ("BiasAdd cannot combine X Duplicate with bias Split(dim 0) "
                                                     "(bias split must match X's last dim)")


def test_rope_rule():
    """RoPE keeps batch, sequence (context parallelism) and head splits, refuses a head_dim split."""
    x = [(2, 4, 8, 16)]
    for k in (0, 1, 2, D, P):
        assert R._rope_rule((k,), x, {}) == (k,)
    assert _rule_error(R._rope_rule, (3,), x) == ("RoPE needs whole head dims on a device; split the batch, the "
                                                  "sequence or the heads instead")


def test_attention_rule():
    """Causal attention: q, k, v keyed alike, split on batch, sequence or heads, or Duplicate."""
    qkv = [(2, 4, 8, 16)] * 3
    for k in (D, 0, 1, 2):
        assert R._attention_rule((k, k, k), qkv, {}) == (k,)
    assert _rule_error(R._attention_rule, (0, 0, 1), qkv) == ("q, k, v are sharded differently (Split(dim 0), "
                                                              "Split(dim 0), Split(dim 1))")
    assert _rule_error(R._attention_rule, (D, 0, 0), qkv) == ("q, k, v are sharded differently (Duplicate, "
                                                              "Split(dim 0), Split(dim 0))")
    tail = ("causal attention supports splitting the batch (0), the sequence (1: context parallelism, keys and "
            "values travel between the devices) or the heads (2), not ")
    assert _rule_error(R._attention_rule, (3, 3, 3), qkv) == tail + "Split(dim 3)"
    assert _rule_error(R._attention_rule, (P, P, P), qkv) == tail + "Partial"


# ---- reshape, sum, split, concat, cross-entropy ----------------------------------------------------------------------
def test_reshape_map_groups():
    """The leading dim of each group of dims whose products agree maps to the leading dim of its image."""
    assert R._reshape_map((2, 3, 8), (2, 3, 2, 4)) == {0: 0, 1: 1, 2: 2}
    assert R._reshape_map((2, 3, 4), (6, 4)) == {0: 0, 2: 1}
    assert R._reshape_map((6, 4), (2, 3, 4)) == {0: 0, 1: 2}
    assert R._reshape_map((4, 6), (6, 4)) == {0: 0}
    assert R._reshape_map((2, 3, 4, 5), (2, 12, 5)) == {0: 0, 1: 1, 3: 2}
    assert R._reshape_map((S, T, 8), (S * T, 2, 4)) == {0: 0, 2: 1}


def test_reshape_map_stops_when_no_group_closes():
    """Dims whose products never agree (the shape rule refuses such a reshape first) map nothing further: the
    group grows only inside both shapes."""
    assert R._reshape_map((2,), (3,)) == {}
    assert R._reshape_map((2,), (4,)) == {}
    assert R._reshape_map((4,), (2,)) == {}
    assert R._reshape_map((2, 2), (2, 3)) == {0: 0}
    assert R._reshape_map((), (2,)) == {}
    assert R._reshape_map((2, 3, 1), (6,)) == {0: 0}  # dst used up, src's trailing 1 left: stop, no more dst dims


def test_reshape_rule():
    """A split dim stays split where the map sends it; Partial and Duplicate pass; an inner dim of a merged group
    is refused with the shapes in the text."""
    xs = [(2, 3, 4)]
    assert R._reshape_rule((0,), xs, {"shape": (6, 4)}) == (0,)
    assert R._reshape_rule((2,), xs, {"shape": (6, 4)}) == (1,)
    assert R._reshape_rule((0,), [(2, 3, 1)], {"shape": (6,)}) == (0,)
    assert R._reshape_rule((P,), xs, {"shape": (6, 4)}) == (P,)
    assert R._reshape_rule((D,), xs, {"shape": (6, 4)}) == (D,)
    assert _rule_error(R._reshape_rule, (1,), xs, {"shape": (6, 4)}) == (
        "Reshape [2, 3, 4] -> [6, 4] cannot keep dim 1 split (only the leading dim of a merged or split group can "
        "stay split)")


def test_norm_dims_wraps_negative_dims_and_sorts():
    assert R._norm_dims((-1, 0), 3) == (0, 2)
    assert R._norm_dims((2, 1), 3) == (1, 2)


def test_sum_rule():
    """Summing a split dim gives Partial; another split dim shifts down by the summed dims before it (not with
    keepdim); Partial and Duplicate pass."""
    xs = [(2, 3, 4)]
    assert R._sum_rule((2,), xs, {"dims": (-1,)}) == (P,)
    assert R._sum_rule((0,), xs, {"dims": (0, 2)}) == (P,)
    assert R._sum_rule((1,), xs, {"dims": (0,)}) == (0,)
    assert R._sum_rule((1,), xs, {"dims": (0,), "keepdim": True}) == (1,)
    assert R._sum_rule((2,), xs, {"dims": (0, 1)}) == (0,)
    assert R._sum_rule((2,), xs, {"dims": (1,)}) == (1,)
    assert R._sum_rule((1,), xs, {"dims": (2,)}) == (1,)
    assert R._sum_rule((0,), xs, {"dims": (-1,), "keepdim": False}) == (0,)
    assert R._sum_rule((D,), xs, {"dims": (0,)}) == (D,)
    assert R._sum_rule((P,), xs, {"dims": (0,)}) == (P,)


def test_split_rule():
    """Split copies the key to every part, and refuses to split along a split dim."""
    assert R._split_rule((0,), [(4, 6)], {"dim": 1, "parts": 3}) == (0, 0, 0)
    assert R._split_rule((D,), [(4, 6)], {"dim": 1, "parts": 2}) == (D, D)
    assert _rule_error(R._split_rule, (1,), [(4, 6)], {"dim": 1, "parts": 2}) == (
        "Split along dim 1, which is itself split across devices; Reshard first")


def test_concat_rule():
    """Concat: equal keys (Partial allowed) unless split along the concat dim."""
    assert R._concat_rule((0, 0), [(4, 6)] * 2, {"dim": 1}) == (0,)
    assert R._concat_rule((P, P), [(4, 6)] * 2, {"dim": 1}) == (P,)
    assert _rule_error(R._concat_rule, (1, 1), [(4, 6)] * 2, {"dim": 1}) == (
        "Concat along dim 1, which is split across devices; Reshard first")
    assert _rule_error(R._concat_rule, (0, 1), [(4, 6)] * 2, {"dim": 1}).startswith(
        "inputs are sharded differently (Split(dim 0), Split(dim 1))")


def test_cross_entropy_rule():
    """CrossEntropy of logits[B, S, V] and targets[B, S]: equal token splits give Partial; a vocab split is
    refused with the all-gather hint; other pairs name both keys."""
    lt = [(2, 4, 32), (2, 4)]
    assert R._ce_rule((D, D), lt, {}) == (D,)
    assert R._ce_rule((0, 0), lt, {}) == (P,)
    assert R._ce_rule((1, 1), lt, {}) == (P,)
    vocab = ("CrossEntropy over a vocab-split logits tensor is not supported; Reshard the logits to Duplicate "
             "(all-gather) first")
    assert _rule_error(R._ce_rule, (2, D), lt) == vocab
    assert _rule_error(R._ce_rule, (2, 2), lt) == vocab
    assert _rule_error(R._ce_rule, (0, 1), lt) == "CrossEntropy cannot combine logits Split(dim 0) with targets " \
                                                  "Split(dim 1)"
    assert _rule_error(R._ce_rule, (P, P), lt) == "CrossEntropy cannot combine logits Partial with targets Partial"
    assert _rule_error(R._ce_rule, (0, D), lt) == "CrossEntropy cannot combine logits Split(dim 0) with targets " \
                                                  "Duplicate"


def test_leaves_have_no_axis_rule():
    assert _rule_error(R._no_rule, (D,), []) == "leaf and Reshard annotations come from the plan, not from deduction"


# ---- shape rules -------------------------------------------------------------------------------------------------
def test_need_names_the_node():
    R._need(True, "n", "never raised")
    with pytest.raises(ShapeError) as e:
        R._need(False, "lin", "bad")
    assert str(e.value) == "op 'lin': bad"


def test_shape_same():
    """Elementwise ops: every input the first one's shape (rank and dims, symbols compared as symbols)."""
    assert R._shape_same([(2, S)], {}, "n") == [(2, S)]
    assert R._shape_same([(2, S), (2, S), (2, S)], {}, "n") == [(2, S)]
    assert _shape_error(R._shape_same, [(2, 3), (2, 4)]) == "op 'n': input shapes [2, 3], [2, 4] must be equal"
    assert _shape_error(R._shape_same, [(2, 3), (2, 3), (3, 3)]) == ("op 'n': input shapes [2, 3], [2, 3], [3, 3] "
                                                                     "must be equal")
    assert _shape_error(R._shape_same, [(2, 3), (2, 3, 1)]) == "op 'n': input shapes [2, 3], [2, 3, 1] must be equal"
    assert _shape_error(R._shape_same, [(2, 3), (2,)]) == "op 'n': input shapes [2, 3], [2] must be equal"


def test_shape_dot():
    assert R._shape_dot([(2, 4, 8), (8, 16)], {}, "n") == [(2, 4, 16)]
    assert R._shape_dot([(8,), (8, 3)], {}, "n") == [(3,)]
    assert _shape_error(R._shape_dot, [(), (8, 3)]) == "op 'n': Dot takes X[..., K] and W[K, N], got [], [8, 3]"
    assert _shape_error(R._shape_dot, [(2, 8), (8,)]) == "op 'n': Dot takes X[..., K] and W[K, N], got [2, 8], [8]"
    assert _shape_error(R._shape_dot, [(2, 8), (8, 3, 1)]) == ("op 'n': Dot takes X[..., K] and W[K, N], got "
                                                               "[2, 8], [8, 3, 1]")
    assert _shape_error(R._shape_dot, [(2, 8), (4, 3)]) == "op 'n': contracted dims differ: X [2, 8] vs W [4, 3]"


def test_shape_linear():
    assert R._shape_linear([(2, 4, 8), (16, 8)], {}, "n") == [(2, 4, 16)]
    assert R._shape_linear([(8,), (16, 8)], {}, "n") == [(16,)]  # a 1-D X (a vector) is fine
    assert _shape_error(R._shape_linear, [(), (3, 8)]) == "op 'n': Linear takes X[..., K] and W[N, K], got [], [3, 8]"
    assert _shape_error(R._shape_linear, [(2, 8), (8,)]) == ("op 'n': Linear takes X[..., K] and W[N, K], got [2, 8], "
                                                             "[8]")
    assert _shape_error(R._shape_linear, [(2, 8), (8, 16)]) == ("op 'n': contracted dims differ: X [2, 8] vs W "
                                                                "[8, 16] (W is [out, in])")


def test_shape_embedding():
    assert R._shape_embedding([(2, 4), (32, 8)], {}, "n") == [(2, 4, 8)]
    assert _shape_error(R._shape_embedding, [(2, 4), (32,)]) == ("op 'n': embedding weight must be [vocab, hidden], "
                                                                 "got [32]")
    assert _shape_error(R._shape_embedding, [(2, 4), (32, 8, 1)]) == ("op 'n': embedding weight must be [vocab, "
                                                                      "hidden], got [32, 8, 1]")


def test_shape_rmsnorm_and_bias():
    """A norm weight / a bias: one dim, the input's last."""
    for rule, what in ((R._shape_rmsnorm, "weight"), (R._shape_bias, "bias")):
        assert rule([(2, 8), (8,)], {}, "n") == [(2, 8)]
        assert rule([(2, 4, 8), (8,)], {}, "n") == [(2, 4, 8)]  # the last dim, not dim 1
        assert _shape_error(rule, [(2, 8), (4,)]) == f"op 'n': {what} [4] must match the last dim of [2, 8]"
        assert _shape_error(rule, [(2, 8), (8, 8)]) == f"op 'n': {what} [8, 8] must match the last dim of [2, 8]"


def test_shape_layernorm():
    assert R._shape_layernorm([(2, 8), (8,), (8,)], {}, "n") == [(2, 8)]
    assert R._shape_layernorm([(2, 4, 8), (8,), (8,)], {}, "n") == [(2, 4, 8)]  # the last dim, not dim 1
    assert _shape_error(R._shape_layernorm, [(2, 8), (4,), (8,)]) == ("op 'n': weight [4] must match the last dim "
                                                                       "of [2, 8]")
    assert _shape_error(R._shape_layernorm, [(2, 8), (8,), (4,)]) == ("op 'n': bias [4] must match the last dim of "
                                                                       "[2, 8]")
    assert _shape_error(R._shape_layernorm, [(2, 8), (8,), (8, 8)]) == ("op 'n': bias [8, 8] must match the last "
                                                                         "dim of [2, 8]")


def test_shape_rope():
    assert R._shape_rope([(2, 4, 8, 16)], {}, "n") == [(2, 4, 8, 16)]
    assert _shape_error(R._shape_rope, [(2, 4, 16)]) == "op 'n': RoPE takes [B, S, heads, head_dim], got [2, 4, 16]"
    assert _shape_error(R._shape_rope, [(2, 4, 8, 15)]) == "op 'n': head_dim 15 must be an even int"
    assert _shape_error(R._shape_rope, [(2, 4, 8, S)]) == "op 'n': head_dim S must be an even int"


def test_shape_attention():
    q, kv = (2, 4, 8, 16), (2, 4, 2, 16)
    assert R._shape_attention([q, kv, kv], {}, "n") == [q]
    rank = "op 'n': attention takes q, k, v as [B, S, heads, head_dim]"
    assert _shape_error(R._shape_attention, [(2, 4, 8), kv, kv]) == rank
    assert _shape_error(R._shape_attention, [q, (2, 4, 2), kv]) == rank
    assert _shape_error(R._shape_attention, [q, kv, (2, 4, 2)]) == rank
    assert _shape_error(R._shape_attention, [q, kv, (2, 4, 2, 8)]) == ("op 'n': k [2, 4, 2, 16] and v [2, 4, 2, 8] "
                                                                       "differ")
    for bad_q in ((3, 4, 8, 16), (2, 5, 8, 16), (2, 4, 8, 8)):
        assert _shape_error(R._shape_attention, [bad_q, kv, kv]) == (
            f"op 'n': q {R.shape_str(bad_q)} and k [2, 4, 2, 16] differ in batch, sequence or head_dim")
    assert _shape_error(R._shape_attention, [(2, 4, 6, 16), (2, 4, 4, 16), (2, 4, 4, 16)]) == (
        "op 'n': query heads 6 must be a multiple of kv heads 4 (GQA)")
    assert _shape_error(R._shape_attention, [(2, 4, S, 16), kv, kv]) == ("op 'n': query heads S must be a multiple "
                                                                         "of kv heads 2 (GQA)")
    kvs = (2, 4, S, 16)
    assert _shape_error(R._shape_attention, [q, kvs, kvs]) == ("op 'n': query heads 8 must be a multiple of kv heads "
                                                               "S (GQA)")


def test_shape_reshape():
    assert R._shape_reshape([(2, 3, 4)], {"shape": [6, 4]}, "n") == [(6, 4)]
    assert R._shape_reshape([(S, 4)], {"shape": (S * 2, 2)}, "n") == [(S * 2, 2)]
    assert _shape_error(R._shape_reshape, [(2, 3)], {"shape": (4, 2)}) == ("op 'n': cannot reshape [2, 3] to [4, 2] "
                                                                           "(element counts differ)")


def test_shape_sum():
    assert R._shape_sum([(2, 3, 4)], {"dims": (0, -1)}, "n") == [(3,)]
    assert R._shape_sum([(2, 3, 4)], {"dims": (0, -1), "keepdim": True}, "n") == [(1, 3, 1)]
    assert R._shape_sum([(2, 3, 4)], {"dims": (1,), "keepdim": False}, "n") == [(2, 4)]


def test_shape_split():
    assert R._shape_split([(4, 6)], {"dim": 1, "parts": 3}, "n") == [(4, 2)] * 3
    assert R._shape_split([(4, 6)], {"dim": 0, "parts": 2}, "n") == [(2, 6)] * 2
    assert R._shape_split([(S, 6)], {"dim": 0, "parts": 2}, "n") == [(Sym(Fraction(1, 2), ("S",)), 6)] * 2
    assert _shape_error(R._shape_split, [(4, 6)], {"dim": 2, "parts": 2}) == "op 'n': split dim 2 out of range for " \
                                                                             "[4, 6]"
    assert _shape_error(R._shape_split, [(4, 6)], {"dim": -1, "parts": 2}) == "op 'n': split dim -1 out of range " \
                                                                              "for [4, 6]"
    assert _shape_error(R._shape_split, [(4, 6)], {"dim": 1, "parts": 4}, node="sp") == (
        "tensor 'sp' dim 1: size 6 is not divisible by 4 (split into 4 parts); HSPMD never pads — change the "
        "sharding degree or the shape")


def test_shape_concat():
    assert R._shape_concat([(2, 3), (2, 5)], {"dim": 1}, "n") == [(2, 8)]
    assert R._shape_concat([(2, 3)], {"dim": 1}, "n") == [(2, 3)]  # one input
    assert R._shape_concat([(2, 3), (2, 5), (2, 1)], {"dim": 1}, "n") == [(2, 9)]
    assert R._shape_concat([(S, 4), (S, 4)], {"dim": 0}, "n") == [(Sym(Fraction(2), ("S",)), 4)]
    assert _shape_error(R._shape_concat, [(2, 3), (4, 5)], {"dim": 1}) == ("op 'n': concat inputs [2, 3], [4, 5] "
                                                                           "differ outside dim 1")
    assert _shape_error(R._shape_concat, [(2, 3), (2, 3, 1)], {"dim": 1}) == ("op 'n': concat inputs [2, 3], "
                                                                              "[2, 3, 1] differ outside dim 1")
    assert _shape_error(R._shape_concat, [(4, 2), (S, 2)], {"dim": 0}) == ("op 'n': cannot add dims 4 and S "
                                                                           "symbolically")


def test_dim_add():
    """Ints add; 0 + a symbol is the symbol; like symbols add coefficients; anything else is refused."""
    assert R._dim_add(3, 4, "n") == 7
    assert R._dim_add(0, S, "n") == S
    assert R._dim_add(S, S, "n") == Sym(Fraction(2), ("S",))
    assert R._dim_add(S * 3, S, "n") == Sym(Fraction(4), ("S",))
    with pytest.raises(ShapeError) as e:
        R._dim_add(S, T, "cat")
    assert str(e.value) == "op 'cat': cannot add dims S and T symbolically"
    with pytest.raises(ShapeError) as e:
        R._dim_add(S, 0, "cat")
    assert str(e.value) == "op 'cat': cannot add dims S and 0 symbolically"


def test_shape_cross_entropy():
    assert R._shape_ce([(2, 4, 32), (2, 4)], {}, "n") == [()]
    assert _shape_error(R._shape_ce, [(2, 4), (2, 4)]) == "op 'n': logits [2, 4] must be targets [2, 4] + [vocab]"
    assert _shape_error(R._shape_ce, [(2, 5, 32), (2, 4)]) == ("op 'n': logits [2, 5, 32] must be targets [2, 4] + "
                                                               "[vocab]")


def test_shape_reshard_and_leaf():
    assert R._shape_reshard([(2, S), (9,)], {}, "n") == [(2, S)]
    assert R._shape_leaf([], {"shape": [2, S]}, "n") == [(2, S)]


def test_batch_dims_and_dtype_helpers():
    assert R._leading([(2, 3, 4)]) == (0, 1)
    assert R._all_dims([(2, 3, 4)]) == (0, 1, 2)
    assert R._weight_dtype(["int64", "bfloat16"]) == "bfloat16"
    assert R._int64(["bfloat16"]) == "int64"


# ---- the table -------------------------------------------------------------------------------------------------------
#: kind -> (shape rule, axis rule, custom, weight_inputs, batch_dims of [(2, 3, 4)], dtype rule, input_grad, mixes)
TABLE = {
    "placeholder": (R._shape_leaf, R._no_rule, False, (), (), None, None, ()),
    "parameter": (R._shape_leaf, R._no_rule, False, (), (), None, None, ()),
    "Reshard": (R._shape_reshard, R._no_rule, False, (), (), None, None, ()),
    "embedding": (R._shape_embedding, R._embedding_rule, True, (1,), (0, 1, 2), R._weight_dtype, None, ()),
    "positions": (R._shape_same, R._positions_rule, False, (), (), R._int64, None, ()),
    "dot": (R._shape_dot, R._dot_rule, True, (1,), (0, 1), None, R._dot_input_grad, ()),
    "linear": (R._shape_linear, R._linear_rule, True, (1,), (0, 1), None, R._linear_input_grad, ()),
    "bias_add": (R._shape_bias, R._bias_rule, False, (1,), (0, 1), None, None, ()),
    "rmsnorm": (R._shape_rmsnorm, R._rmsnorm_rule, False, (1,), (0, 1), None, None, ()),
    "layernorm": (R._shape_layernorm, R._norm_rule, False, (1, 2), (0, 1), None, None, ()),
    "rope": (R._shape_rope, R._rope_rule, False, (), (), None, None, ()),
    "attention": (R._shape_attention, R._attention_rule, False, (), (), None, None, (1,)),
    "swiglu": (R._shape_same, R._same, False, (), (), None, None, ()),
    "gelu": (R._shape_same, R._same, False, (), (), None, None, ()),
    "add": (R._shape_same, R._linear_same, False, (), (), None, None, ()),
    "mul": (R._shape_same, R._mul_rule, False, (), (), None, None, ()),
    "reshape": (R._shape_reshape, R._reshape_rule, True, (), (), None, None, ()),
    "sum": (R._shape_sum, R._sum_rule, True, (), (), None, None, ()),
    "split": (R._shape_split, R._split_rule, False, (), (), None, None, ()),
    "concat": (R._shape_concat, R._concat_rule, False, (), (), None, None, ()),
    "cross_entropy": (R._shape_ce, R._ce_rule, True, (), (), None, None, ()),
}


@pytest.mark.parametrize("kind", sorted(TABLE))
def test_builtin_op_table(kind):
    """Each built-in kind carries its own shape and axis rules, Table 2's custom flag, its weight inputs and batch
    dims (for weight-gradient deduction), dtype rule, input-gradient rule and mixed dims."""
    op = R.OPS[kind]
    shape, axis, custom, weights, batch, dtype, grad, mixes = TABLE[kind]
    assert op.kind == kind
    assert (op.shape, op.axis, op.custom, op.weight_inputs, op.dtype, op.input_grad, op.mixes) == (
        shape, axis, custom, weights, dtype, grad, mixes)
    assert op.batch_dims([(2, 3, 4)]) == batch


def test_builtin_kinds():
    assert {k for k in R.OPS if k in TABLE} == set(TABLE) and R.RESHARD == "Reshard"


def test_opdef_defaults():
    op = R.OpDef("k", R._shape_same, R._same)
    assert (op.custom, op.weight_inputs, op.dtype, op.input_grad, op.mixes) == (False, (), None, None, ())
    assert op.batch_dims([(2, 3)]) == ()


# ---- registry functions --------------------------------------------------------------------------------------------
def test_register_op_refuses_a_known_kind_unless_replace(monkeypatch):
    monkeypatch.setattr(R, "OPS", dict(R.OPS))
    op = R.OpDef("gelu", R._shape_same, R._linear_same)
    with pytest.raises(SpecializationError) as e:
        R.register_op(op)
    assert str(e.value) == "op kind 'gelu' is already registered; pass replace=True to replace it"
    assert R.OPS["gelu"].axis is R._same
    assert R.register_op(op, replace=True) is op
    assert R.OPS["gelu"] is op
    new = R.OpDef("square_relu_k", R._shape_same, R._same)
    assert R.register_op(new) is new and R.OPS["square_relu_k"] is new


def test_op_def_lists_the_known_kinds(monkeypatch):
    """The unknown-kind error names the node when given and lists every kind, sorted."""
    assert R.op_def("dot") is R.OPS["dot"]
    monkeypatch.setattr(R, "OPS", {k: R.OPS[k] for k in ("dot", "Reshard", "add")})
    with pytest.raises(SpecializationError) as e:
        R.op_def("nope")
    assert str(e.value) == ("unknown op kind 'nope'; known: Reshard, add, dot (add one with "
                            "hspmd_sdk.core.ops.register_op)")
    with pytest.raises(SpecializationError) as e:
        R.op_def("nope", "h1")
    assert str(e.value) == ("unknown op kind 'nope' for node 'h1'; known: Reshard, add, dot (add one with "
                            "hspmd_sdk.core.ops.register_op)")


def test_infer_shapes_names_the_node():
    assert R.infer_shapes("dot", [(2, 8), (8, 4)], {}, "mm") == [(2, 4)]
    with pytest.raises(ShapeError) as e:
        R.infer_shapes("dot", [(2, 8), (4, 4)], {}, "mm")
    assert str(e.value) == "op 'mm': contracted dims differ: X [2, 8] vs W [4, 4]"
    with pytest.raises(SpecializationError, match=r"^unknown op kind 'zz' for node 'mm'; known: "):
        R.infer_shapes("zz", [], {}, "mm")


def test_infer_dtype():
    """The kind's dtype rule, else the first input's, else float32 (leaves)."""
    assert R.infer_dtype("embedding", ["int64", "bfloat16"]) == "bfloat16"
    assert R.infer_dtype("positions", ["bfloat16"]) == "int64"
    assert R.infer_dtype("add", ["bfloat16", "float32"]) == "bfloat16"
    assert R.infer_dtype("placeholder", []) == "float32"
    with pytest.raises(SpecializationError, match=r"^unknown op kind 'zz'; known: "):
        R.infer_dtype("zz", ["float32"])
