"""The editor's honest verdict on a draft: what blocks it (errors), what costs (warnings), and what it needs.

* errors block Save, Launch and Apply: the core's checks (:func:`.draft.check_draft`: layers not covered, a rank
  in two stages, TP degrees, the pinned global batch) and running out of memory -- in the simulator, or, for a
  draft with other errors, in the core's estimate (so that a stage lists both) -- with the changes not made yet
  that would make it fit, each priced (:func:`oom_advice`);
* warnings are named as such: a TP group spread over several nodes (its all-reduces cross the network), and,
  once communication is resolved, a stage boundary that sends redundant bytes across nodes;
* memory per device always describes the draft shown: simulated when the draft simulates, else the core's
  estimate (:meth:`Strategy.device_memory`) of the stages that have devices -- the same estimate either way (the
  simulator's memory is :func:`hspmd_sdk.core.memory.device_memory`), runtime of each device included.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.strategy import Strategy
from ..errors import PlanValidationError
from ..planner.cost import CostModel
from ._units import fmt_bytes, fmt_memory, fmt_seconds
from .draft import Draft, Problem

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..planner.simulator import SimResult

__all__ = ["layout_warnings", "memory_errors", "estimated_memory_errors", "oom_advice", "draft_strategy",
           "draft_memory", "comm_warnings"]


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


def memory_errors(strategy: "Strategy", sim: "SimResult", model: Any = None, seq_len: int | None = None,
                  cluster: "Cluster | None" = None) -> list[Problem]:
    """An error at every stage with a device whose simulated peak exceeds its memory, with the changes that would
    make it fit (see :func:`oom_advice`; with ``model`` given)."""
    out = []
    for i, p in enumerate(strategy.pipelines):
        for j, s in enumerate(p.stages):
            over = [r for r in s.devices if r in sim.oom]
            if over:
                r = max(over, key=lambda d: sim.peak_memory[d] / sim.capacity[d])
                advice = oom_advice(strategy, i, j, r, sim.peak_memory, sim.capacity[r], model, seq_len, cluster)
                out.append(Problem(f"pipelines[{i}].stages[{j}]",
                                   f"out of memory: rank {r} needs ~{fmt_memory(sim.peak_memory[r])} of "
                                   f"{fmt_memory(sim.capacity[r])}; {advice}", i, j))
    return out


def estimated_memory_errors(draft: Draft, memory: dict[int, float], model: Any, seq_len: int | None,
                            cluster: "Cluster") -> list[Problem]:
    """An error at every stage of a draft that does not simulate (it has other errors) whose estimated memory
    (:func:`draft_memory`) exceeds a device's capacity: a stage that is out of memory *and* has, say, a TP error
    shows both."""
    strategy = draft_strategy(draft)
    if strategy is None or not memory:
        return []
    where = [(i, [j for j, st in enumerate(p.stages) if st.devices]) for i, p in enumerate(draft.pipelines)]
    where = [(i, js) for i, js in where if js]  # draft_strategy's pipelines and stages, in the draft's numbers
    out = []
    n = cluster.num_ranks
    for si, p in enumerate(strategy.pipelines):
        for sj, s in enumerate(p.stages):
            cap = {r: cluster.spec(r).memory_mb * 2.0**20 for r in s.devices if 0 <= r < n and r in memory}
            over = [r for r in cap if memory[r] > cap[r]]
            if not over:
                continue
            r = max(over, key=lambda d: memory[d] / cap[d])
            i, j = where[si][0], where[si][1][sj]
            advice = oom_advice(strategy, si, sj, r, memory, cap[r], model, seq_len, cluster)
            out.append(Problem(f"pipelines[{i}].stages[{j}]",
                               f"out of memory (estimate; the plan does not simulate until its other errors are "
                               f"fixed): rank {r} needs ~{fmt_memory(memory[r])} of {fmt_memory(cap[r])}; {advice}",
                               i, j))
    return out


#: Rank numbers for the devices a "what if" adds (never a rank of a cluster).
_FAKE = 1 << 24


def oom_advice(strategy: "Strategy", i: int, j: int, rank: int, memory: Any, capacity: float, model: Any,
               seq_len: int | None, cluster: "Cluster | None" = None) -> str:
    """What would make stage ``j`` of pipeline ``i`` fit, in words: only changes that are not made yet
    (recompute, ZeRO-1, a smaller micro-batch, more TP, more stages), each with the memory it would leave on the
    stage's fullest device, those that fit first.

    Each change is priced as the core's estimate (:meth:`Strategy.memory_estimate`) of the changed strategy,
    offset by what ``memory`` (simulated or estimated) adds to the estimate of the unchanged one on ``rank``."""
    p, s = strategy.pipelines[i], strategy.pipelines[i].stages[j]
    on = [w for w, yes in (("recompute", s.recompute), (f"ZeRO-{max(strategy.zero, 1)}", strategy.zero1)) if yes]
    already = f" ({' and '.join(on)} {'is' if len(on) == 1 else 'are'} on already)" if on else ""
    if model is None:
        return "give it more devices (TP) or fewer layers" + already
    try:
        base = strategy.memory_estimate(model, seq_len)
    except Exception:  # noqa: BLE001 - no estimate, no priced advice
        return "give it more devices (TP) or fewer layers" + already
    offset = memory[rank] - base[rank]
    priced: list[tuple[str, float]] = []
    for label, variants in _changes(strategy, i, j, model, cluster):
        best = None
        for text, changed, watch in variants:  # the smallest change of this kind that fits, else the largest
            try:
                est = changed.memory_estimate(model, seq_len)
            except Exception:  # noqa: BLE001
                continue
            best = (text, max(est[d] for d in watch) + offset)
            if best[1] <= capacity:
                break
        if best is not None:
            priced.append(best)
    fits = [f"{t} (~{fmt_memory(b)})" for t, b in priced if b <= capacity]
    short = [f"{t} (~{fmt_memory(b)})" for t, b in priced if b > capacity]
    if fits:
        return "would fit: " + "; or ".join(fits) + already
    if short:
        return ("no single change fits -- " + "; ".join(short) + ": combine them, or use devices with more "
                "memory" + already)
    return "use devices with more memory" + already


def _changes(strategy: "Strategy", i: int, j: int, model: Any, cluster: "Cluster | None"
             ) -> list[tuple[str, list[tuple[str, "Strategy", list[int]]]]]:
    """Every change not made yet to stage ``j`` of pipeline ``i``: ``(kind, [(words, changed strategy, ranks
    whose memory answers), ...])``, the variants of a kind from the smallest change up."""
    p = strategy.pipelines[i]
    s = p.stages[j]

    def with_pipe(pipe: Any) -> "Strategy":
        return strategy.model_copy(update={"pipelines": [*strategy.pipelines[:i], pipe, *strategy.pipelines[i + 1:]]})

    def with_stages(*stages: Any) -> "Strategy":
        return with_pipe(p.model_copy(update={"stages": [*p.stages[:j], *stages, *p.stages[j + 1:]]}))

    out: list[tuple[str, list[tuple[str, "Strategy", list[int]]]]] = []
    if not s.recompute and strategy.zero < 3:  # (ZeRO-3: every pipeline recomputes alike, not one stage)
        out.append(("recompute", [("recompute on this stage", with_stages(s.model_copy(update={"recompute": True})),
                                   s.devices)]))
    if not strategy.zero1 and strategy.dp_degree > 1:
        out.append(("zero1", [("ZeRO-1", strategy.model_copy(update={"zero1": True}), s.devices)]))
    elif strategy.zero == 1 and strategy.dp_degree > 1:  # the gradients too
        out.append(("zero2", [("ZeRO-2", strategy.model_copy(update={"zero": 2}), s.devices)]))
    elif strategy.zero == 2 and strategy.dp_degree > 1 and not any(x.recompute for q in strategy.pipelines
                                                                   for x in q.stages):  # the parameters too
        for words, update in (("ZeRO-3", {"zero": 3}), ("ZeRO-3 under GPipe", {"zero": 3, "schedule": "gpipe"})):
            try:  # 1F1B at ZeRO-3 needs the pipelines alike; GPipe takes any
                out.append(("zero3", [(words, strategy.model_copy(update=update), s.devices)]))
                break
            except ValueError:  # pydantic's, from the validated copy
                continue
    if p.micro_batch_size > 1:
        n = p.num_micro_batches * p.micro_batch_size
        out.append(("mbs", [(f"micro-batch size 1 ({n} micro-batches)",
                             with_pipe(p.model_copy(update={"micro_batch_size": 1, "num_micro_batches": n})),
                             s.devices)]))
    t = s.tp_degree
    most = cluster.num_ranks if cluster is not None else 8 * t
    tps = [k for k in range(t + 1, most + 1) if not model.tp_problems(k)]
    if tps:
        out.append(("tp", [(f"TP{k} ({k - t} more device{'s' if k - t > 1 else ''} in this stage)",
                            with_stages(s.model_copy(update={"devices": [*s.devices, *range(_FAKE, _FAKE + k - t)],
                                                             "ratios": None})), s.devices) for k in tps]))
    a, b = s.layers
    splits = []
    for n in range(2, min(s.num_layers, 8) + 1):  # n stages of about equal layers, each with its own TP group
        cuts = [a + (b - a + 1) * q // n for q in range(n + 1)]
        stages = [s.model_copy(update={"layers": [cuts[q], cuts[q + 1] - 1],
                                       "devices": s.devices if q == 0 else
                                       list(range(_FAKE + 64 * q, _FAKE + 64 * q + t))}) for q in range(n)]
        ranges = ", ".join(f"{x.layers[0]}–{x.layers[1]}" for x in stages)
        splits.append((f"{n} stages of its layers ({ranges}; {(n - 1) * t} more device"
                       f"{'s' if (n - 1) * t > 1 else ''})", with_stages(*stages),
                       [d for x in stages for d in x.devices]))
    if splits:
        out.append(("stages", splits))
    return out


def draft_strategy(draft: Draft) -> "Strategy | None":
    """The draft as a :class:`Strategy` without its empty stages and pipelines (for estimates), or ``None``."""
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


def draft_memory(draft: Draft, model: Any, seq_len: int | None, cost: Any = None,
                 cluster: "Cluster | None" = None) -> dict[int, float]:
    """The one memory estimate (:func:`hspmd_sdk.core.memory.device_memory`, with the cost model's runtime parts
    and switches: what the simulator counts) of the draft's stages that have devices, in bytes per rank: the
    plan's tensors plus each device's runtime (a GPU's CUDA context, a CPU worker's process baseline, by its kind
    on ``cluster``)."""
    s = draft_strategy(draft)
    if s is None:
        return {}
    options = (cost or CostModel()).memory_options()
    try:
        return {r: m.total for r, m in s.device_memory(model, cluster, seq_len=seq_len, **options).items()}
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
        # the SDK's own cost, not the plan's mistake: say what it costs, that training runs so, and what avoids it
        how = (f" It costs {fmt_bytes(fix.current_inter)} inter-node forward, ~{fmt_seconds(fix.current_seconds)} a "
               f"step, and the SDK trains this plan so: it sends a stage boundary as whole copies. A split send "
               f"({' → '.join(fix.kinds)}: one shard to each receiving rank, then a gather inside the node) would "
               f"move {fmt_bytes(fix.inter)}, ~{fmt_seconds(fix.seconds)}; the SDK cannot run it that way yet, so "
               "nothing in the plan needs changing for it. Only the two stages on one node, or a lower TP degree on "
               "the receiving stage, avoid the copies." if fix is not None else "")
        out.append(Problem(f"pipelines[{a.pipeline}].stages[{a.dst_stage}]",
                           f"redundant boundary traffic at {name} (pipeline {pipes}): every receiving TP rank gets "
                           f"its own full copy across nodes, {a.redundancy:.0f}× the bytes needed.{how}",
                           a.pipeline, a.dst_stage, level="warning"))
    return out
