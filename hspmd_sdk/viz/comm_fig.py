"""Communication views: one Reshard's ``CommPlan`` (or a graph switch's ``SwitchPlan``) drawn on the cluster
diagram, the bytes each rank sends (a table), and the sender x receiver traffic heatmap of a switch.

Everything drawn is read from the plan the core produced (``ops``, ``messages``, ``transfers()``, ``volume()``);
link classes come from :meth:`Cluster.link`.
"""
from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import plotly.graph_objects as go
from plotly.colors import qualitative

from ..core.annotation import format_ranks
from ._geometry import ClusterGeometry, geometry
from ._style import LINK_COLOURS
from ._units import fmt_bytes
from .cluster_fig import LEGEND_PX, _apply_style, base_figure, tile_style

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.strategy import Strategy

__all__ = ["comm_figure", "volume_table_figure", "volume_table_html", "traffic_matrix", "switch_heatmap",
           "p2p_messages", "describe_groups"]

_OP_COLOURS = qualitative.Dark2


def p2p_messages(plan: Any) -> list[tuple[int, int, int]]:
    """``(src, dst, bytes)`` of every point-to-point message of a ``CommPlan`` (SendRecv / BSR operators) or of
    a ``SwitchPlan`` (packed messages), in plan order."""
    out: list[tuple[int, int, int]] = []
    for op in getattr(plan, "ops", ()):
        for m in getattr(op, "messages", ()):
            if m.src != m.dst:
                out.append((m.src, m.dst, m.nbytes))
    for step in getattr(plan, "steps", ()):
        for m in step.messages:
            if m.src != m.dst:
                out.append((m.src, m.dst, m.nbytes))
    return out


def _link_class(cluster: "Cluster", a: int, b: int) -> str:
    return "inter" if cluster.link(a, b).cls == "inter" else "intra"


_fmt = fmt_bytes


def _unit(peak: float) -> tuple[str, float]:
    """The decimal unit the largest value reads best in."""
    return next(((u, f) for u, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if peak >= f), ("B", 1.0))


