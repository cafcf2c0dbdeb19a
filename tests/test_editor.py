"""The plan editor driven from Python: edits give the expected Strategy; invalid edits are reported at the
stage they concern, block Save/Launch and keep the last valid plan; undo/redo; the pinned global batch; warnings
that cost; what the canvas is told to draw, checked against hand counts and the core's own objects."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

from hspmd_sdk import Cluster, LlamaConfig, Strategy  # noqa: E402
from hspmd_sdk.errors import HSPMDError  # noqa: E402
from hspmd_sdk.planner import CostModel  # noqa: E402
from hspmd_sdk.viz import PlanEditor, training_runtime  # noqa: E402
from hspmd_sdk.viz._canvas_view import canvas_view  # noqa: E402
from hspmd_sdk.viz._editor_view import comm_state  # noqa: E402

CL = Cluster.mixed({"H800": 4, "H20": 4}, per_node=4)


def _editor(**kw) -> PlanEditor:
    kw.setdefault("global_batch", 8)
    return PlanEditor(CL, "tiny", seq_len=16, background=False, **kw)


def _two_pipelines(ed: PlanEditor) -> None:
    ed.select_stage(0, 0)
    ed.click_device(4)
    ed.click_device(5)
    ed.set_micro_batches(0, num_micro_batches=4)
    assert ed.add_stage() == 1
    ed.click_device(0)
    assert ed.add_pipeline(num_micro_batches=4) == 1
    ed.select_devices([6, 7])
    ed.add_stage()
    ed.click_device(1)
    ed.set_layers(1, 0, 0, 2)
    ed.set_layers(1, 1, 3, 3)
    ed.set_zero1(True)


EXPECTED = {"pipelines": [
    {"stages": [{"devices": [4, 5], "layers": [0, 1]}, {"devices": [0], "layers": [2, 3]}],
     "micro_batch_size": 1, "num_micro_batches": 4},
    {"stages": [{"devices": [6, 7], "layers": [0, 2]}, {"devices": [1], "layers": [3, 3]}],
     "micro_batch_size": 1, "num_micro_batches": 4}], "schedule": "1f1b", "zero1": True}


def test_a_sequence_of_edits_builds_the_expected_strategy():
    ed = _editor()
    assert not ed.is_valid and not ed.strategy  # a falsy NoPlan that says so when displayed
    assert any(p.stage == 0 and "no devices" in p.message for p in ed.errors)
    _two_pipelines(ed)
    assert ed.is_valid, ed.summary()
    assert ed.strategy == Strategy.load(EXPECTED)
    assert ed.plan is not None and "layers.0.attn.wq" in ed.plan.annotations
    assert ed.program is not None and ed.sim is not None
    boundaries = dict(ed.boundary_reshards())
    assert set(boundaries) == {"layers.2.in", "layers.3.in"}
    assert all(kinds for kinds in boundaries.values())
    text = ed.summary()
    assert "✓ valid" in text and "layers.2.in" in text and "memory" in text


def test_invalid_edit_is_shown_at_its_stage_blocks_save_and_keeps_the_last_valid_plan(tmp_path):
    ed = _editor(strategy=EXPECTED)
    good = ed.strategy
    ed.select_stage(1, 0)
    ed.click_device(2)  # TP 3 does not divide the 4 heads of the tiny model
    assert not ed.is_valid
    [err] = ed.errors
    assert (err.pipeline, err.stage) == (1, 0)
    assert "TP degree 3 does not divide" in err.message
    assert ed.strategy == good
    text = ed.summary()
    assert "Traceback" not in text and "Save, Launch and Apply are blocked" in text
    assert "editor.strategy keeps the last valid plan" in text
    target = tmp_path / "s.json"
    with pytest.raises(HSPMDError, match="TP degree 3"):
        ed.save(target)
    assert not target.exists()  # nothing written: not the last valid plan either
    assert "not saved" in ed.message
    with pytest.raises(HSPMDError, match="cannot launch"):
        ed.launch(steps=1)
    view = canvas_view(ed)
    assert view["can"]["save"] is False and "TP degree 3" in view["can"]["save_why"]
    assert view["verdict"]["level"] == "error"
    [stage] = [s for p in view["pipelines"] for s in p["stages"] if (s["p"], s["s"]) == (1, 0)]
    assert stage["problems"][0]["level"] == "error" and "TP degree 3" in stage["problems"][0]["text"]
    assert {t["flag"] for t in view["tiles"] if t["r"] in (6, 7, 2)} == {"error"}


def test_out_of_memory_is_an_error_at_its_stage():
    # llama-7b, every layer on one H800 with TP1: ~6.7e9 parameters x 16 bytes do not fit 80 GiB
    ed = PlanEditor(CL, "llama-7b", {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 31]}],
                                                    "micro_batch_size": 1, "num_micro_batches": 2}]},
                    seq_len=512, background=False)
    [err] = ed.errors
    assert (err.pipeline, err.stage) == (0, 0) and err.level == "error"
    assert "out of memory: rank 0 needs" in err.message and "GiB of 79.6 GiB" in err.message
    assert not ed.is_valid and not ed.strategy
    assert "error" in ed.blocked("save")
    assert ed.summary().startswith("✗ 1 error(s): Save, Launch and Apply are blocked")


def test_hover_and_summary_describe_the_draft_shown_not_the_last_valid_plan():
    ed = _editor(strategy=EXPECTED)
    before = canvas_view(ed)["tiles"][0]["title"]
    assert "simulated" in before
    ed.select_stage(0, 1)
    ed.click_device(2)
    ed.click_device(3)  # stage (0, 1) is now ranks [0, 2, 3]: TP3 does not divide the heads
    assert not ed.is_valid
    want = Strategy.load(ed.draft.to_dict()).memory_estimate(LlamaConfig.preset("tiny"), 16)
    reserve = CostModel().memory_reserve_mb * 2**20  # the simulator's runtime reserve, added to compare
    tile = canvas_view(ed)["tiles"][0]
    assert "estimate: Strategy.device_memory, the device's runtime included" in tile["title"]
    assert f"needs ~{(want[0] + reserve) / 2**30:.1f} GiB" in tile["title"]  # the draft's, not the old sim's
    assert ed._memory[0] == pytest.approx(want[0] + reserve)
    assert "estimate, not simulated" in ed.summary()
    assert "ranks 0,2,3" in ed.summary()  # the draft's stage, not the last valid plan's [0]
    ed.set_layers(0, 1, 3, 3)  # layer 2 uncovered: the draft is not even a strategy, nothing is estimated
    tile = canvas_view(ed)["tiles"][0]
    assert "needs" not in tile["title"] and "mem" not in tile


def test_moving_devices_undo_and_redo():
    ed = _editor(strategy=EXPECTED)
    ed.select_stage(0, 1)
    ed.click_device(1)  # from pipeline 1 stage 1 -> pipeline 0 stage 1 (TP 2); pipeline 1 stage 1 is now empty
    d = ed.draft
    assert d.pipelines[0].stages[1].devices == [0, 1] and d.pipelines[1].stages[1].devices == []
    assert any((p.pipeline, p.stage) == (1, 1) and "no devices" in p.message for p in ed.errors)
    ed.move_devices([2], 1, 1)  # drag-and-drop rank 2 onto pipeline 1 stage 1
    assert ed.is_valid and ed.selected == (1, 1)
    assert ed.strategy.pipelines[1].stages[1].devices == [2]
    assert ed.undo() and ed.draft.pipelines[1].stages[1].devices == []
    assert ed.undo() and ed.draft.pipelines[1].stages[1].devices == [1]
    assert ed.is_valid and ed.strategy == Strategy.load(EXPECTED)
    assert ed.redo() and ed.redo() and ed.draft.pipelines[1].stages[1].devices == [2]
    assert not ed.redo() and "nothing to redo" in ed.message
    assert ed.undo()
    ed.set_recompute(0, 0, True)  # a new edit after an undo drops the redo history
    assert not ed.can_redo


def test_many_undos_and_redos_lose_nothing():
    ed = _editor(strategy=EXPECTED)
    states = [ed.draft]
    for k in range(40):
        ed.set_layers(0, 0, 0, 1 + k % 2)
        states.append(ed.draft)
    for k in range(40):
        assert ed.undo()
        assert ed.draft == states[-2 - k]
    assert ed.draft == states[0] and ed.strategy == Strategy.load(EXPECTED)
    for k in range(40):
        assert ed.redo()
    assert ed.draft == states[-1]


def test_drag_onto_a_new_stage_or_pipeline_and_unassign():
    ed = _editor(strategy=EXPECTED)
    ed.move_devices([2, 3], 0, 2)  # "+ stage" of pipeline 0: a new stage takes the second half of layers 2-3
    d = ed.draft
    assert [s.layers for s in d.pipelines[0].stages] == [[0, 1], [2, 2], [3, 3]]
    assert d.pipelines[0].stages[2].devices == [2, 3] and ed.selected == (0, 2)
    ed.undo()
    ed.move_devices([3, 2], 2, 0)  # "+ pipeline": a new pipeline with every layer
    d = ed.draft
    assert len(d.pipelines) == 3 and d.pipelines[2].stages[0].devices == [2, 3]
    assert d.pipelines[2].stages[0].layers == [0, 3]
    assert any("global batch is 8" in p.message for p in ed.errors)  # 4 + 4 + 1 samples: the batch is pinned
    ed.unassign_devices([2, 3])
    assert ed.draft.pipelines[2].stages[0].devices == []


def test_the_global_batch_is_pinned_unless_the_user_changes_it():
    ed = _editor(strategy=EXPECTED)
    ed.set_micro_batches(1, num_micro_batches=5)
    [err] = ed.errors
    assert err.pipeline is None and "global batch is 8" in err.message
    assert ed.global_batch == 8 and ed.batch_source == "given"
    ed.set_global_batch(9)
    assert ed.is_valid and ed.global_batch == 9 and ed.batch_source == "set by you"
    assert ed.undo() and ed.global_batch == 8 and not ed.is_valid
    fresh = PlanEditor(CL, "tiny", seq_len=16, background=False)  # no batch given: the first valid plan pins it
    fresh.load(EXPECTED)
    assert fresh.global_batch == 8 and fresh.batch_source == "the first valid plan"
    fresh.set_micro_batches(0, num_micro_batches=5)
    assert not fresh.is_valid and fresh.global_batch == 8


def test_a_tp_group_across_nodes_is_a_named_warning_with_its_cost():
    ed = _editor(strategy=EXPECTED)
    step = ed.sim.step_time
    ed.set_devices(0, 0, [3, 4])  # ranks 3 (node0) and 4 (node1)
    assert ed.is_valid  # a warning, not an error
    [warn] = [p for p in ed.warnings if "TP group across 2 nodes" in p.message]
    assert (warn.pipeline, warn.stage) == (0, 0) and "node0, node1" in warn.message
    head = ed.summary().splitlines()[0]
    assert head.startswith("⚠ valid") and "warning(s)" in head
    if ed.sim.step_time != step:
        assert "(was " in head
    view = canvas_view(ed)
    assert view["verdict"]["level"] == "warning"
    [stage] = [s for p in view["pipelines"] for s in p["stages"] if (s["p"], s["s"]) == (0, 0)]
    assert stage["nodes"] == 2


def test_remove_stage_merges_layers_and_remove_pipeline():
    ed = _editor(strategy=EXPECTED)
    ed.remove_stage(1, 1)
    assert ed.draft.pipelines[1].stages[0].layers == [0, 3]
    ed.remove_pipeline(1)
    ed.set_micro_batches(0, num_micro_batches=8)
    assert ed.is_valid and ed.strategy.dp_degree == 1


def test_bad_operations_give_a_message_not_an_exception():
    ed = _editor(strategy=EXPECTED)
    ed.select_stage(0, 1)
    ed.set_layers(0, 1, 3, 3)
    ed.set_layers(0, 0, 0, 2)
    ed.add_stage(0)  # the last stage holds one layer: cannot split it
    assert "only layer 3" in ed.message
    ed.set_layers(7, 0, 0, 1)
    assert "no pipeline 7" in ed.message
    with pytest.raises(IndexError):
        ed.click_device(99)


def test_an_unknown_tensor_name_says_which_names_are_close():
    ed = _editor(strategy=EXPECTED)
    ed.pick_tensor("layers.0.attn.wq")
    assert ed.tensor == "layers.0.attn.wq"
    ed.pick_tensor("lm_head")
    assert ed.tensor == "layers.0.attn.wq"  # unchanged
    assert "not in the annotation plan" in ed.message and "lm_head.weight" in ed.message
    ed.pick_tensor("layers.0.atn.wq")
    assert "layers.0.attn.wq" in ed.message
    groups = dict(ed.tensor_groups())
    assert "layers.0.attn.wq" in groups["layers.0"] and "lm_head.weight" in groups["other"]
    assert sum(len(v) for v in groups.values()) == len(ed.plan.annotations)
    assert list(groups)[:3] == ["layers.0", "layers.1", "layers.2"]


def test_save_load_round_trip(tmp_path):
    ed = _editor(strategy=EXPECTED)
    path = ed.save(tmp_path / "s.json")
    assert Strategy.load(path) == ed.strategy
    other = _editor()
    other.load(path)
    assert other.is_valid and other.strategy == ed.strategy
    assert other.undo() and not other.is_valid
    assert json.loads(ed.to_json())["zero1"] is True


def test_background_resolution_matches_inline():
    ed = PlanEditor(CL, "tiny", EXPECTED, seq_len=16, background=True)
    ed.select_stage(0, 1)
    ed.click_device(3)  # [0, 3]: TP 2
    assert ed.strategy.pipelines[0].stages[1].devices == [0, 3]  # waits for the background worker
    assert ed.program is not None
    inline = _editor(strategy=ed.strategy)
    assert ed.boundary_reshards() == inline.boundary_reshards()
    assert [a.label() for a in ed.comm.arrows] == [a.label() for a in inline.comm.arrows]
    assert ed.comm.busiest == inline.comm.busiest is not None  # delivered after the arrows, same result
    ed.close()


def test_training_runtime_is_refused_for_remote_hosts():
    ok, why = training_runtime(CL)
    assert not ok and "not this machine" in why  # Cluster.mixed hosts are node0, node1: never launched locally
    ed = _editor(strategy=EXPECTED)
    assert why in ed.blocked("launch") and canvas_view(ed)["can"]["launch"] is False
    local = PlanEditor(Cluster.local(2), "tiny", {"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 3]}],
                                                                "micro_batch_size": 1, "num_micro_batches": 2}]},
                       seq_len=16, background=False)
    assert local.blocked("launch") == ""


def test_figures_of_the_editor_read_the_program():
    ed = _editor(strategy=EXPECTED)
    fig = ed.figure("layers.0.attn.wq")
    assert any(t.name and t.name.startswith("subgroup 1") for t in fig.data)
    plan = ed.comm_plan("layers.2.in")
    assert plan is ed.program.comm_plans["layers.2.in"]  # the core's object, not a re-derivation
    assert "layers.2.in" in dict(ed.boundary_reshards())
    cf = ed.comm_figure("layers.2.in")
    n_msgs = sum(len(getattr(op, "messages", ())) for op in plan.ops)
    assert len([sh for sh in cf.layout.shapes if sh.name == "message"]) == n_msgs
    g = ed.gantt([0])
    assert {t.name for t in g.data} >= {"forward", "backward"}
    with pytest.raises(KeyError):
        ed.comm_plan("layers.99.in")


def test_a_resolution_error_is_shown_at_its_tensor_and_keeps_the_last_valid_plan(monkeypatch):
    import importlib

    from hspmd_sdk.errors import SpecializationError

    spec = importlib.import_module("hspmd_sdk.core.specialize")

    ed = _editor(strategy=EXPECTED)
    good = ed.strategy
    real = spec.specialize

    def failing(model, plan, cluster=None, **kw):
        if plan.meta["stages"][0][1] == [0, 3]:
            raise SpecializationError("tensor 'layers.2.in': cannot resolve this Reshard (test)")
        return real(model, plan, cluster, **kw)

    monkeypatch.setattr(spec, "specialize", failing)
    ed.select_stage(0, 1)
    ed.click_device(3)
    [err] = ed.errors
    assert err.tensor == "layers.2.in" and "cannot resolve" in err.message
    assert ed.strategy == good and not ed.is_valid
    assert "tensor layers.2.in" in ed.summary() and "Traceback" not in ed.summary()


# ---- issue 27, finding 5 ----------------------------------------------------------------------------------------
LLAMA7B_ONE_DEVICE = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 31], "recompute": True}],
                                     "micro_batch_size": 2, "num_micro_batches": 2}], "zero1": True}


def _simulated_fits(strategy: dict, model: str = "llama-7b") -> bool:
    """The simulator's verdict on a strategy (an editor showing it has no out-of-memory error)."""
    ed = PlanEditor(CL, model, strategy, seq_len=512, background=False)
    return not any("out of memory" in p.message for p in ed.errors) and ed.sim is not None


