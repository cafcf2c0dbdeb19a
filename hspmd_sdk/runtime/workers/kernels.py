"""Local torch implementations of the defined graph's compute ops (no ``torch.distributed``): the kernel registry.

``KERNELS`` maps an op kind (:data:`hspmd_sdk.core.ops.OPS`) to a :class:`Kernel`: a function
``fn(*inputs, **attrs)`` working on one device's local tensors, and optionally ``local_attrs(node, ctx)``, the
extra keyword arguments a sharded run needs, computed from where this device's shards sit (``ctx``: a
:class:`KernelContext`).  The executor calls ``fn(*inputs, **node.attr, **local_attrs(node, ctx))``; nothing else
in the runtime knows an op kind.  The built-in local attributes:

* ``reshape(..., shape=...)``: the *local* concrete shape (the node's attr is global and symbolic);
* ``embedding(..., vocab_start=...)``: the first vocabulary row the local weight holds (vocab-parallel
  embedding; rows outside give zeros, so the result is a Partial summand);
* ``rope(..., position_offset=...)`` / ``positions(..., position_offset=...)``: position of the first local token;
* ``cross_entropy(..., total_count=...)``: the step's number of real target tokens; the result is then
  ``sum(local losses) / total_count``, a Partial summand of the global mean (targets ``-100`` are padding).

Packing (mixed-length data, SPEC §7): a micro-batch may be *one row holding several documents* back to back
(:attr:`KernelContext.documents`: their lengths).  A kernel says how it takes that (:attr:`Kernel.packing`):
``"tokenwise"`` (it never mixes positions: a packed row is just more tokens), or ``"documents"`` (it mixes or
numbers positions and is called with ``documents=`` the lengths: ``attention`` attends within each document,
``rope`` and ``positions`` restart at 0 at every document).  :func:`packing_problems` lists a graph's op kinds
with neither, for which a packed row would silently let documents see each other: packing is refused then.

A user adds an op with :func:`hspmd_sdk.core.ops.register_op` (shape and deduction rules) and
:func:`register_kernel` (its torch kernel).  :func:`run_graph` executes a whole defined graph op by op on one
device (every Reshard is the identity there); the tests use it to prove that a model's graph and its reference
module are the same model.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

from ...core.symbolic import symbols_of
from .cp_attention import CPLayout, balanced_order, cp_attention, order_segments

if TYPE_CHECKING:
    from ...core.graph import Graph, Node

__all__ = ["KERNELS", "Kernel", "KernelContext", "register_kernel", "run_graph", "rope_cos_sin", "IGNORE_INDEX",
           "packing_problems", "document_positions"]

#: A target of this value is padding: it adds nothing to the loss and is not counted.
IGNORE_INDEX = -100


class KernelContext(Protocol):
    """Where a device's shards sit, for :attr:`Kernel.local_attrs` (the executor provides one per micro-batch)."""

    loss_normalizer: int | None  #: real target tokens of the whole step (``None``: the local count)
    #: optional: ``N > 1`` when the micro-batch's sequence is laid out in the balanced order of CP degree ``N``
    #: (:func:`~.cp_attention.balanced_order`): positions are then global positions of that order
    sequence_balance: int
    #: lengths of the documents packed back to back in the micro-batch's one row (``None``: a row is a sequence)
    documents: tuple[int, ...] | None

    def box(self, tensor: str) -> tuple[tuple[int, int], ...]:
        """This device's box of ``tensor`` in global coordinates (the batch dim in micro-batch rows)."""
        ...

    def global_shape(self, tensor: str) -> tuple[int, ...]: ...

    def local_shape(self, tensor: str) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class Kernel:
    """An op kind's torch kernel and the local keyword arguments it needs on a sharded device."""

    fn: Callable[..., Any]
    local_attrs: Callable[["Node", KernelContext], dict[str, Any]] | None = None
    #: ``"tokenwise"``, ``"documents"`` (takes ``documents=`` in a packed row) or ``None`` (unknown: no packing)
    packing: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def attrs(self, node: "Node", ctx: KernelContext) -> dict[str, Any]:
        """The node's attrs plus the local ones (the local ones win).  Not the documents of a packed row: see
        :meth:`packed_attrs`."""
        out = dict(node.attr)
        if self.local_attrs is not None:
            out.update(self.local_attrs(node, ctx))
        return out

    def packed_attrs(self, ctx: KernelContext) -> dict[str, Any]:
        """``{"documents": ...}`` for a ``"documents"`` kernel in a packed micro-batch, else ``{}`` (changes with
        every micro-batch: not cached with :meth:`attrs`)."""
        docs = ctx.documents
        return {"documents": docs} if docs is not None and self.packing == "documents" else {}


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
    """RMSNorm, computed in fp32 (a bf16 input comes back bf16)."""
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps) * weight.float()).to(x.dtype)


