"""A rank's micro-batch shapes (paper Appendix A.2; mixed-length data, SPEC §7): the plan's micro-batching of its
pipeline, each pass's layout of micro-batches (their symbol bindings, packed documents and feeds), the
communication plans at a micro-batch's shape and the stage's schedule for a number of micro-batches.

By default every micro-batch runs at the plan's shape; a step given its own micro-batches runs each at its own
(:meth:`MicroBatchShapes.micro_bindings`), the symbolic plans resolved there once and cached: nothing is
re-specialized.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ...core.schedule import Action, build_schedule
from ...core.symbolic import evaluate_shape
from .comm import with_dtype
from .errors import ExecutorError
from .feeds import Feeder

if TYPE_CHECKING:
    from ...core.comm_plan import CommPlan
    from ...core.graph import Graph
    from ...core.specialize import ExecutableGraph, Program
    from .feeds import MicroBatch

__all__ = ["MicroBatchShapes"]


class MicroBatchShapes:
    """The micro-batch shapes of :class:`~.executor.StepExecutor`, a part of it (its methods run on the executor).

    It reads the executor's set-up: ``program``, ``rank``, its ``pipeline`` and ``stage``, the step's ``bindings``
    (``B``, ``S``), ``eg`` (its leaves), ``graph``, ``device`` and ``dtype``, and caches plans in ``_plans``; it
    sets the plan's micro-batching (``num_micro``, ``micro_size``, ``chunk``), the ``feeder`` and, per pass, the
    micro-batches' ``_layout``, ``_documents`` and ``_feeds`` (``_cur``: the current one's shape)."""

    program: "Program"
    rank: int
    pipeline: int
    stage: int
    bindings: dict[str, int]
    eg: "ExecutableGraph"
    graph: "Graph"
    device: torch.device
    dtype: torch.dtype
    loss_normalizer: int | None
    _plans: dict[Any, Any]

    def _init_micro_batches(self) -> None:
        """The plan's micro-batching of this rank's pipeline, the per-step shapes and the feeds' cutter."""
        program, rank = self.program, self.rank
        self.num_micro = program.num_micro_batches(self.pipeline)
        self.chunk = program.batch_rows(rank, self.bindings)
        rows = self.chunk[1] - self.chunk[0]
        mbs = program.micro_batch_size(self.pipeline)
        self.micro_size = int(mbs) if mbs else rows // self.num_micro
        if self.micro_size * self.num_micro != rows:
            raise ExecutorError(f"rank {rank}: pipeline {self.pipeline} holds {rows} rows of the batch but runs "
                                f"{self.num_micro} micro-batches of {self.micro_size}")
        # every micro-batch's shape: (bindings, rows); the plan's by default, the dispatcher's per step
        self._cur: tuple[dict[str, int], int] = (self.bindings, self.micro_size)
        self._layout: list[tuple[dict[str, int], int]] = [self._cur] * self.num_micro
        # a packed micro-batch (one row, several documents): their lengths; None: every row one sequence
        self._cur_documents: tuple[int, ...] | None = None
        self._documents: list[tuple[int, ...] | None] = [None] * self.num_micro
        self._mb_bindings: dict[tuple[int, int], dict[str, int]] = {}
        self._schedules: dict[int, list[Any]] = {}
        self.trained_targets = 0  # real (non-padding) target tokens this rank's loss read in the last step
        self.feeder = Feeder(program, rank, leaves=self.eg.leaves, device=self.device, dtype=self.dtype,
                             bindings=self.bindings, micro_size=self.micro_size, num_micro=self.num_micro,
                             pipeline=self.pipeline)

    def global_shape(self, tensor: str) -> tuple[int, ...]:
        """``tensor``'s global shape at the current micro-batch's bindings."""
        return tuple(int(d) for d in evaluate_shape(self.graph.tensors[tensor].shape, self._cur[0], tensor=tensor))

    def _plan(self, name: str, mb: int | None = None) -> "CommPlan":
        """The plan of communication ``name`` at micro-batch ``mb``'s shape (default: the current one), for the
        run's dtype (the symbolic plan resolved at the concrete shape once, cached)."""
        bindings, rows = self._cur if mb is None else self._layout[mb]
        key = (name, rows, bindings.get("S"), bindings.get("B"))
        got = self._plans.get(key)
        if got is None:
            got = self._plans[key] = with_dtype(
                self.program.micro_batch_plan(name, self.rank, bindings, rows), self.dtype)
        return got

    # ---- per-step micro-batch shapes (mixed-length data) ----------------------------------------------------
    def micro_bindings(self, rows: int, seq_len: int) -> dict[str, int]:
        """Symbol values under which this pipeline's batch chunk holds at least ``rows`` rows and the sequence is
        ``seq_len`` long: ``B`` is the program's ``B`` scaled by a whole factor (the top tier splits the batch in
        fixed proportions), ``S`` is ``seq_len``.  A micro-batch of ``rows x seq_len`` then runs the plans of
        those bindings with the chunk rewritten to its rows (:meth:`Program.micro_batch_plan`)."""
        key = (int(rows), int(seq_len))
        got = self._mb_bindings.get(key)
        if got is None:
            if rows < 1 or seq_len < 1:
                raise ExecutorError(f"rank {self.rank}: a micro-batch of {rows} rows x {seq_len} tokens")
            base = int(self.program.bindings.get("B", self.bindings["B"]))
            a, b = self.program.batch_rows(self.rank, {**self.bindings, "B": base, "S": int(seq_len)})
            k = max(1, math.ceil(rows / max(b - a, 1)))
            got = {**self.bindings, "B": base * k, "S": int(seq_len)}
            a, b = self.program.batch_rows(self.rank, got)
            if b - a < rows:
                raise ExecutorError(f"rank {self.rank}: pipeline {self.pipeline}'s share of B={got['B']} is "
                                    f"{b - a} rows, fewer than the micro-batch's {rows}")
            self.program.bind(got)
            self._mb_bindings[key] = got
        return got

    def _schedule_of(self, num_micro: int) -> list[Action]:
        """This stage's actions for ``num_micro`` micro-batches (``Pre``, ``Post`` only for none)."""
        got = self._schedules.get(num_micro)
        if got is None:
            stages = self.program.num_stages(self.pipeline)
            got = self._schedules[num_micro] = [Action("PRE"), Action("POST")] if num_micro == 0 else \
                build_schedule(self.program.schedule_kind, stages, self.stage, num_micro)
        return got

    def _prepare(self, batch: torch.Tensor | Mapping[str, torch.Tensor] | None, batch_rows: tuple[int, int] | None,
                 micro_batches: Sequence[MicroBatch] | None, loss_normalizer: int | None) -> list[Action]:
        """Set up a pass over one batch (the feeds, each micro-batch's shape; see :meth:`~.executor.StepExecutor.step`);
        returns the stage's schedule actions for it."""
        if micro_batches is not None:
            micro_batches = [self.feeder.padded(m) for m in micro_batches]
            self._layout = [(self.micro_bindings(int(m[0]), int(m[1])), int(m[0])) for m in micro_batches]
            self._documents = [self.feeder.documents(i, m) for i, m in enumerate(micro_batches)]
            self.loss_normalizer = int(loss_normalizer) if loss_normalizer is not None else None
            self._feeds = self.feeder.micro([m[2] for m in micro_batches], self._layout)
            return self._schedule_of(len(self._layout))
        self._documents = [None] * self.num_micro
        self._layout = [(self.bindings, self.micro_size)] * self.num_micro
        self._feeds = self.feeder.local(self.feeder.full(batch), batch_rows)
        return self.program.schedule(self.rank)

    def _local_feeds(self, full: Mapping[str, torch.Tensor],
                     rows: tuple[int, int] | None = None) -> dict[str, list[torch.Tensor]]:
        """:meth:`.feeds.Feeder.local`: ``full``'s placeholders cut to this rank's micro-batch feeds."""
        return self.feeder.local(full, rows)

    @property
    def sequence_multiple(self) -> int:
        """What every micro-batch's sequence length must be a multiple of: the least common multiple of the
        degrees by which the program splits a sequence dim (``S``) of any tensor (context parallelism), else 1."""
        return self.feeder.sequence_multiple

    @property
    def sequence_balance(self) -> int:
        """``N > 1`` when this pipeline lays its micro-batches' sequences out in the balanced order of CP degree
        ``N`` (:func:`~.cp_attention.balanced_order`): every attention of the pipeline splits the sequence (its
        query's dim 1) over ``N`` ranks, and every op of the graph takes positions from the order
        (:func:`~.kernels.reorder_problems` is empty).  Rank ``i`` of a CP group then holds global chunks ``i``
        and ``2N-1-i`` and every rank does the same causal work.  Else 1: the contiguous split (exact too, the last
        chunk's rank doing most of the causal work).  The same on every rank of the pipeline (a function of the
        Program: :func:`.feeds.sequence_balance`).  ``HSPMD_CP_LAYOUT=contiguous`` in the workers' environment
        keeps the contiguous split (for measurements)."""
        return self.feeder.sequence_balance
