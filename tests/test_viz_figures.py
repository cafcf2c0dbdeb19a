"""Structure of the viz figures, checked against the SPEC's layout rules and the core's plans."""
from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from hspmd_sdk import Annotation, Cluster, LlamaConfig, Strategy  # noqa: E402
from hspmd_sdk.core.resolve import resolve  # noqa: E402
from hspmd_sdk.core.schedule import build_schedule  # noqa: E402
from hspmd_sdk.core.switch import plan_switch  # noqa: E402
from hspmd_sdk.planner import simulate  # noqa: E402
from hspmd_sdk.viz import (cluster_figure, comm_figure, gantt_figure, switch_heatmap, volume_table_figure,  # noqa: E402
                           volume_table_html)
from hspmd_sdk.viz._geometry import geometry  # noqa: E402
from hspmd_sdk.viz._style import LINK_COLOURS, UNUSED  # noqa: E402

CL = Cluster.mixed({"H800": 4, "H20": 4}, per_node=4)


def _tiles(fig):
    return fig.data[0]


def test_cluster_diagram_has_one_tile_per_device_and_one_box_per_node():
    fig = cluster_figure(CL)
    assert len(_tiles(fig).x) == CL.num_ranks
    boxes = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(boxes) == len(CL.nodes)
    texts = " ".join(a.text for a in fig.layout.annotations)
    assert "H800" in texts and "H20" in texts and "NVLink" in texts
    assert "inter-node" in fig.layout.title.text
    assert all(str(r) in fig.data[1].text[r] for r in range(CL.num_ranks))


def test_strategy_overlay_colours_stages_and_labels_layers():
    s = Strategy.load({"pipelines": [
        {"stages": [{"devices": [4, 5], "layers": [0, 1]}, {"devices": [0], "layers": [2, 3]}],
         "micro_batch_size": 1, "num_micro_batches": 4},
        {"stages": [{"devices": [6, 7], "layers": [0, 2]}, {"devices": [1], "layers": [3, 3]}],
         "micro_batch_size": 1, "num_micro_batches": 4}]})
    fig = cluster_figure(CL, s)
    fill = list(_tiles(fig).marker.color)
    assert fill[4] == fill[5] and fill[6] == fill[7]
    assert len({fill[4], fill[0], fill[6], fill[1]}) == 4  # every stage its own colour
    assert fill[2] == fill[3] == UNUSED
    assert "L0–1" in fig.data[1].text[4] and "L3–3" in fig.data[1].text[1]
    legend = [t.name for t in fig.data[2:]]
    assert len(legend) == 4 and any("L0–2" in n for n in legend)


def test_annotation_overlay_outlines_subgroups_and_draws_shards_where_local_view_says():
    ann = Annotation("[0,1] S0x2 | [4,5] S1x2 ; hdim=-1")
    fig = cluster_figure(CL, annotation=ann, shape=(4, 8), tensor="w")
    geom = geometry(CL)
    outlines = {s.name: [] for s in fig.layout.shapes if s.name and s.name.startswith("subgroup")}
    for s in fig.layout.shapes:
        if s.name and s.name.startswith("subgroup"):
            outlines[s.name].append(s.line.color)
    assert set(outlines) == {"subgroup0", "subgroup1"}
    assert len(set(outlines["subgroup0"])) == 1 and len(set(outlines["subgroup1"])) == 1
    assert outlines["subgroup0"][0] != outlines["subgroup1"][0]
    shards = [s for s in fig.layout.shapes if s.name and s.name.startswith("shard")]
    assert len(shards) == 4
    # rank 1 holds rows 2..4 of 4 (S0x2, position 1): the lower half of its tensor grid, all columns
    grid = [s for s in fig.layout.shapes if s.name == "tensor"]
    t1 = geom.tiles[1]
    g1 = next(g for g in grid if t1.x0 < g.x0 < t1.x1 and t1.y0 < g.y0 < t1.y1)
    s1 = next(s for s in shards if t1.x0 < s.x0 < t1.x1 and t1.y0 < s.y0 < t1.y1)
    assert s1.y0 == pytest.approx((g1.y0 + g1.y1) / 2) and s1.y1 == pytest.approx(g1.y1)
    assert s1.x0 == pytest.approx(g1.x0) and s1.x1 == pytest.approx(g1.x1)
    # rank 4 (subgroup 1, S1x2 position 0) holds columns 0..4 of 8: the left half, all rows
    t4 = geom.tiles[4]
    g4 = next(g for g in grid if t4.x0 < g.x0 < t4.x1 and t4.y0 < g.y0 < t4.y1)
    s4 = next(s for s in shards if t4.x0 < s.x0 < t4.x1 and t4.y0 < s.y0 < t4.y1)
    assert s4.x1 == pytest.approx((g4.x0 + g4.x1) / 2) and s4.y1 == pytest.approx(g4.y1)
    names = [t.name for t in fig.data[2:]]
    assert names == ["subgroup 0: [0,1] S0x2", "subgroup 1: [4,5] S1x2"]
    assert "HSize 2" in fig.data[2].legendgrouptitle.text


