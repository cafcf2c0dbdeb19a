"""Training data without downloads: bytes of the Python standard library's own source files (the default).

The corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (excluding ``site-packages`` and
``dist-packages``), sorted by relative path and concatenated; a token is a byte (vocabulary 256, no tokenizer).
It is packed into non-overlapping samples of ``seq_len + 1`` tokens (inputs are ``[:, :-1]``, targets
``[:, 1:]``); the last 1% of its bytes is the validation split (:meth:`StdlibBytes.val_batch`), never
trained on.  ``global_batch(step, ...)`` depends only on ``(seed, step)`` (and the machine's Python version), so
every plan, on every rank, sees the same data: step ``s`` takes samples ``s*B .. s*B+B-1`` of a seeded
per-epoch permutation.  ``split_batch`` cuts a global batch into per-pipeline slices (the top-tier split).

Pure numpy/torch; no torch.distributed.
"""
from __future__ import annotations

import functools
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import numpy as np
import torch

from ..data.order import sample_indices

VOCAB_SIZE = 256
#: The data a run trains on when it names none: the standard library's source, real text on any machine.
DEFAULT_DATA = "stdlib"
#: The share of the standard-library bytes held out for validation: the corpus's last bytes, never trained on.
STDLIB_VAL_FRACTION = 0.01
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class TokenDataset(Protocol):
    """What the executor needs from a dataset: its vocabulary and the global batch of a step,
    ``(global_batch_size, seq_len + 1)`` int64 tokens, a pure function of ``(seed, step)``; ``rows=(a, b)`` gives
    only rows ``a..b-1`` of it (the same rows as slicing the full batch), reading only those samples.  The
    sources: :class:`SyntheticTokens`, :class:`StdlibBytes`, and a prepared corpus
    (:class:`hspmd_sdk.data.TokenCorpus`, which adds validation batches)."""

    vocab_size: int

    def global_batch(self, step: int, global_batch_size: int, seq_len: int, seed: int,
                     rows: tuple[int, int] | None = None) -> torch.Tensor: ...


def _rows(rows: tuple[int, int] | None, global_batch_size: int) -> slice:
    """``rows=(a, b)`` of a global batch as a slice (checked)."""
    if rows is None:
        return slice(0, global_batch_size)
    a, b = (int(x) for x in rows)
    if not 0 <= a <= b <= global_batch_size:
        raise ValueError(f"rows=({a}, {b}) is not a range of the global batch's {global_batch_size} rows "
                         "(0 <= a <= b <= global_batch_size)")
    return slice(a, b)


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


@functools.lru_cache(maxsize=4)
def _offsets(root: str) -> tuple[tuple[Path, ...], np.ndarray]:
    """The corpus files and where each starts in their concatenation (the last entry: the total length)."""
    files = stdlib_files(Path(root))
    return tuple(files), np.concatenate([[0], np.cumsum([f.stat().st_size for f in files])]).astype(np.int64)


