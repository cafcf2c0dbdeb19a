"""The executor's wait for its sends (``sends.SendWaiter``): it stops when a peer of the world died, however the
send's own wait behaves.

gloo (torch 2.13) does not fail an ``isend`` whose bytes were still queued on a connection when that connection
broke: a pipeline rank whose send to a stage that had just died lost that race waited in ``Work.wait()`` for the
process group's timeout, and the job's recovery with it (seen 1 run in ~10 of
``test_reconfigure_races.py::test_the_nth_failure_is_detected_as_fast_as_the_first``, by ``py-spy dump``: the
survivor in ``StepExecutor._wait_sends`` with no gloo connection left).  The race itself cannot be forced; these
tests force what it leaves: a send whose wait never returns on its own.
"""
from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk.runtime.workers.sends import SendWaiter  # noqa: E402
from hspmd_sdk.runtime.workers.liveness import CommFailure  # noqa: E402


class _Work:
    """A send's work: ``wait`` returns once ``release`` is set, or raises ``error``."""

    def __init__(self, release: threading.Event | None = None, error: BaseException | None = None) -> None:
        self.release, self.error, self.waited = release, error, 0

    def wait(self) -> None:
        self.waited += 1
        if self.release is not None:
            self.release.wait()
        if self.error is not None:
            raise self.error


def _pending(*works: _Work) -> list:
    return [(w, torch.zeros(1)) for w in works]


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "hspmd-sends"}


def _until(cond, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_completed_sends_are_waited_for_each_once() -> None:
    works = [_Work(), _Work(), _Work()]
    SendWaiter(lambda: False, rank=3).wait(_pending(*works))
    assert [w.waited for w in works] == [1, 1, 1]


def test_a_failed_send_raises_its_own_error() -> None:
    error = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(RuntimeError) as got:
        SendWaiter(lambda: False, rank=3).wait(_pending(_Work(), _Work(error=error)))
    assert got.value is error  # unchanged: the session tells a peer's failure from a bug by it


def test_a_send_that_never_completes_ends_at_the_halt() -> None:
    """The stuck wait stays on its thread; the caller raises ``CommFailure`` within a poll of the halt, and the
    next wait (after recovery) runs on a fresh thread."""
    halted = threading.Event()
    stuck = threading.Event()
    before = _threads()
    waiter = SendWaiter(halted.is_set, rank=5, poll_s=0.01)
    threading.Timer(0.2, halted.set).start()
    t0 = time.monotonic()
    with pytest.raises(CommFailure, match="rank 5: a peer died while this rank waited for 1 message"):
        waiter.wait(_pending(_Work(release=stuck)))
    assert 0.2 <= time.monotonic() - t0 < 2.0
    first = _threads() - before
    assert len(first) == 1
    halted.clear()  # the next world: sends complete again, though the old thread is still stuck
    later = _Work()
    waiter.wait(_pending(later))
    assert later.waited == 1
    second = _threads() - before - first
    assert len(second) == 1 and all(t.is_alive() for t in first)  # a fresh thread; the stuck one still waits
    stuck.set()  # the old thread's wait returns: it ends (its queue was closed)
    assert _until(lambda: not any(t.is_alive() for t in first))
    assert all(t.is_alive() for t in second)


def test_the_thread_ends_with_its_waiter() -> None:
    import gc

    before = _threads()
    waiter = SendWaiter(lambda: False)
    waiter.wait(_pending(_Work()))
    mine = _threads() - before
    assert len(mine) == 1
    del waiter
    gc.collect()
    assert _until(lambda: not any(t.is_alive() for t in mine))


def test_without_a_halt_signal_the_caller_waits_itself() -> None:
    w = _Work()
    SendWaiter(None).wait(_pending(w))
    assert w.waited == 1


#: rank 0 sends to rank 1 (a forked child, alive, which never receives) and waits with a halt at 0.3 s
_GLOO = r"""
import datetime, os, sys, threading, time
import torch, torch.distributed as dist
from hspmd_sdk.runtime.workers.sends import SendWaiter
from hspmd_sdk.runtime.workers.liveness import CommFailure
rank = 1 if os.fork() == 0 else 0
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
if rank == 1:
    time.sleep(3)
    os._exit(0)
halted = threading.Event()
threading.Timer(0.3, halted.set).start()
t0 = time.monotonic()
try:
    SendWaiter(halted.is_set, rank=0).wait([(dist.isend(torch.ones(4), 1), None)])
    print("returned", time.monotonic() - t0, flush=True)
except CommFailure as e:
    print("CommFailure", time.monotonic() - t0, flush=True)
os._exit(0)
"""


@pytest.mark.timeout(60)
def test_a_real_gloo_send_nobody_receives_ends_at_the_halt() -> None:
    """A real ``isend`` whose receiver (alive) never posts the receive: ``Work.wait()`` would block for the
    process group's 30 s timeout; the waiter ends at the halt, 0.3 s in."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", _GLOO, str(port)], capture_output=True, text=True, timeout=50)
    what, seconds = out.stdout.split()[:2]
    assert what == "CommFailure" and 0.3 <= float(seconds) < 3.0, (out.stdout, out.stderr[-2000:])
