"""Annotation deduction (paper §6.1): from the plan's leaf and Reshard annotations to every tensor's annotation.

* DG Union and HSize propagate unchanged: every input of an op must have the same DG Union (hence HSize); a
  mismatch without a Reshard is a :class:`~hspmd_sdk.errors.SpecializationError` naming both tensors.
* DS Union and HDim follow the op's axis rule (:mod:`hspmd_sdk.core.op_registry`): per sharding subgroup the inputs'
  DS are refined to common device axes and each axis is mapped; HDim is the same rule on one axis of HSize.

Results are memoised on ``(op, attrs, input annotations, input shapes)``: the layers of one pipeline stage share
annotations, so a 60-layer model costs a handful of distinct deductions.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping, Sequence

from ..errors import ShapeError, SpecializationError
from .annotation import DS, DUPLICATE, PARTIAL, Annotation, format_ranks, is_split
from .graph import Graph, Node
from .op_registry import OPS, OpDef, RuleError
from .symbolic import Constraint, Dim, Sym, dim_div, dim_frac

__all__ = ["deduce", "deduce_node", "refine_axes", "deduce_ds", "partial_as_duplicate", "weight_grad_annotation",
           "activation_grad_annotation",
           "local_shape", "local_constraints"]


# ---- bottom tier: DS ------------------------------------------------------------------------------------------
def refine_axes(ds_list: Sequence[DS]) -> list[tuple[tuple[int, ...], int]]:
    """The common refinement of several DS over the same devices: a list of ``(keys, degree)`` axes, slowest
    first, where ``keys[i]`` is input ``i``'s key on that axis.  An axis of degree ``n`` splits into an outer
    ``m`` and inner ``n/m`` axis with the same key (mixed-radix digits stay consistent)."""
    # each DS's axes still to place, slowest last (popped first); the top of a stack is what remains of its axis
    stacks = [[(k, ds.states[k]) for k in reversed(ds.order)] for ds in ds_list]
    out: list[tuple[tuple[int, ...], int]] = []
    while any(stacks):
        if not all(stacks):
            raise RuleError(f"DS {', '.join(map(str, ds_list))} span different numbers of devices")
        rest = [s[-1][1] for s in stacks]
        m = min(rest)
        if any(r % m for r in rest):
            raise RuleError(f"DS {', '.join(map(str, ds_list))} have device axes that do not nest "
                            f"(degrees {rest}); align them with a Reshard")
        out.append((tuple(s[-1][0] for s in stacks), m))
        for s in stacks:
            key, deg = s.pop()
            if deg > m:
                s.append((key, deg // m))
    return out


def _assemble(axes: list[tuple[int, int]]) -> DS:
    """Build a DS from ``(key, degree)`` axes, merging adjacent axes of one key."""
    return _assemble_cached(tuple(axes))


@lru_cache(maxsize=4096)
def _assemble_cached(axes: tuple[tuple[int, int], ...]) -> DS:
    merged: list[list[int]] = []
    for key, deg in axes:
        if merged and merged[-1][0] == key:
            merged[-1][1] *= deg
        elif any(m[0] == key for m in merged):
            raise RuleError(f"the result would hold key {key} on two non-adjacent device axes, which a DS cannot "
                            "express; insert a Reshard")
        else:
            merged.append([key, deg])
    return DS({k: d for k, d in merged}, [k for k, _ in merged])


def deduce_ds(op: OpDef, ds_list: Sequence[DS], shapes: Sequence[tuple[Dim, ...]],
              attrs: Mapping[str, Any]) -> list[DS]:
    """Bottom-tier deduction for one sharding subgroup: output DS of ``op`` from its inputs' DS."""
    axes = refine_axes(ds_list)
    per_out: list[list[tuple[int, int]]] | None = None
    for keys, deg in axes:
        outs = op.axis(keys, shapes, attrs)
        if per_out is None:
            per_out = [[] for _ in outs]
        for i, k in enumerate(outs):
            per_out[i].append((k, deg))
    if per_out is None:  # no device axes: every input is whole on one device
        n_out = len(op.axis((DUPLICATE,) * len(ds_list), shapes, attrs))
        return [DS() for _ in range(n_out)]
    return [_assemble(a) for a in per_out]


# ---- top tier and the whole annotation ------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def _hdim_ds_cached(hdim: int, hsize: int) -> DS:
    return DS({hdim: hsize})  # HSize 1: a degree-1 key, which DS drops (the empty DS)


def _hdim_ds(ann: Annotation) -> DS:
    return _hdim_ds_cached(ann.hdim, ann.hsize)


