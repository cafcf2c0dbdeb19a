"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/strategy_plan.py.

The ZeRO-1 shard choices and a stage's DS are pinned case by case from the rules their docstrings state; the plans
of small strategies (even, heterogeneous, uneven TP, context parallel; with and without ZeRO-1) are pinned by the
annotations of one tensor of every kind (data, activation, a parameter split along each dim or duplicated, its
other use, its gradient's target), in the compact notation of :class:`~hspmd_sdk.core.annotation.Annotation`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest

from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.strategy import Stage, Strategy
from hspmd_sdk.core.graph import GraphBuilder
from hspmd_sdk.core.model_spec import Placement
from hspmd_sdk.core.strategy_plan import (_stage_ds, _uneven_annotation, _zero_dim_uneven, plan_from_strategy,
                                         zero_shard)
from hspmd_sdk.errors import PlanValidationError, SpecializationError

TINY = LlamaConfig.preset("tiny")  # 4 layers, hidden 64, vocab 256
#: hidden 8 (4 heads of 2), ffn 8: every parameter small enough that 3 pipelines cannot shard it evenly
SMALL = LlamaConfig(name="small", vocab_size=8, hidden_size=8, num_layers=2, num_heads=4, ffn_hidden_size=8,
                    max_seq_len=8)
#: hidden 2 (one head): no parameter has a dim of 3 elements or more but the embedding's vocab and the FFN's
MINI = LlamaConfig(name="mini", vocab_size=8, hidden_size=2, num_layers=2, num_heads=1, ffn_hidden_size=4,
                   max_seq_len=8)


def pl(mbs: int, n: int, *stages: dict[str, Any]) -> dict[str, Any]:
    return {"stages": list(stages), "micro_batch_size": mbs, "num_micro_batches": n}


def st(devices: list[int], layers: list[int], **kw: Any) -> dict[str, Any]:
    return {"devices": devices, "layers": layers, **kw}


def plan(data: dict[str, Any], model: Any = TINY, ranks: int = 8) -> Any:
    return plan_from_strategy(model, Strategy.load(data), Cluster.local(ranks))


def texts(p: Any, *names: str) -> dict[str, str | None]:
    """The annotations of ``names`` in notation (``None``: not in the plan)."""
    return {n: (str(p.annotations[n]) if n in p.annotations else None) for n in names}


# ---- ZeRO-1 shards -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, split, groups, expected", [
    ((4, 4), None, [[0], [1]], (0, None)),            # even: the first dim
    ((64, 64), None, [[0], [1], [2]], (0, [22, 21, 21])),  # no even dim: uneven chunks, sizes differ by one
    ((5, 7), None, [[0], [1]], (1, [4, 3])),          # uneven: the largest dim
    ((7, 5), 1, [[0], [1]], (0, [4, 3])),             # the TP-split dim is a dim like any other at TP 1
    ((6, 4), 0, [[0, 1], [2, 3]], (1, None)),         # an even dim TP does not split before an uneven split dim
    ((8, 3), 0, [[0, 1], [2, 3]], (0, None)),         # the TP-split dim when its TP chunks divide evenly
    ((6, 3), 0, [[0, 1], [2, 3]], (1, [2, 1])),       # uneven: a dim TP does not split first
    ((12,), 0, [[0, 1], [2, 3, 4]], (0, None)),       # TP chunks of lcm(2, 3) = 6
    ((6,), 0, [[0, 1], [2, 3, 4]], None),             # one chunk of 6 for 2 pipelines
    ((3,), 0, [[0, 1], [2, 3]], None),                # TP 2 does not divide 3
    ((2,), None, [[0], [1], [2]], None),              # fewer elements than pipelines
    ((3,), None, [[0], [1], [2]], (0, None)),         # exactly one element a pipeline
    ((3, 4), 0, [[0, 1], [2, 3]], (1, None)),         # a dim TP 2 cannot split is skipped, the next one taken
    ((6,), 0, [[0, 1], [2, 3]], (0, [4, 2])),         # uneven TP-split dim: chunks of whole TP units (2)
])
def test_zero_shard(shape: tuple[int, ...], split: int | None, groups: list[list[int]], expected: Any) -> None:
    """zero_shard's preference order: even non-TP dim, even TP dim, then the largest dim in near-even chunks."""
    got = zero_shard(shape, split, groups)
    assert got == expected
    assert got is None or (type(got[0]) is int and (got[1] is None or all(type(r) is int for r in got[1])))


