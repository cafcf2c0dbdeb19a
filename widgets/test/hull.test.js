// The orthogonal hulls drawn around a stage's tiles of one node: each tile grown by HULL (5 px), bridged to its
// right and lower neighbours in the node's grid (and the corner between four), and the union's outline.
import { test } from "node:test";
import assert from "node:assert/strict";
import { hull, hullSvg } from "../src/plan_canvas/hull.js";

// A grid of 20 x 20 tiles, 10 px apart: tile (col, row) spans 10 + 30 col .. 30 + 30 col (and likewise in y).
const T = (col, row) => ({ x: 10 + col * 30, y: 10 + row * 30, w: 20, h: 20, col, row });

const covered = (rects, x, y) => rects.some((r) => r[0] <= x && x <= r[2] && r[1] <= y && y <= r[3]);
const perimeter = (edges) => edges.reduce((s, e) => s + Math.abs(e[2] - e[0]) + Math.abs(e[3] - e[1]), 0);
// the covered area, counted on a 1 px lattice of cell centres (independent of how the hull decomposes it)
function area(rects, x0, y0, x1, y1) {
  let n = 0;
  for (let x = x0 + 0.5; x < x1; x++) for (let y = y0 + 0.5; y < y1; y++) if (covered(rects, x, y)) n++;
  return n;
}
// every edge lies on the border of the union: covered on one side, not on the other
function onBorder(rects, e) {
  const [mx, my] = [(e[0] + e[2]) / 2, (e[1] + e[3]) / 2];
  const [a, b] = e[1] === e[3] ? [[mx, my - 0.5], [mx, my + 0.5]] : [[mx - 0.5, my], [mx + 0.5, my]];
  return covered(rects, ...a) !== covered(rects, ...b);
}

test("one tile: its box grown by 5 px, outlined by four edges", () => {
  const h = hull([T(0, 0)]);
  assert.deepEqual(h.rects, [[5, 5, 35, 35]]);
  assert.deepEqual(h.edges, [[5, 5, 35, 5], [5, 35, 35, 35], [5, 5, 5, 35], [35, 5, 35, 35]]);
});

test("two neighbours in a row: bridged into one 60 x 30 rectangle (convex: it fills its bounding box)", () => {
  const h = hull([T(0, 0), T(1, 0)]);
  assert.deepEqual(h.rects, [[5, 5, 35, 35], [30, 5, 40, 35], [35, 5, 65, 35]]);
  assert.equal(perimeter(h.edges), 2 * 60 + 2 * 30);
  assert.equal(area(h.rects, 0, 0, 70, 40), 60 * 30);
  for (const e of h.edges) assert.ok(onBorder(h.rects, e), `edge ${e} inside the hull`);
  assert.ok(!h.edges.some((e) => e[0] === e[2] && e[0] > 5 && e[0] < 65), "no vertical edge between the tiles");
});

test("two neighbours in a column: one 30 x 60 rectangle", () => {
  const h = hull([T(2, 0), T(2, 1)]);
  assert.deepEqual(h.rects, [[65, 5, 95, 35], [65, 30, 95, 40], [65, 35, 95, 65]]);
  assert.equal(perimeter(h.edges), 2 * 30 + 2 * 60);
  assert.equal(area(h.rects, 60, 0, 100, 70), 30 * 60);
});

test("two diagonal tiles: not bridged, two squares meeting at a corner", () => {
  const h = hull([T(0, 0), T(1, 1)]);
  assert.deepEqual(h.rects, [[5, 5, 35, 35], [35, 35, 65, 65]]);
  assert.equal(perimeter(h.edges), 2 * 4 * 30);
  assert.equal(covered(h.rects, 50, 20), false);
  assert.equal(covered(h.rects, 20, 50), false);
});

test("three tiles in an L: the corner stays open (the hull is not convex)", () => {
  const tiles = [T(0, 0), T(1, 0), T(0, 1)];
  const h = hull(tiles);
  assert.equal(covered(h.rects, 50, 50), false);  // where the fourth tile would be
  assert.equal(covered(h.rects, 37, 37), false);  // the gap next to it
  assert.equal(area(h.rects, 0, 0, 70, 70), 60 * 30 + 30 * 30);
  // the L's outline: 60 + 30 + 30 + 30 + 30 + 60
  assert.equal(perimeter(h.edges), 240);
  for (const e of h.edges) assert.ok(onBorder(h.rects, e));
});

test("three tiles with the fourth missing: the corner is filled only when all four are there", () => {
  // (0, 0), (1, 0), (1, 1): (0, 0) has a right neighbour and a diagonal one, but no lower one
  const h = hull([T(0, 0), T(1, 0), T(1, 1)]);
  assert.equal(covered(h.rects, 32, 37), false);  // the corner cell between the four grid places
  assert.equal(covered(h.rects, 37, 37), true);  // the bridge down from (1, 0)
  assert.equal(area(h.rects, 0, 0, 70, 70), 60 * 30 + 30 * 30);
  const g = hull([T(0, 0), T(0, 1), T(1, 1)]);  // the mirror image: a lower neighbour and a diagonal one
  assert.equal(covered(g.rects, 37, 32), false);
  assert.equal(area(g.rects, 0, 0, 70, 70), 60 * 30 + 30 * 30);
});

test("a full 2 x 2 block: the corner between four tiles is filled, one 60 x 60 square", () => {
  const tiles = [T(0, 0), T(1, 0), T(0, 1), T(1, 1)];
  const h = hull(tiles);
  assert.ok(h.rects.some((r) => r[0] === 30 && r[1] === 30 && r[2] === 40 && r[3] === 40));
  assert.equal(area(h.rects, 0, 0, 70, 70), 60 * 60);
  assert.equal(perimeter(h.edges), 240);
});

test("every member tile, grown by 5 px, lies inside its hull", () => {
  const tiles = [T(0, 0), T(1, 0), T(3, 0), T(0, 1), T(2, 1), T(3, 1), T(1, 2)];
  const h = hull(tiles);
  for (const t of tiles) {
    for (const [x, y] of [[t.x - 5, t.y - 5], [t.x + t.w + 5, t.y - 5], [t.x - 5, t.y + t.h + 5], [t.x + t.w + 5, t.y + t.h + 5], [t.x + 10, t.y + 10]]) {
      assert.ok(covered(h.rects, x, y), `(${x}, ${y}) of tile ${t.col},${t.row}`);
    }
  }
  assert.equal(covered(h.rects, 80, 20), false);  // (2, 0) is not a member, nor bridged over
  for (const e of h.edges) assert.ok(onBorder(h.rects, e));
});

test("hullSvg: the filled union under its outline; dashed for a DG Union", () => {
  assert.equal(hullSvg([[T(0, 0)]], "#123", "#abc", 0.35, false, "hc-hull"),
    '<g class="hc-hull"><g opacity="0.35"><rect x="5" y="5" width="30" height="30" fill="#abc" stroke="none"/></g>' +
    '<path d="M5,5L35,5M5,35L35,35M5,5L5,35M35,5L35,35" stroke="#123" stroke-width="2.5" fill="none" stroke-linecap="square"/></g>');
  const dashed = hullSvg([[T(0, 0)], [T(1, 1)]], "#f00", "#f00", 0.08, true, "hc-union");
  assert.equal((dashed.match(/<g class="hc-union">/g) || []).length, 2);  // one hull per part
  assert.ok(dashed.includes('stroke-width="3" fill="none" stroke-linecap="square" stroke-dasharray="7 4"/>'));
  assert.equal(hullSvg([], "#000", "#000", 1, false, "x"), "");
});
