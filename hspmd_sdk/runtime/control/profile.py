"""Measuring the hardware for the cost model (§8): the runtime times what the planner prices.

:func:`profile_device` fits a matmul line, :func:`profile_model` times whole operators of a model's single-device
reference (and, with ``executor=True``, the executor's own fixed cost: :mod:`.overhead`), :func:`profile_link`
measures the local link with real process groups (:func:`collective_sweep` inside a running job too).  Each
returns a :class:`~hspmd_sdk.planner.CostModel` value -- the planner reads it and imports nothing of the runtime.
Imports torch when called.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

from ...planner.cost import ComputeFit, CostModel, LinkOverride, OperatorProfile, fit_line, fit_plane, fit_link
from ...models.registry import load_model_spec
from .overhead import with_executor_overhead  # the runtime measures its own fixed cost

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ...core.model_spec import ModelSpec

__all__ = ["profile_device", "profile_model", "profile_link", "collective_sweep", "DEFAULT_SHAPES", "LINK_SIZES"]


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
    fit = fit_line(flops, secs)
    fit = fit.model_copy(update={"device": device, "dtype": dtype})
    base = base or CostModel()
    return base.model_copy(update={"compute_fits": {**base.compute_fits, kind or device: fit}})


def _sync(torch: object, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # type: ignore[attr-defined]


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
    The Adam step (fp32, the ranks' kernel: :meth:`~hspmd_sdk.runtime.workers.executor.AdamConfig.build`) is timed on
    the layer's parameters: seconds per parameter.  ``threads``: torch threads while profiling (each runtime
    worker runs with 1; ``None`` leaves the setting alone).

    It also times the layer's two norms and residual adds alone (``layer_replicated_*``: what TP without
    sequence parallelism computes whole on every device of the group).

    ``executor=True`` (default) then sets the lines' intercepts to the fixed cost per micro-batch that the SDK's
    executor itself pays (:func:`hspmd_sdk.runtime.control.overhead.with_executor_overhead`: a one-rank executor of the
    model with one and two layers on tiny micro-batches): fitted on the reference at 128+ tokens the intercept is
    an extrapolation, and on a CPU the executor's per-micro-batch cost is milliseconds, which a planner that
    splits steps into micro-batches must see.  ``False`` keeps the reference's fitted intercepts.

    With ``link=True`` it also runs :func:`profile_link` (``backend``, 2 local processes) and stores the result in
    ``link_overrides[link_class]``, with ``comm_bytes_factor = 2`` (the runtime communicates fp32, the model
    counts bf16).  The run is fp32 (the reference model's dtype).  Takes a few seconds for a small model.
    """
    import torch

    config = load_model_spec(config)
    seq = min(config.max_seq_len, 128)
    longer = [seq * 2 ** k for k in range(1, 4) if seq * 2 ** k <= config.max_seq_len]  # attention's own rate
    shapes = [tuple(s) for s in (shapes or [(seq * k, seq) for k in (1, 2, 4, 8)] + [(seq * 8, x) for x in longer])]
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        ref = config.with_layers(1).build_reference(seed=0).to(device)
        rows, split = _operator_rows(config, ref, shapes, device, repeats)
        adam = _adam_seconds_per_param(list(ref.layers[0].parameters()), device, repeats)
    finally:
        if threads is not None:
            torch.set_num_threads(old)
    prof = _fitted_profile(rows, split, shapes, device, adam=adam, threads=threads, model=config.name or "")
    base = base or CostModel()
    update: dict = {"profiles": {**base.profiles, kind or device: prof}}
    if link:
        update["link_overrides"] = {**base.link_overrides, link_class: profile_link(backend=backend)}
        update["comm_bytes_factor"] = 2.0
    out = base.model_copy(update=update)
    if executor:
        try:
            out = with_executor_overhead(out, config, kind or device, device=device, threads=threads)
        except Exception as e:  # noqa: BLE001 - a model the one-rank probe cannot run keeps the reference's fit
            import warnings

            warnings.warn(f"profile_model: the executor's fixed cost per micro-batch could not be measured for "
                          f"{config.name or type(config).__name__} ({type(e).__name__}: {e}); the intercepts stay "
                          "the reference's fit (executor=False)", RuntimeWarning, stacklevel=2)
    return out


