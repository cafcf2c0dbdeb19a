"""Faults that name their culprit and never hang (local workers): heartbeats, stalls, the control channel,
failure policies, a failing log disk, and resource lifetime.

Every test is bounded (``pytest.mark.timeout``) and uses short heartbeats (0.2 s, so a rank is lost after 2 s of
silence) with generous margins on what it asserts, for a loaded 2-core machine.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pytest
from _procs import assert_no_workers_left, group_members, wait_for

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.errors import RuntimeFailure
from hspmd_sdk.runtime import JobStatus, launch
from hspmd_sdk.runtime.control.faults import Failure, Reaction
from hspmd_sdk.runtime.control.job import LogDirError
from hspmd_sdk.runtime.workers.liveness import Heartbeat, in_communication
from hspmd_sdk.runtime.protocol import Channel, decode

SELFTEST = "hspmd_sdk.testing.entries"
FAST = {"heartbeat_s": 0.2, "stall_s": 2.0, "timeout_s": 120}


def collective_loop(world: int = 2, **payload):
    return launch(cluster=Cluster.local(world), entry=f"{SELFTEST}:hang_on_rank", steps=100_000,
                  payload={"rank": -1, **payload}, **FAST)


# ---- the launcher -> worker channel ---------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_control_messages_reach_all_or_some_ranks_in_order() -> None:
    job = launch(cluster=Cluster.local(3), entry=f"{SELFTEST}:echo_control", steps=1, **FAST)
    wait_for(lambda: all(job.metrics.rank(r) for r in range(3)))
    job._send_control({"n": 1})
    job._send_control({"n": 2, "text": "only rank 1 \u00e9"}, ranks=[1])
    job._send_control({"n": 3}, ranks=[0, 2])
    with pytest.raises(KeyError, match=r"ranks \[7\] are not in job"):
        job._send_control({"n": 4}, ranks=[7])
    with pytest.raises(TypeError):
        job._send_control({"n": object()})
    job._send_control({"stop": True})
    result = job.wait(timeout=60)
    got = {r: result.results[r]["messages"] for r in range(3)}
    assert got[1] == [{"n": 1}, {"n": 2, "text": "only rank 1 \u00e9"}, {"stop": True}]
    assert got[0] == got[2] == [{"n": 1}, {"n": 3}, {"stop": True}]
    assert 'control: {"n": 3}' in job.logs(2)


# ---- hung ranks -----------------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_a_stopped_rank_is_named_with_its_stack_not_a_waiting_peer(tmp_path: Path) -> None:
    job = collective_loop(3)
    pgids = list(job.pids().values())
    wait_for(lambda: job.metrics.last_step() >= 5)
    os.kill(job.pids()[1], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure) as info:
        job.wait(timeout=60)
    took = time.monotonic() - t0
    err = info.value
    assert err.rank == 1, str(err)
    assert "rank 1 hung: no heartbeat" in str(err) and "stopped, frozen" in str(err)
    assert took < 20, f"named after {took:.1f} s (silence limit 2 s)"
    assert "stack (faulthandler) of rank 1" in str(err)
    assert "most recent call first" in err.traceback and "hang_on_rank" in err.traceback
    first = job.first_failure()
    assert first is not None and first.kind == "hung" and first.ranks == (1,)
    assert job.status is JobStatus.FAILED
    assert_no_workers_left(pgids)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["sleep", "spin"])
def test_a_rank_out_of_communication_while_peers_wait_is_the_culprit(how: str) -> None:
    job = launch(cluster=Cluster.local(3), entry=f"{SELFTEST}:hang_on_rank", steps=100_000,
                 payload={"rank": 2, "step": 3, "how": how}, **FAST)
    pgids = list(job.pids().values())
    wait_for(lambda: "hangs" in job.logs(2))
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure) as info:
        job.wait(timeout=60)
    took = time.monotonic() - t0
    err = info.value
    assert err.rank == 2, str(err)
    assert "has not entered communication" in str(err) and "ranks [0, 1] have waited in communication" in str(err)
    assert took < 25, f"named after {took:.1f} s (stall_s 2 s, collective timeout 120 s)"
    assert "hang_on_rank" in err.traceback  # the culprit's own stack, where it hangs
    assert_no_workers_left(pgids)


@pytest.mark.timeout(60)
def test_busy_collectives_are_not_a_stall() -> None:
    """Back-to-back all-reduces for many stall periods: everyone is in and out of communication all the time and
    steps progress, so nobody may be named."""
    job = launch(cluster=Cluster.local(2), entry=f"{SELFTEST}:hang_on_rank", steps=150,
                 payload={"rank": -1, "pause": 0.0}, heartbeat_s=0.1, stall_s=0.5, timeout_s=60)
    result = job.wait(timeout=50)
    assert len(result.losses) == 150 and job.failures == []


def test_heartbeat_samples_communication_from_the_stack() -> None:
    """A thread blocked in a C-level ``work.wait()`` (as on torch's async work) is in communication; one blocked
    in the very same C function under another name is not, nor is plain Python."""
    import functools
    import sys
    import types

    work = types.SimpleNamespace(wait=functools.partial(time.sleep, 1.0))

    def waiter() -> None:
        work.wait()

    def sleeper() -> None:
        time.sleep(1.0)

    threads = [threading.Thread(target=f, daemon=True) for f in (waiter, sleeper)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    frames = sys._current_frames()
    assert in_communication(frames[threads[0].ident])
    assert not in_communication(frames[threads[1].ident])
    assert not in_communication(sys._getframe())
    r, w = os.pipe()
    beat = Heartbeat(Channel(w, rank=0), 0.05, main=threads[0])
    first = beat.sample()
    assert first["comm_s"] is not None and first["busy_s"] is None
    assert Heartbeat(Channel(w, rank=0), 0.05, main=threads[1]).sample()["comm_s"] is None
    for t in threads:
        t.join()
    os.close(r)
    os.close(w)


# ---- failure policies -----------------------------------------------------------------------------------------
class Recorder:
    """A policy that records every failure and lets the other ranks finish (the seam an elastic job uses)."""

    def __init__(self) -> None:
        self.seen: list[Failure] = []

    def on_failure(self, job, failure: Failure) -> Reaction:
        self.seen.append(failure)
        return Reaction.CONTINUE


@pytest.mark.timeout(60)
def test_a_custom_policy_sees_typed_failures_and_lets_the_others_finish() -> None:
    policy = Recorder()
    job = launch(cluster=Cluster.local(3), entry=f"{SELFTEST}:fail_alone", steps=3,
                 payload={"rank": 1, "steps_each": 4, "pause": 0.2}, policy=policy, **FAST)
    result = job.wait(timeout=45)
    assert job.status is JobStatus.SUCCEEDED
    assert [(f.kind, f.ranks, f.returncode) for f in policy.seen] == [("exited", (1,), 7)]
    assert result.failures == policy.seen and job.failures == policy.seen
    assert result.results[0] == result.results[2] == {"done": True} and result.results[1] == {}
    assert [m.step for m in result.metrics[2]] == [0, 1, 2, 3]


class DropHung(Recorder):
    """Stops a hung rank itself and lets the others go on (what an elastic policy does first)."""

    def on_failure(self, job, failure: Failure) -> Reaction:
        super().on_failure(job, failure)
        if failure.kind == "hung":
            job.stop_ranks(failure.ranks)
        return Reaction.CONTINUE


@pytest.mark.timeout(60)
def test_a_policy_can_stop_a_hung_rank_and_let_the_others_finish() -> None:
    policy = DropHung()
    # 4 s of work per rank: rank 1 is stopped long before it could finish, also when the test runs late (it once
    # finished its 1 s of work before the SIGSTOP arrived on a loaded machine)
    job = launch(cluster=Cluster.local(3), entry=f"{SELFTEST}:fail_alone", steps=3, policy=policy,
                 payload={"rank": -1, "steps_each": 40, "pause": 0.1}, **FAST)
    wait_for(lambda: all(job.metrics.rank(r) for r in range(3)))
    os.kill(job.pids()[1], signal.SIGSTOP)
    result = job.wait(timeout=45)
    assert job.status is JobStatus.SUCCEEDED
    assert [(f.kind, f.ranks) for f in policy.seen] == [("hung", (1,))]
    assert "most recent call first" in policy.seen[0].traceback
    assert result.results[0] == result.results[2] == {"done": True} and result.results[1] == {}
    assert "stopped by the launcher" in job.logs(1)


@pytest.mark.timeout(60)
def test_the_default_policy_stops_everyone_and_a_signal_is_typed() -> None:
    job = launch(cluster=Cluster.local(2), entry=f"{SELFTEST}:fail_on_rank", steps=1000,
                 payload={"rank": 1, "step": 2, "how": "kill"}, **FAST)
    with pytest.raises(RuntimeFailure, match="rank 1 exited with status -9"):
        job.wait(timeout=45)
    first = job.first_failure()
    assert first is not None and first.kind == "exited" and first.signal == "SIGKILL"


# ---- the disk -------------------------------------------------------------------------------------------------
@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A 24 KiB tmpfs (root only): a disk that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.timeout(90)
def test_a_full_log_disk_degrades_to_a_warning_and_the_job_finishes(tiny_tmpfs: Path, capfd) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job = launch(cluster=Cluster.local(2), entry=f"{SELFTEST}:allreduce_check", steps=40, log_dir=tiny_tmpfs,
                     payload={"blob": "x"}, **FAST)
        result = job.wait(timeout=60)
    assert job.status is JobStatus.SUCCEEDED and len(result.losses) == 40
    assert "step 39: collectives done on rank 1" in job.logs(1)  # the logs are whole in memory
    text = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len([t for t in text if "cannot write its logs" in t]) == 1, text
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.timeout(90)
def test_a_full_log_disk_does_not_hide_a_failure(tiny_tmpfs: Path) -> None:
    (tiny_tmpfs / "filler").write_bytes(b"x" * 20_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job = launch(cluster=Cluster.local(2), entry=f"{SELFTEST}:fail_on_rank", steps=1000, log_dir=tiny_tmpfs,
                     payload={"rank": 1, "step": 30}, **FAST)
        with pytest.raises(RuntimeFailure, match="deliberate failure on rank 1") as info:
            job.wait(timeout=60)
    assert "log files incomplete" in str(info.value)


@pytest.mark.timeout(30)
def test_a_read_only_log_dir_is_an_error_before_any_worker(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=16k", "tmpfs", str(ro)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(LogDirError, match="Read-only file system"):
            launch(cluster=Cluster.local(2), entry=f"{SELFTEST}:allreduce_check", steps=1, log_dir=ro)
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


@pytest.mark.timeout(30)
def test_an_unwritable_log_dir_is_an_error_before_any_worker(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    before = set(os.listdir("/proc"))
    with pytest.raises(LogDirError, match="cannot write the job's logs in .*Nothing was started"):
        launch(cluster=Cluster.local(2), entry=f"{SELFTEST}:allreduce_check", steps=1, log_dir=blocker / "logs")
    started = [p for p in set(os.listdir("/proc")) - before if p.isdigit()]
    for p in started:
        try:
            assert "hspmd_sdk.runtime.workers.worker" not in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            pass


# ---- resource lifetime ----------------------------------------------------------------------------------------
def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def hspmd_threads() -> list[str]:
    """The SDK's threads of jobs (the fork server's reader lives as long as the launching process, like the server)."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("hspmd") and t.name != "hspmd-forkserver")


