"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/tp_ratios.py.

The sizes a stage's TP split reaches are pinned for a one-layer GQA Llama (hidden 24, 6 heads of 4, 2 KV heads,
FFN 40, vocab 48), read off its graph by hand: each column-split weight, its gathered copy, its output, the heads
it reshapes to; the row-split weights; the vocab-split head.  The ratio checks' messages are the texts a user reads.
"""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.tp_ratios import feasible_ratios, ratio_problem, ratio_units, stage_units
from hspmd_sdk.errors import ShapeError

ONE = LlamaConfig(name="one", vocab_size=48, hidden_size=24, num_layers=1, num_heads=6, num_kv_heads=2,
                  ffn_hidden_size=40, max_seq_len=16)
UNITS = {
    "embed.weight": ("first", 1, 24), "embed.weight.gather": ("first", 1, 24), "embed": ("first", 2, 24),
    "layers.0.attn.wq": (0, 1, 24), "layers.0.attn.wq.gather": (0, 1, 24), "layers.0.attn.q": (0, 2, 24),
    "layers.0.attn.q_heads": (0, 2, 6),
    "layers.0.attn.wk": (0, 1, 8), "layers.0.attn.wk.gather": (0, 1, 8), "layers.0.attn.k": (0, 2, 8),
    "layers.0.attn.k_heads": (0, 2, 2),
    "layers.0.attn.wv": (0, 1, 8), "layers.0.attn.wv.gather": (0, 1, 8), "layers.0.attn.v": (0, 2, 8),
    "layers.0.attn.v_heads": (0, 2, 2),
    "layers.0.attn.q_rope": (0, 2, 6), "layers.0.attn.k_rope": (0, 2, 2), "layers.0.attn.core": (0, 2, 6),
    "layers.0.attn.merge": (0, 2, 24), "layers.0.attn.wo": (0, 0, 24), "layers.0.attn.wo.gather": (0, 0, 24),
    "layers.0.mlp.w1": (0, 1, 40), "layers.0.mlp.w1.gather": (0, 1, 40), "layers.0.mlp.gate": (0, 2, 40),
    "layers.0.mlp.w3": (0, 1, 40), "layers.0.mlp.w3.gather": (0, 1, 40), "layers.0.mlp.up": (0, 2, 40),
    "layers.0.mlp.act": (0, 2, 40), "layers.0.mlp.w2": (0, 0, 40), "layers.0.mlp.w2.gather": (0, 0, 40),
    "lm_head.weight": ("last", 1, 48), "lm_head.weight.gather": ("last", 1, 48), "lm_head": ("last", 2, 48),
}


def _stage(layers: tuple[int, int], ratios: tuple[int, ...] | None) -> NS:
    return NS(layers=layers, tp_ratios=ratios, tp_degree=2 if ratios is None else len(ratios))


def test_ratio_units_of_a_one_layer_gqa_llama() -> None:
    """Every tensor the TP split reaches, with its stage position, split dim and size, in graph order; the norms,
    residuals and the loss (duplicated or not split) are not among them."""
    units = ratio_units(ONE)
    assert list(units.items()) == list(UNITS.items())


def test_stage_units_by_layer_range_and_ends() -> None:
    """A stage's units: its layers (both ends included), plus the embedding / head when it holds them."""
    four = LlamaConfig.preset("tiny")  # 4 layers
    mid = stage_units(four, _stage((1, 2), None))
    assert {n.split(".")[1] for n, _, _ in mid} == {"1", "2"} and len(mid) == 2 * 27
    assert ("layers.1.attn.q_heads", 2, 4) in mid and ("layers.2.mlp.w2", 0, 128) in mid
    assert stage_units(ONE, _stage((0, 0), None)) == [(n, d, s) for n, (w, d, s) in UNITS.items() if w == 0]
    first = stage_units(ONE, _stage((0, 0), None), first=True)
    assert [n for n, _, _ in first][:3] == ["embed.weight", "embed.weight.gather", "embed"] and len(first) == 30
    last = stage_units(ONE, _stage((0, 0), None), last=True)
    assert [n for n, _, _ in last][-3:] == ["lm_head.weight", "lm_head.weight.gather", "lm_head"]
    assert len(last) == 30
    assert len(stage_units(ONE, _stage((0, 0), None), first=True, last=True)) == len(UNITS)
    assert stage_units(ONE, _stage((1, 1), None)) == []