@pytest.mark.parametrize("shape, split, ratios, pipelines, expected", [
    ((64, 64), 1, (3, 1), 2, 0),   # a dim TP does not split first
    ((3, 8), 1, (3, 1), 2, 1),     # the TP-split dim: chunks 6 and 2 both divide by 2
    ((8, 6), 0, (3, 1), 2, 1),
    ((3, 4), 1, (3, 1), 2, None),  # chunks 3 and 1 do not
    ((2,), None, (3, 1), 2, 0),    # exactly one element a pipeline
    ((3,), None, (3, 1), 2, None),
    ((5,), 0, (8, 1, 1), 2, None),  # chunks 4, 0, 0: an empty chunk has no element a pipeline
])
def test_zero_dim_inside_uneven_subgroups(shape: tuple[int, ...], split: int | None, ratios: tuple[int, ...],
                                          pipelines: int, expected: int | None) -> None:
    """_zero_dim_uneven: a dim whose every subgroup chunk the pipelines divide evenly, non-TP dims first."""
    assert _zero_dim_uneven(shape, split, ratios, pipelines) == expected


def test_uneven_annotation_of_a_tp_split_activation() -> None:
    """On uneven stages a tensor's HDim is its TP split dim in the stage's ratios, whatever its kind (the Placement
    contract allows TP-split data and activations); only a parameter under ZeRO-1 over pipelines gets a shard."""
    stages = [Stage(devices=[0, 1], layers=[0, 0], ratios=[3, 1]), Stage(devices=[2, 3], layers=[0, 0], ratios=[3, 1])]
    replicated: list[str] = []
    shown = {(kind, split, zero1): tuple(None if a is None else str(a) for a in _uneven_annotation(
                 "x", Placement("x", kind, 0, split), stages, (8, 8), zero1, replicated))
             for kind in ("activation", "parameter") for split in (None, 1) for zero1 in (False, True)}
    assert shown == {
        ("activation", None, False): ("[0,2] S0x2 | [1,3] S0x2", None),
        ("activation", None, True): ("[0,2] S0x2 | [1,3] S0x2", None),
        ("activation", 1, False): ("[0,2] S0x2 | [1,3] S0x2 ; hdim=1 ratios=3:1", None),
        ("activation", 1, True): ("[0,2] S0x2 | [1,3] S0x2 ; hdim=1 ratios=3:1", None),
        ("parameter", None, False): ("[0,2] D2 | [1,3] D2", None),
        ("parameter", None, True): ("[0,2] D2 | [1,3] D2", "[0,2] S0x2 | [1,3] S0x2"),
        ("parameter", 1, False): ("[0,2] D2 | [1,3] D2 ; hdim=1 ratios=3:1", None),
        ("parameter", 1, True): ("[0,2] D2 | [1,3] D2 ; hdim=1 ratios=3:1",
                                 "[0,2] S0x2 | [1,3] S0x2 ; hdim=1 ratios=3:1")}
    full, shard = _uneven_annotation("x", Placement("x", "parameter", 0, 1), stages[:1], (8, 8), True, replicated)
    assert str(full) == "[0] R | [1] R ; hdim=1 ratios=3:1" and shard is None  # one pipeline: nothing to shard over
    data, none = _uneven_annotation("t", Placement("t", "data", "first", 1), stages, (8, 8), False, replicated)
    assert str(data) == "[0,2] S0x2 | [1,3] S0x2 ; hdim=1 ratios=3:1" and none is None
    assert replicated == []
    # ZeRO-1 over two pipelines of a parameter no dim of which divides: named, not sharded
    full, shard = _uneven_annotation("w", Placement("w", "parameter", 0, None), stages, (3,), True, replicated)
    assert str(full) == "[0,2] D2 | [1,3] D2" and shard is None and replicated == ["w"]
    # one pipeline: not even a scalar is named
    full, shard = _uneven_annotation("s", Placement("s", "parameter", 0, None), stages[:1], (), True, replicated)
    assert str(full) == "[0] R | [1] R" and shard is None and replicated == ["w"]


# ---- context-parallel stage DS -------------------------------------------------------------------------------
@pytest.mark.parametrize("stage, split, kind, ds", [
    (dict(devices=[0, 1], layers=[0, 0]), None, "parameter", "D2"),
    (dict(devices=[0, 1], layers=[0, 0]), 1, "activation", "S1x2"),  # no CP: TP may split the sequence dim
    (dict(devices=[0, 1, 2, 3], layers=[0, 0], cp=2), None, "parameter", "D4"),
    (dict(devices=[0, 1, 2, 3], layers=[0, 0], cp=2), None, "activation", "S1x2 D2"),
    (dict(devices=[0, 1, 2, 3], layers=[0, 0], cp=2), None, "data", "S1x2 D2"),
    (dict(devices=[0, 1, 2, 3], layers=[0, 0], cp=2), 0, "parameter", "D2 S0x2"),
    (dict(devices=[0, 1, 2, 3], layers=[0, 0], cp=2), 1, "parameter", "D2 S1x2"),
    (dict(devices=[0, 1, 2, 3], layers=[0, 0], cp=2), 0, "activation", "S1x2 S0x2"),
    (dict(devices=[0, 1, 2, 3], layers=[0, 0], cp=2), 2, "data", "S1x2 S2x2"),
    (dict(devices=[0, 1], layers=[0, 0], cp=2), 0, "parameter", "D2"),      # CP only: TP 1 splits nothing
    (dict(devices=[0, 1], layers=[0, 0], cp=2), None, "activation", "S1x2"),
    (dict(devices=[0, 1], layers=[0, 0], cp=2), 2, "activation", "S1x2"),
])
def test_stage_ds(stage: dict[str, Any], split: int | None, kind: str, ds: str) -> None:
    """A tensor's DS on a stage: CP (slowest) splits the sequence of data / activations, TP (fastest) its dim."""
    assert str(_stage_ds(Stage(**stage), split, kind, "x")) == ds


