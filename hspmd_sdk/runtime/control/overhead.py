"""The executor's fixed cost per micro-batch, measured, and folded into a profiled cost model.

:func:`hspmd_sdk.runtime.profile_model` times the model's single-device reference (a plain ``nn.Module``) at shapes
of 128 to 1,024 tokens and fits ``seconds = a * FLOPs + b`` per operator.  The slope is right; the intercept is an
extrapolation, and it is not what the runtime pays: the executor replays the specialized graph operator by
operator (kernel attributes, Reshards, the autograd graph of each micro-batch, gradient hooks), and on a CPU that
fixed cost is milliseconds a micro-batch -- for a small model as much as its FLOPs.  A planner that does not
know it splits a step into many small micro-batches that each look free (the mixed-length dispatcher did: ten
padded micro-batches a rank where three would do).

:func:`executor_overhead` measures it where it arises: a :class:`~.executor.StepExecutor` of the model with one
and with two decoder layers, on one rank (no process group), runs steps of ``k`` micro-batches of ``rows x seq``
tokens (tiny: nothing but fixed cost): the step's time grows by one micro-batch's fixed cost per micro-batch, split
into forward and backward as the schedule's forward and backward actions split it.  Per
micro-batch, the two-layer minus the one-layer time is one decoder layer's fixed cost; the rest is the fixed cost
of the embedding and the head.  :func:`with_executor_overhead` sets the profile's intercepts to those figures
(less the FLOP term of the tiny shape), so that the simulator, the planners and the dispatcher all price a
micro-batch at what the executor takes to run it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

from ...core.cluster import Cluster
from ...core.specialize import specialize
from ...core.strategy import Strategy
from ...core.strategy_plan import plan_from_strategy

if TYPE_CHECKING:
    from ...core.model_spec import ModelSpec
    from ...planner.cost import ComputeFit, CostModel

__all__ = ["ExecutorOverhead", "executor_overhead", "with_executor_overhead"]


@dataclass(frozen=True)
class ExecutorOverhead:
    """Fixed seconds one micro-batch pays in the executor: per decoder layer (forward, backward) and for the rest
    of the model (embedding, final norm, head and loss; forward, backward), at ``rows x seq`` tokens."""

    layer_fwd: float
    layer_bwd: float
    rest_fwd: float
    rest_bwd: float
    rows: int
    seq: int


class _NoGroups:
    """A one-rank program communicates with nobody; any use of a group is a bug of the measurement."""

    rank, world_size = 0, 1

    def group(self, ranks: Sequence[int]) -> NoReturn:  # pragma: no cover - a one-rank program has no collectives
        raise RuntimeError(f"the overhead probe runs one rank; it asked for a group of {ranks}")


def _per_micro_batch(model: "ModelSpec", layers: int, *, rows: int, seq: int, micro: int, repeats: int,
                     device: str) -> tuple[float, float]:
    """Median (forward, backward) seconds of one micro-batch of ``model.with_layers(layers)`` in the executor."""
    import numpy as np
    import torch

    from ..workers.executor import AdamConfig, StepExecutor  # lazy: torch (executor)
    from ..workers.mixed_worker import micro_batch_feeds  # lazy: numpy (mixed_worker)

    m = model.with_layers(layers)
    cluster = Cluster.local(1)
    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [0], "layers": [0, layers - 1]}],
                                             "micro_batch_size": rows, "num_micro_batches": 1}],
                              "name": "overhead-probe", "zero1": False})
    program = specialize(m, plan_from_strategy(m, strategy, cluster), cluster, bindings={"B": rows, "S": seq})
    marks: list[tuple[float, str]] = []
    ex = StepExecutor(program, 0, _NoGroups(), seed=0, global_batch=rows, seq_len=seq, adam=AdamConfig(lr=1e-6),
                      device=torch.device(device),
                      trace=lambda event, **info: marks.append((time.perf_counter(), info.get("kind", "")))
                      if event == "action" else None)
    rng = np.random.default_rng(0)
    vocab = int(getattr(m, "vocab_size", 2))

    def batch(k: int) -> list[tuple[int, int, dict[str, Any]]]:
        return [(rows, seq, micro_batch_feeds(m, program.graph, [rng.integers(0, vocab, seq + 1)
                                                                for _ in range(rows)])) for _ in range(k)]

    few, many = batch(max(1, micro // 4)), batch(micro)
    totals: dict[int, list[float]] = {len(few): [], len(many): []}
    share = []
    for rep in range(repeats + 1):
        for mbs in (few, many):  # interleaved, so that background load hits both alike
            marks.clear()
            t0 = time.perf_counter()
            ex.step(None, micro_batches=mbs, loss_normalizer=rows * seq * len(mbs))
            end = time.perf_counter()
            marks.append((end, "end"))
            if rep == 0:  # warm-up: the shape's plans and kernel attributes are resolved and cached
                continue
            totals[len(mbs)].append(end - t0)
            spans = {"F": 0.0, "B": 0.0}
            for (a, kind), (b, _) in zip(marks, marks[1:]):
                if kind in spans:
                    spans[kind] += b - a
            share.append(spans["F"] / max(spans["F"] + spans["B"], 1e-12))
    # the step's seconds grow by this much per extra micro-batch (everything a micro-batch costs, in or between
    # its actions), split into forward and backward as the actions' own spans split
    per = (statistics.median(totals[len(many)]) - statistics.median(totals[len(few)])) / (len(many) - len(few))
    f = statistics.median(share)
    return max(per, 0.0) * f, max(per, 0.0) * (1.0 - f)


def executor_overhead(model: "ModelSpec", *, device: str = "cpu", threads: int | None = 1, rows: int = 1, seq: int = 8,
                      micro: int = 8, repeats: int = 7) -> ExecutorOverhead:
    """Measure the executor's fixed cost per micro-batch for ``model`` (a :class:`~hspmd_sdk.core.model_spec.
    ModelSpec`) on ``device`` with ``threads`` torch threads (the workers run with 1): see the module docstring.
    Per micro-batch: the growth of the step's time from ``micro // 4`` to ``micro`` micro-batches (median of
    ``repeats`` interleaved runs), split into forward and backward as the forward and backward actions' own spans
    split.  Takes about a second for a small model on a CPU."""
    import torch

    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        f1, b1 = _per_micro_batch(model, 1, rows=rows, seq=seq, micro=micro, repeats=repeats, device=device)
        f2, b2 = _per_micro_batch(model, 2, rows=rows, seq=seq, micro=micro, repeats=repeats, device=device)
    finally:
        if threads is not None:
            torch.set_num_threads(old)
    lf, lb = max(f2 - f1, 0.0), max(b2 - b1, 0.0)
    return ExecutorOverhead(layer_fwd=lf, layer_bwd=lb, rest_fwd=max(f1 - lf, 0.0), rest_bwd=max(b1 - lb, 0.0),
                            rows=rows, seq=seq)


def with_executor_overhead(cost: "CostModel", model: "ModelSpec", kind: str = "cpu",
                           overhead: ExecutorOverhead | None = None, **kw: Any) -> "CostModel":
    """``cost`` (a :class:`~hspmd_sdk.planner.CostModel` with a profile of ``kind`` from
    :func:`~hspmd_sdk.runtime.profile_model`) with the profile's intercepts set to the executor's measured fixed
    cost per micro-batch (:func:`executor_overhead`; ``kw`` goes to it): ``layer_fwd.b``/``layer_bwd.b`` per
    decoder layer, and the head's ``b`` for the rest of the model (less the embedding line's own intercept).  Each
    intercept is the measured seconds less the line's FLOP term at the probe's tiny shape (never below zero)."""
    prof = cost.profiles.get(kind)
    if prof is None:
        raise ValueError(f"the cost model has no profile of {kind!r} (profiles: {sorted(cost.profiles)}); run "
                         "profile_model first")
    o = overhead or executor_overhead(model, **kw)
    tokens = o.rows * o.seq
    lflops, hflops = model.layer_flops(tokens, o.seq), model.head_flops(tokens)

    def b(fit: "ComputeFit", seconds: float, flops: float, less: float = 0.0) -> "ComputeFit":
        return fit.model_copy(update={"b": max(seconds - fit.a * flops - less, 0.0)})

    embed_b = prof.embed.b
    new = prof.model_copy(update={
        "layer_fwd": b(prof.layer_fwd, o.layer_fwd, lflops), "layer_bwd": b(prof.layer_bwd, o.layer_bwd, lflops),
        "head_fwd": b(prof.head_fwd, o.rest_fwd, hflops),
        "head_bwd": b(prof.head_bwd, o.rest_bwd, hflops, less=embed_b + prof.embed.a * tokens * model.hidden_size),
        "executor_overhead": {"layer_fwd": o.layer_fwd, "layer_bwd": o.layer_bwd, "rest_fwd": o.rest_fwd,
                              "rest_bwd": o.rest_bwd, "rows": o.rows, "seq": o.seq}})
    return cost.model_copy(update={"profiles": {**cost.profiles, kind: new}})
