"""Transports start a job's worker processes on one host and stop them.

A :class:`Transport` starts the workers of a set of ranks on a host and hands every line they write to the job
(``on_line(rank, stream, text)``), then their exit status (``on_exit(rank, returncode)``, called after the last
line).  It returns a :class:`WorkerGroup` to poll and kill them.  :class:`LocalTransport` runs them on this machine;
an SSH transport (one connection per host, a per-host agent started with ``setsid`` that spawns the ranks and
multiplexes their lines, which already carry their rank) implements the same two classes.

Each local worker is the leader of its own session and process group (``start_new_session=True``), so killing the
group also kills whatever the worker spawned, and a Ctrl-C in the notebook never reaches the workers directly: the
job decides what happens.  Each worker reads the spec from stdin and keeps stdin open: when the launcher dies, the
pipe closes and the worker exits.  After the spec, stdin carries control lines (:mod:`.protocol`): the group pings
every worker each ``spec.heartbeat_s`` seconds and relays the job's control messages; one writer thread per worker
writes them in order, so a caller never blocks on a full pipe.
"""
from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from typing import IO, TYPE_CHECKING, Any, Callable, Sequence

from . import forkserver
from .forkserver import ForkedProcess, ForkServer
from ..protocol import EXIT_ORPHANED, control_line, control_text_line, message_text
from ..spec import LaunchSpec

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ..control.preflight import HostFacts

LineSink = Callable[[int, str, str], None]
"""``on_line(rank, stream, text)``: ``stream`` is ``"out"`` (protocol channel) or ``"err"`` (raw stderr)."""
ExitSink = Callable[[int, int], None]
"""``on_exit(rank, returncode)``: negative return codes are signals, as in ``subprocess``."""

WORKER_MODULE = "hspmd_sdk.runtime.workers.worker"
#: Seconds to wait, after a worker exited, for the last lines of its pipes before stopping what holds them.
DRAIN_S = 2.0