def test_the_out_of_memory_advice_names_only_changes_not_made_that_would_fit():
    ed = PlanEditor(CL, "llama-7b", LLAMA7B_ONE_DEVICE, seq_len=512, background=False)
    [err] = ed.errors
    assert err.message.startswith("out of memory: rank 0 needs")
    advice = err.message.split(";", 1)[1]
    assert "ZeRO-1 (" not in advice and "recompute on" not in advice  # both are on already: not suggested
    assert "recompute and ZeRO-1 are on already" in advice
    assert "micro-batch size 1" not in advice  # it would not fit alone: not offered as a fix
    assert _simulated_fits({**LLAMA7B_ONE_DEVICE, "pipelines": [{**LLAMA7B_ONE_DEVICE["pipelines"][0],
                                                                  "micro_batch_size": 1, "num_micro_batches": 4}]
                            }) is False
    assert "would fit: TP2" in advice and "2 stages of its layers (0–15, 16–31" in advice
    # what it says would fit does fit, in the simulator, with the estimate it quoted
    tp2 = {**LLAMA7B_ONE_DEVICE, "pipelines": [{**LLAMA7B_ONE_DEVICE["pipelines"][0], "stages": [
        {"devices": [0, 1], "layers": [0, 31], "recompute": True}]}]}
    two = {**LLAMA7B_ONE_DEVICE, "pipelines": [{**LLAMA7B_ONE_DEVICE["pipelines"][0], "stages": [
        {"devices": [0], "layers": [0, 15], "recompute": True}, {"devices": [1], "layers": [16, 31],
                                                                 "recompute": True}]}]}
    for fixed in (tp2, two):
        ok = PlanEditor(CL, "llama-7b", fixed, seq_len=512, background=False)
        assert ok.is_valid, ok.summary()
        quoted = float(advice.split("TP2" if fixed is tp2 else "2 stages")[1].split("(~")[1].split(" GiB")[0])
        assert max(ok.sim.peak_memory.values()) / 2**30 == pytest.approx(quoted, rel=0.05)
    # with neither on, and two pipelines, both are offered -- when they would fit
    plain = PlanEditor(CL, "tiny", EXPECTED, global_batch=8, seq_len=16, background=False)
    from hspmd_sdk.viz._checks import oom_advice

    s = Strategy.load({**EXPECTED, "zero1": False})
    need = s.memory_estimate(plain.model, 16)
    text = oom_advice(s, 0, 0, 4, need, need[4] - 1, plain.model, 16, CL)  # 1 byte short: anything fits
    assert "recompute on this stage" in text and "ZeRO-1" in text and "on already" not in text


