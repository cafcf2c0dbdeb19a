// The canvas widget: renders the view Python syncs (toolbar, verdict, side cards, the stage area with its hulls,
// arrows, labels and tiles) and turns every user action into a message {op, ...} (see index.js).

import { esc } from "../common/esc.js";
import { SVG, PAD, NODE_GAP, HULL, LANE, LINK, ZERO_LEVELS } from "./constants.js";
import { layout } from "./layout.js";
import { bbox, byNode, edgePoint } from "./geometry.js";
import { hullSvg } from "./hull.js";
import { channels, route, segments, laneShift } from "./routing.js";
import { headBoxes, placeLabel } from "./labels.js";
import { isClick, isDrag, tilesInBox, tilesInLasso } from "./selection.js";
import { historyShortcut, nextTile, stepStage } from "./keys.js";
import { groupOf } from "./tensors.js";
import { cpGroupsSvg, cpMessage, ratiosMessage, stageControls, tileTag } from "./stagegrid.js";
import { patchChildren, resetControls } from "./patch.js";

// The live fields of a memory bar and its figure (patch.js setFields): the tooltip (on `bar`), the fill's width and
// colour (red past 100%, amber past 90%), the figure's text.
function memFields(bar, fill, text, mem, title, label) {
  const colour = mem > 1 ? "#d62728" : mem > 0.9 ? "#d4a72c" : "#2da44e";
  return [[bar, "title", title], [fill, "style", `width:${Math.min(100, mem * 100).toFixed(0)}%;background:${colour}`], [text, "text", label]];
}

const BODY = `<div class="hc-body"><div class="hc-area"></div><div class="hc-side"></div></div>`;

export class Canvas {
  constructor(model, el) {
    this.model = model;
    this.el = el;
    this.sel = new Set();
    this.focus = null;
    this.mode = "box";
    this.inspect = null;  // the rank whose card the side panel shows (a plain click)
    this.routes = new Map();  // routes through the gaps, per layout (arrows and a Reshard's messages)
    this.width = 0;
    this.root = document.createElement("div");
    this.root.className = "hspmd-canvas";
    this.root.setAttribute("data-lm-suppress-shortcuts", "true");
    el.appendChild(this.root);
    this.root.addEventListener("pointerdown", (e) => this.onPointerDown(e));
    this.root.addEventListener("click", (e) => this.onClick(e));
    this.root.addEventListener("change", (e) => this.onChange(e));
    this.root.addEventListener("keydown", (e) => this.onKey(e));
    this.gesture = false;
    this.pending = false;
    // "▶ Launch locally" clicked: the button is disabled and "starting workers…" shown at once, before the kernel
    // (busy loading the runtime and starting processes) answers; its view takes over once it says launching.
    this.launch = { at: 0, acked: false };
    this.onView = () => {
      const can = (this.model.get("view") || {}).can || {};
      if (this.launch.at && can.launching) this.launch.acked = true;
      else if (this.launch.acked) this.launch = { at: 0, acked: false };
      return this.gesture ? (this.pending = true) : this.render();
    };
    // the tensor names for the picker's search box: one datalist beside the canvas, rebuilt only when they change
    this.names = document.createElement("datalist");
    this.names.id = `hc-tensors-${this.uid()}`;
    el.appendChild(this.names);
    this.onTensors = () => {
      this.names.innerHTML = (model.get("tensors") || []).flatMap((g) => g[1]).map((n) => `<option value="${esc(n)}">`).join("");
      this.onView();
    };
    model.on("change:view", this.onView);
    model.on("change:tensors", this.onTensors);
    this.ro = new ResizeObserver(() => {
      const area = this.root.querySelector(".hc-area");
      const w = area ? area.clientWidth : 0;
      if (w && Math.abs(w - this.width) > 8) this.render();
    });
    this.ro.observe(this.root);
    this.onTensors();
  }

  destroy() {
    this.model.off("change:view", this.onView);
    this.model.off("change:tensors", this.onTensors);
    this.ro.disconnect();
  }

  send(msg) {
    this.model.send(msg);
  }

  // ---- rendering -------------------------------------------------------------------------------------------
  // A redraw patches the canvas (patch.js): each part -- the toolbar, the verdict, each side card, each pipeline's
  // card, the stage area's layers, each tile -- is an HTML string, and only the parts whose string changed are
  // re-parsed and updated in place.  The area's width is read before anything is written, so the redraw never
  // forces a layout of half-built markup.
  render() {
    const view = this.model.get("view") || {};
    const cluster = this.model.get("cluster") || { nodes: [], num_ranks: 0 };
    if (!cluster.nodes.length) return;
    const keep = this.captureFocus();
    let area = this.root.querySelector(".hc-area");
    if (!area) {  // the first redraw: the frame, then its width (the one layout it forces)
      this.patch(this.root, [...this.topParts(view), ["body", BODY]]);
      area = this.root.querySelector(".hc-area");
    }
    this.width = area.clientWidth || this.root.clientWidth || 900;
    const lw = Math.max(this.width - 8, 300);  // room for the hulls around the outer tiles
    if (!this.lay || this.layCluster !== cluster || this.layWidth !== lw) {  // a new layout only when it changes
      this.lay = layout(cluster, lw);
      this.layCluster = cluster;
      this.layWidth = lw;
    }
    this.patch(this.root, [...this.topParts(view), ["body", BODY]]);
    this.patch(this.root.querySelector(":scope > .hc-toolbar"), this.toolbarParts(view));
    const side = this.root.querySelector(".hc-side");
    this.patch(side, this.sideParts(view));
    const stages = side.querySelector(":scope > .hc-stages");
    this.patch(stages, this.stagesParts(view));
    this.drawStageArea(area, view, cluster);
    this.root.dataset.version = String(view.version ?? "");
    this.root.dataset.valid = String(view.verdict?.level !== "error");
    this.root.dataset.comm = view.comm?.state || "";
    resetControls(this.root.querySelectorAll("input, select"), keep && keep.typed ? keep.el : null);
    this.restoreFocus(keep);
  }

  // Patch `parent`'s keyed children (patch.js); `svg`: they are SVG elements, parsed inside an <svg>.
  patch(parent, parts, svg = false) {
    if (!this.tpl) this.tpl = document.createElement("template");
    return patchChildren(parent, parts, (html) => {
      this.tpl.innerHTML = svg ? `<svg>${html}</svg>` : html;
      return svg ? this.tpl.content.firstElementChild : this.tpl.content;
    });
  }

