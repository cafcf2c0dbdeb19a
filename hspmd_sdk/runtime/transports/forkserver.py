"""A fork server for local CPU workers: torch imported once, each worker a fork of it.

Starting a worker costs its imports: torch (about 1.7 s of one core), then ``torch._dynamo``, which the first
``torch.optim`` call imports (about 2 s more).  Four workers on two cores import at once, so the processes, imports
and build of a 4-rank job took 11 of its 13 s to the first step (``benchmarks/RESULTS.md`` §15).  The fork server
imports torch, ``torch._dynamo`` and the SDK's worker side once, then forks one child per worker.

The child is a worker like any other: a process of its own, leader of its own session and process group (so
killing the group kills what it spawned), its stdin, stdout and stderr the launcher's pipes (passed over a Unix
socket with ``SCM_RIGHTS``), the launch's environment and working directory, then
:func:`hspmd_sdk.runtime.workers.worker.main`.  Everything the worker reads at run time (its spec, ``RANK``, the
rendezvous) is as before; what differs is only what happened at import: the server imported with the launcher's
environment as it was when the server started.

Used only where that is safe (:meth:`~hspmd_sdk.runtime.transports.transport.LocalTransport` decides): the gloo backend (CUDA
must not be initialised before a fork, and a GPU worker's start is dominated by CUDA anyway), the launcher's own
interpreter, the same ``PYTHONPATH``; ``HSPMD_FORK_SERVER=0`` turns it off.  The server is started lazily, one per
launching process, in the launcher's process group (it ignores SIGINT: Ctrl-C is the launcher's to handle), and
exits when the launcher's end of its socket closes; it reaps its children and reports their exit status.

The server runs as ``python -m hspmd_sdk.runtime.transports.forkserver_process FD PAD``; each child rewrites its command line
(the argument area ``/proc/self/stat`` locates) to a fresh worker's, ``python -m hspmd_sdk.runtime.workers.worker --rank
R``, so ``ps`` and a search for worker processes see forked and fresh workers alike, and never the server.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Any, Callable, NoReturn, Sequence

#: Modules the server imports before it forks: torch, what ``torch.optim`` imports on first use, the worker side.
PRELOAD = ("torch", "torch.distributed", "torch.optim", "torch._dynamo", "hspmd_sdk.runtime.workers.worker",
           "hspmd_sdk.runtime.workers.worker_entry", "hspmd_sdk.runtime.workers.session",
           "hspmd_sdk.runtime.workers.executor", "hspmd_sdk.runtime.workers.kernels", "hspmd_sdk.runtime.workers.comm")
#: Exit status reported when the server went away before the worker's exit could be read.
EXIT_UNKNOWN = 255
_MSG_MAX = 1 << 20
SERVER_MODULE = "hspmd_sdk.runtime.transports.forkserver_process"
WORKER_MODULE = "hspmd_sdk.runtime.workers.worker"
_PAD = 48  # command-line room for a worker's arguments
START_TIMEOUT_S = 120.0


# ---- the server (in its own process) ---------------------------------------------------------------------------
def serve(fd: int, run: Callable[[list[str]], Any]) -> NoReturn:
    """The server's loop: preload, say ``ready``, then fork a child per request that calls ``run(argv)`` (the
    worker's ``main``) until the socket closes."""
    import importlib
    import selectors

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 - the launcher falls back to a plain start and says why
        _send(sock, {"error": f"{type(e).__name__}: {e}"})
        os._exit(1)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, None)
    pidfds: dict[int, int] = {}  # pidfd -> pid
    _send(sock, {"ready": os.getpid()})
    while True:
        for key, _ in sel.select():
            if key.data is None:
                msg, fds, _flags, _addr = socket.recv_fds(sock, _MSG_MAX, 3)
                if not msg:
                    os._exit(0)  # the launcher is gone; its workers notice their closed stdin themselves
                req = json.loads(msg)
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    sock.close()
                    for pidfd in pidfds:
                        os.close(pidfd)
                    _child(req, fds, run)
                for f in fds:
                    os.close(f)
                pidfd = os.pidfd_open(pid)
                pidfds[pidfd] = pid
                sel.register(pidfd, selectors.EVENT_READ, pid)
                _send(sock, {"id": req["id"], "pid": pid})
            else:
                sel.unregister(key.fd)
                os.close(key.fd)
                pid = pidfds.pop(key.fd)
                _, status = os.waitpid(pid, 0)
                _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(req: dict[str, Any], fds: list[int], run: Callable[[list[str]], Any]) -> NoReturn:
    """In the forked child: become a worker process (session, stdio, environment, directory), run the worker."""
    code = 1
    try:
        os.setsid()
        for target, f in enumerate(fds):
            os.dup2(f, target)
        for f in fds:
            if f > 2:
                os.close(f)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.path[0] = req["cwd"]  # as ``python -m`` would have it
        sys.argv = [sys.argv[0], *req["argv"]]
        import importlib

        importlib.invalidate_caches()  # files written since the server started (an entry module) are found
        _set_name(req.get("name", "hspmd-worker"))
        _set_cmdline([sys.executable, "-m", WORKER_MODULE, *req["argv"]])
        run(req["argv"])  # the worker's main exits the process itself
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the worker could not even start: its stderr says why
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _set_name(name: str) -> None:
    """The thread name ``ps -o comm`` and ``top`` show (Linux ``prctl(PR_SET_NAME)``, 15 bytes)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
    except Exception:  # noqa: BLE001 - a name is a convenience
        pass


def _set_cmdline(args: list[str]) -> None:
    """Rewrite this process's command line (``/proc/self/cmdline``, ``ps``) in the argument area the kernel reports
    (``/proc/self/stat`` fields 48-49); the server's ``PAD`` argument leaves the room.  Nothing is written when it
    does not fit."""
    try:
        import ctypes

        stat = open("/proc/self/stat").read()
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 on
        start, end = int(fields[45]), int(fields[46])
    except (OSError, ValueError, IndexError):
        return
    data = b"\0".join(a.encode() for a in args) + b"\0"
    if 0 < len(data) <= end - start:
        ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def _send(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


# ---- the launcher's side ------------------------------------------------------------------------------------------
class ForkedProcess:
    """A worker forked by the server, with the part of :class:`subprocess.Popen` the transports use: ``pid``,
    ``stdin``/``stdout``/``stderr`` (the launcher's ends of the pipes), ``poll``, ``wait``, ``returncode``."""

    def __init__(self, pid: int, args: list[str], stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid, self.args = pid, args
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServer:
    """The launcher's handle on one server: :meth:`spawn` a worker; a reader thread delivers exit statuses."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen([python, "-m", SERVER_MODULE, str(theirs.fileno()), "-" * _PAD],
                                         pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.sock = ours
        self._lock = threading.Lock()      # one request at a time: replies come in request order
        self._state = threading.Lock()
        self._procs: dict[int, ForkedProcess] = {}
        self._reply: list[dict[str, Any]] = []
        self._replied = threading.Condition(self._state)
        self._next = 0
        self.alive = True
        ours.settimeout(START_TIMEOUT_S)
        try:
            first = json.loads(ours.recv(_MSG_MAX) or b"{}")
        except (OSError, ValueError) as e:
            first = {"error": f"no answer in {START_TIMEOUT_S:g} s ({e})"}
        ours.settimeout(None)
        if "ready" not in first:
            self.close()
            raise OSError(f"the fork server did not start: {first.get('error', 'it exited')}")
        self._reader = threading.Thread(target=self._read, name="hspmd-forkserver", daemon=True)
        self._reader.start()

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, name: str) -> ForkedProcess:
        """Fork a worker running ``python -m hspmd_sdk.runtime.workers.worker *argv`` with ``env`` in ``cwd``."""
        pipes = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
        mine = [pipes[0][1], pipes[1][0], pipes[2][0]]
        try:
            with self._lock:
                if not self.alive:
                    raise OSError("the fork server has exited")
                self._next += 1
                _send(self.sock, {"id": self._next, "argv": argv, "env": env, "cwd": cwd, "name": name}, theirs)
                with self._replied:
                    while self.alive and not self._reply:
                        self._replied.wait()
                    if not self._reply:
                        raise OSError("the fork server exited before it forked the worker")
                    pid = int(self._reply.pop(0)["pid"])
                    proc = ForkedProcess(pid, ["python", "-m", WORKER_MODULE, *argv],
                                         os.fdopen(mine[0], "wb"), os.fdopen(mine[1], "rb"), os.fdopen(mine[2], "rb"))
                    self._procs[pid] = proc
        except BaseException:
            for f in mine:
                _close_quietly(f)
            raise
        finally:
            for f in theirs:
                _close_quietly(f)
        return proc

    def _read(self) -> None:
        try:
            while True:
                data = self.sock.recv(_MSG_MAX)
                if not data:
                    break
                msg = json.loads(data)
                with self._replied:
                    if "exit" in msg:
                        proc = self._procs.pop(int(msg["exit"]), None)
                        if proc is not None:
                            proc._exited(int(msg["code"]))
                    else:
                        self._reply.append(msg)
                        self._replied.notify_all()
        except OSError:
            pass
        with self._replied:
            self.alive = False
            self._replied.notify_all()
            orphans, self._procs = list(self._procs.values()), {}
        for proc in orphans:  # the server went away: watch each worker's exit from here (status unknown)
            threading.Thread(target=_watch_orphan, args=(proc,), name=f"hspmd-orphan-{proc.pid}",
                             daemon=True).start()

    def close(self) -> None:
        """Close the socket: the server exits (its workers keep running, watched by their own stdin)."""
        self.alive = False
        try:
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _watch_orphan(proc: ForkedProcess) -> None:
    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        proc._exited(EXIT_UNKNOWN)
        return
    try:
        import select

        select.select([pidfd], [], [])
    finally:
        os.close(pidfd)
    proc._exited(EXIT_UNKNOWN)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# ---- one server per launching process -------------------------------------------------------------------------------
_servers: dict[tuple[str, str], ForkServer | None] = {}  # (python, PYTHONPATH) -> server, None: could not start
_servers_lock = threading.Lock()


def enabled() -> bool:
    """Whether local CPU workers may be forked (``HSPMD_FORK_SERVER=0`` says no; Linux with pidfds only)."""
    return os.environ.get("HSPMD_FORK_SERVER", "1") != "0" and hasattr(os, "pidfd_open") \
        and hasattr(socket, "send_fds")


def server_for(python: str, env: dict[str, str]) -> ForkServer | None:
    """The server for workers of ``python`` with ``env``'s ``PYTHONPATH`` (started on first use), or ``None``
    where it cannot start (said once on stderr; workers then start as plain processes)."""
    key = (python, env.get("PYTHONPATH", ""))
    with _servers_lock:
        if key in _servers:
            server = _servers[key]
            if server is None or server.alive:
                return server
        try:
            server = ForkServer(python, {**os.environ, "PYTHONPATH": key[1]} if key[1] else
                                {k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        except OSError as e:
            print(f"hspmd_sdk: workers start as plain processes ({e})", file=sys.stderr)
            server = None
        _servers[key] = server
        return server


def shutdown() -> None:
    """Close this process's servers (running workers go on); the next launch starts a fresh one, which imports
    the SDK's code anew (after editing it in a running kernel)."""
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        if server is not None:
            server.close()
