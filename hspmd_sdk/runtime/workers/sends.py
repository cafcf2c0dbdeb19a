"""Split-phase point-to-point messages (:class:`~hspmd_sdk.core.comm_ops.PointToPointOp`): sends posted and waited
for later, receives posted ahead and assembled where they are read -- what pipeline stages (:mod:`.p2p`) and graph
switches (:mod:`.switch_exec`) use; :func:`~.comm.execute` runs a whole operator at once.

A message ``i`` of an operator is tagged ``tag_base + i`` on the wire; sender and receiver post the same messages
with the same tags and, with ``group``, on the same process group (:data:`P2PGroup`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from ...core.slices import Box, box_numel, box_shape, relative
from .comm import Pending

if TYPE_CHECKING:
    from ...core.comm_ops import PointToPointOp

__all__ = ["P2PGroup", "post_sends", "post_receives", "receive", "SendWaiter"]


P2PGroup = Callable[[int, int], "dist.ProcessGroup | None"]


def post_sends(op: PointToPointOp, x: torch.Tensor | None, rank: int, in_box: Box | None,
               tag_base: int = 0, group: P2PGroup | None = None) -> list[tuple[dist.Work, torch.Tensor]]:
    """Post this rank's sends of ``op`` asynchronously (``isend``; message ``i`` tagged ``tag_base + i``) from its
    local tensor ``x`` holding ``in_box``; returns ``(work, buffer)`` pairs to wait on later.  With
    :func:`receive` this is the split-phase form of a point-to-point operator that pipeline stages use: the
    sending stage goes on computing while its messages travel.  ``group(src, dst)``: the process group a message
    travels on (default: the whole job's)."""
    pending = []
    for i, m in enumerate(op.messages):
        if m.src == rank and m.dst != rank:
            assert x is not None and in_box is not None
            buf = x[relative(m.box, in_box)].contiguous()
            pg = group(m.src, m.dst) if group is not None else None
            pending.append((dist.isend(buf, m.dst, tag=tag_base + i, group=pg), buf))
    return pending


class SendWaiter:
    """Waits for posted messages (:func:`post_sends`' pairs; a switch's ``batch_isend_irecv``) on a daemon thread
    of its own, while the caller's thread watches ``halted`` (a peer of this world died:
    ``WorkerState.peer_failed``) every ``poll_s`` seconds.

    Why a thread: gloo (torch 2.13) does not fail a send whose bytes were still queued on a connection when that
    connection broke (its ``Pair::signalException`` signals queued sends of bound buffers only, not ``isend``'s
    unbound ones).  A rank whose send to a peer that had just died lost that race waited in ``Work.wait()`` until
    the process group's timeout, and the whole recovery with it.  Waited for here, the caller stops at the halt
    and raises :class:`~.liveness.CommFailure`; the stuck wait is left on its thread (it ends at the group's
    timeout, also after the group was destroyed: checked), and later waits get a fresh thread.  The exception a
    message's wait raised reaches the caller unchanged."""

    def __init__(self, halted: Callable[[], bool] | None, *, rank: int = -1, poll_s: float = 0.02) -> None:
        self.halted, self.rank, self.poll_s = halted, rank, poll_s
        self._jobs: Any = None

    def wait(self, pending: list[tuple[dist.Work, torch.Tensor]]) -> None:
        """Wait until every send of ``pending`` completed; raises what a wait raised, or ``CommFailure`` when
        ``halted()`` turns true first."""
        if not pending:
            return
        if self.halted is None:  # no one to say that a peer died: wait here
            for work, _ in pending:
                work.wait()
            return
        import threading

        if self._jobs is None:
            import queue
            import weakref

            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_wait_sends_loop, args=(self._jobs,), name="hspmd-sends", daemon=True).start()
            weakref.finalize(self, self._jobs.put, None)  # the thread ends with its waiter
        done, failed = threading.Event(), []
        self._jobs.put((pending, done, failed))
        while not done.wait(self.poll_s):
            if self.halted():
                self._jobs.put(None)  # its thread ends if its wait ever returns; the next wait starts another
                self._jobs = None
                from .liveness import CommFailure  # lazy: liveness is the worker's, comm also runs in tests

                raise CommFailure(f"rank {self.rank}: a peer died while this rank waited for {len(pending)} "
                                  "message(s) to complete")
        if failed:
            raise failed[0]


def _wait_sends_loop(jobs: Any) -> None:
    """A :class:`SendWaiter`'s thread: waits for each job's sends in turn, until it gets ``None``."""
    while True:
        job = jobs.get()
        if job is None:
            return
        pending, done, failed = job
        try:
            for work, _ in pending:
                work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which raises it
            failed.append(e)
        done.set()
        del job, pending


def post_receives(op: PointToPointOp, rank: int, dtype: torch.dtype, device: torch.device,
                  tag_base: int = 0, group: P2PGroup | None = None) -> Pending:
    """Post this rank's receives of ``op`` (``irecv``; message ``i`` tagged ``tag_base + i``) and return at once;
    ``.wait()`` assembles its output box (``None`` if it has none).  The peer posts the same messages with the
    same tags (:func:`post_sends` or :func:`~.comm.execute`).  Posting early changes no result: messages match by
    (peer, tag) in posting order, and the caller waits where it would have received.  ``group``: as in
    :func:`post_sends` (the sender's and the receiver's must agree)."""
    outb = dict(op.out_boxes)
    if rank not in outb:
        return Pending.done(None)
    what = f"{op.kind} receive (tag {tag_base})"
    mine = [(i, m) for i, m in enumerate(op.messages) if m.dst == rank and m.src != rank]
    if len(mine) == 1 and mine[0][1].box == outb[rank]:  # one message is the whole output: receive in place
        (i, m), = mine
        whole = torch.empty(box_shape(outb[rank]), dtype=dtype, device=device)
        pg = group(m.src, m.dst) if group is not None else None
        return Pending([dist.irecv(whole.view(-1), m.src, tag=tag_base + i, group=pg)], lambda: whole, what, rank)
    out = torch.zeros(box_shape(outb[rank]), dtype=dtype, device=device)
    recvs = []
    for i, m in enumerate(op.messages):
        if m.dst == rank and m.src != rank:
            buf = torch.empty(box_numel(m.box), dtype=dtype, device=device)
            pg = group(m.src, m.dst) if group is not None else None
            recvs.append((dist.irecv(buf, m.src, tag=tag_base + i, group=pg), buf, m.box))

    def finish() -> torch.Tensor:
        for _, buf, box in recvs:
            out[relative(box, outb[rank])] = buf.reshape(box_shape(box))
        return out

    return Pending([w for w, _, _ in recvs], finish, what, rank)


def receive(op: PointToPointOp, rank: int, dtype: torch.dtype, device: torch.device,
            tag_base: int = 0) -> torch.Tensor | None:
    """Receive this rank's part of ``op`` (blocking) into a new tensor of its output box; ``None`` if it has none
    (:func:`post_receives`, waited for)."""
    return post_receives(op, rank, dtype, device, tag_base).wait()
