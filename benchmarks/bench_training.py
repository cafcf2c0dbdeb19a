"""Real training: tokens/s against torch DDP, and what clipping, validation and the data path cost (issue 44).

The model is a ~0.9 M-parameter GPT-2 (4 layers, hidden 128, 4 heads, ffn 512, vocabulary 512: nanoGPT's CPU
"baby GPT" size) trained on the prepared standard-library corpus (``stdlib_corpus(512)``), global batch 8 x 256
tokens (2,048 tokens a step), fp32, on 4 local ranks (gloo), with the full recipe: fused Adam (betas 0.9/0.95,
weight decay 1e-4 on the matrices), warmup + cosine schedule, clipping at global norm 1.0.  Contestants, each a
job of ``--steps`` steps on 4 local worker processes:

* ``dp4``: ``hspmd_sdk.launch`` under DP4 (the public path: the worker's session loop, the step's commit, metrics);
* ``hetero``: ``launch`` under ``example_hetero_tiny`` (a TP2 stage then a TP1 stage beside a 1-rank pipeline);
* ``ddp``: the same model (``build_reference``) under ``torch.nn.parallel.DistributedDataParallel`` in the same
  worker processes (:func:`ddp_entry`), each rank reading its 2 rows of the same global batch from the same
  corpus, torch's fused Adam on the same parameter groups, the same schedule, ``clip_grad_norm_``: a plain
  nanoGPT-style loop;
* ``dp4_noclip``: ``dp4`` with ``max_norm=None`` (the cost of clipping);
* ``dp4_eval``: ``dp4`` with a validation every ``--eval-every`` steps (the cost of validation).

Both sides time a step the same way: ``WorkerState.begin_step`` to ``report`` on every rank (data read, forward,
backward, gradient sync, clipping, Adam, the metrics message; a validation step includes its validation), and a
step's time is the slowest rank's.  Each repeat runs every contestant once, in turns (the order rotates between
repeats, so a patch of background load hits all alike); the figure of a job is its median step time after
``--warmup`` steps, and a contestant's figure the median over repeats.  Tokens/s = 2,048 / step time.

Step by step in one job (:func:`interleaved_entry`, the house's interleaved method of ``benchmarks._peers``): our
DP4 executor with the step's commit, without and with clipping, and the DDP step without and with
``clip_grad_norm_``, one step each in rotating order per round: the ratio ours / DDP and the cost of clipping as
medians of ratios of adjacent steps, which background load disturbs far less than whole jobs in turns.  There each
rank also counts its process's CPU seconds per step (every thread: compute and gloo's): with 4 ranks on 2 cores a
step's wall time is about the ranks' CPU time over the cores, so the CPU ratio says where the time goes.

The data path: ``TokenCorpus.global_batch`` timed directly in this process for the same steps' batches (the whole
batch, and one DP4 rank's 2 rows, what a rank reads per step), against the DP4 step.

Run: ``python benchmarks/bench_training.py [--steps 40] [--repeats 5]`` (about 5 minutes on 2 cores).  Figures:
``benchmarks/results/training.json``; the table is in ``benchmarks/RESULTS.md`` (§32).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Mapping

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hspmd_sdk import Cluster, GPTConfig, Strategy, launch, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime.control.launcher import launch_entry  # noqa: E402
from hspmd_sdk.runtime.lr_schedule import Schedule, schedule_of  # noqa: E402
from hspmd_sdk.runtime.transports.transport import LocalTransport  # noqa: E402

EXAMPLES = REPO / "hspmd_sdk" / "examples"
RESULTS = REPO / "benchmarks" / "results"
ENTRY = "benchmarks.bench_training:ddp_entry"

VOCAB, B, S, SEED = 512, 8, 256, 0
MODEL = GPTConfig(name="bench-1m", vocab_size=VOCAB, hidden_size=128, num_layers=4, num_heads=4,
                  ffn_hidden_size=512, max_seq_len=S)
RECIPE: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=1e-4, decay="matrices",
                              schedule={"kind": "cosine", "warmup_steps": 5, "min_lr_factor": 0.1}, max_norm=1.0)
DP4 = {"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 2,
                      "num_micro_batches": 1} for r in range(4)], "name": "dp4"}


# ---- the peer: DDP in the SDK's worker processes ---------------------------------------------------------------
def ddp_entry(state: Any, spec: Any) -> dict[str, Any]:
    """``DistributedDataParallel`` on the model's single-device module; rank ``r`` trains rows ``[r*B/W,
    (r+1)*B/W)`` of each global batch (read with ``rows=``, as our ranks read theirs), torch's fused Adam on the
    decayed (>= 2 dims) and undecayed groups, the run's schedule and ``clip_grad_norm_``.  Each step is timed by
    ``state.begin_step`` / ``state.report`` as our workers time theirs; returns this rank's losses."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = GPTConfig.model_validate(spec.payload["model"])

    class Loss(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return self.m.loss(tokens, targets)

    module = DDP(Loss(model.build_reference(int(spec.payload["seed"]))))
    return peer_steps(state, spec, module, module.parameters(), fused=True)


def peer_steps(state: Any, spec: Any, loss_of: Any, parameters: Any, **adam: Any) -> dict[str, Any]:
    """A peer's training loop (DDP's, FSDP2's): torch's Adam (``adam``: ``fused=`` / ``foreach=``) on the decayed
    (>= 2 dims) and undecayed groups, the run's schedule and ``clip_grad_norm_``; ``loss_of(tokens, targets)``
    the step's loss on this rank's rows ``[r*B/W, (r+1)*B/W)`` of each global batch (read with ``rows=``, as our
    ranks read theirs).  Each step is timed by ``state.begin_step`` / ``state.report`` as our workers time theirs;
    returns this rank's losses."""
    import torch
    import torch.distributed as dist

    from hspmd_sdk.runtime.data import dataset_for

    p = spec.payload
    model = GPTConfig.model_validate(p["model"])
    run = p["recipe"]
    B_, S_, seed, steps = int(p["global_batch"]), int(p["seq_len"]), int(p["seed"]), int(spec.steps)
    params = list(parameters)
    groups = [{"params": [q for q in params if q.dim() >= 2]},
              {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.Adam(groups, lr=run["lr"], betas=tuple(run["betas"]), eps=run["eps"],
                           weight_decay=run["weight_decay"], **adam)
    sched: Schedule = schedule_of(run["schedule"])
    max_norm = run["max_norm"]
    data = dataset_for(p["data"], model.vocab_size)
    w, r = dist.get_world_size(), dist.get_rank()
    rows = (r * B_ // w, (r + 1) * B_ // w)
    losses = []
    dist.barrier()
    for step in range(steps):
        state.begin_step()
        lr = sched.lr(step, run["lr"], steps)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = data.global_batch(step, B_, S_, seed, rows=rows)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(batch[:, :-1], batch[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if max_norm is not None else None
        opt.step()
        losses.append(float(loss.detach()))
        if norm is not None and hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        state.report(step, loss=losses[-1], tokens=(rows[1] - rows[0]) * S_, lr=lr,
                     grad_norm=None if norm is None else float(norm))
    return {"losses": losses}


def interleaved_entry(state: Any, spec: Any) -> dict[str, Any]:
    """Step by step in one job, each step bracketed by barriers (``benchmarks._peers._timed``), on the same
    pre-read global batches, in rotating order: our DP4 executor (the ``StepExecutor`` as ``benchmarks._peers``
    drives it, plus the step's commit: one all-reduce of its loss and owned squared gradient norm, as the session's
    commit gathers them, which gives the global norm) without and with clipping (``max_norm``), and the DDP step
    without and with ``clip_grad_norm_`` -- four models trained side by side.  Leaves out the session's data
    read, metrics and schedule; robust to background load (adjacent steps see the same load)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks._peers import _timed
    from hspmd_sdk.runtime.data import dataset_for
    from hspmd_sdk.runtime.protocol import program_of_run, training_of
    from hspmd_sdk.runtime.workers.comm import comm_groups
    from hspmd_sdk.runtime.workers.executor import AdamConfig, StepExecutor, program_comm_plans

    p = spec.payload
    run, max_norm = p["run"], float(p["max_norm"])
    program = program_of_run(run)
    state.create_groups(comm_groups(program_comm_plans(program)))
    o = training_of(run).optimizer
    adam = AdamConfig(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, decay=o.decay)
    model = GPTConfig.model_validate(run["config"])
    B_, S_, seed = int(run["global_batch"]), int(run["seq_len"]), int(run["seed"])
    w, r = dist.get_world_size(), dist.get_rank()
    rows = slice(r * B_ // w, (r + 1) * B_ // w)

    def ours(clip: float | None) -> Any:
        ex = StepExecutor(program, state.rank, state, seed=seed, global_batch=B_, seq_len=S_, device=state.device,
                          adam=adam, max_norm=clip)

        def commit(loss: float) -> float:
            t = torch.tensor([loss, ex.grad_sq], dtype=torch.float64)
            dist.all_reduce(t)
            return float(t[1].sqrt())

        return lambda batch: ex.step(batch, before_update=commit)

    class Loss(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return self.m.loss(tokens, targets)

    def ddp(clip: float | None) -> Any:
        module = DDP(Loss(model.build_reference(seed)))
        params = list(module.parameters())
        opt = torch.optim.Adam([{"params": [q for q in params if q.dim() >= 2]},
                                {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}],
                               lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=True)

        def step(batch: torch.Tensor) -> float:
            b = batch[rows]
            opt.zero_grad(set_to_none=True)
            loss = module(b[:, :-1], b[:, 1:])
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            return float(loss.detach())

        return step

    steps = {"ours": ours(None), "ours_clip": ours(max_norm), "ddp": ddp(None), "ddp_clip": ddp(max_norm)}
    names = list(steps)
    data = dataset_for(run["data"], model.vocab_size)
    batches = [data.global_batch(s, B_, S_, seed) for s in range(8)]
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(int(p["warmup"]) + int(p["rounds"])):
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            used: list[float] = []
            dt, _ = _timed(lambda: steps[name](batches[rnd % len(batches)]), used)
            if rnd >= int(p["warmup"]):
                times[name].append(dt)
                cpu[name].append(used[0])
    return {"times": times, "cpu": cpu}


# ---- the launcher side -------------------------------------------------------------------------------------------
def load() -> str:
    a, b, c = os.getloadavg()
    return f"{a:.2f} {b:.2f} {c:.2f}"


def program_of(strategy: Mapping[str, Any], cluster: Cluster) -> Any:
    return specialize(MODEL, plan_from_strategy(MODEL, Strategy.load(dict(strategy)), cluster), cluster)


def step_times(result: Any, steps: int) -> list[float]:
    """Per step, the slowest rank's step time."""
    out = []
    for s in range(steps):
        ts = [m.step_time for ms in result.metrics.values() for m in ms if m.step == s and m.step_time is not None]
        out.append(max(ts))
    return out


def run_contestant(name: str, args: argparse.Namespace, corpus: str, programs: dict[str, Any],
                   cluster: Cluster) -> dict[str, Any]:
    t0 = time.perf_counter()
    before = load()
    if name == "ddp":
        payload = {"model": MODEL.model_dump(mode="json"), "recipe": RECIPE, "global_batch": B, "seq_len": S,
                   "seed": SEED, "data": corpus}
        res = launch_entry(None, cluster, steps=args.steps, seed=SEED, entry=ENTRY, payload=payload,
                           transport=LocalTransport(cwd=str(REPO)), progress=False, timeout_s=900).wait()
        per_rank = [res.results[r]["losses"] for r in sorted(res.results)]
        losses = [sum(x) / len(x) for x in zip(*per_rank)]  # equal rows per rank: the global batch's mean
    else:
        kw = dict(RECIPE)
        if name == "dp4_noclip":
            kw["max_norm"] = None
        if name == "dp4_eval":
            kw.update(eval_every=args.eval_every, eval_batches=args.eval_batches)
        program = programs["hetero" if name == "hetero" else "dp4"]
        res = launch(program, cluster, steps=args.steps, seed=SEED, data=corpus, seq_len=S, progress=False,
                     timeout_s=900, **kw).wait()
        losses = list(res.losses)
    times = step_times(res, args.steps)
    kept = times[args.warmup:]
    out = {"name": name, "times": times, "median_s": statistics.median(kept), "min_s": min(kept),
           "losses": losses, "wall_s": time.perf_counter() - t0, "load_before": before, "load_after": load()}
    if name == "dp4_eval":
        ev = [t for s, t in enumerate(times) if s >= args.warmup and (s + 1) % args.eval_every == 0]
        plain = [t for s, t in enumerate(times) if s >= args.warmup and (s + 1) % args.eval_every]
        out.update(eval_step_s=statistics.median(ev), plain_step_s=statistics.median(plain), eval_steps=len(ev))
    out["tokens_per_s"] = B * S / out["median_s"]
    print(f"  {name:<11} median {out['median_s'] * 1e3:7.1f} ms  min {out['min_s'] * 1e3:7.1f} ms  "
          f"{out['tokens_per_s']:8.0f} tok/s  (job {out['wall_s']:.0f} s, load {before} -> {out['load_after']})",
          flush=True)
    return out


def interleaved(args: argparse.Namespace, corpus: str, program: Any, cluster: Cluster) -> dict[str, Any]:
    """Our DP4 executor and DDP, each without and with clipping, step by step in one job (:func:`interleaved_entry`);
    ratios are medians of the ratios of the steps of one round (the same load)."""
    from hspmd_sdk.runtime.control.train import training_run

    run = training_run(program, steps=1, seed=SEED, data=corpus, seq_len=S, lr=RECIPE["lr"], betas=RECIPE["betas"],
                       eps=RECIPE["eps"], weight_decay=RECIPE["weight_decay"], cluster=cluster)
    before = load()
    res = launch_entry(None, cluster, steps=1, seed=SEED, entry="benchmarks.bench_training:interleaved_entry",
                       payload={"run": run, "rounds": args.interleaved_rounds, "warmup": args.warmup,
                                "max_norm": RECIPE["max_norm"]},
                       transport=LocalTransport(cwd=str(REPO)), progress=False, timeout_s=900).wait()
    t = res.results[0]["times"]
    cpu = {n: [statistics.median(v) for v in zip(*(res.results[r]["cpu"][n] for r in sorted(res.results)))]
           for n in t}  # per round, the median rank's CPU seconds (this process, every thread)

    def pairwise(a: str, b: str, of: Mapping[str, list[float]] = t) -> float:
        return statistics.median(x / y for x, y in zip(of[a], of[b]))

    out = {"median_s": {n: statistics.median(v) for n, v in t.items()}, "min_s": {n: min(v) for n, v in t.items()},
           "ours_over_ddp_tokens_per_s": pairwise("ddp", "ours"),
           "ours_over_ddp_tokens_per_s_clipped": pairwise("ddp_clip", "ours_clip"),
           "clip_cost_ours": pairwise("ours_clip", "ours") - 1, "clip_cost_ddp": pairwise("ddp_clip", "ddp") - 1,
           "cpu_s": {n: statistics.median(v) for n, v in cpu.items()},
           "ours_over_ddp_cpu_per_step": pairwise("ours", "ddp", cpu),
           "ours_over_ddp_cpu_per_step_clipped": pairwise("ours_clip", "ddp_clip", cpu),
           "n": len(t["ours"]), "times": t, "load_before": before, "load_after": load()}
    m = out["median_s"]
    print("  " + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in m.items())
          + f" (n={out['n']}, load {before} -> {out['load_after']})")
    print(f"  ours tokens/s over DDP's (pairwise): {out['ours_over_ddp_tokens_per_s']:.3f} without clipping, "
          f"{out['ours_over_ddp_tokens_per_s_clipped']:.3f} with; clipping costs ours "
          f"{out['clip_cost_ours'] * 100:+.1f}%, DDP {out['clip_cost_ddp'] * 100:+.1f}% of a step", flush=True)
    print(f"  CPU seconds of a step per rank (every thread), ours over DDP's: "
          f"{out['ours_over_ddp_cpu_per_step']:.3f} without clipping, "
          f"{out['ours_over_ddp_cpu_per_step_clipped']:.3f} with (" + ", ".join(
              f"{n} {v * 1e3:.1f} ms" for n, v in out["cpu_s"].items()) + ")", flush=True)
    return out


def data_path(corpus: str, steps: int) -> dict[str, float]:
    """Seconds of ``TokenCorpus.global_batch`` for the run's batches, timed directly (this process, 1 thread):
    the whole global batch, and one DP4 rank's 2 rows."""
    import torch

    from hspmd_sdk.runtime.data import dataset_for

    torch.set_num_threads(1)
    data = dataset_for(corpus, VOCAB)
    data.global_batch(0, B, S, SEED)  # the first call imports torch's numpy bridge and draws the permutation
    out = {}
    for what, rows in (("global_batch_s", None), ("rank_rows_s", (2, 4))):
        ts = []
        for step in range(steps):
            t = time.perf_counter()
            data.global_batch(step, B, S, SEED, rows=rows)
            ts.append(time.perf_counter() - t)
        out[what] = statistics.median(ts)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="steps of each job")
    p.add_argument("--repeats", type=int, default=5, help="rounds: each contestant once per round, in turns")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each job left out of its median")
    p.add_argument("--eval-every", type=int, default=5, help="dp4_eval: a validation every this many steps")
    p.add_argument("--eval-batches", type=int, default=4, help="dp4_eval: validation batches (8 x 256 tokens)")
    p.add_argument("--only", default="dp4,ddp,hetero,dp4_noclip,dp4_eval", help="contestants, comma-separated")
    p.add_argument("--interleaved-rounds", type=int, default=40,
                   help="steps of each of the four in the step-by-step comparison (0: skip it)")
    p.add_argument("--json", default=str(RESULTS / "training.json"))
    args = p.parse_args(argv)
    from hspmd_sdk.data import stdlib_corpus

    corpus = str(stdlib_corpus(VOCAB))
    cluster = Cluster.local(4)
    hetero = json.loads((EXAMPLES / "example_hetero_tiny.json").read_text())
    programs = {"dp4": program_of(DP4, cluster), "hetero": program_of(hetero, cluster)}
    names = args.only.split(",")
    print(f"bench_training: {MODEL} ({MODEL.param_count() / 1e6:.2f} M parameters), batch {B} x {S}, corpus "
          f"{corpus}, {os.cpu_count()} cores, load {load()}", flush=True)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cores": os.cpu_count(),
                           "model": MODEL.model_dump(mode="json"), "params": MODEL.param_count(),
                           "global_batch": B, "seq_len": S, "recipe": RECIPE, "args": vars(args),
                           "load_start": load(), "rounds": []}
    for rnd in range(args.repeats):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        print(f"round {rnd + 1}/{args.repeats}: {', '.join(order)}", flush=True)
        out["rounds"].append({n: run_contestant(n, args, corpus, programs, cluster) for n in order})
    rounds = out["rounds"]

    def med(name: str, key: str = "median_s") -> float:
        return statistics.median(r[name][key] for r in rounds)

    def per_round(a: str, b: str) -> list[float]:
        return [r[a]["median_s"] / r[b]["median_s"] for r in rounds]

    summary: dict[str, Any] = {n: {"median_s": med(n), "tokens_per_s": B * S / med(n)} for n in names}
    if {"dp4", "ddp"} <= set(names):
        summary["dp4_vs_ddp_throughput"] = [1 / x for x in per_round("dp4", "ddp")]  # ours tokens/s over DDP's
        summary["dp4_over_ddp_tokens_per_s"] = med("ddp") / med("dp4")
        summary["dp4_over_ddp_by_minima"] = min(r["ddp"]["min_s"] for r in rounds) / min(r["dp4"]["min_s"]
                                                                                         for r in rounds)
        ours = rounds[0]["dp4"]["losses"]
        theirs = rounds[0]["ddp"]["losses"]
        summary["dp4_ddp_loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    if {"hetero", "ddp"} <= set(names):
        summary["hetero_vs_ddp_throughput"] = [1 / x for x in per_round("hetero", "ddp")]
        summary["hetero_over_ddp_tokens_per_s"] = med("ddp") / med("hetero")
    if {"dp4", "dp4_noclip"} <= set(names):
        summary["clip_cost_per_round"] = [x - 1 for x in per_round("dp4", "dp4_noclip")]
        summary["clip_cost"] = statistics.median(summary["clip_cost_per_round"])
        summary["clip_cost_by_minima"] = min(r["dp4"]["min_s"] for r in rounds) / min(r["dp4_noclip"]["min_s"]
                                                                                      for r in rounds) - 1
    if "dp4_eval" in names:
        extra = [r["dp4_eval"]["eval_step_s"] - r["dp4_eval"]["plain_step_s"] for r in rounds]
        summary["validation_s"] = statistics.median(extra)
        summary["validation_s_per_batch"] = summary["validation_s"] / args.eval_batches
        base = med("dp4") if "dp4" in names else med("dp4_eval", "plain_step_s")
        summary["validation_in_steps"] = summary["validation_s"] / base
        summary["validation_overhead_at"] = {str(k): summary["validation_s"] / (k * base)
                                             for k in (args.eval_every, 100, 1000)}
    if args.interleaved_rounds:
        print("step by step in one job: our DP4 executor (+ the commit) and DDP, each without and with clipping")
        summary["interleaved"] = interleaved(args, corpus, programs["dp4"], cluster)
    dp = data_path(corpus, args.steps)
    base = med("dp4") if "dp4" in names else None
    summary["data_path"] = {**dp, **({"rank_rows_share_of_step": dp["rank_rows_s"] / base,
                                      "global_batch_share_of_step": dp["global_batch_s"] / base} if base else {})}
    out["summary"] = summary
    out["load_end"] = load()
    print_table(summary, args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print(f"load at end {out['load_end']}; figures in {args.json}")
    return out


def print_table(s: Mapping[str, Any], args: argparse.Namespace) -> None:
    print("\n| contestant | median step | tokens/s |\n|---|---|---|")
    for n in ("dp4", "hetero", "ddp", "dp4_noclip", "dp4_eval"):
        if n in s:
            print(f"| {n} | {s[n]['median_s'] * 1e3:.1f} ms | {s[n]['tokens_per_s']:.0f} |")
    if "dp4_over_ddp_tokens_per_s" in s:
        print(f"\nDP4 tokens/s over DDP's: {s['dp4_over_ddp_tokens_per_s']:.3f} (rounds "
              + " / ".join(f"{x:.3f}" for x in s["dp4_vs_ddp_throughput"])
              + f"), by the fastest steps {s['dp4_over_ddp_by_minima']:.3f}; losses DP4 vs DDP max rel diff "
              f"{s['dp4_ddp_loss_max_rel_diff']:.1e}")
    if "hetero_over_ddp_tokens_per_s" in s:
        print(f"hetero tokens/s over DDP's: {s['hetero_over_ddp_tokens_per_s']:.3f} (rounds "
              + " / ".join(f"{x:.3f}" for x in s["hetero_vs_ddp_throughput"]) + ")")
    if "clip_cost" in s:
        print(f"clipping (max_norm=1.0 vs None): {s['clip_cost'] * 100:+.1f}% of a step (rounds "
              + " / ".join(f"{x * 100:+.1f}%" for x in s["clip_cost_per_round"])
              + f"), by the fastest steps {s['clip_cost_by_minima'] * 100:+.1f}%")
    if "validation_s" in s:
        print(f"validation ({args.eval_batches} batches): {s['validation_s'] * 1e3:.1f} ms = "
              f"{s['validation_in_steps']:.2f} steps; amortised: "
              + ", ".join(f"every {k}: {v * 100:.1f}%" for k, v in s["validation_overhead_at"].items()))
    d = s["data_path"]
    print(f"data path: global_batch {d['global_batch_s'] * 1e3:.3f} ms (8 rows), a DP4 rank's 2 rows "
          f"{d['rank_rows_s'] * 1e3:.3f} ms"
          + (f" = {d['rank_rows_share_of_step'] * 100:.2f}% of a DP4 step" if "rank_rows_share_of_step" in d else ""))


if __name__ == "__main__":
    main()
