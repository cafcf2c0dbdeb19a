"""``prepare``: local text / JSON lines / parquet files -> a prepared token corpus directory (:mod:`~.format`).

The documents are read through Hugging Face ``datasets`` offline (:mod:`~.sources`), split into train and val by
document (a seeded draw of ``val_fraction`` of them), tokenized with a given ``tokenizer.json`` or a byte-level BPE
trained here on the train documents, each followed by the end-of-text token, and written to a temporary directory
beside ``out`` that is renamed to ``out`` at the end: a crash leaves no half corpus.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator, Sequence

import numpy as np

from .format import (IDX_DTYPE, SPLITS, TOKENIZER_FILE, CorpusError, CorpusMeta, SplitMeta, TokenizerMeta,
                     bins_digest, dtype_for)
from .sources import group_sources, input_files, iter_texts, load_source
from .tokenizer import EOT_TOKEN, find_eot, load_tokenizer, tokenizer_file, train_bpe

#: Documents tokenized per ``encode_batch`` call.
BATCH_DOCUMENTS = 256


def prepare(inputs: Sequence[str | Path] | str | Path, out: str | Path, *, tokenizer: str | Path | None = None,
            train_tokenizer_vocab: int | None = None, eot_token: str | None = None, val_fraction: float = 0.01,
            seed: int = 0, text_field: str = "text", encoding_errors: str = "strict", overwrite: bool = False,
            progress: bool = True) -> Path:
    """Prepare a token corpus from local files; returns its directory ``out``.

    ``inputs``: text files (one document each, read as UTF-8 with ``encoding_errors``), ``.json`` / ``.jsonl`` /
    ``.parquet`` files (one document per row, its text in column ``text_field``), or directories of them.
    Exactly one of ``tokenizer`` (a ``tokenizer.json`` or a Hugging Face tokenizer directory; copied into
    ``out``) and ``train_tokenizer_vocab`` (train a byte-level BPE of that many tokens on the train documents,
    saved as ``out/tokenizer.json``).  ``eot_token``: the end-of-text token of a given tokenizer (default: its
    directory's ``eos_token``, else a usual spelling found in its vocabulary; of a trained one: its name,
    :data:`~.tokenizer.EOT_TOKEN` by default).  ``val_fraction`` of the documents (at least one) go to the val
    split, drawn with ``seed``.  Empty documents are skipped.  ``out`` must not exist (or be an empty directory)
    unless ``overwrite``.  ``progress`` shows progress bars on stderr.  Nothing reaches the network, and
    ``datasets``' cache lives in the temporary directory (removed).

    Raises :class:`~.format.CorpusError` naming the input, the tokenizer or ``out`` and what to do."""
    _check_arguments(tokenizer, train_tokenizer_vocab, val_fraction)
    files = input_files([inputs] if isinstance(inputs, (str, Path)) else list(inputs))
    out = Path(out).expanduser().resolve()
    _check_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tables = [load_source(s, cache_dir=work / ".hf-cache", text_field=text_field,
                              encoding_errors=encoding_errors, progress=progress) for s in group_sources(files)]
        is_val = _val_mask(sum(len(t) for t in tables), val_fraction, seed, files)
        tok, tok_meta = _tokenizer(tables, is_val, work, tokenizer, train_tokenizer_vocab, eot_token, progress)
        splits = _write_splits(tables, is_val, tok, tok_meta, work, progress)
        del tables
        shutil.rmtree(work / ".hf-cache", ignore_errors=True)
        vocab = tok_meta.vocab_size
        CorpusMeta(vocab_size=vocab, dtype=dtype_for(vocab).name, splits=splits, tokenizer=tok_meta,
                   digest=bins_digest(work), seed=seed, val_fraction=val_fraction,
                   sources=[str(f) for f in files[:1000]]).write(work)
        _publish(work, out, overwrite)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out


def _check_arguments(tokenizer: Any, vocab: int | None, val_fraction: float) -> None:
    if (tokenizer is None) == (vocab is None):
        raise CorpusError("pass exactly one of tokenizer= (a tokenizer.json or Hugging Face tokenizer directory) "
                          "and train_tokenizer_vocab= (train a byte-level BPE of that many tokens on the inputs)")
    if not 0.0 < float(val_fraction) < 1.0:
        raise CorpusError(f"val_fraction must be between 0 and 1 (exclusive), not {val_fraction}: the corpus needs "
                          "a val split and a train split")
    if tokenizer is not None:
        tokenizer_file(tokenizer)


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite and not (out.is_dir() and not any(out.iterdir())):
        raise CorpusError(f"{out}: already exists; choose another output directory or pass overwrite=True "
                          "(--overwrite)")
    if out.exists() and not out.is_dir():
        raise CorpusError(f"{out}: a file, not a directory; choose another output directory")


def _val_mask(n: int, val_fraction: float, seed: int, files: Sequence[Path]) -> np.ndarray:
    """Which of the ``n`` documents (in input order) go to val: ``round(n * val_fraction)`` (at least one, at
    most ``n - 1``), drawn with ``seed``."""
    if n < 2:
        raise CorpusError(f"{files[0]}{' ...' if len(files) > 1 else ''}: {n} document(s); a corpus needs at least "
                          "2 (one for train, one for val): add input documents")
    count = min(max(1, round(n * val_fraction)), n - 1)
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng([int(seed), 0x5A1]).choice(n, size=count, replace=False)] = True
    return mask


def _texts(tables: Sequence[Any], keep: np.ndarray | None = None) -> Iterator[str]:
    """Non-empty documents in order (only those with ``keep[i]`` when given)."""
    i = 0
    for batch in iter_texts(tables):
        for text in batch:
            if text and (keep is None or keep[i]):
                yield text
            i += 1


def _tokenizer(tables: Sequence[Any], is_val: np.ndarray, work: Path, path: str | Path | None, vocab: int | None,
               eot_token: str | None, progress: bool) -> tuple[Any, TokenizerMeta]:
    """The tokenizer (given, or trained on the train documents), saved as ``work/tokenizer.json``."""
    if path is not None:
        tok = load_tokenizer(path)
        eot, eot_id = find_eot(tok, path, eot_token)
        shutil.copyfile(tokenizer_file(path), work / TOKENIZER_FILE)
        source, trained = str(Path(path).expanduser().resolve()), False
    else:
        assert vocab is not None
        tok = train_bpe(_texts(tables, ~is_val), int(vocab), length=int((~is_val).sum()), progress=progress,
                        eot_token=eot_token or EOT_TOKEN)
        eot, eot_id = find_eot(tok, eot_token=eot_token or EOT_TOKEN)
        tok.save(str(work / TOKENIZER_FILE))
        source, trained = f"byte-level BPE trained on the inputs (vocab_size={vocab})", True
    size = int(tok.get_vocab_size(with_added_tokens=True))
    return tok, TokenizerMeta(source=source, trained=trained, vocab_size=size, eot_token=eot, eot_id=eot_id)


@dataclass
class _SplitWriter:
    """One split's ``.bin`` being written: its file, document offsets and largest token id."""

    file: IO[bytes]
    dtype: np.dtype
    starts: list[int] = field(default_factory=list)
    tokens: int = 0
    max_id: int = -1

    def add(self, ids: np.ndarray) -> None:
        self.starts.append(self.tokens)
        self.file.write(ids.astype(self.dtype, copy=False).tobytes())
        self.tokens += int(ids.size)
        self.max_id = max(self.max_id, int(ids.max()))


