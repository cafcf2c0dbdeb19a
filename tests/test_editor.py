"""The plan editor driven from Python: edits give the expected Strategy; invalid edits are reported at the
stage they concern and keep the last valid plan."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from hspmd_sdk import Cluster, Strategy  # noqa: E402
from hspmd_sdk.viz import PlanEditor, training_runtime  # noqa: E402

CL = Cluster.mixed({"H800": 4, "H20": 4}, per_node=4)


def _editor(**kw) -> PlanEditor:
    return PlanEditor(CL, "tiny", global_batch=8, seq_len=16, background=False, **kw)


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
    assert not ed.is_valid and ed.strategy is None
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


def test_invalid_edit_is_shown_at_its_stage_and_keeps_the_last_valid_plan():
    ed = _editor(strategy=EXPECTED)
    good = ed.strategy
    ed.select_stage(0, 0)
    ed.click_device(2)  # TP 3 does not divide the 4 heads of the tiny model
    assert not ed.is_valid
    [err] = ed.errors
    assert (err.pipeline, err.stage) == (0, 0)
    assert "TP degree 3 does not divide" in err.message
    assert ed.strategy == good
    assert "Traceback" not in ed.summary() and "keeping the last valid plan" in ed.summary()
    ed.set_layers(0, 1, 3, 3)  # now also a gap in the layers of pipeline 0
    msgs = {(p.pipeline, p.stage) for p in ed.errors}
    assert (0, 0) in msgs or (0, 1) in msgs
    assert ed.strategy == good


def test_moving_a_device_between_stages_and_undo():
    ed = _editor(strategy=EXPECTED)
    ed.select_stage(0, 1)
    ed.click_device(1)  # from pipeline 1 stage 1 -> pipeline 0 stage 1 (TP 2); pipeline 1 stage 1 is now empty
    d = ed.draft
    assert d.pipelines[0].stages[1].devices == [0, 1] and d.pipelines[1].stages[1].devices == []
    assert any((p.pipeline, p.stage) == (1, 1) and "no devices" in p.message for p in ed.errors)
    ed.select_stage(1, 1)
    ed.click_device(2)
    assert ed.is_valid
    assert ed.strategy.pipelines[1].stages[1].devices == [2]
    assert ed.undo() and ed.draft.pipelines[1].stages[1].devices == []
    assert ed.undo() and ed.draft.pipelines[1].stages[1].devices == [1]
    assert ed.is_valid and ed.strategy == Strategy.load(EXPECTED)


def test_global_batch_and_model_problems_are_reported():
    ed = _editor(strategy=EXPECTED)
    ed.set_micro_batches(1, num_micro_batches=3)
    [err] = ed.errors
    assert err.pipeline is None and "global batch is 8" in err.message
    ed.set_micro_batches(1, num_micro_batches=4)
    ed.set_layers(1, 1, 3, 4)
    assert any("model has 4 layers" in p.message for p in ed.errors)


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
    ed.pick_tensor("no.such.tensor")
    assert "not in the annotation plan" in ed.message
    with pytest.raises(IndexError):
        ed.click_device(99)


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
    ed.close()


def test_widgets_call_the_same_methods():
    ed = _editor(strategy=EXPECTED)
    ui_root = ed.widget
    ui = ed._ui
    assert "hspmd-plan-editor" in ui_root._dom_classes
    ed.select_stage(0, 1)
    ui._on_click(None, SimpleNamespace(point_inds=[1]), None)  # a tile click from the browser
    assert ed.draft.pipelines[0].stages[1].devices == [0, 1]
    assert list(ui.fig.data[0].marker.color)[1] == list(ui.fig.data[0].marker.color)[0]
    assert "no devices" in ui.summary.value
    ed.undo()
    assert "✓ valid" in ui.summary.value
    ed.pick_tensor("layers.0.attn.wq")
    assert len(ui.fig.layout.shapes) > len(ui._node_shapes) and "HSize 2" in ui.tensor_legend.value
    ok, why = training_runtime(CL)
    assert not ok and "not this machine" in why  # Cluster.mixed hosts are node0, node1: never launched locally
    assert ui.launch.disabled and why in ui.launch.tooltip
    local_ok, _ = training_runtime(Cluster.local(2))
    assert PlanEditor(Cluster.local(2), "tiny", background=False).widget is not None
    assert training_runtime(Cluster.local(2))[0] is local_ok


def test_figures_of_the_editor_read_the_program():
    ed = _editor(strategy=EXPECTED)
    fig = ed.figure("layers.0.attn.wq")
    assert any(t.name and t.name.startswith("subgroup 1") for t in fig.data)
    plan = ed.comm_plan("layers.2.in")
    assert plan is ed.program.comm_plans["layers.2.in"]  # the core's object, not a re-derivation
    assert "layers.2.in" in dict(ed.boundary_reshards())
    cf = ed.comm_figure("layers.2.in")
    n_msgs = sum(len(getattr(op, "messages", ())) for op in plan.ops)
    assert len([a for a in cf.layout.annotations if a.showarrow]) == n_msgs
    g = ed.gantt([0])
    assert {t.name for t in g.data} >= {"forward", "backward"}
    with pytest.raises(KeyError):
        ed.comm_plan("layers.99.in")
    ed.widget
    ed.pick_tensor("layers.2.in")
    assert "Reshard" in ed._ui.tensor_legend.value


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
