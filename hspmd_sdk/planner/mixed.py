"""Scenario (c), mixed-length data: length intervals, per-interval pipelines, per-step dispatch (Appendix A.1 (c),
Appendix C.4).

**Offline** (:func:`plan_mixed`), from a sample of the dataset's sequence lengths, for a cluster of one or several
device kinds:

1. interval boundaries (1K, 1.5K, 2K, 3K, 4K, ... up to the context, by default) cut lengths into base intervals; a
   pipeline serving the merged interval ``(lo, hi]`` has the *window* ``hi``: its micro-batches hold at most ``hi``
   tokens (``rows x padded length``), so one row of ``hi`` tokens is the most memory it ever needs;
2. a *parallel method* is a pipeline homogeneous in device kind (a restriction of this planner, not of HSPMD):
   kind, TP degree (a power of two dividing the kind's nodes, so TP groups stay inside nodes), number of stages
   (layers split to balance the stage times), activation recomputation (only where the method does not fit
   without); it is feasible for a window when every stage fits in memory at that window;
3. for every merged interval and device kind, the methods are reduced to one Pareto front of (devices used,
   estimated time of the interval's micro-batches in a step): a method is kept only where it is the fastest for
   its device count and faster than every smaller count (dominated methods, counts, and recomputation where the
   plain method fits, are pruned);
4. a dynamic programme over (boundary, devices used of each kind) -- numpy arrays with one axis per kind --
   chooses which base intervals to merge and one front point per merged interval, minimising the slowest
   interval's estimated time, every device used at most once.  The gradient synchronisation and optimizer after
   the pipelines are set by the method with the most parameters per device, so the DP runs once per level of that
   overhead (on the methods within it) and the smallest ``makespan + overhead`` wins;
5. the pipelines are placed on the cluster (per kind, larger TP groups first, into nodes: TP groups never cross a
   node) and combined into one heterogeneous :class:`Strategy`.  This is repeated for each maximum sequence length
   (by default the boundaries that a step's longest sequence reaches with probability >= 2% under the sample),
   since a step whose longest sequence is short wants no long-window pipeline: a :class:`MixedPlan` of
   :class:`MixedEntry` (the paper's Strategies A and B, Tables 15-16).

:meth:`MixedPlan.programs` specializes every entry (``plan.settings`` carries ``max_seq_len``, ``windows`` and
the strategy, so a :class:`Program` alone is a dispatch candidate).

**Online** (:func:`dispatch`, or a :class:`Dispatcher` built once and called per step): the step's sequences
(fixed by the data) go, longest first, to where the estimated finish time grows least: over the pipelines whose
window holds the sequence, into that pipeline's open micro-batch (padded to its longest, while ``rows x longest``
stays within the window; sorted lengths keep padding small) or as a new micro-batch -- so padding is accepted only
where the cost model says that batching pays; each candidate whose ``max_seq_len`` holds the step's longest
sequence is costed this way (padded shapes, attention's quadratic term included, plus its ZeRO-1 gather, gradient
synchronisation and optimizer) and the cheapest is chosen (counting the switch from the ``current`` one, if
given).  :func:`simulate_dispatch` simulates the result (:func:`~hspmd_sdk.planner.mixed_sim.simulate_shapes`).
In a running job the launcher reports each finished step's measured time (:meth:`Dispatcher.observe`), and the
choice weighs each candidate's estimate by how much more its steps measure than all candidates'
(:meth:`Dispatcher.factor`): where the cost model errs more for one candidate than for another, the measurement
decides.

**Shared cores** (``CostModel.cores``, local CPU workers: more ranks on a node than cores): the cost lines charge
every rank the node's shared rate all the time, so they overcharge a pipeline's bubble (a rank waiting in it frees
its core for the others).  There the step simulator, with processor sharing, decides instead: the dispatcher prices
each candidate's assignment by simulating it, and :func:`plan_mixed` also plans each maximum length with pipelines
held to 2, 4, ... stages and keeps the variant whose dispatched sample steps simulate fastest.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ..core.comm_ops import OpKind
from ..core.plan import ExecutionSettings
from ..core.schedule import in_flight
from ..core.specialize import specialize
from ..core.strategy import Pipeline, Strategy
from ..core.strategy_plan import plan_from_strategy
from ..errors import PlanValidationError, SpecializationError
from ..models.registry import load_model_spec
from .cost import BF16, CostModel
from .hetero import tp_degrees
from .mixed_cost import PipelineCost, split_layers, switch_estimate
from .mixed_sim import packed_baseline, pack, sample_batch, simulate_shapes
from .simulator import _oversubscribed

if TYPE_CHECKING:  # pragma: no cover
    from ..core.cluster import Cluster
    from ..core.model_spec import ModelSpec
    from ..core.specialize import Program
    from .simulator import SimResult

__all__ = ["Method", "MixedEntry", "MixedPlan", "Dispatch", "Dispatcher", "plan_mixed", "dispatch",
           "simulate_mixed", "simulate_dispatch", "packed_baseline", "pack", "sample_lengths", "sample_batch",
           "micro_batches", "packed_rows", "memory_windows"]


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


def micro_batches(lengths: Sequence[int], window: int) -> list[list[int]]:
    """Sequences (as given, each at most ``window``) into padded micro-batches of at most ``window`` tokens:
    longest first, each micro-batch as many consecutive sequences as ``rows x its longest <= window`` allows.
    Returns lists of indices into ``lengths``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    for i in order:
        if lengths[i] > window:
            raise ValueError(f"a sequence of {lengths[i]} tokens does not fit a window of {window}")
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= window:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def packed_rows(lengths: Sequence[int], window: int) -> list[list[int]]:
    """Sequences (each at most ``window``) into rows of at most ``window`` tokens, whole sequences back to back:
    longest first, each into the open row while it fits, else a new row.  Returns lists of indices into
    ``lengths``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    used = 0
    for i in order:
        if lengths[i] > window:
            raise ValueError(f"a sequence of {lengths[i]} tokens does not fit a window of {window}")
        if out and used + lengths[i] <= window:
            out[-1].append(i)
            used += lengths[i]
        else:
            out.append([i])
            used = lengths[i]
    return out


# ---- plans ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """A pipeline homogeneous in device ``kind``: ``tp * cp`` devices a stage (``cp`` context-parallel groups of
    ``tp`` TP ranks, SPEC §11), ``pp`` stages, optional recomputation."""

    kind: str
    tp: int
    pp: int
    recompute: bool = False
    cp: int = 1

    @property
    def width(self) -> int:
        """Devices of one stage."""
        return self.tp * self.cp

    @property
    def devices(self) -> int:
        return self.width * self.pp

    def __str__(self) -> str:
        cp = f"CP{self.cp}" if self.cp > 1 else ""
        return f"{self.kind} TP{self.tp}{cp}PP{self.pp}{'+AC' if self.recompute else ''}"


class MixedEntry(BaseModel):
    """One candidate strategy of a :class:`MixedPlan`, for steps whose longest sequence is at most ``max_seq_len``.
    ``windows[p]``: the token budget of a micro-batch of pipeline ``p`` (``rows x padded length``; also the longest
    sequence it takes; at least ``max_seq_len`` for the largest, more where ``plan_mixed`` widened it).  The strategy's micro-batch fields are placeholders: :func:`dispatch` decides per step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_seq_len: int = Field(gt=0)
    windows: list[int]
    methods: list[str] = Field(default_factory=list, description="parallel method of each pipeline")
    strategy: Strategy
    estimate: float = Field(default=0.0, description="estimated seconds of a typical step (the DP's makespan plus "
                                                     "ZeRO-1 gather, gradient sync and optimizer)")


