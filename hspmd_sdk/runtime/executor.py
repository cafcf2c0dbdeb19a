"""The training executor: one rank runs its executable graph step by step (paper §6.3, Appendix A.2).

Per step a rank replays its schedule (:meth:`Program.schedule`): ``PRE`` (ZeRO parameter gathering), ``F``/``B`` of
each of its pipeline's micro-batches in GPipe or 1F1B order, then ``POST`` (gradient synchronisation, Adam).
Everything it does comes from the :class:`~hspmd_sdk.core.specialize.Program`: the compute ops of its
executable graph (:data:`~hspmd_sdk.runtime.kernels.KERNELS` on local shards), and the ``CommPlan`` of every
Reshard, backward Reshard, gradient reduction and gradient synchronisation, executed by :mod:`.comm`.  Nothing is
re-derived; the only run-time decision is the concrete micro-batch shape (:mod:`.microbatch`).

Backward is torch autograd over the local ops.  A Reshard whose source and destination both hold this rank is a
differentiable :func:`~.comm.reshard` (forward plan, backward plan ``<name>.bwd``); an activation with a gradient
reduction (Megatron's *f*) is wrapped so that its accumulated gradient runs ``<tensor>.grad_reduce``.  A Reshard
that crosses pipeline stages (this rank holds only its source, or only its destination — SendRecv or BSR, also
between stages of different TP degrees) is where the schedule's transfers happen: the sending stage posts its
messages asynchronously at the end of its ``F`` (``SEND_F``) and receives the gradient before its ``B``
(``RECV_B``); the receiving stage receives before its ``F`` (``RECV_F``) and sends the input's gradient after its
``B`` (``SEND_B``).  Receives block; sends do not (they are waited for at the end of the step) — the semantics
under which :func:`hspmd_sdk.core.schedule.replay` proves the schedules deadlock-free.

Loss: the graph's ``cross_entropy`` runs with ``total_count`` = the *global* number of target tokens of the step,
so each micro-batch's loss is its summand of the global mean and the accumulated gradients (summed over
micro-batches, then across pipelines by ``<param>.grad_sync``) are exactly the single-device model's.

Optimizer: :class:`torch.optim.Adam` on this rank's parameter shards (elementwise, so shard-wise Adam is Adam).
With ZeRO-1 the parameters themselves are sharded across pipelines (``<param>.gather`` in ``PRE``), the gradient
is reduce-scattered onto the shard (SplitReduceScatter), and the optimizer state is per shard: sharded as the
plan says.  Optional activation recomputation per stage re-runs a micro-batch's local forward inside
``torch.utils.checkpoint`` (see :class:`StepExecutor`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ..core.annotation import local_view
from ..core.comm_ops import CollectiveOp, IdentityOp, PointToPointOp, SplitCollectiveOp
from ..core.slices import box_numel, box_shape, relative
from ..core.symbolic import evaluate_shape
from ..errors import HSPMDError
from .comm import execute, execute_bucketed, reshard, torch_dtype
from .kernels import KERNELS
from .microbatch import batch_dim, micro_batch_plan
from .params import init_local_parameters

__all__ = ["StepExecutor", "ExecutorError", "program_comm_plans", "AdamConfig"]


class ExecutorError(HSPMDError):
    """The executor cannot run this program on this rank (names the rank and what is missing)."""


@dataclass(frozen=True)
class AdamConfig:
    """``torch.optim.Adam`` hyper-parameters."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


def program_comm_plans(program: Any) -> list[Any]:
    """Every ``CommPlan`` of the program (for ``comm_groups``): forward/Pre Reshards, their backward plans,
    gradient reductions and gradient synchronisations — identical on every rank."""
    return (list(program.comm_plans.values()) + list(program.backward_plans.values())
            + list(program.grad_reduce_plans.values()) + list(program.grad_sync_plans.values()))


