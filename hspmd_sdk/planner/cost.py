"""The operator-centric cost model (§8, Appendix A.1).

Every estimate is built from a few operators, each costed on one hardware resource:

* compute of a decoder layer (and of the embedding / LM head) on a device kind, for a tensor-parallel (TP)
  degree, micro-batch size and sequence length: ``FLOPs / TP`` divided by the device's peak bf16 throughput
  times a model-FLOPs utilisation (**analytic**), or a fitted line ``time = a * FLOPs + b`` (**profiled**, see
  :func:`profile_device`);
* communication on a link class (``intra``: NVLink, ``inter``: the network) from :meth:`Cluster.link`:
  TP all-reduces inside a layer (Megatron: two in the forward, two in the backward, of
  ``tokens x hidden x 2`` bytes, ring cost ``2(n-1)/n``), the all-gathers of the embedding output and of the
  logits and the all-reduce of the LM head's input gradient, pipeline point-to-point of one activation or
  gradient (``tokens x hidden x 2`` bytes), data-parallel gradient synchronisation (ring all-reduce, or
  reduce-scatter + all-gather under ZeRO-1) over the slowest link of the group;
* memory: bf16 parameters and gradients, fp32 master weights and Adam ``m``/``v`` (ZeRO-1 divides these across
  the replicas holding the same layer), activations of the micro-batches in flight.

Backward costs ``backward_factor`` (2) forwards; activation recompute adds one more forward to the backward.
**Representative profiling** (:func:`profile_model`): on a CPU, bare matmuls are only about 60% of a decoder
step (RMSNorm, RoPE, SwiGLU, the attention kernel, the loss and Adam are the rest), so a matmul line underestimates
a step.  :func:`profile_model` times the real forward and backward of ONE decoder layer of the reference Llama
(:mod:`hspmd_sdk.models.reference`) at a few ``(tokens, seq_len)`` shapes, the embedding and the final norm + LM head
+ cross-entropy, and the Adam step, and fits per-operator lines ``time = a * FLOPs + b``
(:class:`OperatorProfile`, stored per device kind in ``CostModel.profiles``); these replace both
``compute_fits`` and the ``backward_factor`` for that kind.  It can also measure the local gloo link
(:func:`profile_link`: a 2-process all_reduce / send-recv run) into ``CostModel.link_overrides``, which replaces
the latency and bandwidth of a link class (``"intra"``, ``"inter"``) from :meth:`Cluster.link` -- the Cluster
presets stay as they are.  The collective is profiled the way the executor runs it, blocking, between bursts of
compute, so the link also carries the fixed cost every blocking call pays (``LinkOverride.call_latency``: waking
up and being scheduled; what made TP2, with 19 small all-reduces a step, 1.3x slower than predicted).
Everything is JSON (:meth:`CostModel.save` / :meth:`CostModel.load`).

All figures are seconds and bytes.  The efficiencies are fields of :class:`CostModel`, documented there and
overridable; nothing here is global.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # pragma: no cover
    from ..core.cluster import Cluster, DeviceSpec, Link
    from ..core.model_spec import ModelSpec

__all__ = ["CostModel", "ComputeFit", "OperatorProfile", "LinkOverride", "profile_device", "profile_model",
           "profile_link", "ring_factor", "LayerCost", "layer_cost",
           "head_cost", "embedding_cost", "static_memory", "activation_memory"]

BF16 = 2
FP32 = 4
#: bytes per parameter of the fp32 optimizer part: master weight, Adam m, Adam v.
OPTIMIZER_BYTES = 3 * FP32

#: HBM bandwidth (GB/s) of the preset device kinds, for the memory-bound optimizer step (vendor figures).
DEFAULT_HBM_GBS: dict[str, float] = {"H800": 3350.0, "H20": 4000.0, "A100": 2039.0, "H100": 3350.0,
                                     "H200": 4800.0, "cpu": 50.0}


class ComputeFit(BaseModel):
    """A profiled line ``seconds = a * flops + b`` for one device kind (from :func:`profile_device`)."""

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
    """Profiled costs of whole model operators on one device kind (from :func:`profile_model`).

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
        "from (hspmd_sdk.runtime.overhead); None: intercepts fitted on the reference")


