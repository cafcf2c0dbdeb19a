"""The worker side of checkpoints: saving after training steps, and reading the shards a resume needs.

:class:`CheckpointSaver` (one per run and worker) saves after every ``every``-th step and after the last.  At the
step boundary it takes a *snapshot* of the pieces this rank writes (:func:`~.checkpoint_plan.write_plan`: copies
of those slices of its parameters and Adam moments, its RNG state, Adam's step count); with ``async`` (the
default) a background thread then writes them while training goes on, so the step stalls only for the copies.
One checkpoint is in flight at a time: the next one (or the end of the run) waits for it.

Coordination uses no collective (a background thread must not interleave with the training's collectives): each
rank announces its written file on the job's TCPStore through a client of its own (key
``hspmd-ckpt/<job>.<run>/<step>/<rank>``: file size, pieces' offsets and CRC-32s); rank 0 waits for every writer, writes
the manifest and renames the directory (:mod:`.checkpoint` describes the layout and the commit).

:func:`load_resume` reads, on one rank of the new program, every tensor it holds: the read plan's intersections of
its boxes with the stored pieces, nothing else (``bytes_read`` counts them; ``os_read_bytes`` is the kernel's count
of the same thread's reads, where Linux gives it).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping

from ..core.annotation import local_view
from ..core.slices import relative
from .checkpoint import (MANIFEST, DataPosition, FileEntry, Manifest, Piece, TensorEntry, list_checkpoints,
                         shard_file_name, step_dir_name, stored_pieces)
from .checkpoint_io import (CheckpointError, PieceReader, StoredPiece, atomic_write_bytes,
                            fsync_dir, write_shard)
from .checkpoint_plan import layouts_of, read_plan, write_plan

__all__ = ["CheckpointSaver", "load_resume", "restore_rng"]

_POLL_S = 0.005


def _key(name: str, i: int) -> str:
    return f"{name}@{i}"


class CheckpointSaver:
    """Saves ``program``'s training state from this worker after steps (see the module docstring).

    ``ex``: the rank's :class:`~.executor.StepExecutor` (``None`` on a rank that sits the run out: it writes
    nothing, but rank 0 always commits).  ``run["checkpoint"]``: ``{"dir", "every", "keep", "async"}``;
    ``run["_crash"]`` (tests only): ``{"rank", "step", "point"}`` SIGKILLs this process at that write point."""

    def __init__(self, state: Any, run: Mapping[str, Any], program: Any, ex: Any, index: int = 0) -> None:
        opts = run["checkpoint"]
        self.root = Path(opts["dir"])
        self.every, self.keep, self.async_ = int(opts["every"]), int(opts["keep"]), bool(opts["async"])
        self.state, self.run, self.program, self.ex = state, run, program, ex
        self.rank, self.job_id = state.rank, state.spec.job_id
        self.token = f"{self.job_id}.{index}"  # the job's run ``index``: runs of one job never share store keys
        self.layouts = layouts_of(program)
        self.state_layouts = program.state_layouts()
        self.plan = write_plan(self.layouts)
        self.writers = sorted(program.ranks)
        self.mine = [(name, i, box) for name, pieces in self.plan.items()
                     for i, (r, box) in enumerate(pieces) if r == self.rank]
        self.crash = run.get("_crash")
        self._store = None
        self._thread: threading.Thread | None = None
        self._pruner: threading.Thread | None = None
        self._error: BaseException | None = None
        self.saved: list[dict[str, Any]] = []

    # ---- the training loop's calls ---------------------------------------------------------------------
    def after_step(self, completed: int, *, last: bool) -> None:
        """Save if ``completed`` (steps done) is a multiple of ``every`` or this was the last step."""
        if completed % self.every and not last:
            return
        t0 = time.perf_counter()
        self.wait()
        items, opt_step = self.snapshot(copy=self.async_)
        record = {"step": completed, "blocked_s": 0.0, "write_s": None}
        self.saved.append(record)
        if self.async_:
            self._thread = threading.Thread(target=self._write_guarded, args=(completed, items, opt_step, record),
                                            name=f"hspmd-checkpoint-{completed}", daemon=True)
            self._thread.start()
        else:
            self._write(completed, items, opt_step, record)
        record["blocked_s"] = round(time.perf_counter() - t0, 6)

    def wait(self) -> None:
        """Wait for the checkpoint in flight (and the pruning after it); re-raise its error here (the training
        loop's thread)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> dict[str, Any]:
        """Wait for the last checkpoint; what was saved: per checkpoint its step, the seconds the loop was blocked
        (``blocked_s``) and the write took (``write_s``; ``shard_s`` the rank's file; on rank 0 ``commit_s``, of which
        ``wait_s`` waiting for the other ranks' files) and, once pruned, ``prune_s`` (removing old checkpoints, in a
        thread of its own: deleting large files costs disk time nobody needs to wait for)."""
        self.wait()
        return {"dir": str(self.root), "saved": self.saved, "async": self.async_}

    # ---- snapshot -----------------------------------------------------------------------------------------
    def snapshot(self, *, copy: bool) -> tuple[list[tuple[str, Any]], int | None]:
        """``(items, Adam's step count)``: this rank's pieces as ``(key, tensor)`` — copies with ``copy`` (they are
        written while training goes on), else views — and its RNG state."""
        import torch

        if self.ex is None:
            return [], None
        opt = self.ex.optimizer_state()
        steps = {st["step"] for st in opt.values() if st}
        if len(steps) > 1:
            raise CheckpointError(f"rank {self.rank}: Adam's step counts differ between parameters ({sorted(steps)})")
        items = []
        for name, i, box in self.mine:
            layout = self.state_layouts[name]
            local = self._local(layout, opt)
            held = local_view(layout.annotation, layout.shape, self.rank).box
            t = local.detach()[relative(box, held)]
            items.append((_key(name, i), t.to("cpu", copy=True).contiguous() if copy else t.cpu().contiguous()))
        items.append((f"__rng__/{self.rank}", torch.get_rng_state()))
        if torch.cuda.is_available() and getattr(self.state.device, "type", "cpu") == "cuda":
            items.append((f"__rng__/{self.rank}:cuda", torch.cuda.get_rng_state(self.state.device)))
        return items, int(steps.pop()) if steps else 0

    def _local(self, layout: Any, opt: Mapping[str, Any]) -> Any:
        if layout.param not in self.ex.params:
            raise CheckpointError(f"rank {self.rank}: the write plan gives it {layout.name!r}, which it does not hold")
        if layout.kind == "param":
            return self.ex.params[layout.param]
        st = opt.get(layout.param) or {}
        if layout.kind not in st:
            raise CheckpointError(f"rank {self.rank}: parameter {layout.param!r} has no Adam {layout.kind} to save "
                                  "(it never received a gradient)")
        return st[layout.kind]

    # ---- writing (maybe in the background) ----------------------------------------------------------------
    def _write_guarded(self, completed: int, items: list[tuple[str, Any]], opt_step: int | None,
                       record: dict[str, Any]) -> None:
        try:
            self._write(completed, items, opt_step, record)
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by wait()
            self._error = e

    def _point(self, completed: int) -> Any:
        crash = self.crash

        def point(name: str) -> None:
            if crash and crash["point"] == name and int(crash["rank"]) == self.rank and int(crash["step"]) == completed:
                os.kill(os.getpid(), signal.SIGKILL)
        return point

    def _write(self, completed: int, items: list[tuple[str, Any]], opt_step: int | None,
               record: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        tmp = self.root / f".tmp-{step_dir_name(completed)}-{self.token}"
        tmp.mkdir(parents=True, exist_ok=True)
        point = self._point(completed)
        mine = None
        if self.rank in self.writers:
            fname = shard_file_name(self.rank)
            size, written = write_shard(tmp / fname, items, point=point)
            record["shard_s"] = round(time.perf_counter() - t0, 6)
            mine = {"file": fname, "bytes": size, "optimizer_step": opt_step,
                    "pieces": {w.key: [w.offset, w.nbytes, w.crc32] for w in written}}
            if self.rank != 0:
                self._announce(completed, mine)
        if self.rank == 0:
            t1 = time.perf_counter()
            self._commit(completed, tmp, mine, point, record)
            record["commit_s"] = round(time.perf_counter() - t1, 6)
        record["write_s"] = round(time.perf_counter() - t0, 6)

    def _client(self) -> Any:
        """A TCPStore client of this saver's own (the training thread's client may block in a wait)."""
        if self._store is None:
            import torch.distributed as dist

            spec = self.state.spec
            self._store = dist.TCPStore(spec.master_addr, spec.master_port, is_master=False,
                                        timeout=timedelta(seconds=spec.timeout_s))
        return self._store

    def _announce(self, completed: int, record: Mapping[str, Any]) -> None:
        self._client().set(f"hspmd-ckpt/{self.token}/{completed}/{self.rank}", json.dumps(record))

    def _collect(self, completed: int, mine: Mapping[str, Any] | None) -> dict[int, Mapping[str, Any]]:
        """Every writer's record: rank 0's own, the others' from the store as they arrive."""
        out: dict[int, Mapping[str, Any]] = {0: mine} if mine is not None else {}
        waiting = [r for r in self.writers if r not in out]
        deadline = time.monotonic() + float(self.state.spec.timeout_s)
        while waiting:
            store = self._client()
            keys = {r: f"hspmd-ckpt/{self.token}/{completed}/{r}" for r in waiting}
            for r, k in keys.items():
                if store.check([k]):
                    out[r] = json.loads(store.get(k))
            waiting = [r for r in waiting if r not in out]
            if waiting:
                if time.monotonic() > deadline:
                    raise CheckpointError(f"checkpoint of step {completed}: rank(s) {waiting} did not finish writing "
                                          f"their shards within {self.state.spec.timeout_s} s")
                time.sleep(_POLL_S)
        return out

    def _commit(self, completed: int, tmp: Path, mine: Mapping[str, Any] | None, point: Any,
                timing: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        records = self._collect(completed, mine)
        timing["wait_s"] = round(time.perf_counter() - t0, 6)
        manifest = self._manifest(completed, records)
        atomic_write_bytes(tmp / MANIFEST, manifest.model_dump_json(indent=1).encode(), point=point,
                           point_name="manifest-partial")
        fsync_dir(tmp)
        point("before-commit")
        final = self.root / step_dir_name(completed)
        if final.exists():  # e.g. resumed from an older step into the same root: replace it
            old = self.root / f".old-{final.name}-{self.token}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(self.root)
        point("before-prune")
        self._pruner = threading.Thread(target=self._prune, args=(timing,), name="hspmd-checkpoint-prune",
                                        daemon=True)
        self._pruner.start()

    def _prune(self, timing: dict[str, Any]) -> None:
        """Keep the newest ``keep`` checkpoints; remove what crashed writes of other jobs left."""
        t0 = time.perf_counter()
        for _, path in list_checkpoints(self.root)[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        for p in self.root.iterdir():
            if p.name.startswith((".tmp-", ".old-")) and f"-{self.job_id}." not in p.name:
                shutil.rmtree(p, ignore_errors=True)
        timing["prune_s"] = round(time.perf_counter() - t0, 6)

    def _manifest(self, completed: int, records: Mapping[int, Mapping[str, Any]]) -> Manifest:
        from ..core.model_spec import model_json

        run, program = self.run, self.program
        steps = {rec["optimizer_step"] for rec in records.values() if rec.get("optimizer_step") is not None}
        if len(steps) != 1:
            raise CheckpointError(f"checkpoint of step {completed}: ranks report Adam step counts {sorted(steps)}")
        tensors = {}
        for name, pieces in self.plan.items():
            layout = self.layouts[name]
            sl = self.state_layouts[name]
            stored = []
            for i, (r, box) in enumerate(pieces):
                off, n, crc = records[r]["pieces"][_key(name, i)]
                stored.append(Piece(box=box, file=records[r]["file"], key=_key(name, i), offset=off, nbytes=n,
                                    crc32=crc))
            tensors[name] = TensorEntry(param=sl.param, kind=sl.kind, shape=layout.shape, dtype=layout.dtype,
                                        pieces=tuple(stored))
        rng = {}
        for r, rec in records.items():
            for key, (off, n, crc) in rec["pieces"].items():
                if key.startswith("__rng__/"):
                    rng[key.removeprefix("__rng__/")] = Piece(box=((0, n),), file=rec["file"], key=key, offset=off,
                                                              nbytes=n, crc32=crc)
        return Manifest(
            step=completed, job_id=self.job_id, world_size=self.state.world_size, model=model_json(program.model),
            model_class=run.get("model_class"), plan=run["plan"], cluster=run["cluster"],
            bindings={k: int(v) for k, v in run.get("bindings", {}).items()}, pipelines=program.pipelines,
            adam=dict(run["adam"]), optimizer_step=steps.pop(),
            data=DataPosition(source=run["data"], seed=int(run["seed"]), global_batch=int(run["global_batch"]),
                              seq_len=int(run["seq_len"]), next_step=completed),
            tensors=tensors, files={rec["file"]: FileEntry(rank=r, bytes=rec["bytes"]) for r, rec in records.items()},
            rng=rng)


# ---- resuming -------------------------------------------------------------------------------------------------
def load_resume(resume: Mapping[str, Any], program: Any, rank: int) -> tuple[dict[str, Any], dict[str, Any],
                                                                           dict[str, Any]]:
    """``(params, optimizer_state, stats)`` of ``rank`` under ``program`` from the checkpoint ``resume``
    (:func:`~.checkpoint.resume_payload`): each tensor the rank's executable graph holds, read as the
    intersections of its box with the stored pieces.  ``stats``: ``bytes_read`` (data bytes asked for),
    ``os_read_bytes`` (the kernel's count for this thread, or ``None``), ``needed_bytes`` (the read plan's),
    ``seconds``."""
    from .params import load_local_parameters

    t0 = time.perf_counter()
    pieces = stored_pieces(resume)
    held = set(program.executable_graph(rank).parameters)
    kinds = program.state_layouts()
    layouts = {n: l for n, l in layouts_of(program).items() if kinds[n].param in held}
    plan = read_plan(layouts, {n: [p.box for p in ps] for n, ps in pieces.items()}, rank)
    tensors: dict[str, Any] = {}
    with PieceReader(Path(resume["dir"]), count_os=True) as reader:
        for name, (box, items) in plan.items():
            tensors[name] = reader.assemble(pieces[name], items, box, tensor=name)
    params = load_local_parameters(program, rank, lambda name, shape, box: tensors[name])
    step = float(resume["optimizer_step"])
    optimizer_state = {p: {"exp_avg": tensors[f"{p}.exp_avg"], "exp_avg_sq": tensors[f"{p}.exp_avg_sq"],
                           "step": step} for p in params}
    stats = {"bytes_read": reader.bytes_read, "os_read_bytes": reader.os_bytes_read,
             "needed_bytes": sum(it.nbytes for _, items in plan.values() for it in items),
             "seconds": round(time.perf_counter() - t0, 6)}
    return params, optimizer_state, stats


def restore_rng(resume: Mapping[str, Any], rank: int, device: Any = None) -> bool:
    """Restore this rank's RNG state if the saved job had the same rank (the SDK's own randomness — data and
    initialisation — is a pure function of the seed and the step, so no plan change depends on it)."""
    import torch

    rng = resume.get("rng", {})
    if str(rank) not in rng:
        return False
    with PieceReader(Path(resume["dir"])) as reader:
        for key, (fname, off, n) in rng.items():
            r, _, kind = key.partition(":")
            if r != str(rank):
                continue
            state = reader.read(StoredPiece(fname, int(off), ((0, int(n)),), "uint8", int(n)), ((0, int(n)),))
            if kind == "cuda":
                if device is not None and getattr(device, "type", "") == "cuda":
                    torch.cuda.set_rng_state(state.clone(), device)
            else:
                torch.set_rng_state(state.clone())
    return True
