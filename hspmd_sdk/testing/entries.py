"""Diagnostic entries for checking a runtime installation (and the launcher's tests).

Launch one with ``launch(cluster=Cluster.local(4), entry="hspmd_sdk.testing.entries:allreduce_check",
steps=2)``.  Each is an ordinary entry ``fn(state, spec) -> dict``.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from ..runtime.spec import LaunchSpec
from ..runtime.workers.worker import WorkerState


def default_groups(world: int) -> list[list[int]]:
    """Disjoint pairs, plus overlapping groups: ``(1, 2)`` and the first three ranks (for a world of >= 3)."""
    groups = [[r, r + 1] for r in range(0, world - 1, 2)]
    if world >= 3:
        groups += [[1, 2], [0, 1, 2]]
    return groups


def allreduce_check(state: WorkerState, spec: LaunchSpec) -> dict[str, Any]:
    """Real collectives on the world and on sub-groups, returned raw for the caller to check.

    Per step: world all_reduce of ``rank + 1``; all_reduce of ``rank + 1`` inside each group of
    ``payload["groups"]`` (default :func:`default_groups`) that holds this rank; all-gather (into one tensor) of
    ``rank``; reduce-scatter (one tensor) of ``rank + 1`` everywhere; a ring of batch_isend_irecv (send ``rank``
    to the next rank).
    Reports ``loss = world_sum / (step + 1)`` each step and prints a line to stdout and one to fd 1 directly.
    """
    import torch
    import torch.distributed as dist

    world, rank = state.world_size, state.rank
    groups = [sorted(g) for g in spec.payload.get("groups", default_groups(world))]
    state.create_groups(groups)
    out: dict[str, Any] = {}
    for step in range(spec.steps):
        state.begin_step()
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        out["world_sum"] = t.item()
        out["group_sums"] = {}
        for g in groups:
            if rank in g:
                x = torch.tensor([float(rank + 1)])
                dist.all_reduce(x, group=state.group(g))
                out["group_sums"][",".join(map(str, g))] = x.item()
        gathered = torch.empty(world)
        _all_gather(gathered, torch.tensor([float(rank)]))
        out["gathered"] = gathered.tolist()
        rs = torch.empty(1)
        _reduce_scatter(rs, torch.full((world,), float(rank + 1)))
        out["reduce_scatter"] = rs.item()
        out["ring_recv"] = _ring(rank, world) if world > 1 else rank
        state.emulate(0.001)
        print(f"step {step}: collectives done on rank {rank}")
        os.write(1, f"fd1 line from rank {rank}\n".encode())
        state.report(step, loss=out["world_sum"] / (step + 1), tokens=8)
    out["pid"] = os.getpid()
    out["payload_bytes"] = len(json.dumps(spec.payload))
    return out


def _all_gather(out: Any, inp: Any) -> None:
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    fn(out, inp)


def _reduce_scatter(out: Any, inp: Any) -> None:
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    fn(out, inp)


def _ring(rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    send, recv = torch.tensor([float(rank)]), torch.empty(1)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return int(recv.item())


def fail_on_rank(state: WorkerState, spec: LaunchSpec) -> dict[str, Any]:
    """All-reduce every step; ``payload["rank"]`` fails at ``payload["step"]``.

    ``payload["how"]``: ``"raise"`` (a ValueError, default), ``"exit"`` (``os._exit(7)``, no traceback) or
    ``"kill"`` (SIGKILL itself, like the OOM killer).  The other ranks then fail in their next collective.
    """
    import torch
    import torch.distributed as dist

    bad, at = int(spec.payload.get("rank", 0)), int(spec.payload.get("step", 0))
    how = str(spec.payload.get("how", "raise"))
    for step in range(spec.steps):
        if state.rank == bad and step == at:
            print(f"rank {bad} is about to fail ({how}) at step {step}", file=sys.stderr)
            if how == "exit":
                sys.stderr.flush()
                os._exit(7)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"deliberate failure on rank {bad} at step {step} (fail_on_rank self-test)")
        t = torch.ones(1)
        dist.all_reduce(t)
        state.report(step, loss=t.item())
    return {"steps": spec.steps}


def sleep_forever(state: WorkerState, spec: LaunchSpec) -> dict[str, Any]:
    """Report step 0, then sleep until killed; ``payload["child"]``: also start a ``sleep`` child process."""
    if spec.payload.get("child"):
        child = subprocess.Popen(["sleep", "1000"])
        state.log(f"child pid {child.pid}")
    state.report(0, loss=0.0)
    for _ in itertools.count():
        time.sleep(0.1)
    return {}


def leave_child(state: WorkerState, spec: LaunchSpec) -> dict[str, Any]:
    """Start a ``sleep`` child that inherits the worker's pipes, and return at once (the launcher must stop it)."""
    child = subprocess.Popen(["sleep", "1000"])
    state.report(0, loss=1.0)
    return {"child": child.pid}


def echo_control(state: WorkerState, spec: LaunchSpec) -> dict[str, Any]:
    """Report step 0, then log and collect every control message (``state.poll_control()``) until one says
    ``{"stop": true}``; returns them all in arrival order."""
    state.report(0, loss=0.0)
    got: list[dict[str, Any]] = []
    while not any(m.get("stop") for m in got):
        for m in state.poll_control():
            state.log(f"control: {json.dumps(m, sort_keys=True)}")
            got.append(m)
        time.sleep(0.02)
    return {"messages": got}


def hang_on_rank(state: WorkerState, spec: LaunchSpec) -> dict[str, Any]:
    """All-reduce every step; from step ``payload["step"]`` on, rank ``payload["rank"]`` hangs out of
    communication (``payload["how"]``: ``"sleep"``, a long sleep in Python; ``"spin"``, a busy loop) while its
    peers wait for it in the next all-reduce.  ``payload["rank"] = -1``: nobody hangs (a collective loop)."""
    import torch
    import torch.distributed as dist

    bad, at = int(spec.payload.get("rank", 0)), int(spec.payload.get("step", 0))
    how = str(spec.payload.get("how", "sleep"))
    for step in range(spec.steps):
        if state.rank == bad and step == at:
            state.log(f"rank {bad} hangs ({how}) at step {step}")
            deadline = time.monotonic() + 1000
            while time.monotonic() < deadline:
                if how == "sleep":
                    time.sleep(1000)
        t = torch.ones(1)
        dist.all_reduce(t)
        state.report(step, loss=t.item())
        time.sleep(float(spec.payload.get("pause", 0.02)))
    return {"steps": spec.steps}


def fail_alone(state: WorkerState, spec: LaunchSpec) -> dict[str, Any]:
    """No communication after the start: once every rank has joined (one barrier, so that no peer is still
    connecting to it), rank ``payload["rank"]`` exits with status 7; the others report ``payload["steps_each"]``
    steps, ``payload["pause"]`` seconds apart, and return (for failure policies)."""
    import torch.distributed as dist

    dist.barrier()
    if state.rank == int(spec.payload.get("rank", 0)):
        os._exit(7)
    for step in range(int(spec.payload.get("steps_each", 3))):
        time.sleep(float(spec.payload.get("pause", 0.1)))
        state.report(step, loss=float(step))
    return {"done": True}
