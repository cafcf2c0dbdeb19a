"""Runtime step time against torch peers, heterogeneous speed-up, and training quality (issue 5).

Every comparison runs *in one job*: the SDK's own worker processes (gloo, CPU) run HSPMD's executor and the torch
peer alternately, round after round (:mod:`benchmarks._peers`), so process setup, threads, data and background
load are shared.  A step is timed between two ``dist.barrier()`` calls (the slowest rank's wall time); the figure
is the median after warm-up, and the ratio is ours / peer (< 1: we are faster).

(a) DP4 vs ``DistributedDataParallel`` on the reference module;
(b) TP2 x DP2 vs DTensor TP (``parallelize_module``, Colwise/Rowwise on the attention and MLP projections) + DDP;
(c) PP4 1F1B vs ``torch.distributed.pipelining`` ``Schedule1F1B`` with manually built ``PipelineStage``s;
(d) a heterogeneous plan (uneven data parallelism) vs the best homogeneous plan with ranks 2 and 3 emulated 3x
    slower, measured three ways — no slowdown; the runtime's ``slowdown={2: 3, 3: 3}`` (which stretches a rank's
    whole step, waits included); a compute-only emulation (``_peers.emulated_entry``: sleeps only after compute) —
    and predicted by ``planner.simulate`` with a cost model profiled on this CPU (``profile_device``, 1 thread);
    the slow ranks are a second device kind ``cpu3x`` whose profiled line ``seconds = a * flops + b`` has ``a`` and
    ``b`` multiplied by 3.  Repeated on 2 ranks (rank 1 slow), where workers do not outnumber the 2 cores;
(e) training quality: 300 steps on the standard-library bytes, homogeneous DP4 vs the heterogeneous
    ``example_hetero_tiny`` plan on the tiny model; curves to ``benchmarks/results/quality.json``;
(f) DP4 in bf16 (``precision="bf16"``: bf16 weights, activations, gradients and all-reduce, fp32 masters) vs DDP
    with its forward under ``torch.autocast`` bf16 (fp32 weights, gradients and all-reduce) on the same model.

``--bucket-mb`` / ``--first-bucket-mb`` set our gradient buckets' caps (default: the executor's, DDP's 25 / 1 MiB).
``--peer-adam``: the peers' Adam, ``fused`` (default: torch's fused kernel, the one our ranks run, so the ratio
compares the distributed runtimes) or ``default`` (``torch.optim.Adam``'s default on CPU, the for-loop one).

Run: ``python benchmarks/bench_runtime.py`` (about 10 min on 2 cores); ``--quick`` for a smoke run (~2 min);
``--only a,c`` for some parts.  Figures: ``benchmarks/results/runtime.json``; the tables are in
``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk import LlamaConfig  # noqa: E402
from hspmd_sdk.core.specialize import specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime import launch  # noqa: E402
from hspmd_sdk.runtime.control.train import training_run  # noqa: E402
from hspmd_sdk.runtime.transports.transport import LocalTransport  # noqa: E402

EXAMPLES = REPO / "hspmd_sdk" / "examples"
RESULTS = REPO / "benchmarks" / "results"
ENTRY = "benchmarks._peers:bench_entry"

#: Big enough that matmuls dominate on a CPU core (fp32): 4 layers, hidden 256, ffn 768, seq 128.
BENCH_MODEL = LlamaConfig(name="bench", vocab_size=256, hidden_size=256, num_layers=4, num_heads=8,
                          num_kv_heads=8, ffn_hidden_size=768, max_seq_len=128)
SEQ, B, SEED, LR = 128, 8, 0, 1e-3


def pipe(stages: list[tuple[list[int], list[int]]], mbs: int, n: int) -> dict[str, Any]:
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": mbs,
            "num_micro_batches": n}


def strategy(pipes: list[dict[str, Any]], name: str, schedule: str = "1f1b") -> Strategy:
    return Strategy.load({"pipelines": pipes, "schedule": schedule, "name": name})


L = BENCH_MODEL.num_layers - 1
DP4 = strategy([pipe([([r], [0, L])], B // 4, 1) for r in range(4)], "dp4")
DP2XTP2 = strategy([pipe([([0, 1], [0, L])], B // 2, 1), pipe([([2, 3], [0, L])], B // 2, 1)], "dp2xtp2")
TP2 = strategy([pipe([([0, 1], [0, L])], B, 1)], "tp2")
PP4 = strategy([pipe([([r], [r, r]) for r in range(4)], 1, B)], "pp4-1f1b")
#: Heterogeneous: the two fast ranks take 3 samples each, the two (emulated 3x) slow ranks 1 each.
HETERO_DP = strategy([pipe([([0], [0, L])], 1, 3), pipe([([1], [0, L])], 1, 3),
                      pipe([([2], [0, L])], 1, 1), pipe([([3], [0, L])], 1, 1)], "hetero-dp 3:3:1:1")
SLOW = {2: 3.0, 3: 3.0}
#: The same on 2 ranks (rank 1 emulated 3x slower): no more processes than cores.
DP2 = strategy([pipe([([r], [0, L])], B // 2, 1) for r in range(2)], "dp2")
HETERO_DP2 = strategy([pipe([([0], [0, L])], 2, 3), pipe([([1], [0, L])], 2, 1)], "hetero-dp 6:2")
SLOW2 = {1: 3.0}


def program_of(config: LlamaConfig, strat: Strategy, cluster: Cluster) -> Any:
    return specialize(config, plan_from_strategy(config, strat, cluster), cluster)


def load() -> str:
    a, b, c = os.getloadavg()
    return f"{a:.2f} {b:.2f} {c:.2f}"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---- (a)-(c): ours vs a torch peer in one job ----------------------------------------------------------------
def versus(name: str, strat: Strategy, peer: dict[str, Any], world: int, args: argparse.Namespace,
           precision: str = "fp32") -> dict:
    cluster = Cluster.local(world)
    run = training_run(program_of(BENCH_MODEL, strat, cluster), steps=1, seed=SEED, seq_len=SEQ, lr=LR,
                       cluster=cluster, precision=precision)
    peer = {**peer, "adam": args.peer_adam}
    payload = {"run": run, "peer": peer, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
               "ours_options": ours_options(args)}
    before = load()
    t0 = time.perf_counter()
    res = launch(None, cluster, steps=1, entry=ENTRY, payload=payload, timeout_s=600,
                 transport=LocalTransport(cwd=str(REPO))).wait()
    wall = time.perf_counter() - t0
    times = res.results[0]["times"]
    cpu = {k: median([median([r["cpu"][k][i] for r in res.results.values()]) for i in range(len(times[k]))])
           for k in ("ours", "peer")}  # CPU seconds per step: median over steps of the ranks' median
    ours, theirs = median(times["ours"]), median(times["peer"])
    pairs = [a / b for a, b in zip(times["ours"], times["peer"])]
    out = {"name": name, "strategy": strat.name, "peer": peer["kind"], "ours_s": ours, "peer_s": theirs,
           "ratio": ours / theirs, "pair_ratio": median(pairs), "ours_min_s": min(times["ours"]),
           "peer_min_s": min(times["peer"]), "min_ratio": min(times["ours"]) / min(times["peer"]),
           "n": len(times["ours"]), "ours_all": times["ours"], "peer_all": times["peer"],
           "load_before": before, "load_after": load(), "wall_s": wall,
           "ours_loss0": res.results[0]["losses"]["ours"][0], "peer_loss0": res.results[0]["losses"]["peer"][0],
           "threads": res.results[0]["threads"], "ours_cpu_s": cpu["ours"], "peer_cpu_s": cpu["peer"],
           "cpu_ratio": cpu["ours"] / cpu["peer"]}
    print(f"  {name:<28} median ours {ours * 1e3:7.1f} ms  peer {theirs * 1e3:7.1f} ms  ratio {ours / theirs:5.2f}"
          f" | pairwise {out['pair_ratio']:5.2f} | min {out['ours_min_s'] * 1e3:6.1f} / {out['peer_min_s'] * 1e3:6.1f}"
          f" = {out['min_ratio']:5.2f} | cpu/step {cpu['ours'] * 1e3:6.1f} / {cpu['peer'] * 1e3:6.1f} ="
          f" {out['cpu_ratio']:5.2f}  (n={out['n']}, load {before} -> {out['load_after']}, {wall:.0f} s)",
          flush=True)
    return out


def ours_options(args: argparse.Namespace) -> dict[str, Any]:
    """Executor options from the command line (bucket caps); empty: the executor's defaults."""
    out: dict[str, Any] = {}
    if args.bucket_mb is not None:
        out["bucket_bytes"] = int(args.bucket_mb * 2**20)
    if args.first_bucket_mb is not None:
        out["first_bucket_bytes"] = int(args.first_bucket_mb * 2**20)
    return out


