"""Kills for the mutants of hspmd_sdk/core/plan.py (issue 49): the plan's summary text, its context problems and
their messages, the legacy-``meta`` migration's exact conditions, and the settings' derived values."""
from __future__ import annotations

import json
import re

import pytest

from hspmd_sdk import Cluster
from hspmd_sdk.core.plan import AnnotationPlan, ExecutionSettings, agree_zero
from hspmd_sdk.errors import PlanValidationError

ANN = {"wte": "[0,1] S0x2 | [2] R", "layers.0.wq": "[0,3] S1x2 | [5,6] S1x2"}


def _plan(**kw) -> AnnotationPlan:
    return AnnotationPlan.load({"annotations": ANN, **kw})


# ---- ExecutionSettings ---------------------------------------------------------------------------------------
def test_batch_sums_micro_batch_size_times_count_per_pipeline() -> None:
    """batch = sum(mbs_i * nmb_i); an int count applies to every pipeline; mismatched lengths or no sizes: None."""
    assert ExecutionSettings(micro_batch_size=[2, 3], num_micro_batches=[4, 5]).batch == 2 * 4 + 3 * 5
    assert ExecutionSettings(micro_batch_size=[2, 3], num_micro_batches=4).batch == 20
    assert ExecutionSettings(micro_batch_size=[2, 3], num_micro_batches=[4]).batch is None
    assert ExecutionSettings(num_micro_batches=[4]).batch is None
    assert ExecutionSettings().batch is None


def test_micro_batches_per_pipeline() -> None:
    """An int count is every pipeline's; a tuple is indexed; a pipeline past its end gets 1."""
    assert ExecutionSettings(num_micro_batches=7).micro_batches(5) == 7
    s = ExecutionSettings(num_micro_batches=[4, 5])
    assert (s.micro_batches(0), s.micro_batches(1), s.micro_batches(2), s.micro_batches(9)) == (4, 5, 1, 1)
    assert ExecutionSettings().micro_batches(0) == 1


def test_is_candidate_needs_strategy_max_seq_len_and_windows() -> None:
    """Each of the three missing alone makes it no candidate."""
    full = dict(strategy={"a": 1}, max_seq_len=64, windows=[64])
    assert ExecutionSettings(**full).is_candidate
    for k in full:
        assert not ExecutionSettings(**{**full, k: None}).is_candidate, k


def test_settings_defaults() -> None:
    """The defaults a hand-written plan runs with."""
    s = ExecutionSettings()
    assert (s.schedule, s.micro_batch_size, s.num_micro_batches, s.recompute, s.zero1, s.zero1_replicated,
            s.strategy, s.max_seq_len, s.windows) == ("1f1b", None, 1, (), False, (), None, None, None)
    with pytest.raises(Exception):
        ExecutionSettings(bogus=1)  # extra="forbid"
    with pytest.raises(Exception):
        s.zero1 = True  # frozen


# ---- the legacy meta migration -------------------------------------------------------------------------------
def test_legacy_meta_moves_every_settings_key_and_drops_mixed_strategy() -> None:
    """A plan_from_strategy meta: each ExecutionSettings field in it moves to settings, mixed_strategy goes."""
    meta = {"source": "plan_from_strategy", "note": "n", "schedule": "gpipe", "micro_batch_size": [2],
            "num_micro_batches": [3], "recompute": [0], "zero1": True, "zero1_replicated": ["w"],
            "strategy": {"x": 1}, "max_seq_len": 8, "windows": [8], "mixed_strategy": {"x": 1}}
    p = _plan(meta=meta)
    assert p.meta == {"source": "plan_from_strategy", "note": "n"}
    assert p.settings == ExecutionSettings(schedule="gpipe", micro_batch_size=[2], num_micro_batches=[3],
                                           recompute=[0], zero1=True, zero1_replicated=["w"], strategy={"x": 1},
                                           max_seq_len=8, windows=[8])


def test_legacy_meta_needs_the_source_no_settings_and_some_key() -> None:
    """Not migrated: another source, no source, an explicit settings, or nothing to move (then mixed_strategy
    stays in meta too)."""
    assert _plan(meta={"source": "me", "schedule": "gpipe"}).meta == {"source": "me", "schedule": "gpipe"}
    assert _plan(meta={"schedule": "gpipe"}).settings.schedule == "1f1b"
    p = _plan(meta={"source": "plan_from_strategy", "schedule": "gpipe"}, settings={"zero1": True})
    assert p.meta == {"source": "plan_from_strategy", "schedule": "gpipe"}
    assert p.settings == ExecutionSettings(zero1=True)
    p = _plan(meta={"source": "plan_from_strategy", "mixed_strategy": 1})
    assert p.meta == {"source": "plan_from_strategy", "mixed_strategy": 1} and p.settings == ExecutionSettings()
    # the input dict is not changed in place
    data = {"annotations": ANN, "meta": {"source": "plan_from_strategy", "schedule": "gpipe"}}
    AnnotationPlan.load(data)
    assert data["meta"] == {"source": "plan_from_strategy", "schedule": "gpipe"} and "settings" not in data


