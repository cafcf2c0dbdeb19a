"""The per-subgroup local views (issue 45, item 4): ``subgroup_views`` works a subgroup's boxes out once per DS and
extent and offsets them, ``Annotation.subgroup_boxes`` checks a shape once per DS and extent, and specialization's
kernel groups, node rank sets and pipeline order read them per subgroup.  Each must say exactly what the per-rank
definitions say: the layout oracle (``layout_oracle``, independent of the SDK), ``local_view`` of one rank,
``subgroup_box`` and ``check_shape`` subgroup by subgroup, and the per-rank versions written out here."""
from __future__ import annotations

import random
from typing import Any

import pytest
from pydantic import BaseModel

import layout_oracle as oracle
from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.annotation import DS, Annotation, local_view, local_views, subgroup_views
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.ops import op_def
from hspmd_sdk.core.specialize import _kernel_groups, _node_rank_sets, _pipeline_order, specialize
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.core.symbolic import evaluate_shape
from hspmd_sdk.errors import ShapeError
from resolve_reference import annotation_of, fitting_shape, plain


def _random_cases(seed: int, n: int) -> list[tuple[Annotation, tuple[int, ...]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ndim = rng.randint(1, 3)
        ann = annotation_of(rng, range(rng.randint(2, 24)), ndim)
        out.append((ann, fitting_shape([ann], ndim, [rng.choice([1, 2, 3]) for _ in range(ndim)])))
    return out


def _many_subgroups() -> list[tuple[Annotation, tuple[int, ...]]]:
    """Large HSize: uneven hratios on a split HDim, subgroups sharing DS objects and equal DS made apart, TP2/TP4
    mixed, a Partial HDim with Partial subgroups (the summands numbered across subgroups)."""
    tp4, tp2, p2 = DS({1: 4}), DS({1: 2}), DS({-2: 2, 1: 2}, [1, -2])
    dg, ds, at = [], [], 0
    for k in range(30):
        size = 4 if k % 3 else 2
        dg.append(list(range(at, at + size))[::-1 if k % 5 == 0 else 1])
        ds.append(tp4 if size == 4 and k % 2 else DS({1: 4}) if size == 4 else tp2)
        at += size
    ratios = [1 + k % 4 for k in range(30)]
    uneven = Annotation(dg, ds, 0, ratios)
    partial = Annotation(dg, [p2 if len(g) == 4 else DS({-2: 2}) for g in dg], -2)
    dup = Annotation(dg, ds, -1)
    even = Annotation(dg, ds, 0)
    return [(uneven, (sum(ratios) * 2, 16)), (partial, (6, 8)), (dup, (5, 8)), (even, (60, 8))]


CASES = _random_cases(1, 400) + _many_subgroups()


@pytest.mark.parametrize("ann, shape", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_subgroup_views_are_the_per_rank_views(ann: Annotation, shape: tuple[int, ...]) -> None:
    views = subgroup_views(ann, shape)
    truth = oracle.layout(plain(ann), shape)
    assert views.subgroup_boxes == [ann.subgroup_box(shape, k) for k in range(ann.hsize)]
    assert len(views.boxes) == len(views.partial_indices) == len(views.partial_counts) == ann.hsize
    for k, dg in enumerate(ann.dg_union):
        assert len(views.boxes[k]) == len(views.partial_indices[k]) == len(dg)
        for pos, r in enumerate(dg):
            one = local_view(ann, shape, r)  # the single-rank path: the subgroup's own box, no offsets
            assert one is not None
            got = (r, k, pos, views.boxes[k][pos], views.partial_indices[k][pos], views.partial_counts[k])
            assert got == (one.rank, one.subgroup, one.position, one.box, one.partial_index, one.partial_count)
            held = truth[r]
            assert (views.boxes[k][pos], views.partial_indices[k][pos], views.partial_counts[k]) == \
                (held.box, held.index, held.count)
    assert [(v.rank, v.box) for v in local_views(ann, shape)] == [(r, b) for dg, bs in zip(ann.dg_union, views.boxes)
                                                                   for r, b in zip(dg, bs)]


def _check_shape_per_subgroup(ann: Annotation, shape: tuple[int, ...]) -> None:
    """``check_shape`` as it was written before: every subgroup in turn, its HDim chunk then its DS."""
    from hspmd_sdk.core.annotation import format_ranks

    for k, ds in enumerate(ann.ds_union):
        try:
            box = ann.subgroup_box(shape, k)
        except ShapeError as e:
            raise ShapeError(str(e)) from None
        try:
            ds.check_shape([b - a for a, b in box])
        except ShapeError as e:
            raise ShapeError(f"subgroup {k} ({format_ranks(ann.dg_union[k])}): {e}") from None


def _error(fn: Any, *args: Any) -> str | None:
    try:
        fn(*args)
    except ShapeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("seed", range(4))
def test_subgroup_boxes_raise_what_the_per_subgroup_check_raises(seed: int) -> None:
    """On shapes that often do not fit (a dim off by one, ratios that do not divide), the first failing subgroup
    and the text are the per-subgroup check's."""
    rng = random.Random(seed)
    failed = 0
    for ann, shape in _random_cases(seed + 10, 150) + _many_subgroups():
        bad = tuple(n + rng.choice([0, 0, 1, -1]) if n > 1 else n for n in shape)
        for s in (shape, bad):
            want = _error(_check_shape_per_subgroup, ann, s)
            assert _error(ann.check_shape, s) == want
            assert _error(subgroup_views, ann, s) == want
            failed += want is not None
            if want is None:
                assert ann.subgroup_boxes(s) == [ann.subgroup_box(s, k) for k in range(ann.hsize)]
    assert failed > 20


def test_equal_annotations_with_distinct_ds_objects_are_equal() -> None:
    dg = [[2 * k, 2 * k + 1] for k in range(50)]
    a = Annotation(dg, [DS({0: 2})] * 50, -1)
    b = Annotation(dg, [DS({0: 2}) for _ in range(50)], -1)
    assert a == b and hash(a) == hash(b)
    c = Annotation(dg, [DS({0: 2})] * 49 + [DS({-1: 2})], -1)
    assert a != c and b != c
    d = Annotation(dg, [DS({0: 2}), DS({-1: 2})] * 25, -1)
    e = Annotation(dg, [DS({0: 2}), DS({0: 2})] * 25, -1)  # the same pair of objects, then one unequal pair
    assert d != e


def test_an_annotation_in_another_model_is_not_checked_again_but_a_new_one_is() -> None:
    class Holder(BaseModel):
        anns: dict[str, Annotation]

    a = Annotation([[0, 1], [2, 3]], [DS({0: 2})] * 2, 0)
    assert Holder(anns={"x": a}).anns["x"] is a
    assert Holder.model_validate({"anns": {"x": {"dg_union": [[0, 1]], "ds_union": [{"states": {0: 2}}]}}}).anns[
        "x"] == Annotation.spmd([0, 1], DS({0: 2}))
    with pytest.raises(ValueError, match="disjoint"):
        Holder.model_validate({"anns": {"x": {"dg_union": [[0, 1], [1, 2]], "ds_union": [{"states": {0: 2}}] * 2}}})


# ---- specialization's per-subgroup passes, against their per-rank definitions ----------------------------------
def _kernel_groups_per_rank(graph: Any, anns: Any, bindings: Any) -> list[list[int]]:
    out: dict[tuple[Any, ...], list[int]] = {}
    for n in graph.nodes:
        mixes = op_def(n.kind).mixes
        if not mixes or not n.inputs:
            continue
        t = n.inputs[0]
        shape = tuple(int(d) for d in evaluate_shape(graph.tensors[t].shape, bindings, tensor=t))
        for view in local_views(anns[t], shape):
            key = (n.name,) + tuple(b for d, b in enumerate(view.box) if d not in mixes)
            out.setdefault(key, []).append(view.rank)
    return [g for g in out.values() if len(set(g)) > 1]


HETERO = {"pipelines": [  # TP2 -> TP1, TP4 (cp 2 x tp 2) -> TP2 -> TP1, TP1: uneven micro-batching
    {"stages": [{"devices": [0, 1], "layers": [0, 1]}, {"devices": [2], "layers": [2, 3]}],
     "micro_batch_size": 3, "num_micro_batches": 1},
    {"stages": [{"devices": [3, 4, 5, 6], "layers": [0, 0], "cp": 2}, {"devices": [7, 8], "layers": [1, 2]},
                {"devices": [9], "layers": [3, 3]}], "micro_batch_size": 1, "num_micro_batches": 2},
    {"stages": [{"devices": [11], "layers": [0, 3]}], "micro_batch_size": 2, "num_micro_batches": 1}]}


@pytest.mark.parametrize("zero1", [False, True])
def test_kernel_groups_node_ranks_and_pipeline_order_are_the_per_rank_ones(zero1: bool) -> None:
    config = LlamaConfig.preset("tiny")
    strategy = Strategy.load({**HETERO, "zero1": zero1})
    cluster = Cluster.local(12)
    prog = specialize(config, plan_from_strategy(config, strategy, cluster), cluster)
    graph, anns = prog.graph, prog.annotations
    groups = _kernel_groups(graph, anns, prog.bindings)
    assert groups == _kernel_groups_per_rank(graph, anns, prog.bindings)
    assert any(len(g) == 2 for g in groups)  # the cp=2 stage's attention
    nodes = _node_rank_sets(graph, anns)
    for n in graph.nodes:
        assert nodes[n.name] == frozenset(r for t in n.inputs + n.outputs for r in anns[t].ranks)
    dg = anns[graph.placeholders[0].outputs[0]].dg_union
    key = _pipeline_order(graph, anns)
    for stage in [[0, 1], [2], [3, 4, 5, 6], [9], [11], [10], [10, 2]]:
        first = next((k for k, g in enumerate(dg) if set(stage) & set(g)), len(dg))
        assert key(stage) == (first, min(stage))
