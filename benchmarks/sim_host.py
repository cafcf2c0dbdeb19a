"""One simulated host of the control-plane harness (issue 45 item 2): many simulated workers in one process.

Started by :class:`sim_workers.SimTransport` (``python benchmarks/sim_host.py``).  Each simulated worker speaks
the real worker protocol (:mod:`hspmd_sdk.runtime.protocol`) with no torch work: it reads its launch line (the
real :class:`~hspmd_sdk.runtime.spec.LaunchSpec` line the launcher wrote for it, its own Program part included),
says ``hello``, ``phase`` and ``ready`` when the whole world has started (the rendezvous), beats every
``heartbeat_s``, reports a ``metric`` per step on a step clock common to every simulated host, applies a ``switch``
at its next step boundary (``switched``), halts on ``halt`` (``halted``, with the version it holds), rejoins on
``reconfigure`` (``switched``) and goes on from the step it names, ends after the step under way on ``stop``, then
says ``trained`` and ``result`` and exits.

What a simulated worker does *not* do: train, communicate with its peers, or agree with them at a commit (a real
worker applies a switch at the step every rank agreed on; a simulated one at its next step boundary after it heard
it, so the ranks' ``switched`` steps may differ by one: the launcher's bookkeeping does not depend on it).

stdin, from the transport (one command a line, JSON):

* ``{"cmd": "start", "ranks": [...]}`` then a line per rank, its launch line;
* ``{"cmd": "go", "t0": T}``: every rank of the world started; step ``k`` ends at ``T + (k + 1) * step_s``;
* ``{"cmd": "control", "ranks": [...]}`` then one control line (``control_line("control", msg=...)``) for them;
* ``{"cmd": "die", "ranks": [...]}``: those ranks are lost (as by SIGKILL: they say nothing more);
* ``{"cmd": "kill", "ranks": [...]}``: the job stops them (as by SIGTERM).

stdout, to the transport: ``<rank> <protocol line>`` for each line a worker writes, ``X <rank> <returncode>`` when
it exits.
"""
from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from typing import Any

PREFIX = "@hspmd "
SIGKILL, SIGTERM = 9, 15


class Rank:
    """One simulated worker."""

    def __init__(self, rank: int, spec: dict[str, Any]) -> None:
        self.rank = rank
        self.steps = int(spec["steps"])
        self.tokens = 1
        self.step = 0                 # the next step to run
        self.world = 0                # the reconfiguration it runs in
        self.version = [0, 0]         # the plan version it holds
        self.switches: list[int] = []  # switch ids heard, not applied yet
        self.halted = False
        self.alive = True