def test_a_stage_out_of_memory_and_with_a_tp_error_lists_both():
    ed = PlanEditor(CL, "llama-32b", {"pipelines": [{"stages": [{"devices": [0, 1, 2], "layers": [0, 59]}],
                                                     "micro_batch_size": 1, "num_micro_batches": 2}]},
                    seq_len=512, background=False)
    at_stage = [p.message for p in ed.errors if (p.pipeline, p.stage) == (0, 0)]
    assert len(at_stage) == 2, at_stage
    assert any("TP degree 3 does not divide" in m for m in at_stage)
    [oom] = [m for m in at_stage if "out of memory" in m]
    # by hand: a third of the 32B model's training states (16 bytes a parameter) alone exceeds the H800's memory
    assert 16 * ed.model.param_count() / 3 > 79.6 * 2**30
    assert "(estimate" in oom and "rank 0 needs" in oom and "of 79.6 GiB" in oom
    view = canvas_view(ed)
    [stage] = view["pipelines"][0]["stages"]
    assert len(stage["problems"]) == 2


def test_a_fresh_editors_strategy_says_there_is_no_plan_yet():
    ed = _editor()
    s = ed.strategy
    assert not s and s is not None
    assert repr(s).startswith("no plan yet")
    assert "no devices yet" in repr(s) and "no devices yet" in s._repr_html_()
    _two_pipelines(ed)
    assert ed.strategy == Strategy.load(EXPECTED)


