"""From a high-level :class:`~hspmd_sdk.core.strategy.Strategy` to the annotation plan of the Llama graph.

The plan realises the strategy in HSPMD's two tiers (paper §4, Appendix C):

* **Top tier = the pipelines.**  Every annotation has HSize = the number of pipelines; subgroup ``k`` is the
  TP group of pipeline ``k`` that holds the tensor (its stage for that layer).  Data and activations are split
  along the batch across pipelines (HDim 0) in proportion to each pipeline's samples per step
  (``hratios = micro_batch_size * num_micro_batches``); parameters are replicated (HDim -1), or with ZeRO-1
  split across pipelines (HDim 0 or 1) and gathered by the Reshard ``<param>.gather`` (SplitAllGather).
* **Bottom tier = tensor parallelism inside a stage** (Megatron): ``wq, wk, wv, w1, w3`` column-split
  (``S1``), ``wo, w2`` row-split (``S0``) so their Dot is Partial and the Reshards ``layers.{i}.attn.out`` /
  ``layers.{i}.mlp.out`` all-reduce it; norms Duplicate; the embedding split along hidden (all-gathered at
  ``embed.out``) and the LM head along vocab (all-gathered at ``logits``).  Each pipeline may use its own TP
  degree per stage.
* **Stage boundaries**: ``layers.{i}.in`` puts the hidden state on the stage of layer ``i`` in every pipeline;
  where a pipeline changes stage there it resolves to SendRecv (same TP degree) or BSR (different TP degree),
  elsewhere to Identity.
* **Gradient synchronisation**: ``<param>.grad_sync`` is the annotation gradients must reach after the
  backward pass (the parameter's own layout).  Gradients come out Partial across pipelines (HDim -2), so the
  sync resolves to SplitAllReduce (or, with ZeRO-1, SplitReduceScatter onto the shards).

``plan.meta`` records the schedule and each pipeline's micro-batching for :func:`specialize`.
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import PlanValidationError
from .annotation import DS, DUPLICATE, Annotation
from .graph import Graph
from .plan import AnnotationPlan

if TYPE_CHECKING:
    from .cluster import Cluster
    from .model_config import LlamaConfig
    from .strategy import Strategy

__all__ = ["plan_from_strategy", "tp_split_dim"]

#: Bottom-tier split dim of each layer parameter under Megatron TP (``None``: Duplicate).
_TP_SPLIT = {"attn_norm.weight": None, "attn.wq": 1, "attn.wk": 1, "attn.wv": 1, "attn.wo": 0,
             "mlp_norm.weight": None, "mlp.w1": 1, "mlp.w3": 1, "mlp.w2": 0}


def tp_split_dim(name: str) -> int | None:
    """Megatron TP split dim of parameter ``name`` (``None``: Duplicate in the TP group)."""
    if name == "embed.weight":
        return 1
    if name == "lm_head.weight":
        return 1
    if name == "final_norm.weight":
        return None
    return _TP_SPLIT[name.split(".", 2)[2]]


def _config_of(model: Any) -> "LlamaConfig":
    from .model_config import LlamaConfig

    if isinstance(model, LlamaConfig):
        return model
    if isinstance(model, Graph) and isinstance(model.meta.get("config"), LlamaConfig):
        return model.meta["config"]
    raise PlanValidationError([("model", "plan_from_strategy needs a LlamaConfig or a graph built by "
                                         "build_llama_graph")], what="strategy")


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


def _zero_dim(shape: Sequence[int], split: int | None, hsize: int) -> int | None:
    """ZeRO-1 top-tier split dim: a dim not split by TP that HSize divides (``None``: keep replicated)."""
    for d in range(len(shape)):
        if d != split and shape[d] % hsize == 0:
            return d
    return None


def plan_from_strategy(model: "LlamaConfig | Graph", strategy: "Strategy", cluster: "Cluster") -> AnnotationPlan:
    """The annotation plan of the Llama graph (:func:`hspmd_sdk.models.build_llama_graph`) under ``strategy``.

    Raises :class:`PlanValidationError` (field paths into the strategy) when the strategy does not fit the
    model or the cluster.
    """
    from ..models.llama import layer_param_names, param_shapes

    config = _config_of(model)
    strategy.check(model=config, cluster=cluster)
    hsize = len(strategy.pipelines)
    ratios = [p.batch for p in strategy.pipelines]
    shapes = param_shapes(config)
    anns: dict[str, Annotation] = {}

    def act(name: str, layer: int | str) -> None:
        anns[name] = _ann(_groups(strategy, layer), None, 0, ratios)

    def param(name: str, layer: int | str) -> None:
        groups = _groups(strategy, layer)
        split = tp_split_dim(name)
        full = _ann(groups, split)
        zd = _zero_dim(shapes[name], split, hsize) if strategy.zero1 and hsize > 1 else None
        leaf = full if zd is None else _ann(groups, split, zd)
        anns[name] = leaf
        if zd is not None:
            anns[f"{name}.gather"] = full
        anns[f"{name}.grad_sync"] = leaf

    act("tokens", "first")
    act("targets", "last")
    param("embed.weight", "first")
    act("embed.out", "first")
    for i in range(config.num_layers):
        act(f"layers.{i}.in", i)
        for name in layer_param_names(i):
            param(name, i)
        act(f"layers.{i}.attn.out", i)
        act(f"layers.{i}.mlp.out", i)
    act("final_norm.in", "last")
    param("final_norm.weight", "last")
    param("lm_head.weight", "last")
    act("logits", "last")
    meta = {
        "source": "plan_from_strategy",
        "strategy_name": strategy.name,
        "schedule": strategy.schedule,
        "zero1": strategy.zero1,
        "micro_batch_size": [p.micro_batch_size for p in strategy.pipelines],
        "num_micro_batches": [p.num_micro_batches for p in strategy.pipelines],
        "stages": [[list(s.devices) for s in p.stages] for p in strategy.pipelines],
    }
    return AnnotationPlan(annotations=anns, meta=meta)