class LinkOverride(BaseModel):
    """Measured costs of a link class, replacing :meth:`Cluster.link`'s latency and bandwidth (from
    :func:`profile_link`).  ``latency``/``bandwidth`` (s, bytes/s) cost point-to-point transfers;
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
    * ``memory_reserve_mb``: per device memory the framework holds besides tensors (CUDA context, allocator).
    * ``profiles``: per device kind, an :class:`OperatorProfile` (from :func:`profile_model`); when present it is
      the source of layer / head / embedding compute and of the optimizer time for that kind (it takes precedence
      over ``compute_fits``, ``mfu`` and ``backward_factor``).
    * ``link_overrides``: link class (``"intra"``, ``"inter"``) -> :class:`LinkOverride`, measured latency and
      bandwidth that replace the :class:`Cluster`'s for every link of that class.
    * ``comm_bytes_factor``: bytes on the wire per byte the model counts (the model counts bf16; ``2.0`` for a
      run that communicates fp32).
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
    memory_reserve_mb: float = Field(default=2048.0, ge=0)
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

    # ---- operators -----------------------------------------------------------------------------------------
    def compute_time(self, flops: float, spec: "DeviceSpec") -> float:
        """Seconds for ``flops`` of one operator on a device of ``spec`` (profiled fit if any, else analytic)."""
        if flops <= 0:
            return 0.0
        fit = self.compute_fits.get(spec.kind)
        if fit is not None:
            return fit.a * flops + fit.b
        return flops / (spec.bf16_tflops * 1e12 * self.mfu.get(spec.kind, self.default_mfu))

    def p2p_time(self, nbytes: float, link: "Link") -> float:
        """Seconds to send ``nbytes`` point-to-point over ``link``."""
        if link.cls == "self" or nbytes <= 0:
            return 0.0
        nbytes *= self.comm_bytes_factor
        o = self.link_overrides.get(link.cls)
        if o is not None:
            return self.comm_scale * (o.latency + nbytes / o.bandwidth)
        return self.comm_scale * (link.latency + nbytes / (link.bandwidth * self.p2p_efficiency))

    def collective_time(self, op: str, nbytes: float, n: int, link: "Link") -> float:
        """Seconds for a ring ``op`` (``all_reduce``, ``reduce_scatter``, ``all_gather``) of ``nbytes`` per
        device over ``n`` devices whose slowest link is ``link``."""
        if n <= 1 or nbytes <= 0 or link.cls == "self":
            return 0.0
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1
        volume = ring_factor(op, n) * nbytes * self.comm_bytes_factor
        o = self.link_overrides.get(link.cls)
        if o is not None:
            lat = o.latency if o.collective_latency is None else o.collective_latency
            bw = o.bandwidth if o.collective_bandwidth is None else o.collective_bandwidth
            return self.comm_scale * (o.call_latency + steps * lat + volume / bw)
        return self.comm_scale * (steps * link.latency + volume / (link.bandwidth * self.collective_efficiency))

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


def ring_factor(op: str, n: int) -> float:
    """Bytes each device sends per byte of its buffer in a ring collective: ``2(n-1)/n`` for all-reduce,
    ``(n-1)/n`` for reduce-scatter and all-gather."""
    if op not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"unknown collective {op!r}")
    if n <= 1:
        return 0.0
    return (2.0 if op == "all_reduce" else 1.0) * (n - 1) / n


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

    @property
    def fwd(self) -> float:
        return self.fwd_compute + self.fwd_comm

    @property
    def bwd(self) -> float:
        return self.bwd_compute + self.bwd_comm


def layer_cost(model: "ModelSpec", spec: "DeviceSpec", tp: int, tp_link: "Link", micro_batch: int,
               seq_len: int, cost: CostModel, *, recompute: bool = False) -> LayerCost:
    """One decoder layer on one device of a TP group of ``tp`` devices whose slowest link is ``tp_link``.

    Compute: ``layer_flops / tp``; with a profile and without ``cost.sequence_parallel``, plus ``1 - 1/tp`` of the
    profiled replicated part (norms and residuals, which every device of the group computes whole).  TP
    communication (Megatron): two all-reduces of ``tokens x hidden`` bf16 in the forward and two in the backward
    (two more when the backward recomputes the forward), plus the link's ``skew`` times the compute before them
    (:meth:`CostModel.collective_skew`).  Activations:
    :meth:`ModelSpec.layer_activation_bytes` divided by ``tp`` (with ``cost.sequence_parallel``; without it the
    RMSNorm inputs/outputs, ``4 * hidden`` per token, stay replicated); with ``recompute`` only the layer input
    is kept and one layer's full activations are transient.
    """
    tokens = micro_batch * seq_len
    flops = model.layer_flops(tokens, seq_len) / tp
    prof = cost.profiles.get(spec.kind)
    if prof is not None:  # profiled whole-layer lines (attention's FLOPs at their own rate where fitted)
        lin = model.layer_flops(tokens, 0) / tp
        fwd, bwd = _layer_line(prof.layer_fwd, lin, flops - lin), _layer_line(prof.layer_bwd, lin, flops - lin)
        if tp > 1 and not cost.sequence_parallel:  # norms and residuals stay whole on every device of the group
            x, share = tokens * model.hidden_size, 1.0 - 1.0 / tp
            fwd += share * _line(prof.layer_replicated_fwd, x)
            bwd += share * _line(prof.layer_replicated_bwd, x)
    else:
        fwd = cost.compute_time(flops, spec)
        bwd = cost.backward_factor * fwd
    ar = cost.collective_time("all_reduce", tokens * model.hidden_size * BF16, tp, tp_link)
    full_act = _layer_activation_bytes(model, tokens, tp, cost.sequence_parallel)
    bwd += fwd if recompute else 0.0
    skew = cost.collective_skew(tp, tp_link)  # every stretch of compute ends at one of the blocking all-reduces
    return LayerCost(
        fwd_compute=fwd, bwd_compute=bwd, fwd_comm=2 * ar + skew * fwd,
        bwd_comm=(4 if recompute else 2) * ar + skew * bwd,
        act_bytes=tokens * model.hidden_size * BF16 / (tp if cost.sequence_parallel else 1) if recompute
        else full_act,
        transient_bytes=full_act if recompute else 0.0,
        params=model.layer_param_count() / tp)


def _line(fit: ComputeFit, x: float) -> float:
    return fit.a * x + fit.b if x > 0 else 0.0


def _layer_line(fit: ComputeFit, matmul: float, attention: float) -> float:
    """A layer's profiled seconds: ``a * matmul FLOPs + c * attention FLOPs + b`` (``c`` = ``a`` when not fitted)."""
    if matmul + attention <= 0:
        return 0.0
    return fit.a * matmul + (fit.a if fit.c is None else fit.c) * attention + fit.b