def rope_cos_sin(seq: int, head_dim: int, theta: float, *, offset: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[seq, head_dim/2]`` for positions ``offset .. offset+seq-1``."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    pos = torch.arange(offset, offset + seq, dtype=torch.float64, device=device)
    ang = torch.outer(pos, inv)
    return ang.cos().to(dtype), ang.sin().to(dtype)


@functools.lru_cache(maxsize=512)
def _rope_tables(seq: int, head_dim: int, theta: float, offset: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos``/``sin`` ``[1, seq, 1, head_dim/2]``, built once per shape (constants: a micro-batch of a length
    seen before, every layer of it, reuses them)."""
    cos, sin = rope_cos_sin(seq, head_dim, theta, offset=offset, dtype=torch.float32, device=device)
    return cos[None, :, None, :], sin[None, :, None, :]


@functools.lru_cache(maxsize=64)
def document_positions(documents: tuple[int, ...], offset: int, seq: int) -> torch.Tensor:
    """Positions ``[seq]`` (int64) of tokens ``offset .. offset+seq-1`` of a row packing ``documents`` (their
    lengths, in order): each document counts from 0."""
    if offset < 0 or offset + seq > sum(documents):
        raise ValueError(f"tokens {offset}..{offset + seq} of a packed row of {sum(documents)} tokens "
                         f"(documents {list(documents)})")
    pos = torch.cat([torch.arange(int(d), dtype=torch.int64) for d in documents])
    return pos[offset:offset + seq]


@functools.lru_cache(maxsize=16)
def _packed_rope_tables(documents: tuple[int, ...], offset: int, seq: int, head_dim: int, theta: float,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_rope_tables` at the positions of a packed row (once per micro-batch: its layers reuse them)."""
    pos = document_positions(documents, offset, seq).to(device)
    cos, sin = _rope_tables(max(documents), head_dim, theta, 0, device)
    return cos[:, pos], sin[:, pos]


@functools.lru_cache(maxsize=64)
def segment_positions(segments: tuple[tuple[int, int], ...], documents: tuple[int, ...] | None) -> torch.Tensor:
    """Positions (int64) of the global tokens ``segments`` (``(start, end)`` ranges, in local order): the indices
    themselves, or with ``documents`` (one packed row) each document counting from 0."""
    idx = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in segments]) if segments else \
        torch.zeros(0, dtype=torch.int64)
    if documents is None:
        return idx
    return document_positions(tuple(documents), 0, int(sum(documents)))[idx]


