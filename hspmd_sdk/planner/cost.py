"""The operator-centric cost model (§8, Appendix A.1).

Every estimate is built from a few operators, each costed on one hardware resource:

* compute of a decoder layer (and of the embedding / LM head) on a device kind, for a tensor-parallel (TP)
  degree, micro-batch size and sequence length: ``FLOPs / TP`` divided by the device's peak bf16 throughput
  times a model-FLOPs utilisation (**analytic**), or a fitted line ``time = a * FLOPs + b`` (**profiled**, see
  :func:`hspmd_sdk.runtime.profile_device`);
* communication on a link class (``intra``: NVLink, ``inter``: the network) from :meth:`Cluster.link`:
  the TP collectives of the embedding, a decoder layer and the LM head, forward and backward, as the model's own
  specialized Program runs them (:mod:`.tp_comm`: for Llama two all-reduces of ``tokens x hidden`` a layer each
  way, the all-gathers of the embedding output and of the logits, the all-reduce of the head's input gradient;
  GPT's head all-reduces its logits), each priced as a ring collective by :meth:`OpKind.ring`, the volumes the
  Program's ``CollectiveOp.transfers`` count (``2(n-1)/n`` of the buffer for an all-reduce, ``(n-1)/n`` for a
  reduce-scatter or an all-gather), pipeline point-to-point of one activation or
  gradient (``tokens x hidden x 2`` bytes), data-parallel gradient synchronisation (ring all-reduce, or
  reduce-scatter + all-gather under ZeRO-1) over the slowest link of the group;
* memory: bf16 parameters and gradients, fp32 master weights and Adam ``m``/``v`` (ZeRO-1 divides these across
  the replicas holding the same layer), activations of the micro-batches in flight, and the device's runtime (a
  GPU's CUDA context, a CPU worker's process baseline) -- the core's one estimate,
  :mod:`hspmd_sdk.core.memory`, whose per-unit activation figures the operators below carry;
* context parallelism (a stage's ``cp``, SPEC §11): every rank of a CP group holds ``S / cp`` tokens of each
  sequence, so its linear layers, norms, embedding and LM head work on those tokens and keep their activations;
  its attention computes its query chunk against every key block its mask does not hide wholly, a chunk against
  itself causally (the busiest rank sets the pace: the last chunk's rank with the contiguous layout, every rank
  alike with the balanced one: :func:`cp_attention_share`); keys and values ring around the group
  (:func:`cp_ring_bytes`), overlapped with
  the attention compute, only the part of the transfers the compute does not cover is paid.

Backward costs ``backward_factor`` (2) forwards; activation recompute adds one more forward to the backward.
**Representative profiling** (the runtime's :func:`hspmd_sdk.runtime.profile_model`): on a CPU, bare matmuls are
only about 60% of a decoder step (RMSNorm, RoPE, SwiGLU, the attention kernel, the loss and Adam are the rest), so
a matmul line underestimates a step.  ``profile_model`` times the real forward and backward of ONE decoder layer of
the reference Llama (:mod:`hspmd_sdk.models.reference`) at a few ``(tokens, seq_len)`` shapes, the embedding and
the final norm + LM head + cross-entropy, and the Adam step, and fits per-operator lines ``time = a * FLOPs + b``
(:class:`OperatorProfile`, stored per device kind in ``CostModel.profiles``); these replace both
``compute_fits`` and the ``backward_factor`` for that kind.  It can also measure the local gloo link
(``profile_link``: a 2-process all_reduce / send-recv run) into ``CostModel.link_overrides``, which replaces
the latency and bandwidth of a link class (``"intra"``, ``"inter"``) from :meth:`Cluster.link` -- the Cluster
presets stay as they are.  The collective is profiled the way the executor runs it, blocking, between bursts of
compute, so the link also carries the fixed cost every blocking call pays (``LinkOverride.call_latency``: waking
up and being scheduled; what made TP2, with 19 small all-reduces a step, 1.3x slower than predicted).
Everything is JSON (:meth:`CostModel.save` / :meth:`CostModel.load`).

All figures are seconds and bytes.  The efficiencies are fields of :class:`CostModel`, documented there and
overridable; nothing here is global.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ..core.comm_ops import OpKind
from ..core.memory import (BF16_BYTES, CPU_PROCESS_BASELINE_MB, CUDA_CONTEXT_RESERVE_MB, FP32_BYTES,
                           OPTIMIZER_BYTES as _OPTIMIZER_BYTES, head_activations, layer_activations, runtime_bytes)
from ..core.resolve import itemsize_of as _itemsize
from .tp_comm import Collective, UnitCollectives, unit_collectives

if TYPE_CHECKING:  # pragma: no cover
    from ..core.cluster import Cluster, DeviceSpec, Link
    from ..core.model_spec import ModelSpec

__all__ = ["CostModel", "ComputeFit", "OperatorProfile", "LinkOverride", "fit_link", "ring_factor", "LayerCost",
           "layer_cost",
           "head_cost", "embedding_cost", "static_memory", "activation_memory", "cp_attention_share", "cp_ring_bytes"]

BF16 = BF16_BYTES
FP32 = FP32_BYTES
#: bytes per parameter of the fp32 optimizer part: master weight, Adam m, Adam v.
OPTIMIZER_BYTES = _OPTIMIZER_BYTES

#: HBM bandwidth (GB/s) of the preset device kinds, for the memory-bound optimizer step (vendor figures).
DEFAULT_HBM_GBS: dict[str, float] = {"H800": 3350.0, "H20": 4000.0, "A100": 2039.0, "H100": 3350.0,
                                     "H200": 4800.0, "cpu": 50.0}


class ComputeFit(BaseModel):
    """A profiled line ``seconds = a * flops + b`` for one device kind (from
    :func:`hspmd_sdk.runtime.profile_device`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    a: float = Field(ge=0, description="seconds per FLOP")
    b: float = Field(ge=0, description="fixed seconds per operator (launch overhead)")
    c: float | None = Field(default=None, ge=0, description="seconds per attention FLOP (the part of a layer's "
                            "FLOPs that grows with the sequence length), fitted when the profile spans several "
                            "sequence lengths; None: priced at a")
    device: str = ""
    dtype: str = ""
    r2: float | None = None

    @property
    def tflops(self) -> float:
        """The throughput the slope implies, in TFLOPS."""
        return 1e-12 / self.a if self.a > 0 else float("inf")


class OperatorProfile(BaseModel):
    """Profiled costs of whole model operators on one device kind (from :func:`hspmd_sdk.runtime.profile_model`).

    Each line maps the operator's *forward* FLOPs (per device, i.e. already divided by the TP degree) to seconds:
    ``layer_fwd``/``layer_bwd`` for one decoder layer (x: :meth:`ModelSpec.layer_flops`), ``head_fwd``/``head_bwd``
    for the final norm + LM head + cross-entropy (x: :meth:`ModelSpec.head_flops`), ``embed`` for the embedding
    forward + backward (x: ``tokens * hidden``, a nominal count).  ``layer_replicated_fwd``/``_bwd``: the part of
    a decoder layer that tensor parallelism without sequence parallelism does not divide -- its two norms and
    two residual adds on the full hidden state, which every device of a TP group computes (x: ``tokens *
    hidden``).  ``points``: the measured ``(x, seconds)`` per line (``lf``, ``lb``, ``hf``, ``hb``, ``e``, ``rf``,
    ``rb``).  ``optimizer_s_per_param``: seconds of the
    Adam step per parameter (fp32 ``torch.optim.Adam``).  ``shapes``: the ``(tokens, seq_len)`` shapes measured.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    layer_fwd: ComputeFit
    layer_bwd: ComputeFit
    head_fwd: ComputeFit
    head_bwd: ComputeFit
    embed: ComputeFit = Field(default_factory=lambda: ComputeFit(a=0.0, b=0.0))
    layer_replicated_fwd: ComputeFit = Field(default_factory=lambda: ComputeFit(a=0.0, b=0.0))
    layer_replicated_bwd: ComputeFit = Field(default_factory=lambda: ComputeFit(a=0.0, b=0.0))
    optimizer_s_per_param: float = Field(default=0.0, ge=0)
    shapes: list[tuple[int, int]] = Field(default_factory=list)
    threads: int | None = None
    model: str = ""
    points: dict[str, list[tuple[float, float]]] = Field(default_factory=dict)
    executor_overhead: dict[str, float] | None = Field(
        default=None, description="the executor's measured fixed seconds per micro-batch the intercepts were set "
        "from (hspmd_sdk.runtime.control.overhead); None: intercepts fitted on the reference")


class LinkOverride(BaseModel):
    """Measured costs of a link class, replacing :meth:`Cluster.link`'s latency and bandwidth (from
    :func:`hspmd_sdk.runtime.profile_link`).  ``latency``/``bandwidth`` (s, bytes/s) cost point-to-point transfers;
    ``collective_latency``/``collective_bandwidth`` cost each step of a ring collective (default: the p2p
    figures).  ``call_latency``: what one *blocking* collective call costs beyond its ring steps when it is issued
    the way the executor issues it, between bursts of compute: the processes were busy or asleep and have to be
    woken and scheduled; measured by :func:`profile_link` as the difference between the in-context and the
    back-to-back all-reduce (0: not measured).  ``skew``: the wait for the group's slowest member, in seconds per
    second of compute each member did since its previous blocking collective -- on a shared machine the same work
    takes a different time on each member (preemption, cache and frequency jitter), and the collective starts when
    the last one arrives; measured by :func:`profile_link` from the in-context all-reduce after two lengths of
    compute (0: not measured; dedicated accelerators run the same kernels in the same time and show ~0).  A
    collective costs ``call_latency + steps * collective_latency + volume / collective_bandwidth``, plus ``skew``
    times the compute before it (:func:`layer_cost`, :func:`head_cost`).  Measured figures already include the
    achieved efficiency, so ``p2p_efficiency`` and ``collective_efficiency`` are not applied on an overridden
    link."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    latency: float = Field(ge=0)
    bandwidth: float = Field(gt=0)
    collective_latency: float | None = Field(default=None, ge=0)
    collective_bandwidth: float | None = Field(default=None, gt=0)
    call_latency: float = Field(default=0.0, ge=0, description="seconds every blocking collective call pays once, "
                                "on top of its ring steps (see profile_link)")
    skew: float = Field(default=0.0, ge=0, description="seconds a blocking collective waits for its slowest member "
                        "per second of compute before it (see profile_link)")
    send_overhead: float = Field(default=0.0, ge=0, description="seconds a point-to-point send keeps its sender busy "
                                 "posting it (copies, the transport's bookkeeping: milliseconds for gloo on loaded "
                                 "CPU ranks; fitted by planner.calibrate); 0: a send does not occupy its sender")
    backend: str = ""


