"""A plan's execution settings are typed (SPEC §9): specialization and the runtime read ``plan.settings``, never
``plan.meta``; plans written before ``settings`` existed load with their meta's keys moved; bad settings are
refused naming the field."""
from __future__ import annotations

import json

import pytest

from hspmd_sdk import AnnotationPlan, Cluster, ExecutionSettings, LlamaConfig, Strategy, specialize
from hspmd_sdk.core.specialize import Program
from hspmd_sdk.core.strategy_plan import plan_from_strategy, strategy_of
from hspmd_sdk.errors import PlanValidationError, ShapeError, SpecializationError

MODEL = LlamaConfig.preset("tiny")
CLUSTER = Cluster.local(4)
PP2_DP2 = Strategy.load({"name": "pp2-dp2", "schedule": "gpipe", "zero1": True, "pipelines": [
    {"stages": [{"devices": [0], "layers": [0, 1], "recompute": True}, {"devices": [1], "layers": [2, 3]}],
     "micro_batch_size": 2, "num_micro_batches": 3},
    {"stages": [{"devices": [2], "layers": [0, 1]}, {"devices": [3], "layers": [2, 3]}],
     "micro_batch_size": 1, "num_micro_batches": 2},
]})


def _legacy(plan: AnnotationPlan) -> dict:
    """The JSON ``plan_from_strategy`` wrote before ``settings``: the settings' keys inside ``meta``."""
    data = json.loads(plan.to_json())
    data["meta"].update({k: v for k, v in data.pop("settings").items() if v is not None})
    return data


def test_plan_from_strategy_fills_the_settings_and_specialization_reads_them() -> None:
    plan = plan_from_strategy(MODEL, PP2_DP2, CLUSTER)
    s = plan.settings
    assert (s.schedule, s.zero1, s.micro_batch_size, s.num_micro_batches, s.recompute) == \
        ("gpipe", True, (2, 1), (3, 2), (0,))
    assert s.batch == 8 and Strategy.load(s.strategy) == PP2_DP2.named() and not s.is_candidate
    assert not {"schedule", "micro_batch_size", "num_micro_batches", "recompute", "strategy"} & set(plan.meta)
    prog = specialize(MODEL, plan, CLUSTER)
    assert prog.schedule_kind == "gpipe" and prog.micro_batches == (3, 2) and prog.micro_batch_sizes == (2, 1)
    assert prog.recompute == frozenset({0}) and prog.bindings["B"] == 8
    assert strategy_of(prog) == PP2_DP2.named()
    # the settings alone decide: the same annotations under other settings give another schedule
    other = plan.model_copy(update={"settings": s.model_copy(update={"schedule": "1f1b", "recompute": ()})})
    prog2 = specialize(MODEL, other, CLUSTER)
    assert prog2.schedule_kind == "1f1b" and prog2.recompute == frozenset()
    assert prog2.schedules[(0, 0)] != prog.schedules[(0, 0)]


def test_meta_is_free_form_and_read_by_nothing() -> None:
    plan = plan_from_strategy(MODEL, PP2_DP2, CLUSTER)
    noisy = plan.model_copy(update={"meta": {"schedule": "1f1b", "num_micro_batches": [9, 9], "recompute": [3],
                                             "strategy": "not a strategy", "note": "mine"}})
    assert AnnotationPlan.load(noisy.to_json()).settings == plan.settings  # a hand-made meta is not migrated
    a, b = specialize(MODEL, plan, CLUSTER), specialize(MODEL, noisy, CLUSTER)
    assert (b.schedule_kind, b.micro_batches, b.recompute) == (a.schedule_kind, a.micro_batches, a.recompute)
    assert strategy_of(b) == strategy_of(a)


def test_plans_written_before_settings_load_with_the_same_settings() -> None:
    plan = plan_from_strategy(MODEL, PP2_DP2, CLUSTER)
    old = _legacy(plan)
    assert "settings" not in old and old["meta"]["schedule"] == "gpipe"
    back = AnnotationPlan.load(old)
    assert back.settings == plan.settings and back.meta == plan.meta and back == plan
    assert specialize(MODEL, back, CLUSTER) == specialize(MODEL, plan, CLUSTER)
    # an old mixed-length candidate also carried "mixed_strategy", the same strategy again
    cand = plan.model_copy(update={"settings": plan.settings.model_copy(update={"max_seq_len": 64,
                                                                                "windows": (64, 32)})})
    old = _legacy(cand)
    old["meta"]["mixed_strategy"] = old["meta"]["strategy"]
    back = AnnotationPlan.load(old)
    assert back.settings.is_candidate and back.settings == cand.settings and "mixed_strategy" not in back.meta


def test_a_hand_written_plan_runs_with_default_settings_or_its_own() -> None:
    plan = plan_from_strategy(MODEL, Strategy.load({"pipelines": [{"stages": [
        {"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}], "micro_batch_size": 1,
        "num_micro_batches": 4}]}), Cluster.local(2))
    bare = dict(plan.annotations)  # a mapping of annotations: no settings at all
    prog = specialize(MODEL, bare, Cluster.local(2))
    assert (prog.schedule_kind, prog.micro_batches, prog.recompute) == ("1f1b", (1,), frozenset())
    own = AnnotationPlan(annotations=bare, settings=ExecutionSettings(schedule="gpipe", num_micro_batches=4,
                                                                      recompute=[1]))
    prog = specialize(MODEL, own, Cluster.local(2))
    assert (prog.schedule_kind, prog.micro_batches, prog.recompute) == ("gpipe", (4,), frozenset({1}))
    assert strategy_of(prog) is None


def test_bad_settings_are_refused_naming_the_field() -> None:
    plan = plan_from_strategy(MODEL, PP2_DP2, CLUSTER)
    data = json.loads(plan.to_json())
    for field, value, why in (("schedule", "zb", "gpipe"), ("num_micro_batches", [3, 0], "greater than"),
                              ("recompute", [-1], "greater than or equal"), ("speed", 2, "Extra inputs")):
        bad = {**data, "settings": {**data["settings"], field: value}}
        with pytest.raises(PlanValidationError) as info:
            AnnotationPlan.load(bad)
        assert any(p.startswith(f"settings.{field}") and why in r for p, r in info.value.problems), \
            info.value.problems
    with pytest.raises(SpecializationError, match=r"plan.settings.recompute names rank\(s\) \[7\]"):
        specialize(MODEL, plan.model_copy(update={"settings": plan.settings.model_copy(update={"recompute": (7,)})}),
                   CLUSTER)
    with pytest.raises(ShapeError, match="add up to 8 samples"):
        specialize(MODEL, plan, CLUSTER, bindings={"B": 6, "S": 16})


def test_program_json_carries_the_settings_and_programs_take_keywords() -> None:
    prog = specialize(MODEL, plan_from_strategy(MODEL, PP2_DP2, CLUSTER), CLUSTER)
    back = Program.from_json(prog.to_json())
    assert back == prog and back.plan.settings == prog.plan.settings
    with pytest.raises(TypeError):
        Program(prog.graph, prog.plan)  # type: ignore[misc]  # keyword arguments only


def test_the_plan_model_says_where_its_construction_from_a_strategy_went() -> None:
    """``AnnotationPlan.from_strategy`` is gone (the plan model imports nothing of the translation, issue 23): calling
    it names ``plan_from_strategy``."""
    with pytest.raises(AttributeError, match="plan_from_strategy"):
        AnnotationPlan.from_strategy(MODEL, PP2_DP2, CLUSTER)
