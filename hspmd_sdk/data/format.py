"""The on-disk format of a prepared token corpus (SPEC §14) and its error.

A prepared corpus is a directory holding, for each split ``train`` and ``val``:

* ``<split>.bin``: every token id of the split, flat, documents one after another, little-endian ``uint16`` when
  the vocabulary fits in 65,536 ids, else ``uint32`` (:func:`dtype_for`);
* ``<split>.idx``: the start offset (in tokens, into the ``.bin``) of each document, little-endian ``int64``,
  strictly increasing from 0;

and ``meta.json``, a :class:`CorpusMeta`: the format version, the vocabulary size and dtype, per split its token
and document counts and largest token id, the tokenizer it was made with, and a digest (sha256 of ``train.bin``
then ``val.bin``, first 32 hex digits).  Every document ends with the tokenizer's end-of-text token.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import HSPMDError

#: Version of the layout above; a reader refuses a corpus written by a newer one.
FORMAT_VERSION = 1
SPLITS: tuple[str, str] = ("train", "val")
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
#: Little-endian offsets of the documents in a ``.idx`` file.
IDX_DTYPE = np.dtype("<i8")
#: Largest vocabulary stored as ``uint16``.
UINT16_VOCAB = 1 << 16
#: Hex digits of the sha256 kept as the corpus digest.
DIGEST_CHARS = 32
#: What a corpus directory holds, for error messages.
LAYOUT = ("a prepared corpus directory holds train.bin, val.bin, train.idx, val.idx and meta.json, as "
          "`hspmd data prepare` or hspmd_sdk.data.prepare write them")


class CorpusError(HSPMDError, ValueError):
    """A prepared corpus (or the input to prepare one) is missing, truncated, inconsistent or does not fit the
    model; the message names the file and what to do."""


def dtype_for(vocab_size: int) -> np.dtype:
    """``uint16`` when every id of a vocabulary of ``vocab_size`` fits in 16 bits, else ``uint32`` (little-endian)."""
    if vocab_size < 1:
        raise CorpusError(f"a vocabulary has at least one token, not {vocab_size}")
    return np.dtype("<u2") if vocab_size <= UINT16_VOCAB else np.dtype("<u4")


class SplitMeta(BaseModel):
    """One split's counts: tokens in its ``.bin``, documents in its ``.idx``, the largest token id it holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tokens: int = Field(ge=0)
    documents: int = Field(ge=0)
    max_token_id: int = Field(ge=-1)


class TokenizerMeta(BaseModel):
    """The tokenizer a corpus was made with: where it came from (a path, or ``trained`` on the inputs), its
    vocabulary size (added tokens included) and the end-of-text token appended to every document."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str
    trained: bool = False
    vocab_size: int = Field(ge=1)
    eot_token: str
    eot_id: int = Field(ge=0)


class CorpusMeta(BaseModel):
    """``meta.json`` of a prepared corpus."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format_version: int = FORMAT_VERSION
    vocab_size: int = Field(ge=1)
    dtype: Literal["uint16", "uint32"]
    splits: dict[Literal["train", "val"], SplitMeta]
    tokenizer: TokenizerMeta
    digest: str
    seed: int = 0
    val_fraction: float = 0.0
    #: The input files it was prepared from (the first 1000).
    sources: list[str] = Field(default_factory=list)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype("<u2") if self.dtype == "uint16" else np.dtype("<u4")

    @property
    def max_token_id(self) -> int:
        return max(s.max_token_id for s in self.splits.values())

    def write(self, directory: Path) -> None:
        (directory / META_FILE).write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def read(cls, directory: Path) -> "CorpusMeta":
        """``directory/meta.json``, checked (:class:`CorpusError` naming the file and the field)."""
        path = directory / META_FILE
        if not path.is_file():
            raise CorpusError(f"{path}: missing: {directory} is not a prepared corpus ({LAYOUT})")
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorpusError(f"{path}: not readable JSON ({e}); prepare the corpus again") from None
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise CorpusError(f"{path}: format_version {version} is newer than this hspmd_sdk reads "
                              f"({FORMAT_VERSION}); upgrade hspmd_sdk or prepare the corpus again")
        try:
            meta = cls.model_validate(raw)
        except ValidationError as e:
            where = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '<root>'}: {err['msg']}"
                              for err in e.errors(include_url=False))
            raise CorpusError(f"{path}: invalid meta ({where}); prepare the corpus again") from None
        missing = [s for s in SPLITS if s not in meta.splits]
        if missing:
            raise CorpusError(f"{path}: splits: no {', '.join(missing)} split; prepare the corpus again")
        if meta.np_dtype != dtype_for(meta.vocab_size):
            raise CorpusError(f"{path}: dtype {meta.dtype} does not match vocab_size {meta.vocab_size} "
                              f"(expected {dtype_for(meta.vocab_size).name}); prepare the corpus again")
        return meta


def bins_digest(directory: Path) -> str:
    """sha256 of ``train.bin`` then ``val.bin``, first :data:`DIGEST_CHARS` hex digits (read in chunks)."""
    import hashlib

    h = hashlib.sha256()
    for split in SPLITS:
        with open(Path(directory) / f"{split}.bin", "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()[:DIGEST_CHARS]
