"""The parameters' gathers, set up once per executor (ZeRO, SPEC §15): which of ``PRE``'s top-tier gathers a step
coalesces into buckets posted in ``PRE`` (ZeRO-1 and -2, :class:`~.buckets.GatherBuckets`), and which are ZeRO-3's
units, gathered around their use (:class:`~.zero3.Zero3Params`).

A ZeRO-3 unit is FSDP's: the parameters of one layer over one set of ranks (:func:`gather_ranks`, the one place that
set is derived), consecutive units of one set merged until each holds ``zero3_unit_bytes`` (:func:`merge_units`).
Everything here is decided from the Program alone, alike on every rank of a gather's set.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import torch

from .buckets import GatherBuckets, bucketable
from .comm import Pending
from .zero3 import Zero3Params

if TYPE_CHECKING:
    from ...core.comm_plan import CommPlan
    from ...core.specialize import ExecOp

__all__ = ["ParameterGathers", "gather_ranks", "merge_units"]

T = TypeVar("T")


def gather_ranks(plan: "CommPlan") -> tuple[int, ...]:
    """The ranks a parameter's gather runs over, sorted: its plan's sources and destinations.  A ZeRO-3 unit holds
    gathers of one such set (the key :func:`merge_units` merges by)."""
    return tuple(sorted(set(plan.src.ranks) | set(plan.dst.ranks)))


def merge_units(units: Sequence[tuple[tuple[int, ...], list[T]]], nbytes: Callable[[T], int],
                unit_bytes: int) -> list[list[T]]:
    """Units of one set of ranks merged in order until each holds ``unit_bytes`` (FSDP's size-based wrapping: a tiny
    layer's own unit would cost a collective per owner for a few kB).  ``units``: ``(rank set, members)`` in the
    order the forward first reads them; ``nbytes(member)``: its gathered size.  Decided per set of ranks from its
    own units and the parameters' global sizes: alike on every rank of the set."""
    out: list[list[T]] = []
    open_: dict[tuple[int, ...], tuple[list[T], list[int]]] = {}  # ranks -> (the unit filling, its bytes)
    for ranks, us in units:
        size = sum(nbytes(o) for o in us)
        got = open_.get(ranks)
        if got is not None and got[1][0] < unit_bytes:
            got[0].extend(us)
            got[1][0] += size
        else:
            unit = list(us)
            open_[ranks] = (unit, [size])
            out.append(unit)
    return out


class ParameterGathers:
    """The gathers' set-up of :class:`~.executor.StepExecutor`, a part of it (its methods run on the executor).

    It reads the executor's set-up: ``program``, ``eg`` (its ``pre`` and ``forward`` operators), ``graph``,
    ``nodes``, ``zero3_unit_bytes``, the gradient buckets ``grad_sync`` (which watch ZeRO-3's leaves)
    and the parameters' plans (``_pre_plan``); it sets ``gathers`` (the coalesced buckets) with the ``_coalesced``
    operators' indices, and ``zero3``."""

    program: Any
    rank: int
    groups: Any
    device: torch.device
    dtype: torch.dtype
    trace: Callable[..., None] | None
    eg: Any
    graph: Any
    nodes: dict[str, Any]
    zero3_unit_bytes: int
    params: dict[str, torch.Tensor]
    grad_sync: Any
    step_values: dict[str, torch.Tensor]
    _leaves: dict[str, torch.Tensor]
    _pre_plan: Callable[[str], "CommPlan"]

    def _init_gathers(self, bucket_bytes: int, first_bucket_bytes: int | None) -> None:
        """The parameters' gather buckets (``PRE``'s top-tier gathers), and ZeRO-3's units taken out of them."""
        made = {o.outputs[0] for o in self.eg.pre}
        coalesced = [o for o in self.eg.pre if o.inputs[0] not in made and bucketable(self._pre_plan(o.name))]
        self.zero3 = self._zero3_params(coalesced) if self.program.plan.settings.zero >= 3 else None
        # ZeRO-3: the most micro-batches a pipeline runs (a replica running fewer joins the others' gathers)
        counts = [self.program.num_micro_batches(p) for p in range(len(self.program.pipelines))]
        self._most_micro = max(counts)
        self._zero3_uneven = self.program.plan.settings.zero >= 3 and len(set(counts)) > 1
        if self.zero3 is not None:
            coalesced = [o for o in coalesced if o.outputs[0] not in self.zero3]
        self._coalesced = {o.name: k for k, o in enumerate(coalesced)}
        self.gathers = GatherBuckets([self._pre_plan(o.name) for o in coalesced], [o.outputs[0] for o in coalesced],
                                     self.groups, rank=self.rank, device=self.device, dtype=self.dtype,
                                     bucket_bytes=bucket_bytes, first_bucket_bytes=first_bucket_bytes,
                                     trace=self.trace)

    def _zero3_params(self, gathers: list["ExecOp"]) -> Zero3Params | None:
        """ZeRO-3: of the parameters' top-tier gathers, those this rank receives and its forward reads (and no
        other ``PRE`` operator: a tied weight moved on is held for the step), in units -- the parameters of one
        layer (the model's placements; one unit without a model) over one set of ranks, the same on every rank
        of the set --, units and members in the order the forward first reads them (:mod:`.zero3`); ``None`` if
        there are none."""
        first: dict[str, int] = {}
        for i, op in enumerate(self.eg.forward):
            for t in (op.inputs if op.kind == "Reshard" else self.nodes[op.name].inputs):
                first.setdefault(t, i)
        # what every rank of a gather's group decides alike, from the graph: a gathered tensor that a Reshard reads
        # (a tied weight's move, on whichever ranks it runs) is held for the step
        ops = [o for o in gathers if o.outputs[0] in first and self.rank in self._pre_plan(o.name).dst.ranks
               and not any(c.is_reshard for c in self.graph.consumers(o.outputs[0]))]
        if not ops:
            return None
        model = self.program.model
        where = {p.tensor: p.where for p in model.placements()} if model is not None else {}
        # (rank set, layer) -> members in Program order (every rank's buffers alike); units by first read
        units: dict[tuple[tuple[int, ...], Any], list[Any]] = {}
        for o in ops:
            units.setdefault((gather_ranks(self._pre_plan(o.name)), where.get(o.inputs[0])), []).append(o)
        ordered = sorted(units.items(), key=lambda kv: min(first[o.outputs[0]] for o in kv[1]))
        members = merge_units([(ranks, us) for (ranks, _), us in ordered], self._gathered_size,
                              self.zero3_unit_bytes)
        # their own process groups where the worker made them (WorkerState.create_twin_groups): a gather never
        # queues behind a gradient bucket of the same ranks
        twins = self.groups.twin if hasattr(self.groups, "twin") else self.groups
        buckets = [GatherBuckets([self._pre_plan(o.name) for o in us], [o.outputs[0] for o in us], twins,
                                 rank=self.rank, device=self.device, dtype=self.dtype, bucket_bytes=2**62,
                                 first_bucket_bytes=None, trace=self.trace, keep_buffers=False) for us in members]

        def start(k: int) -> list[Pending]:
            with torch.no_grad():
                return buckets[k].start([self.step_values[o.inputs[0]].detach() for o in members[k]])

        return Zero3Params([[o.outputs[0] for o in us] for us in members], start,
                           lambda name, leaf: self.grad_sync.watch(name, leaf))

    def _gathered_size(self, op: "ExecOp") -> int:
        """The bytes of ``PRE`` operator ``op``'s gathered (global) tensor at the wire dtype."""
        plan = self._pre_plan(op.name)
        return math.prod(plan.shape) * plan.itemsize

    # ---- reporting -----------------------------------------------------------------------------------------------
    def gathered_bytes(self) -> int:
        """Bytes of gathered parameters this rank holds now (ZeRO: the outputs of ``PRE``'s gathers, whole for the
        step at levels 1-2; at ZeRO-3 only those being read, :mod:`.zero3`)."""
        held = 0 if self.zero3 is None else self.zero3.held_bytes
        for name, t in self.step_values.items():
            if name not in self._leaves and name not in self.params:
                held += t.untyped_storage().nbytes()
        return held
