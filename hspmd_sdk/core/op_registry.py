"""The operator kinds of the defined graph, by kind: a symbolic shape rule and a deduction rule for each (the
registry that :class:`~hspmd_sdk.core.graph.GraphBuilder` and the deduction read; the builder functions are
:mod:`hspmd_sdk.core.ops`).

Deduction (paper §6.1, Table 2).  DG Union and HSize always propagate unchanged (checked by
:mod:`hspmd_sdk.core.deduction`).  DS Union and HDim follow a per-op *axis rule*: the inputs' DS are refined to a
common list of device axes (mixed-radix digits, slowest first) and each axis maps the tuple of input keys on it
(``-2`` Partial, ``-1`` Duplicate, ``d`` Split of dim ``d``) to the output key(s).  Top-tier (HDim) deduction is
the same rule applied to one axis of degree HSize, "a simplified 1D sharding" as the paper puts it.  Most ops
propagate keys unchanged; Dot (Figure 13), Sum, Reshape, Embedding and CrossEntropy have custom rules.

The local torch implementation of each op lives in :mod:`hspmd_sdk.runtime.workers.kernels` (this module imports no
torch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..errors import ShapeError, SpecializationError
from .annotation import DUPLICATE, PARTIAL, is_split
from .symbolic import Dim, Sym, dim_div, dim_prod, dims_equal, divides, shape_str

__all__ = ["OpDef", "OPS", "RuleError", "register_op", "op_def", "infer_shapes", "infer_dtype", "RESHARD",
           "PARTIAL", "DUPLICATE"]

#: The kind of a Reshard marker (:meth:`~hspmd_sdk.core.graph.GraphBuilder.reshard`).
RESHARD = "Reshard"

Shapes = Sequence[tuple[Dim, ...]]


class RuleError(Exception):
    """An axis rule cannot place its inputs' keys; the deduction wraps it with tensor and subgroup names."""


AxisRule = Callable[[tuple[int, ...], Shapes, Mapping[str, Any]], tuple[int, ...]]
ShapeRule = Callable[[Shapes, Mapping[str, Any], str], list[tuple[Dim, ...]]]


@dataclass(frozen=True)
class OpDef:
    """An operator kind: its shape rule, its axis rule, and which inputs are weights (for gradient deduction).

    ``custom`` marks the ops of Table 2 whose deduction changes DS Union / HDim (Dot, Sum, Reshape, ...).
    ``weight_inputs``: indices of inputs that are usually parameters; ``batch_dims(shapes)`` gives the dims of
    the activation (input 0) that the weight does not have: a Duplicate weight axis facing a Split of such a dim
    gets a Partial gradient.  ``dtype(input dtypes)``: the output dtype (default: the first input's).
    ``input_grad(x key, w key)``: for a matmul-like op, the key of input 0's gradient on a device axis where the
    weight has key ``w key`` — Partial where a Duplicate activation meets an output-split weight (Megatron's
    "f": the specializer inserts that gradient's all-reduce); ``None`` for ops whose input gradients are laid out
    like their inputs.  ``mixes``: dims of input 0 that the op mixes although its rule lets them be split — the
    devices holding different chunks of such a dim exchange data inside the kernel (attention's sequence dim:
    context parallelism), so the specializer puts them in one pipeline stage, as it does a collective's devices.
    """

    kind: str
    shape: ShapeRule
    axis: AxisRule
    custom: bool = False
    weight_inputs: tuple[int, ...] = ()
    batch_dims: Callable[[Shapes], tuple[int, ...]] = lambda shapes: ()
    dtype: Callable[[Sequence[str]], str] | None = None
    input_grad: Callable[[int, int], int] | None = None
    mixes: tuple[int, ...] = ()


