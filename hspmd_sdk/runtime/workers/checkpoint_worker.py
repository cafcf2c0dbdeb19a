"""The worker side of checkpoints: saving after training steps, and reading the shards a resume needs.

:class:`CheckpointSaver` (one per run and worker) saves after every ``every``-th step and after the last.  At the
step boundary it takes a *snapshot* of the pieces this rank writes (:func:`~.checkpoint_plan.write_plan`: copies
of those slices of its parameters and Adam moments, its RNG state, Adam's step count); with ``async`` (the
default) a background thread then writes them while training goes on, so the step stalls only for the copies.
One checkpoint is in flight at a time: the next one (or the end of the run) waits for it.

Coordination uses no collective (a background thread must not interleave with the training's collectives): each
rank announces its written file on the job's rendezvous store (:mod:`.store`) through a client of its own (key
``hspmd-ckpt/<job>.<run>.<generation>/<step>/<rank>``: file size, pieces' offsets and CRC-32s); rank 0 waits for every writer, writes
the manifest and renames the directory (:mod:`.checkpoint` describes the layout and the commit).

:func:`load_resume` reads, on one rank of the new program, every tensor it holds: the read plan's intersections of
its boxes with the stored pieces, nothing else (``bytes_read`` counts them; ``os_read_bytes`` is the kernel's count
of the same thread's reads, where Linux gives it).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ...core.annotation import local_view
from ...core.slices import relative
from ..checkpoints.checkpoint import (MANIFEST, DataPosition, FileEntry, Manifest, Piece, TensorEntry, data_identity,
                         list_checkpoints, seal_manifest, shard_file_name, step_dir_name, stored_pieces)
from ..checkpoints.checkpoint_io import (WRITE_POINTS, CheckpointError, PieceReader, StoredPiece, atomic_write_bytes,
                            fsync_dir, write_shard)
from ..checkpoints.checkpoint_plan import layouts_of, read_plan, write_plan
from .liveness import CommFailure, waits
from ...core.model_spec import model_json
from ..protocol import adam_json, training_of

if TYPE_CHECKING:
    import torch

    from ...core.slices import Box
    from ...core.specialize import Program, StateLayout
    from ..checkpoints.checkpoint_io import Point
    from ..checkpoints.checkpoint_plan import Layout
    from .executor import StepExecutor
    from .store import RendezvousStore
    from .worker import WorkerState

__all__ = ["CheckpointSaver", "load_resume", "restore_rng"]

_POLL_S = 0.005
_LEFTOVER = re.compile(r"^\.(?:tmp|old)-step-(\d+)-(.+)$")


def _key(name: str, i: int) -> str:
    return f"{name}@{i}"


@dataclass(frozen=True)
class _Target:
    """What one checkpoint is taken of: the running Program and executor, this process's rank and world then (a
    graph switch or an elastic reconfiguration changes them), and the write plan of that Program."""

    program: "Program"
    ex: "StepExecutor | None"
    rank: int
    world: int
    token: str                                   # names the store keys and the temporary directory
    layouts: Mapping[str, "Layout"]
    state_layouts: Mapping[str, "StateLayout"]
    plan: Mapping[str, list[tuple[int, "Box"]]]
    abandoned: threading.Event                   # set when a failure makes this checkpoint impossible

    @property
    def writers(self) -> list[int]:
        """Ranks that write a file: every rank of the Program (its pieces and its RNG state)."""
        return sorted(self.program.ranks)

    def mine(self) -> list[tuple[str, int, "Box"]]:
        return [(name, i, box) for name, pieces in self.plan.items() for i, (r, box) in enumerate(pieces)
                if r == self.rank]


class _Abandoned(Exception):
    """The checkpoint in flight was given up (a peer failed): not an error of the run."""


class CheckpointSaver:
    """Saves the running Program's training state from this worker after steps (see the module docstring).

    ``run["checkpoint"]``: ``{"dir", "every", "keep", "async"}``; ``index``: the run's place in the job.  The
    Program and executor are passed at each save (``ex`` ``None`` on a rank that sits the Program out: it writes
    nothing, but rank 0 always commits), so a checkpoint after a graph switch is one of the new Program.
    ``run["faults"]`` entries ``{"rank", "step", "at"}`` with ``at`` one of
    :data:`~.checkpoint_io.WRITE_POINTS` (tests) SIGKILL this process at that point of the checkpoint of step
    ``step``."""

    def __init__(self, state: "WorkerState", run: Mapping[str, Any], index: int = 0) -> None:
        opts = run["checkpoint"]
        self.root = Path(opts["dir"])
        self.every, self.keep, self.async_ = int(opts["every"]), int(opts["keep"]), bool(opts["async"])
        self.state, self.run, self.index = state, run, index
        self.job_id = state.spec.job_id
        resumed = (run.get("resume") or {}).get("job_id")  # the training this run continues: its checkpoints too
        self.lineage = {self.job_id, *([resumed] if resumed else [])}  # are ours to prune; never another job's
        launch_rank = getattr(state, "launch_rank", state.rank)
        self.faults = [f for f in run.get("faults") or () if f.get("at") in WRITE_POINTS
                       and int(f["rank"]) == launch_rank]
        self._plans: dict[int, tuple[Any, Any, Any, Any]] = {}
        self._store: Any = None
        self._store_at: tuple[str, int] | None = None
        self._thread: threading.Thread | None = None
        self._pruner: threading.Thread | None = None
        self._error: BaseException | None = None
        self._current: _Target | None = None
        self.saved: list[dict[str, Any]] = []
        #: save after the next step whatever ``every`` says: a failure interrupted the last checkpoint's write
        #: (the launcher decides, in its reconfiguration: every rank gets the same)
        self.retake = False

    # ---- the training loop's calls ---------------------------------------------------------------------
    def after_step(self, completed: int, *, last: bool, program: "Program", ex: "StepExecutor | None",
                   generation: int = 0) -> None:
        """Save ``program``'s state if ``completed`` (steps done) is a multiple of ``every``, this was the last
        step or :attr:`retake` is set.  ``generation``: the job's reconfiguration count (the same on every rank), so
        that a checkpoint given up in a failure and its redo never share names."""
        if completed % self.every and not last and not self.retake:
            return
        self.retake = False
        t0 = time.perf_counter()
        self.wait()
        target = self._current = self._target(program, ex, generation)
        items, opt_step = self.snapshot(target, copy=self.async_)
        record = {"step": completed, "blocked_s": 0.0, "write_s": None}
        self.saved.append(record)
        if self.async_:
            self._thread = threading.Thread(target=self._write_guarded,
                                            args=(target, completed, items, opt_step, record),
                                            name=f"hspmd-checkpoint-{completed}", daemon=True)
            self._thread.start()
        else:
            self._write_guarded(target, completed, items, opt_step, record)
            self._raise()
        record["blocked_s"] = round(time.perf_counter() - t0, 6)

    def abandon(self) -> None:
        """Give up the checkpoint in flight (a peer failed: it can never complete); the previous checkpoint stays
        the latest.  The next save goes on normally."""
        if self._current is not None:
            self._current.abandoned.set()  # its thread stops at its next point; nobody waits for it
        self._thread, self._pruner, self._error = None, None, None
        self._store, self._store_at = None, None  # the world is re-formed: a new rendezvous

    @waits
    def wait(self) -> None:
        """Wait for the checkpoint in flight (and the pruning after it); re-raise its error here (the training
        loop's thread).  A wait for peers (their records), as :meth:`_collect`: never the culprit of a stall."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None
        self._raise()

    def _raise(self) -> None:
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
    def _target(self, program: "Program", ex: "StepExecutor | None", generation: int) -> _Target:
        got = self._plans.get(id(program))
        if got is None or got[0] is not program:
            layouts = layouts_of(program)
            got = self._plans[id(program)] = (program, layouts, program.state_layouts(), write_plan(layouts))
        _, layouts, state_layouts, plan = got
        return _Target(program, ex, self.state.rank, self.state.world_size,
                       f"{self.job_id}.{self.index}.{generation}", layouts, state_layouts, plan, threading.Event())

    def pieces(self, program: "Program", ex: "StepExecutor | None") -> list[tuple[str, "torch.Tensor"]]:
        """The ``(key, tensor)`` pieces this rank writes for ``program`` (views, its RNG state last)."""
        return self.snapshot(self._target(program, ex, 0), copy=False)[0]

    def snapshot(self, target: _Target, *, copy: bool) -> tuple[list[tuple[str, "torch.Tensor"]], int | None]:
        """``(items, Adam's step count)``: this rank's pieces as ``(key, tensor)`` — copies with ``copy`` (they are
        written while training goes on), else views — and its RNG state."""
        import torch

        ex, rank = target.ex, target.rank
        if ex is None:
            return [], None
        opt = ex.optimizer_state()
        steps = {st["step"] for st in opt.values() if st}
        if len(steps) > 1:
            raise CheckpointError(f"rank {rank}: Adam's step counts differ between parameters ({sorted(steps)})")
        items = []
        for name, i, box in target.mine():
            layout = target.state_layouts[name]
            local = _local(ex, rank, layout, opt)
            held = local_view(layout.annotation, layout.shape, rank).box
            t = local.detach()[relative(box, held)]
            items.append((_key(name, i), t.to("cpu", copy=True).contiguous() if copy else t.cpu().contiguous()))
        items.append((f"__rng__/{rank}", torch.get_rng_state()))
        if torch.cuda.is_available() and getattr(self.state.device, "type", "cpu") == "cuda":
            items.append((f"__rng__/{rank}:cuda", torch.cuda.get_rng_state(self.state.device)))
        return items, int(steps.pop()) if steps else 0

    # ---- writing (maybe in the background) ----------------------------------------------------------------
    def _write_guarded(self, target: _Target, completed: int, items: list[tuple[str, "torch.Tensor"]],
                       opt_step: int | None, record: dict[str, Any]) -> None:
        try:
            self._write(target, completed, items, opt_step, record)
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by wait()
            if not target.abandoned.is_set():  # a given-up checkpoint's failure is no error of the run
                self._error = e
            record["abandoned"] = target.abandoned.is_set()

    def _point(self, target: _Target, completed: int) -> "Point":
        faults = [f for f in self.faults if int(f["step"]) == completed]

        def point(name: str) -> None:
            if any(f["at"] == name for f in faults):
                os.kill(os.getpid(), signal.SIGKILL)
            if target.abandoned.is_set():
                raise _Abandoned
        return point

    def _write(self, target: _Target, completed: int, items: list[tuple[str, "torch.Tensor"]], opt_step: int | None,
               record: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        tmp = self.root / f".tmp-{step_dir_name(completed)}-{target.token}"
        # only a writer (before it reports its shard) and rank 0 (which renames the folder once every writer
        # reported) make the folder: a rank writing nothing could make it while rank 0 renames it, and mkdir
        # then raises FileExistsError (the random reconfiguration sweep met it), or leave an empty one behind
        if target.rank in target.writers or target.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        point = self._point(target, completed)
        mine = None
        if target.rank in target.writers:
            fname = shard_file_name(target.rank)
            size, written = write_shard(tmp / fname, items, point=point)
            record["shard_s"] = round(time.perf_counter() - t0, 6)
            mine = {"file": fname, "bytes": size, "optimizer_step": opt_step,
                    "pieces": {w.key: [w.offset, w.nbytes, w.crc32] for w in written}}
            if target.rank != 0:
                self._client().set(f"hspmd-ckpt/{target.token}/{completed}/{target.rank}", json.dumps(mine))
        if target.rank == 0:
            t1 = time.perf_counter()
            self._commit(target, completed, tmp, mine, point, record)
            record["commit_s"] = round(time.perf_counter() - t1, 6)
        record["write_s"] = round(time.perf_counter() - t0, 6)

    def _client(self) -> "RendezvousStore":
        """A rendezvous-store client of this saver's own, at the job's current rendezvous (the training thread's
        client may block in a wait; after an elastic reconfiguration the rendezvous is another)."""
        from .store import RendezvousStore  # lazy: torch (store)

        spec = self.state.spec
        current = self.state.extras.get("store")
        at = (str(current.host), int(current.port)) if current is not None else \
            (spec.master_addr, int(spec.master_port))
        if self._store is None or self._store_at != at:
            if self._store is not None:
                self._store.close()
            self._store = RendezvousStore.connect(at[0], at[1], spec.secret, timedelta(seconds=spec.timeout_s))
            self._store_at = at
        return self._store

    @waits
    def _collect(self, target: _Target, completed: int, mine: Mapping[str, Any] | None
                 ) -> dict[int, Mapping[str, Any]]:
        """Every writer's record: rank 0's own, the others' from the store as they arrive.  A wait for peers:
        fault detection counts rank 0 here among the waiters (``@waits``), and when the launcher says a peer of
        this world died (``WorkerState.peer_failed``) the wait ends with :class:`~.liveness.CommFailure` (a
        synchronous checkpoint: the training thread then halts like its peers)."""
        out: dict[int, Mapping[str, Any]] = {0: mine} if mine is not None else {}
        waiting = [r for r in target.writers if r not in out]
        deadline = time.monotonic() + float(self.state.spec.timeout_s)
        while waiting:
            if target.abandoned.is_set():
                raise _Abandoned
            if self.state.peer_failed():
                raise CommFailure(f"checkpoint of step {completed}: a peer of this world died while rank 0 waited "
                                  f"for the shards of rank(s) {waiting}")
            store = self._client()
            for r in waiting:
                key = f"hspmd-ckpt/{target.token}/{completed}/{r}"
                if store.check([key]):
                    out[r] = json.loads(store.get(key))
            waiting = [r for r in waiting if r not in out]
            if waiting:
                if time.monotonic() > deadline:
                    raise CheckpointError(f"checkpoint of step {completed}: rank(s) {waiting} did not finish writing "
                                          f"their shards within {self.state.spec.timeout_s} s")
                time.sleep(_POLL_S)
        return out

    def _commit(self, target: _Target, completed: int, tmp: Path, mine: Mapping[str, Any] | None, point: "Point",
                timing: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        records = self._collect(target, completed, mine)
        timing["wait_s"] = round(time.perf_counter() - t0, 6)
        manifest = self._manifest(target, completed, records)
        atomic_write_bytes(tmp / MANIFEST, manifest.model_dump_json(indent=1).encode(), point=point,
                           point_name="manifest-partial")
        fsync_dir(tmp)
        point("before-commit")
        final = self.root / step_dir_name(completed)
        if final.exists():  # e.g. resumed from an older step into the same root: replace it
            old = self.root / f".old-{final.name}-{target.token}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(self.root)
        point("before-prune")
        self._pruner = threading.Thread(target=self._prune, args=(completed, timing), name="hspmd-checkpoint-prune",
                                        daemon=True)
        self._pruner.start()

    def _prune(self, committed: int, timing: dict[str, Any]) -> None:
        """Keep the newest ``keep`` checkpoints of this training (written by this job or by the job it resumed
        from: the manifest's ``job_id``; another job's are never touched); remove what interrupted writes of this
        training left: the resumed job's temporary directories, and this job's of steps up to the one just
        committed (given up in a failure)."""
        t0 = time.perf_counter()
        ours = [path for _, path in list_checkpoints(self.root) if _written_by(path) in self.lineage]
        for path in ours[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        for p in self.root.iterdir():
            m = _LEFTOVER.match(p.name)
            owner = next((j for j in self.lineage if m.group(2).startswith(f"{j}.")), None) if m else None
            if owner is not None and (owner != self.job_id or int(m.group(1)) <= committed):
                shutil.rmtree(p, ignore_errors=True)
        timing["prune_s"] = round(time.perf_counter() - t0, 6)

    def _manifest(self, target: _Target, completed: int, records: Mapping[int, Mapping[str, Any]]) -> Manifest:
        run, program = self.run, target.program
        steps = {rec["optimizer_step"] for rec in records.values() if rec.get("optimizer_step") is not None}
        if len(steps) != 1:
            raise CheckpointError(f"checkpoint of step {completed}: ranks report Adam step counts {sorted(steps)}")
        tensors = {}
        for name, pieces in target.plan.items():
            layout, sl = target.layouts[name], target.state_layouts[name]
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
        return seal_manifest(Manifest(
            step=completed, job_id=self.job_id, world_size=target.world, model=model_json(program.model),
            model_class=run.get("model_class"), plan=program.plan.model_dump(mode="json"),
            cluster=program.cluster.model_dump(mode="json") if program.cluster is not None else run["cluster"],
            bindings={k: int(v) for k, v in run.get("bindings", {}).items()}, pipelines=program.pipelines,
            adam=adam_json(training_of(run)), optimizer_step=steps.pop(),
            data=_position(run, completed),
            tensors=tensors, files={rec["file"]: FileEntry(rank=r, bytes=rec["bytes"]) for r, rec in records.items()},
            rng=rng))


def _written_by(path: Path) -> str | None:
    """The ``job_id`` of the checkpoint ``path`` (``None`` if its manifest cannot be read: not ours to remove)."""
    try:
        return str(json.loads((path / MANIFEST).read_text()).get("job_id"))
    except (OSError, ValueError, AttributeError):
        return None


def _position(run: Mapping[str, Any], completed: int) -> DataPosition:
    source, batch, seq = data_identity(run)
    return DataPosition(source=source, seed=int(run["seed"]), global_batch=batch, seq_len=seq, next_step=completed)


def _local(ex: "StepExecutor", rank: int, layout: "StateLayout", opt: Mapping[str, Any]) -> "torch.Tensor":
    """The local tensor of ``layout`` (a parameter or one of its Adam moments) on this rank."""
    if layout.param not in ex.params:
        raise CheckpointError(f"rank {rank}: the write plan gives it {layout.name!r}, which it does not hold")
    if layout.kind == "param":
        return ex.params[layout.param]
    st = opt.get(layout.param) or {}
    if layout.kind not in st:
        raise CheckpointError(f"rank {rank}: parameter {layout.param!r} has no Adam {layout.kind} to save "
                              "(it never received a gradient)")
    return st[layout.kind]


# ---- resuming -------------------------------------------------------------------------------------------------
def load_resume(resume: Mapping[str, Any], program: "Program", rank: int
                ) -> tuple[dict[str, "torch.Tensor"], dict[str, dict[str, Any]], dict[str, Any]]:
    """``(params, optimizer_state, stats)`` of ``rank`` under ``program`` from the checkpoint ``resume``
    (:func:`~.checkpoint.resume_payload`): each tensor the rank's executable graph holds, read as the
    intersections of its box with the stored pieces.  ``stats``: ``bytes_read`` (data bytes asked for),
    ``os_read_bytes`` (the kernel's count for this thread, or ``None``), ``needed_bytes`` (the read plan's),
    ``seconds``."""
    from .params import load_local_parameters  # lazy: torch (params)

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


def restore_rng(resume: Mapping[str, Any], rank: int, device: "torch.device | None" = None) -> bool:
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
