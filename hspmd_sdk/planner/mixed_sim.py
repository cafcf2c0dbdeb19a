"""Simulating mixed-length steps, and the two baselines of scenario (c) (paper §9 (c), Appendix C.4).

* :func:`simulate_shapes` is the step simulator (:func:`hspmd_sdk.planner.simulate`) for pipelines whose
  micro-batches each have their own padded shape ``(rows, length)``: the same ZeRO-1 gather, schedule replay
  (:func:`hspmd_sdk.core.schedule.replay`), bucketed gradient synchronisation and optimizer, with every ``F``/``B``
  timed at its own micro-batch's shape and every transfer sized by it.  :func:`~hspmd_sdk.planner.mixed.
  simulate_dispatch` runs it on what :func:`~hspmd_sdk.planner.mixed.dispatch` decided, so its ``step_time`` is the
  prediction to report beside a measured step.
* :func:`packed_baseline` is the Megatron/DeepSpeed way: every sequence packed into context-length windows
  (best-fit decreasing, :func:`pack`; attention over the whole window), one symmetric strategy (DP x TP x PP, even
  layers, with or without recomputation, on all devices or on one kind's), the fastest in the simulator.
* :func:`plan_hotspa` / :func:`simulate_hotspa` are the HotSPa way: length buckets, one homogeneous strategy per
  bucket over all devices (Table 14), each step runs the buckets one after another with gradient accumulation,
  switching strategy between buckets (:func:`~hspmd_sdk.planner.mixed_cost.switch_estimate` per switch), and
  synchronises gradients once.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from typing import TYPE_CHECKING, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ..core.schedule import Action, build_schedule, replay
from ..core.strategy import Strategy
from ..errors import PlanValidationError
from ..models.registry import load_model_spec
from .cost import CostModel
from .hetero import tp_degrees
from .mixed_cost import PipelineCost, switch_estimate
from .simulator import (Event, SimResult, Stretch, Transfer, _boundary_messages, _core_share, _post_send, _send_of,
                        _shared_cores, _simulate_step, _stage_cost, simulate)

if TYPE_CHECKING:  # pragma: no cover
    from ..core.cluster import Cluster
    from ..core.model_spec import ModelSpec
    from ..core.strategy import Pipeline, Stage

__all__ = ["simulate_shapes", "sample_batch", "pack", "packed_baseline", "HotSPaPlan", "plan_hotspa",
           "simulate_hotspa", "HotSPaStep"]

Shape = tuple[int, ...]  # (rows, padded length) or (1, tokens, sum of squared lengths): a packed row


# ---- the simulation of one dispatched step ------------------------------------------------------------------------
def simulate_shapes(model: "ModelSpec | str", strategy: "Strategy", cluster: "Cluster",
                    shapes: Sequence[Sequence[Shape]], *, cost: CostModel | None = None,
                    label: str = "", cache: dict | None = None) -> SimResult:
    """Simulate one step of ``strategy`` in which pipeline ``p`` runs micro-batches of ``shapes[p]`` (each
    ``(rows, padded length)``, or ``(1, tokens, sum of squared lengths)`` for a row packing sequences, in that
    order; an empty list: the pipeline computes nothing but takes part in the gradient synchronisation).  The strategy's own micro-batch fields are ignored.  Memory: the in-flight
    micro-batches are counted at the largest activation among the pipeline's micro-batches (an upper bound; on an
    uneven stage each device's own share, :func:`_own_memory`).
    ``cache``: stage costs kept across calls for one model and cost model (:meth:`PipelineCost.of`; a dispatcher
    simulates every step)."""
    model = load_model_spec(model)
    cost = cost or CostModel()
    if len(shapes) != strategy.dp_degree:
        raise ValueError(f"shapes has {len(shapes)} pipelines; the strategy has {strategy.dp_degree}")
    ref = max((shape[1] for mbs in shapes for shape in mbs), default=1)
    pipes = [PipelineCost.of(model, p, cluster, cost, {} if cache is None else cache) for p in strategy.pipelines]
    costs, devices, lines = {}, {}, {}
    for i, p in enumerate(strategy.pipelines):
        for j, st in enumerate(p.stages):
            ends = (j == 0, j == p.num_stages - 1)
            sc = _stage_cost(model, st, *ends, cluster, 1, ref, cost, balanced=p.cp_balance > 1)
            mem = [pipes[i].stages[j].memory(*shape) for shape in shapes[i]] or [(0.0, 0.0)]
            costs[(i, j)] = dataclasses.replace(sc, act_per_mb=max(a for a, _ in mem),
                                                transient=max(t for _, t in mem),
                                                memory_of=_own_memory(model, st, ends, cluster, cost, p, shapes[i],
                                                                      sc.memory_of))
            devices[(i, j)] = list(st.devices)
            lines[(i, j)] = pipes[i].stages[j]
    counted = strategy.model_copy(update={"pipelines": [
        p.model_copy(update={"num_micro_batches": max(1, len(mbs))}) for p, mbs in zip(strategy.pipelines, shapes)]})

    # every micro-batch's (forward, backward) seconds and their collectives' part, once: processor sharing
    # replays the step several times
    work = {k: [line.times(*shape) + line.comm(*shape) for shape in shapes[k[0]]] for k, line in lines.items()}

    def one(stretch: "Stretch | None") -> SimResult:
        return _simulate_step(strategy, cluster, cost, costs, devices, label=label, counted=counted, stretch=stretch,
                              run=lambda start, events, **_: _replay(model, strategy, cluster, shapes, cost, work,
                                                                devices, start, events, stretch))
    return _shared_cores(one, devices, cluster, cost)


def _own_memory(model: "ModelSpec", stage: "Stage", ends: tuple[bool, bool], cluster: "Cluster", cost: CostModel,
                pipe: "Pipeline", shapes: Sequence[Shape], own: tuple) -> tuple:
    """An uneven stage's (``ratios``) per-device memory (:attr:`~.simulator._StageCost.memory_of`: device,
    activation bytes per micro-batch, transient bytes, units) at the largest of its pipeline's micro-batches, each
    device's own share priced at each micro-batch's rows and length (a packed row ``(1, tokens, sum of squares)``
    as one row of ``tokens``: an upper bound); no activations where the pipeline has no micro-batches.  ``()`` (an
    even stage) stays ``()``."""
    if not own:
        return own
    at = [_stage_cost(model, stage, *ends, cluster, rows, length, cost, balanced=pipe.cp_balance > 1).memory_of
          for rows, length in dict.fromkeys((shape[0], shape[1]) for shape in shapes)]
    return tuple((d, max((m[n][1] for m in at), default=0.0), max((m[n][2] for m in at), default=0.0), units)
                 for n, (d, _, _, units) in enumerate(own))


def _replay(model: "ModelSpec", strategy: "Strategy", cluster: "Cluster", shapes: Sequence[Sequence[Shape]],
            cost: CostModel, work: dict, devices: dict, start: dict, events: dict,
            stretch: "Stretch | None" = None) -> tuple[dict, list[Transfer]]:
    """Every stage's schedule replayed with each micro-batch timed at its own shape (as the simulator's
    ``_run_pipelines``: a send occupies its channel without blocking the sender beyond posting it, a receive waits
    for the data).
    ``work[stage][mb]``: the micro-batch's forward and backward seconds and their collectives' part.
    ``stretch``: processor sharing (the lines' compute is at every rank of the node computing at once; their
    collectives are not stretched)."""
    clock = dict(start)
    shares = {k: _core_share(cluster, devices[k], cost) for k in work}
    channel_free: dict = {}
    sends: dict = {}  # (stage, peer, rows x length) -> the simulator's priced transfer (_send_of)
    transfers: list[Transfer] = []

    def execute(key: object, a: Action, payload: object) -> object:
        k = key  # (pipeline, stage)
        if a.kind in ("F", "B"):
            f, b, fc, bc = work[k][a.micro_batch]  # type: ignore[index]
            dur = f if a.kind == "F" else b
            if stretch is not None:
                comm = fc if a.kind == "F" else bc
                dur = stretch(k, clock[k], (dur - comm) / shares[k]) + comm
            events[k].append(Event(clock[k], clock[k] + dur, a.kind, a.micro_batch))
            clock[k] += dur
        elif a.kind in ("SEND_F", "SEND_B"):
            dst = (k[0], a.peer)  # type: ignore[index]
            shape = shapes[k[0]][a.micro_batch]  # type: ignore[index]
            values = shape[0] * shape[1] * model.hidden_size  # rows x (padded) length
            send = sends.get((k, dst, values))
            if send is None:
                stages = strategy.pipelines[k[0]].stages
                send = sends[(k, dst, values)] = _send_of(_boundary_messages(stages[k[1]], stages[dst[1]], values),
                                                          cluster, cost, None)
            _post_send(cost, send.link, k, a, clock, events)
            t0 = max(clock[k], channel_free.get((k, dst), 0.0))
            t1 = t0 + send.seconds
            channel_free[(k, dst)] = t1
            transfers.append(Transfer(k[0], k[1], dst[1], a.kind[-1], a.micro_batch or 0, t0, t1, send.nbytes))
            return t1
        elif a.kind in ("RECV_F", "RECV_B"):
            clock[k] = max(clock[k], float(payload))  # type: ignore[arg-type]
        return None

    schedules = {(i, j): build_schedule(strategy.schedule, p.num_stages, j, len(shapes[i]))
                 for i, p in enumerate(strategy.pipelines) if shapes[i] for j in range(p.num_stages)}
    replay(schedules, execute)
    return clock, transfers


# ---- the length sample, packing and the homogeneous strategies of the baselines -----------------------------------
def sample_batch(lengths: Sequence[int], tokens: int, *, seed: int = 0) -> list[int]:
    """Draw sequences from ``lengths`` (with replacement) until they hold ``tokens`` tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        x = int(lengths[int(rng.integers(len(lengths)))])
        out.append(x)
        total += x
    return out