def test_stage_ds_refuses_tp_and_cp_on_the_sequence_dim() -> None:
    """The error's path names the stage and its text the tensor, the dim and the cp."""
    with pytest.raises(PlanValidationError) as info:
        _stage_ds(Stage(devices=[0, 1, 2, 3], layers=[0, 0], cp=2), 1, "activation", "h")
    assert info.value.problems == [("stage R0-3 L0-0 cp=2", "tensor 'h': tensor parallelism splits its sequence dim "
                                                           "1, which context parallelism (cp=2) splits too; use cp=1 "
                                                           "on this stage")]


# ---- plans ----------------------------------------------------------------------------------------------------
KEYS = ("tokens", "targets", "embed.weight", "embed.weight.gather", "embed.weight.grad_sync", "embed.out",
        "layers.0.in", "layers.0.attn_norm.weight", "layers.0.attn.wq", "layers.0.attn.wq.gather",
        "layers.0.attn.wq.grad_sync", "layers.0.attn.wo", "layers.2.in", "layers.3.mlp.w2", "final_norm.weight")


def test_plan_of_heterogeneous_pipelines_with_zero1() -> None:
    """Top tier = pipelines (batch split 6:2 by samples), bottom tier = each stage's TP; ZeRO-1 shards the
    parameters over the pipelines along a dim TP does not split, and their other uses gather them back."""
    p = plan({"pipelines": [pl(2, 3, st([0, 1], [0, 1]), st([2], [2, 3])), pl(1, 2, st([3, 4], [0, 3]))],
              "zero1": True})
    assert texts(p, *KEYS) == {
        "tokens": "[0,1] D2 | [3,4] D2 ; hdim=0 ratios=6:2",
        "targets": "[2] R | [3,4] D2 ; hdim=0 ratios=6:2",
        "embed.weight": "[0,1] S1x2 | [3,4] S1x2 ; hdim=0",
        "embed.weight.gather": "[0,1] S1x2 | [3,4] S1x2",
        "embed.weight.grad_sync": "[0,1] S1x2 | [3,4] S1x2 ; hdim=0",
        "embed.out": "[0,1] D2 | [3,4] D2 ; hdim=0 ratios=6:2",
        "layers.0.in": "[0,1] D2 | [3,4] D2 ; hdim=0 ratios=6:2",
        "layers.0.attn_norm.weight": "[0,1] D2 | [3,4] D2 ; hdim=0",
        "layers.0.attn.wq": "[0,1] S1x2 | [3,4] S1x2 ; hdim=0",
        "layers.0.attn.wq.gather": "[0,1] S1x2 | [3,4] S1x2",
        "layers.0.attn.wq.grad_sync": "[0,1] S1x2 | [3,4] S1x2 ; hdim=0",
        "layers.0.attn.wo": "[0,1] S0x2 | [3,4] S0x2 ; hdim=1",
        "layers.2.in": "[2] R | [3,4] D2 ; hdim=0 ratios=6:2",
        "layers.3.mlp.w2": "[2] R | [3,4] S0x2 ; hdim=1",
        "final_norm.weight": "[2] R | [3,4] D2 ; hdim=0"}
    assert len(p.annotations) == 134 and p.settings.zero1_replicated == ()
    assert p.meta == {"source": "plan_from_strategy", "model": "tiny", "strategy_name": "hetero(tp2+tp1 | tp2)-zero1",
                      "stages": [[[0, 1], [2]], [[3, 4]]]}
    s = p.settings
    assert (s.schedule, s.zero1, s.micro_batch_size, s.num_micro_batches) == ("1f1b", True, (2, 1), (3, 2))


def test_plan_without_zero1_keeps_parameters_whole_and_other_uses_implicit() -> None:
    """Without ZeRO-1 a parameter's layout is its full one, so its other use on the same stage adds nothing;
    recompute ranks are listed sorted."""
    p = plan({"pipelines": [pl(1, 2, st([1, 0], [0, 1], recompute=True), st([2], [2, 3])),
                            pl(1, 2, st([3], [0, 1]), st([5, 4], [2, 3], recompute=True))], "schedule": "gpipe"})
    assert texts(p, "embed.weight", "embed.weight.gather", "embed.weight.grad_sync", "layers.0.attn.wq",
                 "layers.0.attn.wq.gather", "layers.2.in", "tokens") == {
        "embed.weight": "[1,0] S1x2 | [3] R",
        "embed.weight.gather": None,
        "embed.weight.grad_sync": "[1,0] S1x2 | [3] R",
        "layers.0.attn.wq": "[1,0] S1x2 | [3] R",
        "layers.0.attn.wq.gather": None,
        "layers.2.in": "[2] R | [5,4] D2 ; hdim=0",
        "tokens": "[1,0] D2 | [3] R ; hdim=0"}
    assert p.settings.recompute == (0, 1, 4, 5) and p.settings.schedule == "gpipe" and not p.settings.zero1
    assert p.meta["strategy_name"] == "hetero(tp2+tp1 | tp1+tp2)-gpipe"


