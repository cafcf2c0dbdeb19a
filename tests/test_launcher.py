"""The launcher: real worker processes on gloo, streamed metrics and logs, failures, cancel, interrupts.

Worlds are 2-4 processes (the test machine may have 2 cores); the entries are the diagnostic ones in
``hspmd_sdk.testing.entries``.  Expected values are computed here, independently of the workers.
"""
from __future__ import annotations

import _thread
import io
import os
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest

import _procs
from _procs import group_members

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.errors import HSPMDError, RuntimeFailure
from hspmd_sdk.runtime import JobCancelled, JobStatus, LaunchSpec, backend_for, build_spec, launch, launch_spec
from hspmd_sdk.runtime.control.job import Failure
from hspmd_sdk.runtime.control.progress import LineProgress
from hspmd_sdk.runtime.protocol import Channel, LineWriter, decode, encode, is_collateral

SELFTEST = "hspmd_sdk.testing.entries"
assert_no_workers_left = partial(_procs.assert_no_workers_left, within=3.0)
wait_for = partial(_procs.wait_for, timeout=30.0)


# ---- real jobs ------------------------------------------------------------------------------------------------
def test_four_rank_collectives_metrics_and_logs(tmp_path: Path) -> None:
    world, steps = 4, 2
    job = launch(cluster=Cluster.local(world), entry=f"{SELFTEST}:allreduce_check", steps=steps, seed=3,
                 slowdown={1: 2.0}, log_dir=tmp_path, timeout_s=60, payload={"blob": "x" * 300_000})
    result = job.wait(timeout=60)
    assert job.status is JobStatus.SUCCEEDED
    groups = [[0, 1], [2, 3], [1, 2], [0, 1, 2]]
    for r in range(world):
        res = result.results[r]
        assert res["world_sum"] == sum(q + 1 for q in range(world))
        assert res["gathered"] == [float(q) for q in range(world)]
        assert res["reduce_scatter"] == sum(q + 1 for q in range(world))
        assert res["ring_recv"] == (r - 1) % world
        assert res["group_sums"] == {",".join(map(str, g)): float(sum(q + 1 for q in g)) for g in groups if r in g}
    assert all(result.results[r]["payload_bytes"] > 300_000 for r in range(world))  # the spec travelled whole
    assert result.losses == [10.0, 5.0]  # world_sum / (step + 1), reported by rank 0
    for r in range(world):
        assert [m.step for m in result.metrics[r]] == [0, 1]
        assert all(m.memory_mb and m.memory_mb > 0 for m in result.metrics[r])
    assert result.metrics[1][0].emulated_slowdown == 2.0 and result.metrics[0][0].emulated_slowdown is None
    assert result.emulation == {1: 2.0}
    # logs: print(), writes to fd 1 (redirected to stderr), emulation banner; one file per rank + job.log
    logs1 = job.logs(1)
    assert "step 1: collectives done on rank 1" in logs1 and "fd1 line from rank 1" in logs1
    assert "EMULATION: rank 1 emulates a device 2x slower" in logs1
    assert "step 0: collectives done on rank 0" not in logs1
    assert "fd1 line from rank 3" in (tmp_path / "rank3.log").read_text()
    joblog = (tmp_path / "job.log").read_text().splitlines()
    assert "[rank 2] step 0: collectives done on rank 2" in joblog
    assert all(line.startswith("[rank ") for line in joblog)
    assert_no_workers_left(list(job.pids().values()))


def test_failure_names_first_rank_with_traceback_and_stops_everyone(tmp_path: Path) -> None:
    job = launch(cluster=Cluster.local(4), entry=f"{SELFTEST}:fail_on_rank", steps=50, log_dir=tmp_path,
                 payload={"rank": 2, "step": 1}, timeout_s=60)
    pgids = list(job.pids().values())
    wait_for(lambda: job.metrics.last_step() >= 0)  # running
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure) as info:
        job.wait(timeout=60)
    assert time.monotonic() - t0 < 10
    err = info.value
    assert err.rank == 2
    assert "ValueError: deliberate failure on rank 2 at step 1" in err.traceback
    assert "fail_on_rank" in err.traceback and "Traceback (most recent call last)" in err.traceback
    assert "rank 2" in str(err) and str(tmp_path) in str(err)
    assert job.status is JobStatus.FAILED
    assert_no_workers_left(pgids)


