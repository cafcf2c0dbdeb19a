"""What a ``Program``'s communication means on the cluster: stage-boundary arrows, their bytes per step, the
redundant ones (and the cheaper resolution the core offers), and the busiest link.

Everything is read from the ``CommPlan``s the core resolved (``Program.comm_plans``, ``backward_plans``,
``grad_reduce_plans``, ``grad_sync_plans``) and the cluster's links; the alternative for a redundant boundary is
planned by the core's :func:`~hspmd_sdk.core.resolve.resolve`.  Nothing here names a model or a tensor: a stage
boundary is a Reshard that moves a sharding subgroup to other devices (its DG Union changes).

Bytes per step: the program's plans are resolved at its representative bindings (the strategy's global batch),
so the forward plan of an activation Reshard carries one step's activations and its backward plan one step's
gradients; parameter plans (gradient synchronisation, ZeRO gathers) run once a step.  Recomputation and
micro-batch latency are not counted.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.annotation import DS, DUPLICATE, Annotation
from ..core.resolve import resolve
from ..core.slices import box_numel
from ._units import fmt_bandwidth, fmt_bytes, fmt_seconds

__all__ = ["BoundaryArrow", "BoundaryFix", "BusiestLink", "CommView", "comm_view", "fmt_bytes", "fmt_seconds",
           "boundary_arrows", "link_loads"]

#: A boundary whose inter-node bytes exceed this multiple of the minimum (one copy per receiving node) is flagged.
REDUNDANT_FACTOR = 1.5


def _sum_volume(transfers: Iterable[tuple[int, int, int, int]], cluster: Any, senders: set[int]) -> dict[str, int]:
    out = {"intra": 0, "inter": 0}
    for s, d, n, _ in transfers:
        if s != d and s in senders:
            out["inter" if cluster.link(s, d).cls == "inter" else "intra"] += n
    return out


@dataclass(frozen=True)
class BoundaryFix:
    """A cheaper resolution of a redundant boundary, planned by the core: the Reshard to ``via`` (each
    receiving device gets one shard) and then from ``via`` to the destination (inside the receiving group)."""

    via: str
    kinds: tuple[str, ...]
    inter: int
    intra: int
    seconds: float
    current_inter: int
    current_seconds: float
    plans: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    def describe(self) -> str:
        return (f"send it split: {' → '.join(self.kinds)} via {self.via} moves {fmt_bytes(self.inter)} "
                f"inter-node instead of {fmt_bytes(self.current_inter)} (whole Reshard, forward), "
                f"~{fmt_seconds(self.seconds)} instead of ~{fmt_seconds(self.current_seconds)}; the resolver's "
                "plan, which the SDK cannot train yet (it sends a stage boundary as whole copies)")


@dataclass(frozen=True)
class BoundaryArrow:
    """One pipeline's part of a stage-boundary Reshard: from stage ``src_stage`` to ``dst_stage`` of pipeline
    ``pipeline``; bytes this pipeline's devices send per step, forward (activations) and backward (gradients)."""

    reshard: str
    pipeline: int
    src_stage: int
    dst_stage: int
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    kinds: tuple[str, ...]
    forward: Mapping[str, int]
    backward: Mapping[str, int]
    minimum_inter: int
    fix: BoundaryFix | None = None

    @property
    def per_step(self) -> dict[str, int]:
        return {c: self.forward.get(c, 0) + self.backward.get(c, 0) for c in ("intra", "inter")}

    @property
    def redundancy(self) -> float:
        """Inter-node bytes sent forward over the minimum (one copy per receiving node); 0 when none cross."""
        inter = self.forward.get("inter", 0)
        return inter / self.minimum_inter if self.minimum_inter else 0.0

    @property
    def redundant(self) -> bool:
        return self.redundancy > REDUNDANT_FACTOR

    def label(self) -> str:
        """``SendRecv · 14.0 GB inter per step`` (bytes per step, forward + backward, per link class)."""
        parts = [f"{fmt_bytes(v)} {c}" for c, v in self.per_step.items() if v]
        return f"{' + '.join(self.kinds)} · " + (" + ".join(parts) + " per step" if parts else "nothing moves")


@dataclass(frozen=True)
class BusiestLink:
    """The device pair whose link carries the most seconds of traffic per step."""

    src: int
    dst: int
    cls: str
    nbytes: int
    seconds: float
    bandwidth: float

    def describe(self) -> str:
        return (f"busiest link: rank {self.src} → {self.dst} ({self.cls}-node, {fmt_bandwidth(self.bandwidth)}): "
                f"{fmt_bytes(self.nbytes)} a step, ~{fmt_seconds(self.seconds)}")


@dataclass(frozen=True)
class CommView:
    arrows: tuple[BoundaryArrow, ...]
    busiest: BusiestLink | None
    grad_sync: tuple[tuple[str, int], ...]


def _stage_index(strategy: Any) -> dict[frozenset[int], tuple[int, int]]:
    return {frozenset(s.devices): (i, j) for i, p in enumerate(strategy.pipelines) for j, s in enumerate(p.stages)}