def test_plan_names_the_parameters_zero1_cannot_shard() -> None:
    """settings.zero1_replicated: parameters with fewer elements than pipelines along every dim stay whole."""
    p = plan({"pipelines": [pl(1, 1, st([r], [0, 1])) for r in range(3)], "zero1": True}, MINI, 6)
    assert p.settings.zero1_replicated == (
        "layers.0.attn_norm.weight", "layers.0.attn.wq", "layers.0.attn.wk", "layers.0.attn.wv", "layers.0.attn.wo",
        "layers.0.mlp_norm.weight", "layers.1.attn_norm.weight", "layers.1.attn.wq", "layers.1.attn.wk",
        "layers.1.attn.wv", "layers.1.attn.wo", "layers.1.mlp_norm.weight", "final_norm.weight")
    assert texts(p, "layers.0.attn_norm.weight", "layers.0.attn_norm.weight.grad_sync", "embed.weight") == {
        "layers.0.attn_norm.weight": "[0] R | [1] R | [2] R",
        "layers.0.attn_norm.weight.grad_sync": "[0] R | [1] R | [2] R",
        "embed.weight": "[0] R | [1] R | [2] R ; hdim=0 ratios=3:3:2"}
    # one pipeline: ZeRO-1 has nothing to shard over, and nothing is named
    one = plan({"pipelines": [pl(1, 1, st([0], [0, 1]))], "zero1": True}, MINI, 6)
    assert one.settings.zero1_replicated == () and str(one.annotations["embed.weight"]) == "[0] R"


def test_plan_of_an_uneven_stage() -> None:
    """An uneven TP stage takes the top tier: one subgroup per TP rank, HDim = the TP split dim in the ratios."""
    p = plan({"pipelines": [pl(1, 2, st([0, 1], [0, 1], ratios=[3, 1]), st([2], [2, 3]))]})
    assert texts(p, *KEYS) == {
        "tokens": "[0] R | [1] R", "targets": "[2] R",
        "embed.weight": "[0] R | [1] R ; hdim=1 ratios=3:1", "embed.weight.gather": None,
        "embed.weight.grad_sync": "[0] R | [1] R ; hdim=1 ratios=3:1",
        "embed.out": "[0] R | [1] R", "layers.0.in": "[0] R | [1] R", "layers.0.attn_norm.weight": "[0] R | [1] R",
        "layers.0.attn.wq": "[0] R | [1] R ; hdim=1 ratios=3:1", "layers.0.attn.wq.gather": None,
        "layers.0.attn.wq.grad_sync": "[0] R | [1] R ; hdim=1 ratios=3:1",
        "layers.0.attn.wo": "[0] R | [1] R ; hdim=0 ratios=3:1", "layers.2.in": "[2] R",
        "layers.3.mlp.w2": "[2] R", "final_norm.weight": "[2] R"}
    assert len(p.annotations) == 95 and p.meta["strategy_name"] == "tp2/1-pp2-ratios3:1"


