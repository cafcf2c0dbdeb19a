"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/strategy.py.

They pin what a person reads (the strategy's shape name, ``str()`` forms, ``summary()`` text, the messages of the
context checks) exactly, and the small queries (``share``, ``tp_groups``, ``cp_balance``) by hand.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest

from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.memory import device_memory
from hspmd_sdk.core.strategy import Pipeline, Stage, Strategy, _over_memory, memory_estimate, parallel_text
from hspmd_sdk.errors import PlanValidationError


def pl(mbs: int, n: int, *stages: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"stages": list(stages), "micro_batch_size": mbs, "num_micro_batches": n, **kw}


def st(devices: list[int], layers: list[int], **kw: Any) -> dict[str, Any]:
    return {"devices": devices, "layers": layers, **kw}


def load(*pipelines: dict[str, Any], **kw: Any) -> Strategy:
    return Strategy.load({"pipelines": list(pipelines), **kw})


def problems(data: Any, **ctx: Any) -> list[tuple[str, str]]:
    with pytest.raises(PlanValidationError) as info:
        Strategy.load(data, **ctx)
    return info.value.problems


# ---- parallel_text, str() ------------------------------------------------------------------------------------
@pytest.mark.parametrize("devices, cp, text", [
    (4, 1, "TP4"), (1, 1, "TP1"), (4, 0, "TP4"),  # no CP (a cp below 1 is no CP)
    (4, 2, "CP2×TP2"), (8, 2, "CP2×TP4"), (2, 2, "CP2"), (4, 4, "CP4"),
    (6, 4, "CP4 of 6 devices"), (3, 2, "CP2 of 3 devices"),  # cp that does not divide the devices
])
def test_parallel_text(devices: int, cp: int, text: str) -> None:
    """A stage's parallelism for people, every form of it."""
    assert parallel_text(devices, cp) == text


def test_parallel_text_default_is_no_cp() -> None:
    """parallel_text's cp defaults to 1: no context parallelism."""
    assert parallel_text(4) == "TP4" and parallel_text(1) == "TP1"


def test_stage_queries_and_str() -> None:
    """Stage.__str__ (ranks, layers, cp, ratios in lowest terms, recompute) and the derived queries."""
    s = Stage(devices=[4, 5, 6, 7], layers=[2, 5], cp=2, recompute=True)
    assert str(s) == "R4-7 L2-5 cp=2 +recompute"
    assert s.tp_groups == [[4, 5], [6, 7]] and s.tp_degree == 2 and s.parallel_text == "CP2×TP2"
    assert (s.first_layer, s.last_layer, s.num_layers) == (2, 5, 4)
    assert Stage(devices=[0, 1, 2], layers=[0, 0], cp=3).tp_groups == [[0], [1], [2]]
    assert Stage(devices=[0, 1, 2], layers=[0, 0]).tp_groups == [[0, 1, 2]]
    assert Stage(devices=[3], layers=[1, 1]).parallel_text == "TP1"
    assert str(Stage(devices=[3], layers=[1, 1])) == "R3 L1-1"
    u = Stage(devices=[0, 1], layers=[0, 3], ratios=[6, 2])
    assert str(u) == "R0,1 L0-3 ratios=3:1" and u.tp_ratios == (3, 1) and u.is_uneven
    assert u.share(0) == 0.75 and u.share(1) == 0.25
    assert str(Stage(devices=[0, 1, 2], layers=[0, 3], ratios=[2, 4, 6])) == "R0-2 L0-3 ratios=1:2:3"
    even = Stage(devices=[0, 1, 2], layers=[0, 0], ratios=[5, 5, 5])
    assert even.tp_ratios is None and not even.is_uneven and str(even) == "R0-2 L0-0"
    assert even.share(2) == pytest.approx(1 / 3)
    assert Stage(devices=[0, 1, 2, 3], layers=[0, 0], cp=2).share(3) == 0.5  # 1 / tp_degree, not 1 / devices


def test_pipeline_and_strategy_str_and_cp_balance() -> None:
    """Pipeline / Strategy __str__, and cp_balance: the common cp of all stages when above 1, else 1."""
    p = Pipeline(stages=[Stage(devices=[0, 1], layers=[0, 1], cp=2), Stage(devices=[2, 3], layers=[2, 3], cp=2)],
                 micro_batch_size=2, num_micro_batches=3)
    assert str(p) == "3 x bs2: R0,1 L0-1 cp=2 | R2,3 L2-3 cp=2"
    assert p.cp_balance == 2
    q = Pipeline(stages=[Stage(devices=[4], layers=[0, 3])], micro_batch_size=1, num_micro_batches=1)
    assert q.cp_balance == 1
    mixed = Pipeline(stages=[Stage(devices=[0, 1], layers=[0, 1], cp=2), Stage(devices=[2], layers=[2, 3])],
                     micro_batch_size=1, num_micro_batches=1)
    assert mixed.cp_balance == 1
    two = Pipeline(stages=[Stage(devices=[0, 1], layers=[0, 1], cp=2),
                           Stage(devices=[2, 3, 4, 5], layers=[2, 3], cp=4)], micro_batch_size=1, num_micro_batches=1)
    assert two.cp_balance == 1
    assert str(Strategy(pipelines=[p, q])) == "Strategy(3 x bs2: R0,1 L0-1 cp=2 | R2,3 L2-3 cp=2 || 1 x bs1: R4 L0-3)"