def _group_rings(plan: Any) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Per collective operator: its name and the rank groups it runs over (bottom-tier groups, or the distinct
    rank sets of a top-tier operator's slice collectives)."""
    out = []
    for i, op in enumerate(getattr(plan, "ops", ())):
        if hasattr(op, "groups"):
            groups = [g.ranks for g in op.groups if len(g.ranks) > 1]
        elif hasattr(op, "slices"):
            groups = list(dict.fromkeys(s.ranks for s in op.slices if len(s.ranks) > 1))
        else:
            continue
        if groups:
            out.append((f"[{i}] {op.kind}: {len(groups)} group(s)", groups))
    return out


def _ring_trace(geom: ClusterGeometry, name: str, groups: list[tuple[int, ...]], colour: str) -> go.Scatter:
    xs: list[float | None] = []
    ys: list[float | None] = []
    for g in groups:
        pts = [geom.tiles[r] for r in g] + [geom.tiles[g[0]]]
        xs += [t.cx for t in pts] + [None]
        ys += [t.cy + 0.22 for t in pts] + [None]
    return go.Scatter(x=xs, y=ys, mode="lines+markers", name=name, line=dict(color=colour, width=3),
                      marker=dict(size=7, color=colour), hoverinfo="name", legendgroup="collectives")


def _exit(t: Any, x: float, y: float, margin: float) -> tuple[float, float]:
    """Where the segment from tile ``t``'s centre towards ``(x, y)`` leaves the tile (plus ``margin``)."""
    dx, dy = x - t.cx, y - t.cy
    half = (t.x1 - t.x0) / 2 + margin
    scale = half / max(abs(dx), abs(dy), 1e-9)
    return t.cx + dx * min(scale, 1.0), t.cy + dy * min(scale, 1.0)


def _arrow(geom: ClusterGeometry, src: int, dst: int, nbytes: int, biggest: int, cls: str) -> list[dict[str, Any]]:
    """One message as shapes drawn *below* the tiles (so they never cover a tile's label): a line from the
    sender's tile edge to the receiver's, and an arrowhead in the gap just outside the receiver's tile."""
    a, b = geom.tiles[src], geom.tiles[dst]
    x0, y0 = _exit(a, b.cx, b.cy, 0.02)
    x1, y1 = _exit(b, a.cx, a.cy, 0.02)
    colour = LINK_COLOURS[cls]
    width = 1.5 + 4.5 * nbytes / max(biggest, 1)
    dx, dy = x1 - x0, y1 - y0
    n = max((dx * dx + dy * dy) ** 0.5, 1e-9)
    ux, uy = dx / n, dy / n
    size = 0.06  # the head must fit in the gap between two tiles (GAP = 0.14)
    bx, by = x1 - ux * size * 1.3, y1 - uy * size * 1.3
    head = f"M{x1},{y1} L{bx - uy * size},{by + ux * size} L{bx + uy * size},{by - ux * size} Z"
    return [dict(type="line", x0=x0, y0=y0, x1=bx, y1=by, layer="below", name="message",
                 line=dict(color=colour, width=width)),
            dict(type="path", path=head, layer="below", name="head", fillcolor=colour, line=dict(color=colour, width=1))]


def comm_figure(plan: Any, cluster: "Cluster", *, strategy: "Strategy | None" = None, title: str = "") -> go.Figure:
    """A ``CommPlan`` (or ``SwitchPlan``) on the cluster diagram.

    Collectives (bottom-tier groups; top-tier slice collectives by rank set) are rings in one colour per
    operator; each point-to-point message (``SendRecv``/``BSR``) is an arrow from sender to receiver whose
    width grows with its bytes, teal inside a node and red across nodes, drawn below the tiles (shapes named
    ``"message"`` and ``"head"``) so that no label is covered; hovering its middle gives its bytes.  Devices are tinted by ``strategy``
    if given.  The title lists the operators and the bytes sent inside and across nodes.
    """
    geom = geometry(cluster)
    kinds = " → ".join(getattr(plan, "kinds", []) or ["Identity"])
    vol = plan.volume(cluster)
    intra, inter = sum(v["intra"] for v in vol.values()), sum(v["inter"] for v in vol.values())
    head = title or (f"Reshard {plan.src} → {plan.dst}" if hasattr(plan, "src") else "Graph switch")
    fig = base_figure(cluster, geom, f"{head}<br><sup>{kinds}; sent {_fmt(intra)} intra-node, "
                                     f"{_fmt(inter)} inter-node</sup>")
    fig.update_layout(margin_t=70, height=geom.px_height + 24)
    _apply_style(fig, tile_style(cluster, strategy))
    for i, (name, groups) in enumerate(_group_rings(plan)):
        fig.add_trace(_ring_trace(geom, name, groups, _OP_COLOURS[i % len(_OP_COLOURS)]))
    msgs = p2p_messages(plan)
    biggest = max((m[2] for m in msgs), default=1)
    arrows = [sh for s, d, n in msgs for sh in _arrow(geom, s, d, n, biggest, _link_class(cluster, s, d))]
    fig.layout.shapes = tuple(fig.layout.shapes) + tuple(arrows)  # after the node boxes, still under the tiles
    if msgs:  # hover for every message, at its middle (invisible markers: nothing covers the tiles)
        mids = [((geom.tiles[s].cx + geom.tiles[d].cx) / 2, (geom.tiles[s].cy + geom.tiles[d].cy) / 2) for s, d, _ in msgs]
        fig.add_trace(go.Scatter(x=[m[0] for m in mids], y=[m[1] for m in mids], mode="markers", name="messages",
                                 marker=dict(size=14, opacity=0), showlegend=False, hoverinfo="text",
                                 hovertext=[f"{s} → {d}: {_fmt(n)} ({_link_class(cluster, s, d)}-node)"
                                            for s, d, n in msgs]))
    if msgs:
        for cls in ("intra", "inter"):
            n = sum(1 for s, d, _ in msgs if _link_class(cluster, s, d) == cls)
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line=dict(color=LINK_COLOURS[cls], width=4),
                                     name=f"{cls}-node sends ({n})", legendgroup="p2p"))
    if len(fig.data) > 2:
        fig.update_layout(width=fig.layout.width + LEGEND_PX, margin_r=LEGEND_PX, legend=dict(x=1.0))
    return fig


# ---- tables ------------------------------------------------------------------------------------------------
def _volume_rows(vol: Mapping[int, Mapping[str, int]], cluster: "Cluster | None", only_senders: bool
                 ) -> tuple[str, list[tuple[int, str, float, float]]]:
    """The unit (MB like the paper's Table 4 when it fits) and ``(rank, kind, intra, inter)`` rows in it."""
    unit, scale = _unit(max((max(v["intra"], v["inter"]) for v in vol.values()), default=0))
    rows = []
    for r, v in sorted(vol.items()):
        if only_senders and not (v["intra"] or v["inter"]):
            continue
        rows.append((r, cluster.kind(r) if cluster is not None else "", v["intra"] / scale, v["inter"] / scale))
    return unit, rows