def settle(timeout: float = 10.0) -> None:
    """Wait until the SDK's threads of finished jobs have ended (their last step runs after ``wait()``)."""
    deadline = time.monotonic() + timeout
    while hspmd_threads() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_twenty_local_launches_leave_fds_and_threads_where_they_started() -> None:
    def one(ok: bool = True) -> None:
        """A job that succeeds, or one whose entry fails at once (the failure path releases everything too)."""
        entry = f"{SELFTEST}:fail_alone" if ok else "no_such_module_hspmd:entry"
        job = launch(cluster=Cluster.local(1), entry=entry, steps=1,
                     payload={"rank": -1, "steps_each": 1, "pause": 0.0}, **FAST)
        if ok:
            assert job.wait(timeout=60).results[0] == {"done": True}
        else:
            with pytest.raises(RuntimeFailure, match="cannot import module"):
                job.wait(timeout=60)
        jobs.append(job)  # kept alive: nothing may depend on garbage collection to be released

    jobs: list = []
    one()  # warm-up: imports, lazily created pools
    settle()
    fds, threads = open_fds(), threading.active_count()
    for _ in range(4):  # 20 launches, five at a time, one of each five succeeding
        batch = [threading.Thread(target=one, args=(i == 0,)) for i in range(5)]
        for t in batch:
            t.start()
        for t in batch:
            t.join()
    assert len(jobs) == 21
    settle()
    assert hspmd_threads() == [] and threading.active_count() == threads, [t.name for t in threading.enumerate()]
    assert open_fds() == fds