@lru_cache(maxsize=65536)
def _deduce_cached(kind: str, attrs: tuple[tuple[str, Any], ...], anns: tuple[Annotation, ...],
                   shapes: tuple[tuple[Dim, ...], ...]) -> tuple[Annotation, ...]:
    op = OPS[kind]
    ad = dict(attrs)
    first = anns[0]
    memo: dict[tuple[DS, ...], list[DS]] = {}  # the subgroups of a large plan repeat a few DS combinations
    per_sub = []
    for k in range(first.hsize):
        ds_in = tuple(a.ds_union[k] for a in anns)
        got = memo.get(ds_in)
        if got is None:
            got = memo[ds_in] = deduce_ds(op, ds_in, shapes, ad)
        per_sub.append(got)
    top = deduce_ds(op, [_hdim_ds(a) for a in anns], shapes, ad)
    # the inputs split across subgroups (HDim) must be split in the same ratios: subgroup k computes on the k-th
    # chunk of each, and chunks of different sizes do not meet
    split = [a for a in anns if is_split(a.hdim)]
    if len({tuple(a.hratios or ()) for a in split}) > 1:
        raise RuleError("the inputs split across subgroups (HDim) are split in different ratios ("
                        + ", ".join(":".join(map(str, a.hratios)) if a.hratios else "even" for a in split)
                        + "); give them the same hratios or insert a Reshard")
    ratios = split[0].hratios if split else None
    outs: list[Annotation] = []
    for i in range(len(per_sub[0])):
        hd = top[i].order[0] if top[i].order else DUPLICATE
        outs.append(Annotation([list(dg) for dg in first.dg_union], [p[i] for p in per_sub], hd,
                               ratios if is_split(hd) else None))
    return tuple(outs)


def _dgu(ann: Annotation) -> str:
    return "[" + ", ".join(f"[{format_ranks(g)}]" for g in ann.dg_union) + "]"


def deduce_node(node: Node, anns: Sequence[Annotation], shapes: Sequence[tuple[Dim, ...]]) -> list[Annotation]:
    """Output annotations of a compute node; ``SpecializationError`` names the node, tensors and subgroup."""
    for t, a in zip(node.inputs[1:], anns[1:]):
        if a.dg_union != anns[0].dg_union:
            raise SpecializationError(
                f"op {node.name!r} ({node.kind}): input {node.inputs[0]!r} lives on DG Union "
                f"{_dgu(anns[0])} (HSize {anns[0].hsize}) but input {t!r} on {_dgu(a)} (HSize {a.hsize}); an op "
                f"runs where its inputs are, so insert a Reshard before {t!r} (or {node.inputs[0]!r}) to move it")
    try:
        return list(_deduce_cached(node.kind, node.attrs, tuple(anns), tuple(tuple(s) for s in shapes)))
    except RuleError as e:
        desc = "; ".join(f"{t!r}: {a}" for t, a in zip(node.inputs, anns))
        raise SpecializationError(f"op {node.name!r} ({node.kind}) cannot be deduced: {e}. Inputs: {desc}") from None


def deduce(graph: Graph, given: Mapping[str, Annotation]) -> dict[str, Annotation]:
    """Annotation of every tensor of ``graph`` (§6.1).

    ``given`` holds the plan's annotations: required for every leaf; optional for a Reshard (without one, the
    Reshard keeps its input's annotation and resolves to Identity).  Annotations of other tensors in ``given``
    are an error (they are deduced, not chosen).
    """
    out: dict[str, Annotation] = {}
    chosen: set[str] = set()  # the tensors a plan may annotate: leaves' and Reshards' outputs
    for node in graph.nodes:
        if node.is_leaf or node.is_reshard:
            chosen.add(node.outputs[0])
        if node.is_leaf:
            name = node.outputs[0]
            if name not in given:
                raise SpecializationError(f"{node.kind} {name!r} has no annotation in the plan; add "
                                          f"plan.annotations[{name!r}] (leaf operators must be annotated, §3)")
            out[name] = given[name]
        elif node.is_reshard:
            name = node.outputs[0]
            out[name] = given.get(name, out[node.inputs[0]])
        else:
            anns = [out[t] for t in node.inputs]
            shapes = [graph.tensors[t].shape for t in node.inputs]
            for name, a in zip(node.outputs, deduce_node(node, anns, shapes)):
                out[name] = a
    extra = [n for n in given if n in graph.tensors and n not in chosen]
    if extra:
        raise SpecializationError(f"the plan annotates tensors that are neither leaves nor Reshards: {extra}")
    return out


# ---- gradients -------------------------------------------------------------------------------------------------
@lru_cache(maxsize=4096)
def partial_as_duplicate(ann: Annotation) -> Annotation:
    """The annotation of the gradient flowing back into a tensor annotated ``ann``: Partial becomes Duplicate
    (every summand receives the whole gradient), top tier and bottom tier."""
    subs = []
    for ds in ann.ds_union:
        axes = [(DUPLICATE if k == PARTIAL else k, ds.states[k]) for k in ds.order]
        subs.append(_assemble(axes))
    hd = DUPLICATE if ann.hdim == PARTIAL else ann.hdim
    return Annotation([list(dg) for dg in ann.dg_union], subs, hd, ann.hratios)  # hd is split iff ann.hdim is