# ---- issues 26 and 28: a stage's uneven TP ratios (SPEC §12) and its context parallelism (SPEC §11) ------------
TP2 = {"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 3]}], "micro_batch_size": 1,
                      "num_micro_batches": 8}]}
FOUR = {"pipelines": [{"stages": [{"devices": [0, 1, 2, 3], "layers": [0, 3]}], "micro_batch_size": 1,
                       "num_micro_batches": 8}]}


def test_set_ratios_gives_the_stage_uneven_shares_in_the_strategy_and_the_plans_hdim_ratios():
    ed = _editor(strategy=TP2)
    ed.set_ratios(0, 0, [3, 1])
    assert ed.is_valid, ed.summary()
    assert ed.strategy.pipelines[0].stages[0].ratios == [3, 1]
    wq, wo = ed.plan.annotations["layers.0.attn.wq"], ed.plan.annotations["layers.0.attn.wo"]
    assert (wq.dg_union, wq.hdim, wq.hratios) == ([[0], [1]], 1, [3, 1])  # column split: 3:1 of dim 1
    assert (wo.hdim, wo.hratios) == (0, [3, 1])  # row split
    # by hand: the tiny model's wq is 64 x 64 (4 heads of 16); rank 0 holds 3 heads = 48 columns, rank 1 one
    assert [ed.program.local_shape("layers.0.attn.wq", r, ed.program.bindings) for r in (0, 1)] == [(64, 48),
                                                                                                   (64, 16)]
    assert "TP2 ratios 3:1" in ed.summary()
    ed.set_ratios(0, 0, "1:3")  # the stage card's text
    assert ed.strategy.pipelines[0].stages[0].ratios == [1, 3]
    assert ed.plan.annotations["layers.0.attn.wq"].hratios == [1, 3]
    ed.set_ratios(0, 0, [2, 2])  # all equal: the even split, no ratios kept
    assert ed.draft.pipelines[0].stages[0].ratios is None and ed.strategy.pipelines[0].stages[0].ratios is None
    assert ed.plan.annotations["layers.0.attn.wq"].hratios is None
    assert ed.program.local_shape("layers.0.attn.wq", 0, ed.program.bindings) == (64, 32)
    ed.set_ratios(0, 0, "3:1")
    ed.set_ratios(0, 0, "")  # cleared: even again
    assert ed.strategy == Strategy.load(TP2)
    assert ed.undo() and ed.strategy.pipelines[0].stages[0].ratios == [3, 1]  # undoable like any edit