def test_plan_of_uneven_stages_over_two_pipelines_with_zero1() -> None:
    """The pipelines take the bottom tier: the batch split evenly, parameters sharded over them (DS S<d>x2) and
    gathered back (D2) by their other use."""
    p = plan({"pipelines": [pl(1, 2, st([0, 1], [0, 3], ratios=[3, 1])), pl(1, 2, st([2, 3], [0, 3], ratios=[3, 1]))],
              "zero1": True})
    assert texts(p, *KEYS) == {
        "tokens": "[0,2] S0x2 | [1,3] S0x2", "targets": "[0,2] S0x2 | [1,3] S0x2",
        "embed.weight": "[0,2] S0x2 | [1,3] S0x2 ; hdim=1 ratios=3:1",
        "embed.weight.gather": "[0,2] D2 | [1,3] D2 ; hdim=1 ratios=3:1",
        "embed.weight.grad_sync": "[0,2] S0x2 | [1,3] S0x2 ; hdim=1 ratios=3:1",
        "embed.out": "[0,2] S0x2 | [1,3] S0x2", "layers.0.in": "[0,2] S0x2 | [1,3] S0x2",
        "layers.0.attn_norm.weight": "[0,2] S0x2 | [1,3] S0x2",
        "layers.0.attn.wq": "[0,2] S0x2 | [1,3] S0x2 ; hdim=1 ratios=3:1",
        "layers.0.attn.wq.gather": "[0,2] D2 | [1,3] D2 ; hdim=1 ratios=3:1",
        "layers.0.attn.wq.grad_sync": "[0,2] S0x2 | [1,3] S0x2 ; hdim=1 ratios=3:1",
        "layers.0.attn.wo": "[0,2] S1x2 | [1,3] S1x2 ; hdim=0 ratios=3:1",
        "layers.2.in": "[0,2] S0x2 | [1,3] S0x2",
        "layers.3.mlp.w2": "[0,2] S1x2 | [1,3] S1x2 ; hdim=0 ratios=3:1",
        "final_norm.weight": "[0,2] S0x2 | [1,3] S0x2"}
    assert p.settings.zero1_replicated == ()
    # without ZeRO-1 the parameters are duplicated over the pipelines, and their other uses add nothing
    q = plan({"pipelines": [pl(1, 2, st([0, 1], [0, 3], ratios=[3, 1])), pl(1, 2, st([2, 3], [0, 3], ratios=[3, 1]))]})
    assert texts(q, "embed.weight", "embed.weight.gather", "layers.0.attn.wq", "layers.0.attn.wq.gather") == {
        "embed.weight": "[0,2] D2 | [1,3] D2 ; hdim=1 ratios=3:1", "embed.weight.gather": None,
        "layers.0.attn.wq": "[0,2] D2 | [1,3] D2 ; hdim=1 ratios=3:1", "layers.0.attn.wq.gather": None}


def test_plan_of_uneven_stages_names_what_zero1_cannot_shard() -> None:
    """Three pipelines beside uneven 1:3 stages of a small model: no chunk divides by 3, so nothing is sharded
    and every parameter is named."""
    p = plan({"pipelines": [pl(1, 1, st([2 * r, 2 * r + 1], [0, 1], ratios=[1, 3])) for r in range(3)],
              "zero1": True}, SMALL, 6)
    assert p.settings.zero1_replicated[:3] == ("embed.weight", "layers.0.attn_norm.weight", "layers.0.attn.wq")
    assert len(p.settings.zero1_replicated) == 21 and p.settings.zero1_replicated[-1] == "lm_head.weight"
    assert texts(p, "layers.0.attn_norm.weight", "layers.0.attn_norm.weight.gather",
                 "layers.0.attn_norm.weight.grad_sync", "layers.0.attn.wq", "tokens") == {
        "layers.0.attn_norm.weight": "[0,2,4] D3 | [1,3,5] D3",
        "layers.0.attn_norm.weight.gather": None,
        "layers.0.attn_norm.weight.grad_sync": "[0,2,4] D3 | [1,3,5] D3",
        "layers.0.attn.wq": "[0,2,4] D3 | [1,3,5] D3 ; hdim=1 ratios=1:3",
        "tokens": "[0,2,4] S0x3 | [1,3,5] S0x3"}


def test_plan_of_context_parallel_stages() -> None:
    """CP stages: data and activations split the sequence over the CP coordinate (slowest), parameters are
    duplicated over it; a parameter's other use on its own stage adds nothing."""
    p = plan({"pipelines": [pl(1, 2, st([0, 1, 2, 3], [0, 1], cp=2), st([4, 5], [2, 3], cp=2))]})
    assert texts(p, *KEYS) == {
        "tokens": "[0-3] S1x2 D2", "targets": "[4,5] S1x2",
        "embed.weight": "[0-3] D2 S1x2", "embed.weight.gather": None, "embed.weight.grad_sync": "[0-3] D2 S1x2",
        "embed.out": "[0-3] S1x2 D2", "layers.0.in": "[0-3] S1x2 D2", "layers.0.attn_norm.weight": "[0-3] D4",
        "layers.0.attn.wq": "[0-3] D2 S1x2", "layers.0.attn.wq.gather": None,
        "layers.0.attn.wq.grad_sync": "[0-3] D2 S1x2", "layers.0.attn.wo": "[0-3] D2 S0x2",
        "layers.2.in": "[4,5] S1x2", "layers.3.mlp.w2": "[4,5] D2", "final_norm.weight": "[4,5] D2"}
    assert len(p.annotations) == 95 and p.settings.zero1_replicated == ()


