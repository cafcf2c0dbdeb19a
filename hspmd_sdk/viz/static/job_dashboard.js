// GENERATED FILE: do not edit. Built from widgets/src by `npm run build` (esbuild) in widgets/.

// src/job_dashboard/format.js
function clock(s) {
  if (s == null || !isFinite(s)) return "–";
  s = Math.max(0, Math.round(s));
  const h = Math.floor(s / 3600), m = Math.floor(s % 3600 / 60), sec = s % 60;
  return (h ? `${h}:${String(m).padStart(2, "0")}` : `${m}`) + `:${String(sec).padStart(2, "0")}`;
}
function rate(t) {
  if (t == null) return "";
  return t >= 1e6 ? `${(t / 1e6).toFixed(2)}M tok/s` : t >= 1e3 ? `${(t / 1e3).toFixed(1)}k tok/s` : `${t.toFixed(0)} tok/s`;
}
function secs(t) {
  return t >= 1 ? t.toFixed(2) + " s" : (t * 1e3).toFixed(0) + " ms";
}
function mem(mb) {
  if (mb == null) return "";
  return mb >= 102.4 ? `${(mb / 1024).toFixed(mb >= 10240 ? 0 : 1)} GiB` : `${mb.toFixed(1)} MiB`;
}
function memPair(measured, estimated) {
  if (measured == null) return "";
  if (estimated == null) return mem(measured);
  const gib = Math.max(measured, estimated) >= 102.4;
  const f = (mb) => gib ? `${(mb / 1024).toFixed(2)} GiB` : `${mb.toFixed(1)} MiB`;
  return `${f(measured)} measured / ${f(estimated)} est.`;
}

// src/common/esc.js
function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// src/job_dashboard/loss.js
function lossScale(losses, w, h, val = []) {
  const all = losses.concat(val.map((p) => p[1]));
  const lo = Math.min(...all), hi = Math.max(...all);
  const span = hi - lo || 1;
  const x = (i) => 46 + (losses.length === 1 ? 0 : i / (losses.length - 1) * (w - 54));
  const y = (v) => 6 + (1 - (v - lo) / span) * (h - 22);
  return { lo, hi, x, y };
}
function lossCurve(losses, w, h, val = []) {
  if (!losses.length) return `<div class="hd-empty">no loss reported yet</div>`;
  val = val.filter((p) => p[0] < losses.length);
  const { lo, hi, x, y } = lossScale(losses, w, h, val);
  const squares = val.map(([i, v]) => `<rect class="hd-val" x="${(x(i) - 3).toFixed(1)}" y="${(y(v) - 3).toFixed(1)}" width="6" height="6"><title>step ${i}: validation ${v.toFixed(4)}</title></rect>`).join("");
  const pts = losses.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  return `<svg class="hd-loss" width="${w}" height="${h}" role="img" aria-label="loss curve">
    <line x1="46" y1="${h - 16}" x2="${w - 4}" y2="${h - 16}" class="hd-axis"/><line x1="46" y1="4" x2="46" y2="${h - 16}" class="hd-axis"/>
    <text x="42" y="${y(hi) + 4}" text-anchor="end">${hi.toFixed(3)}</text><text x="42" y="${y(lo) + 4}" text-anchor="end">${lo.toFixed(3)}</text>
    <text x="46" y="${h - 3}">step 0</text><text x="${w - 4}" y="${h - 3}" text-anchor="end">step ${losses.length - 1}</text>
    <polyline points="${pts}" class="hd-line"/>${losses.length < 60 ? losses.map((v, i) => `<circle cx="${x(i).toFixed(1)}" cy="${y(v).toFixed(1)}" r="2.2"><title>step ${i}: ${v.toFixed(4)}</title></circle>`).join("") : ""}${squares}</svg>`;
}

