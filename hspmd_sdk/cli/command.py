"""A subcommand of ``hspmd`` as a value, and the exit status every subcommand shares.

Each subcommand's module defines its :class:`Command` (``VALIDATE = Command(help, add_arguments, run)``);
:mod:`hspmd_sdk.cli.entry` lists them, by name, in :data:`~hspmd_sdk.cli.entry.COMMANDS`.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Command", "EXIT_INTERRUPTED"]

#: Exit status after Ctrl-C (128 + SIGINT, what shells report).
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class Command:
    """One subcommand: its help line, a function adding its arguments, and the function running it (which returns
    the exit status)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], Any]
    run: Callable[[argparse.Namespace], int]
