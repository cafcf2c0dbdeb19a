"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/annotation.py.

The reference is the independent layout oracle (``layout_oracle``, the paper's §4 in numpy, reading only the
public fields of an annotation): seeded random annotations (the generators of ``resolve_reference``) must give, for
every rank, the oracle's box, subgroup, position and partial summand; DS coordinates must be the odometer of
``itertools.product``; the notation and the rank lists are checked on strings written by hand.
"""
from __future__ import annotations

import itertools
import pickle
import random
import re

import pytest

import layout_oracle as oracle
from hspmd_sdk.core.annotation import (MAX_RANK, DS, Annotation, format_ranks, local_view, local_views,
                                       parse_ranks)
from hspmd_sdk.errors import ShapeError

from resolve_reference import annotation_of, fitting_shape, plain


def test_local_views_are_the_oracles_layout() -> None:
    rng = random.Random("kill-annotation")
    for trial in range(150):
        n = rng.randint(1, 16)
        ndim = rng.randint(1, 3)
        ann = annotation_of(rng, range(n), ndim)
        shape = fitting_shape([ann], ndim, [rng.choice([1, 2, 3]) for _ in range(ndim)])
        want = oracle.layout(plain(ann), shape)
        views = list(local_views(ann, shape))
        assert [v.rank for v in views] == list(want), trial  # DG Union order
        for v in views:
            h = want[v.rank]
            assert (v.subgroup, v.position, v.box) == (h.subgroup, h.position, h.box), (trial, ann, shape, v)
            assert (v.partial_index, v.partial_count) == (h.index, h.count), (trial, ann, v)
            assert v.shape == h.shape and v.slices == h.slices
            one = 1
            for a, b in h.box:
                one *= b - a
            assert v.numel == one
            assert local_view(ann, shape, v.rank) == v
            assert ann.locate(v.rank) == (h.subgroup, h.position)
        outside = max(want) + 1
        assert local_view(ann, shape, outside) is None and ann.locate(outside) is None
        assert ann.ranks == list(want)


def test_coords_and_position_are_the_odometer() -> None:
    for states, order in [({-2: 2, -1: 3, 0: 2}, [0, -2, -1]), ({1: 4, 0: 2}, None), ({-1: 2, 0: 2}, [-1, 0]),
                          ({0: 3, 1: 1, 2: 2}, [2, 0])]:
        ds = DS(states, order)
        want = oracle.coordinates(states, order)
        assert ds.device_num == len(want)
        for pos, c in enumerate(want):
            assert ds.coords(pos) == c and list(ds.coords(pos)) == [k for k, _ in oracle.axes(states, order)]
            assert ds.position(c) == pos
        with pytest.raises(IndexError):
            ds.coords(len(want))
        with pytest.raises(IndexError):
            ds.coords(-1)
    assert DS({-1: 2, 0: 2}).coords(1) == {-1: 0, 0: 1}
    assert DS({0: 2, 1: 3}, [1, 0]).position({1: 2}) == 4  # missing keys count as 0


def test_ds_notation_and_queries() -> None:
    ds = DS.parse("P2 D3 S1x4")
    assert ds.states == {-2: 2, -1: 3, 1: 4} and ds.order == [-2, -1, 1]
    assert (ds.partial, ds.duplicate, ds.degree(1), ds.degree(0), ds.split_dims) == (2, 3, 4, 1, [1])
    assert str(ds) == "P2 D3 S1x4" and repr(ds) == "DS('P2 D3 S1x4')"
    assert str(DS("S0x2 D2")) == "S0x2 D2" and DS("S0x2 D2").order == [0, -1]
    assert str(DS({})) == "R" and DS("R") == DS({}) and DS("").states == {}
    assert DS({0: 1, -1: 2}).states == {-1: 2}  # degree-1 keys dropped
    assert hash(DS("D2 S0x2")) == hash(DS({-1: 2, 0: 2})) and hash(DS("D2 S0x2")) != hash(DS("S0x2 D2"))
    for bad in ["Q2", "S0x", "P2 P2", "S0x2 S0x3", "Dx2"]:
        with pytest.raises(ValueError):
            DS(bad)
    DS({0: 4}).check_shape([8, 3])
    with pytest.raises(ShapeError):
        DS({0: 4}).check_shape([6, 3])
    with pytest.raises(ShapeError):
        DS({2: 2}).check_shape([4, 4])


def test_rank_lists() -> None:
    assert parse_ranks("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_ranks(" 5 , 7-9,, 2") == [5, 7, 8, 9, 2]
    assert parse_ranks("4-4") == [4]
    for bad in ["3-1", "-1", "99999999", "0-131072"]:
        with pytest.raises(ValueError):
            parse_ranks(bad)
    assert parse_ranks("131071") == [131071]
    assert format_ranks([0, 1, 2, 3, 8]) == "0-3,8"
    assert format_ranks([0, 1, 3, 4]) == "0,1,3,4"
    assert format_ranks([5, 6, 7, 1, 2, 3]) == "5-7,1-3"
    assert format_ranks([2]) == "2" and format_ranks([]) == ""
    assert format_ranks([3, 2, 1]) == "3,2,1"


def test_annotation_notation_boxes_and_equality() -> None:
    a = Annotation.parse("[0,3] S1x2 | [5-7] D3 ; hdim=0 ratios=1:2")
    assert a.dg_union == [[0, 3], [5, 6, 7]] and a.hdim == 0 and a.hratios == [1, 2] and a.hsize == 2
    assert str(a) == "[0,3] S1x2 | [5-7] D3 ; hdim=0 ratios=1:2"
    assert repr(a) == f"Annotation({str(a)!r})"
    assert a.subgroup_box((12, 4), 0) == ((0, 4), (0, 4)) and a.subgroup_box((12, 4), 1) == ((4, 12), (0, 4))
    with pytest.raises(ShapeError):
        a.subgroup_box((10, 4), 0)  # 10 does not split 1:2
    with pytest.raises(ShapeError):
        Annotation.parse("[0] R | [1] R ; hdim=2").subgroup_box((4, 4), 0)
    with pytest.raises(ShapeError, match="tensor 'w'"):
        a.check_shape((12, 3), "w")  # S1x2 of 3
    a.check_shape((12, 4), "w")
    b = Annotation([[0, 3], [5, 6, 7]], [DS({1: 2}), DS({-1: 3})], 0, [1, 2])
    assert a == b and hash(a) == hash(b) and a != Annotation.parse("[0,3] S1x2 | [5-7] D3 ; hdim=0")
    assert a != Annotation.parse("[0,3] S1x2 | [5-7] D3 ; hdim=1 ratios=1:2")
    assert a != Annotation.parse("[0,3] S1x2 | [5-7] D3 ; hdim=0 ratios=2:1")
    assert a != Annotation.parse("[3,0] S1x2 | [5-7] D3 ; hdim=0 ratios=1:2")
    assert a != Annotation.parse("[0,3] S0x2 | [5-7] D3 ; hdim=0 ratios=1:2")
    assert (a == 5) is False and a.__eq__(5) is NotImplemented
    eq = Annotation.parse("[0,1] D2 | [2,3] D2 ; hdim=0 ratios=3:3")
    assert eq.hratios is None and str(eq) == "[0,1] D2 | [2,3] D2 ; hdim=0"
    assert str(Annotation.parse("[0,1] P2 | [2,3] P2 ; hdim=-2")) == "[0,1] P2 | [2,3] P2 ; hdim=-2"
    assert str(Annotation.parse("[0,1] D2 | [2,3] D2")) == "[0,1] D2 | [2,3] D2"
    single = Annotation.parse("[0-3] S0x4 ; hdim=0 ratios=1")
    assert single.hdim == -1 and single.hratios is None and str(single) == "[0-3] S0x4"
    for bad in ["[0,1] D2 ; bogus=1", "0,1 D2", "[0,1] D3"]:
        with pytest.raises(ValueError):
            Annotation.parse(bad)
    spmd = Annotation.spmd([4, 5])
    assert spmd.dg_union == [[4, 5]] and spmd.ds_union == [DS({-1: 2})]
    assert Annotation.spmd([0, 1], "S0x2").ds_union == [DS({0: 2})]
    assert Annotation.spmd([0, 1], DS({-2: 2})).ds_union == [DS({-2: 2})]


def test_copies_pickles_and_partial_offsets() -> None:
    a = Annotation.parse("[0,1] P2 | [2,3,4] P3 ; hdim=-2")
    assert a.partial_offsets == (0, 2, 5)
    views = {v.rank: (v.partial_index, v.partial_count) for v in local_views(a, (4,))}
    assert views == {0: (0, 5), 1: (1, 5), 2: (2, 5), 3: (3, 5), 4: (4, 5)}
    list(local_views(a, (4,)))
    c = pickle.loads(pickle.dumps(a))
    assert c == a and hash(c) == hash(a) and list(local_views(c, (4,))) == list(local_views(a, (4,)))
    state = a.__getstate__()
    assert not set(state["__dict__"]) & {"partial_offsets", "_rank_index", "_ratio_offsets", "_hash"}
    m = a.model_copy(update={"hdim": -1})
    assert m.hdim == -1 and m.dg_union == a.dg_union and m != a  # (hash(-1) == hash(-2) in CPython)
    assert a.model_copy() == a and a.model_copy().hratios is None
    r = Annotation.parse("[0] R | [1] R ; hdim=0 ratios=1:3").model_copy()
    assert r.hratios == [1, 3]
    with pytest.raises(ValueError):
        a.model_copy(update={"hratios": [1, 2]})


def test_local_view_checks_the_shape() -> None:
    a = Annotation.parse("[0,1] S0x2 | [2,3] S0x2 ; hdim=0")
    assert local_view(a, (8,), 3).box == ((6, 8),)
    with pytest.raises(ShapeError):
        local_view(a, (6,), 3)  # 3 rows per subgroup, split in 2
    with pytest.raises(ShapeError):
        list(local_views(a, (6,)))
    views = list(local_views(Annotation.parse("[0,1] S0x2 | [2,3] S0x2"), (4,)))  # replicas share boxes
    assert [v.box for v in views] == [((0, 2),), ((2, 4),), ((0, 2),), ((2, 4),)]
    assert [(v.subgroup, v.position) for v in views] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_subgroup_sizes_not_offsets_are_checked() -> None:
    """Subgroup 1 holds rows 4..10 of 10 (ratios 2:3): 6 rows split in 3 fits, whatever the offset."""
    a = Annotation.parse("[0,1] S0x2 | [2,3,4] S0x3 ; hdim=0 ratios=2:3")
    a.check_shape((10,))
    assert [local_view(a, (10,), r).box for r in (0, 1, 2, 3, 4)] == [((0, 2),), ((2, 4),), ((4, 6),), ((6, 8),),
                                                                   ((8, 10),)]


def test_ds_normalises_missing_states_and_the_order_given() -> None:
    assert DS().states == {} and DS().order == [] and DS.model_validate({}) == DS("R")
    assert DS(order=[]) == DS({})
    assert DS("S0x2 D2", [-1, 0]).order == [-1, 0]  # an explicit order beats the notation's
    assert DS("S0x2 D2").order == [0, -1]
    assert DS({0: 2, 1: 1}, [1, 0]).order == [0]  # a degree-1 key of the order is dropped with its state
    assert DS({0: 2, 1: 1, -1: 3}, [1, -1, 0]).order == [-1, 0]
    with pytest.raises(ValueError, match=r"order \[0, 5\] must be a permutation of the keys of degree > 1 \[0\]"):
        DS({0: 2}, [0, 5])  # a key absent from the states is not dropped
    for degree in (2.0, True, "2"):
        with pytest.raises(ValueError, match=re.escape(f"degree of key 0 must be an integer, got {degree!r}")):
            DS({0: degree})
    for order in ({0}, [True], ["0"], "0"):  # a set of ints; a list of a bool, of a str; a str
        with pytest.raises(ValueError, match="order must be a list of integer keys"):
            DS({0: 2}, order)


def test_shape_errors_say_where() -> None:
    with pytest.raises(ShapeError, match=r"^DS S0x4 splits dim 0 of size 6 into 4 chunks, which does not divide it"):
        DS({0: 4}).check_shape([6, 3])
    with pytest.raises(ShapeError, match=r"^DS S2x2 splits dim 2 but the tensor has 2 dims \(4, 4\)$"):
        DS({2: 2}).check_shape([4, 4])
    a = Annotation.parse("[0,3] S1x2 | [5-7] D3 ; hdim=0 ratios=1:2")
    msg = "subgroup 0 (0,3): DS S1x2 splits dim 1 of size 3 into 2 chunks, which does not divide it (HSPMD never pads)"
    with pytest.raises(ShapeError) as e:
        a.check_shape((12, 3))
    assert str(e.value) == msg
    with pytest.raises(ShapeError) as e:
        a.check_shape((12, 3), "w")
    assert str(e.value) == "tensor 'w': " + msg
    ratio = f"annotation {a}: dim 0 of size 10 cannot be split in ratios [1, 2] into integral chunks"
    with pytest.raises(ShapeError) as e:
        a.check_shape((10, 4))
    assert str(e.value) == ratio
    with pytest.raises(ShapeError) as e:
        a.check_shape((10, 4), "w")
    assert str(e.value) == "tensor 'w': " + ratio
    b = Annotation.parse("[0] R | [1] R | [2] R ; hdim=0")
    with pytest.raises(ShapeError) as e:
        b.subgroup_box((10,), 2)
    assert str(e.value) == f"annotation {b}: dim 0 of size 10 cannot be split in ratios [1, 1, 1] into integral chunks"
    with pytest.raises(ShapeError) as e:
        b.check_shape((4, 4), "x")
    assert str(e.value).startswith(f"tensor 'x': annotation {b}: dim 0 of size 4 cannot be split in ratios [1, 1, 1]")
    c = Annotation.parse("[0,1] S0x2 | [2,3] S0x2 ; hdim=0")
    with pytest.raises(ShapeError) as e:
        local_view(c, (6,), 3)  # 3 rows in subgroup 1, split in 2
    assert str(e.value) == ("subgroup 1: DS S0x2 splits dim 0 of size 3 into 2 chunks, which does not divide it "
                            "(HSPMD never pads)")


def test_rank_list_bounds() -> None:
    assert parse_ranks(" " * 8 + "7" + " " * 8 + ",8") == [7, 8]  # spaces are dropped before the length check
    assert parse_ranks("0000005") == [5] and parse_ranks("0-0000002") == [0, 1, 2]  # 7 digits are read
    assert parse_ranks("0000002-3") == [2, 3]
    for text, part in [("00000001", "00000001"), ("0-00000002", "0-00000002"), ("00000001-2", "00000001-2"),
                       ("9" * 5000, "9" * 40)]:  # 8 digits or more are refused before int() reads them
        with pytest.raises(ValueError) as e:
            parse_ranks(text)
        assert str(e.value) == f"rank {part!r} is out of range (0..{MAX_RANK})"
    for text in ["131072", "131070-131072", "0-131071,5", "0-131071,0-1"]:
        with pytest.raises(ValueError) as e:
            parse_ranks(text)
        assert str(e.value).startswith(f"rank {text.rpartition(',')[2]!r} is out of range (0..131071, at most 131072 ")
    assert len(parse_ranks("0-131071")) == MAX_RANK + 1 and parse_ranks(str(MAX_RANK)) == [MAX_RANK]
    assert len(parse_ranks("0-131070,5")) == MAX_RANK + 1  # at most MAX_RANK + 1 ranks, repeats counted
    for bad in ["-1", "a", "1-", "3-x"]:
        with pytest.raises(ValueError) as e:
            parse_ranks(bad)
        assert str(e.value) == f"cannot read rank {bad!r}: write a rank as 5, a range as 0-3"
    with pytest.raises(ValueError, match=r"^rank range '3-1' is empty$"):
        parse_ranks("3-1")


def test_annotation_options_and_text_validation() -> None:
    for opt in ["hdim=0=1", "ratios=1:2=3", "hdim=x", "ratios="]:
        with pytest.raises(ValueError) as e:
            Annotation.parse(f"[0] R | [1] R ; {opt}")
        assert str(e.value) == f"cannot read annotation option {opt!r}: expected hdim=<d> or ratios=a:b"
    with pytest.raises(ValueError) as e:
        Annotation.parse("[0] R | [1] R ; hdims=0")
    assert str(e.value) == "unknown annotation option 'hdims=0' (expected hdim=<d> or ratios=a:b)"
    assert Annotation.model_validate("[0,1] D2") == Annotation.spmd([0, 1])  # text through pydantic's validation
    assert Annotation.model_validate("[0] R | [1] R ; hdim=0").hdim == 0


def test_negative_and_repeated_ranks_are_named() -> None:
    for dg, msg in [([[0, 1], [-3, 2]], "dg_union[1] has negative rank -3"),
                    ([[0, -1]], "dg_union[0] has negative rank -1"),
                    ([[1, 0], [2, 0]], "rank 0 appears in dg_union[0] and dg_union[1]; device groups must be disjoint"),
                    ([[0, 0]], "rank 0 appears in dg_union[0] and dg_union[0]; device groups must be disjoint")]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            Annotation(dg, [DS({-1: len(g)}) for g in dg], 0)
    assert Annotation([[0, 1], [2, 3]], [DS({-1: 2})] * 2, 0).ranks == [0, 1, 2, 3]  # rank 0 is a rank


def test_single_subgroup_prints_and_boxes_whole() -> None:
    one = Annotation.parse("[0,1] S0x2 ; hdim=0")
    assert one.hdim == -1 and str(one) == "[0,1] S0x2" and one.subgroup_box((4, 6), 0) == ((0, 4), (0, 6))
    two = Annotation.parse("[0] R | [1] R ; hdim=1")
    assert str(two) == "[0] R | [1] R ; hdim=1" and two.subgroup_box((4, 6), 1) == ((0, 4), (3, 6))
    ratios = Annotation.parse("[0] R | [1] R | [2] R ; hdim=0 ratios=1:2:3")
    assert [ratios.subgroup_box((12,), k) for k in range(3)] == [((0, 2),), ((2, 6),), ((6, 12),)]


def test_model_copy_is_always_independent() -> None:
    a = Annotation.parse("[0,1] S0x2 | [2,3] S0x2 ; hdim=0 ratios=1:3")
    for c in (a.model_copy(), a.model_copy(deep=False), a.model_copy(deep=True)):
        assert c == a and c is not a and c.dg_union is not a.dg_union and c.dg_union[0] is not a.dg_union[0]
        assert c.hratios is not a.hratios and c.hratios == [1, 3]
    assert a.model_copy(update={"hratios": [2, 2]}).hratios is None


# ---- the per-subgroup forms (issue 45: specialize at 102,400 ranks) --------------------------------------------
def _counting(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    """Count the calls of ``owner.name`` (a function or method), without changing what it does."""
    calls: list[int] = []
    real = getattr(owner, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_same_ds_compares_each_distinct_pair_once_and_decides_like_equality(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_same_ds`` is list equality (different lengths, an unequal pair: False) that compares each pair of distinct
    DS objects once (a replica's subgroups share their DS objects) and never an object with itself."""
    from hspmd_sdk.core import annotation as mod

    x, y, z = DS.parse("S0x2"), DS.parse("S0x2"), DS.parse("D2")
    assert x is not y and x == y
    assert mod._same_ds([x], [y]) and not mod._same_ds([x], [x, x]) and not mod._same_ds([x, y], [x])
    assert not mod._same_ds([x], [z]) and not mod._same_ds([x, x], [y, z])
    calls = _counting(monkeypatch, DS, "__eq__")
    assert mod._same_ds([x] * 5, [y] * 5) and len(calls) == 1  # the pair (x, y) once
    calls.clear()
    assert mod._same_ds([x] * 5, [x] * 5) and calls == []  # the same object: nothing to compare


