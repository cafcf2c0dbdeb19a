// Arrow routing through the gaps between tiles (Dijkstra over the channel crossings, 40 px a turn), the lanes of
// several arrows, the segments labels sit on, and where a label goes.
import { test } from "node:test";
import assert from "node:assert/strict";
import { layout } from "../src/plan_canvas/layout.js";
import { bbox } from "../src/plan_canvas/geometry.js";
import { Heap, channels, laneShift, route, segments } from "../src/plan_canvas/routing.js";
import { headBoxes, placeLabel } from "../src/plan_canvas/labels.js";

// Two nodes of four side by side at 900 px: tiles 90 x 70 at y 46..116, x 12, 118, 224, 330 | 480, 586, 692, 798.
const TWO = { nodes: [{ i: 0, ranks: [0, 1, 2, 3] }, { i: 1, ranks: [4, 5, 6, 7] }], num_ranks: 8 };
const LAY = layout(TWO, 900);
const CH = channels(LAY);

// whether a segment passes through the inside of a tile (touching its border is allowed)
const crosses = ([ax, ay], [bx, by], t) =>
  Math.max(ax, bx) > t.x && Math.min(ax, bx) < t.x + t.w && Math.max(ay, by) > t.y && Math.min(ay, by) < t.y + t.h;
const onBorder = ([x, y], b) =>
  x >= b.x0 && x <= b.x1 && y >= b.y0 && y <= b.y1 && (x === b.x0 || x === b.x1 || y === b.y0 || y === b.y1);

test("channels: the node margins, the gaps between tiles and the lines through the tiles' centres", () => {
  // node 0: margins 6 and 426, gaps 110, 216, 322, centres 57, 163, 269, 375; between the nodes 450; node 1 alike
  // from 468 (its right margin 894; 918, beyond the canvas, is dropped, as are -18 and y -18, 146)
  assert.deepEqual(CH.X, [6, 57, 110, 163, 216, 269, 322, 375, 426, 450, 474, 525, 578, 631, 684, 737, 790, 843, 894]);
  assert.deepEqual(CH.Y, [38, 81, 122]);  // under the header (34 + 6 - 2), the tiles' centres, the bottom margin (128 - 6)
  const i57 = CH.X.indexOf(57), i110 = CH.X.indexOf(110);
  assert.equal(CH.ok[i57][1], false);  // (57, 81): tile 0's centre
  assert.equal(CH.ok[i110][1], true);  // (110, 81): the gap between tiles 0 and 1
  assert.equal(CH.right[i57][0], true);  // along y 38, above the tiles
  assert.equal(CH.down[i110][0], true);  // down the gap from y 38 to 81
  assert.equal(CH.right[CH.X.indexOf(6)][1], false);  // from the margin into tile 0
  assert.equal(CH.free(0, 40, 900, 40), true);
  assert.equal(CH.free(0, 81, 900, 81), false);
  assert.equal(CH.free(102.5, 0, 102.5, 200), false);  // tile 0 ends at x 102: within 1 px still counts as the tile
  assert.equal(CH.free(103, 0, 103, 200), true);
});

test("route: between tiles of one node it runs below the tiles in between, ends on the two tiles' boxes", () => {
  const src = bbox([LAY.tiles[0]], 2), dst = bbox([LAY.tiles[3]], 2);  // 10..104 x 44..118, 328..422 x 44..118
  // below (4 px to y 122, 318 along, 4 back up) beats above (6 + 318 + 6) and the gaps (blocked by tiles 1, 2)
  assert.deepEqual(route(CH, src, dst), [[57, 118], [57, 122], [375, 122], [375, 118]]);
});

test("route: across nodes, through the gap between them", () => {
  assert.deepEqual(route(CH, bbox([LAY.tiles[0]], 2), bbox([LAY.tiles[4]], 2)), [[57, 118], [57, 122], [525, 122], [525, 118]]);
  // neighbours: straight across the 16 px gap, from the right border of one box to the left border of the other
  // (through the crossing (216, 81), dropped as collinear)
  assert.deepEqual(route(CH, bbox([LAY.tiles[1]], 2), bbox([LAY.tiles[2]], 2)), [[210, 81], [222, 81]]);
});

