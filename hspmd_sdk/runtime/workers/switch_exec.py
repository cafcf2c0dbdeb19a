"""Executing a graph switch (paper §7): the fused BSR of a :class:`~hspmd_sdk.core.switch.SwitchPlan`.

Per step of the plan, each surviving rank issues **one** ``batch_isend_irecv`` holding one send per packed message
it sends and one receive per packed message it gets -- the packed buffer is exactly the plan's
:class:`~hspmd_sdk.core.switch.PackedMessage` (its items at their byte offsets), so one (sender, receiver) pair
costs one transfer whatever the number of tensors.  Local copies and zero fills need no communication.

Failed ranks (``plan.failed``) are dead: they never call this, and the plan never makes them send.  Ranks in
the plan are the plan's numbering; when the survivors re-formed their world with new ranks, ``ranks`` maps plan
rank -> process rank, and ``group`` is the process group the point-to-point messages run in (default: the world).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

import torch
import torch.distributed as dist

from ...core.annotation import local_views
from ...core.slices import Box, box_numel, box_shape, format_box, relative
from .comm import CommExecutionError, default_device
from .sends import SendWaiter

if TYPE_CHECKING:
    from ...core.switch import PackedMessage, SwitchPlan
    from .worker import WorkerState

__all__ = ["execute_switch"]




def execute_switch(plan: "SwitchPlan", tensors: Mapping[str, torch.Tensor], state: "WorkerState | None" = None, *,
                   rank: int | None = None, ranks: Mapping[int, int] | None = None,
                   group: dist.ProcessGroup | None = None,
                   device: torch.device | str | None = None,
                   dtypes: Mapping[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """Move this rank's tensors from the plan's source layouts to its destination layouts.

    ``tensors``: this rank's local tensor of every tensor the source plan places on it (by name).  Returns the
    local tensor of every tensor the destination plan places on it.  ``rank``: this rank in the plan's numbering
    (default ``state.rank``, else the process rank).  ``ranks``/``group``: see the module docstring.
    ``dtypes``: the dtype of tensors this rank receives without holding any of them before (default: the dtype
    of a local tensor of the same element size, else float64/float32/bfloat16/uint8 by the planned itemsize).
    """
    me = _plan_rank(state, rank)
    if me in plan.failed:
        raise CommExecutionError(f"rank {me} is marked failed in the switch plan; a failed rank does not take part")
    to_proc = (lambda r: int(ranks[r])) if ranks is not None else (lambda r: r)
    sboxes = {t.name: {v.rank: v.box for v in local_views(t.src, t.shape)} for t in plan.tensors}
    dboxes = {t.name: {v.rank: v.box for v in local_views(t.dst, t.shape)} for t in plan.tensors}
    mine = _check_inputs(plan, tensors, sboxes, me)
    dev = torch.device(device) if device is not None else _device_of(tensors, state)
    dtypes = {t.name: (dtypes or {}).get(t.name) or _dtype_of(t.name, tensors, t.itemsize) for t in plan.tensors}
    out = {name: torch.zeros(box_shape(b[me]), dtype=dtypes[name], device=dev)
           for name, b in dboxes.items() if me in b}
    # a peer lost mid-switch must not hold this rank for the group's timeout (gloo may never fail its sends)
    waiter = SendWaiter(getattr(state, "peer_failed", None), rank=me)
    for step in plan.steps:
        for name, r, box in step.copies:
            if r == me:
                out[name][relative(box, dboxes[name][me])] = mine[name][relative(box, sboxes[name][me])]
        _exchange(step.messages, me, to_proc, group, mine, sboxes, dboxes, dtypes, out, dev, waiter)
    return out


def _plan_rank(state: "WorkerState | None", rank: int | None) -> int:
    if rank is not None:
        return int(rank)
    if state is not None and hasattr(state, "rank"):
        return int(state.rank)
    return dist.get_rank()


def _device_of(tensors: Mapping[str, torch.Tensor], state: "WorkerState | None") -> torch.device:
    return next(iter(tensors.values())).device if tensors else default_device(state)


def _dtype_of(name: str, tensors: Mapping[str, torch.Tensor], itemsize: int) -> torch.dtype:
    """The dtype of ``name`` here; a rank that does not hold it uses the float dtype of the planned itemsize."""
    if name in tensors:
        return tensors[name].dtype
    by_size = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16, 1: torch.uint8}
    known = {t.dtype for t in tensors.values() if t.element_size() == itemsize}
    return known.pop() if len(known) == 1 else by_size[itemsize]


def _check_inputs(plan: "SwitchPlan", tensors: Mapping[str, torch.Tensor], sboxes: dict[str, dict[int, Box]],
                  me: int) -> dict[str, torch.Tensor]:
    mine = {}
    for t in plan.tensors:
        box = sboxes[t.name].get(me)
        if box is None or me in plan.empty:  # (a rank that holds nothing of the source only receives)
            continue
        x = tensors.get(t.name)
        if x is None:
            raise CommExecutionError(f"rank {me}, switch: no local tensor {t.name!r}, but the source plan places "
                                     f"{format_box(box)} of it here")
        if tuple(x.shape) != box_shape(box):
            raise CommExecutionError(f"rank {me}, switch: tensor {t.name!r} has shape {tuple(x.shape)} but the "
                                     f"source plan places {format_box(box)} (shape {box_shape(box)}) here")
        if x.element_size() != t.itemsize:
            raise CommExecutionError(f"rank {me}, switch: tensor {t.name!r} is {x.dtype} but was planned with "
                                     f"{t.itemsize}-byte elements")
        mine[t.name] = x
    return mine


def _pack(m: "PackedMessage", mine: dict[str, torch.Tensor], sboxes: dict[str, dict[int, Box]],
          dev: torch.device) -> torch.Tensor:
    buf = torch.empty(m.nbytes, dtype=torch.uint8, device=dev)
    for it in m.items:
        piece = mine[it.tensor][relative(it.box, sboxes[it.tensor][m.src])].contiguous().reshape(-1)
        buf[it.offset:it.offset + it.nbytes] = piece.view(torch.uint8)
    return buf


def _exchange(messages: tuple["PackedMessage", ...], me: int, to_proc: Callable[[int], int],
              group: dist.ProcessGroup | None,
              mine: dict[str, torch.Tensor], sboxes: dict[str, dict[int, Box]], dboxes: dict[str, dict[int, Box]],
              dtypes: dict[str, torch.dtype], out: dict[str, torch.Tensor], dev: torch.device,
              waiter: SendWaiter) -> None:
    """One ``batch_isend_irecv`` with every packed message this rank sends or receives, waited for by ``waiter``
    (it stops when a peer of the world died), then unpack."""
    ops, recvs = [], []
    for i, m in enumerate(messages):
        tag = i if m.tag is None else m.tag  # (a part's messages carry their index in the whole step)
        if m.src == me:
            buf = _pack(m, mine, sboxes, dev)
            ops.append(dist.P2POp(dist.isend, buf, to_proc(m.dst), group=group, tag=tag))
        elif m.dst == me:
            buf = torch.empty(m.nbytes, dtype=torch.uint8, device=dev)
            ops.append(dist.P2POp(dist.irecv, buf, to_proc(m.src), group=group, tag=tag))
            recvs.append((m, buf))
    if ops:
        try:
            waiter.wait([(req, None) for req in dist.batch_isend_irecv(ops)])
        except RuntimeError as e:
            raise CommExecutionError(f"rank {me}, switch: fused BSR failed: {e}") from e
    for m, buf in recvs:
        for it in m.items:
            dbox = dboxes[it.tensor][me]
            piece = buf[it.offset:it.offset + it.nbytes].view(dtypes[it.tensor]).reshape(box_shape(it.box))
            if box_numel(it.box) * out[it.tensor].element_size() != it.nbytes:
                raise CommExecutionError(f"rank {me}, switch: item {it.tensor!r} {format_box(it.box)} is "
                                         f"{it.nbytes} bytes, not {out[it.tensor].dtype}")
            out[it.tensor][relative(it.box, dbox)] = piece
