// The entry modules keep the anywidget contract: a default export with render({model, el}) returning a cleanup
// function, and the named exports the shipped files always had (plan_canvas: layout; job_dashboard: clock).
import { test } from "node:test";
import assert from "node:assert/strict";
import * as canvas from "../src/plan_canvas/index.js";
import * as dashboard from "../src/job_dashboard/index.js";

test("entries: default {render} and their named exports", () => {
  assert.deepEqual(Object.keys(canvas).sort(), ["default", "layout"]);
  assert.deepEqual(Object.keys(dashboard).sort(), ["clock", "default"]);
  assert.equal(typeof canvas.default.render, "function");
  assert.equal(typeof dashboard.default.render, "function");
  assert.equal(dashboard.clock(61), "1:01");
});
