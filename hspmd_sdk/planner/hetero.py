"""Scenario (a), heterogeneous devices: the paper's two-level planner (Appendix A.1 (a)).

The objective is the paper's: minimise the maximum estimated execution time over the devices, subject to every
device's memory.  Estimates come from the operator-centric cost model (:mod:`hspmd_sdk.planner.cost`); the few
best plans are then ranked by the step simulator (:func:`hspmd_sdk.planner.simulate`).

**Heuristic-guided search** (prunes the first level before any solver runs):

* TP groups live inside one node, hence on one device kind; the TP degree of a kind is a power of two no larger
  than the node and dividing the heads, KV heads, hidden and FFN sizes (:func:`tp_degrees`);
* every ``(TP degree per kind, number of pipelines D, micro-batch size b)`` is scored by a closed-form bound
  (balanced layers, ``(m + S - 1)`` stage times per pipeline) and by total memory; only the ``candidates`` best
  go to the solvers;
* groups of a kind are spread over the pipelines as evenly as possible (``floor(G_k / D)`` each, the remainder
  ``G_k mod D`` placed by the solver); stages are ordered by device kind, slow kinds first or fast kinds first
  (both are tried), groups of a kind in rank order (consecutive groups share a node).

**First level, pipeline configuration** (:func:`configure_pipelines`): a Pyomo model.  Variables: ``y[p, k]``
(binary, does pipeline ``p`` get one of the remaining groups of kind ``k``), ``m[p]`` (integer micro-batches) and
the makespan ``T``.  Pipeline ``p`` has ``S_p = sum_k (f_k + y_pk)`` stages of capacity
``C_p = sum_k (f_k + y_pk) c_k`` (``c_k``: layers per second of one group of kind ``k``); with layers balanced by
capacity its 1F1B time is ``L (m_p + S_p - 1) / C_p``, so the constraint ``L (m_p + S_p - 1) <= T C_p`` is
bilinear (``T * y``): a MINLP.  Because ``y`` is binary the product is linearised exactly (McCormick,
``w = T y``), and HiGHS (``appsi_highs``) solves the resulting MILP.  Memory enters as a linear lower bound on the
pipeline's total memory.

**Second level, layer and micro-batch assignment** (PuLP + CBC): per distinct pipeline an ILP
(:func:`solve_layers`) gives each stage an integer number of layers minimising the 1F1B time
``sum_s t_s + (m - 1) max_s t_s`` under each stage's memory (parameters, gradients, optimizer states divided by
ZeRO-1, in-flight activations, LM-head logits); then one ILP (:func:`solve_micro_batches`) splits the global
batch's micro-batches over the pipelines to minimise the slowest pipeline.

**ZeRO shares** (:mod:`.zero_shares`), where the devices differ in memory: a pipeline type needs room only beyond
the states ZeRO does not shard, the pipelines together holding the sharded part (a pooled constraint of the first
level); a pipeline whose layer ILP has no solution at even shares is solved again at its share by free memory
(:func:`share_shards`); every candidate strategy then gets its shares from the memory estimate before the
simulator ranks it.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from ..core.comm_ops import OpKind
from ..core.schedule import in_flight
from ..core.strategy import Strategy
from ..errors import PlanValidationError
from ..models.registry import load_model_spec
from ._pulp import _cbc, _variable
from .cost import BF16, FP32, CostModel, embedding_cost, head_cost, layer_cost
from .hetero_mixed import arrangement_strategies, mixed_arrangements, recomputing
from .simulator import SimResult, simulate
from .zero_shares import peak_fraction, shares_note, with_memory_shares

if TYPE_CHECKING:  # pragma: no cover
    from ..core.cluster import Cluster
    from ..core.model_spec import ModelSpec

__all__ = ["plan_hetero", "TPGroup", "StageProfile", "PipelinePlan", "Candidate", "PlanContext", "tp_degrees",
           "split_node", "make_groups", "configure_pipelines", "solve_layers", "solve_micro_batches",
           "build_strategy", "rank_by_simulation", "refine_micro_batches", "enumerate_candidates", "search",
           "solve_candidate", "solve_pipelines", "share_shards", "pick"]


# ---- TP groups ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group: ranks on one node (so of one device kind)."""

    ranks: tuple[int, ...]
    kind: str
    node: int

    @property
    def tp(self) -> int:
        return len(self.ranks)


def tp_degrees(model: "ModelSpec", max_degree: int) -> list[int]:
    """Powers of two up to ``max_degree`` that the model can take as TP degree (``model.tp_problems``)."""
    out, d = [], 1
    while d <= max_degree:
        if d == 1 or not model.tp_problems(d):
            out.append(d)
        d *= 2
    return out


def split_node(ranks: Sequence[int], degree: int, allowed: Sequence[int]) -> list[list[int]]:
    """Cut one node's ``ranks`` (in order) into TP groups of ``degree``; a remainder is cut into the largest
    ``allowed`` degrees that fit (7 ranks at degree 4: groups of 4, 2 and 1, as the paper's C2)."""
    out, i = [], 0
    sizes = sorted(allowed, reverse=True)  # a remainder (left < degree) takes only sizes <= left
    while i < len(ranks):
        left = len(ranks) - i
        take = degree if left >= degree else next(a for a in sizes if a <= left)
        out.append(list(ranks[i:i + take]))
        i += take
    return out


def make_groups(cluster: "Cluster", ranks: Iterable[int], degree: dict[str, int],
                allowed: Sequence[int]) -> dict[str, list[TPGroup]]:
    """TP groups of the given ``ranks`` (a subset of the cluster), node by node, at ``degree[kind]``."""
    wanted = set(ranks)
    out: dict[str, list[TPGroup]] = {}
    for n, node in enumerate(cluster.nodes):
        here = [r for r in node.ranks if r in wanted]
        if not here:
            continue
        for g in split_node(here, degree[node.kind], allowed):
            out.setdefault(node.kind, []).append(TPGroup(tuple(g), node.kind, n))
    return out


# ---- per-group costs ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageProfile:
    """Costs of one TP group per micro-batch of size ``b``: seconds (forward + backward) per decoder layer, for
    the embedding and for the LM head; bytes per device per layer (static: parameters, gradients, optimizer
    part; activations per in-flight micro-batch); the embedding's and head's bytes; capacity."""

    layer_time: float
    emb_time: float
    head_time: float
    layer_static: float
    layer_act: float
    layer_transient: float
    emb_static: float
    emb_act: float
    head_static: float
    head_act: float
    head_transient: float
    capacity: float


def _static_bytes(params: float, zero_shards: float, zero: int = 1) -> float:
    """Model-state bytes of ``params`` parameters: bf16 weights and gradients, fp32 master and Adam moments; the
    optimizer part over ``zero_shards`` replicas, from ZeRO level 2 the gradients too, at level 3 the weights too
    (what ZeRO-3 gathers at once is a stage's transient: :func:`_gathered`)."""
    z = max(zero_shards, 1.0)
    return params * (BF16 / (z if zero >= 3 else 1.0) + BF16 / (z if zero >= 2 else 1.0) + 3 * FP32 / z)