# ---- shape_name ----------------------------------------------------------------------------------------------
SHAPES = [
    ([pl(1, 1, st([0], [0, 3]))], {}, "single-device"),
    ([pl(1, 1, st([0], [0, 3]))], {"zero1": True, "schedule": "gpipe"}, "single-device"),  # one pipeline, stage
    ([pl(1, 1, st([0], [0, 3])), pl(1, 1, st([1], [0, 3]))], {}, "dp2"),
    ([pl(1, 1, st([r], [0, 3])) for r in range(3)], {"zero1": True}, "dp3-zero1"),
    ([pl(1, 1, st([0, 1], [0, 3]))], {}, "tp2"),
    ([pl(1, 1, st([0, 1, 2], [0, 3]))], {"zero1": True}, "tp3"),
    ([pl(1, 1, st([0], [0, 1]), st([1], [2, 3]))], {}, "pp2"),
    ([pl(1, 1, st([0], [0, 1]), st([1], [2, 3]))], {"schedule": "gpipe"}, "pp2-gpipe"),
    ([pl(1, 1, st([0], [0, 0]), st([1], [1, 1]), st([2], [2, 3]))], {}, "pp3"),
    ([pl(1, 1, st([0, 1], [0, 1]), st([2, 3], [2, 3])), pl(1, 1, st([4, 5], [0, 1]), st([6, 7], [2, 3]))],
     {"zero1": True, "schedule": "gpipe"}, "dp2-tp2-pp2-gpipe-zero1"),
    ([pl(1, 1, st([0, 1], [0, 1]), st([2], [2, 3]))], {}, "tp2/1-pp2"),
    ([pl(1, 1, st([0, 1], [0, 1]), st([2], [2, 3])), pl(1, 1, st([3], [0, 3]))], {"zero1": True},
     "hetero(tp2+tp1 | tp1)-zero1"),
    ([pl(1, 1, st([0, 1], [0, 1]), st([2], [2, 3])), pl(1, 1, st([3], [0, 3]))], {"schedule": "gpipe"},
     "hetero(tp2+tp1 | tp1)-gpipe"),
    ([pl(1, 1, st([0, 1], [0, 3], ratios=[3, 1]))], {}, "tp2-ratios3:1"),
    ([pl(1, 1, st([0, 1], [0, 0], ratios=[3, 1]), st([2, 3], [1, 1], ratios=[1, 3]),
         st([4, 5], [2, 3], ratios=[6, 2]))], {}, "tp2-pp3-ratios3:1,1:3"),
    ([pl(1, 1, st([0, 1], [0, 3], cp=2))], {}, "cp2"),
    ([pl(1, 1, st([0, 1, 2, 3], [0, 3], cp=2))], {}, "tp2-cp2"),
    ([pl(1, 1, st([0, 1], [0, 1], cp=2), st([2, 3, 4, 5], [2, 3], cp=4), st([6, 7], [4, 5], cp=2))], {},
     "pp3-cp2/4"),
    ([pl(1, 1, st([0, 1], [0, 3], cp=2)), pl(1, 1, st([2, 3], [0, 3], cp=2))], {}, "dp2-cp2"),
]


@pytest.mark.parametrize("pipelines, extra, name", SHAPES, ids=[s[2] for s in SHAPES])
def test_shape_name(pipelines: list[dict[str, Any]], extra: dict[str, Any], name: str) -> None:
    """The name Strategy.load gives a strategy without one: its shape, every part of it."""
    s = load(*pipelines, **extra)
    assert s.shape_name() == name and s.name == name
    assert load(*pipelines, **extra, name="mine").name == "mine"


def test_to_json_indents_by_two_by_default() -> None:
    """to_json's default indent (2), and indent=None for one line."""
    s = load(pl(1, 2, st([0], [0, 3])))
    assert s.to_json() == s.model_dump_json(indent=2) and "\n  \"pipelines\"" in s.to_json()
    assert "\n" not in s.to_json(indent=None)
    assert json.loads(s.to_json(indent=None)) == json.loads(s.to_json())


def test_direct_construction_hides_its_own_frame_from_pytest() -> None:
    """_Worded.__init__ sets __tracebackhide__ = True so that pytest shows the caller's line, not the SDK's."""
    with pytest.raises(PlanValidationError) as info:
        Stage(devices=[0, 0], layers=[0, 1])
    hidden = [tb.tb_frame.f_locals["__tracebackhide__"] for tb in _walk(info.value.__traceback__)
              if "__tracebackhide__" in tb.tb_frame.f_locals]
    assert hidden == [True]
    assert all(e.frame.f_locals.get("__tracebackhide__") is not True for e in info.traceback.filter(info))


def _walk(tb: Any) -> list[Any]:
    out = []
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


# ---- context checks: messages --------------------------------------------------------------------------------
_WHERE = ("the editor's global batch box (PlanEditor.set_global_batch), global_batch= of Strategy.load/check, "
          "--global-batch of hspmd validate/plan/simulate")
_HEAD = ("micro-batches sum to 11 samples (pipeline 0: 3 x bs2, pipeline 1: 4 x bs1, pipeline 2: 1 x bs1) but "
         "the global batch is ")


@pytest.mark.parametrize("global_batch, tail", [
    (2, "; every pipeline takes at least one sample, so 3 pipelines cannot share 2 samples whatever their "
        f"micro-batches: raise the global batch to at least 3 in {_WHERE}, or remove pipelines"),
    (1, "; every pipeline takes at least one sample, so 3 pipelines cannot share 1 sample whatever their "
        f"micro-batches: raise the global batch to at least 3 in {_WHERE}, or remove pipelines"),
    (3, f"; change num_micro_batches or micro_batch_size so the pipelines add up to 3 (e.g. 1 x bs1 in each "
        f"pipeline), or change the global batch in {_WHERE}"),
    (12, f"; change num_micro_batches or micro_batch_size so the pipelines add up to 12 (e.g. 4 x bs1 in each "
         f"pipeline), or change the global batch in {_WHERE}"),
    (10, f"; change num_micro_batches or micro_batch_size so the pipelines add up to 10 (e.g. 4 x bs1 in 1 "
         f"pipeline(s) and 3 x bs1 in the others), or change the global batch in {_WHERE}"),
    (14, f"; change num_micro_batches or micro_batch_size so the pipelines add up to 14 (e.g. 5 x bs1 in 2 "
         f"pipeline(s) and 4 x bs1 in the others), or change the global batch in {_WHERE}"),
])
def test_global_batch_message(global_batch: int, tail: str) -> None:
    """The global-batch problem's text: too few samples for the pipelines, or an even / near-even suggestion."""
    data = {"pipelines": [pl(2, 3, st([0], [0, 3])), pl(1, 4, st([1], [0, 3])), pl(1, 1, st([2], [0, 3]))]}
    assert problems(data, global_batch=global_batch) == [("pipelines", _HEAD + str(global_batch) + tail)]
    assert Strategy.load(data).check(global_batch=11).global_batch == 11


