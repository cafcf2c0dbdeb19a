"""``PRE`` (paper §6.3, Appendix A.2): the step's parameter leaves and the parameters' Reshards.

Each step computes with leaves of the fp32 master parameters (the same storage in fp32, bf16 working copies
otherwise), made once and kept with their gradient hooks.  The parameters' Reshards (ZeRO-1's SplitAllGather, a
tied weight's move to its other stage) make fresh leaves whose gradients the gradient synchronisation collects.
Top-tier gathers are only started in ``PRE``, coalesced into buckets (:class:`~.buckets.GatherBuckets`), and each
gathered parameter is waited for where the forward first reads it (:meth:`ParameterLeaves._get`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from .comm import Pending, execute_async, with_dtype
from .p2p import PRE_TAG, identity_for
from .zero3 import Zero3Params

if TYPE_CHECKING:
    from ...core.comm_plan import CommPlan
    from ...core.specialize import ExecutableGraph, Program
    from .buckets import GatherBuckets, GradBuckets
    from .comm import Groups

__all__ = ["ParameterLeaves"]


class ParameterLeaves:
    """The ``PRE`` part of :class:`~.executor.StepExecutor` (its methods run on the executor).

    It reads the executor's set-up: ``program``, ``eg`` (its ``pre`` operators), ``params`` (the fp32 masters),
    ``dtype``, the gradient buckets ``grad_sync`` and gather buckets ``gathers`` with the ``_coalesced`` operators'
    indices, and keeps the step's values in ``step_values``."""

    program: "Program"
    rank: int
    groups: "Groups"
    device: torch.device
    dtype: torch.dtype
    eg: "ExecutableGraph"
    params: dict[str, torch.Tensor]
    grad_sync: "GradBuckets"
    gathers: "GatherBuckets"
    step_values: dict[str, torch.Tensor]
    _coalesced: dict[str, int]
    _gathers: dict[str, Pending]
    _inflight: list[Pending]
    _leaves: dict[str, torch.Tensor]
    _pre_kept: dict[str, torch.Tensor] | None
    _plans: dict[Any, Any]
    _event: Callable[..., None]
    zero3: Zero3Params | None

    def pre(self) -> None:
        """``Pre``: parameter leaves (working copies of the master weights in the run's dtype), and the Reshards of
        parameters (ZeRO-1 SplitAllGather, a tied weight's move to its other stage).  Their outputs are fresh
        leaves whose gradients the gradient synchronisation collects.  Top-tier gathers are only started here, in
        buckets (:class:`~.buckets.GatherBuckets`): the forward waits for each where it first reads it."""
        vals = self.step_values = self._parameter_leaves()
        self._gathers, self._inflight = {}, []
        zero3 = self.zero3
        if zero3 is not None:  # ZeRO-3: gathered where the forward reads them (.zero3), new leaves each step
            zero3.begin_step()
        if self._pre_kept is not None:  # every PRE op leaves a kept leaf: the same leaves and watches every step
            vals.update(self._pre_kept)
            self.grad_sync.rewatch()
            return
        with torch.no_grad():  # the parameters' gathers, coalesced in buckets, all posted first (every rank alike)
            started = self.gathers.start([vals[o.inputs[0]].detach() if o.inputs[0] in vals else None
                                          for o in self.eg.pre if o.name in self._coalesced])
        for op in self.eg.pre:
            src, dst = op.inputs[0], op.outputs[0]
            if zero3 is not None and dst in zero3:
                continue
            plan = self._pre_plan(op.name)
            if src in self._gathers:
                self._resolve(src)
            if identity_for(plan, self.rank):
                if src in vals:  # the same storage, but a leaf of its own: each use collects its own gradient
                    vals[dst] = self._leaves[dst] if dst in self._leaves else vals[src].detach().requires_grad_(True)
                    if src in self.params:  # a parameter's leaf: kept for the next steps too
                        self._leaves[dst] = vals[dst]
                continue
            if op.name in self._coalesced:
                pending = started[self._coalesced[op.name]]
            else:
                with torch.no_grad():
                    pending = execute_async(plan, vals[src].detach() if src in vals else None, self.groups,
                                            rank=self.rank, device=self.device, tag_base=PRE_TAG)
            if self.rank in plan.dst.ranks:
                self._gathers[dst] = pending
            else:
                self._inflight.append(pending)
        self.grad_sync.begin(set(vals) | set(self._gathers) | (set(zero3.names) if zero3 is not None else set()))
        for name, t in vals.items():
            self.grad_sync.watch(name, t, keep=name in self._leaves)
        if not self._gathers and not self._inflight and zero3 is None and all(name in self._leaves for name in vals):
            self._pre_kept = {k: v for k, v in vals.items() if k not in self.params}
            self.grad_sync.remember()

    def _parameter_leaves(self) -> dict[str, torch.Tensor]:
        """The step's leaves of the parameters (and of their unmoved copies, :meth:`pre`), made once and kept,
        their gradient hooks with them (:meth:`GradBuckets.watch`): in fp32 they share the master weights'
        storage, which Adam updates in place; in another dtype they are copies, refreshed here every step."""
        if not self._leaves:
            self._leaves = {k: v.detach().to(self.dtype).requires_grad_(True) for k, v in self.params.items()}
        elif self.dtype != torch.float32:
            with torch.no_grad():
                for k, v in self.params.items():
                    self._leaves[k].copy_(v)
        for t in self._leaves.values():  # an interrupted step may have left gradients
            t.grad = None
        return {k: self._leaves[k] for k in self.params}

    def _pre_plan(self, name: str) -> "CommPlan":
        key = f"pre:{name}"
        got = self._plans.get(key)
        if got is None:
            got = self._plans[key] = with_dtype(self.program.comm_plans[name], self.dtype)
        return got

    def _resolve(self, name: str) -> torch.Tensor:
        """Wait for the PRE output ``name`` (a gathered parameter) and make it a leaf of this step."""
        t = self._gathers.pop(name).wait().requires_grad_(True)
        self.step_values[name] = t
        self.grad_sync.watch(name, t)
        self._event("param_ready", name=name)
        return t

    def _resolve_all(self) -> None:
        for name in list(self._gathers):
            self._resolve(name)
        for pending in self._inflight:
            pending.wait()
        self._inflight = []

    def _get(self, vals: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """``vals[name]``, waiting for it first if it is a gather still in flight."""
        got = vals.get(name)
        if got is None and name in self._gathers:
            got = vals[name] = self._resolve(name)
        elif got is None and self.zero3 is not None and name in self.zero3:
            got = vals[name] = self.zero3.read(name)
        return vals[name] if got is None else got