def test_plan_of_context_parallel_pipelines_with_zero1() -> None:
    """CP stages over two pipelines with ZeRO-1: parameters sharded over the pipelines (a dim chosen by the TP
    ranks alone), gathered back by their other uses; batch split by samples."""
    p = plan({"pipelines": [pl(1, 2, st([0, 1], [0, 3], cp=2)), pl(1, 2, st([2, 3], [0, 3], cp=2))], "zero1": True})
    assert texts(p, *KEYS) == {
        "tokens": "[0,1] S1x2 | [2,3] S1x2 ; hdim=0", "targets": "[0,1] S1x2 | [2,3] S1x2 ; hdim=0",
        "embed.weight": "[0,1] D2 | [2,3] D2 ; hdim=0", "embed.weight.gather": "[0,1] D2 | [2,3] D2",
        "embed.weight.grad_sync": "[0,1] D2 | [2,3] D2 ; hdim=0",
        "embed.out": "[0,1] S1x2 | [2,3] S1x2 ; hdim=0", "layers.0.in": "[0,1] S1x2 | [2,3] S1x2 ; hdim=0",
        "layers.0.attn_norm.weight": "[0,1] D2 | [2,3] D2 ; hdim=0",
        "layers.0.attn.wq": "[0,1] D2 | [2,3] D2 ; hdim=0", "layers.0.attn.wq.gather": "[0,1] D2 | [2,3] D2",
        "layers.0.attn.wq.grad_sync": "[0,1] D2 | [2,3] D2 ; hdim=0",
        "layers.0.attn.wo": "[0,1] D2 | [2,3] D2 ; hdim=1", "layers.2.in": "[0,1] S1x2 | [2,3] S1x2 ; hdim=0",
        "layers.3.mlp.w2": "[0,1] D2 | [2,3] D2 ; hdim=1", "final_norm.weight": "[0,1] D2 | [2,3] D2 ; hdim=0"}
    unequal = plan({"pipelines": [pl(1, 3, st([0, 1], [0, 3], cp=2)), pl(1, 1, st([2, 3], [0, 3], cp=2))]})
    assert texts(unequal, "tokens", "layers.0.attn.wq", "layers.0.attn.wq.gather", "layers.0.attn.wq.grad_sync") == {
        "tokens": "[0,1] S1x2 | [2,3] S1x2 ; hdim=0 ratios=3:1",
        "layers.0.attn.wq": "[0,1] D2 | [2,3] D2",  # no ZeRO-1: replicated over the pipelines
        "layers.0.attn.wq.gather": None, "layers.0.attn.wq.grad_sync": "[0,1] D2 | [2,3] D2"}
    assert unequal.settings.zero1_replicated == ()
    # ZeRO-1 with one pipeline: nothing to shard over, nothing named
    alone = plan({"pipelines": [pl(1, 1, st([0, 1, 2, 3], [0, 3], cp=2))], "zero1": True},)
    assert alone.settings.zero1_replicated == () and str(alone.annotations["layers.0.attn.wq"]) == "[0-3] D2 S1x2"
    alone_uneven = plan({"pipelines": [pl(1, 1, st([0, 1], [0, 3], ratios=[3, 1]))], "zero1": True})
    assert alone_uneven.settings.zero1_replicated == ()
    assert str(alone_uneven.annotations["layers.0.attn.wq"]) == "[0] R | [1] R ; hdim=1 ratios=3:1"
    three = plan({"pipelines": [pl(1, 1, st([2 * r, 2 * r + 1], [0, 1], cp=2)) for r in range(3)], "zero1": True},
                 MINI, 6)
    assert three.settings.zero1_replicated[:2] == ("layers.0.attn_norm.weight", "layers.0.attn.wq")
    assert len(three.settings.zero1_replicated) == 13
    assert texts(three, "layers.0.attn_norm.weight", "layers.0.attn_norm.weight.grad_sync", "embed.weight") == {
        "layers.0.attn_norm.weight": "[0,1] D2 | [2,3] D2 | [4,5] D2",
        "layers.0.attn_norm.weight.grad_sync": "[0,1] D2 | [2,3] D2 | [4,5] D2",
        "embed.weight": "[0,1] D2 | [2,3] D2 | [4,5] D2 ; hdim=0 ratios=3:3:2"}


@dataclass(frozen=True)
class ScalarModel:
    """A model of one layer whose parameters are a scalar and a vector of 4 (the ModelSpec parts a plan reads)."""

    name: str = "scalar"
    num_layers: int = 1

    def build_graph(self) -> Any:
        b = GraphBuilder("scalar")
        b.parameter("scale", ())
        b.parameter("w", (4,))
        return b.build()

    def placements(self) -> list[Placement]:
        return [Placement("scale", "parameter", 0, None), Placement("w", "parameter", 0, None)]

    def tp_problems(self, degree: int) -> list[str]:
        return []


@dataclass(frozen=True)
class PlacedOpModel(ScalarModel):
    """ScalarModel plus an op (gelu of ``w``) whose output the model places too: a plan annotates only leaves and
    Reshards, so the op's placement is not read."""

    name: str = "placed-op"

    def build_graph(self) -> Any:
        b = GraphBuilder("placed-op")
        w = b.parameter("w", (4,))
        b.add("gelu", [w], {}, name="act")
        return b.build()

    def placements(self) -> list[Placement]:
        return [Placement("w", "parameter", 0, None), Placement("act", "activation", 0, None)]


def test_a_plan_annotates_leaves_and_reshards_only() -> None:
    """An op output's placement is not made an annotation (specialization deduces it)."""
    p = plan({"pipelines": [pl(1, 1, st([0], [0, 0]))]}, PlacedOpModel(), 1)
    assert {k: str(v) for k, v in p.annotations.items()} == {"w": "[0] R", "w.grad_sync": "[0] R"}


