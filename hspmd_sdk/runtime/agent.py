"""The per-host agent: ``python -m hspmd_sdk.runtime.agent --host NAME --job ID`` (started over SSH).

One agent runs on each host of a remote job, in a session of its own (the SSH transport starts it under
``setsid``).  It reads control messages from stdin, one JSON object a line:

- ``{"t": "start", "ranks": [...], "spec": "<LaunchSpec JSON>"}`` (first line): start one worker per rank, each
  in its own process group, exactly as :class:`~hspmd_sdk.runtime.transport.LocalTransport` does locally (the
  spec goes to each worker's stdin; rank, world size and master address into its environment);
- ``{"t": "kill", "grace": seconds}``: stop every worker (SIGTERM, SIGKILL after the grace period).

and writes messages to stdout, one ``@agent {JSON}`` line each, written whole under a lock so that lines of
different workers never interleave: ``ready`` (agent pid and process group), ``started`` (a rank's pid = its
process group), ``line`` (one line a worker wrote: ``s`` is ``out``/``err``, ``x`` the text), ``exit`` (a rank's
return code and whether the agent's own kill caused it), ``bye``.  When stdin closes (the launcher went away or
the connection dropped) the agent stops every worker and exits; it also exits once every worker has exited.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from typing import Any, Sequence

from .spec import LaunchSpec
from .transport import LocalTransport, WorkerGroup

PREFIX = "@agent "
#: Grace period (s) between SIGTERM and SIGKILL when the launcher's connection closes.
EOF_GRACE_S = 0.5


class Emitter:
    """Writes ``@agent`` lines to a file descriptor, one ``os.write`` loop per line under a lock."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()
        self.broken = False

    def __call__(self, kind: str, **fields: Any) -> None:
        data = (PREFIX + json.dumps({"t": kind, **fields}, separators=(",", ":")) + "\n").encode("utf-8",
                                                                                                   "replace")
        with self._lock:
            if self.broken:
                return
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError:
                self.broken = True  # the launcher is gone; the stdin watcher stops the workers


class LineReader:
    """Reads lines from a file descriptor with ``os.read`` (no buffering surprises with threads)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = bytearray()

    def readline(self) -> bytes:
        while b"\n" not in self._buf:
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                rest, self._buf = bytes(self._buf), bytearray()
                return rest
            self._buf += chunk
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return line + b"\n"


class Agent:
    """The agent's state: its workers, the ranks that exited, and the emitter."""

    def __init__(self, host: str, emit: Emitter) -> None:
        self.host = host
        self.emit = emit
        self.group: WorkerGroup | None = None
        self.ranks: list[int] = []
        self._exited: set[int] = set()
        self._lock = threading.Lock()
        self.all_exited = threading.Event()

    def start(self, msg: dict[str, Any]) -> None:
        spec = LaunchSpec.from_line(msg["spec"])
        self.ranks = [int(r) for r in msg["ranks"]]
        self.group = LocalTransport().start(self.host, self.ranks, spec, self._on_line, self._on_exit)
        for rank, pid in self.group.pids().items():
            self.emit("started", rank=rank, pid=pid)

    def _on_line(self, rank: int, stream: str, text: str) -> None:
        self.emit("line", rank=rank, s=stream, x=text)

    def _on_exit(self, rank: int, rc: int) -> None:
        group = self.group
        killed = bool(group is not None and group.stopped_by_kill(rank, rc))
        self.emit("exit", rank=rank, rc=rc, killed=killed)
        with self._lock:
            self._exited.add(rank)
            if self.ranks and self._exited >= set(self.ranks):
                self.all_exited.set()

    def kill(self, grace_s: float) -> None:
        if self.group is not None:
            self.group.kill(grace_s=grace_s)

    def control(self, reader: LineReader) -> None:
        """Serve ``kill`` messages until stdin closes; then stop everything."""
        while True:
            line = reader.readline()
            if not line:
                break
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("t") == "kill":
                threading.Thread(target=self.kill, args=(float(msg.get("grace", 0.5)),), daemon=True).start()
        self.kill(EOF_GRACE_S)
        self.all_exited.wait(10.0)
        os._exit(0)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hspmd_sdk.runtime.agent", description=__doc__.split("\n")[0])
    p.add_argument("--host", required=True, help="this host's name in the cluster")
    p.add_argument("--job", default="", help="job id (so that the process is recognisable in a listing)")
    args = p.parse_args(argv)
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader (started under setsid)
    out = os.dup(1)
    os.dup2(2, 1)  # a stray print cannot corrupt the protocol channel
    emit = Emitter(out)
    reader = LineReader(0)
    emit("ready", pid=os.getpid(), pgid=os.getpgid(0), hostname=socket.gethostname(), python=sys.executable)
    agent = Agent(args.host, emit)
    first = reader.readline()
    if not first:
        os._exit(0)
    try:
        agent.start(json.loads(first))
    except Exception as exc:  # noqa: BLE001 - the launcher must hear why
        emit("fatal", message=f"{type(exc).__name__}: {exc}")
        agent.kill(0.0)
        os._exit(1)
    threading.Thread(target=agent.control, args=(reader,), name="hspmd-agent-control", daemon=True).start()
    agent.all_exited.wait()
    emit("bye")
    os._exit(0)


if __name__ == "__main__":
    main()
