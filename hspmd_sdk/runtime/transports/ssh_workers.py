"""The launcher's end of a host's agent: :class:`RemoteWorkers`, the workers of one host run by its agent
(:mod:`.agent`) over that host's SSH connection, and the event-loop thread every connection of a transport lives on.

The agent's protocol is lines on its stdin and stdout: the launcher sends ``start`` (the launch spec), pings and
control messages; the agent answers with the workers' pids, their protocol lines (tagged with the rank) and their
exits.  A lost connection or an agent that does not answer a kill makes its ranks :meth:`RemoteWorkers.lost`, and
their process groups are killed over a fresh connection.
"""
from __future__ import annotations

import asyncio
import json
import queue
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Coroutine, Protocol, Sequence, TypeVar

from ..protocol import EXIT_ORPHANED, control_line, message_text
from .agent import PREFIX as AGENT_PREFIX
from .hosts import SSHError
from .transport import ExitSink, LineSink, WorkerGroup

if TYPE_CHECKING:
    import asyncssh

__all__ = ["RemoteWorkers", "LoopThread", "AgentHost", "EXIT_LOST"]

T = TypeVar("T")

#: Return code reported for a rank whose host connection was lost before it reported its exit.
EXIT_LOST = 255


# ---- the event loop thread ------------------------------------------------------------------------------------
class LoopThread:
    """An asyncio loop on a daemon thread; ``run(coro, timeout)`` from any other thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hspmd-ssh-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self.thread:
            raise RuntimeError("SSHTransport: a blocking call from its own event loop thread")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, Any]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Cancel what still runs on the loop, shut its executor (name lookups), stop it, join the thread and
        close the loop (its selector and self-pipe): nothing of the transport outlives it."""
        if threading.current_thread() is self.thread:
            raise RuntimeError("SSHTransport.close() from its own event loop thread")

        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()
        try:
            self.run(drain(), timeout=10)
        except Exception:  # noqa: BLE001 - closing is best effort; the loop is stopped below anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


class AgentHost(Protocol):
    """What a host's workers need of their transport: a name for messages, the event loop, and the fallback
    that kills process groups over a fresh connection."""

    kill_timeout_s: float

    @property
    def loop(self) -> LoopThread: ...

    def where(self, host: str) -> str: ...

    def kill_process_groups(self, host: str, pgids: Sequence[int], timeout_s: float = 10.0,
                            retries: int | None = None) -> None: ...


