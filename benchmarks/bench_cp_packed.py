"""Context-parallel attention over a packed row: CP2's forward + backward of one row of many documents, against the
same row as one document and against one rank's per-document attention (the packed path without CP).

Two local gloo processes of one torch thread each run :func:`hspmd_sdk.runtime.workers.cp_attention.cp_attention`
(ring) on their halves of the row in the balanced layout; one process runs
:func:`hspmd_sdk.runtime.workers.kernels.attention` with ``documents=`` on the whole row.  Documents: lengths drawn
from an exponential distribution (mean ``--mean`` tokens, seeded) until they fill ``--seq`` tokens.  Each figure is
the median of ``--repeats`` timed calls after one warm-up (rank 0's clock; both CP ranks run in lockstep).

Run: ``python benchmarks/bench_cp_packed.py [--seq 4096] [--mean 100]``; with ``PYTHONPATH`` at another checkout it
measures that checkout's kernel (how RESULTS §29 compares before and after).
"""
from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def documents(seq: int, mean: float, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while sum(out) < seq:
        out.append(int(min(seq - sum(out), max(1, rng.exponential(mean)))))
    return out


def _timed(fn: Any, repeats: int, barrier: Any = None) -> float:
    runs = []
    for _ in range(repeats + 1):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs[1:])


def _inputs(seq: int, heads: int, dim: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, seq, heads, dim, generator=g) for _ in range(4)]


def _cp_worker(rank: int, port: int, args: dict[str, Any], out: Any) -> None:
    from hspmd_sdk.runtime.workers.cp_attention import CPLayout, cp_attention, split_sequence

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    layout = CPLayout(args["seq"], 2, True)
    q, k, v, do = (split_sequence(t, layout, rank) for t in _inputs(args["seq"], args["heads"], args["dim"]))
    res = {}
    for name, docs in (("one document", None), ("documents", args["documents"])):
        def step() -> None:
            a, b, c = (t.clone().requires_grad_(True) for t in (q, k, v))
            cp_attention(a, b, c, layout, variant="ring", documents=docs).backward(do)
        res[name] = _timed(step, args["repeats"], dist.barrier)
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mean", type=float, default=100.0)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = vars(ap.parse_args())
    args["documents"] = documents(args["seq"], args["mean"])
    from hspmd_sdk.runtime.workers.kernels import attention

    torch.set_num_threads(1)
    q, k, v, do = _inputs(args["seq"], args["heads"], args["dim"])

    def one_rank() -> None:
        a, b, c = (t.clone().requires_grad_(True) for t in (q, k, v))
        attention(a, b, c, documents=tuple(args["documents"])).backward(do)
    single = _timed(one_rank, args["repeats"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_cp_worker, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    cp = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    row = {"seq": args["seq"], "documents": len(args["documents"]), "heads": args["heads"], "dim": args["dim"],
           "cp2_documents_ms": 1e3 * cp["documents"], "cp2_one_document_ms": 1e3 * cp["one document"],
           "one_rank_documents_ms": 1e3 * single}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