_UNEXPRESSIBLE = ("; an uneven TP stage beside a pipeline that splits the same layer differently cannot be expressed "
                  "by one two-tier annotation (the top tier holds the uneven TP split, the bottom tier the "
                  "pipelines); give every pipeline the same TP degree and ratios on that layer, or train the "
                  "pipelines separately")
_SAME_BATCHING = (": with a stage of uneven ratios, every pipeline takes an equal batch share in the same "
                  "micro-batches (the HSPMD annotation splits the batch evenly inside an uneven TP subgroup); give "
                  "the pipelines the same micro-batching")


def test_uneven_stages_beside_other_pipelines() -> None:
    """Which uneven-TP combinations over several pipelines are refused, and the exact field path and text."""
    # the same ratios on the same layers in both pipelines: fine
    load(pl(1, 2, st([0, 1], [0, 1], ratios=[3, 1]), st([2], [2, 3])),
         pl(1, 2, st([3, 4], [0, 1], ratios=[3, 1]), st([5], [2, 3])))
    # pipeline 1 uneven where pipeline 0 is even: the path names pipeline 1's stage
    assert problems({"pipelines": [pl(1, 2, st([0, 1], [0, 1]), st([2, 7], [2, 3])),
                                   pl(1, 2, st([3, 4], [0, 2]), st([5, 6], [3, 3], ratios=[1, 2]))]}) == [
        ("pipelines[1].stages[1].ratios", "layer 3 is TP2 even in pipelines[0].stages[1] but TP2 ratios 1:2 in "
                                          "pipelines[1].stages[1]" + _UNEXPRESSIBLE)]
    # pipeline 0 uneven where pipeline 1 is even: the path names pipeline 0's stage
    assert problems({"pipelines": [pl(1, 2, st([0, 1], [0, 1]), st([2, 7], [2, 3], ratios=[2, 1])),
                                   pl(1, 2, st([3, 4], [0, 2]), st([5, 6], [3, 3], ratios=[1, 2]))]}) == [
        ("pipelines[0].stages[1].ratios", "layer 2 is TP2 ratios 2:1 in pipelines[0].stages[1] but TP2 even in "
                                          "pipelines[1].stages[0]" + _UNEXPRESSIBLE)]
    # uneven in both, with different ratios, on a third pipeline
    assert problems({"pipelines": [pl(1, 1, st([0, 1], [0, 3], ratios=[2, 1])),
                                   pl(1, 1, st([2, 3], [0, 3], ratios=[2, 1])),
                                   pl(1, 1, st([4, 5], [0, 3], ratios=[1, 2]))]}) == [
        ("pipelines[2].stages[0].ratios", "layer 0 is TP2 ratios 2:1 in pipelines[0].stages[0] but TP2 ratios 1:2 "
                                          "in pipelines[2].stages[0]" + _UNEXPRESSIBLE)]
    # a different TP degree on the last layer the pipelines share
    assert problems({"pipelines": [pl(1, 1, st([0], [0, 2]), st([1, 2], [3, 3], ratios=[2, 1])),
                                   pl(1, 1, st([3], [0, 2]), st([4, 5, 6], [3, 3], ratios=[2, 1, 1]))]}) == [
        ("pipelines[1].stages[1].ratios", "layer 3 is TP2 ratios 2:1 in pipelines[0].stages[1] but TP3 ratios 2:1:1 "
                                          "in pipelines[1].stages[1]" + _UNEXPRESSIBLE)]
    # layers only one pipeline covers are not compared (the model check reports the coverage)
    load(pl(1, 2, st([0, 1], [0, 1]), st([2, 7], [2, 3], ratios=[2, 1])),
         pl(1, 2, st([3, 4], [0, 1]), st([5, 6], [2, 2], ratios=[2, 1])))
    # different micro-batching beside an uneven stage
    assert problems({"pipelines": [pl(1, 2, st([0, 1], [0, 3], ratios=[2, 1])),
                                   pl(2, 1, st([2, 3], [0, 3], ratios=[2, 1]))]}) == [
        ("pipelines[1]", "1 x bs2 beside pipelines[0]'s 2 x bs1" + _SAME_BATCHING)]
    assert problems({"pipelines": [pl(1, 2, st([0, 1], [0, 3], ratios=[2, 1])),
                                   pl(1, 2, st([2, 3], [0, 3], ratios=[2, 1])),
                                   pl(1, 3, st([4, 5], [0, 3], ratios=[2, 1]))]}) == [
        ("pipelines[2]", "3 x bs1 beside pipelines[0]'s 2 x bs1" + _SAME_BATCHING)]
    # even stages may differ freely, and one pipeline may be uneven alone
    load(pl(1, 2, st([0, 1], [0, 3])), pl(2, 3, st([2], [0, 3])))
    load(pl(1, 2, st([0, 1], [0, 3], ratios=[2, 1])))


