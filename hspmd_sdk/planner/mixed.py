"""Scenario (c), mixed-length data: length intervals, per-interval pipelines, per-batch dispatch
(Appendix A.1 (c), Appendix C.4).

**Offline** (:func:`plan_mixed`), from a sample of the dataset's sequence lengths:

1. candidate interval boundaries (powers of two up to the context length, by default) cut lengths into base
   intervals; a pipeline serving the interval ``(lo, hi]`` packs its sequences into *windows* of ``hi`` tokens
   (best-fit decreasing, :func:`pack`), one window a micro-batch of size 1;
2. a *parallel method* is a homogeneous pipeline: TP degree, number of stages (layers split evenly), activation
   recomputation; it is feasible for a window when every stage fits in memory (cost model);
3. a dynamic programme over (boundary, devices used) chooses which base intervals to merge, a method for each
   merged interval and how many pipelines of it, minimising the slowest interval's estimated time for one batch
   (windows per batch from the sample, scaled to ``tokens_per_batch``) with every device used at most once;
4. the pipelines are combined into one heterogeneous :class:`Strategy` (ranks in order, larger TP groups first so
   that TP groups stay inside nodes); this is repeated for each maximum sequence length (boundary), since a
   batch whose longest sequence is short wants no long-window pipeline: a :class:`MixedPlan` of
   :class:`MixedEntry` keyed by ``max_seq_len`` (the paper's Strategies A and B, Tables 15-16).

**Online** (:func:`dispatch`), per batch: for every entry able to take the batch's longest sequence, sequences
(longest first) go to the pipeline whose estimated finish time grows least (into an open window of it when one
has room), and the entry with the smallest estimated step time is chosen.  :func:`simulate_mixed` runs the
chosen strategy in the step simulator (each pipeline at its window length), and :func:`packed_baseline` is the
standard SPMD answer: one homogeneous strategy over sequences packed into context-length windows.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ..core.strategy import Strategy
from .cost import CostModel
from .hetero import PipelinePlan, PlanContext, TPGroup, _stage_parts, _sync_estimate, tp_degrees

if TYPE_CHECKING:  # pragma: no cover
    from ..core.cluster import Cluster
    from ..core.model_spec import ModelSpec

__all__ = ["Method", "MixedEntry", "MixedPlan", "Dispatch", "plan_mixed", "dispatch", "simulate_mixed",
           "packed_baseline", "pack", "sample_lengths", "sample_batch"]


# ---- data ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """A homogeneous pipeline: ``tp`` devices a stage, ``pp`` stages, optional activation recomputation."""

    tp: int
    pp: int
    recompute: bool = False

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP{self.tp}PP{self.pp}{'+AC' if self.recompute else ''}"


class MixedEntry(BaseModel):
    """One strategy of a :class:`MixedPlan`: for batches whose longest sequence is at most ``max_seq_len``.
    ``windows[p]`` is the window (micro-batch length in tokens) of pipeline ``p``; the strategy's micro-batch
    counts are placeholders that :func:`dispatch` fills per batch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_seq_len: int = Field(gt=0)
    windows: list[int]
    methods: list[str] = Field(default_factory=list, description="parallel method of each pipeline")
    strategy: Strategy
    estimate: float = Field(default=0.0, description="estimated seconds for a typical batch")


