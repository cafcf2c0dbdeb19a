"""Checkpoint files: safetensors written atomically, read box by box with exactly the bytes a box needs.

A shard file is a standard safetensors file (an 8-byte little-endian header length, a JSON header
``{key: {"dtype", "shape", "data_offsets"}}``, then the raw row-major data), so any safetensors reader opens it.
It is written here rather than by ``safetensors.torch.save_file`` for three reasons: the data goes straight from
the tensors to the file (no serialised copy in memory), each piece's CRC-32 is computed in the same pass, and the
file is written under a temporary name, ``fsync``-ed and renamed, with named points in between where the tests'
crash hook can stop the process (:data:`WRITE_POINTS`).

Reading never goes through the header: the manifest records each piece's absolute file offset, so a rank reads a
box as the contiguous runs of bytes it occupies in the piece (:func:`byte_runs`) with ``os.preadv`` into one
buffer — exactly ``numel * itemsize`` bytes, whatever part of a stored piece it needs.  :class:`ThreadReadCounter`
(Linux ``/proc/thread-self/io``) lets a caller count what the operating system actually delivered.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from ...core.slices import Box, box_shape, relative
from ...errors import HSPMDError
from .checkpoint_plan import DTYPE_BYTES

if TYPE_CHECKING:
    import torch

    from .checkpoint_plan import ReadItem

__all__ = ["CheckpointError", "write_shard", "read_header", "byte_runs", "PieceReader", "StoredPiece",
           "atomic_write_bytes", "fsync_dir", "ThreadReadCounter", "piece_crc", "WRITE_POINTS", "SAFETENSORS_DTYPE"]

#: The named points of a checkpoint write, in order (a crash hook may stop the process at any of them):
#: half of a rank's shard bytes in its temporary file; the shard file complete and renamed, not yet announced;
#: half of the manifest written (rank 0); the manifest complete, the directory not yet renamed; the new checkpoint
#: committed, older ones not yet pruned.
WRITE_POINTS = ("shard-partial", "shard-renamed", "manifest-partial", "before-commit", "before-prune")

#: SDK dtype name -> safetensors dtype code.
SAFETENSORS_DTYPE = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                     "int32": "I32", "uint8": "U8"}
_CHUNK = 16 << 20
Point = Callable[[str], None]


class CheckpointError(HSPMDError):
    """A checkpoint is missing, incomplete, corrupted or does not match the program (names the file, the tensor
    and what to do)."""


def _no_point(name: str) -> None:
    return None


# ---- writing ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WrittenPiece:
    """Where a piece landed: absolute byte offset in the file, its byte count and CRC-32."""

    key: str
    offset: int
    nbytes: int
    crc32: int


def _dtype_name(t: "torch.Tensor") -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in SAFETENSORS_DTYPE:
        raise CheckpointError(f"cannot checkpoint a tensor of dtype {t.dtype} (supported: {sorted(SAFETENSORS_DTYPE)})")
    return name


def _raw(t: "torch.Tensor") -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _write_all(fd: int, mv: memoryview) -> None:
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def write_shard(path: Path, items: Sequence[tuple[str, "torch.Tensor"]], *, point: Point = _no_point,
                metadata: Mapping[str, str] | None = None) -> tuple[int, list[WrittenPiece]]:
    """Write ``items`` (key, tensor) as the safetensors file ``path``: to ``<path>.tmp``, fsync, rename.

    Returns the file size and every piece's offset, size and CRC-32.  ``point`` is called with
    ``"shard-partial"`` after exactly half of the data bytes are in the temporary file and with
    ``"shard-renamed"`` after the rename."""
    views = [(k, _raw(t), _dtype_name(t), tuple(int(d) for d in t.shape)) for k, t in items]
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    start = 0
    for key, mv, dtype, shape in views:
        header[key] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(shape), "data_offsets": [start, start + len(mv)]}
        start += len(mv)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data 8-byte aligned, as safetensors writes it
    base = 8 + len(text)
    total = start
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written: list[WrittenPiece] = []
    try:
        _write_all(fd, memoryview(struct.pack("<Q", len(text)) + text))
        half, done, fired = total // 2, 0, total == 0
        for key, mv, _, _ in views:
            crc, pos = 0, 0
            while pos < len(mv):
                end = min(len(mv), pos + _CHUNK)
                if not fired and done < half < done + (end - pos):
                    end = pos + (half - done)  # stop at exactly half of the data
                crc = zlib.crc32(mv[pos:end], crc)
                _write_all(fd, mv[pos:end])
                done += end - pos
                pos = end
                if not fired and done >= half:
                    fired = True
                    point("shard-partial")
            written.append(WrittenPiece(key, base + header[key]["data_offsets"][0], len(mv), crc))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    point("shard-renamed")
    return base + total, written


def atomic_write_bytes(path: Path, data: bytes, *, point: Point = _no_point, point_name: str | None = None) -> None:
    """``data`` to ``path`` through ``<path>.tmp``, fsync, rename; ``point(point_name)`` after half of it."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        mv = memoryview(data)
        _write_all(fd, mv[: len(mv) // 2])
        if point_name:
            point(point_name)
        _write_all(fd, mv[len(mv) // 2:])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- reading ------------------------------------------------------------------------------------------------
def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """``(data start offset, header dict)`` of a safetensors file; :class:`CheckpointError` naming the file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated: {len(head)} bytes, not even a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > 100 << 20:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
            text = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(text) < n:
        raise CheckpointError(f"{path}: truncated inside its safetensors header ({8 + len(text)} of {8 + n} bytes)")
    try:
        header = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{path}: corrupted safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header (not a JSON object)")
    return 8 + n, header


def byte_runs(shape: Sequence[int], inner: Box, itemsize: int) -> Iterator[tuple[int, int]]:
    """``(byte offset, byte count)`` of the contiguous runs that the sub-box ``inner`` (coordinates relative to
    the stored piece) occupies in a row-major piece of ``shape``, in order."""
    ndim = len(shape)
    if ndim == 0:
        yield 0, itemsize
        return
    strides = [math.prod(shape[d + 1:]) for d in range(ndim)]
    k = ndim - 1  # the run spans dim k partly and every later dim fully
    while k > 0 and inner[k] == (0, shape[k]):
        k -= 1
    run = (inner[k][1] - inner[k][0]) * strides[k] * itemsize
    lead = [range(a, b) for a, b in inner[:k]]
    for idx in itertools.product(*lead):
        elem = sum(i * strides[d] for d, i in enumerate(idx)) + inner[k][0] * strides[k]
        yield elem * itemsize, run


@dataclass(frozen=True)
class StoredPiece:
    """A stored piece as a reader needs it: file name (in the checkpoint directory), absolute data offset, its
    global box, dtype and byte count."""

    file: str
    offset: int
    box: Box
    dtype: str
    nbytes: int


class PieceReader:
    """Reads parts of stored pieces from one checkpoint directory (files opened once, ``os.preadv``).

    ``bytes_read`` counts the data bytes it asked the operating system for; with ``count_os``, ``os_bytes_read``
    is the kernel's count of the bytes this thread read during those calls (:class:`ThreadReadCounter`; ``None``
    where not available) — an independent check."""

    def __init__(self, directory: Path, *, count_os: bool = False) -> None:
        self.directory = Path(directory)
        self._fds: dict[str, int] = {}
        self.bytes_read = 0
        self.count_os = count_os
        self.os_bytes_read: int | None = 0 if count_os else None

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            path = self.directory / name
            try:
                fd = self._fds[name] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open: {e.strerror or e}") from None
        return fd

    def read(self, piece: StoredPiece, box: Box, *, tensor: str = "") -> "torch.Tensor":
        """The part ``box`` (global coordinates, inside ``piece.box``) of a stored piece, as a tensor."""
        import torch

        itemsize = DTYPE_BYTES[piece.dtype]
        pshape = box_shape(piece.box)
        inner = tuple((a - p, b - p) for (a, b), (p, _) in zip(box, piece.box))
        out = torch.empty(box_shape(box), dtype=getattr(torch, piece.dtype))  # read into it: no zero fill
        nbytes = out.numel() * itemsize
        if not nbytes:
            return out
        mv = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
        fd, pos = self._fd(piece.file), 0
        counter = ThreadReadCounter() if self.count_os else None
        if counter is not None:
            counter.__enter__()
        for off, n in byte_runs(pshape, inner, itemsize):
            got = os.preadv(fd, [mv[pos:pos + n]], piece.offset + off)
            if got != n:
                raise CheckpointError(f"{self.directory / piece.file}: tensor {tensor!r}: short read ({got} of {n} "
                                      f"bytes at offset {piece.offset + off}); the file is truncated")
            pos += n
        if counter is not None:
            counter.__exit__(None, None, None)
            self.os_bytes_read = None if counter.bytes is None or self.os_bytes_read is None \
                else self.os_bytes_read + counter.bytes
        self.bytes_read += nbytes
        return out

    def assemble(self, pieces: Sequence[StoredPiece], items: Sequence["ReadItem"], box: Box, *, tensor: str = ""
                 ) -> "torch.Tensor":
        """The tensor of ``box`` from the read items (:class:`~.checkpoint_plan.ReadItem`) of ``pieces``."""
        import torch

        if len(items) == 1 and items[0].box == box:
            return self.read(pieces[items[0].piece], box, tensor=tensor)
        out = torch.empty(box_shape(box), dtype=getattr(torch, pieces[items[0].piece].dtype))
        for it in items:
            out[relative(it.box, box)] = self.read(pieces[it.piece], it.box, tensor=tensor)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "PieceReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def piece_crc(path: Path, offset: int, nbytes: int) -> int:
    """CRC-32 of ``nbytes`` bytes of ``path`` from ``offset`` (read in 16 MiB chunks)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = nbytes
        while left:
            chunk = f.read(min(left, _CHUNK))
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
    return crc


def _rchar() -> tuple[int, int] | None:
    """``(rchar, length of this read)`` of the calling thread, from ``/proc/thread-self/io`` (Linux)."""
    try:
        with open("/proc/thread-self/io", "rb", buffering=0) as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(b"rchar:"):
            return int(line.split()[1]), len(text)
    return None


class ThreadReadCounter:
    """``with ThreadReadCounter() as c: ...`` -> ``c.bytes``: the bytes the calling thread read from the operating
    system inside the block (every ``read``/``pread`` on any file), counted by the kernel; ``None`` where
    ``/proc/thread-self/io`` does not exist.  An independent check of :attr:`PieceReader.bytes_read`."""

    def __init__(self) -> None:
        self.bytes: int | None = None
        self._start: tuple[int, int] | None = None

    def __enter__(self) -> "ThreadReadCounter":
        self._start = _rchar()
        return self

    def __exit__(self, *exc: Any) -> None:
        end = _rchar()
        if self._start is not None and end is not None:
            # the rchar read at the start is counted in the end value: take its own length off
            self.bytes = end[0] - self._start[0] - self._start[1]