def test_load_errors_say_strategy() -> None:
    """Strategy.load words its errors for a strategy: the message and what a missing file was expected to be."""
    with pytest.raises(PlanValidationError) as info:
        Strategy.load({"pipelines": []})
    assert str(info.value) == ("invalid strategy: pipelines: List should have at least 1 item after validation, "
                               "not 0")
    with pytest.raises(PlanValidationError) as info:
        Strategy.load("nope{")
    assert info.value.problems == [("nope{", "no such file (expected a strategy JSON file or JSON text)")]


class _VocabEmbedding(LlamaConfig):
    """A Llama whose embedding is split along the vocabulary: only the first stage then holds a vocab-size split."""

    def placements(self) -> Any:
        return [dataclasses.replace(p, tp_split=0) if p.tensor in ("embed.weight", "embed.weight.gather") else p
                for p in super().placements()]


def test_uneven_ratios_are_checked_against_the_end_stages_tensors() -> None:
    """An uneven first stage is checked with the embedding, an uneven last stage with the LM head, a middle one
    with neither: vocab 250 does not split 3:1."""
    plain = LlamaConfig(**{**LlamaConfig.preset("tiny").model_dump(), "vocab_size": 250})
    vocab = _VocabEmbedding(**plain.model_dump())
    first = {"pipelines": [pl(1, 1, st([0, 1], [0, 1], ratios=[3, 1]), st([2], [2, 3]))]}
    last = {"pipelines": [pl(1, 1, st([2], [0, 1]), st([0, 1], [2, 3], ratios=[3, 1]))]}
    middle = {"pipelines": [pl(1, 1, st([2], [0, 0]), st([0, 1], [1, 2], ratios=[3, 1]), st([3], [3, 3]))]}
    head = ("ratios 3:1 split tensor 'lm_head.weight' dim 1 of size 250 into 187.5 : 62.5, not whole parts (each TP "
            "rank must hold whole heads, KV heads and rows); every size the stage's split reaches must divide by 4; "
            "nearest feasible ratios: 1:1")
    assert problems(first, model=vocab) == [
        ("pipelines[0].stages[0].ratios", head.replace("'lm_head.weight' dim 1", "'embed.weight' dim 0"))]
    assert Strategy.load(first, model=plain).name == "tp2/1-pp2-ratios3:1"
    assert problems(last, model=vocab) == problems(last, model=plain) == [("pipelines[0].stages[1].ratios", head)]
    Strategy.load(middle, model=vocab)
    Strategy.load(middle, model=plain)


def test_even_tp_stages_are_checked_against_the_model() -> None:
    """TP 2 over a model of one head is refused; TP 1 stages need no check."""
    one_head = LlamaConfig(**{**LlamaConfig.preset("tiny").model_dump(), "num_heads": 1, "num_kv_heads": None})
    assert problems({"pipelines": [pl(1, 1, st([0], [0, 1]), st([1, 2], [2, 3]))]}, model=one_head) == [
        ("pipelines[0].stages[1].devices", "TP degree 2 does not divide num_heads=1")]


# ---- summary ------------------------------------------------------------------------------------------------
def test_summary_without_model_or_cluster() -> None:
    """The head line and the pipeline / stage lines, singular forms, no memory."""
    s = Strategy(pipelines=[Pipeline(stages=[Stage(devices=[0], layers=[0, 3])], micro_batch_size=1,
                                     num_micro_batches=1)])
    assert s.summary() == ("Strategy: 1 pipeline, 1 rank, schedule 1f1b, ZeRO-1 off, global batch 1\n"
                           "  pipeline 0: 1 micro-batch x bs1 (1 sample), 1 stage\n"
                           "    stage 0: ranks 0          TP1  layers 0-3 (4)")


def test_summary_with_model_ratios_and_recompute() -> None:
    """Memory per stage is its worst rank's (rank 0 holds 3/4 here), with the footer naming the seq_len."""
    s = Strategy(pipelines=[Pipeline(stages=[Stage(devices=[0, 1], layers=[0, 1], recompute=True, ratios=[3, 1]),
                                             Stage(devices=[2], layers=[2, 3])],
                                     micro_batch_size=2, num_micro_batches=3)], name="x")
    m = LlamaConfig.preset("tiny")
    est = device_memory(s, m)
    assert est[0].total > est[1].total
    assert s.summary(m) == (
        "Strategy 'x': 1 pipeline, 3 ranks, schedule 1f1b, ZeRO-1 off, global batch 6\n"
        "  pipeline 0: 3 micro-batches x bs2 (6 samples), 2 stages\n"
        "    stage 0: ranks 0,1        TP2  layers 0-1 (2)  ratios 3:1  recompute  ~1.3 MiB/rank\n"
        "    stage 1: ranks 2          TP1  layers 2-3 (2)  ~2.2 MiB/rank\n"
        "  memory: estimate of bf16 params+grads, fp32 Adam states and in-flight activations at seq_len 64 "
        "(no cluster given: tensors only, no device runtime); peak 2.2 MiB")
    assert s.summary(m, Cluster.local(4)) == (
        "Strategy 'x': 1 pipeline, 3 ranks, schedule 1f1b, ZeRO-1 off, global batch 6\n"
        "  pipeline 0: 3 micro-batches x bs2 (6 samples), 2 stages\n"
        "    stage 0: ranks 0,1        TP2  layers 0-1 (2)  [2xcpu]  ratios 3:1  recompute  ~0.3 GiB/rank "
        "(tensors 1.3 MiB)\n"
        "    stage 1: ranks 2          TP1  layers 2-3 (2)  [1xcpu]  ~0.3 GiB/rank (tensors 2.2 MiB)\n"
        "  memory: estimate of bf16 params+grads, fp32 Adam states and in-flight activations at seq_len 64, plus "
        "each device's runtime (process baseline 0.3 GiB a CPU worker); peak 0.3 GiB")


