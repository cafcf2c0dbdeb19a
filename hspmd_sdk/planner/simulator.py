"""An event-driven simulation of one training step of a strategy on a cluster (§8's "evaluate a plan").

The step follows the schedules the runtime executes (:func:`hspmd_sdk.core.schedule.build_schedule`), replayed
together by :func:`hspmd_sdk.core.schedule.replay` with a timing callback:

1. ``PRE`` (ZeRO-1 only): all-gather of the parameters across the replicas holding each layer;
2. every pipeline runs its own micro-batches (count and size per pipeline): ``F``/``B`` take the stage's compute
   time plus its TP collectives, those of the model's own specialized Program (:mod:`.tp_comm`), priced as ring
   collectives (the slowest device kind of the TP group sets the pace); activations and
   gradients move between neighbouring stages point-to-point over :meth:`Cluster.link`, one transfer at a time
   per direction, without blocking the sender beyond posting it (:meth:`CostModel.send_time`, a ``comm`` event;
   0 unless a measured link says otherwise); a transfer lasts as long as its busiest sender, which sends its
   messages one after another (a stage feeding a wider TP group sends each of its receivers a copy); a receive
   waits for its data;
3. ``POST``: gradient synchronisation after each stage's last backward (ring all-reduce, or reduce-scatter with
   ZeRO-1) in *buckets*: runs of layers held by the same set of stages (for heterogeneous pipelines whose stages
   hold different layer ranges, HSPMD's SplitAllReduce/SplitReduceScatter); a bucket starts when all its holders
   are ready and runs at the pace of its slowest holder and link; then the Adam update of the parameters each
   device owns.

Two forms, one pricing.  ``simulate(model, strategy, cluster, ...)`` derives the step's communication from the
strategy: the values each rank synchronises from the model's placements (TP-split parameters by the stage's
share, duplicated norms whole), each boundary's messages from its stages' shapes.  ``simulate(program)`` reads
them off the specialized Program: its ``grad_sync_plans`` and ZeRO-1 gathers (ring collectives: every group, or
every slice of a top-tier split collective) and the SendRecv / BSR messages of its stage boundaries at one
micro-batch.  Both price through the same functions (:func:`_sync_seconds`, :func:`_send_of`) at one ``dtype``
(:meth:`CostModel.wire_bytes`), and agree where both apply (the tests hold them equal over DP, TP, PP, CP,
ZeRO-1, uneven and heterogeneous pipelines); the strategy form is the planners' (no specialization in a search).

Compute comes from the cost model: analytic, a matmul fit (``CostModel.compute_fits``) or whole profiled operators
(``CostModel.profiles``, :func:`hspmd_sdk.runtime.profile_model`).  Link latency and bandwidth come from
:meth:`Cluster.link`, unless ``CostModel.link_overrides`` holds measured figures for the link's class (e.g.
``"intra"`` for local gloo ranks; with :func:`~hspmd_sdk.runtime.profile_link` they include the fixed cost of
every blocking collective call, ``LinkOverride.call_latency``, which TP's many small all-reduces pay in full, and
the wait for the group's slowest member, ``LinkOverride.skew`` times the compute before each call, priced from
the unshared compute).  With ``CostModel.cores`` set and a node holding more ranks than cores
(local CPU runs), compute and optimizer time of a device are scaled by processor sharing: the time-weighted mean of
``max(1, ranks of its node computing at that moment / cores)`` over its own compute, found as a fixed point of
the simulated timeline (a rank waiting in a bubble or a collective frees its core).

Memory per device is the core's one estimate (:func:`hspmd_sdk.core.memory.device_memory`, with the cost model's
switches and runtime parts, :meth:`CostModel.memory_options`): bf16 parameters and gradients, the fp32 optimizer
part (divided by the number of replicas holding each layer under ZeRO-1), activations of the micro-batches in flight
(:func:`in_flight`), the largest transient buffer, and the device's runtime (:meth:`CostModel.runtime_bytes`: a
GPU's CUDA context reserve, a CPU worker's process baseline) -- the figure ``Strategy.summary`` and the job
dashboard show.  A mixed-length step (:func:`~.mixed_sim.simulate_shapes`) counts its own micro-batch shapes.
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Hashable

from ..core.comm_ops import CollectiveOp, OpKind, PointToPointOp, SplitCollectiveOp, ring_numel
from ..core.memory import device_memory
from ..core.model_spec import placements_by_tensor
from ..core.resolve import itemsize_of
from ..core.schedule import Action, build_schedule, in_flight, replay
from ..core.slices import box_numel
from ..core.specialize import Program, ProgramPart
from ..core.strategy import Strategy
from ..core.strategy_plan import graph_of
from ..errors import PlanValidationError
from ..models.registry import load_model_spec
from .cost import BF16, CostModel, LayerCost, embedding_cost, head_cost, layer_cost, static_memory
from .tp_comm import _RING, _SPLIT  # the ring kinds, and the ring kind of each top-tier split collective

if TYPE_CHECKING:  # pragma: no cover
    from ..core.cluster import Cluster, DeviceSpec, Link
    from ..core.model_spec import ModelSpec
    from ..core.strategy import Stage

__all__ = ["simulate", "SimResult", "Event", "Transfer"]

EventKind = str  # "F" | "B" | "comm" | "sync" | "optim" | "idle"


@dataclass(frozen=True)
class Event:
    """One interval on a device's compute timeline."""

    start: float
    end: float
    kind: EventKind
    micro_batch: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Transfer:
    """A point-to-point activation (``F``) or gradient (``B``) transfer between two stages of one pipeline."""

    pipeline: int
    src_stage: int
    dst_stage: int
    kind: str
    micro_batch: int
    start: float
    end: float
    nbytes: float


@dataclass
class SimResult:
    """The outcome of :func:`simulate`.

    ``step_time`` (s); ``timeline``: device -> non-overlapping :class:`Event` list covering ``[0, step_time]``;
    ``bubble_fraction``: idle share of the devices' time between the first forward and the last backward of the
    step; ``peak_memory`` and ``memory`` (breakdown): bytes per device; ``capacity``: bytes per device;
    ``oom``: devices whose peak exceeds their capacity; ``transfers``: pipeline point-to-point transfers.
    """

    step_time: float
    timeline: dict[int, list[Event]]
    bubble_fraction: float
    peak_memory: dict[int, float]
    memory: dict[int, dict[str, float]]
    capacity: dict[int, float]
    oom: list[int]
    transfers: list[Transfer] = field(default_factory=list)
    pipeline_end: list[float] = field(default_factory=list)
    sync_time: float = 0.0
    label: str = ""

    def busy(self, device: int, kinds: tuple[str, ...] = ("F", "B")) -> float:
        """Seconds ``device`` spends in events of ``kinds``."""
        return sum(e.duration for e in self.timeline[device] if e.kind in kinds)

    def summary(self) -> str:
        """A few readable lines: step time, bubble, pipelines, memory and OOM."""
        lines = [f"{self.label + ': ' if self.label else ''}step {self.step_time:.3f} s, bubble "
                 f"{self.bubble_fraction:.1%}, gradient sync + optimizer {self.sync_time:.3f} s"]
        for i, t in enumerate(self.pipeline_end):
            lines.append(f"  pipeline {i}: last backward at {t:.3f} s")
        worst = max(self.peak_memory, key=lambda d: self.peak_memory[d] / self.capacity[d])
        lines.append(f"  peak memory {max(self.peak_memory.values()) / 2**30:.1f} GiB; fullest device {worst}: "
                     f"{self.peak_memory[worst] / 2**30:.1f} / {self.capacity[worst] / 2**30:.1f} GiB")
        lines.append(f"  OOM on devices {self.oom}" if self.oom else "  fits in memory")
        return "\n".join(lines)


