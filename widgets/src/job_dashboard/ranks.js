// The ranks of the current world: a bar of the last step time each (a dead rank: a struck grey bar, a ✕ and what
// happened instead of a time); the ranks an elastic job removed, apart.

import { esc } from "../common/esc.js";
import { secs, mem, memPair } from "./format.js";

// The ranks of a state: `shown` (the current world, in order) and `removed` (those an elastic job removed).  Without
// s.ranks, one rank per s.step_times entry [rank, time], running or done as the job is.
export function rankList(s) {
  const ranks = (s.ranks && s.ranks.length) ? s.ranks
    : (s.step_times || []).map(([r, t]) => ({ rank: r, state: s.running ? "running" : "done", time: t }));
  return { shown: ranks.filter((r) => r.state !== "removed"), removed: ranks.filter((r) => r.state === "removed") };
}

// The time of a full bar: the longest last step time of the ranks that have one and are not dead (1 when none).
export function barScale(shown) {
  const live = shown.filter((r) => r.time != null && r.state !== "dead");
  return Math.max(0, ...live.map((r) => r.time)) || 1;
}

// A rank's bar width in percent of the full bar hi: a dead rank's is full (drawn struck and grey), a rank without a
// time has none.
export function barWidth(r, hi) {
  const dead = r.state === "dead";
  return r.time != null ? (dead ? 100 : (r.time / hi) * 100) : 0;
}

// A rank's memory: what it measured, beside the plan's estimate for its device where the job has one
// (r.memory_estimate_mb; s.memory_note says what each figure holds), with estimate/measured in the tooltip.
export function memCell(r, note) {
  if (r.memory_mb == null) return "";
  if (r.memory_estimate_mb == null) {
    return `<span class="hd-mem" title="peak memory of this rank's process">${mem(r.memory_mb)}</span>`;
  }
  const ratio = r.memory_mb > 0 ? ` · estimate/measured ${(r.memory_estimate_mb / r.memory_mb).toFixed(2)}` : "";
  return `<span class="hd-mem" title="${esc((note || "measured vs the plan's estimate") + ratio)}">${memPair(r.memory_mb, r.memory_estimate_mb)}</span>`;
}

export function rankRows(s) {
  const { shown, removed } = rankList(s);
  if (!shown.length && !removed.length) return `<div class="hd-empty">no rank reported yet</div>`;
  const hi = barScale(shown);
  const rows = shown.map((r) => {
    const dead = r.state === "dead";
    const width = barWidth(r, hi);
    const what = dead ? `<span class="hd-mark" title="${esc(r.why)}">✕ ${esc(r.why)}${r.died_step != null ? ` · step ${r.died_step}` : ""}</span>`
      : r.time != null ? `<span class="hd-time">${secs(r.time)}</span>`
      : `<span class="hd-time hd-empty">${r.state === "starting" ? "starting…" : esc(r.why || r.state)}</span>`;
    const extra = !dead && r.state === "stopped" ? ` <small class="hd-empty">${esc(r.why)}</small>` : "";
    return `<div class="hd-rank hd-${esc(r.state)} ${r.rank === s.slowest ? "hd-slow" : ""}" data-rank="${r.rank}" data-state="${esc(r.state)}">
      <button class="hd-rl" data-rank="${r.rank}" title="show rank ${r.rank}'s log">R${r.rank}</button>
      <span class="hd-bar"><span style="width:${width.toFixed(0)}%"></span></span>${what}${extra}
      ${memCell(r, s.memory_note)}</div>`;
  }).join("");
  const gone = removed.length ? `<div class="hd-removed">removed from the job (${s.world.length} ranks now): ${removed.map((r) =>
    `<button class="hd-rl hd-gone" data-rank="${r.rank}" title="${esc(r.why)} · show its log">R${r.rank}</button> <small>${esc(r.why)}</small>`).join(" ")}</div>` : "";
  return rows + gone;
}