class WorkerGroup(ABC):
    """The workers a transport started on one host."""

    host: str
    ranks: list[int]

    @abstractmethod
    def poll(self) -> dict[int, int | None]:
        """Rank -> return code, ``None`` while running."""

    @abstractmethod
    def kill(self, grace_s: float = 0.5, ranks: Sequence[int] | None = None) -> None:
        """Stop the workers of ``ranks`` (default: every one) and their children: SIGTERM, then SIGKILL after
        ``grace_s``.  Idempotent."""

    @abstractmethod
    def pids(self) -> dict[int, int]:
        """Rank -> process id (on its host)."""

    @abstractmethod
    def stopped_by_kill(self, rank: int, returncode: int) -> bool:
        """Whether ``rank`` exiting with ``returncode`` is the doing of ``kill`` (not a failure of its own).

        ``kill`` sends SIGTERM (and closes stdin, on which a worker exits with ``EXIT_ORPHANED``); only a worker
        still alive after the grace period gets SIGKILL.  So a SIGKILL, a segfault or an abort of a worker that
        was not escalated is its own failure even when it happens while the job is stopping.
        """

    @abstractmethod
    def send_control(self, msg: dict[str, Any], ranks: Sequence[int], *, text: str | None = None) -> None:
        """Queue the control message ``msg`` for ``ranks`` (delivered in order; never blocks).  ``text``: ``msg``
        already encoded (:func:`~..protocol.message_text`), written as it is: the job encodes a message once."""

    @abstractmethod
    def dump_stack(self, rank: int) -> None:
        """Ask ``rank`` to write every thread's stack to its stderr (SIGUSR1; SIGCONT wakes a stopped one)."""

    def link_silence(self) -> float:
        """Seconds since the link to this host last carried anything (0 for local processes)."""
        return 0.0

    def lost(self, rank: int) -> str | None:
        """Why ``rank``'s exit status is not known (its host's connection was lost), or ``None``."""
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Transport(ABC):
    """Starts workers on hosts, and says what :func:`~hspmd_sdk.runtime.control.launcher.launch_entry` needs before it does: the hosts checked,
    where a world meets (rendezvous), each host's resources and threads.  The defaults are this machine's
    (:class:`LocalTransport`); :class:`~.ssh.SSHTransport` asks the hosts over SSH."""

    #: Every worker runs on this machine (hosts ``localhost``, rendezvous on loopback).
    local: bool = True
    #: Capacity lost on this transport comes back by itself (a scheduler's restarted or freed node): an elastic job
    #: grows back onto it unless told otherwise (``launch(..., grow_back=False)``, :mod:`.growback`).
    grows_back: bool = False

    def preflight(self, cluster: "Cluster") -> None:
        """Check every host of ``cluster`` before anything starts; raise naming what is wrong (this machine:
        nothing to check)."""

    def rendezvous(self, host: str, *, fresh: bool = False) -> tuple[str, int]:
        """Address and a port free now on ``host`` for a world's rendezvous store (its rank 0 runs there); ``fresh``: for
        a re-formed world, whose first store may still hold its port."""
        return "127.0.0.1", free_port()

    def host_facts(self, host: str, *, cuda: bool = False) -> "HostFacts":
        """Cores, available RAM and (``cuda``) CUDA devices of ``host``, for the resource preflight."""
        from ..control.preflight import local_facts  # lazy: tests patch preflight.local_facts

        return local_facts(cuda=cuda)

    def threads_per_worker(self, cluster: "Cluster") -> int | None:
        """torch threads each worker of ``cluster`` may use (``None``: the cores here over the ranks)."""
        return None

    def available(self, host: str) -> bool:
        """Whether ``host`` can take workers again after the job lost ranks there (an elastic job's grow back,
        :mod:`.growback`): this machine always can."""
        return True

    @abstractmethod
    def start(self, host: str, ranks: Sequence[int], spec: LaunchSpec, on_line: LineSink,
              on_exit: ExitSink) -> WorkerGroup:
        """Start one worker per rank on ``host``, each reading ``spec`` from its stdin."""

    def close(self) -> None:
        """Release connections, threads and files (nothing for local processes).  Idempotent."""

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LocalTransport(Transport):
    """Workers as local processes: ``python -m hspmd_sdk.runtime.workers.worker --rank R``.

    ``python`` is the launcher's own interpreter unless given; ``cwd`` defaults to the launcher's working
    directory (so modules there are importable as entries); ``env`` adds variables to the inherited ones.
    ``fork``: CPU (gloo) workers of the launcher's interpreter are forked from a server that imported torch once
    (:mod:`.forkserver`: seconds less per launch); ``False``, or ``HSPMD_FORK_SERVER=0``, starts each afresh.
    """

    def __init__(self, python: str | None = None, *, cwd: str | None = None,
                 env: dict[str, str] | None = None, fork: bool = True) -> None:
        self.python = python or sys.executable
        self.cwd = cwd
        self.env = dict(env or {})
        self.fork = fork

    def start(self, host: str, ranks: Sequence[int], spec: LaunchSpec, on_line: LineSink,
              on_exit: ExitSink) -> WorkerGroup:
        group = LocalWorkers(host, list(ranks), heartbeat_s=spec.heartbeat_s)
        try:
            for r in ranks:
                group.add(r, self._popen(r, spec), on_line, on_exit, spec.line_for(r))  # its own part
        except BaseException:
            group.kill(grace_s=0)
            raise
        group.start_pings()
        return group

    def _popen(self, rank: int, spec: LaunchSpec) -> "subprocess.Popen[bytes] | ForkedProcess":
        env = {**os.environ, **self.env, **worker_env(spec, rank)}
        argv = ["--rank", str(rank)]
        server = self._fork_server(spec, env)
        if server is not None:
            try:
                return server.spawn(argv, env, os.path.abspath(self.cwd or os.getcwd()), f"hspmd-rank{rank}")
            except OSError:
                pass  # the server went away: this worker and the next start as plain processes
        return subprocess.Popen([self.python, "-m", WORKER_MODULE, *argv], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.cwd, env=env,
                                start_new_session=True)

    def _fork_server(self, spec: LaunchSpec, env: dict[str, str]) -> "ForkServer | None":
        """The fork server for these workers (:mod:`.forkserver`): gloo only, the launcher's interpreter."""
        if not self.fork or spec.backend != "gloo" or self.python != sys.executable or not forkserver.enabled():
            return None
        return forkserver.server_for(self.python, env)