def test_subgroup_views_share_one_layout_and_work_it_out_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Subgroups with the same DS object and subgroup box share their lists (boxes and summand indices, when no
    offset applies); the positions' boxes of a DS are worked out once per extent (``_position_box`` once per
    position), and a shape is checked once per DS object and extent."""
    from hspmd_sdk.core import annotation as mod

    ds = DS.parse("S0x2")  # one DS object in every subgroup (as strategies build them)
    ann = Annotation([[0, 1], [2, 3], [4, 5]], [ds, ds, ds], -1)  # the whole tensor each (no HDim split)
    views = mod.subgroup_views(ann, (8, 4))
    assert views.boxes[0] is views.boxes[1] is views.boxes[2]
    assert views.partial_indices[0] is views.partial_indices[1]
    positions = _counting(monkeypatch, mod, "_position_box")
    checks = _counting(monkeypatch, DS, "check_shape")
    split = Annotation([[0, 1], [2, 3], [4, 5]], [ds, ds, ds], 1)  # three column blocks of one extent
    views = mod.subgroup_views(split, (8, 6))
    assert len(positions) == 2 and len(checks) == 1
    assert [v[0] for v in views.boxes] == [((0, 4), (0, 2)), ((0, 4), (2, 4)), ((0, 4), (4, 6))]


def test_a_shape_error_names_no_tensor_without_a_name() -> None:
    """``subgroup_boxes`` without a name: the message starts at the subgroup (no ``tensor '...'`` prefix)."""
    with pytest.raises(ShapeError) as e:
        Annotation("[0,1] S0x2").subgroup_boxes((3, 4))
    assert str(e.value).startswith("subgroup 0 (0,1): DS S0x2 splits dim 0 of size 3")
