"""What the cluster canvas is told to draw, against hand counts: stage-boundary arrows with their operators and
bytes per step, redundant traffic and the resolver's cheaper alternative, the busiest link, a tensor's DG Union and
shards; and the widget's message routing (each message calls the editor method a script would)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

from hspmd_sdk import Cluster  # noqa: E402
from hspmd_sdk.viz import PlanEditor  # noqa: E402
from hspmd_sdk.viz._canvas_view import canvas_view, cluster_view  # noqa: E402
from hspmd_sdk.viz._units import fmt_bytes  # noqa: E402

CL = Cluster.mixed({"H800": 4, "H20": 4}, per_node=4)  # node0: ranks 0-3 (H800), node1: ranks 4-7 (H20)
HIDDEN = 64  # the tiny model's hidden size
CROSS = {"pipelines": [  # two pipelines, each a TP2 stage on node1 feeding a TP2 stage on node0
    {"stages": [{"devices": [4, 5], "layers": [0, 1]}, {"devices": [0, 1], "layers": [2, 3]}],
     "micro_batch_size": 1, "num_micro_batches": 4},
    {"stages": [{"devices": [6, 7], "layers": [0, 1]}, {"devices": [2, 3], "layers": [2, 3]}],
     "micro_batch_size": 1, "num_micro_batches": 4}]}
ONE = {"pipelines": [{"stages": [{"devices": [4], "layers": [0, 1]}, {"devices": [0], "layers": [2, 3]}],
                      "micro_batch_size": 1, "num_micro_batches": 8}]}


def _editor(strategy, **kw) -> PlanEditor:
    return PlanEditor(CL, "tiny", strategy, global_batch=8, seq_len=16, background=False, **kw)


def _hidden_bytes(ed: PlanEditor, samples: int) -> int:
    """One copy of a pipeline's hidden state at the program's bindings (fp32), by hand."""
    return samples * ed.program.bindings["S"] * HIDDEN * 4


def test_boundary_arrows_carry_the_operators_and_bytes_per_step_counted_by_hand():
    ed = _editor(CROSS)
    copy = _hidden_bytes(ed, 4)  # each pipeline carries 4 of the 8 samples
    arrows = ed.comm.arrows
    assert [(a.pipeline, a.src_stage, a.dst_stage, a.reshard) for a in arrows] == [
        (0, 0, 1, "layers.2.in"), (1, 0, 1, "layers.2.in")]
    for a in arrows:
        # D2 -> D2 on other devices: SendRecv, each of the 2 TP ranks sends its full copy across the network
        assert a.kinds == ("SendRecv",)
        assert dict(a.forward) == {"intra": 0, "inter": 2 * copy}
        assert dict(a.backward) == {"intra": 0, "inter": 2 * copy}
        assert a.label() == f"SendRecv · {fmt_bytes(4 * copy)} inter per step"
    view = canvas_view(ed)
    assert [(x["p"], x["from"], x["to"], x["op"], x["cls"]) for x in view["comm"]["arrows"]] == [
        (0, 0, 1, "SendRecv", "inter"), (1, 0, 1, "SendRecv", "inter")]
    assert view["comm"]["state"] == "ready" and not view["comm"]["stale"]
    json.dumps(view)  # what the widget syncs must be JSON


def test_redundant_boundary_is_flagged_with_the_resolvers_cheaper_plan():
    ed = _editor(CROSS)
    copy = _hidden_bytes(ed, 4)
    for a in ed.comm.arrows:
        assert a.redundant and a.redundancy == pytest.approx(2.0)  # 2 copies where node0 needs one
        fix = a.fix
        assert fix is not None and fix.kinds == ("BSR", "AllGather")
        assert fix.inter == 2 * copy and fix.current_inter == 4 * copy  # whole Reshard, forward: half the bytes
        assert fix.intra > 0 and fix.seconds < fix.current_seconds
    [warn] = [p for p in ed.warnings if "redundant boundary traffic" in p.message]
    assert (warn.pipeline, warn.stage) == (0, 1) and "layers.2.in (pipeline 0, 1)" in warn.message
    assert "2× the bytes needed" in warn.message and "BSR → AllGather" in warn.message
    assert ed.is_valid  # a warning, not an error


def test_an_intra_node_boundary_is_not_redundant():
    ed = _editor({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 1]}, {"devices": [2, 3],
                                                                                    "layers": [2, 3]}],
                                 "micro_batch_size": 1, "num_micro_batches": 8}]})
    [a] = ed.comm.arrows
    assert dict(a.forward) == {"intra": 2 * _hidden_bytes(ed, 8), "inter": 0}
    assert not a.redundant and a.fix is None
    assert canvas_view(ed)["comm"]["arrows"][0]["cls"] == "intra"


def test_the_busiest_link_of_a_two_stage_pipeline_is_its_boundary():
    ed = _editor(ONE)
    b = ed.comm.busiest
    assert (b.src, b.dst) in {(4, 0), (0, 4)} and b.cls == "inter"
    assert b.nbytes == _hidden_bytes(ed, 8)  # one direction: activations forward or gradients backward
    link = CL.link(b.src, b.dst)
    assert b.seconds == pytest.approx(b.nbytes / link.bandwidth + link.latency)  # one message: one latency
    assert canvas_view(ed)["comm"]["busiest"]["src"] == b.src


def test_a_picked_tensor_shows_its_dg_union_and_each_devices_shard():
    ed = _editor(CROSS)
    ed.pick_tensor("layers.0.attn.wq")  # Megatron: column split inside each TP2 stage, replicated across pipelines
    t = canvas_view(ed)["tensor"]
    assert (t["hsize"], t["hdim"]) == (2, -1)
    assert [g["ranks"] for g in t["subgroups"]] == [[4, 5], [6, 7]]
    assert len({g["colour"] for g in t["subgroups"]}) == 2
    assert t["shards"]["4"]["box"] == [0.0, 1.0, 0.0, 0.5] and t["shards"]["5"]["box"] == [0.0, 1.0, 0.5, 1.0]
    assert t["shards"]["6"]["box"] == [0.0, 1.0, 0.0, 0.5]
    assert t["cuts_c"] == [0.0, 0.5, 1.0] and t["cuts_r"] == [0.0, 1.0]
    assert "0" not in t["shards"]  # rank 0 holds layer 2-3's weights, not layer 0's
    assert "each subgroup holds the whole tensor" in t["words"]
    assert set(t["terms"]) == {"HSize", "HDim", "DG Union", "DS"}  # the paper's terms, explained beside it
    assert "Heterogeneous Size" in t["terms"]["HSize"] and "Heterogeneous Dimension" in t["terms"]["HDim"]
    ed.pick_tensor("layers.2.in")  # a Reshard: its messages are drawn too
    act = canvas_view(ed)["tensor"]
    # a 3-D activation (batch, seq, hidden) split only along the batch between the pipelines: the grid draws dim 0
    # and says dims 1 and 2 are held whole (not "rows = dim 0, columns = dim 1" as if dim 2 did not exist)
    assert act["shape"] == [8, ed.program.bindings["S"], HIDDEN]
    assert (act["rows"], act["cols"]) == ([0], []) and "dims 1, 2 held whole" in act["grid"]
    assert act["shards"]["0"]["rects"] == [[0.0, 0.5, 0.0, 1.0]] and act["shards"]["2"]["rects"] == [[0.5, 1.0, 0.0, 1.0]]
    r = act["reshard"]
    assert r["kinds"] == ["SendRecv"] and len(r["messages"]) == 4
    assert {(s, d) for s, d, _, _ in r["messages"]} == {(4, 0), (5, 1), (6, 2), (7, 3)}


def test_cluster_view_and_units():
    ed = _editor(CROSS)
    c = cluster_view(ed)
    assert [n["ranks"] for n in c["nodes"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert c["nodes"][0]["mem_gib"] == 79.6 and c["nodes"][1]["nvlink_gbs"] == 900
    view = canvas_view(ed)
    text = json.dumps(view)
    assert "e+" not in text.replace("\\u", "")  # no raw floats like 4e+09 in anything shown
    tile = view["tiles"][0]
    # the capacity as everywhere else: 81559 MiB is 79.6 GiB (not rounded to "80 GiB")
    assert tile["mem_text"].endswith(f"/{81559 / 1024:.1f} GiB")
    assert c["nodes"][0]["sub"] == f"{81559 / 1024:.1f} GiB each · NVLink 400 GB/s"


def test_widget_messages_call_the_editor(tmp_path):
    ed = _editor(CROSS)
    ed.widget  # builds the canvas
    ui = ed._ui
    v0 = ui.canvas.view["version"]
    ui._on_msg(None, {"op": "select", "p": 0, "s": 1}, None)
    ui._on_msg(None, {"op": "toggle", "rank": 2}, None)  # Alt+click: rank 2 joins the selected stage, and leaves
    assert ed.draft.pipelines[0].stages[1].devices == [0, 1, 2]
    ui._on_msg(None, {"op": "toggle", "rank": 2}, None)
    assert ed.draft.pipelines[0].stages[1].devices == [0, 1]
    ui._on_msg(None, {"op": "add_pipeline"}, None)  # a click on "+ pipeline"
    assert len(ed.draft.pipelines) == 3 and ed.selected == (2, 0)
    ui._on_msg(None, {"op": "undo"}, None)
    ui._on_msg(None, {"op": "move", "ranks": [2, 3], "p": 0, "s": 1}, None)  # drag onto pipeline 0 stage 1
    assert ed.draft.pipelines[0].stages[1].devices == [0, 1, 2, 3]
    assert ui.canvas.view["version"] > v0
    assert ui.canvas.view["pipelines"][1]["stages"][1]["ranks"] == []
    ui._on_msg(None, {"op": "undo"}, None)
    assert ed.draft.pipelines[0].stages[1].devices == [0, 1]
    ui._on_msg(None, {"op": "redo"}, None)
    ui._on_msg(None, {"op": "save", "path": str(tmp_path / "x.json")}, None)  # invalid draft: refused
    assert not (tmp_path / "x.json").exists() and "not saved" in ui.canvas.view["message"]
    ui._on_msg(None, {"op": "undo"}, None)
    ui._on_msg(None, {"op": "save", "path": str(tmp_path / "x.json")}, None)
    assert (tmp_path / "x.json").exists()
    for level in (3, 2, 0, 1):  # the toolbar's ZeRO select
        ui._on_msg(None, {"op": "zero", "level": level}, None)
        assert (ed.draft.zero if ed.draft.zero1 else 0, ui.canvas.view["zero"]) == (level, level)
    ui._on_msg(None, {"op": "no-such-op"}, None)
    assert "unknown action" in ed.message
    ui._on_msg(None, {"op": "comm", "reshard": "layers.2.in"}, None)
    assert len(ui.comm_out.outputs) == 2 and "application/vnd.plotly.v1+json" in ui.comm_out.outputs[0]["data"]
    assert ui.comm_note.value == ""
    ui._on_msg(None, {"op": "fix", "reshard": "layers.2.in"}, None)
    assert len(ui.comm_out.outputs) == 3  # the fix in words, then its two Reshards drawn
    ui._on_msg(None, {"op": "timeline"}, None)
    assert len(ui.timeline.outputs) == 1 and ui.timeline_note.value == ""
    ui._on_msg(None, {"op": "layers", "p": 0, "s": 0, "first": 0, "last": 0}, None)  # the Gantt is now stale
    assert ui.canvas.view["timeline_stale"] and "stale" in ui.timeline_note.value
    assert "stale" in ui.comm_note.value
    ui._on_msg(None, {"op": "tensor", "name": "lm_head"}, None)
    assert "did you mean" in ui.canvas.view["message"]
    groups = dict(ui.canvas.tensors)
    assert "layers.3.mlp.w2" in groups["layers.3"]


def test_the_shard_grid_draws_every_split_dim_of_a_3d_tensor():
    from hspmd_sdk.core.annotation import DS, Annotation
    from hspmd_sdk.viz._canvas_view import shard_grid

    # split along dim 2 inside subgroup 0, along dim 1 inside subgroup 1, and along dim 0 between them (HDim 0):
    # rows = dim 0; columns = the blocks of dims 1 x 2 in row-major order: (0,0) (0,1) (1,0) (1,1), a quarter each
    g = shard_grid(Annotation([[0, 1], [2, 3]], [DS("S2x2"), DS("S1x2")], hdim=0), (4, 6, 8))
    assert (g["rows"], g["cols"]) == ([0], [1, 2]) and "dims 1×2 (flattened)" in g["grid"]
    assert g["cuts_r"] == [0.0, 0.5, 1.0] and g["cuts_c"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    # by hand: rank 0 holds dim0 0:2, dim1 0:6, dim2 0:4 -> blocks (0,0) and (1,0): two separate column ranges
    assert g["shards"]["0"]["rects"] == [[0.0, 0.5, 0.0, 0.25], [0.0, 0.5, 0.5, 0.75]]
    assert g["shards"]["1"]["rects"] == [[0.0, 0.5, 0.25, 0.5], [0.0, 0.5, 0.75, 1.0]]
    # rank 2 holds dim0 2:4, dim1 0:3, dim2 0:8 -> blocks (0,0) and (0,1): one range
    assert g["shards"]["2"]["rects"] == [[0.5, 1.0, 0.0, 0.5]] and g["shards"]["3"]["rects"] == [[0.5, 1.0, 0.5, 1.0]]
    # only dim 2 split (HSize 1): drawn across, dims 0 and 1 named as whole
    g = shard_grid(Annotation([[0, 1]], [DS("S2x2")]), (4, 6, 8))
    assert (g["rows"], g["cols"]) == ([], [2]) and "dims 0, 1 held whole" in g["grid"]
    assert g["shards"]["1"]["rects"] == [[0.0, 1.0, 0.5, 1.0]]
    # a matrix stays a matrix: dim 0 down, dim 1 across
    g = shard_grid(Annotation([[0, 1]], [DS("S1x2")]), (4, 6))
    assert (g["rows"], g["cols"]) == ([0], [1]) and g["shards"]["0"]["rects"] == [[0.0, 1.0, 0.0, 0.5]]


def test_a_context_parallel_stage_is_shown_as_its_cp_x_tp_grid():
    """A stage of four devices with ``cp=2`` is two context-parallel groups of TP2, not a TP4 group: the canvas's
    stage row, each device's tooltip and the text summary say ``CP2×TP2``; a plain stage stays ``TP2``."""
    cp = {"pipelines": [{"stages": [{"devices": [4, 5, 6, 7], "layers": [0, 3], "cp": 2}],
                         "micro_batch_size": 4, "num_micro_batches": 2}]}
    ed = _editor(cp)
    view = canvas_view(ed)
    stage = view["pipelines"][0]["stages"][0]
    assert (stage["shape"], stage["cp"], stage["tp"]) == ("CP2×TP2", 2, 2)
    assert all("CP2×TP2" in t["title"] for t in view["tiles"] if t["r"] in (4, 5, 6, 7))
    assert "CP2×TP2" in ed.summary() and "TP4" not in ed.summary()
    assert ed.strategy.pipelines[0].stages[0].cp == 2  # the editor keeps the plan's CP (it dropped it before)
    plain = canvas_view(_editor(CROSS))["pipelines"][0]["stages"][0]
    assert (plain["shape"], plain["cp"], plain["tp"]) == ("TP2", 1, 2)