def _gathered(params: float, zero: int) -> float:
    """ZeRO-3's gathered weights at once on a rank whose largest unit holds ``params`` parameters: the unit being
    read and the next one prefetched (:func:`hspmd_sdk.core.memory.zero3_gathered`; the planner's units are
    layers, whose bf16 weights at the sizes it plans exceed the runtime's least unit); nothing below level 3."""
    return 2 * params * BF16 if zero >= 3 else 0.0


class PlanContext:
    """The model, cluster, workload and cost model a planning run shares, with a cache of group profiles."""

    def __init__(self, model: "ModelSpec", cluster: "Cluster", *, global_batch: int, seq_len: int,
                 cost: CostModel | None = None, schedule: str = "1f1b", zero1: bool = True,
                 zero: int | None = None, zero_shares: bool = False) -> None:
        self.model, self.cluster, self.global_batch, self.seq_len = model, cluster, global_batch, seq_len
        self.cost = cost or CostModel()
        # the ZeRO level of the strategies planned (SPEC §15); zero1 is its alias for levels 0 and 1
        self.zero = (1 if zero1 else 0) if zero is None else int(zero)
        self.schedule, self.zero1 = schedule, self.zero >= 1
        # uneven ZeRO shares by free memory (:mod:`.zero_shares`): plan_hetero's, where the devices' memory differs
        self.zero_shares = zero_shares and self.zero >= 1
        # activation recomputation, the layer ILPs' fallback where a pipeline does not fit: not at ZeRO-3, where a
        # layer ILP's per-pipeline choice would differ between replicas (ZeRO-3 recomputes only alike in every
        # pipeline: Strategy._zero3_problem; build_strategy)
        self.recompute_options: tuple[bool, ...] = (False,) if self.zero >= 3 else (False, True)
        self._profiles: dict[tuple, StageProfile] = {}
        self._links: dict[tuple, object] = {}
        self._group_links: dict[tuple, object] = {}
        self._costs: dict[tuple, tuple] = {}

    def link(self, a: int, b: int):
        """``cluster.link(a, b)``, cached."""
        hit = self._links.get((a, b))
        if hit is None:
            hit = self._links[(a, b)] = self.cluster.link(a, b)
        return hit

    def zero_shards(self, num_pipelines: int) -> int:
        return num_pipelines if self.zero1 else 1

    def state_bytes(self) -> tuple[float, float]:
        """The whole model's state bytes that ZeRO does not shard and those it does, at this level."""
        m = self.model
        params = m.num_layers * m.layer_param_count() + m.embedding_param_count() + m.head_param_count()
        sharded = params * (3 * FP32 + (BF16 if self.zero >= 2 else 0.0) + (BF16 if self.zero >= 3 else 0.0)) \
            if self.zero1 else 0.0
        return params * (2 * BF16 + 3 * FP32) - sharded, sharded

    def profile(self, group: TPGroup, micro_batch: int, zero_shards: int, recompute: bool = False) -> StageProfile:
        """The :class:`StageProfile` of ``group`` (operator costs cached by kind, TP degree and link: its class,
        bandwidth and latency -- an ``intra`` link is NVLink inside a node or the host's link between its nodes)."""
        link = self._group_links.get(group.ranks)
        if link is None:
            # the slowest link of the ring (a group may span nodes: mixed-length plans); one rank: its own link
            r = group.ranks
            link = min((self.link(a, b) for a, b in zip(r, r[1:] + r[:1])), key=lambda l: l.bandwidth)
            self._group_links[group.ranks] = link
        key = (group.kind, group.tp, link, micro_batch, zero_shards, recompute)
        hit = self._profiles.get(key)
        if hit is None:
            base = self._costs.get(key[:4] + key[5:])
            if base is None:
                base = self._costs[key[:4] + key[5:]] = self._operator_costs(group, link, micro_batch, recompute)
            hit = self._profiles[key] = self._make_profile(group.kind, base, zero_shards)
        return hit

    def _operator_costs(self, group: TPGroup, link, b: int, recompute: bool) -> tuple:
        spec = self.cluster.devices[group.kind]
        m, s, c, t = self.model, self.seq_len, self.cost, group.tp
        return (layer_cost(m, spec, t, link, b, s, c, recompute=recompute), embedding_cost(m, spec, t, link, b, s, c),
                head_cost(m, spec, t, link, b, s, c))

    def _make_profile(self, kind: str, base: tuple, z: int) -> StageProfile:
        lay, emb, head = base
        spec = self.cluster.devices[kind]
        gathered = _gathered(max(lay.params, emb.params, head.params), self.zero)
        return StageProfile(
            layer_time=lay.fwd + lay.bwd, emb_time=emb.fwd + emb.bwd, head_time=head.fwd + head.bwd,
            layer_static=_static_bytes(lay.params, z, self.zero), layer_act=lay.act_bytes,
            layer_transient=lay.transient_bytes + gathered,
            emb_static=_static_bytes(emb.params, z, self.zero), emb_act=emb.act_bytes,
            head_static=_static_bytes(head.params, z, self.zero), head_act=head.act_bytes,
            head_transient=head.transient_bytes + gathered,
            capacity=spec.memory_mb * 2.0**20 - self.cost.runtime_bytes(kind))

    def p2p_time(self, a: TPGroup, b: TPGroup, micro_batch: int) -> float:
        """One activation (or gradient) between neighbouring stages."""
        nbytes = micro_batch * self.seq_len * self.model.hidden_size * BF16
        link = min((self.link(x, y) for x, y in zip(a.ranks, b.ranks)), key=lambda l: l.bandwidth)
        return self.cost.p2p_time(nbytes, link)

    def in_flight(self, num_stages: int, stage: int, num_micro_batches: int) -> int:
        return in_flight(self.schedule, num_stages, stage, num_micro_batches)


# ---- second level: layers per stage, micro-batches per pipeline -----------------------------------------------
@dataclass(frozen=True)
class PipelinePlan:
    """One pipeline after the layer ILP: its stages (groups, in order), layers per stage, per-micro-batch stage
    times (s) and the boundary transfer time (s) of one micro-batch (all boundaries, both directions)."""

    groups: tuple[TPGroup, ...]
    layers: tuple[int, ...]
    stage_times: tuple[float, ...]
    p2p: float
    recompute: bool = False

    @property
    def bottleneck(self) -> float:
        return max(self.stage_times)

    def time(self, num_micro_batches: int) -> float:
        """Estimated 1F1B time: fill and drain (every stage once) plus ``m - 1`` bottleneck stage times."""
        if num_micro_batches <= 0:
            return 0.0
        return sum(self.stage_times) + (num_micro_batches - 1) * self.bottleneck + self.p2p


def _stage_parts(prof: StageProfile, first: bool, last: bool, held: int) -> tuple[float, float, float, float]:
    """(fixed seconds, fixed bytes, bytes per layer, transient bytes) of one stage."""
    fixed_t = (prof.emb_time if first else 0.0) + (prof.head_time if last else 0.0)
    fixed_b = ((prof.emb_static + prof.emb_act * held) if first else 0.0) + \
        ((prof.head_static + prof.head_act * held) if last else 0.0)
    per_layer = prof.layer_static + prof.layer_act * held
    transient = max(prof.layer_transient, prof.head_transient if last else 0.0)
    return fixed_t, fixed_b, per_layer, transient


