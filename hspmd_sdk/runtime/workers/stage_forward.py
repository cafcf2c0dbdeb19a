"""A stage's local forward (paper §6.3): the compute operators of its executable graph on local shards (the kernel
registry, :mod:`.kernels`) and its forward Reshards, for one micro-batch.

A Reshard whose source and destination both hold this rank is a differentiable :func:`~.comm.reshard` (forward
plan, backward plan ``<name>.bwd``); one that crosses pipeline stages leaves its source for ``SEND_F``
(:attr:`MicroBatchRecord.outputs`) or takes its destination from ``RECV_F`` (:attr:`MicroBatchRecord.received`).
An activation with a gradient reduction (Megatron's *f*) is wrapped so that its accumulated gradient runs
``<tensor>.grad_reduce``.  Activation recomputation re-runs the local forward inside ``torch.utils.checkpoint``.
The compute seconds (:attr:`StageForward.compute_s`) never count waiting for peers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from ...core.annotation import local_view
from ...core.microbatch import batch_dim
from ...core.slices import Box, box_shape
from .comm import execute, reshard
from .errors import ExecutorError
from .kernels import kernel_for
from .p2p import identity_for, tag
from .zero3 import Zero3Params
from ..trace import comm_seconds

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ...core.comm_plan import CommPlan
    from ...core.graph import Graph, Node
    from ...core.specialize import ExecOp, ExecutableGraph
    from .comm import Groups
    from .kernels import Kernel

__all__ = ["MicroBatchRecord", "LocalContext", "StageForward"]


@dataclass
class MicroBatchRecord:
    """What a micro-batch's actions leave for its later actions."""

    loss: torch.Tensor | None = None
    loss_value: float = 0.0
    received: dict[str, torch.Tensor] = field(default_factory=dict)         # RECV_F -> F
    outputs: list[tuple[str, torch.Tensor]] = field(default_factory=list)    # F -> SEND_F, B (sent downstream)
    inputs: list[tuple[str, torch.Tensor]] = field(default_factory=list)     # F -> B, SEND_B (received)
    out_grads: list[torch.Tensor] = field(default_factory=list)              # RECV_B -> B


