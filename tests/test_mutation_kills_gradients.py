"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/gradients.py.

The gradient-layout convention of the module's docstring (Split stays, Partial -> Duplicate, Duplicate -> Partial
when consumed divergently, on both tiers), worked out by hand per DS and per HDim; and the backward plan of a
Reshard as ``resolve(grad_dst, grad_src)`` with the forward plan's shape, dtype and cluster.
"""
from __future__ import annotations

import pytest

from hspmd_sdk.core.annotation import DS, Annotation
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.gradients import _grad_ds, backward_plan_for, gradient_layout
from hspmd_sdk.core.resolve import resolve
from hspmd_sdk.errors import ResolutionError

P, D = -2, -1


def _same(a: DS, b: DS) -> None:
    """Equal states and the same order (the order is a layout: which device holds which coordinate)."""
    assert (dict(a.states), list(a.order)) == (dict(b.states), list(b.order))


def test_consumed_must_be_named():
    with pytest.raises(ValueError) as e:
        gradient_layout(Annotation("[0,1] D2"), "both")
    assert str(e.value) == "consumed must be 'redundant' or 'divergent', not 'both'"


def test_redundant_keeps_splits_and_duplicates():
    """Without a Partial, a redundant gradient has the tensor's own DS, order included."""
    ds = DS({0: 2, D: 2, 1: 3}, [1, D, 0])
    _same(_grad_ds(ds, "redundant"), ds)


def test_redundant_partial_becomes_duplicate_in_place():
    """Partial -> Duplicate of the same degree, at the Partial's place in the order."""
    _same(_grad_ds(DS({P: 2, 0: 3}, [P, 0]), "redundant"), DS({D: 2, 0: 3}, [D, 0]))
    _same(_grad_ds(DS({P: 2, 0: 3}, [0, P]), "redundant"), DS({D: 2, 0: 3}, [0, D]))


def test_redundant_partial_merges_into_an_adjacent_duplicate():
    """Partial next to Duplicate (either side): one Duplicate of the product degree, at the Duplicate's place."""
    _same(_grad_ds(DS({P: 2, D: 3, 0: 2}, [0, P, D]), "redundant"), DS({D: 6, 0: 2}, [0, D]))
    _same(_grad_ds(DS({P: 2, D: 3, 0: 2}, [D, P, 0]), "redundant"), DS({D: 6, 0: 2}, [D, 0]))
    _same(_grad_ds(DS({P: 3, D: 2, 1: 2}, [P, D, 1]), "redundant"), DS({D: 6, 1: 2}, [D, 1]))


def test_redundant_partial_and_duplicate_apart_are_refused():
    ds = DS({P: 2, 0: 2, D: 2}, [P, 0, D])
    with pytest.raises(ResolutionError) as e:
        _grad_ds(ds, "redundant")
    assert str(e.value) == ("gradient_layout: DS P2 S0x2 D2 has Partial and Duplicate keys that are not adjacent in "
                            "its order; its gradient has no single-DS layout, pass it explicitly")
    with pytest.raises(ResolutionError):
        _grad_ds(DS({P: 2, 0: 2, D: 2}, [D, 0, P]), "redundant")


def test_divergent_swaps_partial_and_duplicate():
    """Divergent consumption: Partial <-> Duplicate, degrees and order kept, splits untouched."""
    _same(_grad_ds(DS({P: 2, D: 3, 0: 2}, [D, 0, P]), "divergent"), DS({D: 2, P: 3, 0: 2}, [P, 0, D]))
    _same(_grad_ds(DS({D: 4, 1: 2}, [1, D]), "divergent"), DS({P: 4, 1: 2}, [1, P]))
    _same(_grad_ds(DS({0: 2}), "divergent"), DS({0: 2}))
    # a Partial kept apart from a Duplicate is fine when divergent (a swap, no merge)
    _same(_grad_ds(DS({P: 2, 0: 2, D: 2}, [P, 0, D]), "divergent"), DS({D: 2, 0: 2, P: 2}, [D, 0, P]))


def test_gradient_layout_applies_the_rule_to_every_subgroup():
    ann = Annotation([[0, 1, 2, 3], [4, 5]], [DS({P: 2, 0: 2}, [0, P]), DS({0: 2})], 1)
    g = gradient_layout(ann)
    assert g.dg_union == [[0, 1, 2, 3], [4, 5]]
    _same(g.ds_union[0], DS({D: 2, 0: 2}, [0, D]))
    _same(g.ds_union[1], DS({0: 2}))
    assert g.hdim == 1 and g.hratios is None


def test_hdim_partial_becomes_duplicate_both_ways():
    top = Annotation([[0, 1], [2, 3]], [DS({0: 2}), DS({0: 2})], P)
    assert gradient_layout(top).hdim == D
    assert gradient_layout(top, "divergent").hdim == D


def test_hdim_duplicate_becomes_partial_only_when_divergent_and_several_subgroups():
    two = Annotation([[0, 1], [2, 3]], [DS({0: 2}), DS({0: 2})], D)
    assert gradient_layout(two).hdim == D
    assert gradient_layout(two, "divergent").hdim == P
    one = Annotation([[0, 1]], [DS({D: 2})])
    g = gradient_layout(one, "divergent")
    assert g.hdim == D and g.hsize == 1
    _same(g.ds_union[0], DS({P: 2}))


def test_hdim_split_keeps_its_ratios():
    ann = Annotation([[0], [1, 2, 3]], [DS({}), DS({D: 3})], 0, [1, 3])
    for consumed in ("redundant", "divergent"):
        g = gradient_layout(ann, consumed)
        assert (g.hdim, g.hratios) == (0, [1, 3])
    _same(gradient_layout(ann, "divergent").ds_union[1], DS({P: 3}))


def test_backward_plan_defaults_to_the_redundant_layouts():
    """The backward of a Reshard P -> S0 (a reduce-scatter) moves the S0 gradient back to D: an all-gather."""
    src, dst = Annotation("[0,1] P2"), Annotation("[0,1] S0x2")
    cluster = Cluster.local(2)
    fwd = resolve(src, dst, (4, 6), "bfloat16", cluster)
    bwd = backward_plan_for(fwd)
    assert bwd.src == dst and bwd.dst == Annotation("[0,1] D2")
    assert (bwd.shape, bwd.dtype, bwd.cluster) == ((4, 6), "bfloat16", cluster)
    assert bwd.kinds == ["AllGather"]


def test_backward_plan_takes_given_layouts():
    """grad_dst: where the output's gradient arrives; grad_src: where the input's gradient is wanted."""
    dup, part = Annotation("[0,1] D2"), Annotation("[0,1] P2")
    fwd = resolve(dup, dup, (4, 6))
    bwd = backward_plan_for(fwd, grad_dst=part)
    assert (bwd.src, bwd.dst, bwd.kinds) == (part, dup, ["AllReduce"])
    bwd = backward_plan_for(fwd, grad_src=Annotation("[0,1] S1x2"))
    assert (bwd.src, bwd.dst) == (dup, Annotation("[0,1] S1x2"))
    assert (bwd.shape, bwd.dtype, bwd.cluster) == ((4, 6), "float32", None)