def test_a_rank_killed_by_a_signal_is_the_failure_not_its_peers() -> None:
    job = launch(cluster=Cluster.local(2), entry=f"{SELFTEST}:fail_on_rank", steps=50,
                 payload={"rank": 1, "step": 1, "how": "kill"}, timeout_s=60)
    pgids = list(job.pids().values())
    with pytest.raises(RuntimeFailure, match="rank 1 exited with status -9") as info:
        job.wait(timeout=60)
    assert info.value.rank == 1
    assert "about to fail (kill)" in info.value.traceback  # the tail of its stderr
    assert_no_workers_left(pgids)


def test_cancel_mid_run_leaves_no_process_not_even_children() -> None:
    job = launch(cluster=Cluster.local(2), entry=f"{SELFTEST}:sleep_forever", steps=1, payload={"child": True})
    pgids = list(job.pids().values())
    wait_for(lambda: job.metrics.last_step() >= 0 and "child pid" in job.logs(1))
    child = int(job.logs(1).split("child pid ")[1].split()[0])
    assert child in group_members(pgids)
    job.cancel()
    assert job.status is JobStatus.CANCELLED
    with pytest.raises(JobCancelled):
        job.wait()
    assert_no_workers_left(pgids)


def test_a_child_left_behind_by_a_finished_worker_is_stopped() -> None:
    job = launch(cluster=Cluster.local(1), entry=f"{SELFTEST}:leave_child", steps=1)
    pgids = list(job.pids().values())
    result = job.wait(timeout=60)
    assert result.losses == [1.0]
    assert result.results[0]["child"] not in group_members(pgids)
    assert_no_workers_left(pgids)


def test_keyboard_interrupt_in_wait_cancels_the_job() -> None:
    job = launch(cluster=Cluster.local(2), entry=f"{SELFTEST}:sleep_forever", steps=1)
    pgids = list(job.pids().values())
    wait_for(lambda: job.metrics.last_step() >= 0)
    threading.Timer(0.3, _thread.interrupt_main).start()  # what the notebook's stop button does
    with pytest.raises(KeyboardInterrupt):
        job.wait(timeout=30)
    assert job.status is JobStatus.CANCELLED
    assert_no_workers_left(pgids)


def test_bad_entry_is_reported_with_its_rank() -> None:
    job = launch(cluster=Cluster.local(2), entry="hspmd_sdk.testing.entries:no_such_entry", steps=1)
    with pytest.raises(RuntimeFailure, match="has no function 'no_such_entry'") as info:
        job.wait(timeout=30)
    assert info.value.rank in (0, 1)


def test_workers_exit_when_the_launcher_dies(tmp_path: Path) -> None:
    script = (f"import sys, time\nfrom hspmd_sdk.core.cluster import Cluster\nfrom hspmd_sdk.runtime import launch\n"
              f"job = launch(cluster=Cluster.local(2), entry='{SELFTEST}:sleep_forever', steps=1)\n"
              "while job.metrics.last_step() < 0: time.sleep(0.05)\n"
              "print(*job.pids().values(), flush=True)\ntime.sleep(120)\n")
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pgids = [int(p) for p in launcher.stdout.readline().split()]
        assert len(pgids) == 2
        launcher.kill()  # SIGKILL: no cleanup runs in the launcher
        launcher.wait()
        assert_no_workers_left(pgids, within=20)
    finally:
        launcher.kill()


# ---- in-process pieces ----------------------------------------------------------------------------------------
def test_protocol_round_trip_and_raw_lines() -> None:
    line = encode("metric", 3, step=2, loss=1.5)
    assert line.endswith("\n") and line.count("\n") == 1
    msg = decode(line.rstrip("\n"))
    assert msg is not None and msg["t"] == "metric" and msg["rank"] == 3 and msg["loss"] == 1.5
    assert decode("plain text") is None and decode("@hspmd {not json") is None


