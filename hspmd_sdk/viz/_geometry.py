"""Where the cluster diagram puts things: node boxes and device tiles, in data units (y grows downwards).

Every figure that draws on the cluster (strategy overlay, annotation overlay, communication view) and the plan
editor use the same :class:`ClusterGeometry`, so a rank is always at the same place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.cluster import Cluster

__all__ = ["ClusterGeometry", "Box2D", "geometry"]

#: Tile side, gap between tiles, padding inside a node box, height of the node header, gap between nodes.
TILE, GAP, PAD, HEADER, NODE_GAP = 1.0, 0.14, 0.18, 0.42, 0.5
#: Pixels per data unit: figure sizes follow from it, so tiles (markers, in pixels) match shapes (data units).
PX_PER_UNIT = 62
MARGIN = dict(l=10, r=10, t=46, b=10)


@dataclass(frozen=True)
class Box2D:
    """An axis-aligned rectangle ``[x0, x1] x [y0, y1]`` in data units."""

    x0: float
    y0: float
    x1: float
    y1: float

    @property
    def cx(self) -> float:
        return (self.x0 + self.x1) / 2

    @property
    def cy(self) -> float:
        return (self.y0 + self.y1) / 2


@dataclass(frozen=True)
class ClusterGeometry:
    """Node boxes (index = node index) and device tiles (index = rank), and the drawing's extent."""

    nodes: tuple[Box2D, ...]
    tiles: tuple[Box2D, ...]
    width: float
    height: float

    @property
    def px_width(self) -> int:
        return int(self.width * PX_PER_UNIT) + MARGIN["l"] + MARGIN["r"]

    @property
    def px_height(self) -> int:
        return int(self.height * PX_PER_UNIT) + MARGIN["t"] + MARGIN["b"]

    @property
    def tile_px(self) -> float:
        """A tile's side in pixels (the size of a square marker that covers it)."""
        return TILE * PX_PER_UNIT * 0.97

    def tile(self, rank: int) -> Box2D:
        return self.tiles[rank]


def _per_row(n: int) -> int:
    return n if n <= 4 else 4 if n <= 8 else 8


def geometry(cluster: "Cluster", nodes_per_row: int | None = None) -> ClusterGeometry:
    """Lay the nodes out in rows (two per row by default when there are more than two), each node's devices in
    rows of up to four (eight for larger nodes)."""
    n_nodes = len(cluster.nodes)
    cols = nodes_per_row or (1 if n_nodes == 1 else 2 if n_nodes <= 8 else 3)
    widths = [_per_row(len(n.ranks)) for n in cluster.nodes]
    col_w = max(widths) * (TILE + GAP) - GAP + 2 * PAD
    heights = [math.ceil(len(n.ranks) / w) * (TILE + GAP) - GAP + 2 * PAD + HEADER
               for n, w in zip(cluster.nodes, widths)]
    tiles: dict[int, Box2D] = {}
    boxes: list[Box2D] = []
    y = 0.0
    for row_start in range(0, n_nodes, cols):
        row = range(row_start, min(row_start + cols, n_nodes))
        row_h = max(heights[i] for i in row)
        for c, i in enumerate(row):
            x0 = c * (col_w + NODE_GAP)
            boxes.append(Box2D(x0, y, x0 + col_w, y + heights[i]))
            for k, rank in enumerate(cluster.nodes[i].ranks):
                tx = x0 + PAD + (k % widths[i]) * (TILE + GAP)
                ty = y + HEADER + PAD + (k // widths[i]) * (TILE + GAP)
                tiles[rank] = Box2D(tx, ty, tx + TILE, ty + TILE)
        y += row_h + NODE_GAP
    width = min(cols, n_nodes) * (col_w + NODE_GAP) - NODE_GAP
    return ClusterGeometry(tuple(boxes), tuple(tiles[r] for r in range(cluster.num_ranks)), width, y - NODE_GAP)
