"""Pipeline point-to-point: the one path by which stage-boundary messages are sent and received (paper §6.3).

A Reshard that crosses pipeline stages (a rank holds only its source, or only its destination) is carried by the
schedule's transfer actions: the sending stage posts its messages asynchronously (``SEND_F`` / ``SEND_B``), the
receiving stage receives them blocking (``RECV_F`` / ``RECV_B``), and every send of a step is waited for at its end
-- the semantics under which :func:`hspmd_sdk.core.schedule.replay` proves the schedules deadlock-free.
:class:`StageTransfers` holds one rank's messages in flight; :func:`tag` gives each micro-batch and direction its
own message tags (``PRE`` / ``POST`` have :data:`PRE_TAG` / :data:`POST_TAG`), so that a receive posted ahead
(:func:`next_receives`, under gloo) matches only its own message.  :func:`pipeline_groups` makes a process group per
pair of ranks and direction (what NCCL needs).  :func:`identity_for` tells where a plan sends, receives or
computes nothing for a rank (its tensor stays as it is).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ...core.comm_ops import CollectiveOp, IdentityOp, PointToPointOp, SplitCollectiveOp
from ...core.program_part import world_pipeline_pairs
from .comm import Pending, execute_op
from .sends import SendWaiter, post_receives, post_sends
from .errors import ExecutorError

if TYPE_CHECKING:
    from ...core.comm_plan import CommPlan
    from ...core.schedule import Action
    from ...core.specialize import Program
    from .comm import Groups

__all__ = ["StageTransfers", "tag", "PRE_TAG", "POST_TAG", "next_receives", "pipeline_pairs", "pipeline_groups",
           "identity_for"]


def tag(mb: int, direction: int) -> int:
    """Message tag base of micro-batch ``mb`` (``direction`` 0: activations, 1: gradients)."""
    return ((mb % 4096) * 2 + direction) * 1024


#: Tag bases of the point-to-point messages of ``PRE`` (a tied weight's copy) and ``POST`` (its gradient back),
#: past every micro-batch's: a receive posted ahead for micro-batch 0 never matches them.
PRE_TAG, POST_TAG = tag(4095, 1) + 1024, tag(4095, 1) + 2048


class StageTransfers:
    """One rank's stage-boundary messages: sends posted asynchronously and waited for at the end of the step,
    receives blocking, a receive's first operator possibly posted ahead (:meth:`post_ahead`).

    ``groups``: the process-group lookup; ``p2p_groups``: :func:`pipeline_groups` (default: the job's group);
    ``dtype`` / ``device``: of the received tensors.  Sends are waited for while watching for a peer's death
    (``groups.peer_failed``; gloo may never fail them)."""

    def __init__(self, groups: "Groups", *, rank: int, device: torch.device, dtype: torch.dtype,
                 p2p_groups: Mapping[tuple[int, int, int], dist.ProcessGroup] | None = None) -> None:
        self.groups, self.rank, self.device, self.dtype = groups, rank, device, dtype
        self.p2p_groups = p2p_groups
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []   # sends posted this step
        self.posted: dict[tuple[str, int, str], Pending] = {}     # receives posted ahead: (kind, mb, op)
        self._sends = SendWaiter(getattr(groups, "peer_failed", None), rank=rank)

    def clear(self) -> None:
        """Forget what an interrupted pass left in flight (a new pass starts)."""
        self.posted.clear()
        self.pending.clear()

    def group(self, direction: int) -> Callable[[int, int], dist.ProcessGroup | None] | None:
        """Where a stage-boundary message of ``direction`` (0: activations, 1: gradients) travels: its pair's
        group of that direction (NCCL), or the job's group (``None``)."""
        if self.p2p_groups is None:
            return None
        groups = self.p2p_groups
        return lambda src, dst: groups.get((direction, min(src, dst), max(src, dst)))

    def send(self, plan: "CommPlan", local: torch.Tensor, mb: int, direction: int) -> None:
        """Post this rank's messages of a stage-crossing plan asynchronously (other operators run in place)."""
        cur: torch.Tensor | None = local.detach()
        t, group = tag(mb, direction), self.group(direction)
        for i, op in enumerate(plan.ops):
            if isinstance(op, PointToPointOp):
                self.pending.extend(post_sends(op, cur, self.rank, dict(op.in_boxes).get(self.rank), t, group))
            else:
                cur = execute_op(plan, i, cur, self.groups, rank=self.rank, device=self.device)

    def post_ahead(self, key: tuple[str, int, str], plan: "CommPlan", mb: int, direction: int) -> bool:
        """Post the receives of ``plan``'s first operator under ``key`` ahead of its action, if it is a
        point-to-point operator and not posted yet; returns whether it posted."""
        if key in self.posted or not plan.ops or not isinstance(plan.ops[0], PointToPointOp):
            return False
        self.posted[key] = post_receives(plan.ops[0], self.rank, self.dtype, self.device, tag(mb, direction),
                                         self.group(direction))
        return True

    def receive(self, plan: "CommPlan", mb: int, direction: int, key: tuple[str, int, str] | None = None
                ) -> torch.Tensor:
        """Receive this rank's part of a stage-crossing plan (blocking; its first operator's receives may have
        been posted ahead under ``key``); returns its destination tensor."""
        cur: torch.Tensor | None = None
        t, group = tag(mb, direction), self.group(direction)
        for i, op in enumerate(plan.ops):
            if isinstance(op, PointToPointOp):
                ahead = self.posted.pop(key, None) if i == 0 and key is not None else None
                got = (ahead or post_receives(op, self.rank, self.dtype, self.device, t, group)).wait()
                cur = got if got is not None else cur
            else:
                cur = execute_op(plan, i, cur, self.groups, rank=self.rank, device=self.device)
        if cur is None:
            raise ExecutorError(f"rank {self.rank}: plan {plan.src} -> {plan.dst} gives this rank nothing to receive")
        return cur

    def wait_sends(self) -> None:
        """Wait for every send of the step (watching for a peer's death)."""
        if self.pending:
            pending, self.pending = self.pending, []
            self._sends.wait(pending)


def next_receives(actions: Sequence["Action"]) -> list[list[int]]:
    """For each action index, the receive actions to post before it runs: a ``RECV_F`` / ``RECV_B`` is posted
    when the previous receive of its direction runs (the first ones before the first action), so each is posted
    once, at most two per direction are outstanding, and each is posted before its own action."""
    out: list[list[int]] = [[] for _ in actions]
    last: dict[str, int] = {}
    for j, a in enumerate(actions):
        if a.kind in ("RECV_F", "RECV_B"):
            out[last.get(a.kind, 0)].append(j)
            last[a.kind] = j
    return out


def pipeline_pairs(program: "Program") -> list[tuple[int, int, int]]:
    """``(direction, low rank, high rank)`` of every pair of ranks that exchanges stage-boundary messages — a
    rank holding only the source of a Reshard with one holding only its destination (direction 0: activations,
    the Reshard's plan; 1: gradients, its backward plan) — sorted, the same on every rank: the core's
    :func:`~hspmd_sdk.core.program_part.world_pipeline_pairs`, which a Program part carries.  Messages of ranks
    that hold both ends run inside :func:`~.comm.reshard` on the job's group."""
    pairs = getattr(program, "world_pipeline_pairs", None)  # a part carries them; a whole Program's are worked out
    return sorted(tuple(k) for k in (world_pipeline_pairs(program) if pairs is None else pairs))


def pipeline_groups(program: "Program", timeout_s: float = 120.0) -> dict[tuple[int, int, int], dist.ProcessGroup]:
    """A process group per :func:`pipeline_pairs` entry, created in sorted order (call on every rank of the
    job).  NCCL runs a pair's point-to-point operations in issue order on one stream, and a 1F1B stage issues
    its sends of activations and receives of gradients in another order than its neighbour: on one group per
    direction each stream sees the same order on both sides (micro-batch order)."""
    from datetime import timedelta

    return {key: dist.new_group(list(key[1:]), timeout=timedelta(seconds=timeout_s))
            for key in pipeline_pairs(program)}


def identity_for(plan: "CommPlan", rank: int) -> bool:
    """Whether ``plan`` leaves ``rank``'s tensor as it is (every operator is Identity or does not touch it)."""
    for op in plan.ops:
        if isinstance(op, IdentityOp):
            continue
        if isinstance(op, CollectiveOp):
            for g in op.groups:
                if rank in g.ranks:
                    i = g.ranks.index(rank)
                    if len(g.ranks) > 1 or g.in_boxes[i] != g.out_boxes[i]:
                        return False
        elif isinstance(op, SplitCollectiveOp):
            if any(r == rank for r, _ in op.in_boxes + op.out_boxes):
                return False
        elif isinstance(op, PointToPointOp):
            if any(rank in (m.src, m.dst) for m in op.messages) or rank in op.zero_fill:
                return False
            outb = dict(op.in_boxes), dict(op.out_boxes)
            if rank in outb[1] and outb[0].get(rank) != outb[1][rank]:
                return False
        else:
            return False
    return True