@functools.lru_cache(maxsize=16)
def _segment_rope_tables(segments: tuple[tuple[int, int], ...], documents: tuple[int, ...] | None, head_dim: int,
                         theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_rope_tables` at the positions of the global tokens ``segments`` (a context-parallel rank's tokens
    in the balanced order)."""
    pos = segment_positions(segments, documents).to(device)
    cos, sin = _rope_tables(int(pos.max()) + 1 if pos.numel() else 1, head_dim, theta, 0, device)
    return cos[:, pos], sin[:, pos]


def rope(x: torch.Tensor, *, theta: float = 10000.0, position_offset: int = 0,
         documents: tuple[int, ...] | None = None,
         segments: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
    """Half-split rotary embedding of ``x[B, S, heads, head_dim]``: pairs ``(i, i + head_dim/2)``; computed in
    fp32 (a bf16 input comes back bf16).  ``documents``: one packed row; positions restart at each document.
    ``segments``: the global tokens ``x`` holds, in its order (instead of ``position_offset``: a sequence laid
    out in the balanced context-parallel order, :func:`~.cp_attention.balanced_order`)."""
    _, s, _, hd = x.shape
    if segments is not None:
        cos, sin = _segment_rope_tables(tuple(segments), None if documents is None else tuple(documents), int(hd),
                                        float(theta), x.device)
    elif documents is None:
        cos, sin = _rope_tables(int(s), int(hd), float(theta), int(position_offset), x.device)
    else:
        cos, sin = _packed_rope_tables(tuple(documents), int(position_offset), int(s), int(hd), float(theta),
                                       x.device)
    xf = x.float()
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              documents: tuple[int, ...] | None = None, cp_ranks: tuple[int, ...] | None = None,
              cp_seq: int | None = None, cp_balanced: bool = False) -> torch.Tensor:
    """Causal softmax attention on ``[B, S, heads, head_dim]``; kv heads are repeated for GQA.  Runs
    ``scaled_dot_product_attention`` (flash / memory-efficient kernels where the device has them).

    ``documents``: ``q`` is one row packing documents of these lengths back to back; each attends only within
    itself (variable-length attention: one call per document on views of the row, so the work is
    ``sum(length**2)``, not ``S**2``).

    ``cp_ranks``: the sequence (``cp_seq`` tokens) is split in equal contiguous chunks over these ranks (context
    parallelism, a DS split of dim 1), this rank holding its own; keys and values ring between them
    (:func:`hspmd_sdk.runtime.workers.cp_attention.cp_attention`), the result equal to whole-sequence attention.
    ``cp_balanced``: the sequence is laid out in the balanced order (:func:`~.cp_attention.balanced_order`), so
    that the ``i``-th chunk holds global chunks ``i`` and ``2N-1-i`` and every rank does the same causal work."""
    if cp_ranks is not None and len(cp_ranks) > 1:
        layout = CPLayout(int(cp_seq), len(cp_ranks), balanced=bool(cp_balanced))  # type: ignore[arg-type]
        return cp_attention(q, k, v, layout, ranks=cp_ranks, causal=causal, documents=documents, tag=CP_TAG)
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1])
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if documents is None:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale).transpose(1, 2)
    if q.shape[0] != 1 or sum(documents) != q.shape[1]:
        raise ValueError(f"a packed row of documents {list(documents)} ({sum(documents)} tokens) needs q of one "
                         f"row and as many positions, got {tuple(q.shape)} (is the sequence split across devices?)")
    sizes = [int(d) for d in documents]
    outs = [F.scaled_dot_product_attention(a, b, c, is_causal=causal, scale=scale)
            for a, b, c in zip(qt.split(sizes, 2), kt.split(sizes, 2), vt.split(sizes, 2))]
    return (torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]).transpose(1, 2)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def positions(x: torch.Tensor, *, position_offset: int = 0, documents: tuple[int, ...] | None = None,
              segments: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
    """``[B, S]`` int64 positions ``offset .. offset+S-1`` of every row (``documents``: of one packed row,
    restarting at 0 at each document; ``segments``: of the global tokens the row holds, in its order, as in
    :func:`rope`)."""
    b, s = x.shape[0], x.shape[1]
    if segments is not None:  # copies: the cached positions are shared by every layer and micro-batch
        pos = segment_positions(tuple(segments), None if documents is None else tuple(documents)).to(
            x.device, copy=True)
        if pos.shape[0] != s:
            raise ValueError(f"positions: {s} tokens, but the segments {list(segments)} hold {pos.shape[0]}")
    elif documents is not None:
        pos = document_positions(tuple(documents), int(position_offset), int(s)).to(x.device, copy=True)
    else:
        pos = torch.arange(position_offset, position_offset + s, dtype=torch.int64, device=x.device)
    return pos.unsqueeze(0).expand(b, s)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def bias_add(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x + b


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, eps: float = 1e-5) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


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
    """``sum`` of the token losses over ``total_count`` (default: the local real targets); padding targets
    (:data:`IGNORE_INDEX`) add nothing.  Computed and returned in at least fp32 (the loss of a bf16 run is fp32,
    as in mixed-precision training; its gradient flows back to the logits in their dtype)."""
    flat = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
    tg = targets.reshape(-1)
    losses = F.cross_entropy(flat, tg, reduction="sum", ignore_index=IGNORE_INDEX)
    count = int((tg != IGNORE_INDEX).sum()) if total_count is None else total_count
    return losses / max(count, 1)


# ---- local attributes of the built-in ops -------------------------------------------------------------------
def _reshape_attrs(node: "Node", ctx: KernelContext) -> dict[str, Any]:
    return {"shape": ctx.local_shape(node.outputs[0])}


def _vocab_start(node: "Node", ctx: KernelContext) -> dict[str, Any]:
    w = node.inputs[1]
    rows = ctx.box(w)[0]
    return {} if rows == (0, ctx.global_shape(w)[0]) else {"vocab_start": rows[0]}


def _position_offset(node: "Node", ctx: KernelContext) -> dict[str, Any]:
    start, end = ctx.box(node.inputs[0])[1]
    balance = getattr(ctx, "sequence_balance", 1)
    if balance > 1:  # the sequence is laid out in the balanced CP order: the global tokens of this box

        return {"segments": order_segments(balanced_order(ctx.global_shape(node.inputs[0])[1], balance),
                                           start, end)}
    return {"position_offset": start} if start else {}


#: the message tags of context-parallel attention's ring (on the default group): past the executor's pipeline,
#: ``PRE`` and ``POST`` tags, so a receive posted ahead never matches one of its messages
CP_TAG = 3 << 23


def _sequence_group(node: "Node", ctx: KernelContext) -> dict[str, Any]:
    """Context parallelism: where ``q``'s sequence dim is split across devices, the ranks holding the other
    chunks (in sequence order) and the whole length."""
    q = node.inputs[0]
    seq = ctx.global_shape(q)[1]
    balance = getattr(ctx, "sequence_balance", 1)
    if ctx.box(q)[1] == (0, seq):
        if balance > 1:
            raise ValueError(f"attention {node.name!r}: the sequence is laid out in the balanced order of CP "
                             f"degree {balance} but {q!r} is not split along it")
        return {}
    peers = getattr(ctx, "sequence_peers", None)
    if peers is None:
        raise ValueError(f"attention {node.name!r}: the sequence of {q!r} is split across devices but the kernel "
                         "context names no peers (sequence_peers)")
    ranks = tuple(peers(q, 1))
    if balance > 1 and len(ranks) != balance:
        raise ValueError(f"attention {node.name!r}: {q!r} is split over {len(ranks)} ranks {list(ranks)} but the "
                         f"sequence is laid out in the balanced order of CP degree {balance}")
    return {"cp_ranks": ranks, "cp_seq": int(seq), **({"cp_balanced": True} if balance > 1 else {})}


def _loss_normalizer(node: "Node", ctx: KernelContext) -> dict[str, Any]:
    return {} if ctx.loss_normalizer is None else {"total_count": int(ctx.loss_normalizer)}


_T, _D = "tokenwise", "documents"
KERNELS: dict[str, Kernel] = {
    "embedding": Kernel(embedding, _vocab_start, _T), "positions": Kernel(positions, _position_offset, _D),
    "dot": Kernel(dot, None, _T), "linear": Kernel(linear, None, _T), "bias_add": Kernel(bias_add, None, _T),
    "rmsnorm": Kernel(rmsnorm, None, _T), "layernorm": Kernel(layernorm, None, _T),
    "rope": Kernel(rope, _position_offset, _D), "attention": Kernel(attention, _sequence_group, _D),
    "swiglu": Kernel(swiglu, None, _T), "gelu": Kernel(gelu, None, _T), "add": Kernel(add, None, _T),
    "mul": Kernel(mul, None, _T), "reshape": Kernel(reshape, _reshape_attrs, _T), "sum": Kernel(sum_, None, _T),
    "split": Kernel(split, None, _T), "concat": Kernel(concat, None, _T),
    "cross_entropy": Kernel(cross_entropy, _loss_normalizer, _T),
}
PACKING_KINDS = (_T, _D)
#: the built-in kernels: the only ones known to read positions from :attr:`KernelContext.sequence_balance`
_BUILTIN = dict(KERNELS)


def register_kernel(kind: str, fn: Callable[..., Any], *,
                    local_attrs: Callable[["Node", KernelContext], dict[str, Any]] | None = None,
                    packing: str | None = None, replace: bool = False) -> Kernel:
    """Register the torch kernel of op ``kind`` (whose rules :func:`hspmd_sdk.core.ops.register_op` added).

    ``local_attrs(node, ctx)`` returns the keyword arguments that depend on where this device's shards sit (see
    :class:`KernelContext`).  ``packing``: ``"tokenwise"`` if the op never mixes positions, ``"documents"`` if
    ``fn`` takes ``documents=`` (the lengths of the documents packed in one row) and keeps them apart; ``None``
    (default) keeps models using the op off packed micro-batches.  The worker processes must register it too: do
    it at import time of a module the workers import (e.g. the module that defines the model config)."""
    if kind in KERNELS and not replace:
        raise ValueError(f"a kernel for op kind {kind!r} is already registered; pass replace=True to replace it")
    if packing is not None and packing not in PACKING_KINDS:
        raise ValueError(f"packing={packing!r} for op kind {kind!r}: one of {PACKING_KINDS} or None")
    KERNELS[kind] = Kernel(fn, local_attrs, packing)
    return KERNELS[kind]


#: tokenwise ops that still mix positions when they work along the sequence dim: their attribute naming the dim(s)
_ALONG = {"split": "dim", "concat": "dim", "sum": "dims"}


def packing_problems(graph: "Graph") -> list[str]:
    """Why micro-batches packing several documents in a row cannot run ``graph`` (empty: they can): every op kind
    whose kernel does not say how it takes them (:attr:`Kernel.packing`), and every ``split`` / ``concat`` /
    ``sum`` along the sequence dim ``S`` (those would mix the documents of a row)."""

    out = []
    for kind in sorted({n.kind for n in graph.nodes if n.kind not in ("placeholder", "parameter", "Reshard")}):
        k = KERNELS.get(kind)
        if k is None or k.packing is None:
            out.append(f"op kind {kind!r} has no packing rule (register_kernel(..., packing='tokenwise' or "
                       "'documents'))")
    for n in graph.nodes:
        if n.kind in _ALONG and n.inputs:
            dims = n.attr.get(_ALONG[n.kind])
            dims = [] if dims is None else [dims] if isinstance(dims, int) else list(dims)
            shape = graph.tensors[n.inputs[0]].shape
            if any("S" in symbols_of(shape[d]) for d in dims if -len(shape) <= d < len(shape)):
                out.append(f"node {n.name!r} ({n.kind}) works along the sequence dim of {n.inputs[0]!r}")
    return out


def reorder_problems(graph: "Graph") -> list[str]:
    """Why ``graph`` cannot run on a sequence laid out in the balanced context-parallel order (empty: it can):
    what stops packed rows (:func:`packing_problems`: an op could mix positions), and every op kind of
    ``"documents"`` packing that is not a built-in kernel (it may take positions from its box, not from
    :attr:`KernelContext.sequence_balance`)."""
    out = packing_problems(graph)
    for kind in sorted({n.kind for n in graph.nodes}):
        k = KERNELS.get(kind)
        if k is not None and k.packing == _D and k is not _BUILTIN.get(kind):
            out.append(f"op kind {kind!r} is not a built-in position-aware kernel")
    return out


def kernel_for(kind: str, node: str = "") -> Kernel:
    """The registered kernel of ``kind``; the error says how to register one."""
    k = KERNELS.get(kind)
    if k is None:
        where = f" (node {node!r})" if node else ""
        raise KeyError(f"no torch kernel for op kind {kind!r}{where}; register one with "
                       "hspmd_sdk.runtime.workers.kernels.register_kernel")
    return k


@dataclass
class _WholeContext:
    """A single device holding every tensor whole (what :func:`run_graph` runs on)."""

    shapes: Mapping[str, tuple[int, ...]]
    loss_normalizer: int | None = None
    documents: tuple[int, ...] | None = None

    def box(self, tensor: str) -> tuple[tuple[int, int], ...]:
        return tuple((0, int(d)) for d in self.shapes[tensor])

    def global_shape(self, tensor: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self.shapes[tensor])

    def local_shape(self, tensor: str) -> tuple[int, ...]:
        return self.global_shape(tensor)


def run_graph(graph: "Graph", feeds: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], *,
              documents: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """Execute ``graph`` (a :class:`hspmd_sdk.core.graph.Graph`) on one device; returns every tensor by name.

    ``feeds`` gives the placeholders, ``params`` the parameters (full tensors); Reshards are identities.
    ``documents``: the feeds are one row packing documents of these lengths (see the module docstring).
    """
    bindings = graph.infer_bindings({k: tuple(v.shape) for k, v in feeds.items()})
    if documents is not None and packing_problems(graph):
        raise ValueError(f"graph {graph.name!r} cannot run packed rows: {'; '.join(packing_problems(graph))}")
    ctx = _WholeContext(graph.bind(bindings), documents=None if documents is None else tuple(int(d) for d in documents))
    values: dict[str, torch.Tensor] = {}
    for node in graph.nodes:
        if node.kind == "placeholder":
            values[node.outputs[0]] = feeds[node.outputs[0]]
        elif node.kind == "parameter":
            values[node.outputs[0]] = params[node.outputs[0]]
        elif node.kind == "Reshard":
            values[node.outputs[0]] = values[node.inputs[0]]
        else:
            kernel = kernel_for(node.kind, node.name)
            out = kernel(*(values[t] for t in node.inputs), **kernel.attrs(node, ctx), **kernel.packed_attrs(ctx))
            outs = out if isinstance(out, tuple) else (out,)
            for name, v in zip(node.outputs, outs):
                values[name] = v
    return values