@dataclass(frozen=True)
class NamelessModel:
    """The parts of a ModelSpec a plan reads, without a ``name``."""

    num_layers: int = 1

    def build_graph(self) -> Any:
        b = GraphBuilder("nameless")
        b.parameter("w", (4,))
        return b.build()

    def placements(self) -> list[Placement]:
        return [Placement("w", "parameter", 0, None)]

    def tp_problems(self, degree: int) -> list[str]:
        return []


def test_a_model_without_a_name_is_planned_with_meta_model_none() -> None:
    """meta["model"] is the model's name, or None for a model without one."""
    p = plan({"pipelines": [pl(1, 1, st([0], [0, 0]))]}, NamelessModel(), 1)
    assert p.meta == {"source": "plan_from_strategy", "model": None, "strategy_name": "single-device",
                      "stages": [[[0]]]}


@pytest.mark.parametrize("cp", [1, 2])
def test_zero1_names_a_scalar_parameter_only_over_several_pipelines(cp: int) -> None:
    """A 0-dim parameter has no dim to shard: ZeRO-1 over two pipelines names it, over one pipeline it has nothing
    to shard over and names nothing (even and context-parallel stages alike)."""
    one = plan({"pipelines": [pl(1, 1, st(list(range(cp)), [0, 0], cp=cp))], "zero1": True}, ScalarModel(), 4)
    two = plan({"pipelines": [pl(1, 1, st(list(range(cp)), [0, 0], cp=cp)),
                              pl(1, 1, st(list(range(cp, 2 * cp)), [0, 0], cp=cp))], "zero1": True}, ScalarModel(), 4)
    g1, g2 = ("[0] R", "[1] R") if cp == 1 else ("[0,1] D2", "[2,3] D2")
    assert one.settings.zero1_replicated == ()
    assert {k: str(v) for k, v in one.annotations.items()} == {"scale": g1, "scale.grad_sync": g1, "w": g1,
                                                              "w.grad_sync": g1}
    assert two.settings.zero1_replicated == ("scale",)
    assert {k: str(v) for k, v in two.annotations.items()} == {
        "scale": f"{g1} | {g2}", "scale.grad_sync": f"{g1} | {g2}", "w": f"{g1} | {g2} ; hdim=0",
        "w.grad_sync": f"{g1} | {g2} ; hdim=0"}


# ---- errors ---------------------------------------------------------------------------------------------------
def test_plan_errors_name_the_model_and_the_leaves() -> None:
    """Not a model config; a strategy that does not fit the model; placements that miss leaves (first five)."""
    one = {"pipelines": [pl(1, 1, st([0], [0, 3]))]}
    with pytest.raises(PlanValidationError) as info:
        plan_from_strategy(object(), Strategy.load(one), Cluster.local(1))
    assert info.value.problems == [("model", "plan_from_strategy needs a model config (a ModelSpec such as "
                                             "LlamaConfig or GPTConfig), not object")]
    with pytest.raises(PlanValidationError) as info:
        plan(one, SMALL)
    assert info.value.problems == [("pipelines[0]", "layers cover 0..3 but the model has 2 layers (0..1)")]
    with pytest.raises(PlanValidationError) as info:
        plan({"pipelines": [pl(1, 1, st([0, 5], [0, 3]))]}, TINY, 2)
    assert info.value.problems == [("pipelines[0].stages[0].devices", "rank 5 is not in the cluster (2 ranks: 0..1)")]

    class Missing(LlamaConfig):
        def placements(self) -> Any:
            return [p for p in super().placements() if not p.tensor.startswith(("tokens", "layers.1."))]

    class SplitSequence(LlamaConfig):
        def placements(self) -> Any:
            return [dataclasses.replace(p, tp_split=1) if p.tensor == "layers.0.in" else p for p in super().placements()]

    with pytest.raises(PlanValidationError) as info:
        plan({"pipelines": [pl(1, 1, st([0, 1, 2, 3], [0, 3], cp=2))]}, SplitSequence(**TINY.model_dump()))
    assert info.value.problems == [("stage R0-3 L0-3 cp=2", "tensor 'layers.0.in': tensor parallelism splits its "
                                                           "sequence dim 1, which context parallelism (cp=2) splits "
                                                           "too; use cp=1 on this stage")]

    with pytest.raises(SpecializationError) as err:
        plan(one, Missing(**TINY.model_dump()))
    assert str(err.value) == ("model 'tiny': placements() gives no placement for leaf tensor(s) ['tokens', "
                              "'layers.1.attn_norm.weight', 'layers.1.attn.wq', 'layers.1.attn.wk', "
                              "'layers.1.attn.wv']; every placeholder and parameter needs one")