  // The stage area: its box, then its layers (the SVG under the tiles, the tiles one by one, the labels, the SVG
  // the box and lasso draw on, the picked tiles' bar).
  drawStageArea(area, view, cluster) {
    const parts = this.stageParts(view, cluster);
    let sa = area.firstElementChild;
    if (!sa || !sa.classList.contains("hc-stagearea")) {
      area.replaceChildren();
      sa = document.createElement("div");
      sa.className = "hc-stagearea";
      area.appendChild(sa);
    }
    const style = `height:${parts.height}px;width:${parts.width}px`;
    if (sa.getAttribute("style") !== style) sa.setAttribute("style", style);
    this.patch(sa, [["under", parts.underBox], ["tiles", `<div class="hc-tiles"></div>`], ["labels", parts.labels], ["over", parts.over],
      ...(parts.selbar ? [["selbar", parts.selbar]] : [])]);
    this.patch(sa.querySelector(":scope > .hc-under"), parts.underParts, true);
    this.patch(sa.querySelector(":scope > .hc-tiles"), parts.tiles);
  }

  captureFocus() {
    const a = document.activeElement;
    if (!a || !this.root.contains(a) || !a.dataset.key) return null;
    return { el: a, key: a.dataset.key, value: a.value, start: a.selectionStart, end: a.selectionEnd, typed: a.dataset.typed === "1" };
  }

  // Focus stays where it was: on the same element when the redraw kept it, else on its successor (the element
  // with the same data-key), with the text typed into it.
  restoreFocus(k) {
    if (!k) return;
    if (k.el.isConnected && this.root.contains(k.el) && document.activeElement === k.el) return;
    const el = this.root.querySelector(`[data-key="${k.key}"]`);
    if (!el) return;
    if (k.typed && "value" in el) {
      el.value = k.value;
      el.dataset.typed = "1";
    }
    el.focus({ preventScroll: true });
    try { if (k.start != null) el.setSelectionRange(k.start, k.end); } catch (_) { /* not a text input */ }
  }

  // The toolbar as one string (a redraw patches its groups: toolbarParts).
  toolbar(v) {
    return `<div class="hc-toolbar" role="toolbar" aria-label="plan editor">${this.toolbarParts(v).map((p) => p[1]).join("")}</div>`;
  }

  // The toolbar's groups, keyed (undo/redo, select mode, settings, tensor picker, file, run).
  // Whether a click on Launch waits for the kernel's answer (at most a minute: a kernel that never answers
  // gives the button back).
  launchPending() {
    const l = this.launch; // absent on a canvas not built by the constructor (a test's bare prototype)
    return !!l && l.at > 0 && Date.now() - l.at < 60000;
  }

  toolbarParts(v) {
    const can = v.can || {};
    const launching = can.launching || this.launchPending();
    const btn = (op, text, ok, tip, extra = "") =>
      `<button class="hc-btn" data-op="${op}" data-key="btn-${op}" ${ok ? "" : "disabled"} title="${esc(tip)}" ${extra}>${text}</button>`;
    const groups = this.model.get("tensors") || [];
    const gsel = this.group || (v.tensor_name ? groupOf(groups, v.tensor_name) : "");
    const names = (groups.find((g) => g[0] === gsel) || [null, []])[1];
    const history = `<span class="hc-group">${btn("undo", "↶ Undo", can.undo, "undo the last change (Ctrl+Z)")}${btn("redo", "↷ Redo", can.redo, "redo (Ctrl+Shift+Z or Ctrl+Y)")}</span>`;
    const mode = `<span class="hc-group" title="dragging on the empty canvas selects devices">select
        <button class="hc-btn hc-toggle ${this.mode === "box" ? "on" : ""}" data-op="mode" data-mode="box" data-key="mode-box" aria-pressed="${this.mode === "box"}">▭ box</button><button class="hc-btn hc-toggle ${this.mode === "lasso" ? "on" : ""}" data-op="mode" data-mode="lasso" data-key="mode-lasso" aria-pressed="${this.mode === "lasso"}">◯ lasso</button></span>`;
    const settings = `<span class="hc-group"><label>schedule <select data-op="schedule" data-key="schedule">${["1f1b", "gpipe"].map((s) => `<option ${s === v.schedule ? "selected" : ""}>${s}</option>`).join("")}</select></label>
        <label title="what the pipelines shard (ZeRO): 1 the fp32 master weights and Adam states, 2 also the gradients, 3 also the weights (gathered around each use)">ZeRO <select data-op="zero" data-key="zero">${ZERO_LEVELS.map(([z, what]) => `<option value="${z}" ${z === (v.zero ?? (v.zero1 ? 1 : 0)) ? "selected" : ""}>${z}: ${what}</option>`).join("")}</select></label>
        <label title="samples per step; pinned: edits never change it (${esc(v.batch_source)})">global batch <input class="hc-num" type="number" min="1" data-op="batch" data-key="batch" value="${v.global_batch ?? ""}"></label></span>`;
    const picker = `<span class="hc-group hc-picker"><label>tensor <select data-op="tgroup" data-key="tgroup" aria-label="tensor group"><option value="">—</option>${groups.map((g) => `<option value="${esc(g[0])}" ${g[0] === gsel ? "selected" : ""}>${esc(g[0])} (${g[1].length})</option>`).join("")}</select></label><select data-op="tname" data-key="tname" aria-label="tensor">${names.length ? `<option value="">pick…</option>` : ""}${names.map((n) => `<option ${n === v.tensor_name ? "selected" : ""} value="${esc(n)}">${esc(gsel && n.startsWith(gsel + ".") ? n.slice(gsel.length + 1) : n)}</option>`).join("")}</select>
        <input class="hc-text" list="hc-tensors-${this.uid()}" placeholder="or type a name" data-op="tensor" data-key="tensor" value="${esc(v.tensor_name)}" size="18">${v.tensor_name ? btn("untensor", "✕", true, "clear the tensor") : ""}</span>`;
    const file = `<span class="hc-group"><input class="hc-text" data-key="path" data-role="path" value="${esc(this.path || "strategy.json")}" size="14" title="file for Save / Load">${btn("save", "Save", can.save, can.save ? "save the plan shown as strategy JSON" : "blocked: " + can.save_why)}${btn("load", "Load", true, "load a strategy JSON")}</span>`;
    const run = `<span class="hc-group">${btn("timeline", "Timeline", can.timeline, can.timeline ? "draw the simulated timeline of the plan shown" : "the plan shown does not simulate")}${launching ? btn("launch", "⏳ starting workers…", false, "the workers of this plan are starting") : btn("launch", "▶ Launch locally", can.launch, can.launch ? "train the plan shown on this machine (hspmd_sdk.launch)" : "blocked: " + can.launch_why)}${can.job ? btn("apply", "⇄ Apply to running job", can.apply, can.apply ? "job.switch(editor.program) at the job's next step boundary" : "blocked: " + can.apply_why) : ""}</span>`;
    return [["history", history], ["mode", mode], ["settings", settings], ["tensor", picker], ["file", file], ["run", run]];
  }

  uid() {
    if (!this._uid) this._uid = Math.random().toString(36).slice(2, 8);
    return this._uid;
  }

