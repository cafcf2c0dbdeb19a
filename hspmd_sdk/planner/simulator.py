"""An event-driven simulation of one training step of a strategy on a cluster (§8's "evaluate a plan").

The step follows the schedules the runtime executes (:func:`hspmd_sdk.core.schedule.build_schedule`), replayed
together by :func:`hspmd_sdk.core.schedule.replay` with a timing callback:

1. ``PRE`` (ZeRO-1 only): all-gather of the bf16 parameters across the replicas holding each layer;
2. every pipeline runs its own micro-batches (count and size per pipeline): ``F``/``B`` take the stage's compute
   time plus its TP collectives, those of the model's own specialized Program (:mod:`.tp_comm`), priced as ring
   collectives (the slowest device kind of the TP group sets the pace); activations and
   gradients move between neighbouring stages point-to-point over :meth:`Cluster.link`, one transfer at a time
   per direction, without blocking the sender beyond posting it (:meth:`CostModel.send_time`, a ``comm`` event;
   0 unless a measured link says otherwise); a receive waits for its data;
3. ``POST``: gradient synchronisation after each stage's last backward (ring all-reduce, or reduce-scatter with
   ZeRO-1) in *buckets*: runs of layers held by the same set of stages (for heterogeneous pipelines whose stages
   hold different layer ranges, HSPMD's SplitAllReduce/SplitReduceScatter); a bucket starts when all its holders
   are ready and runs at the pace of its slowest holder and link; then the Adam update of the parameters each
   device owns.

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

from ..core.comm_ops import OpKind
from ..core.memory import device_memory
from ..core.schedule import Action, build_schedule, in_flight, replay
from ..core.strategy import Strategy
from ..models.registry import load_model_spec
from .cost import BF16, CostModel, LayerCost, embedding_cost, head_cost, layer_cost, static_memory

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


def _ring_link(cluster: "Cluster", devices: list[int]) -> "Link":
    """The slowest link of a ring over ``devices``."""
    if len(devices) == 1:
        return cluster.link(devices[0], devices[0])
    links = [cluster.link(devices[k], devices[(k + 1) % len(devices)]) for k in range(len(devices))]
    return min(links, key=lambda l: l.bandwidth)


def _stage_cost(model: "ModelSpec", stage: "Stage", first: bool, last: bool, cluster: "Cluster",
                micro_batch: int, seq_len: int, cost: CostModel, share: float | None = None, *,
                balanced: bool = False) -> _StageCost:
    """The stage's forward/backward seconds of one micro-batch, activation and transient bytes, parameters per
    unit.  ``share``: the compute slowdown of its devices (default :func:`_core_share`, every rank of the node
    computing at once).  A CP stage (``stage.cp > 1``) is priced per rank of its ``cp x tp`` grid
    (:func:`~.cost.layer_cost`'s ``cp``; ``balanced``: the load-balanced chunk layout)."""
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
            mine = of(model, spec, split, link, *args, ratios=ratios, **kw)
            if split == tp:
                return mine
            group = of(model, spec, tp, link, *args, ratios=ratios, **kw)  # the collectives of the group's tp ranks
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
                        ring_gap_bwd=sum(c.ring_gap_bwd for _, c in parts), recompute=stage.recompute)
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


def _buckets(costs: dict[StageKey, _StageCost]) -> list[tuple[tuple[StageKey, ...], dict[StageKey, float]]]:
    """Runs of model units held by the same stages: ``(holders, params per device of each holder)``, in model
    order (embedding, layers, head)."""
    holders: dict[Hashable, dict[StageKey, float]] = {}
    for key, sc in costs.items():
        for unit, params in sc.units:
            holders.setdefault(unit, {})[key] = params
    order = sorted(holders, key=lambda u: (-1,) if u[0] == "embedding" else (10**9,) if u[0] == "head"
                   else (u[1],))
    out: list[tuple[tuple[StageKey, ...], dict[StageKey, float]]] = []
    for unit in order:
        hs = tuple(sorted(holders[unit]))
        if out and out[-1][0] == hs:
            for k in hs:
                out[-1][1][k] += holders[unit][k]
        else:
            out.append((hs, dict(holders[unit])))
    return out


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