def test_line_writer_sends_whole_lines(tmp_path: Path) -> None:
    r, w = os.pipe()
    writer = LineWriter(Channel(w, rank=5), "stdout")
    writer.write("par")
    writer.write("tial\nsecond line\nrest")
    writer.flush()
    os.close(w)
    with os.fdopen(r) as f:
        msgs = [decode(line.rstrip("\n")) for line in f]
    assert [m["text"] for m in msgs] == ["partial", "second line", "rest"]
    assert {m["rank"] for m in msgs} == {5}


def test_collateral_errors_rank_below_the_genuine_one() -> None:
    gloo = "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:50882: Connection reset by peer."
    assert is_collateral(gloo) and not is_collateral("ValueError: shapes (3,) and (4,) differ")
    early_collateral = Failure(0, gloo, "", True, time=1.0)
    genuine = Failure(2, "ValueError: x", "tb", False, time=2.0)
    assert min([early_collateral, genuine], key=Failure.sort_key) is genuine


def test_spec_validation_and_json_round_trip() -> None:
    spec = build_spec(Cluster.local(2), entry=f"{SELFTEST}:allreduce_check", steps=3, seed=4,
                      payload={"x": [1, 2]}, slowdown={1: 3})
    assert spec.backend == "gloo" and spec.master_addr == "127.0.0.1" and spec.world_size == 2
    assert LaunchSpec.from_line(spec.to_line()) == spec
    with pytest.raises(ValueError, match="slowdown"):
        LaunchSpec.model_validate(spec.model_dump() | {"slowdown": {5: 2.0}})
    with pytest.raises(ValueError, match="entry"):
        LaunchSpec.model_validate(spec.model_dump() | {"entry": "no-colon"})
    assert backend_for(["H800", "H20"]) == "nccl"
    with pytest.raises(ValueError, match="both CPU and GPU"):
        backend_for(["cpu", "H20"])


def test_remote_hosts_need_a_transport() -> None:
    cluster = Cluster.load(
        {"nodes": [{"host": "gpu-a", "kind": "cpu", "ranks": [0]}, {"host": "gpu-b", "kind": "cpu", "ranks": [1]}]})
    spec = build_spec(cluster, entry=f"{SELFTEST}:allreduce_check", local=False)
    assert spec.master_addr == "gpu-a"
    with pytest.raises(HSPMDError, match=r"hosts \['gpu-a', 'gpu-b'\] are not this machine"):
        launch_spec(spec, cluster)
    with pytest.raises(HSPMDError, match="transport=LocalTransport()"):
        launch(cluster=Cluster.mixed({"H800": 2, "H20": 2}, per_node=2), entry=f"{SELFTEST}:allreduce_check",
               steps=1)
    local = build_spec(Cluster.mixed({"H800": 2, "H20": 2}, per_node=2), entry="m:f", backend="gloo")
    assert local.hosts == ["localhost"] * 4 and local.devices == ["H800", "H800", "H20", "H20"]


def test_line_progress_renders_in_place() -> None:
    buf = io.StringIO()
    bar = LineProgress(4, "job", stream=buf, width=8, tty=True)
    bar.update(2, "loss 1.0")
    bar.close("succeeded")
    out = buf.getvalue()
    assert "\rjob [####....] 2/4 loss 1.0" in out and out.endswith("[succeeded]\n")


def test_line_progress_writes_plain_lines_to_a_pipe() -> None:
    """Piped or logged (not a terminal: a StringIO says so), every update is a line of its own: no carriage return
    piles the updates onto one line."""
    buf = io.StringIO()
    bar = LineProgress(4, "job", stream=buf, width=8)
    bar.update(1, "loss 2.0")
    bar.note("reconfigured (user): step 2")
    bar.update(4, "loss 1.0")
    bar.close("succeeded")
    out = buf.getvalue()
    assert "\r" not in out
    assert out.splitlines() == ["job [##......] 1/4 loss 2.0", "reconfigured (user): step 2",
                                "job [########] 4/4 loss 1.0", "job [########] 4/4 loss 1.0 [succeeded]"]