  // The canvas's first children, keyed for patch.js: the toolbar, the verdict, the message and the stale note.
  topParts(v) {
    const vd = v.verdict || { level: "error", text: "" };
    const c = v.counts || {};
    const parts = [["toolbar", `<div class="hc-toolbar" role="toolbar" aria-label="plan editor"></div>`], ["verdict", `<div class="hc-verdict hc-${vd.level}" role="status" aria-live="polite"><span class="hc-headline">${esc(vd.text)}</span>
      <span class="hc-counts">${c.errors ? `<b class="hc-e">${c.errors} error(s)</b>` : ""} ${c.warnings ? `<b class="hc-w">${c.warnings} warning(s)</b>` : ""}</span></div>`]];
    const message = this.launchPending() && !(v.can || {}).launching ? "starting workers…" : v.message;
    if (message) parts.push(["message", `<div class="hc-message" role="status">${esc(message)}</div>`]);
    if (v.timeline_stale) parts.push(["stale", `<div class="hc-stale">⚠ the timeline below is of an earlier plan: press Timeline to redraw it</div>`]);
    return parts;
  }

  // The side panel's cards, keyed: the inspected device, the picked tensor, the general problems, the stages (an
  // empty card: its rows are stagesParts) and the communication.
  sideParts(v) {
    const parts = [];
    const inspect = this.inspectCard(v);
    if (inspect) parts.push(["inspect", inspect]);
    if (v.tensor) parts.push(["tensor", this.tensorLegend(v.tensor)]);
    else if (v.tensor_error) parts.push(["tensor", `<div class="hc-card hc-error">${esc(v.tensor_error)}</div>`]);
    const general = (v.problems || []).map((p) => `<li class="hc-${p.level}">${p.level === "error" ? "✗ error" : "⚠ warning"} · <b>${esc(p.where)}</b>: ${esc(p.text)}</li>`).join("");
    if (general) parts.push(["problems", `<div class="hc-card"><ul class="hc-problems">${general}</ul></div>`]);
    parts.push(["stages", `<div class="hc-card hc-stages"></div>`], ["comm", this.commCard(v.comm || {})]);
    return parts;
  }

  // The stages card's rows, keyed: its head, the help line, one card per pipeline, "+ pipeline".
  stagesParts(v) {
    return [["head", `<div class="hc-card-head">Stages <small>click a chip to select its stage</small></div>`],
      ["help", `<div class="hc-help hc-note" data-role="help">click a tile: inspect it (nothing moves) · Shift/Ctrl+click: pick more · <b>move</b>: drag tiles onto a stage chip, "+ stage" or "+ pipeline", or <b>Alt+click</b> a tile (it joins or leaves the selected stage), or Enter (the picked tiles join it)</div>`],
      ...(v.pipelines || []).map((p) => [`p${p.p}`, ...this.pipelineCard(p, v)]),
      ["add", `<div class="hc-drop hc-newpipe" role="button" tabindex="0" data-op="add_pipeline" data-key="add-pipeline" data-drop="${(v.pipelines || []).length},0" title="click: add a pipeline (one stage with every layer, no devices yet); drop devices here: a new pipeline with them">+ pipeline</div>`]];
  }

  // The card of the inspected device: what its tile's tooltip says, its stage's problems, and the explicit moves.
  inspectCard(v) {
    const r = this.inspect;
    const t = r == null ? null : (v.tiles || []).find((x) => x.r === r);
    if (!t) return "";
    const st = t.p >= 0 ? (v.pipelines[t.p] || { stages: [] }).stages[t.s] : null;
    const probs = st ? st.problems.map((x) => `<div class="hc-msg hc-${x.level}">${x.level === "error" ? "✗" : "⚠"} ${esc(x.text)}</div>`).join("") : "";
    const sel = v.selected;
    const here = sel && t.p === sel[0] && t.s === sel[1];
    const lines = String(t.title || "").split("\n").map((l) => `<div>${esc(l)}</div>`).join("");
    return `<div class="hc-card hc-inspect" data-rank="${r}"><div class="hc-card-head">Device ${r} <small>inspecting: nothing moved</small>
      <button class="hc-x" data-op="inspect_close" title="close (Esc)">✕</button></div>${lines}${probs}
      <div class="hc-actions">${t.p >= 0 ? `<button class="hc-btn hc-small" data-op="select" data-p="${t.p}" data-s="${t.s}" title="select its stage (clicked chips and Enter act on the selected stage)">select P${t.p} S${t.s}</button>` : ""}
      ${sel && !here ? `<button class="hc-btn hc-small" data-op="inspect_move" data-rank="${r}" title="move this device into the selected stage (undo: Ctrl+Z)">→ move into P${sel[0]} S${sel[1]}</button>` : ""}
      ${t.p >= 0 ? `<button class="hc-btn hc-small" data-op="inspect_unassign" data-rank="${r}" title="take it out of its stage (undo: Ctrl+Z)">take out of its stage</button>` : ""}</div></div>`;
  }