// src/job_dashboard/ranks.js
function rankList(s) {
  const ranks = s.ranks && s.ranks.length ? s.ranks : (s.step_times || []).map(([r, t]) => ({ rank: r, state: s.running ? "running" : "done", time: t }));
  return { shown: ranks.filter((r) => r.state !== "removed"), removed: ranks.filter((r) => r.state === "removed") };
}
function barScale(shown) {
  const live = shown.filter((r) => r.time != null && r.state !== "dead");
  return Math.max(0, ...live.map((r) => r.time)) || 1;
}
function barWidth(r, hi) {
  const dead = r.state === "dead";
  return r.time != null ? dead ? 100 : r.time / hi * 100 : 0;
}
function memCell(r, note) {
  if (r.memory_mb == null) return "";
  if (r.memory_estimate_mb == null) {
    return `<span class="hd-mem" title="peak memory of this rank's process">${mem(r.memory_mb)}</span>`;
  }
  const ratio = r.memory_mb > 0 ? ` · estimate/measured ${(r.memory_estimate_mb / r.memory_mb).toFixed(2)}` : "";
  return `<span class="hd-mem" title="${esc((note || "measured vs the plan's estimate") + ratio)}">${memPair(r.memory_mb, r.memory_estimate_mb)}</span>`;
}
function rankRows(s) {
  const { shown, removed } = rankList(s);
  if (!shown.length && !removed.length) return `<div class="hd-empty">no rank reported yet</div>`;
  const hi = barScale(shown);
  const rows = shown.map((r) => {
    const dead = r.state === "dead";
    const width = barWidth(r, hi);
    const what = dead ? `<span class="hd-mark" title="${esc(r.why)}">✕ ${esc(r.why)}${r.died_step != null ? ` · step ${r.died_step}` : ""}</span>` : r.time != null ? `<span class="hd-time">${secs(r.time)}</span>` : `<span class="hd-time hd-empty">${r.state === "starting" ? "starting…" : esc(r.why || r.state)}</span>`;
    const extra = !dead && r.state === "stopped" ? ` <small class="hd-empty">${esc(r.why)}</small>` : "";
    return `<div class="hd-rank hd-${esc(r.state)} ${r.rank === s.slowest ? "hd-slow" : ""}" data-rank="${r.rank}" data-state="${esc(r.state)}">
      <button class="hd-rl" data-rank="${r.rank}" title="show rank ${r.rank}'s log">R${r.rank}</button>
      <span class="hd-bar"><span style="width:${width.toFixed(0)}%"></span></span>${what}${extra}
      ${memCell(r, s.memory_note)}</div>`;
  }).join("");
  const gone = removed.length ? `<div class="hd-removed">removed from the job (${s.world.length} ranks now): ${removed.map((r) => `<button class="hd-rl hd-gone" data-rank="${r.rank}" title="${esc(r.why)} · show its log">R${r.rank}</button> <small>${esc(r.why)}</small>`).join(" ")}</div>` : "";
  return rows + gone;
}