class StdlibBytes:
    """The byte-level standard-library corpus.  ``max_bytes`` keeps only its first bytes (faster tests).

    A batch reads only its own bytes from the files (``os.pread`` over the files a sample spans): a worker never
    loads the 30 MB corpus.  :attr:`tokens` is the whole corpus in memory, for tools."""

    vocab_size = VOCAB_SIZE

    def __init__(self, root: Path | str | None = None, *, max_bytes: int | None = None) -> None:
        self.root = Path(root) if root is not None else stdlib_root()
        self.max_bytes = max_bytes

    @property
    def tokens(self) -> np.ndarray:
        """The whole corpus, one uint8 token a byte (read into memory once; batches do not need it)."""
        return _load(str(self.root), self.max_bytes)

    @property
    def size(self) -> int:
        """The corpus's length in bytes (tokens)."""
        total = int(_offsets(str(self.root))[1][-1])
        return total if self.max_bytes is None else min(total, int(self.max_bytes))

    @property
    def train_bytes(self) -> int:
        """The bytes training samples come from: all but the last :data:`STDLIB_VAL_FRACTION` (validation's)."""
        return self.size - int(self.size * STDLIB_VAL_FRACTION)

    def num_samples(self, seq_len: int) -> int:
        """How many packed training samples of ``seq_len + 1`` tokens the corpus holds."""
        return self.train_bytes // (seq_len + 1)

    def num_val_samples(self, seq_len: int) -> int:
        """How many packed validation samples of ``seq_len + 1`` tokens the held-out tail holds."""
        return (self.size - self.train_bytes) // (seq_len + 1)

    def read(self, start: int, length: int) -> np.ndarray:
        """Bytes ``start .. start+length-1`` of the corpus, read from the files they lie in."""
        files, offsets = _offsets(str(self.root))
        out = bytearray()
        i = int(np.searchsorted(offsets, start, side="right")) - 1
        pos, stop = start, start + length
        while pos < stop and i < len(files):
            with open(files[i], "rb") as f:
                chunk = os.pread(f.fileno(), min(stop, int(offsets[i + 1])) - pos, pos - int(offsets[i]))
            out += chunk
            pos += len(chunk)
            i += 1
        return np.frombuffer(bytes(out), dtype=np.uint8)

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        return self.read(index * (seq_len + 1), seq_len + 1)

    def val_batch(self, index: int, global_batch_size: int, seq_len: int,
                  rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Validation batch ``index``: consecutive samples of the held-out tail (batch ``i`` takes samples
        ``i*B .. i*B+B-1``, wrapping around), which no training batch reads."""
        n = self.num_val_samples(seq_len)
        if n < 1:
            raise ValueError(f"the corpus's validation tail ({self.size - self.train_bytes} bytes) is shorter than "
                             f"one sample of seq_len + 1 = {seq_len + 1} tokens; use a smaller seq_len or a larger "
                             "corpus")
        idx = ((index * global_batch_size + np.arange(global_batch_size)) % n)[_rows(rows, global_batch_size)]
        out = np.empty((idx.size, seq_len + 1), dtype=np.int64)
        for r, i in enumerate(idx.tolist()):
            out[r] = self.read(self.train_bytes + i * (seq_len + 1), seq_len + 1)
        return torch.from_numpy(out)

    def global_batch(self, step: int, global_batch_size: int, seq_len: int, seed: int,
                     rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``(global_batch_size, seq_len + 1)`` int64 tokens of step ``step`` (deterministic in seed, step);
        ``rows=(a, b)``: only rows ``a..b-1``."""
        n = self.num_samples(seq_len)
        if n < 1:
            raise ValueError(f"the corpus ({self.size} bytes) is shorter than one sample of "
                             f"seq_len + 1 = {seq_len + 1} tokens; use a smaller seq_len")
        idx = sample_indices(step, global_batch_size, n, seed)[_rows(rows, global_batch_size)]
        out = np.empty((idx.size, seq_len + 1), dtype=np.int64)
        for r, i in enumerate(idx.tolist()):
            out[r] = self.sample(i, seq_len)
        return torch.from_numpy(out)


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

    def global_batch(self, step: int, global_batch_size: int, seq_len: int, seed: int,
                     rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``rows=(a, b)``: only rows ``a..b-1`` (the full batch's rows: the whole batch is drawn)."""
        rng = np.random.default_rng([seed, step, 0x5EED])
        out = rng.integers(0, self.vocab_size, size=(global_batch_size, seq_len + 1), dtype=np.int64)
        return torch.from_numpy(np.ascontiguousarray(out[_rows(rows, global_batch_size)]))

    def val_batch(self, index: int, global_batch_size: int, seq_len: int,
                  rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Validation batch ``index``: random tokens of a stream of their own (never a training batch's)."""
        rng = np.random.default_rng([index, 0x7A1])
        out = rng.integers(0, self.vocab_size, size=(global_batch_size, seq_len + 1), dtype=np.int64)
        return torch.from_numpy(np.ascontiguousarray(out[_rows(rows, global_batch_size)]))


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


# ---- documents of different lengths (mixed-length data, SPEC §7) ---------------------------------------------
#: ``data=`` name of the embedded variable-length source: the standard-library bytes, one document per file.
STDLIB_DOCS = "stdlib-docs"


class Documents:
    """Token documents of different lengths (1-d integer arrays), in a fixed order.

    Make one from any sequence of token arrays (``Documents(arrays)``), from the standard library's source files
    one document per file (:meth:`stdlib`, byte tokens: the embedded default, long-tailed), or from a tokenized
    text file (:meth:`from_file`: one document per line, token ids separated by whitespace).  ``vocab_size`` is at
    least the largest token + 1."""

    def __init__(self, docs: Sequence[Any], *, vocab_size: int | None = None, name: str = "documents") -> None:
        arrays = []
        for i, d in enumerate(docs):
            a = np.asarray(d)
            if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
                raise ValueError(f"{name}[{i}]: a document is a 1-d array of integer tokens, not shape "
                                 f"{a.shape} of {a.dtype}")
            if a.size and int(a.min()) < 0:
                raise ValueError(f"{name}[{i}]: token {int(a.min())} is negative")
            arrays.append(a if a.size else a.astype(np.int64))  # kept in its dtype (stdlib: uint8 bytes)
        self.docs: list[np.ndarray] = arrays
        top = max((int(a.max()) for a in arrays if a.size), default=-1) + 1
        if vocab_size is not None and top > vocab_size:
            raise ValueError(f"{name}: token {top - 1} is outside the vocabulary of {vocab_size}")
        self.vocab_size = int(vocab_size if vocab_size is not None else max(top, 1))
        self.name = name
        self.stdlib_files: int | None = None  #: set by :meth:`stdlib` (-1: every file): workers re-read it
        self.stdlib_root: str | None = None

    @classmethod
    def stdlib(cls, root: Path | str | None = None, *, max_files: int | None = None) -> "Documents":
        """The standard library's ``*.py`` files, one document each, in corpus order (byte tokens, vocabulary
        256); ``max_files`` keeps the first files only (faster tests)."""
        files = stdlib_files(Path(root) if root is not None else None)[:max_files]
        out = cls([np.frombuffer(p.read_bytes(), dtype=np.uint8) for p in files], vocab_size=VOCAB_SIZE,
                  name=STDLIB_DOCS)
        out.stdlib_files = -1 if max_files is None else int(max_files)
        out.stdlib_root = str(root) if root is not None else None
        return out

    @classmethod
    def from_file(cls, path: str | Path, *, vocab_size: int | None = None) -> "Documents":
        """A tokenized text file: one document per line, its token ids separated by whitespace."""
        lines = Path(path).read_text().splitlines()
        docs = []
        for n, line in enumerate(lines, 1):
            try:
                docs.append(np.array([int(x) for x in line.split()], dtype=np.int64))
            except ValueError:
                raise ValueError(f"{path}:{n}: a line is token ids separated by whitespace") from None
        return cls(docs, vocab_size=vocab_size, name=str(path))

    def __len__(self) -> int:
        return len(self.docs)

    @property
    def num_tokens(self) -> int:
        return int(sum(a.size for a in self.docs))


def chunk_documents(docs: Documents, context: int) -> list[np.ndarray]:
    """Every document as sequences of at most ``context + 1`` tokens (``context`` input/target pairs): a document
    longer than that is cut into consecutive chunks that overlap by one token, so each of its next-token pairs is
    in exactly one chunk (none is dropped); a document of fewer than two tokens has no pair and gives none."""
    if context < 1:
        raise ValueError(f"context must be >= 1 token, not {context}")
    out = []
    for d in docs.docs:
        for start in range(0, max(d.size - 1, 0), context):
            out.append(d[start:start + context + 1])
    return out


class LengthBatches:
    """Mixed-length global batches by token budget (SPEC §7): which sequences make up step ``k`` depends only on
    the documents, ``context``, ``tokens_per_step`` and ``seed`` — never on a plan.

    The documents are cut into sequences of at most ``context`` input tokens (:func:`chunk_documents`); each
    epoch visits them in a permutation seeded by ``(seed, epoch)``; step ``k`` takes the next sequences of that
    stream while their input tokens add up to at most ``tokens_per_step`` (at least one a step).  A sequence of
    ``n + 1`` tokens has length ``n``: ``n`` inputs, ``n`` targets."""

    def __init__(self, docs: Documents, *, context: int, tokens_per_step: int, seed: int = 0) -> None:
        self.docs, self.context, self.seed = docs, int(context), int(seed)
        self.tokens_per_step = int(tokens_per_step)
        self.sequences = chunk_documents(docs, self.context)
        if not self.sequences:
            raise ValueError(f"{docs.name}: no document has two tokens or more: nothing to train on")
        if self.tokens_per_step < self.context:
            raise ValueError(f"tokens_per_step={self.tokens_per_step} is smaller than one chunk of the context "
                             f"({self.context} tokens); a step must hold the longest sequence")
        self.lengths = np.array([s.size - 1 for s in self.sequences], dtype=np.int64)
        self._starts: list[int] = [0]  # stream position where step k starts
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        got = self._perms.get(epoch)
        if got is None:
            got = self._perms[epoch] = np.random.default_rng([self.seed, epoch, 0x1E9]).permutation(
                len(self.sequences))
        return got

    def _at(self, position: int) -> int:
        """Index of the sequence at stream position ``position``."""
        n = len(self.sequences)
        return int(self._perm(position // n)[position % n])

    def _span(self, step: int) -> tuple[int, int]:
        if step < 0:
            raise ValueError(f"step must be >= 0, not {step}")
        while len(self._starts) <= step + 1:
            pos, total = self._starts[-1], 0
            while True:
                x = int(self.lengths[self._at(pos)])
                if total and total + x > self.tokens_per_step:
                    break
                total += x
                pos += 1
            self._starts.append(pos)
        return self._starts[step], self._starts[step + 1]

    def step_indices(self, step: int) -> list[int]:
        """Indices (into :attr:`sequences`) of step ``step``'s sequences, in stream order."""
        a, b = self._span(step)
        return [self._at(p) for p in range(a, b)]

    def step_lengths(self, step: int) -> list[int]:
        """Input lengths of step ``step``'s sequences (what the dispatcher assigns)."""
        return [int(self.lengths[i]) for i in self.step_indices(step)]

    def step_sequences(self, step: int) -> list[np.ndarray]:
        """Step ``step``'s sequences (``length + 1`` tokens each), in stream order."""
        return [self.sequences[i] for i in self.step_indices(step)]

    def step_targets(self, step: int) -> int:
        """Real target tokens of step ``step`` (the loss's normaliser)."""
        return int(sum(self.step_lengths(step)))


def length_distribution(docs: Documents, context: int | None = None) -> np.ndarray:
    """Lengths of the documents' sequences: input tokens of each document, or with ``context`` of each chunk
    (:func:`chunk_documents`) — for a histogram of how long-tailed the data is."""
    if context is None:
        return np.array([max(d.size - 1, 0) for d in docs.docs if d.size > 1], dtype=np.int64)
    return np.array([s.size - 1 for s in chunk_documents(docs, context)], dtype=np.int64)


def padded_rows(sequences: Sequence[np.ndarray], pad: int = -100) -> torch.Tensor:
    """Sequences (``n_i + 1`` tokens each) as one ``[rows, max n_i + 1]`` int64 tensor padded on the right with
    ``pad`` (what :func:`micro_batch_feeds` turns into inputs and masked targets)."""
    width = max(int(s.size) for s in sequences)
    out = np.full((len(sequences), width), pad, dtype=np.int64)
    for i, s in enumerate(sequences):
        out[i, :s.size] = s
    return torch.from_numpy(out)


def documents_for(data: Any, vocab_size: int | None = None) -> Documents:
    """The :class:`~.data.Documents` of ``data=``: ``"stdlib-docs"`` (the standard library, one document per
    file), a :class:`~.data.Documents`, a list of token arrays, the path of a tokenized text file (one
    document per line), or a prepared corpus directory (its train documents, memory-mapped views)."""
    if isinstance(data, Documents):
        docs = data
    elif isinstance(data, str) and data == STDLIB_DOCS:
        docs = Documents.stdlib()
    elif isinstance(data, (str, Path)) and Path(data).expanduser().is_dir():
        docs = _corpus_documents(str(Path(data).expanduser().resolve()))
    elif isinstance(data, (str, Path)):
        if not Path(data).is_file():
            raise ValueError(f"data={str(data)!r}: not {STDLIB_DOCS!r}, no such file (a tokenized text file: "
                             "one document per line, token ids separated by whitespace) and no prepared corpus "
                             "directory")
        docs = Documents.from_file(data)
    elif isinstance(data, Sequence):
        docs = Documents(data)
    else:
        raise ValueError(f"data must be {STDLIB_DOCS!r}, a list of token arrays, Documents or a tokenized text file, "
                         f"not {type(data).__name__}")
    if vocab_size is not None and docs.vocab_size > vocab_size:
        raise ValueError(f"data {docs.name!r} has tokens up to {docs.vocab_size - 1} but the model's vocabulary "
                         f"has {vocab_size}")
    return docs


def data_spec(docs: Documents, *, context: int, tokens_per_step: int, seed: int) -> dict[str, Any]:
    """The JSON form of a mixed-length source for the workers (documents other than the embedded default are
    written once to a temporary ``.npz`` that each worker reads)."""
    import hashlib

    digest = hashlib.sha256()
    for d in docs.docs:  # the documents' identity, whatever file they were read from (checkpoints compare it)
        digest.update(np.int64(d.size).tobytes())
        digest.update(np.ascontiguousarray(d, dtype=np.int64).tobytes())
    spec: dict[str, Any] = {"kind": "mixed", "context": int(context), "tokens_per_step": int(tokens_per_step),
                            "seed": int(seed), "vocab_size": int(docs.vocab_size),
                            "digest": digest.hexdigest()[:32]}
    if getattr(docs, "stdlib_files", None) is not None:
        spec["source"] = {"stdlib": docs.stdlib_files, "root": docs.stdlib_root}
    elif getattr(docs, "corpus", None) is not None:  # a prepared corpus: each worker memory-maps it
        spec["source"] = {"corpus": docs.corpus}
    else:
        path = Path(tempfile.mkdtemp(prefix="hspmd-docs-")) / "documents.npz"
        lengths = np.array([d.size for d in docs.docs], dtype=np.int64)
        np.savez(path, tokens=np.concatenate(docs.docs) if docs.docs else np.zeros(0, np.int64), lengths=lengths)
        spec["source"] = {"npz": str(path)}
    return spec


def batches_of(spec: Mapping[str, Any]) -> LengthBatches:
    """The :class:`~.data.LengthBatches` of a :func:`data_spec` (worker side)."""
    src = spec["source"]
    if "stdlib" in src:
        n = int(src["stdlib"])
        docs = Documents.stdlib(src.get("root"), max_files=None if n < 0 else n)
    elif "corpus" in src:
        docs = _corpus_documents(src["corpus"])
    else:
        with np.load(src["npz"]) as z:
            tokens, lengths = z["tokens"], z["lengths"]
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        docs = Documents([tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])], vocab_size=int(spec["vocab_size"]))
    return LengthBatches(docs, context=int(spec["context"]), tokens_per_step=int(spec["tokens_per_step"]),
                         seed=int(spec["seed"]))


class ValidationSequences:
    """The validation batches of a mixed-length run (SPEC §13 ``eval``): the validation split's documents cut into
    sequences of at most ``context`` tokens (:func:`chunk_documents`), in document order (no shuffling: every
    evaluation reads the same batches); batch ``b`` is the ``per_batch`` sequences from position
    ``b * per_batch`` of that stream (wrapping around).  Never training data: only a source with a validation split
    (a prepared corpus) has them."""

    def __init__(self, docs: Documents, *, context: int, per_batch: int) -> None:
        self.sequences = chunk_documents(docs, int(context))
        if not self.sequences:
            raise ValueError(f"{docs.name}: the validation split has no document of two tokens or more")
        self.context, self.per_batch = int(context), max(1, int(per_batch))

    def batch(self, index: int) -> list[np.ndarray]:
        """Validation batch ``index``: ``per_batch`` sequences (``length + 1`` tokens each)."""
        n = len(self.sequences)
        return [self.sequences[(index * self.per_batch + j) % n] for j in range(self.per_batch)]


def validation_of(spec: Mapping[str, Any], context: int) -> ValidationSequences:
    """The validation batches of a mixed-length source (:func:`data_spec`): its prepared corpus's ``val`` split
    cut at ``context`` tokens, ``tokens_per_step // context`` sequences a batch.  A source without a validation
    split raises ``ValueError`` saying which sources have one."""
    src = spec["source"]
    if "corpus" not in src:
        raise ValueError("validation (eval_every=) of mixed-length data needs a validation split: train on a "
                         "prepared corpus (data='DIR', hspmd data prepare), not on documents given in memory, a "
                         "token file or 'stdlib-docs'")
    from ..data.corpus import TokenCorpus

    corpus = TokenCorpus(src["corpus"])
    docs = Documents(corpus.documents("val"), vocab_size=corpus.vocab_size, name=f"{src['corpus']} (val)")
    return ValidationSequences(docs, context=context, per_batch=int(spec["tokens_per_step"]) // int(context))


def _corpus_documents(path: str) -> Documents:
    """The train documents of the prepared corpus in ``path`` (memory-map views; workers re-open it)."""
    from ..data.corpus import TokenCorpus

    corpus = TokenCorpus(path)
    docs = Documents(corpus.documents("train"), vocab_size=corpus.vocab_size, name=path)
    docs.corpus = path  # type: ignore[attr-defined]  # data_spec sends the directory, not the tokens
    return docs


def describe_data(data: Any) -> str:
    """What a run trains on, in a few words, for progress lines and the dashboard: ``"stdlib source (bytes)"``,
    ``"synthetic random tokens"`` (which the loss cannot learn below ln(vocabulary)), a corpus directory's name,
    ``"documents (N)"``."""
    if data is None or data == "stdlib":
        return "stdlib source (bytes)"
    if data == "synthetic":
        return "synthetic random tokens (loss stays at ln V)"
    if data == "stdlib-docs":
        return "stdlib files as documents (bytes)"
    if isinstance(data, Mapping):  # a mixed-length source (:func:`data_spec`)
        src = data.get("source") or {}
        if src.get("corpus"):
            return f"corpus {Path(str(src['corpus'])).name}"
        return "stdlib files as documents (bytes)" if src.get("stdlib") is not None else "mixed-length documents"
    if isinstance(data, (str, Path)):
        return f"corpus {Path(data).expanduser().name}" if Path(data).expanduser().is_dir() else f"{data}"
    try:
        return f"documents ({len(data)})"
    except TypeError:
        return type(data).__name__


def dataset_for(data: Any, vocab_size: int) -> TokenDataset | LengthBatches:
    """The token source of a run: ``"synthetic"`` or ``"stdlib"`` (needs a vocabulary of at least 256), a
    prepared corpus directory (:class:`hspmd_sdk.data.TokenCorpus`, memory-mapped; its token ids must fit
    ``vocab_size``), or a mixed-length source (:func:`data_spec`: :class:`LengthBatches`)."""
    if isinstance(data, Mapping) and data.get("kind") == "mixed":
        return batches_of(data)
    if data == "synthetic":
        return SyntheticTokens(vocab_size)
    if data == "stdlib":
        if vocab_size < VOCAB_SIZE:
            raise ValueError(f"data='stdlib' (the default: the standard library's source, byte-level, 256 tokens) "
                             f"needs a vocabulary of at least 256 but the model's has {vocab_size}; pass "
                             "data='synthetic' (random tokens) or a prepared corpus that fits")
        return StdlibBytes()
    if isinstance(data, (str, Path)) and Path(data).expanduser().is_dir():
        from ..data.corpus import TokenCorpus
        from ..data.format import CorpusError

        corpus = TokenCorpus(data)
        if corpus.meta.max_token_id >= vocab_size:
            raise CorpusError(f"{corpus.path / 'meta.json'}: token id {corpus.meta.max_token_id} is beyond the "
                              f"model's vocabulary of {vocab_size}; use a model with vocab_size "
                              f"{corpus.meta.tokenizer.vocab_size} or prepare the corpus with a tokenizer that fits")
        return corpus
    from ..data.format import LAYOUT

    raise ValueError(f"data must be 'synthetic', 'stdlib' or a prepared corpus directory, not {data!r} ({LAYOUT})")