  // A pipeline's card: [html, fields] (its stages' memory figures are live fields, patch.js setFields).
  pipelineCard(p, v) {
    const fields = [];
    const rows = p.stages.map((s) => {
      const probs = s.problems.map((x) => `<div class="hc-msg hc-${x.level}">${x.level === "error" ? "✗" : "⚠"} ${esc(x.text)}</div>`).join("");
      const mem = s.mem != null ? `<span class="hc-mem"><span class="hc-bar"><span></span></span><span class="hc-memt"></span></span>` : `<span class="hc-mem hc-note">memory: not estimated</span>`;
      if (s.mem != null) {  // live fields of the card (patch.js setFields)
        const at = `.hc-stage[data-stage="${s.p},${s.s}"] .hc-mem`;
        fields.push(...memFields(at, `${at} .hc-bar > span`, `${at} .hc-memt`, s.mem, `fullest device of the stage, ${s.mem_kind}`,
          `${s.mem_text}${s.mem_kind === "estimate" ? " (estimate)" : ""}`));
      }
      const nl = this.model.get("cluster").num_layers || 1;
      return `<div class="hc-stage ${s.selected ? "hc-selected" : ""} ${s.problems.some((x) => x.level === "error") ? "hc-has-error" : ""}" data-stage="${s.p},${s.s}">
        <div class="hc-srow"><button class="hc-chip hc-drop" data-op="select" data-key="chip-${s.p}-${s.s}" data-p="${s.p}" data-s="${s.s}" data-drop="${s.p},${s.s}" style="background:${s.fill};border-color:${s.line};color:${s.ink || "#1b1f24"}" title="select pipeline ${s.p} stage ${s.s} (clicked devices join it); drop devices here" aria-pressed="${s.selected}">${s.selected ? "▶ " : ""}S${s.s}</button>
        <span class="hc-ranks" title="${s.cp > 1 ? `${s.cp} context-parallel groups of ${s.tp} TP rank${s.tp > 1 ? "s" : ""} (the sequence split over the groups)` : "TP group"}">${esc(s.ranks_text)} <small>${esc(s.shape || `TP${s.tp}`)}${s.ratios_text ? " " + esc(s.ratios_text) : ""}${s.kinds ? " · " + esc(s.kinds) : ""}</small></span>
        <button class="hc-x" data-op="remove_stage" data-p="${s.p}" data-s="${s.s}" title="remove this stage (its layers go to a neighbour)">✕</button></div>
        <div class="hc-srow2"><span class="hc-layers">layers <input class="hc-num" type="number" min="0" max="${nl - 1}" data-op="layers" data-which="first" data-p="${s.p}" data-s="${s.s}" data-key="first-${s.p}-${s.s}" value="${s.layers[0]}" aria-label="first layer">–<input class="hc-num" type="number" min="0" max="${nl - 1}" data-op="layers" data-which="last" data-p="${s.p}" data-s="${s.s}" data-key="last-${s.p}-${s.s}" value="${s.layers[1]}" aria-label="last layer"></span>
        <label class="hc-rc" title="recompute activations in backward"><input type="checkbox" data-op="recompute" data-p="${s.p}" data-s="${s.s}" ${s.recompute ? "checked" : ""}> recompute</label>${mem}</div>
        ${stageControls(s)}${probs}</div>`;
    }).join("");
    const pprobs = p.problems.map((x) => `<div class="hc-msg hc-${x.level}">${x.level === "error" ? "✗" : "⚠"} ${esc(x.text)}</div>`).join("");
    return [`<div class="hc-pipeline" style="border-color:${p.colour}">
      <div class="hc-phead"><b style="color:${p.colour}">Pipeline ${p.p}</b>
        <label><input class="hc-num" type="number" min="1" data-op="micro" data-which="nmb" data-p="${p.p}" data-key="nmb-${p.p}" value="${p.nmb}" aria-label="micro-batches"> micro-batches</label> ×
        <label>bs <input class="hc-num" type="number" min="1" data-op="micro" data-which="mbs" data-p="${p.p}" data-key="mbs-${p.p}" value="${p.mbs}" aria-label="micro-batch size"></label>
        = ${p.samples} <button class="hc-x" data-op="remove_pipeline" data-p="${p.p}" title="remove this pipeline">✕</button></div>
      ${pprobs}${rows}<div class="hc-drop hc-newstage" role="button" tabindex="0" data-drop="${p.p},${p.stages.length}" data-op="add_stage" data-key="add-stage-${p.p}" data-p="${p.p}" title="click: add a stage; drop devices here: a new stage with them">+ stage</div></div>`,
      fields];
  }

  commCard(c) {
    let rows = "";
    if (c.state === "resolving") rows = `<div class="hc-note">resolving communication (plan_from_strategy + specialize) …</div>`;
    else if (c.state === "none") rows = `<div class="hc-note">communication: not resolved (the plan shown has errors)</div>`;
    for (const a of c.stale ? [] : c.arrows || []) {
      rows += `<div class="hc-commrow" data-op="comm" data-reshard="${esc(a.reshard)}" title="draw this Reshard (comm_figure)">
        <span class="hc-dot" style="background:${LINK[a.cls]}"></span>P${a.p} S${a.from}→S${a.to} <code>${esc(a.reshard)}</code> ${esc(a.label)}
        ${a.redundant ? `<b class="hc-w">×${Math.round(a.redundant)} redundant</b> <button class="hc-btn hc-small" data-op="fix" data-reshard="${esc(a.reshard)}" title="${esc(a.fix)}">show fix</button>` : ""}</div>`;
    }
    if (c.busiest && !c.stale) rows += `<div class="hc-note"><span class="hc-dot" style="background:#6a1b9a"></span>${esc(c.busiest.text)}</div>`;
    if (c.sync && !c.stale) rows += `<div class="hc-note">gradient sync: ${esc(c.sync)}</div>`;
    return `<div class="hc-card hc-comm"><div class="hc-card-head">Communication <small>bytes per step = forward + backward, at the program's shapes${c.bindings ? " (" + esc(c.bindings) + ")" : ""} · click a row for its figure</small></div>${rows}</div>`;
  }

  tensorLegend(t) {
    const subs = t.subgroups.map((g) => `<div><span class="hc-swatch" style="border-color:${g.colour}"></span> <b>G${g.k}</b> [${esc(g.ranks_text)}] <code>${esc(g.ds)}</code></div>`).join("");
    const rs = t.reshard ? `<div class="hc-note"><b>${esc(t.reshard.text)}</b>${t.reshard.more ? ` (${t.reshard.more} more messages not drawn)` : ""}</div>` : "";
    const terms = t.terms || {};
    const term = (k) => `<dt title="${esc(terms[k])}">${esc(k)}</dt><dd>${esc(terms[k])}</dd>`;
    return `<div class="hc-card hc-tensor"><div class="hc-card-head">${esc(t.name)} <small>${esc(JSON.stringify(t.shape))}</small></div>
      <div title="${esc(terms.HSize)}\n${esc(terms.HDim)}"><b>DG Union</b>: ${esc(t.words)}</div><div><code>${esc(t.annotation)}</code></div>${subs}
      <div class="hc-note">${esc(t.grid)}; filled = the box a device holds · Σi/n = summand i of n · Dn = the same shard on n devices</div>
      <dl class="hc-terms" aria-label="the paper's terms">${["HSize", "HDim", "DG Union", "DS"].filter((k) => terms[k]).map(term).join("")}</dl>${rs}</div>`;
  }

  // The stage area as one string (what the tests read; a redraw patches its parts: stageParts).
  stageArea(v, cluster) {
    const p = this.stageParts(v, cluster);
    return `<div class="hc-stagearea" style="height:${p.height}px;width:${p.width}px">
      ${p.underBox.replace("></svg>", `>${p.underParts.map((u) => u[1]).join("")}</svg>`)}
      <div class="hc-tiles">${p.tiles.map((t) => t[1]).join("")}</div>
      ${p.labels}
      ${p.over}
      ${p.selbar}</div>`;
  }

