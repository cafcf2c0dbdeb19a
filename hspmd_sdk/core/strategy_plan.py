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
* **Uneven TP stages** (a stage with ``ratios``, SPEC §12, HAP): a DS splits only evenly, so the uneven TP split
  takes the *top* tier: HSize = the TP degree, subgroup ``k`` = the ``k``-th TP rank of the stage in every
  pipeline, HDim = the tensor's TP split dim with ``hratios`` = the stage's ratios (HDim -1 for a tensor the stage
  duplicates).  The pipelines move to the bottom tier: inside subgroup ``k``, data and activations split the
  batch evenly over the pipelines (``DS S0xP``), parameters are duplicated (``DxP``) or, with ZeRO-1, split
  evenly over the pipelines along a dim that divides (``DS S<d>xP``, gathered by an AllGather).  This needs every
  pipeline to split that layer alike and to take equal batch shares in the same micro-batches; the strategy
  refuses other uneven combinations (:func:`~hspmd_sdk.core.strategy._uneven_pipelines_problem`).  Ratios are
  proportions (the annotation's chunk sizes are ``size * r_k / sum(r)``), so one ratio list serves a weight's
  ``nh * hd`` columns and the ``nh`` heads they reshape to; :func:`~hspmd_sdk.core.tp_ratios.ratio_problem` refuses ratios
  that would cut a head (or any other tensor the split reaches) and names the nearest feasible ones.  Tensors of even stages keep
  exactly the even plan.

``plan.settings`` (:class:`~hspmd_sdk.core.plan.ExecutionSettings`) records the schedule, each pipeline's
micro-batching, the ranks that recompute activations and the strategy itself, for
:func:`~hspmd_sdk.core.specialize.specialize` and the runtime's re-planning.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import PlanValidationError, SpecializationError
from .annotation import DS, DUPLICATE, Annotation, is_split
from .gc_pause import gc_paused
from .model_spec import placements_by_tensor
from .plan import AnnotationPlan, ExecutionSettings
from .strategy import Strategy

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph import Graph
    from .model_spec import ModelSpec
    from .strategy import Stage

__all__ = ["plan_from_strategy", "zero_shard", "graph_of"]


@lru_cache(maxsize=16)
def graph_of(model: "ModelSpec") -> "Graph":
    """The defined graph of ``model`` (built once per config: configs are frozen, hashable values)."""
    return model.build_graph()


def _stages(strategy: "Strategy", layer: int | str) -> list["Stage"]:
    """Per pipeline, the stage holding ``layer`` (``"first"``/``"last"`` for embedding / head)."""
    out = []
    for p in strategy.pipelines:
        if layer == "first":
            out.append(p.stages[0])
        elif layer == "last":
            out.append(p.stages[-1])
        else:
            out.append(next(s for s in p.stages if s.layers[0] <= layer <= s.layers[1]))
    return out


def _ann(groups: Sequence[Sequence[int]], split: int | None, hdim: int = DUPLICATE,
         hratios: Sequence[int] | None = None) -> Annotation:
    key = (tuple(map(tuple, groups)), split, hdim, tuple(hratios or ()))  # (hratios only with a split hdim)
    return _ann_cached(*key)


@lru_cache(maxsize=4096)
def _ann_cached(groups: tuple[tuple[int, ...], ...], split: int | None, hdim: int,
                hratios: tuple[int, ...]) -> Annotation:
    ds = [_ds(DUPLICATE if split is None else split, len(g)) for g in groups]
    return Annotation([list(g) for g in groups], ds, hdim, list(hratios) if hratios else None)


@lru_cache(maxsize=256)
def _ds(key: int, degree: int) -> DS:
    return DS({key: degree})


def zero_shard(shape: Sequence[int], split: int | None, groups: Sequence[Sequence[int]],
               shares: Sequence[float] | None = None) -> tuple[int, list[int] | None] | None:
    """ZeRO-1's top-tier split of a parameter of ``shape`` over the pipelines' subgroups ``groups``:
    ``(hdim, hratios)``, or ``None`` when no dim has at least one element per pipeline (the parameter then stays
    replicated, and the plan's ``settings.zero1_replicated`` names it).

    Preference: a dim that TP does not split and that the number of pipelines divides (equal chunks); then the
    TP-split dim if its chunks still divide by every subgroup's TP degree; then uneven chunks (HAP-style
    ``hratios``, sizes differing by at most one unit) over the largest such dim — so 3 pipelines shard a
    ``[64, 64]`` weight as 22 / 21 / 21 rows instead of not at all.

    ``shares`` (``Pipeline.zero_share`` per pipeline, SPEC §15), not all equal: chunks in proportion to them
    (:func:`share_chunks`, at least one unit each) over the largest dim that TP does not split, else the TP-split
    one."""
    hsize = len(groups)
    tp_unit = math.lcm(*(len(g) for g in groups))
    if shares is not None and len(set(shares)) > 1:
        fits = [(d == split, -size, d) for d, size in enumerate(shape)
                if not size % (tp_unit if d == split else 1) and size // (tp_unit if d == split else 1) >= hsize]
        if not fits:
            return None
        d = min(fits)[2]
        unit = tp_unit if d == split else 1
        return d, [c * unit for c in share_chunks(shape[d] // unit, shares)]
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


def share_chunks(units: int, shares: Sequence[float]) -> list[int]:
    """``units`` cut in proportion to ``shares`` (largest remainders, the earlier first on a tie), each at least 1
    (``units >= len(shares)``).

    >>> share_chunks(64, [3, 1]), share_chunks(10, [1, 1, 1]), share_chunks(3, [100, 1, 1])
    ([48, 16], [4, 3, 3], [1, 1, 1])
    """
    n, total = len(shares), float(sum(shares))
    exact = [(units - n) * s / total for s in shares]  # one unit each first, the rest by share
    chunks = [1 + int(math.floor(e)) for e in exact]
    for k in sorted(range(n), key=lambda k: (-(exact[k] - math.floor(exact[k])), k))[:units - sum(chunks)]:
        chunks[k] += 1
    return chunks


# ---- uneven TP stages (HAP ratios) ----------------------------------------------------------------------------
@lru_cache(maxsize=4096)
def _uneven_ann(groups: tuple[tuple[int, ...], ...], ds_key: int, hdim: int, hratios: tuple[int, ...]
                ) -> Annotation:
    """Subgroup ``k`` = ``groups[k]`` (the ``k``-th TP rank of every pipeline), each laid out by ``DS {ds_key: P}``
    over its ``P`` pipelines; top tier ``hdim`` in ``hratios``."""
    ds = _ds(ds_key, len(groups[0]))
    ratios = list(hratios) if is_split(hdim) else None  # (hratios: an uneven stage's, never empty)
    return Annotation([list(g) for g in groups], [ds] * len(groups), hdim, ratios)


def _zero_dim_uneven(shape: Sequence[int], split: int | None, ratios: Sequence[int], pipelines: int) -> int | None:
    """ZeRO-1 inside an uneven TP subgroup: a dim whose every subgroup chunk the pipelines divide evenly (a dim
    TP does not split first), else ``None`` (the parameter stays replicated)."""
    total = sum(ratios)
    options = []
    for d, size in enumerate(shape):
        chunks = [size * r // total for r in ratios] if d == split else [size]
        if all(c >= pipelines and c % pipelines == 0 for c in chunks):
            options.append((d == split, d))
    return min(options)[1] if options else None


def _uneven_annotation(name: str, place: Any, stages: Sequence["Stage"], shape: Sequence[int], zero1: bool,
                       replicated: list[str]) -> tuple[Annotation, Annotation | None]:
    """The annotation of a tensor placed on uneven stages (see the module docstring) and, for a parameter under
    ZeRO-1 over several pipelines, its sharded layout (``None`` when no dim divides: ``name`` is then appended to
    ``replicated``)."""
    ratios = stages[0].tp_ratios
    assert ratios is not None
    groups = tuple(tuple(st.devices[k] for st in stages) for k in range(len(ratios)))
    hdim = DUPLICATE if place.tp_split is None else place.tp_split
    if place.kind != "parameter":
        return _uneven_ann(groups, 0, hdim, ratios), None
    full = _uneven_ann(groups, DUPLICATE, hdim, ratios)
    if not zero1 or len(stages) < 2:
        return full, None
    d = _zero_dim_uneven(shape, place.tp_split, ratios, len(stages))
    if d is None:
        replicated.append(name)
        return full, None
    return full, _uneven_ann(groups, d, hdim, ratios)


# ---- context-parallel stages (SPEC §11) -----------------------------------------------------------------------
#: the sequence dim of data and activations ``[B, S, ...]``, which context parallelism splits
SEQ_DIM = 1


def _stage_ds(stage: "Stage", split: int | None, kind: str, name: str) -> DS:
    """A tensor's DS on one stage: ``cp`` (slowest digit) x ``tp`` (fastest).  Data and activations split the
    sequence over the CP coordinate, parameters are duplicated over it; the TP coordinate splits ``split`` (or
    duplicates)."""
    tp, cp = stage.tp_degree, stage.cp
    key = DUPLICATE if split is None else split
    if cp == 1:
        return _ds(key, tp)
    cp_key = DUPLICATE if kind == "parameter" else SEQ_DIM
    if key == SEQ_DIM and kind != "parameter":
        raise PlanValidationError([(f"stage {stage}", f"tensor {name!r}: tensor parallelism splits its sequence "
                                                      f"dim {SEQ_DIM}, which context parallelism (cp={cp}) splits "
                                                      "too; use cp=1 on this stage")], what="strategy")
    if tp == 1:
        return _ds(cp_key, cp)
    if key == cp_key:
        return _ds(key, cp * tp)
    return DS({cp_key: cp, key: tp}, [cp_key, key])


def _cp_annotation(anns: dict[str, Annotation], replicated: list[str], node: Any, place: Any,
                   stages: Sequence["Stage"], shape: Sequence[Any], strategy: "Strategy",
                   ratios: Sequence[int]) -> None:
    """Annotate a tensor placed on stages of which one at least has ``cp > 1`` (the even plan otherwise, with
    each stage's DS from :func:`_stage_ds`)."""
    name = node.outputs[0]
    groups = [list(st.devices) for st in stages]
    ds = [_stage_ds(st, place.tp_split, place.kind, name) for st in stages]
    if place.kind != "parameter":
        anns[name] = Annotation(groups, ds, 0, list(ratios))
        return
    full = Annotation(groups, ds, DUPLICATE)
    if node.is_reshard:
        if full != anns.get(node.inputs[0]):
            anns[name] = full
        return
    hsize = len(stages)
    tp_only = [list(range(st.tp_degree)) for st in stages]  # zero_shard counts TP ranks only
    shard = None
    if strategy.zero1 and hsize > 1:
        shard = zero_shard(shape, place.tp_split, tp_only, strategy.zero_shares())
        if shard is None:
            replicated.append(name)
    anns[name] = full if shard is None else Annotation(groups, ds, shard[0], shard[1])
    anns[f"{name}.grad_sync"] = anns[name]


@gc_paused
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
    strategy = strategy.named()  # the plan's settings (and so Job.events) name the strategy it was made from
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
    #: a place (layer, "first", "last") -> its stage in each pipeline, their devices, whether one of them is uneven,
    #: whether one has cp > 1: the same for every tensor of a layer, found once
    at: dict[int | str, tuple[list["Stage"], list[list[int]], bool, bool]] = {}
    for node in graph.nodes:
        name = node.outputs[0]
        place = table.get(name) if (node.is_leaf or node.is_reshard) else None
        if place is None:
            continue
        if place.where not in at:
            found = _stages(strategy, place.where)
            at[place.where] = (found, [list(st.devices) for st in found], any(st.is_uneven for st in found),
                               any(st.cp > 1 for st in found))
        stages, groups, uneven, cp = at[place.where]
        if uneven:
            full, shard = _uneven_annotation(name, place, stages, graph.tensors[name].shape,
                                             strategy.zero1 and place.kind == "parameter" and not node.is_reshard,
                                             replicated)
            if node.is_reshard:
                if place.kind != "parameter" or full != anns.get(node.inputs[0]):
                    anns[name] = full
                continue
            if place.kind == "parameter":
                anns[name] = shard or full
                anns[f"{name}.grad_sync"] = anns[name]
            else:
                anns[name] = full
            continue
        if cp:
            _cp_annotation(anns, replicated, node, place, stages, graph.tensors[name].shape, strategy, ratios)
            continue
        if place.kind != "parameter":
            anns[name] = _ann(groups, place.tp_split, 0, ratios)
            continue
        full = _ann(groups, place.tp_split)
        if node.is_reshard:  # another use of a parameter: its full layout where it is used
            if full != anns.get(node.inputs[0]):
                anns[name] = full
            continue
        shard = None
        if strategy.zero1 and hsize > 1:
            shard = zero_shard(graph.tensors[name].shape, place.tp_split, groups, strategy.zero_shares())
            if shard is None:
                replicated.append(name)
        anns[name] = full if shard is None else _ann(groups, place.tp_split, shard[0], shard[1])
        anns[f"{name}.grad_sync"] = anns[name]
    settings = ExecutionSettings(
        schedule=strategy.schedule, zero=strategy.zero, zero1=strategy.zero1,
        micro_batch_size=[p.micro_batch_size for p in strategy.pipelines],
        num_micro_batches=[p.num_micro_batches for p in strategy.pipelines],
        recompute=sorted(r for p in strategy.pipelines for s in p.stages if s.recompute for r in s.devices),
        zero1_replicated=replicated, strategy=strategy.model_dump(mode="json"))
    meta = {"source": "plan_from_strategy", "model": getattr(model, "name", None), "strategy_name": strategy.name,
            "stages": [[list(s.devices) for s in p.stages] for p in strategy.pipelines]}
    return AnnotationPlan(annotations=anns, settings=settings, meta=meta)


def strategy_of(program: Any) -> "Strategy | None":
    """The :class:`~.strategy.Strategy` a Program was specialized from (``plan.settings.strategy``), or ``None``
    for a plan written by hand."""
    data = program.plan.settings.strategy
    return Strategy.load(data) if data else None
