// hspmd_sdk · a running job's dashboard (an anywidget ESM module; the entry of its bundle, built by esbuild into
// hspmd_sdk/viz/static/job_dashboard.js: `npm run build` in widgets/).
// Python (hspmd_sdk/viz/dashboard.py, the state model in _job.py) syncs `state`: status, step/steps, elapsed,
// ETA, tokens/s, losses, each rank of the job's current world (state: running, done, dead, stopped; last step
// time, memory), the ranks an elastic job removed, every failure and reconfiguration, the plan the job runs now;
// and `log`: the rank log shown.  It sends {type: "stop"} (the stop button, after a confirming second click) and
// {type: "logs", rank} (a click on a rank; rank null hides the log).
//
// Modules: format.js (clock, rates, times, memory), loss.js (the loss curve), ranks.js (the rank bars),
// view.js (the markup, the stop button's state).

import { clock } from "./format.js";
import { render, pressStop, settle } from "./view.js";

export { clock };

export default {
  render({ model, el }) {
    const ui = { armed: false, stopping: false, at: performance.now(), timer: null };
    const draw = () => {
      const s = model.get("state");
      settle(s, ui);
      render(el, s, model.get("log"), ui);
    };
    const fresh = () => { ui.at = performance.now(); draw(); };
    const tick = () => {  // the clock moves between snapshots (the kernel sends one when something else changed)
      const s = model.get("state");
      if (!s || !s.running) return;
      const dt = (performance.now() - ui.at) / 1000;
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
          setTimeout(() => { if (ui.armed) { ui.armed = false; draw(); } }, 4000);
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
    ui.timer = setInterval(tick, 1000);
    draw();
    return () => {
      clearInterval(ui.timer);
      el.removeEventListener("click", click);
      model.off("change:state", fresh);
      model.off("change:log", draw);
    };
  },
};
