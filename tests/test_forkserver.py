"""The fork server (``hspmd_sdk.runtime.transports.forkserver``): local CPU workers forked from a process that imported torch
once are still workers of their own -- own session and process group, the launch's environment and working
directory, an entry module written after the server started, exit statuses as ``subprocess`` reports them -- and
nothing outlives the launcher.  Without the server (``fork=False``, ``HSPMD_FORK_SERVER=0``) workers start afresh."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hspmd_sdk import Cluster
from hspmd_sdk.runtime import launch
from hspmd_sdk.runtime.transports import forkserver
from hspmd_sdk.runtime.transports.transport import LocalTransport

sys.path.insert(0, str(Path(__file__).parent))
from _procs import wait_for  # noqa: E402

FAST = {"heartbeat_s": 0.2, "stall_s": 5.0, "timeout_s": 60}
PROBE = '''
import os, sys, torch.distributed as dist

def probe(state, spec):
    dist.barrier()
    return {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
            "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"), "rank_env": os.environ.get("RANK"),
            "cmdline": open("/proc/self/cmdline", "rb").read().decode().rstrip("\\0").split("\\0"),
            "comm": open("/proc/self/comm").read().strip(), "threads": len(os.listdir("/proc/self/task"))}
'''


def _probe_module(tmp_path: Path, name: str) -> Path:
    """An entry module written now: a server started earlier has never seen it."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PROBE))
    return tmp_path


def _run(tmp_path: Path, name: str, transport: LocalTransport, world: int = 2) -> dict:
    job = launch(cluster=Cluster.local(world), entry=f"{name}:probe", steps=1, transport=transport,
                 log_dir=tmp_path / f"logs_{name}", **FAST)
    return job.wait(timeout=60).results


@pytest.mark.timeout(120)
def test_forked_workers_are_workers_of_their_own_with_the_launch_environment(tmp_path: Path) -> None:
    cwd = _probe_module(tmp_path, "probe_forked")
    results = _run(tmp_path, "probe_forked", LocalTransport(cwd=str(cwd), env={"PROBE_VALUE": "forked"}))
    server = forkserver.server_for(sys.executable, dict(os.environ))
    assert server is not None and server.alive
    for rank, r in results.items():
        assert r["ppid"] == server.proc.pid  # forked by the server ...
        assert r["pid"] == r["pgid"] == r["sid"]  # ... yet the leader of its own session and process group
        assert r["cwd"] == str(cwd) and r["env"] == "forked" and r["rank_env"] == str(rank)
        # ps (and a search for worker processes) sees a fresh worker's command line, not the server's
        assert r["cmdline"] == [sys.executable, "-m", "hspmd_sdk.runtime.workers.worker", "--rank", str(rank)], r["cmdline"]
        assert r["comm"] == f"hspmd-rank{rank}"
    assert len({r["pid"] for r in results.values()}) == 2


@pytest.mark.timeout(120)
def test_without_the_server_workers_start_afresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cwd = _probe_module(tmp_path, "probe_plain")
    for transport in (LocalTransport(cwd=str(cwd), fork=False), LocalTransport(cwd=str(cwd))):
        results = _run(tmp_path, "probe_plain", transport)
        assert all(r["ppid"] == os.getpid() for r in results.values()), results  # the launcher's own children
        assert all(r["cmdline"][1:4] == ["-m", "hspmd_sdk.runtime.workers.worker", "--rank"] for r in results.values())
        monkeypatch.setenv("HSPMD_FORK_SERVER", "0")  # the second round: the switch in the environment


@pytest.mark.timeout(120)
def test_exit_statuses_are_reported_as_subprocess_does(tmp_path: Path) -> None:
    server = forkserver.server_for(sys.executable, dict(os.environ))
    assert server is not None
    # the worker module's argument parser refuses an unknown flag: status 2, its usage on stderr
    proc = server.spawn(["--no-such-flag"], dict(os.environ), str(tmp_path), "hspmd-test")
    proc.stdin.close()
    assert proc.wait(timeout=30) == 2 and b"--no-such-flag" in proc.stderr.read()
    killer = server.spawn(["--rank", "0"], dict(os.environ), str(tmp_path), "hspmd-test")  # waits for its spec
    wait_for(lambda: os.getpgid(killer.pid) == killer.pid)  # its own process group once it called setsid
    os.killpg(killer.pid, signal.SIGKILL)
    assert killer.wait(timeout=30) == -signal.SIGKILL and killer.poll() == -signal.SIGKILL
    for p in (proc, killer):
        p.stdout.close()
        p.stderr.close()
        if not p.stdin.closed:
            p.stdin.close()


LAUNCHER = '''
import sys, time
from hspmd_sdk import Cluster
from hspmd_sdk.runtime import launch
job = launch(cluster=Cluster.local(2), entry="hspmd_sdk.testing.entries:sleep_forever", steps=1,
             log_dir=sys.argv[1], heartbeat_s=0.2, timeout_s=60)
while not all(job.pids().values()) or len(job.pids()) < 2:
    time.sleep(0.05)
time.sleep(1.0)
print(" ".join(str(p) for p in job.pids().values()), flush=True)
time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


@pytest.mark.timeout(120)
def test_a_killed_launcher_leaves_neither_server_nor_workers(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "logs")], stdout=subprocess.PIPE,
                            text=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        servers = [p for p in _children(proc.pid)
                   if b"hspmd_sdk.runtime.transports.forkserver_process" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(servers) == 1 and all(p in _children(servers[0]) for p in workers)  # forked by the server
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in workers + servers):
            time.sleep(0.05)
        assert not any(_alive(p) for p in workers + servers), "a worker or the server outlived the launcher"
    finally:
        proc.kill()


@pytest.mark.timeout(120)
def test_a_server_that_died_is_replaced_and_the_job_still_runs(tmp_path: Path) -> None:
    server = forkserver.server_for(sys.executable, dict(os.environ))
    assert server is not None
    server.proc.kill()
    server.proc.wait()
    wait_for(lambda: not server.alive, timeout=10)
    results = _run(tmp_path, "probe_again", LocalTransport(cwd=str(_probe_module(tmp_path, "probe_again"))))
    fresh = forkserver.server_for(sys.executable, dict(os.environ))
    assert fresh is not None and fresh is not server and fresh.alive
    assert all(r["ppid"] == fresh.proc.pid for r in results.values())


@pytest.mark.timeout(120)
def test_shutdown_ends_the_server_and_the_next_launch_starts_a_fresh_one(tmp_path: Path) -> None:
    old = forkserver.server_for(sys.executable, dict(os.environ))
    assert old is not None
    forkserver.shutdown()
    assert old.proc.poll() is not None  # the server process has exited
    results = _run(tmp_path, "probe_fresh", LocalTransport(cwd=str(_probe_module(tmp_path, "probe_fresh"))))
    new = forkserver.server_for(sys.executable, dict(os.environ))
    assert new is not None and new is not old and all(r["ppid"] == new.proc.pid for r in results.values())
