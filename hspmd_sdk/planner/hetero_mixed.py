"""Mixed-kind TP groups for :func:`~hspmd_sdk.planner.hetero.plan_hetero` (SPEC §12, HAP inside HSPMD).

The two-level planner keeps each TP group on one device kind.  A host that holds devices of several kinds (a
workstation or a node with mixed GPU generations: several :class:`~hspmd_sdk.core.cluster.Node` entries of one
``host``) can also run TP groups that mix them, each device holding a share of every TP-split tensor in
proportion to what it can do: HAP's sharding ratios, from the linear program of
:func:`~hspmd_sdk.planner.ratios.plan_ratios` (speeds and memories from the cost model).

This module builds those candidates: every host's devices dealt into ``k`` groups that each take an equal part of
each of its kinds (in rank order; ``k`` such that every group's TP degree divides the model; a host of 2 H800 and 4
H20 gives groups of 1 H800 + 2 H20, or one of all six), each group one pipeline of one stage
holding every layer with its ratios, the step's micro-batches shared over the groups by their estimated speeds
(the share that makes the slowest group's time least), with and without recomputation.  ``plan_hetero`` simulates them beside its
best plan of single-kind groups and keeps the faster.

Scope: a candidate uses every rank, so it exists only when every host of ``ranks`` has at least two kinds, in
numbers that one group count divides; groups are not split into pipeline stages (a model that a group cannot hold
whole gets no candidate).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..core.strategy import Stage, Strategy
from ..errors import HSPMDError
from .ratios import plan_ratios

__all__ = ["MixedGroups", "host_groups", "mixed_strategies"]


@dataclass(frozen=True)
class MixedGroups:
    """One way to deal the hosts' devices into mixed-kind TP groups: ``groups`` (ranks, by host and rank order)
    and each group's ``ratios`` and estimated seconds for one micro-batch (``times``)."""

    groups: tuple[tuple[int, ...], ...]
    ratios: tuple[tuple[int, ...], ...]
    times: tuple[float, ...]


def host_groups(ctx: Any, ranks: Sequence[int], count: int) -> list[tuple[int, ...]] | None:
    """Every host's devices among ``ranks`` dealt into ``count`` groups, each taking an equal part of each of the
    host's kinds (the i-th group the i-th part of each kind, in rank order; a group's ranks sorted): a host of 2
    H800 and 4 H20 in 2 groups gives two groups of 1 H800 and 2 H20.  ``None`` when some host has one kind only or
    ``count`` does not divide the number of devices of each of its kinds."""
    by_host: dict[str, dict[str, list[int]]] = {}
    for r in sorted(ranks):
        node = ctx.cluster.node_of(r)
        by_host.setdefault(node.host, {}).setdefault(node.kind, []).append(r)
    out: list[tuple[int, ...]] = []
    for kinds in by_host.values():
        if len(kinds) < 2 or any(len(v) % count for v in kinds.values()):
            return None
        for i in range(count):
            out.append(tuple(sorted(r for v in kinds.values()
                                    for r in v[i * len(v) // count:(i + 1) * len(v) // count])))
    return out


def _deal(groups: Sequence[tuple[int, ...]], ctx: Any, micro_batch: int) -> MixedGroups | None:
    """Each group's ratios (``plan_ratios`` for a stage of every layer) and estimated time; ``None`` when a
    group cannot hold the model or its TP degree cannot split it."""
    ratios, times = [], []
    for g in groups:
        try:
            plan = plan_ratios(ctx.model, ctx.cluster, Stage(devices=list(g), layers=[0, ctx.model.num_layers - 1]),
                               micro_batch=micro_batch, seq_len=ctx.seq_len, cost=ctx.cost)
        except HSPMDError:
            return None
        ratios.append(plan.ratios)
        times.append(plan.step_time)
    return MixedGroups(tuple(groups), tuple(ratios), tuple(times))


def _shares(total: int, times: Sequence[float]) -> list[int] | None:
    """``total`` micro-batches over groups of these times per micro-batch, at least one each, so that the slowest
    group's ``count * time`` is least: each micro-batch in turn to the group that would finish it first, the
    slower on a tie (exact for equal jobs on machines of different speeds, where shares in proportion to the
    speeds, rounded by largest remainders, miss the optimum in about one case in six); the data-parallel half of
    the ratio LP, which decomposes (see :mod:`.ratios`).  ``None`` when there are fewer micro-batches than groups."""
    if total < len(times):
        return None
    got = [1] * len(times)
    for _ in range(total - len(times)):
        i = min(range(len(times)), key=lambda g: ((got[g] + 1) * times[g], -times[g], g))  # ties: the slower
        got[i] += 1
    return got


def mixed_strategies(ctx: Any, ranks: Sequence[int], *, degrees: Sequence[int],
                     micro_batches: Sequence[int] = (1, 2, 4), min_pipelines: int = 1,
                     max_pipelines: int | None = None, name: str | None = None) -> list["Strategy"]:
    """Candidate strategies of mixed-kind TP groups with ratios over ``ranks`` (see the module docstring): for
    each group size in ``degrees`` (the TP degrees the model divides into, :func:`~.hetero.tp_degrees`) and
    micro-batch size that divides the global batch, without and with recomputation.  ``ctx``: the
    :class:`~.hetero.PlanContext` of the planning run."""
    degrees = set(degrees)
    out = []
    for count in range(1, len(ranks) + 1):
        groups = host_groups(ctx, ranks, count)
        if groups is None or any(len(g) not in degrees for g in groups):
            continue
        if len(groups) < min_pipelines or (max_pipelines is not None and len(groups) > max_pipelines):
            continue
        for b in micro_batches:
            if ctx.global_batch % b:
                continue
            dealt = _deal(groups, ctx, b)
            counts = _shares(ctx.global_batch // b, dealt.times) if dealt is not None else None
            if dealt is None or counts is None:
                continue
            for recompute in (False, True):
                pipelines = [{"stages": [{"devices": list(g), "layers": [0, ctx.model.num_layers - 1],
                                          "recompute": recompute, "ratios": list(r)}],
                              "micro_batch_size": b, "num_micro_batches": m}
                             for g, r, m in zip(dealt.groups, dealt.ratios, counts)]
                out.append(Strategy.load({"pipelines": pipelines, "schedule": ctx.schedule, "zero1": ctx.zero1,
                                          "name": name}))
    return out
