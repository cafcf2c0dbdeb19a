"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of planner/tp_comm.py.

The expected collectives are Megatron's, worked out by hand for the tiny Llama (hidden 64, vocab 256, 4 heads):
two all-reduces of the hidden state per layer each way, the embedding's gather of the hidden state (its table is
split by columns), the head's gather of the logits forward and all-reduce of its input's gradient backward.
"""
from __future__ import annotations

import dataclasses

import pytest

from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.comm_ops import CollectiveGroup, CollectiveOp, OpKind, SliceCollective, SplitCollectiveOp
from hspmd_sdk.planner.tp_comm import Collective, TPCommError, UnitCollectives, _rings, _three_layers, unit_collectives

LLAMA = LlamaConfig.preset("tiny")
H, V = LLAMA.hidden_size, LLAMA.vocab_size
AR, AG = OpKind.ALL_REDUCE, OpKind.ALL_GATHER
NONE = UnitCollectives((), (), (), (), (), ())


def _megatron(g: int) -> UnitCollectives:
    """The tiny Llama's TP collectives over ``g`` ranks, by hand (see the module docstring)."""
    return UnitCollectives(embedding_fwd=(Collective(AG, g, H),), embedding_bwd=(),
                           layer_fwd=(Collective(AR, g, H),) * 2, layer_bwd=(Collective(AR, g, H),) * 2,
                           head_fwd=(Collective(AG, g, V),), head_bwd=(Collective(AR, g, H),))


class _Opaque:
    """A user's config that is neither pydantic nor a dataclass (no ``model_copy``): it cannot be copied with three
    layers.  A hashable value, as every config must be (specialize() caches graphs by config)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        if name == "model_copy":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Opaque) and other._inner == self._inner

    def __hash__(self) -> int:
        return hash(self._inner)


@dataclasses.dataclass
class _DataclassConfig:
    name: str
    num_layers: int


def test_tp_one_or_less_reads_no_model() -> None:
    """tp <= 1 runs no TP collective: the empty units, without reading (or even needing) a model -- the cost model
    relies on it for a device's fractional compute share."""
    assert unit_collectives(None, 1) == NONE
    assert unit_collectives(None, 0) == NONE


def test_even_and_two_rank_uneven_groups_run_megatrons_collectives() -> None:
    """All-equal ratios are the even split; 3:1 over two ranks runs split collectives over both ranks, priced as
    the ring collectives of the same buffers."""
    assert unit_collectives(LLAMA, 4, [1, 1, 1, 1]) == _megatron(4)
    assert unit_collectives(LLAMA, 2, [3, 1]) == _megatron(2)


def test_all_equal_ratios_fail_as_the_even_degree_and_uneven_ones_name_their_ratios() -> None:
    """The error names the degree, and the ratios only when they are uneven (all equal is the even split)."""
    with pytest.raises(TPCommError) as e:
        unit_collectives(LLAMA, 3, [1, 1, 1])
    assert "the TP collectives of model 'tiny' at tp=3 cannot be read: its specialization fails (" in str(e.value)
    with pytest.raises(TPCommError) as e:
        unit_collectives(LLAMA, 3, [2, 1, 2])
    assert "of model 'tiny' at tp=3 ratios=[2, 1, 2] cannot be read: its specialization fails (" in str(e.value)


def test_a_config_of_five_layers_that_cannot_be_copied_is_read_whole_and_per_layer() -> None:
    """A config that cannot be copied with three layers is specialized as it is (5 layers: the middle stage runs
    three layers' collectives, divided per layer; the first and last stages' less one layer's are the embedding's
    and the head's)."""
    model = _Opaque(LLAMA.model_copy(update={"num_layers": 5}))
    assert unit_collectives(model, 2) == _megatron(2)
    assert unit_collectives(model, 2, [3, 1]) == _megatron(2)


def test_three_layers_copies_what_it_can() -> None:
    """A pydantic config is copied with three layers (the rest unchanged), a dataclass one replaced, one with three
    layers already and one that cannot be copied are returned themselves."""
    five = LLAMA.model_copy(update={"num_layers": 5})
    got = _three_layers(five)
    assert got.num_layers == 3 and got == LLAMA.model_copy(update={"num_layers": 3})
    three = LLAMA.model_copy(update={"num_layers": 3})
    assert _three_layers(three) is three
    assert _three_layers(_DataclassConfig("dc", 6)) == _DataclassConfig("dc", 3)
    opaque = _Opaque(five)
    assert _three_layers(opaque) is opaque


def _box(n: int) -> tuple[tuple[int, int], ...]:
    return ((0, n),)


def test_rings_keeps_ring_collectives_of_two_or_more_ranks() -> None:
    """Single-rank groups run nothing; an AllToAll or a LocalSplit is no ring collective; an uneven group's split
    collective is the ring collective of its slices' whole buffer, over every rank it involves."""
    ar = CollectiveOp(AR, (CollectiveGroup((0, 1), (_box(8), _box(8)), (_box(8), _box(8))),
                           CollectiveGroup((2,), (_box(8),), (_box(8),))), 2)
    assert _rings(ar) == [(AR, (0, 1), 8)]
    a2a = CollectiveOp(OpKind.ALL_TO_ALL, (CollectiveGroup((0, 1), (_box(8), _box(8)), (_box(4), _box(4))),), 2,
                       dim=0, src_dim=0)
    assert _rings(a2a) == []
    local = CollectiveOp(OpKind.LOCAL_SPLIT, (CollectiveGroup((0,), (_box(8),), (_box(4),)),), 2)
    assert _rings(local) == []
    two = SplitCollectiveOp(OpKind.SPLIT_ALL_REDUCE, -2, -1,
                            (SliceCollective(((0, 4),), (0, 1), (0, 1), (0, 1)),
                             SliceCollective(((4, 6),), (0, 1), (0, 1), (0, 1))),
                            ((0, _box(6)), (1, _box(6))), ((0, _box(6)), (1, _box(6))), 2)
    assert _rings(two) == [(AR, (0, 1), 6)]
    alone = SplitCollectiveOp(OpKind.SPLIT_ALL_GATHER, 0, -1, (SliceCollective(_box(6), (0,), (0,), (0,)),),
                              ((0, _box(6)),), ((0, _box(6)),), 2)
    assert _rings(alone) == []
