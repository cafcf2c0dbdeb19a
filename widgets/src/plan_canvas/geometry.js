// Geometry of tiles and boxes: bounding boxes, a stage's tiles per node, where a line leaves a box, overlaps, and
// the hit test of a point against a box.  A box: {x0, y0, x1, y1, cx, cy}; a tile: see layout.js.

// The bounding box of tiles, grown by `grow` on every side.
export function bbox(tiles, grow = 0) {
  const x0 = Math.min(...tiles.map((t) => t.x)) - grow, y0 = Math.min(...tiles.map((t) => t.y)) - grow;
  const x1 = Math.max(...tiles.map((t) => t.x + t.w)) + grow, y1 = Math.max(...tiles.map((t) => t.y + t.h)) + grow;
  return { x0, y0, x1, y1, cx: (x0 + x1) / 2, cy: (y0 + y1) / 2 };
}

// The tiles of `ranks`, grouped by node (in the order of their first rank); ranks without a tile are left out.
export function byNode(lay, ranks) {
  const parts = new Map();
  for (const r of ranks) {
    const t = lay.tiles[r];
    if (!t) continue;
    if (!parts.has(t.node)) parts.set(t.node, []);
    parts.get(t.node).push(t);
  }
  return [...parts.values()];
}

// Where a line from the box centre towards (x, y) leaves the box.
export function edgePoint(b, x, y) {
  const dx = x - b.cx, dy = y - b.cy;
  if (!dx && !dy) return [b.cx, b.cy];
  const sx = dx ? (b.x1 - b.cx) / Math.abs(dx) : Infinity, sy = dy ? (b.y1 - b.cy) / Math.abs(dy) : Infinity;
  const s = Math.min(sx, sy);
  return [b.cx + dx * s, b.cy + dy * s];
}

// The area two boxes share (0 when they only touch).
export function overlap(a, b) {
  const w = Math.min(a.x1, b.x1) - Math.max(a.x0, b.x0), h = Math.min(a.y1, b.y1) - Math.max(a.y0, b.y0);
  return w > 0 && h > 0 ? w * h : 0;
}

// The centre of a tile (what box and lasso selection test).
export function centre(t) {
  return [t.x + t.w / 2, t.y + t.h / 2];
}

// Whether (x, y) lies in the box spanned by the corners a and b (in any order), its border included.
export function inBox(x, y, a, b) {
  return x >= Math.min(a[0], b[0]) && x <= Math.max(a[0], b[0]) && y >= Math.min(a[1], b[1]) && y <= Math.max(a[1], b[1]);
}
