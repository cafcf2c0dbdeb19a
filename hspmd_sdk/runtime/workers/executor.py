"""The training executor: one rank replays its executable graph step by step (paper §6.3, Appendix A.2).

Per step a rank replays its stage's stored schedule (:meth:`Program.schedule`), action by action: ``PRE`` (the
parameters' Reshards: ZeRO gathering, a tied weight's second placement), then per micro-batch ``RECV_F`` / ``F`` /
``SEND_F`` and ``RECV_B`` / ``B`` / ``SEND_B`` in GPipe or 1F1B order, then ``POST`` (gradient synchronisation,
Adam).  Everything it does comes from the :class:`~hspmd_sdk.core.specialize.Program`: the compute ops of its
executable graph (the kernel registry :data:`~hspmd_sdk.runtime.workers.kernels.KERNELS`, on local shards), the loss
tensor the graph marks, and the ``CommPlan`` of every Reshard, backward Reshard, gradient reduction and gradient
synchronisation at the micro-batch's shape (:meth:`Program.micro_batch_plan`), executed by :mod:`.comm`.  It names
no model, no op kind and no tensor.

Backward is torch autograd over the local ops.  A Reshard that crosses pipeline stages (SendRecv or BSR, also
between stages of different TP degrees) is the schedule's transfer actions: receives block, sends do not (they are
waited for at the end of the step) — the semantics under which :func:`hspmd_sdk.core.schedule.replay` proves the
schedules deadlock-free.  The executor is the coordinator of its parts, each a module of its own:

* :mod:`.interpreter` — the schedule replayed through a table from action kind to handler;
* :mod:`.parameter_leaves` — ``PRE``: the step's parameter leaves, ZeRO-1's gathers started in buckets and waited
  for where the forward first reads them;
* :mod:`.param_gathers` — which of those gathers are coalesced in buckets, and ZeRO-3's units (:mod:`.zero3`);
* :mod:`.micro_shapes` — the micro-batches' shapes (the plan's, or a step's own), their plans and schedules;
* :mod:`.stage_forward` — ``F``: the local operators and in-stage Reshards, recomputation;
* :mod:`.p2p` — the one send/receive path of stage-boundary messages (receives posted ahead under gloo);
* :mod:`.feeds` — the batch cut into this rank's micro-batch feeds (packing, the context-parallel balanced order);
* :mod:`.optimizer` — Adam on the fp32 master shards, its state by parameter name, clipping by the global norm;
* :mod:`.buckets` — ``POST``'s gradient synchronisation, its buckets started from autograd hooks during the last
  ``B``.  None of the overlap changes a result.

Precision (SPEC §8): ``precision="bf16"`` computes with bf16 working copies of the fp32 master parameters (made
in ``PRE``), bf16 activations and gradients, every plan executed for bf16 (:func:`~.comm.with_dtype`); the loss
is fp32; each use's gradient is summed over micro-batches in fp32, synchronised in bf16 and applied in fp32 to the
masters, whose Adam state is fp32.

Loss: the loss op runs with the step's *global* number of target tokens (the kernel registry's
``loss_normalizer``), so each micro-batch's loss is its summand of the global mean and the accumulated gradients
(summed over micro-batches, then across pipelines by the gradient synchronisation) are exactly the single-device
model's.  Each rank holds only its shards — built from the model's initialisation
(:func:`~.params.init_local_parameters`), or handed in (``params=``, ``optimizer_state=``: a switch, a checkpoint,
Hugging Face weights); with ZeRO-1 the parameters are sharded across pipelines (gathered in ``PRE``), the gradient
is reduce-scattered onto the shard, and the optimizer state is per shard.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ...core.annotation import local_view
from .buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, GradBuckets, SyncItem
from .comm import Pending, with_dtype
from .errors import ExecutorError
from .feeds import sequence_balance
from .interpreter import StepInterpreter
from .kernels import IGNORE_INDEX
from .micro_shapes import MicroBatchShapes
from .optimizer import (AdamConfig, clip_gradients, load_state_by_name, owned_grad_sq, owned_parts, owned_slices,
                        state_by_name)
from .optimizer import adam_problems, adam_step_state, fused_adam_available  # noqa: F401 (re-exported)
from .p2p import POST_TAG, StageTransfers, identity_for, next_receives, pipeline_groups, pipeline_pairs
from .param_gathers import ParameterGathers
from .parameter_leaves import ParameterLeaves
from .params import check_local_parameters, init_local_parameters
from .stage_forward import LocalContext, MicroBatchRecord, StageForward
from .zero3 import ZERO3_UNIT_BYTES
from ..trace import span

if TYPE_CHECKING:
    from ...core.comm_plan import CommPlan
    from ...core.specialize import ExecOp, Program
    from .comm import Groups
    from .feeds import MicroBatch

__all__ = ["StepExecutor", "ExecutorError", "program_comm_plans", "AdamConfig", "PRECISIONS", "precision_dtype",
           "pipeline_pairs", "pipeline_groups", "sequence_balance"]
#: Re-exported from the executor's parts for their importers: :mod:`.optimizer` (``adam_problems``,
#: ``adam_step_state``, ``fused_adam_available``) and :mod:`.p2p` (``_next_receives``, the schedule's receives to
#: post ahead).
_next_receives = next_receives

#: ``precision=`` -> the dtype of parameters' working copies, activations, gradients and messages (SPEC §8).  The
#: master weights and Adam's state are fp32 either way.
PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def precision_dtype(precision: str) -> torch.dtype:
    """The compute dtype of ``precision`` (``"fp32"`` or ``"bf16"``); the error names the choices."""
    try:
        return PRECISIONS[precision]
    except (KeyError, TypeError):
        raise ExecutorError(f"precision must be one of {sorted(PRECISIONS)}, not {precision!r}") from None


def program_comm_plans(program: "Program") -> list["CommPlan"]:
    """Every ``CommPlan`` of the program (for ``comm_groups``): forward/Pre Reshards, their backward plans,
    gradient reductions and gradient synchronisations — identical on every rank."""
    return (list(program.comm_plans.values()) + list(program.backward_plans.values())
            + list(program.grad_reduce_plans.values()) + list(program.grad_sync_plans.values()))


class StepExecutor(StepInterpreter, ParameterLeaves, ParameterGathers, StageForward, MicroBatchShapes):
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

    def __init__(self, program: "Program", rank: int, groups: "Groups", *, seed: int = 0, global_batch: int,
                 seq_len: int, adam: AdamConfig = AdamConfig(), recompute: bool | None = None,
                 device: torch.device | None = None, emulate: Callable[[float], Any] | None = None,
                 params: Mapping[str, torch.Tensor] | None = None,
                 optimizer_state: Mapping[str, Mapping[str, Any]] | None = None, precision: str = "fp32",
                 bucket_bytes: int = BUCKET_BYTES, first_bucket_bytes: int | None = FIRST_BUCKET_BYTES,
                 trace: Callable[..., None] | None = None,
                 p2p_groups: Mapping[tuple[int, int, int], dist.ProcessGroup] | None = None,
                 probe: Callable[[str], Any] | None = None, max_norm: float | None = None,
                 zero3_unit_bytes: int = ZERO3_UNIT_BYTES) -> None:
        self.program, self.rank, self.groups = program, rank, groups
        self.zero3_unit_bytes = int(zero3_unit_bytes)
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
        self._init_optimizer(seed, params, adam, optimizer_state)
        self._init_micro_batches()
        self.grad_reduce = {o.inputs[0] for o in self.eg.backward if o.kind == "GradReduce"}
        self.roles = {o.name: self._role(o) for o in self.eg.forward if o.kind == "Reshard"}
        # Reshards between equal annotations move nothing at any shape: no plan to resolve per micro-batch shape
        self.unchanged = {o.name for o in self.eg.forward
                          if o.kind == "Reshard" and self.anns[o.inputs[0]] == self.anns[o.outputs[0]]}
        self.context = LocalContext(self)
        self._attrs: dict[str, dict[str, Any]] = {}
        self._plans: dict[str, Any] = {}
        self._init_communication(bucket_bytes, first_bucket_bytes)
        self.step_values: dict[str, torch.Tensor] = {}
        self._leaves: dict[str, torch.Tensor] = {}  # the parameters' leaves, step after step (_parameter_leaves)
        self._pre_kept: dict[str, torch.Tensor] | None = None  # PRE's outputs when they are kept leaves (pre)
        self._drops: list[tuple[str, ...]] | None = None  # per forward operator, what to let go after it
        self._prepared: dict[tuple[Any, ...], list[Any]] = {}  # micro-batch shape -> _forward_prepared
        self.records: dict[int, MicroBatchRecord] = {}
        self.captured_grads: dict[str, torch.Tensor] | None = None
        self._before_update: Callable[[float], Any] | None = None
        self._step_loss = 0.0
        self.compute_s = 0.0

    def _init_optimizer(self, seed: int, params: Mapping[str, torch.Tensor] | None, adam: AdamConfig,
                        optimizer_state: Mapping[str, Mapping[str, Any]] | None) -> None:
        """The fp32 master shards (from the model's initialisation, or ``params``) and Adam over them."""
        if params is None:
            local = init_local_parameters(self.program, self.rank, seed)
        else:
            local = check_local_parameters(self.program, self.rank, params)
        # the fp32 master weights (what Adam updates, what checkpoints and switches move)
        self.params = {k: v.detach().to(device=self.device, dtype=torch.float32).contiguous().requires_grad_(True)
                       for k, v in local.items()}
        self.optimizer = adam.build(list(self.params.values()))
        if optimizer_state is not None:
            self.load_optimizer_state(optimizer_state)

    def _init_communication(self, bucket_bytes: int, first_bucket_bytes: int | None) -> None:
        """The stage-boundary transfers, the gradient buckets and the parameters' gather buckets."""
        self.transfers = StageTransfers(self.groups, rank=self.rank, device=self.device, dtype=self.dtype,
                                        p2p_groups=self.p2p_groups)
        self._gathers: dict[str, Pending] = {}             # PRE outputs still in flight (ZeRO-1 gathers)
        self._inflight: list[Pending] = []                  # PRE communication this rank only sends in
        # Receives are posted ahead only where messages match by (peer, tag) whatever the order of posting (gloo).
        # NCCL serialises a pair's operations on one stream, where an early receive could hold back a send.
        self.post_ahead = dist.is_initialized() and dist.get_backend() == "gloo"
        self.grad_sync = GradBuckets(self._sync_items(), self.groups, rank=self.rank, device=self.device,
                                     dtype=self.dtype, bucket_bytes=bucket_bytes,
                                     first_bucket_bytes=first_bucket_bytes, trace=self.trace, tag_base=POST_TAG,
                                     release=self.program.plan.settings.zero >= 2)
        self._init_gathers(bucket_bytes, first_bucket_bytes)

    def _sync_items(self) -> list[SyncItem]:
        """One item per ``GradSync`` of this rank (Program order), its plan at the wire dtype; ``None`` where
        the plan leaves the rank's sum of the uses' gradients as it is."""
        items = []
        for op in self.eg.post:
            if op.kind != "GradSync":
                continue
            p = op.outputs[0]
            keep = p in self.params and identity_for(op.comm, self.rank)
            items.append(SyncItem(p, None if keep else with_dtype(op.comm, self.dtype), tuple(op.inputs)))
        return items

    # ---- set-up ---------------------------------------------------------------------------------------------
    def _role(self, op: "ExecOp") -> str:
        """``local`` (holds source and destination), ``send`` (only the source) or ``recv`` (only the
        destination) for a forward Reshard on this rank."""
        src, dst = self.anns[op.inputs[0]], self.anns[op.outputs[0]]
        has_src, has_dst = self.rank in src.ranks, self.rank in dst.ranks
        return "local" if has_src and has_dst else "send" if has_src else "recv"

    # ---- the optimizer: learning rate, global norm ------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        """The learning rate of the next update (every parameter group: a schedule's value for the step)."""
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)

    def owned_slices(self) -> dict[str, tuple[tuple[slice, ...], ...]]:
        """Parameter name -> the slices of this rank's shard whose elements it owns (:func:`.optimizer.owned_slices`:
        each element of the model is owned by exactly one rank), for sums that must count every element once (the
        gradient's global norm)."""
        if self._owned is None:
            self._owned = owned_slices(self.program, self.params, self.rank)
        return self._owned

    def owned_grad_sq(self) -> float:
        """The squared L2 norm of the gradient elements this rank owns (:func:`.optimizer.owned_grad_sq`).  Summed
        over the world, the squared global norm of the single-device model."""
        if self._owned_parts is None:  # (parameter, slice or None for its whole shard), worked out once
            self._owned_parts = owned_parts(self.params, self.owned_slices())
        return owned_grad_sq(self._owned_parts)

    def _clip(self, norm: float | None) -> None:
        """Scale every gradient by :func:`.optimizer.clip_coefficient` of the global ``norm`` (with ``max_norm``
        set; :func:`.optimizer.clip_gradients`)."""
        self.grad_norm = norm
        if self.max_norm is None or norm is None:
            return
        clip_gradients(list(self.params.values()), norm, self.max_norm)

    # ---- training state by name ----------------------------------------------------------------------------
    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Adam's state of this rank's shards by parameter name: ``{"exp_avg", "exp_avg_sq"}`` (tensors of the
        parameter's box) and ``"step"`` (a float) — empty dicts before the first step."""
        return state_by_name(self.params, self.optimizer)

    def load_optimizer_state(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Set Adam's state from :meth:`optimizer_state`'s form (every local parameter, shards of its box)."""
        load_state_by_name(self.params, self.optimizer, state, rank=self.rank)

    # ---- one step ---------------------------------------------------------------------------------------------
    @property
    def needs_data(self) -> bool:
        """Whether this rank reads the batch (its executable graph has a placeholder: first or last stage)."""
        return any(self.graph.producer(n).kind == "placeholder" for n in self.eg.leaves)

    def step(self, batch: torch.Tensor | Mapping[str, torch.Tensor] | None, *, capture_grads: bool = False,
             before_update: Callable[[float], Any] | None = None,
             micro_batches: Sequence[MicroBatch] | None = None, loss_normalizer: int | None = None,
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
        self.transfers.clear()  # nothing of an interrupted step is left in flight for this one
        self._before_update = before_update
        self.compute_s = 0.0  # this step's compute seconds (kernels, backward, Adam; never waiting for peers)
        return self._interpret(actions, self._TRAIN, capture_grads=capture_grads)

    def evaluate(self, batch: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
                 batch_rows: tuple[int, int] | None = None, *, micro_batches: Sequence[MicroBatch] | None = None,
                 loss_normalizer: int | None = None) -> float:
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
        self.transfers.clear()
        with torch.no_grad():
            loss = self._interpret(actions, self._EVAL, span_prefix="eval ")
            self._resolve_all()
            self.transfers.wait_sends()
        self.records.clear()
        self.step_values = {}
        self.trained_targets = trained
        return loss if self.loss_contributor() else 0.0

    def _event(self, event: str, **info: Any) -> None:
        if self.trace is not None:
            self.trace(event, **info)

    def _record(self, mb: int) -> MicroBatchRecord:
        rec = self.records.get(mb)
        if rec is None:
            rec = self.records[mb] = MicroBatchRecord()
        return rec

    def recv_forward(self, mb: int) -> None:
        """``RECV_F``: this stage's inputs of micro-batch ``mb`` from the previous stage (blocking)."""
        rec = self._record(mb)
        for op in self.eg.forward:
            if op.kind == "Reshard" and self.roles[op.name] == "recv":
                rec.received[op.name] = self.transfers.receive(self._plan(op.name, mb), mb, 0,
                                                               ("RECV_F", mb, op.name))

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
        zero3 = self.zero3
        run = self._forward_recompute if self.recompute else self._run_whole_forward
        if zero3 is not None and mb == 0:  # the order its gathers are posted in (phantom passes replay it)
            with zero3.recording("F"):
                run(mb, vals, rec)
        else:
            run(mb, vals, rec)
        if zero3 is not None and mb == len(self._layout) - 1:  # serve the replicas that run more micro-batches
            zero3.phantom("F", self._most_micro - len(self._layout))
        if self.loss_name in vals and self.rank in self.anns[self.loss_name].ranks:
            rec.loss = vals[self.loss_name]
            rec.loss_value = float(rec.loss.detach())
            if self.loss_contributor():
                self.trained_targets += self._real_targets(mb)

    def send_forward(self, mb: int) -> None:
        """``SEND_F``: post this stage's outputs of micro-batch ``mb`` to the next stage (asynchronous)."""
        for name, t in self.records[mb].outputs:
            self.transfers.send(self._plan(name, mb), t, mb, 0)

    def recv_backward(self, mb: int) -> None:
        """``RECV_B``: the gradients of this stage's outputs of micro-batch ``mb`` from the next stage."""
        rec = self.records[mb]
        rec.out_grads = [self.transfers.receive(self._plan(f"{name}.bwd", mb), mb, 1, ("RECV_B", mb, name))
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
        zero3 = self.zero3
        # ZeRO-3 with pipelines of unequal micro-batch counts: the gradient buckets wait until every rank has
        # served the others' gathers (a bucket waited for inside a backward would hold up a peer's gather)
        self.grad_sync.last_backward(last and not self._zero3_uneven)
        if roots and zero3 is not None and mb == 0:
            with zero3.recording("B"):
                self._timed(torch.autograd.backward, roots, grads)
        elif roots:
            self._timed(torch.autograd.backward, roots, grads)
        self._event("backward_end", mb=mb)
        if last:
            self._resolve_all()  # a gather that no operator read gets no gradient; finish it all the same
            if zero3 is not None:  # serve the replicas that run more micro-batches
                zero3.phantom("B", self._most_micro - len(self._layout))
            self.grad_sync.backward_done()
        # keep only what SEND_B needs: the activations and gradients of this micro-batch can go
        self.records[mb] = MicroBatchRecord(loss_value=rec.loss_value, inputs=rec.inputs)
        return rec.loss_value

    def send_backward(self, mb: int) -> None:
        """``SEND_B``: post the gradients of this stage's inputs of micro-batch ``mb`` to the previous stage."""
        rec = self.records.pop(mb)
        for name, t in rec.inputs:
            g = t.grad if t.grad is not None else torch.zeros_like(t)
            self.transfers.send(self._plan(f"{name}.bwd", mb), g, mb, 1)

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
        self.transfers.wait_sends()  # every message of the step is out before the step commits
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