# ---- issues 26 and 28: each tile's share of an uneven stage, and its place in a CP x TP grid -------------------
def test_each_tile_carries_its_share_of_an_uneven_stage_and_the_picker_draws_the_uneven_shards():
    ed = _editor({"pipelines": [{"stages": [{"devices": [4, 5], "layers": [0, 1], "ratios": [3, 1]},
                                            {"devices": [0, 1], "layers": [2, 3]}],
                                 "micro_batch_size": 1, "num_micro_batches": 8}]})
    view = canvas_view(ed)
    tiles = {t["r"]: t for t in view["tiles"]}
    # by hand: 3:1 is 3/4 and 1/4; the even TP2 stage is 1/2 each, not marked uneven
    assert [(tiles[r]["share"], tiles[r]["share_pct"], tiles[r]["uneven"]) for r in (4, 5, 0, 1)] == [
        ("3/4", 75.0, True), ("1/4", 25.0, True), ("1/2", 50.0, False), ("1/2", 50.0, False)]
    assert "holds 3/4 (75%) of every TP-split tensor (ratios 3:1)" in tiles[4]["title"]
    assert "holds" not in tiles[0]["title"]
    assert tiles[2]["share"] == "" and tiles[2]["p"] == -1  # unused
    s0, s1 = view["pipelines"][0]["stages"]
    assert (s0["ratios"], s0["ratios_text"], s0["uneven"], s0["shares"]) == ([3, 1], "3:1", True, ["3/4", "1/4"])
    assert (s1["ratios"], s1["ratios_text"], s1["uneven"]) == (None, "", False)
    # the shares are the core's: Stage.share of the strategy the editor holds
    stage = ed.strategy.pipelines[0].stages[0]
    assert [tiles[r]["share_pct"] / 100 for r in (4, 5)] == [stage.share(4), stage.share(5)]
    # the figure's hover says it too
    hover = ed.figure().data[0].hovertext
    assert "holds 3/4 of every TP-split tensor (ratios 3:1)" in hover[4] and "holds" not in hover[0]
    # the picker: wq (64 x 64, columns split 3:1 over ranks 4 and 5) drawn as 48 and 16 columns
    ed.pick_tensor("layers.0.attn.wq")
    t = canvas_view(ed)["tensor"]
    assert "split along dim 1 in ratios 3:1" in t["words"]
    assert t["shards"]["4"]["rects"] == [[0.0, 1.0, 0.0, 0.75]] and t["shards"]["5"]["rects"] == [[0.0, 1.0, 0.75, 1.0]]
    assert t["cuts_c"] == [0.0, 0.75, 1.0] and "dim 1 0:48" in t["shards"]["4"]["text"]
    fig = ed.figure()  # the standalone figure of the picked tensor: the same boxes
    widths = sorted(round(s.x1 - s.x0, 6) for s in fig.layout.shapes if s.name and s.name.startswith("shard"))
    assert widths[1] == pytest.approx(3 * widths[0])


