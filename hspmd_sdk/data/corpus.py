"""A prepared token corpus read by memory map (:class:`TokenCorpus`): the dataset contract of the runtime.

Training samples are fixed-length windows of the train split: sample ``i`` is
``train.bin[i*(S+1) : (i+1)*(S+1)]`` (inputs ``[:-1]``, targets ``[1:]``), drawn in the global order of
:func:`~.order.sample_indices`.  Validation batches are consecutive windows of the val split, which holds other
documents than the train split.  Nothing reads a split whole: the ``.bin`` files stay memory-mapped and a batch
reads only its own rows.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .format import IDX_DTYPE, LAYOUT, SPLITS, TOKENIZER_FILE, CorpusError, CorpusMeta, bins_digest
from .order import PermutationCache

if TYPE_CHECKING:
    import torch


def _check_rows(rows: tuple[int, int] | None, global_batch_size: int) -> tuple[int, int]:
    if rows is None:
        return 0, global_batch_size
    a, b = (int(x) for x in rows)
    if not 0 <= a <= b <= global_batch_size:
        raise ValueError(f"rows=({a}, {b}) is not a range of the global batch's {global_batch_size} rows "
                         "(0 <= a <= b <= global_batch_size)")
    return a, b


class TokenCorpus:
    """A prepared corpus directory (:mod:`~.format`), opened read-only and checked against its ``meta.json``.

    Opening checks every file (a missing or empty one, a ``.bin`` that is not a whole number of tokens or not the
    count of ``meta.json``: truncated, an ``.idx`` that does not start at 0, increase, or stay inside its
    ``.bin``) and raises :class:`~.format.CorpusError` naming the file and what to do.  It reads only the
    offsets; the tokens stay on disk behind read-only ``np.memmap``\\ s (:meth:`tokens`, :meth:`documents`), and a
    batch reads only its own rows' bytes.

    The same contract as the runtime's toy sources: :attr:`vocab_size`, :meth:`global_batch` (fixed-length
    training samples in the global order), plus :meth:`val_batch`, :meth:`check` and :meth:`documents`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            what = "a file" if self.path.exists() else "no such directory"
            raise CorpusError(f"{self.path}: {what}, not a prepared corpus ({LAYOUT})")
        self.meta = CorpusMeta.read(self.path)
        self.vocab_size = int(self.meta.vocab_size)
        self._tokens = {s: self._open_bin(s) for s in SPLITS}
        self._starts = {s: self._open_idx(s) for s in SPLITS}
        self._order = PermutationCache()

    # ---- opening ----------------------------------------------------------------------------------------------
    def _open_bin(self, split: str) -> np.ndarray:
        path, dtype = self.path / f"{split}.bin", self.meta.np_dtype
        want = self.meta.splits[split].tokens
        size = self._size(path)
        if size % dtype.itemsize:
            raise CorpusError(f"{path}: truncated: {size} bytes is not a whole number of {dtype.name} tokens "
                              f"({dtype.itemsize} bytes each); prepare the corpus again")
        if size // dtype.itemsize != want:
            raise CorpusError(f"{path}: truncated or replaced: it holds {size // dtype.itemsize} tokens but "
                              f"meta.json says {want}; prepare the corpus again")
        return np.memmap(path, dtype=dtype, mode="r", shape=(want,))

    def _open_idx(self, split: str) -> np.ndarray:
        path = self.path / f"{split}.idx"
        size, docs = self._size(path), self.meta.splits[split].documents
        if size != docs * IDX_DTYPE.itemsize:
            raise CorpusError(f"{path}: truncated or replaced: {size} bytes, but meta.json's {docs} documents "
                              f"need {docs * IDX_DTYPE.itemsize} (int64 offsets); prepare the corpus again")
        starts = np.memmap(path, dtype=IDX_DTYPE, mode="r", shape=(docs,))
        tokens = self.meta.splits[split].tokens
        steps = np.diff(starts)
        if int(starts[0]) != 0 or (steps.size and int(steps.min()) <= 0) or int(starts[-1]) >= tokens:
            raise CorpusError(f"{path}: document offsets must start at 0 and increase strictly below the "
                              f"{tokens} tokens of {split}.bin; prepare the corpus again")
        return starts

    def _size(self, path: Path) -> int:
        if not path.is_file():
            raise CorpusError(f"{path}: missing: {self.path} is not a complete prepared corpus ({LAYOUT}); "
                              "prepare it again")
        size = path.stat().st_size
        if size == 0:
            raise CorpusError(f"{path}: empty file: a split holds at least one document; prepare the corpus again "
                              "(with more input documents, or a larger val_fraction when val is empty)")
        return size

    # ---- what it holds ----------------------------------------------------------------------------------------
    def tokens(self, split: str = "train") -> np.ndarray:
        """The split's tokens: a read-only memory map (slicing it reads only the slice)."""
        return self._tokens[self._split(split)]

    def num_samples(self, seq_len: int, split: str = "train") -> int:
        """Fixed-length samples of ``seq_len + 1`` tokens that the split holds."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, not {seq_len}")
        return int(self.tokens(split).shape[0]) // (seq_len + 1)

    def documents(self, split: str = "train") -> list[np.ndarray]:
        """The split's documents (each ending with the end-of-text token), as memory-map views of its ``.bin``
        cut at the ``.idx`` offsets: nothing is copied (``runtime.data.documents_for`` wraps them as
        ``Documents`` for mixed-length training)."""
        tokens = self.tokens(split).view(np.ndarray)  # plain views of the map: light objects, no copy
        starts = self._starts[self._split(split)]
        bounds = np.append(np.asarray(starts, dtype=np.int64), tokens.shape[0]).tolist()
        return [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    @property
    def digest(self) -> str:
        """The digest recorded in ``meta.json`` (identity of the tokens; :meth:`verify` recomputes it)."""
        return self.meta.digest

    def verify(self) -> None:
        """Recompute the digest from the ``.bin`` files (reads them through, in chunks) and raise
        :class:`~.format.CorpusError` if it is not ``meta.json``'s."""
        got = bins_digest(self.path)
        if got != self.meta.digest:
            raise CorpusError(f"{self.path}: the tokens' digest is {got}, meta.json says {self.meta.digest}: a "
                              ".bin file was changed; prepare the corpus again")

    # ---- batches ----------------------------------------------------------------------------------------------
    def global_batch(self, step: int, global_batch_size: int, seq_len: int, seed: int,
                     rows: tuple[int, int] | None = None) -> "torch.Tensor":
        """Training batch of ``step``: ``(B, seq_len + 1)`` int64 tokens, sample ``i`` being
        ``train.bin[i*(S+1):(i+1)*(S+1)]`` and the samples those of :func:`~.order.sample_indices`
        ``(step, B, num_samples, seed)``.  ``rows=(a, b)`` gives only rows ``a..b-1`` (and reads only them)."""
        n = self.num_samples(seq_len)
        if n < 1:
            raise CorpusError(f"{self.path / 'train.bin'}: {self.tokens().shape[0]} tokens is shorter than one "
                              f"sample of seq_len + 1 = {seq_len + 1}; use a smaller seq_len or a larger corpus")
        a, b = _check_rows(rows, global_batch_size)
        idx = self._order.indices(step, global_batch_size, n, seed)[a:b]
        return self._windows("train", idx, seq_len)

    def val_batch(self, index: int, global_batch_size: int, seq_len: int,
                  rows: tuple[int, int] | None = None) -> "torch.Tensor":
        """Validation batch ``index``: ``(B, seq_len + 1)`` int64 tokens, the consecutive samples
        ``index*B .. index*B+B-1`` of the val split (modulo its number of samples): never training data."""
        n = self.num_samples(seq_len, "val")
        if index < 0 or global_batch_size < 1:
            raise ValueError(f"index must be >= 0 and global_batch_size >= 1 (got {index}, {global_batch_size})")
        if n < 1:
            raise CorpusError(f"{self.path / 'val.bin'}: {self.tokens('val').shape[0]} tokens is shorter than one "
                              f"sample of seq_len + 1 = {seq_len + 1}; use a smaller seq_len or prepare the corpus "
                              "with a larger val_fraction")
        a, b = _check_rows(rows, global_batch_size)
        idx = (np.arange(a, b, dtype=np.int64) + int(index) * global_batch_size) % n
        return self._windows("val", idx, seq_len)

    def _windows(self, split: str, idx: np.ndarray, seq_len: int) -> "torch.Tensor":
        """Samples ``idx`` of ``split`` as int64 rows, read with positional reads of just their bytes (a memory
        map would do too, but the kernel maps whole page-cache folios into the process on a fault: its resident
        size would grow towards the file's)."""
        import torch  # lazy: `hspmd data show` needs no torch

        dtype, width = self.meta.np_dtype, seq_len + 1
        nbytes = width * dtype.itemsize
        out = np.empty((idx.size, width), dtype=np.int64)
        path = self.path / f"{split}.bin"
        fd = os.open(path, os.O_RDONLY)
        try:
            for r, i in enumerate(idx.tolist()):
                raw = os.pread(fd, nbytes, i * nbytes)
                if len(raw) != nbytes:
                    raise CorpusError(f"{path}: truncated since it was opened (sample {i} is past its end); "
                                      "prepare the corpus again")
                out[r] = np.frombuffer(raw, dtype=dtype)
        finally:
            os.close(fd)
        return torch.from_numpy(out)

    # ---- fit to a run -----------------------------------------------------------------------------------------
    def check(self, global_batch: int, seq_len: int, vocab_size: int) -> list[str]:
        """Every reason this corpus cannot train a model of ``vocab_size`` tokens with batches of
        ``global_batch`` samples of ``seq_len`` tokens (empty: it can): a token id beyond the model's vocabulary,
        a tokenizer whose vocabulary is larger than the model's, a train split shorter than one step, a val split
        shorter than one validation batch."""
        problems, meta = [], self.meta
        top = meta.max_token_id
        if top >= vocab_size:
            problems.append(f"{self.path / 'meta.json'}: token id {top} is beyond the model's vocabulary of "
                            f"{vocab_size}; use a model with vocab_size {meta.tokenizer.vocab_size} or prepare "
                            "the corpus with a tokenizer that fits")
        if meta.tokenizer.vocab_size > vocab_size:  # a larger model vocabulary (padded, as GPT-2's 50304) is fine
            problems.append(f"{self.path / 'meta.json'}: tokenizer {meta.tokenizer.source!r} has "
                            f"{meta.tokenizer.vocab_size} tokens but the model's vocabulary has only {vocab_size}; "
                            f"set the model's vocab_size to {meta.tokenizer.vocab_size} (or more)")
        for split, what in (("train", "one training step"), ("val", "one validation batch")):
            have = self.num_samples(seq_len, split) if seq_len >= 1 else 0
            if have < global_batch:
                problems.append(f"{self.path / (split + '.bin')}: {have} samples of seq_len + 1 = {seq_len + 1} "
                                f"tokens, fewer than the {global_batch} of {what}; use a smaller batch or seq_len, "
                                "or a larger corpus" + (" (or val_fraction)" if split == "val" else ""))
        return problems

    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` the corpus was made with (its copy ``tokenizer.json`` in the directory)."""
        from .tokenizer import load_tokenizer

        return load_tokenizer(self.path / TOKENIZER_FILE)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        """Pickled as its path (a worker re-opens the memory maps; the tokens never travel)."""
        return (type(self), (str(self.path),))

    def _split(self, split: str) -> str:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        return split

    def __repr__(self) -> str:
        t = self.meta.splits
        return (f"TokenCorpus({str(self.path)!r})  # vocab {self.vocab_size}, train {t['train'].tokens} tokens / "
                f"{t['train'].documents} docs, val {t['val'].tokens} tokens / {t['val'].documents} docs")