_BIG = {"pipelines": [pl(1, 2, st([0], [0, 29]), st([1], [30, 59])), pl(1, 2, st([2, 3], [0, 59]))], "zero1": True}
_BIG_HEAD = ("Strategy 'hetero(tp1+tp1 | tp2)-zero1': 2 pipelines, 4 ranks, schedule 1f1b, ZeRO-1 on, global "
             "batch 4\n"
             "  pipeline 0: 2 micro-batches x bs1 (2 samples), 2 stages\n"
             "    stage 0: ranks 0          TP1  layers 0-29 (30)  [1xH20]  ~203.6 GiB/rank (tensors 201.6 GiB) — "
             "exceeds H20's 95.6 GiB\n"
             "    stage 1: ranks 1          TP1  layers 30-59 (30)  [1xH20]  ~180.7 GiB/rank (tensors 178.7 GiB) — "
             "exceeds H20's 95.6 GiB\n"
             "  pipeline 1: 2 micro-batches x bs1 (2 samples), 1 stage\n")
_BIG_FOOT = ("  memory: estimate of bf16 params+grads, fp32 Adam states (ZeRO-1 over DP) and in-flight activations at "
             "seq_len 4096, plus each device's runtime (CUDA context 2.0 GiB a GPU); peak 203.6 GiB; ")


def test_summary_marks_stages_over_their_devices_memory() -> None:
    """The over-memory marks and footer (plural, singular), and ranks outside the cluster shown as '?' kinds."""
    big = LlamaConfig.preset("llama-32b")
    s = Strategy.load(_BIG)
    assert s.summary(big, Cluster.homogeneous("H20", 4)) == (
        _BIG_HEAD + "    stage 0: ranks 2,3        TP2  layers 0-59 (60)  [2xH20]  ~179.9 GiB/rank (tensors 177.9 GiB) "
        "— exceeds H20's 95.6 GiB\n" + _BIG_FOOT + "3 stages exceed their devices' memory (marked)")
    assert s.summary(big, Cluster.homogeneous("H20", 2)) == (
        _BIG_HEAD + "    stage 0: ranks 2,3        TP2  layers 0-59 (60)  [2x?]  ~177.9 GiB/rank\n" + _BIG_FOOT
        + "2 stages exceed their devices' memory (marked)")
    one = Strategy.load({"pipelines": [pl(1, 1, st([0], [0, 59])), pl(1, 1, st([1], [0, 59]))]})
    text = one.summary(big, Cluster.homogeneous("H20", 1))
    assert text.endswith("; 1 stage exceeds its devices' memory (marked)") and text.count("— exceeds") == 1
    assert "[1x?]" in text
    assert "exceed" not in Strategy.load({"pipelines": [pl(1, 1, st([0], [0, 3]))]}).summary(
        LlamaConfig.preset("tiny"), Cluster.homogeneous("H20", 1))


def test_over_memory_is_strictly_above_the_device() -> None:
    """A stage is marked only when an estimate exceeds its device's memory, not when it equals it."""
    cluster = Cluster.homogeneous("H20", 2)
    cap = cluster.spec(1).memory_bytes
    assert _over_memory([0, 1], {0: 0.0, 1: float(cap)}, cluster) == ""
    assert _over_memory([0, 1], {0: 0.0, 1: cap + 1.0}, cluster) == " — exceeds H20's 95.6 GiB"
    assert _over_memory([0, 1], {0: cap + 1.0, 1: cap + 1.0}, None) == ""


def test_summary_runtime_of_a_mixed_cluster() -> None:
    """The footer names each kind of runtime once, in name order: CUDA context before process baseline."""
    s = Strategy.load({"pipelines": [pl(1, 1, st([0], [0, 1]), st([1], [2, 3]))]})
    text = s.summary(LlamaConfig.preset("tiny"), Cluster.mixed({"cpu": 1, "H20": 1}, per_node=1))
    assert ", plus each device's runtime (CUDA context 2.0 GiB a GPU; process baseline 0.3 GiB a CPU worker); " \
           "peak " in text
    assert "[1xcpu]" in text and "[1xH20]" in text


# ---- memory ---------------------------------------------------------------------------------------------------
def test_memory_estimate_takes_the_seq_len_given() -> None:
    """memory_estimate and Strategy.memory_estimate / device_memory pass seq_len (and the strategy) through."""
    m = LlamaConfig.preset("tiny")
    s = Strategy.load({"pipelines": [pl(1, 2, st([0, 1], [0, 3]))], "schedule": "gpipe"})
    short, full = memory_estimate(s, m, seq_len=32), memory_estimate(s, m)
    assert short[0] < full[0]
    # activations scale with tokens: 4 layers x 896 values x 2 bytes / 2 x 2 in flight + head input 64 x 2 x 2 +
    # logits 2 x 256 x 4 / 2, per token
    assert full[0] - short[0] == pytest.approx(32 * (4 * 896 * 2 / 2 * 2 + 64 * 2 * 2 + 2 * 256 * 4 / 2))
    assert s.memory_estimate(m, seq_len=32) == short and s.memory_estimate(m) == full
    other = Strategy.load({"pipelines": [pl(1, 2, st([0], [0, 3]))]})
    assert other.memory_estimate(m) == memory_estimate(other, m) != full
    dm = s.device_memory(m, Cluster.local(2), seq_len=32)
    assert {r: d.tensors for r, d in dm.items()} == short and dm[0].runtime > 0
    assert s.device_memory(m) == device_memory(s, m) and s.device_memory(m)[0].kind == ""
    seven = other.device_memory(m, device="cuda", gpu_reserve_mb=7)
    assert seven == device_memory(other, m, device="cuda", gpu_reserve_mb=7) and seven[0].runtime == 7 * 2 ** 20


