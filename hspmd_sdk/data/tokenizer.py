"""Tokenizers for preparing a corpus: a ``tokenizers`` ``tokenizer.json`` (or a Hugging Face tokenizer directory
holding one), or a byte-level BPE trained locally; and the end-of-text token appended to every document."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from .format import TOKENIZER_FILE, CorpusError

#: The end-of-text token of a tokenizer trained here (GPT-2's spelling).
EOT_TOKEN = "<|endoftext|>"
#: End-of-text spellings looked for in a given tokenizer, in this order, when its directory names none.
EOT_CANDIDATES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[EOS]", "<|im_end|>")


def tokenizer_file(path: str | Path) -> Path:
    """The ``tokenizer.json`` of ``path`` (that file, or a directory holding one)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise CorpusError(f"{p}: no such tokenizer file; pass a tokenizers `tokenizer.json` or a Hugging Face "
                          "tokenizer directory containing one (or train one with --train-tokenizer VOCAB)")
    return p


def load_tokenizer(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` or a directory holding one."""
    from tokenizers import Tokenizer

    p = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
        raise CorpusError(f"{p}: not a tokenizers tokenizer.json ({' '.join(str(e).split())[:200]})") from None


def find_eot(tokenizer: Any, path: str | Path | None = None, eot_token: str | None = None) -> tuple[str, int]:
    """``(token, id)`` of the end-of-text token: ``eot_token`` if given, else the ``eos_token`` of a Hugging Face
    directory's ``tokenizer_config.json``, else the first of :data:`EOT_CANDIDATES` in the vocabulary."""
    names: list[str] = [eot_token] if eot_token else []
    if not eot_token:
        config = tokenizer_file(path).parent / "tokenizer_config.json" if path is not None else None
        if config is not None and config.is_file():
            try:
                raw = json.loads(config.read_text())
            except (OSError, json.JSONDecodeError):
                raw = None
            eos = raw.get("eos_token") if isinstance(raw, dict) else None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            names += [eos] if isinstance(eos, str) else []
        names += list(EOT_CANDIDATES)
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return name, int(token_id)
    where = f" {tokenizer_file(path)}" if path is not None else ""
    tried = eot_token or ", ".join(names)
    raise CorpusError(f"tokenizer{where} has no end-of-text token (looked for {tried}); pass eot_token= the "
                      "token that ends a document in it")


def train_bpe(texts: Iterable[str], vocab_size: int, *, length: int | None = None, progress: bool = False,
              eot_token: str = EOT_TOKEN) -> Any:
    """A byte-level BPE of ``vocab_size`` tokens (its end-of-text token ``eot_token`` included) trained on
    ``texts``: every byte is in its alphabet, so any text encodes and decodes back exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise CorpusError(f"a byte-level BPE needs a vocabulary of at least 258 tokens (256 bytes, the "
                          f"end-of-text token and one merge), not {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), special_tokens=[eot_token], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=length)
    return tok
