"""``hspmd checkpoint show DIR`` and ``hspmd checkpoint export DIR --hf OUT`` (:data:`CHECKPOINT`).

``DIR`` is a checkpoint root (its latest complete checkpoint) or one ``step-NNNNNNNN`` directory.  ``show`` prints
the step, the model, the strategy it was saved under, the data position, the bytes each rank wrote and the
integrity check (every file, header and checksum; ``--no-verify`` skips it); ``export`` writes the parameters as a
Hugging Face model directory.  Errors (:class:`~.runtime.checkpoint_io.CheckpointError`: a missing, truncated or corrupted
shard, naming the file and the tensor) go through the CLI's one ``error:`` line, exit status 1.
"""
from __future__ import annotations

import argparse

from .command import Command
from .inputs import int_in


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="step, model, strategy, size per rank and integrity of a checkpoint",
                          description="Print a checkpoint's step, model, strategy, data position, size per rank "
                                      "and integrity (every file, header and checksum checked).")
    show.add_argument("directory", metavar="DIR", help="a checkpoint root (its latest checkpoint) or a step directory")
    show.add_argument("--no-verify", action="store_true", help="skip reading the files (integrity not checked)")
    export = sub.add_parser("export", help="write a checkpoint's parameters as a Hugging Face model directory",
                            description="Write the parameters of a checkpoint as a Hugging Face model directory "
                                        "(config.json + model.safetensors) that transformers loads.")
    export.add_argument("directory", metavar="DIR", help="a checkpoint root (its latest checkpoint) or a step directory")
    export.add_argument("--hf", required=True, metavar="OUT", help="the Hugging Face directory to write")


def add_training_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    """``--checkpoint-dir``, ``--checkpoint-every``, ``--resume-from`` for ``hspmd run`` and ``hspmd launch``."""

    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save sharded checkpoints here (after the last step, and every --checkpoint-every steps); "
                        "with --elastic, state no survivor holds is reloaded from the newest one")
    g.add_argument("--checkpoint-every", type=int_in(1, 10**9), default=None, metavar="K")
    g.add_argument("--resume-from", default=None, metavar="DIR",
                   help="continue from the newest complete checkpoint in DIR, under this strategy (any plan)")


def training_checkpoint_options(args: argparse.Namespace) -> dict[str, object]:
    """The ``launch`` keywords of :func:`add_training_checkpoint_arguments`."""
    return {"checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every,
            "resume_from": args.resume_from}


def run_checkpoint(args: argparse.Namespace) -> int:
    # lazy: the checkpoint reader, not loaded at `hspmd --help`
    from ..runtime.checkpoints.checkpoint import load_checkpoint

    if args.checkpoint_command == "show":
        verify = not args.no_verify
        ck = load_checkpoint(args.directory, verify=verify)
        print(ck.summary(verified=verify))
        return 0
    ck = load_checkpoint(args.directory)
    out = ck.to_hf(args.hf)
    print(f"wrote {out} (Hugging Face {ck.model.family} model, step {ck.step} of {ck.path})")
    return 0


CHECKPOINT = Command("show a sharded checkpoint (step, model, strategy, sizes, integrity) or export it to Hugging "
                     "Face", add_checkpoint_arguments, run_checkpoint)
