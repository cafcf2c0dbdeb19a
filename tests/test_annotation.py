"""Annotations (SPEC.md §1, paper §4): local views against layouts written out by hand, the notation, errors.

Every expected box below is computed by hand from the SPEC's rules, not by the implementation: a box is a tuple
of per-dim ``(start, stop)`` of the global tensor.
"""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from hspmd_sdk.core.annotation import DS, Annotation, format_ranks, local_view, local_views, parse_ranks
from hspmd_sdk.core.loading import load_model
from hspmd_sdk.errors import PlanValidationError, ShapeError


def validated(model, data, what="annotation"):
    return load_model(model, data, what=what)


def views(ann: Annotation, shape: tuple[int, ...]) -> dict[int, tuple[tuple[tuple[int, int], ...], int, int]]:
    """rank -> (box, partial index, partial count)."""
    return {v.rank: (v.box, v.partial_index, v.partial_count) for v in local_views(ann, shape)}


# ---- bottom tier: DS -----------------------------------------------------------------------------------------
def test_spec_example_dup_then_split_default_order() -> None:
    # SPEC §1: states={-1: 2, 0: 2}, default order [-1, 0]: positions 0,1 hold chunks 0,1 of dim 0 (replica 0);
    # positions 2,3 hold chunks 0,1 again (replica 1).  Tensor (4, 6): chunk 0 = rows 0-2, chunk 1 = rows 2-4.
    ds = DS({-1: 2, 0: 2})
    assert ds.order == [-1, 0] and ds.device_num == 4
    ann = Annotation.spmd([10, 11, 12, 13], ds)
    c0, c1 = ((0, 2), (0, 6)), ((2, 4), (0, 6))
    assert views(ann, (4, 6)) == {10: (c0, 0, 1), 11: (c1, 0, 1), 12: (c0, 0, 1), 13: (c1, 0, 1)}


def test_order_variant_split_then_dup() -> None:
    # order [0, -1]: the duplicate key varies fastest, so positions 0,1 both hold chunk 0, positions 2,3 chunk 1.
    ds = DS({-1: 2, 0: 2}, [0, -1])
    assert ds == DS("S0x2 D2") and ds.order == [0, -1]
    ann = Annotation.spmd([0, 1, 2, 3], ds)
    c0, c1 = ((0, 2), (0, 6)), ((2, 4), (0, 6))
    assert views(ann, (4, 6)) == {0: (c0, 0, 1), 1: (c0, 0, 1), 2: (c1, 0, 1), 3: (c1, 0, 1)}


def test_two_split_dims_last_key_fastest() -> None:
    # {0: 2, 1: 3} over 6 devices on a (4, 9) tensor: position i -> (row chunk i // 3, column chunk i % 3).
    ann = Annotation.spmd(list(range(6)), DS({0: 2, 1: 3}))
    got = views(ann, (4, 9))
    for i in range(6):
        r, c = divmod(i, 3)
        assert got[i] == (((2 * r, 2 * r + 2), (3 * c, 3 * c + 3)), 0, 1)


def test_partial_indices_inside_a_subgroup() -> None:
    # {-2: 2, 0: 2}, order [-2, 0]: positions 0,1 hold summand 0 (row chunks 0,1); positions 2,3 summand 1.
    ann = Annotation.spmd([4, 5, 6, 7], DS({-2: 2, 0: 2}))
    c0, c1 = ((0, 1), (0, 3)), ((1, 2), (0, 3))
    assert views(ann, (2, 3)) == {4: (c0, 0, 2), 5: (c1, 0, 2), 6: (c0, 1, 2), 7: (c1, 1, 2)}


def test_degree_one_entries_are_dropped() -> None:
    assert DS({-1: 1, 0: 4, 1: 1}) == DS({0: 4})
    assert DS({0: 1}).device_num == 1 and str(DS({})) == "R"


def test_split_that_does_not_divide_is_an_error() -> None:
    ann = Annotation.spmd([0, 1, 2], DS({0: 3}))
    with pytest.raises(ShapeError, match="does not divide"):
        list(local_views(ann, (4, 2)))
    with pytest.raises(ShapeError, match="dim 2"):
        local_view(Annotation.spmd([0, 1], DS({2: 2})), (4, 4), 0)