  // The stage area's layers: `underBox` (an SVG) and `underParts` (its keyed groups: markers, nodes, a hull per
  // stage, arrows, leader lines), `tiles` ([key, html, live fields] per device), `labels`,
  // `over` (the SVG that box and lasso selection draw on), `selbar` (the picked tiles' bar, or ""), and its size.
  stageParts(v, cluster) {
    const lay = this.lay;
    const tiles = v.tiles || [];
    const tmode = !!v.tensor;
    let nodes = "";
    // nodes
    for (const b of lay.boxes) {
      const n = b.node;
      nodes += `<rect class="hc-node" x="${b.x}" y="${b.y}" width="${b.w}" height="${b.h}" rx="6"/>
        <text class="hc-node-head" x="${b.x + PAD}" y="${b.y + 14}"><tspan font-weight="600">${esc(n.host)}</tspan> · ${n.ranks.length}×${esc(n.kind)}</text>
        <text class="hc-node-sub" x="${b.x + PAD}" y="${b.y + 27}">${esc(n.sub)}</text>`;
    }
    for (const a of lay.boxes) for (const b of lay.boxes) {
      if (a.y === b.y && b.x > a.x && b.x - (a.x + a.w) < NODE_GAP + 1) nodes += `<line class="hc-net" x1="${a.x + a.w}" y1="${a.y + a.h / 2}" x2="${b.x}" y2="${b.y + b.h / 2}"/>`;
      if (a.x === b.x && b.y > a.y && b.y - (a.y + a.h) < NODE_GAP + 1) nodes += `<line class="hc-net" x1="${a.x + a.w / 2}" y1="${a.y + a.h}" x2="${b.x + b.w / 2}" y2="${b.y}"/>`;
    }
    // hulls: one keyed group per stage (or DG Union subgroup), so an edit redraws the hulls it changed
    const hulls = [];
    const labels = [];
    const badges = [];
    const stages = (v.pipelines || []).flatMap((p) => p.stages);
    if (!tmode) {
      for (const s of stages) {
        if (!s.ranks.length) continue;
        const parts = byNode(lay, s.ranks);
        let under = hullSvg(parts, s.line, s.fill, 0.35, false, "hc-hull") + cpGroupsSvg(lay, s);
        if (parts.length > 1) {
          const cs = parts.map((p) => bbox(p, HULL));
          for (let i = 1; i < cs.length; i++) under += `<line class="hc-crossnode" x1="${cs[i - 1].cx}" y1="${cs[i - 1].cy}" x2="${cs[i].cx}" y2="${cs[i].cy}"/>`;
          badges.push({ x: cs[0].x0, y: cs[0].y0 - 16, cls: "hc-badge hc-badge-red", text: `⚠ P${s.p} S${s.s}: TP across ${parts.length} nodes`, title: "its all-reduces cross the inter-node network" });
        }
        hulls.push([`h${s.p},${s.s}`, `<g>${under}</g>`]);
      }
    } else {
      for (const g of v.tensor.subgroups) {
        const parts = byNode(lay, g.ranks);
        hulls.push([`u${g.k}`, `<g>${hullSvg(parts, g.colour, g.colour, 0.08, true, "hc-union")}</g>`]);
        const b = bbox(parts[0], HULL);
        badges.push({ x: b.x0, y: b.y0 - 16, cls: "hc-badge hc-union-tag", text: `G${g.k} ${g.ds}`, colour: g.colour, title: `subgroup ${g.k} of the DG Union: [${g.ranks_text}] ${g.ds}` });
      }
    }
    // stage-boundary arrows, routed through the gaps
    const comm = v.comm || {};
    const tileRects = lay.tiles.filter(Boolean).map((t) => ({ x0: t.x, y0: t.y, x1: t.x + t.w, y1: t.y + t.h }));
    let over = "";
    const arrows = tmode ? [] : comm.arrows || [];
    const maxB = Math.max(1, ...arrows.map((a) => a.intra + a.inter));
    const ch = arrows.length ? this.channelsOf(lay) : null;
    arrows.forEach((a, i) => {
      const srcParts = byNode(lay, a.src), dstParts = byNode(lay, a.dst);
      if (!srcParts.length || !dstParts.length) return;
      const src = bbox(srcParts[0], HULL), dst = bbox(dstParts[dstParts.length - 1], HULL);
      const key = `a:${srcParts[0].map((t) => t.r).join(",")}>${dstParts[dstParts.length - 1].map((t) => t.r).join(",")}`;
      if (!this.routes.has(key)) {
        let pts = route(ch, src, dst);
        if (!pts) {
          const [x1, y1] = edgePoint(src, dst.cx, dst.cy), [x2, y2] = edgePoint(dst, src.cx, src.cy);
          pts = [[x1, y1], [x2, y2]];
        }
        this.routes.set(key, pts);
      }
      const pts = this.routes.get(key);
      const shifted = laneShift(pts, i, 2.5);
      const width = 2 + 3.5 * Math.sqrt((a.intra + a.inter) / maxB);
      const colour = comm.stale ? "#9aa3ad" : LINK[a.cls];
      over += `<polyline class="hc-arrow ${comm.stale ? "hc-stale-arrow" : ""}" data-reshard="${esc(a.reshard)}" data-p="${a.p}" data-src="${a.src.join(",")}" data-dst="${a.dst.join(",")}" points="${shifted.map((p) => p.join(",")).join(" ")}" stroke="${colour}" stroke-width="${width.toFixed(1)}" stroke-linejoin="round" marker-end="url(#hc-head-${a.cls}${comm.stale ? "-stale" : ""})"/>`;
      if (!comm.stale) labels.push({ a, segs: segments(shifted) });
    });
    // a picked Reshard: its messages as arrows and its collectives as rings
    if (tmode && v.tensor.reshard) {
      let k = 0;
      for (const g of v.tensor.reshard.groups) {
        for (const ranks of g.ranks) {
          const parts = byNode(lay, ranks);
          if (!parts.length || k++ >= 24) continue;
          const b = bbox(parts[0], HULL);
          badges.push({ x: b.x0 + 2, y: b.y1 - 2, cls: "hc-badge hc-collective", text: `⟳ ${g.kind}`,
                        title: `${g.kind} over ranks ${ranks.join(", ")}` });
        }
      }
      // each message routed through the gaps (never across an unrelated tile), its lanes a little apart
      const mch = this.channelsOf(lay);
      v.tensor.reshard.messages.forEach(([s, d, n, cls], i) => {
        const a = lay.tiles[s], b = lay.tiles[d];
        if (!a || !b || s === d) return;
        const pts = this.routeOf(mch, s, d, bbox([a], 2), bbox([b], 2));
        const shifted = laneShift(pts, i, 2);
        over += `<polyline class="hc-msgline" data-src="${s}" data-dst="${d}" points="${shifted.map((q) => q.join(",")).join(" ")}" fill="none" stroke="${LINK[cls]}" stroke-linejoin="round" marker-end="url(#hc-head-${cls})"><title>${s} → ${d}: ${(n / 1e6).toFixed(1)} MB (${cls}-node)</title></polyline>`;
      });
    }
    // busiest link, routed like the arrows
    let busiest = null;
    if (comm.busiest && !comm.stale && !tmode) {
      const a = lay.tiles[comm.busiest.src], b = lay.tiles[comm.busiest.dst];
      if (a && b) {
        const pts = this.routeOf(ch || this.channelsOf(lay), a.r, b.r, bbox([a], 2), bbox([b], 2));
        over += `<polyline class="hc-busiest" points="${pts.map((p) => p.join(",")).join(" ")}"><title>${esc(comm.busiest.text)}</title></polyline>`;
        busiest = segments(pts);
      }
    }
    // labels: on their route where it runs through a gap, else in free space near it (a lane is kept below the
    // nodes) with a leader line; they avoid tiles, node headers and each other
    const placed = [];
    let labelHtml = "";
    let leaders = "";
    const heads = headBoxes(lay);
    const place = (segs, w, h) => placeLabel(segs, w, h, { width: lay.width, height: lay.height, tileRects, heads, placed });
    for (const { a, segs } of labels) {
      const text = `${a.op} · ${a.short}/step`;
      const w = Math.round(12 + 5.6 * text.length + (a.redundant ? 22 : 0)), h = 15;
      const best = place(segs, w, h);
      if (!best) continue;
      const { r } = best;
      if (best.near > 10) {
        const cx = Math.min(Math.max(best.anchor[0], r.x0), r.x1), cy = Math.min(Math.max(best.anchor[1], r.y0), r.y1);
        leaders += `<line class="hc-leader" x1="${best.anchor[0]}" y1="${best.anchor[1]}" x2="${cx}" y2="${cy}" stroke="${LINK[a.cls]}"/>`;
      }
      labelHtml += `<div class="hc-arrow-label hc-${a.cls}" data-op="comm" data-reshard="${esc(a.reshard)}" data-p="${a.p}" style="left:${r.x0.toFixed(0)}px;top:${r.y0.toFixed(0)}px;width:${w}px" title="P${a.p} S${a.from} → S${a.to} ${esc(a.reshard)}: ${esc(a.label)}${a.fix ? "\nfix: " + esc(a.fix) : ""} — click for its comm_figure"><b>${esc(a.op)}</b> · ${esc(a.short)}/step${a.redundant ? ` <span class="hc-w">×${Math.round(a.redundant)}</span>` : ""}</div>`;
    }
    if (busiest) {
      const best = place(busiest, 74, 15);
      if (best) badges.push({ x: best.r.x0, y: best.r.y0, cls: "hc-badge hc-badge-purple", text: "busiest link", title: comm.busiest.text });
    }
    const badgeHtml = badges.map((b) => `<div class="${b.cls}" style="left:${b.x}px;top:${Math.max(0, b.y)}px;${b.colour ? `border-color:${b.colour};color:${b.colour}` : ""}" title="${esc(b.title)}">${esc(b.text)}</div>`).join("");
    // tiles
    const sel = v.selected ? `${v.selected[0]},${v.selected[1]}` : "";
    const focus = this.focus ?? 0;
    const tileParts = tiles.filter((t) => lay.tiles[t.r]).map((t) => {
      const L = lay.tiles[t.r];
      const inSel = `${t.p},${t.s}` === sel;
      const shard = tmode ? v.tensor.shards[String(t.r)] : null;
      const fill = tmode ? (shard ? "#ffffff" : "#f2f4f7") : t.fill || "#eceff3";
      const cls = ["hc-tile", t.p >= 0 ? "hc-used" : "hc-unused", inSel ? "hc-insel" : "", this.sel.has(t.r) ? "hc-picked" : "", this.inspect === t.r ? "hc-inspected" : "",
        t.flag ? `hc-flag-${t.flag}` : "", t.failed ? "hc-failed" : ""].join(" ");
      const showMem = t.mem != null && !tmode;  // the bar and figure: live fields (patch.js setFields)
      const mem = showMem ? `<div class="hc-tbar"><span></span></div><div class="hc-tmem"></div>` : "";
      const body = tmode ? (shard ? this.shardGrid(shard, v.tensor, L) : `<div class="hc-tmem">holds nothing</div>`) :
        `<div class="hc-tlayers">${esc(t.layers || "unused")}${tileTag(t)}</div>${mem}`;
      const title = t.title + (shard ? "\n" + shard.text : "");
      const drop = t.p >= 0 ? `data-drop="${t.p},${t.s}"` : "";
      return [`t${t.r}`, `<div class="${cls}" role="button" tabindex="${t.r === focus ? 0 : -1}" data-rank="${t.r}" data-key="tile-${t.r}" ${drop}
        data-stage="${t.p >= 0 ? `${t.p},${t.s}` : ""}" aria-label="rank ${t.r}, ${esc(t.kind)}${t.p >= 0 ? `, pipeline ${t.p} stage ${t.s}` : ", unused"}" aria-pressed="${this.sel.has(t.r)}"
        style="left:${L.x}px;top:${L.y}px;width:${L.w}px;height:${L.h}px;background:${fill};color:${tmode ? "#1b1f24" : t.ink || "#1b1f24"};border-color:${t.p >= 0 && !tmode ? t.line : "#9aa3ad"}">
        <div class="hc-thead"><b>${t.r}</b> <span>${esc(t.kind)}</span>${t.failed ? ' <b class="hc-e">✕ failed</b>' : ""}</div>${body}</div>`,
        [["", "title", title], ...(showMem ? memFields(".hc-tbar", ".hc-tbar > span", ".hc-tmem", t.mem, t.mem_text, t.mem_text) : [])]];
    });
    const head = (id, colour) => `<marker id="${id}" viewBox="0 0 10 10" refX="9" refY="5" markerUnits="userSpaceOnUse" markerWidth="13" markerHeight="13" orient="auto-start-reverse"><path d="M0,0L10,5L0,10z" fill="${colour}"/></marker>`;
    const markers = ["intra", "inter", "mixed"].map((c) => head(`hc-head-${c}`, LINK[c]) + head(`hc-head-${c}-stale`, "#9aa3ad")).join("");
    const note = comm.stale ? `<div class="hc-badge hc-resolving" style="right:4px;top:0">resolving communication …</div>` : "";
    const hgt = lay.height + (arrows.length ? LANE : 6);
    return {
      height: hgt, width: lay.width + 6, tiles: tileParts,
      // the SVG under the tiles: its box, and its layers keyed (a redraw patches them: nodes, hulls, arrows)
      underBox: `<svg class="hc-under" width="${lay.width + 6}" height="${hgt}"></svg>`,
      underParts: [["defs", `<defs>${markers}</defs>`], ["nodes", `<g>${nodes}</g>`], ...hulls, ["arrows", `<g>${over}</g>`], ["leaders", `<g>${leaders}</g>`]],
      labels: `<div class="hc-labels">${labelHtml}${badgeHtml}${note}</div>`,
      over: `<svg class="hc-over" width="${lay.width + 6}" height="${hgt}"></svg>`,
      selbar: this.sel.size ? this.selectionBar(v) : "",
    };
  }

