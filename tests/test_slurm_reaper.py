"""The Slurm reaper (``hspmd_sdk.runtime.transports.slurm_reaper``) on its own: what it cancels when its launcher's pipe
ends, against a stand-in ``scancel`` that records its arguments.  The same on a real Slurm, with a launcher
SIGKILLed while its job runs: tests/test_slurm.py."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hspmd_sdk.runtime.transports.slurm_reaper import reap


def _fake_scancel(tmp: Path) -> tuple[str, Path]:
    log = tmp / "scancel.log"
    exe = tmp / "scancel"
    exe.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    exe.chmod(0o755)
    return str(exe), log


@pytest.mark.timeout(30)
def test_the_jobs_still_held_are_cancelled_when_the_pipe_ends_without_close(tmp_path: Path) -> None:
    exe, log = _fake_scancel(tmp_path)
    assert reap(["add 11\n", "add 12\n", "add 13\n", "drop 12\n", "add 11\n"], exe) == ["11", "13"]
    assert log.read_text() == "11 13\n"


@pytest.mark.timeout(30)
def test_close_cancels_nothing_and_nothing_held_runs_no_scancel(tmp_path: Path) -> None:
    exe, log = _fake_scancel(tmp_path)
    assert reap(["add 11\n", "close\n", "add 12\n"], exe) == []
    assert reap(["add 5\n", "drop 5\n"], exe) == []
    assert not log.exists()


@pytest.mark.timeout(30)
def test_the_reaper_process_cancels_when_its_writer_is_killed(tmp_path: Path) -> None:
    """A writer process (standing in for the launcher) adds two jobs to a reaper it starts in a session of its own,
    then is SIGKILLed: the reaper sees its input end and runs scancel with both."""
    exe, log = _fake_scancel(tmp_path)
    writer = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
r = subprocess.Popen([sys.executable, "-m", "hspmd_sdk.runtime.transports.slurm_reaper", {exe!r}], stdin=subprocess.PIPE,
                     text=True, start_new_session=True)
r.stdin.write("add 7\\nadd 8\\n"); r.stdin.flush()
print(r.pid, flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    reaper = int(writer.stdout.readline())
    writer.kill()
    writer.wait()
    for _ in range(200):
        if log.exists() and not Path(f"/proc/{reaper}").exists():
            break
        time.sleep(0.05)
    assert log.read_text() == "7 8\n"