def test_each_tile_carries_its_cp_x_tp_coordinates_which_match_the_sequence_chunk_it_holds():
    from hspmd_sdk.core.annotation import local_view

    # devices in a shuffled order: the grid is by position in the stage (TP fastest), not by rank
    ed = _editor({"pipelines": [{"stages": [{"devices": [6, 4, 7, 5], "layers": [0, 3], "cp": 2}],
                                 "micro_batch_size": 1, "num_micro_batches": 8}]})
    view = canvas_view(ed)
    tiles = {t["r"]: t for t in view["tiles"]}
    want = {6: [0, 0], 4: [0, 1], 7: [1, 0], 5: [1, 1]}  # by hand: positions 0..3 -> (i // 2, i % 2)
    assert {r: tiles[r]["cp"] for r in want} == want
    assert {r: tiles[r]["grid"] for r in want} == {6: "cp0·tp0", 4: "cp0·tp1", 7: "cp1·tp0", 5: "cp1·tp1"}
    assert "CP group 1 of 2 (sequence chunk 1), TP rank 0 of 2" in tiles[7]["title"]
    assert all(not tiles[r]["uneven"] and tiles[r]["share"] == "1/2" for r in want)
    [stage] = view["pipelines"][0]["stages"]
    assert stage["cp_groups"] == [[6, 4], [7, 5]] == ed.strategy.pipelines[0].stages[0].tp_groups
    assert stage["cp_options"] == [1, 2, 4] and (stage["cp"], stage["tp"]) == (2, 2)
    # the CP coordinate is the sequence chunk the plan gives the device (its activations' dim 1)
    act, shape = ed.plan.annotations["layers.0.in"], ed.tensor_shape("layers.0.in")
    half = shape[1] // 2
    for r, (c, _) in want.items():
        assert local_view(act, shape, r).box[1] == (c * half, (c + 1) * half)
    assert "CP group 1 of 2, TP rank 0 (cp1·tp0)" in ed.figure().data[0].hovertext[7]
    plain = canvas_view(_editor(CROSS))  # no CP: coordinates kept, no grid label
    assert plain["tiles"][4]["cp"] == [0, 0] and plain["tiles"][5]["grid"] == ""