# ---- per-stage costs ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _StageCost:
    fwd: float
    bwd: float
    act_per_mb: float
    transient: float
    units: tuple[tuple[Hashable, float], ...]  # (model unit, params per device)
    fwd_comm: float = 0.0  # the in-stage (TP) collectives' part of fwd / bwd
    bwd_comm: float = 0.0
    # context parallelism: the layers' ring gaps (LayerCost.ring_gap_*): fwd pays max(0, ring_gap_fwd), bwd
    # max(0, ring_gap_bwd) and, when it recomputes, max(0, ring_gap_fwd) again
    ring_gap_fwd: float = 0.0
    ring_gap_bwd: float = 0.0
    recompute: bool = False
    # an uneven stage (ratios): each device's own (device, act_per_mb, transient, units) -- a device with a larger
    # share holds more than the pace-setter whose costs are above
    memory_of: tuple[tuple[int, float, float, tuple[tuple[Hashable, float], ...]], ...] = ()
    # the values each unit's gradient synchronisation moves per device: the stage's largest share of the unit's
    # parameters, exactly as the model places them (:func:`_sync_units`; TP-duplicated norms whole); () -> units
    sync_units: tuple[tuple[Hashable, float], ...] = ()


def _ring_link(cluster: "Cluster", devices: list[int]) -> "Link":
    """The slowest link of a ring over ``devices``."""
    if len(devices) == 1:
        return cluster.link(devices[0], devices[0])
    links = [cluster.link(devices[k], devices[(k + 1) % len(devices)]) for k in range(len(devices))]
    return min(links, key=lambda l: l.bandwidth)


def _stage_cost(model: "ModelSpec", stage: "Stage", first: bool, last: bool, cluster: "Cluster",
                micro_batch: int, seq_len: int, cost: CostModel, share: float | None = None, *,
                balanced: bool = False, dtype: str | None = None, tied: bool = False) -> _StageCost:
    """The stage's forward/backward seconds of one micro-batch, activation and transient bytes, parameters per
    unit.  ``share``: the compute slowdown of its devices (default :func:`_core_share`, every rank of the node
    computing at once).  A CP stage (``stage.cp > 1``) is priced per rank of its ``cp x tp`` grid
    (:func:`~.cost.layer_cost`'s ``cp``; ``balanced``: the load-balanced chunk layout).  ``dtype``: the TP
    collectives' values on the wire (:meth:`CostModel.wire_bytes`); ``tied``: a tied weight's other uses are
    synchronised on their own stage (:func:`_sync_units`: some pipeline of the strategy has several stages)."""
    tp, cp = stage.tp_degree, stage.cp
    groups = stage.tp_groups  # one TP group per CP coordinate; CP group t: rank t of each
    link = min((_ring_link(cluster, g) for g in groups), key=lambda l: l.bandwidth)
    cp_link = min((_ring_link(cluster, [g[t] for g in groups]) for t in range(tp)), key=lambda l: l.bandwidth) \
        if cp > 1 else None
    ratios = stage.ratios if stage.ratios is not None and len(set(stage.ratios)) > 1 else None
    # each (kind, share of the TP-split tensors) once: an even stage gives every device 1/tp, an uneven one (SPEC
    # §12, HAP) device i ratios[i] / sum(ratios): it computes, keeps and holds that share of the split work, as if
    # its group had sum / ratios[i] ranks, while its collectives still span the tp ranks
    specs = {(cluster.spec(d).kind, tp if ratios is None else sum(ratios) / r): cluster.spec(d)
             for d, r in zip(stage.devices, ratios or [1] * len(stage.devices))}
    best: _StageCost | None = None
    priced_as: dict[tuple[str, float], _StageCost] = {}
    for (kind, split), spec in specs.items():  # lockstep TP and CP groups: the slowest device sets the pace

        def priced(of: Callable[..., LayerCost], *args: Any, **kw: Any) -> LayerCost:
            mine = of(model, spec, split, link, *args, ratios=ratios, dtype=dtype, **kw)
            if split == tp:
                return mine
            group = of(model, spec, tp, link, *args, ratios=ratios, dtype=dtype, **kw)  # the tp ranks' collectives
            return mine.model_copy(update={"fwd_comm": group.fwd_comm, "bwd_comm": group.bwd_comm})

        layer = priced(layer_cost, micro_batch, seq_len, cost, recompute=stage.recompute, cp=cp, cp_link=cp_link,
                       balanced=balanced)
        parts: list[tuple[Hashable, LayerCost]] = [(("layer", i), layer) for i in range(stage.layers[0],
                                                                                          stage.layers[1] + 1)]
        if first:
            parts.insert(0, (("embedding",), priced(embedding_cost, micro_batch, seq_len, cost, cp=cp)))
        if last:
            parts.append((("head",), priced(head_cost, micro_batch, seq_len, cost, cp=cp)))
        f = _core_share(cluster, stage.devices, cost) if share is None else share  # oversubscribed local CPUs
        sc = _StageCost(fwd=sum(c.fwd_compute * f + c.fwd_comm for _, c in parts),
                        bwd=sum(c.bwd_compute * f + c.bwd_comm for _, c in parts),
                        act_per_mb=sum(c.act_bytes for _, c in parts),
                        transient=max(c.transient_bytes for _, c in parts),
                        units=tuple((u, c.params) for u, c in parts if c.params > 0),
                        fwd_comm=sum(c.fwd_comm for _, c in parts), bwd_comm=sum(c.bwd_comm for _, c in parts),
                        ring_gap_fwd=sum(c.ring_gap_fwd for _, c in parts),
                        ring_gap_bwd=sum(c.ring_gap_bwd for _, c in parts), recompute=stage.recompute,
                        sync_units=_sync_units(model, stage, first, last, cost.include_embedding, tied))
        priced_as[(kind, split)] = sc
        if best is None or sc.fwd + sc.bwd > best.fwd + best.bwd:
            best = sc
    assert best is not None
    if ratios is None:
        return best
    own = [priced_as[(cluster.spec(d).kind, sum(ratios) / r)] for d, r in zip(stage.devices, ratios)]
    return replace(best, memory_of=tuple((d, c.act_per_mb, c.transient, c.units) for d, c in zip(stage.devices, own)))