class MixedPlan(BaseModel):
    """Candidate strategies keyed by maximum sequence length, shortest first (JSON round-trips)."""

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

    def programs(self, model: "ModelSpec | str", cluster: "Cluster") -> list["Program"]:
        """Every entry specialized (:func:`hspmd_sdk.specialize` of ``plan_from_strategy``), in entry order.

        Each Program's ``plan.settings`` carries, besides what :func:`plan_from_strategy` records (the strategy),
        ``max_seq_len`` and ``windows`` (one token budget per pipeline, in the order of ``program.pipelines``,
        which is the strategy's) -- what :func:`dispatch` reads from a Program alone; ``plan.meta`` notes
        ``context_len`` and ``candidate`` (the entry index).
        """
        model = load_model_spec(model)
        out = []
        for i, e in enumerate(self.entries):
            plan = plan_from_strategy(model, e.strategy, cluster)
            settings = plan.settings.model_copy(update={"max_seq_len": e.max_seq_len, "windows": tuple(e.windows)})
            meta = {**plan.meta, "context_len": self.context_len, "candidate": i}
            prog = specialize(model, plan.model_copy(update={"settings": settings, "meta": meta}), cluster)
            want = [[sorted(s.devices) for s in p.stages] for p in e.strategy.pipelines]
            if [[sorted(s) for s in p] for p in prog.pipelines] != want:
                raise SpecializationError(f"entry {i}: the specialized pipelines {prog.pipelines} are not the "
                                          f"strategy's {want} in order; windows would be misread")
            out.append(prog)
        return out