# ---- uneven ZeRO shares (Pipeline.zero_share, SPEC §15) --------------------------------------------------------
@pytest.mark.parametrize("units, shares, expected", [
    (64, [3, 1], [48, 16]), (10, [1, 1, 1], [4, 3, 3]), (3, [100, 1, 1], [1, 1, 1]),  # the docstring's
    (10, [2, 1], [6, 4]),      # one each, then 8 by 2:1 = 5.33 + 2.67: 6 + 3, the larger remainder (0.67) gets the 10th
    (10, [1, 2], [4, 6]),      # the same, mirrored: the unit goes to the first share now
    (5, [3, 1], [3, 2]),       # one each, then 3 by 3:1 = 2.25 + 0.75: 3 + 1, the 5th to the second (0.75 > 0.25)
    (7, [1, 1, 1, 1], [2, 2, 2, 1]),  # ties of remainders: the earlier shares first
    (6, [1, 3], [2, 4]),       # exact: 4 by 1:3 is 1 + 3, no remainder to give out
])
def test_share_chunks_cuts_units_by_largest_remainders(units: int, shares: list[float], expected: list[int]) -> None:
    """share_chunks gives each share one unit, then the rest in proportion (floors), then one more unit to each of
    the largest remainders (the earlier share first on a tie): every chunk >= 1 and the chunks add up to units."""
    from hspmd_sdk.core.strategy_plan import share_chunks

    got = share_chunks(units, shares)
    assert got == expected and sum(got) == units and min(got) >= 1


@pytest.mark.parametrize("shape, split, groups, expected", [
    ((6, 10), None, [[0], [1]], (1, [7, 3])),        # the largest dim TP does not split: 1 + 1, then 8 by 3:1
    ((5,), None, [[0], [1]], (0, [3, 2])),           # an odd dim: no even-division requirement for shares
    ((2,), None, [[0], [1]], (0, [1, 1])),           # exactly one element per pipeline still shards
    ((3,), None, [[0], [1]], (0, [2, 1])),
    ((8, 3), 0, [[0, 1], [2, 3]], (1, [2, 1])),      # a dim TP does not split before the (larger) TP-split dim
    ((4, 1), 0, [[0, 1], [2, 3]], (0, [2, 2])),      # the TP-split dim in whole TP units (2 units: one each)
    ((7, 1), 0, [[0, 1], [2, 3]], None),             # 7 rows do not divide by TP 2; 1 column < 2 pipelines
    ((2, 1), 0, [[0, 1], [2, 3]], None),             # 2 rows are one TP unit: fewer units than pipelines
])
def test_zero_shard_by_uneven_shares(shape: tuple[int, ...], split: int | None, groups: list[list[int]],
                                     expected: Any) -> None:
    """With shares not all equal (3:1 here), zero_shard cuts the largest dim TP does not split (else the TP-split
    one, in units of the TP degrees' lcm) by share_chunks, at least one unit per pipeline; None when no dim has
    that many units."""
    assert zero_shard(shape, split, groups, [3, 1]) == expected


def test_zero_shard_with_equal_shares_is_the_even_choice() -> None:
    """Equal shares (1:1) are no uneven shares: the even choice (a dim the pipelines divide, no hratios)."""
    assert zero_shard((4, 4), None, [[0], [1]], [1, 1]) == (0, None)
    assert zero_shard((4, 4), None, [[0], [1]], [2.0, 2.0]) == (0, None)


@pytest.mark.parametrize("cp", [1, 2])
def test_plan_shards_parameters_by_zero_shares(cp: int) -> None:
    """A pipeline with zero_share 3 beside one with 1 holds 3/4 of each ZeRO-sharded parameter (even and context
    parallel stages alike): hratios 48:16 of a 64-row weight, 192:64 of the 256-row embedding, and the gradient
    goes to the same shards."""
    g1, g2 = ("[0] R", "[1] R") if cp == 1 else ("[0,1] D2", "[2,3] D2")
    devs = [list(range(cp)), list(range(cp, 2 * cp))]
    p = plan({"pipelines": [{**pl(1, 2, st(devs[0], [0, 3], cp=cp)), "zero_share": 3},
                            pl(1, 2, st(devs[1], [0, 3], cp=cp))], "zero": 1})
    assert texts(p, "layers.0.attn.wq", "layers.0.attn.wq.grad_sync", "embed.weight") == {
        "layers.0.attn.wq": f"{g1} | {g2} ; hdim=0 ratios=48:16",
        "layers.0.attn.wq.grad_sync": f"{g1} | {g2} ; hdim=0 ratios=48:16",
        "embed.weight": f"{g1} | {g2} ; hdim=0 ratios=192:64"}


def test_plan_settings_keep_the_zero_level() -> None:
    """The plan's settings carry the strategy's ZeRO level itself (2 here), not only the ZeRO-1 flag."""
    p = plan({"pipelines": [pl(1, 2, st([0], [0, 3])), pl(1, 2, st([1], [0, 3]))], "zero": 2})
    assert (p.settings.zero, p.settings.zero1) == (2, True)
