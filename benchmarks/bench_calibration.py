"""Calibration of the simulator against the runtime on this machine (issues 6 and 17).

The runtime trains five strategies on local worker processes (gloo, one torch thread each), all strategies of
one world size in one job, stepped in turn (one step each per round, so background load hits all alike); a
step is timed between two ``dist.barrier()`` calls (the slowest rank).  :func:`hspmd_sdk.planner.simulate`
predicts each; reported: measured / simulated (goal: within 20%, i.e. 0.8-1.2, on a quiet machine).

Strategies (the bench model: 4 layers, hidden 256, ffn 768, seq 128, global batch 8): one rank (no
communication: the compute model's own error); DP2, PP2 1F1B (4 micro-batches), TP2 and DP2 at ZeRO-3 on 2 ranks; the
``example_hetero_tiny`` layout (a TP2 -> TP1 pipeline with 3 micro-batches of 2 beside a 1-rank pipeline with 1)
on 4 ranks.

The cost model: :func:`hspmd_sdk.runtime.profile_model` times one decoder layer of the reference Llama
(forward and backward, and its norms + residuals alone), the embedding, the final norm + LM head + loss and the
Adam step at the bench model's shapes (1 thread), in this process; ``CostModel.cores`` is this machine's core
count (compute shared when more ranks than cores).  Two models of the link, both fp32 on the wire:

* ``back-to-back`` (the previous calibration, issue 6): the 2-rank all-reduce timed back to back after a barrier
  -- the link's floor; the TP activations counted as if sequence parallel (``sequence_parallel=True``).
* ``as run`` (issue 17): the blocking all-reduce timed the way the executor issues it, between bursts of compute,
  copies in and out included (:func:`hspmd_sdk.runtime.control.profile.collective_sweep`), which adds a per-call latency
  (``LinkOverride.call_latency``: waking up, being scheduled) and the in-context bandwidth; timed again after a
  longer burst (8 ms instead of 2 ms), the growth of the wait with the compute before a call is the skew
  (``LinkOverride.skew``: the slowest member arrives later the longer they all computed); the norms and
  residuals computed whole on every device of a TP group (``sequence_parallel=False``, as the runtime does).

Both are measured *inside each job*: after every round of steps, ranks (0, 1), (2, 3), ... sweep the link sizes
back to back and in context, so the link is measured under the same load as the steps (the median over rounds is
used).  Every rank also times a burst of matmuls at the same moment as the others; against the same burst alone
in this process it gives the share of a core a rank really gets in the job (other ranks *and* background load):
the ``as run + share`` prediction scales the compute by it instead of by ``CostModel.cores`` -- the one
robustness measure for a shared machine, where ``cores`` (which assumes the node is otherwise idle) is wrong.
The compute profile is taken afresh before each repetition; a repetition is (profile, one job per world size), and
``--repeat N`` (default 3) reports per strategy the median over the N repetitions of measured / simulated, each
with its own profile and in-job link -- so a burst of background load in one repetition does not decide a figure.
``profile_link()`` in this process (what a user of ``profile_model(link=True)`` gets, measured once at the start)
is a further prediction.  The load average is recorded per job.  Rank 0's seconds inside collectives per step are
printed beside the simulated communication.

Memory (issue 48): each job's ranks report their peak resident memory (RSS); the simulator's estimate of a rank
(:func:`hspmd_sdk.core.memory.device_memory`, what ``hspmd show``, the editor and the dashboard show) is the CPU
worker's process baseline once plus the tensors of every strategy the job holds on that rank at once (all its
strategies are built before the first step).  Reported: estimated / measured per rank.

Run: ``python benchmarks/bench_calibration.py`` (about 3 min with ``--repeat 3``); ``--quiet-below 1.0`` waits
before each repetition for the 1-minute load average to drop below 1 (a shared machine); ``--quick`` for a smoke
run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_runtime import (BENCH_MODEL, RESULTS, SEED, SEQ, LR, load, median, pipe,  # noqa: E402
                                      program_of, strategy)
from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk.runtime import launch  # noqa: E402
from hspmd_sdk.runtime.control.train import training_run  # noqa: E402
from hspmd_sdk.runtime.transports.transport import LocalTransport  # noqa: E402

L = BENCH_MODEL.num_layers - 1
STRATEGIES = {
    1: {"single": strategy([pipe([([0], [0, L])], 8, 1)], "single (1 rank)")},
    2: {"dp2": strategy([pipe([([0], [0, L])], 4, 1), pipe([([1], [0, L])], 4, 1)], "dp2"),
        "pp2_1f1b": strategy([pipe([([0], [0, 1]), ([1], [2, L])], 2, 4)], "pp2-1f1b"),
        "tp2": strategy([pipe([([0, 1], [0, L])], 8, 1)], "tp2"),
        # ZeRO-3 (issue 46): every forward and backward gathers the parameters again (one unit: 4 MiB merged)
        "dp2_zero3": strategy([pipe([([0], [0, L])], 4, 1), pipe([([1], [0, L])], 4, 1)], "dp2").model_copy(
            update={"zero": 3, "name": "dp2-zero3"})},
    4: {"hetero_tiny_layout": strategy([pipe([([0, 1], [0, 1]), ([2], [2, L])], 2, 3), pipe([([3], [0, L])], 2, 1)],
                                       "example_hetero_tiny layout")},
}
COMPUTE_S = 2e-3  # compute before each in-context all-reduce (short), and the longer one that measures the skew
SKEW_COMPUTE_S = 8e-3


def measure(world: int, strats: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, list[float]], dict,
                                                                                 dict[str, list[float]], dict,
                                                                                 dict[int, float]]:
    """One job: every strategy of ``world`` stepped in turn, the link probed after every round.  Returns step
    times, the link sweeps, rank 0's seconds inside collectives per step and its last step's collectives per op
    (calls, bytes, seconds), and each rank's peak memory (MiB, RSS)."""
    from hspmd_sdk.runtime.control.profile import LINK_SIZES

    cluster = Cluster.local(world)
    runs = [training_run(program_of(BENCH_MODEL, s, cluster), steps=1, seed=SEED, seq_len=SEQ, lr=LR,
                         cluster=cluster) for s in strats.values()]
    payload = {"runs": runs, "factors": {}, "rounds": args.rounds, "warmup": args.warmup, "threads": 1,
               "link_probe": {"sizes": list(LINK_SIZES), "compute_s": COMPUTE_S, "skew_compute_s": SKEW_COMPUTE_S},
               "time_comm": True}
    res = launch(None, cluster, steps=1, entry="benchmarks._peers:emulated_entry", payload=payload, timeout_s=900,
                 transport=LocalTransport(cwd=str(REPO))).wait()
    out = res.results[0]
    return ({n: r["times"] for n, r in zip(strats, out["runs"])}, out.get("link") or {},
            {n: [c[0] for c in r["collectives"]] for n, r in zip(strats, out["runs"])},
            {n: r["collectives"][-1][2] if r["collectives"] else {} for n, r in zip(strats, out["runs"])},
            {int(r): float(v["memory_mb"]) for r, v in res.results.items() if v.get("memory_mb") is not None})