# ---- top tier: HDim, HSize, hratios --------------------------------------------------------------------------
def test_spec_json_example_hdim_duplicate() -> None:
    # SPEC §1 JSON: two subgroups [0,3] and [5,6], each splitting dim 1 in two; hdim -1 replicates T across them.
    ann = validated(Annotation, {"dg_union": [[0, 3], [5, 6]], "ds_union": [{"states": {"1": 2}},
                                                                            {"states": {"1": 2}}], "hdim": -1},
                    what="annotation")
    left, right = ((0, 4), (0, 4)), ((0, 4), (4, 8))
    assert views(ann, (4, 8)) == {0: (left, 0, 1), 3: (right, 0, 1), 5: (left, 0, 1), 6: (right, 0, 1)}
    assert local_view(ann, (4, 8), 1) is None


def test_hdim_split_with_equal_and_uneven_ratios() -> None:
    # hdim 0 over [[0], [1, 2]]: subgroup 0 gets rows 0-4 of 8, subgroup 1 rows 4-8 split in columns by S1x2.
    ann = Annotation("[0] R | [1,2] S1x2 ; hdim=0")
    assert views(ann, (8, 4)) == {0: (((0, 4), (0, 4)), 0, 1), 1: (((4, 8), (0, 2)), 0, 1),
                                  2: (((4, 8), (2, 4)), 0, 1)}
    # ratios 1:3: subgroup 0 gets 2 of 8 rows, subgroup 1 the other 6 (HAP-style uneven sharding).
    uneven = Annotation("[0] R | [1,2] S1x2 ; hdim=0 ratios=1:3")
    assert uneven.hratios == [1, 3]
    assert views(uneven, (8, 4)) == {0: (((0, 2), (0, 4)), 0, 1), 1: (((2, 8), (0, 2)), 0, 1),
                                     2: (((2, 8), (2, 4)), 0, 1)}
    with pytest.raises(ShapeError, match="integral"):
        list(local_views(uneven, (6, 4)))  # 6 * 1/4 is not an integer


def test_hdim_partial_numbers_summands_across_subgroups() -> None:
    # hdim -2: subgroup k holds the k-th summand; inside [1,2] P2 splits that summand again.  Summands are
    # numbered over all subgroups: rank 0 -> 0, rank 1 -> 1, rank 2 -> 2, of 3.
    ann = Annotation("[0] R | [1,2] P2 ; hdim=-2")
    whole = ((0, 2), (0, 2))
    assert views(ann, (2, 2)) == {0: (whole, 0, 3), 1: (whole, 1, 3), 2: (whole, 2, 3)}


def test_figure6_hsize3_x_and_w() -> None:
    # Paper Figures 4 (right) and 6: DG Union [[0,3],[1],[2,4]] -- TP between GPUs 0,3; GPU 1 alone (a PP
    # stage); CP between GPUs 2,4; DP across the three subgroups (HSize 3).
    # X (batch 6, seq 4, hidden 8), HDim 0: the batch is split over the DP subgroups (rows 0-2, 2-4, 4-6);
    #   [0,3] duplicates its rows (TP ranks see the same input), [1] holds its rows whole,
    #   [2,4] splits the sequence dim 1 in two (CP).
    x = Annotation([[0, 3], [1], [2, 4]], [DS({-1: 2}), DS({}), DS({1: 2})], 0)
    full = (0, 8)
    assert views(x, (6, 4, 8)) == {
        0: (((0, 2), (0, 4), full), 0, 1), 3: (((0, 2), (0, 4), full), 0, 1),
        1: (((2, 4), (0, 4), full), 0, 1),
        2: (((4, 6), (0, 2), full), 0, 1), 4: (((4, 6), (2, 4), full), 0, 1),
    }
    # W (8 x 16), HDim -1: every subgroup holds all of W; [0,3] splits its columns (TP, dim 1), [1] holds it
    #   whole, [2,4] duplicates it.
    w = Annotation([[0, 3], [1], [2, 4]], [DS({1: 2}), DS({}), DS({-1: 2})], -1)
    assert w.hsize == 3 and x.hsize == 3
    assert views(w, (8, 16)) == {
        0: (((0, 8), (0, 8)), 0, 1), 3: (((0, 8), (8, 16)), 0, 1),
        1: (((0, 8), (0, 16)), 0, 1), 2: (((0, 8), (0, 16)), 0, 1), 4: (((0, 8), (0, 16)), 0, 1),
    }


