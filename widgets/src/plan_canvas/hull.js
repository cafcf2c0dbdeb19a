// Orthogonal hulls: the outline drawn around a stage's (or a DG Union subgroup's) tiles of one node.

import { HULL } from "./constants.js";

// The outline of the union of a set of tiles of one node: tiles grown by `grow` (HULL unless given), bridged to
// their neighbours in the node's grid.  Returns {rects, edges} in pixels (rects: [x0, y0, x1, y1] whose union is
// the hull; edges: [x0, y0, x1, y1] boundary segments of the union, each horizontal or vertical).
export function hull(tiles, grow = HULL) {
  const rects = [];
  const at = new Map(tiles.map((t) => [`${t.col},${t.row}`, t]));
  for (const t of tiles) {
    rects.push([t.x - grow, t.y - grow, t.x + t.w + grow, t.y + t.h + grow]);
    const right = at.get(`${t.col + 1},${t.row}`), down = at.get(`${t.col},${t.row + 1}`);
    if (right) rects.push([t.x + t.w, t.y - grow, right.x, t.y + t.h + grow]);
    if (down) rects.push([t.x - grow, t.y + t.h, t.x + t.w + grow, down.y]);
    if (right && down && at.get(`${t.col + 1},${t.row + 1}`)) rects.push([t.x + t.w, t.y + t.h, right.x, down.y]);
  }
  const xs = [...new Set(rects.flatMap((r) => [r[0], r[2]]))].sort((a, b) => a - b);
  const ys = [...new Set(rects.flatMap((r) => [r[1], r[3]]))].sort((a, b) => a - b);
  const cov = (i, j) => {
    if (i < 0 || j < 0 || i >= xs.length - 1 || j >= ys.length - 1) return false;
    const cx = (xs[i] + xs[i + 1]) / 2, cy = (ys[j] + ys[j + 1]) / 2;
    return rects.some((r) => r[0] <= cx && cx <= r[2] && r[1] <= cy && cy <= r[3]);
  };
  const edges = [];
  for (let i = 0; i < xs.length - 1; i++) {
    for (let j = 0; j < ys.length - 1; j++) {
      if (!cov(i, j)) continue;
      if (!cov(i, j - 1)) edges.push([xs[i], ys[j], xs[i + 1], ys[j]]);
      if (!cov(i, j + 1)) edges.push([xs[i], ys[j + 1], xs[i + 1], ys[j + 1]]);
      if (!cov(i - 1, j)) edges.push([xs[i], ys[j], xs[i], ys[j + 1]]);
      if (!cov(i + 1, j)) edges.push([xs[i + 1], ys[j], xs[i + 1], ys[j + 1]]);
    }
  }
  return { rects, edges };
}

// The hulls of parts (each the tiles of one node) as SVG: the filled union under its outline (dashed: a DG Union);
// `grow`: how far the outline stands off the tiles (HULL unless given).
export function hullSvg(parts, colour, fill, opacity, dashed, cls, grow = HULL) {
  let out = "";
  for (const p of parts) {
    const h = hull(p, grow);
    out += `<g class="${cls}"><g opacity="${opacity}">` + h.rects.map((r) => `<rect x="${r[0]}" y="${r[1]}" width="${r[2] - r[0]}" height="${r[3] - r[1]}" fill="${fill}" stroke="none"/>`).join("") + "</g>";
    out += `<path d="${h.edges.map((e) => `M${e[0]},${e[1]}L${e[2]},${e[3]}`).join("")}" stroke="${colour}" stroke-width="${dashed ? 3 : 2.5}" fill="none" stroke-linecap="square"${dashed ? ' stroke-dasharray="7 4"' : ""}/></g>`;
  }
  return out;
}
