"""ZeRO levels on 4 local ranks: our DP4 with ZeRO 0, 1, 2 and 3 against torch DDP and FSDP2 (issue 46).

The model, corpus, batch and recipe are ``bench_training.py``'s (the tutorial's ~0.9 M GPT-2, 8 x 256 tokens a step,
Adam 0.9/0.95 with weight decay on matrices, warmup + cosine, clipping at 1.0).  Contestants, each a job of
``--steps`` steps on the same 4 gloo worker processes' machine, in rotating order over ``--repeats`` rounds:

* ``dp4``, ``dp4_zero1``, ``dp4_zero2``, ``dp4_zero3``: ``launch`` of the DP4 strategy with ``zero`` 0, 1, 2, 3;
* ``ddp``: ``DistributedDataParallel`` (``bench_training.ddp_entry``): the peer of ZeRO-0;
* ``fsdp2_zero2``: torch's ``fully_shard`` on the model (one unit) with ``reshard_after_forward=False``
  (parameters stay gathered from forward to backward, gradients reduce-scattered: FSDP2's ZeRO-2), the peer of
  ``dp4_zero2``; ``fsdp2_zero3``: the default ``reshard_after_forward=True`` (ZeRO-3), the peer of ``dp4_zero3``
  (FSDP2 on one unit regathers the whole model for the backward; ours regathers parameter by parameter).

FSDP2 runs torch's Adam with ``foreach`` (its ``fused`` needs plain tensors); both peers train in
``bench_training.peer_steps`` (the same groups, schedule and ``clip_grad_norm_``).  A job's figure is its median step after ``--warmup`` steps (the slowest rank's
``begin_step`` -> ``report``), a contestant's the median over rounds.  Also checked: every contestant's losses equal
DP4's (the same training).  Run: ``python benchmarks/bench_zero.py [--steps 30] [--repeats 3]``; figures:
``benchmarks/results/zero.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_training import (B, DP4, ENTRY, MODEL, RECIPE, S, SEED, load, peer_steps,  # noqa: E402
                                       program_of, step_times)
from hspmd_sdk import Cluster, GPTConfig, launch  # noqa: E402
from hspmd_sdk.runtime.control.launcher import launch_entry  # noqa: E402
from hspmd_sdk.runtime.transports.transport import LocalTransport  # noqa: E402

NAMES = ["dp4", "dp4_zero1", "dp4_zero2", "dp4_zero3", "ddp", "fsdp2_zero2", "fsdp2_zero3"]


def fsdp_entry(state: Any, spec: Any) -> dict[str, Any]:
    """FSDP2 (``fully_shard``) on the model's single-device module, rank ``r`` training rows ``[r*B/W, (r+1)*B/W)``
    of each global batch; ``reshard_after_forward`` from the payload; each step timed as our workers time theirs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    p = spec.payload
    reshard = bool(p["reshard_after_forward"])
    module = GPTConfig.model_validate(p["model"]).build_reference(int(p["seed"]))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # one FSDP unit, the whole model: the reference model runs its blocks as methods of the root, not as calls of
    # submodules, so a unit per block would never see its forward hooks
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    return peer_steps(state, spec, module.loss, module.parameters(), foreach=True)


def run_contestant(name: str, args: argparse.Namespace, corpus: str, programs: dict[str, Any],
                   cluster: Cluster) -> dict[str, Any]:
    t0, before = time.perf_counter(), load()
    if name in ("ddp", "fsdp2_zero2", "fsdp2_zero3"):
        payload = {"model": MODEL.model_dump(mode="json"), "recipe": RECIPE, "global_batch": B, "seq_len": S,
                   "seed": SEED, "data": corpus, "reshard_after_forward": name == "fsdp2_zero3"}
        entry = ENTRY if name == "ddp" else "benchmarks.bench_zero:fsdp_entry"
        res = launch_entry(None, cluster, steps=args.steps, seed=SEED, entry=entry, payload=payload,
                           transport=LocalTransport(cwd=str(REPO)), progress=False, timeout_s=900).wait()
        per_rank = [res.results[r]["losses"] for r in sorted(res.results)]
        losses = [sum(x) / len(x) for x in zip(*per_rank)]  # equal rows per rank: the global batch's mean
    else:
        res = launch(programs[name], cluster, steps=args.steps, seed=SEED, data=corpus, seq_len=S, progress=False,
                     timeout_s=900, **RECIPE).wait()
        losses = list(res.losses)
    kept = step_times(res, args.steps)[args.warmup:]
    out = {"name": name, "median_s": statistics.median(kept), "min_s": min(kept), "losses": losses,
           "wall_s": time.perf_counter() - t0, "load_before": before, "load_after": load()}
    print(f"  {name:<12} median {out['median_s'] * 1e3:7.1f} ms  min {out['min_s'] * 1e3:7.1f} ms  "
          f"(job {out['wall_s']:.0f} s, load {before} -> {out['load_after']})", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--only", default=",".join(NAMES))
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "zero.json"))
    args = p.parse_args(argv)
    from hspmd_sdk.data import stdlib_corpus

    corpus, cluster = str(stdlib_corpus(MODEL.vocab_size)), Cluster.local(4)
    programs = {"dp4": program_of(DP4, cluster), "dp4_zero1": program_of({**DP4, "zero": 1}, cluster),
                "dp4_zero2": program_of({**DP4, "zero": 2}, cluster),
                "dp4_zero3": program_of({**DP4, "zero": 3}, cluster)}
    names = args.only.split(",")
    print(f"bench_zero: {MODEL}, batch {B} x {S}, 4 local ranks, load {load()}", flush=True)
    rounds = []
    for rnd in range(args.repeats):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        print(f"round {rnd + 1}/{args.repeats}: {', '.join(order)}", flush=True)
        rounds.append({n: run_contestant(n, args, corpus, programs, cluster) for n in order})
    med = {n: statistics.median(r[n]["median_s"] for r in rounds) for n in names}
    ratios = {f"{a}_over_{b}": med[b] / med[a] for a, b in (("dp4_zero2", "fsdp2_zero2"), ("dp4", "ddp"),
                                                            ("dp4_zero2", "dp4"), ("fsdp2_zero2", "ddp"),
                                                            ("dp4_zero1", "dp4"), ("fsdp2_zero3", "fsdp2_zero2"),
                                                            ("dp4_zero3", "fsdp2_zero3"), ("dp4_zero3", "dp4"))
              if a in med and b in med}  # throughput of a over b (> 1: a is faster)
    base = rounds[0][names[0]]["losses"]
    same = {n: max(abs(a - b) / abs(b) for a, b in zip(rounds[0][n]["losses"], base)) for n in names}
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args), "median_s": med,
           "throughput_ratios": ratios, "loss_max_rel_diff_vs_first": same, "rounds": rounds, "load_end": load()}
    for n in names:
        print(f"{n:<12} {med[n] * 1e3:7.1f} ms   {B * S / med[n]:8.0f} tokens/s   losses vs {names[0]}: {same[n]:.1e}")
    for k, v in ratios.items():
        print(f"tokens/s {k.replace('_over_', ' / ')}: {v:.3f}")
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
