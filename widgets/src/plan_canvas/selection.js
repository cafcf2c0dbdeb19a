// Box and lasso selection on the empty canvas: a tile is picked when its centre lies in the band (border included)
// or in the lasso polygon.  A pointer gesture that never leaves CLICK px of where it started is a click.

import { centre, inBox } from "./geometry.js";

export const CLICK = 6;

// Even-odd test of (x, y) against the polygon pts ([[x, y], ...], closed implicitly).
export function inPolygon(x, y, pts) {
  let inside = false;
  for (let i = 0, j = pts.length - 1; i < pts.length; j = i++) {
    const [xi, yi] = pts[i], [xj, yj] = pts[j];
    if ((yi > y) !== (yj > y) && x < ((xj - xi) * (y - yi)) / (yj - yi) + xi) inside = !inside;
  }
  return inside;
}

// Whether the points of a gesture ([[x, y], ...], the first where it started) all stay within CLICK px of the first.
export function isClick(pts) {
  const [x0, y0] = pts[0];
  return pts.every(([px, py]) => Math.hypot(px - x0, py - y0) < CLICK);
}

// Whether the pointer has moved far enough from `start` ({x, y}) to be a drag.
export function isDrag(start, x, y) {
  return Math.hypot(x - start.x, y - start.y) >= CLICK;
}

// The ranks of the tiles (layout tiles, holes allowed) whose centre lies in the box with corners a and b.
export function tilesInBox(tiles, a, b) {
  const out = [];
  for (const t of tiles) {
    if (!t) continue;
    const [cx, cy] = centre(t);
    if (inBox(cx, cy, a, b)) out.push(t.r);
  }
  return out;
}

// The ranks of the tiles whose centre lies in the lasso polygon pts.
export function tilesInLasso(tiles, pts) {
  const out = [];
  for (const t of tiles) {
    if (!t) continue;
    const [cx, cy] = centre(t);
    if (inPolygon(cx, cy, pts)) out.push(t.r);
  }
  return out;
}
