// Where an arrow's label goes: on its route where it runs through a gap, else in free space near it (a lane is kept
// below the nodes) with a leader line; labels avoid tiles, node headers and each other.

import { HEAD, LANE } from "./constants.js";
import { overlap } from "./geometry.js";

// The boxes of the node headers of a layout (labels keep off them).
export function headBoxes(lay) {
  return lay.boxes.map((b) => ({ x0: b.x, y0: b.y, x1: b.x + b.w, y1: b.y + HEAD - 4 }));
}

// The box of a w x h label for the route segments segs (routing.segments): candidates on the segments, around
// them and in the lane below the nodes, each priced by its overlap with tiles (x4), node headers and the labels
// placed before (x40), twice its distance to the route and 30 off the route.  Returns {r, cost, near, anchor}
// (r: the box; anchor: the point of the route nearest it, at distance near) and adds r to `placed`; null when no
// candidate fits the area (width x height: the layout's, tileRects and heads: boxes to avoid).
export function placeLabel(segs, w, h, { width, height, tileRects, heads, placed }) {
  const H = height + LANE;
  let best = null;
  const pts = [];
  for (const sg of segs) for (const t of [0.5, 0.3, 0.7, 0.15, 0.85]) pts.push([sg.a[0] + (sg.b[0] - sg.a[0]) * t, sg.a[1] + (sg.b[1] - sg.a[1]) * t, 0]);
  const base = pts.slice();
  for (const [x, y] of base) for (const dx of [-1.5, -0.8, 0, 0.8, 1.5]) for (const dy of [-40, -22, 0, 22, 40]) pts.push([x + dx * w, y + dy, 1]);
  for (const [x] of base) pts.push([x, height + LANE / 2, 1]);
  for (const [x, y, off] of pts) {
    const r = { x0: x - w / 2, y0: y - h / 2, x1: x + w / 2, y1: y + h / 2 };
    if (r.x0 < 0 || r.x1 > width + 4 || r.y0 < -14 || r.y1 > H) continue;
    let near = Infinity, anchor = base[0];
    for (const p of base) {
      const d = Math.hypot(p[0] - x, p[1] - y);
      if (d < near) { near = d; anchor = p; }
    }
    const cost = 4 * tileRects.reduce((c, q) => c + overlap(r, q), 0) + heads.reduce((c, q) => c + overlap(r, q), 0) +
      40 * placed.reduce((c, q) => c + overlap(r, q), 0) + 2 * near + (off ? 30 : 0);
    if (!best || cost < best.cost) best = { r, cost, near, anchor };
  }
  if (best) placed.push(best.r);
  return best;
}