def test_legacy_meta_ignores_non_dict_input_and_meta() -> None:
    """A plan object, JSON text and a non-dict meta pass through the validator untouched."""
    p = _plan(meta={"source": "plan_from_strategy", "schedule": "gpipe"})
    assert AnnotationPlan.load(p) == p
    assert AnnotationPlan.load(p.to_json()) == p
    assert AnnotationPlan._legacy_meta({"meta": [1]}) == {"meta": [1]}
    assert AnnotationPlan._legacy_meta("text") == "text"


# ---- load / json / errors ------------------------------------------------------------------------------------
def test_load_error_names_the_annotation_plan() -> None:
    """The error says which document was invalid."""
    with pytest.raises(PlanValidationError) as info:
        AnnotationPlan.load({"annotations": {"w": 3}})
    assert info.value.what == "annotation plan" and str(info.value).startswith("invalid annotation plan")


def test_to_json_indent() -> None:
    """indent=2 by default, compact with None."""
    p = _plan()
    assert p.to_json().startswith('{\n  "format_version": 1,\n  "annotations": {\n    "wte"')
    assert p.to_json(indent=None).startswith('{"format_version":1,"annotations":{"wte":')
    assert p.to_json(indent=4).startswith('{\n    "format_version": 1')
    assert json.loads(p.to_json()) == json.loads(p.to_json(indent=None))


def test_json_schema_is_the_models() -> None:
    """The schema lists the plan's fields."""
    s = AnnotationPlan.json_schema()
    assert s == AnnotationPlan.model_json_schema() and s["title"] == "AnnotationPlan"
    assert set(s["properties"]) == {"format_version", "annotations", "settings", "meta"}


def test_from_strategy_is_gone_with_a_pointer() -> None:
    """The message tells the user what to call instead."""
    with pytest.raises(AttributeError) as info:
        AnnotationPlan.from_strategy(1, k=2)
    assert str(info.value) == (
        "AnnotationPlan.from_strategy() is gone (the plan model imports nothing of the strategy -> plan "
        "translation): use `from hspmd_sdk.core.strategy_plan import plan_from_strategy` and "
        "`plan_from_strategy(model, strategy, cluster)`")


# ---- context checks ------------------------------------------------------------------------------------------
def test_problems_lists_each_out_of_cluster_rank_in_order() -> None:
    """One problem per rank >= num_ranks, with the field path of its DG and the cluster's range."""
    p = _plan()
    assert p.problems() == [] and p.problems(None) == []
    assert p.problems(Cluster.local(7)) == []
    assert p.problems(Cluster.local(6)) == [
        ("annotations.layers.0.wq.dg_union[1]", "rank 6 is not in the cluster (6 ranks: 0..5)")]
    assert p.problems(Cluster.local(3)) == [
        ("annotations.layers.0.wq.dg_union[0]", "rank 3 is not in the cluster (3 ranks: 0..2)"),
        ("annotations.layers.0.wq.dg_union[1]", "rank 5 is not in the cluster (3 ranks: 0..2)"),
        ("annotations.layers.0.wq.dg_union[1]", "rank 6 is not in the cluster (3 ranks: 0..2)")]


def test_check_raises_every_problem_or_returns_self() -> None:
    """check() returns the plan when it fits, else raises naming each problem."""
    p = _plan()
    assert p.check() is p and p.check(Cluster.local(7)) is p
    with pytest.raises(PlanValidationError) as info:
        p.check(Cluster.local(6))
    assert info.value.what == "annotation plan"
    assert str(info.value) == ("invalid annotation plan: annotations.layers.0.wq.dg_union[1]: "
                               "rank 6 is not in the cluster (6 ranks: 0..5)")


# ---- queries -------------------------------------------------------------------------------------------------
def test_ranks_and_getitem() -> None:
    """ranks: sorted, deduplicated; a missing tensor's KeyError says which and how many there are."""
    p = _plan()
    assert p.ranks == [0, 1, 2, 3, 5, 6]
    assert str(p["wte"]) == "[0,1] S0x2 | [2] R"
    with pytest.raises(KeyError) as info:
        p["nope"]
    assert info.value.args == ("no annotation for tensor 'nope' in this plan (2 tensors)",)
    assert info.value.__suppress_context__ and info.value.__cause__ is None