def link_models(parent: Any, samples: dict) -> tuple[Any, Any, dict]:
    """The ``back-to-back`` and ``as run`` link overrides from one job's in-job sweeps (median per size over its
    rounds); point-to-point figures from ``parent`` (this process's :func:`profile_link`)."""
    from hspmd_sdk.planner.cost import fit_link
    from hspmd_sdk.runtime.control.profile import LINK_SIZES

    def med(key: str) -> list[float]:
        return [median([r[i] for r in samples[key]]) for i in range(len(LINK_SIZES))]

    iso, ctx, long = med("isolated"), med("in_context"), med("in_context_long")
    p2p = [parent.latency + n / parent.bandwidth for n in LINK_SIZES]  # the parent's p2p line
    raw = {"sizes": list(LINK_SIZES), "isolated_s": iso, "in_context_s": ctx, "in_context_long_s": long}
    return (fit_link(LINK_SIZES, p2p, iso, backend="gloo"),
            fit_link(LINK_SIZES, p2p, iso, ctx, backend="gloo", in_context_long=long,
                     compute_s=(COMPUTE_S, SKEW_COMPUTE_S)), raw)


def describe(lk: Any) -> str:
    return (f"step {lk.collective_latency * 1e6:.0f} us + {lk.collective_bandwidth / 1e9:.2f} GB/s, per call "
            f"{lk.call_latency * 1e6:.0f} us, skew {lk.skew:.3f} s/s of compute")


