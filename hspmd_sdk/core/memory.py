"""Memory per device for a plan: the one estimate that every display shows (``hspmd show`` and
:meth:`Strategy.summary`, the plan editor through the simulator, the job dashboard beside what the job measures).

:func:`device_memory` gives, for each rank of a :class:`~hspmd_sdk.core.strategy.Strategy`, a :class:`DeviceMemory`:

* **model states**, the paper's mixed precision: bf16 parameters and gradients (2 + 2 bytes a parameter) and the
  fp32 optimizer part (master weights, Adam m and v: 12 bytes).  A stage holds its layers, plus the embedding on its
  pipeline's first stage and the final norm and LM head on its last; each rank holds ``1 / TP degree`` of them (an
  uneven stage, ``ratios``: its own share, :meth:`Stage.share`).  With ZeRO-1 a unit's 12 optimizer bytes are
  divided by the number of stages (over all pipelines) that hold it (uneven ``Pipeline.zero_share``: in proportion to
  the shares), and with ZeRO-2 (``Strategy.zero >= 2``) its 2 gradient bytes too (each rank keeps its shard of the
  reduce-scattered gradient); with ZeRO-3 its 2 parameter bytes too, plus what is gathered at once
  (:func:`zero3_gathered`: the unit being read and the next one prefetched, :mod:`~hspmd_sdk.runtime.workers.
  zero3`);
* **activations**: what a layer keeps for its backward (:meth:`ModelSpec.layer_activation_bytes`, divided by the
  TP degree with sequence parallelism) for the micro-batches in flight at the stage's peak
  (:func:`~hspmd_sdk.core.schedule.in_flight`), the head's input on a last stage, plus the largest transient
  buffer: the fp32 logits and their gradient on a last stage, one layer's full activations when the stage
  recomputes (it then keeps only each layer's input);
* **the runtime**: what the device holds besides the plan's tensors, by the kind of device (:func:`runtime_bytes`):
  on a GPU the CUDA context and the caching allocator's slack (:data:`CUDA_CONTEXT_RESERVE_MB`); on a local CPU
  worker process (device kind ``"cpu"``) no CUDA context, but the process itself: the interpreter, torch, the SDK's
  worker side and gloo (:data:`CPU_PROCESS_BASELINE_MB`, measured).

What a running job measures (``StepMetrics.memory_mb``) differs by device, and so does what it compares with
(:meth:`DeviceMemory.comparable`): a CPU worker reports its process's peak resident memory, which holds all of the
above (:attr:`DeviceMemory.total`); a GPU worker reports torch's peak allocated bytes, which hold the tensors only
(:attr:`DeviceMemory.tensors`: the CUDA context is not in torch's count).

An estimate, not a measurement.  On a CPU worker the tensors take more than the mixed-precision accounting says
(the worker trains in fp32 with per-micro-batch gradient accumulation buffers, not itemised further here:
measured 1.7-2.6x for a 17M-parameter model on 4 ranks, whose estimate is then 0.70-0.77 of the peak RSS); for a
model as small as the tiny Llama the process baseline is nearly all of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable

from .cluster import LOCAL_KIND
from .plan import ZERO3_UNIT_BYTES
from .schedule import in_flight

if TYPE_CHECKING:  # pragma: no cover
    from .cluster import Cluster
    from .model_spec import ModelSpec
# ``Strategy`` and ``Stage`` (core/strategy.py) are named in annotations only: strategy.py imports this module, and
# an import back, even for type checking, would be an import cycle.

__all__ = ["DeviceMemory", "device_memory", "runtime_bytes", "is_cpu_kind", "layer_activations", "head_activations",
           "CUDA_CONTEXT_RESERVE_MB",
           "CPU_PROCESS_BASELINE_MB", "BF16_BYTES", "FP32_BYTES", "PARAM_GRAD_BYTES", "OPTIMIZER_BYTES"]

#: Device memory a GPU worker holds besides tensors: the CUDA context (kernels, cuBLAS/NCCL workspaces) and the
#: caching allocator's slack.  A planning margin, as Megatron-style planners keep one.
CUDA_CONTEXT_RESERVE_MB = 2048.0
#: Resident memory of a local CPU worker process before the plan's tensors: the interpreter, torch (with
#: ``torch.optim`` and ``torch._dynamo``, which the first optimizer step imports), the SDK's worker side and gloo.
#: Measured for the tiny Llama on 4 local gloo ranks (``hspmd demo``'s plan; torch 2.13 CPU, Python 3.11, Linux
#: x86-64, workers forked from the fork server): 280-289 MiB peak RSS a rank, of which the plan's tensors are
#: 1-4 MiB.  A fresh interpreter with the same imports holds ~306 MiB.
CPU_PROCESS_BASELINE_MB = 280.0

BF16_BYTES = 2
FP32_BYTES = 4
#: bf16 parameter + bf16 gradient, a parameter.
PARAM_GRAD_BYTES = 2 * BF16_BYTES
#: fp32 master weight, Adam m and Adam v, a parameter.
OPTIMIZER_BYTES = 3 * FP32_BYTES


def is_cpu_kind(kind: str) -> bool:
    """Whether a device kind is a CPU worker process (``"cpu"``: :meth:`Cluster.local`, hostfiles and Slurm nodes
    without a GPU) rather than a GPU."""
    return kind == LOCAL_KIND


def runtime_bytes(kind: str, *, gpu_reserve_mb: float = CUDA_CONTEXT_RESERVE_MB,
                  cpu_baseline_mb: float = CPU_PROCESS_BASELINE_MB) -> float:
    """Bytes a device of ``kind`` holds besides the plan's tensors: a CPU worker's process baseline, else a GPU's
    CUDA context reserve; ``0`` for an unknown kind (``""``: no cluster given)."""
    if not kind:
        return 0.0
    return (cpu_baseline_mb if is_cpu_kind(kind) else gpu_reserve_mb) * 2.0**20


@dataclass(frozen=True)
class DeviceMemory:
    """The estimated bytes one rank holds while it trains a plan (see the module docstring).

    ``params``, ``grads``, ``optimizer``, ``activations``: the plan's tensors; ``runtime``: the device's own
    (CUDA context or process baseline, :func:`runtime_bytes`); ``kind``: the device kind it was estimated for
    (``""``: none given, ``runtime`` is 0)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    runtime: float
    kind: str = ""

    @property
    def tensors(self) -> float:
        """The plan's tensors: model states and activations."""
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def total(self) -> float:
        """Tensors plus the runtime: the figure every display shows."""
        return self.tensors + self.runtime

    @property
    def on_cpu(self) -> bool:
        """Estimated for a CPU worker process (no CUDA context)."""
        return is_cpu_kind(self.kind)

    def runtime_text(self) -> str:
        """What the runtime part is, for people: ``process baseline (Python, torch, gloo)``, ``CUDA context``."""
        if not self.kind:
            return "no device given"
        return "process baseline (Python, torch, gloo)" if self.on_cpu else "CUDA context and allocator reserve"

    def comparable(self, *, measured_on_gpu: bool) -> float:
        """The part of the estimate that a job's measured figure holds: a CPU worker's peak RSS holds everything
        (:attr:`total`), a GPU worker's peak CUDA allocated bytes the tensors only (:attr:`tensors`)."""
        return self.tensors if measured_on_gpu else self.total

    def parts(self) -> dict[str, float]:
        """The breakdown as the simulator reports it: ``params``, ``grads``, ``optimizer``, ``activations``,
        ``reserve`` (the runtime)."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "reserve": self.runtime}


def device_memory(strategy: "Strategy", model: "ModelSpec", cluster: "Cluster | None" = None, *,
                  seq_len: int | None = None, device: str | None = None,
                  gpu_reserve_mb: float = CUDA_CONTEXT_RESERVE_MB, cpu_baseline_mb: float = CPU_PROCESS_BASELINE_MB,
                  sequence_parallel: bool = True, include_embedding: bool = True) -> dict[int, DeviceMemory]:
    """The estimated memory of every rank of ``strategy`` training ``model`` (see the module docstring).

    ``cluster``: where the ranks are; each rank's device kind chooses its runtime part (:func:`runtime_bytes`).
    Without it, or for a rank outside it, the runtime part is 0 (tensors only).  ``device``: ``"cpu"`` or
    ``"cuda"`` for every rank, whatever the cluster's kinds (a job launched with ``device="cpu"`` on a cluster
    of GPU kinds runs CPU workers).  ``seq_len``: tokens a sample (default ``model.max_seq_len``).
    ``gpu_reserve_mb``, ``cpu_baseline_mb``: the runtime parts (:class:`~hspmd_sdk.planner.CostModel` has them as
    fields).  ``sequence_parallel=False``: the ``4 * hidden`` values a token around the norms stay replicated
    across TP; ``include_embedding=False``: the decoder layers only (the planners' ``CostModel`` switches)."""
    seq = model.max_seq_len if seq_len is None else seq_len
    units_of = {(i, j): _units(model, p.num_stages, j, s, include_embedding)
                for i, p in enumerate(strategy.pipelines) for j, s in enumerate(p.stages)}
    shares = strategy.zero_shares() or [1.0] * len(strategy.pipelines)  # ZeRO's share of each pipeline
    holders: dict[Hashable, float] = {}  # per unit, the shares of the stages holding it (their count if even)
    for (i, _), units in units_of.items():
        for unit, _ in units:
            holders[unit] = holders.get(unit, 0.0) + shares[i]
    out: dict[int, DeviceMemory] = {}
    for i, p in enumerate(strategy.pipelines):
        for j, s in enumerate(p.stages):
            held = in_flight(strategy.schedule, p.num_stages, j, p.num_micro_batches)
            tokens = p.micro_batch_size * seq / s.cp
            last = j == p.num_stages - 1 and include_embedding
            of_split: dict[float, tuple[float, float, float, float, float]] = {}  # a stage's ranks share most
            for r in s.devices:
                split = s.tp_degree if not s.is_uneven else 1 / s.share(r)
                got = of_split.get(split)
                if got is None:
                    params = grads = optimizer = largest = total = 0.0
                    for unit, count in units_of[(i, j)]:
                        mine = count / split
                        ways = holders[unit] / shares[i]  # ZeRO divides this rank's part by it (even: holders)
                        params += mine * BF16_BYTES / (ways if strategy.zero >= 3 else 1)
                        grads += mine * BF16_BYTES / (ways if strategy.zero >= 2 else 1)
                        optimizer += mine * OPTIMIZER_BYTES / (ways if strategy.zero1 else 1)
                        if ways > 1:
                            largest, total = max(largest, mine * BF16_BYTES), total + mine * BF16_BYTES
                    if strategy.zero >= 3:
                        params += zero3_gathered(largest, total)
                    got = of_split[split] = (params, grads, optimizer,
                                             *_activations(model, s, tokens, split, last, sequence_parallel))
                params, grads, optimizer, kept, transient = got
                kind = _kind_of(r, cluster, device)
                out[r] = DeviceMemory(params, grads, optimizer, kept * held + transient,
                                      runtime_bytes(kind, gpu_reserve_mb=gpu_reserve_mb,
                                                    cpu_baseline_mb=cpu_baseline_mb), kind)
    return out


def zero3_gathered(largest: float, total: float) -> float:
    """ZeRO-3's gathered bytes at once on a rank whose sharded units hold ``total`` bytes, the largest
    ``largest``: a unit merges layers up to :data:`~.plan.ZERO3_UNIT_BYTES` (so it holds less than that plus one
    layer, or everything); the unit read and the next one prefetched, or the one unit there is."""
    unit = min(total, largest + ZERO3_UNIT_BYTES)
    return unit if unit >= total else 2 * unit


def _units(model: "ModelSpec", num_stages: int, j: int, stage: "Stage",
           include_embedding: bool) -> list[tuple[Hashable, float]]:
    """The model units a stage holds, with their parameter counts: its layers, the embedding (first stage) and
    the head (last stage) -- those two only with ``include_embedding``."""
    out: list[tuple[Hashable, float]] = [(("layer", k), float(model.layer_param_count()))
                                         for k in range(stage.layers[0], stage.layers[1] + 1)]
    if include_embedding and j == 0:
        out.insert(0, (("embedding",), float(model.embedding_param_count())))
    if include_embedding and j == num_stages - 1:
        out.append((("head",), float(model.head_param_count())))
    return out


def layer_activations(model: "ModelSpec", tokens: float, split: float, *, recompute: bool = False,
                      sequence_parallel: bool = True) -> tuple[float, float]:
    """``(kept, transient)`` bytes of one decoder layer for ``tokens`` tokens on a rank holding ``1 / split`` of
    the TP group's work: its activations (``recompute``: only its input, and its full activations transient)."""
    total = model.layer_activation_bytes(tokens)
    if sequence_parallel:
        full = total / split
    else:  # the norms' inputs and outputs, 4 * hidden values a token, stay whole on every rank of the group
        replicated = tokens * 4 * model.hidden_size * BF16_BYTES
        full = replicated + (total - replicated) / split
    if recompute:
        return tokens * model.hidden_size * BF16_BYTES / (split if sequence_parallel else 1), full
    return full, 0.0


def head_activations(model: "ModelSpec", tokens: float, split: float) -> tuple[float, float]:
    """``(kept, transient)`` bytes of the final norm, LM head and loss for ``tokens`` tokens: its input kept, the
    fp32 logits and their gradient (``tokens x vocab / split`` each) transient."""
    return tokens * model.hidden_size * BF16_BYTES, 2 * tokens * model.vocab_size * FP32_BYTES / split


def _activations(model: "ModelSpec", stage: "Stage", tokens: float, split: float, last: bool,
                 sequence_parallel: bool) -> tuple[float, float]:
    """``(kept a micro-batch, largest transient)`` of a stage's rank."""
    kept, transient = layer_activations(model, tokens, split, recompute=stage.recompute,
                                        sequence_parallel=sequence_parallel)
    kept *= stage.num_layers
    if last:
        head_kept, head_transient = head_activations(model, tokens, split)
        kept, transient = kept + head_kept, max(transient, head_transient)
    return kept, transient


def _kind_of(rank: int, cluster: "Cluster | None", device: str | None) -> str:
    """The device kind whose runtime part a rank gets: ``device`` when given (``"cpu"``/``"cuda"``), else the
    cluster's kind of the rank, ``""`` when unknown."""
    if device is not None:  # "cpu" is LOCAL_KIND itself
        return device
    if cluster is None or not 0 <= rank < cluster.num_ranks:
        return ""
    return cluster.kind(rank)
