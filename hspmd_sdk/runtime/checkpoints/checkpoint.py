"""Sharded checkpoints that load under any plan and any world size, and into Hugging Face (SPEC §5).

A checkpoint root (``launch(..., checkpoint_dir=ROOT, checkpoint_every=K)``) holds one directory per saved step::

    ROOT/step-00000004/manifest.json            what is where (below)
    ROOT/step-00000004/rank00000.safetensors    the pieces rank 0 wrote (safetensors: slice-readable)
    ROOT/step-00000004/rank00001.safetensors    ...

Every rank writes its own pieces of the parameters and both Adam moments (``Program.state_layouts()`` names:
``<param>``, ``<param>.exp_avg``, ``<param>.exp_avg_sq``) and its RNG state; each element of each tensor is written
exactly once, by the least-loaded rank holding it (:func:`~.checkpoint_plan.write_plan`).  The manifest records
the model (JSON + class path), the annotation plan, cluster and pipelines, the Adam options and step count, the data
position (source, seed, global batch, sequence length, next step) and, per tensor, its shape, dtype and pieces
(box, file, absolute byte offset, size, CRC-32).

``ROOT`` must be a directory every rank can write (on several hosts: one shared filesystem, as for DCP's file system
writer).  Complete or absent: the ranks write into ``ROOT/.tmp-step-00000004-<job>/`` (each file under a temporary
name, fsync-ed, renamed); rank 0 waits until every rank has announced its file, writes the manifest the same way and
renames the directory to ``step-00000004`` (atomic), then prunes all but the newest ``keep`` of its training's own
checkpoints (the manifest's ``job_id``: this job's and those of the job it resumed from; never another job's).  A
crash at any point leaves the previous checkpoint the latest complete one.  ``ROOT`` belongs to one job at a time:
the launcher holds ``ROOT/checkpoint.lock`` while the job runs (:mod:`.checkpoint_lock`; a second job is refused
before any worker starts, a dead job's lock is taken over with :func:`break_checkpoint_lock`).

The manifest is sealed: its ``sha256`` entry holds, for every other field, the SHA-256 of the field's canonical
JSON (sorted keys, no spaces; :func:`manifest_digests`), and a manifest also agrees with itself — its directory's
name with ``step``, the data position's ``next_step`` and Adam's ``optimizer_step`` with ``step`` (each saved step is
one Adam update: a resume or a reload restores both together), each shard file's name with its rank, inside the
world.  Opening a checkpoint refuses any disagreement naming the file and the field
(:meth:`Checkpoint.check_manifest`), so an edited ``step`` or ``optimizer_step`` never resumes silently wrong.
Manifests of format version 1 (written before the seal) open with the cross-checks only, and say so.

Resuming (``launch(..., resume_from=ROOT or a step directory)``) checks the checkpoint in the launcher before any
worker starts — every file present with its recorded size, its safetensors header agreeing with the manifest,
every piece's checksum, the pieces tiling every tensor, the model, the data settings and the program's tensors
and shapes matching — and each worker then reads, for every tensor it holds under the *new* program, exactly the
intersections of its box with the stored pieces (:func:`~.checkpoint_plan.read_plan`).

Format: safetensors files + a JSON manifest, not ``torch.distributed.checkpoint``: DCP's metadata can describe
boxes (``ChunkStorageMetadata`` offsets and sizes) but its readers deserialise every overlapping stored chunk whole
before narrowing it (so a rank needing a quarter of a chunk reads all of it), its layouts come from DTensor /
ShardedTensor (a DeviceMesh cannot express a TP degree per pipeline or HDim ratios), and load needs the same
process group as save; safetensors is a maintained format whose raw row-major data makes any box a set of byte
runs, and a Hugging Face tool opens each file as it is.

:func:`load_checkpoint` opens one in a single process: ``.step``, ``.model``, ``.state_dict()``, ``.to_hf(dir)``.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError

from ...core.plan import AnnotationPlan
from ...core.slices import box_shape, format_box
from .checkpoint_io import CheckpointError, PieceReader, SAFETENSORS_DTYPE, StoredPiece, piece_crc, read_header
from .checkpoint_lock import CheckpointLocked, break_checkpoint_lock
from .checkpoint_plan import DTYPE_BYTES, ReadItem, tiling_problems
from ...core.model_spec import model_json
from ...errors import PlanValidationError
from ...models.hf import to_hf
from ...models.registry import model_from_class

if TYPE_CHECKING:
    import torch
    from ...core.model_spec import ModelSpec
    from ...core.specialize import Program

__all__ = ["load_checkpoint", "Checkpoint", "CheckpointError", "Manifest", "list_checkpoints", "resolve_checkpoint",
           "MANIFEST", "step_dir_name", "shard_file_name", "manifest_digests", "seal_manifest",
           "break_checkpoint_lock", "CheckpointLocked"]

MANIFEST = "manifest.json"
FORMAT = "hspmd-checkpoint"
VERSION = 2  #: 2: sealed (``sha256``); 1: written before the seal
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of ``step`` (steps completed): ``step-00000004``."""
    return f"step-{step:08d}"