def test_summary_exact_text() -> None:
    """Header, one aligned line per tensor, the non-default settings (strategy left out), then meta."""
    p = _plan(meta={"note": "x", "k": 2}, settings={"schedule": "gpipe", "num_micro_batches": [2, 3],
                                                  "recompute": [1], "strategy": {"a": 1}})
    assert p.summary() == (
        "AnnotationPlan: 2 tensors on ranks 0-3,5,6\n"
        "  wte          HSize 2  [0,1] S0x2 | [2] R\n"
        "  layers.0.wq  HSize 2  [0,3] S1x2 | [5,6] S1x2\n"
        "  settings.schedule: gpipe\n"
        "  settings.num_micro_batches: (2, 3)\n"
        "  settings.recompute: (1,)\n"
        "  meta.note: x\n"
        "  meta.k: 2")
    assert p.summary(limit=1) == (
        "AnnotationPlan: 2 tensors on ranks 0-3,5,6\n"
        "  wte          HSize 2  [0,1] S0x2 | [2] R\n"
        "  ... 1 more\n"
        "  settings.schedule: gpipe\n"
        "  settings.num_micro_batches: (2, 3)\n"
        "  settings.recompute: (1,)\n"
        "  meta.note: x\n"
        "  meta.k: 2")
    assert p.summary(limit=2) == p.summary(limit=3) == p.summary()


def test_summary_default_limit_is_40_and_width_caps_at_48() -> None:
    """40 tensors shown by default; names are padded to the longest, at most 48 characters."""
    ann = {f"t{i:02d}": "[0] R" for i in range(42)}
    lines = AnnotationPlan.load({"annotations": ann}).summary().split("\n")
    assert lines[0] == "AnnotationPlan: 42 tensors on ranks 0" and len(lines) == 42
    assert lines[40] == "  t39  HSize 1  [0] R" and lines[41] == "  ... 2 more"
    long = "x" * 50
    lines = AnnotationPlan.load({"annotations": {long: "[0] R", "y": "[0] R"}}).summary().split("\n")
    assert lines[1] == f"  {long}  HSize 1  [0] R" and lines[2] == "  y" + " " * 47 + "  HSize 1  [0] R"
    assert AnnotationPlan.load({"annotations": {}}).summary() == "AnnotationPlan: 0 tensors on ranks "


# ---- agree_zero: the ZeRO level and its zero1 alias ----------------------------------------------------------------
_CONTRADICTS = "zero1: {} contradicts zero: {} (zero1 means zero >= 1): give one of them"


def test_agree_zero_passes_other_input_through_untouched() -> None:
    """Not a dict, or a dict naming neither field: the very same object back."""
    for data in ([("zero", 2)], "zero", None, 3, ExecutionSettings()):
        assert agree_zero(data) is data
    for data in ({}, {"schedule": "gpipe"}, {"Zero": 2, "ZERO1": True}):
        assert agree_zero(data) is data and data == dict(data)
    assert agree_zero({}) == {}


def test_agree_zero_with_zero1_alone_sets_the_level() -> None:
    """zero1 alone: True (the bool only) is level 1, anything else level 0; the input is not changed."""
    for flag, level in ((True, 1), (False, 0), (1, 0), (None, 0), ("yes", 0)):
        data = {"zero1": flag, "x": 1}
        assert agree_zero(data) == {"zero1": flag, "x": 1, "zero": level}, flag
        assert data == {"zero1": flag, "x": 1}


def test_agree_zero_with_the_level_alone_sets_zero1() -> None:
    """zero alone: zero1 is whether it is an int (not a bool) of at least 1; the level itself is kept."""
    for level, flag in ((0, False), (1, True), (2, True), (3, True), (-1, False), (True, False), (False, False),
                        ("2", False), (None, False), (1.0, False)):
        data = {"zero": level}
        got = agree_zero(data)
        assert got == {"zero": level, "zero1": flag} and type(got["zero1"]) is bool, level
        assert got["zero"] is level and data == {"zero": level}


def test_agree_zero_with_both_keeps_them_or_names_the_contradiction() -> None:
    """Both given: agreeing ones are kept as they are; an int level and a bool flag that disagree are refused,
    naming both; a bool level or an int flag is left to the field's own validation (no contradiction raised)."""
    for level, flag in ((0, False), (1, True), (2, True), (3, True), (True, False), (True, True), (2, 0), (0, 1),
                        (2, None), (None, True), ("2", False)):
        data = {"zero": level, "zero1": flag}
        got = agree_zero(data)
        assert got == data and got is not data and got["zero"] is level and got["zero1"] is flag, (level, flag)
    for level, flag in ((2, False), (1, False), (3, False), (0, True)):
        with pytest.raises(ValueError, match="^" + re.escape(_CONTRADICTS.format(flag, level)) + "$"):
            agree_zero({"zero": level, "zero1": flag})


def test_settings_read_the_level_through_agree_zero() -> None:
    """ExecutionSettings: zero1 alone is level 1, a level sets zero1, a contradiction and a bool level are refused."""
    assert (ExecutionSettings(zero1=True).zero, ExecutionSettings(zero=2).zero1) == (1, True)
    assert (ExecutionSettings(zero=0).zero1, ExecutionSettings().zero, ExecutionSettings().zero1) == (False, 0, False)
    with pytest.raises(ValueError, match=re.escape(_CONTRADICTS.format(True, 0))):
        ExecutionSettings(zero=0, zero1=True)
    with pytest.raises(ValueError):
        ExecutionSettings(zero=True)