def pack(lengths: Iterable[int], window: int) -> list[list[int]]:
    """Best-fit decreasing: sequences (each at most ``window``) into windows of ``window`` tokens (the baselines'
    packing, several documents a row)."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # sorted (remaining, bin index)
    for x in sorted(lengths, reverse=True):
        if x > window:
            raise ValueError(f"a sequence of {x} tokens does not fit a window of {window}")
        i = bisect.bisect_left(room, (x, -1))
        if i < len(room):
            left, b = room.pop(i)
            bins[b].append(x)
            bisect.insort(room, (left - x, b))
        else:
            bins.append([x])
            bisect.insort(room, (window - x, len(bins) - 1))
    return bins


def _homogeneous(model: "ModelSpec", cluster: "Cluster") -> list[tuple[list[int], int, int, bool]]:
    """Every symmetric strategy shape ``(ranks, TP, PP, recompute)``: on all devices, and on the devices of each
    kind alone when there are several (a symmetric strategy may leave the slower kind idle); TP a power of two the
    model takes that divides every node used (TP groups inside nodes), PP a power of two up to 8."""
    subsets = [[r for n in cluster.nodes for r in n.ranks]]
    if len(cluster.kinds()) > 1:
        subsets += [[r for n in cluster.nodes if n.kind == k for r in n.ranks] for k in cluster.kinds()]
    out = []
    for ranks in subsets:
        sizes = {len(n.ranks) for n in cluster.nodes if n.ranks[0] in set(ranks)}
        tps = [t for t in tp_degrees(model, min(sizes)) if all(x % t == 0 for x in sizes)]
        out += [(ranks, t, p, rc) for t in tps for p in (1, 2, 4, 8) for rc in (False, True)
                if p <= model.num_layers and len(ranks) % (t * p) == 0]
    return out


def _homogeneous_strategy(model: "ModelSpec", ranks: Sequence[int], tp: int, pp: int, recompute: bool, per: int, *,
                          schedule: str, zero1: bool, name: str) -> Strategy:
    dp, L = len(ranks) // (tp * pp), model.num_layers
    pipes = []
    for d in range(dp):
        base, first, stages = d * tp * pp, 0, []
        for s in range(pp):
            cnt = L // pp + (1 if s < L % pp else 0)
            stages.append({"devices": list(ranks[base + s * tp:base + (s + 1) * tp]),
                           "layers": [first, first + cnt - 1], "recompute": recompute})
            first += cnt
        pipes.append({"stages": stages, "micro_batch_size": 1, "num_micro_batches": per})
    return Strategy.load({"pipelines": pipes, "schedule": schedule, "zero1": zero1, "name": name})


def _best_homogeneous(model: "ModelSpec", cluster: "Cluster", windows: Sequence[int], window: int,
                      cost: CostModel | None, *, schedule: str, zero1: bool,
                      label: str) -> tuple[Strategy, float] | None:
    """The symmetric strategy with the smallest mean simulated time over steps of ``windows[k]`` packed windows of
    ``window`` tokens (spread evenly over its pipelines), among those that fit in memory at any micro-batch count
    (checked at the larger of the most micro-batches and the number of stages).  Returns it (with the micro-batch
    count of the first step) and that mean."""
    best: tuple[Strategy, float] | None = None
    for ranks, tp, pp, rc in _homogeneous(model, cluster):
        dp = len(ranks) // (tp * pp)
        kinds = "+".join(sorted({cluster.kind(r) for r in ranks}))
        name = f"{label} DP{dp}TP{tp}PP{pp}{'+AC' if rc else ''} on {len(ranks)} {kinds} at {window}"
        runs: dict[int, SimResult] = {}

        def run(per: int) -> SimResult:
            if per not in runs:
                s = _homogeneous_strategy(model, ranks, tp, pp, rc, per, schedule=schedule, zero1=zero1, name=name)
                runs[per] = simulate(model, s, cluster, seq_len=window, cost=cost)
            return runs[per]

        pers = [max(1, math.ceil(w / dp)) for w in windows]
        if run(max(max(pers), pp)).oom:
            continue
        mean = sum(run(p).step_time for p in pers) / len(pers)
        if best is None or mean < best[1]:
            best = (_homogeneous_strategy(model, ranks, tp, pp, rc, pers[0], schedule=schedule, zero1=zero1,
                                          name=name), mean)
    return best


def packed_baseline(model: "ModelSpec | str", cluster: "Cluster", batch: Sequence[int], *, context_len: int,
                    cost: CostModel | None = None, schedule: str = "1f1b",
                    zero1: bool = True) -> tuple[Strategy, float]:
    """Standard SPMD (Megatron/DeepSpeed): the step's sequences packed into ``context_len`` windows, one
    symmetric strategy (every DP x TP x PP with even layers, with and without recomputation, TP groups inside
    nodes, on all devices or on one device kind's), the fastest in the simulator that fits in memory -- chosen for
    this step, which favours the baseline over one fixed strategy.  Returns the strategy and its simulated step time."""
    model = load_model_spec(model)
    windows = len(pack([min(int(x), context_len) for x in batch], context_len))
    best = _best_homogeneous(model, cluster, [windows], context_len, cost, schedule=schedule, zero1=zero1,
                             label="packed baseline")
    if best is None:
        raise PlanValidationError([("context_len", f"no homogeneous strategy of {model.name} on {cluster.num_ranks} "
                                                   f"devices fits {context_len}-token windows")], what="baseline")
    return best


# ---- HotSPa --------------------------------------------------------------------------------------------------------
class HotSPaPlan(BaseModel):
    """HotSPa's plan: bucket upper bounds (tokens, increasing, the last the context) and one homogeneous strategy
    per bucket (its micro-batch counts are those of a typical step)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    buckets: list[int] = Field(min_length=1)
    strategies: list[Strategy] = Field(min_length=1)

    def summary(self) -> str:
        lo, lines = 0, ["HotSPa plan:"]
        for b, s in zip(self.buckets, self.strategies):
            lines.append(f"  ({lo}, {b}]: {s.name}")
            lo = b
        return "\n".join(lines)


def _default_buckets(context_len: int) -> list[int]:
    """Table 14's intervals: 4K, 16K, then the context (for 32K: 0-4K, 4K-16K, 16K-32K)."""
    return sorted({b for b in (4096, 16384) if b < context_len} | {context_len})


def _bucketed(batch: Sequence[int], buckets: Sequence[int]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in buckets]
    for x in batch:
        out[min(bisect.bisect_left(buckets, x), len(buckets) - 1)].append(min(int(x), buckets[-1]))
    return out


def plan_hotspa(model: "ModelSpec | str", cluster: "Cluster", lengths: Sequence[int], *, tokens_per_batch: int,
                context_len: int, buckets: Sequence[int] | None = None, cost: CostModel | None = None,
                schedule: str = "1f1b", zero1: bool = True, steps: int = 8, seed: int = 0) -> HotSPaPlan:
    """HotSPa's pre-defined strategies: for each length bucket (default: 4K, 16K, context), the symmetric strategy
    with the smallest mean simulated time for that bucket's packed windows over ``steps`` steps of
    ``tokens_per_batch`` tokens drawn from the length sample ``lengths`` (:func:`sample_batch`
    with seeds ``seed, seed + 1, ...``), fitting in memory at any micro-batch count."""
    model = load_model_spec(model)
    buckets = sorted(set(buckets or _default_buckets(context_len)))
    if buckets[-1] != context_len:
        raise PlanValidationError([("buckets", f"the last bucket must end at the context ({context_len}); got "
                                               f"{buckets}")], what="HotSPa plan")
    sample = [min(int(x), context_len) for x in lengths if x > 0]
    counts: list[list[int]] = [[] for _ in buckets]
    for k in range(steps):
        for b, seqs in enumerate(_bucketed(sample_batch(sample, tokens_per_batch, seed=seed + k), buckets)):
            counts[b].append(len(pack(seqs, buckets[b])))
    strategies = []
    for b, window in enumerate(buckets):
        best = _best_homogeneous(model, cluster, [max(1, c) for c in counts[b]], window, cost, schedule=schedule,
                                 zero1=zero1, label=f"HotSPa bucket {b}")
        if best is None:
            raise PlanValidationError([(f"buckets[{b}]", f"no symmetric strategy fits {window}-token windows")],
                                      what="HotSPa plan")
        strategies.append(best[0])
    return HotSPaPlan(buckets=buckets, strategies=strategies)


@dataclasses.dataclass(frozen=True)
class HotSPaStep:
    """One simulated HotSPa step: ``compute[k]`` seconds of bucket ``k`` (its pipelines and ZeRO-1 gather, no
    gradient sync), ``switch`` seconds of the strategy switches the step makes (buckets in order, back to the first
    bucket's strategy at the next step), ``sync`` the one gradient sync + optimizer, ``step_time`` the total."""

    compute: tuple[float, ...]
    switch: float
    sync: float
    oom: tuple[int, ...]

    @property
    def step_time(self) -> float:
        return sum(self.compute) + self.switch + self.sync


def simulate_hotspa(model: "ModelSpec | str", cluster: "Cluster", plan: HotSPaPlan, batch: Sequence[int], *,
                    cost: CostModel | None = None) -> HotSPaStep:
    """Simulate one HotSPa step of ``batch``: each bucket's sequences packed into the bucket's windows and run by its
    strategy (micro-batches spread evenly over its pipelines), one after another with gradient accumulation; a
    switch (:func:`~hspmd_sdk.planner.mixed_cost.switch_estimate`) wherever consecutive non-empty buckets (cyclically,
    the next step starts at the first) use different strategies; one gradient synchronisation at the end."""
    model = load_model_spec(model)
    used, compute, oom, sync = [], [], set(), 0.0
    for k, seqs in enumerate(_bucketed(batch, plan.buckets)):
        if not seqs:
            continue
        s = plan.strategies[k]
        per = max(1, math.ceil(len(pack(seqs, plan.buckets[k])) / s.dp_degree))
        s = s.model_copy(update={"pipelines": [p.model_copy(update={"num_micro_batches": per})
                                               for p in s.pipelines]})
        r = simulate(model, s, cluster, seq_len=plan.buckets[k], cost=cost)
        compute.append(r.step_time - r.sync_time)
        sync = r.sync_time
        oom |= set(r.oom)
        used.append(plan.strategies[k])
    switch = sum(switch_estimate(model, cluster, a, b, cost) for a, b in zip(used, used[1:] + used[:1])
                 if len(used) > 1)
    return HotSPaStep(tuple(compute), switch, sync, tuple(sorted(oom)))
