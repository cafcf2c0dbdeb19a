"""The cluster diagram: nodes as boxes, devices as tiles; overlays of a strategy and of one tensor's annotation.

The annotation overlay draws, on each device of the DG Union, a small grid of the global tensor with the box that
device holds filled in the colour of its sharding subgroup -- in the spirit of DTensor's ``visualize_sharding``
and JAX's ``visualize_array_sharding``.  Boxes come from :func:`hspmd_sdk.core.annotation.local_view`, the one
definition of a layout; nothing is re-derived here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import plotly.graph_objects as go

from ..core.annotation import DUPLICATE, PARTIAL, Annotation, format_ranks, is_split, local_view
from ._geometry import HEADER, MARGIN, PAD, ClusterGeometry, geometry
from ._style import ERROR, SELECTED, UNUSED, pipeline_colour, stage_colour, subgroup_colour
from ._tp_grid import ratios_text, share_text, stage_places, uneven
from ._units import fmt_memory, fmt_node_devices

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.strategy import Strategy

__all__ = ["cluster_figure", "TileStyle", "tile_style", "AnnotationOverlay", "annotation_overlay", "grid_dims",
           "base_figure", "hdim_words", "grid_axes", "grid_axis", "grid_words"]

LEGEND_PX = 290
TILES, LABELS = 0, 1  # trace indices of the device tiles and their labels in every cluster-diagram figure


# ---- tiles -------------------------------------------------------------------------------------------------
@dataclass
class TileStyle:
    """Per-rank look of the device tiles: fill, outline colour and width, label and hover text."""

    fill: list[str]
    line: list[str]
    width: list[float]
    label: list[str]
    hover: list[str]


def _gb(nbytes: float) -> str:
    return fmt_memory(nbytes)


def tile_style(cluster: "Cluster", strategy: "Strategy | Any | None" = None, *,
               memory: Mapping[int, float] | None = None, selected: tuple[int, int] | None = None,
               flagged: Sequence[int] = ()) -> TileStyle:
    """How each device tile looks under ``strategy`` (a ``Strategy``, or the editor's draft of one): stage fill
    (a shade of its pipeline's colour), layer range in the label; ``memory`` (bytes per rank, e.g.
    ``SimResult.peak_memory``) in the hover; ``selected`` stage outlined in black, ``flagged`` ranks in red."""
    n = cluster.num_ranks
    fill, line, width = [UNUSED] * n, ["#9aa3ad"] * n, [1.0] * n
    label, hover = [], []
    where: dict[int, tuple[int, int]] = {}
    if strategy is not None:
        for i, p in enumerate(strategy.pipelines):
            for j, s in enumerate(p.stages):
                for r in s.devices:
                    if 0 <= r < n:
                        where[r] = (i, j)
                        fill[r] = stage_colour(i, j, len(p.stages))
                        line[r], width[r] = pipeline_colour(i), 2.0
    flagged_set = set(flagged)
    for r in range(n):
        spec = cluster.spec(r)
        cap = spec.memory_mb * 2.0**20
        text = [f"rank {r} · {spec.kind} · {cluster.node_of(r).host}", f"memory {_gb(cap)}"]
        lab = f"<b>{r}</b> {spec.kind}"
        if r in where and strategy is not None:
            i, j = where[r]
            st = strategy.pipelines[i].stages[j]
            lab += f"<br>L{st.layers[0]}–{st.layers[1]}"
            text.append(f"pipeline {i}, stage {j}: layers {st.layers[0]}–{st.layers[1]}, {st.parallel_text}")
            text += _place_words(st, r)
            if selected == (i, j):
                line[r], width[r] = SELECTED, 4.0
        elif strategy is not None:
            text.append("unused")
        if memory is not None and r in memory:
            text.append(f"needs ~{_gb(memory[r])} of {_gb(cap)} ({memory[r] / cap:.0%})")
        if r in flagged_set:
            line[r], width[r] = ERROR, 4.0
        label.append(lab)
        hover.append("<br>".join(text))
    return TileStyle(fill, line, width, label, hover)


def _place_words(stage: Any, rank: int) -> list[str]:
    """A device's CP × TP coordinates (with context parallelism) and its share of every TP-split tensor (with
    uneven ratios), for its hover."""
    ratios, cp = getattr(stage, "ratios", None), getattr(stage, "cp", 1)
    place = stage_places(stage.devices, ratios, cp).get(rank)
    if place is None:
        return []
    out = [f"CP group {place.cp} of {cp}, TP rank {place.tp} ({place.grid_text})"] if cp > 1 else []
    if place.share is not None and uneven(ratios):
        out.append(f"holds {share_text(place.share)} of every TP-split tensor (ratios {ratios_text(ratios)})")
    return out


def _tile_traces(geom: ClusterGeometry, style: TileStyle) -> list[go.Scatter]:
    n = len(geom.tiles)
    tiles = go.Scatter(
        x=[t.cx for t in geom.tiles], y=[t.cy for t in geom.tiles], mode="markers", name="devices",
        customdata=list(range(n)), hovertext=style.hover, hoverinfo="text", showlegend=False,
        marker=dict(symbol="square", size=geom.tile_px, color=style.fill,
                    line=dict(color=style.line, width=style.width)),
        selected=dict(marker=dict(opacity=1.0)), unselected=dict(marker=dict(opacity=0.55)))
    labels = go.Scatter(
        x=[t.cx for t in geom.tiles], y=[t.y0 + 0.27 for t in geom.tiles], mode="text", text=style.label,
        textfont=dict(size=10, color="#1b1f24"), hoverinfo="skip", showlegend=False, name="labels")
    return [tiles, labels]


# ---- nodes and links ---------------------------------------------------------------------------------------
def _node_shapes(cluster: "Cluster", geom: ClusterGeometry) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    shapes: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    for i, (node, box) in enumerate(zip(cluster.nodes, geom.nodes)):
        spec = cluster.devices[node.kind]
        shapes.append(dict(type="rect", x0=box.x0, y0=box.y0, x1=box.x1, y1=box.y1, layer="below",
                           line=dict(color="#56606b", width=1.5), fillcolor="#f7f9fb"))
        notes.append(dict(x=box.x0 + PAD, y=box.y0 + HEADER / 2 + 0.04, xanchor="left", yanchor="middle",
                          showarrow=False, font=dict(size=10, color="#2d333a"),
                          text=f"<b>{node.host}</b> · {len(node.ranks)}×{node.kind} · "
                               f"{fmt_node_devices(spec)}"))
    # inter-node links (one class: the network): dashed lines across the gaps between neighbouring node boxes
    for a in geom.nodes:
        for b in geom.nodes:
            if abs(a.y0 - b.y0) < 1e-9 and 0 < b.x0 - a.x1 < 1.0:
                shapes.append(dict(type="line", x0=a.x1, x1=b.x0, y0=a.cy, y1=a.cy, layer="below",
                                   line=dict(color="#8a939e", width=2, dash="dash")))
            if abs(a.x0 - b.x0) < 1e-9 and 0 < b.y0 - a.y1 < 1.0:
                shapes.append(dict(type="line", x0=a.cx, x1=a.cx, y0=a.y1, y1=b.y0, layer="below",
                                   line=dict(color="#8a939e", width=2, dash="dash")))
    return shapes, notes


def base_figure(cluster: "Cluster", geom: ClusterGeometry | None = None, title: str = "") -> go.Figure:
    """The bare diagram: node boxes with their kind, memory and NVLink bandwidth, the inter-node network, and
    the device tiles (trace 0) with their labels (trace 1).  Other figures draw on top of it."""
    geom = geom or geometry(cluster)
    shapes, notes = _node_shapes(cluster, geom)
    fig = go.Figure(data=_tile_traces(geom, tile_style(cluster)))
    link = (f"links: intra-node NVLink (per kind, in node headers) · inter-node {cluster.inter_bandwidth_gbs:g} "
            f"GB/s, {cluster.inter_latency_us:g} µs (dashed)")
    fig.update_layout(
        title=dict(text=(title or str(cluster)) + f"<br><sup>{link}</sup>", x=0.01, font=dict(size=14)),
        width=geom.px_width, height=geom.px_height, margin=MARGIN, autosize=False, plot_bgcolor="white",
        shapes=shapes, annotations=notes, dragmode="select", hovermode="closest", clickmode="event",
        xaxis=dict(range=[-0.05, geom.width + 0.05], visible=False, fixedrange=True),
        yaxis=dict(range=[geom.height + 0.05, -0.05], visible=False, fixedrange=True),
        legend=dict(x=1.01, y=1, xanchor="left", font=dict(size=10)))
    return fig


def _apply_style(fig: go.Figure, style: TileStyle) -> None:
    t, lab = fig.data[TILES], fig.data[LABELS]
    t.marker.color, t.marker.line.color, t.marker.line.width = style.fill, style.line, style.width
    t.hovertext, lab.text = style.hover, style.label


# ---- annotation overlay ------------------------------------------------------------------------------------
def hdim_words(ann: Annotation) -> str:
    """HDim in words: how the top tier shards the tensor across subgroups."""
    if ann.hsize == 1:
        return "HSize 1 (plain SPMD)"
    if ann.hdim == DUPLICATE:
        how = "each subgroup holds the whole tensor"
    elif ann.hdim == PARTIAL:
        how = "each subgroup holds a summand"
    else:
        how = f"split along dim {ann.hdim}" + (f" in ratios {':'.join(map(str, ann.hratios))}"
                                                if ann.hratios else " evenly")
    return f"HSize {ann.hsize}, HDim {ann.hdim} ({how})"


def grid_dims(ann: Annotation, ndim: int) -> tuple[int, int]:
    """Two tensor dims to show as (rows, columns): split dims first (HDim, then DS splits).  The figures and the
    canvas draw every split dim instead (:func:`grid_axes`)."""
    split = ([ann.hdim] if is_split(ann.hdim) and ann.hsize > 1 else []) + sorted(
        {d for ds in ann.ds_union for d in ds.split_dims})
    dims = list(dict.fromkeys(d for d in split if d < ndim))
    dims += [d for d in range(ndim) if d not in dims]
    if ndim == 1:
        return (-1, 0)
    rows, cols = sorted(dims[:2])
    return rows, cols


def grid_axis(dims: list[int], shape: tuple[int, ...], boxes: list[tuple[tuple[int, int], ...]]
              ) -> tuple[list[float], Any]:
    """One axis of the shard grid: ``dims`` flattened in row-major order, each cut at every shard edge.  Returns
    the cell edges (fractions of the axis) and a function from a box to its segments on the axis."""
    cuts = {d: sorted({e for b in boxes for e in b[d]} | {0, shape[d]}) for d in dims}
    cells = [1.0]  # fraction of the axis per cell, row-major over the dims' chunks
    for d in dims:
        sizes = [(b - a) / shape[d] for a, b in zip(cuts[d], cuts[d][1:])]
        cells = [c * f for c in cells for f in sizes]
    edges = [0.0]
    for c in cells:
        edges.append(edges[-1] + c)

    def segments(box: tuple[tuple[int, int], ...]) -> list[tuple[float, float]]:
        if not dims:
            return [(0.0, 1.0)]
        spans = [(cuts[d].index(box[d][0]), cuts[d].index(box[d][1])) for d in dims]
        counts = [len(cuts[d]) - 1 for d in dims]
        out: list[tuple[float, float]] = []

        def walk(level: int, index: int) -> None:
            lo, hi = spans[level]
            if level == len(dims) - 1:
                a, b = edges[index * counts[level] + lo], edges[index * counts[level] + hi]
                if out and abs(out[-1][1] - a) < 1e-12:
                    out[-1] = (out[-1][0], b)
                else:
                    out.append((a, b))
                return
            for i in range(lo, hi):
                walk(level + 1, index * counts[level] + i)
        walk(0, 0)
        return out
    return [round(e, 5) for e in edges], segments


def grid_axes(shape: tuple[int, ...], boxes: list[tuple[tuple[int, int], ...]]) -> tuple[list[int], list[int]]:
    """The tensor dims the shard grid draws as rows and as columns: a matrix as it is (dim 0 down, dim 1 across),
    a vector across; a tensor of 3 or more dims by the dims some shard does not hold whole, whatever they are:
    the first down, the others across (flattened); a dim every shard holds whole is not drawn."""
    n = len(shape)
    if n == 1:
        return [], [0]
    if n == 2:
        return [0], [1]
    split = [d for d in range(n) if any(tuple(b[d]) != (0, shape[d]) for b in boxes)]
    if len(split) == 1 and split[0] != 0:
        return [], split
    return split[:1], split[1:]


def grid_words(shape: tuple[int, ...], rows: list[int], cols: list[int]) -> str:
    def axis(dims: list[int]) -> str:
        return f"dim {dims[0]}" if len(dims) == 1 else "dims " + "×".join(map(str, dims)) + " (flattened)"
    parts = ([f"rows = {axis(rows)}"] if rows else []) + ([f"columns = {axis(cols)}"] if cols else [])
    whole = [d for d in range(len(shape)) if d not in rows and d not in cols]
    if not parts:
        return f"grid: no dim is split (dims {', '.join(map(str, whole))} held whole)"
    tail = (f"; dim{'s' if len(whole) > 1 else ''} {', '.join(map(str, whole))} held whole" if whole else "")
    return "grid: " + ", ".join(parts) + tail


@dataclass
class AnnotationOverlay:
    """Shapes drawn over the tiles, legend entries ``(text, colour)`` and a header line."""

    shapes: list[dict[str, Any]] = field(default_factory=list)
    legend: list[tuple[str, str]] = field(default_factory=list)
    header: str = ""


def annotation_overlay(geom: ClusterGeometry, ann: Annotation, shape: Sequence[int], tensor: str = ""
                       ) -> AnnotationOverlay:
    """One tensor's annotation on the diagram: each subgroup's devices outlined in the subgroup's colour, and on
    each device a small grid of the global tensor with the box it holds (``local_view``) filled; a Partial
    summand is drawn dashed and labelled ``Σi/n``; a grid labelled ``Dn`` is replicated on ``n`` devices of its
    subgroup (Duplicate)."""
    ann.check_shape(shape, tensor)
    shape = tuple(shape)
    views = [(k, ds, r, local_view(ann, shape, r)) for k, (dg, ds) in enumerate(zip(ann.dg_union, ann.ds_union))
             for r in dg]
    boxes = [tuple(tuple(x) for x in v.box) for _, _, _, v in views]
    rows, cols = grid_axes(shape, boxes)
    _, rows_of = grid_axis(rows, shape, boxes)
    _, cols_of = grid_axis(cols, shape, boxes)
    out = AnnotationOverlay()
    for k, (dg, ds) in enumerate(zip(ann.dg_union, ann.ds_union)):
        out.legend.append((f"subgroup {k}: [{format_ranks(dg)}] {ds}", subgroup_colour(k)))
    for (k, ds, r, v), box in zip(views, boxes):
        colour = subgroup_colour(k)
        if r >= len(geom.tiles):
            continue
        t = geom.tiles[r]
        out.shapes.append(dict(type="rect", x0=t.x0 - 0.03, y0=t.y0 - 0.03, x1=t.x1 + 0.03, y1=t.y1 + 0.03,
                               line=dict(color=colour, width=3), layer="above", name=f"subgroup{k}"))
        gx0, gx1, gy0, gy1 = t.x0 + 0.12, t.x1 - 0.12, t.y0 + 0.5, t.y1 - 0.08
        grid: dict[str, Any] = dict(type="rect", x0=gx0, y0=gy0, x1=gx1, y1=gy1, layer="above",
                                    line=dict(color="#6b7480", width=1), fillcolor="white", name="tensor")
        if ds.duplicate > 1:  # this shard is replicated on ds.duplicate devices of the subgroup
            grid["label"] = dict(text=f"D{ds.duplicate}", font=dict(size=7, color="#454d57"),
                                 textposition="bottom right")
        out.shapes.append(grid)
        for (r0, r1) in rows_of(box):
            for (c0, c1) in cols_of(box):
                shard: dict[str, Any] = dict(type="rect", x0=gx0 + (gx1 - gx0) * c0, y0=gy0 + (gy1 - gy0) * r0,
                                             x1=gx0 + (gx1 - gx0) * c1, y1=gy0 + (gy1 - gy0) * r1, layer="above",
                                             fillcolor=colour, opacity=0.9, name=f"shard{k}",
                                             line=dict(color="#1b1f24", width=1))
                if v.partial_count > 1:
                    shard["line"] = dict(color="#1b1f24", width=1.5, dash="dot")
                    shard["label"] = dict(text=f"Σ{v.partial_index}/{v.partial_count}", font=dict(size=8))
                out.shapes.append(shard)
    dup = " · D = duplicate, S = split, P = partial (Σ i/n: summand i of n)"
    grid_text = grid_words(shape, rows, cols)
    out.header = f"{tensor + ' ' if tensor else ''}{tuple(shape)}: {hdim_words(ann)}; {grid_text}{dup}"
    return out


def _legend_trace(name: str, colour: str, group: str, title: str = "") -> go.Scatter:
    return go.Scatter(x=[None], y=[None], mode="markers", name=name, legendgroup=group,
                      legendgrouptitle=dict(text=title) if title else None,
                      marker=dict(symbol="square", size=12, color=colour))


# ---- the figure --------------------------------------------------------------------------------------------
def cluster_figure(cluster: "Cluster", strategy: "Strategy | None" = None, *, annotation: Annotation | None = None,
                   shape: Sequence[int] | None = None, tensor: str = "", memory: Mapping[int, float] | None = None,
                   title: str = "") -> go.Figure:
    """The cluster diagram, optionally with a strategy and one tensor's annotation drawn on it.

    * ``strategy``: each stage's devices filled with a shade of its pipeline's colour (later stages darker),
      outlined in the pipeline colour, labelled with their layer range; the legend lists stages.
    * ``annotation`` + ``shape`` (the tensor's global shape; ``tensor`` its name): DG Union subgroups outlined,
      each device's shard on a small grid of the global tensor; HSize/HDim and each subgroup's DS in the legend.
    * ``memory``: bytes per rank shown in the hover (e.g. ``SimResult.peak_memory``).
    """
    geom = geometry(cluster)
    fig = base_figure(cluster, geom, title or (f"{strategy.name or 'Strategy'} on {cluster}" if strategy else ""))
    _apply_style(fig, tile_style(cluster, strategy, memory=memory))
    if strategy is not None:
        for i, p in enumerate(strategy.pipelines):
            for j, s in enumerate(p.stages):
                fig.add_trace(_legend_trace(f"S{j}: ranks {format_ranks(s.devices)}, L{s.layers[0]}–{s.layers[1]}",
                                            stage_colour(i, j, p.num_stages), f"p{i}",
                                            f"pipeline {i}: {p.num_micro_batches}×bs{p.micro_batch_size}"))
    if annotation is not None:
        if shape is None:
            raise ValueError("cluster_figure: an annotation needs the tensor's global shape (shape=...)")
        ov = annotation_overlay(geom, annotation, shape, tensor)
        fig.layout.shapes = tuple(fig.layout.shapes) + tuple(ov.shapes)
        for text, colour in ov.legend:
            title = f"{tensor or 'tensor'}: HSize {annotation.hsize}, HDim {annotation.hdim}"
            fig.add_trace(_legend_trace(text, colour, "annotation", title if text == ov.legend[0][0] else ""))
        fig.update_layout(title_text=fig.layout.title.text + f"<br><sup>{ov.header}</sup>",
                          margin=dict(MARGIN, t=MARGIN["t"] + 26), height=geom.px_height + 26)
    if len(fig.data) > 2:  # room for the legend on the right
        fig.update_layout(width=fig.layout.width + LEGEND_PX, margin_r=LEGEND_PX)
        fig.update_layout(legend=dict(x=1.0, xanchor="left"))
        _fit_legend(fig)
    return fig


#: Pixels a legend entry (or a group's title) takes, and the gap between groups (plotly's defaults at size 10).
LEGEND_ROW_PX, LEGEND_GAP_PX = 21, 10


def _fit_legend(fig: go.Figure) -> None:
    """A figure as tall as its legend: a short cluster with many stages (one row of 4 devices, 4 pipelines) had
    its legend clipped to a scroll box.  The tiles keep their size; the figure grows below them."""
    groups = {t.legendgroup for t in fig.data[2:] if t.legendgroup}
    margin = fig.layout.margin
    need = int((len(fig.data) - 2 + len(groups)) * LEGEND_ROW_PX + len(groups) * LEGEND_GAP_PX
               + (margin.t or 0) + (margin.b or 0))
    height = fig.layout.height or 0
    if need > height:
        bottom, top = fig.layout.yaxis.range  # reversed: the top of the drawing is ``top``
        inner = height - (margin.t or 0) - (margin.b or 0)
        per_unit = inner / (bottom - top)  # pixels per unit now: kept
        fig.update_layout(height=need, yaxis_range=[top + (inner + need - height) / per_unit, top])
