"""The planner's ZeRO shares: each pipeline's share of every ZeRO-sharded tensor (``Pipeline.zero_share``) in
proportion to the memory its devices have free for it.

**The rule.**  A device's estimate (:func:`hspmd_sdk.core.memory.device_memory`) is a part that ZeRO does not
shard, ``U`` (bf16 weights below ZeRO-3, its gathered units at ZeRO-3; gradients below ZeRO-2; activations; the
runtime), and the part it does, which is the device's share of the sharded state its stage would hold alone, ``F``
(fp32 master weights and Adam moments; from ZeRO-2 the gradients too; at ZeRO-3 the bf16 weights too).  With
shares ``s``, a device of pipeline ``p`` holds ``U + F * s_p / sum(s)`` (every pipeline holds every layer once),
which fits its memory ``C`` while ``s_p / sum(s) <= (C - U) / F``.  So pipeline ``p`` can take at most the
fraction ``f_p = min over its devices of (C - U) / F`` of the sharded state, a plan fits with some shares exactly
when ``sum(f) >= 1``, and the shares ``s_p`` in proportion to ``f_p`` fill every pipeline's fullest device to the
same fraction ``1 / sum(f)`` of its free memory (the best one can do for the worst device).
Where pipelines' devices have the same memory and the same stages, ``f`` is the same for all: even shares.

Why free memory and not simply the devices' memory: a 24 GB card beside an 80 GB one holds the same bf16 weights
and activations; shares by raw memory (24 : 80) would leave it less room for its share than it has, shares by what
is left after the unsharded part give it exactly what it can hold.

The shares are rounded to three significant digits (the largest is 1) and kept only where they lower the fullest
device's fraction of its memory by at least :data:`MIN_GAIN` (or make a plan fit that did not): otherwise the
strategy keeps even shares (``zero_share`` left out, its JSON unchanged).  Shares are not set beside uneven TP
``ratios`` (the strategy refuses the two together).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..core.memory import device_memory

if TYPE_CHECKING:  # pragma: no cover
    from ..core.cluster import Cluster
    from ..core.memory import DeviceMemory
    from ..core.model_spec import ModelSpec
    from ..core.strategy import Strategy
    from .cost import CostModel

__all__ = ["memory_shares", "with_memory_shares", "peak_fraction", "shares_note", "MIN_GAIN"]

#: The smallest drop of the fullest device's fraction of its memory (0.01: one percent of its memory) for which
#: the planner gives a fitting plan uneven shares.
MIN_GAIN = 0.01


def _sharded(strategy: "Strategy", m: "DeviceMemory") -> float:
    """The bytes of a device's estimate that ZeRO shards at ``strategy``'s level: at ZeRO-3 its shard of the bf16
    weights too, which is its shard of the bf16 gradients (the same parameters, the same bytes: the estimate's
    ``params`` also holds the gathered units, which no share divides)."""
    return m.optimizer + (m.grads if strategy.zero >= 2 else 0.0) + (m.grads if strategy.zero >= 3 else 0.0)


def memory_shares(strategy: "Strategy", model: "ModelSpec", cluster: "Cluster", *, seq_len: int,
                  cost: "CostModel") -> list[float] | None:
    """The pipelines' ZeRO shares by free memory (the module's rule), largest 1, three significant digits; ``None``
    where the rule gives even shares, where the strategy cannot take shares (no ZeRO, one pipeline, uneven TP
    ratios) or where some pipeline has no memory left for any share."""
    pipes = strategy.pipelines
    if strategy.zero < 1 or len(pipes) < 2 or any(st.is_uneven for p in pipes for st in p.stages):
        return None
    even = strategy if strategy.zero_shares() is None else _shared(strategy, None)
    mem = device_memory(even, model, cluster, seq_len=seq_len, **cost.memory_options())
    room = []
    for p in pipes:
        f = math.inf
        for r in p.ranks:
            sharded = _sharded(strategy, mem[r])
            if sharded > 0:  # its stage's whole sharded state: even shares divide it over the pipelines
                f = min(f, (cluster.spec(r).memory_bytes - (mem[r].total - sharded)) / (sharded * len(pipes)))
        room.append(f)
    if not all(0 < f < math.inf for f in room):
        return None
    top = max(room)
    shares = [float(f"{f / top:.3g}") for f in room]
    return None if len(set(shares)) == 1 else shares


def peak_fraction(strategy: "Strategy", model: "ModelSpec", cluster: "Cluster", *, seq_len: int,
                  cost: "CostModel") -> tuple[float, int]:
    """The largest fraction of its memory that a device's estimate takes, and that device's rank."""
    mem = device_memory(strategy, model, cluster, seq_len=seq_len, **cost.memory_options())
    return max((m.total / cluster.spec(r).memory_bytes, r) for r, m in mem.items())


def with_memory_shares(strategy: "Strategy", model: "ModelSpec", cluster: "Cluster", *, seq_len: int,
                       cost: "CostModel") -> "Strategy":
    """``strategy`` with the shares of :func:`memory_shares` where they lower the fullest device's fraction of its
    memory by :data:`MIN_GAIN` or more, or make it fit; else ``strategy`` itself."""
    shares = memory_shares(strategy, model, cluster, seq_len=seq_len, cost=cost)
    if shares is None:
        return strategy
    trial = _shared(strategy, shares)
    before = peak_fraction(strategy, model, cluster, seq_len=seq_len, cost=cost)[0]
    after = peak_fraction(trial, model, cluster, seq_len=seq_len, cost=cost)[0]
    return trial if after <= before - MIN_GAIN or after <= 1.0 < before else strategy


def shares_note(strategy: "Strategy", model: "ModelSpec", cluster: "Cluster", *, seq_len: int,
                cost: "CostModel") -> str | None:
    """What a strategy's uneven ZeRO shares are and what they change, for its name: ``ZeRO shares 1:0.23 by free
    memory: the fullest device (rank 1) at 97% of its memory, 131% (rank 1) with even shares``; ``None`` without
    shares."""
    shares = strategy.zero_shares()
    if shares is None:
        return None
    now, r = peak_fraction(strategy, model, cluster, seq_len=seq_len, cost=cost)
    was, q = peak_fraction(_shared(strategy, None), model, cluster, seq_len=seq_len, cost=cost)
    return (f"ZeRO shares {':'.join(f'{s:g}' for s in shares)} by free memory: the fullest device (rank {r}) at "
            f"{now:.0%} of its memory, {was:.0%} (rank {q}) with even shares")


def _shared(strategy: "Strategy", shares: list[float] | None) -> "Strategy":
    """``strategy`` with these pipelines' ``zero_share`` (``None``: even, the field left out), validated."""
    data = strategy.model_dump()
    for p, s in zip(data["pipelines"], shares or [None] * len(data["pipelines"])):
        p.pop("zero_share", None)
        if s is not None:
            p["zero_share"] = s
    return type(strategy).model_validate(data)
