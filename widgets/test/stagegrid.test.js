// A stage's TP ratios and CP x TP grid on the canvas: the tag on each tile (its share when the stage is uneven, its
// cp·tp coordinates with context parallelism), one dashed outline per CP group inside the stage's hull, the stage
// card's ratios and cp fields, and the messages those fields send (each calls PlanEditor.set_ratios / set_cp).
import { test } from "node:test";
import assert from "node:assert/strict";
import { layout } from "../src/plan_canvas/layout.js";
import { hull } from "../src/plan_canvas/hull.js";
import { CP_GROW, cpGroupsSvg, cpMessage, ratiosMessage, stageControls, tileTag } from "../src/plan_canvas/stagegrid.js";
import { Canvas } from "../src/plan_canvas/canvas.js";

const CLUSTER = { nodes: [{ i: 0, host: "node0", kind: "H800", sub: "", ranks: [0, 1, 2, 3] }, { i: 1, host: "node1", kind: "H20", sub: "", ranks: [4, 5, 6, 7] }], num_ranks: 8, num_layers: 4 };

// the view's parts as _canvas_view.py sends them (only what the stage area and the stage card read)
function tile(r, extra = {}) {
  return { r, kind: r < 4 ? "H800" : "H20", p: -1, s: -1, flag: "", failed: false, title: `rank ${r}`, share: "", share_pct: null, uneven: false, cp: null, grid: "", ...extra };
}
function stage(extra) {
  return { p: 0, s: 0, ranks: [], ranks_text: "", tp: 1, cp: 1, shape: "TP1", layers: [0, 3], recompute: false, fill: "#abc", line: "#1f77b4", ink: "#000",
    kinds: "", nodes: 1, mem: null, mem_text: "", mem_kind: "", problems: [], selected: false, ratios: null, ratios_text: "", uneven: false, shares: null,
    cp_groups: null, cp_options: [1], ...extra };
}
// ratios 3:1 on ranks 0, 1 (pipeline 0) and CP2×TP2 on ranks 4-7 (pipeline 1)
const UNEVEN = stage({ ranks: [0, 1], ranks_text: "0,1", kinds: "2×H800", tp: 2, shape: "TP2", ratios: [3, 1], ratios_text: "3:1", uneven: true, shares: ["3/4", "1/4"], cp_groups: [[0, 1]], cp_options: [1, 2] });
const CP = stage({ p: 1, ranks: [4, 5, 6, 7], ranks_text: "4-7", kinds: "4×H20", tp: 2, cp: 2, shape: "CP2×TP2", shares: ["1/2", "1/2", "1/2", "1/2"], cp_groups: [[4, 5], [6, 7]], cp_options: [1, 2, 4], line: "#ff7f0e" });
const VIEW = {
  selected: [0, 0], pipelines: [{ p: 0, stages: [UNEVEN], problems: [] }, { p: 1, stages: [CP], problems: [] }], comm: {},
  tiles: [tile(0, { p: 0, s: 0, layers: "L0–3", share: "3/4", share_pct: 75, uneven: true, cp: [0, 0] }), tile(1, { p: 0, s: 0, layers: "L0–3", share: "1/4", share_pct: 25, uneven: true, cp: [0, 1] }),
    tile(2), tile(3),
    ...[4, 5, 6, 7].map((r, i) => tile(r, { p: 1, s: 0, layers: "L0–3", share: "1/2", share_pct: 50, cp: [i >> 1, i & 1], grid: `cp${i >> 1}·tp${i & 1}` }))],
};

// a Canvas without a DOM: the rendering methods are pure functions of the view and the layout
function canvas() {
  const c = Object.create(Canvas.prototype);
  Object.assign(c, { model: { get: (k) => (k === "cluster" ? CLUSTER : k === "view" ? VIEW : []) }, sel: new Set(), focus: null, inspect: null, routes: new Map(), lay: layout(CLUSTER, 900), sent: [] });
  c.send = (m) => c.sent.push(m);
  return c;
}
const tileHtml = (html, r) => {
  const m = html.match(new RegExp(`<div class="hc-tile[^"]*"[^>]*data-rank="${r}"[\\s\\S]*?</div></div>`));
  assert.ok(m, `no tile ${r}`);
  return m[0];
};

test("tile tag: the share of an uneven stage's device, the cp·tp coordinates of a CP stage's, nothing for an even TP stage", () => {
  assert.match(tileTag(VIEW.tiles[0]), /<span class="hc-tshare">3\/4<\/span>/);
  assert.match(tileTag(VIEW.tiles[0]), /title="holds 3\/4 \(75%\) of every TP-split tensor of its stage"/);
  assert.match(tileTag(VIEW.tiles[1]), />1\/4</);
  assert.match(tileTag(VIEW.tiles[7]), /<span class="hc-tgrid">cp1·tp1<\/span>/);
  assert.match(tileTag(VIEW.tiles[7]), /context-parallel group 1, TP rank 1/);
  assert.doesNotMatch(tileTag(VIEW.tiles[7]), /hc-tshare/);  // an even CP stage: 1/2 each is not worth a tag
  assert.equal(tileTag(tile(2)), "");  // unused
  assert.equal(tileTag(tile(3, { p: 0, s: 0, share: "1/2", share_pct: 50, cp: [0, 1] })), "");  // even TP2
  assert.equal(tileTag({ ...VIEW.tiles[0], share: "" }), "");  // ratios that do not fit its stage: no share shown
});

