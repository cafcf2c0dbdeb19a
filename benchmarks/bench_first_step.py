"""From the notebook cell to the first step: local vs SSH vs Slurm (issue 25, "Performance").

The same training job -- the tiny Llama, data parallel over 4 ranks, one step of the global batch 8 -- launched
the four ways the SDK reaches workers, each timed from the ``launch(...)`` call (what a notebook cell runs) until
the first step is done on every rank, with the job's own start-up breakdown (``job.startup()``):

* ``local, forked``: local processes forked from the fork server (after a first launch in the kernel);
* ``local, fresh``: local processes each importing torch (``LocalTransport(fork=False)``);
* ``SSH``: two loopback sshd hosts of 2 ranks each (:class:`hspmd_sdk.testing.sshd.LoopbackHosts`): a per-host
  agent over SSH, whose workers it forks from its own fork server (started with the agent: each launch pays it);
* ``Slurm``: a real Slurm (:class:`hspmd_sdk.testing.slurm.LocalSlurm`, 2 nodes in network namespaces, 2 GPUs
  (GRES) each): one allocation per node (``salloc``), one ``srun`` step per rank (each imports torch afresh).

Goal (issue 25): Slurm under 10 s on a warm allocation; Monarch's maintainers expect ~30 s with a prebuilt
image.  The allocation here is not warm: each launch asks ``salloc`` for it (a few tens of ms on this cluster).
The peer is plain torch measured in the same run (``bench_startup.peer_once``: spawn + gloo + DDP, first step).
Slurm needs root (the fixture is skipped otherwise, and said so).

Run: ``python benchmarks/bench_first_step.py [--rounds 3]``.  Figures: ``benchmarks/results/first_step.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime import launch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DP4 = {"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 2,
                      "num_micro_batches": 1} for r in range(4)]}
SEQ = 32


def _program(cluster: Cluster) -> Any:
    model = LlamaConfig.preset("tiny")
    return specialize(model, plan_from_strategy(model, Strategy.load(DP4), cluster), cluster,
                      bindings={"B": 8, "S": SEQ})


def timed(cluster: Cluster, transport: Any, **kw: Any) -> dict[str, Any]:
    """One launch of the job: seconds from the call to the first step done on every rank, and its parts."""
    program = _program(cluster)
    t0 = time.perf_counter()
    job = launch(program, cluster, steps=1, seq_len=SEQ, transport=transport, progress=False, timeout_s=120, **kw)
    job.wait(timeout=300)
    wall = time.perf_counter() - t0
    s = job.startup()
    return {"cell_to_first_step_s": wall, "startup_total_s": s.total_s,
            "parts": {"prepare": s.prepare_s, **{k: v for k, v in s.phases.items()}}}


def local(fork: bool) -> Callable[[], dict[str, Any]]:
    from hspmd_sdk.runtime.transports.transport import LocalTransport

    return lambda: timed(Cluster.local(4), LocalTransport(fork=fork))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=str(RESULTS / "first_step.json"))
    args = p.parse_args(argv)
    from bench_startup import peer_once

    from hspmd_sdk.runtime import SlurmTransport
    from hspmd_sdk.runtime.transports.ssh import SSHTransport
    from hspmd_sdk.testing.slurm import LocalSlurm, SlurmNode, slurm_unavailable
    from hspmd_sdk.testing.sshd import LoopbackHosts

    local(True)()  # not counted: the kernel's first launch starts the fork server
    rows: dict[str, list[dict[str, Any]]] = {"local, forked": [], "local, fresh": [], "SSH": [], "Slurm": []}
    peer: list[float] = []
    why_no_slurm = slurm_unavailable()
    with LoopbackHosts(2, ranks_per_host=2) as lab:
        ssh_cluster = lab.cluster
        slurm_ctx = LocalSlurm([SlurmNode("n1", "H800", gpus=2, cpus=2, memory_mb=4000),
                                SlurmNode("n2", "H20", gpus=2, cpus=2, memory_mb=4000)]) if not why_no_slurm else None
        try:
            if slurm_ctx is not None:
                slurm_ctx.start()
                os.environ.update(slurm_ctx.env)
            for _ in range(args.rounds):  # alternate: the same background load for every way
                rows["local, forked"].append(local(True)())
                rows["local, fresh"].append(local(False)())
                rows["SSH"].append(timed(ssh_cluster, SSHTransport(lab.hosts, **lab.ssh_options)))
                if slurm_ctx is not None:
                    rows["Slurm"].append(timed(Cluster.from_slurm(), SlurmTransport(time="10:00"), device="cpu"))
                peer.append(peer_once())
        finally:
            if slurm_ctx is not None:
                slurm_ctx.stop()
    out: dict[str, Any] = {"rounds": args.rounds, "cores": os.cpu_count(), "slurm": why_no_slurm or "ran",
                           "peer": {"name": "torch.multiprocessing spawn + gloo + DDP, first step (4 local ranks)",
                                    "median_s": statistics.median(peer), "rounds": peer}, "ways": {}}
    print(f"cell -> first step done, 4 ranks, median of {args.rounds} (s):")
    for way, rs in rows.items():
        if not rs:
            print(f"  {way:<14} skipped: {why_no_slurm}")
            continue
        m = statistics.median(r["cell_to_first_step_s"] for r in rs)
        parts = {k: statistics.median((r["parts"].get(k) or 0.0) for r in rs) for k in rs[0]["parts"]}
        out["ways"][way] = {"median_s": m, "parts": parts, "rounds": rs, "over_peer": m / out["peer"]["median_s"]}
        print(f"  {way:<14} {m:6.2f}  (" + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) +
              f")  x{m / out['peer']['median_s']:.2f} of the peer")
    print(f"  peer: {out['peer']['median_s']:.2f} s")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


if __name__ == "__main__":
    main()