def test_log_lines_after_the_end_are_ignored_quietly(capfd) -> None:
    """A late line (a host whose start failed reports its exits after the job ended) is not written to a
    closed file and prints no traceback."""
    job = launch(cluster=Cluster.local(1), entry=f"{SELFTEST}:fail_alone", steps=1,
                 payload={"rank": -1, "steps_each": 1, "pause": 0.0}, **FAST)
    job.wait(timeout=60)
    job._on_line(0, "err", "late line")
    job._on_exit(0, 0)
    assert "I/O operation on closed file" not in capfd.readouterr().err


def test_beats_are_protocol_messages() -> None:
    r, w = os.pipe()
    beat = Heartbeat(Channel(w, rank=4), 0.05).start()
    time.sleep(0.3)
    beat.stop()
    beat.thread.join()
    os.close(w)
    with os.fdopen(r) as f:
        msgs = [decode(line.rstrip("\n")) for line in f]
    assert len(msgs) >= 2 and all(m["t"] == "beat" and m["rank"] == 4 for m in msgs)
    assert all((m["comm_s"] is None) != (m["busy_s"] is None) for m in msgs)


def test_a_jobs_logs_hold_a_bounded_number_of_files_open(tmp_path: Path) -> None:
    """Thousands of ranks, a bounded number of open files (1,024 open rank logs put the launcher's descriptors
    past select()'s limit: the planners' solvers failed while an elastic job of 1,024 ranks replanned): every rank
    has its log file from the start, at most OPEN_RANK_LOGS are open, a rank's lines land in its file in order
    however often it was closed between them, in batches (every FLUSH_S, and at the end)."""
    from hspmd_sdk.runtime.control.job import FLUSH_S, OPEN_RANK_LOGS, _Logs

    before = len(os.listdir("/proc/self/fd"))
    logs = _Logs(tmp_path, range(300), "j")
    assert sorted(p.name for p in tmp_path.glob("rank*.log")) == sorted(f"rank{r}.log" for r in range(300))
    for rnd in range(2):
        for r in range(300):
            logs.write(r, f"line {rnd} of {r}")
        logs.flush()  # (also done every FLUSH_S by a thread of its own)
        assert len(os.listdir("/proc/self/fd")) - before <= OPEN_RANK_LOGS + 1  # + job.log
    logs.write(7, "not yet in the file")
    assert (tmp_path / "rank7.log").read_text() == "line 0 of 7\nline 1 of 7\n"  # 7 was closed, written out
    time.sleep(3 * FLUSH_S)
    assert (tmp_path / "rank7.log").read_text().endswith("not yet in the file\n")  # the thread wrote it
    logs.write(None, "done")
    logs.add([300])
    logs.write(300, "a newcomer")
    logs.close()
    assert len(os.listdir("/proc/self/fd")) <= before
    assert (tmp_path / "rank7.log").read_text() == "line 0 of 7\nline 1 of 7\nnot yet in the file\n"
    assert (tmp_path / "rank300.log").read_text() == "a newcomer\n"
    assert (tmp_path / "job.log").read_text().splitlines()[-2:] == ["[job] done", "[rank 300] a newcomer"]