class _GradReduce(torch.autograd.Function):
    """Identity forward; backward runs the activation's gradient reduction plan (Megatron's *f*)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: "CommPlan", groups: "Groups",
                rank: int) -> torch.Tensor:  # type: ignore[override]
        ctx.plan, ctx.groups, ctx.rank = plan, groups, rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        g = execute(ctx.plan, grad.contiguous(), ctx.groups, rank=ctx.rank, device=grad.device)
        return g, None, None, None


class LocalContext:
    """The :class:`~.kernels.KernelContext` of one rank at its current micro-batch's shape (the kernels' view of
    :class:`StageForward`)."""

    def __init__(self, ex: "StageForward") -> None:
        self.ex = ex
        self._peers: dict[Any, tuple[int, ...]] = {}  # context-parallel groups by (tensor, dim, shape)

    @property
    def loss_normalizer(self) -> int | None:
        return self.ex.loss_normalizer

    @property
    def documents(self) -> tuple[int, ...] | None:
        return self.ex._cur_documents

    @property
    def sequence_balance(self) -> int:
        return self.ex.sequence_balance

    def global_shape(self, tensor: str) -> tuple[int, ...]:
        return self.ex.global_shape(tensor)

    def box(self, tensor: str) -> Box:
        ex = self.ex
        view = local_view(ex.anns[tensor], self.global_shape(tensor), ex.rank)
        if view is None:
            raise ExecutorError(f"rank {ex.rank} holds no shard of {tensor!r}")
        box = view.box
        d = batch_dim(ex.graph.tensors[tensor].shape)
        return box if d is None else box[:d] + ((0, ex._cur[1]),) + box[d + 1:]

    def local_shape(self, tensor: str) -> tuple[int, ...]:
        return box_shape(self.box(tensor))

    def sequence_peers(self, tensor: str, dim: int) -> tuple[int, ...]:
        """The ranks holding the same part of ``tensor`` as this one except along ``dim`` (its context-parallel
        group), in the order of their chunks of ``dim``."""
        ex = self.ex
        key = (tensor, dim, self.global_shape(tensor))
        got = self._peers.get(key)
        if got is None:
            ann, shape = ex.anns[tensor], key[2]
            mine = local_view(ann, shape, ex.rank)
            if mine is None:
                raise ExecutorError(f"rank {ex.rank} holds no shard of {tensor!r}")
            same = []
            for r in ann.ranks:
                view = local_view(ann, shape, r)
                if view is not None and all(a == b for d, (a, b) in enumerate(zip(view.box, mine.box)) if d != dim):
                    same.append((view.box[dim], r))
            starts = [b for b, _ in same]
            if len(set(starts)) != len(starts):
                raise ExecutorError(f"rank {ex.rank}: {tensor!r} is split along dim {dim} but several ranks hold "
                                    f"the same chunk ({sorted(same)}); cannot tell its context-parallel group")
            got = self._peers[key] = tuple(r for _, r in sorted(same))
        return got


class StageForward:
    """The local forward of :class:`~.executor.StepExecutor`, a part of it (its methods run on the executor).

    It reads the executor's set-up: ``eg`` (the rank's executable graph), ``nodes``, ``roles`` and ``unchanged``
    (forward Reshards), ``grad_reduce``, ``loss_name``, the current micro-batch's shape ``_cur`` and documents
    ``_cur_documents``, and its plans (``_plan``) and values (``_get``: waiting for a parameter's gather).  Its
    compute seconds go to ``compute_s`` (reported to ``emulate`` when speed emulation is on)."""

    rank: int
    groups: "Groups"
    device: torch.device
    graph: "Graph"
    anns: Mapping[str, Any]
    eg: "ExecutableGraph"
    nodes: dict[str, Any]
    roles: dict[str, str]
    unchanged: set[str]
    grad_reduce: set[str]
    loss_name: str
    loss_normalizer: int | None
    context: LocalContext
    sequence_balance: int
    global_shape: Callable[[str], tuple[int, ...]]
    emulate: Callable[[float], Any] | None
    compute_s: float
    _cur: tuple[dict[str, int], int]
    _cur_documents: tuple[int, ...] | None
    _attrs: dict[Any, dict[str, Any]]
    _drops: list[tuple[str, ...]] | None
    _prepared: dict[tuple[Any, ...], list[Any]]
    _plan: Callable[..., Any]
    _get: Callable[[dict[str, torch.Tensor], str], torch.Tensor]
    zero3: Zero3Params | None

    def _node_attrs(self, node: "Node") -> dict[str, Any]:
        """A node's kernel attributes at the current micro-batch's shape (the loss operator's also at the step's
        normaliser); cached."""
        bindings, rows = self._cur
        key = (node.name, rows, bindings.get("S"), bindings.get("B"),
               self.loss_normalizer if self.loss_name in node.outputs else None)
        got = self._attrs.get(key)
        if got is None:
            got = self._attrs[key] = kernel_for(node.kind, node.name).attrs(node, self.context)
        return got

    def _run_forward(self, mb: int, vals: dict[str, torch.Tensor], rec: MicroBatchRecord,
                     ops: "Iterable[ExecOp]") -> None:
        """Run ``ops`` (some of the stage's forward operators, in order) on ``vals``, each timed on its own."""
        for op in ops:
            if op.kind == "Reshard":
                self._forward_reshard(op, mb, vals, rec)
            else:
                self._compute(op, vals)

    def _run_whole_forward(self, mb: int, vals: dict[str, torch.Tensor], rec: MicroBatchRecord) -> None:
        """The stage's whole forward on ``vals``, as :meth:`_run_forward` computes it, with less bookkeeping per
        operator (its kernel, inputs, outputs and attributes looked up once per micro-batch shape: the per-operator
        lookups cost a 4-layer GPT-2's DP step ~7% of its forward) and each value let go after its last reader
        (:meth:`_forward_drops`).  The compute seconds are counted per run of compute operators between two
        Reshards, less the communication inside them; with speed emulation on, per operator (:meth:`_timed`)."""
        ops, drops = self.eg.forward, self._forward_drops()
        if self.emulate is not None:  # emulation is told each kernel's seconds
            for op, drop in zip(ops, drops):
                if op.kind == "Reshard":
                    self._forward_reshard(op, mb, vals, rec)
                else:
                    self._compute(op, vals)
                self._drop(vals, drop)
            return
        prepared = self._forward_prepared()
        documents, zero3 = self._cur_documents, self.zero3
        clock, t0, c0 = time.perf_counter, time.perf_counter(), comm_seconds()
        for op, drop, (node, kernel, attrs, reduced) in zip(ops, drops, prepared):
            if node is None:  # a Reshard: communication, timed apart
                self.compute_s += max(0.0, clock() - t0 - (comm_seconds() - c0))
                self._forward_reshard(op, mb, vals, rec)
                t0, c0 = clock(), comm_seconds()
            else:
                args = [vals[t] if t in vals else self._get(vals, t) for t in node.inputs]
                if attrs is None:  # the loss operator: its attributes follow the step's normaliser
                    attrs = self._node_attrs(node)
                if documents is not None and kernel.packing == "documents":
                    out = kernel.fn(*args, **attrs, documents=documents)
                else:
                    out = kernel.fn(*args, **attrs)
                if isinstance(out, tuple):
                    for name, v in zip(node.outputs, out):
                        vals[name] = self._reduced(name, v)
                else:
                    name = node.outputs[0]
                    vals[name] = self._reduced(name, out) if reduced else out
                if zero3 is not None:
                    self._zero3_produced(node.inputs, node.outputs, vals)
            if zero3 is None:  # (the common case inline: this loop is the step's hottest Python)
                for name in drop:
                    vals.pop(name, None)
            else:
                self._drop(vals, drop)
        self.compute_s += max(0.0, clock() - t0 - (comm_seconds() - c0))

    def _drop(self, vals: dict[str, torch.Tensor], names: tuple[str, ...]) -> None:
        """Let the values go whose last forward reader has run (a ZeRO-3 parameter's storage with its last name)."""
        zero3 = self.zero3
        for name in names:
            vals.pop(name, None)
            if zero3 is not None:
                zero3.dropped(name)

    def _zero3_produced(self, inputs: tuple[str, ...], outputs: tuple[str, ...], vals: dict[str, torch.Tensor]) -> None:
        """ZeRO-3: an operator that read gathered parameters made ``outputs`` (:meth:`.zero3.Zero3Params.produced`:
        aliases kept live, the backward refilling them first)."""
        zero3 = self.zero3
        assert zero3 is not None
        owners = zero3.owners(inputs)
        if owners:
            vals.update(zero3.produced(owners, {n: vals[n] for n in outputs if n in vals}))

    def _forward_prepared(self) -> list[tuple["Node | None", "Kernel | None", dict[str, Any] | None, bool]]:
        """Per forward operator at the current micro-batch shape: ``(node, kernel, attributes, reduced)``
        (``None``s for a Reshard; attributes ``None`` for the loss operator, read per step); cached per shape."""
        bindings, rows = self._cur
        key = (rows, bindings.get("S"), bindings.get("B"))
        got = self._prepared.get(key)
        if got is None:
            got = []
            for op in self.eg.forward:
                if op.kind == "Reshard":
                    got.append((None, None, None, False))
                    continue
                node = self.nodes[op.name]
                kernel = kernel_for(node.kind, node.name)
                attrs = None if self.loss_name in node.outputs else self._node_attrs(node)
                got.append((node, kernel, attrs, len(node.outputs) == 1 and node.outputs[0] in self.grad_reduce))
            self._prepared[key] = got
        return got

    def _forward_drops(self) -> list[tuple[str, ...]]:
        """Per forward operator, the values whose last reader it is (the loss is kept: :meth:`forward` reads
        it); computed once."""
        if self._drops is None:
            last: dict[str, int] = {}
            for i, op in enumerate(self.eg.forward):
                for name in (op.inputs if op.kind == "Reshard" else self.nodes[op.name].inputs):
                    last[name] = i
            drops: list[list[str]] = [[] for _ in self.eg.forward]
            for name, i in last.items():
                if name != self.loss_name:
                    drops[i].append(name)
            self._drops = [tuple(d) for d in drops]
        return self._drops

    def _forward_recompute(self, mb: int, vals: dict[str, torch.Tensor], rec: MicroBatchRecord) -> None:
        """The local part of the forward (after this stage's receives, before its sends) under
        ``torch.utils.checkpoint``: activations are dropped and recomputed in backward.  In-stage collectives are
        re-run too, identically on every rank of the stage."""
        from torch.utils.checkpoint import checkpoint

        ops = list(self.eg.forward)
        head = [o for o in ops if o.kind == "Reshard" and self.roles[o.name] == "recv"]
        tail = [o for o in ops if o.kind == "Reshard" and self.roles[o.name] == "send"]
        body = [o for o in ops if o not in head and o not in tail]
        self._run_forward(mb, vals, rec, head)
        produced = {t for o in body for t in o.outputs}
        wanted = [o.inputs[0] for o in tail] + ([self.loss_name] if self.loss_name in produced else [])
        names = sorted(k for k, v in vals.items() if isinstance(v, torch.Tensor))
        drops = dict(zip((o.name for o in ops), self._forward_drops()))

        def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # each value let go after its last reader, in the forward and in its rerun: a ZeRO-3 parameter is
            # then gathered alike in every micro-batch (once in the forward; in the backward for the rerun and
            # again for the operators' backward), as a replica running fewer micro-batches replays it
            local = dict(zip(names, tensors))
            for op in body:
                self._run_forward(mb, local, rec, (op,))
                self._drop(local, drops[op.name])
            return tuple(local[w] for w in wanted)

        outs = checkpoint(run, *(vals[n] for n in names), use_reentrant=False)
        vals.update(zip(wanted, outs))
        self._run_forward(mb, vals, rec, tail)

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, its seconds added to :attr:`compute_s` (and reported to ``emulate`` when speed
        emulation is on), less the communication inside it (:func:`~.trace.communicating`: the Reshards' backward
        plans that autograd runs, the context-parallel ring's waits), which is waiting for peers, not computing."""
        c0 = comm_seconds()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        dt = max(0.0, time.perf_counter() - t0 - (comm_seconds() - c0))
        if self.emulate is not None:
            dt += self.emulate(dt) or 0.0
        self.compute_s += dt
        return out

    def _compute(self, op: "ExecOp", vals: dict[str, torch.Tensor]) -> None:
        node = self.nodes[op.name]
        kernel = kernel_for(node.kind, node.name)
        out = self._timed(kernel.fn, *[self._get(vals, t) for t in node.inputs], **self._node_attrs(node),
                          **kernel.packed_attrs(self.context))
        outs = out if isinstance(out, tuple) else (out,)
        for name, v in zip(node.outputs, outs):
            vals[name] = self._reduced(name, v)
        if self.zero3 is not None:
            self._zero3_produced(node.inputs, node.outputs, vals)

    def _reduced(self, name: str, v: torch.Tensor) -> torch.Tensor:
        """Tensor ``name`` (a compute op's or a Reshard's output), wrapped so that its accumulated gradient runs
        ``<name>.grad_reduce`` when it has one (Megatron's *f*)."""
        if name not in self.grad_reduce:
            return v
        return _GradReduce.apply(v, self._plan(f"{name}.grad_reduce"), self.groups, self.rank)

    def _forward_reshard(self, op: "ExecOp", mb: int, vals: dict[str, torch.Tensor], rec: MicroBatchRecord) -> None:
        src, dst = op.inputs[0], op.outputs[0]
        role = self.roles[op.name]
        if role == "local" and op.name in self.unchanged:
            vals[dst] = self._get(vals, src)
        elif role == "local":
            plan, back = self._plan(op.name, mb), self._plan(f"{op.name}.bwd", mb)
            x = self._get(vals, src)
            if identity_for(plan, self.rank) and identity_for(back, self.rank):
                vals[dst] = x
            else:
                # the same message tags as a peer's send/receive of this plan (it may be on another stage)
                vals[dst] = reshard(x, plan, back, self.groups, rank=self.rank, device=self.device,
                                    tag_base=tag(mb, 0), backward_tag_base=tag(mb, 1))
        elif role == "send":
            rec.outputs.append((op.name, self._get(vals, src)))
        else:
            x = rec.received.pop(op.name).requires_grad_(True)
            vals[dst] = x
            rec.inputs.append((op.name, x))
        if dst in vals:
            vals[dst] = self._reduced(dst, vals[dst])
            if self.zero3 is not None:
                self._zero3_produced((src,), (dst,), vals)