  // The channels of a layout and the routes through them, kept while the layout stays (a redraw that only
  // changes the plan reuses them).
  channelsOf(lay) {
    if (this.routesFor !== lay) { this.routesFor = lay; this.routes = new Map(); this.ch = channels(lay); }
    return this.ch;
  }

  routeOf(ch, s, d, a, b) {
    const key = `${s}>${d}`;
    if (!this.routes.has(key)) {
      this.routes.set(key, route(ch, a, b) || [[a.cx, a.cy], [b.cx, b.cy]]);
    }
    return this.routes.get(key);
  }

  shardGrid(s, t, L) {
    const gw = L.w - 10, gh = L.h - 26;
    const col = t.subgroups[s.k].colour;
    const lines = t.cuts_r.slice(1, -1).map((y) => `<line x1="0" x2="${gw}" y1="${(y * gh).toFixed(1)}" y2="${(y * gh).toFixed(1)}"/>`).join("") +
      t.cuts_c.slice(1, -1).map((x) => `<line y1="0" y2="${gh}" x1="${(x * gw).toFixed(1)}" x2="${(x * gw).toFixed(1)}"/>`).join("");
    const label = s.partial || (s.dup ? `D${s.dup}` : "");
    return `<svg class="hc-grid" width="${gw}" height="${gh}"><rect x="0" y="0" width="${gw}" height="${gh}" fill="#fff" stroke="#6b7480"/>
      ${(s.rects || [s.box]).map(([r0, r1, c0, c1]) => `<rect class="hc-shard" x="${(c0 * gw).toFixed(1)}" y="${(r0 * gh).toFixed(1)}" width="${((c1 - c0) * gw).toFixed(1)}" height="${((r1 - r0) * gh).toFixed(1)}" fill="${col}" fill-opacity="0.85" ${s.partial ? 'stroke="#1b1f24" stroke-dasharray="3 2"' : ""}/>`).join("")}
      <g class="hc-cuts">${lines}</g>${label ? `<text x="${gw - 2}" y="${gh - 3}" text-anchor="end">${esc(label)}</text>` : ""}</svg>`;
  }

