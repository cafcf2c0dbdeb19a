"""Which uneven TP ratios (HAP, SPEC §12) a model's tensors can take: the whole parts a stage's split must keep.

A stage with ``ratios`` splits each of its TP-split tensors into chunks of ``size * r_k / sum(r)`` along the split
dim (the annotations' HDim ratios).  The split reaches more tensors than the weights: a column-split ``wq`` of
``nh * hd`` columns reshapes to ``nh`` heads, GQA's ``wk`` to its KV heads, a vocab-split head to its logits.
:func:`ratio_units` finds every such size once per model by deducing a probe plan; ratios (in lowest terms) are
feasible for a stage exactly when ``sum(r)`` divides every size its split reaches (:func:`ratio_problem`), and
:func:`feasible_ratios` gives the nearest ones that are.  Pure Python; imports nothing of the strategy or plan
modules (the strategy's checks call it).
"""
from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import HSPMDError
from .annotation import DS, Annotation, is_split
from .deduction import deduce
from .model_spec import placements_by_tensor

if TYPE_CHECKING:
    from .model_spec import ModelSpec

#: a :class:`~hspmd_sdk.core.strategy.Stage` (not imported: the strategy's checks import this module)
Stage = Any

__all__ = ["ratio_units", "stage_units", "feasible_ratios", "ratio_problem"]


@lru_cache(maxsize=64)
def _probe(hdim: int | None) -> Annotation:
    """A tensor at HDim ``hdim`` (``None``: the annotation's default, duplicated) over two one-device subgroups."""
    return Annotation([[0], [1]], [DS({}), DS({})], hdim)


@lru_cache(maxsize=16)
def ratio_units(model: "ModelSpec") -> dict[str, tuple[Any, int, int]]:
    """Every tensor of ``model``'s graph that a stage's TP split reaches: ``name -> (where, dim, size)``, where
    ``where`` is the stage position (a layer index, ``"first"`` or ``"last"``) and ``size`` the tensor's
    concrete extent along the split ``dim``.  Found by deducing a probe plan (every TP-split leaf at HDim = its
    split dim over two subgroups), so a weight's ``nh * hd`` columns and the ``nh`` heads they reshape to (and
    GQA's KV heads) all appear: ratios are feasible for a stage when every such size splits integrally."""
    graph = model.build_graph()
    table = placements_by_tensor(model)
    given = {name: _probe(p.tp_split) for name, p in table.items() if name in graph.tensors}
    anns = deduce(graph, given)  # refuses a placed tensor that is neither a leaf nor a Reshard, and an unplaced leaf
    where: dict[str, Any] = {}
    for node in graph.nodes:  # in graph order: a node's inputs are earlier nodes' outputs
        place = table.get(node.outputs[0])  # placed: a leaf or a Reshard; otherwise where its first input is
        at = place.where if place is not None else where[node.inputs[0]]
        for t in node.outputs:
            where[t] = at
    out: dict[str, tuple[Any, int, int]] = {}
    for name, ann in anns.items():
        if is_split(ann.hdim) and where.get(name) is not None:
            size = graph.tensors[name].shape[ann.hdim]
            if isinstance(size, int):
                out[name] = (where[name], ann.hdim, size)
    return out


def stage_units(model: "ModelSpec", stage: Stage, *, first: bool = False, last: bool = False
                ) -> list[tuple[str, int, int]]:
    """``(tensor, dim, size)`` of every size ``stage``'s TP split reaches (``first`` / ``last``: the stage holds
    the embedding / the head)."""
    places = set(range(stage.layers[0], stage.layers[1] + 1)) | ({"first"} if first else set()) \
        | ({"last"} if last else set())
    return [(name, d, size) for name, (w, d, size) in ratio_units(model).items() if w in places]


def feasible_ratios(ratios: Sequence[int], unit: int) -> list[int] | None:
    """The ratios nearest to ``ratios`` (in lowest terms) that split ``unit`` whole parts integrally with at least
    one part per rank, or ``None`` when ``unit`` has fewer parts than ranks.  Every size that a stage's split
    reaches must be a multiple of ``sum(ratios)`` in lowest terms, so ``unit`` is the gcd of those sizes."""
    n, total = len(ratios), sum(ratios)
    best: tuple[Fraction, list[int]] | None = None
    for parts in range(n, unit + 1):
        if unit % parts:
            continue
        exact = [Fraction(r * parts, total) for r in ratios]  # exact: equal remainders and errors tie exactly
        got = [max(1, int(x)) for x in exact]
        while sum(got) < parts:  # largest remainder
            i = max(range(n), key=lambda i: exact[i] - got[i])
            got[i] += 1
        while sum(got) > parts:
            i = max((i for i in range(n) if got[i] > 1), key=lambda i: got[i] - exact[i])
            got[i] -= 1
        err = max(abs(Fraction(g, parts) - Fraction(r, total)) for g, r in zip(got, ratios))
        g = math.gcd(*got)
        if best is None or err <= best[0]:  # ties: the finer split, nearer the ask
            best = (err, [x // g for x in got])
    return None if best is None else best[1]


def ratio_problem(model: "ModelSpec", stage: Stage, *, first: bool = False, last: bool = False) -> str | None:
    """Why ``stage``'s ratios cannot split ``model``'s tensors on it (a head cut in two, a size that does not
    divide), naming the tensor and the nearest feasible ratios; ``None`` when they can.  ``first`` / ``last``:
    the stage holds the embedding / the head."""
    ratios = stage.tp_ratios
    if ratios is None:
        return None
    try:
        units = stage_units(model, stage, first=first, last=last)
    except HSPMDError as e:  # a model whose graph the probe cannot deduce: say so rather than fail elsewhere
        return f"cannot check ratios {':'.join(map(str, ratios))} against model {model.name!r}: {e}"
    total = sum(ratios)
    bad = next(((n, d, size) for n, d, size in units if size % total), None)
    if bad is None:
        return None
    name, d, size = bad
    unit = math.gcd(*(size for _, _, size in units))
    near = feasible_ratios(ratios, unit)
    shares = " : ".join(f"{size * r / total:g}" for r in ratios)
    hint = (f"nearest feasible ratios: {':'.join(map(str, near))}" if near is not None else
            f"no split over {stage.tp_degree} ranks exists (the sizes have only {unit} common parts)")
    return (f"ratios {':'.join(map(str, ratios))} split tensor {name!r} dim {d} of size {size} into {shares}, "
            f"not whole parts (each TP rank must hold whole heads, KV heads and rows); every size the stage's "
            f"split reaches must divide by {total}; {hint}")