class CostModel(BaseModel):
    """The tunable constants of the cost model.  Defaults are typical Megatron-on-Hopper figures.

    * ``mfu``: achieved fraction of peak bf16 FLOPS per device kind; kinds not listed use ``default_mfu``.
    * ``compute_fits``: per device kind, a profiled :class:`ComputeFit` that replaces the analytic estimate.
    * ``collective_efficiency`` / ``p2p_efficiency``: achieved fraction of a link's bandwidth by ring
      collectives / by point-to-point transfers.
    * ``comm_scale``: multiplies every communication time; ``0`` models free communication (pipeline theory).
    * ``backward_factor``: backward FLOPs per forward FLOP.
    * ``include_embedding``: cost the embedding and LM head (compute and memory); ``False`` models only the
      decoder layers, so that equal layer counts give exactly equal stages.
    * ``sequence_parallel``: Megatron sequence parallelism with TP (the TP all-reduces become reduce-scatter +
      all-gather of the same volume, and the RMSNorm activations are split too, so every activation divides
      by the TP degree); ``False``: the ``4 * hidden`` values a token around the norms stay replicated.
    * ``optimizer_bytes_per_param`` and ``hbm_gbs``/``hbm_efficiency``: the memory-bound Adam step reads and
      writes that many bytes per parameter it owns.
    * ``memory_reserve_mb``: memory a GPU holds besides tensors (CUDA context, allocator), MiB a device;
      ``cpu_baseline_mb``: what a CPU worker process (device kind ``"cpu"``) holds before any tensor (the
      interpreter, torch, gloo), MiB a process.  Which one a device gets is :meth:`runtime_bytes`
      (:func:`hspmd_sdk.core.memory.runtime_bytes`: by its kind).
    * ``profiles``: per device kind, an :class:`OperatorProfile` (from ``runtime.profile_model``); when present it is
      the source of layer / head / embedding compute and of the optimizer time for that kind (it takes precedence
      over ``compute_fits``, ``mfu`` and ``backward_factor``).
    * ``link_overrides``: link class (``"intra"``, ``"inter"``) -> :class:`LinkOverride`, measured latency and
      bandwidth that replace the :class:`Cluster`'s for every link of that class.
    * ``comm_bytes_factor``: bytes on the wire per byte the model counts where it counts without a dtype (bf16;
      ``2.0`` for a run that communicates fp32).  A count at a known dtype (``simulate(..., dtype=)``, a
      Program's own) is already the wire's: :meth:`wire_bytes`.
    * ``cores``: CPU cores per node, for local simulations with more ranks on a node than cores.  When set, the
      compute and optimizer time of a device is slowed by the ranks of its node computing at the same time
      (:func:`hspmd_sdk.planner.simulate`: processor sharing over the simulated timeline, so ranks waiting in a
      pipeline bubble or a collective free their core; the mixed-length simulation and the planners use the
      bound ``max(1, ranks_on_its_node / cores)``).  It assumes the OS shares the cores evenly.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    default_mfu: float = Field(default=0.45, gt=0, le=1)
    mfu: dict[str, float] = Field(default_factory=dict)
    compute_fits: dict[str, ComputeFit] = Field(default_factory=dict)
    collective_efficiency: float = Field(default=0.7, gt=0, le=1)
    p2p_efficiency: float = Field(default=0.8, gt=0, le=1)
    comm_scale: float = Field(default=1.0, ge=0)
    backward_factor: float = Field(default=2.0, gt=0)
    include_embedding: bool = True
    sequence_parallel: bool = True
    optimizer_bytes_per_param: float = Field(default=28.0, ge=0)
    hbm_gbs: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_HBM_GBS))
    default_hbm_gbs: float = Field(default=2000.0, gt=0)
    hbm_efficiency: float = Field(default=0.8, gt=0, le=1)
    memory_reserve_mb: float = Field(default=CUDA_CONTEXT_RESERVE_MB, ge=0)
    cpu_baseline_mb: float = Field(default=CPU_PROCESS_BASELINE_MB, ge=0)
    profiles: dict[str, OperatorProfile] = Field(default_factory=dict)
    link_overrides: dict[str, LinkOverride] = Field(default_factory=dict)
    comm_bytes_factor: float = Field(default=1.0, gt=0)
    cores: int | None = Field(default=None, ge=1)

    # ---- persistence ---------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write this cost model as JSON."""
        Path(path).write_text(self.model_dump_json(indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """Read a cost model written by :meth:`save`."""
        return cls.model_validate_json(Path(path).read_text())

    # ---- memory --------------------------------------------------------------------------------------------
    def runtime_bytes(self, kind: str) -> float:
        """Bytes a device of ``kind`` holds besides the plan's tensors: ``cpu_baseline_mb`` for a CPU worker
        process, ``memory_reserve_mb`` for a GPU (:func:`hspmd_sdk.core.memory.runtime_bytes`)."""
        return runtime_bytes(kind, gpu_reserve_mb=self.memory_reserve_mb, cpu_baseline_mb=self.cpu_baseline_mb)

    def memory_options(self) -> dict[str, float | bool]:
        """This cost model's keywords of :func:`hspmd_sdk.core.memory.device_memory`: the runtime parts and the
        sequence-parallel and embedding switches, so that an estimate made with them is the simulator's."""
        return {"gpu_reserve_mb": self.memory_reserve_mb, "cpu_baseline_mb": self.cpu_baseline_mb,
                "sequence_parallel": self.sequence_parallel, "include_embedding": self.include_embedding}

    # ---- operators -----------------------------------------------------------------------------------------
    def compute_time(self, flops: float, spec: "DeviceSpec") -> float:
        """Seconds for ``flops`` of one operator on a device of ``spec`` (profiled fit if any, else analytic)."""
        if flops <= 0:
            return 0.0
        fit = self.compute_fits.get(spec.kind)
        if fit is not None:
            return fit.a * flops + fit.b
        return flops / (spec.bf16_tflops * 1e12 * self.mfu.get(spec.kind, self.default_mfu))

    def wire_bytes(self, elements: float, dtype: str | None = None) -> float:
        """Bytes on the wire for ``elements`` values: at ``dtype``'s item size where the count knows its dtype (a
        Program's plans, a run's precision: ``"float32"``, ``"bfloat16"``), else the cost model's own count, bf16
        times :attr:`comm_bytes_factor`.  The one place that turns a count of values into bytes on the wire."""
        if dtype is None:
            return elements * BF16 * self.comm_bytes_factor
        return elements * _itemsize(dtype)

    def p2p_time(self, nbytes: float, link: "Link") -> float:
        """Seconds to send ``nbytes`` (counted at bf16, times :attr:`comm_bytes_factor` on the wire)
        point-to-point over ``link``."""
        if link.cls == "self" or nbytes <= 0:
            return 0.0
        return self._p2p_wire(nbytes * self.comm_bytes_factor, link)

    def p2p_seconds(self, elements: float, link: "Link", dtype: str | None = None) -> float:
        """Seconds to send ``elements`` values point-to-point over ``link``, bytes by :meth:`wire_bytes`."""
        if link.cls == "self" or elements <= 0:
            return 0.0
        return self._p2p_wire(self.wire_bytes(elements, dtype), link)

    def _p2p_wire(self, nbytes: float, link: "Link") -> float:
        o = self.link_overrides.get(link.cls)
        if o is not None:
            return self.comm_scale * (o.latency + nbytes / o.bandwidth)
        return self.comm_scale * (link.latency + nbytes / (link.bandwidth * self.p2p_efficiency))

    def collective_time(self, op: "OpKind | str", nbytes: float, n: int, link: "Link") -> float:
        """Seconds for a ring ``op`` (``AllReduce``, ``ReduceScatter``, ``AllGather``; :class:`~hspmd_sdk.core.
        comm_ops.OpKind` or its older spelling ``"all_reduce"``, ...) of ``nbytes`` per device (the whole buffer:
        the gathered one for ``AllGather``; counted at bf16, times :attr:`comm_bytes_factor` on the wire) over ``n``
        devices whose slowest link is ``link``.  The ring's bytes and steps are :meth:`OpKind.ring`'s, the ones a
        Program's ``CollectiveOp.transfers`` counts."""
        if n <= 1 or nbytes <= 0 or link.cls == "self":
            return 0.0
        return self._collective_wire(op, nbytes * self.comm_bytes_factor, n, link)

    def collective_seconds(self, op: "OpKind | str", elements: float, n: int, link: "Link",
                           dtype: str | None = None) -> float:
        """:meth:`collective_time` of a buffer of ``elements`` values, bytes by :meth:`wire_bytes`."""
        if n <= 1 or elements <= 0 or link.cls == "self":
            return 0.0
        return self._collective_wire(op, self.wire_bytes(elements, dtype), n, link)

    def _collective_wire(self, op: "OpKind | str", nbytes: float, n: int, link: "Link") -> float:
        volume, steps = OpKind(op).ring(n, nbytes)
        o = self.link_overrides.get(link.cls)
        if o is not None:
            lat = o.latency if o.collective_latency is None else o.collective_latency
            bw = o.bandwidth if o.collective_bandwidth is None else o.collective_bandwidth
            return self.comm_scale * (o.call_latency + steps * lat + volume / bw)
        return self.comm_scale * (steps * link.latency + volume / (link.bandwidth * self.collective_efficiency))

    def send_time(self, link: "Link") -> float:
        """Seconds a point-to-point send over ``link`` keeps its sender busy before the transfer goes on without it
        (:attr:`LinkOverride.send_overhead`; 0 without a measured link)."""
        o = self.link_overrides.get(link.cls)
        return 0.0 if o is None or link.cls == "self" else self.comm_scale * o.send_overhead

    def collective_skew(self, n: int, link: "Link") -> float:
        """Seconds a blocking collective over ``n`` devices whose slowest link is ``link`` waits for its slowest
        member per second of compute each did before it (:attr:`LinkOverride.skew`; 0 without a measured link)."""
        o = self.link_overrides.get(link.cls)
        if n <= 1 or o is None or link.cls == "self":
            return 0.0
        return self.comm_scale * o.skew

    def core_share(self, ranks_on_node: int) -> float:
        """The slowdown of compute when ``ranks_on_node`` ranks share ``cores`` cores: ``max(1, ranks / cores)``
        (1 when ``cores`` is unset).  An approximation, see the class docstring."""
        return max(1.0, ranks_on_node / self.cores) if self.cores else 1.0

    def optimizer_time(self, params: float, spec: "DeviceSpec") -> float:
        """Seconds for the Adam update of ``params`` parameters (profiled per parameter if ``profiles`` has the
        kind, else memory-bound)."""
        prof = self.profiles.get(spec.kind)
        if prof is not None and prof.optimizer_s_per_param > 0:
            return params * prof.optimizer_s_per_param
        bw = self.hbm_gbs.get(spec.kind, self.default_hbm_gbs) * 1e9 * self.hbm_efficiency
        return params * self.optimizer_bytes_per_param / bw


def ring_factor(op: "OpKind | str", n: int) -> float:
    """Bytes each device sends per byte of its buffer in a ring collective (:meth:`OpKind.ring`): ``2(n-1)/n`` for
    all-reduce, ``(n-1)/n`` for reduce-scatter and all-gather.  Raises ``ValueError`` for another kind."""
    try:
        kind = OpKind(op)
    except ValueError:
        raise ValueError(f"unknown collective {op!r}") from None
    return kind.ring(n, 1.0)[0]


# ---- per-operator costs -----------------------------------------------------------------------------------
class LayerCost(BaseModel):
    """The cost of one model unit (a decoder layer, the embedding or the LM head) for one micro-batch on one
    device of a TP group: forward and backward seconds (compute and TP communication apart), activation bytes
    kept per in-flight micro-batch, transient working bytes, and parameters held by the device."""

    model_config = ConfigDict(frozen=True)

    fwd_compute: float = 0.0
    bwd_compute: float = 0.0
    fwd_comm: float = 0.0
    bwd_comm: float = 0.0
    act_bytes: float = 0.0
    transient_bytes: float = 0.0
    params: float = 0.0
    #: context parallelism: the ring's transfer seconds less the attention compute they overlap, before the
    #: ``max(0, .)`` that ``fwd_comm`` / ``bwd_comm`` pay (negative: hidden), so that a caller can keep the cost
    #: as an affine part plus ``max(0, gap)`` (:class:`~hspmd_sdk.planner.mixed_cost.StageCost`)
    ring_gap_fwd: float = 0.0
    ring_gap_bwd: float = 0.0

    @property
    def fwd(self) -> float:
        return self.fwd_compute + self.fwd_comm

    @property
    def bwd(self) -> float:
        return self.bwd_compute + self.bwd_comm


def cp_attention_share(cp: int, balanced: bool = False) -> float:
    """The busiest CP rank's share of a layer's causal attention work, relative to the whole sequence's (what
    :meth:`ModelSpec.layer_flops` counts and a profile's attention rate prices: a causal kernel computes the
    visible half of the score matrix).  The CP kernel computes each key block a rank's queries see: blocks wholly
    visible in full, a chunk against itself causally (half), as the fused kernels do.  The sequence is cut into
    ``cp`` chunks (``2 cp`` balanced): contiguous, the last rank computes ``cp - 1`` whole blocks and one half of
    the ``cp**2 / 2`` visible, ``(2cp - 1) / cp**2``; balanced (chunks ``i`` and ``2cp - 1 - i``), every rank the
    same ``2cp`` of ``(2cp)**2 / 2``: ``1 / cp``."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, not {cp}")
    if cp == 1:
        return 1.0
    return 1.0 / cp if balanced else (2 * cp - 1) / (cp * cp)


def cp_ring_bytes(model: "ModelSpec", micro_batch: int, seq_len: int, tp: int, cp: int) -> tuple[float, float]:
    """Bytes one rank of a CP group sends around the ring per decoder layer and micro-batch, ``(forward,
    backward)``: its keys and values (``2 x tokens / cp x kv_dim / tp``, bf16 as the model counts) travel ``cp - 1``
    hops in the forward; the backward rings them again (``cp - 1`` hops) and sends the key/value gradient
    accumulators ``cp`` hops (home to their owner), about twice the forward."""
    fwd, bwd = _cp_ring_elements(model, micro_batch, seq_len, tp, cp)
    return fwd * BF16, bwd * BF16


def _cp_ring_elements(model: "ModelSpec", micro_batch: int, seq_len: int, tp: int, cp: int) -> tuple[float, float]:
    """:func:`cp_ring_bytes` in values (a rank's keys and values, ``cp - 1`` hops forward, ``2cp - 1`` back)."""
    if cp <= 1:
        return 0.0, 0.0
    kv_dim = getattr(model, "kv_dim", model.hidden_size)
    block = 2 * micro_batch * (seq_len / cp) * kv_dim / tp
    return (cp - 1) * block, (2 * cp - 1) * block


def layer_cost(model: "ModelSpec", spec: "DeviceSpec", tp: int, tp_link: "Link", micro_batch: int,
               seq_len: int, cost: CostModel, *, recompute: bool = False, cp: int = 1,
               cp_link: "Link | None" = None, balanced: bool = False,
               ratios: "Sequence[int] | None" = None, dtype: str | None = None) -> LayerCost:
    """One decoder layer on one device of a TP group of ``tp`` devices whose slowest link is ``tp_link``.

    Compute: ``layer_flops / tp``; with a profile and without ``cost.sequence_parallel``, plus ``1 - 1/tp`` of the
    profiled replicated part (norms and residuals, which every device of the group computes whole).  TP
    communication: the layer's collectives as its specialized Program runs them (:func:`~.tp_comm.unit_collectives`;
    for Llama and GPT two all-reduces of ``tokens x hidden`` bf16 in the forward and two in the backward), the
    forward's again when the backward recomputes it, plus the link's ``skew`` times the compute before them
    (:meth:`CostModel.collective_skew`).  Activations:
    :meth:`ModelSpec.layer_activation_bytes` divided by ``tp`` (with ``cost.sequence_parallel``; without it the
    RMSNorm inputs/outputs, ``4 * hidden`` per token, stay replicated); with ``recompute`` only the layer input
    is kept and one layer's full activations are transient.

    ``ratios``: an uneven TP group's shares (SPEC §12), whose collectives are read off a Program split so.
    ``dtype``: the values' type on the wire (:meth:`CostModel.wire_bytes`; ``None``: the cost model's bf16 count).

    Context parallelism (``cp > 1``, the group's slowest ring link ``cp_link``): the linear part, the
    activations and the TP collectives are those of ``tokens / cp`` tokens; the attention FLOPs are the busiest
    rank's :func:`cp_attention_share` of the whole sequence's; the ring's transfers (:func:`cp_ring_bytes`, one
    batched send/receive a hop) are paid where they outlast the attention compute they overlap.
    """
    whole = micro_batch * seq_len
    tokens = whole / cp
    lin = model.layer_flops(whole, 0) / cp / tp
    att = (model.layer_flops(whole, seq_len) - model.layer_flops(whole, 0)) * cp_attention_share(cp, balanced) / tp
    flops = lin + att
    prof = cost.profiles.get(spec.kind)
    if prof is not None:  # profiled whole-layer lines (attention's FLOPs at their own rate where fitted)
        fwd, bwd = _layer_line(prof.layer_fwd, lin, att), _layer_line(prof.layer_bwd, lin, att)
        att_f = fwd - _layer_line(prof.layer_fwd, lin, 0.0)  # the attention's seconds (no tokens: 0 - 0)
        att_b = bwd - _layer_line(prof.layer_bwd, lin, 0.0)
        if tp > 1 and not cost.sequence_parallel:  # norms and residuals stay whole on every device of the group
            x, share = tokens * model.hidden_size, 1.0 - 1.0 / tp
            fwd += share * _line(prof.layer_replicated_fwd, x)
            bwd += share * _line(prof.layer_replicated_bwd, x)
    else:
        fwd = cost.compute_time(flops, spec)
        bwd = cost.backward_factor * fwd
        att_f = fwd - cost.compute_time(lin, spec)
        att_b = cost.backward_factor * att_f
    tpc = _collectives(model, tp, ratios)
    comm_f = _tp_seconds(tpc.layer_fwd, tokens, tp_link, cost, dtype)
    comm_b = _tp_seconds(tpc.layer_bwd, tokens, tp_link, cost, dtype)
    kept, transient = layer_activations(model, tokens, tp, recompute=recompute,
                                        sequence_parallel=cost.sequence_parallel)
    gap_f, gap_b = _cp_ring_gap(model, micro_batch, seq_len, tp, cp, cp_link, cost, att_f, att_b, dtype)
    ring_f, ring_b = max(0.0, gap_f), max(0.0, gap_b)
    bwd += fwd if recompute else 0.0
    ring_b += ring_f if recompute else 0.0
    skew = cost.collective_skew(tp, tp_link)  # every stretch of compute ends at one of the blocking all-reduces
    return LayerCost(
        fwd_compute=fwd, bwd_compute=bwd, fwd_comm=comm_f + skew * fwd + ring_f,
        bwd_comm=comm_b + (comm_f if recompute else 0.0) + skew * bwd + ring_b,
        act_bytes=kept, transient_bytes=transient,
        params=model.layer_param_count() / tp, ring_gap_fwd=gap_f, ring_gap_bwd=gap_b)


def _collectives(model: "ModelSpec", tp: float, ratios: "Sequence[int] | None" = None) -> UnitCollectives:
    """The TP collectives of ``model``'s units at ``tp`` split in ``ratios`` (:func:`~.tp_comm.unit_collectives`,
    read off the specialized Program); none for a ``tp`` that is an uneven stage's compute share (fractional, or
    not the number of its ``ratios``), whose group's collectives the caller prices at the group's degree."""
    if not float(tp).is_integer() or (ratios is not None and len(ratios) != int(tp)):
        return unit_collectives(model, 1)
    return unit_collectives(model, int(tp), ratios)


def _tp_seconds(collectives: tuple[Collective, ...], tokens: float, link: "Link", cost: CostModel,
                dtype: str | None = None) -> float:
    """Seconds of ``collectives`` (one after another, blocking) for ``tokens`` tokens of ``dtype`` over ``link``."""
    return sum(cost.collective_seconds(c.kind, c.per_token * tokens, c.members, link, dtype) for c in collectives)


def _cp_ring_gap(model: "ModelSpec", micro_batch: int, seq_len: int, tp: int, cp: int, link: "Link | None",
                 cost: CostModel, att_f: float, att_b: float, dtype: str | None = None) -> tuple[float, float]:
    """The CP ring's transfer seconds less the attention compute they overlap, forward and backward: each hop's
    transfer (one batched send/receive, priced point-to-point) overlaps the attention compute of a block, so a layer
    pays ``max(0, gap)`` (``att_f`` / ``att_b``: the attention's seconds, the layer's less its matmuls')."""
    if cp <= 1 or link is None:
        return 0.0, 0.0
    fe, be = _cp_ring_elements(model, micro_batch, seq_len, tp, cp)
    hop_f, hop_b = fe / (cp - 1), be / (2 * cp - 1)
    ring_f = (cp - 1) * cost.p2p_seconds(hop_f, link, dtype)
    ring_b = (2 * cp - 1) * cost.p2p_seconds(hop_b, link, dtype)
    return ring_f - att_f, ring_b - att_b


def _line(fit: ComputeFit, x: float) -> float:
    return fit.a * x + fit.b if x > 0 else 0.0


def _layer_line(fit: ComputeFit, matmul: float, attention: float) -> float:
    """A layer's profiled seconds: ``a * matmul FLOPs + c * attention FLOPs + b`` (``c`` = ``a`` when not fitted)."""
    if matmul + attention <= 0:
        return 0.0
    return fit.a * matmul + (fit.a if fit.c is None else fit.c) * attention + fit.b


def embedding_cost(model: "ModelSpec", spec: "DeviceSpec", tp: int, tp_link: "Link", micro_batch: int,
                   seq_len: int, cost: CostModel, *, cp: int = 1,
                   ratios: "Sequence[int] | None" = None, dtype: str | None = None) -> LayerCost:
    """The token embedding, split along hidden in a TP group (as :func:`~hspmd_sdk.core.strategy_plan.
    plan_from_strategy` lays it out): no FLOPs to speak of, one all-gather of its ``tokens x hidden`` output in the
    forward (its backward is a local split).  ``cp``: each rank embeds its ``tokens / cp``."""
    if not cost.include_embedding:
        return LayerCost()
    tokens = micro_batch * seq_len / cp
    tpc = _collectives(model, tp, ratios)
    prof = cost.profiles.get(spec.kind)
    # profiled: the embedding's forward + backward, put in the backward (the forward is a gather)
    bwd = _line(prof.embed, tokens * model.hidden_size / tp) if prof is not None else 0.0
    return LayerCost(fwd_comm=_tp_seconds(tpc.embedding_fwd, tokens, tp_link, cost, dtype), bwd_compute=bwd,
                     bwd_comm=_tp_seconds(tpc.embedding_bwd, tokens, tp_link, cost, dtype),
                     params=model.embedding_param_count() / tp)


def head_cost(model: "ModelSpec", spec: "DeviceSpec", tp: int, tp_link: "Link", micro_batch: int,
              seq_len: int, cost: CostModel, *, cp: int = 1,
              ratios: "Sequence[int] | None" = None, dtype: str | None = None) -> LayerCost:
    """Final RMSNorm, the vocab-parallel LM head and the cross-entropy loss.

    The fp32 logits (``tokens x vocab / tp``) are transient: the loss and its gradient are computed right
    after the forward of the last stage.  TP communication as the specialized Program runs it
    (:func:`~.tp_comm.unit_collectives`): for Llama the logits are all-gathered (``tokens x vocab``) in the
    forward and the gradient of the head's (Duplicate) input is all-reduced (``tokens x hidden``) in the backward;
    GPT's tied head all-reduces its Partial logits and all-gathers its input's gradient.  ``cp``: each rank's
    ``tokens / cp``."""
    if not cost.include_embedding:
        return LayerCost()
    tokens = micro_batch * seq_len / cp
    flops = model.head_flops(tokens) / tp
    prof = cost.profiles.get(spec.kind)
    if prof is not None:
        fwd, bwd = _line(prof.head_fwd, flops), _line(prof.head_bwd, flops)
    else:
        fwd = cost.compute_time(flops, spec)
        bwd = cost.backward_factor * fwd
    skew = cost.collective_skew(tp, tp_link)  # the logits' gather waits for the head, the input's all-reduce too
    tpc = _collectives(model, tp, ratios)
    fwd_comm = _tp_seconds(tpc.head_fwd, tokens, tp_link, cost, dtype) + skew * fwd
    bwd_comm = _tp_seconds(tpc.head_bwd, tokens, tp_link, cost, dtype) + skew * bwd
    kept, transient = head_activations(model, tokens, tp)
    return LayerCost(fwd_compute=fwd, bwd_compute=bwd, fwd_comm=fwd_comm, bwd_comm=bwd_comm,
                     act_bytes=kept, transient_bytes=transient,
                     params=model.head_param_count() / tp)


def static_memory(params: float, zero_shards: float) -> dict[str, float]:
    """Bytes for ``params`` parameters held by a device: bf16 weights and gradients, and the fp32 optimizer part
    (master weights, Adam m and v) divided by ``zero_shards`` (1 without ZeRO-1)."""
    return {"params": params * BF16, "grads": params * BF16,
            "optimizer": params * OPTIMIZER_BYTES / max(zero_shards, 1.0)}


def activation_memory(per_micro_batch: float, in_flight: int, transient: float) -> float:
    """Peak activation bytes: ``in_flight`` micro-batches of kept activations plus the largest transient."""
    return per_micro_batch * in_flight + transient


# ---- fitting measurements (the measuring is the runtime's: :mod:`hspmd_sdk.runtime.control.profile`) -------------------
def fit_line(xs: Iterable[float], ys: Iterable[float]) -> ComputeFit:
    """Least squares ``y = a x + b`` with ``a, b >= 0``: a line that does not rise (or ``x`` that does not vary) is
    flat at the mean (or 0), ``a = 0``; a negative intercept is clamped to 0 and ``a`` refit through the origin."""
    xs, ys = list(xs), list(ys)
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    b = my - a * mx
    if a <= 0:  # not rising: a flat line at the mean (0 for measurements below 0)
        a, b = 0.0, max(my, 0.0)
    elif b < 0:  # a negative intercept: clamped to 0, the slope refit through the origin
        b = 0.0
        a = max(sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0)
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (a * x + b)) ** 2 for x, y in zip(xs, ys))
    return ComputeFit(a=a, b=b, r2=1 - ss_res / ss_tot if ss_tot > 0 else None)


def fit_plane(x1: Sequence[float], x2: Sequence[float], ys: Sequence[float]) -> ComputeFit:
    """Least squares ``y = a x1 + c x2 + b`` with ``a, c, b >= 0`` (a coefficient that comes out negative is
    dropped and the rest refit); ``c`` is ``None`` when ``x2`` does not vary independently of ``x1``."""
    import numpy as np

    X = np.column_stack([np.asarray(x1, float), np.asarray(x2, float), np.ones(len(ys))])
    y = np.asarray(ys, float)
    if np.linalg.matrix_rank(X) < 3:
        f = fit_line([a + b for a, b in zip(x1, x2)], ys)
        return f
    keep = [0, 1, 2]
    while True:
        coef = np.zeros(3)
        coef[keep] = np.linalg.lstsq(X[:, keep], y, rcond=None)[0]
        bad = [k for k in keep if coef[k] < 0]
        if not bad:
            break
        keep.remove(min(bad, key=lambda k: coef[k]))  # none left: lstsq of no columns, nothing bad, done
    a, c, b = (float(max(v, 0.0)) for v in coef)
    res, tot = float(((X @ np.array([a, c, b]) - y) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    return ComputeFit(a=a, b=b, c=c, r2=1 - res / tot if tot > 0 else None)



def fit_link(sizes: Sequence[int], p2p: Sequence[float], all_reduce: Sequence[float],
             in_context: Sequence[float] | None = None, *, backend: str = "",
             in_context_long: Sequence[float] | None = None,
             compute_s: tuple[float, float] | None = None) -> LinkOverride:
    """The :class:`LinkOverride` of measured seconds per size (bytes): one-way point-to-point, back-to-back 2-rank
    all-reduce and (optional) in-context 2-rank all-reduce after ``compute_s[0]`` seconds of compute, and after
    ``compute_s[1]`` (``in_context_long``: gives ``skew``; see :func:`~hspmd_sdk.runtime.profile_link`)."""
    if in_context_long is not None and in_context is None:
        raise ValueError("fit_link: in_context_long needs in_context (the shorter compute's sweep) too")
    p = fit_line(sizes, p2p)
    ar = fit_line(sizes, all_reduce)
    update: dict = {}
    if in_context is not None:
        ctx = fit_line(sizes, in_context)
        update = {"call_latency": max(0.0, ctx.b - ar.b), "collective_bandwidth": 1.0 / ctx.a if ctx.a > 0 else 1e12}
        if in_context_long is not None:
            if compute_s is None or not compute_s[1] > compute_s[0]:
                raise ValueError(f"fit_link: in_context_long needs compute_s=(short, long) with long > short, got "
                                 f"{compute_s}")
            skew = max(0.0, (fit_line(sizes, in_context_long).b - ctx.b) / (compute_s[1] - compute_s[0]))
            update.update(skew=skew, call_latency=max(0.0, ctx.b - ar.b - skew * compute_s[0]))
    return LinkOverride(latency=p.b, bandwidth=1.0 / p.a if p.a > 0 else 1e12, collective_latency=ar.b / 2,
                        collective_bandwidth=update.get("collective_bandwidth", 1.0 / ar.a if ar.a > 0 else 1e12),
                        call_latency=update.get("call_latency", 0.0), skew=update.get("skew", 0.0),
                        backend=backend)