test("stage area: each device tile carries its share or its cp·tp coordinates", () => {
  const html = Canvas.prototype.stageArea.call(canvas(), VIEW, CLUSTER);
  assert.match(tileHtml(html, 0), /<div class="hc-tlayers">L0–3<span class="hc-ttag"[^>]*><span class="hc-tshare">3\/4<\/span><\/span><\/div>/);
  assert.match(tileHtml(html, 1), /hc-tshare">1\/4</);
  for (const [r, grid] of [[4, "cp0·tp0"], [5, "cp0·tp1"], [6, "cp1·tp0"], [7, "cp1·tp1"]]) assert.match(tileHtml(html, r), new RegExp(`hc-tgrid">${grid}<`));
  assert.doesNotMatch(tileHtml(html, 2), /hc-ttag/);
  // a picked tensor: the tiles show its shards instead (the uneven boxes come from Python's shard grid)
  const t = { name: "w", shape: [4, 4], subgroups: [{ k: 0, ranks: [0], ranks_text: "0", ds: "R", colour: "#f00" }, { k: 1, ranks: [1], ranks_text: "1", ds: "R", colour: "#0f0" }],
    shards: { 0: { k: 0, box: [0, 1, 0, 0.75], rects: [[0, 1, 0, 0.75]], partial: "", dup: 0, text: "" }, 1: { k: 1, box: [0, 1, 0.75, 1], rects: [[0, 1, 0.75, 1]], partial: "", dup: 0, text: "" } }, cuts_r: [0, 1], cuts_c: [0, 0.75, 1] };
  const picked = Canvas.prototype.stageArea.call(canvas(), { ...VIEW, tensor: t }, CLUSTER);
  assert.doesNotMatch(picked, /hc-ttag|hc-cpgroup/);
  const gw = layout(CLUSTER, 900).tiles[0].w - 10;
  assert.match(tileHtml(picked, 0), new RegExp(`<rect class="hc-shard" x="0.0" y="0.0" width="${(0.75 * gw).toFixed(1)}"`));
});

test("tiles: the tooltip and the memory figure are live fields, so an edit that changes only them re-parses no tile", () => {
  const at = (mem, text) => ({ ...VIEW, tiles: VIEW.tiles.map((t) => (t.r === 0 ? { ...t, mem, mem_text: text, title: `rank 0\nneeds ${text}` } : t)) });
  const [before] = Canvas.prototype.stageParts.call(canvas(), at(0.5, "40/80 GiB"), CLUSTER).tiles;
  const [after] = Canvas.prototype.stageParts.call(canvas(), at(0.95, "76/80 GiB"), CLUSTER).tiles;
  assert.equal(before[0], "t0");
  assert.equal(after[1], before[1]);  // the same markup: patchChildren keeps the element and only writes the fields
  assert.doesNotMatch(after[1], /76\/80|needs/);
  assert.deepEqual(after[2], [["", "title", "rank 0\nneeds 76/80 GiB"], [".hc-tbar", "title", "76/80 GiB"],
    [".hc-tbar > span", "style", "width:95%;background:#d4a72c"], [".hc-tmem", "text", "76/80 GiB"]]);
});

test("CP grid: one dashed outline per CP group, around its own TP ranks, inside the stage's hull", () => {
  const lay = layout(CLUSTER, 900);
  const svg = cpGroupsSvg(lay, CP);
  const groups = [...svg.matchAll(/<g class="hc-cpgroup" data-cp="(\d)" data-cp-stage="1,0">/g)].map((m) => +m[1]);
  assert.deepEqual(groups, [0, 1]);
  assert.match(svg, /stroke="#ff7f0e"[^>]*stroke-dasharray/);
  // the outline of group 0 is the hull of tiles 4 and 5 grown by CP_GROW: it keeps off tile 6
  const path = svg.match(/data-cp="0"[\s\S]*?<path d="([^"]+)"/)[1];
  const want = hull([lay.tiles[4], lay.tiles[5]], CP_GROW).edges.map((e) => `M${e[0]},${e[1]}L${e[2]},${e[3]}`).join("");
  assert.equal(path, want);
  const xs = [...path.matchAll(/[ML](-?[\d.]+),/g)].map((m) => +m[1]);
  assert.ok(Math.max(...xs) === lay.tiles[5].x + lay.tiles[5].w + CP_GROW && Math.max(...xs) < lay.tiles[6].x);
  assert.ok(CP_GROW < 5);  // inside the stage's hull (HULL = 5 px)
  assert.equal(cpGroupsSvg(lay, UNEVEN), "");  // one CP group: no inner outline
  assert.equal(cpGroupsSvg(lay, stage({ cp: 3, cp_groups: null })), "");  // a cp that does not divide: none
  const html = Canvas.prototype.stageArea.call(canvas(), VIEW, CLUSTER);
  assert.equal((html.match(/class="hc-cpgroup"/g) || []).length, 2);
});

