"""The operator-centric cost model (§8, Appendix A.1).

Every estimate is built from a few operators, each costed on one hardware resource:

* compute of a decoder layer (and of the embedding / LM head) on a device kind, for a tensor-parallel (TP)
  degree, micro-batch size and sequence length: ``FLOPs / TP`` divided by the device's peak bf16 throughput
  times a model-FLOPs utilisation (**analytic**), or a fitted line ``time = a * FLOPs + b`` (**profiled**, see
  :func:`profile_device`);
* communication on a link class (``intra``: NVLink, ``inter``: the network) from :meth:`Cluster.link`:
  TP all-reduces inside a layer (Megatron: two in the forward, two in the backward, of
  ``tokens x hidden x 2`` bytes, ring cost ``2(n-1)/n``), pipeline point-to-point of one activation or
  gradient (``tokens x hidden x 2`` bytes), data-parallel gradient synchronisation (ring all-reduce, or
  reduce-scatter + all-gather under ZeRO-1) over the slowest link of the group;
* memory: bf16 parameters and gradients, fp32 master weights and Adam ``m``/``v`` (ZeRO-1 divides these across
  the replicas holding the same layer), activations of the micro-batches in flight.

Backward costs ``backward_factor`` (2) forwards; activation recompute adds one more forward to the backward.
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
    from ..core.model_config import LlamaConfig

__all__ = ["CostModel", "ComputeFit", "profile_device", "ring_factor", "LayerCost", "layer_cost",
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
    device: str = ""
    dtype: str = ""
    r2: float | None = None

    @property
    def tflops(self) -> float:
        """The throughput the slope implies, in TFLOPS."""
        return 1e-12 / self.a if self.a > 0 else float("inf")


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
        return self.comm_scale * (link.latency + nbytes / (link.bandwidth * self.p2p_efficiency))

    def collective_time(self, op: str, nbytes: float, n: int, link: "Link") -> float:
        """Seconds for a ring ``op`` (``all_reduce``, ``reduce_scatter``, ``all_gather``) of ``nbytes`` per
        device over ``n`` devices whose slowest link is ``link``."""
        if n <= 1 or nbytes <= 0 or link.cls == "self":
            return 0.0
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1
        volume = ring_factor(op, n) * nbytes
        return self.comm_scale * (steps * link.latency + volume / (link.bandwidth * self.collective_efficiency))

    def optimizer_time(self, params: float, spec: "DeviceSpec") -> float:
        """Seconds for the Adam update of ``params`` parameters (memory-bound)."""
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


def layer_cost(model: "LlamaConfig", spec: "DeviceSpec", tp: int, tp_link: "Link", micro_batch: int,
               seq_len: int, cost: CostModel, *, recompute: bool = False) -> LayerCost:
    """One decoder layer on one device of a TP group of ``tp`` devices whose slowest link is ``tp_link``.

    Compute: ``layer_flops / tp``.  TP communication (Megatron): two all-reduces of ``tokens x hidden`` bf16
    in the forward and two in the backward (two more when the backward recomputes the forward).  Activations:
    :meth:`LlamaConfig.layer_activation_bytes` divided by ``tp`` (with ``cost.sequence_parallel``; without it the
    RMSNorm inputs/outputs, ``4 * hidden`` per token, stay replicated); with ``recompute`` only the layer input
    is kept and one layer's full activations are transient.
    """
    tokens = micro_batch * seq_len
    fwd = cost.compute_time(model.layer_flops(tokens, seq_len) / tp, spec)
    ar = cost.collective_time("all_reduce", tokens * model.hidden_size * BF16, tp, tp_link)
    full_act = _layer_activation_bytes(model, tokens, tp, cost.sequence_parallel)
    bwd = cost.backward_factor * fwd + (fwd if recompute else 0.0)
    return LayerCost(
        fwd_compute=fwd, bwd_compute=bwd, fwd_comm=2 * ar, bwd_comm=(4 if recompute else 2) * ar,
        act_bytes=tokens * model.hidden_size * BF16 / (tp if cost.sequence_parallel else 1) if recompute
        else full_act,
        transient_bytes=full_act if recompute else 0.0,
        params=model.layer_param_count() / tp)


def _layer_activation_bytes(model: "LlamaConfig", tokens: int, tp: int, sequence_parallel: bool) -> float:
    total = model.layer_activation_bytes(tokens)  # no TP
    if sequence_parallel:
        return total / tp
    replicated = tokens * 4 * model.hidden_size * BF16
    return replicated + (total - replicated) / tp


def embedding_cost(model: "LlamaConfig", spec: "DeviceSpec", tp: int, tp_link: "Link", micro_batch: int,
                   seq_len: int, cost: CostModel) -> LayerCost:
    """The vocab-parallel token embedding: no FLOPs to speak of, one all-reduce of its output."""
    if not cost.include_embedding:
        return LayerCost()
    tokens = micro_batch * seq_len
    ar = cost.collective_time("all_reduce", tokens * model.hidden_size * BF16, tp, tp_link)
    return LayerCost(fwd_comm=ar, params=model.embedding_param_count() / tp)


def head_cost(model: "LlamaConfig", spec: "DeviceSpec", tp: int, tp_link: "Link", micro_batch: int,
              seq_len: int, cost: CostModel) -> LayerCost:
    """Final RMSNorm, the vocab-parallel LM head and the cross-entropy loss.

    The fp32 logits (``tokens x vocab / tp``) are transient: the loss and its gradient are computed right
    after the forward of the last stage."""
    if not cost.include_embedding:
        return LayerCost()
    tokens = micro_batch * seq_len
    fwd = cost.compute_time(model.head_flops(tokens) / tp, spec)
    return LayerCost(fwd_compute=fwd, bwd_compute=cost.backward_factor * fwd,
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

