"""Context parallelism on this machine (issue 26): a long sequence through CP2 against TP2 and one rank.

The runtime trains the bench model (Llama family: ``--layers`` decoder layers, hidden 256, 4 heads, ffn 512,
vocabulary 256) on one sequence of ``--seq`` tokens a step (global batch 1), fp32, on local gloo workers of one
torch thread each, under four plans of the same model:

* ``one rank``: the whole model on rank 0 (attention: torch's ``scaled_dot_product_attention``);
* ``TP2``: Megatron tensor parallelism over two ranks (heads and FFN columns split, two all-reduces a layer);
* ``CP2``: the sequence split over two ranks, keys and values ringing between them
  (:mod:`hspmd_sdk.runtime.workers.cp_attention`), in the balanced order (rank ``i`` holds chunks ``i`` and ``3-i``);
* ``CP2 contiguous``: the same plan with the sequence cut in two halves (``HSPMD_CP_LAYOUT=contiguous``), where
  the second rank does three quarters of the causal attention work.

Measured per plan: the step time (the slowest rank's, median of the steps after the first; the plans run in turn
for ``--rounds`` rounds, the median counts) and each rank's peak resident memory at ``--seq`` and at ``--base-seq`` tokens (the difference is what the long sequence costs a rank
beyond the process itself: activations kept for backward and transient buffers -- measured, not estimated).
Predicted: :func:`hspmd_sdk.planner.simulate` of each plan with a cost model profiled here before each round
(:func:`hspmd_sdk.runtime.profile_model` of the bench model at lengths up to ``--seq``, one thread); reported:
the median over rounds of measured / simulated (goal 0.8-1.2).

torch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``) is the natural peer
but does not run here: on CPU SDPA dispatches to ``_scaled_dot_product_flash_attention_for_cpu``, which it does not
override ("does not have a sharding strategy registered", torch 2.13); the script checks that again and prints it.

Run: ``python benchmarks/bench_cp.py`` (about 4 minutes at the default 4096 tokens); ``--seq 8192`` for longer.
Writes ``benchmarks/results/cp.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime.transports.transport import LocalTransport  # noqa: E402

PLANS: dict[str, tuple[int, dict[str, Any], dict[str, str]]] = {
    "one rank": (1, {"devices": [0]}, {}),
    "TP2": (2, {"devices": [0, 1]}, {}),
    "CP2": (2, {"devices": [0, 1], "cp": 2}, {}),
    "CP2 contiguous": (2, {"devices": [0, 1], "cp": 2}, {"HSPMD_CP_LAYOUT": "contiguous"}),
}


class OneThread(LocalTransport):
    """Local workers of one torch thread each, whatever the number of ranks (the plans compare ranks, not
    threads)."""

    def threads_per_worker(self, cluster: Any) -> int | None:
        return 1


def bench_model(layers: int, seq: int) -> LlamaConfig:
    return LlamaConfig(name="bench-cp", vocab_size=256, hidden_size=256, num_layers=layers, num_heads=4,
                       num_kv_heads=4, ffn_hidden_size=512, max_seq_len=seq)


def strategy(model: LlamaConfig, stage: dict[str, Any]) -> Strategy:
    return Strategy.load({"pipelines": [{"stages": [{**stage, "layers": [0, model.num_layers - 1]}],
                                         "micro_batch_size": 1, "num_micro_batches": 1}]})


def train(model: LlamaConfig, ranks: int, stage: dict[str, Any], env: dict[str, str], seq: int,
          steps: int) -> dict[str, Any]:
    from hspmd_sdk.runtime.control.train import launch

    cluster = Cluster.local(ranks)
    program = specialize(model, plan_from_strategy(model, strategy(model, stage), cluster), cluster)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        result = launch(program, cluster, steps=steps, seq_len=seq, seed=0, transport=OneThread(),
                                 timeout_s=1800).wait()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    per_step = [max(result.metrics[r][s].step_time for r in result.metrics) for s in range(steps)]
    memory = {r: max(m.memory_mb or 0.0 for m in ms) for r, ms in result.metrics.items()}
    return {"step_s": statistics.median(per_step[1:]), "steps_s": per_step, "memory_mb": memory,
            "loss": result.losses[-1]}


def torch_cp_runs() -> str:
    """Whether torch's context_parallel runs SDPA on CPU here: ``"runs"`` or the error it raises."""
    import subprocess

    code = r'''
import datetime, os, torch, torch.distributed as dist, torch.nn.functional as F, torch.multiprocessing as mp
def run(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh("cpu", (2,))
    q, k, v = (torch.randn(1, 4, 64, 16) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        msg = "runs"
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
    if rank == 0:
        print(msg.splitlines()[0])
    dist.destroy_process_group()
if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(run, args=(port,), nprocs=2)
'''
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # spawn re-imports the main module: a file, not -c
        script = Path(tmp) / "torch_cp.py"
        script.write_text(code)
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    lines = [x for x in out.stdout.splitlines() if x.strip()]
    return lines[-1] if lines else f"did not run: {out.stderr.strip().splitlines()[-1:]}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--base-seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plans", nargs="*", default=list(PLANS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cp.json"))
    args = ap.parse_args(argv)
    from hspmd_sdk.planner import simulate
    from hspmd_sdk.runtime.control.profile import profile_model

    model = bench_model(args.layers, args.seq)
    s = args.seq
    peer = torch_cp_runs()
    print(f"torch context_parallel on CPU: {peer}")
    print(f"load average {os.getloadavg()[0]:.2f}; bench model {args.layers} layers, hidden 256, seq {s}")
    out: dict[str, Any] = {"seq": s, "base_seq": args.base_seq, "layers": args.layers, "torch_cp": peer,
                           "plans": {}}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in args.plans}
    for rnd in range(args.rounds):  # the plans in turn, round after round: a burst of load hits them alike
        # the cost model profiled afresh each round (a profile taken in a burst of load mispredicts a round)
        cost = profile_model(model, "cpu", threads=1, shapes=[(s // 4, s // 4), (s // 2, s // 2), (s, s)],
                             repeats=3)
        for name in args.plans:
            ranks, stage, env = PLANS[name]
            run = train(model, ranks, stage, env, s, args.steps)
            # the simulator prices the layout the runtime picks (balanced for a uniform CP pipeline), not the
            # contiguous one, which only the environment variable gives
            run["simulated_s"] = None if env else simulate(model, strategy(model, stage), Cluster.local(ranks),
                                                           seq_len=s, global_batch=1, cost=cost).step_time
            rounds[name].append(run)
            print(f"round {rnd} {name:<15} {run['step_s']:.2f} s/step, simulated {run['simulated_s'] or 0:.2f} s "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    for name in args.plans:
        ranks, stage, env = PLANS[name]
        runs = rounds[name]
        step = statistics.median(r["step_s"] for r in runs)
        ratios = [r["step_s"] / r["simulated_s"] for r in runs if r["simulated_s"]]
        ratio = statistics.median(ratios) if ratios else None
        base = train(model, ranks, stage, env, args.base_seq, 2)
        memory = {r: max(run["memory_mb"][r] for run in runs) for r in runs[0]["memory_mb"]}
        extra = {r: memory[r] - base["memory_mb"].get(r, 0.0) for r in memory}
        out["plans"][name] = {"step_s": step, "rounds": runs, "memory_mb": memory,
                              "base_memory_mb": base["memory_mb"], "long_minus_base_mb": extra,
                              "measured_over_simulated": ratio, "loss": runs[-1]["loss"]}
        shown = "  n/a" if ratio is None else f"{ratio:5.2f}"
        print(f"{name:<15} step {step:6.2f} s (median of {len(runs)} rounds)  measured / simulated {shown}  "
              f"memory beyond seq {args.base_seq} per rank "
              f"{', '.join(f'r{r} {v:.0f} MB' for r, v in sorted(extra.items()))}  loss {runs[-1]['loss']:.4f}")
    plans = out["plans"]
    if "CP2" in plans:
        for other in ("one rank", "TP2", "CP2 contiguous"):
            if other in plans:
                print(f"CP2 vs {other}: step time {plans[other]['step_s'] / plans['CP2']['step_s']:.2f}x faster, "
                      f"peak extra memory per rank {max(plans['CP2']['long_minus_base_mb'].values()) / max(max(plans[other]['long_minus_base_mb'].values()), 1e-9):.2f} of {other}'s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
