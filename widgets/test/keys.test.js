// The canvas's keyboard and history controls.  The undo/redo history itself is the PlanEditor's (Python): the
// canvas sends {op: "undo"} / {op: "redo"} and enables its buttons from the view's `can`; tested here: which keys
// send which, the buttons' state, arrow-key moves between tiles, [ and ] through the stages, the tensor picker.
import { test } from "node:test";
import assert from "node:assert/strict";
import { layout } from "../src/plan_canvas/layout.js";
import { historyShortcut, nextTile, stepStage } from "../src/plan_canvas/keys.js";
import { groupOf } from "../src/plan_canvas/tensors.js";
import { Canvas } from "../src/plan_canvas/canvas.js";

test("undo/redo shortcuts: Ctrl or Cmd + Z undoes, + Shift+Z or Y redoes, nothing else does", () => {
  assert.equal(historyShortcut({ key: "z", ctrlKey: true }), "undo");
  assert.equal(historyShortcut({ key: "z", metaKey: true }), "undo");
  assert.equal(historyShortcut({ key: "Z", ctrlKey: true, shiftKey: true }), "redo");
  assert.equal(historyShortcut({ key: "z", metaKey: true, shiftKey: true }), "redo");
  assert.equal(historyShortcut({ key: "y", ctrlKey: true }), "redo");
  assert.equal(historyShortcut({ key: "Y", metaKey: true, shiftKey: true }), "redo");
  assert.equal(historyShortcut({ key: "z" }), null);
  assert.equal(historyShortcut({ key: "y", shiftKey: true }), null);
  assert.equal(historyShortcut({ key: "z", altKey: true }), null);
  assert.equal(historyShortcut({ key: "x", ctrlKey: true }), null);
});

test("undo/redo buttons: enabled exactly when the editor can undo / redo", () => {
  const self = Object.assign(Object.create(Canvas.prototype), { model: { get: () => [] }, mode: "box", group: "", path: null, uid: () => "u1" });
  const bar = (can) => Canvas.prototype.toolbar.call(self, { can });
  const state = (html, op) => {
    const m = html.match(new RegExp(`<button class="hc-btn" data-op="${op}" data-key="btn-${op}" (disabled)? title="([^"]*)"`));
    assert.ok(m, `no ${op} button`);
    return [m[1] === "disabled" ? "disabled" : "enabled", m[2]];
  };
  assert.deepEqual(state(bar({ undo: true, redo: false }), "undo"), ["enabled", "undo the last change (Ctrl+Z)"]);
  assert.deepEqual(state(bar({ undo: true, redo: false }), "redo"), ["disabled", "redo (Ctrl+Shift+Z or Ctrl+Y)"]);
  assert.deepEqual(state(bar({ undo: false, redo: true }), "undo")[0], "disabled");
  assert.deepEqual(state(bar({ undo: false, redo: true }), "redo")[0], "enabled");
  assert.deepEqual(state(bar({}), "undo")[0], "disabled");
});

test("arrow keys: to the nearest tile ahead, a step across costing three steps along", () => {
  const two = { nodes: [{ i: 0, ranks: [0, 1, 2, 3] }, { i: 1, ranks: [4, 5, 6, 7] }], num_ranks: 8 };
  const wide = layout(two, 900).tiles;  // one row: x 12, 118, 224, 330 | 480, 586, 692, 798
  assert.equal(nextTile(wide, 0, "ArrowRight"), 1);
  assert.equal(nextTile(wide, 3, "ArrowRight"), 4);  // into the next node
  assert.equal(nextTile(wide, 0, "ArrowLeft"), null);
  assert.equal(nextTile(wide, 0, "ArrowDown"), null);
  assert.equal(nextTile(wide, 7, "ArrowRight"), null);
  // at 300 px: two columns of four (node 0 at x 12, node 1 at x 164; rows at y 46, 134, 222, 310)
  const tall = layout(two, 300).tiles;
  assert.equal(nextTile(tall, 0, "ArrowDown"), 1);
  assert.equal(nextTile(tall, 0, "ArrowRight"), 4);  // 152 along beats 152 + 3 * 88 for tile 5
  assert.equal(nextTile(tall, 3, "ArrowRight"), 7);  // the same row of the other node, not its first tile
  assert.equal(nextTile(tall, 5, "ArrowUp"), 4);  // 88 along beats 88 + 3 * 152 for tile 0
  assert.equal(nextTile(tall, 5, "ArrowLeft"), 1);
  assert.equal(nextTile(tall, 3, "ArrowDown"), null);
});

test("arrow keys: a tile straight ahead beats a nearer one off to the side (a step across costs three along)", () => {
  const at = (r, x, y) => ({ r, x, y, w: 10, h: 10 });
  const tiles = [at(0, 0, 0), at(1, 0, 100), at(2, 30, 50)];
  assert.equal(nextTile(tiles, 0, "ArrowDown"), 1);  // 100 + 0 < 50 + 3 * 30
  tiles[2] = at(2, 10, 50);
  assert.equal(nextTile(tiles, 0, "ArrowDown"), 2);  // 50 + 3 * 10 < 100
  assert.equal(nextTile(tiles, 1, "ArrowUp"), 2);  // 50 + 30 < 100
  assert.equal(nextTile([at(0, 0, 0), at(1, 0, 0)], 0, "ArrowRight"), null);  // level with it: not ahead
});

test("[ and ]: through every stage of every pipeline in order, wrapping around", () => {
  const pipes = [{ stages: [{ p: 0, s: 0 }, { p: 0, s: 1 }] }, { stages: [{ p: 1, s: 0 }] }];
  assert.deepEqual(stepStage(pipes, [0, 0], 1), [0, 1]);
  assert.deepEqual(stepStage(pipes, [0, 1], 1), [1, 0]);
  assert.deepEqual(stepStage(pipes, [1, 0], 1), [0, 0]);  // wraps
  assert.deepEqual(stepStage(pipes, [0, 0], -1), [1, 0]);  // wraps back
  assert.deepEqual(stepStage(pipes, null, 1), [0, 0]);  // nothing selected: ] picks the first stage
  assert.deepEqual(stepStage(pipes, null, -1), [0, 1]);  // and [ counts back from before the first: index 3 - 2
  assert.deepEqual(stepStage(pipes, [5, 5], 1), [0, 0]);  // a selection no longer there counts as none
  assert.equal(stepStage([], [0, 0], 1), null);
  assert.equal(stepStage(undefined, null, 1), null);
  assert.equal(stepStage([{ stages: [] }], null, 1), null);
});

test("tensor picker: the group that holds a name", () => {
  const groups = [["layers.0", ["layers.0.attn.wq", "layers.0.mlp.w1"]], ["head", ["lm_head"]]];
  assert.equal(groupOf(groups, "layers.0.mlp.w1"), "layers.0");
  assert.equal(groupOf(groups, "lm_head"), "head");
  assert.equal(groupOf(groups, "layers.1.mlp.w1"), "");
  assert.equal(groupOf([], "x"), "");
});
