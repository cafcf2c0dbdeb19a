"""The control-plane harness (issue 45 item 2, ``benchmarks/bench_control.py``): the real launcher, job and
controller against simulated workers that speak the real protocol (``benchmarks/sim_workers.py``,
``benchmarks/sim_host.py``), many in one process, no torch work.  Here at 64 ranks on 8 hosts in 2 simulated host
processes (the benchmark runs the same at 1,024 ranks and more)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_control import run_world  # noqa: E402


@pytest.mark.timeout(240)
def test_a_simulated_job_launches_switches_and_recovers_from_a_lost_worker_with_nothing_left() -> None:
    row = run_world(64, processes=2, step_s=0.3, steps=300)
    assert row["status"] == "succeeded" and row["sim_hosts_left"] == 0  # stopped, every simulated worker gone
    assert row["hosts"] == 8 and row["ready_s"] >= row["launch_s"] > 0
    # every rank got its own launch line with its part, all of one stage shape: the same size
    launch = row["launch_bytes"]
    assert launch["messages"] == 64 and launch["max"] <= 1.05 * launch["mean"]
    # the user switch reached every rank as its parts, and every rank applied it
    assert row["switch_bytes"]["messages"] == 64 and row["switch"]["done_s"] >= row["switch"]["call_s"]
    # the lost rank was detected and a recovery decided; each survivor got its own parts, none the whole Program
    failure = row["failure"]
    assert failure["failed_ranks"] == [64 // 2 + 3] and failure["survivors"] == 63
    assert failure["whole_messages"] == 0 and row["reconfigure_bytes"]["messages"] == 63
    assert 0 < failure["detect_s"] < 5 and failure["done_s"] >= failure["sent_s"] > 0
