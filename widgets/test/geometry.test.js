// Layout and hit tests of the cluster canvas: where tiles go, which points lie in a tile or a band, boxes and
// where a line leaves them.  Every expected value is worked out by hand from the measures in constants.js
// (GAP 16, PAD 12, HEAD 34, NODE_GAP 36, HULL 5).
import { test } from "node:test";
import assert from "node:assert/strict";
import { layout } from "../src/plan_canvas/layout.js";
import { bbox, byNode, centre, edgePoint, inBox, overlap } from "../src/plan_canvas/geometry.js";
import { tilesInBox } from "../src/plan_canvas/selection.js";

// Two nodes of four devices.  At 900 px the best layout puts both nodes in one row, four tiles a row: a tile
// is floor((900 - 36 - 2 * (24 + 3 * 16)) / 8) = 90 px wide, round(90 * 0.78) = 70 high; a node box is
// 24 + 4 * 90 + 3 * 16 = 432 wide and 34 + 24 + 70 = 128 high; the second box starts at 432 + 36 = 468.
export const TWO = { nodes: [{ i: 0, ranks: [0, 1, 2, 3] }, { i: 1, ranks: [4, 5, 6, 7] }], num_ranks: 8 };
export const LAY = layout(TWO, 900);

test("layout: one device on a 300 px canvas gets the largest tile (92 x 72) in a 116 x 130 node box", () => {
  const lay = layout({ nodes: [{ i: 0, ranks: [0] }], num_ranks: 1 }, 300);
  assert.deepEqual(lay.tiles[0], { r: 0, node: 0, x: 12, y: 46, w: 92, h: 72, col: 0, row: 0, cols: 1 });
  assert.deepEqual(lay.boxes.map((b) => [b.x, b.y, b.w, b.h]), [[0, 0, 116, 130]]);
  assert.equal(lay.width, 116);
  assert.equal(lay.height, 130);
});

test("layout: two nodes of four side by side at 900 px", () => {
  assert.equal(LAY.size, 90);
  assert.deepEqual(LAY.boxes.map((b) => [b.x, b.y, b.w, b.h]), [[0, 0, 432, 128], [468, 0, 432, 128]]);
  assert.deepEqual(LAY.tiles.map((t) => [t.r, t.node, t.x, t.y, t.w, t.h, t.col, t.row]), [
    [0, 0, 12, 46, 90, 70, 0, 0], [1, 0, 118, 46, 90, 70, 1, 0], [2, 0, 224, 46, 90, 70, 2, 0], [3, 0, 330, 46, 90, 70, 3, 0],
    [4, 1, 480, 46, 90, 70, 0, 0], [5, 1, 586, 46, 90, 70, 1, 0], [6, 1, 692, 46, 90, 70, 2, 0], [7, 1, 798, 46, 90, 70, 3, 0]]);
  assert.equal(LAY.width, 900);
  assert.equal(LAY.height, 128);
});

test("layout: a narrow canvas wraps the tiles (never below 58 px) and keeps the layout lowest at the largest tile", () => {
  // 300 px: four a row would be floor((300 - 24 - 48) / 4) = 57 px < 58.  Two a row, nodes stacked: 92 px tiles,
  // 2 * (34 + 24 + 2 * 72 + 16 + 36) = 508 high; one a row, both nodes side by side: floor((300 - 36 - 48) / 2) =
  // 108 -> 92 px tiles, 34 + 24 + 4 * 72 + 3 * 16 + 36 = 430 high: lower, so it wins.
  const lay = layout(TWO, 300);
  assert.equal(lay.size, 92);
  assert.deepEqual(lay.tiles.slice(0, 5).map((t) => [t.col, t.row, t.x, t.y]),
    [[0, 0, 12, 46], [0, 1, 12, 134], [0, 2, 12, 222], [0, 3, 12, 310], [0, 0, 164, 46]]);
  assert.deepEqual(lay.boxes.map((b) => [b.x, b.y, b.w, b.h]), [[0, 0, 116, 394], [152, 0, 116, 394]]);
  assert.equal(lay.width, 268);
});

