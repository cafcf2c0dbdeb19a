"""Context-parallel (CP) causal softmax attention: the sequence split over the ranks of a CP group, exact.

Layout (:class:`CPLayout`).  A sequence of ``S`` tokens is cut into ``2N`` chunks for a group of ``N`` ranks
(sizes as equal as can be; the first ``S mod 2N`` chunks one token longer, so any ``S`` works, e.g. CP3).  Rank
``i`` holds chunks ``i`` and ``2N-1-i``, in that order, back to back: under a causal mask every rank then does the
same attention work (Megatron's and torch's load-balanced CP).  ``balanced=False`` gives the plain layout: ``N``
contiguous chunks, rank ``i`` the ``i``-th (what a DS split of the sequence dim holds).  :func:`split_sequence`
takes a rank's tokens out of a whole ``[B, S, ...]`` tensor, :func:`gather_sequence` puts the ranks' pieces back,
:func:`cp_positions` gives a rank's global positions (restarting at 0 at every document of a packed row, as
:func:`hspmd_sdk.runtime.workers.kernels.document_positions` numbers them), for RoPE and learned position embeddings.

Attention (:func:`cp_attention`).  Each rank keeps its own queries; keys and values reach it in one of two ways:

* ``variant="ring"``: ``N - 1`` steps of one batched send/receive (``batch_isend_irecv``) around the group, each
  posted before the step's compute so that the transfer overlaps it; backward rings the key/value blocks again
  with a gradient accumulator travelling beside them, which comes home to its owner after ``N`` hops;
* ``variant="allgather"``: one ``all_gather_into_tensor`` of every rank's keys and values; backward gathers them
  again and returns the key/value gradients to their owners by one ``reduce_scatter_tensor``.

Every rank computes its queries against each block it holds, block by block, and merges the partial results by
their log-sum-exp (online softmax); blocks that the mask hides wholly are skipped.  Visibility is by global token
index: causal (``key <= query``) and, for a packed row (``documents=``: the lengths of the documents packed back
to back), same-document -- a block of a packed row is cut into one piece per document it holds on both sides,
each wholly visible or causal on its diagonal, so attention costs the documents' own ``sum(length**2)`` and no
piece needs a mask tensor.  On a CPU every piece runs torch's fused attention kernel, which returns the
log-sum-exp too (``_scaled_dot_product_flash_attention_for_cpu`` and its backward: no ``L x L`` scores, the
hidden half of a causal piece skipped); other devices take the matmul path below.  Backward (a
``torch.autograd.Function``) recomputes each piece's probabilities from the saved log-sum-exp (flash-attention's
backward), so it is exact and keeps no ``S x S`` matrix.  GQA: key/value heads travel unrepeated and are repeated per block, as in
:func:`hspmd_sdk.runtime.workers.kernels.attention`; their gradients are summed back over the repeats.

Computation is in fp32 at least (a bf16 input comes back bf16); keys and values travel in their own dtype, key/value
gradients in fp32.  Messages go on the CP group's own communicator (``group``), so they never meet other traffic.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from ..trace import communicating

__all__ = ["CPLayout", "cp_attention", "split_sequence", "gather_sequence", "cp_positions", "balanced_order",
           "order_segments", "VARIANTS"]

VARIANTS = ("ring", "allgather")
#: the flat-buffer collectives (``*_single`` where torch has them; the older names are deprecated there)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
Segment = tuple[int, int]


# ---- layout -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CPLayout:
    """Which global tokens each of the ``cp`` ranks of a group holds, for a sequence of ``seq`` tokens."""

    seq: int
    cp: int
    balanced: bool = True

    def __post_init__(self) -> None:
        if self.cp < 1 or self.seq < 0:
            raise ValueError(f"CPLayout: cp must be >= 1 and seq >= 0, got cp={self.cp}, seq={self.seq}")

    @functools.cached_property
    def _chunks(self) -> tuple[Segment, ...]:
        n = 2 * self.cp if self.balanced else self.cp
        base, extra = divmod(self.seq, n)
        bounds, start = [], 0
        for c in range(n):
            size = base + (1 if c < extra else 0)
            bounds.append((start, start + size))
            start += size
        return tuple(bounds)

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """The ``(start, end)`` ranges of global tokens ``rank`` holds, in the order its local tensor holds them."""
        if not 0 <= rank < self.cp:
            raise ValueError(f"CPLayout: rank {rank} outside a group of {self.cp}")
        c = self._chunks
        return (c[rank], c[2 * self.cp - 1 - rank]) if self.balanced else (c[rank],)

    def local_len(self, rank: int) -> int:
        return sum(e - s for s, e in self.segments(rank))

    @functools.cached_property
    def max_local(self) -> int:
        return max(self.local_len(r) for r in range(self.cp))

    def indices(self, rank: int) -> torch.Tensor:
        """Global indices (int64) of the tokens ``rank`` holds, in local order."""
        return torch.cat([torch.arange(s, e, dtype=torch.int64) for s, e in self.segments(rank)])


@functools.lru_cache(maxsize=256)
def balanced_order(seq: int, cp: int) -> tuple[Segment, ...]:
    """The load-balanced token order of a sequence for ``cp`` ranks: every rank's segments of
    ``CPLayout(seq, cp)``, rank after rank.  A sequence laid out in this order and then cut into ``cp`` equal
    contiguous pieces (a DS split of the sequence dim, ``seq`` a multiple of ``cp``) gives rank ``i`` exactly
    chunks ``i`` and ``2cp-1-i``: how the runtime balances causal work without a collective of its own (the
    executor reorders the data once; every per-position op reads global positions from the order)."""
    if cp > 1 and seq % cp:
        raise ValueError(f"balanced_order: {seq} tokens do not split into {cp} equal pieces")
    layout = CPLayout(seq, cp)
    return tuple(seg for r in range(cp) for seg in layout.segments(r) if seg[1] > seg[0])


def order_segments(order: Sequence[Segment], start: int, end: int) -> tuple[Segment, ...]:
    """The global segments of laid-out tokens ``start .. end`` of a sequence laid out as ``order`` (segments of
    global token indices, back to back)."""
    out, pos = [], 0
    for s, e in order:
        n = e - s
        a, b = max(start - pos, 0), min(end - pos, n)
        if a < b:
            out.append((s + a, s + b))
        pos += n
    if pos < end or start < 0 or end < start:
        raise ValueError(f"order_segments: tokens {start}..{end} of an order of {pos} tokens")
    return tuple(out)


def split_sequence(x: torch.Tensor, layout: CPLayout, rank: int, *, dim: int = 1) -> torch.Tensor:
    """``rank``'s tokens of a whole tensor ``x`` (``layout.seq`` long along ``dim``), in local order."""
    if x.shape[dim] != layout.seq:
        raise ValueError(f"split_sequence: dim {dim} of {tuple(x.shape)} is not the layout's {layout.seq} tokens")
    return torch.cat([x.narrow(dim, s, e - s) for s, e in layout.segments(rank)], dim=dim)


