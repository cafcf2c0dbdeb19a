// A stage's TP ratios (HAP, SPEC §12) and its CP × TP grid (SPEC §11) on the canvas: the tag on each device tile
// (its share of every TP-split tensor, its cp·tp coordinates), the outline of each context-parallel group inside the
// stage's hull, the stage card's two controls, and the messages they send.  What a share or a coordinate is, Python
// decides (hspmd_sdk/viz/_tp_grid.py, sent in the view); this only draws it.

import { esc } from "../common/esc.js";
import { byNode } from "./geometry.js";
import { hullSvg } from "./hull.js";

// How far a CP group's outline stands off its tiles: inside the stage's hull (HULL, 5 px).
export const CP_GROW = 2;

// The tag a stage tile carries ("" for none): its share ("3/4") when its stage splits unevenly, its coordinates
// ("cp0·tp1") when its stage has context parallelism.
export function tileTag(t) {
  const parts = [];
  const tips = [];
  if (t.uneven && t.share) {
    parts.push(`<span class="hc-tshare">${esc(t.share)}</span>`);
    tips.push(`holds ${t.share}${t.share_pct != null ? ` (${t.share_pct}%)` : ""} of every TP-split tensor of its stage`);
  }
  if (t.grid) {
    parts.push(`<span class="hc-tgrid">${esc(t.grid)}</span>`);
    tips.push(`context-parallel group ${t.cp[0]}, TP rank ${t.cp[1]}`);
  }
  if (!parts.length) return "";
  return `<span class="hc-ttag" title="${esc(tips.join("\n"))}">${parts.join(" ")}</span>`;
}

// The outlines of a stage's context-parallel groups (each its TP ranks, per node), dashed, inside the stage's hull;
// "" for a stage without context parallelism.
export function cpGroupsSvg(lay, s) {
  const groups = s.cp_groups || [];
  if (groups.length < 2) return "";
  return groups.map((g, c) => `<g class="hc-cpgroup" data-cp="${c}" data-cp-stage="${s.p},${s.s}">${hullSvg(byNode(lay, g), s.line, "none", 0, true, "hc-cphull", CP_GROW)}</g>`).join("");
}

// The stage card's row of controls: the TP ratios (text, "3:1"; empty: even) with each device's share, and the
// number of context-parallel groups (a divisor of the stage's device count).
export function stageControls(s) {
  const n = s.ranks.length;
  const options = (s.cp_options || [1]).join(", ");
  const ratiosTip = `uneven TP (HAP): one positive integer per device, in the stage's order (${s.ranks.join(", ") || "no devices"}); 3:1 gives the first device 3/4 of every TP-split tensor. Empty or all equal: the even split`;
  const cpTip = `context parallelism: the stage's ${n} device${n === 1 ? "" : "s"} form cp groups of TP ranks (the sequence split over the groups); cp can be ${options}`;
  const shares = s.uneven && s.shares ? `<small class="hc-shares" title="each device's share of every TP-split tensor">= ${s.shares.map(esc).join(" · ")}</small>` : "";
  return `<div class="hc-srow3"><label class="hc-ratios" title="${esc(ratiosTip)}">ratios <input class="hc-text" data-op="ratios" data-p="${s.p}" data-s="${s.s}" data-key="ratios-${s.p}-${s.s}" value="${esc(s.ratios_text || "")}" placeholder="even" size="7" aria-label="TP ratios of pipeline ${s.p} stage ${s.s}"></label>${shares}
    <label class="hc-cp" title="${esc(cpTip)}">cp <input class="hc-num" type="number" min="1" max="${Math.max(n, 1)}" data-op="cp" data-p="${s.p}" data-s="${s.s}" data-key="cp-${s.p}-${s.s}" value="${s.cp}" aria-label="context-parallel groups of pipeline ${s.p} stage ${s.s}"></label></div>`;
}

// The message the ratios field sends: its text as typed (Python parses it and says what is wrong with it).
export function ratiosMessage(p, s, text) {
  return { op: "ratios", p, s, value: String(text ?? "").trim() };
}

// The message the cp field sends, or null while it is empty or not a number (a fraction is sent: Python says why
// it is refused).
export function cpMessage(p, s, text) {
  const v = String(text ?? "").trim();
  if (!v) return null;
  const n = Number(v);
  return Number.isFinite(n) ? { op: "cp", p, s, value: n } : null;
}