# ---- context-free and context checks: the rest of their messages ----------------------------------------------
def test_stage_checks_at_their_bounds() -> None:
    """The largest rank is accepted; uneven ratios with cp > 1, and a ratio below 1, are refused with their text."""
    from hspmd_sdk.core.annotation import MAX_RANK
    assert Stage(devices=[MAX_RANK], layers=[0, 0]).devices == [MAX_RANK]
    assert problems({"pipelines": [pl(1, 1, st([0, 1], [0, 3], cp=2, ratios=[3, 1]))]}) == [
        ("pipelines[0].stages[0].ratios", "uneven TP ratios [3, 1] with cp=2 are not supported yet; use cp=1 or "
                                          "even ratios")]
    assert Strategy.load({"pipelines": [pl(1, 1, st([0, 1], [0, 3], cp=2, ratios=[2, 2]))]}).name == "cp2"
    assert problems({"pipelines": [pl(1, 1, st([0, 1], [0, 3], ratios=[2, 0]))]}) == [
        ("pipelines[0].stages[0].ratios", "0 in [2, 0] is not a positive integer; every TP rank holds a share of "
                                          "at least 1")]


def test_first_stage_must_start_at_layer_zero() -> None:
    """The contiguity message of the first stage."""
    assert problems({"pipelines": [pl(1, 1, st([0], [1, 3]))]}) == [
        ("pipelines[0].stages[0].layers", "starts at layer 1 but the first stage must start at layer 0 (stages hold "
                                          "contiguous layer ranges in order)")]


def test_model_check_goes_on_after_an_uneven_stage() -> None:
    """An uneven stage that fits does not end the check: the even TP-2 stage after it is checked too."""
    odd = LlamaConfig(**{**LlamaConfig.preset("tiny").model_dump(), "vocab_size": 251})
    assert problems({"pipelines": [pl(1, 1, st([0, 1], [0, 1], ratios=[3, 1]), st([2, 3], [2, 3]))]}, model=odd) == [
        ("pipelines[0].stages[1].devices", "TP degree 2 does not divide vocab_size=251")]


def test_cluster_check_names_several_outside_ranks_at_once() -> None:
    """Ranks outside the cluster: one line a stage, plural when several."""
    assert problems({"pipelines": [pl(1, 1, st([0, 5, 6], [0, 3]))]}, cluster=Cluster.local(2)) == [
        ("pipelines[0].stages[0].devices", "ranks 5,6 are not in the cluster (2 ranks: 0..1)")]


def test_summary_kinds_of_a_mixed_stage() -> None:
    """A stage over two device kinds lists both, comma separated."""
    s = Strategy.load({"pipelines": [pl(1, 1, st([0, 1], [0, 3]))]})
    assert "[1xcpu, 1xH20]" in s.summary(None, Cluster.mixed({"cpu": 1, "H20": 1}, per_node=1))


# ---- ZeRO levels: the level checks, ZeRO-3's refusals, zero_shares, model_copy ----------------------------------
def _share_pipes() -> list[dict[str, Any]]:
    """Two DP replicas of 4 layers, the first with ZeRO share 3 (the second counts 1)."""
    return [pl(1, 2, st([0], [0, 3]), zero_share=3), pl(1, 2, st([1], [0, 3]))]


def test_a_zero_share_needs_zero_and_even_tp() -> None:
    """A zero_share without ZeRO, and one beside an uneven TP stage (of any pipeline), are refused with their text;
    with ZeRO (zero1 alone, or a level) and even stages it loads."""
    assert problems({"pipelines": _share_pipes()}) == [
        ("pipelines[0].zero_share", "a share of the sharded state needs ZeRO (zero >= 1; it is 0)")]
    assert problems({"pipelines": [pl(1, 2, st([0], [0, 3])), pl(1, 2, st([1], [0, 3]), zero_share=2)]}) == [
        ("pipelines[1].zero_share", "a share of the sharded state needs ZeRO (zero >= 1; it is 0)")]
    uneven = [_share_pipes()[0], pl(1, 2, st([1, 2], [0, 3], ratios=[3, 1]))]
    for level in ({"zero1": True}, {"zero": 2}):
        assert problems({"pipelines": uneven, **level}) == [
            ("pipelines[0].zero_share", "uneven ZeRO shares beside uneven TP ratios are not supported yet (their "
                                        "ZeRO split stays even): leave zero_share out")]
    for level, zero in (({"zero1": True}, 1), ({"zero": 1}, 1), ({"zero": 2}, 2), ({"zero": 3}, 3)):
        s = Strategy.load({"pipelines": _share_pipes(), **level})
        assert (s.zero, s.zero1, s.pipelines[0].zero_share, s.pipelines[1].zero_share) == (zero, True, 3.0, None)
    # uneven TP without any share: no share problem
    assert Strategy.load({"pipelines": [pl(1, 2, st([0, 1], [0, 3], ratios=[3, 1]))], "zero": 2}).zero == 2


def test_zero_shares_is_none_without_any_and_one_where_not_given() -> None:
    """zero_shares(): None when no pipeline gives a share (even), else one a pipeline, 1.0 where not given."""
    assert load(pl(1, 1, st([0], [0, 3])), pl(1, 1, st([1], [0, 3])), zero1=True).zero_shares() is None
    assert load(pl(1, 1, st([0], [0, 3])), zero=2).zero_shares() is None
    assert Strategy.load({"pipelines": _share_pipes(), "zero": 1}).zero_shares() == [3.0, 1.0]
    three = load(pl(1, 1, st([0], [0, 3])), pl(1, 1, st([1], [0, 3]), zero_share=0.5),
                 pl(1, 1, st([2], [0, 3]), zero_share=2), zero=2)
    assert three.zero_shares() == [1.0, 0.5, 2.0]
    assert all(type(x) is float for x in three.zero_shares())


