"""A worker's side of fault detection: its heartbeat, its control inbox, and its watch on the launcher.

Three small pieces, each on a daemon thread of the worker process so that a long kernel never silences them:

* :class:`Listener` reads the launcher's control lines from stdin (see :mod:`.protocol`): ``ping`` keeps the
  launcher alive in the worker's eyes, ``control`` goes to the :class:`ControlInbox` (``WorkerState.poll_control``),
  ``dump`` writes every thread's stack to stderr.  When stdin closes, the worker exits (``EXIT_ORPHANED``).
* :class:`Heartbeat` sends a ``beat`` every ``spec.heartbeat_s`` seconds with ``comm_s``, the seconds the main
  thread has been waiting in communication, or ``busy_s``, the seconds it has been out of it; it also ends the
  worker when the launcher has been silent for ``spec.silent_s`` (a partition, a frozen agent or launcher).
* :func:`in_communication` tells, from the main thread's stack alone, whether it waits in communication: a frame of
  ``torch.distributed`` (every collective, ``send``/``recv``, ``barrier``, rendezvous), or a ``.wait()`` call on
  asynchronous work (``isend``/``irecv``/``batch_isend_irecv``).  Nothing is patched or wrapped: the sampling
  works for every executor, including ones the SDK does not know.
"""
from __future__ import annotations

import dis
import faulthandler
import functools
import os
import random
import signal
import sys
import threading
import time
from collections import deque
from types import CodeType, FrameType
from typing import Any, Callable

from ...errors import HSPMDError
from ..protocol import EXIT_ORPHANED, Channel, LineReader

#: Attribute names whose call blocks until communication completes (``Work.wait``, ``Future.wait``).
_WAIT_CALLS = frozenset({"wait"})


class CommFailure(HSPMDError):
    """Communication with a peer failed (it died, or abandoned its groups after a peer died)."""


class ControlInbox:
    """Control messages from the launcher, in arrival order; thread-safe.

    A ``halt`` message (the launcher learnt that a peer of the world ``after`` died) is not queued: it is noted at
    once, so that a worker waiting for that peer outside a collective (a store poll, say) can stop waiting
    (:meth:`halted`) even while its training thread is blocked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: deque[dict[str, Any]] = deque()
        self._halts: set[int] = set()

    def put(self, msg: dict[str, Any]) -> None:
        with self._lock:
            if msg.get("type") == "halt":
                self._halts.add(int(msg.get("after", -1)))
                return
            self._items.append(msg)

    def halted(self, generation: int) -> bool:
        """Whether the launcher said that a peer of the world of reconfiguration ``generation`` died."""
        with self._lock:
            return int(generation) in self._halts

    def take(self) -> list[dict[str, Any]]:
        """Every pending message (oldest first); the inbox is empty afterwards."""
        with self._lock:
            out = list(self._items)
            self._items.clear()
        return out


class Listener:
    """Reads the launcher's control lines after the spec; exits the process when stdin closes."""

    def __init__(self, reader: LineReader, channel: Channel, inbox: ControlInbox,
                 exit: Callable[[int], Any] = os._exit) -> None:
        self.reader, self.channel, self.inbox = reader, channel, inbox
        self._exit = exit
        self.last_heard = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="hspmd-control", daemon=True)

    def start(self) -> "Listener":
        self.thread.start()
        return self

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    def _run(self) -> None:
        import json

        while True:
            line = self.reader.readline()
            if not line:
                break
            self.last_heard = time.monotonic()
            try:
                msg = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if not isinstance(msg, dict):
                continue
            kind = msg.get("t")
            if kind == "control" and isinstance(msg.get("msg"), dict):
                self.inbox.put(msg["msg"])
            elif kind == "dump":
                dump_stacks()
        leave(self.channel, f"rank {self.channel.rank}: launcher closed the connection; exiting", self._exit)


