"""Cancels a launcher's Slurm allocations when the launcher dies without releasing them (issue 25).

:class:`~.slurm.SlurmTransport` starts one reaper when it first holds an allocation: ``python -m
hspmd_sdk.runtime.transports.slurm_reaper SCANCEL`` in a session of its own (a signal to the launcher's process group does
not reach it), its stdin a pipe whose only writer is the launcher.  The launcher writes one line per change:

* ``add JOBID``: an allocation was granted;
* ``drop JOBID``: the launcher cancelled it itself;
* ``close``: the transport closed (every allocation cancelled): the reaper exits and does nothing.

The end of its input without ``close`` means the launcher is gone -- killed by any signal, SIGKILL included (the
kernel closes a dead process's end of the pipe), or exited without closing the transport -- and then the reaper
cancels every job still added (``scancel``).  That ends their job steps, so the ``srun`` clients the launcher
started (sessions of their own, which outlive it) exit too, and nothing of the job is left on any node or here.

Only the standard library: it starts in a few milliseconds and imports nothing of the SDK.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Iterable, TextIO

__all__ = ["reap"]


def reap(lines: Iterable[str], scancel: str) -> list[str]:
    """Follow the launcher's ``lines``; at their end without ``close``, ``scancel`` the jobs still held.  Returns
    the job ids it cancelled (empty after ``close``)."""
    held: list[str] = []
    for line in lines:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "add" and arg and arg not in held:
            held.append(arg)
        elif cmd == "drop" and arg in held:
            held.remove(arg)
        elif cmd == "close":
            return []
    if held:
        try:
            subprocess.run([scancel, *held], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60)
        except (OSError, subprocess.SubprocessError):
            pass  # nothing left to tell: the launcher is gone
    return held


def main(argv: list[str] | None = None, stdin: TextIO | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hspmd_sdk.runtime.transports.slurm_reaper SCANCEL", file=sys.stderr)
        return 2
    reap(stdin or sys.stdin, args[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