def _layer_activation_bytes(model: "ModelSpec", tokens: int, tp: int, sequence_parallel: bool) -> float:
    total = model.layer_activation_bytes(tokens)  # no TP
    if sequence_parallel:
        return total / tp
    replicated = tokens * 4 * model.hidden_size * BF16
    return replicated + (total - replicated) / tp


def embedding_cost(model: "ModelSpec", spec: "DeviceSpec", tp: int, tp_link: "Link", micro_batch: int,
                   seq_len: int, cost: CostModel) -> LayerCost:
    """The token embedding, split along hidden in a TP group (as :func:`~hspmd_sdk.core.strategy_plan.
    plan_from_strategy` lays it out): no FLOPs to speak of, one all-gather of its ``tokens x hidden`` output in the
    forward (its backward is a local split)."""
    if not cost.include_embedding:
        return LayerCost()
    tokens = micro_batch * seq_len
    ar = cost.collective_time("all_gather", tokens * model.hidden_size * BF16, tp, tp_link)
    prof = cost.profiles.get(spec.kind)
    # profiled: the embedding's forward + backward, put in the backward (the forward is a gather)
    bwd = _line(prof.embed, tokens * model.hidden_size / tp) if prof is not None else 0.0
    return LayerCost(fwd_comm=ar, bwd_compute=bwd, params=model.embedding_param_count() / tp)


def head_cost(model: "ModelSpec", spec: "DeviceSpec", tp: int, tp_link: "Link", micro_batch: int,
              seq_len: int, cost: CostModel) -> LayerCost:
    """Final RMSNorm, the vocab-parallel LM head and the cross-entropy loss.

    The fp32 logits (``tokens x vocab / tp``) are transient: the loss and its gradient are computed right
    after the forward of the last stage.  TP communication as :func:`~hspmd_sdk.core.strategy_plan.
    plan_from_strategy` lays it out: the logits are all-gathered (``tokens x vocab``) in the forward, and the
    gradient of the head's (Duplicate) input is all-reduced (``tokens x hidden``) in the backward."""
    if not cost.include_embedding:
        return LayerCost()
    tokens = micro_batch * seq_len
    flops = model.head_flops(tokens) / tp
    prof = cost.profiles.get(spec.kind)
    if prof is not None:
        fwd, bwd = _line(prof.head_fwd, flops), _line(prof.head_bwd, flops)
    else:
        fwd = cost.compute_time(flops, spec)
        bwd = cost.backward_factor * fwd
    skew = cost.collective_skew(tp, tp_link)  # the logits' gather waits for the head, the input's all-reduce too
    fwd_comm = cost.collective_time("all_gather", tokens * model.vocab_size * BF16, tp, tp_link) + skew * fwd
    bwd_comm = cost.collective_time("all_reduce", tokens * model.hidden_size * BF16, tp, tp_link) + skew * bwd
    return LayerCost(fwd_compute=fwd, bwd_compute=bwd, fwd_comm=fwd_comm, bwd_comm=bwd_comm,
                     act_bytes=tokens * model.hidden_size * BF16,
                     transient_bytes=2 * tokens * model.vocab_size * FP32 / tp,
                     params=model.head_param_count() / tp)