class MixedPlan(BaseModel):
    """Strategies keyed by maximum sequence length, shortest first (JSON round-trips)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    context_len: int
    tokens_per_batch: int
    entries: list[MixedEntry] = Field(min_length=1)

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    def summary(self) -> str:
        lines = [f"MixedPlan: context {self.context_len}, {self.tokens_per_batch} tokens a batch, "
                 f"{len(self.entries)} strategies"]
        for e in self.entries:
            pipes = ", ".join(f"{m}@{w}" for m, w in zip(e.methods, e.windows))
            lines.append(f"  max_seq_len <= {e.max_seq_len}: {len(e.windows)} pipelines [{pipes}] "
                         f"(est {e.estimate:.2f} s)")
        return "\n".join(lines)


@dataclass
class Dispatch:
    """The per-batch decision: the entry used, its strategy with this batch's micro-batch counts, the windows
    (lists of sequence lengths) of each pipeline, and the estimated step time (s)."""

    entry: int
    max_seq_len: int
    strategy: Strategy
    windows: list[int]
    packed: list[list[list[int]]]
    estimate: float
    estimates: dict[int, float] = field(default_factory=dict)


# ---- lengths ------------------------------------------------------------------------------------------------
def sample_lengths(n: int, context_len: int, *, seed: int = 0, median: int = 1024, sigma: float = 1.1,
                   tail: float = 0.01) -> list[int]:
    """A long-tailed length sample like the paper's Figure 18: lognormal around ``median`` (most sequences
    short), plus a ``tail`` fraction near the context limit; clipped to ``[16, context_len]``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    body = np.exp(rng.normal(math.log(median), sigma, n))
    long = rng.random(n) < tail
    body[long] = rng.uniform(0.6, 1.0, int(long.sum())) * context_len
    return [int(x) for x in np.clip(body, 16, context_len)]


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
    """Best-fit decreasing: sequences (each at most ``window``) into windows of ``window`` tokens."""
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