def test_summary_shows_a_pipeline_s_zero_share() -> None:
    """The pipeline line of summary() ends with its ZeRO share when it gives one, and only then."""
    lines = Strategy.load({"pipelines": _share_pipes(), "zero": 2}).summary().split("\n")
    assert lines[0] == ("Strategy 'dp2-zero2': 2 pipelines, 2 ranks, schedule 1f1b, ZeRO-2 on, global batch 4")
    assert lines[1] == "  pipeline 0: 2 micro-batches x bs1 (2 samples), 1 stage, ZeRO share 3"
    assert lines[3] == "  pipeline 1: 2 micro-batches x bs1 (2 samples), 1 stage"
    half = load(pl(1, 2, st([0], [0, 3]), zero_share=0.25), pl(1, 2, st([1], [0, 3])), zero1=True)
    assert half.summary().split("\n")[1] == "  pipeline 0: 2 micro-batches x bs1 (2 samples), 1 stage, ZeRO share 0.25"


def _zero3_recompute(i: int, first: str, got: str) -> str:
    return ("activation recomputation under ZeRO-3 (zero: 3) gathers a stage's parameters again inside its backward, "
            "so every pipeline must split the layers into the same stages and recompute the same ones (pipelines[0]: "
            f"{first}, pipelines[{i}]: {got}); recompute alike in every pipeline, leave recompute out or use zero: 2")


def _zero3_count(i: int, first: int, got: int) -> str:
    return (f"under 1F1B, ZeRO-3 (zero: 3) needs every pipeline to run as many micro-batches, so that the replicas "
            f"of a layer gather its parameters in the same order: pipelines[0] runs {first}, pipelines[{i}] {got}; "
            "use schedule: gpipe (a replica running fewer joins the others' gathers after its own) or give the "
            "pipelines different micro_batch_size")


def _zero3_split(i: int, first: str, got: str) -> str:
    return (f"under 1F1B, ZeRO-3 (zero: 3) needs every pipeline to split the layers into the same stages "
            f"(pipelines[0]: {first}, pipelines[{i}]: {got}), so that the replicas of a layer run its forwards and "
            "backwards in the same order; use schedule: gpipe for pipelines of different shapes")


def test_zero3_recomputes_only_alike_in_every_pipeline_under_either_schedule() -> None:
    """A recomputing stage under ZeRO-3 needs every pipeline to split the layers into the same stages and recompute
    the same ones: the first pipeline that differs is named, at its first recomputing stage (else its first), with
    both pipelines' forms, under 1F1B and GPipe; at ZeRO-2 the same strategy loads; alike pipelines load, and so
    does a single recomputing pipeline."""
    pipes = [pl(1, 2, st([0], [0, 1]), st([1], [2, 3])), pl(1, 2, st([2], [0, 1]), st([3], [2, 3], recompute=True))]
    for schedule in ("1f1b", "gpipe"):
        assert problems({"pipelines": pipes, "zero": 3, "schedule": schedule}) == [
            ("pipelines[1].stages[1].recompute", _zero3_recompute(1, "[[0, 1], [2, 3]]",
                                                                  "[[0, 1], [2, 3, 'recompute']]"))]
        assert Strategy.load({"pipelines": pipes, "zero": 2, "schedule": schedule}).zero == 2
    first = [pl(1, 2, st([0], [0, 1], recompute=True), st([1], [2, 3])), pl(1, 2, st([2], [0, 1]), st([3], [2, 3])),
             pl(1, 2, st([4], [0, 1], recompute=True), st([5], [2, 3]))]
    assert problems({"pipelines": first, "zero": 3}) == [
        ("pipelines[1].stages[0].recompute", _zero3_recompute(1, "[[0, 1, 'recompute'], [2, 3]]", "[[0, 1], [2, 3]]"))]
    shapes = [pl(1, 2, st([0], [0, 1], recompute=True), st([1], [2, 3], recompute=True)),
              pl(1, 2, st([2], [0, 3], recompute=True))]
    assert problems({"pipelines": shapes, "zero": 3, "schedule": "gpipe"}) == [
        ("pipelines[1].stages[0].recompute", _zero3_recompute(1, "[[0, 1, 'recompute'], [2, 3, 'recompute']]",
                                                              "[[0, 3, 'recompute']]"))]
    alike = [pl(1, 2, st([r], [0, 1], recompute=True), st([r + 1], [2, 3])) for r in (0, 2)]
    assert all(Strategy.load({"pipelines": ps, "zero": 3}).zero == 3
               for ps in (alike, [pl(1, 2, st([0], [0, 3], recompute=True))]))


def test_zero3_under_1f1b_needs_as_many_micro_batches() -> None:
    """Under 1F1B every pipeline must run pipelines[0]'s micro-batch count: the first that does not is named,
    with both counts (the second of two, the third of three)."""
    assert problems({"pipelines": [pl(1, 3, st([0], [0, 3])), pl(1, 1, st([1], [0, 3]))], "zero": 3}) == [
        ("pipelines[1].num_micro_batches", _zero3_count(1, 3, 1))]
    assert problems({"pipelines": [pl(2, 2, st([0], [0, 3])), pl(1, 2, st([1], [0, 3])), pl(1, 5, st([2], [0, 3]))],
                     "zero": 3}) == [("pipelines[2].num_micro_batches", _zero3_count(2, 2, 5))]


def test_zero3_under_1f1b_needs_the_same_stages() -> None:
    """Under 1F1B every pipeline must split the layers as pipelines[0] does: the first that does not is named,
    with both splits."""
    two = [pl(1, 2, st([0], [0, 1]), st([1], [2, 3])), pl(1, 2, st([2], [0, 3]))]
    assert problems({"pipelines": two, "zero": 3}) == [
        ("pipelines[1].stages", _zero3_split(1, "[[0, 1], [2, 3]]", "[[0, 3]]"))]
    three = [pl(1, 2, st([0], [0, 1]), st([1], [2, 3])), pl(1, 2, st([2], [0, 1]), st([3], [2, 3])),
             pl(1, 2, st([4], [0, 2]), st([5], [3, 3]))]
    assert problems({"pipelines": three, "zero": 3}) == [
        ("pipelines[2].stages", _zero3_split(2, "[[0, 1], [2, 3]]", "[[0, 2], [3, 3]]"))]


