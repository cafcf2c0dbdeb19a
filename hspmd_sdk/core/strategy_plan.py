"""From a high-level :class:`~hspmd_sdk.core.strategy.Strategy` to an annotation plan, for any model.

The model says where each of its tensors lives (:meth:`ModelSpec.placements <hspmd_sdk.core.model_spec.ModelSpec>`:
a stage by layer index or first/last, data / activation / parameter, the TP split dim); this module realises the
strategy in HSPMD's two tiers (paper §4, Appendix C) from that table alone — it names no model family and no
parameter:

* **Top tier = the pipelines.**  Every annotation has HSize = the number of pipelines; subgroup ``k`` is the
  TP group of pipeline ``k`` that holds the tensor (its stage for that layer).  Data and activations are split
  along the batch across pipelines (HDim 0) in proportion to each pipeline's samples per step
  (``hratios = micro_batch_size * num_micro_batches``); parameters are replicated (HDim -1), or with ZeRO-1
  split across pipelines (:func:`zero_shard`) and gathered again by the parameter's Reshards (SplitAllGather).
* **Bottom tier = tensor parallelism inside a stage**: each tensor split along its placement's ``tp_split`` dim
  over the stage's ranks (Duplicate when ``None``).  Each pipeline may use its own TP degree per stage.
* **A parameter's other uses** (a Reshard of a parameter: ZeRO gathering, or a tied weight used on another
  stage, such as GPT-2's embedding in its LM head) get the parameter's full layout on the stage that uses them;
  specialization resolves the move (BSR between stages) and sums the gradients of all uses.
* **Stage boundaries**: an activation placed on the stage of layer ``i`` resolves to SendRecv (same TP degree)
  or BSR (different TP degree) where a pipeline changes stage there, elsewhere to Identity.
* **Gradient synchronisation**: ``<param>.grad_sync`` is the annotation gradients must reach after the backward
  pass (the parameter's own layout, sharded under ZeRO-1).

``plan.meta`` records the schedule, each pipeline's micro-batching and the ranks that recompute activations,
for :func:`~hspmd_sdk.core.specialize.specialize`.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import PlanValidationError, SpecializationError
from .annotation import DS, DUPLICATE, Annotation
from .model_spec import placements_by_tensor
from .plan import AnnotationPlan

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph import Graph
    from .model_spec import ModelSpec
    from .strategy import Strategy

__all__ = ["plan_from_strategy", "zero_shard", "graph_of"]


@lru_cache(maxsize=16)
def graph_of(model: "ModelSpec") -> "Graph":
    """The defined graph of ``model`` (built once per config: configs are frozen, hashable values)."""
    return model.build_graph()


def _groups(strategy: "Strategy", layer: int | str) -> list[list[int]]:
    """Per pipeline, the ranks of the stage holding ``layer`` (``"first"``/``"last"`` for embedding / head)."""
    out = []
    for p in strategy.pipelines:
        if layer == "first":
            out.append(list(p.stages[0].devices))
        elif layer == "last":
            out.append(list(p.stages[-1].devices))
        else:
            out.append(next(list(s.devices) for s in p.stages if s.layers[0] <= layer <= s.layers[1]))
    return out


def _ann(groups: Sequence[Sequence[int]], split: int | None, hdim: int = DUPLICATE,
         hratios: Sequence[int] | None = None) -> Annotation:
    key = (tuple(map(tuple, groups)), split, hdim, tuple(hratios or ()) if hdim >= 0 else ())
    return _ann_cached(*key)


@lru_cache(maxsize=4096)
def _ann_cached(groups: tuple[tuple[int, ...], ...], split: int | None, hdim: int,
                hratios: tuple[int, ...]) -> Annotation:
    ds = [_ds(DUPLICATE if split is None else split, len(g)) for g in groups]
    return Annotation([list(g) for g in groups], ds, hdim, list(hratios) if hratios else None)


@lru_cache(maxsize=256)
def _ds(key: int, degree: int) -> DS:
    return DS({key: degree})


def zero_shard(shape: Sequence[int], split: int | None, groups: Sequence[Sequence[int]]
               ) -> tuple[int, list[int] | None] | None:
    """ZeRO-1's top-tier split of a parameter of ``shape`` over the pipelines' subgroups ``groups``:
    ``(hdim, hratios)``, or ``None`` when no dim has at least one element per pipeline (the parameter then stays
    replicated, and the plan's ``meta["zero1_replicated"]`` names it).

    Preference: a dim that TP does not split and that the number of pipelines divides (equal chunks); then the
    TP-split dim if its chunks still divide by every subgroup's TP degree; then uneven chunks (HAP-style
    ``hratios``, sizes differing by at most one unit) over the largest such dim — so 3 pipelines shard a
    ``[64, 64]`` weight as 22 / 21 / 21 rows instead of not at all."""
    hsize = len(groups)
    tp_unit = math.lcm(*(len(g) for g in groups))
    even, uneven = [], []
    for d, size in enumerate(shape):
        unit = tp_unit if d == split else 1
        if size % unit:
            continue
        units = size // unit
        if units < hsize:
            continue
        rank = (d == split, d)
        if units % hsize == 0:
            even.append((rank, d, None))
        else:
            base, extra = divmod(units, hsize)
            ratios = [(base + (1 if k < extra else 0)) * unit for k in range(hsize)]
            uneven.append(((d == split, -size, d), d, ratios))
    for options in (even, uneven):
        if options:
            _, d, ratios = min(options, key=lambda o: o[0])
            return d, ratios
    return None


def plan_from_strategy(model: "ModelSpec", strategy: "Strategy", cluster: "Cluster") -> AnnotationPlan:
    """The annotation plan of ``model``'s defined graph under ``strategy`` on ``cluster``, built from the model's
    :meth:`~hspmd_sdk.core.model_spec.ModelSpec.placements` (see the module docstring).

    Raises :class:`PlanValidationError` (field paths into the strategy) when the strategy does not fit the
    model or the cluster, and :class:`SpecializationError` when the model's placements miss a leaf of its graph.
    """
    if not hasattr(model, "placements"):
        raise PlanValidationError([("model", f"plan_from_strategy needs a model config (a ModelSpec such as "
                                             f"LlamaConfig or GPTConfig), not {type(model).__name__}")],
                                  what="strategy")
    strategy.check(model=model, cluster=cluster)
    strategy = strategy.named()  # the plan's meta (and so Job.events) names the strategy it was made from
    graph = graph_of(model)
    table = placements_by_tensor(model)
    missing = [n.outputs[0] for n in graph.leaves if n.outputs[0] not in table]
    if missing:
        raise SpecializationError(f"model {model.name!r}: placements() gives no placement for leaf tensor(s) "
                                  f"{missing[:5]}; every placeholder and parameter needs one")
    hsize = len(strategy.pipelines)
    ratios = [p.batch for p in strategy.pipelines]
    anns: dict[str, Annotation] = {}
    replicated: list[str] = []
    for node in graph.nodes:
        name = node.outputs[0]
        place = table.get(name) if (node.is_leaf or node.is_reshard) else None
        if place is None:
            continue
        groups = _groups(strategy, place.where)
        if place.kind != "parameter":
            anns[name] = _ann(groups, place.tp_split, 0, ratios)
            continue
        full = _ann(groups, place.tp_split)
        if node.is_reshard:  # another use of a parameter: its full layout where it is used
            if full != anns.get(node.inputs[0]):
                anns[name] = full
            continue
        shard = zero_shard(graph.tensors[name].shape, place.tp_split, groups) \
            if strategy.zero1 and hsize > 1 else None
        if strategy.zero1 and hsize > 1 and shard is None:
            replicated.append(name)
        anns[name] = full if shard is None else _ann(groups, place.tp_split, shard[0], shard[1])
        anns[f"{name}.grad_sync"] = anns[name]
    meta = {
        "source": "plan_from_strategy",
        "model": getattr(model, "name", None),
        "strategy_name": strategy.name,
        "schedule": strategy.schedule,
        "zero1": strategy.zero1,
        "micro_batch_size": [p.micro_batch_size for p in strategy.pipelines],
        "num_micro_batches": [p.num_micro_batches for p in strategy.pipelines],
        "stages": [[list(s.devices) for s in p.stages] for p in strategy.pipelines],
        "recompute": sorted(r for p in strategy.pipelines for s in p.stages if s.recompute for r in s.devices),
        "strategy": strategy.model_dump(mode="json"),
    }
    if replicated:
        meta["zero1_replicated"] = replicated
    return AnnotationPlan(annotations=anns, meta=meta)