# ---- costs of a method ------------------------------------------------------------------------------------------
class _Costs:
    """Per (method, window): the :class:`PipelinePlan` of one pipeline (even layer split) or ``None`` when it
    does not fit in memory; cached."""

    def __init__(self, model: "ModelSpec", cluster: "Cluster", cost: CostModel, zero_shards: int,
                 schedule: str) -> None:
        self.model, self.cluster, self.cost, self.z, self.schedule = model, cluster, cost, zero_shards, schedule
        self._ctx: dict[int, PlanContext] = {}
        self._plans: dict[tuple[Method, int], PipelinePlan | None] = {}
        self.kind = cluster.kind(0)
        self.per_node = min(len(n.ranks) for n in cluster.nodes)

    def ctx(self, window: int) -> PlanContext:
        if window not in self._ctx:
            self._ctx[window] = PlanContext(self.model, self.cluster, global_batch=1, seq_len=window,
                                            cost=self.cost, schedule=self.schedule)
        return self._ctx[window]

    def groups(self, method: Method, first_rank: int = 0) -> list[TPGroup]:
        return [TPGroup(tuple(range(first_rank + s * method.tp, first_rank + (s + 1) * method.tp)), self.kind,
                        self.cluster.node_index(first_rank + s * method.tp)) for s in range(method.pp)]

    def plan(self, method: Method, window: int) -> PipelinePlan | None:
        key = (method, window)
        if key not in self._plans:
            self._plans[key] = self._make(method, window)
        return self._plans[key]

    def _make(self, method: Method, window: int) -> PipelinePlan | None:
        ctx, L, S = self.ctx(window), self.model.num_layers, method.pp
        if S > L or method.devices > self.cluster.num_ranks:
            return None
        groups = self.groups(method)
        layers = [L // S + (1 if s < L % S else 0) for s in range(S)]
        times = []
        for s, (g, n) in enumerate(zip(groups, layers)):
            prof = ctx.profile(g, 1, self.z, method.recompute)
            ft, fb, per, tr = _stage_parts(prof, s == 0, s == S - 1, ctx.in_flight(S, s, S))
            if fb + tr + n * per > prof.capacity:
                return None
            times.append(ft + n * prof.layer_time)
        p2p = 2 * sum(ctx.p2p_time(a, b, 1) for a, b in zip(groups, groups[1:]))
        return PipelinePlan(tuple(groups), tuple(layers), tuple(times), p2p, method.recompute)


def _methods(model: "ModelSpec", cluster: "Cluster", max_tp: int) -> list[Method]:
    tps = tp_degrees(model, max_tp)
    pps = [p for p in (1, 2, 4, 8) if p <= model.num_layers]
    return [Method(t, p, rc) for t in tps for p in pps for rc in (False, True) if t * p <= cluster.num_ranks]


# ---- the dynamic programme -------------------------------------------------------------------------------------
def _boundaries(context_len: int, lengths: Sequence[int]) -> list[int]:
    out, b = [], 1024
    while b < context_len:
        out.append(b)
        b *= 2
    out.append(context_len)
    lo = min(lengths)
    return [x for x in out if x >= min(lo, out[-1])] or [context_len]


def _interval_plan(costs: _Costs, lengths: Sequence[int], bounds: Sequence[int], devices: int, scale: float,
                   methods: Sequence[Method]) -> tuple[float, list[tuple[Method, int, int]]] | None:
    """The DP: ``best[i][G]`` = smallest makespan covering base intervals ``< i`` with ``G`` devices.  Returns the
    makespan and ``(method, count, window)`` per chosen interval, or ``None``."""
    n = len(bounds)
    edges = [0] + list(bounds)
    inside = [[x for x in lengths if edges[i] < x <= edges[i + 1]] for i in range(n)]
    INF = math.inf
    best = [[INF] * (devices + 1) for _ in range(n + 1)]
    back: list[list[tuple | None]] = [[None] * (devices + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for i in range(1, n + 1):
        window = bounds[i - 1]
        for j in range(i):
            seqs = [x for k in range(j, i) for x in inside[k]]
            if not seqs:
                for G in range(devices + 1):
                    if best[j][G] < best[i][G]:
                        best[i][G], back[i][G] = best[j][G], (j, None, 0, window)
                continue
            windows = len(pack(seqs, window)) * scale
            for m in methods:
                plan = costs.plan(m, window)
                if plan is None:
                    continue
                for cnt in range(1, devices // m.devices + 1):
                    t = plan.time(max(1, math.ceil(windows / cnt)))
                    used = cnt * m.devices
                    for G in range(used, devices + 1):
                        v = max(best[j][G - used], t)
                        if v < best[i][G]:
                            best[i][G], back[i][G] = v, (j, m, cnt, window)
    G = min(range(devices + 1), key=lambda g: (best[n][g], -g))
    makespan = best[n][G]
    if makespan == INF:
        return None
    out, i = [], n
    while i > 0:
        j, m, cnt, window = back[i][G]  # type: ignore[misc]
        if m is not None:
            out.append((m, cnt, window))
            G -= cnt * m.devices
        i = j
    return makespan, out[::-1]


def _combine(costs: _Costs, chosen: Sequence[tuple[Method, int, int]], *, schedule: str,
             zero1: bool) -> tuple[Strategy, list[int], list[str]]:
    """Pipelines of the chosen intervals on consecutive ranks, larger TP first; placeholder micro-batch counts."""
    order = sorted(((m, w) for m, cnt, w in chosen for _ in range(cnt)), key=lambda mw: (-mw[0].tp, -mw[1]))
    L, rank, pipelines, windows, names = costs.model.num_layers, 0, [], [], []
    for m, w in order:
        plan = costs.plan(m, w)
        assert plan is not None
        stages, first = [], 0
        for s, n in enumerate(plan.layers):
            stages.append({"devices": list(range(rank + s * m.tp, rank + (s + 1) * m.tp)),
                           "layers": [first, first + n - 1], "recompute": m.recompute})
            first += n
        rank += m.devices
        pipelines.append({"stages": stages, "micro_batch_size": 1, "num_micro_batches": 1})
        windows.append(w)
        names.append(str(m))
    return Strategy.load({"pipelines": pipelines, "schedule": schedule, "zero1": zero1}), windows, names


def plan_mixed(model: "ModelSpec | str", cluster: "Cluster", lengths: Sequence[int], *, tokens_per_batch: int,
               context_len: int | None = None, cost: CostModel | None = None, boundaries: Sequence[int] | None = None,
               methods: Sequence[Method] | None = None, schedule: str = "1f1b", zero1: bool = True,
               max_tp: int = 16, long_weights: Sequence[int] = (1, 2, 4)) -> MixedPlan:
    """Plan a set of strategies for mixed-length data (the paper's scenario (c)) from a sample of ``lengths``.

    ``cluster`` must be of one device kind.  ``context_len`` (default: the longest length) truncates longer
    sequences.  ``boundaries`` are the candidate interval ends (default: 1K, 2K, 4K, ... up to the context);
    ``methods`` the candidate parallel methods (default: TP 1..``max_tp`` x PP 1, 2, 4, 8, with and without
    recomputation).  For each maximum length the DP runs on the sample as it is and with the sequences of the
    top interval counted ``long_weights`` times (batches heavier in long sequences).  Memory is checked with ZeRO-1 over two replicas (the smallest useful plan); the
    simulator checks the final strategies.
    """
    from ..models.registry import load_model_spec
    from ..errors import PlanValidationError

    model = load_model_spec(model)
    if len(cluster.kinds()) != 1:
        raise PlanValidationError([("cluster", "plan_mixed plans homogeneous clusters (one device kind); got "
                                               f"{cluster.kinds()}")], what="mixed plan")
    context = context_len or max(lengths)
    lengths = [min(int(x), context) for x in lengths if x > 0]
    bounds = sorted(set(boundaries or _boundaries(context, lengths)) | {context})
    bounds = [b for b in bounds if b <= context]
    costs = _Costs(model, cluster, cost or CostModel(), 2 if zero1 else 1, schedule)
    methods = list(methods or _methods(model, cluster, max_tp))
    entries: list[MixedEntry] = []
    for k, cap in enumerate(bounds):
        sub = [x for x in lengths if x <= cap]
        if not sub or (entries and max(sub) <= entries[-1].max_seq_len):
            continue
        below = bounds[k - 1] if k else 0
        for weight in long_weights:  # batches heavier in long sequences than the sample
            skewed = sub + [x for x in sub if x > below] * (int(weight) - 1)
            found = _interval_plan(costs, skewed, [b for b in bounds if b <= cap], cluster.num_ranks,
                                   tokens_per_batch / sum(skewed), methods)
            if found is None:
                continue
            est, chosen = found
            strategy, windows, names = _combine(costs, chosen, schedule=schedule, zero1=zero1)
            if any(e.strategy.pipelines == strategy.pipelines and e.windows == windows for e in entries):
                continue
            strategy = strategy.model_copy(update={"name": f"mixed: max_seq_len <= {cap} (long x{weight:g})"})
            entries.append(MixedEntry(max_seq_len=cap, windows=windows, methods=names, strategy=strategy,
                                      estimate=est))
    if not entries or entries[-1].max_seq_len < context:
        raise PlanValidationError([("lengths", f"no strategy for {model.name} on {cluster.num_ranks} devices takes "
                                               f"sequences of {context} tokens")], what="mixed plan")
    return MixedPlan(context_len=context, tokens_per_batch=tokens_per_batch, entries=entries)


# ---- online: dispatch ---------------------------------------------------------------------------------------------
def _pipeline_plans(costs: _Costs, entry: MixedEntry) -> list[PipelinePlan]:
    out = []
    for p, w in zip(entry.strategy.pipelines, entry.windows):
        m = Method(p.stages[0].tp_degree, p.num_stages, p.stages[0].recompute)
        plan = costs.plan(m, w)
        if plan is None:  # a hand-edited entry: cost it as it is
            raise ValueError(f"pipeline {m} at window {w} does not fit in memory")
        out.append(plan)
    return out


def _assign(plans: Sequence[PipelinePlan], windows: Sequence[int], batch: Sequence[int]) -> tuple[
        list[list[list[int]]], float]:
    """Longest sequence first, to the eligible pipeline whose estimated time grows least."""
    packed: list[list[list[int]]] = [[] for _ in plans]
    room: list[list[int]] = [[] for _ in plans]
    for x in sorted(batch, reverse=True):
        best = None
        for p, (plan, w) in enumerate(zip(plans, windows)):
            if x > w:
                continue
            fits = next((i for i, r in enumerate(room[p]) if r >= x), None)
            t = plan.time(len(packed[p]) + (0 if fits is not None else 1))
            key = (t, w, p)
            if best is None or key < best[0]:
                best = (key, p, fits)
        assert best is not None
        _, p, fits = best
        if fits is None:
            packed[p].append([x])
            room[p].append(windows[p] - x)
        else:
            packed[p][fits].append(x)
            room[p][fits] -= x
    return packed, max(plan.time(len(w)) for plan, w in zip(plans, packed))


def dispatch(plan: MixedPlan, model: "ModelSpec | str", cluster: "Cluster", batch: Sequence[int], *,
             cost: CostModel | None = None) -> Dispatch:
    """Assign one batch's sequences to the pipelines of every entry that can take its longest sequence and pick
    the entry with the smallest estimated step time.  Sequences longer than the context are truncated."""
    from ..models.registry import load_model_spec

    model = load_model_spec(model)
    batch = [min(int(x), plan.context_len) for x in batch if x > 0]
    longest = max(batch)
    zero1 = plan.entries[0].strategy.zero1
    costs = _Costs(model, cluster, cost or CostModel(), 2 if zero1 else 1, plan.entries[0].strategy.schedule)
    best: Dispatch | None = None
    estimates: dict[int, float] = {}
    for i, entry in enumerate(plan.entries):
        if entry.max_seq_len < longest:
            continue
        plans = _pipeline_plans(costs, entry)
        packed, t = _assign(plans, entry.windows, batch)
        D = len(plans)
        t += max(_sync_estimate(costs.ctx(entry.windows[0]), p, D) for p in plans)
        estimates[i] = t
        if best is None or t < best.estimate:
            pipes = [p.model_copy(update={"num_micro_batches": max(1, len(w))})
                     for p, w in zip(entry.strategy.pipelines, packed)]
            best = Dispatch(i, entry.max_seq_len, entry.strategy.model_copy(update={"pipelines": pipes}),
                            list(entry.windows), packed, t)
    assert best is not None
    best.estimates = estimates
    return best


# ---- evaluation ------------------------------------------------------------------------------------------------
def simulate_mixed(model: "ModelSpec | str", cluster: "Cluster", chosen: Dispatch, *,
                   cost: CostModel | None = None) -> tuple[float, list[int]]:
    """Simulated step time (s) of a dispatched batch and the devices out of memory.

    The simulator takes one sequence length per run, so the strategy is simulated once per distinct window
    length; each pipeline's last backward is read from the run at its own window, the gradient synchronisation
    and optimizer tail from the run of the slowest pipeline.  Pipelines given no sequence are ignored for time.
    """
    from .simulator import simulate

    runs = {w: simulate(model, chosen.strategy, cluster, seq_len=w, cost=cost) for w in set(chosen.windows)}
    ends, oom = [], []
    for p, (w, packed) in enumerate(zip(chosen.windows, chosen.packed)):
        r = runs[w]
        devs = set(chosen.strategy.pipelines[p].ranks)
        oom += [d for d in r.oom if d in devs]
        if packed:
            ends.append((r.pipeline_end[p], w))
    end, w = max(ends)
    return end + runs[w].sync_time, sorted(oom)


def packed_baseline(model: "ModelSpec | str", cluster: "Cluster", batch: Sequence[int], *, context_len: int,
                    cost: CostModel | None = None, schedule: str = "1f1b",
                    zero1: bool = True) -> tuple[Strategy, float]:
    """Standard SPMD: the batch packed into ``context_len`` windows, one homogeneous strategy (every DP x TP x PP
    with even layers, with and without recomputation), the fastest in the simulator that fits in memory.
    Returns the strategy and its simulated step time."""
    from ..models.registry import load_model_spec
    from .simulator import simulate

    model = load_model_spec(model)
    n = cluster.num_ranks
    windows = len(pack([min(int(x), context_len) for x in batch], context_len))
    best: tuple[Strategy, float] | None = None
    for m in _methods(model, cluster, 16):
        if n % m.devices:
            continue
        dp = n // m.devices
        per = max(1, math.ceil(windows / dp))
        costs = _Costs(model, cluster, cost or CostModel(), dp if zero1 else 1, schedule)
        if costs.plan(m, context_len) is None:
            continue
        pipes = []
        for d in range(dp):
            base, first, stages = d * m.devices, 0, []
            for s in range(m.pp):
                cnt = model.num_layers // m.pp + (1 if s < model.num_layers % m.pp else 0)
                stages.append({"devices": list(range(base + s * m.tp, base + (s + 1) * m.tp)),
                               "layers": [first, first + cnt - 1], "recompute": m.recompute})
                first += cnt
            pipes.append({"stages": stages, "micro_batch_size": 1, "num_micro_batches": per})
        s = Strategy.load({"pipelines": pipes, "schedule": schedule, "zero1": zero1,
                           "name": f"packed baseline DP{dp}{m} at {context_len}"})
        r = simulate(model, s, cluster, seq_len=context_len, cost=cost)
        if not r.oom and (best is None or r.step_time < best[1]):
            best = (s, r.step_time)
    if best is None:
        raise ValueError(f"no homogeneous strategy fits {context_len}-token windows")
    return best