def volume_table_figure(plan: Any, cluster: "Cluster | None" = None, *, only_senders: bool = True) -> go.Figure:
    """Bytes each rank sends, intra-node and inter-node (``plan.volume()``), in the unit the largest reads best in
    (MB for real models), as a ``go.Table``; the paper's Table 4 layout (sender rank: NVLink | IB)."""
    unit, rows = _volume_rows(plan.volume(cluster), cluster, only_senders)
    cols = list(zip(*rows)) if rows else [[], [], [], []]
    fig = go.Figure(go.Table(
        header=dict(values=["sender rank", "kind", f"intra-node (NVLink) {unit}", f"inter-node (IB) {unit}"],
                    fill_color="#dde3ea", align="left"),
        cells=dict(values=[list(cols[0]), list(cols[1]), [f"{x:.1f}" for x in cols[2]],
                           [f"{x:.1f}" for x in cols[3]]], align="left")))
    fig.update_layout(height=min(120 + 22 * len(rows), 700), margin=dict(l=10, r=10, t=30, b=10),
                      title=dict(text="bytes sent per rank", font=dict(size=13)))
    return fig


def volume_table_html(plan: Any, cluster: "Cluster | None" = None, *, only_senders: bool = True) -> str:
    """The same table as :func:`volume_table_figure`, as a small HTML table (no pandas)."""
    unit, rows = _volume_rows(plan.volume(cluster), cluster, only_senders)
    body = "".join(f"<tr><td>R{r}</td><td>{html.escape(k)}</td><td style='text-align:right'>{a:.1f}</td>"
                   f"<td style='text-align:right'>{b:.1f}</td></tr>" for r, k, a, b in rows)
    if not rows:
        body = "<tr><td colspan=4><i>no rank sends anything</i></td></tr>"
    return ("<table class='hspmd-volume' style='border-collapse:collapse;font-size:12px'>"
            f"<tr><th>sender</th><th>kind</th><th>intra {unit}</th><th>inter {unit}</th></tr>" + body + "</table>")


# ---- switch heatmap ----------------------------------------------------------------------------------------
def traffic_matrix(plan: Any, ranks: Iterable[int] | None = None) -> tuple[list[int], list[list[float]]]:
    """``(ranks, bytes[sender][receiver])`` summed over the plan's operators/steps (``plan.transfers()``)."""
    total: dict[tuple[int, int], float] = {}
    for step in plan.transfers():
        for s, d, n, _ in step:
            if s != d:
                total[(s, d)] = total.get((s, d), 0.0) + n
    rs = sorted(set(ranks) if ranks is not None else {r for k in total for r in k})
    index = {r: i for i, r in enumerate(rs)}
    z = [[0.0] * len(rs) for _ in rs]
    for (s, d), n in total.items():
        if s in index and d in index:
            z[index[s]][index[d]] = n
    return rs, z


def switch_heatmap(plan: Any, cluster: "Cluster | None" = None, *, title: str = "") -> go.Figure:
    """The traffic of a switch (or any plan with ``transfers()``): sender x receiver bytes (in GB, MB, kB or B,
    whichever fits the largest cell).  Node blocks (intra-node
    traffic, NVLink) are outlined; cells outside them are inter-node (IB)."""
    cluster = cluster or getattr(plan, "cluster", None)
    ranks = cluster.ranks if cluster is not None else None
    rs, z = traffic_matrix(plan, ranks)
    unit, scale = _unit(max((v for row in z for v in row), default=0.0))
    mb = [[v / scale for v in row] for row in z]
    cls = [[(_link_class(cluster, s, d) if cluster is not None and s != d else "") for d in rs] for s in rs]
    fig = go.Figure(go.Heatmap(
        z=[[v if v > 0 else None for v in row] for row in mb], x=rs, y=rs, colorscale="Viridis",
        customdata=cls, colorbar=dict(title=unit), hoverongaps=False,
        hovertemplate="sender %{y} → receiver %{x}: %{z:.1f} " + unit + " (%{customdata}-node)<extra></extra>"))
    shapes = []
    if cluster is not None:
        for node in cluster.nodes:
            lo, hi = min(node.ranks) - 0.5, max(node.ranks) + 0.5
            shapes.append(dict(type="rect", x0=lo, x1=hi, y0=lo, y1=hi, line=dict(color="#d1495b", width=1.5)))
    sent = _fmt(sum(map(sum, z)))
    name = title or (f"{'Fused' if getattr(plan, 'fused', True) else 'Unfused'} BSR traffic" if hasattr(plan, "steps")
                     else "traffic")
    fig.update_layout(title=dict(text=f"{name}: {sent} sent<br><sup>node blocks outlined: intra-node "
                                      "(NVLink); elsewhere inter-node (IB)</sup>", font=dict(size=14)),
                      xaxis=dict(title="receiver rank", constrain="domain"),
                      yaxis=dict(title="sender rank", autorange="reversed", scaleanchor="x"),
                      shapes=shapes, width=640, height=600, plot_bgcolor="white")
    return fig


def describe_groups(plan: Any) -> list[str]:
    """One line per collective operator: its kind and rank groups (compact rank notation)."""
    return [f"{name}: " + "; ".join(format_ranks(list(g)) for g in groups[:6]) + (" ..." if len(groups) > 6 else "")
            for name, groups in _group_rings(plan)]