def gather_sequence(parts: Sequence[torch.Tensor], layout: CPLayout, *, dim: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's local piece (``parts[r]`` from rank ``r``): the inverse of
    :func:`split_sequence`."""
    if len(parts) != layout.cp:
        raise ValueError(f"gather_sequence: {len(parts)} pieces for a group of {layout.cp}")
    pieces: list[tuple[int, torch.Tensor]] = []
    for r, part in enumerate(parts):
        if part.shape[dim] != layout.local_len(r):
            raise ValueError(f"gather_sequence: rank {r}'s piece has {part.shape[dim]} tokens along dim {dim}, "
                             f"the layout gives it {layout.local_len(r)}")
        off = 0
        for s, e in layout.segments(r):
            pieces.append((s, part.narrow(dim, off, e - s)))
            off += e - s
    return torch.cat([p for _, p in sorted(pieces, key=lambda sp: sp[0])], dim=dim)


def cp_positions(layout: CPLayout, rank: int, documents: Sequence[int] | None = None) -> torch.Tensor:
    """Global positions (int64, ``[local_len]``) of ``rank``'s tokens; with ``documents`` (one packed row), each
    document counts from 0."""
    idx = layout.indices(rank)
    if documents is None:
        return idx
    return _doc_starts(_check_docs(documents, layout.seq))[1][idx]


def _check_docs(documents: Sequence[int], seq: int) -> tuple[int, ...]:
    docs = tuple(int(d) for d in documents)
    if any(d < 0 for d in docs) or sum(docs) != seq:
        raise ValueError(f"documents {list(docs)} ({sum(docs)} tokens) must be non-negative lengths adding up "
                         f"to the sequence's {seq} tokens")
    return docs


@functools.lru_cache(maxsize=32)
def _doc_starts(documents: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per global token: its document id and its position in that document."""
    lengths = torch.tensor(documents, dtype=torch.int64)
    ids = torch.repeat_interleave(torch.arange(len(documents), dtype=torch.int64), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return ids, torch.arange(int(lengths.sum()), dtype=torch.int64) - starts[ids]


# ---- masks ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Mask:
    """Which keys each query may see, by global token index: causal (``key <= query``) and, for a packed row,
    same-document."""

    causal: bool
    documents: tuple[int, ...] | None

    @functools.cached_property
    def _ends(self) -> list[int]:
        return list(itertools.accumulate(self.documents or ()))

    def pieces(self, qseg: Segment, kseg: Segment) -> list[tuple[Segment, Segment, str | None]]:
        """The visible parts of queries ``qseg`` against keys ``kseg`` (two chunks: equal or disjoint), each
        ``(query range, key range, mask)`` in global indices with the mask ``None`` (every key seen) or ``"causal"``
        (the same tokens on both sides).  A packed row's block splits by document: each piece is one document's
        queries against its own keys, so every piece runs the fused kernel and the work is the documents' own
        (``sum(length**2)``), not the block's."""
        (qs, qe), (ks, ke) = qseg, kseg
        if qe <= qs or ke <= ks or (self.causal and qseg != kseg and ks >= qe):  # empty, or keys after queries
            return []
        m = "causal" if self.causal and qseg == kseg else None
        if self.documents is None:
            return [(qseg, kseg, m)]
        out: list[tuple[Segment, Segment, str | None]] = []
        lo, hi = min(qs, ks), max(qe, ke)
        i = bisect.bisect_right(self._ends, lo)  # the first document ending after lo
        while i < len(self._ends) and self._ends[i] - self.documents[i] < hi:  # type: ignore[index]
            ds, de = self._ends[i] - self.documents[i], self._ends[i]  # type: ignore[index]
            q, k = (max(qs, ds), min(qe, de)), (max(ks, ds), min(ke, de))
            if q[1] > q[0] and k[1] > k[0]:
                out.append((q, k, m))
            i += 1
        return out


#: CPU's fused attention kernel that also returns the log-sum-exp (and its backward): every piece (wholly visible,
#: or causal on its diagonal) runs it on a CPU (no ``L x L`` score matrix, about twice as fast as the matmuls)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _pairs(layout: CPLayout, rank: int, owner: int, mask: _Mask) -> list[tuple[slice, slice, str | None]]:
    """The visible (query rows, key rows, mask) pieces of ``rank``'s queries against ``owner``'s keys, in local
    coordinates of each (:meth:`_Mask.pieces`)."""
    out = []
    qoff = 0
    for qseg in layout.segments(rank):
        koff = 0
        for kseg in layout.segments(owner):
            for (qa, qb), (ka, kb), m in mask.pieces(qseg, kseg):
                out.append((slice(qoff + qa - qseg[0], qoff + qb - qseg[0]),
                            slice(koff + ka - kseg[0], koff + kb - kseg[0]), m))
            koff += kseg[1] - kseg[0]
        qoff += qseg[1] - qseg[0]
    return out


# ---- block math (q, k, v as [B, H, L, D], fp32) -----------------------------------------------------------
def _safe(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (rows that see nothing) replaced by 0, so that ``exp(s - lse)`` stays 0 there."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _fused(q: torch.Tensor) -> bool:
    return _FLASH_CPU is not None and q.device.type == "cpu"


def _scores(q: torch.Tensor, k: torch.Tensor, mask: str | None, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is None:
        return s
    tril = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()  # causal on the diagonal
    return s.masked_fill(~tril, float("-inf"))


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _fused(q):
        o, lse = _FLASH_CPU(q, k, v, 0.0, mask == "causal", scale=scale)
        return o, lse
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - _safe(lse)[..., None]), v), lse


def _merge(o: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Online softmax: fold a block's ``(o_b, lse_b)`` into the running ``(o, lse)`` in place."""
    new = torch.logaddexp(lse, lse_b)
    safe = _safe(new)
    o.mul_(torch.exp(lse - safe)[..., None]).add_(o_b * torch.exp(lse_b - safe)[..., None])
    lse.copy_(new)


def _block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str | None, scale: float,
                    lse: torch.Tensor, do: torch.Tensor, delta: torch.Tensor, o: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block from the final output ``o``, log-sum-exp ``lse`` and ``delta = rowsum(dO * O)``
    (flash-attention's backward of one block given the whole row's softmax statistics)."""
    if _fused(q):
        dq, dk, dv = _FLASH_CPU_BWD(do, q, k, v, o, lse, 0.0, mask == "causal", scale=scale)
        return dq, dk, dv
    p = torch.exp(_scores(q, k, mask, scale) - _safe(lse)[..., None])
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta[..., None])
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def _repeat(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _unrepeat(x: torch.Tensor, rep: int) -> torch.Tensor:
    if rep == 1:
        return x
    b, h, n, d = x.shape
    return x.view(b, h // rep, rep, n, d).sum(2)


# ---- the group --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Group:
    """This rank's place in the CP group and its ring neighbours (global ranks, for point-to-point).  ``ranks``:
    the group's global ranks when it has no process group of its own (messages then go on the default group,
    tagged from ``tag``)."""

    pg: "dist.ProcessGroup | None"
    rank: int
    size: int
    ranks: tuple[int, ...] | None = None
    tag: int = 0

    @staticmethod
    def of(pg: dist.ProcessGroup | None, cp: int, ranks: Sequence[int] | None = None, tag: int = 0) -> "_Group":
        if ranks is not None:
            ranks = tuple(int(r) for r in ranks)
            me = dist.get_rank() if dist.is_initialized() else 0
            if len(ranks) != cp or me not in ranks:
                raise ValueError(f"cp_attention: rank {me} is not one of the CP ranks {list(ranks)} (a layout for "
                                 f"{cp})")
            return _Group(None, ranks.index(me), cp, ranks, tag)
        if cp == 1 and (pg is None or not dist.is_initialized()):
            return _Group(pg, 0, 1)
        size, rank = dist.get_world_size(pg), dist.get_rank(pg)
        if size != cp:
            raise ValueError(f"cp_attention: the layout is for {cp} ranks, the group has {size}")
        return _Group(pg, rank, size, None, tag)

    def peer(self, offset: int) -> int:
        r = (self.rank + offset) % self.size
        if self.ranks is not None:
            return self.ranks[r]
        return r if self.pg is None else dist.get_global_rank(self.pg, r)

    def shift(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> list[dist.Work]:
        """Post ``send`` to the next rank and ``recv`` from the previous one; returns the works to wait on."""
        ops = [dist.P2POp(dist.isend, send, self.peer(1), group=self.pg, tag=self.tag + tag),
               dist.P2POp(dist.irecv, recv, self.peer(-1), group=self.pg, tag=self.tag + tag)]
        return dist.batch_isend_irecv(ops)


def _wait(works: list[dist.Work]) -> None:
    with communicating():  # waiting for the ring, not computing (the executor's compute_s leaves it out)
        for w in works:
            w.wait()


# ---- forward and backward over the blocks -----------------------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    layout: CPLayout
    mask: _Mask
    variant: str
    scale: float
    rep: int


def _pack(k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """``[2, B, Hkv, length, D]``: k and v (``[B, L, Hkv, D]``), heads first, zero-padded to ``length``."""
    b, n, h, d = k.shape
    buf = k.new_zeros(2, b, h, length, d)
    buf[0, :, :, :n] = k.transpose(1, 2)
    buf[1, :, :, :n] = v.transpose(1, 2)
    return buf


def _blocks(kv: torch.Tensor | Sequence[torch.Tensor], plan: _Plan, g: _Group
            ) -> Iterator[tuple[int, torch.Tensor | Sequence[torch.Tensor]]]:
    """Yield ``(owner, k, v)`` blocks (repeated heads, compute dtype), fetching them by the plan's variant; for
    the ring, each step's transfer is posted before its block is handed out."""
    if g.size == 1:
        yield 0, kv
        return
    if plan.variant == "allgather":
        whole = kv.new_empty(g.size * kv.numel())  # flat: every backend takes 1-D buffers
        with communicating():
            _ALL_GATHER(whole, kv.reshape(-1), group=g.pg)
        whole = whole.view((g.size,) + tuple(kv.shape))
        for t in range(g.size):
            yield (g.rank + t) % g.size, whole[(g.rank + t) % g.size]
        return
    cur = kv
    for t in range(g.size):
        nxt, works = None, []
        if t < g.size - 1:
            nxt = torch.empty_like(cur)
            works = g.shift(cur, nxt, tag=0)
        yield (g.rank - t) % g.size, cur
        _wait(works)
        cur = nxt


def _forward(q: torch.Tensor, kv: torch.Tensor, plan: _Plan, g: _Group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of the local queries ``q [B, H, Lq, D]`` (fp32) against every block."""
    o = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    for owner, blk in _blocks(kv, plan, g):
        k, v = (_repeat(blk[i].to(q.dtype), plan.rep) for i in (0, 1))
        for qs, ks, m in _pairs(plan.layout, g.rank, owner, plan.mask):
            o_b, lse_b = _block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], m, plan.scale)
            _merge(o[:, :, qs], lse[:, :, qs], o_b, lse_b)
    return o, lse


def _block_grads(q: torch.Tensor, blk: torch.Tensor, owner: int, dq: torch.Tensor, saved: tuple[torch.Tensor, ...],
                 plan: _Plan, g: _Group) -> torch.Tensor:
    """Add the local queries' gradient of one block to ``dq``; return the block's ``[2, B, Hkv, L, D]`` fp32
    key/value gradient (this rank's contribution)."""
    lse, do, delta, o = saved
    k, v = (_repeat(blk[i].to(q.dtype), plan.rep) for i in (0, 1))
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for qs, ks, m in _pairs(plan.layout, g.rank, owner, plan.mask):
        dq_b, dk_b, dv_b = _block_backward(q[:, :, qs], k[:, :, ks], v[:, :, ks], m, plan.scale, lse[:, :, qs],
                                           do[:, :, qs], delta[:, :, qs], o[:, :, qs])
        dq[:, :, qs] += dq_b
        dk[:, :, ks] += dk_b
        dv[:, :, ks] += dv_b
    return torch.stack([_unrepeat(dk, plan.rep), _unrepeat(dv, plan.rep)])


def _backward_allgather(q: torch.Tensor, kv: torch.Tensor, saved: tuple[torch.Tensor, ...], plan: _Plan,
                        g: _Group) -> tuple[torch.Tensor, torch.Tensor]:
    dq = torch.zeros_like(q)
    dkv = torch.zeros((g.size,) + tuple(kv.shape), dtype=q.dtype, device=q.device)
    for owner, blk in _blocks(kv, plan, g):
        dkv[owner] = _block_grads(q, blk, owner, dq, saved, plan, g)
    if g.size == 1:
        return dq, dkv[0]
    mine = torch.empty_like(dkv[0])
    with communicating():
        _REDUCE_SCATTER(mine.view(-1), dkv.view(-1), group=g.pg)
    return dq, mine


def _backward_ring(q: torch.Tensor, kv: torch.Tensor, saved: tuple[torch.Tensor, ...], plan: _Plan,
                   g: _Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value blocks ring as in forward; each block's gradient accumulator follows one hop behind and, after
    the last rank added to it, goes home to its owner."""
    dq = torch.zeros_like(q)
    incoming, works = None, []
    for t, (owner, blk) in enumerate(_blocks(kv, plan, g)):
        acc = _block_grads(q, blk, owner, dq, saved, plan, g)
        if g.size == 1:
            return dq, acc
        _wait(works)
        if incoming is not None:
            acc += incoming
        incoming = torch.empty_like(acc)
        works = g.shift(acc, incoming, tag=1)
    _wait(works)
    return dq, incoming


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan,
                g: _Group) -> torch.Tensor:  # type: ignore[override]
        cdt = torch.promote_types(q.dtype, torch.float32)
        qt = q.transpose(1, 2).to(cdt)
        kv = _pack(k, v, plan.layout.max_local)
        o, lse = _forward(qt, kv, plan, g)
        ctx.save_for_backward(qt, kv, o, lse)
        ctx.plan, ctx.g, ctx.shapes = plan, g, (q.dtype, k.dtype, k.shape[1])
        return o.transpose(1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        qt, kv, o, lse = ctx.saved_tensors
        qdt, kdt, n = ctx.shapes
        do = grad.transpose(1, 2).to(qt.dtype)
        saved = (lse, do, (do * o).sum(-1), o)
        run = _backward_ring if ctx.plan.variant == "ring" else _backward_allgather
        dq, dkv = run(qt, kv, saved, ctx.plan, ctx.g)
        dk, dv = (dkv[i, :, :, :n].transpose(1, 2).to(kdt) for i in (0, 1))
        return dq.transpose(1, 2).to(qdt), dk, dv, None, None


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout, *,
                 group: dist.ProcessGroup | None = None, variant: str = "ring", causal: bool = True,
                 documents: Sequence[int] | None = None, ranks: Sequence[int] | None = None,
                 tag: int = 0) -> torch.Tensor:
    """Softmax attention of this rank's queries ``q [B, Lq, H, D]`` over the whole sequence, whose keys and
    values ``k, v [B, Lq, Hkv, D]`` are spread over the CP ``group`` (``None``: the world) as ``layout`` says;
    returns this rank's output ``[B, Lq, H, D]``, equal to the matching rows of whole-sequence attention.
    Every rank of the group calls it with the same ``layout``, ``variant``, ``causal`` and ``documents``.

    ``documents``: every row packs documents of these lengths (adding up to ``layout.seq``) back to back, and
    each token attends only within its own document.

    ``ranks``: instead of a ``group``, the CP group's global ranks in layout order; the ring's messages then go on
    the default group with tags ``tag`` and ``tag + 1`` (the all-gather variant needs a ``group``)."""
    if variant not in VARIANTS:
        raise ValueError(f"cp_attention: variant {variant!r}, one of {VARIANTS}")
    if ranks is not None and (group is not None or variant != "ring"):
        raise ValueError("cp_attention: ranks= is for the ring without a process group; pass group= for the "
                         "all-gather variant")
    g = _Group.of(group, layout.cp, ranks, tag)
    want = layout.local_len(g.rank)
    if q.dim() != 4 or q.shape[1] != want or k.shape != v.shape or k.shape[:2] != q.shape[:2] \
            or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"cp_attention on rank {g.rank} of {g.size}: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}; expected [B, {want}, H, D] and k = v = [B, {want}, Hkv, D] with "
                         "H a multiple of Hkv")
    docs = None if documents is None else _check_docs(documents, layout.seq)
    plan = _Plan(layout, _Mask(bool(causal), docs), variant, 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // k.shape[2])
    return _CPAttention.apply(q, k, v, plan, g)