def _write_splits(tables: Sequence[Any], is_val: np.ndarray, tok: Any, tok_meta: TokenizerMeta, work: Path,
                  progress: bool) -> dict[str, SplitMeta]:
    """Tokenize every document into ``work/{train,val}.bin`` and write the ``.idx`` files; the splits' counts."""
    from tqdm.auto import tqdm

    dtype, eot = dtype_for(tok_meta.vocab_size), np.array([tok_meta.eot_id], dtype=np.int64)
    with open(work / "train.bin", "wb") as ftrain, open(work / "val.bin", "wb") as fval, \
            tqdm(total=len(is_val), desc="tokenize", unit="doc", disable=not progress) as bar:
        writers = {"train": _SplitWriter(ftrain, dtype), "val": _SplitWriter(fval, dtype)}
        i = 0
        for batch in iter_texts(tables, BATCH_DOCUMENTS):
            kept = [(i + j, t) for j, t in enumerate(batch) if t]
            for (row, _), enc in zip(kept, tok.encode_batch([t for _, t in kept], add_special_tokens=False)):
                ids = np.concatenate([np.asarray(enc.ids, dtype=np.int64), eot])
                writers["val" if is_val[row] else "train"].add(ids)
            i += len(batch)
            bar.update(len(batch))
    for split in SPLITS:
        w = writers[split]
        if not w.starts:
            raise CorpusError(f"the {split} split has no non-empty document; add input documents"
                              + (" or raise val_fraction" if split == "val" else ""))
        if w.max_id >= tok_meta.vocab_size:
            raise CorpusError(f"tokenizer {tok_meta.source}: gave token id {w.max_id}, beyond its vocabulary of "
                              f"{tok_meta.vocab_size}; the tokenizer file is inconsistent")
        np.asarray(w.starts, dtype=IDX_DTYPE).tofile(work / f"{split}.idx")
    return {s: SplitMeta(tokens=writers[s].tokens, documents=len(writers[s].starts), max_token_id=writers[s].max_id)
            for s in SPLITS}


def _publish(work: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished ``work`` directory to ``out`` (replacing an old ``out`` only with ``overwrite``)."""
    old = None
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise CorpusError(f"{out}: appeared while preparing; choose another output directory or pass "
                              "overwrite=True (--overwrite)")
        old = out.with_name(f".{out.name}.old-{work.name.rsplit('-', 1)[-1]}")
        out.rename(old)
    elif out.exists():
        out.rmdir()
    work.chmod(0o755)  # mkdtemp made it private; a corpus is readable like any other output
    work.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