@dataclass
class _MicroBatch:
    """What a micro-batch's F leaves for its B."""

    loss: torch.Tensor | None = None
    outputs: list[tuple[str, torch.Tensor]] = field(default_factory=list)   # sent to the next stage
    inputs: list[tuple[str, torch.Tensor]] = field(default_factory=list)    # received from the previous stage
    loss_value: float = 0.0


class _GradReduce(torch.autograd.Function):
    """Identity forward; backward runs the activation's gradient reduction plan (Megatron's *f*)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: Any, groups: Any, rank: int) -> torch.Tensor:  # type: ignore[override]
        ctx.plan, ctx.groups, ctx.rank = plan, groups, rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        g = execute(ctx.plan, grad.contiguous(), ctx.groups, rank=ctx.rank, device=grad.device)
        return g, None, None, None


class StepExecutor:
    """Runs training steps of ``program`` on rank ``rank``.

    ``groups``: the process-group lookup (the :class:`~.worker.WorkerState`); every rank must already have called
    ``state.create_groups(comm_groups(program_comm_plans(program)))``.  ``global_batch``/``seq_len``: the step's
    concrete ``B`` and ``S``.  ``recompute``: activation recomputation on this rank's stage (the micro-batch's
    local forward between its stage-boundary transfers is re-run in backward).
    """

    def __init__(self, program: Any, rank: int, groups: Any, *, seed: int, global_batch: int, seq_len: int,
                 adam: AdamConfig = AdamConfig(), recompute: bool = False,
                 device: torch.device | None = None, emulate: Callable[[float], Any] | None = None) -> None:
        self.program, self.rank, self.groups = program, rank, groups
        # speed emulation (CPU demos): called with the seconds of each compute piece -- a forward kernel, a
        # stage's autograd backward, the optimizer step -- never with time spent waiting for other ranks
        self.emulate = emulate
        self.device = device or torch.device("cpu")
        self.graph = program.graph
        self.anns = program.annotations
        self.eg = program.executable_graph(rank)
        if self.eg.pipeline is None:
            raise ExecutorError(f"rank {rank} runs no forward operator of this program")
        self.pipeline, self.stage = self.eg.pipeline, self.eg.stage
        self.bindings = {"B": int(global_batch), "S": int(seq_len)}
        program.bind(self.bindings)
        self.total_tokens = int(global_batch) * int(seq_len)
        self.recompute = recompute
        self.nodes = {n.name: n for n in self.graph.nodes}
        self.params = {k: v.to(self.device) if v.device != self.device else v
                       for k, v in init_local_parameters(program, rank, seed).items()}
        self.optimizer = torch.optim.Adam(list(self.params.values()), lr=adam.lr, betas=adam.betas, eps=adam.eps,
                                          weight_decay=adam.weight_decay, foreach=False)
        self.num_micro = program.num_micro_batches(self.pipeline)
        self.chunk = self._batch_chunk()
        rows = self.chunk[1] - self.chunk[0]
        mbs = program.micro_batch_size(self.pipeline)
        self.micro_size = int(mbs) if mbs else rows // self.num_micro
        if self.micro_size * self.num_micro != rows:
            raise ExecutorError(f"rank {rank}: pipeline {self.pipeline} holds {rows} rows of the batch but runs "
                                f"{self.num_micro} micro-batches of {self.micro_size}")
        self.grad_reduce = {o.inputs[0] for o in self.eg.backward if o.kind == "GradReduce"}
        self.roles = {o.name: self._role(o) for o in self.eg.forward if o.kind == "Reshard"}
        self.used = self._used_tensors()
        self._plans: dict[tuple[str, int], Any] = {}
        self._attrs: dict[str, dict[str, Any]] = {}
        self._pending: list[Any] = []
        self.step_values: dict[str, torch.Tensor] = {}
        self.records: dict[int, _MicroBatch] = {}
        self.captured_grads: dict[str, torch.Tensor] | None = None

    # ---- set-up ---------------------------------------------------------------------------------------------
    def _global_shape(self, tensor: str) -> tuple[int, ...]:
        return tuple(int(d) for d in evaluate_shape(self.graph.tensors[tensor].shape, self.bindings, tensor=tensor))

    def _batch_chunk(self) -> tuple[int, int]:
        """This pipeline's rows ``[a, b)`` of the global batch, from the annotation of a local activation."""
        for op in self.eg.forward:
            for t in op.outputs + op.inputs:
                d = batch_dim(self.graph.tensors[t].shape)
                if d is not None and self.rank in self.anns[t].ranks:
                    return local_view(self.anns[t], self._global_shape(t), self.rank).box[d]
        raise ExecutorError(f"rank {self.rank}: no local activation has a batch dim")

    def _role(self, op: Any) -> str:
        """``local`` (holds source and destination), ``send`` (only the source) or ``recv`` (only the
        destination) for a forward Reshard on this rank."""
        src, dst = self.anns[op.inputs[0]], self.anns[op.outputs[0]]
        has_src, has_dst = self.rank in src.ranks, self.rank in dst.ranks
        return "local" if has_src and has_dst else "send" if has_src else "recv"

    def _used_tensors(self) -> dict[str, str]:
        """Parameter -> the tensor its consumers read (the end of its chain of ``Pre`` Reshards)."""
        used = {p: p for p in self.params}
        owner = {p: p for p in self.params}
        for op in self.eg.pre:
            p = owner.get(op.inputs[0])
            if p is not None:
                owner[op.outputs[0]] = p
                used[p] = op.outputs[0]
        return used

    def _plan(self, name: str, tensor: str) -> Any:
        """The micro-batch plan of communication ``name`` (moving ``tensor``) at this pipeline's micro size."""
        key = (name, self.micro_size)
        got = self._plans.get(key)
        if got is None:
            plan = self.program.concrete_plan(name, self.bindings)
            d = batch_dim(self.graph.tensors[tensor].shape)
            got = plan if d is None else micro_batch_plan(plan, d, self.chunk, self.micro_size)
            self._plans[key] = got
        return got

    def _node_attrs(self, node: Any) -> dict[str, Any]:
        got = self._attrs.get(node.name)
        if got is not None:
            return got
        attrs = dict(node.attr)
        out = node.outputs[0]
        if node.kind == "reshape":
            shape = list(self.program.local_shape(out, self.rank, self.bindings))
            d = batch_dim(self.graph.tensors[out].shape)
            if d is not None:
                shape[d] = self.micro_size
            attrs["shape"] = tuple(int(s) for s in shape)
        elif node.kind == "cross_entropy":
            attrs["total_count"] = self.total_tokens
        elif node.kind == "embedding":
            w = node.inputs[1]
            box = local_view(self.anns[w], self._global_shape(w), self.rank).box
            if box[0] != (0, self._global_shape(w)[0]):
                attrs["vocab_start"] = box[0][0]
        elif node.kind == "rope":
            x = node.inputs[0]
            box = local_view(self.anns[x], self._global_shape(x), self.rank).box
            if box[1][0]:
                attrs["position_offset"] = box[1][0]
        self._attrs[node.name] = attrs
        return attrs

    # ---- one step ---------------------------------------------------------------------------------------------
    @property
    def needs_data(self) -> bool:
        """Whether this rank reads the batch (its executable graph has a placeholder: first or last stage)."""
        return any(self.graph.producer(n).kind == "placeholder" for n in self.eg.leaves)

    def step(self, batch: torch.Tensor | None, *, capture_grads: bool = False) -> float:
        """Run one training step on the global batch ``batch[B, S+1]`` (every rank that :attr:`needs_data` passes
        the same; others may pass ``None``); returns this rank's summand of the global loss (see
        :meth:`loss_contributor`)."""
        full = {} if batch is None else {"tokens": batch[:, :-1], "targets": batch[:, 1:]}
        self._feeds = self._local_feeds(full)
        self.records.clear()
        loss = 0.0
        for action in self.program.schedule(self.rank):
            kind = action.kind
            if kind == "PRE":
                self.pre()
            elif kind == "F":
                self.forward(action.micro_batch)
            elif kind == "B":
                loss += self.backward(action.micro_batch)
            elif kind == "POST":
                self.post(capture_grads=capture_grads)
            # SEND_*/RECV_*: the transfers run inside F and B at the stage-boundary Reshards (module docstring)
        return loss

    def _local_feeds(self, full: Mapping[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        """Each placeholder leaf of this rank, cut to its box and split into the pipeline's micro-batches."""
        out: dict[str, list[torch.Tensor]] = {}
        for name in self.eg.leaves:
            if self.graph.producer(name).kind != "placeholder":
                continue
            if name not in full:
                raise ExecutorError(f"rank {self.rank}: the step has no {name!r} but this rank's graph reads it")
            t = full[name]
            view = local_view(self.anns[name], tuple(t.shape), self.rank)
            local = t[view.slices].to(self.device)
            d = batch_dim(self.graph.tensors[name].shape)
            out[name] = list(torch.split(local, self.micro_size, dim=d))
        return out

    def pre(self) -> None:
        """``Pre``: parameter leaves, and the Reshards that gather them (ZeRO-1 SplitAllGather)."""
        vals: dict[str, torch.Tensor] = dict(self.params)
        for op in self.eg.pre:
            src, dst = op.inputs[0], op.outputs[0]
            plan = self.program.comm_plans[op.name]
            if _identity_for(plan, self.rank):
                if src in vals:
                    vals[dst] = vals[src]
                continue
            with torch.no_grad():
                out = execute(plan, vals[src].detach() if src in vals else None, self.groups, rank=self.rank,
                              device=self.device)
            if out is not None:
                vals[dst] = out.requires_grad_(True)
        self.step_values = vals

    def forward(self, mb: int) -> None:
        """``F`` of micro-batch ``mb``."""
        rec = _MicroBatch()
        vals = dict(self.step_values)
        for name, parts in self._feeds.items():
            vals[name] = parts[mb]
        if self.recompute:
            self._forward_recompute(mb, vals, rec)
        else:
            self._run_forward(mb, vals, rec)
        if rec.loss is not None:
            rec.loss_value = float(rec.loss.detach())
        self.records[mb] = rec

    def _run_forward(self, mb: int, vals: dict[str, torch.Tensor], rec: _MicroBatch) -> None:
        for op in self.eg.forward:
            if op.kind == "Reshard":
                self._forward_reshard(op, mb, vals, rec)
            else:
                self._compute(op, vals)
        if "loss" in vals and self.rank in self.anns["loss"].ranks:
            rec.loss = vals["loss"]

    def _forward_recompute(self, mb: int, vals: dict[str, torch.Tensor], rec: _MicroBatch) -> None:
        """The local part of the forward (after this stage's receives, before its sends) under
        ``torch.utils.checkpoint``: activations are dropped and recomputed in backward.  In-stage collectives are
        re-run too, identically on every rank of the stage."""
        from torch.utils.checkpoint import checkpoint

        ops = list(self.eg.forward)
        head = [o for o in ops if o.kind == "Reshard" and self.roles[o.name] == "recv"]
        tail = [o for o in ops if o.kind == "Reshard" and self.roles[o.name] == "send"]
        body = [o for o in ops if o not in head and o not in tail]
        for op in head:
            self._forward_reshard(op, mb, vals, rec)
        wanted = [o.inputs[0] for o in tail] + (["loss"] if "loss" in {t for o in body for t in o.outputs} else [])
        names = sorted(k for k, v in vals.items() if isinstance(v, torch.Tensor))

        def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            local = dict(zip(names, tensors))
            for op in body:
                if op.kind == "Reshard":
                    self._forward_reshard(op, mb, local, rec)
                else:
                    self._compute(op, local)
            return tuple(local[w] for w in wanted)

        outs = checkpoint(run, *(vals[n] for n in names), use_reentrant=False)
        vals.update(zip(wanted, outs))
        for op in tail:
            self._forward_reshard(op, mb, vals, rec)
        if "loss" in vals and self.rank in self.anns["loss"].ranks:
            rec.loss = vals["loss"]

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, reporting its seconds to ``emulate`` when speed emulation is on."""
        if self.emulate is None:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.emulate(time.perf_counter() - t0)
        return out

    def _compute(self, op: Any, vals: dict[str, torch.Tensor]) -> None:
        node = self.nodes[op.name]
        out = self._timed(KERNELS[node.kind], *(vals[t] for t in node.inputs), **self._node_attrs(node))
        outs = out if isinstance(out, tuple) else (out,)
        for name, v in zip(node.outputs, outs):
            if name in self.grad_reduce:
                v = _GradReduce.apply(v, self._plan(f"{name}.grad_reduce", name), self.groups, self.rank)
            vals[name] = v

    def _forward_reshard(self, op: Any, mb: int, vals: dict[str, torch.Tensor], rec: _MicroBatch) -> None:
        src, dst = op.inputs[0], op.outputs[0]
        role = self.roles[op.name]
        plan = self._plan(op.name, src)
        if role == "local":
            if _identity_for(plan, self.rank) and _identity_for(self._plan(f"{op.name}.bwd", src), self.rank):
                vals[dst] = vals[src]
            else:
                # the same message tags as a peer's _send/_receive of this plan (it may be on another stage)
                vals[dst] = reshard(vals[src], plan, self._plan(f"{op.name}.bwd", src), self.groups, rank=self.rank,
                                    device=self.device, tag_base=_tag(mb, 0), backward_tag_base=_tag(mb, 1))
        elif role == "send":
            self._send(plan, vals[src], _tag(mb, 0))
            rec.outputs.append((op.name, vals[src]))
        else:
            x = self._receive(plan, _tag(mb, 0)).requires_grad_(True)
            vals[dst] = x
            rec.inputs.append((op.name, x))

    def backward(self, mb: int) -> float:
        """``B`` of micro-batch ``mb``; returns the micro-batch's loss summand (0 off the last stage)."""
        rec = self.records.pop(mb)
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if rec.loss is not None:
            roots.append(rec.loss)
            grads.append(torch.ones_like(rec.loss))
        for name, t in reversed(rec.outputs):
            roots.append(t)
            grads.append(self._receive(self._plan(f"{name}.bwd", self.nodes[name].inputs[0]), _tag(mb, 1)))
        if roots:
            self._timed(torch.autograd.backward, roots, grads)
        for name, t in reversed(rec.inputs):
            g = t.grad if t.grad is not None else torch.zeros_like(t)
            self._send(self._plan(f"{name}.bwd", self.nodes[name].inputs[0]), g, _tag(mb, 1))
        return rec.loss_value

    def post(self, *, capture_grads: bool = False) -> None:
        """``Post``: gradient synchronisation per the plan, then Adam on the local shards."""
        syncs: list[tuple[str, Any, torch.Tensor]] = []
        for op in self.eg.post:
            if op.kind == "GradSync":
                p = op.inputs[0]
                used = self.step_values.get(self.used[p])
                g = used.grad if used is not None and used.grad is not None else None
                if g is None:
                    g = torch.zeros_like(used if used is not None else self.params[p])
                if _identity_for(op.comm, self.rank):
                    self.params[p].grad = g
                else:
                    syncs.append((p, op.comm, g))
        # one collective per bucket of gradients, not one per parameter (like DDP's buckets)
        outs = execute_bucketed([(plan, g) for _, plan, g in syncs], self.groups, rank=self.rank,
                                device=self.device)
        for (p, _, _), out in zip(syncs, outs):
            self.params[p].grad = out
        if capture_grads:
            self.captured_grads = {k: v.grad.detach().clone() for k, v in self.params.items()}
        if any(o.kind == "OptimizerStep" for o in self.eg.post):
            self._timed(self.optimizer.step)
        self.optimizer.zero_grad(set_to_none=True)
        self.step_values = {}
        self._wait_sends()

    # ---- stage-boundary transfers -------------------------------------------------------------------------------
    def _send(self, plan: Any, local: torch.Tensor, tag: int) -> None:
        """Post this rank's messages of a stage-crossing plan asynchronously (other operators run in place)."""
        cur: torch.Tensor | None = local.detach()
        for op in plan.ops:
            if isinstance(op, PointToPointOp):
                inb = dict(op.in_boxes)
                for i, m in enumerate(op.messages):
                    if m.src == self.rank and m.dst != self.rank:
                        buf = cur[relative(m.box, inb[self.rank])].contiguous()
                        self._pending.append((dist.isend(buf, m.dst, tag=tag + i), buf))
            else:
                cur = _run_single(op, plan, cur, self.groups, self.rank, self.device)

    def _receive(self, plan: Any, tag: int) -> torch.Tensor:
        """Receive this rank's part of a stage-crossing plan (blocking); returns its destination tensor."""
        cur: torch.Tensor | None = None
        for op in plan.ops:
            if isinstance(op, PointToPointOp):
                outb = dict(op.out_boxes)
                if self.rank not in outb:
                    continue
                out = torch.zeros(box_shape(outb[self.rank]), dtype=torch_dtype(plan.dtype), device=self.device)
                recvs = []
                for i, m in enumerate(op.messages):
                    if m.dst == self.rank and m.src != self.rank:
                        buf = torch.empty(box_numel(m.box), dtype=out.dtype, device=self.device)
                        recvs.append((dist.irecv(buf, m.src, tag=tag + i), buf, m.box))
                for work, buf, box in recvs:
                    work.wait()
                    out[relative(box, outb[self.rank])] = buf.reshape(box_shape(box))
                cur = out
            else:
                cur = _run_single(op, plan, cur, self.groups, self.rank, self.device)
        if cur is None:
            raise ExecutorError(f"rank {self.rank}: plan {plan.src} -> {plan.dst} gives this rank nothing to receive")
        return cur

    def _wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    # ---- reporting -----------------------------------------------------------------------------------------------
    def loss_contributor(self) -> bool:
        """Whether this rank's loss summands count toward the global loss: one rank per Partial summand of the
        ``loss`` annotation (TP replicas of a last stage hold equal copies)."""
        ann = self.anns["loss"]
        if self.rank not in ann.ranks:
            return False
        mine = local_view(ann, (), self.rank).partial_index
        first = next(r for r in ann.ranks if local_view(ann, (), r).partial_index == mine)
        return first == self.rank


def _tag(mb: int, direction: int) -> int:
    """Message tag base of micro-batch ``mb`` (``direction`` 0: activations, 1: gradients)."""
    return ((mb % 4096) * 2 + direction) * 1024




def _identity_for(plan: Any, rank: int) -> bool:
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
            outb = dict(op.out_boxes)
            if rank in outb and dict(op.in_boxes).get(rank) != outb[rank]:
                return False
        else:
            return False
    return True


def _run_single(op: Any, plan: Any, cur: torch.Tensor | None, groups: Any, rank: int,
                device: torch.device) -> torch.Tensor | None:
    """One non-point-to-point operator of a plan through :func:`~.comm.execute` (ranks it does not write keep
    their tensor)."""
    from dataclasses import replace

    sub = replace(plan, ops=(op,))
    out = execute(sub, cur, groups, rank=rank, device=device)
    return out if out is not None else cur
