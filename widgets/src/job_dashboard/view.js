// The dashboard's markup: the head (status, progress, clocks, rates, the stop button), the loss curve, the ranks,
// the events, the plan the job runs now and the rank log shown; and the stop button's two-click state.

import { esc } from "../common/esc.js";
import { clock, rate, secs } from "./format.js";
import { lossCurve } from "./loss.js";
import { rankRows } from "./ranks.js";

// The fraction of the steps done (0 when the number of steps is unknown, at most 1).
export function progress(s) {
  return s.steps ? Math.min(1, s.step / s.steps) : 0;
}

// The stop button's state: "stopping" (pressed, the job still running), "armed" (clicked once: the next click
// stops), "ready", or null (no button: the job cannot be stopped).
export function stopState(s, ui) {
  return ui.stopping && s.running ? "stopping" : s.can_stop ? (ui.armed ? "armed" : "ready") : null;
}

// A click on the stop button: the first arms it (returns false), a second while armed stops the job (returns true:
// send the stop message now).
export function pressStop(ui) {
  if (!ui.armed) {
    ui.armed = true;
    return false;
  }
  ui.armed = false;
  ui.stopping = true;
  return true;
}

// A new state: a job that no longer runs has nothing to stop (the button forgets being armed or pressed).
export function settle(s, ui) {
  if (s && !s.running) { ui.armed = false; ui.stopping = false; }
}

export function planView(p) {
  if (!p || !p.pipelines || !p.pipelines.length) return "";
  const rows = p.pipelines.map((pl, i) => `<div class="hd-pipe"><small>pipeline ${i}${pl.micro ? ` · ${esc(pl.micro)}` : ""}</small>
    ${pl.stages.map((st) => `<span class="hd-stage" title="ranks ${st.ranks.join(", ")}${st.layers ? ` · layers ${esc(st.layers)}` : ""}">R${st.ranks.join(",")}${st.layers ? ` <small>L${esc(st.layers)}</small>` : ""}</span>`).join("<span class=\"hd-arrow\">→</span>")}</div>`).join("");
  return `<div class="hd-panel hd-plan"><div class="hd-title">plan now <small>(since ${esc(p.since)}; launch ranks)</small></div>${rows}</div>`;
}

export function logView(log) {
  if (!log || log.rank == null) return "";
  return `<div class="hd-log" data-rank="${log.rank}"><div class="hd-title">log of rank ${log.rank}
    <small>(last ${Math.min(log.lines, 200)} of ${log.lines} lines${log.path ? ` · whole log: ${esc(log.path)}` : ""})</small>
    <button class="hd-close" title="hide the log">×</button></div><pre>${esc(log.text)}</pre></div>`;
}

// The status badge: what the job's status reads for people ("stopped at step 5" for a job stopped gracefully),
// coloured by its status.
export function statusBadge(s) {
  return `<span class="hd-status hd-${esc(s.status)}">${esc(s.status_text || s.status)}</span>`;
}

// The stop button in state st (stopState); its tooltip says what it does to this job (Python's stop_hint).
export function stopButton(s, st) {
  if (st === "stopping") return `<button class="hd-stop" disabled>stopping…</button>`;
  if (!st) return "";
  const hint = s.stop_hint || "stop every worker of this job now (job.cancel())";
  return `<button class="hd-stop${st === "armed" ? " hd-armed" : ""}" title="${esc(hint)}">${st === "armed" ? "click again to stop" : "■ stop"}</button>`;
}

// Draws state s (and the rank log shown) into el.
export function render(el, s, log, ui) {
  if (!s || !s.job_id) { el.innerHTML = `<div class="hspmd-dashboard"><i>no job</i></div>`; return; }
  const frac = progress(s);
  const events = (s.events || []).map((e) => `<li class="hd-ev hd-${esc(e.reason)}" data-reason="${esc(e.reason)}"${e.detail ? ` title="${esc(e.detail)}"` : ""}>${esc(e.text)}</li>`).join("");
  const none = s.running ? "none yet" : "none";
  const stop = stopButton(s, stopState(s, ui));
  el.innerHTML = `<div class="hspmd-dashboard" data-status="${esc(s.status)}" data-step="${s.step}">
    <div class="hd-head"><b>job ${esc(s.job_id)}</b> ${statusBadge(s)}
      <span class="hd-progress" title="steps done"><span style="width:${(frac * 100).toFixed(0)}%"></span></span> step ${s.step}${s.steps ? " / " + s.steps : ""}
      ${s.starting ? `<span class="hd-phase">${esc(s.starting)}</span>` : ""}
      ${s.data ? `<span class="hd-data" title="what the job trains on">data: ${esc(s.data)}</span>` : ""}
      <span class="hd-clock">elapsed <b class="hd-elapsed">${clock(s.elapsed_s)}</b>${s.running && s.eta_s != null ? ` · ETA <b class="hd-eta">${clock(s.eta_s)}</b>` : ""}</span>
      ${s.tokens_per_s != null ? `<span class="hd-tps" title="tokens of a step over the median time of the newest steps">${rate(s.tokens_per_s)}</span>` : ""}
      ${s.step_s != null ? `<span class="hd-steps" title="median time of the newest steps (their slowest rank)">${secs(s.step_s)}/step</span>` : ""}
      ${stop}
      ${s.error ? `<span class="hd-error">${esc(s.error.split("\n")[0])}</span>` : ""}</div>
    <div class="hd-body"><div class="hd-panel"><div class="hd-title">loss${trainingFigures(s)}</div>${lossCurve(s.losses || [], 300, 120, s.val_losses || [])}</div>
      <div class="hd-panel hd-ranks"><div class="hd-title">last step time per rank${s.slowest != null ? ` <small>(slowest R${s.slowest})</small>` : ""} <small>· click a rank for its log</small></div>${rankRows(s)}</div>
      <div class="hd-panel"><div class="hd-title">events <small>(failures and reconfigurations)</small></div>${events ? `<ul class="hd-events">${events}</ul>` : `<div class="hd-empty hd-noevents">${none}${s.can_switch ? "" : " — this job cannot switch plans"}</div>`}</div>
      ${planView(s.plan)}</div>${logView(log)}</div>`;
}

// The training recipe's figures beside the loss: the last validation loss, learning rate and gradient norm (before
// clipping), each where the job reports it.
export function trainingFigures(s) {
  const parts = [];
  const val = s.val_losses || [];
  if (val.length) parts.push(`<span class="hd-valtext" title="validation loss at step ${val[val.length - 1][0]}">val ${val[val.length - 1][1].toFixed(4)}</span>`);
  if (s.lr != null) parts.push(`<span class="hd-lr" title="learning rate of the last step">lr ${s.lr.toExponential(2)}</span>`);
  if (s.grad_norm != null) parts.push(`<span class="hd-gnorm" title="gradient norm of the last step, before clipping">‖g‖ ${s.grad_norm.toFixed(3)}</span>`);
  return parts.length ? ` <small>· ${parts.join(" · ")}</small>` : "";
}

