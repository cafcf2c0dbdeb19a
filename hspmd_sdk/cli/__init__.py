"""The ``hspmd`` command line, one package: :mod:`.entry` (the entry point: the parser, :func:`main`, the exit
statuses) and one module a group of subcommands, each a :class:`~.command.Command` value that :mod:`.entry` lists by
name:

* :mod:`.validate`: ``validate``, ``show``, ``examples``;
* :mod:`.run`: ``demo``, ``run`` (local worker processes);
* :mod:`.resolve`: ``resolve``;
* :mod:`.plan`: ``plan``, ``simulate``;
* :mod:`.ssh`: ``launch`` (SSH hosts or Slurm);
* :mod:`.checkpoint`: ``checkpoint``;
* :mod:`.data`: ``data``;
* :mod:`.train`: ``train``;

and :mod:`.inputs`, the argument types and file readers they share.  ``hspmd ...`` (the console script,
``hspmd_sdk.cli:main``) and ``python -m hspmd_sdk.cli ...`` are the same program.  Importing the package loads no
PyTorch: a subcommand imports the runtime when it runs.
"""
from __future__ import annotations

from .command import EXIT_INTERRUPTED, Command
from .inputs import describe_model, read_json, resolve_file
from .entry import COMMANDS, build_parser, leave_now, main

__all__ = ["main", "build_parser", "COMMANDS", "Command", "EXIT_INTERRUPTED", "leave_now", "describe_model",
           "resolve_file", "read_json"]