test("route: in a grid it turns through the gaps and crosses no tile, not even the ones it connects", () => {
  // one node of nine tiles, three a row: from the top-left tile to the bottom-right one, and the reverse
  const lay = layout({ nodes: [{ i: 0, ranks: [0, 1, 2, 3, 4, 5, 6, 7, 8] }], num_ranks: 9 }, 330);
  assert.deepEqual(lay.tiles.map((t) => [t.col, t.row]).slice(0, 4), [[0, 0], [1, 0], [2, 0], [0, 1]]);
  const ch = channels(lay);
  for (const [s, d] of [[0, 8], [8, 0], [2, 6], [1, 7], [3, 5]]) {
    const src = bbox([lay.tiles[s]], 2), dst = bbox([lay.tiles[d]], 2);
    const pts = route(ch, src, dst);
    assert.ok(pts && pts.length >= 2, `${s} -> ${d}`);
    assert.ok(onBorder(pts[0], src), `${s} -> ${d} starts on ${s}'s box: ${pts[0]}`);
    assert.ok(onBorder(pts[pts.length - 1], dst), `${s} -> ${d} ends on ${d}'s box: ${pts[pts.length - 1]}`);
    for (let k = 0; k + 1 < pts.length; k++) {
      const [a, b] = [pts[k], pts[k + 1]];
      assert.ok(a[0] === b[0] || a[1] === b[1], `segment ${a} ${b} is not horizontal or vertical`);
      for (const t of lay.tiles) assert.ok(!crosses(a, b, t), `${s} -> ${d}: ${a} ${b} crosses tile ${t.r}`);
    }
    for (let k = 1; k + 1 < pts.length; k++) {  // collinear points are dropped: every inner point is a turn
      const [a, b, c] = [pts[k - 1], pts[k], pts[k + 1]];
      assert.ok(!((a[0] === b[0] && b[0] === c[0]) || (a[1] === b[1] && b[1] === c[1])), `${s} -> ${d}: ${b} is not a turn`);
    }
  }
});

test("route: null when no channel runs near a box (the caller then draws a straight line)", () => {
  const far = { x0: 5000, y0: 5000, x1: 5010, y1: 5010, cx: 5005, cy: 5005 };
  assert.equal(route(CH, bbox([LAY.tiles[0]], 2), far), null);
  assert.equal(route(CH, far, bbox([LAY.tiles[0]], 2)), null);
});

test("laneShift: the ith arrow's inner points move by ((i % 5) - 2) * step, its ends stay", () => {
  const pts = [[0, 0], [0, 10], [30, 10], [30, 0]];
  assert.deepEqual(laneShift(pts, 0, 2.5), [[0, 0], [-5, 5], [25, 5], [30, 0]]);
  assert.deepEqual(laneShift(pts, 2, 2.5), pts);
  assert.deepEqual(laneShift(pts, 4, 2), [[0, 0], [4, 14], [34, 14], [30, 0]]);
  assert.deepEqual(laneShift(pts, 7, 2), pts);  // 7 % 5 = 2
  assert.deepEqual(laneShift([[1, 1], [2, 2]], 0, 2.5), [[1, 1], [2, 2]]);
});

test("segments: a route's straight pieces, horizontal ones first, longest first", () => {
  const segs = segments([[0, 0], [0, 10], [30, 10], [30, 0], [50, 0]]);
  assert.deepEqual(segs.map((s) => [s.a, s.b, s.len, s.horiz]), [
    [[0, 10], [30, 10], 30, true], [[30, 0], [50, 0], 20, true], [[0, 0], [0, 10], 10, false], [[30, 10], [30, 0], 10, false]]);
});

test("Heap: pops entries by their first element, smallest first", () => {
  const h = new Heap();
  for (const c of [5, 3, 9, 1, 7, 3, 0, 8]) h.push([c, `x${c}`]);
  assert.equal(h.size, 8);
  const out = [];
  while (h.size) out.push(h.pop()[0]);
  assert.deepEqual(out, [0, 1, 3, 3, 5, 7, 8, 9]);
});

test("placeLabel: on its route where nothing is in the way; the next label moves aside; tiles are avoided", () => {
  const segs = [{ a: [0, 50], b: [200, 50] }];
  const placed = [];
  const ctx = { width: 300, height: 100, tileRects: [], heads: [], placed };
  const first = placeLabel(segs, 40, 10, ctx);
  assert.deepEqual(first.r, { x0: 80, y0: 45, x1: 120, y1: 55 });  // centred on the middle of the segment
  assert.equal(first.near, 0);
  assert.deepEqual(placed, [first.r]);
  const second = placeLabel(segs, 40, 10, ctx);  // the middle is taken: 30% along, just touching the first
  assert.deepEqual(second.r, { x0: 40, y0: 45, x1: 80, y1: 55 });
  const third = placeLabel(segs, 40, 10, { width: 300, height: 100, heads: [], placed: [],
    tileRects: [{ x0: 70, y0: 40, x1: 130, y1: 60 }] });  // a tile over the middle: 15% along is the first clear spot
  assert.deepEqual(third.r, { x0: 10, y0: 45, x1: 50, y1: 55 });
});

test("placeLabel: null when no candidate fits the canvas; node headers are boxes to avoid", () => {
  const placed = [];
  assert.equal(placeLabel([{ a: [0, 50], b: [200, 50] }], 400, 10, { width: 100, height: 100, tileRects: [], heads: [], placed }), null);
  assert.deepEqual(placed, []);
  assert.deepEqual(headBoxes(LAY), [{ x0: 0, y0: 0, x1: 432, y1: 30 }, { x0: 468, y0: 0, x1: 900, y1: 30 }]);
});