def _dup_to_split(ann: Any, shape: tuple[int, ...]) -> Any:
    """``ann`` with each subgroup's Duplicate replaced by a split of the same degree along a dim that every
    subgroup's sub-tensor divides (the hdim excluded); ``None`` when there is no Duplicate or no such dim."""
    if all(ds.duplicate <= 1 for ds in ann.ds_union):
        return None
    for d in range(len(shape)):
        if d == ann.hdim:
            continue
        ok = True
        new = []
        for k, ds in enumerate(ann.ds_union):
            states = dict(ds.states)
            deg = states.pop(DUPLICATE, 1)
            if deg <= 1:
                new.append(ds)
                continue
            if d in states:
                ok = False
                break
            box = ann.subgroup_box(shape, k)
            if (box[d][1] - box[d][0]) % deg:
                ok = False
                break
            states[d] = deg
            new.append(DS(states))
        if ok:
            return Annotation([list(g) for g in ann.dg_union], new, ann.hdim, ann.hratios)
    return None


def _fix_for(plan: Any, cluster: Any) -> BoundaryFix | None:
    via = _dup_to_split(plan.dst, tuple(plan.shape))
    if via is None:
        return None
    try:
        a = resolve(plan.src, via, plan.shape, plan.dtype, cluster)
        b = resolve(via, plan.dst, plan.shape, plan.dtype, cluster)
    except Exception:  # noqa: BLE001 - no alternative is offered when the resolver cannot plan one
        return None
    vol = [a.volume(cluster), b.volume(cluster)]
    inter = sum(v["inter"] for vv in vol for v in vv.values())
    intra = sum(v["intra"] for vv in vol for v in vv.values())
    cur = plan.volume(cluster)
    return BoundaryFix(str(via), tuple(a.kinds) + tuple(b.kinds), inter, intra,
                       a.estimated_time(cluster) + b.estimated_time(cluster),
                       sum(v["inter"] for v in cur.values()), plan.estimated_time(cluster), (a, b))


def _minimum_inter(plan: Any, k: int, cluster: Any) -> int:
    """One copy of subgroup ``k``'s sub-tensor per receiving node that holds none of it already."""
    src_nodes = {cluster.node_index(r) for r in plan.src.dg_union[k]}
    dst_nodes = {cluster.node_index(r) for r in plan.dst.dg_union[k]}
    size = box_numel(plan.dst.subgroup_box(plan.shape, k)) * plan.itemsize
    return size * len(dst_nodes - src_nodes)


def boundary_arrows(program: Any, strategy: Any, cluster: Any) -> list[BoundaryArrow]:
    """Every stage boundary of ``program``, one arrow per pipeline and Reshard whose subgroup changes devices,
    in pipeline then stage order.  Redundant ones carry the core's cheaper alternative (:class:`BoundaryFix`)."""
    stages = _stage_index(strategy)
    out: list[BoundaryArrow] = []
    fixes: dict[str, BoundaryFix | None] = {}
    for name, plan in program.comm_plans.items():
        src, dst = plan.src, plan.dst
        if src.hsize != dst.hsize or all(set(a) == set(b) for a, b in zip(src.dg_union, dst.dg_union)):
            continue
        back = program.backward_plans.get(name)
        for k, (a, b) in enumerate(zip(src.dg_union, dst.dg_union)):
            if set(a) == set(b):
                continue
            sa, sb = stages.get(frozenset(a)), stages.get(frozenset(b))
            if sa is None or sb is None or sa[0] != sb[0]:
                continue
            senders = set(a) | set(b)
            fwd = _sum_volume((t for op in plan.ops for t in op.transfers()), cluster, senders)
            bwd = (_sum_volume((t for op in back.ops for t in op.transfers()), cluster, senders)
                   if back is not None else {"intra": 0, "inter": 0})
            arrow = BoundaryArrow(name, sa[0], sa[1], sb[1], tuple(a), tuple(b), tuple(plan.kinds), fwd, bwd,
                                  _minimum_inter(plan, k, cluster))
            if arrow.redundant:
                if name not in fixes:
                    fixes[name] = _fix_for(plan, cluster)
                fix = fixes[name]
                if fix is not None and fix.inter < fix.current_inter:
                    arrow = BoundaryArrow(**{**arrow.__dict__, "fix": fix})
            out.append(arrow)
    out.sort(key=lambda x: (x.pipeline, x.src_stage, x.dst_stage))
    return out


def link_loads(program: Any) -> dict[tuple[int, int], tuple[int, int]]:
    """``(sender, receiver) -> (bytes, messages)`` a step over every communication of the program."""
    loads: dict[tuple[int, int], list[int]] = {}
    for plans in (program.comm_plans, program.backward_plans, program.grad_reduce_plans, program.grad_sync_plans):
        for plan in plans.values():
            for op in plan.ops:
                for s, d, n, steps in op.transfers():
                    if s != d and n:
                        got = loads.setdefault((s, d), [0, 0])
                        got[0] += n
                        got[1] += steps
    return {k: (v[0], v[1]) for k, v in loads.items()}


def busiest_link(program: Any, cluster: Any) -> BusiestLink | None:
    best: BusiestLink | None = None
    for (s, d), (n, steps) in link_loads(program).items():
        link = cluster.link(s, d)
        secs = n / link.bandwidth + steps * link.latency
        if best is None or secs > best.seconds:
            best = BusiestLink(s, d, "inter" if link.cls == "inter" else "intra", n, secs, link.bandwidth)
    return best


def comm_view(program: Any, strategy: Any, cluster: Any, *, busiest: bool = True) -> CommView:
    """Arrows, the busiest link (``busiest=False``: left ``None``, to be added later) and the gradient
    synchronisation's operators of ``program``."""
    from collections import Counter

    sync = Counter(" + ".join(p.kinds) for p in program.grad_sync_plans.values())
    return CommView(tuple(boundary_arrows(program, strategy, cluster)),
                    busiest_link(program, cluster) if busiest else None, tuple(sync.most_common()))
