// The job dashboard's pure parts: number formats, the loss curve's scale, the rank bars (which ranks, their
// width, their state), progress, the stop button's two clicks, and the markup's texts.
import { test } from "node:test";
import assert from "node:assert/strict";
import { esc } from "../src/common/esc.js";
import { clock, mem, memPair, rate, secs } from "../src/job_dashboard/format.js";
import { lossCurve, lossScale } from "../src/job_dashboard/loss.js";
import { barScale, barWidth, memCell, rankList, rankRows } from "../src/job_dashboard/ranks.js";
import { logView, planView, pressStop, progress, settle, statusBadge, stopButton, stopState, trainingFigures } from "../src/job_dashboard/view.js";

test("esc: the five HTML specials; null and undefined as nothing", () => {
  assert.equal(esc(`<a href="x">'&'</a>`), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
  assert.equal(esc(null), "");
  assert.equal(esc(undefined), "");
  assert.equal(esc(0), "0");
});

test("clock: m:ss below an hour, h:mm:ss from there, rounded, never negative; – when unknown", () => {
  assert.equal(clock(0), "0:00");
  assert.equal(clock(9.4), "0:09");
  assert.equal(clock(59.5), "1:00");  // rounds up into the next minute
  assert.equal(clock(754), "12:34");
  assert.equal(clock(3600), "1:00:00");
  assert.equal(clock(3725.4), "1:02:05");
  assert.equal(clock(-3), "0:00");
  for (const v of [null, undefined, NaN, Infinity]) assert.equal(clock(v), "–");
});

test("rate, secs, mem: units chosen by size", () => {
  assert.equal(rate(999.4), "999 tok/s");
  assert.equal(rate(1000), "1.0k tok/s");
  assert.equal(rate(12345.6), "12.3k tok/s");
  assert.equal(rate(2.5e6), "2.50M tok/s");
  assert.equal(rate(null), "");
  assert.equal(secs(0.734), "734 ms");
  assert.equal(secs(0.9999), "1000 ms");
  assert.equal(secs(1), "1.00 s");
  assert.equal(secs(2.5), "2.50 s");
  assert.equal(mem(50.2), "50.2 MiB");
  assert.equal(mem(102.3), "102.3 MiB");
  assert.equal(mem(102.4), "0.1 GiB");
  assert.equal(mem(2048), "2.0 GiB");
  assert.equal(mem(10240), "10 GiB");
  assert.equal(mem(null), "");
});

test("loss curve: steps spread over x 46..w-8, losses over y 6 (highest)..h-16 (lowest)", () => {
  const { lo, hi, x, y } = lossScale([5, 3, 4], 300, 120);
  assert.deepEqual([lo, hi], [3, 5]);
  assert.deepEqual([x(0), x(1), x(2)], [46, 169, 292]);
  assert.deepEqual([y(5), y(4), y(3)], [6, 55, 104]);
  const one = lossScale([2], 300, 120);  // one loss: at the left, on the bottom line
  assert.deepEqual([one.x(0), one.y(2)], [46, 104]);
  const flat = lossScale([1, 1], 300, 120);
  assert.deepEqual([flat.y(1), flat.x(1)], [104, 292]);
});

test("loss curve markup: the polyline's points, a dot per step below 60 steps, the axis labels", () => {
  const svg = lossCurve([5, 3, 4], 300, 120);
  assert.ok(svg.includes('<polyline points="46.0,6.0 169.0,104.0 292.0,55.0" class="hd-line"/>'));
  assert.equal((svg.match(/<circle /g) || []).length, 3);
  assert.ok(svg.includes('<title>step 1: 3.0000</title>'));
  assert.ok(svg.includes('>5.000</text>') && svg.includes('>3.000</text>') && svg.includes('>step 2</text>'));
  assert.equal((lossCurve(Array.from({ length: 60 }, (_, i) => i), 300, 120).match(/<circle /g) || []).length, 0);
  assert.equal(lossCurve([], 300, 120), '<div class="hd-empty">no loss reported yet</div>');
});

test("validation losses: a square at each validation step, inside the scale; none past the last step", () => {
  const svg = lossCurve([5, 3, 4], 300, 120, [[1, 2], [7, 9]]);
  assert.equal((svg.match(/<rect class="hd-val"/g) || []).length, 1);  // step 7 is not trained yet
  assert.ok(svg.includes("<title>step 1: validation 2.0000</title>"));
  assert.ok(svg.includes(">2.000</text>") && svg.includes(">5.000</text>"));  // the range takes the val loss in
  const { lo } = lossScale([5, 3, 4], 300, 120, [[1, 2]]);
  assert.equal(lo, 2);
});

test("training figures: the last validation loss, the learning rate and the gradient norm, where reported", () => {
  const t = trainingFigures({ val_losses: [[1, 4.5], [3, 4.25]], lr: 0.003, grad_norm: 1.23456 });
  assert.ok(t.includes("val 4.2500") && t.includes("step 3") && t.includes("lr 3.00e-3") && t.includes("1.235"));
  assert.equal(trainingFigures({}), "");
});

const RANKS = [{ rank: 0, state: "running", time: 0.5, memory_mb: 2048 }, { rank: 1, state: "running", time: 0.8 },
  { rank: 2, state: "dead", time: 1.6, why: "killed", died_step: 5 }, { rank: 3, state: "removed", why: "host gone" },
  { rank: 4, state: "starting" }];

test("ranks: the current world apart from the removed ones; without ranks, one per step time", () => {
  const { shown, removed } = rankList({ ranks: RANKS });
  assert.deepEqual(shown.map((r) => r.rank), [0, 1, 2, 4]);
  assert.deepEqual(removed.map((r) => r.rank), [3]);
  assert.deepEqual(rankList({ ranks: [], step_times: [[0, 1.5], [1, 0.2]], running: true }).shown,
    [{ rank: 0, state: "running", time: 1.5 }, { rank: 1, state: "running", time: 0.2 }]);
  assert.deepEqual(rankList({ step_times: [[3, 1]], running: false }).shown, [{ rank: 3, state: "done", time: 1 }]);
  assert.deepEqual(rankList({}), { shown: [], removed: [] });
});

test("rank bars: the slowest live rank fills the bar; a dead rank's bar is full, a rank without a time empty", () => {
  const { shown } = rankList({ ranks: RANKS });
  const hi = barScale(shown);
  assert.equal(hi, 0.8);  // the dead rank's 1.6 s does not count
  assert.deepEqual(shown.map((r) => barWidth(r, hi)), [62.5, 100, 100, 0]);
  assert.equal(barScale([]), 1);
  assert.equal(barScale([{ state: "dead", time: 3 }]), 1);
});

test("rank rows markup: state, time or what happened, memory, the slowest marked, the removed apart", () => {
  const html = rankRows({ ranks: RANKS, slowest: 1, world: [0, 1, 2] });
  assert.ok(html.includes('<div class="hd-rank hd-running hd-slow" data-rank="1" data-state="running">'));
  assert.ok(html.includes('<span class="hd-bar"><span style="width:63%"></span></span><span class="hd-time">500 ms</span>'));
  assert.ok(html.includes('<span class="hd-mark" title="killed">✕ killed · step 5</span>'));
  assert.ok(html.includes('<span class="hd-time hd-empty">starting…</span>'));
  assert.ok(html.includes('title="peak memory of this rank\'s process">2.0 GiB</span>'));
  assert.ok(html.includes('removed from the job (3 ranks now): <button class="hd-rl hd-gone" data-rank="3" title="host gone · show its log">R3</button>'));
  assert.equal(rankRows({}), '<div class="hd-empty">no rank reported yet</div>');
});

test("memory: measured beside the estimate in one unit, the ratio and what each holds in the tooltip", () => {
  assert.equal(memPair(284.8, 281.2), "0.28 GiB measured / 0.27 GiB est.");
  assert.equal(memPair(60, 80), "60.0 MiB measured / 80.0 MiB est.");
  assert.equal(memPair(60, 2100), "0.06 GiB measured / 2.05 GiB est.");  // the larger chooses the unit
  assert.equal(memPair(2048, null), "2.0 GiB");
  assert.equal(memPair(null, 3), "");
  const cell = memCell({ memory_mb: 400, memory_estimate_mb: 300 }, "measured: RSS & more");
  assert.ok(cell.includes('title="measured: RSS &amp; more · estimate/measured 0.75">0.39 GiB measured / 0.29 GiB est.</span>'), cell);
  assert.equal(memCell({ memory_mb: null, memory_estimate_mb: 300 }), "");
  const html = rankRows({ ranks: [{ rank: 0, state: "running", time: 0.5, memory_mb: 284.8, memory_estimate_mb: 281.2 }],
    memory_note: "n" });
  assert.ok(html.includes(">0.28 GiB measured / 0.27 GiB est.</span>"), html);
});

test("progress: steps done over steps, at most 1, 0 without a step count", () => {
  assert.equal(progress({ step: 7, steps: 20 }), 0.35);
  assert.equal(progress({ step: 25, steps: 20 }), 1);
  assert.equal(progress({ step: 3, steps: 0 }), 0);
  assert.equal(progress({ step: 3 }), 0);
});

test("stop button: a first click arms it, a second stops the job; a finished job has nothing to stop", () => {
  const s = { running: true, can_stop: true };
  const ui = { armed: false, stopping: false };
  assert.equal(stopState(s, ui), "ready");
  assert.equal(pressStop(ui), false);
  assert.deepEqual(ui, { armed: true, stopping: false });
  assert.equal(stopState(s, ui), "armed");
  assert.equal(pressStop(ui), true);  // now send {type: "stop"}
  assert.deepEqual(ui, { armed: false, stopping: true });
  assert.equal(stopState(s, ui), "stopping");
  settle(s, ui);  // still running: nothing changes
  assert.deepEqual(ui, { armed: false, stopping: true });
  settle({ running: false }, ui);
  assert.deepEqual(ui, { armed: false, stopping: false });
  assert.equal(stopState({ running: false, can_stop: false }, ui), null);
  assert.equal(stopState({ running: false, can_stop: false }, { armed: false, stopping: true }), null);
  settle(null, ui);  // no state yet: nothing to do
});

test("plan and log panels: their texts", () => {
  assert.equal(planView(null), "");
  assert.equal(planView({ pipelines: [] }), "");
  const plan = planView({ since: "step 5", pipelines: [{ micro: "4×1", stages: [{ ranks: [0, 1], layers: "0-1" }, { ranks: [2], layers: "" }] }] });
  assert.ok(plan.includes("plan now <small>(since step 5; launch ranks)</small>"));
  assert.ok(plan.includes('R0,1 <small>L0-1</small></span><span class="hd-arrow">→</span><span class="hd-stage" title="ranks 2">R2</span>'));
  assert.equal(logView(null), "");
  assert.equal(logView({ rank: null }), "");
  const log = logView({ rank: 1, lines: 250, path: "/tmp/r1.log", text: "a<b>" });
  assert.ok(log.includes("(last 200 of 250 lines · whole log: /tmp/r1.log)"));
  assert.ok(log.includes("<pre>a&lt;b&gt;</pre>"));
});

test("status badge: a gracefully stopped job reads 'stopped at step N', coloured as stopped; others their status", () => {
  assert.equal(statusBadge({ status: "stopped", status_text: "stopped at step 5" }),
    `<span class="hd-status hd-stopped">stopped at step 5</span>`);
  assert.equal(statusBadge({ status: "succeeded", status_text: "succeeded" }),
    `<span class="hd-status hd-succeeded">succeeded</span>`);
  assert.equal(statusBadge({ status: "running" }), `<span class="hd-status hd-running">running</span>`);
});

test("stop button: its tooltip says what it does to this job (graceful job.stop() or job.cancel())", () => {
  const graceful = { stop_hint: "stop this job gracefully: every worker finishes the step it is in (job.stop())" };
  assert.match(stopButton(graceful, "ready"), /title="stop this job gracefully: [^"]*\(job\.stop\(\)\)"/);
  assert.doesNotMatch(stopButton(graceful, "ready"), /job\.cancel/);
  assert.match(stopButton({}, "armed"), /title="stop every worker of this job now \(job\.cancel\(\)\)">click again/);
  assert.equal(stopButton(graceful, "stopping"), `<button class="hd-stop" disabled>stopping…</button>`);
  assert.equal(stopButton(graceful, null), "");
});