def shard_file_name(rank: int) -> str:
    """The name of rank ``rank``'s shard file: ``rank00001.safetensors``."""
    return f"rank{rank:05d}.safetensors"


# ---- the manifest -------------------------------------------------------------------------------------------
class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Piece(_Frozen):
    """One stored piece of a tensor: its global ``box``, the ``file`` and safetensors ``key`` holding it, the
    absolute byte ``offset`` of its data in the file, its size and CRC-32."""

    box: tuple[tuple[int, int], ...]
    file: str
    key: str
    offset: int
    nbytes: int
    crc32: int


class TensorEntry(_Frozen):
    """A tensor of training state: its parameter, kind (``param``/``exp_avg``/``exp_avg_sq``), full shape, dtype and
    the pieces that tile it."""

    param: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]


class FileEntry(_Frozen):
    rank: int
    bytes: int


class DataPosition(_Frozen):
    """Where the data stream stands: the run's source, seed, global batch (samples) and sequence length, and the
    next step to read (= steps completed).  A batch is a pure function of ``(seed, step)``, so this is the whole
    data-loader state, valid under any plan."""

    source: str
    seed: int
    global_batch: int
    seq_len: int
    next_step: int


class Manifest(_Frozen):
    """What a checkpoint holds and where (``manifest.json``); ``sha256``: the seal (:func:`manifest_digests` of the
    other fields; ``None`` in a format version 1 manifest)."""

    format: Literal["hspmd-checkpoint"] = FORMAT
    version: Literal[1, 2] = VERSION
    step: int
    job_id: str
    world_size: int
    model: dict[str, Any]
    model_class: str | None
    plan: dict[str, Any]
    cluster: dict[str, Any]
    bindings: dict[str, int]
    pipelines: list[list[list[int]]]
    adam: dict[str, Any]
    optimizer_step: int
    data: DataPosition
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    rng: dict[str, Piece]
    sha256: dict[str, str] | None = None


def manifest_digests(manifest: Manifest) -> dict[str, str]:
    """Field name -> SHA-256 (hex) of the field's canonical JSON (``json.dumps`` with sorted keys and no spaces, of
    the manifest's JSON form), for every field but ``sha256``: what the seal records and what opening checks."""
    data = json.loads(manifest.model_dump_json(exclude={"sha256"}))
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
            for k, v in data.items()}


def seal_manifest(manifest: Manifest) -> Manifest:
    """``manifest`` (format version 2) with its seal: ``sha256`` = :func:`manifest_digests`."""
    m = manifest.model_copy(update={"version": VERSION, "sha256": None})
    return m.model_copy(update={"sha256": manifest_digests(m)})


# ---- finding checkpoints ------------------------------------------------------------------------------------
def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every committed checkpoint under ``root``, oldest first (temporary directories of
    an interrupted write are not checkpoints)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MANIFEST).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: itself when it holds a manifest, else the latest committed
    checkpoint under it; :class:`CheckpointError` when there is none."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1][1]
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    partial = sorted(p.name for p in path.iterdir() if p.name.startswith(".tmp-"))
    hint = f" (only the unfinished write(s) {partial}, left by a crash)" if partial else ""
    raise CheckpointError(f"{path}: holds no complete checkpoint{hint}; checkpoints are its step-NNNNNNNN "
                          "directories with a manifest.json")