def worker_env(spec: LaunchSpec, rank: int) -> dict[str, str]:
    """The variables torch's ecosystem expects in a worker's environment."""
    return {"RANK": str(rank), "WORLD_SIZE": str(spec.world_size), "LOCAL_RANK": str(spec.local_rank(rank)),
            "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(spec.master_port), "PYTHONUNBUFFERED": "1"}


class LocalWorkers(WorkerGroup):
    """Local worker processes, one process group each; reader threads feed the job, a writer thread per worker
    feeds its stdin, and one thread pings them all every ``heartbeat_s`` seconds."""

    def __init__(self, host: str, ranks: list[int], *, heartbeat_s: float = 1.0) -> None:
        self.host = host
        self.ranks = ranks
        self.heartbeat_s = heartbeat_s
        self._procs: dict[int, subprocess.Popen[bytes] | ForkedProcess] = {}
        self._stdin: dict[int, StdinWriter] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._killing: set[int] = set()
        self._escalated: set[int] = set()
        self._exited: set[int] = set()
        self._quiet = threading.Event()  # every worker exited or the group was killed: no more pings

    def add(self, rank: int, proc: subprocess.Popen[bytes] | ForkedProcess, on_line: LineSink, on_exit: ExitSink,
            spec_line: str) -> None:
        self._procs[rank] = proc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        # a thread: a large payload must not block starting the next worker
        self._stdin[rank] = writer = StdinWriter(proc.stdin, spec_line, name=f"hspmd-rank{rank}-stdin")
        pumps = [threading.Thread(target=_pump, args=(stream, rank, name, on_line), name=f"hspmd-rank{rank}-{name}",
                                  daemon=True) for stream, name in ((proc.stdout, "out"), (proc.stderr, "err"))]
        for t in pumps:
            t.start()
        waiter = threading.Thread(target=self._await_exit, args=(rank, proc, pumps, on_exit),
                                  name=f"hspmd-rank{rank}-exit", daemon=True)
        waiter.start()
        self._threads += [writer.thread, *pumps, waiter]

    def start_pings(self) -> None:
        """Ping every worker every ``heartbeat_s`` seconds until all exited (their watchdog's sign of life)."""
        t = threading.Thread(target=self._ping, name=f"hspmd-ping-{self.host}", daemon=True)
        t.start()
        self._threads.append(t)

    def _ping(self) -> None:
        line = control_line("ping")
        while not self._quiet.wait(self.heartbeat_s):
            for w in list(self._stdin.values()):
                w.put(line)

    def _await_exit(self, rank: int, proc: subprocess.Popen[bytes] | ForkedProcess, pumps: list[threading.Thread],
                    on_exit: ExitSink) -> None:
        """When the worker exits: deliver its last lines, stop what it left running, then report the exit."""
        rc = proc.wait()
        self._stdin[rank].close()
        for t in pumps:
            t.join(DRAIN_S)
        if any(t.is_alive() for t in pumps):  # a child of the worker still holds its pipes: stop it
            _signal_group(proc.pid, signal.SIGKILL)
            for t in pumps:
                t.join()
        with self._lock:
            self._exited.add(rank)
            if self._exited >= set(self._procs):
                self._quiet.set()
        on_exit(rank, rc)

    def send_control(self, msg: dict[str, Any], ranks: Sequence[int], *, text: str | None = None) -> None:
        line = control_text_line(message_text(msg) if text is None else text)
        for r in ranks:
            w = self._stdin.get(r)
            if w is not None:
                w.put(line)

    def dump_stack(self, rank: int) -> None:
        proc = self._procs.get(rank)
        if proc is None or proc.returncode is not None:
            return
        for sig in (signal.SIGUSR1, signal.SIGCONT):  # a stopped worker handles SIGUSR1 once continued
            try:
                os.kill(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return

    def poll(self) -> dict[int, int | None]:
        return {r: p.poll() for r, p in self._procs.items()}

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self._procs.items()}

    def stopped_by_kill(self, rank: int, returncode: int) -> bool:
        with self._lock:
            return rank in self._killing and (returncode in (-signal.SIGTERM, EXIT_ORPHANED)
                                              or rank in self._escalated)

    def kill(self, grace_s: float = 0.5, ranks: Sequence[int] | None = None) -> None:
        """Stop the workers of ``ranks`` (default: all): close their stdin, SIGTERM, SIGKILL after ``grace_s``."""
        with self._lock:
            procs = {r: p for r, p in self._procs.items() if ranks is None or r in ranks}
            self._killing |= set(procs)
            if ranks is None:
                self._quiet.set()
        for r, p in procs.items():
            self._stdin[r].close()
            _signal_group(p.pid, signal.SIGTERM)
            _signal_group(p.pid, signal.SIGCONT)  # a stopped worker acts on SIGTERM only once continued
        deadline = time.monotonic() + grace_s
        for p in procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        with self._lock:
            self._escalated |= {r for r, p in procs.items() if p.returncode is None}
        for p in procs.values():  # the leader may be gone while children it spawned are still in its group
            _signal_group(p.pid, signal.SIGKILL)
        for p in procs.values():
            p.wait()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the reader, writer and exit threads (all lines and exits delivered)."""
        for t in self._threads:
            t.join(timeout)


class StdinWriter:
    """A worker's stdin: the spec first, then control lines, written in order by a thread of its own.

    ``put`` never blocks (a stopped worker stops reading; its pipe may fill).  ``close`` ends the stream after
    what is queued; only the writer thread touches the file, so a closed descriptor is never written again."""

    def __init__(self, stream: IO[bytes], first: str, *, name: str) -> None:
        self._stream = stream
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._closed = False
        self._queue.put(first)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, line: str) -> None:
        if not self._closed:
            self._queue.put(line)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)

    def _run(self) -> None:
        fd = self._stream.fileno()
        try:
            while True:
                line = self._queue.get()
                if line is None:
                    break
                view = memoryview(line.encode())
                while view:
                    view = view[os.write(fd, view):]
        except OSError:
            pass  # the worker died (its exit status tells why) or the job was stopped meanwhile
        finally:
            self._closed = True
            _close_quietly(self._stream)


def _pump(stream: IO[bytes], rank: int, name: str, on_line: LineSink) -> None:
    try:
        for raw in iter(stream.readline, b""):
            try:
                on_line(rank, name, raw.decode("utf-8", "replace").rstrip("\r\n"))
            except Exception:  # noqa: BLE001 - a bug in a handler must not stop reading (the worker would block)
                traceback.print_exc()
    finally:
        stream.close()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _close_quietly(stream: IO[bytes] | None) -> None:
    if stream is not None:
        try:
            stream.close()
        except OSError:
            pass


#: Host names that mean "this machine".
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_local_host(host: str) -> bool:
    return host in LOCAL_NAMES or host == socket.gethostname()
