"""``hspmd data prepare INPUT... --out DIR`` and ``hspmd data show DIR`` (:data:`DATA`).

``prepare`` turns local text / JSON lines / parquet files into a prepared token corpus (SPEC §14,
:func:`hspmd_sdk.data.prepare`), with a given tokenizer (``--tokenizer``) or a byte-level BPE trained on the
inputs (``--train-tokenizer VOCAB``); ``show`` prints a corpus's meta, its token and document counts, and its
first tokens decoded.  Errors (:class:`~hspmd_sdk.data.CorpusError`: a missing input, a bad tokenizer, a
truncated corpus, naming the file) go through the CLI's one ``error:`` line, exit status 1.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .command import Command
from .inputs import MAX_SEED, int_in, number_above

#: Largest vocabulary ``--train-tokenizer`` accepts (uint32 ids).
MAX_VOCAB = 1 << 31

if TYPE_CHECKING:
    from ..data.corpus import TokenCorpus


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="tokenize local text / JSON lines / parquet files into a prepared corpus",
                          description="Tokenize local files into a prepared corpus directory (train.bin, val.bin, "
                                      "train.idx, val.idx, meta.json, tokenizer.json), offline, with a progress "
                                      "bar.  A text file is one document; a JSON lines or parquet file one "
                                      "document per row.")
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="text, .jsonl/.json or .parquet files, or "
                                                                 "directories of them")
    prep.add_argument("--out", required=True, metavar="DIR", help="the corpus directory to write (must not exist)")
    tok = prep.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", metavar="PATH", help="a tokenizers tokenizer.json, or a Hugging Face tokenizer "
                                                         "directory holding one")
    tok.add_argument("--train-tokenizer", type=int_in(258, MAX_VOCAB), metavar="VOCAB",
                     help="train a byte-level BPE of VOCAB tokens on the inputs (saved as DIR/tokenizer.json)")
    prep.add_argument("--eot-token", metavar="TOKEN", help="the end-of-text token appended to every document "
                                                           "(default: the tokenizer's eos token, <|endoftext|>)")
    prep.add_argument("--val-fraction", type=number_above(0.0, high=1.0), default=0.01, metavar="F",
                      help="share of the documents held out for validation (default 0.01, at least one)")
    prep.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="seed of the train/val draw (default 0)")
    prep.add_argument("--text-field", default="text", metavar="F",
                      help="the column holding the text in JSON lines / parquet inputs (default text)")
    prep.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    prep.add_argument("--no-progress", action="store_true", help="no progress bars")
    show = sub.add_parser("show", help="meta, token counts and the first tokens (decoded) of a prepared corpus",
                          description="Print a prepared corpus's meta (vocabulary, dtype, tokenizer, digest), the "
                                      "token and document counts of each split, and its first tokens decoded.")
    show.add_argument("directory", metavar="DIR", help="a prepared corpus directory")
    show.add_argument("--tokens", type=int_in(0, 1 << 20), default=48, metavar="N",
                      help="how many of the first train tokens to decode (default 48)")


def run_data(args: argparse.Namespace) -> int:
    # lazy: datasets / tokenizers are loaded only by the subcommand that needs them
    if args.data_command == "prepare":
        from ..data.corpus import TokenCorpus
        from ..data.pipeline import prepare

        out = prepare(args.inputs, args.out, tokenizer=args.tokenizer, train_tokenizer_vocab=args.train_tokenizer,
                      eot_token=args.eot_token, val_fraction=args.val_fraction, seed=args.seed,
                      text_field=args.text_field, overwrite=args.overwrite, progress=not args.no_progress)
        print(f"wrote {out}")
        print(summary(TokenCorpus(out), first_tokens=0))
        return 0
    from ..data.corpus import TokenCorpus

    print(summary(TokenCorpus(args.directory), first_tokens=args.tokens))
    return 0


def summary(corpus: "TokenCorpus", *, first_tokens: int = 48) -> str:
    """A corpus's meta and counts, one fact a line; with the first ``first_tokens`` train tokens decoded."""
    meta = corpus.meta
    tok = meta.tokenizer
    lines = [f"corpus {corpus.path}  (format {meta.format_version}, digest {meta.digest})",
             f"  vocabulary: {meta.vocab_size} tokens, stored as {meta.dtype}",
             f"  tokenizer:  {tok.source} ({tok.vocab_size} tokens, end of text {tok.eot_token!r} = {tok.eot_id})"]
    for name, split in meta.splits.items():
        lines.append(f"  {name + ':':<6}      {split.tokens:,} tokens in {split.documents:,} documents "
                     f"(largest id {split.max_token_id})")
    if first_tokens:
        ids = [int(t) for t in corpus.tokens("train")[:first_tokens]]
        lines.append(f"  first {len(ids)} tokens: {ids}")
        if (corpus.path / "tokenizer.json").is_file():
            lines.append(f"  decoded: {corpus.tokenizer().decode(ids, skip_special_tokens=False)!r}")
        else:
            lines.append(f"  decoded: (not shown: no tokenizer.json in {corpus.path})")
    return "\n".join(lines)


DATA = Command("prepare a token corpus from local text / JSON lines / parquet files, or show one", add_data_arguments,
               run_data)
