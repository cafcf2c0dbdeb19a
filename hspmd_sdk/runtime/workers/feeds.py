"""Feeding a rank: the step's batch cut into this rank's micro-batch feeds (paper §6.3).

A training step reads the global batch (token sequences the model's ``feeds`` turns into the graph's placeholders,
or a mapping placeholder -> full tensor), or a dispatcher's micro-batches of their own shapes (mixed-length data,
SPEC §7).  :class:`Feeder` cuts either to this rank's box of each placeholder it reads, per micro-batch, in the
run's dtype: :meth:`Feeder.local` (the plan's micro-batching, from the full batch or this pipeline's rows of it),
:meth:`Feeder.micro` (a dispatcher's micro-batches, each at its shape).  A dispatcher's micro-batch is padded to
the sequence multiple a context-parallel split needs (:meth:`Feeder.padded`) and may pack documents into one row
(:meth:`Feeder.documents`, checked against the graph's kernels).

Context parallelism: where every attention of the pipeline splits the sequence over ``N > 1`` ranks, the data is
laid out in the balanced order once, when it is cut to this rank's box (:func:`sequence_balance`,
:func:`~.cp_attention.balanced_order`).
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from ...core.annotation import local_view
from ...core.microbatch import batch_dim
from ...core.symbolic import Sym, evaluate_shape
from .cp_attention import balanced_order
from .errors import ExecutorError
from .kernels import IGNORE_INDEX, packing_problems, reorder_problems

if TYPE_CHECKING:
    from ...core.specialize import Program

__all__ = ["Feeder", "sequence_balance", "sequence_multiple"]

#: A dispatcher's micro-batch (mixed-length data, :meth:`~.executor.StepExecutor.step`): ``(rows, seq_len, feeds)``
#: or ``(rows, seq_len, feeds, documents)``; ``feeds`` (placeholder -> the micro-batch's full tensor) is ``None`` on
#: the ranks that read no data, ``documents`` the lengths of the documents a packed row holds (or ``None``).
MicroBatch = (tuple[int, int, Mapping[str, torch.Tensor] | None]
              | tuple[int, int, Mapping[str, torch.Tensor] | None, Sequence[int] | None])


def sequence_balance(program: "Program", pipeline: int) -> int:
    """The CP degree ``N`` whose balanced order (:func:`~.cp_attention.balanced_order`) pipeline ``pipeline`` of
    ``program`` lays its sequences out in (:attr:`StepExecutor.sequence_balance`), else 1: ``N`` when every
    attention of the pipeline splits the sequence (the query's dim 1) over ``N > 1`` ranks and every op of the
    graph takes positions from the order (:func:`~.kernels.reorder_problems` is empty), unless the environment
    says ``HSPMD_CP_LAYOUT=contiguous``.  A context-parallel group's ranks are one stage of one pipeline
    (:func:`~hspmd_sdk.core.pipelines.build_pipelines`), so they decide alike."""
    if os.environ.get("HSPMD_CP_LAYOUT", "balanced") == "contiguous" or reorder_problems(program.graph):
        return 1
    ranks = {r for stage in program.pipelines[pipeline] for r in stage}
    degrees = set()
    for node in program.graph.nodes:
        if node.kind != "attention":
            continue
        q = node.inputs[0]
        ann = program.annotations[q]
        mine = ranks.intersection(ann.ranks)
        if not mine:
            continue
        shape = tuple(int(d) for d in evaluate_shape(program.graph.tensors[q].shape, program.bindings, tensor=q))
        for r in mine:
            view = local_view(ann, shape, r)
            if view is not None:
                degrees.add(shape[1] // max(view.box[1][1] - view.box[1][0], 1))
    return degrees.pop() if len(degrees) == 1 and min(degrees) > 1 else 1


def sequence_multiple(program: "Program") -> int:
    """What every micro-batch's sequence length must be a multiple of: the least common multiple of the degrees
    by which ``program`` splits a sequence dim (``S``) of any tensor (context parallelism), else 1."""
    got = 1
    graph = program.graph
    for name, ann in program.annotations.items():
        shape = graph.tensors[name].shape if name in graph.tensors else ()
        dims = [d for d, x in enumerate(shape) if isinstance(x, Sym) and x.factors == ("S",) and x.coef == 1]
        for ds in ann.ds_union:
            for d in dims:
                got = math.lcm(got, int(ds.states.get(d, 1)))
    return got


class Feeder:
    """Cuts a step's data into rank ``rank``'s feeds: placeholder -> one tensor per micro-batch, of this rank's
    box (floating-point ones in ``dtype``, on ``device``).  ``leaves``: the placeholders and other leaves of the
    rank's executable graph; ``bindings``: the step's ``B`` and ``S``; ``micro_size`` / ``num_micro``: the plan's
    micro-batching of this rank's pipeline ``pipeline``."""

    def __init__(self, program: "Program", rank: int, *, leaves: Sequence[str], device: torch.device,
                 dtype: torch.dtype, bindings: Mapping[str, int], micro_size: int, num_micro: int,
                 pipeline: int) -> None:
        self.program, self.rank, self.device, self.dtype = program, rank, device, dtype
        self.graph, self.anns = program.graph, program.annotations
        self.placeholders = [n for n in leaves if self.graph.producer(n).kind == "placeholder"]
        self.bindings, self.micro_size, self.num_micro, self.pipeline = bindings, micro_size, num_micro, pipeline
        self._multiple: int | None = None
        self._balance: int | None = None
        self._order_index: dict[int, torch.Tensor] = {}  # S -> the balanced order's indices (sequence_balance)
        self._packing_problems: list[str] | None = None  # why this graph cannot run packed rows (once)

    @property
    def sequence_multiple(self) -> int:
        """:func:`sequence_multiple` of the program (worked out once)."""
        if self._multiple is None:
            self._multiple = sequence_multiple(self.program)
        return self._multiple

    @property
    def sequence_balance(self) -> int:
        """:func:`sequence_balance` of the program and this pipeline (worked out once, when first asked)."""
        if self._balance is None:
            self._balance = sequence_balance(self.program, self.pipeline)
        return self._balance

    def reordered(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A placeholder's whole tensor with its sequence dims (``S``) in the pipeline's balanced order."""
        n = self.sequence_balance
        if n == 1:
            return t
        for d, x in enumerate(self.graph.tensors[name].shape):
            if isinstance(x, Sym) and x.factors == ("S",) and x.coef == 1:
                idx = self._order_index.get(t.shape[d])
                if idx is None:
                    idx = self._order_index[t.shape[d]] = torch.cat(
                        [torch.arange(a, b) for a, b in balanced_order(int(t.shape[d]), n)])
                t = t.index_select(d, idx.to(t.device))
        return t

    def padded(self, micro: MicroBatch) -> MicroBatch:
        """A dispatcher's micro-batch ``(rows, seq_len, feeds[, documents])`` padded on the right to a multiple of
        :attr:`sequence_multiple` (a context-parallel split never pads inside the plan: the annotations need whole
        chunks): targets ``-100`` (out of the loss and of ``trained_targets``), other feeds 0; a packed row gets
        the padding as one more document (attending only within itself), a padded row more right padding (causal
        attention keeps it out of the real positions).  Unchanged when the length is already a multiple."""
        q, seq = self.sequence_multiple, int(micro[1])
        pad = -seq % q
        if pad == 0:
            return micro
        feeds = micro[2]
        if feeds is not None:
            loss = self.graph.producer(self.graph.loss)
            targets = {t for t in loss.inputs if self.graph.producer(t).kind == "placeholder"}
            out = {}
            for k, t in feeds.items():
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == seq:
                    fill = IGNORE_INDEX if k in targets else 0
                    t = torch.cat([t, t.new_full((t.shape[0], pad) + tuple(t.shape[2:]), fill)], dim=1)
                out[k] = t
            feeds = out
        docs = micro[3] if len(micro) > 3 else None
        head = (micro[0], seq + pad, feeds)
        return head + ((tuple(docs) + (pad,),) if docs is not None else ((None,) if len(micro) > 3 else ()))

    def documents(self, mb: int, micro: MicroBatch) -> tuple[int, ...] | None:
        """The document lengths of micro-batch ``mb`` if it is a packed row (checked), else ``None``."""
        if len(micro) < 4 or micro[3] is None:
            return None
        docs = tuple(int(d) for d in micro[3])
        if self._packing_problems is None:
            self._packing_problems = packing_problems(self.graph)
        problems = self._packing_problems
        if problems:
            raise ExecutorError(f"rank {self.rank}: micro-batch {mb} packs documents but the model's graph cannot "
                                f"keep them apart: {'; '.join(problems)}")
        if int(micro[0]) != 1 or sum(docs) != int(micro[1]) or min(docs, default=0) <= 0:
            raise ExecutorError(f"rank {self.rank}: packed micro-batch {mb} has {micro[0]} rows of {micro[1]} "
                                f"tokens but documents {list(docs)}: one row, the documents' lengths summing "
                                "to its length")
        return docs

    def full(self, batch: torch.Tensor | Mapping[str, torch.Tensor] | None) -> Mapping[str, torch.Tensor]:
        """The step's full feeds: ``batch`` if it is a mapping placeholder -> tensor, else the model's ``feeds``
        of it (nothing for ``None``)."""
        if batch is None:
            return {}
        if isinstance(batch, Mapping):
            return batch
        model = self.program.model
        if model is None:
            raise ExecutorError(f"rank {self.rank}: the program has no model to turn a batch into feeds; pass a "
                                "mapping placeholder -> tensor")
        return model.feeds(batch)

    def local(self, full: Mapping[str, torch.Tensor],
              rows: tuple[int, int] | None = None) -> dict[str, list[torch.Tensor]]:
        """Each placeholder leaf of this rank, cut to its box and split into the pipeline's micro-batches
        (floating-point feeds in the run's dtype).  ``rows=(a, b)``: ``full`` holds only rows ``a..b-1`` of the
        global batch (this pipeline's share, :attr:`StepExecutor.chunk`: all a rank reads), not all of it."""
        out: dict[str, list[torch.Tensor]] = {}
        for name in self.placeholders:
            if name not in full:
                raise ExecutorError(f"rank {self.rank}: the step has no {name!r} but this rank's graph reads it")
            t = self.reordered(name, full[name])
            d = batch_dim(self.graph.tensors[name].shape)
            shape = list(t.shape)
            if rows is not None and d is not None:
                shape[d] = self.bindings["B"]
            slices = list(local_view(self.anns[name], tuple(shape), self.rank).slices)
            if rows is not None and d is not None:
                start, stop = slices[d].start - rows[0], slices[d].stop - rows[0]
                if start < 0 or stop > t.shape[d]:
                    raise ExecutorError(f"rank {self.rank}: {name!r} needs rows {slices[d].start}.."
                                        f"{slices[d].stop - 1} of the batch, the step read rows "
                                        f"{rows[0]}..{rows[1] - 1}")
                slices[d] = slice(start, stop)
            local = t[tuple(slices)].to(self.device)
            if local.is_floating_point():
                local = local.to(self.dtype)
            out[name] = list(torch.split(local, self.micro_size, dim=d)) if d is not None else [local] * self.num_micro
        return out

    def micro(self, feeds: Sequence[Mapping[str, torch.Tensor] | None],
              layout: Sequence[tuple[Mapping[str, int], int]]) -> dict[str, list[torch.Tensor]]:
        """Each placeholder leaf of this rank, per micro-batch: the micro-batch's full tensor (``feeds[mb]``) cut
        to this rank's box at that micro-batch's shape ``layout[mb]`` (bindings, rows: its batch rows are the
        micro-batch's rows)."""
        out: dict[str, list[torch.Tensor]] = {}
        if not self.placeholders:
            return out
        for mb, full in enumerate(feeds):
            bindings, rows = layout[mb]
            for name in self.placeholders:
                if full is None or name not in full:
                    raise ExecutorError(f"rank {self.rank}: micro-batch {mb} has no {name!r} but this rank's "
                                        "graph reads it")
                out.setdefault(name, []).append(self._micro_one(mb, name, full[name], bindings, rows))
        return out

    def _micro_one(self, mb: int, name: str, t: torch.Tensor, bindings: Mapping[str, int], rows: int
                   ) -> torch.Tensor:
        """Micro-batch ``mb``'s full tensor ``t`` of placeholder ``name`` (checked) cut to this rank's box."""
        shape = evaluate_shape(self.graph.tensors[name].shape, bindings, tensor=name)
        d = batch_dim(self.graph.tensors[name].shape)
        if d is not None:
            shape = shape[:d] + (rows,) + shape[d + 1:]
        if tuple(t.shape) != tuple(int(x) for x in shape):
            raise ExecutorError(f"rank {self.rank}: micro-batch {mb}'s {name!r} has shape "
                                f"{tuple(t.shape)}, not {tuple(shape)}")
        t = self.reordered(name, t)
        view = local_view(self.anns[name], tuple(int(x) for x in evaluate_shape(
            self.graph.tensors[name].shape, bindings, tensor=name)), self.rank)
        slices = list(view.slices)
        if d is not None:
            slices[d] = slice(0, rows)
        local = t[tuple(slices)].to(self.device)
        if local.is_floating_point():
            local = local.to(self.dtype)
        return local