test("hit test: a point in a box, its border included, the corners in any order", () => {
  const t = LAY.tiles[0];  // 12..102 x 46..116, centre (57, 81)
  assert.deepEqual(centre(t), [57, 81]);
  assert.equal(inBox(57, 81, [0, 0], [57, 81]), true);  // on the corner
  assert.equal(inBox(57, 81, [57, 81], [0, 0]), true);  // corners swapped
  assert.equal(inBox(57, 81, [0, 0], [56.9, 200]), false);  // just left of the right border
  assert.equal(inBox(57, 81, [0, 81], [100, 200]), true);  // on the top border
  assert.equal(inBox(57, 81, [0, 81.1], [100, 200]), false);
  assert.equal(inBox(-1, 5, [0, 0], [10, 10]), false);
});

test("hit test: the tiles whose centre a band covers", () => {
  // centres: (57, 81), (163, 81), (269, 81), (375, 81) | (525, 81), ...
  assert.deepEqual(tilesInBox(LAY.tiles, [0, 0], [500, 200]), [0, 1, 2, 3]);
  assert.deepEqual(tilesInBox(LAY.tiles, [375, 81], [525, 81]), [3, 4]);  // a line through two centres: borders count
  assert.deepEqual(tilesInBox(LAY.tiles, [376, 0], [524, 200]), []);  // between the centres: nothing
  assert.deepEqual(tilesInBox(LAY.tiles, [900, 128], [0, 0]), [0, 1, 2, 3, 4, 5, 6, 7]);
  const holes = [undefined, LAY.tiles[1]];  // ranks without a tile are skipped
  assert.deepEqual(tilesInBox(holes, [0, 0], [900, 200]), [1]);
});

test("bbox: the tiles' bounding box, grown", () => {
  assert.deepEqual(bbox([LAY.tiles[0], LAY.tiles[1]], 5), { x0: 7, y0: 41, x1: 213, y1: 121, cx: 110, cy: 81 });
  assert.deepEqual(bbox([LAY.tiles[3]]), { x0: 330, y0: 46, x1: 420, y1: 116, cx: 375, cy: 81 });
});

test("byNode: a stage's tiles grouped by node, in the order of their first rank; ranks without a tile dropped", () => {
  const parts = byNode(LAY, [4, 0, 5, 99]);
  assert.deepEqual(parts.map((p) => p.map((t) => t.r)), [[4, 5], [0]]);
  assert.deepEqual(byNode(LAY, []), []);
});

test("edgePoint: where the line from a box's centre towards a point leaves the box", () => {
  const b = { x0: 0, y0: 0, x1: 10, y1: 4, cx: 5, cy: 2 };
  assert.deepEqual(edgePoint(b, 15, 2), [10, 2]);  // straight right
  assert.deepEqual(edgePoint(b, 5, -10), [5, 0]);  // straight up
  assert.deepEqual(edgePoint(b, 25, 12), [9, 4]);  // (20, 10) away: the bottom edge at 2/10 of the way
  assert.deepEqual(edgePoint(b, 5, 2), [5, 2]);  // the centre itself
});

test("overlap: the shared area of two boxes, 0 when they only touch or are apart", () => {
  const a = { x0: 0, y0: 0, x1: 10, y1: 10 };
  assert.equal(overlap(a, { x0: 5, y0: 5, x1: 20, y1: 20 }), 25);
  assert.equal(overlap(a, { x0: 10, y0: 0, x1: 20, y1: 10 }), 0);
  assert.equal(overlap(a, { x0: 30, y0: 30, x1: 40, y1: 40 }), 0);
  assert.equal(overlap(a, { x0: 2, y0: 3, x1: 4, y1: 8 }), 10);  // inside
});