def test_the_ratios_and_cp_fields_call_the_editor():
    # one pipeline (a pipeline beside it would have to split the layers in the same ratios: the core says so)
    ed = _editor({"pipelines": [CROSS["pipelines"][0]]})
    ed.set_micro_batches(0, num_micro_batches=8)
    ed.widget
    ui = ed._ui
    ui._on_msg(None, {"op": "ratios", "p": 0, "s": 1, "value": "3:1"}, None)
    assert ed.draft.pipelines[0].stages[1].ratios == [3, 1] and ed.is_valid
    assert [t["share"] for t in ui.canvas.view["tiles"][:2]] == ["3/4", "1/4"]
    ui._on_msg(None, {"op": "ratios", "p": 0, "s": 1, "value": "3:x"}, None)
    assert "not whole numbers" in ui.canvas.view["message"] and ed.draft.pipelines[0].stages[1].ratios == [3, 1]
    ui._on_msg(None, {"op": "ratios", "p": 0, "s": 1, "value": ""}, None)  # cleared: even
    assert ed.draft.pipelines[0].stages[1].ratios is None and ui.canvas.view["tiles"][0]["uneven"] is False
    ed.set_devices(0, 1, [0, 1, 2, 3])
    ui._on_msg(None, {"op": "cp", "p": 0, "s": 1, "value": 2}, None)
    assert ed.draft.pipelines[0].stages[1].cp == 2
    assert ui.canvas.view["pipelines"][0]["stages"][1]["shape"] == "CP2×TP2"
    assert [t["grid"] for t in ui.canvas.view["tiles"][:4]] == ["cp0·tp0", "cp0·tp1", "cp1·tp0", "cp1·tp1"]
    ui._on_msg(None, {"op": "cp", "p": 0, "s": 1, "value": 3}, None)  # an error, live, at the stage
    [stage] = [s for s in ui.canvas.view["pipelines"][0]["stages"] if s["s"] == 1]
    assert "cannot share 4 device(s)" in stage["problems"][0]["text"] and ui.canvas.view["can"]["save"] is False
    ui._on_msg(None, {"op": "cp", "p": 0, "s": 1, "value": 1.5}, None)
    assert "not a whole number" in ui.canvas.view["message"] and ed.draft.pipelines[0].stages[1].cp == 3
