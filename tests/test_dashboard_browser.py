"""The job dashboard in a real browser (JupyterLab on loopback + headless Chromium, Playwright): a killed rank is
marked dead on the page while the others go on, a click on a rank opens its log, and the stop button (two
clicks) stops the job through ``job.cancel()``.

The notebook launches 2 local workers that report a step every 50 ms (a policy lets the job go on after a
failure) and kills rank 1 with SIGKILL after its third step.  Skipped only when ``/usr/bin/chromium`` is missing
and ``CI`` is not set.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from _lab import CHROME_ARGS, CHROMIUM, jupyter_lab, notebook, open_notebook, page_problems, run_all, watch_console

if not Path(CHROMIUM).exists() and not os.environ.get("CI"):
    pytest.skip("no /usr/bin/chromium (and not in CI)", allow_module_level=True)
if not os.environ.get("CI"):
    pytest.importorskip("playwright.sync_api")
from playwright.sync_api import expect, sync_playwright  # noqa: E402  (in CI a missing Playwright is a failure)

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
LAUNCH = """from hspmd_sdk import Cluster
from hspmd_sdk.runtime import launch
from hspmd_sdk.runtime.control.faults import Reaction


class GoOn:  # the job goes on after a failure
    def on_failure(self, job, failure):
        return Reaction.CONTINUE


job = launch(cluster=Cluster.local(2), entry="hspmd_sdk.testing.entries:fail_alone", steps=4000, policy=GoOn(),
             payload={"rank": -1, "steps_each": 4000, "pause": 0.05}, heartbeat_s=1.0, timeout_s=60)
from hspmd_sdk.viz import JobDashboard
JobDashboard(job)"""
KILL = """import os, signal, time
while len(job.metrics.rank(1)) < 3:
    time.sleep(0.05)
os.kill(job.pids()[1], signal.SIGKILL)"""


@pytest.mark.timeout(240)
def test_a_killed_rank_is_marked_and_the_stop_button_stops_the_job(tmp_path):
    with jupyter_lab(tmp_path) as lab, sync_playwright() as pw:
        notebook([LAUNCH, KILL], lab.root / "dash.ipynb")
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS, timeout=60_000)
        expect.set_options(timeout=90_000)  # a loaded 2-core machine: workers start slowly
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(90_000)
            errors: list[str] = []
            watch_console(page, errors)
            open_notebook(page, lab.url("dash.ipynb"))
            run_all(page)
            dash = page.locator(".hspmd-dashboard").first
            dead = dash.locator(".hd-rank[data-rank='1']")
            expect(dead).to_have_attribute("data-state", "dead")
            expect(dead.locator(".hd-mark")).to_have_text(re.compile(r"^✕ killed \(SIGKILL\) · step \d+$"))
            expect(dash.locator(".hd-rank[data-rank='0']")).to_have_attribute("data-state", "running")
            expect(dash.locator("li.hd-ev[data-reason='failure']")).to_contain_text("rank 1 exited with status -9")
            assert dash.get_attribute("data-status") == "running"
            assert "elapsed" in dash.locator(".hd-clock").inner_text()
            dead.locator("button.hd-rl").click()  # a click on R1: its log under the dashboard
            expect(dash.locator(".hd-log[data-rank='1'] pre")).to_contain_text("killed by SIGKILL")
            stop = dash.locator("button.hd-stop")
            stop.click()
            expect(stop).to_have_text("click again to stop")
            assert dash.get_attribute("data-status") == "running"  # one click stops nothing
            stop.click()
            expect(dash).to_have_attribute("data-status", "cancelled", timeout=60_000)
            expect(dash.locator(".hd-rank[data-rank='0']")).to_have_attribute("data-state", "stopped")
            expect(dash.locator(".hd-rank[data-rank='1']")).to_have_attribute("data-state", "dead")
            expect(dash.locator("li.hd-ev[data-reason='stopped']")).to_contain_text("stopped from the dashboard")
            assert dash.locator("button.hd-stop").count() == 0
            ARTIFACTS.mkdir(exist_ok=True)
            dash.screenshot(path=str(ARTIFACTS / "dashboard_dead_rank_stopped.png"))
            assert errors == [] and page_problems(page) == []
        finally:
            expect.set_options(timeout=5_000)  # Playwright's default, for other tests
            browser.close()
