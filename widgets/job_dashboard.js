// hspmd_sdk · a running job's dashboard (an anywidget ESM module; plain ES module, no build step).
// Python (hspmd_sdk/viz/dashboard.py) syncs `state`: status, step/steps, losses, each rank's last step time and
// the job's events (switches, failures) as they happen.

function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function lossCurve(losses, w, h) {
  if (!losses.length) return `<div class="hd-empty">no loss reported yet</div>`;
  const lo = Math.min(...losses), hi = Math.max(...losses);
  const span = hi - lo || 1;
  const x = (i) => 36 + (losses.length === 1 ? 0 : (i / (losses.length - 1)) * (w - 44));
  const y = (v) => 6 + (1 - (v - lo) / span) * (h - 22);
  const pts = losses.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  return `<svg class="hd-loss" width="${w}" height="${h}" role="img" aria-label="loss curve">
    <line x1="36" y1="${h - 16}" x2="${w - 4}" y2="${h - 16}" class="hd-axis"/><line x1="36" y1="4" x2="36" y2="${h - 16}" class="hd-axis"/>
    <text x="32" y="${y(hi) + 4}" text-anchor="end">${hi.toFixed(3)}</text><text x="32" y="${y(lo) + 4}" text-anchor="end">${lo.toFixed(3)}</text>
    <text x="36" y="${h - 3}">step 0</text><text x="${w - 4}" y="${h - 3}" text-anchor="end">step ${losses.length - 1}</text>
    <polyline points="${pts}" class="hd-line"/>${losses.length < 60 ? losses.map((v, i) => `<circle cx="${x(i).toFixed(1)}" cy="${y(v).toFixed(1)}" r="2.2"><title>step ${i}: ${v.toFixed(4)}</title></circle>`).join("") : ""}</svg>`;
}

function stepTimes(times, slowest) {
  if (!times.length) return `<div class="hd-empty">no step finished yet</div>`;
  const hi = Math.max(...times.map((t) => t[1])) || 1;
  return times.map(([r, t]) => `<div class="hd-rank ${r === slowest ? "hd-slow" : ""}"><span class="hd-rl">R${r}</span><span class="hd-bar"><span style="width:${((t / hi) * 100).toFixed(0)}%"></span></span><span>${t >= 1 ? t.toFixed(2) + " s" : (t * 1e3).toFixed(0) + " ms"}</span></div>`).join("");
}

function render(el, s) {
  if (!s || !s.job_id) { el.innerHTML = `<div class="hspmd-dashboard"><i>no job</i></div>`; return; }
  const frac = s.steps ? Math.min(1, s.step / s.steps) : 0;
  const events = (s.events || []).map((e) => `<li class="hd-ev hd-${esc(e.reason)}" data-reason="${esc(e.reason)}">${esc(e.text)}</li>`).join("");
  el.innerHTML = `<div class="hspmd-dashboard" data-status="${esc(s.status)}" data-step="${s.step}">
    <div class="hd-head"><b>job ${esc(s.job_id)}</b> <span class="hd-status hd-${esc(s.status)}">${esc(s.status)}</span>
      <span class="hd-progress" title="steps done"><span style="width:${(frac * 100).toFixed(0)}%"></span></span> step ${s.step}${s.steps ? " / " + s.steps : ""}
      ${s.error ? `<span class="hd-error">${esc(s.error)}</span>` : ""}</div>
    <div class="hd-body"><div class="hd-panel"><div class="hd-title">loss</div>${lossCurve(s.losses || [], 300, 120)}</div>
      <div class="hd-panel"><div class="hd-title">last step time per rank${s.slowest != null ? ` <small>(slowest R${s.slowest})</small>` : ""}</div>${stepTimes(s.step_times || [], s.slowest)}</div>
      <div class="hd-panel"><div class="hd-title">events <small>(switches and failures)</small></div>${events ? `<ul class="hd-events">${events}</ul>` : `<div class="hd-empty">none${s.can_switch ? "" : " — this job cannot switch plans"}</div>`}</div></div></div>`;
}

export default {
  render({ model, el }) {
    const draw = () => render(el, model.get("state"));
    model.on("change:state", draw);
    draw();
    return () => model.off("change:state", draw);
  },
};
