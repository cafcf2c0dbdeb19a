"""Training data without downloads: bytes of the Python standard library's own source files.

The corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (excluding ``site-packages`` and
``dist-packages``), sorted by relative path and concatenated; a token is a byte (vocabulary 256, no tokenizer).
It is packed into non-overlapping samples of ``seq_len + 1`` tokens (inputs are ``[:, :-1]``, targets
``[:, 1:]``).  ``global_batch(step, ...)`` depends only on ``(seed, step)`` (and the machine's Python version), so
every plan, on every rank, sees the same data: step ``s`` takes samples ``s*B .. s*B+B-1`` of a seeded
per-epoch permutation.  ``split_batch`` cuts a global batch into per-pipeline slices (the top-tier split).

Pure numpy/torch; no torch.distributed.
"""
from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
import torch

VOCAB_SIZE = 256
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class TokenDataset(Protocol):
    """What the executor needs from a dataset."""

    vocab_size: int

    def global_batch(self, step: int, global_batch_size: int, seq_len: int, seed: int) -> torch.Tensor: ...


# ---- the standard-library corpus ----------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The corpus files, sorted by path relative to the stdlib root (deterministic)."""
    return list(_files(str(root or stdlib_root())))


@functools.lru_cache(maxsize=4)
def _files(root_str: str) -> tuple[Path, ...]:
    root = Path(root_str)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # prune: never walk site-packages
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


@functools.lru_cache(maxsize=4)
def _load(root: str, max_bytes: int | None) -> np.ndarray:
    """All corpus bytes as a read-only uint8 array (cached: immutable)."""
    chunks, total = [], 0
    for path in stdlib_files(Path(root)):
        data = path.read_bytes()
        if max_bytes is not None and total + len(data) > max_bytes:
            chunks.append(data[: max_bytes - total])
            break
        chunks.append(data)
        total += len(data)
    arr = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    arr.setflags(write=False)
    return arr


def file_lengths(root: Path | None = None) -> list[int]:
    """Byte length of every corpus file, in corpus order: naturally mixed sequence lengths."""
    return [p.stat().st_size for p in stdlib_files(root)]


class StdlibBytes:
    """The byte-level standard-library corpus.  ``max_bytes`` keeps only its first bytes (faster tests)."""

    vocab_size = VOCAB_SIZE

    def __init__(self, root: Path | str | None = None, *, max_bytes: int | None = None) -> None:
        self.root = Path(root) if root is not None else stdlib_root()
        self.max_bytes = max_bytes

    @property
    def tokens(self) -> np.ndarray:
        """The whole corpus, one uint8 token a byte."""
        return _load(str(self.root), self.max_bytes)

    def num_samples(self, seq_len: int) -> int:
        """How many packed samples of ``seq_len + 1`` tokens the corpus holds."""
        return len(self.tokens) // (seq_len + 1)

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        start = index * (seq_len + 1)
        return self.tokens[start:start + seq_len + 1]

    def global_batch(self, step: int, global_batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
        """``(global_batch_size, seq_len + 1)`` int64 tokens of step ``step`` (deterministic in seed, step)."""
        n = self.num_samples(seq_len)
        if n < 1:
            raise ValueError(f"the corpus ({len(self.tokens)} bytes) is shorter than one sample of "
                             f"seq_len + 1 = {seq_len + 1} tokens; use a smaller seq_len")
        idx = sample_indices(step, global_batch_size, n, seed)
        rows = np.stack([self.sample(int(i), seq_len) for i in idx])
        return torch.from_numpy(rows.astype(np.int64))


def sample_indices(step: int, global_batch_size: int, num_samples: int, seed: int) -> np.ndarray:
    """Sample indices of a step: positions ``step*B ..`` of per-epoch permutations seeded by ``(seed, epoch)``."""
    if step < 0 or global_batch_size < 1:
        raise ValueError(f"step must be >= 0 and global_batch_size >= 1 (got {step}, {global_batch_size})")
    positions = np.arange(step * global_batch_size, (step + 1) * global_batch_size, dtype=np.int64)
    epochs, offsets = positions // num_samples, positions % num_samples
    out = np.empty(global_batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        perm = np.random.default_rng([seed, int(epoch)]).permutation(num_samples)
        mask = epochs == epoch
        out[mask] = perm[offsets[mask]]
    return out


def global_batch(step: int, global_batch_size: int, seq_len: int, seed: int, *,
                 dataset: TokenDataset | None = None) -> torch.Tensor:
    """The global batch of ``step``: ``(global_batch_size, seq_len + 1)`` int64 tokens (standard-library bytes
    unless ``dataset`` is given)."""
    return (dataset or StdlibBytes()).global_batch(step, global_batch_size, seq_len, seed)


# ---- synthetic tokens (tests) -------------------------------------------------------------------------------
class SyntheticTokens:
    """Uniform random tokens, deterministic in ``(seed, step)``; for tests that need no corpus."""

    def __init__(self, vocab_size: int = VOCAB_SIZE) -> None:
        self.vocab_size = vocab_size

    def global_batch(self, step: int, global_batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
        rng = np.random.default_rng([seed, step, 0x5EED])
        rows = rng.integers(0, self.vocab_size, size=(global_batch_size, seq_len + 1), dtype=np.int64)
        return torch.from_numpy(rows)


# ---- batches -> inputs / targets / pipelines ----------------------------------------------------------------
def inputs_targets(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch[:, :-1], batch[:, 1:])``: next-token prediction."""
    return batch[:, :-1], batch[:, 1:]


def pipeline_slices(sizes: Sequence[int], global_batch_size: int | None = None) -> list[slice]:
    """Consecutive row ranges of sizes ``sizes`` (pipeline ``k`` gets rows ``slices[k]``).

    ``global_batch_size``, if given, must equal ``sum(sizes)``.
    """
    if any(s < 0 for s in sizes):
        raise ValueError(f"pipeline batch sizes must be >= 0, got {list(sizes)}")
    total = sum(sizes)
    if global_batch_size is not None and total != global_batch_size:
        raise ValueError(f"pipeline batch sizes {list(sizes)} sum to {total}, not the global batch size "
                         f"{global_batch_size}; make them add up (e.g. micro_batch_size * num_micro_batches "
                         "per pipeline)")
    bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def split_batch(batch: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Cut a global batch into per-pipeline slices of ``sizes`` rows (the top-tier split of the batch)."""
    return [batch[s] for s in pipeline_slices(sizes, batch.shape[0])]