def test_hsize_one_is_plain_spmd() -> None:
    a = Annotation([[0, 1]], [DS({0: 2})], 0)
    assert a.hdim == -1 and a == Annotation.spmd([0, 1], "S0x2")


# ---- notation ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["P2 D2 S0x4", "S1x2 D3", "R", "D8", "S0x2 S1x2"])
def test_ds_notation_round_trip(text: str) -> None:
    ds = DS(text)
    assert str(ds) == text and DS(str(ds)) == ds and eval(repr(ds)) == ds
    assert DS.model_validate_json(ds.model_dump_json()) == ds


@pytest.mark.parametrize("text", ["[0,3] S1x2 | [5,6] S1x2 ; hdim=0", "[0-3] D2 S0x2",
                                  "[0] R | [1,2] S1x2 ; hdim=0 ratios=1:3", "[0] R | [1,2] P2 ; hdim=-2",
                                  "[0,3] S1x2 | [1] R | [2,4] D2"])
def test_annotation_notation_round_trip(text: str) -> None:
    a = Annotation(text)
    assert str(a) == text
    assert Annotation(str(a)) == a and eval(repr(a)) == a
    assert Annotation.model_validate_json(a.model_dump_json()) == a
    assert hash(Annotation(text)) == hash(a)


def test_rank_lists() -> None:
    assert parse_ranks("0-3,8") == [0, 1, 2, 3, 8]
    assert format_ranks([0, 1, 2, 3, 8]) == "0-3,8" and format_ranks([4, 5]) == "4,5"


# ---- errors --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("data, path, fragment", [
    ({"dg_union": [[0, 1]], "ds_union": [{"states": {"0": 3}}]}, "<root>", "has 2 devices but ds_union[0]"),
    ({"dg_union": [[0, 1], [1, 2]], "ds_union": ["D2", "D2"]}, "<root>", "rank 1 appears in dg_union[0]"),
    ({"dg_union": [[0], [1]], "ds_union": ["R"]}, "<root>", "HSize must agree"),
    ({"dg_union": [[0], [1]], "ds_union": ["R", "R"], "hdim": 0, "hratios": [1, 2, 3]}, "<root>",
     "hratios has 3 entries"),
    ({"dg_union": [[0], [1]], "ds_union": ["R", "R"], "hdim": -3}, "<root>", "hdim -3 is invalid"),
    ({"dg_union": [[0, 1]], "ds_union": [{"states": {"0": 0}}]}, "ds_union[0]", "degrees must be >= 1"),
    ({"dg_union": [[0, 1]], "ds_union": [{"states": {"x": 2}}]}, "ds_union[0]", "not an integer"),
    ({"dg_union": [[0, 1, 2, 3]], "ds_union": [{"states": {"0": 2, "1": 2}, "order": [0]}]}, "ds_union[0]",
     "must be a permutation"),
    ({"dg_union": [], "ds_union": []}, "<root>", "dg_union is empty"),
    ({"dg_union": [[0]], "ds_union": ["R"], "extra": 1}, "extra", "Extra inputs are not permitted"),
])
def test_bad_annotations_name_the_problem(data: dict, path: str, fragment: str) -> None:
    with pytest.raises(PlanValidationError) as info:
        validated(Annotation, data, what="annotation")
    err = info.value
    assert any(p == path and fragment in r for p, r in err.problems), err.problems
    assert fragment in str(err)


def test_bad_notation_raises_clear_errors() -> None:
    with pytest.raises(ValueError, match="cannot read DS token 'Q2'"):
        DS("Q2")
    with pytest.raises(ValueError, match="cannot read subgroup"):
        Annotation("0,1 S0x2")
    with pytest.raises(ValidationError, match="has 2 devices"):
        Annotation("[0,1] S0x4")