# ---- axis rules ------------------------------------------------------------------------------------------------
def _same(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """Nonlinear elementwise: every input has the same key, and Partial cannot pass."""
    k = keys[0]
    if any(x != k for x in keys):
        raise RuleError(f"inputs are sharded differently ({_keys(keys)}); they must match")
    if k == PARTIAL:
        raise RuleError("a Partial input cannot pass a nonlinear op; Reshard it (e.g. all-reduce) first")
    return (k,)


def _linear_same(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """Linear elementwise (add, rope, reshard-free reshape): equal keys, Partial allowed."""
    k = keys[0]
    if any(x != k for x in keys):
        raise RuleError(f"inputs are sharded differently ({_keys(keys)}); they must match (Partial + Partial is "
                        "fine, Partial + Duplicate is not)")
    return (k,)


def _mul_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    a, b = keys
    if a == b and a != PARTIAL:
        return (a,)
    if {a, b} == {PARTIAL, DUPLICATE}:
        return (PARTIAL,)
    raise RuleError(f"cannot multiply inputs sharded as {_keys(keys)}")


def _dot_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """Figure 13: X[..., K] @ W[K, N].  Split of the contracted dim on both sides gives Partial."""
    xk, wk = keys
    r = len(shapes[0])
    if xk == DUPLICATE and wk == DUPLICATE:
        return (DUPLICATE,)
    if 0 <= xk < r - 1 and wk == DUPLICATE:
        return (xk,)
    if xk == r - 1 and wk == 0:
        return (PARTIAL,)
    if xk == DUPLICATE and wk == 1:
        return (r - 1,)
    if (xk, wk) in ((PARTIAL, DUPLICATE), (DUPLICATE, PARTIAL)):
        return (PARTIAL,)
    raise RuleError(f"Dot cannot combine X {_key(xk)} with W {_key(wk)} on one device axis (supported: batch "
                    "split x Duplicate, contracted split x row split -> Partial, Duplicate x column split)")


def _embedding_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    tk, wk = keys
    r = len(shapes[0])
    if tk == DUPLICATE and wk == DUPLICATE:
        return (DUPLICATE,)
    if 0 <= tk < r and wk == DUPLICATE:
        return (tk,)
    if tk == DUPLICATE and wk == 1:
        return (r,)
    if tk == DUPLICATE and wk == 0:
        return (PARTIAL,)  # vocab-parallel embedding: rows outside the local range give zeros
    raise RuleError(f"Embedding cannot combine tokens {_key(tk)} with weight {_key(wk)}")


def _rmsnorm_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    xk, wk = keys
    r = len(shapes[0])
    if wk != DUPLICATE:
        raise RuleError(f"RMSNorm weight must be Duplicate, not {_key(wk)}")
    if xk == r - 1:
        raise RuleError("RMSNorm normalises the last dim, which is split here; Reshard it to Duplicate first")
    if xk == PARTIAL:
        raise RuleError("RMSNorm is nonlinear; a Partial input must be reduced (Reshard) first")
    return (xk,)


def _rope_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    (k,) = keys
    if k == 3:
        raise RuleError("RoPE needs whole head dims on a device; split the batch, the sequence or the heads "
                        "instead")
    return (k,)  # a split sequence (context parallelism): each device rotates its tokens by their global positions


def _attention_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    k = keys[0]
    if any(x != k for x in keys):
        raise RuleError(f"q, k, v are sharded differently ({_keys(keys)})")
    if k not in (DUPLICATE, 0, 1, 2):
        raise RuleError(f"causal attention supports splitting the batch (0), the sequence (1: context "
                        f"parallelism, keys and values travel between the devices) or the heads (2), not {_key(k)}")
    return (k,)


def _reshape_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    (k,) = keys
    if not is_split(k):
        return (k,)
    mapping = _reshape_map(shapes[0], attrs["shape"])
    if k not in mapping:
        raise RuleError(f"Reshape {shape_str(shapes[0])} -> {shape_str(attrs['shape'])} cannot keep dim {k} split "
                        "(only the leading dim of a merged or split group can stay split)")
    return (mapping[k],)


def _sum_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    (k,) = keys
    dims = _norm_dims(attrs["dims"], len(shapes[0]))
    if not is_split(k):
        return (k,)
    if k in dims:
        return (PARTIAL,)
    return (k if attrs.get("keepdim") else k - len([d for d in dims if d < k]),)


def _split_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    (k,) = keys
    if k == attrs["dim"]:
        raise RuleError(f"Split along dim {k}, which is itself split across devices; Reshard first")
    return (k,) * attrs["parts"]


def _concat_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    out = _linear_same(keys, shapes, attrs)
    if out[0] == attrs["dim"]:
        raise RuleError(f"Concat along dim {out[0]}, which is split across devices; Reshard first")
    return out


def _ce_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    lk, tk = keys
    r = len(shapes[1])
    if lk == DUPLICATE and tk == DUPLICATE:
        return (DUPLICATE,)
    if lk == tk and 0 <= lk < r:
        return (PARTIAL,)  # each device: sum of its tokens' losses / global token count
    if lk == r:
        raise RuleError("CrossEntropy over a vocab-split logits tensor is not supported; Reshard the logits to "
                        "Duplicate (all-gather) first")
    raise RuleError(f"CrossEntropy cannot combine logits {_key(lk)} with targets {_key(tk)}")


def _linear_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """``X[..., K] @ W[N, K]^T`` (torch's ``F.linear`` weight layout): Dot's rule with W's dims swapped."""
    xk, wk = keys
    swapped = {0: 1, 1: 0}.get(wk, wk)
    return _dot_rule((xk, swapped), shapes, attrs)


def _dot_input_grad(xk: int, wk: int) -> int:
    return PARTIAL if xk == DUPLICATE and wk in (1, PARTIAL) else (DUPLICATE if xk == PARTIAL else xk)


def _linear_input_grad(xk: int, wk: int) -> int:
    return PARTIAL if xk == DUPLICATE and wk in (0, PARTIAL) else (DUPLICATE if xk == PARTIAL else xk)


def _norm_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """RMSNorm / LayerNorm: every weight Duplicate, the normalised last dim whole, no Partial input."""
    xk, *wks = keys
    r = len(shapes[0])
    if any(wk != DUPLICATE for wk in wks):
        raise RuleError(f"norm weights must be Duplicate, not {_keys(tuple(wks))}")
    if xk == r - 1:
        raise RuleError("a norm normalises the last dim, which is split here; Reshard it to Duplicate first")
    if xk == PARTIAL:
        raise RuleError("a norm is nonlinear; a Partial input must be reduced (Reshard) first")
    return (xk,)


def _bias_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """``X[..., N] + b[N]``: b Duplicate (X not Partial: every summand would add it), or b split like X's last
    dim."""
    xk, bk = keys
    r = len(shapes[0])
    if bk == DUPLICATE and xk != PARTIAL and xk != r - 1:
        return (xk,)
    if bk == 0 and xk == r - 1:
        return (xk,)
    if xk == PARTIAL:
        raise RuleError("a bias cannot be added to a Partial input (each summand would add it); Reshard the "
                        "input (all-reduce) first")
    raise RuleError(f"BiasAdd cannot combine X {_key(xk)} with bias {_key(bk)} (bias split must match X's last "
                    "dim)")


def _positions_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    (k,) = keys
    if k == PARTIAL:
        raise RuleError("positions of a Partial tensor are undefined")
    return (k,)


# ---- shape rules -----------------------------------------------------------------------------------------------
def _need(cond: bool, node: str, msg: str) -> None:
    if not cond:
        raise ShapeError(f"op {node!r}: {msg}")


def _shape_same(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    for s in shapes[1:]:
        _need(len(s) == len(shapes[0]) and all(dims_equal(a, b) for a, b in zip(s, shapes[0])), node,
              f"input shapes {', '.join(shape_str(x) for x in shapes)} must be equal")
    return [tuple(shapes[0])]


def _shape_dot(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    x, w = shapes
    _need(len(w) == 2 and len(x) >= 1, node, f"Dot takes X[..., K] and W[K, N], got {shape_str(x)}, {shape_str(w)}")
    _need(dims_equal(x[-1], w[0]), node, f"contracted dims differ: X {shape_str(x)} vs W {shape_str(w)}")
    return [tuple(x[:-1]) + (w[1],)]


def _shape_embedding(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    t, w = shapes
    _need(len(w) == 2, node, f"embedding weight must be [vocab, hidden], got {shape_str(w)}")
    return [tuple(t) + (w[1],)]


def _shape_rmsnorm(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    x, w = shapes
    _need(len(w) == 1 and dims_equal(w[0], x[-1]), node, f"weight {shape_str(w)} must match the last dim of "
                                                         f"{shape_str(x)}")
    return [tuple(x)]


def _shape_rope(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    (x,) = shapes
    _need(len(x) == 4, node, f"RoPE takes [B, S, heads, head_dim], got {shape_str(x)}")
    _need(isinstance(x[3], int) and x[3] % 2 == 0, node, f"head_dim {x[3]} must be an even int")
    return [tuple(x)]


def _shape_attention(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    q, k, v = shapes
    _need(len(q) == 4 and len(k) == 4 and len(v) == 4, node, "attention takes q, k, v as [B, S, heads, head_dim]")
    _need(all(dims_equal(a, b) for a, b in zip(k, v)), node, f"k {shape_str(k)} and v {shape_str(v)} differ")
    _need(dims_equal(q[0], k[0]) and dims_equal(q[1], k[1]) and dims_equal(q[3], k[3]), node,
          f"q {shape_str(q)} and k {shape_str(k)} differ in batch, sequence or head_dim")
    _need(isinstance(q[2], int) and isinstance(k[2], int) and q[2] % k[2] == 0, node,
          f"query heads {q[2]} must be a multiple of kv heads {k[2]} (GQA)")
    return [tuple(q)]


def _shape_reshape(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    (x,) = shapes
    out = tuple(attrs["shape"])
    _need(dims_equal(dim_prod(x), dim_prod(out)), node, f"cannot reshape {shape_str(x)} to {shape_str(out)} "
                                                        "(element counts differ)")
    return [out]


def _shape_sum(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    (x,) = shapes
    dims = _norm_dims(attrs["dims"], len(x))
    if attrs.get("keepdim"):
        return [tuple(1 if i in dims else d for i, d in enumerate(x))]
    return [tuple(d for i, d in enumerate(x) if i not in dims)]


def _shape_split(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    (x,) = shapes
    d, parts = attrs["dim"], attrs["parts"]
    _need(0 <= d < len(x), node, f"split dim {d} out of range for {shape_str(x)}")
    chunk = dim_div(x[d], parts, tensor=node, dim=d, why=f"split into {parts} parts")
    return [tuple(chunk if i == d else s for i, s in enumerate(x))] * parts


def _shape_concat(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    d = attrs["dim"]
    first = shapes[0]
    total: Dim = 0
    for s in shapes:
        _need(len(s) == len(first) and all(dims_equal(a, b) for i, (a, b) in enumerate(zip(s, first)) if i != d),
              node, f"concat inputs {', '.join(shape_str(x) for x in shapes)} differ outside dim {d}")
        total = _dim_add(total, s[d], node)
    return [tuple(total if i == d else x for i, x in enumerate(first))]


def _shape_ce(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    logits, targets = shapes
    _need(len(logits) == len(targets) + 1 and all(dims_equal(a, b) for a, b in zip(logits, targets)), node,
          f"logits {shape_str(logits)} must be targets {shape_str(targets)} + [vocab]")
    return [()]


def _shape_linear(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    x, w = shapes
    _need(len(w) == 2 and len(x) >= 1, node, f"Linear takes X[..., K] and W[N, K], got {shape_str(x)}, "
                                             f"{shape_str(w)}")
    _need(dims_equal(x[-1], w[1]), node, f"contracted dims differ: X {shape_str(x)} vs W {shape_str(w)} (W is "
                                         "[out, in])")
    return [tuple(x[:-1]) + (w[0],)]


def _shape_layernorm(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    x, w, b = shapes
    for name, s in (("weight", w), ("bias", b)):
        _need(len(s) == 1 and dims_equal(s[0], x[-1]), node, f"{name} {shape_str(s)} must match the last dim of "
                                                             f"{shape_str(x)}")
    return [tuple(x)]


def _shape_bias(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    x, b = shapes
    _need(len(b) == 1 and dims_equal(b[0], x[-1]), node, f"bias {shape_str(b)} must match the last dim of "
                                                         f"{shape_str(x)}")
    return [tuple(x)]


def _shape_reshard(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    return [tuple(shapes[0])]


def _shape_leaf(shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    return [tuple(attrs["shape"])]


def _no_rule(keys: tuple[int, ...], shapes: Shapes, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    raise RuleError("leaf and Reshard annotations come from the plan, not from deduction")


def _leading(shapes: Shapes) -> tuple[int, ...]:
    return tuple(range(len(shapes[0]) - 1))


def _all_dims(shapes: Shapes) -> tuple[int, ...]:
    return tuple(range(len(shapes[0])))


def _weight_dtype(dtypes: Sequence[str]) -> str:
    return dtypes[1]


def _int64(dtypes: Sequence[str]) -> str:
    return "int64"


OPS: dict[str, OpDef] = {o.kind: o for o in (
    OpDef("placeholder", _shape_leaf, _no_rule),
    OpDef("parameter", _shape_leaf, _no_rule),
    OpDef(RESHARD, _shape_reshard, _no_rule),
    OpDef("embedding", _shape_embedding, _embedding_rule, custom=True, weight_inputs=(1,), batch_dims=_all_dims,
          dtype=_weight_dtype),
    OpDef("positions", _shape_same, _positions_rule, dtype=_int64),
    OpDef("dot", _shape_dot, _dot_rule, custom=True, weight_inputs=(1,), batch_dims=_leading,
          input_grad=_dot_input_grad),
    OpDef("linear", _shape_linear, _linear_rule, custom=True, weight_inputs=(1,), batch_dims=_leading,
          input_grad=_linear_input_grad),
    OpDef("bias_add", _shape_bias, _bias_rule, weight_inputs=(1,), batch_dims=_leading),
    OpDef("rmsnorm", _shape_rmsnorm, _rmsnorm_rule, weight_inputs=(1,), batch_dims=_leading),
    OpDef("layernorm", _shape_layernorm, _norm_rule, weight_inputs=(1, 2), batch_dims=_leading),
    OpDef("rope", _shape_rope, _rope_rule),
    OpDef("attention", _shape_attention, _attention_rule, mixes=(1,)),
    OpDef("swiglu", _shape_same, _same),
    OpDef("gelu", _shape_same, _same),
    OpDef("add", _shape_same, _linear_same),
    OpDef("mul", _shape_same, _mul_rule),
    OpDef("reshape", _shape_reshape, _reshape_rule, custom=True),
    OpDef("sum", _shape_sum, _sum_rule, custom=True),
    OpDef("split", _shape_split, _split_rule),
    OpDef("concat", _shape_concat, _concat_rule),
    OpDef("cross_entropy", _shape_ce, _ce_rule, custom=True),
)}


def register_op(op: OpDef, *, replace: bool = False) -> OpDef:
    """Add an operator kind to the graph API (its shape and deduction rules); returns it.

    Its torch kernel is registered separately with :func:`hspmd_sdk.runtime.workers.kernels.register_kernel` (the core
    imports no torch).  Replacing an existing kind needs ``replace=True``."""
    if op.kind in OPS and not replace:
        raise SpecializationError(f"op kind {op.kind!r} is already registered; pass replace=True to replace it")
    OPS[op.kind] = op
    return op


def op_def(kind: str, node: str = "") -> OpDef:
    """The :class:`OpDef` of ``kind``; the error lists the known kinds."""
    op = OPS.get(kind)
    if op is None:
        where = f" for node {node!r}" if node else ""
        raise SpecializationError(f"unknown op kind {kind!r}{where}; known: {', '.join(sorted(OPS))} (add one "
                                  "with hspmd_sdk.core.ops.register_op)")
    return op


def infer_shapes(kind: str, in_shapes: Shapes, attrs: Mapping[str, Any], node: str) -> list[tuple[Dim, ...]]:
    """Output shapes of an op (the symbolic shape rule); ``ShapeError`` names the node."""
    return op_def(kind, node).shape(in_shapes, attrs, node)


def infer_dtype(kind: str, in_dtypes: Sequence[str]) -> str:
    """Output dtype of an op: its ``dtype`` rule, else the first input's (``float32`` for leaves)."""
    op = op_def(kind)
    if op.dtype is not None:
        return op.dtype(in_dtypes)
    return in_dtypes[0] if in_dtypes else "float32"


# ---- helpers -----------------------------------------------------------------------------------------------
def _key(k: int) -> str:
    return {PARTIAL: "Partial", DUPLICATE: "Duplicate"}.get(k, f"Split(dim {k})")


def _keys(keys: tuple[int, ...]) -> str:
    return ", ".join(_key(k) for k in keys)


def _norm_dims(dims: Sequence[int], rank: int) -> tuple[int, ...]:
    return tuple(sorted(d % rank for d in dims))


def _dim_add(a: Dim, b: Dim, node: str) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if a == 0:
        return b
    if isinstance(a, Sym) and isinstance(b, Sym) and a.factors == b.factors:
        return Sym(a.coef + b.coef, a.factors)
    raise ShapeError(f"op {node!r}: cannot add dims {a} and {b} symbolically")


def _reshape_map(src: Sequence[Dim], dst: Sequence[Dim]) -> dict[int, int]:
    """Input dim -> output dim for the dims that may stay split: the leading dim of each group of dims whose
    products agree (``[B, S, H] -> [B, S, nh, hd]`` maps 0->0, 1->1, 2->2)."""
    out: dict[int, int] = {}
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        while not dims_equal(pi, pj):
            if divides(pi, pj) and i + len(gi) < len(src):
                gi.append(i + len(gi))
                pi = dim_prod([src[k] for k in gi])
            elif j + len(gj) < len(dst):
                gj.append(j + len(gj))
                pj = dim_prod([dst[k] for k in gj])
            else:
                return out
        out[gi[0]] = gj[0]
        i, j = gi[-1] + 1, gj[-1] + 1
    return out