def _run_collectives(op: OpKind, buckets: list[tuple[tuple[StageKey, ...], dict[StageKey, float]]],
                     ready: dict[StageKey, float], devices: dict[StageKey, list[int]], cluster: "Cluster",
                     cost: CostModel, events: dict[StageKey, list[Event]], kind: str,
                     cps: dict[StageKey, int] | None = None) -> dict[StageKey, float]:
    """List-schedule one collective per bucket (in the order given): it starts when all holders are free and
    lasts as long as its slowest holder needs; its ring spans every replica, ``cps[h]`` of them on a CP stage ``h``
    (whose CP ranks hold duplicates), so a lone CP stage synchronises too.  Returns each stage's time when its last
    collective ends."""
    cps = cps or {}
    clock = dict(ready)
    for holders, params in buckets:
        n = sum(cps.get(h, 1) for h in holders)  # a CP stage holds cp replicas of each of its parameters
        if n < 2:
            continue
        links = [_ring_link(cluster, devices[h]) for h in holders if cps.get(h, 1) > 1]
        if len(holders) > 1:
            links.append(_group_link(cluster, [devices[h] for h in holders]))
        link = min(links, key=lambda l: l.bandwidth)
        dur = max(cost.collective_time(op, params[h] * BF16, n, link) for h in holders)
        start = max(clock[h] for h in holders)
        for h in holders:
            events[h].append(Event(start, start + dur, kind))
            clock[h] = start + dur
    return clock


# ---- the simulation -----------------------------------------------------------------------------------------------
def simulate(model: "ModelSpec | str", strategy: "Strategy | str | dict", cluster: "Cluster", *,
             global_batch: int | None = None, seq_len: int, cost: CostModel | None = None,
             label: str = "") -> SimResult:
    """Simulate one training step of ``strategy`` for ``model`` on ``cluster`` with sequences of ``seq_len``.

    ``model`` may be a preset name and ``strategy`` anything :meth:`Strategy.load` reads.  ``global_batch``, if
    given, must equal the strategy's (micro-batch size x count summed over pipelines).  ``cost`` defaults to
    :class:`CostModel`'s analytic defaults.  Raises :class:`PlanValidationError` when the strategy does not fit
    the model, the cluster or the batch.

    >>> from hspmd_sdk.core.cluster import Cluster
    >>> r = simulate("tiny", {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 4, "stages": [
    ...     {"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}]}]}, Cluster.local(2), seq_len=16)
    >>> len([e for e in r.timeline[1] if e.kind == "F"])
    4
    """
    model = load_model_spec(model)
    strategy = Strategy.load(strategy, model=model, cluster=cluster, global_batch=global_batch)
    cost = cost or CostModel()
    devices = {(i, j): list(st.devices) for i, p in enumerate(strategy.pipelines) for j, st in enumerate(p.stages)}
    memory = {r: m.parts() for r, m in device_memory(strategy, model, cluster, seq_len=seq_len,
                                                       **cost.memory_options()).items()}

    def one(stretch: "Stretch | None") -> SimResult:
        costs = {(i, j): _stage_cost(model, st, j == 0, j == p.num_stages - 1, cluster, p.micro_batch_size, seq_len,
                                     cost, None if stretch is None else 1.0, balanced=p.cp_balance > 1)
                 for i, p in enumerate(strategy.pipelines) for j, st in enumerate(p.stages)}
        run = functools.partial(_run_pipelines, model, strategy, cluster, seq_len, cost, costs, devices,
                                stretch=stretch)
        return _simulate_step(strategy, cluster, cost, costs, devices, label=label, run=run, stretch=stretch,
                              memory=memory)

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
                   stretch: "Stretch | None" = None, memory: dict[int, dict[str, float]] | None = None) -> SimResult:
    """One step from the stages' costs: ZeRO-1's parameter all-gather, the pipelines (``run(start, events)``:
    every stage's clock at its end and the transfers), the gradient synchronisation (last layers first), the
    optimizer; ``memory`` per device (breakdown), default: counted from the stage costs of ``counted`` (default:
    ``strategy``)."""
    buckets = _buckets(costs)
    events: dict[StageKey, list[Event]] = {k: [] for k in costs}

    # 1. PRE: ZeRO-1 parameter all-gather.
    start = {k: 0.0 for k in costs}
    if strategy.zero1:
        start = _run_collectives(OpKind.ALL_GATHER, buckets, start, devices, cluster, cost, events, "comm")

    # 2. The pipelines, replayed with timing.
    clock, transfers = run(start, events)
    pipe_end = [max(clock[(i, j)] for j in range(p.num_stages)) for i, p in enumerate(strategy.pipelines)]
    compute_end = dict(clock)

    # 3. POST: gradient synchronisation (last layers first), then the optimizer.
    op = OpKind.REDUCE_SCATTER if strategy.zero1 else OpKind.ALL_REDUCE
    cps = {(i, j): st.cp for i, p in enumerate(strategy.pipelines) for j, st in enumerate(p.stages)}
    clock = _run_collectives(op, buckets[::-1], clock, devices, cluster, cost, events, "sync", cps)
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