def static_memory(params: float, zero_shards: float) -> dict[str, float]:
    """Bytes for ``params`` parameters held by a device: bf16 weights and gradients, and the fp32 optimizer part
    (master weights, Adam m and v) divided by ``zero_shards`` (1 without ZeRO-1)."""
    return {"params": params * BF16, "grads": params * BF16,
            "optimizer": params * OPTIMIZER_BYTES / max(zero_shards, 1.0)}


def activation_memory(per_micro_batch: float, in_flight: int, transient: float) -> float:
    """Peak activation bytes: ``in_flight`` micro-batches of kept activations plus the largest transient."""
    return per_micro_batch * in_flight + transient


# ---- profiling --------------------------------------------------------------------------------------------
DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = (
    (128, 128, 128), (256, 256, 256), (256, 512, 256), (512, 512, 512), (512, 1024, 512), (1024, 1024, 512),
    (1024, 1024, 1024))


def profile_device(device: str = "cpu", shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES, *,
                   kind: str | None = None, dtype: str = "float32", repeats: int = 5,
                   base: CostModel | None = None) -> CostModel:
    """Measure matmul throughput on ``device`` and return ``base`` with a fitted :class:`ComputeFit`.

    Times ``repeats`` runs of ``(m, k) @ (k, n)`` for each of ``shapes`` (median), and fits
    ``seconds = a * flops + b`` by least squares over ``flops = 2 m n k``.  The fit is stored under ``kind``
    (default: ``device``, e.g. ``"cpu"``) so that :meth:`CostModel.compute_time` uses it for devices of that kind.
    Imports torch here only.  Takes about a second on a CPU with the default shapes.
    """
    import torch

    dt = getattr(torch, dtype)
    flops, secs = [], []
    for m, k, n in shapes:
        x = torch.randn(m, k, dtype=dt, device=device)
        w = torch.randn(k, n, dtype=dt, device=device)
        (x @ w).sum()  # warm-up
        runs = []
        for _ in range(repeats):
            _sync(torch, device)
            t0 = time.perf_counter()
            x @ w
            _sync(torch, device)
            runs.append(time.perf_counter() - t0)
        runs.sort()
        flops.append(2.0 * m * n * k)
        secs.append(runs[len(runs) // 2])
    fit = _fit_line(flops, secs)
    fit = fit.model_copy(update={"device": device, "dtype": dtype})
    base = base or CostModel()
    return base.model_copy(update={"compute_fits": {**base.compute_fits, kind or device: fit}})


def _sync(torch: object, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # type: ignore[attr-defined]


def _fit_line(xs: Iterable[float], ys: Iterable[float]) -> ComputeFit:
    """Least squares ``y = a x + b`` with ``a, b >= 0`` (a negative intercept is clamped to 0 and ``a`` refit)."""
    xs, ys = list(xs), list(ys)
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    b = my - a * mx
    if b < 0 or a <= 0:
        b = max(b, 0.0) if a > 0 else my
        a = max(sum(x * (y - b) for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0)
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (a * x + b)) ** 2 for x, y in zip(xs, ys))
    return ComputeFit(a=a, b=b, r2=1 - ss_res / ss_tot if ss_tot > 0 else None)


def _fit_plane(x1: Sequence[float], x2: Sequence[float], ys: Sequence[float]) -> ComputeFit:
    """Least squares ``y = a x1 + c x2 + b`` with ``a, c, b >= 0`` (a coefficient that comes out negative is
    dropped and the rest refit); ``c`` is ``None`` when ``x2`` does not vary independently of ``x1``."""
    import numpy as np

    X = np.column_stack([np.asarray(x1, float), np.asarray(x2, float), np.ones(len(ys))])
    y = np.asarray(ys, float)
    if np.linalg.matrix_rank(X) < 3:
        f = _fit_line([a + b for a, b in zip(x1, x2)], ys)
        return f
    keep = [0, 1, 2]
    while True:
        coef = np.zeros(3)
        coef[keep] = np.linalg.lstsq(X[:, keep], y, rcond=None)[0]
        bad = [k for k in keep if coef[k] < 0]
        if not bad:
            break
        keep.remove(min(bad, key=lambda k: coef[k]))
        if not keep:
            break
    a, c, b = (float(max(v, 0.0)) for v in coef)
    res, tot = float(((X @ np.array([a, c, b]) - y) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    return ComputeFit(a=a, b=b, c=c, r2=1 - res / tot if tot > 0 else None)


# ---- representative profiling -----------------------------------------------------------------------------------
def profile_model(config: "ModelSpec | str", device: str = "cpu", threads: int | None = 1, *,
                  shapes: Sequence[tuple[int, int]] | None = None, kind: str | None = None, repeats: int = 5,
                  link: bool = False, link_class: str = "intra", backend: str = "gloo",
                  base: CostModel | None = None, executor: bool = True) -> CostModel:
    """Profile whole operators of ``config``'s reference Llama on ``device`` and return ``base`` with an
    :class:`OperatorProfile` under ``kind`` (default ``device``) in ``CostModel.profiles``.

    Times (median of ``repeats`` sweeps over the shapes, after a warm-up sweep) the forward and the backward of
    ONE decoder layer of the model's single-device reference (``block(0, h)``; for Llama: RMSNorm, RoPE, attention
    via ``scaled_dot_product_attention``, SwiGLU, residuals), its final norm + LM head + cross-entropy, and the
    embedding forward + backward, at each ``(tokens, seq_len)`` of ``shapes`` (default: 1, 2, 4 and 8 sequences of
    ``s0 = min(max_seq_len, 128)`` tokens, and ``8 * s0`` tokens as sequences of ``2, 4, 8 x s0`` as far as
    ``max_seq_len`` allows), and fits ``seconds = a * FLOPs + b`` per operator over the FLOPs the cost model counts
    (:meth:`ModelSpec.layer_flops`, :meth:`ModelSpec.head_flops`); when the shapes span several sequence lengths
    the layer lines are ``a * matmul FLOPs + c * attention FLOPs + b`` (attention's FLOPs, the part of
    ``layer_flops`` that grows with the sequence, run at their own rate: a CPU's fused attention kernel is not a
    matmul).  Tensor parallelism is costed by dividing the FLOPs by the TP degree and reading the same line.
    The Adam step (fp32, the ranks' kernel: :meth:`~hspmd_sdk.runtime.executor.AdamConfig.build`) is timed on
    the layer's parameters: seconds per parameter.  ``threads``: torch threads while profiling (each runtime
    worker runs with 1; ``None`` leaves the setting alone).

    It also times the layer's two norms and residual adds alone (``layer_replicated_*``: what TP without
    sequence parallelism computes whole on every device of the group).

    ``executor=True`` (default) then sets the lines' intercepts to the fixed cost per micro-batch that the SDK's
    executor itself pays (:func:`hspmd_sdk.runtime.overhead.with_executor_overhead`: a one-rank executor of the
    model with one and two layers on tiny micro-batches): fitted on the reference at 128+ tokens the intercept is
    an extrapolation, and on a CPU the executor's per-micro-batch cost is milliseconds, which a planner that
    splits steps into micro-batches must see.  ``False`` keeps the reference's fitted intercepts.

    With ``link=True`` it also runs :func:`profile_link` (``backend``, 2 local processes) and stores the result in
    ``link_overrides[link_class]``, with ``comm_bytes_factor = 2`` (the runtime communicates fp32, the model
    counts bf16).  The run is fp32 (the reference model's dtype).  Takes a few seconds for a small model.
    """
    import torch
    import torch.nn.functional as F

    from ..models.registry import load_model_spec

    config = load_model_spec(config)
    seq = min(config.max_seq_len, 128)
    longer = [seq * 2 ** k for k in range(1, 4) if seq * 2 ** k <= config.max_seq_len]  # attention's own rate
    shapes = [tuple(s) for s in (shapes or [(seq * k, seq) for k in (1, 2, 4, 8)] + [(seq * 8, x) for x in longer])]
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        ref = config.with_layers(1).build_reference(seed=0).to(device)
        layer = ref.layers[0]
        c = config

        def layer_fwd(h: "torch.Tensor") -> "torch.Tensor":
            return ref.block(0, h)

        def replicated_fwd(h: "torch.Tensor") -> "torch.Tensor":  # what TP does not divide (norms, residuals)
            return ref.replicated(0, h)

        def head_fwd(h: "torch.Tensor", targets: "torch.Tensor") -> "torch.Tensor":
            logits = ref.head(h)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

        inputs = []
        for tokens, s in shapes:
            b = max(1, tokens // s)
            inputs.append((b, s, torch.randn(b, s, c.hidden_size, device=device),
                           torch.randint(0, c.vocab_size, (b, s), device=device)))
        # sweeps over all shapes, repeated (a warm-up sweep first), so that a change of background load hits every
        # shape alike instead of biasing the slope or the intercept; median per shape.
        samples: list[list[list[float]]] = [[[] for _ in range(8)] for _ in inputs]
        for sweep in range(repeats + 1):
            for i, (b, s, h0, tg) in enumerate(inputs):
                t = (_time_fwd_bwd(torch, device, lambda: layer_fwd(h0.clone().requires_grad_()))
                     + _time_fwd_bwd(torch, device, lambda: head_fwd(h0.clone().requires_grad_(), tg))
                     + _time_fwd_bwd(torch, device, lambda: ref.embed_tokens(tg))
                     + _time_fwd_bwd(torch, device, lambda: replicated_fwd(h0.clone().requires_grad_())))
                if sweep:
                    for j in range(8):
                        samples[i][j].append(t[j])
        rows: dict[str, list[tuple[float, float]]] = {k: [] for k in ("lf", "lb", "hf", "hb", "e", "rf", "rb")}
        split: list[tuple[float, float]] = []  # per shape: (matmul FLOPs, attention FLOPs) of the layer
        for (b, s, _, _), smp in zip(inputs, samples):
            lf, lb, hf, hb, ef, eb, rf, rb = (sorted(x)[len(x) // 2] for x in smp)
            n = b * s
            split.append((float(c.layer_flops(n, 0)), float(c.layer_flops(n, s) - c.layer_flops(n, 0))))
            rows["lf"].append((c.layer_flops(n, s), lf))
            rows["lb"].append((c.layer_flops(n, s), lb))
            rows["hf"].append((c.head_flops(n), hf))
            rows["hb"].append((c.head_flops(n), hb))
            rows["e"].append((n * c.hidden_size, ef + eb))
            rows["rf"].append((n * c.hidden_size, rf))
            rows["rb"].append((n * c.hidden_size, rb))
        ref.zero_grad(set_to_none=True)
        params = list(layer.parameters())
        for p in params:
            p.grad = torch.randn_like(p)
        from ..runtime.executor import AdamConfig  # the kernel the ranks run

        opt = AdamConfig().build(params)
        opt.step()  # warm-up (allocates the state)
        runs = []
        for _ in range(repeats):
            _sync(torch, device)
            t0 = time.perf_counter()
            opt.step()
            _sync(torch, device)
            runs.append(time.perf_counter() - t0)
        adam = sorted(runs)[len(runs) // 2] / sum(p.numel() for p in params)
    finally:
        if threads is not None:
            torch.set_num_threads(old)

    def fit(key: str) -> ComputeFit:
        f = _fit_line([x for x, _ in rows[key]], [y for _, y in rows[key]])
        return f.model_copy(update={"device": device, "dtype": "float32"})

    def fit_layer(key: str) -> ComputeFit:  # attention at its own rate when the shapes span sequence lengths
        if len({s for _, s in shapes}) < 2:
            return fit(key)
        f = _fit_plane([m for m, _ in split], [a for _, a in split], [y for _, y in rows[key]])
        return f.model_copy(update={"device": device, "dtype": "float32"})

    prof = OperatorProfile(layer_fwd=fit_layer("lf"), layer_bwd=fit_layer("lb"), head_fwd=fit("hf"), head_bwd=fit("hb"),
                           embed=fit("e"), layer_replicated_fwd=fit("rf"), layer_replicated_bwd=fit("rb"),
                           optimizer_s_per_param=adam, shapes=[(int(t), int(s)) for t, s in shapes],
                           threads=threads, model=config.name or "",
                           points={k: [(float(x), float(y)) for x, y in v] for k, v in rows.items()})
    base = base or CostModel()
    update: dict = {"profiles": {**base.profiles, kind or device: prof}}
    if link:
        update["link_overrides"] = {**base.link_overrides, link_class: profile_link(backend=backend)}
        update["comm_bytes_factor"] = 2.0
    out = base.model_copy(update=update)
    if executor:
        from ..runtime.overhead import with_executor_overhead  # the runtime measures its own fixed cost

        try:
            out = with_executor_overhead(out, config, kind or device, device=device, threads=threads)
        except Exception as e:  # noqa: BLE001 - a model the one-rank probe cannot run keeps the reference's fit
            import warnings

            warnings.warn(f"profile_model: the executor's fixed cost per micro-batch could not be measured for "
                          f"{config.name or type(config).__name__} ({type(e).__name__}: {e}); the intercepts stay "
                          "the reference's fit (executor=False)", RuntimeWarning, stacklevel=2)
    return out


def _time_fwd_bwd(torch: object, device: str, fwd: "object") -> tuple[float, float]:
    """Forward and backward seconds of one run of ``fwd()`` (a tensor; backward with a ones gradient)."""
    _sync(torch, device)
    t0 = time.perf_counter()
    out = fwd()  # type: ignore[operator]
    _sync(torch, device)
    t1 = time.perf_counter()
    out.backward(torch.ones_like(out))  # type: ignore[attr-defined]
    _sync(torch, device)
    return t1 - t0, time.perf_counter() - t1


#: message sizes (bytes) of :func:`profile_link`.
LINK_SIZES: tuple[int, ...] = (4 * 1024, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
#: in-context all-reduces per size in one sweep of :func:`collective_sweep`.
CONTEXT_ITERS = 8


def profile_link(backend: str = "gloo", sizes: Sequence[int] = LINK_SIZES, *, repeats: int = 10,
                 timeout_s: float = 60.0, compute_s: float = 2e-3, skew_compute_s: float | None = None,
                 procs: int = 2) -> LinkOverride:
    """Measure the link between local processes with ``backend`` (default gloo over loopback).

    Spawns ``procs`` processes (``torch.multiprocessing``, ``init_process_group(timeout=...)`` on a free local
    port) working in pairs ``(0, 1), (2, 3), ...`` at the same time (``procs > 2`` measures the link with that
    many ranks sharing the node's cores).  For each of ``sizes`` (bytes of fp32 buffers) it times

    * ``repeats`` ping-pongs (``send``/``recv``; one way = half the round trip) and back-to-back 2-rank
      ``all_reduce``s, each after a barrier (median): the link's floor;
    * in context (``compute_s > 0``): ``repeats`` sweeps of :func:`collective_sweep` -- the all-reduce the way the
      executor issues a TP all-reduce, after about ``compute_s`` of compute, copy in and out included; the mean
      of a sweep (what a step pays, tail included), median over sweeps;
    * the same after ``skew_compute_s`` of compute (default ``4 * compute_s``; ``0``: not measured, ``skew`` 0).

    and fits ``seconds = latency + bytes / bandwidth`` to each (:func:`fit_link`): p2p -> ``latency``,
    ``bandwidth``; a 2-rank ring all-reduce is 2 steps of half the buffer each, so the back-to-back line ``c + bytes
    * d`` gives the per-step ``collective_latency = c / 2``; the in-context line ``c' + bytes * d'`` gives
    ``call_latency = c' - c`` and ``collective_bandwidth = 1 / d'``; the longer compute's line ``c''`` gives
    ``skew = (c'' - c') / (skew_compute_s - compute_s)`` (the wait that grows with the compute before a call), and
    ``call_latency`` is then ``c' - c - skew * compute_s``.  The members agree on the number of matmuls of each
    burst (the largest), so they do the same work.  Takes a few seconds (process start-up, imports; the skew's
    sweeps add ``repeats * len(sizes) * 8`` calls after ``skew_compute_s`` each, ~2.6 s by default).
    """
    import socket

    import torch.multiprocessing as mp

    if procs < 2 or procs % 2:
        raise ValueError(f"procs must be an even number >= 2, got {procs}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    if skew_compute_s is None:
        skew_compute_s = 4 * compute_s
    if compute_s > 0 and skew_compute_s and not skew_compute_s > compute_s:
        raise ValueError(f"profile_link: skew_compute_s must exceed compute_s (got {skew_compute_s} and {compute_s}; "
                         f"0 measures no skew)")
    lengths = [compute_s] + ([skew_compute_s] if skew_compute_s else []) if compute_s > 0 else []
    args = (port, backend, list(sizes), repeats, timeout_s, lengths, procs, q)
    workers = [ctx.Process(target=_link_worker, args=(r, *args)) for r in range(procs)]
    for w in workers:
        w.start()
    try:
        res = q.get(timeout=timeout_s * 4)
    finally:
        for w in workers:
            w.join(timeout=timeout_s)
            if w.is_alive():
                w.terminate()
    if isinstance(res, str):
        raise RuntimeError(f"profile_link failed: {res}")
    in_context = res.get("in_context") or []
    return fit_link(sizes, res["p2p"], res["all_reduce"], in_context[0] if in_context else None, backend=backend,
                    in_context_long=in_context[1] if len(in_context) > 1 else None,
                    compute_s=(compute_s, skew_compute_s) if len(in_context) > 1 else None)


def fit_link(sizes: Sequence[int], p2p: Sequence[float], all_reduce: Sequence[float],
             in_context: Sequence[float] | None = None, *, backend: str = "",
             in_context_long: Sequence[float] | None = None,
             compute_s: tuple[float, float] | None = None) -> LinkOverride:
    """The :class:`LinkOverride` of measured seconds per size (bytes): one-way point-to-point, back-to-back 2-rank
    all-reduce and (optional) in-context 2-rank all-reduce after ``compute_s[0]`` seconds of compute, and after
    ``compute_s[1]`` (``in_context_long``: gives ``skew``; see :func:`profile_link`)."""
    if in_context_long is not None and in_context is None:
        raise ValueError("fit_link: in_context_long needs in_context (the shorter compute's sweep) too")
    p = _fit_line(sizes, p2p)
    ar = _fit_line(sizes, all_reduce)
    update: dict = {}
    if in_context is not None:
        ctx = _fit_line(sizes, in_context)
        update = {"call_latency": max(0.0, ctx.b - ar.b), "collective_bandwidth": 1.0 / ctx.a if ctx.a > 0 else 1e12}
        if in_context_long is not None:
            if compute_s is None or not compute_s[1] > compute_s[0]:
                raise ValueError(f"fit_link: in_context_long needs compute_s=(short, long) with long > short, got "
                                 f"{compute_s}")
            skew = max(0.0, (_fit_line(sizes, in_context_long).b - ctx.b) / (compute_s[1] - compute_s[0]))
            update.update(skew=skew, call_latency=max(0.0, ctx.b - ar.b - skew * compute_s[0]))
    return LinkOverride(latency=p.b, bandwidth=1.0 / p.a if p.a > 0 else 1e12, collective_latency=ar.b / 2,
                        collective_bandwidth=update.get("collective_bandwidth", 1.0 / ar.a if ar.a > 0 else 1e12),
                        call_latency=update.get("call_latency", 0.0), skew=update.get("skew", 0.0),
                        backend=backend)


def collective_sweep(sizes: Sequence[int], group: object = None, *, compute_s: float = 0.0,
                     iters: int = CONTEXT_ITERS) -> list[float]:
    """Seconds of a blocking ``all_reduce`` of an fp32 buffer of each of ``sizes`` bytes on ``group`` (a
    torch.distributed group this process belongs to; ``None``: the world), called by every member.

    ``compute_s > 0``: each call is issued the way the executor issues a TP all-reduce -- after about
    ``compute_s`` of matmuls, copying the input into the buffer and the result out -- and the mean of ``iters``
    calls is returned per size (the calls' tail is what a step pays).  ``compute_s == 0``: back to back, each call
    after a barrier, median of ``iters``.  Used by :func:`profile_link` and, inside a running job, by
    ``benchmarks/bench_calibration.py`` (so the link is measured under the same load as the steps)."""
    import torch
    import torch.distributed as dist

    a = torch.randn(256, 256)
    bursts = 0
    if compute_s > 0:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ a
        bursts = max(1, round(compute_s / ((time.perf_counter() - t0) / 4)))
        agreed = torch.tensor([bursts])  # every member does the same work, as TP ranks do
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        bursts = int(agreed)
    out = []
    for size in sizes:
        x = torch.randn(max(1, size // 4))
        runs = []
        for _ in range(iters):
            if bursts:
                for _ in range(bursts):
                    a @ a
            else:
                dist.barrier(group=group)
            t0 = time.perf_counter()
            y = x.contiguous().clone()
            dist.all_reduce(y, group=group)
            y = y[:].clone()
            runs.append(time.perf_counter() - t0)
        out.append(sum(runs) / len(runs) if bursts else sorted(runs)[len(runs) // 2])
    return out


def _link_worker(rank: int, port: int, backend: str, sizes: list[int], repeats: int, timeout_s: float,
                 lengths: list[float], procs: int, q: object) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=procs,
                                timeout=datetime.timedelta(seconds=timeout_s))
        pairs = [dist.new_group([i, i + 1]) for i in range(0, procs, 2)] if procs > 2 else [None]
        pg = pairs[rank // 2]
        peer = rank ^ 1
        out: dict[str, list] = {"p2p": [], "all_reduce": []}
        for size in sizes:
            t = torch.zeros(max(1, size // 4), dtype=torch.float32)
            pp = []
            for i in range(repeats + 1):
                dist.barrier(group=pg)
                t0 = time.perf_counter()
                if rank % 2 == 0:
                    dist.send(t, peer)
                    dist.recv(t, peer)
                else:
                    dist.recv(t, peer)
                    dist.send(t, peer)
                if i:
                    pp.append((time.perf_counter() - t0) / 2)
            out["p2p"].append(sorted(pp)[len(pp) // 2])
        collective_sweep(sizes, pg, iters=2)  # warm-up
        out["all_reduce"] = collective_sweep(sizes, pg, iters=repeats)
        out["in_context"] = []
        for compute_s in lengths:  # in context, after each length of compute
            collective_sweep(sizes, pg, compute_s=compute_s, iters=2)  # warm-up
            sweeps = [collective_sweep(sizes, pg, compute_s=compute_s) for _ in range(repeats)]
            out["in_context"].append([sorted(col)[len(col) // 2] for col in zip(*sweeps)])
        if rank == 0:
            q.put(out)  # type: ignore[attr-defined]
        dist.destroy_process_group()
    except Exception as e:  # pragma: no cover - reported to the parent
        if rank == 0:
            q.put(f"{type(e).__name__}: {e}")  # type: ignore[attr-defined]