def test_partial_summands_are_labelled():
    ann = Annotation("[0,1] P2 | [4,5] P2 ; hdim=-2")
    fig = cluster_figure(CL, annotation=ann, shape=(4, 4))
    labels = sorted(s.label.text for s in fig.layout.shapes if s.name and s.name.startswith("shard"))
    assert labels == ["Σ0/4", "Σ1/4", "Σ2/4", "Σ3/4"]  # hdim=-2 numbers summands across subgroups


def test_duplicate_shards_are_marked():
    fig = cluster_figure(CL, annotation=Annotation("[0-3] D2 S0x2"), shape=(4, 4))
    grids = [s for s in fig.layout.shapes if s.name == "tensor"]
    assert len(grids) == 4 and all(g.label.text == "D2" for g in grids)
    plain = cluster_figure(CL, annotation=Annotation("[0-3] S0x4"), shape=(4, 4))
    assert not any(s.label.text for s in plain.layout.shapes if s.name == "tensor")


def test_bsr_arrows_one_per_message_coloured_by_link_class():
    src = Annotation("[0-3] S0x4")
    dst = Annotation("[2,3] S0x2 | [4,5] S0x2 ; hdim=0")
    plan = resolve(src, dst, (16, 8), cluster=CL)
    assert "BSR" in plan.kinds or "SendRecv" in plan.kinds
    msgs = [m for op in plan.ops for m in getattr(op, "messages", ()) if m.src != m.dst]
    fig = comm_figure(plan, CL)
    arrows = [sh for sh in fig.layout.shapes if sh.name == "message"]
    heads = [sh for sh in fig.layout.shapes if sh.name == "head"]
    assert len(arrows) == len(heads) == len(msgs) > 0
    geom = geometry(CL)
    for a, m in zip(arrows, msgs):
        cls = "inter" if CL.link(m.src, m.dst).cls == "inter" else "intra"
        assert a.line.color == LINK_COLOURS[cls]
        assert a.layer == "below"  # under the tiles: an arrow never covers a tile's label
        for r in range(CL.num_ranks):  # and its ends lie outside every tile
            t = geom.tiles[r]
            for x, y in ((a.x0, a.y0), (a.x1, a.y1)):
                assert not (t.x0 < x < t.x1 and t.y0 < y < t.y1), (r, x, y)
    assert {a.line.color for a in arrows} == set(LINK_COLOURS.values())  # both classes occur here
    hover = next(t for t in fig.data if t.name == "messages")
    assert len(hover.hovertext) == len(msgs) and hover.marker.opacity == 0


def test_collectives_drawn_as_rings_per_group():
    plan = resolve(Annotation("[0-3] S1x4"), Annotation("[0-3] D4"), (8, 8), cluster=CL)
    assert plan.kinds == ["AllGather"]
    fig = comm_figure(plan, CL)
    rings = fig.data[2:]
    assert len(rings) == 1 and "AllGather" in rings[0].name
    assert sum(1 for x in rings[0].x if x is None) == 1  # one group
    html = volume_table_html(plan, CL)
    # ring AllGather: each of the 4 ranks sends (g-1) * its shard = 3 * 8*2*4 bytes
    assert html.count("<tr>") == 1 + 4
    table = volume_table_figure(plan, CL)
    assert list(table.data[0].cells.values[0]) == [0, 1, 2, 3]


def test_switch_heatmap_sums_message_bytes():
    a = {"w": (Annotation("[0-3] S0x4"), (16, 8)), "v": (Annotation("[0,1] S1x2"), (8, 8))}
    b = {"w": (Annotation("[4-7] S0x4"), (16, 8)), "v": (Annotation("[0,4] S1x2"), (8, 8))}
    sw = plan_switch(a, b, CL)
    fig = switch_heatmap(sw, CL)
    z = fig.data[0].z
    total = sum(v for row in z for v in row if v is not None)
    unit = {"GB": 1e9, "MB": 1e6, "kB": 1e3, "B": 1.0}[fig.data[0].colorbar.title.text]
    assert total * unit == pytest.approx(sum(m.nbytes for s in sw.steps for m in s.messages))
    assert len([s for s in fig.layout.shapes]) == len(CL.nodes)


def test_gantt_bars_match_schedule_actions():
    model = LlamaConfig.preset("tiny")
    s = Strategy.load({"pipelines": [
        {"stages": [{"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}],
         "micro_batch_size": 1, "num_micro_batches": 3},
        {"stages": [{"devices": [4, 5], "layers": [0, 0]}, {"devices": [6], "layers": [1, 2]},
                    {"devices": [7], "layers": [3, 3]}], "micro_batch_size": 1, "num_micro_batches": 5}],
        "schedule": "1f1b"})
    r = simulate(model, s, CL, seq_len=16)
    fig = gantt_figure(r, cluster=CL)
    by_kind = {t.name: t for t in fig.data}
    for i, p in enumerate(s.pipelines):
        for j, st in enumerate(p.stages):
            acts = build_schedule(s.schedule, p.num_stages, j, p.num_micro_batches)
            for kind, name in (("F", "forward"), ("B", "backward")):
                want = sorted(a.micro_batch for a in acts if a.kind == kind)
                for d in st.devices:
                    t = by_kind[name]
                    got = sorted(mb for (dev, mb) in t.customdata if dev == d)
                    assert got == want, (d, kind)
