"""The training executor: one rank replays its executable graph step by step (paper §6.3, Appendix A.2).

Per step a rank replays its stage's stored schedule (:meth:`Program.schedule`), action by action: ``PRE`` (the
parameters' Reshards: ZeRO gathering, a tied weight's second placement), then per micro-batch ``RECV_F`` / ``F`` /
``SEND_F`` and ``RECV_B`` / ``B`` / ``SEND_B`` in GPipe or 1F1B order, then ``POST`` (gradient synchronisation,
Adam).  Everything it does comes from the :class:`~hspmd_sdk.core.specialize.Program`: the compute ops of its
executable graph (the kernel registry :data:`~hspmd_sdk.runtime.workers.kernels.KERNELS`, on local shards), the loss
tensor the graph marks, and the ``CommPlan`` of every Reshard, backward Reshard, gradient reduction and gradient
synchronisation at the micro-batch's shape (:meth:`Program.micro_batch_plan`), executed by :mod:`.comm`.  It names
no model, no op kind and no tensor.

Backward is torch autograd over the local ops.  A Reshard whose source and destination both hold this rank is a
differentiable :func:`~.comm.reshard` (forward plan, backward plan ``<name>.bwd``); an activation with a gradient
reduction (Megatron's *f*) is wrapped so that its accumulated gradient runs ``<tensor>.grad_reduce``.  A Reshard
that crosses pipeline stages (this rank holds only its source, or only its destination — SendRecv or BSR, also
between stages of different TP degrees) is the schedule's transfer actions: the receiving stage receives it in
``RECV_F`` and sends its gradient in ``SEND_B``; the sending stage posts it asynchronously in ``SEND_F`` and
receives the gradient in ``RECV_B``.  Receives block; sends do not (they are waited for at the end of the step) —
the semantics under which :func:`hspmd_sdk.core.schedule.replay` proves the schedules deadlock-free.

Overlap, none of which changes a result or that semantics: under gloo each receive is *posted* ahead, when the
previous receive of its direction runs, and waited for at its own action (messages match by peer and tag, so
posting early cannot match another message: ``PRE``/``POST`` messages have tags of their own); ZeRO-1's gathers
are started in ``PRE``, coalesced into buckets (:class:`~.buckets.GatherBuckets`), and each gathered parameter is
waited for where the forward first reads it; gradient buckets (:mod:`.buckets`) start their collectives from
autograd hooks during the step's last ``B``, as soon as every use of their parameters has its final gradient.

Precision (SPEC §8): ``precision="bf16"`` computes with bf16 working copies of the fp32 master parameters (made
in ``PRE``), bf16 activations and gradients, every plan executed for bf16 (:func:`~.comm.with_dtype`); the loss
is fp32; each use's gradient is summed over micro-batches in fp32, synchronised in bf16 and applied in fp32 to the
masters, whose Adam state is fp32.

Context parallelism: where every attention of the rank's pipeline splits the sequence over ``N > 1`` ranks, the
pipeline lays each micro-batch's sequence out in the balanced order (:attr:`StepExecutor.sequence_balance`): the
data is reordered once when it is cut to this rank's box, so that the DS split gives rank ``i`` of a CP group
global chunks ``i`` and ``2N-1-i`` (even causal work, Megatron's and torch's layout); positions and attention read
global positions from the order.

Loss: the loss op runs with the step's *global* number of target tokens (the kernel registry's
``loss_normalizer``), so each micro-batch's loss is its summand of the global mean and the accumulated gradients
(summed over micro-batches, then across pipelines by the gradient synchronisation) are exactly the single-device
model's.

Parameters and optimizer state: each rank holds only its shards — built from the model's initialisation
(:func:`~.params.init_local_parameters`), or handed in (``params=``, ``optimizer_state=``: a switch, a checkpoint,
Hugging Face weights).  :class:`torch.optim.Adam` runs on the shards (elementwise, so shard-wise Adam is Adam);
:meth:`StepExecutor.optimizer_state` / :meth:`StepExecutor.load_optimizer_state` give its state by parameter
name.  With ZeRO-1 the parameters are sharded across pipelines (gathered in ``PRE``), the gradient is
reduce-scattered onto the shard, and the optimizer state is per shard.  Activation recomputation (the Program's
``recompute`` ranks) re-runs a micro-batch's local forward inside ``torch.utils.checkpoint``.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ...core.annotation import local_view
from ...core.comm_ops import CollectiveOp, IdentityOp, PointToPointOp, SplitCollectiveOp
from ...core.microbatch import batch_dim
from ...core.program_part import world_pipeline_pairs
from ...core.slices import Box, box_shape
from ...core.symbolic import Sym, evaluate_shape
from ...errors import HSPMDError, PlanValidationError
from .buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, GatherBuckets, GradBuckets, SyncItem, bucketable
from .comm import (Pending, SendWaiter, execute, execute_async, execute_op, post_receives, post_sends, reshard,
                   with_dtype)
from .cp_attention import balanced_order
from .kernels import IGNORE_INDEX, kernel_for, packing_problems, reorder_problems
from .params import check_local_parameters, init_local_parameters
from ..trace import comm_seconds, span
from ...core.schedule import Action, build_schedule

__all__ = ["StepExecutor", "ExecutorError", "program_comm_plans", "AdamConfig", "PRECISIONS", "precision_dtype",
           "pipeline_pairs", "pipeline_groups", "sequence_balance"]

#: ``precision=`` -> the dtype of parameters' working copies, activations, gradients and messages (SPEC §8).  The
#: master weights and Adam's state are fp32 either way.
PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def precision_dtype(precision: str) -> torch.dtype:
    """The compute dtype of ``precision`` (``"fp32"`` or ``"bf16"``); the error names the choices."""
    try:
        return PRECISIONS[precision]
    except (KeyError, TypeError):
        raise ExecutorError(f"precision must be one of {sorted(PRECISIONS)}, not {precision!r}") from None


class ExecutorError(HSPMDError):
    """The executor cannot run this program on this rank (names the rank and what is missing)."""


@dataclass(frozen=True)
class AdamConfig:
    """``torch.optim.Adam`` hyper-parameters, checked when made (so a bad value fails before any worker runs)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: which parameters ``weight_decay`` applies to: ``"matrices"`` (those of 2 dimensions or more: none on norms
    #: and biases, nanoGPT's and Megatron's rule) or ``"all"``
    decay: str = "matrices"
    #: ``"adam"`` (``torch.optim.Adam``: weight decay added to the gradients) or ``"adamw"`` (``torch.optim.AdamW``:
    #: decoupled weight decay, what GPT training usually means by it)
    kind: str = "adam"

    def __post_init__(self) -> None:
        problems = adam_problems(self.lr, self.betas, self.eps, self.weight_decay)
        if self.decay not in DECAY_RULES:
            problems.append(("decay", f"must be one of {list(DECAY_RULES)}, not {self.decay!r}"))
        if self.kind not in OPTIMIZERS:
            problems.append(("optimizer", f"must be one of {list(OPTIMIZERS)}, not {self.kind!r}"))
        if problems:
            raise PlanValidationError(problems, what="optimizer options")

    def groups(self, params: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
        """The parameter groups: one, or with ``weight_decay`` under the ``"matrices"`` rule the parameters of 2
        dimensions or more (decayed) and the rest (norms, biases: ``weight_decay=0``).  A shard has its tensor's
        number of dimensions, so every rank splits its shards as the single-device model splits its tensors."""
        params = list(params)
        if self.weight_decay == 0.0 or self.decay == "all":
            return [{"params": params}]
        return [g for g in ({"params": [p for p in params if p.dim() >= 2]},
                            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}) if g["params"]]

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Adam:
        """``torch.optim.Adam`` over ``params`` (fp32, one device, contiguous) with these options, as every rank
        and the single-device reference run it: torch's fused kernel where this torch has one for the device
        (:func:`fused_adam_available`: CPU since torch 2.4, CUDA), else the for-loop implementation.  One kernel
        for all: the update is elementwise, so a shard's update is the full tensor's on those elements (the fused
        kernel's vector tail may round one element of an odd-sized shard differently by an ulp; measured 5x
        faster on this CPU than the loop for the bench model's 38 tensors, 1.8 vs 9.3 ms).  The fused kernel
        ignores strides: parameters, gradients and state must be contiguous (the executor makes them so)."""
        params = list(params)
        kw = dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        groups = self.groups(params)
        cls = torch.optim.AdamW if self.kind == "adamw" else torch.optim.Adam
        if params and all(fused_adam_available(p) for p in params):
            return cls(groups, fused=True, **kw)
        return cls(groups, foreach=False, **kw)


#: ``AdamConfig.decay``: which parameters weight decay applies to.
DECAY_RULES = ("matrices", "all")
#: ``AdamConfig.kind``: the optimizers.
OPTIMIZERS = ("adam", "adamw")


def clip_coefficient(norm: float, max_norm: float) -> torch.Tensor:
    """The factor gradients are scaled by for a global ``norm``: ``min(1, max_norm / (norm + 1e-6))``, in fp32
    exactly as ``torch.nn.utils.clip_grad_norm_`` computes it (so a clipped step is the single-device one)."""
    total = torch.tensor(norm, dtype=torch.float32)
    return torch.clamp(torch.tensor(max_norm, dtype=torch.float32) / (total + 1e-6), max=1.0)


def fused_adam_available(t: torch.Tensor) -> bool:
    """Whether this torch has a fused Adam kernel for ``t``'s device and dtype (checked here: torch itself only
    checks at the first ``step()``)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        devices = _get_fused_kernels_supported_devices()
    except ImportError:  # a torch without the helper has no CPU kernel; CUDA's is older than the helper
        devices = ["cuda"]
    return t.device.type in devices and t.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def adam_step_state(step: float, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Adam's ``step`` entry for ``param`` as ``optimizer`` keeps it (fused: fp32 on the parameter's device)."""
    fused = bool(optimizer.defaults.get("fused"))
    return torch.tensor(float(step), dtype=torch.float32, device=param.device if fused else "cpu")


def adam_problems(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> list[tuple[str, str]]:
    """Adam's options as ``(field, reason)`` problems: finite, ``lr > 0``, ``0 <= beta < 1``, ``eps > 0``,
    ``weight_decay >= 0`` (checked by the launcher before any worker starts, and by :class:`AdamConfig`)."""
    def bad(value: Any) -> bool:
        return isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)

    out = []
    for name, v, strict in (("lr", lr, True), ("eps", eps, True), ("weight_decay", weight_decay, False)):
        if bad(v) or (v <= 0 if strict else v < 0):
            out.append((name, f"must be a finite number {'>' if strict else '>='} 0, not {v!r}"))
    betas = tuple(betas) if isinstance(betas, (tuple, list)) else (betas,)
    if len(betas) != 2 or any(bad(b) or not 0.0 <= b < 1.0 for b in betas):
        out.append(("betas", f"must be two finite numbers in [0, 1), not {betas!r}"))
    return out


def program_comm_plans(program: Any) -> list[Any]:
    """Every ``CommPlan`` of the program (for ``comm_groups``): forward/Pre Reshards, their backward plans,
    gradient reductions and gradient synchronisations — identical on every rank."""
    return (list(program.comm_plans.values()) + list(program.backward_plans.values())
            + list(program.grad_reduce_plans.values()) + list(program.grad_sync_plans.values()))


def sequence_balance(program: Any, pipeline: int) -> int:
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


@dataclass
class _MicroBatch:
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
    def forward(ctx: Any, x: torch.Tensor, plan: Any, groups: Any, rank: int) -> torch.Tensor:  # type: ignore[override]
        ctx.plan, ctx.groups, ctx.rank = plan, groups, rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        g = execute(ctx.plan, grad.contiguous(), ctx.groups, rank=ctx.rank, device=grad.device)
        return g, None, None, None


class _Local:
    """The :class:`~.kernels.KernelContext` of one rank at its micro-batch shape."""

    def __init__(self, ex: "StepExecutor") -> None:
        self.ex = ex

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
        got = ex._peers.get(key)
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
            got = ex._peers[key] = tuple(r for _, r in sorted(same))
        return got


class StepExecutor:
    """Runs training steps of ``program`` on rank ``rank``.

    ``groups``: the process-group lookup (the :class:`~.worker.WorkerState`); every rank must already have called
    ``state.create_groups(comm_groups(program_comm_plans(program)))``.  ``global_batch``/``seq_len``: the step's
    concrete ``B`` and ``S``.  ``recompute``: activation recomputation on this rank's stage (default: whether the
    Program lists the rank).  ``params``: this rank's parameter shards to start from (name -> tensor of its box),
    instead of the model's initialisation from ``seed``; ``optimizer_state``: Adam's state by parameter name
    (:meth:`optimizer_state`'s form).

    ``precision``: ``"fp32"`` or ``"bf16"`` (SPEC §8).  In bf16 each step computes with bf16 copies of the fp32
    master parameters (:attr:`params`): bf16 activations, gradients and messages; the loss in fp32; each use's
    gradient summed over the micro-batches in fp32, synchronised in bf16, applied to the fp32 masters by Adam with
    fp32 state.  ``bucket_bytes`` / ``first_bucket_bytes``: the gradient buckets' caps (:mod:`.buckets`).
    ``trace``: a test hook, ``trace(event, **info)`` with ``event`` one of ``action`` (a schedule action starts),
    ``recv_posted`` (a receive was posted ahead), ``param_ready`` (a gathered parameter was waited for),
    ``grad_final`` and ``bucket_start`` (:class:`~.buckets.GradBuckets`), ``backward_end``.
    ``p2p_groups``: :func:`pipeline_groups` — the stage-boundary messages travel on a group per rank pair and
    direction (what NCCL needs; default: the job's group).
    """

    def __init__(self, program: Any, rank: int, groups: Any, *, seed: int = 0, global_batch: int, seq_len: int,
                 adam: AdamConfig = AdamConfig(), recompute: bool | None = None,
                 device: torch.device | None = None, emulate: Callable[[float], Any] | None = None,
                 params: Mapping[str, torch.Tensor] | None = None,
                 optimizer_state: Mapping[str, Mapping[str, Any]] | None = None, precision: str = "fp32",
                 bucket_bytes: int = BUCKET_BYTES, first_bucket_bytes: int | None = FIRST_BUCKET_BYTES,
                 trace: Callable[..., None] | None = None,
                 p2p_groups: Mapping[tuple[int, int, int], Any] | None = None,
                 probe: Callable[[str], Any] | None = None, max_norm: float | None = None) -> None:
        self.program, self.rank, self.groups = program, rank, groups
        # clipping by global norm: the gradients are scaled by clip_coefficient(norm, max_norm) before Adam, the
        # norm being what ``before_update`` returns (the world's sum of every rank's grad_sq); None: no clipping
        self.max_norm = max_norm
        self.grad_sq = 0.0  # the last step's squared L2 norm of the gradient elements this rank owns
        self.grad_norm: float | None = None  # the last step's global norm (before clipping), when agreed
        self._owned: dict[str, tuple[tuple[slice, ...], ...]] | None = None
        self._owned_parts: list[tuple[torch.Tensor, tuple[slice, ...] | None]] | None = None
        # called with "forward", "backward", "grad_sync", "optimizer" as a step reaches them (fault-injection
        # tests kill the process there)
        self.probe = probe
        # speed emulation (CPU demos): called with the seconds of each compute piece -- a forward kernel, a
        # stage's autograd backward, the optimizer step -- never with time spent waiting for other ranks
        self.emulate = emulate
        self.trace = trace
        self.p2p_groups = p2p_groups
        self.precision, self.dtype = precision, precision_dtype(precision)
        self.device = device or torch.device("cpu")
        self.graph = program.graph
        self.anns = program.annotations
        if self.graph.loss is None:
            raise ExecutorError(f"graph {self.graph.name!r} marks no loss tensor (GraphBuilder.mark_loss); there "
                                "is nothing to train")
        self.loss_name = self.graph.loss
        self.eg = program.executable_graph(rank)
        if self.eg.pipeline is None:
            raise ExecutorError(f"rank {rank} runs no forward operator of this program")
        self.pipeline, self.stage = self.eg.pipeline, self.eg.stage
        self.bindings = {"B": int(global_batch), "S": int(seq_len)}
        program.bind(self.bindings)
        self.loss_normalizer = int(global_batch) * int(seq_len)
        self.recompute = rank in program.recompute if recompute is None else bool(recompute)
        self.nodes = {n.name: n for n in self.graph.nodes}
        if params is None:
            local = init_local_parameters(program, rank, seed)
        else:
            local = check_local_parameters(program, rank, params)
        # the fp32 master weights (what Adam updates, what checkpoints and switches move)
        self.params = {k: v.detach().to(device=self.device, dtype=torch.float32).contiguous().requires_grad_(True)
                       for k, v in local.items()}
        self.optimizer = adam.build(list(self.params.values()))
        if optimizer_state is not None:
            self.load_optimizer_state(optimizer_state)
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
        self._order_index: dict[int, torch.Tensor] = {}  # S -> the balanced order's indices (sequence_balance)
        self._documents: list[tuple[int, ...] | None] = [None] * self.num_micro
        self._packing_problems: list[str] | None = None  # why this graph cannot run packed rows (once)
        self._mb_bindings: dict[tuple[int, int], dict[str, int]] = {}
        self._schedules: dict[int, list[Any]] = {}
        self.trained_targets = 0  # real (non-padding) target tokens this rank's loss read in the last step
        self.grad_reduce = {o.inputs[0] for o in self.eg.backward if o.kind == "GradReduce"}
        self.roles = {o.name: self._role(o) for o in self.eg.forward if o.kind == "Reshard"}
        # Reshards between equal annotations move nothing at any shape: no plan to resolve per micro-batch shape
        self.unchanged = {o.name for o in self.eg.forward
                          if o.kind == "Reshard" and self.anns[o.inputs[0]] == self.anns[o.outputs[0]]}
        self.context = _Local(self)
        self._peers: dict[Any, tuple[int, ...]] = {}  # context-parallel groups by (tensor, dim, shape)
        self._attrs: dict[str, dict[str, Any]] = {}
        self._plans: dict[str, Any] = {}
        self._pending: list[Any] = []
        # the step's sends are waited for while watching for a peer's death (gloo may never fail them)
        self._sends = SendWaiter(getattr(groups, "peer_failed", None), rank=rank)
        self._gathers: dict[str, Pending] = {}             # PRE outputs still in flight (ZeRO-1 gathers)
        self._inflight: list[Pending] = []                  # PRE communication this rank only sends in
        self._posted: dict[tuple[str, int, str], Pending] = {}   # receives posted ahead: (kind, mb, op)
        # Receives are posted ahead only where messages match by (peer, tag) whatever the order of posting (gloo).
        # NCCL serialises a pair's operations on one stream, where an early receive could hold back a send.
        self.post_ahead = dist.is_initialized() and dist.get_backend() == "gloo"
        self.grad_sync = GradBuckets(self._sync_items(), groups, rank=rank, device=self.device, dtype=self.dtype,
                                     bucket_bytes=bucket_bytes, first_bucket_bytes=first_bucket_bytes, trace=trace,
                                     tag_base=POST_TAG, release=program.plan.settings.zero >= 2)
        made = {o.outputs[0] for o in self.eg.pre}
        coalesced = [o for o in self.eg.pre if o.inputs[0] not in made and bucketable(self._pre_plan(o.name))]
        self._coalesced = {o.name: k for k, o in enumerate(coalesced)}
        self.gathers = GatherBuckets([self._pre_plan(o.name) for o in coalesced], [o.outputs[0] for o in coalesced],
                                     groups, rank=rank, device=self.device, dtype=self.dtype, bucket_bytes=bucket_bytes,
                                     first_bucket_bytes=first_bucket_bytes, trace=trace)
        self.step_values: dict[str, torch.Tensor] = {}
        self._leaves: dict[str, torch.Tensor] = {}  # the parameters' leaves, step after step (_parameter_leaves)
        self._pre_kept: dict[str, torch.Tensor] | None = None  # PRE's outputs when they are kept leaves (pre)
        self._drops: list[tuple[str, ...]] | None = None  # per forward operator, what to let go after it
        self._prepared: dict[tuple[Any, ...], list[Any]] = {}  # micro-batch shape -> _forward_prepared
        self.records: dict[int, _MicroBatch] = {}
        self.captured_grads: dict[str, torch.Tensor] | None = None
        self._before_update: Callable[[float], Any] | None = None
        self._step_loss = 0.0
        self.compute_s = 0.0

    def _sync_items(self) -> list[SyncItem]:
        """One item per ``GradSync`` of this rank (Program order), its plan at the wire dtype; ``None`` where
        the plan leaves the rank's sum of the uses' gradients as it is."""
        items = []
        for op in self.eg.post:
            if op.kind != "GradSync":
                continue
            p = op.outputs[0]
            keep = p in self.params and _identity_for(op.comm, self.rank)
            items.append(SyncItem(p, None if keep else with_dtype(op.comm, self.dtype), tuple(op.inputs)))
        return items

    # ---- set-up ---------------------------------------------------------------------------------------------
    def global_shape(self, tensor: str) -> tuple[int, ...]:
        """``tensor``'s global shape at the current micro-batch's bindings."""
        return tuple(int(d) for d in evaluate_shape(self.graph.tensors[tensor].shape, self._cur[0], tensor=tensor))

    def _role(self, op: Any) -> str:
        """``local`` (holds source and destination), ``send`` (only the source) or ``recv`` (only the
        destination) for a forward Reshard on this rank."""
        src, dst = self.anns[op.inputs[0]], self.anns[op.outputs[0]]
        has_src, has_dst = self.rank in src.ranks, self.rank in dst.ranks
        return "local" if has_src and has_dst else "send" if has_src else "recv"

    def _plan(self, name: str, mb: int | None = None) -> Any:
        """The plan of communication ``name`` at micro-batch ``mb``'s shape (default: the current one), for the
        run's dtype (the symbolic plan resolved at the concrete shape once, cached)."""
        bindings, rows = self._cur if mb is None else self._layout[mb]
        key = (name, rows, bindings.get("S"), bindings.get("B"))
        got = self._plans.get(key)
        if got is None:
            got = self._plans[key] = with_dtype(
                self.program.micro_batch_plan(name, self.rank, bindings, rows), self.dtype)
        return got

    def _node_attrs(self, node: Any) -> dict[str, Any]:
        """A node's kernel attributes at the current micro-batch's shape (the loss operator's also at the step's
        normaliser); cached."""
        bindings, rows = self._cur
        key = (node.name, rows, bindings.get("S"), bindings.get("B"),
               self.loss_normalizer if self.loss_name in node.outputs else None)
        got = self._attrs.get(key)
        if got is None:
            got = self._attrs[key] = kernel_for(node.kind, node.name).attrs(node, self.context)
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

    def _schedule_of(self, num_micro: int) -> list[Any]:
        """This stage's actions for ``num_micro`` micro-batches (``Pre``, ``Post`` only for none)."""
        got = self._schedules.get(num_micro)
        if got is None:
            stages = self.program.num_stages(self.pipeline)
            got = self._schedules[num_micro] = [Action("PRE"), Action("POST")] if num_micro == 0 else \
                build_schedule(self.program.schedule_kind, stages, self.stage, num_micro)
        return got

    # ---- the optimizer: learning rate, global norm ------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        """The learning rate of the next update (every parameter group: a schedule's value for the step)."""
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)

    def owned_slices(self) -> dict[str, tuple[tuple[slice, ...], ...]]:
        """Parameter name -> the slices of this rank's shard whose elements it owns (each element of the model
        is owned by exactly one rank: :func:`~hspmd_sdk.core.ownership.owned_boxes`), for sums that must count
        every element once (the gradient's global norm)."""
        if self._owned is None:
            from ...core.ownership import owned_boxes

            self._owned = {}
            for name in self.params:
                shape = tuple(int(d) for d in self.graph.tensors[name].shape)
                boxes = owned_boxes(self.anns[name], shape, self.rank)
                self._owned[name] = tuple(tuple(slice(a, b) for a, b in box) for box in boxes)
        return self._owned

    def owned_grad_sq(self) -> float:
        """The squared L2 norm of the gradient elements this rank owns: the norm of each owned part (a whole
        shard, or a slice of one) in the gradient's dtype as ``clip_grad_norm_`` computes a tensor's, their
        squares summed in fp64.  Summed over the world, the squared global norm of the single-device model."""
        if self._owned_parts is None:  # (parameter, slice or None for its whole shard), worked out once
            self._owned_parts = [(self.params[name], None if _whole(sl, self.params[name]) else sl)
                                 for name, slices in self.owned_slices().items() for sl in slices]
        parts = [g if sl is None else g[sl] for p, sl in self._owned_parts if (g := p.grad) is not None]
        if not parts:
            return 0.0
        norms = torch._foreach_norm(parts)  # one kernel launch for all of them
        return float(torch.stack(norms).to(torch.float64).pow(2).sum())

    def _clip(self, norm: float | None) -> None:
        """Scale every gradient by :func:`clip_coefficient` of the global ``norm`` (with ``max_norm`` set); a
        coefficient of exactly 1 (a norm within ``max_norm``) leaves them as they are, as a product by 1 would."""
        self.grad_norm = norm
        if self.max_norm is None or norm is None:
            return
        coefficient = clip_coefficient(norm, self.max_norm)
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        if grads and float(coefficient) < 1.0:
            torch._foreach_mul_(grads, coefficient.to(grads[0].device))

    # ---- training state by name ----------------------------------------------------------------------------
    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Adam's state of this rank's shards by parameter name: ``{"exp_avg", "exp_avg_sq"}`` (tensors of the
        parameter's box) and ``"step"`` (a float) — empty dicts before the first step."""
        out: dict[str, dict[str, Any]] = {}
        for name, p in self.params.items():
            st = self.optimizer.state.get(p, {})
            out[name] = {k: (float(v) if k == "step" else v) for k, v in st.items()}
        return out

    def load_optimizer_state(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Set Adam's state from :meth:`optimizer_state`'s form (every local parameter, shards of its box)."""
        missing = sorted(set(self.params) - set(state))
        if missing:
            raise ExecutorError(f"rank {self.rank}: optimizer state lacks parameter(s) {missing[:5]}")
        for name, p in self.params.items():
            st = state[name]
            if not st:
                continue
            new: dict[str, Any] = {"step": adam_step_state(st["step"], p, self.optimizer)}
            for k in ("exp_avg", "exp_avg_sq"):
                t = st[k]
                if tuple(t.shape) != tuple(p.shape):
                    raise ExecutorError(f"rank {self.rank}: optimizer state {name}.{k} has shape {tuple(t.shape)}, "
                                        f"the parameter's shard {tuple(p.shape)}")
                new[k] = t.detach().to(device=p.device, dtype=torch.float32).clone(
                    memory_format=torch.contiguous_format)  # the fused kernel ignores strides
            self.optimizer.state[p] = new

    # ---- one step ---------------------------------------------------------------------------------------------
    @property
    def needs_data(self) -> bool:
        """Whether this rank reads the batch (its executable graph has a placeholder: first or last stage)."""
        return any(self.graph.producer(n).kind == "placeholder" for n in self.eg.leaves)

    def step(self, batch: Any, *, capture_grads: bool = False,
             before_update: Callable[[float], Any] | None = None,
             micro_batches: Any = None, loss_normalizer: int | None = None,
             batch_rows: tuple[int, int] | None = None) -> float:
        """Run one training step on the global batch — token sequences ``[B, S+1]`` that the model's ``feeds``
        turns into the graph's placeholders, or a mapping placeholder -> full tensor (every rank that
        :attr:`needs_data` passes the same; others may pass ``None``); returns this rank's summand of the global
        loss (see :meth:`loss_contributor`).

        ``before_update(loss summand)`` runs after the gradient synchronisation and before Adam changes anything:
        the commit point of the step (the training loop agrees there, with every rank, that the step is whole;
        if it raises, no parameter or optimizer state has changed).  It returns the gradient's global norm (the
        square root of the world's sum of :attr:`grad_sq`) or ``None``; with ``max_norm`` the gradients are then
        clipped by it (:meth:`_clip`).

        Overlap (results unchanged): receives are posted ahead (gloo; see the module docstring), ZeRO-1 gathers
        are waited for where the forward first reads them, and gradient buckets start during the last backward
        (:mod:`.buckets`).

        Mixed-length data (SPEC §7): ``micro_batches`` — this pipeline's micro-batches of the step, in order, each
        ``(rows, seq_len, feeds)`` or ``(1, seq_len, feeds, documents)`` with ``feeds`` a mapping placeholder ->
        the micro-batch's full tensor (``None`` on ranks that do not :attr:`needs_data`) — replaces ``batch`` and
        the plan's micro-batching for this step: each micro-batch runs at its own shape (the symbolic plans
        resolved there once, cached; nothing is re-specialized), a stage may run none (``Pre`` and ``Post``
        only).  ``documents``: the micro-batch is one row packing documents of these lengths (summing to
        ``seq_len``); the kernels keep them apart (:mod:`.kernels`, packing).  ``loss_normalizer``: the step's
        real target tokens over every pipeline (padding targets are ``-100``), so the summed loss is the mean
        over the step's real targets.

        ``batch_rows=(a, b)``: ``batch`` holds only rows ``a..b-1`` of the global batch — this pipeline's share
        (:attr:`chunk`), all that a rank needs to read."""
        actions = self._prepare(batch, batch_rows, micro_batches, loss_normalizer)
        self.trained_targets = 0
        self.records.clear()
        self._posted.clear()  # nothing of an interrupted step is left in flight for this one
        self._pending.clear()
        self._before_update = before_update
        self.compute_s = 0.0  # this step's compute seconds (kernels, backward, Adam; never waiting for peers)
        return self._interpret(actions, self._TRAIN, capture_grads=capture_grads)

    def _prepare(self, batch: Any, batch_rows: tuple[int, int] | None, micro_batches: Any,
                 loss_normalizer: int | None) -> list[Any]:
        """Set up a pass over one batch (the feeds, each micro-batch's shape; see :meth:`step`); returns the
        stage's schedule actions for it."""
        if micro_batches is not None:
            micro_batches = [self._sequence_padded(m) for m in micro_batches]
            self._layout = [(self.micro_bindings(int(m[0]), int(m[1])), int(m[0])) for m in micro_batches]
            self._documents = [self._packed(i, m) for i, m in enumerate(micro_batches)]
            self.loss_normalizer = int(loss_normalizer) if loss_normalizer is not None else None
            self._feeds = self._micro_feeds([m[2] for m in micro_batches])
            return self._schedule_of(len(self._layout))
        self._documents = [None] * self.num_micro
        self._layout = [(self.bindings, self.micro_size)] * self.num_micro
        self._feeds = self._local_feeds(self._full_feeds(batch), batch_rows)
        return self.program.schedule(self.rank)

    #: The schedule actions a forward-only pass keeps (validation).
    FORWARD_ACTIONS = frozenset({"PRE", "RECV_F", "F", "SEND_F"})

    def evaluate(self, batch: Any = None, batch_rows: tuple[int, int] | None = None, *,
                 micro_batches: Any = None, loss_normalizer: int | None = None) -> float:
        """The forward pass of one batch under the running plan, without gradients, synchronisation or an update
        (validation): the stage's schedule with its backward actions left out (sends stay asynchronous, receives
        blocking: the forward part of a deadlock-free schedule is deadlock-free).  ``batch``, ``batch_rows``,
        ``micro_batches`` and ``loss_normalizer`` as for :meth:`step`.  Returns this rank's summand of the batch's
        mean loss (0 off the loss contributors); the sum over the world is the loss of the batch, as :meth:`step`
        reports it."""
        actions = [a for a in self._prepare(batch, batch_rows, micro_batches, loss_normalizer)
                   if a.kind in self.FORWARD_ACTIONS]
        trained = self.trained_targets  # the training step's count stays what it was
        self.records.clear()
        self._posted.clear()
        self._pending.clear()
        with torch.no_grad():
            loss = self._interpret(actions, self._EVAL, span_prefix="eval ")
            self._resolve_all()
            self._wait_sends()
        self.records.clear()
        self.step_values = {}
        self.trained_targets = trained
        return loss if self.loss_contributor() else 0.0

    def _interpret(self, actions: Sequence[Any], handlers: Mapping[str, Callable[..., None]], *,
                   capture_grads: bool = False, span_prefix: str = "") -> float:
        """Run ``actions`` (a stage's schedule) in order, each by its kind's handler in ``handlers`` (:attr:`_TRAIN`
        for a training step, :attr:`_EVAL` for a forward-only pass); the receives of the next actions are posted
        ahead where the backend allows.  Returns the pass's loss summand (:attr:`_step_loss`)."""
        last_b = max((i for i, a in enumerate(actions) if a.kind == "B"), default=-1)
        ahead = _next_receives(actions) if self.post_ahead else None
        self._step_loss = 0.0
        for i, action in enumerate(actions):
            kind, mb = action.kind, action.micro_batch
            handler = handlers.get(kind)
            if handler is None:  # the schedule IR has exactly the kinds of the tables
                raise ExecutorError(f"rank {self.rank}: schedule action {action} has no handler in this pass")
            if not span_prefix:
                self._event("action", kind=kind, mb=mb)
            if ahead is not None:
                for j in ahead[i]:
                    self._post_receives(actions[j].kind, actions[j].micro_batch)
            with span(span_prefix + (kind if mb is None else f"{kind} mb{mb}")):  # the profiler's name (.trace)
                handler(self, mb, i == last_b, capture_grads)
        return self._step_loss

    def _backward_summed(self, mb: int, last: bool) -> None:
        self._step_loss += self.backward(mb, last=last)

    def _forward_summed(self, mb: int) -> None:
        self.forward(mb)
        self._step_loss += self.records[mb].loss_value

    #: What each schedule action does in a training step: ``handler(executor, micro_batch, is_last_B, capture)``.
    _TRAIN: Mapping[str, Callable[..., None]] = {
        "PRE": lambda ex, mb, last, cap: ex.pre(),
        "RECV_F": lambda ex, mb, last, cap: ex.recv_forward(mb),
        "F": lambda ex, mb, last, cap: ex.forward(mb),
        "SEND_F": lambda ex, mb, last, cap: ex.send_forward(mb),
        "RECV_B": lambda ex, mb, last, cap: ex.recv_backward(mb),
        "B": lambda ex, mb, last, cap: ex._backward_summed(mb, last),
        "SEND_B": lambda ex, mb, last, cap: ex.send_backward(mb),
        "POST": lambda ex, mb, last, cap: ex.post(capture_grads=cap),
    }
    #: A forward-only pass (validation): the forward actions, each forward's loss summed.
    _EVAL: Mapping[str, Callable[..., None]] = {
        "PRE": _TRAIN["PRE"], "RECV_F": _TRAIN["RECV_F"], "SEND_F": _TRAIN["SEND_F"],
        "F": lambda ex, mb, last, cap: ex._forward_summed(mb),
    }

    @property
    def sequence_multiple(self) -> int:
        """What every micro-batch's sequence length must be a multiple of: the least common multiple of the
        degrees by which the program splits a sequence dim (``S``) of any tensor (context parallelism), else 1."""
        got = getattr(self, "_seq_multiple", None)
        if got is None:
            got = 1
            for name, ann in self.anns.items():
                shape = self.graph.tensors[name].shape if name in self.graph.tensors else ()
                dims = [d for d, x in enumerate(shape) if isinstance(x, Sym) and x.factors == ("S",) and x.coef == 1]
                for ds in ann.ds_union:
                    for d in dims:
                        got = math.lcm(got, int(ds.states.get(d, 1)))
            self._seq_multiple = got
        return got

    @property
    def sequence_balance(self) -> int:
        """``N > 1`` when this pipeline lays its micro-batches' sequences out in the balanced order of CP degree
        ``N`` (:func:`~.cp_attention.balanced_order`): every attention of the pipeline splits the sequence (its
        query's dim 1) over ``N`` ranks, and every op of the graph takes positions from the order
        (:func:`~.kernels.reorder_problems` is empty).  Rank ``i`` of a CP group then holds global chunks ``i``
        and ``2N-1-i`` and every rank does the same causal work.  Else 1: the contiguous split (exact too, the last
        chunk's rank doing most of the causal work).  The same on every rank of the pipeline (a function of the
        Program).  ``HSPMD_CP_LAYOUT=contiguous`` in the workers' environment keeps the contiguous split (for
        measurements)."""
        got = getattr(self, "_seq_balance", None)
        if got is None:
            got = self._seq_balance = sequence_balance(self.program, self.pipeline)
        return got

    def _reordered(self, name: str, t: torch.Tensor) -> torch.Tensor:
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

    def _sequence_padded(self, micro: Sequence[Any]) -> Sequence[Any]:
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
            loss = self.graph.producer(self.loss_name)
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

    def _packed(self, mb: int, micro: Sequence[Any]) -> tuple[int, ...] | None:
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

    def _event(self, event: str, **info: Any) -> None:
        if self.trace is not None:
            self.trace(event, **info)

    def _full_feeds(self, batch: Any) -> Mapping[str, torch.Tensor]:
        if batch is None:
            return {}
        if isinstance(batch, Mapping):
            return batch
        model = self.program.model
        if model is None:
            raise ExecutorError(f"rank {self.rank}: the program has no model to turn a batch into feeds; pass a "
                                "mapping placeholder -> tensor")
        return model.feeds(batch)

    def _local_feeds(self, full: Mapping[str, torch.Tensor],
                     rows: tuple[int, int] | None = None) -> dict[str, list[torch.Tensor]]:
        """Each placeholder leaf of this rank, cut to its box and split into the pipeline's micro-batches
        (floating-point feeds in the run's dtype).  ``rows=(a, b)``: ``full`` holds only rows ``a..b-1`` of the
        global batch (this pipeline's share, :attr:`chunk`: all a rank reads), not all of it."""
        out: dict[str, list[torch.Tensor]] = {}
        for name in self.eg.leaves:
            if self.graph.producer(name).kind != "placeholder":
                continue
            if name not in full:
                raise ExecutorError(f"rank {self.rank}: the step has no {name!r} but this rank's graph reads it")
            t = self._reordered(name, full[name])
            d = batch_dim(self.graph.tensors[name].shape)
            shape = list(t.shape)
            if rows is not None and d is not None:
                shape[d] = self.bindings["B"]
            slices = list(local_view(self.anns[name], tuple(shape), self.rank).slices)
            if rows is not None and d is not None:
                start, stop = slices[d].start - rows[0], slices[d].stop - rows[0]
                if start < 0 or stop > t.shape[d]:
                    raise ExecutorError(f"rank {self.rank}: {name!r} needs rows {slices[d].start}..{slices[d].stop - 1} "
                                        f"of the batch, the step read rows {rows[0]}..{rows[1] - 1}")
                slices[d] = slice(start, stop)
            local = t[tuple(slices)].to(self.device)
            if local.is_floating_point():
                local = local.to(self.dtype)
            out[name] = list(torch.split(local, self.micro_size, dim=d)) if d is not None else [local] * self.num_micro
        return out

    def _micro_feeds(self, feeds: Any) -> dict[str, list[torch.Tensor]]:
        """Each placeholder leaf of this rank, per micro-batch: the micro-batch's full tensor cut to this rank's
        box at that micro-batch's shape (its batch rows are the micro-batch's rows)."""
        out: dict[str, list[torch.Tensor]] = {}
        names = [n for n in self.eg.leaves if self.graph.producer(n).kind == "placeholder"]
        if not names:
            return out
        for mb, full in enumerate(feeds):
            bindings, rows = self._layout[mb]
            for name in names:
                if full is None or name not in full:
                    raise ExecutorError(f"rank {self.rank}: micro-batch {mb} has no {name!r} but this rank's "
                                        "graph reads it")
                t = full[name]
                shape = evaluate_shape(self.graph.tensors[name].shape, bindings, tensor=name)
                d = batch_dim(self.graph.tensors[name].shape)
                if d is not None:
                    shape = shape[:d] + (rows,) + shape[d + 1:]
                if tuple(t.shape) != tuple(int(x) for x in shape):
                    raise ExecutorError(f"rank {self.rank}: micro-batch {mb}'s {name!r} has shape "
                                        f"{tuple(t.shape)}, not {tuple(shape)}")
                t = self._reordered(name, t)
                view = local_view(self.anns[name], tuple(int(x) for x in evaluate_shape(
                    self.graph.tensors[name].shape, bindings, tensor=name)), self.rank)
                slices = list(view.slices)
                if d is not None:
                    slices[d] = slice(0, rows)
                local = t[tuple(slices)].to(self.device)
                if local.is_floating_point():
                    local = local.to(self.dtype)
                out.setdefault(name, []).append(local)
        return out

    def pre(self) -> None:
        """``Pre``: parameter leaves (working copies of the master weights in the run's dtype), and the Reshards of
        parameters (ZeRO-1 SplitAllGather, a tied weight's move to its other stage).  Their outputs are fresh
        leaves whose gradients the gradient synchronisation collects.  Top-tier gathers are only started here, in
        buckets (:class:`~.buckets.GatherBuckets`): the forward waits for each where it first reads it."""
        vals = self.step_values = self._parameter_leaves()
        self._gathers, self._inflight = {}, []
        if self._pre_kept is not None:  # every PRE op leaves a kept leaf: the same leaves and watches every step
            vals.update(self._pre_kept)
            self.grad_sync.rewatch()
            return
        with torch.no_grad():  # the parameters' gathers, coalesced in buckets, all posted first (every rank alike)
            started = self.gathers.start([vals[o.inputs[0]].detach() if o.inputs[0] in vals else None
                                          for o in self.eg.pre if o.name in self._coalesced])
        for op in self.eg.pre:
            src, dst = op.inputs[0], op.outputs[0]
            plan = self._pre_plan(op.name)
            if src in self._gathers:
                self._resolve(src)
            if _identity_for(plan, self.rank):
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
        self.grad_sync.begin(set(vals) | set(self._gathers))
        for name, t in vals.items():
            self.grad_sync.watch(name, t, keep=name in self._leaves)
        if not self._gathers and not self._inflight and all(name in self._leaves for name in vals):
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

    def _pre_plan(self, name: str) -> Any:
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
        return vals[name] if got is None else got

    def _record(self, mb: int) -> _MicroBatch:
        rec = self.records.get(mb)
        if rec is None:
            rec = self.records[mb] = _MicroBatch()
        return rec

    def recv_forward(self, mb: int) -> None:
        """``RECV_F``: this stage's inputs of micro-batch ``mb`` from the previous stage (blocking)."""
        rec = self._record(mb)
        for op in self.eg.forward:
            if op.kind == "Reshard" and self.roles[op.name] == "recv":
                rec.received[op.name] = self._receive(self._plan(op.name, mb), mb, 0, ("RECV_F", mb, op.name))

    def forward(self, mb: int) -> None:
        """``F`` of micro-batch ``mb``."""
        if self.probe is not None:
            self.probe("forward")
        self._cur, self._cur_documents = self._layout[mb], self._documents[mb]
        rec = self._record(mb)
        if self.recompute:  # the checkpointed body reads its inputs up front
            self._resolve_all()
        vals = dict(self.step_values)
        for name, parts in self._feeds.items():
            vals[name] = parts[mb]
        if self.recompute:
            self._forward_recompute(mb, vals, rec)
        else:
            self._run_whole_forward(mb, vals, rec)
        if self.loss_name in vals and self.rank in self.anns[self.loss_name].ranks:
            rec.loss = vals[self.loss_name]
            rec.loss_value = float(rec.loss.detach())
            if self.loss_contributor():
                self.trained_targets += self._real_targets(mb)

    def send_forward(self, mb: int) -> None:
        """``SEND_F``: post this stage's outputs of micro-batch ``mb`` to the next stage (asynchronous)."""
        for name, t in self.records[mb].outputs:
            self._send(self._plan(name, mb), t, mb, 0)

    def _run_forward(self, mb: int, vals: dict[str, torch.Tensor], rec: _MicroBatch, ops: Any) -> None:
        """Run ``ops`` (some of the stage's forward operators, in order) on ``vals``, each timed on its own."""
        for op in ops:
            if op.kind == "Reshard":
                self._forward_reshard(op, mb, vals, rec)
            else:
                self._compute(op, vals)

    def _run_whole_forward(self, mb: int, vals: dict[str, torch.Tensor], rec: _MicroBatch) -> None:
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
                for name in drop:
                    vals.pop(name, None)
            return
        prepared = self._forward_prepared()
        documents = self._cur_documents
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
            for name in drop:
                vals.pop(name, None)
        self.compute_s += max(0.0, clock() - t0 - (comm_seconds() - c0))

    def _forward_prepared(self) -> list[tuple[Any, Any, dict[str, Any] | None, bool]]:
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

    def _forward_recompute(self, mb: int, vals: dict[str, torch.Tensor], rec: _MicroBatch) -> None:
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

        def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            local = dict(zip(names, tensors))
            self._run_forward(mb, local, rec, body)
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

    def _compute(self, op: Any, vals: dict[str, torch.Tensor]) -> None:
        node = self.nodes[op.name]
        kernel = kernel_for(node.kind, node.name)
        out = self._timed(kernel.fn, *[self._get(vals, t) for t in node.inputs], **self._node_attrs(node),
                          **kernel.packed_attrs(self.context))
        outs = out if isinstance(out, tuple) else (out,)
        for name, v in zip(node.outputs, outs):
            vals[name] = self._reduced(name, v)

    def _reduced(self, name: str, v: torch.Tensor) -> torch.Tensor:
        """Tensor ``name`` (a compute op's or a Reshard's output), wrapped so that its accumulated gradient runs
        ``<name>.grad_reduce`` when it has one (Megatron's *f*)."""
        if name not in self.grad_reduce:
            return v
        return _GradReduce.apply(v, self._plan(f"{name}.grad_reduce"), self.groups, self.rank)

    def _forward_reshard(self, op: Any, mb: int, vals: dict[str, torch.Tensor], rec: _MicroBatch) -> None:
        src, dst = op.inputs[0], op.outputs[0]
        role = self.roles[op.name]
        if role == "local" and op.name in self.unchanged:
            vals[dst] = self._get(vals, src)
        elif role == "local":
            plan, back = self._plan(op.name, mb), self._plan(f"{op.name}.bwd", mb)
            x = self._get(vals, src)
            if _identity_for(plan, self.rank) and _identity_for(back, self.rank):
                vals[dst] = x
            else:
                # the same message tags as a peer's _send/_receive of this plan (it may be on another stage)
                vals[dst] = reshard(x, plan, back, self.groups, rank=self.rank, device=self.device,
                                    tag_base=_tag(mb, 0), backward_tag_base=_tag(mb, 1))
        elif role == "send":
            rec.outputs.append((op.name, self._get(vals, src)))
        else:
            x = rec.received.pop(op.name).requires_grad_(True)
            vals[dst] = x
            rec.inputs.append((op.name, x))
        if dst in vals:
            vals[dst] = self._reduced(dst, vals[dst])

    def recv_backward(self, mb: int) -> None:
        """``RECV_B``: the gradients of this stage's outputs of micro-batch ``mb`` from the next stage."""
        rec = self.records[mb]
        rec.out_grads = [self._receive(self._plan(f"{name}.bwd", mb), mb, 1, ("RECV_B", mb, name))
                         for name, _ in rec.outputs]

    def backward(self, mb: int, *, last: bool = False) -> float:
        """``B`` of micro-batch ``mb``; returns the micro-batch's loss summand (0 off the last stage).  ``last``:
        the step's last backward — the gradients it accumulates are final, their buckets start during it."""
        if self.probe is not None:
            self.probe("backward")
        self._cur, self._cur_documents = self._layout[mb], self._documents[mb]  # a recomputed forward: its shape
        rec = self.records[mb]
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if rec.loss is not None:
            roots.append(rec.loss)
            grads.append(torch.ones_like(rec.loss))
        for (_, t), g in zip(rec.outputs, rec.out_grads):
            roots.append(t)
            grads.append(g)
        self.grad_sync.last_backward(last)
        if roots:
            self._timed(torch.autograd.backward, roots, grads)
        self._event("backward_end", mb=mb)
        if last:
            self._resolve_all()  # a gather that no operator read gets no gradient; finish it all the same
            self.grad_sync.backward_done()
        # keep only what SEND_B needs: the activations and gradients of this micro-batch can go
        self.records[mb] = _MicroBatch(loss_value=rec.loss_value, inputs=rec.inputs)
        return rec.loss_value

    def send_backward(self, mb: int) -> None:
        """``SEND_B``: post the gradients of this stage's inputs of micro-batch ``mb`` to the previous stage."""
        rec = self.records.pop(mb)
        for name, t in rec.inputs:
            g = t.grad if t.grad is not None else torch.zeros_like(t)
            self._send(self._plan(f"{name}.bwd", mb), g, mb, 1)

    def post(self, *, capture_grads: bool = False) -> None:
        """``Post``: gradient synchronisation per the plan (each parameter's uses summed; buckets posted during
        the last backward are waited for here), then Adam on the fp32 master shards."""
        if self.probe is not None:
            self.probe("grad_sync")
        with span("sync"):
            self._resolve_all()
            synced = self.grad_sync.finish()
        for p, master in self.params.items():  # the synced sum is the gradient (zeros if no use got one)
            g = synced.get(p)
            master.grad = g.contiguous() if g is not None else torch.zeros_like(master)  # fused Adam: dense
        if capture_grads:
            self.captured_grads = {k: v.grad.detach().clone() for k, v in self.params.items()}
        self._wait_sends()  # every message of the step is out before the step commits
        self.grad_sq = self.owned_grad_sq()
        if self._before_update is not None:  # the commit: it agrees the global norm over the world
            self._clip(self._before_update(self._step_loss if self.loss_contributor() else 0.0))
        if self.probe is not None:
            self.probe("optimizer")
        with span("optim"):
            if any(o.kind == "OptimizerStep" for o in self.eg.post):
                self._timed(self.optimizer.step)
            self.optimizer.zero_grad(set_to_none=True)
        for t in self._leaves.values():
            t.grad = None
        self.step_values = {}

    # ---- stage-boundary transfers -------------------------------------------------------------------------------
    def _p2p_group(self, direction: int) -> Callable[[int, int], Any] | None:
        """Where a stage-boundary message of ``direction`` (0: activations, 1: gradients) travels: its pair's
        group of that direction (NCCL), or the job's group (``None``)."""
        if self.p2p_groups is None:
            return None
        groups = self.p2p_groups
        return lambda src, dst: groups.get((direction, min(src, dst), max(src, dst)))

    def _send(self, plan: Any, local: torch.Tensor, mb: int, direction: int) -> None:
        """Post this rank's messages of a stage-crossing plan asynchronously (other operators run in place)."""
        cur: torch.Tensor | None = local.detach()
        tag, group = _tag(mb, direction), self._p2p_group(direction)
        for i, op in enumerate(plan.ops):
            if isinstance(op, PointToPointOp):
                self._pending.extend(post_sends(op, cur, self.rank, dict(op.in_boxes).get(self.rank), tag, group))
            else:
                cur = execute_op(plan, i, cur, self.groups, rank=self.rank, device=self.device)

    def _post_receives(self, kind: str, mb: int) -> None:
        """Post the receives of action ``kind`` (``RECV_F`` / ``RECV_B``) of micro-batch ``mb`` ahead of it, for
        each of its plans that starts with its point-to-point operator."""
        names = [n for n, r in self.roles.items() if r == ("recv" if kind == "RECV_F" else "send")]
        for name in names:
            plan = self._plan(name if kind == "RECV_F" else f"{name}.bwd", mb)
            key = (kind, mb, name)
            if key in self._posted or not plan.ops or not isinstance(plan.ops[0], PointToPointOp):
                continue
            d = 0 if kind == "RECV_F" else 1
            self._posted[key] = post_receives(plan.ops[0], self.rank, self.dtype, self.device, _tag(mb, d),
                                              self._p2p_group(d))
            self._event("recv_posted", kind=kind, mb=mb, name=name)

    def _receive(self, plan: Any, mb: int, direction: int, key: tuple[str, int, str] | None = None
                 ) -> torch.Tensor:
        """Receive this rank's part of a stage-crossing plan (blocking; its first operator's receives may have
        been posted ahead under ``key``); returns its destination tensor."""
        cur: torch.Tensor | None = None
        tag, group = _tag(mb, direction), self._p2p_group(direction)
        for i, op in enumerate(plan.ops):
            if isinstance(op, PointToPointOp):
                ahead = self._posted.pop(key, None) if i == 0 and key is not None else None
                got = (ahead or post_receives(op, self.rank, self.dtype, self.device, tag, group)).wait()
                cur = got if got is not None else cur
            else:
                cur = execute_op(plan, i, cur, self.groups, rank=self.rank, device=self.device)
        if cur is None:
            raise ExecutorError(f"rank {self.rank}: plan {plan.src} -> {plan.dst} gives this rank nothing to receive")
        return cur

    def _wait_sends(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self._sends.wait(pending)

    # ---- reporting -----------------------------------------------------------------------------------------------
    def _real_targets(self, mb: int) -> int:
        """Real (non-padding) targets of micro-batch ``mb`` in the placeholders the loss operator reads."""

        node = self.graph.producer(self.loss_name)
        n = 0
        for t in node.inputs:
            if t in self._feeds and self.graph.producer(t).kind == "placeholder":
                n += int((self._feeds[t][mb] != IGNORE_INDEX).sum())
        return n

    def loss_contributor(self, rank: int | None = None) -> bool:
        """Whether this rank's (or ``rank``'s) loss summands count toward the global loss: one rank per Partial
        summand of the loss's annotation (TP replicas of a last stage hold equal copies)."""
        rank = self.rank if rank is None else rank
        ann = self.anns[self.loss_name]
        if rank not in ann.ranks:
            return False
        mine = local_view(ann, (), rank).partial_index
        first = next(r for r in ann.ranks if local_view(ann, (), r).partial_index == mine)
        return first == rank


def _whole(slices: tuple[slice, ...], t: torch.Tensor) -> bool:
    """Whether ``slices`` select all of ``t``."""
    return all(sl.start in (0, None) and sl.stop in (n, None) for sl, n in zip(slices, t.shape))


def pipeline_pairs(program: Any) -> list[tuple[int, int, int]]:
    """``(direction, low rank, high rank)`` of every pair of ranks that exchanges stage-boundary messages — a
    rank holding only the source of a Reshard with one holding only its destination (direction 0: activations,
    the Reshard's plan; 1: gradients, its backward plan) — sorted, the same on every rank: the core's
    :func:`~hspmd_sdk.core.program_part.world_pipeline_pairs`, which a Program part carries.  Messages of ranks
    that hold both ends run inside :func:`~.comm.reshard` on the job's group."""
    pairs = getattr(program, "world_pipeline_pairs", None)  # a part carries them; a whole Program's are worked out
    return sorted(tuple(k) for k in (world_pipeline_pairs(program) if pairs is None else pairs))


def pipeline_groups(program: Any, timeout_s: float = 120.0) -> dict[tuple[int, int, int], Any]:
    """A process group per :func:`pipeline_pairs` entry, created in sorted order (call on every rank of the
    job).  NCCL runs a pair's point-to-point operations in issue order on one stream, and a 1F1B stage issues
    its sends of activations and receives of gradients in another order than its neighbour: on one group per
    direction each stream sees the same order on both sides (micro-batch order)."""
    from datetime import timedelta

    return {key: dist.new_group(list(key[1:]), timeout=timedelta(seconds=timeout_s))
            for key in pipeline_pairs(program)}


def _next_receives(actions: Any) -> list[list[int]]:
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


def _tag(mb: int, direction: int) -> int:
    """Message tag base of micro-batch ``mb`` (``direction`` 0: activations, 1: gradients)."""
    return ((mb % 4096) * 2 + direction) * 1024


#: Tag bases of the point-to-point messages of ``PRE`` (a tied weight's copy) and ``POST`` (its gradient back),
#: past every micro-batch's: a receive posted ahead for micro-batch 0 never matches them.
PRE_TAG, POST_TAG = _tag(4095, 1) + 1024, _tag(4095, 1) + 2048


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
            outb = dict(op.in_boxes), dict(op.out_boxes)
            if rank in outb[1] and outb[0].get(rank) != outb[1][rank]:
                return False
        else:
            return False
    return True