def with_share(cost: Any, share: float) -> Any:
    """``cost`` with every profiled compute line and the Adam time scaled by ``share`` instead of ``cores``."""
    prof = cost.profiles["cpu"]
    lines = ("layer_fwd", "layer_bwd", "head_fwd", "head_bwd", "embed", "layer_replicated_fwd", "layer_replicated_bwd")
    update: dict[str, Any] = {k: getattr(prof, k).model_copy(update={"a": getattr(prof, k).a * share,
                                                                   "b": getattr(prof, k).b * share}) for k in lines}
    update["optimizer_s_per_param"] = prof.optimizer_s_per_param * share
    return cost.model_copy(update={"profiles": {"cpu": prof.model_copy(update=update)}, "cores": None})


def job_models(compute: Any, parent: Any, link: dict, world: int, share: float) -> tuple[dict[str, Any], dict]:
    """The cost models of one job: its own compute profile, and the link as profiled in this process
    (``profile_link``) or in the job (``back_to_back``, ``as_run``); ``as_run_share``: ``as_run`` with compute
    scaled by the core share measured in the job instead of ``CostModel.cores``."""
    models = {"profile_link": compute.model_copy(update={"link_overrides": {"intra": parent},
                                                         "sequence_parallel": False})}
    links: dict[str, Any] = {}
    if world < 2:
        models["back_to_back"] = models["as_run"] = models["profile_link"]
    else:
        b2b, run, raw = link_models(parent, link)
        models["back_to_back"] = compute.model_copy(update={"link_overrides": {"intra": b2b}})
        models["as_run"] = compute.model_copy(update={"link_overrides": {"intra": run}, "sequence_parallel": False})
        links = {"back_to_back": b2b.model_dump(), "as_run": run.model_dump(), "raw": raw}
    models["as_run_share"] = with_share(models["as_run"], share)
    return models, links


def parent_burst() -> float:
    """:func:`benchmarks._peers.compute_burst` in this process, with one torch thread like every worker (median
    of 5)."""
    import torch

    from benchmarks._peers import compute_burst

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return median([compute_burst() for _ in range(5)])
    finally:
        torch.set_num_threads(old)


def wait_quiet(below: float, max_wait: float) -> float:
    """Wait until the 1-minute load average is below ``below`` (at most ``max_wait`` s); returns seconds waited."""
    t0 = time.time()
    while os.getloadavg()[0] >= below and time.time() - t0 < max_wait:
        time.sleep(10)
    return time.time() - t0


