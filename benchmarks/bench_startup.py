"""The time from ``launch()`` to the first step on 4 local ranks, and where it goes (issue 23), against a named
peer measured in the same run: plain torch -- ``torch.multiprocessing.start_processes`` (spawn) of 4 processes that
import torch, form a gloo process group, wrap the same model's single-device reference in
``DistributedDataParallel`` and run one Adam step on the same batch shape.  Both sides do the same work up to the
end of the first step; ours also specializes the Program, checks resources, reads the Program's JSON, builds its
executor and starts the liveness threads.

Parts of ours (``job.startup()``, critical path: until the last rank): ``prepare`` (the launcher's option checks,
specialization on the launch cluster, preflight), ``processes`` (spawn to the worker's first line: Python, the
worker module), ``imports`` (torch and the entry's modules), ``rendezvous`` (TCPStore + ``init_process_group``),
``build`` (Program from JSON, executor, parameters), ``first step``.  The peer's: spawn to its first step's end.

Three ways ours starts (``hspmd_sdk.runtime.transports.forkserver``): ``warm`` -- the kernel launched before, its fork server
is up, each worker is a fork of a process that imported torch once; ``first`` -- the kernel's first launch, the
server starts (imports once) then forks; ``fresh`` -- ``LocalTransport(fork=False)``, four processes importing
torch each (what every launch cost before the fork server, and what a GPU launch still does).

Run: ``python benchmarks/bench_startup.py`` (about 1 min on 2 cores; ``--rounds N``).  Figures:
``benchmarks/results/startup.json``; the table is in ``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hspmd_sdk import Cluster, LlamaConfig, specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime import launch  # noqa: E402
from hspmd_sdk.runtime.transports import forkserver
from hspmd_sdk.runtime.control.launcher import free_port  # noqa: E402
from hspmd_sdk.runtime.transports.transport import LocalTransport  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WORLD, BATCH, SEQ = 4, 4, 32
MODES = ("warm", "first", "fresh")


def ours_once(program: Any, cluster: Any, mode: str = "warm") -> dict[str, float]:
    """One launch to its first step; ``mode``: ``warm`` (fork server up), ``first`` (server started by this
    launch), ``fresh`` (no fork server)."""
    if mode == "first":
        forkserver.shutdown()
    transport = LocalTransport(fork=mode != "fresh")
    t0 = time.monotonic()
    job = launch(program, cluster, steps=1, seq_len=SEQ, progress=False, transport=transport)
    job.wait()
    s = job.startup()
    parts = {"prepare": float(s.prepare_s or 0.0), **{k: float(v or 0.0) for k, v in s.phases.items()}}
    parts["total"] = s.total_s
    parts["wall_to_end"] = time.monotonic() - t0
    return parts


def _peer_worker(rank: int, port: int, start: float, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    config = LlamaConfig.preset("tiny")

    class WithLoss(torch.nn.Module):  # DDP syncs gradients of what runs through its forward
        def __init__(self) -> None:
            super().__init__()
            self.ref = config.build_reference(0)

        def forward(self, tokens: Any, targets: Any) -> Any:
            return self.ref.loss(tokens, targets)

    model = torch.nn.parallel.DistributedDataParallel(WithLoss())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (BATCH // WORLD, SEQ + 1))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    opt.step()
    dist.barrier()
    out.put((rank, time.time() - start))
    dist.destroy_process_group()


def peer_once() -> float:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    start = time.time()
    procs = mp.start_processes(_peer_worker, args=(free_port(), start, q), nprocs=WORLD, start_method="spawn",
                               join=False)
    procs.join()
    return max(q.get()[1] for _ in range(WORLD))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=str(RESULTS / "startup.json"))
    args = p.parse_args(argv)
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(WORLD)
    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}],
                                             "micro_batch_size": BATCH // WORLD, "num_micro_batches": 1}
                                            for r in range(WORLD)]})
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
    ours: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    peer = []
    ours_once(program, cluster, "first")  # not counted: the first launch of this process pays its lazy imports
    for _ in range(args.rounds):  # alternate: the same background load for every side
        for m in MODES:
            ours[m].append(ours_once(program, cluster, m))
        peer.append(peer_once())
    med = {m: {k: statistics.median(r[k] for r in ours[m]) for k in ours[m][0]} for m in MODES}
    peer_med = statistics.median(peer)
    out = {"world": WORLD, "rounds": args.rounds, "cores": os.cpu_count(), "ours": med, "ours_rounds": ours,
           "peer": {"name": "torch.multiprocessing spawn + init_process_group(gloo) + DDP first step",
                    "total": peer_med, "rounds": peer},
           "ratio": {m: med[m]["total"] / peer_med for m in MODES}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"launch() to the first step, {WORLD} local ranks, median of {args.rounds} (seconds):")
    print(f"  {'part':<11} " + " ".join(f"{m:>7}" for m in MODES))
    for k in ("prepare", "processes", "imports", "rendezvous", "build", "first step", "total"):
        print(f"  {k:<11} " + " ".join(f"{med[m][k]:7.2f}" for m in MODES))
    print(f"  peer (spawn + gloo + DDP, first step): {peer_med:.2f} s; ratio ours / peer: "
          + ", ".join(f"{m} {out['ratio'][m]:.3f}" for m in MODES))
    return out

if __name__ == "__main__":
    main()