class RemoteWorkers(WorkerGroup):
    """The workers of one host, run by its agent over the host's SSH connection.

    Lines and exits arrive on the event loop and are handed to the job's callbacks by a dispatcher thread of
    their own (in order; a slow callback never stalls the connection).  The group pings the agent every
    ``heartbeat_s`` seconds and notes when it last heard anything from it (:meth:`link_silence`); ranks whose exit
    the agent could not report (its connection ended, or it never answered a kill) are :meth:`lost`.
    """

    def __init__(self, transport: AgentHost, host: str, ranks: list[int], on_line: LineSink,
                 on_exit: ExitSink, *, heartbeat_s: float = 1.0, loop: LoopThread | None = None) -> None:
        self.transport = transport
        self._loop = loop or transport.loop  # the loop its channel lives on (closed with the transport)
        self.host = host
        self.ranks = ranks
        self.heartbeat_s = heartbeat_s
        self._on_line, self._on_exit = on_line, on_exit
        self._proc: Any = None
        self._lock = threading.Lock()
        self._pids: dict[int, int] = {}
        self._rc: dict[int, int] = {}
        self._lost: dict[int, str] = {}
        self._killed_by_agent: set[int] = set()
        self._escalated: set[int] = set()
        self._killing: set[int] = set()
        self._stopping = False
        self._started = threading.Event()
        self._all_exited = threading.Event()
        self._fatal: str | None = None
        self._fallback = False
        self._last_heard: float | None = None
        self.agent_pid: int | None = None
        self.agent_pgid: int | None = None
        self.agent_stderr: list[str] = []
        self._queue: queue.Queue[tuple[str, int, Any, Any] | None] = queue.Queue()
        self._dispatcher = threading.Thread(target=self._dispatch, name=f"hspmd-ssh-{host}", daemon=True)
        self._dispatcher.start()

    # ---- event loop side ---------------------------------------------------------------------------------------
    async def open(self, conn: "asyncssh.SSHClientConnection", cmd: str, start_msg: str) -> None:
        self._proc = await conn.create_process(cmd, encoding="utf-8", errors="replace")
        self._last_heard = time.monotonic()
        self._proc.stdin.write(start_msg)
        await self._proc.stdin.drain()
        loop = asyncio.get_running_loop()
        loop.create_task(self._read_stdout())
        loop.create_task(self._read_stderr())
        loop.create_task(self._ping())

    async def _ping(self) -> None:
        line = control_line("ping")
        while not self._all_exited.is_set():
            await asyncio.sleep(self.heartbeat_s)
            try:
                self._proc.stdin.write(line)  # buffered by asyncssh when the window is full: never blocks
            except Exception:  # noqa: BLE001 - the channel is closed: the reader reports it
                return

    async def _read_stdout(self) -> None:
        pending = ""  # readline returns part of a line longer than the channel's window: join the parts
        try:
            while True:
                part = await self._proc.stdout.readline()
                if not part:
                    break
                self._last_heard = time.monotonic()
                pending += part
                if pending.endswith("\n"):
                    line, pending = pending, ""
                    self._handle(line.rstrip("\r\n"))
            if pending:
                self._handle(pending.rstrip("\r\n"))
        except Exception as e:  # noqa: BLE001 - the connection dropped
            self.agent_stderr.append(f"connection error: {type(e).__name__}: {e}")
        status = None
        try:
            await asyncio.wait_for(self._proc.wait_closed(), 2)
            status = self._proc.returncode
        except Exception:  # noqa: BLE001 - no exit status: the connection itself is gone
            pass
        self._connection_ended(status)

    async def _read_stderr(self) -> None:
        try:
            while True:
                line = await self._proc.stderr.readline()
                if not line:
                    break
                self._last_heard = time.monotonic()
                self.agent_stderr = (self.agent_stderr + [line.rstrip("\r\n")])[-30:]
        except Exception:  # noqa: BLE001
            pass

    def _handle(self, line: str) -> None:
        if not line.startswith(AGENT_PREFIX):
            self.agent_stderr = (self.agent_stderr + [line])[-30:]
            return
        try:
            msg = json.loads(line[len(AGENT_PREFIX):])
        except (ValueError, RecursionError):
            return
        kind = msg.get("t")
        if kind == "line":
            self._queue.put(("line", int(msg["rank"]), msg.get("s", "out"), msg.get("x", "")))
        elif kind == "exit":
            rank, rc = int(msg["rank"]), int(msg["rc"])
            if msg.get("killed"):
                with self._lock:
                    self._killed_by_agent.add(rank)
            self._record_exit(rank, rc)
        elif kind == "started":
            with self._lock:
                self._pids[int(msg["rank"])] = int(msg["pid"])
                if set(self._pids) >= set(self.ranks):
                    self._started.set()
        elif kind == "ready":
            self.agent_pid, self.agent_pgid = int(msg["pid"]), int(msg["pgid"])
        elif kind == "fatal":
            self._fatal = str(msg.get("message"))
            self._started.set()

    def _record_exit(self, rank: int, rc: int, note: str | None = None, lost: str | None = None) -> None:
        with self._lock:
            if rank in self._rc or rank not in self.ranks:
                return
            self._rc[rank] = rc
            if lost is not None:
                self._lost[rank] = lost
            done = set(self._rc) >= set(self.ranks)
        if note:
            self._queue.put(("line", rank, "err", note))
        self._queue.put(("exit", rank, rc, None))
        if done:
            self._all_exited.set()
            self._queue.put(None)

    def _connection_ended(self, status: int | None = None) -> None:
        """The agent's channel closed: every rank that did not report its exit is lost."""
        self._started.set()
        with self._lock:
            missing = [r for r in self.ranks if r not in self._rc]
            if not missing or self._fallback:
                return  # kill() is killing the process groups itself and records their exits
        tail = "\n".join(self.agent_stderr[-10:])
        why = (f"its agent exited with status {status} before its ranks reported their exits" if status is not None
               else "its SSH connection closed before its ranks reported their exits")
        note = f"[launcher] {self.transport.where(self.host)}: {why}" + (f"; agent output:\n{tail}" if tail else "")
        for r in missing:
            self._record_exit(r, EXIT_LOST, note, lost=why)

    # ---- dispatcher thread -------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, rank, a, b = item
            try:
                if kind == "line":
                    self._on_line(rank, a, b)
                else:
                    self._on_exit(rank, a)
            except Exception:  # noqa: BLE001 - a bug in a handler must not stop the others
                import traceback

                traceback.print_exc()

    # ---- WorkerGroup -------------------------------------------------------------------------------------------
    def wait_started(self, timeout_s: float) -> None:
        if not self._started.wait(timeout_s):
            raise SSHError(f"{self.transport.where(self.host)}: the agent did not start the workers within "
                           f"{timeout_s:g} s" + self._stderr_hint())
        if self._fatal or set(self._pids) < set(self.ranks):
            raise SSHError(f"{self.transport.where(self.host)}: the agent could not start the workers: "
                           f"{self._fatal or 'it exited early'}" + self._stderr_hint())

    def _stderr_hint(self) -> str:
        tail = "\n".join(self.agent_stderr[-10:])
        return f"\nagent output:\n{tail}" if tail else ""

    def poll(self) -> dict[int, int | None]:
        with self._lock:
            return {r: self._rc.get(r) for r in self.ranks}

    def pids(self) -> dict[int, int]:
        with self._lock:
            return dict(self._pids)

    def link_silence(self) -> float:
        if self._last_heard is None or self._all_exited.is_set():
            return 0.0
        return time.monotonic() - self._last_heard

    def lost(self, rank: int) -> str | None:
        with self._lock:
            return self._lost.get(rank)

    def stopped_by_kill(self, rank: int, returncode: int) -> bool:
        with self._lock:
            return rank in self._killing and (returncode in (-signal.SIGTERM, EXIT_ORPHANED)
                                              or rank in self._killed_by_agent or rank in self._escalated)

    def _send(self, msg: dict[str, Any]) -> None:
        """Queue one line to the agent (never blocks; a closed channel is the reader's to report)."""
        self._send_line(json.dumps(msg, separators=(",", ":")) + "\n")

    def _send_line(self, line: str) -> None:
        """:meth:`_send` of a line already encoded."""
        proc = self._proc
        if proc is None:
            return

        def write() -> None:
            try:
                proc.stdin.write(line)
            except Exception:  # noqa: BLE001
                pass
        try:
            self._loop.loop.call_soon_threadsafe(write)
        except RuntimeError:
            pass  # the loop is closed: the job is over

    def send_control(self, msg: dict[str, Any], ranks: Sequence[int], *, text: str | None = None) -> None:
        # the agent's line {"t": "control", "ranks": [...], "msg": {...}}, the message's text spliced in as it is
        body = message_text(msg) if text is None else text
        self._send_line('{"t":"control","ranks":' + json.dumps([int(r) for r in ranks], separators=(",", ":"))
                        + ',"msg":' + body + "}\n")

    def dump_stack(self, rank: int) -> None:
        self._send({"t": "dump", "rank": int(rank)})

    def kill(self, grace_s: float = 0.5, ranks: Sequence[int] | None = None) -> None:
        """Ask the agent to stop the workers (``ranks``, default all); if it does not answer in time, SIGKILL their
        process groups over a fresh connection; if the host cannot be reached at all, the ranks are lost."""
        with self._lock:
            targets = [r for r in self.ranks if (ranks is None or r in ranks) and r not in self._rc]
            self._killing |= set(self.ranks if ranks is None else ranks)
            self._stopping = self._stopping or ranks is None
            if not targets:
                return
        proc = self._proc
        if proc is not None:
            msg = {"t": "kill", "grace": grace_s, "ranks": None if ranks is None else targets}
            try:
                self._loop.run(_write(proc, json.dumps(msg) + "\n"), timeout=5)
            except Exception:  # noqa: BLE001 - the channel is gone: the fallback below does the job
                pass
        if proc is not None and self._exited_within(targets, grace_s + self.transport.kill_timeout_s):
            return
        with self._lock:
            self._fallback = self._fallback or ranks is None
            pgids = [self._pids[r] for r in targets if r in self._pids and r not in self._rc]
        if self.agent_pgid is not None and ranks is None:
            pgids.append(self.agent_pgid)
        unreachable = None
        try:
            self.transport.kill_process_groups(self.host, pgids, timeout_s=self.transport.kill_timeout_s + 5,
                                               retries=1)
        except Exception as e:  # noqa: BLE001
            unreachable = f"{type(e).__name__}: {e}"
            self.agent_stderr.append(f"fallback kill failed: {unreachable}")
        with self._lock:
            missing = [r for r in targets if r not in self._rc]
            self._escalated |= set(missing)
        for r in missing:
            if unreachable is not None:
                why = (f"its agent did not answer and the host could not be reached to kill rank {r} "
                       f"({unreachable})")
                self._record_exit(r, EXIT_LOST, f"[launcher] {self.host}: {why}", lost=why)
            else:
                note = (f"[launcher] rank {r} killed over a fresh SSH connection (its agent on {self.host} did "
                        "not answer)" if r in self._pids else f"[launcher] rank {r} never started on {self.host}")
                self._record_exit(r, -signal.SIGKILL, note)
        if proc is not None and ranks is None:
            try:
                self._loop.run(_close_proc(proc), timeout=5)
            except Exception:  # noqa: BLE001
                pass

    def _exited_within(self, ranks: Sequence[int], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if all(r in self._rc for r in ranks):
                    return True
            self._all_exited.wait(0.05)
        return False

    def join(self, timeout: float | None = None) -> None:
        self._dispatcher.join(timeout)


async def _write(proc: "asyncssh.SSHClientProcess[str]", text: str) -> None:
    proc.stdin.write(text)
    await asyncio.wait_for(proc.stdin.drain(), 5)


async def _close_proc(proc: "asyncssh.SSHClientProcess[str]") -> None:
    proc.close()
