// Box and lasso selection: the lasso's even-odd test (inside, outside, on its edges, concave and degenerate
// polygons), the click/drag threshold, and the tiles a lasso picks.
import { test } from "node:test";
import assert from "node:assert/strict";
import { layout } from "../src/plan_canvas/layout.js";
import { CLICK, inPolygon, isClick, isDrag, tilesInLasso } from "../src/plan_canvas/selection.js";

const SQUARE = [[0, 0], [10, 0], [10, 10], [0, 10]];

test("lasso: points inside and outside a square", () => {
  assert.equal(inPolygon(5, 5, SQUARE), true);
  assert.equal(inPolygon(0.1, 9.9, SQUARE), true);
  assert.equal(inPolygon(15, 5, SQUARE), false);
  assert.equal(inPolygon(-1, 5, SQUARE), false);
  assert.equal(inPolygon(5, -0.1, SQUARE), false);
  assert.equal(inPolygon(5, 10.1, SQUARE), false);
});

test("lasso: points on the edge follow the half-open rule (left and top edges in, right and bottom out)", () => {
  // so a point on the edge two lassos share is picked by exactly one of them
  assert.equal(inPolygon(0, 5, SQUARE), true);
  assert.equal(inPolygon(5, 0, SQUARE), true);
  assert.equal(inPolygon(10, 5, SQUARE), false);
  assert.equal(inPolygon(5, 10, SQUARE), false);
  const right = [[10, 0], [20, 0], [20, 10], [10, 10]];
  assert.equal(inPolygon(10, 5, right), true);  // the shared edge belongs to the right-hand square
});

test("lasso: the order of the points does not matter (clockwise or not)", () => {
  const ccw = [...SQUARE].reverse();
  for (const [x, y, want] of [[5, 5, true], [15, 5, false], [0, 5, true], [10, 5, false]]) assert.equal(inPolygon(x, y, ccw), want);
});

test("lasso: a concave polygon leaves its notch out", () => {
  // a U: 30 x 30 with the notch 10..20 x 10..30 cut out of its bottom
  const u = [[0, 0], [30, 0], [30, 30], [20, 30], [20, 10], [10, 10], [10, 30], [0, 30]];
  assert.equal(inPolygon(15, 20, u), false);
  assert.equal(inPolygon(5, 20, u), true);
  assert.equal(inPolygon(25, 20, u), true);
  assert.equal(inPolygon(15, 5, u), true);
  const tri = [[0, 0], [10, 0], [0, 10]];
  assert.equal(inPolygon(4, 4, tri), true);  // 4 + 4 < 10
  assert.equal(inPolygon(6, 6, tri), false);
});

test("lasso: fewer than three points pick nothing", () => {
  assert.equal(inPolygon(0, 0, [[0, 0]]), false);
  assert.equal(inPolygon(2, 5, [[0, 0], [10, 10]]), false);
  assert.equal(inPolygon(1, 1, []), false);
});

test("click or drag: a gesture that never leaves 6 px of its start is a click", () => {
  assert.equal(CLICK, 6);
  assert.equal(isClick([[0, 0]]), true);
  assert.equal(isClick([[0, 0], [3, 4]]), true);  // 5 px away
  assert.equal(isClick([[0, 0], [3, 4], [6, 0]]), false);  // 6 px away: not a click any more
  assert.equal(isClick([[10, 10], [10, 15.9]]), true);
  assert.equal(isDrag({ x: 0, y: 0 }, 5.9, 0), false);
  assert.equal(isDrag({ x: 0, y: 0 }, 6, 0), true);
  assert.equal(isDrag({ x: 1, y: 1 }, 4, 5), false);  // 5 px
});

test("lasso selection: the tiles whose centre the lasso encloses", () => {
  // two nodes of four tiles at 900 px: centres (57, 81), (163, 81), (269, 81), (375, 81) | (525, 81), ...
  const lay = layout({ nodes: [{ i: 0, ranks: [0, 1, 2, 3] }, { i: 1, ranks: [4, 5, 6, 7] }], num_ranks: 8 }, 900);
  assert.deepEqual(tilesInLasso(lay.tiles, [[150, 70], [280, 70], [280, 90], [150, 90]]), [1, 2]);
  // the triangle (40, 60), (560, 60), (40, 300) holds the points with x <= 560 - (520 / 240) * (y - 60): at
  // y 81, x <= 514.5: the four centres of node 0, not (525, 81)
  assert.deepEqual(tilesInLasso(lay.tiles, [[40, 60], [560, 60], [40, 300]]), [0, 1, 2, 3]);
  assert.deepEqual(tilesInLasso(lay.tiles, [[0, 0], [10, 0], [10, 10]]), []);
  assert.deepEqual(tilesInLasso([undefined, lay.tiles[1]], [[0, 0], [900, 0], [900, 200], [0, 200]]), [1]);
});
