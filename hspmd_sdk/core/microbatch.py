"""Concrete micro-batch shapes at run time (paper §6.3, Appendix A.2 "symbolic shape extension").

The annotation plan describes one *step*: ``B`` is the global batch, split across the pipelines (HDim 0) in
proportion to each pipeline's samples per step.  A pipeline then runs its share as ``num_micro_batches``
micro-batches of ``micro_batch_size`` rows, at its own pace.  Nothing in the static plan changes for that — only
the concrete extent of the batch dim does: on every rank of pipeline ``k`` the batch interval of every box of a
Forward/Backward ``CommPlan`` is exactly pipeline ``k``'s chunk ``[a, b)`` (the bottom tier never splits the
batch: TP splits hidden dims), and a micro-batch holds rows ``[0, m)`` of a local tensor of ``m`` rows.

:func:`micro_batch_plan` therefore rewrites the batch interval ``[a, b)`` of a plan's boxes to ``[0, m)``: the
same operators, groups and messages, at the micro-batch's concrete shape.  Boxes of other pipelines (another
interval) are left alone: a rank only executes the parts of a plan that concern it.  A box of this pipeline that
covers part of its chunk cannot be micro-batched and raises.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from .comm_ops import (CollectiveGroup, CollectiveOp, IdentityOp, Message, PointToPointOp, SliceCollective,
                             SplitCollectiveOp)
from .slices import Box, box_numel
from ..errors import HSPMDError

__all__ = ["micro_batch_plan", "batch_dim", "MicroBatchError"]


class MicroBatchError(HSPMDError):
    """A communication plan cannot be executed at a micro-batch's shape."""


def batch_dim(shape: tuple[Any, ...], symbol: str = "B") -> int | None:
    """Index of the dim of a (symbolic) global shape that is the batch symbol, ``None`` if there is none."""
    for i, d in enumerate(shape):
        if not isinstance(d, int) and str(d) == symbol:
            return i
    return None


def micro_batch_plan(plan: Any, dim: int, chunk: tuple[int, int], size: int) -> Any:
    """``plan`` (a step-level ``CommPlan``) at a micro-batch of ``size`` rows of the pipeline whose batch chunk
    is ``chunk`` along ``dim``: every box with that batch interval gets ``(0, size)`` there."""
    a, b = chunk
    if size > b - a or size < 1:
        raise MicroBatchError(f"micro-batch of {size} rows does not fit the pipeline's chunk [{a}, {b})")

    def fix(box: Box) -> Box:  # every box of a plan is a box of its tensor: it has the batch dim
        if box[dim] != (a, b):
            lo, hi = box[dim]
            if lo < b and a < hi:
                raise MicroBatchError(f"box {box} covers part of the pipeline's batch chunk [{a}, {b}) along dim "
                                      f"{dim}: a plan that splits the batch inside a pipeline cannot be "
                                      "micro-batched")
            return box
        return box[:dim] + ((0, size),) + box[dim + 1:]

    def rank_boxes(pairs: tuple[tuple[int, Box], ...]) -> tuple[tuple[int, Box], ...]:
        return tuple((r, fix(bx)) for r, bx in pairs)

    ops = []
    for op in plan.ops:
        if isinstance(op, IdentityOp):
            ops.append(op)
        elif isinstance(op, CollectiveOp):
            groups = tuple(CollectiveGroup(g.ranks, tuple(fix(x) for x in g.in_boxes),
                                           tuple(fix(x) for x in g.out_boxes)) for g in op.groups)
            ops.append(replace(op, groups=groups))
        elif isinstance(op, SplitCollectiveOp):
            slices = tuple(SliceCollective(fix(s.box), s.ranks, s.contributors, s.receivers) for s in op.slices)
            ops.append(replace(op, slices=slices, in_boxes=rank_boxes(op.in_boxes),
                               out_boxes=rank_boxes(op.out_boxes)))
        elif isinstance(op, PointToPointOp):
            msgs = tuple(Message(m.src, m.dst, fix(m.box), box_numel(fix(m.box)) * plan.itemsize)
                         for m in op.messages)
            ops.append(replace(op, messages=msgs, copies=rank_boxes(op.copies), in_boxes=rank_boxes(op.in_boxes),
                               out_boxes=rank_boxes(op.out_boxes)))
        else:  # pragma: no cover - the IR has exactly the kinds above
            raise MicroBatchError(f"unknown communication operator {type(op).__name__}")
    return replace(plan, ops=tuple(ops))
