"""The per-host agent: ``python -m hspmd_sdk.runtime.transports.agent --host=NAME --job=ID`` (started over SSH).

One agent runs on each host of a remote job, in a session of its own (the SSH transport starts it under
``setsid``; the host name is passed as ``--host=NAME``, so no name can be read as an option).  It reads control
messages from stdin, one JSON object a line:

- ``{"t": "start", "ranks": [...], "spec": "<LaunchSpec JSON>"}`` (first line): start one worker per rank, each
  in its own process group, exactly as :class:`~hspmd_sdk.runtime.transports.transport.LocalTransport` does locally (the
  spec goes to each worker's stdin; rank, world size and master address into its environment);
- ``{"t": "kill", "grace": seconds, "ranks": [...] | null}``: stop those workers (default every one): SIGTERM,
  SIGKILL after the grace period;
- ``{"t": "control", "ranks": [...], "msg": {...}}``: relay a control message to those workers' stdin;
- ``{"t": "dump", "rank": R}``: ask worker R for its stacks (SIGUSR1, and SIGCONT in case it is stopped);
- ``{"t": "ping"}``: the launcher is alive.

and writes messages to stdout, one ``@agent {JSON}`` line each, written whole under a lock so that lines of
different workers never interleave: ``ready`` (agent pid and process group), ``started`` (a rank's pid = its
process group), ``line`` (one line a worker wrote: ``s`` is ``out``/``err``, ``x`` the text), ``exit`` (a rank's
return code and whether the agent's own kill caused it), ``beat`` (every ``spec.heartbeat_s`` seconds), ``bye``.

The agent and the launcher watch each other: when stdin closes (the launcher went away, the connection dropped)
or nothing at all has come from the launcher for ``spec.silent_s`` seconds (a partition, a frozen launcher), the
agent stops every worker and exits; it also exits once every worker has exited.  Its workers, in turn, exit when
the agent falls silent (they hear its pings).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Sequence

from ..protocol import LineReader
from ..spec import LaunchSpec
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


class Agent:
    """The agent's state: its workers, the ranks that exited, and the emitter."""

    def __init__(self, host: str, emit: Emitter) -> None:
        self.host = host
        self.emit = emit
        self.group: WorkerGroup | None = None
        self.ranks: list[int] = []
        self.spec: LaunchSpec | None = None
        self.last_heard = time.monotonic()
        self._exited: set[int] = set()
        self._lock = threading.Lock()
        self.all_exited = threading.Event()

    def start(self, msg: dict[str, Any]) -> None:
        self.spec = spec = LaunchSpec.from_line(msg["spec"])
        self.ranks = [int(r) for r in msg["ranks"]]
        self.group = LocalTransport().start(self.host, self.ranks, spec, self._on_line, self._on_exit)
        for rank, pid in self.group.pids().items():
            self.emit("started", rank=rank, pid=pid)
        self.last_heard = time.monotonic()

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

    def kill(self, grace_s: float, ranks: Sequence[int] | None = None) -> None:
        if self.group is not None:
            self.group.kill(grace_s=grace_s, ranks=ranks)

    def handle(self, msg: dict[str, Any]) -> None:
        """One control message from the launcher (after ``start``)."""
        kind, group = msg.get("t"), self.group
        if kind == "kill":
            ranks = msg.get("ranks")
            threading.Thread(target=self.kill, args=(float(msg.get("grace", 0.5)),
                                                     None if ranks is None else [int(r) for r in ranks]),
                             daemon=True).start()
        elif kind == "control" and group is not None and isinstance(msg.get("msg"), dict):
            group.send_control(msg["msg"], [int(r) for r in msg.get("ranks") or self.ranks])
        elif kind == "dump" and group is not None:
            group.dump_stack(int(msg["rank"]))

    def control(self, reader: LineReader) -> None:
        """Serve the launcher's messages until stdin closes; then stop everything."""
        while True:
            line = reader.readline()
            if not line:
                break
            self.last_heard = time.monotonic()
            try:
                msg = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(msg, dict):
                self.handle(msg)
        self.shutdown("the launcher closed the connection")

    def beat(self) -> None:
        """A beat to the launcher every heartbeat period, until every worker exited."""
        assert self.spec is not None
        while not self.all_exited.wait(self.spec.heartbeat_s):
            self.emit("beat")

    def watch(self) -> None:
        """Stop everything when the launcher has been silent for ``spec.silent_s`` (never writes to stdout, so a
        full channel cannot block it)."""
        assert self.spec is not None
        while not self.all_exited.wait(min(0.5, self.spec.heartbeat_s)):
            silent = time.monotonic() - self.last_heard
            if silent > self.spec.silent_s:
                self.shutdown(f"no word from the launcher for {silent:.1f} s (cut off?)")

    def shutdown(self, why: str) -> None:
        try:
            os.write(2, f"hspmd agent on {self.host}: {why}; stopping its workers\n".encode())
        except OSError:
            pass
        self.kill(EOF_GRACE_S)
        self.all_exited.wait(10.0)
        os._exit(0)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hspmd_sdk.runtime.transports.agent", description=__doc__.split("\n")[0])
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
    for name, target in (("control", lambda: agent.control(reader)), ("beat", agent.beat),
                         ("watch", agent.watch)):
        threading.Thread(target=target, name=f"hspmd-agent-{name}", daemon=True).start()
    agent.all_exited.wait()
    emit("bye")
    os._exit(0)


if __name__ == "__main__":
    main()