def test_feasible_ratios_nearest_and_ties() -> None:
    """The nearest ratios over every number of whole parts dividing unit (largest remainder rounding, first rank on
    equal remainders, at least one part a rank); equal errors go to the finer split; None when unit has fewer parts
    than ranks."""
    assert feasible_ratios([1, 1], 1) is None and feasible_ratios([1, 1, 1], 2) is None
    assert feasible_ratios([1, 1], 2) == [1, 1]
    assert feasible_ratios([7, 1], 4) == [3, 1]            # at least one part each
    assert feasible_ratios([1, 7], 8) == [1, 7]
    assert feasible_ratios([1, 1, 6], 4) == [1, 1, 2]
    assert feasible_ratios([5, 2, 2], 6) == [4, 1, 1]       # 6 parts: 3.33, 1.33, 1.33 -> 3, 1, 1 + the first
    assert feasible_ratios([1, 2, 2], 4) == [1, 2, 1]       # 0.8, 1.6, 1.6 -> 1, 1, 1 + the first of the equal
    assert feasible_ratios([2, 3], 10) == [2, 3]
    assert feasible_ratios([3, 2], 6) == [2, 1]
    assert feasible_ratios([4, 1, 1], 3) == [1, 1, 1]
    # equal errors: 5 parts (1.25 -> 1:4) and 10 parts (2.5 -> 3:7) err alike; the finer wins
    assert feasible_ratios([1, 3], 10) == [3, 7]
    # errors equal up to rounding (1e-12): 14 parts (11:3) against 7 parts (5:2): the finer wins
    assert feasible_ratios([3, 1], 14) == [11, 3]
    assert feasible_ratios([1, 5], 21) == [4, 17]
    # largest remainder: 5 parts of 1:1:1 -> 1.67 each -> 1, 1, 1, then one more to each of the first two
    assert feasible_ratios([1, 1, 1], 5) == [2, 2, 1]
    # over the sum after the one-part minimum: take back from the rank holding most above its exact share
    assert feasible_ratios([1, 1, 4, 4], 5) == [1, 1, 1, 2]   # 0.5, 0.5, 2, 2 -> 1, 1, 2, 2: the last 2 of the equal
    assert feasible_ratios([1, 1, 6, 12], 7) == [1, 1, 1, 4]  # 0.35, 0.35, 2.1, 4.2 -> 1, 1, 2, 4: 2.1 gives back


def test_feasible_ratios_ties_are_exact() -> None:
    """Bug fixed: remainders and errors were floats, so rounding noise decided ties of the largest-remainder
    rounding (1:1:4 over 10 parts: the remainders 2/3, 2/3, 2/3 came out as 0.667, 0.667, 0.667000...1 and the
    third rank got the first extra part, giving 2:1:7).  In exact arithmetic the first ranks win equal remainders:
    10 parts -> 1, 1, 6 + one to each of the first two -> 2, 2, 6 = 1:1:3, equal in error to 5 parts' 1:1:3; and
    4:1:1 -> 6, 1, 1 + the first two -> 7, 2, 1, equal in error to 5 parts' 3:1:1, so the finer 7:2:1."""
    assert feasible_ratios([1, 1, 4], 10) == [1, 1, 3]
    assert feasible_ratios([4, 1, 1], 10) == [7, 2, 1]


def test_ratio_problem_messages() -> None:
    """None for an even stage or ratios every reached size divides by; otherwise the first tensor (graph order)
    that does not split whole, its shares, the sum it must divide by, and the nearest feasible ratios -- or that
    none exists over that many ranks."""
    assert ratio_problem(ONE, _stage((0, 0), None)) is None
    assert ratio_problem(ONE, _stage((0, 0), (1, 1))) is None
    assert ratio_problem(ONE, _stage((1, 1), (1, 2)), first=True) is None  # only the embedding's 24: 8 + 16
    assert ratio_problem(ONE, _stage((1, 1), (5, 2))) is None  # neither end by default: no unit at all
    assert ratio_problem(ONE, _stage((0, 0), (3, 1))) == (
        "ratios 3:1 split tensor 'layers.0.attn.q_heads' dim 2 of size 6 into 4.5 : 1.5, not whole parts (each TP "
        "rank must hold whole heads, KV heads and rows); every size the stage's split reaches must divide by 4; "
        "nearest feasible ratios: 1:1")
    assert ratio_problem(ONE, _stage((0, 0), (1, 2))) == (
        "ratios 1:2 split tensor 'layers.0.attn.wk' dim 1 of size 8 into 2.66667 : 5.33333, not whole parts (each "
        "TP rank must hold whole heads, KV heads and rows); every size the stage's split reaches must divide by 3; "
        "nearest feasible ratios: 1:1")
    assert ratio_problem(ONE, _stage((0, 0), (1, 1, 1))) == (
        "ratios 1:1:1 split tensor 'layers.0.attn.wk' dim 1 of size 8 into 2.66667 : 2.66667 : 2.66667, not whole "
        "parts (each TP rank must hold whole heads, KV heads and rows); every size the stage's split reaches must "
        "divide by 3; no split over 3 ranks exists (the sizes have only 2 common parts)")
    assert ratio_problem(ONE, _stage((1, 1), (5, 2)), first=True) == (
        "ratios 5:2 split tensor 'embed.weight' dim 1 of size 24 into 17.1429 : 6.85714, not whole parts (each TP "
        "rank must hold whole heads, KV heads and rows); every size the stage's split reaches must divide by 7; "
        "nearest feasible ratios: 17:7")
    assert ratio_problem(ONE, _stage((1, 1), (5, 2)), last=True).startswith(
        "ratios 5:2 split tensor 'lm_head.weight' dim 1 of size 48 into 34.2857 : 13.7143,")


class _Broken:
    """A model whose graph cannot be built: the check says so instead of failing elsewhere."""
    name = "broken"

    def build_graph(self) -> None:
        raise ShapeError("no graph here")


def test_ratio_problem_of_a_model_the_probe_cannot_deduce() -> None:
    assert ratio_problem(_Broken(), _stage((0, 0), (3, 1))) == ("cannot check ratios 3:1 against model 'broken': "
                                                                 "no graph here")