# ---- data-parallel collectives ----------------------------------------------------------------------------------
StageKey = tuple[int, int]
Bucket = tuple[tuple[StageKey, ...], dict[StageKey, float]]


def _unit_order(unit: Hashable) -> tuple[int]:
    """Model order of a unit: the embedding, the layers by index, the head."""
    return (-1,) if unit[0] == "embedding" else (10**9,) if unit[0] == "head" else (unit[1],)  # type: ignore[index]


def _buckets(costs: dict[StageKey, _StageCost], of: Callable[[_StageCost], tuple] = lambda sc: sc.units
             ) -> list[Bucket]:
    """Runs of model units held by the same stages: ``(holders, params per device of each holder)``, in model
    order (embedding, layers, head).  ``of``: a stage's ``(unit, params)`` (default: its :attr:`_StageCost.units`)."""
    holders: dict[Hashable, dict[StageKey, float]] = {}
    for key, sc in costs.items():
        for unit, params in of(sc):
            holders.setdefault(unit, {})[key] = params
    out: list[Bucket] = []
    for unit in sorted(holders, key=_unit_order):
        hs = tuple(sorted(holders[unit]))
        if out and out[-1][0] == hs:
            for k in hs:
                out[-1][1][k] += holders[unit][k]
        else:
            out.append((hs, dict(holders[unit])))
    return out


def _sync_buckets(costs: dict[StageKey, _StageCost], *, tied: bool = True) -> list[Bucket]:
    """:func:`_buckets` of the values each unit's synchronisation moves (:attr:`_StageCost.sync_units`; the
    units' parameters where a stage cost has none); ``tied=False``: without a tied weight's other uses (the
    ZeRO-1 gather moves the parameter, point-to-point to those)."""
    return _buckets(costs, lambda sc: [(u, n) for u, n in sc.sync_units or sc.units if tied or u[-1] != "tied"])


def _unit_of(where: "int | str") -> Hashable:
    """The model unit of a placement's stage: ``("embedding",)``, ``("layer", i)`` or ``("head",)``."""
    return ("embedding",) if where == "first" else ("head",) if where == "last" else ("layer", where)


@functools.lru_cache(maxsize=64)
def _unit_params(model: "ModelSpec") -> dict[Hashable, tuple[tuple[int, bool], ...]]:
    """Each model unit's parameters as the model places them: ``(elements, split by TP)``; a parameter's use on
    another stage (a tied weight's second placement, GPT-2's embedding in its head) under that stage's unit with
    ``"tied"`` added (``("head", "tied")``): its gradient is synchronised there, before it travels home."""
    placed = placements_by_tensor(model)
    shapes = model.param_shapes()
    out: dict[Hashable, list[tuple[int, bool]]] = {}
    for name, shape in shapes.items():
        p = placed[name]
        out.setdefault(_unit_of(p.where), []).append((math.prod(shape), p.tp_split is not None))
    graph = graph_of(model)
    for p in placed.values():
        if p.kind == "parameter" and p.tensor not in shapes:
            param = _param_of(graph, graph.producer(p.tensor))
            if placed[param].where != p.where:
                out.setdefault(_unit_of(p.where) + ("tied",), []).append((math.prod(shapes[param]),
                                                                            p.tp_split is not None))
    return {u: tuple(v) for u, v in out.items()}


