"""Scenario (b), unstable devices: replanning on the survivors after failures (Appendix A.1 (b)).

The offline plan (from :func:`~hspmd_sdk.planner.hetero.plan_hetero` or a hand-written strategy such as the
paper's Table 11 C1) is the starting point; the replanner reuses it instead of searching again:

* **keep the templates**: pipelines without a failed rank keep their stages and layers; in an affected pipeline
  each stage keeps its surviving ranks, a stage that lost some is cut into the largest allowed TP groups that
  fit (3 survivors of a TP4 stage: a TP2 and a TP1 stage, the paper's C2), and only that pipeline's layer ILP is
  solved again;
* **regroup** (the first level pruned by the offline solution): same number of pipelines (and one fewer) and the
  same TP degree per device kind, the survivors regrouped node by node, the first and second levels solved
  again;

then the micro-batch ILP splits the global batch over the pipelines, the candidates are ranked by the simulator
and the micro-batches polished as in the offline planner.  Every surviving device is used.  Ranks keep their
numbers in the original cluster (:func:`survivor_cluster` renumbers them when a compact cluster is wanted).

Uneven TP stages (``ratios``, SPEC §12, HAP): the ratios describe the devices, so a TP group of the new plan whose
ranks all come from one uneven stage of the running strategy keeps their ratios (an untouched stage its own; a
shrunk one the survivors' ratios, moved to the nearest ones the model's heads and rows can split, or none for a
single device or equal ratios -- :func:`_inherit_ratios`).  A candidate the two-tier annotation cannot express
with them (an uneven stage beside a pipeline that splits the same layer differently, or pipelines of unequal
micro-batching) is planned even, as before.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from ..core.cluster import Cluster, DeviceSpec
from ..core.gc_pause import gc_paused
from ..core.strategy import Strategy
from ..core.tp_ratios import feasible_ratios
from ..errors import PlanValidationError
from ..models.registry import load_model_spec
from .cost import CostModel
from .hetero import (Candidate, PipelinePlan, PlanContext, TPGroup, configure_pipelines, make_groups, pick,
                     solve_candidate, solve_layers, solve_micro_batches, split_node, sync_estimates, tp_degrees,
                     _stage_parts)
from .ratios import split_units

if TYPE_CHECKING:  # pragma: no cover
    from ..core.model_spec import ModelSpec

__all__ = ["replan_elastic", "replan_straggler", "slowed_cluster", "survivor_cluster", "renumber"]


def _group(ctx: PlanContext, ranks: Sequence[int]) -> TPGroup:
    return TPGroup(tuple(ranks), ctx.cluster.kind(ranks[0]), ctx.cluster.node_index(ranks[0]))


def _kept_plan(ctx: PlanContext, groups: Sequence[TPGroup], layers: Sequence[int], b: int, z: int,
               recompute: bool) -> PipelinePlan:
    """The :class:`PipelinePlan` of an unaffected pipeline: its stages and layers as they are."""
    S = len(groups)
    times = []
    for s, (g, n) in enumerate(zip(groups, layers)):
        prof = ctx.profile(g, b, z, recompute)
        times.append(n * prof.layer_time + _stage_parts(prof, s == 0, s == S - 1, 1)[0])
    p2p = 2 * sum(ctx.p2p_time(a, c, b) for a, c in zip(groups, groups[1:]))
    return PipelinePlan(tuple(groups), tuple(layers), tuple(times), p2p, recompute)


def _keep_templates(ctx: PlanContext, strategy: "Strategy", failed: set[int], b: int,
                    allowed: Sequence[int]) -> Candidate | None:
    """Unaffected pipelines as they are; affected ones with their surviving ranks regrouped stage by stage and
    their layers re-solved."""
    M = ctx.global_batch // b
    kept = [p for p in strategy.pipelines if any(r not in failed for r in p.ranks)]  # those with a survivor
    D = len(kept)
    if D == 0:
        return None
    z = ctx.zero_shards(D)
    pipes: list[PipelinePlan] = []
    for p in kept:
        if not any(r in failed for r in p.ranks):
            groups = [_group(ctx, s.devices) for s in p.stages]
            pipes.append(_kept_plan(ctx, groups, [s.num_layers for s in p.stages], b, z,
                                    any(s.recompute for s in p.stages)))
            continue
        groups = []
        for s in p.stages:
            alive = [r for r in s.devices if r not in failed]
            if alive:
                groups += [_group(ctx, g) for g in split_node(alive, s.tp_degree, allowed)]
        plan = solve_layers(ctx, groups, b, max(1, M // D), z) or \
            solve_layers(ctx, groups, b, max(1, M // D), z, recompute=True)
        if plan is None:
            return None
        pipes.append(plan)
    sol = solve_micro_batches(pipes, M, extra=sync_estimates(ctx, pipes))
    if sol is None:
        return None
    degree = {ctx.cluster.kind(s.devices[0]): s.tp_degree for p in kept for s in p.stages}
    return Candidate(degree, D, b, sol[1], [list(p.groups) for p in pipes], "kept", pipes, sol[0], sol[1])


def _regroup(ctx: PlanContext, strategy: "Strategy", survivors: Sequence[int], D: int, b: int,
             allowed: Sequence[int]) -> list[Candidate]:
    """The survivors regrouped at the offline TP degree of each kind, spread over ``D`` pipelines."""
    degree: dict[str, int] = {}
    for p in strategy.pipelines:
        for s in p.stages:
            k = ctx.cluster.kind(s.devices[0])
            degree[k] = max(degree.get(k, 1), s.tp_degree)
    for k in {ctx.cluster.kind(r) for r in survivors}:
        degree.setdefault(k, max(allowed))
    groups = make_groups(ctx.cluster, survivors, degree, allowed)
    if D < 1 or D > sum(len(g) for g in groups.values()) or D > ctx.global_batch // b:
        return []
    comps = configure_pipelines(ctx, groups, D, b)
    if comps is None:
        return []
    return solve_candidate(ctx, Candidate(degree, D, b, 0.0, comps))


@gc_paused
def replan_elastic(model: "ModelSpec | str", cluster: "Cluster", strategy: "Strategy | str | dict",
                   failed: Iterable[int], *, seq_len: int, global_batch: int | None = None,
                   cost: CostModel | None = None, min_pipelines: int | None = None, simulate_top: int = 4,
                   refine: bool = True, name: str | None = None) -> "Strategy":
    """A new strategy on every surviving device of ``cluster`` after ``failed`` ranks are lost.

    ``strategy`` is the one running (its schedule and ZeRO-1 setting are kept; the paper disables ZeRO-1 for
    elastic training so that a replica survives every failure).  ``global_batch`` defaults to the strategy's.
    The returned strategy uses the original rank numbers and never a failed rank.  ``min_pipelines`` (default:
    2 when the running strategy has two or more, else 1) keeps enough data-parallel replicas for the next
    failure to be survivable without a checkpoint.

    >>> from hspmd_sdk.core.cluster import Cluster
    >>> c1 = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 8, "stages": [
    ...     {"devices": [0, 1], "layers": [0, 15]}, {"devices": [2, 3], "layers": [16, 31]}]}]}
    >>> replan_elastic("llama-7b", Cluster.homogeneous("H20", 4), c1, [3], seq_len=2048).num_ranks
    3
    """
    model = load_model_spec(model)
    strategy = Strategy.load(strategy, model=model, cluster=cluster)
    failed = set(failed)
    for r in failed:
        cluster.check_rank(r)
    survivors = [r for r in cluster.ranks if r not in failed]
    gb = global_batch or strategy.global_batch
    ctx = PlanContext(model, cluster, global_batch=gb, seq_len=seq_len, cost=cost, schedule=strategy.schedule,
                      zero=strategy.zero)
    max_node = max(len(n.ranks) for n in cluster.nodes)
    allowed = tp_degrees(model, max_node)
    sizes = sorted({1, strategy.pipelines[0].micro_batch_size} & {b for b in (1, 2, 4) if gb % b == 0})
    floor = min(strategy.dp_degree, 2) if min_pipelines is None else min_pipelines
    cands: list[Candidate] = []
    for b in sizes:
        keep = _keep_templates(ctx, strategy, failed, b, allowed)
        if keep is not None:
            cands.append(keep)
        for D in sorted({strategy.dp_degree, strategy.dp_degree - 1}):
            if D >= floor:
                cands += _regroup(ctx, strategy, survivors, D, b, allowed)
    cands = [c for c in cands if c.num_pipelines >= floor
             and sorted(r for p in c.pipes for g in p.groups for r in g.ranks) == survivors]
    if not cands:
        raise PlanValidationError([("failed", f"no strategy for {model.name} fits the {len(survivors)} surviving "
                                              f"devices")], what="elastic plan")
    cands.sort(key=lambda c: c.estimate)
    name = name or f"replan_elastic: {model.name} on {len(survivors)} devices (lost {sorted(failed)})"
    return pick(ctx, cands, simulate_top=simulate_top, refine=refine, name=name,
                adjust=_keeping_ratios(model, strategy))


def _keeping_ratios(model: "ModelSpec", old: "Strategy") -> "Callable[[Strategy], Strategy] | None":
    """For :func:`~.hetero.pick`: each candidate inherits ``old``'s ratios (:func:`_inherit_ratios`); ``None``
    (candidates as built) when ``old`` has no uneven stage."""
    if not any(s.is_uneven for p in old.pipelines for s in p.stages):
        return None
    return lambda new: _inherit_ratios(model, old, new)


def _inherit_ratios(model: "ModelSpec", old: "Strategy", new: "Strategy") -> "Strategy":
    """``new`` with the ratios of ``old``'s uneven stages on every stage whose ranks all come from one of them
    (restricted to those ranks, in the new stage's order; moved to the nearest feasible ratios for the new
    stage's layers, :func:`~hspmd_sdk.core.tp_ratios.feasible_ratios`; none when one rank is left, the ratios
    are equal or nothing is feasible).  ``new`` unchanged when the result is not a valid strategy (the
    two-tier annotation cannot express it)."""
    owner = {r: s for p in old.pipelines for s in p.stages if s.is_uneven for r in s.devices}
    if not owner:
        return new
    data = new.model_dump()
    changed = False
    for p, pipe in zip(data["pipelines"], new.pipelines):
        for j, (st, stage) in enumerate(zip(p["stages"], pipe.stages)):
            src = owner.get(stage.devices[0])
            if len(stage.devices) < 2 or src is None or any(owner.get(r) is not src for r in stage.devices):
                continue
            ratios = [src.ratios[src.devices.index(r)] for r in stage.devices]
            if len(set(ratios)) <= 1:
                continue
            g = math.gcd(*ratios)
            ratios = [r // g for r in ratios]
            first, last = j == 0, j == len(pipe.stages) - 1
            unit = split_units(model, stage, first=first, last=last)
            if unit % sum(ratios):
                ratios = feasible_ratios(ratios, unit)
            if ratios is None or len(set(ratios)) <= 1:
                continue
            st["ratios"] = ratios
            changed = True
    if not changed:
        return new
    try:
        return Strategy.load(data, model=model)
    except PlanValidationError:
        return new


def survivor_cluster(cluster: "Cluster", failed: Iterable[int]) -> tuple["Cluster", dict[int, int]]:
    """The cluster without ``failed`` ranks, renumbered ``0..n-1`` in order, and the map old rank -> new rank."""
    failed = set(failed)
    mapping: dict[int, int] = {}
    nodes = []
    for n in cluster.nodes:
        alive = [r for r in n.ranks if r not in failed]
        if alive:
            new = []
            for r in alive:
                mapping[r] = len(mapping)
                new.append(mapping[r])
            nodes.append({"host": n.host, "kind": n.kind, "ranks": new})
    data = cluster.model_dump()
    data["nodes"] = nodes
    return Cluster.load(data), mapping


def renumber(strategy: "Strategy", mapping: dict[int, int]) -> "Strategy":
    """``strategy`` with every rank ``r`` replaced by ``mapping[r]``."""
    data = strategy.model_dump()
    for p in data["pipelines"]:
        for s in p["stages"]:
            s["devices"] = [mapping[r] for r in s["devices"]]
    return Strategy.load(data)


def slowed_cluster(cluster: "Cluster", speeds: dict[int, float], cost: CostModel | None = None
                   ) -> tuple["Cluster", CostModel]:
    """``cluster`` with each rank of ``speeds`` made ``factor`` times slower, for planning around stragglers: the
    rank moves to a node of its own (same host) of a device kind ``"<kind>/<factor>"`` whose peak FLOPS (and, in
    ``cost``, whose profiled compute times and Adam time) are scaled by the factor.  Ranks keep their numbers.
    Its links to former node-mates are costed as inter-node (a conservative simplification)."""
    cost = cost or CostModel()
    data = cluster.model_dump()
    devices = dict(data["devices"])
    nodes = []
    moved: list[dict] = []
    updates: dict[str, dict] = {"profiles": dict(cost.profiles), "compute_fits": dict(cost.compute_fits),
                                "mfu": dict(cost.mfu)}
    for node in data["nodes"]:
        keep = [r for r in node["ranks"] if r not in speeds]
        if keep:
            nodes.append({**node, "ranks": keep})
        for r in node["ranks"]:
            if r in speeds:
                k = float(speeds[r])
                base = cluster.devices[node["kind"]]
                kind = f"{node['kind']}/{k:.3g}"
                devices[kind] = DeviceSpec(kind=kind, memory_mb=base.memory_mb, bf16_tflops=base.bf16_tflops / k,
                                           intra_bandwidth_gbs=base.intra_bandwidth_gbs).model_dump()
                moved.append({"host": node["host"], "kind": kind, "ranks": [r]})
                _scale_costs(updates, node["kind"], kind, k)
    data["nodes"], data["devices"] = nodes + moved, devices
    return Cluster.load(data), cost.model_copy(update=updates)


def _scale_costs(updates: dict[str, dict], kind: str, new: str, k: float) -> None:
    """Profiled costs of ``kind`` copied under ``new`` with every compute time ``k`` times longer."""
    def scaled(fit: Any) -> Any:
        return fit.model_copy(update={"a": fit.a * k, "b": fit.b * k})

    prof = updates["profiles"].get(kind)
    if prof is not None:
        updates["profiles"][new] = prof.model_copy(update={
            "layer_fwd": scaled(prof.layer_fwd), "layer_bwd": scaled(prof.layer_bwd),
            "head_fwd": scaled(prof.head_fwd), "head_bwd": scaled(prof.head_bwd), "embed": scaled(prof.embed),
            "optimizer_s_per_param": prof.optimizer_s_per_param * k})
    fit = updates["compute_fits"].get(kind)
    if fit is not None:
        updates["compute_fits"][new] = scaled(fit)
    if kind in updates["mfu"]:
        updates["mfu"][new] = updates["mfu"][kind]


def replan_straggler(model: "ModelSpec | str", cluster: "Cluster", strategy: "Strategy | str | dict",
                     speeds: dict[int, float], *, seq_len: int, global_batch: int | None = None,
                     cost: CostModel | None = None) -> "Strategy":
    """A strategy for ``cluster`` when the ranks of ``speeds`` run ``factor`` times slower than their kind
    (measured stragglers): the running strategy's pipelines with layers and micro-batches re-balanced for the
    measured speeds (the templates kept, as :func:`replan_elastic` does; no rank is dropped), picked by the
    simulator on the slowed cluster (:func:`slowed_cluster`).  Ranks keep their numbers."""
    model = load_model_spec(model)
    strategy = Strategy.load(strategy, model=model, cluster=cluster)
    slow, slow_cost = slowed_cluster(cluster, speeds, cost)
    gb = global_batch or strategy.global_batch
    ctx = PlanContext(model, slow, global_batch=gb, seq_len=seq_len, cost=slow_cost, schedule=strategy.schedule,
                      zero=strategy.zero)
    allowed = tp_degrees(model, max(len(n.ranks) for n in cluster.nodes))
    sizes = sorted({1, strategy.pipelines[0].micro_batch_size} & {b for b in (1, 2, 4) if gb % b == 0})
    cands = [c for b in sizes for c in [_keep_templates(ctx, strategy, set(), b, allowed)] if c is not None]
    if not cands:
        raise ValueError(f"no re-balanced strategy for the stragglers {speeds}")
    cands.sort(key=lambda c: c.estimate)
    name = f"replan_straggler: {model.name}, ranks " + ", ".join(f"{r} x{k:.2f}" for r, k in speeds.items())
    return pick(ctx, cands, simulate_top=4, refine=True, name=name, adjust=_keeping_ratios(model, strategy))