// src/job_dashboard/view.js
function progress(s) {
  return s.steps ? Math.min(1, s.step / s.steps) : 0;
}
function stopState(s, ui) {
  return ui.stopping && s.running ? "stopping" : s.can_stop ? ui.armed ? "armed" : "ready" : null;
}
function pressStop(ui) {
  if (!ui.armed) {
    ui.armed = true;
    return false;
  }
  ui.armed = false;
  ui.stopping = true;
  return true;
}
function settle(s, ui) {
  if (s && !s.running) {
    ui.armed = false;
    ui.stopping = false;
  }
}
function planView(p) {
  if (!p || !p.pipelines || !p.pipelines.length) return "";
  const rows = p.pipelines.map((pl, i) => `<div class="hd-pipe"><small>pipeline ${i}${pl.micro ? ` · ${esc(pl.micro)}` : ""}</small>
    ${pl.stages.map((st) => `<span class="hd-stage" title="ranks ${st.ranks.join(", ")}${st.layers ? ` · layers ${esc(st.layers)}` : ""}">R${st.ranks.join(",")}${st.layers ? ` <small>L${esc(st.layers)}</small>` : ""}</span>`).join('<span class="hd-arrow">→</span>')}</div>`).join("");
  return `<div class="hd-panel hd-plan"><div class="hd-title">plan now <small>(since ${esc(p.since)}; launch ranks)</small></div>${rows}</div>`;
}
function logView(log) {
  if (!log || log.rank == null) return "";
  return `<div class="hd-log" data-rank="${log.rank}"><div class="hd-title">log of rank ${log.rank}
    <small>(last ${Math.min(log.lines, 200)} of ${log.lines} lines${log.path ? ` · whole log: ${esc(log.path)}` : ""})</small>
    <button class="hd-close" title="hide the log">×</button></div><pre>${esc(log.text)}</pre></div>`;
}
function statusBadge(s) {
  return `<span class="hd-status hd-${esc(s.status)}">${esc(s.status_text || s.status)}</span>`;
}
function stopButton(s, st) {
  if (st === "stopping") return `<button class="hd-stop" disabled>stopping…</button>`;
  if (!st) return "";
  const hint = s.stop_hint || "stop every worker of this job now (job.cancel())";
  return `<button class="hd-stop${st === "armed" ? " hd-armed" : ""}" title="${esc(hint)}">${st === "armed" ? "click again to stop" : "■ stop"}</button>`;
}
function render(el, s, log, ui) {
  if (!s || !s.job_id) {
    el.innerHTML = `<div class="hspmd-dashboard"><i>no job</i></div>`;
    return;
  }
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
function trainingFigures(s) {
  const parts = [];
  const val = s.val_losses || [];
  if (val.length) parts.push(`<span class="hd-valtext" title="validation loss at step ${val[val.length - 1][0]}">val ${val[val.length - 1][1].toFixed(4)}</span>`);
  if (s.lr != null) parts.push(`<span class="hd-lr" title="learning rate of the last step">lr ${s.lr.toExponential(2)}</span>`);
  if (s.grad_norm != null) parts.push(`<span class="hd-gnorm" title="gradient norm of the last step, before clipping">‖g‖ ${s.grad_norm.toFixed(3)}</span>`);
  return parts.length ? ` <small>· ${parts.join(" · ")}</small>` : "";
}

// src/job_dashboard/index.js
var index_default = {
  render({ model, el }) {
    const ui = { armed: false, stopping: false, at: performance.now(), timer: null };
    const draw = () => {
      const s = model.get("state");
      settle(s, ui);
      render(el, s, model.get("log"), ui);
    };
    const fresh = () => {
      ui.at = performance.now();
      draw();
    };
    const tick = () => {
      const s = model.get("state");
      if (!s || !s.running) return;
      const dt = (performance.now() - ui.at) / 1e3;
      const e = el.querySelector(".hd-elapsed"), eta = el.querySelector(".hd-eta");
      if (e && s.elapsed_s != null) e.textContent = clock(s.elapsed_s + dt);
      if (eta && s.eta_s != null) eta.textContent = clock(Math.max(0, s.eta_s - dt));
    };
    const click = (ev) => {
      const t = ev.target.closest("button");
      if (!t || !el.contains(t)) return;
      if (t.classList.contains("hd-stop")) {
        if (!pressStop(ui)) {
          draw();
          setTimeout(() => {
            if (ui.armed) {
              ui.armed = false;
              draw();
            }
          }, 4e3);
        } else {
          model.send({ type: "stop" });
          draw();
        }
      } else if (t.classList.contains("hd-close")) {
        model.send({ type: "logs", rank: null });
      } else if (t.dataset.rank != null) {
        model.send({ type: "logs", rank: Number(t.dataset.rank) });
      }
    };
    el.addEventListener("click", click);
    model.on("change:state", fresh);
    model.on("change:log", draw);
    ui.timer = setInterval(tick, 1e3);
    draw();
    return () => {
      clearInterval(ui.timer);
      el.removeEventListener("click", click);
      model.off("change:state", fresh);
      model.off("change:log", draw);
    };
  }
};
export {
  clock,
  index_default as default
};