@pytest.mark.parametrize("ratios, words", [
    ([3, 1, 1], "3 ratio(s) [3, 1, 1] for 2 device(s)"),  # not one per device
    ([3, 0], "0 in [3, 0] is not a positive integer"),
    ("-1:1", "-1 in [-1, 1] is not a positive integer"),
    ("2:1", "nearest feasible ratios: 3:1"),  # 2:1 cuts the 4 heads (and every size) into thirds
])
def test_invalid_ratios_are_an_error_at_the_stage_and_keep_the_draft_and_the_last_valid_plan(ratios, words):
    ed = _editor(strategy=TP2)
    ed.set_ratios(0, 0, [3, 1])
    good = ed.strategy
    ed.set_ratios(0, 0, ratios)
    assert not ed.is_valid
    [err] = ed.errors
    assert (err.pipeline, err.stage, err.tensor) == (0, 0, None) and words in err.message
    assert str(err).startswith("pipeline 0 · stage 0: ")  # the live message names the stage
    assert ed.strategy == good and ed.plan.annotations["layers.0.attn.wq"].hratios == [3, 1]
    assert ed.draft.pipelines[0].stages[0].ratios not in (None, [3, 1])  # the draft keeps what was typed
    view = canvas_view(ed)
    [stage] = view["pipelines"][0]["stages"]
    assert words in stage["problems"][0]["text"] and view["can"]["save"] is False
    assert {t["flag"] for t in view["tiles"] if t["r"] in (0, 1)} == {"error"}
    assert ed.undo() and ed.is_valid and ed.strategy == good