def _run_pipelines(model: "ModelSpec", strategy: "Strategy", cluster: "Cluster", seq_len: int, cost: CostModel,
                   costs: dict[StageKey, _StageCost], devices: dict[StageKey, list[int]],
                   start: dict[StageKey, float], events: dict[StageKey, list[Event]], *,
                   stretch: "Stretch | None" = None) -> tuple[dict[StageKey, float], list[Transfer]]:
    """Replay every stage's schedule with timing: compute advances the stage's clock, a send occupies its
    (sender, receiver) channel for the transfer time without blocking the sender, a receive waits for the data.
    Returns each stage's clock after its last action and the transfers."""
    clock = dict(start)
    channel_free: dict[tuple[StageKey, StageKey], float] = {}
    transfers: list[Transfer] = []
    slowest: dict[tuple[StageKey, StageKey], "Link"] = {}  # the slowest link of a stage pair (asked once per pair)

    def link_of(k: StageKey, dst: StageKey) -> "Link":
        if (k, dst) not in slowest:
            slowest[(k, dst)] = min((cluster.link(s, d) for s, d in zip(devices[k], devices[dst])),
                                    key=lambda l: l.bandwidth)
        return slowest[(k, dst)]

    def execute(key: Hashable, a: Action, payload: object) -> object:
        k: StageKey = key  # type: ignore[assignment]
        sc, p = costs[k], strategy.pipelines[k[0]]
        if a.kind in ("F", "B"):
            dur = sc.fwd if a.kind == "F" else sc.bwd
            if stretch is not None:  # processor sharing slows the compute, not the TP collectives' wait
                comm = sc.fwd_comm if a.kind == "F" else sc.bwd_comm
                dur = stretch(k, clock[k], dur - comm) + comm
            events[k].append(Event(clock[k], clock[k] + dur, a.kind, a.micro_batch))
            clock[k] += dur
        elif a.kind in ("SEND_F", "SEND_B"):
            dst = (k[0], a.peer)
            nbytes = p.micro_batch_size * seq_len * model.hidden_size * BF16
            link = link_of(k, dst)
            _post_send(cost, link, k, a, clock, events)
            t0 = max(clock[k], channel_free.get((k, dst), 0.0))
            t1 = t0 + cost.p2p_time(nbytes, link)
            channel_free[(k, dst)] = t1
            transfers.append(Transfer(k[0], k[1], dst[1], a.kind[-1], a.micro_batch or 0, t0, t1, nbytes))
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
