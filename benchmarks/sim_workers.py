"""Simulated workers for the control-plane harness (issue 45 item 2): a :class:`~hspmd_sdk.runtime.transports.
transport.Transport` whose workers speak the real protocol without torch work, thousands of them in a few
processes (:mod:`sim_host`), against the real launcher, job and controller (``launch(..., transport=
SimTransport(...))``).  Nothing of the controller is reimplemented here: the transport only carries lines, as the
SSH transport's per-host agent does.

The transport starts ``processes`` simulated hosts at its first :meth:`SimTransport.start` and spreads the job's
hosts over them (a job's host stays on one).  Every launch line (``spec.line_for(rank)``: the rank's own Program
part where the run sends parts) and every control message is written to the simulated host as the launcher wrote
it; the transport counts their bytes per rank (:attr:`SimTransport.sent`).  When every rank of the world started,
it tells every simulated host to go (the rendezvous), with a common step clock.  :meth:`SimTransport.lose` loses
ranks as a SIGKILL would (their exit status is -9, nothing more is heard from them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import IO, Any, Sequence

from hspmd_sdk.runtime.protocol import EXIT_ORPHANED, control_text_line, message_text
from hspmd_sdk.runtime.spec import LaunchSpec
from hspmd_sdk.runtime.transports.transport import ExitSink, LineSink, Transport, WorkerGroup

HOST = Path(__file__).resolve().parent / "sim_host.py"


class _Host:
    """One simulated host process and the job's callbacks for its ranks."""

    def __init__(self, python: str, step_s: float) -> None:
        self.proc = subprocess.Popen([python, str(HOST), str(step_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True, text=True, bufsize=1 << 20)
        self.lock = threading.Lock()
        self.on_line: dict[int, LineSink] = {}
        self.on_exit: dict[int, ExitSink] = {}
        self.exited: dict[int, int] = {}
        self.reader = threading.Thread(target=self._read, name=f"sim-host-{self.proc.pid}", daemon=True)
        self.reader.start()

    def write(self, text: str) -> None:
        stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]
        with self.lock:
            try:
                stdin.write(text)
                stdin.flush()
            except (BrokenPipeError, ValueError):
                pass

    def _read(self) -> None:
        stdout: IO[str] = self.proc.stdout  # type: ignore[assignment]
        for line in stdout:
            if line.startswith("X "):
                _, rank, rc = line.split()
                self.exited[int(rank)] = int(rc)
                self.on_exit[int(rank)](int(rank), int(rc))
                continue
            head, _, text = line.partition(" ")
            rank = int(head)
            self.on_line[rank](rank, "out", text.rstrip("\n"))
        self.proc.wait()
        for rank in [r for r in self.on_exit if r not in self.exited]:  # the host died: its ranks with it
            self.exited[rank] = -9
            self.on_exit[rank](rank, -9)

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class SimGroup(WorkerGroup):
    """The simulated workers of one host of the job."""

    def __init__(self, transport: "SimTransport", host: str, ranks: list[int], sim: _Host) -> None:
        self.transport, self.host, self.ranks, self.sim = transport, host, ranks, sim
        self._killed: set[int] = set()

    def poll(self) -> dict[int, int | None]:
        return {r: self.sim.exited.get(r) for r in self.ranks}

    def kill(self, grace_s: float = 0.5, ranks: Sequence[int] | None = None) -> None:
        mine = [r for r in (self.ranks if ranks is None else ranks) if r in self.ranks and r not in self.sim.exited]
        self._killed |= set(mine)
        if mine:
            self.sim.write(json.dumps({"cmd": "kill", "ranks": mine}) + "\n")
        deadline = time.monotonic() + 5.0
        while any(r not in self.sim.exited for r in mine) and time.monotonic() < deadline:
            time.sleep(0.005)

    def pids(self) -> dict[int, int]:
        return {r: self.sim.proc.pid for r in self.ranks}

    def stopped_by_kill(self, rank: int, returncode: int) -> bool:
        return rank in self._killed and returncode in (-15, EXIT_ORPHANED)

    def send_control(self, msg: dict[str, Any], ranks: Sequence[int], *, text: str | None = None) -> None:
        line = control_text_line(message_text(msg) if text is None else text)
        mine = [r for r in ranks if r in self.ranks]
        if mine:
            self.sim.write(json.dumps({"cmd": "control", "ranks": mine}) + "\n" + line)
            self.transport._count(msg, mine, len(line))

    def dump_stack(self, rank: int) -> None:
        pass  # nothing to dump: the harness never leaves a simulated worker silent


class SimTransport(Transport):
    """Simulated workers in ``processes`` host processes (see the module docstring); ``step_s``: the seconds of a
    simulated step.  :attr:`sent`: bytes written per message kind (``"launch"``, each control ``type``), each a
    list of ``(rank, bytes)``; :attr:`last_sent`: when the last message of each kind was written (``perf_counter``);
    :attr:`go_at`: when every rank of the world had started."""

    local = False

    def __init__(self, processes: int = 4, *, step_s: float = 0.5, python: str | None = None) -> None:
        self.processes, self.step_s, self.python = processes, step_s, python or sys.executable
        self._hosts: list[_Host] = []
        self._assigned: dict[str, _Host] = {}
        self._started: set[int] = set()
        self._world: int | None = None
        self._lock = threading.Lock()
        self.sent: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.last_sent: dict[str, float] = {}  #: kind -> when the last message of that kind was written
        self.whole: dict[str, list[int]] = defaultdict(list)  #: kind -> ranks sent the whole Program in one
        self.started_at: float | None = None
        self.go_at: float | None = None

    def rendezvous(self, host: str, *, fresh: bool = False) -> tuple[str, int]:
        return "127.0.0.1", 1  # nobody meets there: the simulated workers do not communicate

    def threads_per_worker(self, cluster: Any) -> int | None:
        return 1

    def start(self, host: str, ranks: Sequence[int], spec: LaunchSpec, on_line: LineSink,
              on_exit: ExitSink) -> WorkerGroup:
        with self._lock:
            if not self._hosts:
                self.started_at = time.perf_counter()
                self._hosts = [_Host(self.python, self.step_s) for _ in range(self.processes)]
                self._world = spec.world_size
            sim = self._assigned.setdefault(host, self._hosts[len(self._assigned) % len(self._hosts)])
        lines = []
        for r in ranks:
            sim.on_line[r], sim.on_exit[r] = on_line, on_exit
            line = spec.line_for(r)  # the launcher's own line for the rank (its part, where the run sends parts)
            self.sent["launch"].append((r, len(line)))
            lines.append(line if line.endswith("\n") else line + "\n")
        sim.write(json.dumps({"cmd": "start", "ranks": list(ranks)}) + "\n" + "".join(lines))
        with self._lock:
            self._started |= set(ranks)
            go = self._world is not None and len(self._started) >= self._world and self.go_at is None
            if go:
                self.go_at = time.perf_counter()
        if go:  # the whole world started: the rendezvous completes, every host steps on one clock
            t0 = time.time() + 0.1
            for h in self._hosts:
                h.write(json.dumps({"cmd": "go", "t0": t0}) + "\n")
        return SimGroup(self, host, list(ranks), sim)

    def lose(self, ranks: Sequence[int]) -> None:
        """Lose ``ranks`` as a SIGKILL would: exit status -9, nothing more from them."""
        by_host: dict[int, list[int]] = defaultdict(list)
        for h in self._hosts:
            for r in ranks:
                if r in h.on_exit:
                    by_host[id(h)].append(r)
        for h in self._hosts:
            if by_host.get(id(h)):
                h.write(json.dumps({"cmd": "die", "ranks": by_host[id(h)]}) + "\n")

    def _count(self, msg: dict[str, Any], ranks: Sequence[int], nbytes: int) -> None:
        kind = str(msg.get("type"))
        self.sent[kind] += [(r, nbytes) for r in ranks]
        if "payload" in msg:
            self.whole[kind] += list(ranks)
        self.last_sent[kind] = time.perf_counter()

    def host_pids(self) -> list[int]:
        return [h.proc.pid for h in self._hosts]

    def close(self) -> None:
        for h in self._hosts:
            h.close()

    def alive(self) -> list[int]:
        """Process ids of the simulated hosts still running."""
        return [h.proc.pid for h in self._hosts if h.proc.poll() is None]


def rss_mb(pid: int | None = None) -> float:
    """Resident memory of a process (default: this one), MB."""
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0