def solve_layers(ctx: PlanContext, groups: Sequence[TPGroup], micro_batch: int, num_micro_batches: int,
                 zero_shards: int, *, recompute: bool = False, time_limit: float = 10.0) -> PipelinePlan | None:
    """The layer-assignment ILP of one pipeline (PuLP + CBC); ``None`` when no assignment fits in memory.

    Integer ``x_s >= 1`` layers on stage ``s`` with ``sum x_s = L``; stage time
    ``t_s = x_s * layer_time + embedding/head``; minimise ``sum_s t_s + (m - 1) tau`` with ``tau >= t_s``;
    per stage ``x_s * (static + activations * in_flight) + fixed <= capacity``.
    """
    import pulp

    L, S, m = ctx.model.num_layers, len(groups), max(num_micro_batches, 1)
    if S > L:
        return None
    profs = [ctx.profile(g, micro_batch, zero_shards, recompute) for g in groups]
    parts = [_stage_parts(p, s == 0, s == S - 1, ctx.in_flight(S, s, m)) for s, p in enumerate(profs)]
    ub = []
    for (ft, fb, per, tr), p in zip(parts, profs):
        room = p.capacity - fb - tr
        ub.append(int(room // per) if per > 0 else L)  # (x_s <= L - (S - 1) follows from the other x >= 1)
        if ub[-1] < 1:
            return None
    prob = pulp.LpProblem("layers", pulp.LpMinimize)
    x = [_variable(prob, f"x{s}", 1, ub[s], "Integer") for s in range(S)]
    tau = _variable(prob, "tau", 0, None, "Continuous")
    times = [x[s] * profs[s].layer_time + parts[s][0] for s in range(S)]
    prob += pulp.lpSum(times) + (m - 1) * tau
    prob += pulp.lpSum(x) == L
    for t in times:
        prob += tau >= t
    prob.solve(_cbc(time_limit))
    if pulp.LpStatus[prob.status] != "Optimal":
        return None
    counts = tuple(int(round(v.value())) for v in x)
    stage_times = tuple(c * p.layer_time + pt[0] for c, p, pt in zip(counts, profs, parts))
    p2p = 2 * sum(ctx.p2p_time(a, b, micro_batch) for a, b in zip(groups, groups[1:]))
    return PipelinePlan(tuple(groups), counts, stage_times, p2p, recompute)


def solve_micro_batches(pipes: Sequence[PipelinePlan], total: int, *, extra: Sequence[float] | None = None,
                        time_limit: float = 10.0) -> tuple[list[int], float] | None:
    """The micro-batch ILP (PuLP + CBC): integer ``m_p >= 1`` with ``sum m_p = total`` minimising
    ``max_p time_p(m_p) + extra_p``.  Returns the counts and the makespan, or ``None`` if ``total`` is
    smaller than the number of pipelines.

    Identical pipelines (same stage times and overheads) form a class solved together: an optimum exists in
    which they differ by at most one micro-batch, so a class has ``m_c`` (integer), ``e_c`` pipelines with one
    more (integer), and a binary ``z_c >= e_c / n_c`` that adds one bottleneck time when ``e_c > 0`` -- the
    model stays small for a thousand pipelines.
    """
    import pulp

    if total < len(pipes):
        return None
    extra = list(extra or [0.0] * len(pipes))
    classes: dict[tuple, list[int]] = {}
    for p, (pipe, e) in enumerate(zip(pipes, extra)):
        classes.setdefault((pipe.stage_times, pipe.p2p, e), []).append(p)
    prob = pulp.LpProblem("micro_batches", pulp.LpMinimize)
    T = _variable(prob, "T", 0, None, "Continuous")
    prob += T
    parts, var = [], {}
    for c, members in enumerate(classes.values()):
        n, pipe, e = len(members), pipes[members[0]], extra[members[0]]
        m = _variable(prob, f"m{c}", 1, None, "Integer")  # (m <= total follows from the sum)
        more = _variable(prob, f"e{c}", 0, n - 1, "Integer")
        z = _variable(prob, f"z{c}", 0, 1, "Binary")
        prob += n * z >= more
        prob += T >= sum(pipe.stage_times) + pipe.p2p - pipe.bottleneck + (m + z) * pipe.bottleneck + e
        parts.append(n * m + more)
        var[c] = (m, more, members)
    prob += pulp.lpSum(parts) == total
    prob.solve(_cbc(time_limit))
    if pulp.LpStatus[prob.status] != "Optimal":
        return None
    counts = [0] * len(pipes)
    for m, more, members in var.values():
        base, plus = int(round(m.value())), int(round(more.value()))
        for i, p in enumerate(members):
            counts[p] = base + (1 if i < plus else 0)
    return counts, max(p.time(c) + e for p, c, e in zip(pipes, counts, extra))


# ---- first level: pipeline configuration ----------------------------------------------------------------------
@dataclass
class Candidate:
    """One point of the search: TP degree per kind, number of pipelines, micro-batch size, stage order, and
    (after the solvers) the pipelines, their micro-batch counts and the estimated step time."""

    degree: dict[str, int]
    num_pipelines: int
    micro_batch: int
    bound: float
    compositions: list[list[TPGroup]] = field(default_factory=list)
    order: str = "slow_first"
    pipes: list[PipelinePlan] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    estimate: float = math.inf

    def describe(self) -> str:
        tp = ",".join(f"{k}:TP{d}" for k, d in self.degree.items())
        return f"D={self.num_pipelines} bs{self.micro_batch} {tp} {self.order}: est {self.estimate:.3f} s"


def _model_static_total(ctx: PlanContext, zero_shards: int) -> float:
    m = ctx.model
    params = m.num_layers * m.layer_param_count() + m.embedding_param_count() + m.head_param_count()
    return _static_bytes(params, zero_shards, ctx.zero)


def _classes(ctx: PlanContext, groups: dict[str, list[TPGroup]]) -> list[tuple[TPGroup, int]]:
    """Groups that cost the same (kind, TP degree, link class): a representative and a count."""
    out: dict[tuple, list] = {}
    for gs in groups.values():
        for g in gs:
            cls = ctx.link(g.ranks[0], g.ranks[-1]).cls
            out.setdefault((g.kind, g.tp, cls), [g, 0])[1] += 1
    return [(g, n) for g, n in out.values()]


def _quick_bound(ctx: PlanContext, classes: list[tuple[TPGroup, int]], D: int, b: int) -> float:
    """Closed-form estimate: balanced layers over the total capacity, ``ceil(M/D) + S - 1`` stage times; ``inf``
    when the pipelines cannot hold the model states and activations."""
    M = ctx.global_batch // b
    total_groups = sum(n for _, n in classes)
    if D > total_groups or D > M:
        return math.inf
    S = math.ceil(total_groups / D)
    if S > ctx.model.num_layers:
        return math.inf
    z = ctx.zero_shards(D)
    for recompute in ctx.recompute_options:  # as the layer ILPs: recompute only where the plain one does not fit
        profs = [(ctx.profile(g, b, z, recompute), g, n) for g, n in classes]
        cap = sum(n / p.layer_time for p, g, n in profs) / D  # layers per second per pipeline
        mem = sum(n * p.capacity * g.tp for p, g, n in profs) / D
        p0, g0, _ = profs[0]
        acts = ctx.model.num_layers * p0.layer_act * g0.tp * (S + 1) / 2
        if mem >= _model_static_total(ctx, z) + acts:
            return (math.ceil(M / D) + S - 1) * ctx.model.num_layers / cap
    return math.inf


@dataclass(frozen=True)
class _Type:
    """A pipeline type of the first level: which kinds get one of their remaining groups."""

    extra: frozenset[str]
    stages: int
    capacity: float  # layers per second (per micro-batch)
    feasible: bool
    headroom: float = 0.0  # with ZeRO shares: the fraction of the sharded model state its memory can hold


def _pipeline_types(ctx: PlanContext, groups: dict[str, list[TPGroup]], D: int, b: int) -> tuple[
        dict[str, int], dict[str, int], list[_Type]]:

    kinds = list(groups)
    L, z = ctx.model.num_layers, ctx.zero_shards(D)
    f = {k: len(groups[k]) // D for k in kinds}
    r = {k: len(groups[k]) % D for k in kinds}
    # plain, and with recomputation (the layer ILPs' fallback for a pipeline that does not fit otherwise)
    options = ctx.recompute_options
    prof = {rc: {k: ctx.profile(groups[k][0], b, z, rc) for k in kinds} for rc in options}
    cap = {k: prof[False][k].capacity * groups[k][0].tp for k in kinds}
    act = {rc: prof[rc][kinds[0]].layer_act * groups[kinds[0]][0].tp * L for rc in options}
    static = _model_static_total(ctx, z)
    unsharded, sharded = ctx.state_bytes()
    spare = [k for k in kinds if r[k]]
    types = []
    for n in range(len(spare) + 1):
        for extra in itertools.combinations(spare, n):
            cnt = {k: f[k] + (k in extra) for k in kinds}
            S = sum(cnt.values())
            memory = sum(cnt[k] * cap[k] for k in kinds)
            need = {rc: act[rc] * (S + 1) / 2 for rc in options}
            fits = [rc for rc in options if memory >= static + need[rc]]
            # with ZeRO shares: a type with room beyond what ZeRO does not shard may take a smaller share (the
            # pipelines together hold the sharded part: configure_pipelines' pooled constraint)
            room = [rc for rc in options if memory > unsharded + need[rc]] if ctx.zero_shares else []
            rc = fits[0] if fits else (room[0] if room else False)
            headroom = (memory - unsharded - need[rc]) / sharded if ctx.zero_shares and sharded else 0.0
            types.append(_Type(frozenset(extra), S, sum(cnt[k] / prof[rc][k].layer_time for k in kinds),
                               1 <= S <= L and bool(fits or room), headroom))
    return f, r, types


def _plain_type_ok(ctx: PlanContext, groups: dict[str, list[TPGroup]], D: int, b: int) -> bool:
    """A necessary condition of the first level: when fewer remaining groups than pipelines are left, some
    pipeline gets only the ``floor`` share, which must then fit."""
    f, r, types = _pipeline_types(ctx, groups, D, b)
    return sum(r.values()) >= D or types[0].feasible


def configure_pipelines(ctx: PlanContext, groups: dict[str, list[TPGroup]], D: int, b: int, *,
                        time_limit: float = 10.0) -> list[list[TPGroup]] | None:
    """The first-level model (Pyomo, solved by HiGHS after exact linearisation): which groups each of ``D``
    pipelines gets.  Returns per pipeline its groups (kind by kind, in rank order); ``None`` if infeasible.

    Every pipeline gets ``f_k = G_k // D`` groups of kind ``k``; the ``r_k = G_k mod D`` remaining ones go one
    per pipeline.  A pipeline *type* ``t`` is the set of kinds whose extra group it gets: ``S_t`` stages,
    capacity ``C_t`` layers per second.  Integer ``n_t`` pipelines of type ``t``; within time ``T`` a pipeline
    of type ``t`` runs ``T C_t / L - S_t + 1`` micro-batches (balanced layers, 1F1B), so the batch needs
    ``sum_t n_t (T C_t / L - S_t + 1) >= M``: bilinear in ``n_t T`` (a MINLP).  ``n_t`` is written in binary
    digits ``beta_tj`` and each product ``T beta_tj`` is replaced by ``v_tj`` with McCormick's (here exact)
    constraints, giving a MILP for HiGHS.  Types whose total memory cannot hold the model states and about
    half the in-flight activations, even with recomputation (priced at its own layer times), are excluded.
    With ZeRO shares (``ctx.zero_shares``, :mod:`.zero_shares`) a type needs room only beyond the states ZeRO does
    not shard, and the pipelines together must hold the sharded part: ``sum_t n_t h_t >= 1`` (``h_t``: the
    fraction of it a type's memory can hold).
    """
    import pyomo.environ as pyo
    from pyomo.contrib import appsi

    f, r, types = _pipeline_types(ctx, groups, D, b)
    L, M = ctx.model.num_layers, ctx.global_batch // b
    usable = [i for i, t in enumerate(types) if t.feasible and t.capacity > 0]
    if not usable:
        return None
    U = (M + max(t.stages for t in types)) * L / min(types[i].capacity for i in usable)
    bits = list(range(max(1, D.bit_length())))

    mdl = pyo.ConcreteModel()
    mdl.beta = pyo.Var(usable, bits, domain=pyo.Binary)
    mdl.v = pyo.Var(usable, bits, bounds=(0, U))
    mdl.T = pyo.Var(bounds=(0, U))
    mdl.obj = pyo.Objective(expr=mdl.T)

    def n(t: int):
        return sum(2**j * mdl.beta[t, j] for j in bits)

    mdl.count = pyo.Constraint(expr=sum(n(t) for t in usable) == D)
    mdl.rem = pyo.ConstraintList()
    for k in groups:
        having = [t for t in usable if k in types[t].extra]
        if having:
            mdl.rem.add(sum(n(t) for t in having) == r[k])
        elif r[k]:
            return None
    if ctx.zero_shares:
        mdl.pool = pyo.Constraint(expr=sum(types[t].headroom * n(t) for t in usable) >= 1)
    mdl.batch = pyo.Constraint(expr=sum(types[t].capacity / L * sum(2**j * mdl.v[t, j] for j in bits)
                                        - (types[t].stages - 1) * n(t) for t in usable) >= M)
    mdl.mc = pyo.ConstraintList()
    for t in usable:
        for j in bits:
            mdl.mc.add(mdl.v[t, j] <= U * mdl.beta[t, j])
            mdl.mc.add(mdl.v[t, j] <= mdl.T)
            mdl.mc.add(mdl.v[t, j] >= mdl.T - U * (1 - mdl.beta[t, j]))
    solver = appsi.solvers.Highs()
    solver.config.time_limit = time_limit
    solver.config.load_solution = False
    res = solver.solve(mdl)
    if res.termination_condition != appsi.base.TerminationCondition.optimal:
        return None
    res.solution_loader.load_vars()
    per_pipeline = [types[t].extra for t in usable for _ in range(int(round(pyo.value(n(t)))))]
    out: list[list[TPGroup]] = [[] for _ in range(D)]
    nxt = {k: 0 for k in groups}
    for p, extra in enumerate(per_pipeline):
        for k in groups:
            take = f[k] + (k in extra)
            out[p].extend(groups[k][nxt[k]:nxt[k] + take])
            nxt[k] += take
    return out


# ---- assembling ------------------------------------------------------------------------------------------------
def _order(ctx: PlanContext, comp: Sequence[TPGroup], order: str) -> list[TPGroup]:
    """Stages by device kind: ``slow_first`` (the paper's Table 9: H20 before H800) or ``fast_first``; groups of
    a kind in rank order; TP groups of different sizes of one kind: larger first."""
    sign = -1.0 if order == "slow_first" else 1.0

    def slowness(kind: str) -> float:
        return ctx.cost.compute_time(1e12, ctx.cluster.devices[kind])

    return sorted(comp, key=lambda g: (sign * slowness(g.kind), -g.tp, g.ranks))


def solve_candidate(ctx: PlanContext, cand: Candidate, *,
                    orders: Sequence[str] = ("slow_first", "fast_first")) -> list[Candidate]:
    """The second level for one first-level configuration, once per stage order: layer ILPs (one per distinct
    pipeline) and the micro-batch ILP.  Returns the solved candidates (possibly none)."""
    D, b = cand.num_pipelines, cand.micro_batch
    z, M = ctx.zero_shards(D), ctx.global_batch // b
    out = []
    for order in orders:
        ordered = [_order(ctx, comp, order) for comp in cand.compositions]
        pipes = solve_pipelines(ctx, ordered, b, M, z)
        if pipes is None and ctx.zero_shares:  # the memory-poor pipelines may hold a smaller share
            shards = share_shards(ctx, ordered, b)
            pipes = None if shards is None else solve_pipelines(ctx, ordered, b, M, shards)
        if pipes is None:
            continue
        sol = solve_micro_batches(pipes, M, extra=sync_estimates(ctx, pipes))
        if sol is None:
            continue
        out.append(Candidate(cand.degree, D, b, cand.bound, cand.compositions, order, pipes, sol[0], sol[1]))
    return out


def share_shards(ctx: PlanContext, ordered: Sequence[Sequence[TPGroup]], b: int) -> list[float] | None:
    """Per pipeline, the number of ways ZeRO divides its sharded state with shares by free memory, as the layer
    ILPs price it (:func:`_static_bytes`): ``sum(h) / h_p``, where ``h_p`` is pipeline ``p``'s memory less the
    states ZeRO does not shard and about half its in-flight activations (with recomputation where it has no room
    without): the first level's measure, before the layers are placed (the strategy's shares are then the
    estimate's, :mod:`.zero_shares`).  ``None`` where some pipeline has no room or all together cannot hold the
    sharded state."""
    unsharded, sharded = ctx.state_bytes()
    L, z = ctx.model.num_layers, ctx.zero_shards(len(ordered))
    room = []
    for comp in ordered:
        memory = sum(ctx.profile(g, b, z).capacity * g.tp for g in comp)
        acts = [ctx.profile(comp[0], b, z, rc).layer_act * comp[0].tp * L * (len(comp) + 1) / 2
                for rc in ctx.recompute_options]
        left = [memory - unsharded - a for a in acts]
        room.append(next((h for h in left if h > 0), 0.0))
    if min(room) <= 0 or sum(room) < sharded:
        return None
    return [sum(room) / h for h in room]


def solve_pipelines(ctx: PlanContext, ordered: Sequence[Sequence[TPGroup]], b: int, M: int,
                    z: float | Sequence[float]) -> list[PipelinePlan] | None:
    """Layer ILPs for pipelines given in stage order (identical kinds/TP/links solved once); a pipeline that does
    not fit is retried with activation recomputation (not at ZeRO-3).  ``None`` if some pipeline fits neither way.
    ``z``: the ways ZeRO divides the sharded state, for all pipelines or per pipeline (uneven shares:
    :func:`share_shards`)."""
    D = len(ordered)
    zs = [z] * D if isinstance(z, (int, float)) else list(z)
    cache: dict[tuple, PipelinePlan | None] = {}
    pipes = []
    for comp, z in zip(ordered, zs):
        sig = (tuple((g.kind, g.tp, ctx.link(g.ranks[0], g.ranks[-1]).cls) for g in comp), z)
        if sig not in cache:
            m_guess = max(1, M // D)
            plan = solve_layers(ctx, comp, b, m_guess, z)
            if plan is None and True in ctx.recompute_options:
                plan = solve_layers(ctx, comp, b, m_guess, z, recompute=True)
            cache[sig] = plan
        plan = cache[sig]
        if plan is None:
            return None
        pipes.append(PipelinePlan(tuple(comp), plan.layers, plan.stage_times,
                                  2 * sum(ctx.p2p_time(a, c, b) for a, c in zip(comp, comp[1:])), plan.recompute))
    return pipes


def _sync_estimate(ctx: PlanContext, i: int, pipes: Sequence[PipelinePlan]) -> float:
    """Gradient synchronisation (reduce-scatter and ZeRO-1 all-gather, or all-reduce) of pipeline ``i``'s slowest
    stage to sync over the ``len(pipes)`` replicas: its parameters, on the slowest link to the devices of the other
    pipelines that hold its first layer (NVLink when the replicas share a node, the network when they do not)."""
    D = len(pipes)
    if D <= 1:
        return 0.0
    ops = (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER) if ctx.zero1 else (OpKind.ALL_REDUCE,)

    def holder(pipe: PipelinePlan, layer: int) -> TPGroup:  # every pipeline holds every layer once
        return next(g for g, end in zip(pipe.groups, itertools.accumulate(pipe.layers)) if layer < end)

    worst, first = 0.0, 0
    for n, g in zip(pipes[i].layers, pipes[i].groups):
        peers = [holder(q, first).ranks[0] for j, q in enumerate(pipes) if j != i]
        link = min((ctx.link(g.ranks[0], r) for r in peers), key=lambda l: l.bandwidth)
        size = n * ctx.model.layer_param_count() / g.tp * BF16
        worst = max(worst, sum(ctx.cost.collective_time(op, size, D, link) for op in ops))
        first += n
    return worst


def sync_estimates(ctx: PlanContext, pipes: Sequence[PipelinePlan]) -> list[float]:
    """:func:`_sync_estimate` of every pipeline of ``pipes`` (the same figures), without its quadratic work.

    A link depends only on where its far end is relative to the near one (the same rank, node, host, or else
    where: :meth:`Cluster.link`), so the slowest link from a stage to the holders of its first layer is the slowest
    of at most four, each taken at the *first* holder of its place (``min`` keeps the first of equal links, as the
    one-by-one form does): the holders of each layer are listed once for all pipelines."""
    D = len(pipes)
    if D <= 1:
        return [0.0] * D
    cl = ctx.cluster
    ops = (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER) if ctx.zero1 else (OpKind.ALL_REDUCE,)
    ends = [list(itertools.accumulate(p.layers)) for p in pipes]
    tables: dict[int, tuple[list[int], dict[tuple[str, Any], list[int]]]] = {}

    def holders(first: int) -> tuple[list[int], dict[tuple[str, Any], list[int]]]:
        """The first rank of the stage holding layer ``first`` in each pipeline, and where each place's holders
        are in that list (by rank, node and host)."""
        got = tables.get(first)
        if got is None:
            ranks = [p.groups[bisect.bisect_right(e, first)].ranks[0] for p, e in zip(pipes, ends)]
            at: dict[tuple[str, Any], list[int]] = {}
            for q, r in enumerate(ranks):
                for key in (("rank", r), ("node", cl.node_index(r)), ("host", cl.node_of(r).host)):
                    at.setdefault(key, []).append(q)
            got = tables[first] = (ranks, at)
        return got

    def slowest(i: int, a: int, first: int) -> Any:
        ranks, at = holders(first)
        node, host = cl.node_index(a), cl.node_of(a).host
        by_host = cl.host_bandwidth_gbs is not None
        places = [next((q for q in at.get(("rank", a), ()) if q != i), None),
                  next((q for q in at[("node", node)] if q != i and ranks[q] != a), None) if ("node", node) in at
                  else None,
                  next((q for q in at[("host", host)] if q != i and cl.node_index(ranks[q]) != node), None)
                  if by_host and ("host", host) in at else None,
                  next((q for q, r in enumerate(ranks) if q != i and cl.node_index(r) != node
                        and not (by_host and cl.node_of(r).host == host)), None)]
        firsts = sorted(q for q in places if q is not None)
        return min((ctx.link(a, ranks[q]) for q in firsts), key=lambda l: l.bandwidth)

    out = []
    for i, pipe in enumerate(pipes):
        worst, first = 0.0, 0
        for n, g in zip(pipe.layers, pipe.groups):
            link = slowest(i, g.ranks[0], first)
            size = n * ctx.model.layer_param_count() / g.tp * BF16
            worst = max(worst, sum(ctx.cost.collective_time(op, size, D, link) for op in ops))
            first += n
        out.append(worst)
    return out


def build_strategy(cand: Candidate, *, schedule: str = "1f1b", zero1: bool = True, zero: int | None = None,
                   name: str | None = None) -> "Strategy":
    """The :class:`Strategy` of a solved candidate.  At ZeRO-3, pipelines that differ in micro-batch count or stages
    are scheduled by GPipe (1F1B needs them equal at ZeRO-3), and a candidate that recomputes where its pipelines
    differ in stages or recomputation is planned at ZeRO-2 (ZeRO-3 regathers a recomputed stage's layers inside
    its backward: every replica must recompute alike); a ``name`` given says so."""
    pipelines = []
    for pipe, m in zip(cand.pipes, cand.counts):
        stages, first = [], 0
        for g, n in zip(pipe.groups, pipe.layers):
            stages.append({"devices": list(g.ranks), "layers": [first, first + n - 1], "recompute": pipe.recompute})
            first += n
        pipelines.append({"stages": stages, "micro_batch_size": cand.micro_batch, "num_micro_batches": m})
    level = {"zero1": zero1} if zero is None else {"zero": zero}
    if zero == 3:  # what ZeRO-3 cannot run yet, planned as it can (Strategy._zero3_problem)
        if any(p.recompute for p in cand.pipes) and len({(tuple(p.layers), p.recompute) for p in cand.pipes}) > 1:
            level, name = {"zero": 2}, name and f"{name} (ZeRO-2: ZeRO-3 recomputes only alike in every pipeline)"
        elif schedule == "1f1b" and len({(m, tuple(p.layers)) for p, m in zip(cand.pipes, cand.counts)}) > 1:
            schedule, name = "gpipe", name and f"{name} (GPipe: under 1F1B, ZeRO-3 needs equal pipelines)"
    return Strategy.load({"pipelines": pipelines, "schedule": schedule, **level, "name": name})


def rank_by_simulation(ctx: PlanContext, strategies: Sequence["Strategy"]) -> list[tuple["Strategy", "SimResult"]]:
    """Simulate each strategy; return ``(strategy, result)`` sorted by step time, out-of-memory ones last."""
    done = [(s, simulate(ctx.model, s, ctx.cluster, global_batch=ctx.global_batch, seq_len=ctx.seq_len,
                         cost=ctx.cost)) for s in strategies]
    return sorted(done, key=lambda sr: (bool(sr[1].oom), sr[1].step_time))


def refine_micro_batches(ctx: PlanContext, strategy: "Strategy", result: "SimResult", *,
                         max_moves: int = 6) -> tuple["Strategy", "SimResult"]:
    """Simulation-guided polish: move one micro-batch from the pipeline that ends last to the one that ends first
    while the simulated step time improves (not at ZeRO-3 under 1F1B, whose pipelines run as many)."""
    best, best_r = strategy, result
    if strategy.zero >= 3 and strategy.schedule == "1f1b":  # its pipelines' counts must stay equal
        return best, best_r
    for _ in range(max_moves):
        if best.dp_degree < 2:
            break
        ends = best_r.pipeline_end
        slow, fast = max(range(len(ends)), key=ends.__getitem__), min(range(len(ends)), key=ends.__getitem__)
        if best.pipelines[slow].num_micro_batches <= 1:
            break
        pipes = list(best.pipelines)
        pipes[slow] = pipes[slow].model_copy(update={"num_micro_batches": pipes[slow].num_micro_batches - 1})
        pipes[fast] = pipes[fast].model_copy(update={"num_micro_batches": pipes[fast].num_micro_batches + 1})
        trial = best.model_copy(update={"pipelines": pipes})
        r = simulate(ctx.model, trial, ctx.cluster, global_batch=ctx.global_batch, seq_len=ctx.seq_len,
                     cost=ctx.cost)
        if r.oom or r.step_time >= best_r.step_time - 1e-9:
            break
        best, best_r = trial, r
    return best, best_r


# ---- the planner -----------------------------------------------------------------------------------------------
def enumerate_candidates(ctx: PlanContext, ranks: Sequence[int], *, max_pipelines: int | None = None,
                         micro_batches: Sequence[int] = (1, 2, 4)) -> list[tuple[Candidate, dict[str, list[TPGroup]]]]:
    """The heuristic-guided search space: every TP degree per kind, number of pipelines and micro-batch size,
    with its closed-form bound, best first (infeasible ones dropped)."""

    cl = ctx.cluster
    kinds = sorted({cl.kind(r) for r in ranks})
    node_size = {k: max(len([r for r in n.ranks if r in set(ranks)]) for n in cl.nodes if n.kind == k)
                 for k in kinds}
    options = {k: tp_degrees(ctx.model, node_size[k]) for k in kinds}
    allowed = tp_degrees(ctx.model, max(node_size.values()))
    out = []
    for combo in itertools.product(*(options[k] for k in kinds)):
        degree = dict(zip(kinds, combo))
        groups = make_groups(cl, ranks, degree, allowed)
        classes = _classes(ctx, groups)
        total = sum(len(g) for g in groups.values())
        for b in micro_batches:
            if ctx.global_batch % b:
                continue
            for D in range(1, min(total, ctx.global_batch // b, max_pipelines or total) + 1):
                bound = _quick_bound(ctx, classes, D, b)
                if math.isfinite(bound) and _plain_type_ok(ctx, groups, D, b):
                    out.append((Candidate(degree, D, b, bound), groups))
    out.sort(key=lambda cg: cg[0].bound)
    return out


def plan_hetero(model: "ModelSpec | str", cluster: "Cluster", *, global_batch: int, seq_len: int,
                cost: CostModel | None = None, ranks: Sequence[int] | None = None, schedule: str = "1f1b",
                zero1: bool = True, candidates: int | None = None, simulate_top: int | None = None,
                min_pipelines: int = 1, max_pipelines: int | None = None, micro_batches: Sequence[int] = (1, 2, 4),
                refine: bool = True, name: str | None = None, mixed_groups: bool = True,
                zero: int | None = None) -> "Strategy":
    """Plan a heterogeneous strategy for ``model`` on ``cluster`` (the paper's scenario (a), Appendix A.1).

    Searches TP degrees per device kind, numbers of pipelines and micro-batch sizes (pruned by a closed-form
    bound; the ``candidates`` best that fit, default 16, or 8 above 256 devices), solves the first level
    (Pyomo/HiGHS) and the second (PuLP/CBC ILPs) for each, and returns the candidate with the smallest simulated step time among the ``simulate_top`` best
    estimates (default 6, or 2 above 256 devices) (out-of-memory plans last; ``refine`` then moves micro-batches between pipelines while the
    simulated time improves).  ``ranks`` restricts the plan to a subset of the cluster (default: all);
    ``min_pipelines``/``max_pipelines`` bound the data-parallel degree (an elastic job wants at least two
    replicas, and ``zero1=False``, so that a failure loses no state).

    ``zero``: the ZeRO level of the plans (SPEC §15; ``zero1`` is the alias of levels 0 and 1).  Not given and
    ``zero1``: when no plan fits the devices' memory with ZeRO-1, the planner plans again with ZeRO-2 (gradients
    sharded too), then with ZeRO-3 (weights sharded too, each layer's gathered before its forward and backward),
    and says so in the strategy's ``name``.  Where the ZeRO-1 plan fits but memory binds (its fullest device's
    estimate at :data:`BINDING` of its memory or more: memory may have kept the planner from more replicas), it
    also plans at ZeRO-2 and ZeRO-3 and returns the fastest in the simulator, its name saying the levels' times
    where another level wins.  Plans at ZeRO-3 recompute nothing and run GPipe where ``schedule`` is
    1F1B and the pipelines differ (ZeRO-3 runs neither recomputation nor 1F1B across unequal pipelines yet): the
    layers are placed under 1F1B's memory, and a plan GPipe's activations do not fit is dropped by the simulator's
    memory check, as every out-of-memory plan is.

    ZeRO shares: where the devices planned differ in memory (an H20 beside an H800, a 24 GB card beside an 80 GB
    one) and the plan shards (ZeRO-1 or 2), each pipeline gets a ``zero_share`` in proportion to the memory its
    devices have free for the sharded state, after what ZeRO does not shard (weights, activations, the runtime):
    :mod:`hspmd_sdk.planner.zero_shares`.  The planner sets them where they lower the fullest device's fraction of
    its memory (by a percent or more) or make a plan fit that even shares do not (its layer and pipeline solvers
    then let a memory-poor pipeline take a smaller share), and the strategy's ``name`` says them and what they
    change.  Devices all of one memory keep even shares (``zero_share`` left out), as do plans with uneven TP
    ``ratios``.

    ``mixed_groups``: where every host holds devices of several kinds (a node of mixed GPU generations), also
    simulate TP groups that mix them with HAP's uneven ratios (:mod:`.hetero_mixed`, SPEC §12) and return them
    when faster; the returned strategy's ``name`` then says which kind of plan won, by how much, and against what.

    >>> from hspmd_sdk.core.cluster import Cluster
    >>> s = plan_hetero("llama-7b", Cluster.mixed({"H800": 8, "H20": 8}), global_batch=16, seq_len=2048)
    >>> s.num_ranks
    16
    """
    model = load_model_spec(model)
    kw = dict(cost=cost, ranks=ranks, schedule=schedule, candidates=candidates, simulate_top=simulate_top,
              min_pipelines=min_pipelines, max_pipelines=max_pipelines, micro_batches=micro_batches, refine=refine,
              name=name, mixed_groups=mixed_groups)
    if zero is not None or not zero1:
        return _plan_hetero(model, cluster, global_batch, seq_len, zero=0 if zero is None else zero, **kw)
    try:
        one = _plan_hetero(model, cluster, global_batch, seq_len, zero=1, **kw)
    except PlanValidationError as e:  # memory binds: shard the gradients too, then the weights
        first = e
    else:
        return _fastest_level(one, model, cluster, global_batch, seq_len, **{**kw, "cost": cost or CostModel()})
    why = first.problems[-1][1] if first.problems else str(first)
    for level, plan in _higher_levels(model, cluster, global_batch, seq_len, **kw):
        return plan.model_copy(update={"name": f"{plan.name} (ZeRO-{level}: with ZeRO-1, {why}"
                                               + (", and with ZeRO-2 too)" if level == 3 else ")")})
    raise first from None


def _higher_levels(model: "ModelSpec", cluster: "Cluster", global_batch: int, seq_len: int,
                   **kw: Any) -> Iterable[tuple[int, "Strategy"]]:
    """``(level, plan)`` at ZeRO-2, then ZeRO-3, for each level that has a plan (planned as it is asked for)."""
    for level in (2, 3):
        try:
            yield level, _plan_hetero(model, cluster, global_batch, seq_len, zero=level, **kw)
        except PlanValidationError:
            continue


#: A plan's memory binds where its fullest device's estimate takes this fraction of its memory or more:
#: :func:`plan_hetero` then plans the higher ZeRO levels too (more replicas may fit) and keeps the fastest.
BINDING = 0.9


def _fastest_level(one: "Strategy", model: "ModelSpec", cluster: "Cluster", global_batch: int, seq_len: int, *,
                   cost: CostModel, **kw: Any) -> "Strategy":
    """``one`` (planned at ZeRO-1) or, where its memory binds (:data:`BINDING`), the plan of ZeRO-2 or ZeRO-3 that
    the simulator finds faster (named so, with the levels' simulated step times)."""
    peak, rank = peak_fraction(one, model, cluster, seq_len=seq_len, cost=cost)
    if peak < BINDING:
        return one
    timed = [(simulate(model, one, cluster, seq_len=seq_len, cost=cost).step_time, 1, one)]
    for level, plan in _higher_levels(model, cluster, global_batch, seq_len, cost=cost, **kw):
        result = simulate(model, plan, cluster, seq_len=seq_len, cost=cost)
        if not result.oom:
            timed.append((result.step_time, level, plan))
    _, level, best = min(timed, key=lambda x: x[0])
    if level == 1:
        return one
    times = ", ".join(f"ZeRO-{z} {t:.3g} s" for t, z, _ in sorted(timed, key=lambda x: x[1]))
    return best.model_copy(update={"name": f"{best.name} (ZeRO-{level}: the fastest where memory binds, ZeRO-1's "
                                           f"fullest device (rank {rank}) at {peak:.0%} of its memory; simulated "
                                           f"steps {times})"})


def _plan_hetero(model: "ModelSpec", cluster: "Cluster", global_batch: int, seq_len: int, *, zero: int,
                 cost: CostModel | None, ranks: Sequence[int] | None, schedule: str, candidates: int | None,
                 simulate_top: int | None, min_pipelines: int, max_pipelines: int | None,
                 micro_batches: Sequence[int], refine: bool, name: str | None, mixed_groups: bool) -> "Strategy":
    """:func:`plan_hetero` at ZeRO level ``zero``."""
    ranks = list(range(cluster.num_ranks)) if ranks is None else sorted(ranks)
    uneven_memory = len({cluster.spec(r).memory_mb for r in ranks}) > 1
    ctx = PlanContext(model, cluster, global_batch=global_batch, seq_len=seq_len, cost=cost, schedule=schedule,
                      zero=zero, zero_shares=uneven_memory)
    large = len(ranks) > 256  # each candidate costs more to solve and to simulate
    candidates = candidates if candidates is not None else (8 if large else 16)
    simulate_top = simulate_top if simulate_top is not None else (2 if large else 6)
    solved = search(ctx, ranks, candidates=candidates, max_pipelines=max_pipelines, min_pipelines=min_pipelines,
                    micro_batches=micro_batches)
    name = name or f"plan_hetero: {model.name} on {len(ranks)} devices"
    mixed = _best_mixed(ctx, ranks, micro_batches, min_pipelines, max_pipelines, name) if mixed_groups else None
    if not solved and mixed is None:
        raise PlanValidationError([("cluster", f"no strategy for {model.name} fits {len(ranks)} devices at "
                                               f"global batch {global_batch}, seq_len {seq_len}")], what="plan")
    plain = None
    if solved:
        try:
            plain = pick(ctx, solved, simulate_top=simulate_top, refine=refine, max_moves=1 if large else 6,
                         name=name)
        except PlanValidationError:
            if mixed is None:
                raise
    if plain is not None and plain.zero_shares() is not None:
        note = shares_note(plain, model, cluster, seq_len=seq_len, cost=ctx.cost)
        plain = plain.model_copy(update={"name": f"{plain.name} ({note})"})
    if mixed is None:
        return plain
    if plain is None:
        return mixed[0].model_copy(update={"name": f"{name} (mixed-kind TP groups with ratios, est. "
                                                   f"{mixed[1]:.3g} s: no plan of single-kind groups fits)"})
    plain_t = rank_by_simulation(ctx, [plain])[0][1].step_time
    stages = [":".join(map(str, st.ratios or ())) or "even" for p in mixed[0].pipelines for st in p.stages]
    how = ", ".join(r if stages.count(r) == 1 else f"{r} (x{stages.count(r)} stages)" for r in dict.fromkeys(stages))
    if mixed[1] < plain_t:
        return mixed[0].model_copy(update={"name": f"{name} (mixed-kind TP groups with ratios {how}: est. "
                                                   f"{mixed[1]:.3g} s against {plain_t:.3g} s for single-kind "
                                                   f"groups)"})
    return plain.model_copy(update={"name": f"{name} (single-kind groups: est. {plain_t:.3g} s against "
                                            f"{mixed[1]:.3g} s for mixed-kind TP groups with ratios {how})"})


def _best_mixed(ctx: PlanContext, ranks: Sequence[int], micro_batches: Sequence[int], min_pipelines: int,
                max_pipelines: int | None, name: str) -> tuple["Strategy", float] | None:
    """The fastest mixed-kind candidate that fits in the simulator, and its simulated step time (groups of any
    size the ratio ILP can cut the model into, pipelined or not: :mod:`.hetero_mixed`).  Each arrangement takes
    micro-batch sizes in increasing order while its simulated time improves (a larger one holds more activations:
    once it does not fit, no larger one does); a candidate is simulated with recomputation only where it runs out
    of memory without (recomputation only adds time)."""
    best: tuple["Strategy", float] | None = None
    cache: dict = {}
    for pipes in mixed_arrangements(ctx, ranks, min_pipelines=min_pipelines, max_pipelines=max_pipelines):
        last = math.inf
        for b in sorted(micro_batches):
            found = arrangement_strategies(ctx, pipes, b, recompute=(False,), name=name, cache=cache)
            if found is None:
                break
            if not found:
                continue
            (s, r), = rank_by_simulation(ctx, found)
            if r.oom:  # recomputing every stage (at ZeRO-3 only where the pipelines' stages are alike)
                try:
                    (s, r), = rank_by_simulation(ctx, [recomputing(s)])
                except PlanValidationError:
                    pass
            if r.oom or r.step_time >= last:
                break
            last = r.step_time
            if best is None or r.step_time < best[1]:
                best = (s, r.step_time)
    return best


def search(ctx: PlanContext, ranks: Sequence[int], *, candidates: int = 8, max_pipelines: int | None = None,
           min_pipelines: int = 1, micro_batches: Sequence[int] = (1, 2, 4)) -> list[Candidate]:
    """Both levels for the best points of the search space (by the closed-form bound) until ``candidates`` of them
    have a plan that fits; solved candidates, best estimate first."""
    solved: list[Candidate] = []
    tried = 0
    for cand, groups in enumerate_candidates(ctx, ranks, max_pipelines=max_pipelines, micro_batches=micro_batches):
        if tried >= candidates:
            break
        if cand.num_pipelines < min_pipelines:
            continue
        comps = configure_pipelines(ctx, groups, cand.num_pipelines, cand.micro_batch)
        if comps is None:
            continue
        cand.compositions = comps
        found = solve_candidate(ctx, cand)
        tried += bool(found)  # only configurations that fit count against the budget
        solved += found
    solved.sort(key=lambda c: c.estimate)
    return solved


def pick(ctx: PlanContext, solved: Sequence[Candidate], *, simulate_top: int = 6, refine: bool = True,
         name: str | None = None, max_moves: int = 6,
         adjust: "Callable[[Strategy], Strategy] | None" = None) -> "Strategy":
    """Simulate the ``simulate_top`` best estimates and return the fastest that fits in memory (after the optional
    micro-batch refinement); if none fits, the next ``simulate_top``, and so on.  Raises
    :class:`PlanValidationError` when no candidate fits.  ``adjust``: applied to each candidate's strategy before
    the simulator ranks it (e.g. the elastic replanner's inherited TP ratios); a refinement the adjusted strategy
    cannot take (it no longer validates) is then not taken.  Without ``adjust`` and with ``ctx.zero_shares``, each
    candidate first gets its ZeRO shares by free memory (:func:`.zero_shares.with_memory_shares`)."""
    for start in range(0, len(solved), max(simulate_top, 1)):
        strategies = [build_strategy(c, schedule=ctx.schedule, zero=ctx.zero, name=name)
                      for c in solved[start:start + max(simulate_top, 1)]]
        if adjust is not None:
            strategies = [adjust(s) for s in strategies]
        elif ctx.zero_shares:
            strategies = [with_memory_shares(s, ctx.model, ctx.cluster, seq_len=ctx.seq_len, cost=ctx.cost)
                          for s in strategies]
        best, res = rank_by_simulation(ctx, strategies)[0]
        if res.oom:
            continue
        if not refine:
            return best
        polished = refine_micro_batches(ctx, best, res, max_moves=max_moves)[0]
        if adjust is None:
            return polished
        try:
            return Strategy.load(polished.model_dump(), model=ctx.model)
        except PlanValidationError:
            return best
    raise PlanValidationError([("cluster", f"every planned strategy for {ctx.model.name} runs out of memory in the "
                                           "simulator; add devices, shorten sequences or lower the global batch")],
                              what="plan")