test("stage card: a ratios field with the shares and a cp field, each naming its stage", () => {
  const row = stageControls(UNEVEN);
  assert.match(row, /<input class="hc-text" data-op="ratios" data-p="0" data-s="0" data-key="ratios-0-0" value="3:1" placeholder="even"/);
  assert.match(row, /<small class="hc-shares"[^>]*>= 3\/4 · 1\/4<\/small>/);
  assert.match(row, /<input class="hc-num" type="number" min="1" max="2" data-op="cp" data-p="0" data-s="0" data-key="cp-0-0" value="1"/);
  assert.match(row, /cp can be 1, 2"/);
  const cp = stageControls(CP);
  assert.match(cp, /data-op="ratios" data-p="1" data-s="0" data-key="ratios-1-0" value=""/);
  assert.match(cp, /max="4" data-op="cp" data-p="1" data-s="0" data-key="cp-1-0" value="2"/);
  assert.match(cp, /cp can be 1, 2, 4/);
  assert.doesNotMatch(cp, /hc-shares/);  // even: no shares
  const [card, fields] = Canvas.prototype.pipelineCard.call(canvas(), VIEW.pipelines[0], VIEW);
  assert.ok(card.includes(row));
  assert.match(card, /<small>TP2 3:1 · 2×H800<\/small>/);  // the stage row names its ratios beside its shape
  assert.deepEqual(fields, []);  // no memory figure in this view: no live fields
  assert.match(Canvas.prototype.pipelineCard.call(canvas(), VIEW.pipelines[1], VIEW)[0], /<small>CP2×TP2 · 4×H20<\/small>/);
  // a memory figure is a live field of the card (written into its element, not parsed: patch.js setFields)
  const st = { ...VIEW.pipelines[0].stages[0], mem: 0.95, mem_text: "76.0/80.0 GiB", mem_kind: "estimate" };
  const [withMem, live] = Canvas.prototype.pipelineCard.call(canvas(), { ...VIEW.pipelines[0], stages: [st] }, VIEW);
  const at = `.hc-stage[data-stage="${st.p},${st.s}"] .hc-mem`;
  assert.match(withMem, /<span class="hc-mem"><span class="hc-bar"><span><\/span><\/span><span class="hc-memt"><\/span><\/span>/);
  assert.deepEqual(live, [[at, "title", "fullest device of the stage, estimate"],
    [`${at} .hc-bar > span`, "style", "width:95%;background:#d4a72c"], [`${at} .hc-memt`, "text", "76.0/80.0 GiB (estimate)"]]);
});

test("the fields' messages: ratios as typed, cp as a number (nothing while it is empty)", () => {
  assert.deepEqual(ratiosMessage(0, 1, " 3:1 "), { op: "ratios", p: 0, s: 1, value: "3:1" });
  assert.deepEqual(ratiosMessage(2, 0, ""), { op: "ratios", p: 2, s: 0, value: "" });  // empty: back to even
  assert.deepEqual(ratiosMessage(0, 0, "3:x"), { op: "ratios", p: 0, s: 0, value: "3:x" });  // Python says why not
  assert.deepEqual(cpMessage(1, 0, "2"), { op: "cp", p: 1, s: 0, value: 2 });
  assert.deepEqual(cpMessage(1, 0, "0"), { op: "cp", p: 1, s: 0, value: 0 });  // an error shown live, at the stage
  assert.deepEqual(cpMessage(1, 0, "1.5"), { op: "cp", p: 1, s: 0, value: 1.5 });
  assert.equal(cpMessage(1, 0, ""), null);
  assert.equal(cpMessage(1, 0, "abc"), null);
});

test("a change in the stage card sends its message (and the layers fields read their own row)", () => {
  const c = canvas();
  const field = (op, p, s, value, extra = {}) => ({ dataset: { op, p: String(p), s: String(s), ...extra }, value, closest: () => null });
  Canvas.prototype.onChange.call(c, { target: field("ratios", 0, 1, "3:1") });
  Canvas.prototype.onChange.call(c, { target: field("cp", 1, 0, "2") });
  Canvas.prototype.onChange.call(c, { target: field("cp", 1, 0, "") });
  // the layers fields: their own stage row, found from the field (a tile of the stage has data-stage too)
  const inputs = { first: { value: "1" }, last: { value: "3" } };
  const row = { querySelector: (q) => inputs[q.match(/data-which="(\w+)"/)[1]] };
  Canvas.prototype.onChange.call(c, { target: { ...field("layers", 0, 1, "1", { which: "first" }), closest: (q) => (q === ".hc-stage" ? row : null) } });
  assert.deepEqual(c.sent, [{ op: "ratios", p: 0, s: 1, value: "3:1" }, { op: "cp", p: 1, s: 0, value: 2 }, { op: "layers", p: 0, s: 1, first: 1, last: 3 }]);
});
