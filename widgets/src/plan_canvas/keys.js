// The keyboard's pure part: the undo/redo shortcuts (the history itself is the PlanEditor's, in Python: the canvas
// only sends {op: "undo"} / {op: "redo"}), arrow-key moves between tiles and [ / ] stepping through the stages.

// "undo" for Ctrl/Cmd+Z, "redo" for Ctrl/Cmd+Shift+Z and Ctrl/Cmd+Y, else null (e: a KeyboardEvent's fields).
export function historyShortcut(e) {
  const mod = e.ctrlKey || e.metaKey;
  if (mod && (e.key === "z" || e.key === "Z")) return e.shiftKey ? "redo" : "undo";
  if (mod && (e.key === "y" || e.key === "Y")) return "redo";
  return null;
}

export const ARROWS = { ArrowLeft: [-1, 0], ArrowRight: [1, 0], ArrowUp: [0, -1], ArrowDown: [0, 1] };

// The rank an arrow key moves the focus to from rank r: of the tiles ahead in that direction (by their top-left
// corners), the one with the least distance along it plus 3x the distance across; null when none is ahead.
export function nextTile(tiles, r, key) {
  const a = tiles[r];
  const dir = ARROWS[key];
  let best = null;
  for (const b of tiles) {
    if (!b || b.r === r) continue;
    const dx = b.x - a.x, dy = b.y - a.y;
    const along = dx * dir[0] + dy * dir[1];
    if (along <= 0) continue;
    const across = Math.abs(dx * dir[1]) + Math.abs(dy * dir[0]);
    const cost = along + 3 * across;
    if (!best || cost < best.cost) best = { r: b.r, cost };
  }
  return best ? best.r : null;
}

// The stage [p, s] that d (+1: "]", -1: "[") steps to from the selected one ([p, s] or null: from before the
// first), through every stage of every pipeline in order, wrapping around; null when there is no stage.
export function stepStage(pipelines, selected, d) {
  const all = (pipelines || []).flatMap((p) => p.stages.map((s) => [s.p, s.s]));
  if (!all.length) return null;
  const i = selected ? all.findIndex((x) => x[0] === selected[0] && x[1] === selected[1]) : -1;
  return all[(i + d + all.length) % all.length];
}
