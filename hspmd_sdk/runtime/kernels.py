"""Local torch implementations of the defined graph's compute ops (no ``torch.distributed``).

``KERNELS`` maps an op kind (:data:`hspmd_sdk.core.ops.OPS`) to a function ``kernel(*inputs, **attrs)`` working on
one device's local tensors.  The runtime calls them with the node's attrs, except for ``reshape``, whose
``shape`` attr is global and symbolic: pass the *local* concrete shape instead.  Extra keyword arguments that
only a sharded run needs:

* ``embedding(..., vocab_start=...)``: the first vocabulary row the local weight holds (vocab-parallel
  embedding; rows outside give zeros, so the result is a Partial summand);
* ``rope(..., position_offset=...)``: position of the first local token;
* ``cross_entropy(..., total_count=...)``: the global number of tokens; the result is then
  ``sum(local losses) / total_count``, a Partial summand of the global mean.

:func:`run_graph` executes a whole defined graph op by op on one device (every Reshard is the identity there);
the tests use it to prove that the Llama graph and the reference module are the same model.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

__all__ = ["KERNELS", "run_graph", "rope_cos_sin"]


def embedding(tokens: torch.Tensor, weight: torch.Tensor, *, vocab_start: int | None = None) -> torch.Tensor:
    """``weight[tokens]``; with ``vocab_start`` the weight holds rows ``vocab_start ..`` only and other tokens
    give zero rows (a Partial summand of the vocab-parallel embedding)."""
    if vocab_start is None:
        return F.embedding(tokens, weight)
    local = tokens - vocab_start
    inside = (local >= 0) & (local < weight.shape[0])
    out = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return out * inside.unsqueeze(-1).to(out.dtype)


def dot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-5) -> torch.Tensor:
    var = x.pow(2).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * weight


def rope_cos_sin(seq: int, head_dim: int, theta: float, *, offset: int = 0, dtype: torch.dtype = torch.float32,
                 device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[seq, head_dim/2]`` for positions ``offset .. offset+seq-1``."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    pos = torch.arange(offset, offset + seq, dtype=torch.float64, device=device)
    ang = torch.outer(pos, inv)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope(x: torch.Tensor, *, theta: float = 10000.0, position_offset: int = 0) -> torch.Tensor:
    """Half-split rotary embedding of ``x[B, S, heads, head_dim]``: pairs ``(i, i + head_dim/2)``."""
    _, s, _, hd = x.shape
    cos, sin = rope_cos_sin(s, hd, theta, offset=position_offset, dtype=x.dtype, device=x.device)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """Causal softmax attention on ``[B, S, heads, head_dim]``; kv heads are repeated for GQA."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qt, kt.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = q.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vt)
    return out.transpose(1, 2)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


def reshape(x: torch.Tensor, *, shape: tuple[int, ...]) -> torch.Tensor:
    return x.reshape(tuple(int(d) for d in shape))


def sum_(x: torch.Tensor, *, dims: tuple[int, ...], keepdim: bool = False) -> torch.Tensor:
    return x.sum(dim=tuple(dims), keepdim=keepdim)


def split(x: torch.Tensor, *, dim: int, parts: int) -> tuple[torch.Tensor, ...]:
    if x.shape[dim] % parts:
        raise ValueError(f"split: dim {dim} of size {x.shape[dim]} is not divisible by {parts}")
    return tuple(torch.chunk(x, parts, dim=dim))


def concat(*xs: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat(xs, dim=dim)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, total_count: int | None = None) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1]).float()
    losses = F.cross_entropy(flat, targets.reshape(-1), reduction="sum")
    count = targets.numel() if total_count is None else total_count
    return (losses / count).to(logits.dtype)


KERNELS: dict[str, Callable[..., Any]] = {
    "embedding": embedding, "dot": dot, "rmsnorm": rmsnorm, "rope": rope, "attention": attention,
    "swiglu": swiglu, "gelu": gelu, "add": add, "mul": mul, "reshape": reshape, "sum": sum_, "split": split,
    "concat": concat, "cross_entropy": cross_entropy,
}


def run_graph(graph: Any, feeds: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
    """Execute ``graph`` (a :class:`hspmd_sdk.core.graph.Graph`) on one device; returns every tensor by name.

    ``feeds`` gives the placeholders, ``params`` the parameters (full tensors); Reshards are identities.
    """
    from hspmd_sdk.core.symbolic import evaluate_shape

    bindings = graph.infer_bindings({k: tuple(v.shape) for k, v in feeds.items()})
    values: dict[str, torch.Tensor] = {}
    for node in graph.nodes:
        if node.kind == "placeholder":
            values[node.outputs[0]] = feeds[node.outputs[0]]
        elif node.kind == "parameter":
            values[node.outputs[0]] = params[node.outputs[0]]
        elif node.kind == "Reshard":
            values[node.outputs[0]] = values[node.inputs[0]]
        else:
            attrs = node.attr
            if node.kind == "reshape":
                attrs["shape"] = evaluate_shape(attrs["shape"], bindings, tensor=node.name)
            out = KERNELS[node.kind](*(values[t] for t in node.inputs), **attrs)
            outs = out if isinstance(out, tuple) else (out,)
            for name, v in zip(node.outputs, outs):
                values[name] = v
    return values