class Host:
    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.ranks: dict[int, Rank] = {}
        self.heartbeat_s = 1.0
        self.t0: float | None = None
        self.tick = 0
        self.out = sys.stdout
        self.lock = threading.Lock()

    # ---- writing ----------------------------------------------------------------------------------------------
    def send(self, lines: list[str]) -> None:
        if lines:
            with self.lock:
                self.out.write("".join(lines))
                self.out.flush()

    @staticmethod
    def line(kind: str, rank: int, **fields: Any) -> str:
        msg = {"t": kind, "rank": rank, "time": time.time(), **fields}
        return f"{rank} {PREFIX}{json.dumps(msg, separators=(',', ':'))}\n"

    def exit(self, r: Rank, rc: int) -> str:
        r.alive = False
        return f"X {r.rank} {rc}\n"

    # ---- commands ---------------------------------------------------------------------------------------------
    def start(self, ranks: list[int], lines: list[str]) -> None:
        for rank, text in zip(ranks, lines):
            spec = json.loads(text)  # the worker's launch line, parsed as a worker parses it
            self.heartbeat_s = float(spec.get("heartbeat_s", 1.0))
            self.ranks[rank] = Rank(rank, spec)
        self.send([self.line("hello", r, pid=os.getpid(), pgid=os.getpgid(0), host="sim") for r in ranks])

    def go(self, t0: float) -> None:
        self.t0 = t0
        out = []
        for r in self.ranks.values():
            out += [self.line("phase", r.rank, name="imported"), self.line("ready", r.rank)]
        self.send(out)

    def control(self, ranks: list[int], text: str) -> None:
        msg = json.loads(text)["msg"]
        kind = msg.get("type")
        out = []
        for rank in ranks:
            r = self.ranks.get(rank)
            if r is None or not r.alive:
                continue
            if kind == "switch":
                r.switches.append(int(msg["id"]))
            elif kind == "stop":  # Job.stop(): the run ends after the step under way
                r.steps = min(r.steps, r.step + 1)
            elif kind == "halt" and not r.halted:
                r.halted = True
                out.append(self.line("halted", rank, step=r.step - 1, source="live", after=r.world,
                                     error="CommFailure: a peer was lost (simulated)", finish=None,
                                     held=list(r.version), previous_held=None, whole=list(r.version), empty=False))
            elif kind == "reconfigure":
                ident, floor = int(msg["id"]), int(msg.get("switch_floor", 0))
                if str(rank) not in {str(k) for k in msg["ranks"]}:
                    out.append(self.exit(r, 1))
                    continue
                r.world, r.version, r.halted = ident, [ident, floor], False
                r.step = int(msg["resume_step"])
                r.switches = [s for s in r.switches if s > floor]
                out.append(self.line("switched", rank, id=ident, what="reconfigure", step=r.step, seconds=0.0,
                                     rejoin_s=0.0, wait_s=0.0, bytes=0))
        self.send(out)

    def stop(self, ranks: list[int], rc: int) -> None:
        self.send([self.exit(self.ranks[r], rc) for r in ranks if r in self.ranks and self.ranks[r].alive])

    # ---- the clock ----------------------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Run every step whose end has passed."""
        if self.t0 is None:
            return
        due = int((now - self.t0) / self.step_s)
        while self.tick < due:
            self.tick += 1
            out = []
            for r in self.ranks.values():
                if not r.alive or r.halted or r.step >= r.steps:
                    continue
                out.append(self.line("metric", r.rank, step=r.step, step_time=self.step_s, loss=1.0,
                                     tokens=r.tokens, extra={"compute_s": self.step_s / 2}))
                r.step += 1
                for ident in r.switches:  # applied at the boundary: the next step runs the new plan
                    r.version = [r.world, ident]
                    out.append(self.line("switched", r.rank, id=ident, what="switch", step=r.step, seconds=0.0,
                                         bytes=0))
                r.switches = []
                if r.step >= r.steps:
                    out.append(self.line("trained", r.rank, step=r.steps - 1))
                    out.append(self.line("result", r.rank, value={"runs": [{"losses": [1.0] * r.steps,
                                                                              "rank": r.rank,
                                                                              "launch_rank": r.rank}],
                                                                    "losses": [1.0] * r.steps}))
                    out.append(self.exit(r, 0))
            self.send(out)

    def beat(self) -> None:
        self.send([self.line("beat", r.rank, comm_s=None) for r in self.ranks.values() if r.alive])


def _reader(q: "queue.Queue[Any]") -> None:
    stdin = sys.stdin
    while True:
        line = stdin.readline()
        if not line:
            q.put(None)
            return
        cmd = json.loads(line)
        if cmd["cmd"] == "start":
            cmd["lines"] = [stdin.readline() for _ in cmd["ranks"]]
        elif cmd["cmd"] == "control":
            cmd["line"] = stdin.readline()
        q.put(cmd)


def main() -> None:
    host = Host(float(sys.argv[1]))
    q: "queue.Queue[Any]" = queue.Queue()
    threading.Thread(target=_reader, args=(q,), daemon=True).start()
    next_beat = time.monotonic()
    while True:
        try:
            cmd = q.get(timeout=0.01)
        except queue.Empty:
            cmd = ""
        if cmd is None:  # the launcher went away: every worker left exits as orphaned
            host.stop([r.rank for r in host.ranks.values() if r.alive], 3)
            return
        if cmd:
            kind = cmd["cmd"]
            if kind == "start":
                host.start([int(r) for r in cmd["ranks"]], cmd["lines"])
            elif kind == "go":
                host.go(float(cmd["t0"]))
            elif kind == "control":
                host.control([int(r) for r in cmd["ranks"]], cmd["line"])
            elif kind == "die":
                host.stop([int(r) for r in cmd["ranks"]], -SIGKILL)
            elif kind == "kill":
                host.stop([int(r) for r in cmd["ranks"]], -SIGTERM)
        host.advance(time.time())
        if time.monotonic() >= next_beat:
            host.beat()
            next_beat = time.monotonic() + host.heartbeat_s
        if host.ranks and host.t0 is not None and not any(r.alive for r in host.ranks.values()):
            return


if __name__ == "__main__":
    main()