Rows = dict[str, list[tuple[float, float]]]


def _operator_rows(c: "ModelSpec", ref: "torch.nn.Module", shapes: Sequence[tuple[int, int]], device: str,
                   repeats: int) -> tuple[Rows, list[tuple[float, float]]]:
    """Per operator (``lf``/``lb`` a layer's forward and backward, ``hf``/``hb`` the head's, ``e`` the embedding,
    ``rf``/``rb`` the layer's replicated part), ``(FLOPs or elements, median seconds)`` at each of ``shapes`` on the
    one-layer reference ``ref``; and per shape the layer's ``(matmul FLOPs, attention FLOPs)``."""
    import torch
    import torch.nn.functional as F

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
            t = (_time_fwd_bwd(torch, device, lambda: ref.block(0, h0.clone().requires_grad_()))
                 + _time_fwd_bwd(torch, device, lambda: head_fwd(h0.clone().requires_grad_(), tg))
                 + _time_fwd_bwd(torch, device, lambda: ref.embed_tokens(tg))
                 # what TP does not divide (norms, residuals)
                 + _time_fwd_bwd(torch, device, lambda: ref.replicated(0, h0.clone().requires_grad_())))
            if sweep:
                for j in range(8):
                    samples[i][j].append(t[j])
    rows: Rows = {k: [] for k in ("lf", "lb", "hf", "hb", "e", "rf", "rb")}
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
    return rows, split


def _adam_seconds_per_param(params: list["torch.nn.Parameter"], device: str, repeats: int) -> float:
    """The median seconds per parameter of the ranks' Adam kernel stepping ``params`` (random gradients)."""
    import torch

    from ..workers.executor import AdamConfig  # lazy: torch (executor); the kernel the ranks run

    for p in params:
        p.grad = torch.randn_like(p)
    opt = AdamConfig().build(params)
    opt.step()  # warm-up (allocates the state)
    runs = []
    for _ in range(repeats):
        _sync(torch, device)
        t0 = time.perf_counter()
        opt.step()
        _sync(torch, device)
        runs.append(time.perf_counter() - t0)
    return sorted(runs)[len(runs) // 2] / sum(p.numel() for p in params)


def _fitted_profile(rows: Rows, split: list[tuple[float, float]], shapes: Sequence[tuple[int, int]], device: str,
                    *, adam: float, threads: int | None, model: str) -> OperatorProfile:
    """The :class:`OperatorProfile` of the timed ``rows``: a line per operator, the layer's a plane (matmul and
    attention FLOPs) when the shapes span several sequence lengths."""

    def fit(key: str) -> ComputeFit:
        f = fit_line([x for x, _ in rows[key]], [y for _, y in rows[key]])
        return f.model_copy(update={"device": device, "dtype": "float32"})

    def fit_layer(key: str) -> ComputeFit:  # attention at its own rate when the shapes span sequence lengths
        if len({s for _, s in shapes}) < 2:
            return fit(key)
        f = fit_plane([m for m, _ in split], [a for _, a in split], [y for _, y in rows[key]])
        return f.model_copy(update={"device": device, "dtype": "float32"})

    return OperatorProfile(layer_fwd=fit_layer("lf"), layer_bwd=fit_layer("lb"), head_fwd=fit("hf"),
                           head_bwd=fit("hb"), embed=fit("e"), layer_replicated_fwd=fit("rf"),
                           layer_replicated_bwd=fit("rb"), optimizer_s_per_param=adam,
                           shapes=[(int(t), int(s)) for t, s in shapes], threads=threads, model=model,
                           points={k: [(float(x), float(y)) for x, y in v] for k, v in rows.items()})


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


def collective_sweep(sizes: Sequence[int], group: "torch.distributed.ProcessGroup | None" = None, *,
                     compute_s: float = 0.0, iters: int = CONTEXT_ITERS) -> list[float]:
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