def _unit_elements(model: "ModelSpec", unit: Hashable, num: int, den: int) -> float:
    """Values of ``unit``'s parameters on a device holding ``num / den`` of each TP-split one (and every
    duplicated one whole)."""
    return float(sum(n * num // den if split else n for n, split in _unit_params(model).get(unit, ())))


def _sync_units(model: "ModelSpec", stage: "Stage", first: bool, last: bool, include_embedding: bool,
                tied: bool = False) -> tuple[tuple[Hashable, float], ...]:
    """The values of each unit the stage holds that its gradient synchronisation moves per device: the stage's
    largest share of every TP-split parameter (``1 / tp``, or ``max(ratios) / sum(ratios)``) and every duplicated
    one (norms) whole -- the local gradient a rank of the stage holds, as the Program's ``grad_sync`` plans have
    it.  The embedding and head only with ``include_embedding`` (:class:`CostModel`).  ``tied``: with the uses of
    tied weights the stage holds (:func:`_unit_params`), which have a synchronisation of their own where some
    pipeline puts them on another stage than their parameter."""
    ratios = stage.tp_ratios
    num, den = (1, stage.tp_degree) if ratios is None else (max(ratios), sum(ratios))
    return _held_units(model, stage.layers[0], stage.layers[1], first and include_embedding,
                       last and include_embedding, tied, num, den)


@functools.lru_cache(maxsize=4096)
def _held_units(model: "ModelSpec", lo: int, hi: int, embedding: bool, head: bool, tied: bool, num: int,
                den: int) -> tuple[tuple[Hashable, float], ...]:
    """:func:`_sync_units` of a stage holding layers ``lo..hi`` (and the embedding, the head), cached: the
    planners' searches price the same stages again and again."""
    units: list[Hashable] = [("layer", i) for i in range(lo, hi + 1)]
    if embedding:
        units.insert(0, ("embedding",))
    if head:
        units.append(("head",))
    if tied:
        units = [v for u in units for v in (u, u + ("tied",))]  # type: ignore[operator]
    got = ((u, _unit_elements(model, u, num, den)) for u in units)
    return tuple((u, n) for u, n in got if n > 0)


def _group_link(cluster: "Cluster", stages: list[list[int]]) -> "Link":
    """The slowest link between position-aligned devices of the holder stages (the DP ring; two or more stages)."""
    width = max(len(s) for s in stages)
    # a link is a function of its ends' nodes (and whether they are one rank): each such place asked once, at its
    # first pair (of equal links, min keeps the first, as over every pair)
    first: dict[tuple[int, int, bool], tuple[int, int]] = {}
    for k in range(width):
        for a, b in zip(stages, stages[1:] + stages[:1]):
            x, y = a[k % len(a)], b[k % len(b)]
            first.setdefault((cluster.node_index(x), cluster.node_index(y), x == y), (x, y))
    return min((cluster.link(x, y) for x, y in first.values()), key=lambda l: l.bandwidth)


@dataclass(frozen=True)
class _Sync:
    """One collective of the step's ``PRE`` or ``POST`` phase: the stages taking part and its seconds."""

    holders: tuple[StageKey, ...]
    seconds: float


def _sync_seconds(op: OpKind, values: dict[StageKey, float], n: int, link: "Link", cost: CostModel,
                  dtype: str | None) -> float:
    """A ring ``op`` over ``n`` replicas whose slowest link is ``link``: as long as its slowest holder needs for
    its ``values`` (per device, of ``dtype``: :meth:`CostModel.collective_seconds`).  Both forms of
    :func:`simulate` price their gradient synchronisation and ZeRO-1 gathers here."""
    return max(cost.collective_seconds(op, values[h], n, link, dtype) for h in values)


def _formula_syncs(op: OpKind, buckets: list[Bucket], devices: dict[StageKey, list[int]], cluster: "Cluster",
                   cost: CostModel, cps: dict[StageKey, int] | None = None, dtype: str | None = None) -> list[_Sync]:
    """One collective per bucket from the strategy: its ring spans every replica, ``cps[h]`` of them on a CP stage
    ``h`` (whose CP ranks hold duplicates), so a lone CP stage synchronises too; its link is the slowest of the
    CP rings and of the position-aligned DP ring (:func:`_group_link`).  A bucket of one replica has none.  Where
    CP stages synchronise with other stages, the reduction across them reaches one rank of each CP group, which
    then all-reduces inside its group (the Program's ``SplitAllReduce`` or ``SplitReduceScatter`` then
    ``AllReduce``, of the ZeRO-1 shard after a reduce-scatter): one more collective per CP degree among the
    holders."""
    cps = cps or {}
    out = []
    for holders, params in buckets:
        n = sum(cps.get(h, 1) for h in holders)  # a CP stage holds cp replicas of each of its parameters
        if n < 2:
            continue
        rings = {h: _ring_link(cluster, devices[h]) for h in holders if cps.get(h, 1) > 1}
        links = list(rings.values())
        if len(holders) > 1:
            links.append(_group_link(cluster, [devices[h] for h in holders]))
        link = min(links, key=lambda l: l.bandwidth)
        out.append(_Sync(holders, _sync_seconds(op, {h: params[h] for h in holders}, n, link, cost, dtype)))
        if len(holders) > 1 and op is not OpKind.ALL_GATHER:
            shard = len(holders) if op is OpKind.REDUCE_SCATTER else 1
            for cp in sorted({cps[h] for h in rings}):
                inner = tuple(h for h in rings if cps[h] == cp)
                out.append(_Sync(inner, _sync_seconds(OpKind.ALL_REDUCE, {h: params[h] / shard for h in inner}, cp,
                                                      min((rings[h] for h in inner), key=lambda l: l.bandwidth),
                                                      cost, dtype)))
    return out


def _run_syncs(syncs: list[_Sync], ready: dict[StageKey, float], events: dict[StageKey, list[Event]],
               kind: str) -> dict[StageKey, float]:
    """List-schedule ``syncs`` in the order given: each starts when all its holders are free.  Returns each
    stage's time when its last collective ends."""
    clock = dict(ready)
    for sync in syncs:
        start = max(clock[h] for h in sync.holders)
        for h in sync.holders:
            events[h].append(Event(start, start + sync.seconds, kind))
            clock[h] = start + sync.seconds
    return clock


# ---- a Program's own gradient synchronisation and ZeRO-1 gathers --------------------------------------------------
#: one ring collective of a plan: (its operator's index in the plan, kind, replicas, ring order, values per rank)
Ring = tuple[int, OpKind, int, tuple[int, ...], dict[int, int]]


def _plan_rings(plan: Any, stage_of: Callable[[int], StageKey]) -> list[Ring]:
    """The ring collectives of a ``CommPlan`` over two or more ranks: a bottom-tier group's (its buffer,
    :func:`ring_numel`, on each member), or a slice of a top-tier split collective (the slice on each of its ranks;
    its replicas are its contributors, or, where one owner hands it out (ZeRO-1's gather), the stages it reaches:
    a stage's TP and CP ranks take the same copy).  A slice that reduces onto some of its ranks only is priced as
    the all-reduce of its contributors (an upper bound).  Point-to-point moves (a tied weight's BSR) are not
    rings."""
    out: list[Ring] = []
    for i, op in enumerate(plan.ops):
        if isinstance(op, CollectiveOp) and op.kind in _RING:
            for g in op.groups:
                if len(g.ranks) > 1:
                    n = ring_numel(op.kind, g.in_boxes)
                    out.append((i, op.kind, len(g.ranks), g.ranks, {r: n for r in g.ranks}))
        elif isinstance(op, SplitCollectiveOp) and op.kind in _SPLIT:
            for sl in op.slices:
                if len(sl.ranks) > 1:
                    n = box_numel(sl.box)
                    replicas = len(sl.contributors) if len(sl.contributors) > 1 else \
                        len({stage_of(r) for r in sl.ranks})
                    out.append((i, _SPLIT[op.kind], replicas, sl.ranks, {r: n for r in sl.ranks}))
    return out


def _program_syncs(program: "Program", entries: list[tuple[Hashable, frozenset[int], Any]], cluster: "Cluster",
                   cost: CostModel, dtype: str) -> list[list[_Sync]]:
    """The buckets of ``entries`` (``(model unit, the ranks of the parameter, CommPlan)``) in model order: runs of
    plans whose rings span the same stages (a plan without rings: its parameter's stages) are one bucket (as
    :func:`_buckets`); in a bucket, the rings of one operator kind and replica count (and place in their plans)
    are one collective, whose values per stage are the most one of its ranks holds and whose link the slowest hop
    of any of its rings, priced by :func:`_sync_seconds`; a bucket's collectives run one after another."""
    if not cost.include_embedding:  # the decoder layers only (CostModel.include_embedding)
        entries = [e for e in entries if e[0][0] == "layer"]
    entries = sorted(entries, key=lambda e: _unit_order(e[0]))  # stable: graph order inside a unit
    stage_of = program.stage_of
    runs: list[tuple[tuple[StageKey, ...], list[Ring]]] = []
    for _, ranks, plan in entries:
        rings = _plan_rings(plan, stage_of)
        on = {r for ring in rings for r in ring[3]} if rings else ranks
        holders = tuple(sorted({stage_of(r) for r in on}))
        if runs and runs[-1][0] == holders:
            runs[-1][1].extend(rings)
        else:
            runs.append((holders, list(rings)))
    hops: dict[tuple[int, ...], "Link"] = {}
    out: list[list[_Sync]] = []
    for _, rings in runs:
        groups: dict[tuple[int, OpKind, int], list[Ring]] = {}
        for ring in rings:
            groups.setdefault(ring[:3], []).append(ring)
        bucket = []
        for (_, op, n), group in sorted(groups.items(), key=lambda kv: kv[0][0]):
            per_rank: dict[int, float] = {}
            for *_, ranks, values in group:
                for r, v in values.items():
                    per_rank[r] = per_rank.get(r, 0.0) + v
                if ranks not in hops:
                    hops[ranks] = min((cluster.link(a, b) for a, b in zip(ranks, ranks[1:] + ranks[:1])),
                                      key=lambda l: l.bandwidth)
            values: dict[StageKey, float] = {}
            for r, v in per_rank.items():
                values[stage_of(r)] = max(values.get(stage_of(r), 0.0), v)
            link = min((hops[ring[3]] for ring in group), key=lambda l: l.bandwidth)
            bucket.append(_Sync(tuple(sorted(values)), _sync_seconds(op, values, n, link, cost, dtype)))
        out.append(bucket)
    return out


def _program_phases(program: "Program", cluster: "Cluster", cost: CostModel, dtype: str
                    ) -> tuple[list[_Sync], list[_Sync]]:
    """The Program's ``PRE`` collectives (its parameters' Reshards that run before the step: ZeRO-1's gathers) in
    model order and its ``POST`` ones (every ``grad_sync`` plan, under the unit of the use whose gradient it
    synchronises: a tied weight's head use with the head) last layers first."""
    graph, placed = program.graph, placements_by_tensor(program.model)
    home = {n: frozenset(program.annotations[n].ranks) for n in program.parameters}
    pre = [(_unit_of(placed[n.name].where), home[_param_of(graph, n)], program.comm_plans[n.name])
           for n in graph.reshards if n.name in program.pre_reshards]
    post = [(_unit_of(placed[gs.uses[0]].where), home[gs.param], program.grad_sync_plans[gs.name])
            for gs in program.grad_syncs]
    return ([s for b in _program_syncs(program, pre, cluster, cost, dtype) for s in b],
            [s for b in _program_syncs(program, post, cluster, cost, dtype)[::-1] for s in b])


def _param_of(graph: Any, node: Any) -> str:
    """The parameter a ``PRE`` Reshard moves (through the Reshards before it)."""
    while True:
        src = graph.producer(node.inputs[0])
        if not src.is_reshard:
            return src.outputs[0]
        node = src


# ---- pipeline sends ------------------------------------------------------------------------------------------------
Message = tuple[int, int, float]  # (sender, receiver, values)


@dataclass(frozen=True)
class _Send:
    """One micro-batch's transfer across a stage boundary: its seconds (its busiest sender's), the bytes that
    sender sends (as counted: :attr:`Transfer.nbytes`) and the slowest link (a send's posting cost)."""

    seconds: float
    nbytes: float
    link: "Link"


def _send_of(messages: list[Message], cluster: "Cluster", cost: CostModel, dtype: str | None) -> _Send:
    """The transfer of ``messages``: as long as its busiest sender, which sends its messages one after another
    (the sum of their :meth:`CostModel.p2p_seconds` over each one's link, as :func:`~hspmd_sdk.core.comm_plan.
    time_of` times a plan).  Both forms of :func:`simulate` price their pipeline sends here."""
    itemsize = BF16 if dtype is None else itemsize_of(dtype)
    seconds: dict[int, float] = {}
    values: dict[int, float] = {}
    links = []
    for src, dst, n in messages:
        link = cluster.link(src, dst)
        links.append(link)
        seconds[src] = seconds.get(src, 0.0) + cost.p2p_seconds(n, link, dtype)
        values[src] = values.get(src, 0.0) + n
    busiest = max(seconds, key=lambda s: (seconds[s], values[s]))
    nbytes = values[busiest] * itemsize
    return _Send(seconds[busiest], int(nbytes) if nbytes.is_integer() else nbytes,
                 min(links, key=lambda l: l.bandwidth))


def _formula_sends(model: "ModelSpec", strategy: "Strategy", cluster: "Cluster", seq_len: int, cost: CostModel,
                   dtype: str | None) -> dict[tuple[StageKey, StageKey], _Send]:
    """Every stage boundary's transfer (both directions) from the strategy: :func:`_boundary_messages` of one
    micro-batch's ``micro-batch x seq_len x hidden`` values, priced by :func:`_send_of`."""
    out: dict[tuple[StageKey, StageKey], _Send] = {}
    for i, p in enumerate(strategy.pipelines):
        whole = p.micro_batch_size * seq_len * model.hidden_size
        for j in range(p.num_stages - 1):
            for a, b in ((j, j + 1), (j + 1, j)):
                messages = _boundary_messages(p.stages[a], p.stages[b], whole)
                out[((i, a), (i, b))] = _send_of(messages, cluster, cost, dtype)
    return out


def _boundary_messages(src: "Stage", dst: "Stage", values: float) -> list[Message]:
    """The messages of one activation (or its gradient) of ``values`` values from stage ``src`` to ``dst``: it is
    duplicated on a stage's TP ranks, so every rank of ``dst`` gets its own ``values / dst.cp``, receiver ``i``
    from sender ``i mod len(src.devices)`` (the Program's SendRecv, or its BSR's load-balanced choice)."""
    return [(src.devices[k % len(src.devices)], d, values / dst.cp) for k, d in enumerate(dst.devices)]


def _program_sends(program: "Program", strategy: "Strategy", cluster: "Cluster", seq_len: int, cost: CostModel,
                   dtype: str) -> dict[tuple[StageKey, StageKey], _Send]:
    """Every stage boundary's transfer (both directions) from the Program's own point-to-point operators: the
    messages of its forward Reshards (``comm_plans``) from a stage to the next and of their backward
    (``backward_plans``) back, at one micro-batch of the pipeline (:meth:`Program.micro_batch_plan`) and
    ``seq_len``."""
    bindings = {**program.bindings, "S": seq_len}
    stage_of = {r: (i, j) for i, p in enumerate(program.pipelines) for j, st in enumerate(p) for r in st}
    found: dict[tuple[StageKey, StageKey], set[str]] = {}
    named = [(n, plan) for n, plan in program.comm_plans.items() if n not in program.pre_reshards]
    named += [(f"{n}.bwd", plan) for n, plan in program.backward_plans.items()]
    for name, plan in named:
        for op in plan.ops:
            if isinstance(op, PointToPointOp):
                for src, dst in op.p2p_edges():
                    a, b = stage_of.get(src), stage_of.get(dst)
                    if a is not None and b is not None and a[0] == b[0] and abs(a[1] - b[1]) == 1:
                        found.setdefault((a, b), set()).add(name)
    out: dict[tuple[StageKey, StageKey], _Send] = {}
    for (a, b), names in found.items():
        rank, micro = program.pipelines[a[0]][a[1]][0], strategy.pipelines[a[0]].micro_batch_size
        messages: list[Message] = []
        for name in sorted(names):
            plan = program.micro_batch_plan(name, rank, bindings, micro)
            messages += [(m.src, m.dst, float(box_numel(m.box))) for op in plan.ops if isinstance(op, PointToPointOp)
                         for m in op.messages if m.src != m.dst and stage_of.get(m.src) == a
                         and stage_of.get(m.dst) == b]
        if messages:
            out[(a, b)] = _send_of(messages, cluster, cost, dtype)
    return out


# ---- the simulation -----------------------------------------------------------------------------------------------
def simulate(model: "ModelSpec | str | Program", strategy: "Strategy | str | dict | None" = None,
             cluster: "Cluster | None" = None, *, global_batch: int | None = None, seq_len: int | None = None,
             cost: CostModel | None = None, dtype: str | None = None, label: str = "") -> SimResult:
    """Simulate one training step of ``strategy`` for ``model`` on ``cluster`` with sequences of ``seq_len``, or
    of a specialized :class:`~hspmd_sdk.core.specialize.Program`: ``simulate(program)``.

    ``model`` may be a preset name and ``strategy`` anything :meth:`Strategy.load` reads.  ``global_batch``, if
    given, must equal the strategy's (micro-batch size x count summed over pipelines).  ``cost`` defaults to
    :class:`CostModel`'s analytic defaults.  Raises :class:`PlanValidationError` when the strategy does not fit
    the model, the cluster or the batch.

    ``simulate(program, seq_len=None, cost=None, dtype=None)`` prices the Program's own communication: its
    gradient synchronisation (``grad_sync_plans``) and ZeRO-1 gathers (the ``PRE`` Reshards of its parameters),
    and its pipeline sends (the SendRecv / BSR messages of its stage boundaries, at one micro-batch); compute, TP
    collectives and memory as for the strategy it was specialized from (``plan.settings.strategy``).
    ``seq_len`` defaults to the Program's representative ``S``.

    ``dtype``: the values' type on the wire (``"float32"``, ``"bfloat16"`` for a ``precision="bf16"`` run, which
    sends the same plans in bf16).  For a Program, default: its own (its parameters' dtype, ``float32`` for the
    SDK's models); for a model and strategy, default: the cost model's count (bf16 times
    ``CostModel.comm_bytes_factor``, :meth:`CostModel.wire_bytes`), which the planners' own estimates share.  At
    one ``dtype`` the two forms give the same step (the strategy's formulas place the same values on the same
    links as the Program's plans; a tied weight's point-to-point moves are priced by neither).

    >>> from hspmd_sdk.core.cluster import Cluster
    >>> r = simulate("tiny", {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 4, "stages": [
    ...     {"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}]}]}, Cluster.local(2), seq_len=16)
    >>> len([e for e in r.timeline[1] if e.kind == "F"])
    4
    """
    if isinstance(model, Program):
        if strategy is not None or cluster is not None or global_batch is not None:
            raise TypeError("simulate(program) takes the Program alone (its strategy, cluster and batch are its "
                            "own): pass seq_len=, cost=, dtype=, label= by keyword")
        return _simulate_program(model, seq_len=seq_len, cost=cost, dtype=dtype, label=label)
    if strategy is None or cluster is None or seq_len is None:
        raise TypeError("simulate(model, strategy, cluster, seq_len=...) needs a strategy, a cluster and seq_len "
                        "(or a specialized Program alone: simulate(program))")
    model = load_model_spec(model)
    strategy = Strategy.load(strategy, model=model, cluster=cluster, global_batch=global_batch)
    cost = cost or CostModel()
    sends = _formula_sends(model, strategy, cluster, seq_len, cost, dtype)
    return _simulate_strategy(model, strategy, cluster, seq_len, cost, dtype, sends, None, label)


def _simulate_program(program: "Program", *, seq_len: int | None, cost: CostModel | None, dtype: str | None,
                      label: str) -> SimResult:
    """:func:`simulate` of a Program (see there)."""
    model, strategy, cluster = _program_context(program)
    seq_len = program.bindings["S"] if seq_len is None else seq_len
    cost = cost or CostModel()
    dtype = dtype or _program_dtype(program)
    sends = _program_sends(program, strategy, cluster, seq_len, cost, dtype)
    return _simulate_strategy(model, strategy, cluster, seq_len, cost, dtype, sends,
                              _program_phases(program, cluster, cost, dtype), label)


def _program_context(program: "Program") -> tuple["ModelSpec", "Strategy", "Cluster"]:
    """The model, strategy and cluster a Program was specialized from; a :class:`PlanValidationError` naming what
    is missing (and what to do) when it cannot be simulated."""
    what = "Program for simulate()"
    if isinstance(program, ProgramPart):
        raise PlanValidationError([("program", f"this is rank {program.rank}'s part of a Program; simulate the "
                                               "whole Program")], what=what)
    strategy = program.plan.settings.strategy
    missing = [(field, why) for field, bad, why in (
        ("program.model", program.model is None, "a bare graph has no cost counts: specialize a model config"),
        ("program.cluster", program.cluster is None, "specialize(model, plan, cluster) with the cluster"),
        ("program.plan.settings.strategy", strategy is None,
         "none: specialize a plan made by plan_from_strategy(model, strategy, cluster)")) if bad]
    if missing:
        raise PlanValidationError(missing, what=what)
    s = Strategy.load(strategy, model=program.model, cluster=program.cluster)
    stages = [[sorted(st.devices) for st in p.stages] for p in s.pipelines]
    if stages != [[list(st) for st in p] for p in program.pipelines]:
        raise PlanValidationError([("program.pipelines", f"{program.pipelines} are not the stages of its strategy "
                                    f"{stages}")], what=what)
    return program.model, s, program.cluster


def _program_dtype(program: "Program") -> str:
    """The dtype of a Program's parameters (the values its gradient synchronisation moves)."""
    dtypes = {program.graph.tensors[n].dtype for n in program.parameters}
    if len(dtypes) != 1:
        raise PlanValidationError([("program.parameters", f"of the dtypes {sorted(dtypes)}: pass dtype= (the one on "
                                    "the wire)")], what="Program for simulate()")
    return dtypes.pop()


def _simulate_strategy(model: "ModelSpec", strategy: "Strategy", cluster: "Cluster", seq_len: int, cost: CostModel,
                       dtype: str | None, sends: dict[tuple[StageKey, StageKey], "_Send"],
                       phases: tuple[list[_Sync], list[_Sync]] | None, label: str) -> SimResult:
    """One step of ``strategy`` with its boundary ``sends`` and its ``PRE``/``POST`` collectives (``phases``;
    ``None``: from the stage costs, :func:`_formula_syncs`)."""
    devices = {(i, j): list(st.devices) for i, p in enumerate(strategy.pipelines) for j, st in enumerate(p.stages)}
    memory = {r: m.parts() for r, m in device_memory(strategy, model, cluster, seq_len=seq_len,
                                                       **cost.memory_options()).items()}
    tied = any(p.num_stages > 1 for p in strategy.pipelines)  # a tied weight's uses on two stages: two syncs

    def one(stretch: "Stretch | None") -> SimResult:
        costs = {(i, j): _stage_cost(model, st, j == 0, j == p.num_stages - 1, cluster, p.micro_batch_size, seq_len,
                                     cost, None if stretch is None else 1.0, balanced=p.cp_balance > 1, dtype=dtype,
                                     tied=tied)
                 for i, p in enumerate(strategy.pipelines) for j, st in enumerate(p.stages)}
        run = functools.partial(_run_pipelines, strategy, costs, sends, cost, stretch=stretch)
        return _simulate_step(strategy, cluster, cost, costs, devices, label=label, run=run, stretch=stretch,
                              memory=memory, phases=phases, dtype=dtype)

    return _shared_cores(one, devices, cluster, cost)


def _shared_cores(one: "Callable[[Stretch | None], SimResult]", devices: dict[StageKey, list[int]],
                  cluster: "Cluster", cost: CostModel) -> SimResult:
    """A step simulated by ``one(stretch)`` under processor sharing (``CostModel.cores``): first the bound
    (``stretch=None``: every rank of a node computing at once), then, where some node has more ranks than cores,
    replayed with :func:`_processor_sharing` against the previous timeline until the step time stops changing (the
    fixed point: ranks in a bubble or a collective free their core).  The one place both simulators (fixed
    shapes and :func:`~hspmd_sdk.planner.mixed_sim.simulate_shapes`) share cores."""
    shared = _oversubscribed(cluster, [d for ds in devices.values() for d in ds], cost)
    stretch: Stretch | None = None
    rounds: list[SimResult] = []
    for _ in range(_SHARING_ROUNDS):
        result = one(stretch)
        if not shared or (stretch is not None and abs(result.step_time - rounds[-1].step_time)
                          <= _SHARING_TOL * rounds[-1].step_time):
            return result
        rounds.append(result)
        stretch = _processor_sharing(result, devices, cluster, cost)
    # not converged (the replay can alternate between two timelines): the slower of the last two
    return max(rounds[-2:], key=lambda r: r.step_time)


def _simulate_step(strategy: "Strategy", cluster: "Cluster", cost: CostModel, costs: dict[StageKey, _StageCost],
                   devices: dict[StageKey, list[int]], *, run: Callable[..., tuple[dict, list[Transfer]]],
                   label: str, counted: "Strategy | None" = None,
                   stretch: "Stretch | None" = None, memory: dict[int, dict[str, float]] | None = None,
                   phases: tuple[list[_Sync], list[_Sync]] | None = None, dtype: str | None = None) -> SimResult:
    """One step from the stages' costs: ZeRO-1's parameter all-gather, the pipelines (``run(start, events,
    regather=...)``:
    every stage's clock at its end and the transfers), the gradient synchronisation (last layers first), the
    optimizer; ``memory`` per device (breakdown), default: counted from the stage costs of ``counted`` (default:
    ``strategy``).  ``phases``: the ``PRE`` and ``POST`` collectives (a Program's own), default: the stage
    costs' buckets (:func:`_sync_buckets`) priced at ``dtype`` by :func:`_formula_syncs`."""
    buckets = _buckets(costs)
    events: dict[StageKey, list[Event]] = {k: [] for k in costs}
    if phases is None:
        syncs = _sync_buckets(costs)
        cps = {(i, j): st.cp for i, p in enumerate(strategy.pipelines) for j, st in enumerate(p.stages)}
        post = OpKind.REDUCE_SCATTER if strategy.zero1 else OpKind.ALL_REDUCE
        phases = (_formula_syncs(OpKind.ALL_GATHER, _sync_buckets(costs, tied=False), devices, cluster, cost, None,
                                 dtype) if strategy.zero1 else [],
                  _formula_syncs(post, syncs[::-1], devices, cluster, cost, cps, dtype))

    # 1. PRE: ZeRO-1 parameter all-gather; at ZeRO-3 none, but every F and B gathers its stage's parameters again.
    regather: dict[StageKey, float] = {}
    if strategy.zero >= 3:
        regather = {k: sum(s.seconds for s in phases[0] if k in s.holders) for k in costs}
        phases = ([], phases[1])
    start = _run_syncs(phases[0], {k: 0.0 for k in costs}, events, "comm")

    # 2. The pipelines, replayed with timing.
    clock, transfers = run(start, events, regather=regather)
    pipe_end = [max(clock[(i, j)] for j in range(p.num_stages)) for i, p in enumerate(strategy.pipelines)]
    compute_end = dict(clock)

    # 3. POST: gradient synchronisation (last layers first), then the optimizer.
    clock = _run_syncs(phases[1], clock, events, "sync")
    if memory is None:
        memory = _memory(counted or strategy, cluster, costs, devices, cost)
    owned_by: dict[StageKey, float] = {k: 0 for k in costs}  # the parameters each stage updates, bucket order
    for h, ps in buckets:
        for kk, params in ps.items():
            owned_by[kk] += params / (len(h) if strategy.zero1 else 1)
    for k in costs:
        owned = owned_by[k]
        spec = _slowest_spec(cluster, devices[k], lambda s: cost.optimizer_time(1.0, s))
        dur = cost.optimizer_time(owned, spec)
        dur = dur * _core_share(cluster, devices[k], cost) if stretch is None else stretch(k, clock[k], dur)
        events[k].append(Event(clock[k], clock[k] + dur, "optim"))
        clock[k] += dur
    step = max(clock.values())
    idle = {k: _with_idle(events[k], step) for k in costs}  # one per stage: its devices share its events
    timeline = {d: list(idle[k]) for k in costs for d in devices[k]}
    computes = [e.start for evs in events.values() for e in evs if e.kind == "F"]
    first_f = min(computes) if computes else 0.0
    last_b = max(compute_end.values())
    window = (last_b - first_f) * sum(len(v) for v in devices.values())
    busy = sum(e.duration * len(devices[k]) for k, evs in events.items() for e in evs if e.kind in ("F", "B"))
    peak = {d: sum(parts.values()) for d, parts in memory.items()}
    capacity = {d: cluster.spec(d).memory_mb * 2.0**20 for d in peak}
    return SimResult(step_time=step, timeline=dict(sorted(timeline.items())),
                     bubble_fraction=1.0 - busy / window if window > 0 else 0.0,
                     peak_memory=dict(sorted(peak.items())), memory=dict(sorted(memory.items())),
                     capacity=dict(sorted(capacity.items())),
                     oom=sorted(d for d in peak if peak[d] > capacity[d]), transfers=transfers,
                     pipeline_end=pipe_end, sync_time=step - last_b, label=label or (strategy.name or ""))


def _run_pipelines(strategy: "Strategy", costs: dict[StageKey, _StageCost],
                   sends: dict[tuple[StageKey, StageKey], _Send], cost: CostModel,
                   start: dict[StageKey, float], events: dict[StageKey, list[Event]], *,
                   stretch: "Stretch | None" = None,
                   regather: dict[StageKey, float] | None = None) -> tuple[dict[StageKey, float], list[Transfer]]:
    """Replay every stage's schedule with timing: compute advances the stage's clock, a send occupies its
    (sender, receiver) channel for the transfer time (``sends``) without blocking the sender, a receive waits for
    the data.  ``regather``: ZeRO-3's gather seconds of a stage's parameters, paid by each of its F and B before
    the compute (a ``comm`` event: the prefetch's overlap is not counted), twice by the B of a recomputing stage.  Returns each stage's clock after its
    last action and the transfers."""
    regather = regather or {}
    clock = dict(start)
    channel_free: dict[tuple[StageKey, StageKey], float] = {}
    transfers: list[Transfer] = []

    def execute(key: Hashable, a: Action, payload: object) -> object:
        k: StageKey = key  # type: ignore[assignment]
        sc = costs[k]
        if a.kind in ("F", "B"):
            # a recomputing stage's B gathers twice: for its forward rerun, then for the operators' backward
            gather = regather.get(k, 0.0) * (2 if a.kind == "B" and sc.recompute else 1)
            if gather > 0:
                events[k].append(Event(clock[k], clock[k] + gather, "comm", a.micro_batch))
                clock[k] += gather
            dur = sc.fwd if a.kind == "F" else sc.bwd
            if stretch is not None:  # processor sharing slows the compute, not the TP collectives' wait
                comm = sc.fwd_comm if a.kind == "F" else sc.bwd_comm
                dur = stretch(k, clock[k], dur - comm) + comm
            events[k].append(Event(clock[k], clock[k] + dur, a.kind, a.micro_batch))
            clock[k] += dur
        elif a.kind in ("SEND_F", "SEND_B"):
            dst = (k[0], a.peer)
            send = sends[(k, dst)]
            _post_send(cost, send.link, k, a, clock, events)
            t0 = max(clock[k], channel_free.get((k, dst), 0.0))
            t1 = t0 + send.seconds
            channel_free[(k, dst)] = t1
            transfers.append(Transfer(k[0], k[1], dst[1], a.kind[-1], a.micro_batch or 0, t0, t1, send.nbytes))
            return t1
        elif a.kind in ("RECV_F", "RECV_B"):
            clock[k] = max(clock[k], float(payload))  # type: ignore[arg-type]
        return None

    replay({k: build_schedule(strategy.schedule, strategy.pipelines[k[0]].num_stages, k[1],
                              strategy.pipelines[k[0]].num_micro_batches) for k in costs}, execute)
    return clock, transfers


def _post_send(cost: CostModel, link: "Link", k: Hashable, a: Action, clock: dict, events: dict) -> None:
    """Posting a send keeps the sender busy for :meth:`CostModel.send_time` (a ``comm`` event; none at 0)."""
    busy = cost.send_time(link)
    if busy > 0:
        events[k].append(Event(clock[k], clock[k] + busy, "comm", a.micro_batch))
        clock[k] += busy


def _core_share(cluster: "Cluster", devices: list[int], cost: CostModel) -> float:
    """The compute slowdown of ``devices`` from ``CostModel.cores``: ``max(1, ranks on the node / cores)`` over the
    busiest node among them (1 when ``cores`` is unset)."""
    if not cost.cores:
        return 1.0
    return max(cost.core_share(len(cluster.nodes[cluster.node_index(d)].ranks)) for d in devices)


_SHARING_ROUNDS = 20
#: the fixed point is reached when a round changes the step time by at most this fraction (its later rounds move
#: the 4th digit: a dispatch or a plan chosen at 0.1% is the same choice, at a quarter of the rounds)
_SHARING_TOL = 1e-3
_COMPUTING = ("F", "B", "optim")
Stretch = Callable[[StageKey, float, float], float]  # (stage, start, seconds of work alone) -> seconds it takes


def _oversubscribed(cluster: "Cluster", devices: list[int], cost: CostModel) -> bool:
    """Whether ``CostModel.cores`` is set and some node of ``devices`` has more ranks than cores."""
    return bool(cost.cores) and any(cost.core_share(len(cluster.nodes[cluster.node_index(d)].ranks)) > 1
                                    for d in devices)


def _processor_sharing(result: SimResult, devices: dict[StageKey, list[int]], cluster: "Cluster",
                       cost: CostModel) -> Stretch:
    """Processor sharing against ``result``'s timeline: a stage's work starting at ``t`` progresses at
    ``min(1, cores / n)`` where ``n`` is the number of ranks of its node computing then (itself and the others'
    forward, backward and optimizer intervals on ``result``); a TP group takes its slowest device.  Replaying the
    step with it until the step time stops changing is the fixed point (ranks in a bubble or a collective free
    their core)."""
    assert cost.cores
    cores = cost.cores
    busy = {d: [(e.start, e.end) for e in evs if e.kind in _COMPUTING and e.end > e.start]
            for d, evs in result.timeline.items()}
    node_of = {d: cluster.node_index(d) for d in busy}
    others: dict[int, tuple[list[float], list[int]]] = {}  # device -> (cut points, others computing from each)
    for d in busy:
        edges = sorted((t, delta) for o in busy if o != d and node_of[o] == node_of[d]
                       for s, e in busy[o] for t, delta in ((s, 1), (e, -1)))
        cuts, counts, n = [], [], 0
        for t, delta in edges:
            n += delta
            if cuts and cuts[-1] == t:
                counts[-1] = n
            else:
                cuts.append(t)
                counts.append(n)
        others[d] = (cuts, counts)

    def one(d: int, t: float, work: float) -> float:
        cuts, counts = others[d]
        i = bisect.bisect_right(cuts, t) - 1
        clock, left = t, work
        while True:
            n = 1 + (counts[i] if i >= 0 else 0)
            rate = min(1.0, cores / n)
            nxt = cuts[i + 1] if i + 1 < len(cuts) else math.inf
            if left <= rate * (nxt - clock):
                return clock + left / rate - t
            left -= rate * (nxt - clock)
            clock, i = nxt, i + 1

    return lambda k, t, work: max(one(d, t, work) for d in devices[k]) if work > 0 else 0.0


def _slowest_spec(cluster: "Cluster", devices: list[int], time_of: Callable[["DeviceSpec"], float]) -> "DeviceSpec":
    """The spec among ``devices`` for which ``time_of`` is largest (the TP group's pace-setter)."""
    return max((cluster.spec(d) for d in devices), key=time_of)


def _memory(strategy: "Strategy", cluster: "Cluster", costs: dict[StageKey, _StageCost],
            devices: dict[StageKey, list[int]], cost: CostModel) -> dict[int, dict[str, float]]:
    """Per-device bytes from the stages' costs (a mixed-length step's shapes): params, grads, optimizer (ZeRO-1:
    divided by the holders of each unit), activations, reserve (the device's runtime,
    :meth:`CostModel.runtime_bytes`).  A device of an uneven stage (``ratios``) counts its own share
    (:attr:`_StageCost.memory_of`).  For fixed shapes it is :func:`~hspmd_sdk.core.memory.device_memory`'s."""
    holders_of: dict[Hashable, int] = {}
    for sc in costs.values():
        for unit, _ in sc.units:
            holders_of[unit] = holders_of.get(unit, 0) + 1
    out: dict[int, dict[str, float]] = {}
    for k, sc in costs.items():
        p = strategy.pipelines[k[0]]
        held = in_flight(strategy.schedule, p.num_stages, k[1], p.num_micro_batches)
        own = {d: (act, transient, units) for d, act, transient, units in sc.memory_of}
        for d in devices[k]:
            act, transient, units = own.get(d, (sc.act_per_mb, sc.transient, sc.units))
            parts = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
            for unit, params in units:
                for name, b in static_memory(params, holders_of[unit] if strategy.zero1 else 1).items():
                    parts[name] += b
            parts["activations"] = act * held + transient
            parts["reserve"] = cost.runtime_bytes(cluster.kind(d))
            out[d] = parts
    return out


def _with_idle(events: list[Event], end: float) -> list[Event]:
    """``events`` sorted, with ``idle`` events filling the gaps in ``[0, end]``."""
    out: list[Event] = []
    t = 0.0
    for e in sorted(events, key=lambda e: e.start):
        if e.start > t + 1e-12:
            out.append(Event(t, e.start, "idle"))
        out.append(e)
        t = max(t, e.end)
    if end > t + 1e-12:
        out.append(Event(t, end, "idle"))
    return out