  selectionBar(v) {
    const s = v.selected;
    return `<div class="hc-selbar" role="group" aria-label="selected devices"><b>${this.sel.size} selected</b>
      ${s ? `<button class="hc-btn" data-op="move_sel">→ P${s[0]} S${s[1]} (selected stage)</button>` : ""}
      <button class="hc-btn" data-op="unassign_sel">take out of their stages</button><button class="hc-btn" data-op="clear_sel">clear</button>
      <small>or drag them onto a stage</small></div>`;
  }

  // ---- events ----------------------------------------------------------------------------------------------
  onClick(e) {
    const el = e.target.closest("[data-op]");
    if (!el || !this.root.contains(el) || el.tagName === "INPUT" || el.tagName === "SELECT") return;
    if (el.disabled) return;
    const op = el.dataset.op, p = +el.dataset.p, s = +el.dataset.s;
    const path = () => (this.root.querySelector('[data-role="path"]') || {}).value || "strategy.json";
    switch (op) {
      case "mode": this.mode = el.dataset.mode; this.render(); return;
      case "select": this.send({ op: "select", p, s }); return;
      case "add_stage": this.send({ op: "add_stage", p }); return;
      case "add_pipeline": this.send({ op: "add_pipeline" }); return;
      case "inspect_close": this.inspect = null; this.sel.clear(); this.render(); return;
      case "inspect_move": {
        const v = this.model.get("view") || {};
        if (v.selected) { this.sel.clear(); this.send({ op: "move", ranks: [+el.dataset.rank], p: v.selected[0], s: v.selected[1] }); }
        return;
      }
      case "inspect_unassign": this.sel.clear(); this.send({ op: "unassign", ranks: [+el.dataset.rank] }); return;
      case "remove_stage": this.send({ op: "remove_stage", p, s }); return;
      case "remove_pipeline": this.send({ op: "remove_pipeline", p }); return;
      case "move_sel": this.moveSelection(); return;
      case "unassign_sel": this.send({ op: "unassign", ranks: [...this.sel] }); this.sel.clear(); return;
      case "clear_sel": this.sel.clear(); this.render(); return;
      case "comm": this.send({ op: "comm", reshard: el.dataset.reshard }); return;
      case "fix": e.stopPropagation(); this.send({ op: "fix", reshard: el.dataset.reshard }); return;
      case "untensor": this.group = ""; this.send({ op: "tensor", name: "" }); return;
      case "save": case "load": this.path = path(); this.send({ op, path: this.path }); return;
      case "launch": this.launch = { at: Date.now(), acked: false }; this.render(); this.send({ op }); return;
      case "undo": case "redo": case "timeline": case "apply": this.send({ op }); return;
      default: return;
    }
  }

  onChange(e) {
    const el = e.target;
    const op = el.dataset.op;
    if (!op) return;
    delete el.dataset.typed;
    const p = +el.dataset.p, s = +el.dataset.s;
    const num = () => parseInt(el.value, 10);
    switch (op) {
      case "schedule": this.send({ op, value: el.value }); return;
      case "zero": this.send({ op, level: num() }); return;
      case "batch": if (num() >= 1) this.send({ op, value: num() }); return;
      case "recompute": this.send({ op, p, s, on: el.checked }); return;
      case "ratios": this.send(ratiosMessage(p, s, el.value)); return;
      case "cp": { const m = cpMessage(p, s, el.value); if (m) this.send(m); return; }
      case "layers": {
        const row = el.closest(".hc-stage");  // its stage's row (a tile of the stage carries data-stage too)
        const first = parseInt(row.querySelector('[data-which="first"]').value, 10);
        const last = parseInt(row.querySelector('[data-which="last"]').value, 10);
        if (Number.isFinite(first) && Number.isFinite(last)) this.send({ op, p, s, first, last });
        return;
      }
      case "micro": if (num() >= 1) this.send({ op, p, [el.dataset.which]: num() }); return;
      case "tgroup": this.group = el.value; this.render(); return;
      case "tname": if (el.value) this.send({ op: "tensor", name: el.value }); return;
      case "tensor": this.group = ""; this.send({ op: "tensor", name: el.value.trim() }); return;
      default: return;
    }
  }

  moveSelection() {
    const v = this.model.get("view") || {};
    if (!this.sel.size || !v.selected) return;
    this.send({ op: "move", ranks: [...this.sel].sort((a, b) => a - b), p: v.selected[0], s: v.selected[1] });
    this.sel.clear();
  }

