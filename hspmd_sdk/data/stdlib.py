"""A real corpus that exists offline on any machine: the Python standard library's source text.

:func:`stdlib_corpus` prepares it once (a byte-level BPE trained on it) into a cache directory keyed by the Python
version, the vocabulary size and the format version, and reuses it afterwards: one corpus per Python version.
"""
from __future__ import annotations

import os
import platform
import sysconfig
from pathlib import Path

from .corpus import TokenCorpus
from .format import FORMAT_VERSION, CorpusError
from .pipeline import prepare

#: Vocabulary of the default standard-library corpus (uint16 tokens).
STDLIB_VOCAB = 8192
#: Share of the files held out for validation.
STDLIB_VAL_FRACTION = 0.02
#: Directories never read: installed packages, bytecode, the test suites and IDLE (half the bytes, slow to tokenize).
STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"})


def default_cache_dir() -> Path:
    """``~/.cache/hspmd_sdk/corpora``."""
    return Path.home() / ".cache" / "hspmd_sdk" / "corpora"


def stdlib_source_files(root: str | Path | None = None) -> list[Path]:
    """The ``*.py`` files under the standard library (``sysconfig.get_paths()["stdlib"]``), outside
    :data:`STDLIB_SKIP`, sorted by path relative to the root (deterministic)."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def stdlib_corpus(vocab_size: int = STDLIB_VOCAB, cache_dir: str | Path | None = None, *,
                  progress: bool = False) -> Path:
    """The prepared standard-library corpus (one document per source file, byte-level BPE of ``vocab_size``
    tokens trained on its train files, 2% of the files for val); prepared on first use (about 10 s) into
    ``cache_dir`` (default :func:`default_cache_dir`) under ``stdlib-py<version>-v<vocab>-f<format>``, then
    reused.  Returns the corpus directory (open it with :class:`~.corpus.TokenCorpus`)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out = root / f"stdlib-py{platform.python_version()}-v{int(vocab_size)}-f{FORMAT_VERSION}"
    if _usable(out):
        return out
    try:
        return prepare(stdlib_source_files(), out, train_tokenizer_vocab=vocab_size,
                       val_fraction=STDLIB_VAL_FRACTION, seed=0, encoding_errors="replace", progress=progress,
                       overwrite=out.exists())
    except CorpusError:
        if _usable(out):  # another process prepared it meanwhile
            return out
        raise


def _usable(out: Path) -> bool:
    if not (out / "meta.json").is_file():
        return False
    try:
        TokenCorpus(out)
    except CorpusError:
        return False
    return True
