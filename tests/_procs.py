"""Helpers the process-level tests share: which worker processes are still alive, and waiting for a condition."""
from __future__ import annotations

import os
import time
from pathlib import Path


def group_members(pgids: list[int]) -> list[int]:
    """Pids of live (non-zombie) processes whose process group is one of ``pgids`` (read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        state, pgrp = fields[0], int(fields[2])
        if pgrp in pgids and state != "Z":
            found.append(int(entry))
    return found


def assert_no_workers_left(pgids: list[int], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while group_members(pgids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(pgids) == [], "worker processes were left behind"


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)