  onKey(e) {
    const t = e.target;
    const typing = t.tagName === "INPUT" || t.tagName === "SELECT" || t.tagName === "TEXTAREA";
    if (typing) {
      if (t.tagName === "INPUT" && t.type !== "checkbox") t.dataset.typed = "1";
      e.stopPropagation();
      return;
    }
    const done = () => { e.preventDefault(); e.stopPropagation(); };
    const history = historyShortcut(e);
    if (history) { done(); this.send({ op: history }); return; }
    const tile = t.closest && t.closest(".hc-tile");
    if (e.key === "Escape") { done(); this.sel.clear(); this.inspect = null; this.render(); return; }
    if ((e.key === "Enter" || e.key === " ") && t.getAttribute && t.getAttribute("role") === "button" && t.dataset.op) { done(); t.click(); return; }
    if (e.key === "[" || e.key === "]") { done(); this.stepStage(e.key === "]" ? 1 : -1); return; }
    if (!tile) return;
    const r = +tile.dataset.rank;
    if (e.key.startsWith("Arrow")) { done(); this.moveFocus(r, e.key); return; }
    if (e.key === " ") { done(); this.sel.has(r) ? this.sel.delete(r) : this.sel.add(r); this.rove(r); this.render(); return; }
    if (e.key === "Enter") { done(); this.rove(r); if (this.sel.size) this.moveSelection(); else this.send({ op: "toggle", rank: r }); return; }
    if (e.key === "Delete" || e.key === "Backspace") {
      done();
      this.send({ op: "unassign", ranks: this.sel.size ? [...this.sel] : [r] });
      this.sel.clear();
      return;
    }
    e.stopPropagation();
  }

  stepStage(d) {
    const v = this.model.get("view") || {};
    const next = stepStage(v.pipelines, v.selected, d);
    if (!next) return;
    const [p, s] = next;
    this.send({ op: "select", p, s });
  }

  moveFocus(r, key) {
    const next = nextTile(this.lay.tiles, r, key);
    if (next == null) return;
    const el = this.rove(next);
    if (el) el.focus();
  }

  // The tile that Tab reaches (the roving tabindex) becomes rank `r`'s, in the DOM at once: the redraw that follows
  // then finds it as it draws it, and never changes a tabindex in the middle of its writes (which forces a style
  // and layout pass, ~6 ms at 48 GPUs).  Returns r's tile.
  rove(r) {
    this.focus = r;
    for (const el of this.root.querySelectorAll('.hc-tile[tabindex="0"]')) if (+el.dataset.rank !== r) el.setAttribute("tabindex", "-1");
    const el = this.root.querySelector(`.hc-tile[data-rank="${r}"]`);
    if (el && el.getAttribute("tabindex") !== "0") el.setAttribute("tabindex", "0");
    return el;
  }

  onPointerDown(e) {
    if (e.button !== 0) return;
    const tile = e.target.closest(".hc-tile");
    const area = e.target.closest(".hc-stagearea");
    if (!area || e.target.closest(".hc-arrow-label, .hc-selbar, .hc-badge")) return;
    const origin = area.getBoundingClientRect();
    const start = { x: e.clientX, y: e.clientY };
    const local = (ev) => [ev.clientX - origin.left, ev.clientY - origin.top];
    let dragging = false, ghost = null, target = null;
    const pts = [local(e)];
    const overSvg = area.querySelector(".hc-over");
    this.gesture = true;
    const finish = () => {
      this.gesture = false;
      if (this.pending) { this.pending = false; this.render(); }
    };
    if (tile) {
      const r = +tile.dataset.rank;
      this.rove(r);
      const ranks = this.sel.has(r) ? [...this.sel].sort((a, b) => a - b) : [r];
      const move = (ev) => {
        if (!dragging && !isDrag(start, ev.clientX, ev.clientY)) return;
        if (!dragging) {
          dragging = true;
          ghost = document.createElement("div");
          ghost.className = "hc-ghost";
          ghost.textContent = ranks.length > 1 ? `${ranks.length} devices` : `rank ${r}`;
          document.body.appendChild(ghost);
          this.root.classList.add("hc-dragging");
        }
        ghost.style.left = `${ev.clientX + 12}px`;
        ghost.style.top = `${ev.clientY + 8}px`;
        const hit = document.elementFromPoint(ev.clientX, ev.clientY);
        const drop = hit && hit.closest && hit.closest("[data-drop]");
        if (target && target !== drop) target.classList.remove("hc-droptarget");
        target = drop && this.root.contains(drop) ? drop : null;
        if (target) target.classList.add("hc-droptarget");
      };
      const up = (ev) => {
        document.removeEventListener("pointermove", move);
        document.removeEventListener("pointerup", up);
        if (ghost) ghost.remove();
        this.root.classList.remove("hc-dragging");
        if (target) target.classList.remove("hc-droptarget");
        finish();
        if (dragging) {
          if (target) {
            const [p, s] = target.dataset.drop.split(",").map(Number);
            this.sel.clear();
            this.send({ op: "move", ranks, p, s });
          }
          return;
        }
        if (ev.altKey) {  // the explicit gesture: into (or out of) the selected stage
          this.sel.clear();
          this.send({ op: "toggle", rank: r });
        } else if (ev.shiftKey || ev.ctrlKey || ev.metaKey) {
          this.sel.has(r) ? this.sel.delete(r) : this.sel.add(r);
          this.inspect = r;
          this.render();
        } else {  // a plain click explores: pick this tile and show its card; the plan does not change
          this.sel = new Set([r]);
          this.inspect = r;
          this.render();
        }
      };
      document.addEventListener("pointermove", move);
      document.addEventListener("pointerup", up);
      e.preventDefault();
      tile.focus({ preventScroll: true });
      return;
    }
    // box or lasso selection on the empty canvas
    const lasso = this.mode === "lasso" || e.altKey;
    const shape = document.createElementNS(SVG, lasso ? "polygon" : "rect");
    shape.setAttribute("class", "hc-band");
    overSvg.appendChild(shape);
    const move = (ev) => {
      const [x, y] = local(ev);
      pts.push([x, y]);
      if (lasso) shape.setAttribute("points", pts.map((p) => p.join(",")).join(" "));
      else {
        const [x0, y0] = pts[0];
        shape.setAttribute("x", Math.min(x0, x)); shape.setAttribute("y", Math.min(y0, y));
        shape.setAttribute("width", Math.abs(x - x0)); shape.setAttribute("height", Math.abs(y - y0));
      }
    };
    const up = (ev) => {
      document.removeEventListener("pointermove", move);
      document.removeEventListener("pointerup", up);
      shape.remove();
      finish();
      if (isClick(pts)) { if (this.sel.size || this.inspect != null) { this.sel.clear(); this.inspect = null; this.render(); } return; }
      if (!ev.shiftKey) this.sel.clear();
      for (const r of lasso ? tilesInLasso(this.lay.tiles, pts) : tilesInBox(this.lay.tiles, pts[0], local(ev))) this.sel.add(r);
      this.render();
    };
    document.addEventListener("pointermove", move);
    document.addEventListener("pointerup", up);
    e.preventDefault();
  }
}