def main(argv: list[str] | None = None) -> dict:
    from hspmd_sdk.planner import simulate
    from hspmd_sdk.runtime.control.profile import profile_link, profile_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="repetitions (profile + one job per world size each); "
                                                         "figures are medians over them")
    p.add_argument("--quiet-below", type=float, default=None, metavar="LOAD",
                   help="before each repetition, wait (up to --max-wait s) for the 1-minute load average to drop "
                        "below LOAD: a shared machine is quiet only now and then")
    p.add_argument("--max-wait", type=float, default=1800.0)
    p.add_argument("--json", default=str(RESULTS / "calibration.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.repeat = 3, 1, 1
    cores = os.cpu_count() or 1
    print(f"bench_calibration: {BENCH_MODEL}, seq {SEQ}, {cores} cores, load {load()}")
    if args.quiet_below is not None:
        wait_quiet(args.quiet_below, args.max_wait)
    parent = profile_link()
    print(f"profile_link() here: p2p {parent.latency * 1e6:.0f} us + {parent.bandwidth / 1e9:.2f} GB/s; all_reduce "
          f"{describe(parent)}")
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cores": cores, "load_start": load(),
                           "repeat": args.repeat, "rounds": args.rounds, "profile_link": parent.model_dump(),
                           "repetitions": [], "rows": []}
    per: dict[str, list[dict]] = {name: [] for strats in STRATEGIES.values() for name in strats}
    for rep in range(args.repeat):  # a repetition: a fresh compute profile, then one job per world size
        if args.quiet_below is not None:
            waited = wait_quiet(args.quiet_below, args.max_wait)
            print(f"repetition {rep + 1}: waited {waited:.0f} s for load < {args.quiet_below} (now {load()})",
                  flush=True)
        compute = profile_model(BENCH_MODEL, "cpu", threads=1).model_copy(
            update={"cores": cores, "comm_bytes_factor": 2.0})  # the runtime communicates fp32
        prof = compute.profiles["cpu"]
        print(f"repetition {rep + 1}/{args.repeat}: layer fwd {1e-9 / prof.layer_fwd.a:.1f} GFLOP/s + "
              f"{prof.layer_fwd.b * 1e6:.0f} us, bwd {1e-9 / max(prof.layer_bwd.a, 1e-30):.1f} GFLOP/s + "
              f"{prof.layer_bwd.b * 1e6:.0f} us; norms + residuals {prof.layer_replicated_fwd.a * 1e9:.2f} + "
              f"{prof.layer_replicated_bwd.a * 1e9:.2f} ns/value; Adam {prof.optimizer_s_per_param * 1e9:.2f} "
              f"ns/param; load {load()}", flush=True)
        if rep == 0:
            compute.model_copy(update={"link_overrides": {"intra": parent}}).save(
                Path(args.json).parent / "cpu_profile.json")
        rec: dict[str, Any] = {"profile": json.loads(compute.model_dump_json()), "worlds": {}}
        for world, strats in STRATEGIES.items():
            before, alone = load(), parent_burst()
            times, link, comm, ops, rss = measure(world, strats, args)
            share = median(link["burst_s"]) / alone
            models, links = job_models(compute, parent, link, world, share)
            rec["worlds"][world] = {"links": links, "load": f"{before} -> {load()}", "core_share": share,
                                    "burst_alone_s": alone, "burst_in_job_s": link["burst_s"]}
            if links:
                b2b, run = (models[k].link_overrides["intra"] for k in ("back_to_back", "as_run"))
                print(f"  in-job link, {world} ranks: back-to-back {describe(b2b)}; as run {describe(run)}", flush=True)
            cluster = Cluster.local(world)
            held: dict[int, float] = {r: 0.0 for r in range(world)}  # tensors of every strategy, bytes a rank
            for name, strat in strats.items():
                sim = simulate(BENCH_MODEL, strat, cluster, seq_len=SEQ, cost=models["as_run"])
                for r, parts in sim.memory.items():
                    held[r] += sim.peak_memory[r] - parts["reserve"]
                m = median(times[name])
                sims = {k: simulate(BENCH_MODEL, strat, cluster, seq_len=SEQ, cost=c).step_time
                        for k, c in models.items()}
                no_comm = simulate(BENCH_MODEL, strat, cluster, seq_len=SEQ,
                                   cost=models["as_run"].model_copy(update={"comm_scale": 0.0})).step_time
                mc = median(comm[name])
                per[name].append({"measured_s": m, "simulated_s": sims, "ratio": {k: m / v for k, v in sims.items()},
                                  "measured_collectives_s": mc, "simulated_comm_s": sims["as_run"] - no_comm,
                                  "collective_ops_last_step": ops[name],
                                  "times": times[name], "load": rec["worlds"][world]["load"]})
                print(f"  {strat.name:<27} measured {m * 1e3:7.1f} ms, as run {sims['as_run'] * 1e3:7.1f} ms "
                      f"(x{m / sims['as_run']:.2f}), back-to-back x{m / sims['back_to_back']:.2f}, as run with the "
                      f"measured core share {share:.2f} x{m / sims['as_run_share']:.2f}; in collectives "
                      f"{mc * 1e3:.1f} ms (rank 0), simulated comm {(sims['as_run'] - no_comm) * 1e3:.1f} ms; "
                      f"load {rec['worlds'][world]['load']}", flush=True)
            base = models["as_run"].runtime_bytes("cpu")
            rec["worlds"][world]["memory"] = mem = {
                r: {"measured_mb": rss[r], "estimated_mb": (base + held[r]) / 2**20,
                    "tensors_mb": held[r] / 2**20, "ratio": (base + held[r]) / 2**20 / rss[r]}
                for r in sorted(rss) if rss[r] > 0}
            print(f"  memory, {world} ranks (estimated / measured peak RSS): " + ", ".join(
                f"rank {r} {v['estimated_mb']:.0f} / {v['measured_mb']:.0f} MiB = {v['ratio']:.2f}"
                for r, v in mem.items()), flush=True)
        out["repetitions"].append(rec)
    print(f"\n{'strategy':<27} {'ranks':>5} {'measured ms':>11} {'meas/back-to-back':>17} {'meas/as run':>11} "
          f"{'meas/as run+share':>17} {'meas/profile_link':>17}  per repetition meas/as run")
    for world, strats in STRATEGIES.items():
        for name, strat in strats.items():
            reps = per[name]
            ratio = {k: median([r["ratio"][k] for r in reps])
                     for k in ("back_to_back", "as_run", "as_run_share", "profile_link")}
            row = {"strategy": name, "ranks": world, "measured_s": median([r["measured_s"] for r in reps]),
                   "ratio": ratio, "repetitions": reps}
            out["rows"].append(row)
            print(f"{strat.name:<27} {world:>5} {row['measured_s'] * 1e3:11.1f} {ratio['back_to_back']:17.2f} "
                  f"{ratio['as_run']:11.2f} {ratio['as_run_share']:17.2f} {ratio['profile_link']:17.2f}  "
                  + " ".join(f"{r['ratio']['as_run']:.2f}" for r in reps))
    print(f"\n{'memory':<27} {'ranks':>5} {'rank':>4} {'est. MiB':>8} {'meas. MiB':>9} {'est/meas':>8}  "
          "(estimate: process baseline + the tensors of every strategy the job holds; measured: peak RSS)")
    out["memory"] = []
    for world in STRATEGIES:
        for r in sorted({r for rec in out["repetitions"] for r in rec["worlds"][world]["memory"]}):
            got = [rec["worlds"][world]["memory"][r] for rec in out["repetitions"]
                   if r in rec["worlds"][world]["memory"]]
            row = {"ranks": world, "rank": r, **{k: median([g[k] for g in got])
                                                 for k in ("estimated_mb", "measured_mb", "tensors_mb", "ratio")}}
            out["memory"].append(row)
            print(f"{'job of ' + ', '.join(STRATEGIES[world]):<27.27} {world:>5} {r:>4} {row['estimated_mb']:8.0f} "
                  f"{row['measured_mb']:9.0f} {row['ratio']:8.2f}")
    out["load_end"] = load()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"figures in {args.json}")
    return out


if __name__ == "__main__":
    main()