@lru_cache(maxsize=4096)
def weight_grad_annotation(kind: str, act: Annotation, weight: Annotation, act_shape: tuple[Dim, ...],
                           weight_shape: tuple[Dim, ...]) -> Annotation:
    """Annotation of a weight's local gradient after the backward of op ``kind``: a Duplicate weight axis that
    faces a Split of a dim the weight does not have (a batch or sequence split: data parallelism) holds a
    Partial gradient.  With HDim -1 across pipelines that split the batch (hdim 0) this gives HDim -2, the
    gradient synchronisation the paper resolves to SplitAllReduce."""
    op = OPS[kind]
    batch = set(op.batch_dims([act_shape, weight_shape]))

    def grad_key(ak: int, wk: int) -> int:
        return PARTIAL if wk == DUPLICATE and ak in batch else wk

    subs = []
    for a_ds, w_ds in zip(act.ds_union, weight.ds_union):
        axes = refine_axes([a_ds, w_ds])
        subs.append(_assemble([(grad_key(keys[0], keys[1]), deg) for keys, deg in axes]))
    # (HSize 1: Annotation makes the HDim Duplicate; grad_key keeps a split key, so hd is split iff weight.hdim is)
    hd = grad_key(act.hdim, weight.hdim)
    return Annotation([list(dg) for dg in weight.dg_union], subs, hd, weight.hratios)


# ---- local shapes ----------------------------------------------------------------------------------------------
def local_shape(ann: Annotation, shape: Sequence[Dim], subgroup: int, tensor: str = "") -> tuple[Dim, ...]:
    """Symbolic shape of the local shard held by every device of ``subgroup`` (equal within a subgroup).

    Concrete dims that do not divide raise ``ShapeError`` now; symbolic ones carry the constraint."""
    out = list(shape)
    where = f"subgroup {subgroup} ({format_ranks(ann.dg_union[subgroup])})"
    if is_split(ann.hdim):  # (an HSize-1 annotation's HDim is always Duplicate)
        d = ann.hdim
        if d >= len(shape):
            raise ShapeError(f"tensor {tensor!r}: HDim {d} but the tensor has {len(shape)} dims")
        ratios = ann.hratios or [1] * ann.hsize
        out[d] = dim_frac(out[d], ratios[subgroup], sum(ratios), tensor=tensor, dim=d,
                          why=f"HDim split in ratios {ratios}, {where}")
    ds = ann.ds_union[subgroup]
    for d in ds.split_dims:
        if d >= len(shape):
            raise ShapeError(f"tensor {tensor!r}: {where} DS {ds} splits dim {d} but the tensor has {len(shape)} dims")
        out[d] = dim_div(out[d], ds.states[d], tensor=tensor, dim=d, why=f"{where} DS {ds}")
    return tuple(out)


def local_constraints(ann: Annotation, shape: Sequence[Dim], tensor: str) -> list[Constraint]:
    """Divisibility constraints the local shards of ``tensor`` put on the symbols (checked again at bind): one per
    distinct expression, naming the first subgroup that needs it.

    Linear in HSize: the local shape of subgroup ``k`` depends only on its HDim ratio and its DS, so subgroups
    that share both (the many equal pipelines of a large plan) are derived once."""
    out: dict[Sym, Constraint] = {}
    seen: set[tuple[int, DS]] = set()
    ratios = ann.hratios or [1] * ann.hsize
    for k in range(ann.hsize):
        key = (ratios[k], ann.ds_union[k])
        if key in seen:
            continue
        seen.add(key)
        for i, d in enumerate(local_shape(ann, shape, k, tensor)):
            if isinstance(d, Sym) and not d.is_integral and d not in out:
                out[d] = Constraint(tensor, i, d, f"local shard of subgroup {k} ({format_ranks(ann.dg_union[k])})")
    return list(out.values())


def activation_grad_annotation(kind: str, anns: Sequence[Annotation], shapes: Sequence[tuple[Dim, ...]],
                               index: int) -> Annotation:
    """Annotation of the gradient op ``kind``'s backward gives input ``index`` (an activation).

    The backward of most ops leaves the gradient laid out like the input (Partial read as Duplicate).  A Dot
    whose Duplicate input meets a column-split (or Partial) weight gives a Partial input gradient on that axis
    (Megatron's "f": identity forward, all-reduce backward; the op's ``input_grad`` rule); the specializer inserts
    that reduction."""
    return _activation_grad(kind, tuple(anns), index)  # (the input_grad rules read keys, not shapes)


@lru_cache(maxsize=4096)
def _activation_grad(kind: str, anns: tuple[Annotation, ...], index: int) -> Annotation:
    base = partial_as_duplicate(anns[index])
    rule = OPS[kind].input_grad
    if rule is None or index != 0:
        return base
    x, w = anns[0], anns[1]
    subs = []
    for x_ds, w_ds in zip(x.ds_union, w.ds_union):
        axes = refine_axes([x_ds, w_ds])
        subs.append(_assemble([(rule(k[0], k[1]), d) for k, d in axes]))
    hd = rule(x.hdim, w.hdim)  # (HSize 1: Annotation makes it Duplicate)
    return Annotation([list(dg) for dg in x.dg_union], subs, hd, x.hratios if is_split(hd) else None)


def clear_caches() -> None:
    """Drop the memoised deductions (for benchmarks that want cold runs)."""
    for fn in (_assemble_cached, _hdim_ds_cached, _deduce_cached, partial_as_duplicate, weight_grad_annotation,
               _activation_grad):
        fn.cache_clear()
