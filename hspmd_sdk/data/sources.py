"""Input documents for :func:`~.pipeline.prepare`: local files read through Hugging Face ``datasets``, offline.

A text file (any name not below) is one document; a JSON / JSON-lines file (``.json``, ``.jsonl``) or a parquet
file is one document per row, its text in the column ``text_field``.  A directory stands for the files below it
with a known suffix (:data:`TEXT_SUFFIXES`, :data:`ROW_SUFFIXES`), sorted by path.  Nothing reaches the network:
the packaged ``text`` / ``json`` / ``parquet`` builders read the local files, their cache goes to a directory the
caller gives (and removes).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

from .format import CorpusError

Kind = Literal["text", "json", "parquet"]
#: Suffixes of the row files and the ``datasets`` builder that reads each.
ROW_SUFFIXES: dict[str, Kind] = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
#: Suffixes of the text files taken from a directory (a file named explicitly is read whatever its suffix).
TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".js",
                           ".ts", ".java", ".tex", ".html", ".xml", ".csv", ".tsv", ".toml", ".yaml", ".yml",
                           ".sh", ".text"})


@dataclass(frozen=True)
class Source:
    """Files read by one ``datasets`` builder, in order."""

    kind: Kind
    files: tuple[Path, ...]


def kind_of(path: Path) -> Kind:
    return ROW_SUFFIXES.get(path.suffix.lower(), "text")


def input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The files of ``inputs`` in order: a file as given, a directory's known files sorted by relative path."""
    out: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_file():
            out.append(p.resolve())
        elif p.is_dir():
            found = sorted((f for f in p.rglob("*") if f.is_file() and not _hidden(f.relative_to(p))
                            and (f.suffix.lower() in TEXT_SUFFIXES or f.suffix.lower() in ROW_SUFFIXES)),
                           key=lambda f: f.relative_to(p).as_posix())
            if not found:
                raise CorpusError(f"{p}: a directory without input files (text files such as .txt/.md/.py, "
                                  "or .json/.jsonl/.parquet with a text column)")
            out += [f.resolve() for f in found]
        else:
            raise CorpusError(f"{p}: no such input file or directory")
    if not out:
        raise CorpusError("no input files: pass text, JSON lines or parquet files (or directories of them)")
    return out


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def group_sources(files: Sequence[Path]) -> list[Source]:
    """Consecutive files of one kind as one :class:`Source` (document order is the files' order)."""
    groups: list[Source] = []
    for f in files:
        kind = kind_of(f)
        if groups and groups[-1].kind == kind:
            groups[-1] = Source(kind, groups[-1].files + (f,))
        else:
            groups.append(Source(kind, (f,)))
    return groups


#: ``datasets.config`` switches held while reading: no hub, no download-count request (it sends one to the
#: network for every packaged builder unless offline).
_OFFLINE = {"HF_HUB_OFFLINE": True, "HF_DATASETS_OFFLINE": True, "HF_UPDATE_DOWNLOAD_COUNTS": False}


@contextlib.contextmanager
def _offline_datasets(show_progress: bool) -> Iterator[None]:
    """``datasets`` offline and its own progress bars on or off while reading; both as they were afterwards."""
    import datasets
    from datasets import config

    saved = {name: getattr(config, name) for name in _OFFLINE if hasattr(config, name)}
    was_disabled = datasets.are_progress_bars_disabled()
    (datasets.enable_progress_bars if show_progress else datasets.disable_progress_bars)()
    for name in saved:
        setattr(config, name, _OFFLINE[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
        (datasets.disable_progress_bars if was_disabled else datasets.enable_progress_bars)()


def load_source(source: Source, *, cache_dir: Path, text_field: str, encoding_errors: str = "strict",
                progress: bool = False) -> Any:
    """The rows of ``source`` as a ``datasets.Dataset`` (memory-mapped Arrow in ``cache_dir``) whose column
    ``text_field`` holds the documents (text files: the column ``text``)."""
    import datasets

    files = [str(f) for f in source.files]
    kwargs: dict[str, Any] = {"sample_by": "document", "encoding_errors": encoding_errors} \
        if source.kind == "text" else {}
    where = files[0] + (f" (and {len(files) - 1} more {source.kind} files)" if len(files) > 1 else "")
    try:
        with _offline_datasets(progress):
            ds = datasets.load_dataset(source.kind, data_files=files, split="train", cache_dir=str(cache_dir),
                                       **kwargs)
    except Exception as e:  # noqa: BLE001 - datasets wraps the reader's error in its own types
        cause = e.__cause__ or e.__context__ or e
        text = " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
        hint = "UTF-8 text" if source.kind == "text" else f"valid {source.kind} with a {text_field!r} column"
        raise CorpusError(f"{where}: could not be read as {hint} ({text})") from None
    field = "text" if source.kind == "text" else text_field
    if field not in ds.column_names:
        raise CorpusError(f"{where}: no column {field!r} (columns: {', '.join(ds.column_names)}); pass the "
                          "column that holds the text (--text-field / text_field=)")
    dtype = getattr(ds.features[field], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise CorpusError(f"{where}: column {field!r} holds {dtype or type(ds.features[field]).__name__}, not text; "
                          "pass the column that holds the text (--text-field / text_field=)")
    return ds.select_columns([field]).rename_column(field, "text") if field != "text" else ds.select_columns(["text"])


def iter_texts(tables: Sequence[Any], batch_size: int = 256) -> Iterator[list[str | None]]:
    """The documents of ``tables`` (from :func:`load_source`) in order, ``batch_size`` at a time."""
    for ds in tables:
        for batch in ds.iter(batch_size=batch_size):
            yield batch["text"]
