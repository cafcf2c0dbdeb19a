"""The fast paths added for planning at 10k ranks (issue 17) equal the straightforward definitions.

* ``Annotation.locate`` (a rank index) against a scan of the DG Union;
* ``local_views`` (boxes shared by subgroups with the same DS and box) against ``local_view`` per rank and
  against an independent per-rank computation from the annotation's definition (SPEC §1);
* ``Annotation`` hashing/equality/pickling/``model_copy`` with its derived caches;
* ``local_constraints`` (one derivation per distinct (ratio, DS)) against every subgroup's ``local_shape``;
* the per-subgroup memo of deduction against deducing each subgroup on its own.

Random annotations come from ``resolve_reference`` (the generator the resolve property tests use).
"""
from __future__ import annotations

import math
import pickle
import random

import pytest

from hspmd_sdk.core.annotation import DS, PARTIAL, Annotation, local_view, local_views
from hspmd_sdk.core.deduction import deduce_ds, deduce_node, local_constraints, local_shape
from hspmd_sdk.core.graph import Node
from hspmd_sdk.core.ops import OPS
from hspmd_sdk.core.symbolic import Sym, sym

from resolve_reference import annotation_of, fitting_shape


def _random_annotations(n: int, seed: int) -> list[tuple[Annotation, tuple[int, ...]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        world = rng.randint(1, 24)
        ranks = rng.sample(range(world + 8), world)
        ndim = rng.randint(1, 3)
        ann = annotation_of(rng, ranks, ndim)
        out.append((ann, fitting_shape([ann], ndim, [rng.randint(1, 3) for _ in range(ndim)])))
    return out


def _reference_view(ann: Annotation, shape: tuple[int, ...], rank: int) -> tuple:
    """SPEC §1 from scratch: subgroup box by HDim and ratios, then the DS's mixed-radix coordinates."""
    k = next(i for i, g in enumerate(ann.dg_union) if rank in g)
    pos = ann.dg_union[k].index(rank)
    box = [[0, n] for n in shape]
    if ann.hdim >= 0 and ann.hsize > 1:
        ratios = ann.hratios or [1] * ann.hsize
        unit = shape[ann.hdim] // sum(ratios)
        box[ann.hdim] = [unit * sum(ratios[:k]), unit * sum(ratios[: k + 1])]
    ds = ann.ds_union[k]
    digits, rest = {}, pos
    for key in reversed(ds.order):
        digits[key] = rest % ds.states[key]
        rest //= ds.states[key]
    for d in ds.split_dims:
        size = (box[d][1] - box[d][0]) // ds.states[d]
        box[d] = [box[d][0] + digits[d] * size, box[d][0] + (digits[d] + 1) * size]
    p_index, p_count = digits.get(PARTIAL, 0), ds.partial
    if ann.hdim == PARTIAL:
        before = sum(g.partial for g in ann.ds_union[:k])
        p_index, p_count = before + p_index, sum(g.partial for g in ann.ds_union)
    return k, pos, tuple(map(tuple, box)), p_index, p_count


def test_locate_equals_a_scan_of_the_dg_union() -> None:
    for ann, _ in _random_annotations(150, seed=1):
        for r in range(max(ann.ranks) + 3):
            want = next(((k, g.index(r)) for k, g in enumerate(ann.dg_union) if r in g), None)
            assert ann.locate(r) == want, (str(ann), r)


def test_local_views_equal_local_view_and_the_definition() -> None:
    cases = _random_annotations(300, seed=2)
    # many equal subgroups: the shared-box path is taken (HDim -1 replicas, HDim -2 summands, ratios)
    cases += [(Annotation([[4 * i + j for j in range(4)] for i in range(6)], [DS({1: 2, -2: 2})] * 6, h), (8, 12))
              for h in (-1, -2)]
    cases.append((Annotation([[2 * i, 2 * i + 1] for i in range(4)], [DS({0: 2})] * 4, 0, [1, 2, 1, 2]), (24, 2)))
    for ann, shape in cases:
        views = list(local_views(ann, shape))
        assert [v.rank for v in views] == ann.ranks
        for v in views:
            assert v == local_view(ann, shape, v.rank), (str(ann), shape, v.rank)
            assert (v.subgroup, v.position, v.box, v.partial_index, v.partial_count) == \
                _reference_view(ann, shape, v.rank), (str(ann), shape, v.rank)


def test_annotation_caches_do_not_change_equality_pickling_or_copies() -> None:
    a = Annotation("[0-3] S0x2 D2 | [4-7] S0x2 D2 ; hdim=0 ratios=1:3")
    b = Annotation("[0-3] S0x2 D2 | [4-7] S0x2 D2 ; hdim=0 ratios=1:3")
    assert a.locate(5) == (1, 1) and a.subgroup_box((8, 4), 1) == ((2, 8), (0, 4))  # fills caches on a only
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != Annotation("[0-3] S0x2 D2 | [4-7] S0x2 D2 ; hdim=0 ratios=1:1")
    assert a != Annotation("[0-3] S0x2 D2 | [4,5,7,6] S0x2 D2 ; hdim=0 ratios=1:3")
    c = pickle.loads(pickle.dumps(a))
    assert c == a and "_rank_index" not in c.__dict__ and c.locate(6) == (1, 2)
    d = a.model_copy(update={"dg_union": [[0, 1, 2, 3], [4, 5, 7, 6]]})
    assert d.locate(6) == (1, 3) and d != a  # no stale index carried over
    with pytest.raises(ValueError, match="hratios"):
        a.model_copy(update={"hdim": -2})  # a copy is validated like a new annotation
    with pytest.raises(ValueError, match="rank 2 appears in dg_union"):
        Annotation([[0, 1], [2, 2]], [DS({0: 2})] * 2)
    with pytest.raises(ValueError, match="negative rank"):
        Annotation([[0, -1]], [DS({0: 2})])


def test_local_constraints_cover_every_subgroup_once_per_expression() -> None:
    B, S = sym("B"), sym("S")
    total = 0
    for ann, shape in _random_annotations(200, seed=3):
        ndim = len(shape)
        sym_shape = tuple((B if i == 0 else S if i == 1 else shape[i]) for i in range(ndim))
        want: dict[Sym, int] = {}
        for k in range(ann.hsize):  # the straightforward way: every subgroup's local shape
            for d in local_shape(ann, sym_shape, k):
                if isinstance(d, Sym) and not d.is_integral:
                    want.setdefault(d, k)
        got = local_constraints(ann, sym_shape, "t")
        assert [c.expr for c in got] == list(want), str(ann)
        for c in got:  # each names the first subgroup that needs it
            assert f"subgroup {want[c.expr]} " in c.where
        total += len(got)
    assert total > 100  # the cases do constrain the symbols


def test_deduction_memo_equals_deducing_each_subgroup() -> None:
    x = Annotation([[4 * i + j for j in range(4)] for i in range(5)],
                   [DS({0: 2, -1: 2}), DS({0: 4}), DS({0: 2, -1: 2}), DS({0: 4}), DS({0: 2, -1: 2})], 0)
    w = Annotation(x.dg_union, [DS({1: 2, -1: 2}, [1, -1]), DS({-1: 4}), DS({1: 2, -1: 2}, [1, -1]),
                                DS({-1: 4}), DS({1: 2, -1: 2}, [1, -1])], -1)
    shapes = [(sym("B"), 16), (16, 8)]
    node = Node("y", "dot", ("x", "w"), ("y",))
    (y,) = deduce_node(node, [x, w], shapes)
    for k in range(x.hsize):
        assert y.ds_union[k] == deduce_ds(OPS["dot"], [x.ds_union[k], w.ds_union[k]], shapes, {})[0]
    assert math.prod(y.ds_union[1].states.values()) == 4


def _naive_scheme(entries, cluster, load):
    """The scheme by its definition (§5.3): for each (slice, receiver) scan every owner through Cluster.link."""
    out = []
    for e in entries:
        for r in e.receivers:
            if r in e.owners:
                out.append((r, r))
                continue
            src = min(e.owners, key=lambda o: (-cluster.link(o, r).bandwidth, load.get(o, 0), o))
            load[src] = load.get(src, 0) + e.nbytes
            out.append((src, r))
    return out


def test_bsr_scheme_equals_the_owner_scan() -> None:
    """The per-node / per-kind heaps pick exactly the sender of a scan over all owners, load carried over
    entries and tables; clusters mix kinds, node sizes and a kind whose NVLink is slower than the network."""
    from hspmd_sdk.core.bsr import BSREntry, LinkModel, bsr_scheme
    from hspmd_sdk.core.cluster import Cluster

    rng = random.Random(5)
    for trial in range(60):
        kinds = rng.sample(["H800", "H20", "A100", "cpu"], rng.randint(1, 3))
        cluster = Cluster.mixed({k: rng.randint(1, 20) for k in kinds}, per_node=rng.choice([1, 2, 4, 8]))
        n = cluster.num_ranks
        entries = []
        for i in range(rng.randint(1, 12)):
            owners = tuple(sorted(rng.sample(range(n), rng.randint(1, n))))
            receivers = tuple(sorted(rng.sample(range(n), rng.randint(1, n))))
            entries.append(BSREntry(i, ((0, 1),), owners, receivers, rng.choice([1, 2, 4, 64])))
        start = {r: rng.randint(0, 8) for r in rng.sample(range(n), n // 3)}
        load_a, load_b = dict(start), dict(start)
        got = [(a.src, a.dst) for a in bsr_scheme(entries, LinkModel(cluster), load_a)]
        assert got == _naive_scheme(entries, cluster, load_b), trial
        assert load_a == load_b