def dp_breakdown(args: argparse.Namespace) -> dict:
    """Our DP4 step split into F+B and POST (gradient sync + Adam) — why (a) is what it is."""
    cluster = Cluster.local(4)
    run = training_run(program_of(BENCH_MODEL, DP4, cluster), steps=1, seed=SEED, seq_len=SEQ, lr=LR,
                       cluster=cluster)
    res = launch(None, cluster, steps=1, entry="benchmarks._peers:breakdown_entry",
                 payload={"run": run, "rounds": min(args.rounds, 10), "warmup": args.warmup}, timeout_s=600,
                 transport=LocalTransport(cwd=str(REPO))).wait()
    out = {k: median(v) for k, v in res.results[0].items()}
    print("  ours dp4 breakdown (median): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in out.items()), flush=True)
    return out


# ---- (d): heterogeneous vs homogeneous under emulated slow ranks ---------------------------------------------
def measured_step(strat: Strategy, args: argparse.Namespace, slowdown: dict[int, float], world: int = 4) -> float:
    """Median over steps (after warm-up) of the slowest rank's reported step time."""
    cluster = Cluster.local(world)
    steps = args.warmup + args.rounds * args.steps
    res = launch(program_of(BENCH_MODEL, strat, cluster), cluster, steps=steps, seed=SEED, seq_len=SEQ,
                          lr=LR, slowdown=slowdown, timeout_s=600, transport=LocalTransport(cwd=str(REPO))).wait()
    per_step = [max(res.step_times(r)[s] for r in range(world)) for s in range(args.warmup, steps)]
    return median(per_step)


def slow_cluster(fast: list[int], slow: list[int]) -> Cluster:
    """Ranks ``fast`` ``cpu``, ranks ``slow`` ``cpu3x`` (same spec; its cost-model line is 3x the profiled one).
    One host: both kinds are separate nodes of ``localhost``, so links between them are the cluster's ``inter``
    link (25 GB/s nominal) — communication is negligible in these predictions either way."""
    spec = Cluster.local(1).devices["cpu"]
    return Cluster.load({"nodes": [{"host": "localhost", "kind": "cpu", "ranks": fast},
                                   {"host": "localhost", "kind": "cpu3x", "ranks": slow}],
                         "devices": {"cpu": spec.model_dump(), "cpu3x": {**spec.model_dump(), "kind": "cpu3x"}}})


def profiled_cost(factor_kinds: dict[str, float], threads: int = 1) -> Any:
    """``profile_device("cpu")`` with ``threads`` torch threads (as each worker has), plus scaled copies."""
    import torch

    from hspmd_sdk.runtime import profile_device

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cost = profile_device("cpu")
    finally:
        torch.set_num_threads(old)
    fit = cost.compute_fits["cpu"]
    fits = {**cost.compute_fits, **{k: fit.model_copy(update={"a": fit.a * f, "b": fit.b * f})
                                     for k, f in factor_kinds.items()}}
    hbm = {**cost.hbm_gbs, **{k: cost.hbm_gbs.get("cpu", 50.0) / f for k, f in factor_kinds.items()}}
    return cost.model_copy(update={"compute_fits": fits, "hbm_gbs": hbm})


def emulated_steps(strats: dict[str, Strategy], args: argparse.Namespace, slowdown: dict[int, float],
                   world: int = 4) -> dict:
    """Median step time of each strategy under compute-only emulation (``_peers.emulated_entry``), interleaved."""
    cluster = Cluster.local(world)
    runs = [training_run(program_of(BENCH_MODEL, s, cluster), steps=1, seed=SEED, seq_len=SEQ, lr=LR,
                         cluster=cluster) for s in strats.values()]
    payload = {"runs": runs, "factors": {str(r): k for r, k in slowdown.items()}, "rounds": args.rounds,
               "warmup": args.warmup}
    res = launch(None, cluster, steps=1, entry="benchmarks._peers:emulated_entry", payload=payload, timeout_s=900,
                 transport=LocalTransport(cwd=str(REPO))).wait()
    return {n: median(r["times"]) for n, r in zip(strats, res.results[0]["runs"])}


def hetero_part(args: argparse.Namespace, world: int) -> dict:
    from hspmd_sdk.planner import simulate

    if world == 4:
        homos, hetero, slow, fast_slow = {"dp4": DP4, "dp2xtp2": DP2XTP2}, HETERO_DP, SLOW, ([0, 1], [2, 3])
    else:
        homos, hetero, slow, fast_slow = {"dp2": DP2, "tp2": TP2}, HETERO_DP2, SLOW2, ([0], [1])
    every = {**homos, "hetero": hetero}
    args = argparse.Namespace(**{**vars(args), "rounds": min(args.rounds, args.d_rounds)})
    before = load()
    compute_only = emulated_steps(every, args, slow, world)
    unslowed = emulated_steps(every, args, {}, world)
    builtin = {name: measured_step(strat, args, slow, world) for name, strat in every.items()}
    print(f"  {world} ranks, slowdown {slow}")
    print(f"  {'plan':<10} {'strategy':<22} {'no slowdown':>12} {'compute-only emu':>17} {'slowdown= (runtime)':>20}"
          f"   (load {before} -> {load()})")
    for name, strat in every.items():
        print(f"  {name:<10} {strat.name:<22} {unslowed[name] * 1e3:9.1f} ms {compute_only[name] * 1e3:14.1f} ms "
              f"{builtin[name] * 1e3:17.1f} ms", flush=True)
    cost = profiled_cost({"cpu3x": 3.0})
    cl = slow_cluster(*fast_slow)
    sim = {n: simulate(BENCH_MODEL, s, cl, seq_len=SEQ, cost=cost).step_time for n, s in every.items()}
    best = {"compute_only": min(homos, key=lambda n: compute_only[n]), "builtin": min(homos, key=lambda n: builtin[n]),
            "simulated": min(homos, key=lambda n: sim[n])}
    out = {"world": world, "slowdown": slow, "unslowed_s": unslowed, "compute_only_s": compute_only,
           "builtin_slowdown_s": builtin, "simulated_s": sim, "best_homogeneous": best,
           "speedup_compute_only": compute_only[best["compute_only"]] / compute_only["hetero"],
           "speedup_builtin": builtin[best["builtin"]] / builtin["hetero"],
           "speedup_simulated": sim[best["simulated"]] / sim["hetero"],
           "fit": cost.compute_fits["cpu"].model_dump()}
    print(f"  speed-up hetero vs best homogeneous: compute-only emulation {out['speedup_compute_only']:.2f}x "
          f"({best['compute_only']}); runtime slowdown= {out['speedup_builtin']:.2f}x ({best['builtin']}); "
          f"simulated {out['speedup_simulated']:.2f}x ({best['simulated']}) "
          f"[sim ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sim.items()) + "]", flush=True)
    return out


# ---- (e): training quality ------------------------------------------------------------------------------------
def quality(args: argparse.Namespace) -> dict:
    """Loss curves of a homogeneous and a heterogeneous plan; written next to ``--json`` as ``quality.json``."""
    from hspmd_sdk.runtime.control.train import start_runs

    tiny = LlamaConfig.preset("tiny")
    cluster = Cluster.local(4)
    hetero = Strategy.load(EXAMPLES / "example_hetero_tiny.json")
    homo = Strategy.load({"pipelines": [pipe([([r], [0, 3])], 2, 1) for r in range(4)], "name": "dp4"})
    runs = [training_run(program_of(tiny, s, cluster), steps=args.quality_steps, seed=SEED, data="stdlib", lr=3e-3,
                         cluster=cluster) for s in (homo, hetero)]
    res = start_runs(runs, cluster, timeout_s=1200, transport=LocalTransport(cwd=str(REPO))).wait()
    curves = {"homogeneous_dp4": res.results[0]["runs"][0]["losses"],
              "heterogeneous_example_hetero_tiny": res.results[0]["runs"][1]["losses"]}
    target = Path(args.json).parent / "quality.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"model": "tiny", "data": "stdlib", "lr": 3e-3,
                                                      "global_batch": 8, "seq_len": 64, "curves": curves}))
    out = {}
    for k, c in curves.items():
        tail = c[-20:]
        out[k] = {"first": c[0], "last": c[-1], "min": min(c), "mean_last20": sum(tail) / len(tail)}
        print(f"  {k:<36} first {c[0]:.3f}  last {c[-1]:.3f}  min {min(c):.3f}  mean(last 20) "
              f"{out[k]['mean_last20']:.3f}   (ln 256 = {math.log(256):.3f})", flush=True)
    a, b = curves.values()
    diffs = [abs(x - y) for x, y in zip(a, b)]
    out["max_abs_diff"] = max(diffs)
    out["mean_abs_diff_last50"] = sum(diffs[-50:]) / len(diffs[-50:])
    print(f"  |homo - hetero|: max {out['max_abs_diff']:.2e}, mean over last 50 steps "
          f"{out['mean_abs_diff_last50']:.2e}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="few steps (a smoke run, noisy figures)")
    p.add_argument("--only", default="a,b,c,f,d,e", help="comma-separated parts (a-f)")
    p.add_argument("--rounds", type=int, default=20, help="rounds (each contestant runs --steps per round)")
    p.add_argument("--steps", type=int, default=1, help="steps per round and contestant (1: alternate per step)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--d-rounds", type=int, default=10, help="measured steps per plan in part (d)")
    p.add_argument("--quality-steps", type=int, default=300)
    p.add_argument("--bucket-mb", type=float, default=None, help="our gradient bucket cap (default: the executor's)")
    p.add_argument("--first-bucket-mb", type=float, default=None, help="our first bucket's cap")
    p.add_argument("--peer-adam", choices=("fused", "default"), default="fused",
                   help="the peers' Adam: torch's fused kernel, as our ranks run it (default), or torch.optim.Adam's "
                        "default for CPU tensors (the for-loop implementation)")
    p.add_argument("--json", default=str(RESULTS / "runtime.json"),
                   help="where the figures go (quality.json beside it)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.quality_steps = 5, 1, 1, 30
    parts = set(args.only.split(","))
    print(f"bench_runtime: model {BENCH_MODEL}, seq {SEQ}, global batch {B}, fp32 (f: bf16), gloo, {os.cpu_count()} cores, "
          f"load {load()}", flush=True)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cores": os.cpu_count(),
                           "load_start": load(), "args": vars(args)}
    if "a" in parts:
        print("(a) DP4 vs torch DDP")
        out["a"] = versus("dp4 vs DDP", DP4, {"kind": "ddp"}, 4, args)
        out["a_breakdown"] = dp_breakdown(args)
    if "b" in parts:
        print("(b) TP2 x DP2 vs DTensor TP + DDP")
        out["b"] = versus("dp2xtp2 vs DTensor TP+DDP", DP2XTP2, {"kind": "tp_ddp", "dp": 2, "tp": 2}, 4, args)
    if "c" in parts:
        print("(c) PP4 1F1B vs torch.distributed.pipelining Schedule1F1B")
        out["c"] = versus("pp4 1f1b vs Schedule1F1B", PP4, {"kind": "pp", "num_micro_batches": B}, 4, args)
    if "f" in parts:
        print("(f) DP4 bf16 (precision='bf16') vs torch DDP with autocast bf16")
        out["f"] = versus("dp4 bf16 vs DDP+autocast", DP4, {"kind": "ddp", "autocast": "bf16"}, 4, args,
                          precision="bf16")
    if "d" in parts:
        print("(d) heterogeneous vs best homogeneous, ranks 2 and 3 emulated 3x slower")
        out["d"] = hetero_part(args, 4)
        out["d2"] = hetero_part(args, 2)
    if "e" in parts:
        print(f"(e) training quality: {args.quality_steps} steps, stdlib bytes, tiny model")
        out["e"] = quality(args)
    out["load_end"] = load()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print(f"load at end {out['load_end']}; figures in {args.json}")
    return out


if __name__ == "__main__":
    main()
