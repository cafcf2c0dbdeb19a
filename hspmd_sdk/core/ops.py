"""Compute operators of the defined graph: the builder API (one function per op kind, appending a node to the
graph of its input tensors).

Each kind's shape rule and deduction rule are in the registry, :mod:`hspmd_sdk.core.op_registry`
(:data:`OPS`, :class:`OpDef`, :func:`register_op`; importable from here too).  The local torch implementation of
each op lives in :mod:`hspmd_sdk.runtime.workers.kernels` (this module imports no torch).
"""
from __future__ import annotations

from typing import Any, Sequence

from .annotation import DUPLICATE, PARTIAL
from .graph import Tensor, _dims
from .op_registry import OPS, OpDef, RuleError, infer_dtype, infer_shapes, op_def, register_op
from .symbolic import Dim

__all__ = ["OpDef", "OPS", "RuleError", "register_op", "op_def", "infer_shapes", "infer_dtype", "PARTIAL",
           "DUPLICATE", "embedding", "positions", "dot", "linear", "bias_add", "rmsnorm", "layernorm", "rope",
           "attention", "swiglu", "gelu", "add", "mul", "reshape", "split", "concat", "sum", "cross_entropy"]


# ---- builder API -------------------------------------------------------------------------------------------
def _b(x: Tensor) -> Any:
    return x.builder


def embedding(tokens: Tensor, weight: Tensor, *, name: str | None = None) -> Tensor:
    """``weight[tokens]``: tokens ``[...]`` (int64), weight ``[vocab, hidden]``."""
    return _b(tokens).add("embedding", [tokens, weight], {}, name=name)[0]


def positions(x: Tensor, *, name: str | None = None) -> Tensor:
    """Position of each element along dim 1 (``x[B, S]`` -> int64 ``[B, S]`` holding ``0..S-1``), for learned
    position embeddings: ``embedding(positions(tokens), wpe)``."""
    return _b(x).add("positions", [x], {}, name=name)[0]


def dot(x: Tensor, w: Tensor, *, name: str | None = None) -> Tensor:
    """``x @ w`` with ``x[..., K]`` and ``w[K, N]`` (the paper's Dot; weights are stored ``[in, out]``)."""
    return _b(x).add("dot", [x, w], {}, name=name)[0]


def linear(x: Tensor, w: Tensor, *, name: str | None = None) -> Tensor:
    """``x @ w.T`` with ``x[..., K]`` and ``w[N, K]`` (torch's ``F.linear`` layout; e.g. an LM head tied to an
    embedding ``[vocab, hidden]``)."""
    return _b(x).add("linear", [x, w], {}, name=name)[0]


def bias_add(x: Tensor, b: Tensor, *, name: str | None = None) -> Tensor:
    """``x + b`` with ``x[..., N]`` and a bias ``b[N]``."""
    return _b(x).add("bias_add", [x, b], {}, name=name)[0]


def layernorm(x: Tensor, weight: Tensor, bias: Tensor, *, eps: float = 1e-5, name: str | None = None) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim."""
    return _b(x).add("layernorm", [x, weight, bias], {"eps": float(eps)}, name=name)[0]


def rmsnorm(x: Tensor, weight: Tensor, *, eps: float = 1e-5, name: str | None = None) -> Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight``."""
    return _b(x).add("rmsnorm", [x, weight], {"eps": float(eps)}, name=name)[0]


def rope(x: Tensor, *, theta: float = 10000.0, name: str | None = None) -> Tensor:
    """Rotary position embedding of ``x[B, S, heads, head_dim]`` (half-split rotation, positions 0..S-1)."""
    return _b(x).add("rope", [x], {"theta": float(theta)}, name=name)[0]


def attention(q: Tensor, k: Tensor, v: Tensor, *, name: str | None = None) -> Tensor:
    """Causal softmax attention, ``[B, S, heads, head_dim]``; ``k``/``v`` may have fewer heads (GQA)."""
    return _b(q).add("attention", [q, k, v], {"causal": True}, name=name)[0]


def swiglu(gate: Tensor, up: Tensor, *, name: str | None = None) -> Tensor:
    """``silu(gate) * up``."""
    return _b(gate).add("swiglu", [gate, up], {}, name=name)[0]


def gelu(x: Tensor, *, approximate: str = "none", name: str | None = None) -> Tensor:
    """GELU; ``approximate="tanh"`` is GPT-2's ``gelu_new``."""
    attrs = {"approximate": approximate} if approximate != "none" else {}
    return _b(x).add("gelu", [x], attrs, name=name)[0]


def add(a: Tensor, b: Tensor, *, name: str | None = None) -> Tensor:
    """Elementwise sum (the residual add)."""
    return _b(a).add("add", [a, b], {}, name=name)[0]


def mul(a: Tensor, b: Tensor, *, name: str | None = None) -> Tensor:
    return _b(a).add("mul", [a, b], {}, name=name)[0]


def reshape(x: Tensor, shape: Sequence[Dim], *, name: str | None = None) -> Tensor:
    """Reshape to ``shape`` (global, symbolic).  A split dim stays split only as the leading dim of its group."""
    return _b(x).add("reshape", [x], {"shape": _dims(shape)}, name=name)[0]


def sum(x: Tensor, dims: Sequence[int] | int, *, keepdim: bool = False, name: str | None = None) -> Tensor:  # noqa: A001
    """Sum over ``dims``; a split of a summed dim becomes Partial."""
    d = (dims,) if isinstance(dims, int) else tuple(dims)
    return _b(x).add("sum", [x], {"dims": d, "keepdim": bool(keepdim)}, name=name)[0]


def split(x: Tensor, dim: int, parts: int, *, name: str | None = None) -> list[Tensor]:
    """``parts`` equal chunks along ``dim`` (a symbolic dim gets the constraint ``dim ≡ 0 (mod parts)``)."""
    d = dim % len(x.shape)
    return _b(x).add("split", [x], {"dim": d, "parts": int(parts)}, name=name, num_outputs=parts)


def concat(xs: Sequence[Tensor], dim: int, *, name: str | None = None) -> Tensor:
    d = dim % len(xs[0].shape)
    return _b(xs[0]).add("concat", list(xs), {"dim": d}, name=name)[0]


def cross_entropy(logits: Tensor, targets: Tensor, *, name: str | None = None) -> Tensor:
    """Mean cross-entropy over all tokens: ``logits[..., V]``, ``targets[...]`` (int64) -> scalar."""
    return _b(logits).add("cross_entropy", [logits, targets], {}, name=name)[0]
