"""The ``hspmd`` entry point: the parser of every subcommand in :data:`COMMANDS`, and :func:`main`, which runs one
and turns its errors into exit statuses.

A subcommand is a :class:`~hspmd_sdk.cli.command.Command` value (help line, a function adding its arguments, the
function running it) defined in its own module and listed here by name; the function returns the exit status.
:class:`~hspmd_sdk.errors.HSPMDError` (e.g. a ``PlanValidationError``) raised by it is printed to stderr, one problem
a line as ``path: reason``, with exit status 1 and no traceback.  Any other exception is one ``error:`` line too
(``hspmd --debug ...`` shows its traceback); Ctrl-C exits 130.  Argument values are checked by their types
(:mod:`hspmd_sdk.cli.inputs`: finite numbers, bounded integers) before anything runs.
"""
from __future__ import annotations

import argparse
import sys
from types import MappingProxyType
from typing import Mapping, Sequence

from ..errors import HSPMDError, PlanValidationError
from . import checkpoint, data, plan, resolve, run, ssh, train, validate
from .command import EXIT_INTERRUPTED, Command

__all__ = ["main", "build_parser", "COMMANDS", "leave_now"]

#: Every subcommand, in the order ``hspmd --help`` lists them.
COMMANDS: Mapping[str, Command] = MappingProxyType({
    "validate": validate.VALIDATE,
    "show": validate.SHOW,
    "examples": validate.EXAMPLES_LIST,
    "demo": run.DEMO,
    "run": run.RUN,
    "resolve": resolve.RESOLVE,
    "plan": plan.PLAN,
    "simulate": plan.SIMULATE,
    "launch": ssh.LAUNCH,
    "checkpoint": checkpoint.CHECKPOINT,
    "data": data.DATA,
    "train": train.TRAIN,
})


# ---- entry point ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hspmd", description="HSPMD: heterogeneous SPMD training plans and tools")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hspmd``; returns the exit status (0 ok, 1 invalid input or error, 2 usage, 130 interrupted).

    Usage errors exit through argparse (``SystemExit(2)``, with its ``error:`` line); every other error is printed
    as ``error: ...`` on stderr, without a traceback unless ``--debug`` is given.  Run as the program itself
    (``argv`` None: the ``hspmd`` script, ``python -m hspmd_sdk.cli``) a command that loaded PyTorch leaves
    without PyTorch's teardown (:func:`leave_now`)."""
    status = _main(argv)
    if argv is None:
        leave_now(status)
    return status


def leave_now(status: int) -> None:
    """End this process with ``status`` at once when PyTorch is loaded and nothing else still runs: the exit
    handlers run (a job's kill-at-exit, a checkpoint lock's release, logging's flush), the streams are flushed,
    then ``os._exit``.  PyTorch's own teardown at interpreter exit takes 1-4 s on a busy CPU machine, a silence
    after the last line before the prompt returns.  Otherwise (no PyTorch, or a non-daemon thread that the
    interpreter would wait for) it returns and the ordinary exit follows."""
    import atexit
    import os
    import threading

    if "torch" not in sys.modules or any(t is not threading.main_thread() and t.is_alive() and not t.daemon
                                         for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("\nerror: interrupted (Ctrl-C); nothing was left running", file=sys.stderr)
        return EXIT_INTERRUPTED
    except PlanValidationError as e:
        if args.debug:
            raise
        cause = getattr(e, "cause", None)
        if cause:
            print(f"error: {cause}\ndetails (invalid {e.what}):", file=sys.stderr)
        else:
            print(f"error: invalid {e.what}:", file=sys.stderr)
        for path, reason in e.problems:
            print(f"  {path}: {reason}", file=sys.stderr)
        return 1
    except HSPMDError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a bug must still be one line, not a traceback
        if args.debug:
            raise
        text = " ".join(str(e).split())[:500]
        print(f"error: {type(e).__name__}: {text} (unexpected: rerun with --debug for the traceback and report "
              "it)", file=sys.stderr)
        return 1

