// hspmd_sdk · the plan editor's cluster canvas (an anywidget ESM module; the entry of its bundle, built by esbuild
// into hspmd_sdk/viz/static/plan_canvas.js: `npm run build` in widgets/).
//
// Python (hspmd_sdk/viz/_canvas.py) syncs two traits: `cluster` (nodes and devices, sent once) and `view`
// (everything about the draft shown, after every change: see hspmd_sdk/viz/_canvas_view.py), plus `tensors`
// (the tensor picker's groups).  Every user action is sent to Python as a message {op, ...} that calls the
// same PlanEditor method a script would; nothing here decides anything about the plan.
//
// Direct manipulation (exploring never changes the plan; moving a device takes an explicit gesture):
// * click a tile: pick it and inspect it (its stage, layers, memory, problems) -- nothing moves;
//   Shift/Ctrl+click adds or removes it from the picked tiles; drag on the empty canvas: box (or lasso) pick;
// * move: drag a tile (or the picked tiles) onto a stage -- a tile of that stage, its chip in the stage list,
//   "+ stage" or "+ pipeline"; or Alt+click a tile: it joins (or leaves) the selected stage; or the picked
//   tiles' bar / the inspect card's buttons; keyboard: arrows move between tiles, Space picks, Enter moves the
//   picked tiles (or the focused one) into the selected stage, Delete takes them out, [ and ] change the
//   selected stage, Ctrl+Z / Ctrl+Shift+Z (or Ctrl+Y) undo and redo;
// * "+ stage" and "+ pipeline": click to add an empty one, or drop devices on them.
//
// Modules: layout.js (where nodes and tiles go), geometry.js (boxes, hit tests), hull.js (the outlines around a
// stage's tiles), routing.js (arrows through the gaps), labels.js (where their labels go), selection.js (box and
// lasso), keys.js (undo/redo shortcuts, arrow keys, [ and ]), tensors.js, stagegrid.js (a stage's TP ratios and
// CP x TP grid: tile tags, CP group outlines, the stage card's ratios and cp fields), patch.js (incremental redraws:
// only the parts whose markup changed are updated, in place), canvas.js (rendering, events).

import { Canvas } from "./canvas.js";

export { layout } from "./layout.js";

export default {
  render({ model, el }) {
    const c = new Canvas(model, el);
    return () => c.destroy();
  },
};