class Heartbeat:
    """Beats about every ``interval`` seconds from a thread of its own; ends the worker when the launcher is silent.

    Each beat samples the main thread's stack (:func:`in_communication`) and says for how long it has been, at
    every sample, in communication (``comm_s``) or out of it (``busy_s``).  The period is jittered by +-20% so
    that sampling never locks onto the phase of a periodic workload.
    """

    def __init__(self, channel: Channel, interval: float, *, listener: Listener | None = None,
                 silent_s: float | None = None, main: threading.Thread | None = None,
                 exit: Callable[[int], Any] = os._exit) -> None:
        self.channel, self.interval = channel, interval
        self.listener, self.silent_s = listener, silent_s
        self._main = (main or threading.main_thread()).ident
        self._exit = exit
        self._in_comm: bool | None = None
        self._since = time.monotonic()
        self._stop = threading.Event()
        self._rng = random.Random(os.getpid())
        self.thread = threading.Thread(target=self._run, name="hspmd-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def sample(self) -> dict[str, float | None]:
        """``{"comm_s": s, "busy_s": None}`` (in communication for ``s`` seconds) or the other way round."""
        frame = sys._current_frames().get(self._main)  # noqa: SLF001 - the documented way to sample a thread
        now = time.monotonic()
        state = in_communication(frame)
        if state != self._in_comm:
            self._in_comm, self._since = state, now
        held = round(now - self._since, 3)
        return {"comm_s": held, "busy_s": None} if state else {"comm_s": None, "busy_s": held}

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval * self._rng.uniform(0.8, 1.2)):
            try:
                self.channel.send("beat", **self.sample())
            except OSError:
                return  # the launcher is gone; the listener ends the process
            now, woke_late = time.monotonic(), time.monotonic() - last > 3 * self.interval
            last = now
            if woke_late:  # this process was stopped or starved itself: let the listener read what came meanwhile
                continue
            if self.listener is not None and self.silent_s is not None and \
                    self.listener.silent_for() > self.silent_s:
                leave(self.channel, f"rank {self.channel.rank}: no word from the launcher for "
                                    f"{self.listener.silent_for():.1f} s (cut off?); exiting", self._exit)
                return


def leave(channel: Channel, why: str, exit: Callable[[int], Any] = os._exit) -> None:
    """Say why on the log channel (if the launcher still listens) and exit as orphaned."""
    try:
        channel.log(why, "log")
    except OSError:
        pass  # the launcher is gone, and its end of our stdout with it
    exit(EXIT_ORPHANED)


#: Code objects of functions that wait for a message (``@waits``): time spent in them is waiting, not working.
_WAITING_CODES: set[CodeType] = set()


def waits(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as waiting for communication (e.g. for the launcher's answer during a reconfiguration), so that
    stall detection counts a worker inside it with the waiters, never as the culprit."""
    _WAITING_CODES.add(fn.__code__)
    return fn


def in_communication(frame: FrameType | None) -> bool:
    """Whether the thread whose innermost frame is ``frame`` waits in communication: it calls ``.wait()``, or some
    frame of its stack is ``torch.distributed`` code or a function marked :func:`waits`."""
    if frame is None:
        return False
    if _called_name(frame.f_code, frame.f_lasti) in _WAIT_CALLS:
        return True
    root = _torch_distributed_dir()
    f: FrameType | None = frame
    while f is not None:
        if f.f_code in _WAITING_CODES or (root is not None and f.f_code.co_filename.startswith(root)):
            return True
        f = f.f_back
    return False


def _torch_distributed_dir() -> str | None:
    mod = sys.modules.get("torch.distributed")
    path = getattr(mod, "__file__", None)
    return os.path.dirname(path) + os.sep if path else None


@functools.lru_cache(maxsize=4096)
def _call_targets(code: CodeType) -> dict[int, str]:
    """Offset of each call instruction of ``code`` -> the attribute name it calls (``x.wait()`` -> ``wait``)."""
    out: dict[int, str] = {}
    attr: str | None = None
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_METHOD", "LOAD_ATTR"):
            attr = str(ins.argval)
        elif ins.opname == "PRECALL":
            if attr is not None:
                out[ins.offset] = attr
        elif ins.opname.startswith("CALL"):
            if attr is not None:
                out[ins.offset] = attr
            attr = None
    return out


def _called_name(code: CodeType, lasti: int) -> str | None:
    try:
        return _call_targets(code).get(lasti)
    except Exception:  # noqa: BLE001 - an unusual code object: simply not a wait
        return None


def dump_stacks() -> None:
    """Every thread's Python stack to the original stderr (what the launcher quotes for a hung rank).  Called with
    the GIL held, so no other thread changes its frames while they are read."""
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)


def serve_stack_requests(signum: int = signal.SIGUSR1) -> threading.Thread:
    """Answer ``signum`` (the launcher's stack request, sent also to a stopped or hung rank) with
    :func:`dump_stacks`, from a thread of its own.  Call from the main thread.

    ``faulthandler.register`` would dump inside the C signal handler, without the GIL, while the process's other
    threads run on (a stopped rank is continued to take the signal): CPython warns that this read of other threads'
    frames may crash, and a rank stopped by SIGSTOP once died of SIGSEGV so.  Here the C handler only writes the
    signal's number to a pipe (``signal.set_wakeup_fd``, which works while the main thread is blocked in a
    collective); the thread reading it dumps holding the GIL.  A rank holding the GIL forever gives no stack."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signum, lambda *_: None)  # a Python handler: the C handler then writes to the wakeup fd
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def serve() -> None:
        while True:
            if signum in os.read(read_fd, 64):
                dump_stacks()

    thread = threading.Thread(target=serve, name="hspmd-stacks", daemon=True)
    thread.start()
    return thread
