"""The editor's honest verdict on a draft: what blocks it (errors), what costs (warnings), and what it needs.

* errors block Save, Launch and Apply: the core's checks (:func:`.draft.check_draft`: layers not covered, a rank
  in two stages, TP degrees, the pinned global batch) and running out of memory in the simulator;
* warnings are named as such: a TP group spread over several nodes (its all-reduces cross the network), and,
  once communication is resolved, a stage boundary that sends redundant bytes across nodes;
* memory per device always describes the draft shown: simulated when the draft simulates, else the core's
  estimate (:meth:`Strategy.memory_estimate`) of the stages that have devices.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._units import fmt_bytes, fmt_memory, fmt_seconds
from .draft import Draft, Problem

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.strategy import Strategy
    from ..planner.simulator import SimResult

__all__ = ["layout_warnings", "memory_errors", "draft_strategy", "draft_memory", "comm_warnings"]


def layout_warnings(draft: Draft, cluster: "Cluster") -> list[Problem]:
    """A warning at every stage whose TP group spans more than one node."""
    out = []
    n = cluster.num_ranks
    for i, p in enumerate(draft.pipelines):
        for j, s in enumerate(p.stages):
            ranks = [r for r in s.devices if 0 <= r < n]
            nodes = sorted({cluster.node_index(r) for r in ranks})
            if len(nodes) > 1:
                hosts = ", ".join(cluster.nodes[k].host for k in nodes[:4]) + (" ..." if len(nodes) > 4 else "")
                out.append(Problem(f"pipelines[{i}].stages[{j}].devices",
                                   f"TP group across {len(nodes)} nodes ({hosts}): its all-reduces cross the "
                                   f"{cluster.inter_bandwidth_gbs:g} GB/s network instead of NVLink; keep a "
                                   "stage's devices on one node", i, j, level="warning"))
    return out


def memory_errors(strategy: "Strategy", sim: "SimResult") -> list[Problem]:
    """An error at every stage with a device whose simulated peak exceeds its memory."""
    out = []
    for i, p in enumerate(strategy.pipelines):
        for j, s in enumerate(p.stages):
            over = [r for r in s.devices if r in sim.oom]
            if over:
                r = max(over, key=lambda d: sim.peak_memory[d] / sim.capacity[d])
                out.append(Problem(f"pipelines[{i}].stages[{j}]",
                                   f"out of memory: rank {r} needs ~{fmt_memory(sim.peak_memory[r])} of "
                                   f"{fmt_memory(sim.capacity[r])} (more TP, fewer layers, smaller "
                                   "micro-batches, recompute or ZeRO-1 would help)", i, j))
    return out


def draft_strategy(draft: Draft) -> "Strategy | None":
    """The draft as a :class:`Strategy` without its empty stages and pipelines (for estimates), or ``None``."""
    from ..core.strategy import Strategy
    from ..errors import PlanValidationError

    d = draft.to_dict()
    pipes = []
    for p in d["pipelines"]:
        stages = [s for s in p["stages"] if s["devices"]]
        if stages:
            pipes.append({**p, "stages": stages})
    if not pipes:
        return None
    try:
        return Strategy.load({**d, "pipelines": pipes})
    except PlanValidationError:
        return None


def draft_memory(draft: Draft, model: Any, seq_len: int | None, cost: Any = None) -> dict[int, float]:
    """The core's memory estimate (bytes per rank) of the draft's stages that have devices, plus the cost
    model's per-device runtime reserve (what the simulator adds too), so that it compares with simulated peaks."""
    from ..planner.cost import CostModel

    s = draft_strategy(draft)
    if s is None:
        return {}
    reserve = (cost or CostModel()).memory_reserve_mb * 2.0**20
    try:
        return {r: b + reserve for r, b in s.memory_estimate(model, seq_len).items()}
    except Exception:  # noqa: BLE001 - an estimate that cannot be made is simply not shown
        return {}


def comm_warnings(comm: Any) -> list[Problem]:
    """One warning per redundant stage-boundary Reshard, at the receiving stage of its first pipeline, with the
    cheaper resolution the resolver offers."""
    out = []
    by_reshard: dict[str, list[Any]] = {}
    for a in comm.arrows if comm is not None else ():
        if a.redundant:
            by_reshard.setdefault(a.reshard, []).append(a)
    for name, arrows in by_reshard.items():
        a = arrows[0]
        pipes = ", ".join(str(x.pipeline) for x in arrows)
        fix = a.fix
        how = (f" Fix: send it split ({' → '.join(fix.kinds)}): {fmt_bytes(fix.inter)} inter-node instead of "
               f"{fmt_bytes(fix.current_inter)} forward, ~{fmt_seconds(fix.seconds)} instead of "
               f"~{fmt_seconds(fix.current_seconds)} (the resolver's plan; the strategy-to-plan rule does not "
               "apply it yet)." if fix is not None else "")
        out.append(Problem(f"pipelines[{a.pipeline}].stages[{a.dst_stage}]",
                           f"redundant boundary traffic at {name} (pipeline {pipes}): every receiving TP rank gets "
                           f"its own full copy across nodes, {a.redundancy:.0f}× the bytes needed.{how}",
                           a.pipeline, a.dst_stage, level="warning"))
    return out
