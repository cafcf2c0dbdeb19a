"""Checkpoint benchmarks (issue 13): save/load throughput against torch.save/torch.load and
``torch.distributed.checkpoint``, how long saving stalls training, and the checkpoint-and-restart path.

(a) I/O, in one job of 4 worker processes on a homogeneous DP2 x TP2 layout (the layout DCP's DTensors express),
    rounds interleaved (the contestants' order rotates every round), each timed between two ``dist.barrier()``
    calls (the slowest rank), medians of the rounds:

    * ``ours save``: the SDK's checkpoint (:class:`~hspmd_sdk.runtime.workers.checkpoint_worker.CheckpointSaver`, in the
      loop): each element once (replicas share the writing), safetensors + CRC-32, fsync, manifest, atomic commit;
    * ``torch.save same bytes``: each rank ``torch.save``s exactly the pieces it wrote for us, fsync;
    * ``torch.save per-rank shards``: each rank saves all its shards (what a per-rank ``torch.save`` checkpoint
      is: replicas written twice), fsync;
    * ``DCP save``: ``dcp.save`` of the same shards as DTensors on a (dp=2, tp=2) mesh (DCP dedups replicas),
      ``FileSystemWriter`` with its default fsync;
    * loads under the same layout: ``ours`` (each rank reads its boxes), ``torch.load`` of the per-rank shard file
      (the same bytes), ``dcp.load`` into the same DTensors;
    * loads under another layout (TP4 over the 4 ranks: resharding): ``ours`` vs ``dcp.load`` into TP4 DTensors.

    Files are written to ``--dir`` (default: a temporary directory on the machine's disk); reads come from the page
    cache for every contestant alike (nothing drops caches on a shared machine).

(b) Stall: the same training (2 ranks, DP2) with no checkpoint, saving in the loop, and saving in the
    background, every step; step times from the job's metrics and the time the loop was blocked per checkpoint
    (:class:`CheckpointSaver` records it), in one job (runs interleaved: none, loop, background, background, loop,
    none).

(c) Checkpoint and restart: :func:`restart` — train under plan A until a checkpoint is committed, kill every
    worker (``Job.cancel``), relaunch under plan B with ``resume_from`` and measure until the first step is done,
    split into the launcher's check of the checkpoint, process start-up + rendezvous + specialization, reading
    the shards and the first step; against a fresh start of plan B (no checkpoint) on the same machine.  This is
    the restart baseline the in-memory graph switch (issue 14, §7) is measured against: import ``restart`` from
    here.

Run: ``python benchmarks/bench_checkpoint.py`` (~3 min on 2 cores), ``--quick`` (~1 min), ``--only a,b,c``.
Figures: ``benchmarks/results/checkpoint.json``; the tables are in ``benchmarks/RESULTS.md`` §7.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hspmd_sdk import LlamaConfig  # noqa: E402
from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk.core.specialize import specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime.checkpoints.checkpoint import list_checkpoints  # noqa: E402
from hspmd_sdk.runtime import launch  # noqa: E402
from hspmd_sdk.runtime.control.train import start_runs, training_run  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
IO_ENTRY = "benchmarks.bench_checkpoint:io_entry"

#: (a): 13.6 M parameters, 164 MB of training state (parameters + 2 Adam moments, fp32)
IO_MODEL = LlamaConfig(name="bench-io", vocab_size=256, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=8,
                       ffn_hidden_size=1536, max_seq_len=128)
#: (b), (c): the runtime benchmarks' model (bench_runtime.py)
STEP_MODEL = LlamaConfig(name="bench", vocab_size=256, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8,
                         ffn_hidden_size=768, max_seq_len=128)
SEQ, B, SEED = 128, 8, 0


def pipe(stages: list[tuple[list[int], list[int]]], mbs: int, n: int) -> dict[str, Any]:
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": mbs,
            "num_micro_batches": n}


def program_of(model: Any, data: Mapping[str, Any], world: int) -> Any:
    cluster = Cluster.local(world)
    return specialize(model, plan_from_strategy(model, Strategy.load(dict(data)), cluster), cluster)


DP2_TP2 = {"pipelines": [pipe([([0, 1], [0, 3])], 4, 1), pipe([([2, 3], [0, 3])], 4, 1)]}
TP4 = {"pipelines": [pipe([([0, 1, 2, 3], [0, 3])], 8, 1)]}


def load() -> str:
    return open("/proc/loadavg").read().split(" ", 3)[:3].__str__()


def med(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


# ---- (a) I/O against torch.save/torch.load and DCP (worker side) ---------------------------------------------
def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dtensors(program: Any, rank: int, local: Mapping[str, Any], mesh: Any, dp_axis: bool) -> dict[str, Any]:
    """The local shards as DTensors: Shard(d) along the dim the annotation splits, Replicate elsewhere."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hspmd_sdk.core.annotation import local_view

    layouts = program.state_layouts()
    out = {}
    for name, t in local.items():
        lay = layouts[name]
        box = local_view(lay.annotation, lay.shape, rank).box
        split = [d for d, (a, b) in enumerate(box) if (a, b) != (0, lay.shape[d])]
        tp = Shard(split[0]) if split else Replicate()
        placements = [Replicate(), tp] if dp_axis else [tp]
        out[name] = DTensor.from_local(t, mesh, placements, run_check=False, shape=lay.shape,
                                       stride=_contiguous_stride(lay.shape))
    return out


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def _seeded_shard(program: Any, name: str, rank: int) -> Any:
    """This rank's box of a random tensor seeded by its name (replicas hold equal values)."""
    import zlib

    import torch

    from hspmd_sdk.core.annotation import local_view

    lay = program.state_layouts()[name]
    full = torch.rand(lay.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return full[local_view(lay.annotation, lay.shape, rank).slices].clone()


def io_entry(state: Any, spec: Any) -> dict[str, Any]:
    """Worker entry of (a): the contestants round after round on this rank's shards."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from hspmd_sdk.models.registry import model_from_class
    from hspmd_sdk.runtime.checkpoints.checkpoint import load_checkpoint, resume_payload
    from hspmd_sdk.runtime.workers.checkpoint_worker import CheckpointSaver, load_resume
    from hspmd_sdk.runtime.workers.params import init_local_parameters

    p = spec.payload
    model = model_from_class(p["model_class"], p["model"])
    rank, root = state.rank, Path(p["dir"])
    prog = program_of(model, p["strategy"], spec.world_size)
    prog_b = program_of(model, p["reshard"], spec.world_size)
    params = init_local_parameters(prog, rank, SEED)
    moments = {n: {k: _seeded_shard(prog, f"{n}.{k}", rank) for k in ("exp_avg", "exp_avg_sq")} for n in params}
    shim = SimpleNamespace(params=params, optimizer_state=lambda: {n: {**m, "step": 1.0} for n, m in moments.items()})
    local = {n: t.detach() for n, t in params.items()}
    local.update({f"{n}.{k}": v for n, m in moments.items() for k, v in m.items()})
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh_b = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    sd = _dtensors(prog, rank, local, mesh, dp_axis=True)
    run = dict(p["run"])
    times: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    phases: list[dict[str, Any]] = []
    contestants = ["ours save", "torch.save same bytes", "torch.save per-rank shards", "DCP save"]
    for rnd in range(int(p["rounds"])):
        step = rnd + 1
        saver = CheckpointSaver(state, run, index=rnd)
        mine = saver.pieces(prog, shim)  # the pieces this rank writes for us: "the same bytes"
        rdir = root / f"torch-{rnd}"
        rdir.mkdir(parents=True, exist_ok=True)
        dcp_dir = root / f"dcp-{rnd}"

        def ours_save() -> None:
            saver.after_step(step, last=True, program=prog, ex=shim)
            phases.append(saver.close()["saved"][-1])

        def torch_same() -> None:
            path = rdir / f"same-{rank}.pt"
            torch.save(dict(mine), path)
            _fsync(path)

        def torch_full() -> None:
            path = rdir / f"full-{rank}.pt"
            torch.save(local, path)
            _fsync(path)

        def dcp_save() -> None:
            dcp.save(sd, checkpoint_id=str(dcp_dir))

        fns = dict(zip(contestants, (ours_save, torch_same, torch_full, dcp_save)))
        order = contestants[rnd % 4:] + contestants[:rnd % 4]
        for name in order:
            times.setdefault(name, []).append(_timed(fns[name]))
        # loads (same layout, then TP4), in a rotating order too
        payload = resume_payload(load_checkpoint(root / "ours", verify=False))
        target = {n: torch.empty_like(t.to_local()) for n, t in sd.items()}
        sd_target = _dtensors(prog, rank, target, mesh, dp_axis=True)
        prog_b_local = {}
        for name, lay in prog_b.state_layouts().items():
            from hspmd_sdk.core.annotation import local_view
            from hspmd_sdk.core.slices import box_shape

            prog_b_local[name] = torch.empty(box_shape(local_view(lay.annotation, lay.shape, rank).box))
        sd_b = _dtensors(prog_b, rank, prog_b_local, mesh_b, dp_axis=False)
        got: dict[str, Any] = {}

        def ours_load() -> None:
            got["ours"] = load_resume(payload, prog, rank)

        def torch_load() -> None:
            got["torch"] = torch.load(rdir / f"full-{rank}.pt")

        def dcp_load() -> None:
            dcp.load(sd_target, checkpoint_id=str(dcp_dir))

        def ours_reshard() -> None:
            got["ours_b"] = load_resume(payload, prog_b, rank)

        def dcp_reshard() -> None:
            dcp.load(sd_b, checkpoint_id=str(dcp_dir))

        loads = {"ours load": ours_load, "torch.load per-rank shards": torch_load, "DCP load": dcp_load,
                 "ours load TP4 (reshard)": ours_reshard, "DCP load TP4 (reshard)": dcp_reshard}
        names = list(loads)
        for name in names[rnd % 5:] + names[:rnd % 5]:
            times.setdefault(name, []).append(_timed(loads[name]))
        # the loads are right (every contestant read what was saved)
        for n, t in got["torch"].items():
            assert torch.equal(t, local[n]), n
        for n, t in sd_target.items():
            assert torch.equal(t.to_local(), local[n]), n
        params_b, opt_b, _ = got["ours_b"]
        for n, t in params_b.items():
            assert torch.equal(t.detach(), sd_b[n].to_local()), n
        sizes = {"ours written": sum(f.stat().st_size for f in (root / "ours").glob("step-*/*.safetensors")),
                 "torch.save same bytes": sum(f.stat().st_size for f in rdir.glob("same-*.pt")),
                 "torch.save per-rank shards": sum(f.stat().st_size for f in rdir.glob("full-*.pt")),
                 "DCP written": sum(f.stat().st_size for f in dcp_dir.glob("*.distcp")),
                 "rank shard bytes": sum(t.numel() * 4 for t in local.values())}
        dist.barrier()
        if rank == 0:
            shutil.rmtree(rdir, ignore_errors=True)
            shutil.rmtree(dcp_dir, ignore_errors=True)
        dist.barrier()
    return {"times": times, "sizes": sizes, "phases": phases}


def io_part(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    cluster = Cluster.local(4)
    prog = program_of(IO_MODEL, DP2_TP2, 4)
    run = training_run(prog, steps=1, seed=SEED, seq_len=SEQ, cluster=cluster, checkpoint_dir=directory / "ours",
                       keep=1, checkpoint_async=False)
    from hspmd_sdk.core.model_spec import model_json
    from hspmd_sdk.models.registry import class_path

    payload = {"model": model_json(IO_MODEL), "model_class": class_path(IO_MODEL), "strategy": DP2_TP2,
               "reshard": TP4, "dir": str(directory), "rounds": 3 if args.quick else 5, "run": run}
    before = load()
    res = launch(None, cluster, steps=1, entry=IO_ENTRY, payload=payload, timeout_s=900).wait()
    per_rank = [r["times"] for r in res.results.values()]
    times = {k: [max(rt[k][i] for rt in per_rank) for i in range(len(per_rank[0][k]))] for k in per_rank[0]}
    sizes = {k: sum(r["sizes"][k] for r in res.results.values()) if k == "rank shard bytes"
             else res.results[0]["sizes"][k] for k in res.results[0]["sizes"]}
    medians = {k: med(v) for k, v in times.items()}
    state_bytes = 3 * 4 * IO_MODEL.param_count()
    out = {"model": IO_MODEL.model_dump(), "state_bytes": state_bytes, "sizes": sizes, "times": times,
           "ours_save_phases": {r: res.results[r]["phases"] for r in res.results},
           "median_s": medians, "load_before": before, "load_after": load(),
           "ratios": {"save: ours / torch.save same bytes": medians["ours save"] / medians["torch.save same bytes"],
                      "save: ours / torch.save per-rank shards": medians["ours save"]
                      / medians["torch.save per-rank shards"],
                      "save: ours / DCP": medians["ours save"] / medians["DCP save"],
                      "load: ours / torch.load (same bytes)": medians["ours load"]
                      / medians["torch.load per-rank shards"],
                      "load: ours / DCP": medians["ours load"] / medians["DCP load"],
                      "reshard load TP4: ours / DCP": medians["ours load TP4 (reshard)"]
                      / medians["DCP load TP4 (reshard)"]},
           "throughput_GBps": {"ours save (state bytes / s)": state_bytes / medians["ours save"] / 1e9,
                               "DCP save (state bytes / s)": state_bytes / medians["DCP save"] / 1e9,
                               "ours load (bytes read / s)": sizes["rank shard bytes"] / medians["ours load"] / 1e9,
                               "torch.load (bytes read / s)": sizes["rank shard bytes"]
                               / medians["torch.load per-rank shards"] / 1e9}}
    return out


# ---- (b) how long saving stalls training ---------------------------------------------------------------------
def stall_part(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    cluster = Cluster.local(2)
    prog = program_of(STEP_MODEL, {"pipelines": [pipe([([0], [0, 3])], 4, 1), pipe([([1], [0, 3])], 4, 1)]}, 2)
    steps = 6 if args.quick else 12
    modes = ["none", "loop", "background", "background", "loop", "none"]
    runs = []
    for i, mode in enumerate(modes):
        extra = {} if mode == "none" else {"checkpoint_dir": directory / f"stall-{i}", "checkpoint_every": 1,
                                           "keep": 1, "checkpoint_async": mode == "background"}
        runs.append(training_run(prog, steps=steps, seed=SEED, seq_len=SEQ, cluster=cluster, **extra))
    before = load()
    res = start_runs(runs, cluster, timeout_s=900).wait()
    step_times: dict[str, list[float]] = {m: [] for m in modes}
    blocked: dict[str, list[float]] = {m: [] for m in modes}
    written: dict[str, list[float]] = {m: [] for m in modes}
    for i, mode in enumerate(modes):
        per_rank = {r: [m.step_time for m in res.metrics[r] if m.extra.get("run") == i][1:]  # first: warm-up
                    for r in res.metrics}
        step_times[mode] += [max(ts) for ts in zip(*per_rank.values())]
        if mode != "none":
            for r, out in res.results.items():
                saved = out["runs"][i]["checkpoint"]["saved"]
                blocked[mode] += [s["blocked_s"] for s in saved]
                written[mode] += [s["write_s"] for s in saved if s["write_s"] is not None]
    state_bytes = 3 * 4 * STEP_MODEL.param_count()
    med_step = {m: med(v) for m, v in step_times.items()}
    return {"state_bytes": state_bytes, "steps_per_run": steps, "median_step_s": med_step,
            "median_blocked_s": {m: med(blocked[m]) for m in ("loop", "background")},
            "median_write_s": {m: med(written[m]) for m in ("loop", "background")},
            "stall_per_step_s": {m: med_step[m] - med_step["none"] for m in ("loop", "background")},
            "load_before": before, "load_after": load()}


# ---- (c) checkpoint and restart --------------------------------------------------------------------------------
def restart(program_a: Any, cluster_a: Any, program_b: Any, cluster_b: Any, root: Path, *, save_at: int = 2,
            seed: int = SEED, seq_len: int = SEQ, timeout_s: float = 300.0,
            transport: Any = None) -> dict[str, float]:
    """The checkpoint-and-restart path, timed: train ``program_a`` until the checkpoint of step ``save_at`` is
    committed in ``root``, kill every worker, relaunch ``program_b`` on ``cluster_b`` resuming from it, until its
    first step is done.  Seconds: ``kill`` (cancel until every worker is gone), ``check`` (the launcher opens and
    verifies the checkpoint and builds the run), ``start`` (process start, rendezvous, specialization: the rest
    until the first step began), ``load`` (the slowest rank reading its shards), ``first_step`` (its step time),
    ``total`` (relaunch to first step done; ``kill`` not included).  ``transport``: a factory of the transport
    of both launches (default: local processes, forked from the fork server)."""
    from hspmd_sdk.runtime.control.train import launch

    extra = {} if transport is None else {"transport": transport()}
    job = launch(program_a, cluster_a, steps=save_at + 1000, seed=seed, seq_len=seq_len,
                          checkpoint_dir=root, checkpoint_every=save_at, timeout_s=timeout_s, **extra)
    deadline = time.monotonic() + timeout_s
    while not any(s >= save_at for s, _ in list_checkpoints(root)):
        if time.monotonic() > deadline:
            job.cancel()
            raise TimeoutError("no checkpoint committed")
        time.sleep(0.01)
    t0 = time.perf_counter()
    job.cancel()
    kill = time.perf_counter() - t0
    t0 = time.perf_counter()
    run = training_run(program_b, steps=save_at + 1, seed=seed, seq_len=seq_len, cluster=cluster_b,
                       resume_from=root)
    check = time.perf_counter() - t0
    job = start_runs([run], cluster_b, timeout_s=timeout_s,
                      **({} if transport is None else {"transport": transport()}))
    while job.metrics.last_step() < 0:
        time.sleep(0.002)
    total = time.perf_counter() - t0
    res = job.wait()
    load_s = max(r["runs"][0]["resumed"]["seconds"] for r in res.results.values() if r["runs"][0].get("resumed"))
    first = max(ms[0].step_time for ms in res.metrics.values() if ms)
    return {"kill": kill, "check": check, "start": total - check - load_s - first, "load": load_s,
            "first_step": first, "total": total}


def fresh_start(program: Any, cluster: Any, *, seed: int = SEED, seq_len: int = SEQ) -> float:
    """Seconds from launching ``program`` (no checkpoint) until its first step is done."""
    from hspmd_sdk.runtime.control.train import launch

    t0 = time.perf_counter()
    job = launch(program, cluster, steps=1, seed=seed, seq_len=seq_len)
    while job.metrics.last_step() < 0:
        time.sleep(0.002)
    total = time.perf_counter() - t0
    job.wait()
    return total


def restart_part(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    four, three = Cluster.local(4), Cluster.local(3)
    pa = pb_same = program_of(STEP_MODEL, DP2_TP2, 4)
    hetero = {"pipelines": [pipe([([0, 1], [0, 1]), ([2], [2, 3])], 2, 4)]}  # TP2 -> TP1 stages
    pb_other = program_of(STEP_MODEL, hetero, 3)
    rounds = 1 if args.quick else 3
    out: dict[str, Any] = {"load_before": load(), "rounds": []}
    for i in range(rounds):
        r = {"same plan, 4 ranks": restart(pa, four, pb_same, four, directory / f"restart-same-{i}"),
             "TP2->TP1 pipeline, 3 ranks": restart(pa, four, pb_other, three, directory / f"restart-other-{i}"),
             "fresh start, 4 ranks (no checkpoint)": fresh_start(pb_same, four),
             "fresh start, 3 ranks (no checkpoint)": fresh_start(pb_other, three)}
        out["rounds"].append(r)
    keys = [k for k in out["rounds"][0] if k.startswith(("same", "TP2"))]
    out["median"] = {k: {f: med([r[k][f] for r in out["rounds"]]) for f in out["rounds"][0][k]} for k in keys}
    out["median"].update({k: med([r[k] for r in out["rounds"]]) for k in out["rounds"][0] if k.startswith("fresh")})
    out["load_after"] = load()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="a,b,c")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--out", default=str(RESULTS / "checkpoint.json"))
    args = p.parse_args(argv)
    parts = set(args.only.split(","))
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hspmd-bench-ckpt-"))
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cpus": os.cpu_count(),
                           "dir": str(directory)}
    try:
        if "a" in parts:
            out["a_io"] = io_part(args, directory / "io")
            print(json.dumps(out["a_io"]["median_s"], indent=1), json.dumps(out["a_io"]["ratios"], indent=1))
        if "b" in parts:
            out["b_stall"] = stall_part(args, directory / "stall")
            print(json.dumps(out["b_stall"], indent=1))
        if "c" in parts:
            out["c_restart"] = restart_part(args, directory / "restart")
            print(json.dumps(out["c_restart"]["median"], indent=1))
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
