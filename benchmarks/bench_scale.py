"""Planning at scale (issue 17, part 5): ``specialize`` of Llama-70B up to 10,240 ranks of mixed kinds,
``plan_switch`` of the full 70B model between two 1,024-rank plans, ``resolve`` per tensor at 10k ranks.

Goals: ``specialize`` at 10,240 ranks < 30 s and < 2 GB; ``plan_switch`` 70B at 1,024 ranks < 10 s; ``resolve``
< 1 s per tensor at 10k ranks.  Reported: a scaling curve (ranks vs seconds, peak memory) with the exponent of
a least-squares fit ``seconds = c * ranks^k`` on a log-log scale (k = 1 is linear).

The strategies (:func:`scale_strategy`) are built from a block of 256 ranks (128 H800 + 128 H20, ranks
0..128b-1 H800 and the rest H20 for b blocks, 8 to a node) holding 7 pipelines of four kinds, every stage TP8
except a TP4 + TP4 tail:

* ``A`` x3: 4 H800 stages of 20 layers, 8 micro-batches;
* ``B`` x1: 8 H20 stages of 10 layers, 4 micro-batches;
* ``C`` x2 (mixed kinds): 2 H800 stages (24 + 24 layers), then H20 stages of 16, 10, 3, 3 layers, the last two TP4
  (a TP8 -> TP4 boundary: BSR), 6 micro-batches;
* ``D`` x1: 2 H20 stages of 40 layers, 3 micro-batches.

So the pipelines cut the 80 layers at 12 different places and the parameters of a layer live on up to 4 kinds of
stage: a plan with many distinct annotations, not one layout repeated.  The second plan of the switch
(:func:`scale_strategy` with ``order="reversed"``) lays the same pipeline kinds out in the opposite order in each
block, so every stage moves to other devices.

Timing: CPU seconds (``time.process_time``: a loaded machine inflates them much less than wall seconds) and wall
seconds; peak memory from ``tracemalloc`` in a second run (it slows Python down ~2x, so the times come from a run
without it), with the memory the executable graphs of up to 1,024 ranks add, per rank (one process holding
every rank's graph is not how a job runs: each worker instantiates its own).  Each
case starts cold (``clear_caches``).  The load average is printed with the figures.

``replan_elastic`` after one lost node (issue 45: < 5 s at 10,240 ranks) at 1,024, 4,096 and 10,240 ranks.

Run: ``python benchmarks/bench_scale.py`` (about 4-6 min here); ``--quick`` stops the curve at 2,048 ranks;
``--only replan`` (or ``specialize``, ``switch``, ``resolve``) runs those parts and keeps the others' figures.
Figures: ``benchmarks/results/scale.json``.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hspmd_sdk import LlamaConfig  # noqa: E402
from hspmd_sdk.core.annotation import DS, Annotation  # noqa: E402
from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk.core.deduction import clear_caches  # noqa: E402
from hspmd_sdk.core.resolve import resolve  # noqa: E402
from hspmd_sdk.core.specialize import specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.core.switch import plan_switch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_RANKS = 256
#: pipeline kind -> (stages as (device kind, TP degree, first layer, last layer), micro-batches)
PIPELINE_KINDS: dict[str, tuple[list[tuple[str, int, int, int]], int]] = {
    "A": ([("H800", 8, 0, 19), ("H800", 8, 20, 39), ("H800", 8, 40, 59), ("H800", 8, 60, 79)], 8),
    "B": ([("H20", 8, 10 * i, 10 * i + 9) for i in range(8)], 4),
    "C": ([("H800", 8, 0, 23), ("H800", 8, 24, 47), ("H20", 8, 48, 63), ("H20", 8, 64, 73), ("H20", 4, 74, 76),
           ("H20", 4, 77, 79)], 6),
    "D": ([("H20", 8, 0, 39), ("H20", 8, 40, 79)], 3),
}
BLOCK = ["A", "A", "A", "C", "C", "B", "D"]  # 96 + 32 H800, 48 + 64 + 16 H20 ranks


def scale_strategy(ranks: int, order: str = "forward") -> tuple[Strategy, Cluster]:
    """A Llama-70B strategy on ``ranks`` (a multiple of 256) mixed H800/H20 ranks, and its cluster (above).

    ``order="reversed"`` lays each block's pipelines out in the opposite order (the second plan of the switch)."""
    if ranks % BLOCK_RANKS:
        raise ValueError(f"ranks must be a multiple of {BLOCK_RANKS}, got {ranks}")
    blocks = ranks // BLOCK_RANKS
    nxt = {"H800": 0, "H20": blocks * BLOCK_RANKS // 2}
    kinds = BLOCK if order == "forward" else BLOCK[::-1]
    pipelines = []
    for _ in range(blocks):
        for kind in kinds:
            layout, micro = PIPELINE_KINDS[kind]
            stages = []
            for dev, tp, first, last in layout:
                stages.append({"devices": list(range(nxt[dev], nxt[dev] + tp)), "layers": [first, last]})
                nxt[dev] += tp
            pipelines.append({"stages": stages, "micro_batch_size": 1, "num_micro_batches": micro})
    assert nxt == {"H800": ranks // 2, "H20": ranks}, nxt
    strategy = Strategy.load({"pipelines": pipelines, "schedule": "1f1b", "zero1": False,
                              "name": f"70B on {ranks} mixed ranks ({order})"})
    return strategy, Cluster.mixed({"H800": ranks // 2, "H20": ranks // 2})


def load() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0] if Path("/proc/loadavg").exists() else "n/a"


def cold() -> None:
    from hspmd_sdk.core.strategy_plan import _ann_cached, _ds

    clear_caches()
    _ann_cached.cache_clear()
    _ds.cache_clear()
    gc.collect()


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(CPU seconds, wall seconds, result) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - c0, time.perf_counter() - t0, out


def peak_mb(fn: Callable[[], Any]) -> float:
    """tracemalloc peak (MB) of one call, from a cold start (the result is dropped)."""
    cold()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def fit_exponent(xs: list[float], ys: list[float]) -> float:
    """Slope of the least-squares line through ``(log x, log y)``."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


MODEL = LlamaConfig.preset("llama-70b")


def specialize_case(ranks: int, graphs: str) -> dict[str, Any]:
    """plan_from_strategy + specialize at ``ranks``; executable graphs of every rank (``graphs="all"``) or of
    the first 64; every resolve call timed."""
    strategy, cluster = scale_strategy(ranks)
    calls: list[tuple[float, str, int]] = []

    def resolver(src: Annotation, dst: Annotation, shape: Any, dtype: Any, cl: Any) -> Any:
        c0 = time.process_time()
        out = resolve(src, dst, shape, dtype, cl)
        calls.append((time.process_time() - c0, "+".join(out.kinds), len(set(src.ranks) | set(dst.ranks))))
        return out

    def run() -> Any:
        plan = plan_from_strategy(MODEL, strategy, cluster)
        return specialize(MODEL, plan, cluster, resolver=resolver)

    cold()
    cpu, wall, prog = timed(run)
    spec_calls = list(calls)
    sample = prog.ranks if graphs == "all" else prog.ranks[:64]
    gcpu, gwall, _ = timed(lambda: [prog.executable_graph(r) for r in sample])
    del prog
    cold()
    tracemalloc.start()  # peak of specialize, then what the executable graphs of (up to) 1,024 ranks add
    try:
        prog = run()
        peak, held = tracemalloc.get_traced_memory()[1] / 1e6, tracemalloc.get_traced_memory()[0] / 1e6
        few = prog.ranks[:1024]
        for r in few:
            prog.executable_graph(r)
        per_rank = (tracemalloc.get_traced_memory()[0] / 1e6 - held) / len(few)
    finally:
        tracemalloc.stop()
    worst = max(spec_calls)
    return {"ranks": ranks, "pipelines": len(strategy.pipelines), "specialize_cpu_s": cpu, "specialize_wall_s": wall,
            "specialize_peak_mb": peak, "program_mb": held, "graphs_ranks": len(sample), "graphs_cpu_s": gcpu,
            "graphs_wall_s": gwall, "graphs_ms_per_rank": gcpu / len(sample) * 1e3, "graph_mb_per_rank": per_rank,
            "resolves": len(spec_calls),
            "resolve_cpu_s_total": sum(c[0] for c in spec_calls), "resolve_cpu_s_max": worst[0],
            "resolve_max_kinds": worst[1], "resolve_max_ranks": worst[2], "load": load()}


def param_layouts(strategy: Strategy, cluster: Cluster) -> dict[str, tuple[Annotation, tuple[int, ...]]]:
    """Every parameter of the model -> (its annotation under ``strategy``, its shape)."""
    from hspmd_sdk.models import build_llama_graph

    graph = build_llama_graph(MODEL)
    plan = plan_from_strategy(MODEL, strategy, cluster)
    return {p.outputs[0]: (plan.annotations[p.outputs[0]], tuple(graph.tensors[p.outputs[0]].shape))
            for p in graph.parameters}


def switch_case(ranks: int) -> dict[str, Any]:
    """plan_switch of every parameter of the 70B model from the forward to the reversed plan at ``ranks``."""
    s1, cluster = scale_strategy(ranks)
    s2, _ = scale_strategy(ranks, order="reversed")
    src, dst = param_layouts(s1, cluster), param_layouts(s2, cluster)
    cold()
    cpu, wall, sw = timed(lambda: plan_switch(src, dst, cluster, dtype="bfloat16"))
    peak = peak_mb(lambda: plan_switch(src, dst, cluster, dtype="bfloat16"))
    return {"ranks": ranks, "tensors": len(dst), "switch_cpu_s": cpu, "switch_wall_s": wall, "switch_peak_mb": peak,
            "messages": sum(len(s.messages) for s in sw.steps), "estimated_switch_s": sw.estimated_time(),
            "load": load()}


def resolve_cases(ranks: int) -> list[dict[str, Any]]:
    """Standalone Reshards of one 70B tensor at ``ranks``: the data-parallel gradient synchronisation of an FFN
    weight (SplitAllReduce over every pipeline; the layer lives on 3/16 of the ranks), the move of the same weight
    between the two plans of the switch (BSR), and two Reshards over *all* ranks: TP8 data parallelism -> a
    heterogeneous TP layout (a TP8 group per 8 ranks -> TP4 groups on the first half, TP8 on the second: BSR) and
    the gradient synchronisation of that layout (Partial across the groups -> replicas: SplitAllReduce)."""
    s1, cluster = scale_strategy(ranks)
    s2, _ = scale_strategy(ranks, order="reversed")
    name = "layers.75.mlp.w1"  # lives on TP8 (A, B, D) and TP4 (C) stages
    a1, shape = param_layouts(s1, cluster)[name]
    a2, _ = param_layouts(s2, cluster)[name]
    grad = Annotation(a1.dg_union, a1.ds_union, -2)
    dp8 = Annotation([list(range(i, i + 8)) for i in range(0, ranks, 8)], [DS({1: 8})] * (ranks // 8), -1)
    half = ranks // 2
    mixed = Annotation([list(range(i, i + 4)) for i in range(0, half, 4)]
                       + [list(range(i, i + 8)) for i in range(half, ranks, 8)],
                       [DS({1: 4})] * (half // 4) + [DS({1: 8})] * (half // 8), -1)
    out = []
    cases = (("grad sync of " + name, grad, a1), ("switch of " + name, a1, a2),
             ("DP x TP8 -> TP4/TP8 groups, all ranks", dp8, mixed),
             ("grad sync of TP4/TP8 groups, all ranks", Annotation(mixed.dg_union, mixed.ds_union, -2), mixed))
    for label, src, dst in cases:
        cold()
        cpu, wall, plan = timed(lambda: resolve(src, dst, shape, "bfloat16", cluster))
        out.append({"ranks": ranks, "case": label, "shape": list(shape), "kinds": plan.kinds, "cpu_s": cpu,
                    "wall_s": wall, "load": load()})
    return out


def replan_case(ranks: int) -> dict[str, Any]:
    """``replan_elastic`` of the 70B plan at ``ranks`` after one node (8 H800 ranks of a 4-stage pipeline) is lost:
    the decision a recovery waits for (issue 45's goal at 10,240 ranks: < 5 s)."""
    from hspmd_sdk.planner.elastic import replan_elastic

    strategy, cluster = scale_strategy(ranks)
    failed = list(cluster.nodes[3].ranks)
    cold()
    cpu, wall, new = timed(lambda: replan_elastic(MODEL, cluster, strategy, failed, seq_len=4096))
    return {"ranks": ranks, "failed": failed, "pipelines_before": len(strategy.pipelines),
            "pipelines_after": len(new.pipelines), "replan_cpu_s": cpu, "replan_wall_s": wall, "load": load()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="curve up to 2,048 ranks only")
    p.add_argument("--json", default=str(RESULTS / "scale.json"))
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS),
                   help="run these parts only; the other parts' figures in --json are kept")
    args = p.parse_args(argv)
    curve = [256, 512, 1024, 2048] if args.quick else [256, 512, 1024, 2048, 4096, 10240]
    old = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
    out: dict[str, Any] = {**old, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_start": load()}
    for part in args.only:
        out[part] = []
    print(f"bench_scale: Llama-70B ({MODEL.num_layers} layers), load {load()}")
    if "specialize" in args.only:
        _specialize_curve(out, curve, args.quick)
    if "switch" in args.only:
        _switch_curve(out, args.quick)
    if "resolve" in args.only:
        for n in ([1024, 2048] if args.quick else [1024, 4096, 10240]):
            for r in resolve_cases(n):
                out["resolve"].append(r)
                print(f"resolve at {n} ranks, {r['case']} {tuple(r['shape'])}: {'+'.join(r['kinds'])}, "
                      f"{r['cpu_s']:.3f} s CPU, {r['wall_s']:.3f} s wall; load {r['load']}", flush=True)
    if "replan" in args.only:
        for n in ([1024, 2048] if args.quick else [1024, 4096, 10240]):
            r = replan_case(n)
            out["replan"].append(r)
            print(f"replan_elastic 70B at {n} ranks, one node lost: {r['replan_cpu_s']:.2f} s CPU, "
                  f"{r['replan_wall_s']:.2f} s wall, {r['pipelines_before']} -> {r['pipelines_after']} pipelines; "
                  f"load {r['load']}", flush=True)
        out["replan_exponent"] = fit_exponent([r["ranks"] for r in out["replan"]],
                                              [r["replan_cpu_s"] for r in out["replan"]])
        print(f"fitted exponent: replan_elastic k = {out['replan_exponent']:.2f}")
    out["load_end"] = load()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"figures in {args.json}")
    return out


PARTS = ("specialize", "switch", "resolve", "replan")


def _specialize_curve(out: dict[str, Any], curve: list[int], quick: bool) -> None:
    print(f"{'ranks':>6} {'pipes':>5} {'specialize CPU s':>16} {'wall s':>7} {'peak MB':>8} "
          f"{'graphs ms/rank':>14} {'graph MB/rank':>13} {'resolves':>8} {'max resolve s':>13}  load")
    for n in curve:
        r = specialize_case(n, "all" if n <= 2048 or not quick else "sample")
        out["specialize"].append(r)
        print(f"{n:>6} {r['pipelines']:>5} {r['specialize_cpu_s']:>16.2f} {r['specialize_wall_s']:>7.2f} "
              f"{r['specialize_peak_mb']:>8.0f} {r['graphs_ms_per_rank']:>14.2f} {r['graph_mb_per_rank']:>13.3f} "
              f"{r['resolves']:>8} {r['resolve_cpu_s_max']:>13.3f}  {r['load']}", flush=True)
    xs = [r["ranks"] for r in out["specialize"]]
    out["specialize_exponent"] = fit_exponent(xs, [r["specialize_cpu_s"] for r in out["specialize"]])
    out["specialize_memory_exponent"] = fit_exponent(xs, [r["specialize_peak_mb"] for r in out["specialize"]])
    out["graphs_exponent"] = fit_exponent(xs, [r["graphs_cpu_s"] / r["graphs_ranks"] * r["ranks"]
                                               for r in out["specialize"]])
    print(f"fitted exponent (seconds ~ ranks^k): specialize k = {out['specialize_exponent']:.2f}, peak memory "
          f"k = {out['specialize_memory_exponent']:.2f}, executable graphs of all ranks k = "
          f"{out['graphs_exponent']:.2f}")


def _switch_curve(out: dict[str, Any], quick: bool) -> None:
    for n in ([256, 512, 1024] if quick else [256, 512, 1024, 2048]):
        r = switch_case(n)
        out["switch"].append(r)
        print(f"plan_switch 70B ({r['tensors']} tensors) at {n} ranks: {r['switch_cpu_s']:.2f} s CPU, "
              f"{r['switch_wall_s']:.2f} s wall, peak {r['switch_peak_mb']:.0f} MB, {r['messages']} messages, "
              f"est. switch {r['estimated_switch_s']:.3f} s; load {r['load']}", flush=True)
    out["switch_exponent"] = fit_exponent([r["ranks"] for r in out["switch"]],
                                          [r["switch_cpu_s"] for r in out["switch"]])
    print(f"fitted exponent: plan_switch k = {out['switch_exponent']:.2f}")


if __name__ == "__main__":
    main()