# ---- costs of methods ----------------------------------------------------------------------------------------------
class _Methods:
    """The pipeline of each (method, window) on the first devices of its kind -- layers split to balance the stage
    times at the window, memory checked for one row of the window in every in-flight slot -- or ``None``."""

    def __init__(self, model: "ModelSpec", cluster: "Cluster", cost: CostModel, *, schedule: str,
                 zero1: bool) -> None:
        self.model, self.cluster, self.cost, self.schedule, self.zero1 = model, cluster, cost, schedule, zero1
        self.z = 2 if zero1 else 1  # ZeRO-1 over at least two replicas; the final strategies are simulated
        self.kind_ranks: dict[str, list[int]] = {}
        for n in cluster.nodes:
            self.kind_ranks.setdefault(n.kind, []).extend(n.ranks)
        self._stages: dict = {}
        self._plans: dict[tuple[Method, int], tuple[PipelineCost, list[int]] | None] = {}

    def pipeline(self, m: Method, layers: Sequence[int]) -> Pipeline:
        ranks = self.kind_ranks[m.kind][:m.devices]
        stages, first = [], 0
        w = m.width
        for s, n in enumerate(layers):
            stages.append({"devices": ranks[s * w:(s + 1) * w], "layers": [first, first + n - 1],
                           "recompute": m.recompute, **({"cp": m.cp} if m.cp > 1 else {})})
            first += n
        return Pipeline.model_validate({"stages": stages, "micro_batch_size": 1, "num_micro_batches": 1})

    def overhead(self, m: Method) -> float:
        """Estimated seconds a pipeline of ``m`` adds to a step outside its forward and backward work: ZeRO-1 gather
        and gradient reduce-scatter (or all-reduce) of its heaviest device's parameters (even layer split) over as
        many replicas as the cluster could hold, on the slowest link, then that device's optimizer step."""
        L, S, md = self.model.num_layers, m.pp, self.model
        heaviest = max((L // S + (1 if s < L % S else 0)) * md.layer_param_count()
                       + (md.embedding_param_count() if s == 0 else 0)
                       + (md.head_param_count() if s == S - 1 else 0) for s in range(S)) / m.tp
        n = max(2, self.cluster.num_ranks // m.devices)
        link = self.cluster.link(0, self.cluster.num_ranks - 1)
        ops = (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER) if self.zero1 else (OpKind.ALL_REDUCE,)
        sync = sum(self.cost.collective_time(op, heaviest * BF16, n, link) for op in ops)
        owned = heaviest / n if self.zero1 else heaviest
        return sync + self.cost.optimizer_time(owned, self.cluster.devices[m.kind])

    def plan(self, m: Method, window: int) -> tuple[PipelineCost, list[int]] | None:
        key = (m, window)
        if key not in self._plans:
            self._plans[key] = self._make(m, window)
        return self._plans[key]

    def _make(self, m: Method, window: int) -> tuple[PipelineCost, list[int]] | None:
        L, S = self.model.num_layers, m.pp
        if S > L or m.devices > len(self.kind_ranks.get(m.kind, [])):
            return None
        even = [L // S + (1 if s < L % S else 0) for s in range(S)]
        splits = [even]
        if S > 1 and L >= 2 * S:  # per-layer and fixed (embedding, head) time of each stage at one row of the window
            one = PipelineCost.of(self.model, self.pipeline(m, [1] * S), self.cluster, self.cost, self._stages)
            two = PipelineCost.of(self.model, self.pipeline(m, [2] * S), self.cluster, self.cost, self._stages)
            t1 = [st.time(1, window) for st in one.stages]
            t2 = [st.time(1, window) for st in two.stages]
            per = [b - a for a, b in zip(t1, t2)]
            splits.insert(0, split_layers(L, per, [a - p for a, p in zip(t1, per)]))
        spec = self.cluster.devices[m.kind]
        capacity = spec.memory_mb * 2.0**20 - self.cost.runtime_bytes(m.kind)
        for layers in splits:
            pc = PipelineCost.of(self.model, self.pipeline(m, layers), self.cluster, self.cost, self._stages)
            if all(st.fits(window, in_flight(self.schedule, S, s, S), self.z, capacity)
                   for s, st in enumerate(pc.stages)):
                return pc, list(layers)
        return None


def _default_methods(model: "ModelSpec", cluster: "Cluster", max_tp: int | None,
                     max_cp: int | None = None) -> list[Method]:
    out = []
    for kind, count in cluster.kinds().items():
        sizes = [len(n.ranks) for n in cluster.nodes if n.kind == kind]
        tps = [t for t in tp_degrees(model, min(max_tp or min(sizes), min(sizes))) if all(s % t == 0 for s in sizes)]
        cps = [c for c in (1, 2, 4, 8) if c <= (max_cp or 8)]
        out += [Method(kind, t, p, rc, c) for t in tps for c in cps for p in (1, 2, 4, 8) for rc in (False, True)
                if p <= model.num_layers and t * c * p <= count and all(s % (t * c) == 0 for s in sizes)]
    return out


# ---- the dynamic programme -------------------------------------------------------------------------------------
def _boundaries(context_len: int) -> list[int]:
    """1K, 1.5K, 2K, 3K, 4K, 6K, ... below the context, and the context."""
    out, b = [], 1024
    while b < context_len:
        out += [x for x in (b, b * 3 // 2) if x < context_len]
        b *= 2
    return out + [context_len]


@dataclass(frozen=True)
class _Option:
    """One point of a merged interval's Pareto front: ``count`` pipelines of ``method`` at ``window``."""

    j: int
    axis: int
    units: int
    time: float
    method: Method | None
    count: int
    window: int


class _Segments:
    """The merged intervals ``(lo, hi]`` of one length sample: their sequences in two micro-batch forms -- one row a
    sequence, and window-sized padded micro-batches (:func:`micro_batches`) -- or, with ``packing``, a third:
    window-sized packed rows (:func:`packed_rows`) -- and each method's costs of them (cached, so that the DP can
    run again on fewer methods for free)."""

    def __init__(self, lengths: Sequence[int], packing: bool = False) -> None:
        import numpy as np

        self.packing = packing
        self.lengths = np.sort(np.asarray(lengths, dtype=np.int64))[::-1]
        self._forms: dict[tuple[int, int], list] = {}
        self._totals: dict[tuple[Method, int, int], tuple[float, float, float, int] | None] = {}

    def count(self, lo: int, hi: int) -> int:
        x = self.lengths
        return int(((x > lo) & (x <= hi)).sum())

    def forms(self, lo: int, hi: int) -> list:
        import numpy as np

        if (lo, hi) not in self._forms:
            seg = self.lengths[(self.lengths > lo) & (self.lengths <= hi)].tolist()  # longest first
            mbs = micro_batches(seg, hi)
            forms = [(np.ones(len(seg)), np.asarray(seg, dtype=float), None),
                     (np.asarray([len(mb) for mb in mbs], dtype=float),
                      np.asarray([seg[mb[0]] for mb in mbs], dtype=float), None)]
            if self.packing and seg:  # one row of T tokens each, attention term Q (the sum of squared lengths)
                rows = packed_rows(seg, hi)
                t = np.asarray([sum(seg[i] for i in r) for r in rows], dtype=float)
                q = np.asarray([sum(seg[i] ** 2 for i in r) for r in rows], dtype=float)
                forms.append((np.ones(len(rows)), t, q))
            self._forms[(lo, hi)] = forms
        return self._forms[(lo, hi)]

    def totals(self, methods: _Methods, m: Method, lo: int, hi: int) -> tuple[float, float, float, int] | None:
        """(sum of bottleneck seconds, largest, fill, micro-batches) of the cheaper form on ``m`` at window ``hi``."""
        key = (m, lo, hi)
        if key not in self._totals:
            found = methods.plan(m, hi)
            self._totals[key] = None if found is None else \
                min(found[0].totals(r, x, q) + (len(r),) for r, x, q in self.forms(lo, hi))
        return self._totals[key]


def _fronts(methods: _Methods, todo: Sequence[Method], segs: _Segments, lo: int, hi: int, scale: float,
            unit: dict[str, int]) -> dict[str, list[tuple[int, float, Method, int]]]:
    """Per kind, the Pareto front (units of devices, seconds, method, count) of serving the sequences in
    ``(lo, hi]``: for each device count the fastest method and count, kept only if faster than every smaller count.
    ``c`` pipelines share the step's micro-batches: ``max(sum / c, largest) + fill`` (the dispatcher pads only where
    the cost model favours it, so each method is costed on the cheaper of the two forms)."""
    fronts: dict[str, dict[int, tuple[float, Method, int]]] = {}
    fits_plain: set[tuple[str, int, int]] = set()
    for m in sorted(todo, key=lambda m: m.recompute):
        if m.recompute and (m.kind, m.tp, m.cp, m.pp) in fits_plain:
            continue  # the same method without recomputation fits: it dominates
        found = segs.totals(methods, m, lo, hi)
        if found is None:
            continue
        if not m.recompute:
            fits_plain.add((m.kind, m.tp, m.cp, m.pp))
        total, largest, fill, n_mbs = found
        best = fronts.setdefault(m.kind, {})
        for c in range(1, len(methods.kind_ranks[m.kind]) // m.devices + 1):
            t = max(total * scale / c, largest) + fill
            u = c * m.devices // unit[m.kind]
            if u not in best or t < best[u][0]:
                best[u] = (t, m, c)
            if c >= n_mbs * scale:  # more pipelines than micro-batches in a step: no faster
                break
    out = {}
    for kind, pts in fronts.items():
        front, low = [], math.inf
        for u in sorted(pts):
            t, m, c = pts[u]
            if t < low - 1e-12:
                front.append((u, t, m, c))
                low = t
        out[kind] = front
    return out


def _interval_plan(methods: _Methods, todo: Sequence[Method], segs: "_Segments | Sequence[int]",
                   bounds: Sequence[int], scale: float) -> tuple[float, list[tuple[Method, int, int]]] | None:
    """The DP: ``best[i][u]`` = smallest makespan covering base intervals ``< i`` with ``u`` units of devices of
    each kind (one array axis per kind).  ``segs``: the length sample (or its :class:`_Segments`).  Returns the
    makespan and ``(method, count, window)`` per chosen merged interval, or ``None``."""
    import numpy as np

    segs = segs if isinstance(segs, _Segments) else _Segments(segs)
    todo = [m for m in todo if methods.plan(m, bounds[0]) is not None]  # memory grows with the window
    kinds = list(methods.kind_ranks)
    unit = {k: math.gcd(*[m.devices for m in todo if m.kind == k] or [1]) for k in kinds}
    dims = tuple(len(methods.kind_ranks[k]) // unit[k] + 1 for k in kinds)
    n = len(bounds)
    edges = [0] + list(bounds)
    best = [np.full(dims, np.inf) for _ in range(n + 1)]
    choice = [np.full(dims, -1, dtype=np.int64) for _ in range(n + 1)]
    best[0][(0,) * len(kinds)] = 0.0
    options: list[_Option] = []
    for i in range(1, n + 1):
        window = bounds[i - 1]
        for j in range(i):
            if not segs.count(edges[j], window):  # nothing to serve: the interval is covered for free
                options.append(_Option(j, -1, 0, 0.0, None, 0, window))
                better = best[j] < best[i]
                best[i] = np.where(better, best[j], best[i])
                choice[i] = np.where(better, len(options) - 1, choice[i])
                continue
            if not np.isfinite(best[j]).any():
                continue
            for kind, front in _fronts(methods, todo, segs, edges[j], window, scale, unit).items():
                axis = kinds.index(kind)
                for u, t, m, c in front:
                    if u >= dims[axis]:
                        continue
                    src = [slice(None)] * len(kinds)
                    dst = [slice(None)] * len(kinds)
                    src[axis], dst[axis] = slice(0, dims[axis] - u), slice(u, None)
                    cand = np.maximum(best[j][tuple(src)], t)
                    here = best[i][tuple(dst)]
                    better = cand < here
                    if not better.any():
                        continue
                    options.append(_Option(j, axis, u, t, m, c, window))
                    best[i][tuple(dst)] = np.where(better, cand, here)
                    choice[i][tuple(dst)] = np.where(better, len(options) - 1, choice[i][tuple(dst)])
    final = best[n]
    if not np.isfinite(final).any():
        return None
    low = float(final.min())
    used = np.indices(dims).reshape(len(kinds), -1).T @ np.array([unit[k] for k in kinds])
    flat = final.reshape(-1)
    # within 2% of the best makespan, use the most devices (dispatch balances them), then the smaller makespan
    ok = np.flatnonzero(flat <= low * 1.02 + 1e-12)
    state = np.unravel_index(int(min(ok, key=lambda s: (-int(used[s]), float(flat[s]), int(s)))), dims)
    makespan = float(final[state])
    out, i, st = [], n, list(state)
    while i > 0:
        opt = options[int(choice[i][tuple(st)])]
        if opt.method is not None:
            out.append((opt.method, opt.count, opt.window))
            st[opt.axis] -= opt.units
        i = opt.j
    return makespan, out[::-1]


def _best_interval_plan(methods: _Methods, todo: Sequence[Method], lengths: Sequence[int], bounds: Sequence[int],
                        scale: float, packing: bool = False) -> tuple[float, list[tuple[Method, int, int]]] | None:
    """The DP once per overhead level ``sigma`` (:meth:`_Methods.overhead`: the gradient sync and optimizer a
    method's pipeline adds to the step, which the slowest of them sets), on the methods within it, minimising
    ``makespan + sigma``; levels within 25% of each other are tried as one, from the lowest, until ``sigma`` alone
    exceeds the best total.  Returns the makespan (without ``sigma``) and the chosen pipelines, or ``None``."""
    segs = _Segments(lengths, packing)
    level = {m: methods.overhead(m) for m in todo}
    groups: list[list[float]] = []
    for v in sorted(set(level.values())):  # levels within 25% of a group's lowest share its highest
        if groups and v <= groups[-1][0] * 1.25:
            groups[-1].append(v)
        else:
            groups.append([v])
    best: tuple[float, float, list[tuple[Method, int, int]]] | None = None
    seen: set[frozenset[Method]] = set()
    for sigma in (g[-1] for g in groups):
        if best is not None and sigma >= best[0]:
            break
        allowed = [m for m in todo if level[m] <= sigma]
        if frozenset(allowed) in seen:
            continue
        seen.add(frozenset(allowed))
        found = _interval_plan(methods, allowed, segs, bounds, scale)
        if found is not None and (best is None or found[0] + sigma < best[0]):
            best = (found[0] + sigma, found[0], found[1])
    return None if best is None else (best[1], best[2])


def _place(methods: _Methods, chosen: Sequence[tuple[Method, int, int]], *, schedule: str, zero1: bool,
           name: str) -> tuple[Strategy, list[int], list[str]]:
    """Pipelines on the cluster: per kind, larger TP groups first, each stage into the first node of its kind with
    room (the node of the previous stage when it has room), so TP groups stay inside nodes; pipelines ordered by
    window (longest first), then first rank."""
    cl = methods.cluster
    free = {i: list(n.ranks) for i, n in enumerate(cl.nodes)}
    order = sorted(((m, w) for m, cnt, w in chosen for _ in range(cnt)), key=lambda mw: (-mw[0].width, -mw[1]))
    placed = []
    for m, w in order:
        found = methods.plan(m, w)
        assert found is not None
        layers, stages, first, node = found[1], [], 0, None
        for n_layers in layers:
            nodes = [i for i, nd in enumerate(cl.nodes) if nd.kind == m.kind and len(free[i]) >= m.width]
            if not nodes:
                raise PlanValidationError([("cluster", f"cannot place {m} in the nodes of kind {m.kind}")],
                                          what="mixed plan")
            node = node if node in nodes else nodes[0]
            devs, free[node] = free[node][:m.width], free[node][m.width:]
            stages.append({"devices": devs, "layers": [first, first + n_layers - 1], "recompute": m.recompute,
                           **({"cp": m.cp} if m.cp > 1 else {})})
            first += n_layers
        placed.append((w, stages, str(m)))
    placed.sort(key=lambda p: (-p[0], p[1][0]["devices"][0]))
    pipelines = [{"stages": s, "micro_batch_size": 1, "num_micro_batches": 1} for _, s, _ in placed]
    strategy = Strategy.load({"pipelines": pipelines, "schedule": schedule, "zero1": zero1, "name": name})
    return strategy, [w for w, _, _ in placed], [m for _, _, m in placed]


def _widest(methods: _Methods, m: Method, window: int, bounds: Sequence[int]) -> int:
    """The largest of ``bounds`` at least ``window`` whose micro-batches ``m``'s pipeline holds in memory (the
    memory check of :meth:`_Methods.plan`: one row of the window in every in-flight slot), or ``window``."""
    best = window
    for b in sorted(bounds):
        if b > window and methods.plan(m, b) is not None:
            best = b
    return best


def _default_caps(lengths: Sequence[int], bounds: Sequence[int], tokens_per_batch: int,
                  threshold: float = 0.02) -> list[int]:
    """Boundaries ``b`` for which a step's longest sequence falls in ``(previous kept, b]`` with probability at
    least ``threshold`` (``P(max <= b) = F(b) ** n``, ``n`` sequences a step, ``F`` the sample's distribution);
    the context always."""
    n = tokens_per_batch / (sum(lengths) / len(lengths))
    keep, below = [], 0.0
    for b in bounds:
        p = (sum(x <= b for x in lengths) / len(lengths)) ** n
        if p - below >= threshold or b == bounds[-1]:
            keep.append(b)
            below = p
    return keep


def plan_mixed(model: "ModelSpec | str", cluster: "Cluster", lengths: Sequence[int], *, tokens_per_batch: int,
               context_len: int | None = None, cost: CostModel | None = None, boundaries: Sequence[int] | None = None,
               max_seq_lens: Sequence[int] | None = None, methods: Sequence[Method] | None = None,
               schedule: str = "1f1b", zero1: bool = True, max_tp: int | None = None, max_cp: int | None = None,
               widen: bool = True, packing: bool = False) -> MixedPlan:
    """Plan candidate strategies for mixed-length data (the paper's scenario (c)) from a sample of ``lengths``, on a
    cluster of one or several device kinds.

    ``context_len`` (default: the longest length) caps the lengths.  ``boundaries``: candidate interval ends
    (default 1K, 1.5K, 2K, 3K, ... up to the context); ``max_seq_lens``: the maximum lengths to prepare a strategy
    for (default: the boundaries a step's longest sequence reaches with probability >= 2%, and the context);
    ``methods``: the candidate :class:`Method` s (default: per kind, TP 1..node size dividing the nodes, context
    parallelism CP 1, 2, 4, 8 with a stage's ``tp * cp`` devices dividing the nodes, PP 1, 2, 4, 8, with and without
    recomputation; ``max_tp`` and ``max_cp`` cap TP and CP).  A CP pipeline splits each sequence over its CP
    groups (less activation memory and attention per rank, a ring of keys and values): where it wins, long-length
    intervals get one.  Each strategy is planned on the sample restricted to
    its maximum length, its longest interval counted at least once a step.  Memory is checked with ZeRO-1 over two
    replicas; each strategy is then simulated at full windows and dropped if out of memory.

    ``widen`` (default): each pipeline's window -- the token budget of its micro-batches -- is then raised from the
    longest sequence it was planned for to the largest boundary (up to the context) its memory holds, so that the
    dispatcher may pack several short sequences into one larger micro-batch where that is cheaper (each
    micro-batch pays the executor's fixed cost once, :mod:`hspmd_sdk.runtime.control.overhead`), and the entry's
    ``max_seq_len`` becomes the longest sequence its windows hold (up to the context): the dispatcher may then
    give it a step longer than it was planned for where that is cheaper, and weighs each candidate by what its
    steps measure (:meth:`Dispatcher.observe`).  Where memory binds (long contexts on GPUs) the windows stay where
    the DP put them.  A candidate that runs the next one's strategy at its windows is dropped.

    ``packing``: the runtime will pack micro-batches (``launch(programs)``'s default for models whose kernels keep
    packed sequences apart): intervals are also priced as window-sized packed rows (no padding, attention per
    sequence), which favours fewer, fuller micro-batches, and ``widen`` may raise windows past the context (2, 4,
    8 times it, up to ``tokens_per_batch``): a packed row's attention stays per sequence.  Default ``False``:
    priced as padded micro-batches (an upper bound on what packing costs).

    Where ranks share cores (``cost.cores`` below the ranks of a node: local CPU workers), each maximum length is
    also planned with pipelines held to at least 2, 4, ... stages, and the variant whose dispatched sample steps
    the step simulator (processor sharing) finds fastest is kept; its ``estimate`` is that simulated mean.
    """
    model = load_model_spec(model)
    cost = cost or CostModel()
    context = int(context_len or max(lengths))
    lengths = [min(int(x), context) for x in lengths if x > 0]
    if not lengths:
        raise PlanValidationError([("lengths", "no positive sequence length in the sample")], what="mixed plan")
    bounds = sorted({b for b in (boundaries or _boundaries(context)) if 0 < b <= context} | {context})
    caps = sorted({min(int(c), context) for c in max_seq_lens} | {context}) if max_seq_lens else \
        _default_caps(lengths, bounds, tokens_per_batch)
    bounds = sorted(set(bounds) | set(caps))
    costs = _Methods(model, cluster, cost, schedule=schedule, zero1=zero1)
    todo = list(methods or _default_methods(model, cluster, max_tp, max_cp))
    shared = _oversubscribed(cluster, list(range(cluster.num_ranks)), cost)
    entries: list[MixedEntry] = []
    below = 0
    for cap in caps:
        sub = [x for x in lengths if x <= cap]
        top = [x for x in sub if x > below]
        if not top:
            continue
        per_step = len(top) * tokens_per_batch / sum(sub)
        weight = max(1, min(64, math.ceil(1.0 / per_step))) if per_step < 1 else 1
        skewed = sub + top * (weight - 1)  # a step for this strategy holds at least one sequence above `below`
        below = cap
        found: list[MixedEntry] = []
        for allowed in _variants(todo, shared):
            entry = _entry(costs, allowed, skewed, bounds, cap, context, tokens_per_batch, packing, widen,
                           model, cluster, cost, schedule, zero1)
            if entry is not None and all(e.strategy != entry.strategy for e in found):
                found.append(entry)
        if found:
            entries.append(_simulated(found, skewed, tokens_per_batch, model, cluster, cost, packing) if shared
                           else min(found, key=lambda e: e.estimate))
    entries = _distinct(entries)
    if not entries or entries[-1].max_seq_len < context:
        raise PlanValidationError([("lengths", f"no strategy for {model.name} on {cluster.num_ranks} devices takes "
                                               f"sequences of {context} tokens")], what="mixed plan")
    return MixedPlan(context_len=context, tokens_per_batch=tokens_per_batch, entries=entries)


def _distinct(entries: Sequence[MixedEntry]) -> list[MixedEntry]:
    """``entries`` less each one that runs the same strategy (its name aside) with the same windows as a later one
    taking sequences at least as long: that one serves the same steps the same way, so the other candidate would
    only add a name (widened windows can make candidates planned for different maximum lengths alike)."""
    def same(a: MixedEntry, b: MixedEntry) -> bool:
        return a.windows == b.windows and a.strategy.model_copy(update={"name": ""}) == \
            b.strategy.model_copy(update={"name": ""})
    return [e for i, e in enumerate(entries)
            if not any(same(e, f) and f.max_seq_len >= e.max_seq_len for f in entries[i + 1:])]


def _variants(todo: Sequence[Method], shared: bool) -> list[list[Method]]:
    """The method sets the DP runs on for one maximum length: all, and without context parallelism (the DP's
    overhead levels are estimates: CP only where its entry wins); where ranks share cores, also each set held to
    pipelines of at least 2, 4, ... stages, since the DP's lines charge a pipeline's bubble at the shared rate
    while a rank in a bubble frees its core (the step simulator decides, :func:`_simulated`)."""
    plain = [m for m in todo if m.cp == 1]
    sets = [list(todo)] + ([plain] if plain and len(plain) < len(todo) else [])
    if shared:
        depths = sorted({m.pp for m in todo if m.pp > 1})
        sets += [[m for m in ms if m.pp >= d] for ms in list(sets) for d in depths]
    return [ms for ms in sets if ms]


#: the steps per candidate :meth:`Dispatcher.factor` looks back on
_OBSERVED = 5

#: sample steps a candidate is simulated on where ranks share cores
_JUDGE_STEPS = 4


def _simulated(found: Sequence[MixedEntry], skewed: Sequence[int], tokens_per_batch: int, model: "ModelSpec",
               cluster: "Cluster", cost: CostModel, packing: bool) -> MixedEntry:
    """Where ranks share cores: the entry whose dispatched sample steps (``_JUDGE_STEPS`` drawn from ``skewed``)
    the step simulator, with processor sharing, finds fastest on average; its ``estimate`` is that mean."""
    steps = [sample_batch(skewed, tokens_per_batch, seed=k) for k in range(_JUDGE_STEPS)]
    judged = []
    for e in found:
        d = Dispatcher([e], model, cluster, cost=cost, packing=packing)
        judged.append(e.model_copy(update={"estimate": sum(d(x).estimate for x in steps) / len(steps)}))
    return min(judged, key=lambda e: e.estimate)


def _entry(costs: _Methods, todo: Sequence[Method], skewed: Sequence[int], bounds: Sequence[int], cap: int,
           context: int, tokens_per_batch: int, packing: bool, widen: bool, model: "ModelSpec", cluster: "Cluster",
           cost: CostModel, schedule: str, zero1: bool) -> MixedEntry | None:
    """The candidate for steps whose longest sequence is at most ``cap`` from the methods ``todo`` (the DP, the
    widened windows, placement and a simulation at full windows), or ``None``."""
    found = _best_interval_plan(costs, todo, skewed, [b for b in bounds if b <= cap],
                                tokens_per_batch / sum(skewed), packing)
    if found is None:
        return None
    est, chosen = found
    # packed rows may outgrow the context (attention stays per sequence): up to the tokens of a step
    reach = list(bounds) + [context * k for k in (2, 4, 8) if packing and context * k <= tokens_per_batch]
    wide = [(m, cnt, _widest(costs, m, w, reach)) for m, cnt, w in chosen] if widen else chosen
    for pick in ([wide, chosen] if wide != chosen else [chosen]):  # the widened windows, else the DP's
        strategy, windows, names = _place(costs, pick, schedule=schedule, zero1=zero1,
                                          name=f"mixed: planned for max_seq_len <= {cap}")
        r = simulate_shapes(model, strategy, cluster, [[(1, w)] * p.num_stages for w, p in
                                                       zip(windows, strategy.pipelines)], cost=cost)
        if not r.oom:  # widened: it takes every sequence its windows hold, the dispatcher choosing by cost
            takes = min(context, max(windows)) if pick is wide else cap
            return MixedEntry(max_seq_len=takes, windows=windows, methods=names, strategy=strategy,
                              estimate=est + _overhead(r))
    return None


# ---- online: dispatch ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dispatch:
    """Where each sequence of one step goes (:func:`dispatch`).

    * ``choice``: index of the chosen candidate (into the ``candidates`` given);
    * ``estimates[i]``: estimated step seconds of candidate ``i`` by the cost model (pipelines at their padded
      micro-batch shapes, then gradient synchronisation and optimizer); ``math.inf`` where the candidate's
      ``max_seq_len`` is shorter than the step's longest sequence;
    * ``switch[i]``: estimated seconds of switching from ``current`` to candidate ``i`` (all 0 without
      ``current``); ``factors[i]``: how much more candidate ``i``'s steps measured against their estimates so far
      than all candidates' (:meth:`Dispatcher.factor`; 1 before any); the choice minimises ``estimates[i] *
      factors[i] + switch[i]``;
    * ``micro_batches[p]``: the chosen candidate's pipeline ``p`` (``program.pipelines[p]``, ``strategy.pipelines[p]``)
      runs these micro-batches in this order, each a tuple of indices into ``lengths``; every index appears exactly
      once over all pipelines; a pipeline may get none (it still takes part in the gradient synchronisation);
    * ``lengths``: the step's sequence lengths, as given; ``strategy``, ``windows``, ``max_seq_len``: the chosen
      candidate's (its strategy's micro-batch fields are placeholders); ``pipeline_estimates[p]``: estimated seconds
      of pipeline ``p``'s forward and backward work.
    """

    choice: int
    estimates: tuple[float, ...]
    switch: tuple[float, ...]
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    lengths: tuple[int, ...]
    strategy: Strategy
    windows: tuple[int, ...]
    max_seq_len: int
    pipeline_estimates: tuple[float, ...]
    packed: bool = False
    factors: tuple[float, ...] = ()

    @property
    def estimate(self) -> float:
        """The chosen candidate's estimated step seconds (without the switch)."""
        return self.estimates[self.choice]

    def shapes(self) -> list[list[tuple[int, int]]]:
        """Per pipeline, per micro-batch: ``(rows, padded length)`` -- the tensor the runtime runs (packed: ``(1,
        its tokens)``)."""
        return [[shape[:2] for shape in pipe] for pipe in self.cost_shapes()]  # type: ignore[misc]

    def cost_shapes(self) -> list[list[tuple[int, ...]]]:
        """:meth:`shapes` as the cost model prices them: packed rows as ``(1, tokens, sum of squared lengths)``
        (attention runs per document)."""
        return _cost_shapes(self.micro_batches, self.lengths, self.packed)

    def padding_fraction(self) -> float:
        """Padding tokens over all tokens of the micro-batches (0 when packed)."""
        padded = sum(r * s for pipe in self.shapes() for r, s in pipe)
        return 1.0 - sum(self.lengths) / padded if padded else 0.0


@dataclass
class _Candidate:
    strategy: Strategy
    windows: list[int]
    max_seq_len: int
    pipes: list[PipelineCost]
    tail: float
    shared: bool  # some node of its devices has more ranks than cores: priced by the step simulator


def _cost_shapes(micro_batches: Sequence[Sequence[Sequence[int]]], lengths: Sequence[int],
                 packed: bool) -> list[list[tuple[int, ...]]]:
    """Per pipeline, per micro-batch of indices into ``lengths``: ``(rows, padded length)``, or a packed row's
    ``(1, tokens, sum of squared lengths)``."""
    if packed:
        return [[(1, sum(lengths[i] for i in mb), sum(lengths[i] ** 2 for i in mb)) for mb in pipe]
                for pipe in micro_batches]
    return [[(len(mb), max(lengths[i] for i in mb)) for mb in pipe] for pipe in micro_batches]


def _overhead(r: Any) -> float:
    """Seconds of a simulated step outside the pipelines' forward and backward work: the ZeRO-1 parameter gather
    before the first forward, the gradient synchronisation and the optimizer after the last backward."""
    starts = [e.start for evs in r.timeline.values() for e in evs if e.kind == "F"]
    return (min(starts) if starts else 0.0) + r.sync_time


def memory_windows(model: "ModelSpec", strategy: Strategy, cluster: "Cluster",
                   cost: CostModel | None = None) -> list[int]:
    """Per pipeline of ``strategy``, the longest micro-batch (one row of tokens) every stage of it holds in memory
    with the schedule's in-flight micro-batches (the memory check :func:`plan_mixed` uses), at most the model's
    ``max_seq_len``: the windows of a candidate that says nothing of its own.  A pipeline that cannot hold one
    token is refused, naming it."""
    cost = cost or CostModel()
    shards = len(strategy.pipelines) if strategy.zero1 and len(strategy.pipelines) > 1 else 1
    cache: dict = {}
    out = []
    for k, p in enumerate(strategy.pipelines):
        pc = PipelineCost.of(model, p, cluster, cost, cache)
        S = len(p.stages)
        capacity = [min(cluster.spec(d).memory_bytes - cost.runtime_bytes(cluster.kind(d)) for d in st.devices)
                    for st in p.stages]

        def fits(w: int) -> bool:
            return all(sc.fits(w, in_flight(strategy.schedule, S, s, S), shards, capacity[s])
                       for s, sc in enumerate(pc.stages))

        lo, hi = 0, int(model.max_seq_len)  # fits(lo) holds (or lo = 0); the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        if lo < 1:
            raise PlanValidationError([(f"pipelines[{k}]", f"holds no micro-batch of even one token in memory "
                                                           f"(stages on ranks {[list(s.devices) for s in p.stages]})")],
                                      what=f"strategy {strategy.name or ''}".strip())
        out.append(lo)
    return out


def _candidate_parts(i: int, cand: Any, model: "ModelSpec", cluster: "Cluster",
                     cost: CostModel) -> tuple[Strategy, list[int], int]:
    """A candidate's strategy, windows and longest sequence: a :class:`MixedEntry`'s own, a Program's from
    :meth:`MixedPlan.programs` (``plan.settings``); any other Program made from a strategy (``plan_from_strategy``)
    or a :class:`~hspmd_sdk.core.strategy.Strategy` takes what its memory holds (:func:`memory_windows`), up to the
    longest sequence its settings state (``ExecutionSettings.max_seq_len``) where they state one."""
    if isinstance(cand, MixedEntry):
        return cand.strategy, list(cand.windows), cand.max_seq_len
    stated = None
    if isinstance(cand, Strategy):
        strategy = cand
    else:
        settings = getattr(getattr(cand, "plan", None), "settings", None)
        if isinstance(settings, ExecutionSettings) and settings.is_candidate:
            return Strategy.load(settings.strategy), list(settings.windows or ()), int(settings.max_seq_len or 0)
        if not isinstance(settings, ExecutionSettings) or settings.strategy is None:
            raise PlanValidationError([(f"candidates[{i}]", "is neither a Strategy nor a Program made from one "
                                                            "(plan_from_strategy, MixedPlan.programs) nor a "
                                                            "MixedEntry: the dispatcher needs its pipelines")],
                                      what="dispatch")
        strategy = Strategy.load(settings.strategy)
        stated = settings.max_seq_len
    windows = memory_windows(model, strategy, cluster, cost)
    return strategy, windows, max(windows) if stated is None else min(int(stated), max(windows))


class Dispatcher:
    """:func:`dispatch` with the candidates' costs prepared once (stage cost lines, gradient-sync tails): build it
    when the job starts and call it per step.  ``candidates``: a :class:`MixedPlan`, or a list of Programs (from
    :meth:`MixedPlan.programs`, or any made from a strategy: their windows are what their memory holds,
    :func:`memory_windows`), of :class:`~hspmd_sdk.core.strategy.Strategy` or of :class:`MixedEntry`.
    ``packing``: micro-batches are single rows packing whole sequences back to back (at most the window in tokens,
    no padding; attention per sequence) instead of padded ``rows x longest`` tensors; each candidate's rows are then
    assigned two ways, :func:`_assign` and the fewest rows its windows allow (:func:`_fewest_rows`), and the cheaper
    kept.  Where a candidate's ranks share cores (``CostModel.cores``), its estimate is the simulated step of its
    assignment (:func:`~hspmd_sdk.planner.mixed_sim.simulate_shapes`, processor sharing) rather than the cost
    lines' sum."""

    def __init__(self, candidates: "MixedPlan | Sequence[Any]", model: "ModelSpec | str", cluster: "Cluster", *,
                 cost: CostModel | None = None, packing: bool = False) -> None:
        self.model, self.cluster, self.cost = load_model_spec(model), cluster, cost or CostModel()
        self.packing = bool(packing)
        items = list(candidates.entries) if isinstance(candidates, MixedPlan) else list(candidates)
        if not items:
            raise PlanValidationError([("candidates", "no candidate strategy")], what="dispatch")
        self._costs: dict = {}  # stage costs, shared by the candidates and every step's simulation
        self.candidates: list[_Candidate] = []
        for i, c in enumerate(items):
            strategy, windows, cap = _candidate_parts(i, c, self.model, cluster, self.cost)
            if len(windows) != strategy.dp_degree or max(windows) < cap:
                raise PlanValidationError([(f"candidates[{i}].windows", f"{windows} for {strategy.dp_degree} "
                                            f"pipelines: one window a pipeline, the largest at least max_seq_len "
                                            f"{cap}")], what="dispatch")
            pipes = [PipelineCost.of(self.model, p, cluster, self.cost, self._costs) for p in strategy.pipelines]
            tail = _overhead(simulate_shapes(self.model, strategy, cluster, [[(1, w)] for w in windows],
                                             cost=self.cost, cache=self._costs))
            shared = _oversubscribed(cluster, strategy.ranks, self.cost)
            self.candidates.append(_Candidate(strategy, windows, cap, pipes, tail, shared))
        self._switch: dict[tuple[int, int], float] = {}
        self._ratios: dict[int, list[float]] = {}  # candidate -> measured / estimated of its last steps (observe)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence any candidate takes."""
        return max(c.max_seq_len for c in self.candidates)

    def switch_time(self, src: int, dst: int) -> float:
        """Estimated seconds of switching candidate ``src`` -> ``dst`` (:func:`switch_estimate`; cached)."""
        if (src, dst) not in self._switch:
            self._switch[(src, dst)] = switch_estimate(self.model, self.cluster, self.candidates[src].strategy,
                                                       self.candidates[dst].strategy, self.cost)
        return self._switch[(src, dst)]

    def __call__(self, lengths: Sequence[int], *, current: int | None = None) -> Dispatch:
        """Dispatch one step's sequence ``lengths`` (see :func:`dispatch`)."""
        lengths = tuple(int(x) for x in lengths)
        self._check(lengths, current)
        longest = max(lengths)
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        estimates, switch, assigned = [], [], {}
        for i, c in enumerate(self.candidates):
            switch.append(0.0 if current is None or current == i else self.switch_time(current, i))
            if c.max_seq_len < longest:
                estimates.append(math.inf)
                continue
            ways = [_assign(c.pipes, c.windows, order, lengths, packed=self.packing)]
            if self.packing:
                fewest = _fewest_rows(c.pipes, c.windows, order, lengths)
                if fewest[0] != ways[0][0]:
                    ways.append(fewest)
            priced = [(self._estimate(c, mbs, times, lengths), k) for k, (mbs, times) in enumerate(ways)]
            estimate, k = min(priced)
            assigned[i] = ways[k]
            estimates.append(estimate)
        factors = [self.factor(i) for i in range(len(self.candidates))]
        choice = min(assigned, key=lambda i: (estimates[i] * factors[i] + switch[i], i))
        mbs, times = assigned[choice]
        c = self.candidates[choice]
        return Dispatch(choice, tuple(estimates), tuple(switch), tuple(tuple(tuple(mb) for mb in p) for p in mbs),
                        lengths, c.strategy, tuple(c.windows), c.max_seq_len, tuple(times), self.packing,
                        tuple(factors))

    def _estimate(self, c: _Candidate, mbs: list[list[list[int]]], times: list[float],
                  lengths: Sequence[int]) -> float:
        """Candidate ``c``'s step seconds with these micro-batches: simulated where its ranks share cores, else
        the slowest pipeline's estimate plus the gradient-sync tail."""
        if c.shared:
            return simulate_shapes(self.model, c.strategy, self.cluster, _cost_shapes(mbs, lengths, self.packing),
                                   cost=self.cost, cache=self._costs).step_time
        return max(times) + c.tail

    def observe(self, choice: int, estimate: float, measured: float) -> None:
        """A step dispatched to candidate ``choice`` with ``estimate`` seconds took ``measured`` (the job's launcher
        reports its finished steps, switches excluded).  From then on the choice weighs each candidate's estimate
        by :meth:`factor`: how the cost model errs for each candidate is measured, not assumed equal (on a shared
        CPU a context-parallel candidate's ring and per-document pieces cost several times what its FLOPs say;
        on a GPU they may not)."""
        if estimate > 0 and measured > 0 and 0 <= choice < len(self.candidates):
            ratios = self._ratios.setdefault(choice, [])
            ratios.append(measured / estimate)
            del ratios[:-_OBSERVED]

    def factor(self, i: int) -> float:
        """How much more candidate ``i``'s steps measure against their estimates than the candidates' together:
        the median of its last observed ratios over the median of all of them.  The cost model's common error
        (a loaded machine, a profile taken elsewhere) cancels, so switch estimates keep their weight; a candidate
        not yet run has 1."""
        own = self._ratios.get(i)
        if not own:
            return 1.0
        return float(statistics.median(own) / statistics.median([r for rs in self._ratios.values() for r in rs]))

    def _check(self, lengths: tuple[int, ...], current: int | None) -> None:
        if not lengths:
            raise PlanValidationError([("lengths", "a step needs at least one sequence")], what="dispatch")
        cap = self.max_seq_len
        for i, x in enumerate(lengths):
            if x <= 0:
                raise PlanValidationError([(f"lengths[{i}]", f"{x} tokens; a sequence has at least one")],
                                          what="dispatch")
            if x > cap:
                raise PlanValidationError([(f"lengths[{i}]", f"{x} tokens is longer than the largest candidate's "
                                                             f"context ({cap}); the data layer cuts such documents "
                                                             "into chunks before dispatch")], what="dispatch")
        if current is not None and not 0 <= current < len(self.candidates):
            raise PlanValidationError([("current", f"{current} is not a candidate index "
                                                   f"(0..{len(self.candidates) - 1})")], what="dispatch")


def _assign(pipes: Sequence[PipelineCost], windows: Sequence[int], order: Sequence[int],
            lengths: Sequence[int], *, packed: bool = False) -> tuple[list[list[list[int]]], list[float]]:
    """Sequences (``order``: longest first) one at a time to where the estimated finish time grows least: over the
    pipelines whose window holds it, either into the pipeline's open micro-batch (while ``rows x longest <=
    window``, padded to its longest; ``packed``: while its tokens stay within the window, appended to its row)
    or as a new micro-batch.  Returns the micro-batches (indices) and each pipeline's estimated seconds
    (:meth:`PipelineCost.time`)."""
    P = len(pipes)
    mbs: list[list[list[int]]] = [[] for _ in range(P)]
    total, fill = [0.0] * P, [0.0] * P
    # the open micro-batch: padded (rows, longest) or packed (tokens, sum of squares); its bottleneck, its fill
    opened: list[tuple[int, int, float, float] | None] = [None] * P
    parts_cache: dict[tuple[int, int, int], tuple[float, float]] = {}

    def parts(p: int, r: int, s: int) -> tuple[float, float]:
        key = (id(pipes[p]), r, s)
        hit = parts_cache.get(key)
        if hit is None:
            hit = parts_cache[key] = pipes[p].parts(1, r, s) if packed else pipes[p].parts(r, s)
        return hit

    def grown(op: tuple[int, int, float, float], x: int, w: int) -> tuple[int, int] | None:
        if packed:
            return (op[0] + x, op[1] + x * x) if op[0] + x <= w else None
        return (op[0] + 1, op[1]) if (op[0] + 1) * op[1] <= w else None

    for idx in order:
        x = lengths[idx]
        best: tuple[tuple[float, int, int, int], int, bool, float, float] | None = None
        for p in range(P):
            w = windows[p]
            if x > w:
                continue
            op = opened[p]
            g = grown(op, x, w) if op is not None else None
            if op is not None and g is not None:  # join the open micro-batch
                b, f = parts(p, *g)
                key = (total[p] - op[2] + b + max(fill[p], f), w, p, 0)
                if best is None or key < best[0]:
                    best = (key, p, True, b, f)
            new = (x, x * x) if packed else (1, x)
            b, f = parts(p, *new)  # or open a new one
            key = (total[p] + b + max(fill[p], f), w, p, 1)
            if best is None or key < best[0]:
                best = (key, p, False, b, f)
        assert best is not None  # _check: every length fits the largest window of an eligible candidate
        _, p, join, b, f = best
        if join:
            op = opened[p]
            assert op is not None
            g = grown(op, x, windows[p])
            assert g is not None
            total[p] += b - op[2]
            mbs[p][-1].append(idx)
            opened[p] = (g[0], g[1], b, f)
        else:
            total[p] += b
            mbs[p].append([idx])
            opened[p] = ((x, x * x) if packed else (1, x)) + (b, f)
        fill[p] = max(fill[p], f)
    return mbs, [t + f if t > 0 else 0.0 for t, f in zip(total, fill)]


def _fewest_rows(pipes: Sequence[PipelineCost], windows: Sequence[int], order: Sequence[int],
                 lengths: Sequence[int]) -> tuple[list[list[list[int]]], list[float]]:
    """Packed rows, as few as the windows allow: sequences (``order``: longest first) one at a time to the pipeline
    whose estimated time grows least, into the fullest of its rows that still holds it (best fit), a new row only
    where none does.  Where ranks share cores a pipeline's bubbles are other ranks' compute, so fewer, fuller
    micro-batches can beat :func:`_assign`'s, which opens a row wherever a dedicated device's bubble says so; the
    dispatcher prices both and keeps the cheaper.  Returns what :func:`_assign` does."""
    P = len(pipes)
    mbs: list[list[list[int]]] = [[] for _ in range(P)]
    rows: list[list[list[float]]] = [[] for _ in range(P)]  # per pipeline, per row: [tokens, sum of squares, b, f]
    total = [0.0] * P

    def time(p: int) -> float:
        return total[p] + max((r[3] for r in rows[p]), default=0.0)

    for idx in order:
        x = lengths[idx]
        best: tuple[float, int, int, float, float] | None = None
        for p in range(P):
            if x > windows[p]:
                continue
            fit = [k for k, r in enumerate(rows[p]) if r[0] + x <= windows[p]]
            k = max(fit, key=lambda k: (rows[p][k][0], -k)) if fit else -1
            row = rows[p][k] if k >= 0 else [0, 0, 0.0, 0.0]
            b, f = pipes[p].parts(1, int(row[0]) + x, row[1] + x * x)
            others = max((r[3] for j, r in enumerate(rows[p]) if j != k), default=0.0)
            grown = total[p] - row[2] + b + max(f, others)
            if best is None or (grown, p) < best[:2]:
                best = (grown, p, k, b, f)
        assert best is not None  # _check: every length fits the largest window of an eligible candidate
        _, p, k, b, f = best
        if k >= 0:
            row = rows[p][k]
            total[p] += b - row[2]
            rows[p][k] = [row[0] + x, row[1] + x * x, b, f]
            mbs[p][k].append(idx)
        else:
            total[p] += b
            rows[p].append([x, x * x, b, f])
            mbs[p].append([idx])
    return mbs, [time(p) if mbs[p] else 0.0 for p in range(P)]


def dispatch(candidates: "MixedPlan | Sequence[Any]", model: "ModelSpec | str", cluster: "Cluster",
             lengths: Sequence[int], *, cost: CostModel | None = None, current: int | None = None,
             packing: bool = False) -> Dispatch:
    """Assign one step's sequences to the pipelines of each candidate and choose the cheapest candidate.

    ``candidates``: a :class:`MixedPlan`, or a list of Programs from :meth:`MixedPlan.programs`; ``lengths``: the
    sequence lengths of the step (fixed by the data: only where each goes is decided here); ``current``: the
    candidate the job runs now, so that switching away costs :meth:`Dispatcher.switch_time`.  Each pipeline's
    micro-batches are padded ``[rows, longest]`` tensors of at most its window in tokens, costed at that shape
    (attention's quadratic term included); ``packing``: single rows of whole sequences back to back, at most the
    window in tokens, attention priced per sequence.  Raises :class:`PlanValidationError` for an empty step, a non-positive
    length, or a sequence longer than every candidate's ``max_seq_len`` (the data layer cuts those into chunks).
    For many steps build a :class:`Dispatcher` once.

    >>> from hspmd_sdk.core.cluster import Cluster
    >>> cl = Cluster.homogeneous("H20", 8)
    >>> plan = plan_mixed("llama-7b", cl, [512] * 90 + [4096] * 10, tokens_per_batch=16384, context_len=4096)
    >>> d = dispatch(plan, "llama-7b", cl, [4096, 100, 2000, 512])
    >>> sorted(i for pipe in d.micro_batches for mb in pipe for i in mb)
    [0, 1, 2, 3]
    """
    return Dispatcher(candidates, model, cluster, cost=cost, packing=packing)(lengths, current=current)


def simulate_dispatch(model: "ModelSpec | str", cluster: "Cluster", d: "Dispatch", *,
                      cost: CostModel | None = None) -> SimResult:
    """:func:`~hspmd_sdk.planner.mixed_sim.simulate_shapes` of a :class:`Dispatch`: the chosen candidate's strategy
    with each pipeline's micro-batches at their shapes (``d.cost_shapes()``: padded, or packed rows)."""
    return simulate_shapes(model, d.strategy, cluster, d.cost_shapes(), cost=cost,
                           label=f"dispatched step on candidate {d.choice} (max_seq_len {d.max_seq_len})")


def simulate_mixed(model: "ModelSpec | str", cluster: "Cluster", d: "Dispatch", *,
                   cost: CostModel | None = None) -> tuple[float, list[int]]:
    """The short form of :func:`simulate_dispatch`: (simulated step seconds, devices out of memory)."""
    r = simulate_dispatch(model, cluster, d, cost=cost)
    return r.step_time, r.oom