def test_zero3_accepts_what_gathers_in_order() -> None:
    """ZeRO-3 loads: 1F1B pipelines of one shape and count (any micro-batch sizes, TP degrees and shares); GPipe
    pipelines of different shapes and counts; one pipeline.  The same refused strategies load at ZeRO-2."""
    same = [pl(1, 2, st([0], [0, 1]), st([1], [2, 3])), pl(2, 2, st([2, 3], [0, 1]), st([4], [2, 3])),
            pl(1, 2, st([5], [0, 1]), st([6], [2, 3]))]
    assert Strategy.load({"pipelines": same, "zero": 3}).zero == 3
    assert Strategy.load({"pipelines": _share_pipes(), "zero": 3}).zero_shares() == [3.0, 1.0]
    assert Strategy.load({"pipelines": [pl(1, 4, st([0], [0, 3]))], "zero": 3}).name == "single-device"
    shapes = [pl(1, 3, st([0], [0, 1]), st([1], [2, 3])), pl(1, 1, st([2], [0, 3])),
              pl(1, 2, st([3], [0, 2]), st([4], [3, 3]))]
    for pipes in (shapes, [pl(1, 3, st([0], [0, 3])), pl(1, 1, st([1], [0, 3]))],
                  [pl(1, 2, st([0], [0, 1]), st([1], [2, 3])), pl(1, 2, st([2], [0, 3]))]):
        assert Strategy.load({"pipelines": pipes, "zero": 3, "schedule": "gpipe"}).zero == 3
        assert Strategy.load({"pipelines": pipes, "zero": 2}).zero == 2
    assert Strategy.load({"pipelines": shapes, "zero": 3, "schedule": "gpipe"})._zero3_problem() is None


def test_model_copy_without_a_level_change_is_pydantic_s_plain_copy() -> None:
    """No update, or one that leaves zero and zero1 alone: pydantic's copy, shallow by default (the copy shares the
    pipelines list) and deep with deep=True, not validated (a wrong field is taken as given)."""
    s = Strategy.load({"pipelines": _share_pipes(), "zero": 2})
    for c in (s.model_copy(), s.model_copy(update=None), s.model_copy(update={}), s.model_copy(deep=False)):
        assert c == s and c is not s and c.pipelines is s.pipelines
    for c in (s.model_copy(deep=True), s.model_copy(update={}, deep=True), s.model_copy(update=None, deep=True)):
        assert c == s and c.pipelines is not s.pipelines and c.pipelines[0] is not s.pipelines[0]
    deep = s.model_copy(update={"name": "x"}, deep=True)
    assert (deep.name, deep.zero, deep.zero1) == ("x", 2, True) and deep.pipelines is not s.pipelines
    named = s.model_copy(update={"name": "y", "schedule": "gpipe"})
    assert (named.name, named.schedule, named.zero, named.zero1) == ("y", "gpipe", 2, True)
    assert named.pipelines is s.pipelines
    raw = s.model_copy(update={"schedule": "nonsense"})  # not validated
    assert raw.schedule == "nonsense"


def test_model_copy_changing_the_level_is_validated() -> None:
    """An update of zero or zero1 gives a validated copy of every other field (name, schedule, pipelines, shares),
    the field given winning over the other: zero1=False turns sharding off (and then a share is refused),
    zero1=True is zero=1, a level sets zero1; a bad level is refused."""
    two = Strategy.load({"pipelines": [pl(1, 2, st([0], [0, 3])), pl(1, 2, st([1], [0, 3]))], "zero": 2,
                         "schedule": "gpipe", "name": "mine"})
    for update, level in (({"zero1": False}, (0, False)), ({"zero1": True}, (1, True)), ({"zero": 3}, (3, True)),
                          ({"zero": 0}, (0, False)), ({"zero": 1, "zero1": True}, (1, True))):
        c = two.model_copy(update=update)
        assert type(c) is Strategy and (c.zero, c.zero1) == level, update
        assert (c.name, c.schedule, c.pipelines) == ("mine", "gpipe", two.pipelines), update
    off = Strategy.load({"pipelines": [pl(1, 2, st([0], [0, 3])), pl(1, 2, st([1], [0, 3]))]})
    for update, level in (({"zero": 2}, (2, True)), ({"zero1": True}, (1, True)), ({"zero": 1}, (1, True))):
        c = off.model_copy(update=update)
        assert (c.zero, c.zero1, c.name) == (*level, off.name), update
    shared = Strategy.load({"pipelines": _share_pipes(), "zero": 1})
    assert shared.model_copy(update={"zero": 2}).zero_shares() == [3.0, 1.0]
    with pytest.raises(ValueError, match=re.escape("pipelines[0].zero_share: a share of the sharded state needs "
                                                   "ZeRO (zero >= 1; it is 0)")):
        shared.model_copy(update={"zero1": False})
    with pytest.raises(ValueError, match=re.escape("zero1: False contradicts zero: 2 (zero1 means zero >= 1): give "
                                                   "one of them")):
        off.model_copy(update={"zero": 2, "zero1": False})
    recompute = Strategy.load({"pipelines": [pl(1, 2, st([0], [0, 3], recompute=True)), pl(1, 2, st([1], [0, 3]))],
                               "zero": 2})
    with pytest.raises(ValueError, match=re.escape("pipelines[1].stages[0].recompute: " + _zero3_recompute(
            1, "[[0, 3, 'recompute']]", "[[0, 3]]"))):
        recompute.model_copy(update={"zero": 3})