def _read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: corrupted manifest (not JSON: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an hspmd checkpoint manifest (format {data.get('format')!r})"
                              if isinstance(data, dict) else f"{path}: not an hspmd checkpoint manifest")
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise CheckpointError(f"{path}: invalid manifest at {where}: {first.get('msg')}") from None


# ---- the checkpoint -----------------------------------------------------------------------------------------
class Checkpoint:
    """A checkpoint opened in one process: ``.step`` (steps completed: where a resume starts), ``.model``,
    ``.state_dict()`` (full parameters), ``.optimizer_state_dict()``, ``.to_hf(directory)``, ``.summary()``.

    Open one with :func:`load_checkpoint`."""

    def __init__(self, directory: str | Path, manifest: Manifest) -> None:
        self.path = Path(directory)
        self.manifest = manifest

    # ---- what it is ---------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Training steps completed when it was saved; a resume runs steps ``step .. N-1``."""
        return self.manifest.step

    @cached_property
    def model(self) -> "ModelSpec":
        """The model config (a :class:`~hspmd_sdk.models.ModelSpec`), rebuilt from its JSON and class path."""

        return model_from_class(self.manifest.model_class, self.manifest.model)

    @cached_property
    def plan(self) -> AnnotationPlan:
        """The :class:`~hspmd_sdk.core.plan.AnnotationPlan` it was saved under."""

        return AnnotationPlan.model_validate(self.manifest.plan)

    @property
    def data(self) -> DataPosition:
        """Where the data stream stands (:class:`DataPosition`)."""
        return self.manifest.data

    @property
    def tensors(self) -> Mapping[str, TensorEntry]:
        """Tensor name -> its entry (:class:`TensorEntry`: shape, dtype, pieces)."""
        return self.manifest.tensors

    def pieces(self, name: str) -> list[StoredPiece]:
        """The stored pieces of tensor ``name`` (for :class:`~.checkpoint_io.PieceReader`)."""
        e = self._entry(name)
        return [StoredPiece(p.file, p.offset, p.box, e.dtype, p.nbytes) for p in e.pieces]

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self.manifest.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path / MANIFEST}: holds no tensor {name!r}") from None

    def size_per_rank(self) -> dict[int, int]:
        """Bytes each rank wrote (its shard file)."""
        out: dict[int, int] = {}
        for f in self.manifest.files.values():
            out[f.rank] = out.get(f.rank, 0) + f.bytes
        return dict(sorted(out.items()))

    # ---- integrity ----------------------------------------------------------------------------------------
    @property
    def sealed(self) -> bool:
        """Whether the manifest carries its seal (format version 2); a version 1 manifest is cross-checked only."""
        return self.manifest.sha256 is not None

    def check_manifest(self) -> "Checkpoint":
        """Check the manifest against itself (cheap: no shard is read): its directory's name (``step-NNNNNNNN``,
        when it has that form) and the data position's ``next_step`` agree with ``step``, Adam's
        ``optimizer_step`` equals ``step`` (one Adam update a step; a resume and a reload restore both), every
        shard file is named after its rank, a rank of the world; then its seal: each field's SHA-256 equals the
        one recorded when it was written (:func:`manifest_digests`).  Raises :class:`CheckpointError` naming the
        file and the field; returns ``self``."""
        m, where = self.manifest, self.path / MANIFEST
        edited = "the manifest was edited or damaged after the checkpoint was written; resume from another checkpoint"
        named = _STEP_DIR.match(self.path.name)
        if named and int(named.group(1)) != m.step:
            raise CheckpointError(f"{where}: field 'step' is {m.step} but the checkpoint's directory is "
                                  f"{self.path.name} (a resume would start at step {m.step} with the state of step "
                                  f"{int(named.group(1))}); {edited}")
        if m.data.next_step != m.step:
            raise CheckpointError(f"{where}: field 'data.next_step' is {m.data.next_step} but 'step' is {m.step} "
                                  f"(the data stream stands where the training does); {edited}")
        if m.optimizer_step != m.step:
            raise CheckpointError(f"{where}: field 'optimizer_step' is {m.optimizer_step} but 'step' is {m.step} "
                                  f"(Adam updates once a step: another count changes its bias correction); {edited}")
        for fname, f in m.files.items():
            if fname != shard_file_name(f.rank) or not 0 <= f.rank < m.world_size:
                raise CheckpointError(f"{where}: field 'files.{fname}.rank' is {f.rank}, which does not write "
                                      f"{fname} in a world of {m.world_size} ('world_size'); {edited}")
        if m.sha256 is None:
            if m.version >= 2:
                raise CheckpointError(f"{where}: field 'sha256' (the manifest's seal) is missing from a format "
                                      f"version {m.version} manifest; {edited}")
            return self
        want = manifest_digests(m)
        changed = [k for k in want if m.sha256.get(k) != want[k]]
        if changed:
            raise CheckpointError(f"{where}: field{'s' if len(changed) > 1 else ''} "
                                  f"{', '.join(repr(k) for k in changed)} differ{'' if len(changed) > 1 else 's'} "
                                  f"from what was written (SHA-256 of the content != the manifest's 'sha256' entry); "
                                  f"{edited}")
        return self

    def verify(self, *, checksums: bool = True) -> "Checkpoint":
        """Check that the files hold what the manifest says: the pieces tiling each tensor exactly once, the
        manifest itself (:meth:`check_manifest`: its seal, its step against its directory, data position and Adam
        step count), every file present with its recorded size, its safetensors header listing every piece at its
        offset with its dtype and shape and (``checksums``) every piece's CRC-32.  Raises :class:`CheckpointError`
        naming the file and the tensor or field; returns ``self``."""
        m = self.manifest
        by_file: dict[str, list[tuple[str, Piece, str]]] = {}
        for name, e in m.tensors.items():
            problems = tiling_problems(name, e.shape, [p.box for p in e.pieces])
            if problems:
                raise CheckpointError(f"{self.path / MANIFEST}: {problems[0]}")
            for p in e.pieces:
                by_file.setdefault(p.file, []).append((name, p, e.dtype))
        self.check_manifest()
        for rank, p in m.rng.items():
            by_file.setdefault(p.file, []).append((f"RNG state of rank {rank}", p, "uint8"))
        for fname, items in by_file.items():
            if fname not in m.files:
                raise CheckpointError(f"{self.path / MANIFEST}: tensor {items[0][0]!r} lies in {fname}, which the "
                                      "manifest does not list")
        for fname, entry in m.files.items():
            self._verify_file(fname, entry, by_file.get(fname, []), checksums)
        return self

    def _verify_file(self, fname: str, entry: FileEntry, items: list[tuple[str, Piece, str]], checksums: bool) -> None:
        path = self.path / fname
        names = sorted({n for n, _, _ in items})
        if not path.is_file():
            raise CheckpointError(f"{path}: missing shard file of rank {entry.rank} (tensors "
                                  f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}); the checkpoint is "
                                  "incomplete — resume from an older one")
        size = path.stat().st_size
        if size != entry.bytes:
            beyond = [(n, p) for n, p, _ in items if p.offset + p.nbytes > size]
            what = (f"; tensor {beyond[0][0]!r} (box {format_box(beyond[0][1].box)}) lies at bytes "
                    f"{beyond[0][1].offset}..{beyond[0][1].offset + beyond[0][1].nbytes}") if beyond else ""
            raise CheckpointError(f"{path}: truncated or rewritten: {size} bytes, the manifest says {entry.bytes}"
                                  f"{what}")
        start, header = read_header(path)
        for name, p, dtype in items:
            h = header.get(p.key)
            where = f"{path}: tensor {name!r} (key {p.key!r}, box {format_box(p.box)})"
            if not isinstance(h, dict):
                raise CheckpointError(f"{where} is missing from the file's header")
            offsets = h.get("data_offsets") or [0, 0]
            if (h.get("dtype") != SAFETENSORS_DTYPE.get(dtype) or tuple(h.get("shape", ())) != box_shape(p.box)
                    or start + offsets[0] != p.offset or offsets[1] - offsets[0] != p.nbytes):
                raise CheckpointError(f"{where}: the file holds dtype {h.get('dtype')} shape {h.get('shape')} at "
                                      f"{start + offsets[0]}, the manifest {dtype} {list(box_shape(p.box))} at "
                                      f"{p.offset}")
            if p.nbytes != math.prod(box_shape(p.box)) * DTYPE_BYTES[dtype]:
                raise CheckpointError(f"{where}: {p.nbytes} bytes do not hold its box")
            if checksums and piece_crc(path, p.offset, p.nbytes) != p.crc32:
                raise CheckpointError(f"{where}: corrupted (its CRC-32 differs from the manifest's); resume from "
                                      "an older checkpoint")

    # ---- whole tensors --------------------------------------------------------------------------------------
    def tensor(self, name: str) -> "torch.Tensor":
        """The full tensor ``name`` (a parameter or ``<param>.exp_avg`` / ``.exp_avg_sq``), read from its pieces."""

        e = self._entry(name)
        stored = self.pieces(name)  # they tile the tensor (verify): read each whole
        items = [ReadItem(name, i, p.box, p.nbytes) for i, p in enumerate(stored)]
        with PieceReader(self.path) as reader:
            return reader.assemble(stored, items, tuple((0, d) for d in e.shape), tensor=name)

    def state_dict(self) -> dict[str, "torch.Tensor"]:
        """Parameter name -> full tensor (for one process: a reference model, Hugging Face, analysis)."""
        return {name: self.tensor(name) for name, e in self.manifest.tensors.items() if e.kind == "param"}

    def optimizer_state_dict(self) -> dict[str, dict[str, Any]]:
        """Parameter name -> ``{"exp_avg", "exp_avg_sq"}`` (full tensors) and ``"step"`` (Adam's step count)."""
        out: dict[str, dict[str, Any]] = {}
        for name, e in self.manifest.tensors.items():
            if e.kind != "param":
                out.setdefault(e.param, {"step": float(self.manifest.optimizer_step)})[e.kind] = self.tensor(name)
        return out

    def to_hf(self, directory: str | Path) -> Path:
        """Write the parameters as a Hugging Face model directory (``config.json`` + ``model.safetensors``) that
        ``transformers.AutoModelForCausalLM.from_pretrained`` loads (:func:`hspmd_sdk.models.to_hf`)."""

        return to_hf(self.model, self.state_dict(), directory)

    # ---- display ------------------------------------------------------------------------------------------
    def strategy_lines(self) -> list[str]:
        """The plan it was saved under, one pipeline a line (stages as TP degree and ranks)."""
        plan = AnnotationPlan.load(self.manifest.plan)
        settings = plan.settings
        head = [f"{len(self.manifest.pipelines)} pipeline(s)", f"schedule {settings.schedule}",
                f"ZeRO-1 {'on' if settings.zero1 else 'off'}"]
        if (settings.strategy or {}).get("name"):
            head.insert(0, repr(settings.strategy["name"]))
        lines = [", ".join(head)]
        mbs = settings.micro_batch_size or ()
        for i, pipe in enumerate(self.manifest.pipelines):
            stages = " -> ".join(f"TP{len(s)} {s}" for s in pipe)
            nmb = settings.micro_batches(i)
            micro = f"  ({nmb} micro-batch{'es' if nmb != 1 else ''} of {mbs[i]})" if i < len(mbs) else ""
            lines.append(f"pipeline {i}: {stages}{micro}")
        return lines

    def summary(self, *, verified: bool | None = None) -> str:
        """A readable summary: step, model, strategy, data position, size per rank, integrity."""
        m = self.manifest
        params = [e for e in m.tensors.values() if e.kind == "param"]
        nbytes = sum(f.bytes for f in m.files.values())
        lines = [f"checkpoint {self.path}", f"  step: {m.step} (a resume starts at step {m.step})",
                 f"  model: {self.model}  [{m.model_class}]",
                 f"  strategy: {self.strategy_lines()[0]}"]
        lines += [f"    {line}" for line in self.strategy_lines()[1:]]
        d = m.data
        lines += [f"  data: {d.source!r}, seed {d.seed}, {d.global_batch} samples x {d.seq_len} tokens a step, next "
                  f"step {d.next_step}",
                  f"  optimizer: Adam {m.adam}, step {m.optimizer_step}",
                  f"  tensors: {len(params)} parameters ({sum(math.prod(e.shape) for e in params):,} elements) + "
                  f"{len(m.tensors) - len(params)} Adam moments, {nbytes:,} bytes in {len(m.files)} files",
                  f"  size per rank (world {m.world_size}):"]
        for rank, b in self.size_per_rank().items():
            n = sum(1 for e in m.tensors.values() for p in e.pieces if m.files[p.file].rank == rank)
            lines.append(f"    rank {rank}: {b:,} bytes, {n} pieces")
        if verified is not None:
            lines.append(f"  integrity: {'ok: every file present, sizes, headers and checksums match' if verified else 'not checked'}")
        if not self.sealed:
            lines.append(f"  manifest: format version {m.version}, written before manifest checksums: its fields are "
                         "cross-checked (step, data position, Adam step, files), not sealed")
        older = [s for s, p in list_checkpoints(self.path.parent) if p != self.path]
        if older:
            lines.append(f"  other checkpoints in {self.path.parent}: steps {older}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, step={self.step}, model={self.model})"


def load_checkpoint(directory: str | Path, *, verify: bool = True) -> Checkpoint:
    """Open the checkpoint ``directory`` names: a checkpoint root (``checkpoint_dir=`` of a run: its latest
    complete checkpoint) or one step directory.  The manifest is always checked against its seal and itself
    (:meth:`Checkpoint.check_manifest`); ``verify``: also every file against the manifest, checksums included
    (:meth:`Checkpoint.verify`), so that nothing is ever loaded silently wrong.  :class:`CheckpointError` names the
    file and the field or tensor."""
    path = resolve_checkpoint(directory)
    ck = Checkpoint(path, _read_manifest(path))
    return ck.verify() if verify else ck.check_manifest()


# ---- resuming a run ---------------------------------------------------------------------------------------
def data_identity(run: Mapping[str, Any]) -> tuple[str, int, int]:
    """``(source, global batch, sequence length)`` of a run's data stream as a checkpoint records it: for
    mixed-length data (:func:`~.data.data_spec`) ``mixed:<documents digest>``, the token budget and the context
    (a step's sequences are a function of these and the seed alone, whatever the candidates)."""
    d = run["data"]
    if isinstance(d, Mapping) and d.get("kind") == "mixed":
        return f"mixed:{d['digest']}", int(d["tokens_per_step"]), int(d["context"])
    return str(d), int(run["global_batch"]), int(run["seq_len"])


def resume_problems(ck: Checkpoint, program: "Program", run: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Why ``run`` (a :func:`~.runs.training_run` of ``program``) cannot continue from ``ck``: ``(field,
    reason)`` pairs naming the tensor or setting (empty: it can).  The model (its config, the name aside, and
    class), the data source, seed, global batch and sequence length must be the checkpoint's, ``steps`` beyond its
    step, and the program's tensors exactly the checkpoint's with their shapes and dtypes; the plan, the world
    size and Adam's options (a new learning rate) may change."""

    where = str(ck.path / MANIFEST)
    out: list[tuple[str, str]] = []
    m = ck.manifest
    theirs = {k: v for k, v in m.model.items() if k != "name"}  # a renamed config is the same model
    ours = {k: v for k, v in model_json(program.model).items() if k != "name"}
    if theirs != ours or (m.model_class and m.model_class != run.get("model_class")):
        diff = [f"{k}: {theirs.get(k)!r} (checkpoint) != {ours.get(k)!r} (program)"
                for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
        if m.model_class != run.get("model_class"):
            diff.insert(0, f"class {m.model_class} (checkpoint) != {run.get('model_class')} (program)")
        out.append(("resume_from", f"{where}: the checkpoint's model is not the program's ({'; '.join(diff[:4])})"))
        return out
    d = m.data
    source, batch, seq = data_identity(run)
    for field, mine in (("data", source), ("seed", run["seed"]), ("global_batch", batch), ("seq_len", seq)):
        saved = d.source if field == "data" else getattr(d, field)
        if saved != mine:
            out.append((field, f"is {mine!r} but the checkpoint {ck.path} was trained with {saved!r}; the data "
                               f"stream continues only with the same {field}"))
    if run["steps"] <= ck.step:
        out.append(("steps", f"is the total step count ({run['steps']}) but the checkpoint {ck.path} has already "
                             f"completed {ck.step}; pass steps > {ck.step}"))
    for name, layout in program.state_layouts().items():
        e = m.tensors.get(name)
        if e is None:
            out.append(("resume_from", f"{where}: holds no tensor {name!r}, which the program trains"))
        elif tuple(e.shape) != tuple(layout.shape) or e.dtype != layout.dtype:
            out.append(("resume_from", f"{where}: tensor {name!r} is {e.dtype} {list(e.shape)}, the program's "
                                       f"{layout.dtype} {list(layout.shape)}"))
    extra = sorted(set(m.tensors) - set(program.state_layouts()))
    if extra:
        out.append(("resume_from", f"{where}: holds tensor(s) {extra[:4]} that the program does not have"))
    return out


def resume_payload(ck: Checkpoint) -> dict[str, Any]:
    """What every worker needs to resume (JSON): the directory, the job that wrote it (its checkpoints are the
    resumed training's own, for pruning), the step, Adam's step count, the stored pieces of every tensor and the
    RNG states by rank."""
    m = ck.manifest
    return {"dir": str(ck.path.resolve()), "job_id": m.job_id, "step": m.step, "optimizer_step": m.optimizer_step,
            "tensors": {n: {"dtype": e.dtype, "pieces": [[list(map(list, p.box)), p.file, p.offset, p.nbytes]
                                                        for p in e.pieces]} for n, e in m.tensors.items()},
            "rng": {r: [p.file, p.offset, p.nbytes] for r, p in m.rng.items()}}


def stored_pieces(payload: Mapping[str, Any]) -> dict[str, list[StoredPiece]]:
    """The pieces of :func:`resume_payload` as :class:`~.checkpoint_io.StoredPiece` by tensor name."""
    out = {}
    for name, e in payload["tensors"].items():
        out[name] = [StoredPiece(f, int(off), tuple(tuple(int(x) for x in ab) for ab in box), e["dtype"], int(n))
                     for box, f, off, n in e["pieces"]]
    return out


def _check_writable(root: Path) -> None:
    """Raise :class:`CheckpointError` unless ``root`` can be created and written."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"{root}: cannot write checkpoints there: {e.strerror or e}") from None


def checkpoint_options(directory: Any, every: Any, keep: Any, async_: Any, steps: int
                       ) -> tuple[dict[str, Any] | None, list[tuple[str, str]]]:
    """The run's ``checkpoint`` entry and the problems of the options (``every`` default: only after the last
    step)."""
    if directory is None:
        bad = [(n, "needs checkpoint_dir=") for n, v in (("checkpoint_every", every),) if v is not None]
        return None, bad
    problems = []
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        problems.append(("checkpoint_every", f"must be a whole number of steps >= 1, not {every!r}"))
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        problems.append(("keep", f"must be a number of checkpoints >= 1, not {keep!r}"))
    root = Path(directory).expanduser().resolve()
    try:
        _check_writable(root)
    except CheckpointError as e:
        problems.append(("checkpoint_dir", str(e)))
    return {"dir": str(root), "every": int(every or max(steps, 1)), "keep": keep, "async": bool(async_)}, problems



def run_fields(run: Mapping[str, Any], program: "Program", *, checkpoint_dir: Any = None, checkpoint_every: Any = None,
               keep: Any = 3, checkpoint_async: bool = True, resume_from: str | Path | None = None) -> dict[str, Any]:
    """The ``checkpoint`` and ``resume`` entries of a training run, checked before any worker starts.

    Raises :class:`~hspmd_sdk.errors.PlanValidationError` for bad options or a checkpoint the run cannot continue
    from (naming the setting, the manifest and the tensor), :class:`CheckpointError` for a checkpoint that is
    missing, incomplete or corrupted (naming the file and the tensor)."""

    ckpt, problems = checkpoint_options(checkpoint_dir, checkpoint_every, keep, checkpoint_async, int(run["steps"]))
    if problems:
        raise PlanValidationError(problems, what="checkpoint options")
    resume = None
    if resume_from is not None:
        ck = load_checkpoint(resume_from)
        problems = resume_problems(ck, program, run)
        if problems:
            raise PlanValidationError(problems, what=f"resume from {ck.path}")
        resume = resume_payload(ck)
    return {"checkpoint": ckpt, "resume": resume}