def test_ratios_text_that_is_not_whole_numbers_changes_nothing_and_says_why():
    ed = _editor(strategy=TP2)
    ed.set_ratios(0, 0, [3, 1])
    before, undos = ed.draft, len(ed._history)
    for bad in ("3:x", "1.5:1", "3/4", [1.5, 1], [True, 1], 3):
        ed.set_ratios(0, 0, bad)
        assert ed.message.startswith("pipeline 0 · stage 0: ratios ") and "not whole numbers" in ed.message
        assert ed.draft == before and len(ed._history) == undos and ed.is_valid
    ed.set_ratios(5, 0, [1, 1])
    assert "no pipeline 5" in ed.message


def test_set_cp_makes_a_cp_x_tp_grid_that_splits_the_sequence_over_the_cp_groups():
    ed = _editor(strategy=FOUR)
    seq = ed.tensor_shape("layers.0.in")[1]
    assert ed.plan.annotations["layers.0.in"].ds_union[0].states == {-1: 4}  # TP4: every rank the whole sequence
    ed.set_cp(0, 0, 2)
    assert ed.is_valid, ed.summary()
    assert ed.strategy.pipelines[0].stages[0].cp == 2 and "CP2×TP2" in ed.summary()
    act = ed.plan.annotations["layers.0.in"]
    assert act.ds_union[0].states == {1: 2, -1: 2}  # the sequence (dim 1) split in 2, duplicated over TP
    # by hand: devices [0, 1, 2, 3] in 2 CP groups of TP2, TP fastest: ranks 0, 1 hold the first half of the
    # sequence, ranks 2, 3 the second half
    from hspmd_sdk.core.annotation import local_view

    shape = ed.tensor_shape("layers.0.in")
    assert [local_view(act, shape, r).box[1] for r in range(4)] == [(0, seq // 2)] * 2 + [(seq // 2, seq)] * 2
    wq = ed.plan.annotations["layers.0.attn.wq"]
    assert [local_view(wq, (64, 64), r).box[1] for r in range(4)] == [(0, 32), (32, 64)] * 2  # TP2, CP copies
    ed.set_cp(0, 0, 4)
    assert ed.strategy.pipelines[0].stages[0].cp == 4
    assert ed.plan.annotations["layers.0.in"].ds_union[0].states == {1: 4}  # CP4: a quarter of the sequence each
    ed.set_cp(0, 0, 1)
    assert ed.strategy == Strategy.load(FOUR)


@pytest.mark.parametrize("cp, words", [
    (3, "3 context-parallel groups cannot share 4 device(s)"),
    (0, "cp must be at least 1"),
    (-2, "cp must be at least 1"),
])
def test_an_invalid_cp_is_an_error_at_the_stage_naming_the_values_it_can_take(cp, words):
    ed = _editor(strategy=FOUR)
    ed.set_cp(0, 0, 2)
    good = ed.strategy
    ed.set_cp(0, 0, cp)
    [err] = ed.errors
    assert (err.pipeline, err.stage) == (0, 0) and words in err.message
    assert err.message.endswith("its 4 devices can take cp 1, 2 or 4")
    assert str(err).startswith("pipeline 0 · stage 0: ")
    assert ed.strategy == good and ed.draft.pipelines[0].stages[0].cp == cp
    view = canvas_view(ed)  # drawn without the grid, not a crash
    [stage] = view["pipelines"][0]["stages"]
    assert stage["cp_groups"] is None and stage["tp"] is None and words in stage["problems"][0]["text"]
    assert all(t["grid"] == "" and t["cp"] is None for t in view["tiles"] if t["r"] < 4)
    json.dumps(view)
    ed.set_cp(0, 0, "two")
    assert "cp 'two' is not a whole number" in ed.message and ed.draft.pipelines[0].stages[0].cp == cp


def test_uneven_ratios_with_cp_are_refused_at_the_stage():
    ed = _editor(strategy=FOUR)
    ed.set_cp(0, 0, 2)
    ed.set_ratios(0, 0, [3, 1, 3, 1])
    [err] = ed.errors
    assert (err.pipeline, err.stage) == (0, 0) and "with cp=2 are not supported yet" in err.message
    ed.set_ratios(0, 0, [1, 1, 1, 1])  # even: fine with CP
    assert ed.is_valid and ed.strategy.pipelines[0].stages[0].cp == 2


def test_a_plan_seen_before_is_not_simulated_again_and_its_figures_are_the_simulators(monkeypatch):
    """Simulations are cached by what they depend on: a click out of a stage and back reuses the first one (the
    step time is still the simulator's own, called fresh); a new sequence length simulates again."""
    from hspmd_sdk.planner import simulator

    calls: list[int] = []
    real = simulator.simulate

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(simulator, "simulate", counting)
    ed = _editor(strategy=EXPECTED)
    ed.select_stage(0, 0)
    assert len(calls) == 1
    ed.click_device(5)  # out of [4, 5]: TP1, a new plan
    assert ed.is_valid and len(calls) == 2
    ed.click_device(5)  # back in: the first plan again
    assert ed.strategy == Strategy.load(EXPECTED) and len(calls) == 2
    assert ed.sim.step_time == real("tiny", Strategy.load(EXPECTED), CL, global_batch=8, seq_len=16).step_time
    ed.undo()  # TP1 again: cached too
    assert len(calls) == 2
    ed.seq_len = 32
    ed.click_device(5)  # TP1 at another sequence length: simulated anew
    assert len(calls) == 3
    assert ed.sim.step_time == real("tiny", ed.strategy, CL, global_batch=8, seq_len=32).step_time


def test_a_device_taken_out_and_put_back_gives_the_same_plan():
    """Alt+click out and back in restores the plan, TP rank order included (a device rejoins a stage in rank order
    when the stage is in rank order); a stage in an order of the user's keeps it, the device after the others."""
    ed = _editor()
    ed.select_stage(0, 0)
    for r in (0, 1, 2, 3):
        ed.click_device(r)
    first = ed.strategy
    for r in (1, 0, 0, 1):  # out, out, in, in
        ed.click_device(r)
    assert ed.strategy == first and ed.strategy.pipelines[0].stages[0].devices == [0, 1, 2, 3]
    ed.set_devices(0, 0, [3, 1, 2])
    ed.click_device(0)
    assert ed.draft.pipelines[0].stages[0].devices == [3, 1, 2, 0]


def test_an_edit_off_the_main_thread_redraws_once():
    """Recent kernels run widget messages on a subshell thread: an edit to a plan whose communication is cached
    still sends one redraw, not one from the cached resolution and another from the edit."""
    import threading

    ed = PlanEditor(CL, "tiny", EXPECTED, seq_len=16, background=True)
    ed.wait()
    ed.select_stage(0, 1)
    ed.click_device(5)  # out: a new plan, resolved on the background thread
    ed.wait()
    ed.click_device(5)  # back in: the first plan, its resolution cached
    ed.wait()
    redraws: list[str] = []
    ed._redraw = lambda: redraws.append(comm_state(ed))
    for _ in range(2):  # out and back in, both cached now
        t = threading.Thread(target=ed.click_device, args=(5,))
        t.start()
        t.join()
    assert redraws == ["ready", "ready"]
    ed.close()


def test_background_resolution_starts_after_the_redraw_and_stops_when_superseded():
    """The editor's redraw of an edit goes out before its communication is resolved on the background thread (the
    canvas says "resolving" meanwhile); a resolution superseded by a newer draft stops between its steps."""
    from hspmd_sdk.viz._resolver import Resolver

    ed = PlanEditor(CL, "tiny", EXPECTED, seq_len=16, background=True)
    ed.wait()
    states: list[tuple[str, bool]] = []
    ed._redraw = lambda: states.append((comm_state(ed), ed._resolver._pending is None
                                                          or ed._resolver._pending.done()))
    ed.select_stage(0, 1)
    ed.click_device(3)  # [0, 3]: a new plan
    assert states[-1] == ("resolving", True)  # drawn as "resolving" before any work was submitted
    assert ed.strategy.pipelines[0].stages[1].devices == [0, 3] and ed.program is not None
    assert comm_state(ed) == "ready"
    ed.close()

    r = Resolver(ed.model, CL, background=True)
    steps: list[str] = []
    wanted = [True, False]
    res = r._compute("k", Strategy.load(EXPECTED), wanted=lambda: steps.append("asked") or wanted.pop(0))
    assert res is None and steps == ["asked", "asked"]  # stopped after from_strategy + specialize
    start = r.request("k2", Strategy.load(EXPECTED), lambda res, later: steps.append("done"))
    assert start is not None and r.busy and r._pending is None  # nothing runs until the caller starts it
    r.cancel()
    start()  # superseded before it was started: it never runs
    assert not r.busy and r._pending is None
    r.close()
