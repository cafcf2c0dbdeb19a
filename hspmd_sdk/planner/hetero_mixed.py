"""Mixed-kind TP groups for :func:`~hspmd_sdk.planner.hetero.plan_hetero` (SPEC §12, HAP inside HSPMD).

The two-level planner keeps each TP group on one device kind.  A host that holds devices of several kinds (a
workstation or a node with mixed GPU generations: several :class:`~hspmd_sdk.core.cluster.Node` entries of one
``host``) can also run TP groups that mix them, each device holding a share of every TP-split tensor in
proportion to what it can do: HAP's sharding ratios, from the ratio ILP of
:func:`~hspmd_sdk.planner.ratios.plan_ratios` (speeds and memories from the cost model, integer parts of the
model's heads, KV heads and rows).

This module builds those candidates: every host's devices dealt into ``k`` groups that each take an equal part of
each of its kinds (in rank order; a host of 2 H800 and 4 H20 gives groups of 1 H800 + 2 H20, or one of all six);
the groups arranged into ``P`` pipelines of ``S`` stages (``P * S`` groups dealt round-robin, or else
consecutive, so that every pipeline's ``j``-th stage has the same kinds in the same order: :func:`arrangement`); a
pipeline's layers split over its stages evenly where they are alike (the layers left over on the middle stages,
:func:`_even_layers`), else in proportion to their speeds (the split that makes the slowest stage's time least,
:func:`_shares`, each stage's time per layer from the ratio ILP of one layer); each stage's ratios from the ratio
ILP for its own layers (with the embedding on the first, the LM head on the last); the step's micro-batches
shared equally over the pipelines; with and without recomputation.  ``plan_hetero`` simulates them (each
arrangement at micro-batch sizes in increasing order while its time improves, with recomputation where it runs
out of memory without: :func:`~.hetero._best_mixed`) beside its best plan of single-kind groups and keeps the
faster.

Scope: a candidate uses every rank, so it exists only when every host of ``ranks`` has at least two kinds, in
numbers that one group count divides.  A group may have any size whose ratios cut the model into whole parts
(three devices over 32 heads: an H800 and two H20 take 21:5:6); ``plan_ratios`` refuses the others, and the
strategy's own checks refuse what the runtime cannot run.  Pipelines are alike (same stage kinds, layers and
ratios) and take equal micro-batches, because the two-tier annotation of uneven stages splits the batch evenly
over pipelines (:func:`~hspmd_sdk.core.strategy._uneven_pipelines_problem`); hosts of different kinds mix in
one candidate only where the arrangement makes the pipelines alike.  Stages run in rank order, and their layers
follow speeds, not a memory model (the layer ILP of :func:`~.hetero.solve_layers` prices single-kind groups): a
split that does not fit is left to recomputation or to the simulator's out-of-memory verdict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..core.strategy import Stage, Strategy
from ..errors import HSPMDError, PlanValidationError
from .ratios import RatioPlan, plan_ratios, split_units

__all__ = ["PipelineLayout", "host_groups", "arrangement", "pipeline_layout", "mixed_arrangements",
           "arrangement_strategies", "mixed_strategies", "recomputing"]

Group = tuple[int, ...]


@dataclass(frozen=True)
class PipelineLayout:
    """One pipeline of mixed-kind TP groups: each stage's ``layers`` (first, last) and ``ratios``, and its
    estimated seconds for one micro-batch (``times``: the ratio ILP's compute estimate)."""

    layers: tuple[tuple[int, int], ...]
    ratios: tuple[tuple[int, ...], ...]
    times: tuple[float, ...]


def host_groups(ctx: Any, ranks: Sequence[int], count: int) -> list[Group] | None:
    """Every host's devices among ``ranks`` dealt into ``count`` groups, each taking an equal part of each of the
    host's kinds (the i-th group the i-th part of each kind, in rank order; a group's ranks sorted): a host of 2
    H800 and 4 H20 in 2 groups gives two groups of 1 H800 and 2 H20.  ``None`` when some host has one kind only or
    ``count`` does not divide the number of devices of each of its kinds."""
    by_host: dict[str, dict[str, list[int]]] = {}
    for r in sorted(ranks):
        node = ctx.cluster.node_of(r)
        by_host.setdefault(node.host, {}).setdefault(node.kind, []).append(r)
    out: list[Group] = []
    for kinds in by_host.values():
        if len(kinds) < 2 or any(len(v) % count for v in kinds.values()):
            return None
        for i in range(count):
            out.append(tuple(sorted(r for v in kinds.values()
                                    for r in v[i * len(v) // count:(i + 1) * len(v) // count])))
    return out


def arrangement(ctx: Any, groups: Sequence[Group], stages: int) -> list[list[Group]] | None:
    """``groups`` (in host and rank order) as ``len(groups) // stages`` pipelines of ``stages`` stages, alike: every
    pipeline's ``j``-th stage of the same kinds in the same order (so of the same ratios: see the module
    docstring).  Groups dealt round-robin where that makes them alike (pipeline ``p`` takes every ``P``-th group
    from the ``p``-th: a host's groups go to different pipelines, which synchronise gradients inside the host
    while activations cross hosts, as Megatron-LM places data parallelism inside pipeline parallelism), else
    consecutive groups; ``None`` when neither is alike."""
    groups = list(groups)
    if stages < 1 or len(groups) % stages:
        return None
    P = len(groups) // stages
    for pipes in ([groups[p::P] for p in range(P)], [groups[p * stages:(p + 1) * stages] for p in range(P)]):
        if all(len({tuple(ctx.cluster.kind(r) for r in pipe[j]) for pipe in pipes}) == 1 for j in range(stages)):
            return pipes
    return None


def _ratios(ctx: Any, group: Group, layers: tuple[int, int], b: int, first: bool, last: bool,
            cache: dict) -> RatioPlan | None:
    """``plan_ratios`` for ``group`` holding ``layers``, or ``None`` where it refuses (the stage does not fit, or
    the model cannot be cut into the group's parts).  Cached by what the answer depends on: the group's kinds,
    the number of layers, the whole parts of the split, the micro-batch and the ends held."""
    kinds = tuple(ctx.cluster.kind(r) for r in group)
    here = (kinds, layers, b, first, last)
    if here not in cache:
        stage = Stage(devices=list(group), layers=list(layers))
        key = (kinds, stage.num_layers, split_units(ctx.model, stage, first=first, last=last), b, first, last)
        if key not in cache:
            try:
                cache[key] = plan_ratios(ctx.model, ctx.cluster, stage, micro_batch=b, seq_len=ctx.seq_len,
                                         first=first, last=last, cost=ctx.cost)
            except HSPMDError:
                cache[key] = None
        cache[here] = cache[key]
    return cache[here]


def pipeline_layout(ctx: Any, pipe: Sequence[Group], micro_batch: int, cache: dict | None = None
                    ) -> PipelineLayout | None:
    """The layers and ratios of a pipeline whose stages are the mixed groups ``pipe`` (see the module
    docstring); ``None`` when it has more stages than layers or a stage's ratio ILP refuses.  ``cache``: shared
    between calls of one planning run."""
    cache = {} if cache is None else cache
    L, S = ctx.model.num_layers, len(pipe)
    if len({tuple(ctx.cluster.kind(r) for r in g) for g in pipe}) == 1:
        counts = _even_layers(L, S)
    else:
        one = [_ratios(ctx, g, (0, 0), 1, False, False, cache) for g in pipe]  # per layer (times scale with b)
        counts = _shares(L, [p.step_time for p in one]) if all(one) else None
    if counts is None:
        return None
    layers, plans, first = [], [], 0
    for j, (g, n) in enumerate(zip(pipe, counts)):
        layers.append((first, first + n - 1))
        plans.append(_ratios(ctx, g, layers[-1], micro_batch, j == 0, j == S - 1, cache))
        if plans[-1] is None:
            return None
        first += n
    return PipelineLayout(tuple(layers), tuple(p.ratios for p in plans), tuple(p.step_time for p in plans))


def _even_layers(layers: int, stages: int) -> list[int] | None:
    """``layers`` over ``stages`` alike stages as evenly as possible, the layers left over (fewer than ``stages``)
    on the middle stages first, then the last, never the first: the first holds the embedding and the most
    micro-batches in flight (1F1B), the last the LM head.  ``None`` when there are fewer layers than stages."""
    if layers < stages:
        return None
    counts = [layers // stages] * stages
    for i in range(1, 1 + layers % stages):  # stages 1 .. stages - 2 (the middle), then stages - 1 (the last)
        counts[i] += 1
    return counts


def _shares(total: int, times: Sequence[float]) -> list[int] | None:
    """``total`` equal jobs (micro-batches, layers) over workers of these times per job, at least one each, so
    that the slowest worker's ``count * time`` is least: each job in turn to the worker that would finish it
    first, the slower on a tie (exact for equal jobs on machines of different speeds, where shares in proportion
    to the speeds, rounded by largest remainders, miss the optimum in about one case in six); the data-parallel
    half of the ratio LP, which decomposes (see :mod:`.ratios`).  ``None`` when there are fewer jobs than
    workers."""
    if total < len(times):
        return None
    got = [1] * len(times)
    for _ in range(total - len(times)):
        i = min(range(len(times)), key=lambda g: ((got[g] + 1) * times[g], -times[g], g))  # ties: the slower
        got[i] += 1
    return got


def mixed_arrangements(ctx: Any, ranks: Sequence[int], *, degrees: Sequence[int] | None = None,
                       min_pipelines: int = 1, max_pipelines: int | None = None) -> list[list[list[Group]]]:
    """Every way to run ``ranks`` as alike pipelines of mixed-kind groups: for each group count
    (:func:`host_groups`) and number of stages, the :func:`arrangement` of ``min_pipelines`` to ``max_pipelines``
    pipelines.  ``degrees``: the group sizes to try (default: any; the ratio ILP refuses those it cannot cut the
    model into)."""
    out: list[list[list[Group]]] = []
    if host_groups(ctx, ranks, 1) is None:  # a host of one kind: no count deals it into mixed groups
        return out
    for count in range(1, len(ranks) + 1):
        groups = host_groups(ctx, ranks, count)
        if groups is None or (degrees is not None and any(len(g) not in degrees for g in groups)):
            continue
        for stages in range(1, len(groups) + 1):
            P = len(groups) // stages
            if P < min_pipelines or (max_pipelines is not None and P > max_pipelines):
                continue
            pipes = arrangement(ctx, groups, stages)
            if pipes is not None:
                out.append(pipes)
    return out


def arrangement_strategies(ctx: Any, pipes: Sequence[Sequence[Group]], micro_batch: int, *,
                           recompute: Sequence[bool] = (False, True), name: str | None = None,
                           cache: dict | None = None) -> list["Strategy"] | None:
    """The strategies of one arrangement of alike pipelines at ``micro_batch`` (:func:`pipeline_layout`, equal
    micro-batches per pipeline), one per ``recompute``: ``[]`` where the global batch does not split so; ``None``
    where no layout fits or the strategy's checks for ``ctx.model`` refuse it (nor will a larger micro-batch fit,
    which holds more activations in the same whole parts)."""
    P = len(pipes)
    if ctx.global_batch % micro_batch or (ctx.global_batch // micro_batch) % P:  # equal micro-batches (docstring)
        return []
    layout = pipeline_layout(ctx, pipes[0], micro_batch, cache)
    if layout is None:
        return None
    out = []
    for rc in recompute:
        pipelines = [{"stages": [{"devices": list(g), "layers": list(lay), "recompute": rc, "ratios": list(r)}
                                 for g, lay, r in zip(pipe, layout.layers, layout.ratios)],
                      "micro_batch_size": micro_batch, "num_micro_batches": ctx.global_batch // micro_batch // P}
                     for pipe in pipes]
        try:  # the model's checks (whole heads...) of one pipeline: the others are alike, recompute aside
            if not out:
                Strategy.load({"pipelines": pipelines[:1]}, model=ctx.model)
            out.append(Strategy.load({"pipelines": pipelines, "schedule": ctx.schedule, "zero": ctx.zero,
                                      "name": name}))
        except PlanValidationError:
            return None
    return out


def mixed_strategies(ctx: Any, ranks: Sequence[int], *, degrees: Sequence[int] | None = None,
                     micro_batches: Sequence[int] = (1, 2, 4), min_pipelines: int = 1,
                     max_pipelines: int | None = None, recompute: Sequence[bool] = (False, True),
                     name: str | None = None) -> list["Strategy"]:
    """Every candidate strategy of mixed-kind TP groups with ratios over ``ranks`` (see the module docstring): for
    each of the :func:`mixed_arrangements` and micro-batch size, without and with recomputation (``recompute``:
    which).  ``ctx``: the :class:`~.hetero.PlanContext` of the planning run."""
    out: list[Strategy] = []
    cache: dict = {}
    for pipes in mixed_arrangements(ctx, ranks, degrees=degrees, min_pipelines=min_pipelines,
                                    max_pipelines=max_pipelines):
        for b in sorted(micro_batches):
            found = arrangement_strategies(ctx, pipes, b, recompute=recompute, name=name, cache=cache)
            if found is None:
                break
            out += found
    return out


def recomputing(strategy: "Strategy") -> "Strategy":
    """``strategy`` with every stage recomputing its activations (what a candidate that runs out of memory tries
    next), validated: ZeRO-3 refuses it where the pipelines split the layers into different stages (a recomputed
    stage's replicas must gather its layers again alike)."""
    pipes = [p.model_copy(update={"stages": [st.model_copy(update={"recompute": True}) for st in p.stages]})
             for p in strategy.pipelines]
    return type(strategy).load({**strategy.model_dump(), "pipelines": [p.model_dump() for p in pipes]})
