"""The tensor-parallel communication of a model's units, read off a specialized Program's own CommPlans.

The cost model does not keep its own list of which collectives tensor parallelism runs (Megatron's "two
all-reduces per layer"): :func:`unit_collectives` specializes the model itself under a ``tp``-way, three-stage
plan once (three layers: the first stage holds the embedding and layer 0, the middle one layer 1, the last layer 2
and the head), and reads every collective a stage's TP group runs from the Program's forward Reshards
(``comm_plans``) and from its backward (``backward_plans``, the Partial gradients' ``grad_reduce_plans``).  The
middle stage's are one decoder layer's; the first and last stages' less one layer's are the embedding's and the
head's.  Each collective is kept as ``(kind, members, elements per token)``: the buffer a ring collective works on
(the whole tensor for ``AllReduce``/``ReduceScatter``, the gathered one for ``AllGather``), per token of the
micro-batch, so one specialization prices every micro-batch size and sequence length; :meth:`CostModel.
collective_time` prices it with :meth:`OpKind.ring`, the formula the Program's ``CollectiveOp.transfers`` use.

An uneven group (SPEC §12, ``ratios``) runs top-tier collectives (``SplitAllReduce``, ``SplitAllGather``) whose
slices partition the tensor: each is kept as the ring collective of the same buffer.  Point-to-point operators
between stages are the pipeline's activations and gradients, which the simulator prices as transfers of its own
schedule; operators a rank runs alone (``LocalSplit``, ``Identity``) move nothing.  Not priced: point-to-point
operators inside one stage (none for Llama and GPT, even or uneven, whose BSRs there move nothing).
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ..core.cluster import Cluster
from ..core.comm_ops import CollectiveOp, OpKind, SplitCollectiveOp, ring_numel
from ..core.slices import box_numel
from ..core.specialize import specialize
from ..core.strategy import Pipeline, Stage, Strategy
from ..core.strategy_plan import plan_from_strategy
from ..errors import HSPMDError

if TYPE_CHECKING:  # pragma: no cover
    from ..core.model_spec import ModelSpec

__all__ = ["Collective", "UnitCollectives", "unit_collectives"]

_RING = (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER)
#: the top-tier collective of an uneven group and the ring collective of the same volume
_SPLIT = {OpKind.SPLIT_ALL_REDUCE: OpKind.ALL_REDUCE, OpKind.SPLIT_REDUCE_SCATTER: OpKind.REDUCE_SCATTER,
          OpKind.SPLIT_ALL_GATHER: OpKind.ALL_GATHER}


@dataclass(frozen=True, order=True)
class Collective:
    """One ring collective of a unit: its ``kind``, its group size ``members`` and the elements per token of the
    buffer it works on (the whole tensor; the gathered one for ``AllGather``)."""

    kind: OpKind
    members: int
    per_token: float


@dataclass(frozen=True)
class UnitCollectives:
    """The TP collectives of the embedding, one decoder layer and the head, forward and backward."""

    embedding_fwd: tuple[Collective, ...]
    embedding_bwd: tuple[Collective, ...]
    layer_fwd: tuple[Collective, ...]
    layer_bwd: tuple[Collective, ...]
    head_fwd: tuple[Collective, ...]
    head_bwd: tuple[Collective, ...]


class TPCommError(HSPMDError, ValueError):
    """The model could not be specialized to read its TP collectives."""


def unit_collectives(model: "ModelSpec", tp: int, ratios: Sequence[int] | None = None) -> UnitCollectives:
    """The TP collectives of ``model``'s units under ``tp``-way tensor parallelism (see the module docstring), split
    in the proportions ``ratios`` (SPEC §12, one per rank; ``None`` or all equal: evenly); cached per model config,
    degree and ratios.  ``tp`` 1: none.  Raises :class:`TPCommError` naming the model and degree when the model
    cannot be specialized so (e.g. heads that ``tp`` does not divide evenly or in those proportions)."""
    if tp <= 1:
        return UnitCollectives((), (), (), (), (), ())
    key = None if ratios is None or len(set(ratios)) <= 1 else tuple(int(r) for r in ratios)
    return _cached(model, tp, key)  # configs are hashable values: specialize() caches their graphs alike


@functools.lru_cache(maxsize=256)
def _cached(model: "ModelSpec", tp: int, ratios: tuple[int, ...] | None) -> UnitCollectives:
    return _read(model, tp, ratios)


def _three_layers(model: "ModelSpec") -> "ModelSpec":
    """``model`` with three layers where its config can be copied so (a pydantic or dataclass config), else
    itself."""
    if model.num_layers == 3:
        return model
    if hasattr(model, "model_copy"):
        return model.model_copy(update={"num_layers": 3})
    if dataclasses.is_dataclass(model):
        return dataclasses.replace(model, num_layers=3)
    return model


def _read(model: "ModelSpec", tp: int, ratios: tuple[int, ...] | None) -> UnitCollectives:
    m = _three_layers(model)
    if m.num_layers < 3:
        raise TPCommError(f"model {getattr(model, 'name', model)!r} has {m.num_layers} layer(s) and a config that "
                          "cannot be copied with three: its TP collectives cannot be read per unit")
    last = m.num_layers - 1
    r = list(ratios) if ratios is not None else None
    stages = [Stage(devices=list(range(tp)), layers=[0, 0], ratios=r),
              Stage(devices=list(range(tp, 2 * tp)), layers=[1, last - 1], ratios=r),
              Stage(devices=list(range(2 * tp, 3 * tp)), layers=[last, last], ratios=r)]
    strategy = Strategy(pipelines=[Pipeline(stages=stages, micro_batch_size=1, num_micro_batches=1)])
    cluster = Cluster.local(3 * tp)
    try:
        program = specialize(m, plan_from_strategy(m, strategy, cluster), cluster, bindings={"B": 1, "S": 16 * tp})
    except HSPMDError as e:
        how = f"tp={tp}" if ratios is None else f"tp={tp} ratios={list(ratios)}"
        raise TPCommError(f"the TP collectives of model {getattr(model, 'name', model)!r} at {how} cannot be "
                          f"read: its specialization fails ({e})") from e
    tokens = program.bindings["B"] * program.bindings["S"]
    fwd = _per_stage(program.comm_plans.values(), stages, tokens)
    bwd = _per_stage(list(program.backward_plans.values()) + list(program.grad_reduce_plans.values()), stages,
                     tokens)
    layers = m.num_layers - 2  # the middle stage's

    def one_layer(c: Counter) -> Counter:
        out = Counter()
        for key, n in c.items():
            if n % layers:
                raise TPCommError(f"model {getattr(model, 'name', model)!r} at tp={tp}: its middle {layers} "
                                  f"layers run {n} x {key}, not the same collectives each")
            out[key] = n // layers
        return out

    lf, lb = one_layer(fwd[1]), one_layer(bwd[1])
    return UnitCollectives(embedding_fwd=_items(fwd[0] - lf), embedding_bwd=_items(bwd[0] - lb),
                           layer_fwd=_items(lf), layer_bwd=_items(lb),
                           head_fwd=_items(fwd[2] - lf), head_bwd=_items(bwd[2] - lb))


def _per_stage(plans: Iterable[Any], stages: list[Stage], tokens: int) -> list[Counter]:
    """Each stage's ring collectives, counted: the operators whose ranks all lie in that stage's TP group."""
    where = {r: i for i, s in enumerate(stages) for r in s.devices}
    out: list[Counter] = [Counter() for _ in stages]
    for plan in plans:
        for op in plan.ops:
            for kind, ranks, numel in _rings(op):
                homes = {where[r] for r in ranks}
                if len(homes) != 1:
                    raise TPCommError(f"a {op.kind} over ranks {list(ranks)} spans stages: not a TP collective")
                out[homes.pop()][Collective(kind, len(ranks), numel / tokens)] += 1
    return out


def _rings(op: Any) -> list[tuple[OpKind, tuple[int, ...], int]]:
    """``(ring kind, ranks, buffer elements)`` of each collective ``op`` runs over two or more ranks: a bottom-tier
    group's (:func:`ring_numel`), or an uneven group's split collective (SPEC §12), whose slices partition the
    tensor reduced or the one gathered, as the ring collective of that buffer."""
    if isinstance(op, SplitCollectiveOp):  # resolve makes them of the three kinds of _SPLIT only
        ranks = tuple(sorted(op.ranks()))
        return [(_SPLIT[op.kind], ranks, sum(box_numel(sl.box) for sl in op.slices))] if len(ranks) > 1 else []
    if isinstance(op, CollectiveOp) and op.kind in _RING:
        return [(op.kind, g.ranks, ring_numel(op.kind, g.in_boxes)) for g in op.groups if len(g.ranks) > 1]
    return []


def _items(c: Counter) -> tuple[Collective, ...]:
    return tuple(sorted(c.elements()))  # Counter.elements: each key its count times, none below one
