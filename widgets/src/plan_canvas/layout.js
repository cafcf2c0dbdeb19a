// The cluster's layout: node boxes in rows, each node's tiles in rows; the tile size follows the width (legible
// from 1024 px up).  A tile: {r, node, x, y, w, h, col, row, cols} (col, row: its place in its node's grid).

import { GAP, PAD, HEAD, NODE_GAP } from "./constants.js";

export function layout(cluster, width) {
  const nodes = cluster.nodes;
  const maxN = Math.max(...nodes.map((n) => n.ranks.length));
  const perRow = [...new Set([maxN, Math.ceil(maxN / 2), Math.ceil(maxN / 4)])].filter((t) => t >= 1);
  let best = null;
  for (const t of perRow) {
    for (let k = 1; k <= nodes.length; k++) {
      const tile = Math.floor((width - (k - 1) * NODE_GAP - k * (2 * PAD + (t - 1) * GAP)) / (k * t));
      if (tile < 58) continue;
      const size = Math.min(tile, 92);
      const rowsPerNode = Math.ceil(maxN / t);
      const nodeH = HEAD + 2 * PAD + rowsPerNode * Math.round(size * 0.78) + (rowsPerNode - 1) * GAP;
      const height = Math.ceil(nodes.length / k) * (nodeH + NODE_GAP);
      const score = Math.min(size, 76) * 10000 - height;
      if (!best || score > best.score) best = { t, k, size, score };
    }
  }
  if (!best) best = { t: Math.min(maxN, 4), k: 1, size: 58 };
  const { t, k, size } = best;
  const th = Math.round(size * 0.78);
  const tiles = new Array(cluster.num_ranks);
  const boxes = [];
  let y = 0;
  for (let i = 0; i < nodes.length; i += k) {
    const row = nodes.slice(i, i + k);
    const rowH = Math.max(...row.map((n) => HEAD + 2 * PAD + Math.ceil(n.ranks.length / t) * (th + GAP) - GAP));
    row.forEach((n, c) => {
      const cols = Math.min(t, n.ranks.length);
      const w = 2 * PAD + t * size + (t - 1) * GAP;
      const x = c * (w + NODE_GAP);
      boxes.push({ x, y, w, h: rowH, node: n });
      n.ranks.forEach((r, j) => {
        tiles[r] = { r, node: n.i, x: x + PAD + (j % t) * (size + GAP), y: y + HEAD + PAD + Math.floor(j / t) * (th + GAP),
                     w: size, h: th, col: j % t, row: Math.floor(j / t), cols };
      });
    });
    y += rowH + NODE_GAP;
  }
  const w = Math.max(...boxes.map((b) => b.x + b.w));
  return { boxes, tiles, width: w, height: y - NODE_GAP, size };
}
