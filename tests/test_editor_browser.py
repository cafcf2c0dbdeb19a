"""The plan editor's canvas in a real browser: JupyterLab on loopback + headless Chromium (Playwright).

One JupyterLab server and one Chromium serve the whole module.  A notebook builds an editor on 8 devices (two nodes
of 4) for the tiny model with a two-pipeline plan and displays it; the tests then act as a user would -- drag a
tile into another stage, box- and lasso-select tiles and drag them onto a stage, undo and redo with the buttons and
the keyboard, make an invalid edit and find Save blocked with the reason at the stage, read the communication
arrows and compare them with the Program's boundary Reshards computed in this process (and check that no routed
line crosses a tile it does not connect), click a tile to inspect it (nothing moves) and Alt+click it to move it,
click "+ pipeline" and "+ stage", narrow the window to 550 px (the toolbar wraps), launch the plan locally
and watch the job dashboard, resize the window, save the notebook with its widget state and reopen it.  Every
test asserts that the page logged no console error.  Screenshots go to ``artifacts/``.

Skipped only when ``/usr/bin/chromium`` is missing and ``CI`` is not set.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from _lab import CHROME_ARGS, CHROMIUM, jupyter_lab, notebook, open_notebook, page_problems, run_all, watch_console

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"

if not Path(CHROMIUM).exists() and not os.environ.get("CI"):
    pytest.skip("no /usr/bin/chromium (and not in CI)", allow_module_level=True)
if not os.environ.get("CI"):
    pytest.importorskip("playwright.sync_api")
from playwright.sync_api import Error as PlaywrightError  # noqa: E402  (in CI a missing Playwright is a failure)
from playwright.sync_api import sync_playwright  # noqa: E402

STRATEGY = {"pipelines": [
    {"stages": [{"devices": [4, 5], "layers": [0, 1]}, {"devices": [0], "layers": [2, 3]}],
     "micro_batch_size": 1, "num_micro_batches": 4},
    {"stages": [{"devices": [6, 7], "layers": [0, 2]}, {"devices": [1], "layers": [3, 3]}],
     "micro_batch_size": 1, "num_micro_batches": 4}], "schedule": "1f1b", "zero1": True}
SETUP = f"""from hspmd_sdk import Cluster
from hspmd_sdk.viz import PlanEditor
STRATEGY = {STRATEGY!r}
ed = PlanEditor(Cluster.mixed({{"H800": 4, "H20": 4}}, per_node=4), "tiny", STRATEGY, global_batch=8, seq_len=16)"""
LOCAL = """local = PlanEditor(Cluster.local(2), "tiny", {"pipelines": [{"stages": [
    {"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}],
    "micro_batch_size": 1, "num_micro_batches": 2}]}, seq_len=16)
local.launch_steps = 3
local"""
LIVE = """from hspmd_sdk import Strategy, specialize
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.models.registry import load_model_spec
from hspmd_sdk.runtime.control.train import launch
tiny, two = load_model_spec("tiny"), Cluster.local(2)
dp2 = Strategy.load({"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 1,
                                    "num_micro_batches": 2} for r in (0, 1)]})
running = launch(specialize(tiny, plan_from_strategy(tiny, dp2, two), two), two, steps=80, seq_len=16)
live = PlanEditor(two, tiny, {"pipelines": [{"stages": [{"devices": [1], "layers": [0, 1]},
    {"devices": [0], "layers": [2, 3]}], "micro_batch_size": 1, "num_micro_batches": 4}]}, seq_len=16, job=running)
live"""
DASH = "from hspmd_sdk.viz import JobDashboard\nJobDashboard(running)"
CELLS = 5  # SETUP, ed, LOCAL, LIVE, DASH

pytestmark = pytest.mark.timeout(240)


# ---- fixtures: one server, one browser, one page on the editor notebook ----------------------------------------
@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab")
    with jupyter_lab(tmp) as server:
        notebook([SETUP, "ed", LOCAL, LIVE, DASH], server.root / "editor.ipynb")
        assert CELLS == 5
        yield server


@pytest.fixture(scope="module")
def browser(lab):
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS, timeout=60_000)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def session(lab, browser):
    """The editor notebook, run once; tests share the page (each leaves the plan as it found it)."""
    page = browser.new_page(viewport={"width": 1600, "height": 1100})
    page.set_default_timeout(60_000)
    errors: list[str] = []
    watch_console(page, errors)
    open_notebook(page, lab.url("editor.ipynb"))
    run_all(page)
    page.locator(".hspmd-canvas").first.wait_for()
    page.locator(".hspmd-canvas .hc-tile").nth(7).wait_for()
    yield page, errors
    page.close()


@pytest.fixture()
def ui(session):
    page, errors = session
    canvas = page.locator(".hspmd-canvas").first
    canvas.scroll_into_view_if_needed()
    wait_comm_ready(canvas)
    start = len(errors)
    yield page, canvas
    assert errors[start:] == [], errors[start:]
    assert page_problems(page) == []


# ---- helpers -------------------------------------------------------------------------------------------------
def version(canvas) -> int:
    return int(canvas.get_attribute("data-version") or -1)


def wait_version_after(canvas, v0: int, timeout_s: float = 30) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if version(canvas) > v0:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the canvas did not redraw after version {v0}")


def wait_comm_ready(canvas, timeout_s: float = 30) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if canvas.get_attribute("data-comm") in ("ready", "none"):
            return
        time.sleep(0.05)
    raise TimeoutError(f"communication never resolved: {canvas.get_attribute('data-comm')}")


def tile(canvas, rank: int):
    return canvas.locator(f".hc-tile[data-rank='{rank}']")


def stage_of(canvas, rank: int) -> str:
    return tile(canvas, rank).get_attribute("data-stage") or ""


def centre(loc):
    box = loc.bounding_box()
    assert box is not None
    return box["x"] + box["width"] / 2, box["y"] + box["height"] / 2


def drag(page, src, dst, steps: int = 8) -> None:
    """A real pointer drag: press on ``src``'s centre, move in steps onto ``dst``'s centre, release."""
    x0, y0 = centre(src)
    x1, y1 = centre(dst)
    page.mouse.move(x0, y0)
    page.mouse.down()
    for k in range(1, steps + 1):
        page.mouse.move(x0 + (x1 - x0) * k / steps, y0 + (y1 - y0) * k / steps)
    page.mouse.up()


def act(page, canvas, fn) -> None:
    """Do ``fn`` and wait for the kernel's validated redraw (and for communication to settle)."""
    v0 = version(canvas)
    fn()
    wait_version_after(canvas, v0)
    wait_comm_ready(canvas)


def undo_to(page, canvas, wanted: dict[int, str]) -> None:
    for _ in range(6):
        if all(stage_of(canvas, r) == s for r, s in wanted.items()):
            return
        act(page, canvas, lambda: canvas.locator("button[data-op='undo']").click())
    assert {r: stage_of(canvas, r) for r in wanted} == wanted


INITIAL = {0: "0,1", 1: "1,1", 2: "", 3: "", 4: "0,0", 5: "0,0", 6: "1,0", 7: "1,0"}

#: Every segment of every routed line on the canvas (stage-boundary arrows, a picked Reshard's messages) against every
#: tile it does not connect (Liang-Barsky clipping against the tile shrunk by 1 px): ``{lines, bad}``.
CROSSING = """c => {
  const tiles = [...c.querySelectorAll('.hc-tile')].map(e => ({r: +e.dataset.rank, x0: parseFloat(e.style.left) + 1,
    y0: parseFloat(e.style.top) + 1, x1: parseFloat(e.style.left) + parseFloat(e.style.width) - 1,
    y1: parseFloat(e.style.top) + parseFloat(e.style.height) - 1}));
  const hits = (ax, ay, bx, by, t) => {
    let u0 = 0, u1 = 1; const dx = bx - ax, dy = by - ay;
    for (const [p, q] of [[-dx, ax - t.x0], [dx, t.x1 - ax], [-dy, ay - t.y0], [dy, t.y1 - ay]]) {
      if (p === 0) { if (q < 0) return false; continue; }
      const u = q / p;
      if (p < 0) { if (u > u1) return false; if (u > u0) u0 = u; } else { if (u < u0) return false; if (u < u1) u1 = u; }
    }
    return u1 - u0 > 1e-6;
  };
  const bad = [];
  let lines = 0;
  for (const el of c.querySelectorAll('polyline.hc-msgline, line.hc-msgline, polyline.hc-arrow')) {
    lines++;
    const ends = new Set([...(el.dataset.src || '').split(','), ...(el.dataset.dst || '').split(',')]
      .filter(Boolean).map(Number));
    const pts = el.tagName === 'line' ? [['x1', 'y1'], ['x2', 'y2']].map(k => k.map(a => +el.getAttribute(a)))
      : el.getAttribute('points').trim().split(/\\s+/).map(p => p.split(',').map(Number));
    for (let k = 0; k + 1 < pts.length; k++)
      for (const t of tiles) if (!ends.has(t.r) && hits(...pts[k], ...pts[k + 1], t)) bad.push([el.tagName, t.r]);
  }
  return {lines, bad};
}"""


# ---- tests ---------------------------------------------------------------------------------------------------
def test_apply_to_running_job_switches_the_live_job(session):
    """The third canvas follows a real local job (DP2); "Apply to running job" switches it to the PP2 plan shown:
    the job's dashboard lists the switch with reason "user"."""
    page, errors = session
    start = len(errors)
    canvas = page.locator(".hspmd-canvas").nth(2)
    canvas.scroll_into_view_if_needed()
    wait_comm_ready(canvas)
    apply = canvas.locator("button[data-op='apply']")
    apply.wait_for(timeout=60_000)
    end = time.monotonic() + 90
    while apply.is_disabled() and time.monotonic() < end:  # enabled once the job runs
        time.sleep(0.2)
    assert not apply.is_disabled(), apply.get_attribute("title")
    apply.click()
    dash = page.locator(".hspmd-dashboard").last
    dash.locator("li.hd-ev[data-reason='user']").first.wait_for(timeout=90_000)
    dash.scroll_into_view_if_needed()  # JupyterLab skips drawing cells off screen: their innerText reads ''
    assert "user" in (dash.locator(".hd-events").text_content() or "")
    for attempt in range(5):  # the dashboard redraws itself at every poll (0.5 s) while the job runs: an element
        try:  # screenshot that took longer (scroll, wait for the element to hold still) finds it replaced
            dash.screenshot(path=str(ARTIFACTS / "editor_apply_to_job.png"), timeout=10_000)
            break
        except PlaywrightError as e:
            if "not attached" not in str(e) or attempt == 4:
                raise
    assert errors[start:] == []


def test_drag_a_tile_into_another_stage(ui):
    page, canvas = ui
    assert stage_of(canvas, 2) == ""
    act(page, canvas, lambda: drag(page, tile(canvas, 2), tile(canvas, 0)))  # unused rank 2 onto P0 S1's tile
    assert stage_of(canvas, 2) == "0,1"
    assert canvas.get_attribute("data-valid") == "true"
    row = canvas.locator(".hc-stage[data-stage='0,1'] .hc-ranks")
    assert row.inner_text().startswith("0,2 TP2")
    canvas.screenshot(path=str(ARTIFACTS / "editor_drag.png"))
    undo_to(page, canvas, INITIAL)


def test_box_select_four_tiles_and_drag_them_onto_a_stage_then_undo_and_redo(ui):
    page, canvas = ui
    area = canvas.locator(".hc-stagearea")
    a, b = tile(canvas, 0).bounding_box(), tile(canvas, 3).bounding_box()
    # a box from just above-left of tile 0 to just below-right of tile 3 (the whole row of node0)
    page.mouse.move(a["x"] - 6, a["y"] - 7)
    page.mouse.down()
    page.mouse.move((a["x"] + b["x"]) / 2, a["y"] + 10, steps=4)
    page.mouse.move(b["x"] + b["width"] + 6, b["y"] + b["height"] + 7, steps=4)
    page.mouse.up()
    picked = sorted(int(x) for x in area.locator(".hc-tile.hc-picked").evaluate_all(
        "els => els.map(e => e.dataset.rank)"))
    assert picked == [0, 1, 2, 3]
    assert "4 selected" in canvas.locator(".hc-selbar").inner_text()
    chip = canvas.locator(".hc-chip[data-drop='0,1']")
    act(page, canvas, lambda: drag(page, tile(canvas, 2), chip))  # drag the selection onto P0 S1's chip
    assert [stage_of(canvas, r) for r in range(4)] == ["0,1"] * 4
    # rank 1 left pipeline 1's last stage empty: an error, at that stage, that blocks Save
    row = canvas.locator(".hc-stage[data-stage='1,1']")
    assert "no devices yet" in row.locator(".hc-msg.hc-error").inner_text()
    assert canvas.locator("button[data-op='save']").is_disabled()
    canvas.screenshot(path=str(ARTIFACTS / "editor_box_select.png"))
    act(page, canvas, lambda: canvas.locator("button[data-op='undo']").click())
    assert {r: stage_of(canvas, r) for r in range(8)} == INITIAL
    act(page, canvas, lambda: canvas.locator("button[data-op='redo']").click())
    assert [stage_of(canvas, r) for r in range(4)] == ["0,1"] * 4
    tile(canvas, 5).focus()  # the keyboard: Ctrl+Z undoes, Ctrl+Shift+Z redoes, Ctrl+Z again
    act(page, canvas, lambda: page.keyboard.press("Control+z"))
    assert {r: stage_of(canvas, r) for r in range(8)} == INITIAL
    act(page, canvas, lambda: page.keyboard.press("Control+Shift+z"))
    assert stage_of(canvas, 3) == "0,1"
    act(page, canvas, lambda: page.keyboard.press("Control+z"))
    assert {r: stage_of(canvas, r) for r in range(8)} == INITIAL
    assert page.locator(".jp-Notebook .jp-Cell").count() == CELLS  # JupyterLab's own shortcuts did not fire


def test_lasso_selection_and_keyboard_moves(ui):
    page, canvas = ui
    canvas.locator("button[data-op='mode'][data-mode='lasso']").click()
    (x2, y2), (x3, y3) = centre(tile(canvas, 2)), centre(tile(canvas, 3))
    page.mouse.move(x2 - 45, y2 - 40)  # a lasso around tiles 2 and 3 (a loop through the gaps)
    page.mouse.down()
    for x, y in [(x3 + 45, y3 - 40), (x3 + 45, y3 + 40), (x2 - 45, y2 + 40), (x2 - 44, y2 - 39)]:
        page.mouse.move(x, y, steps=5)
    page.mouse.up()
    picked = sorted(int(x) for x in canvas.locator(".hc-tile.hc-picked").evaluate_all(
        "els => els.map(e => e.dataset.rank)"))
    assert picked == [2, 3]
    canvas.locator("button[data-op='mode'][data-mode='box']").click()
    page.keyboard.press("Escape")
    # keyboard only: select P1 S1 with its chip, focus tile 2, Space selects it, ArrowRight moves to 3, Space,
    # Enter moves both into the selected stage
    act(page, canvas, lambda: canvas.locator(".hc-chip[data-drop='1,1']").click())
    tile(canvas, 2).focus()
    page.keyboard.press("Space")
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.dataset.rank") == "3"
    page.keyboard.press("Space")
    act(page, canvas, lambda: page.keyboard.press("Enter"))
    assert stage_of(canvas, 2) == stage_of(canvas, 3) == "1,1"
    assert canvas.locator(".hc-stage[data-stage='1,1'] .hc-ranks").inner_text().startswith("1-3 TP3")
    assert canvas.get_attribute("data-valid") == "false"  # TP3 does not divide the heads
    undo_to(page, canvas, INITIAL)
    act(page, canvas, lambda: canvas.locator(".hc-chip[data-drop='0,0']").click())


def test_an_invalid_edit_blocks_save_with_the_message_at_the_stage(ui, lab):
    page, canvas = ui
    act(page, canvas, lambda: canvas.locator(".hc-chip[data-drop='0,0']").click())
    act(page, canvas, lambda: tile(canvas, 2).click(modifiers=["Alt"]))  # rank 2 joins P0 S0: TP3 does not divide 4 heads
    assert stage_of(canvas, 2) == "0,0"
    verdict = canvas.locator(".hc-verdict")
    assert "error" in verdict.inner_text() and "Save, Launch and Apply are blocked" in verdict.inner_text()
    msg = canvas.locator(".hc-stage[data-stage='0,0'] .hc-msg.hc-error").inner_text()
    assert "TP degree 3 does not divide" in msg
    save = canvas.locator("button[data-op='save']")
    assert save.is_disabled() and "TP degree 3" in save.get_attribute("title")
    assert "hc-flag-error" in tile(canvas, 2).get_attribute("class")
    save.click(force=True)  # a disabled button does nothing
    page.wait_for_timeout(300)
    assert not (lab.root / "strategy.json").exists()
    canvas.screenshot(path=str(ARTIFACTS / "editor_invalid.png"))
    tile(canvas, 2).focus()
    act(page, canvas, lambda: page.keyboard.press("Control+z"))
    undo_to(page, canvas, INITIAL)
    assert not save.is_disabled()
    act(page, canvas, lambda: save.click())
    assert json.loads((lab.root / "strategy.json").read_text())["pipelines"][0]["stages"][0]["devices"] == [4, 5]


def test_a_plain_click_inspects_and_only_an_explicit_gesture_moves(ui):
    """Exploring a finished plan by clicking changes nothing; Alt+click, the inspect card's button and dragging
    move (the help line says so)."""
    page, canvas = ui
    act(page, canvas, lambda: canvas.locator(".hc-chip[data-drop='0,1']").click())  # select P0 S1 (rank 0)
    assert "Alt+click" in canvas.locator("[data-role='help']").inner_text()
    v0 = version(canvas)
    for r in (2, 4, 0):  # an unused device, one of another stage, the selected stage's own
        tile(canvas, r).click()
        assert canvas.locator(".hc-inspect").get_attribute("data-rank") == str(r)
        assert "hc-inspected" in tile(canvas, r).get_attribute("class")
    assert "pipeline 0, stage 1" in canvas.locator(".hc-inspect").inner_text()
    page.wait_for_timeout(600)
    assert version(canvas) == v0  # nothing reached the kernel: the plan is as it was
    assert {r: stage_of(canvas, r) for r in range(8)} == INITIAL and canvas.get_attribute("data-valid") == "true"
    act(page, canvas, lambda: tile(canvas, 2).click(modifiers=["Alt"]))  # Alt+click: joins the selected stage
    assert stage_of(canvas, 2) == "0,1" and canvas.get_attribute("data-valid") == "true"
    act(page, canvas, lambda: tile(canvas, 2).click(modifiers=["Alt"]))  # and leaves it
    assert stage_of(canvas, 2) == ""
    tile(canvas, 3).click()  # inspect, then the card's explicit move
    act(page, canvas, lambda: canvas.locator(".hc-inspect button[data-op='inspect_move']").click())
    assert stage_of(canvas, 3) == "0,1"
    tile(canvas, 5).focus()
    page.keyboard.press("Escape")  # the card and the pick go
    assert canvas.locator(".hc-inspect").count() == 0 and canvas.locator(".hc-tile.hc-picked").count() == 0
    undo_to(page, canvas, INITIAL)


def test_a_redraw_updates_in_place_keeps_focus_and_shows_the_views_values(ui):
    """A redraw patches the canvas (widgets/src/plan_canvas/patch.js) instead of rebuilding it: what did not change
    keeps its element, the Alt+clicked tile keeps focus while its stage changes, and a value Python refused goes
    back to the view's in its field (as a rebuild showed it)."""
    page, canvas = ui
    act(page, canvas, lambda: canvas.locator(".hc-chip[data-drop='0,1']").click())  # select P0 S1 (rank 0)
    canvas.evaluate("c => { c.querySelector('[data-role=help]').__kept = 1;"
                    " c.querySelector('.hc-tiles').__kept = 1; }")
    act(page, canvas, lambda: tile(canvas, 2).click(modifiers=["Alt"]))  # joins P0 S1
    assert stage_of(canvas, 2) == "0,1"
    assert canvas.evaluate("c => [c.querySelector('[data-role=help]').__kept, c.querySelector('.hc-tiles').__kept,"
                           " document.activeElement && document.activeElement.dataset.rank]") == [1, 1, "2"]
    act(page, canvas, lambda: tile(canvas, 2).click(modifiers=["Alt"]))  # and leaves it
    assert stage_of(canvas, 2) == "" and canvas.evaluate("() => document.activeElement.dataset.rank") == "2"
    field = canvas.locator("input[data-op='ratios'][data-p='0'][data-s='0']")  # P0 S0: ranks 4, 5, even
    assert field.input_value() == ""
    field.fill("three to one")
    act(page, canvas, lambda: field.press("Enter"))  # refused: not whole numbers
    assert "not whole numbers" in canvas.locator(".hc-message").inner_text()
    assert field.input_value() == ""  # the view's value (the draft did not change)
    assert {r: stage_of(canvas, r) for r in range(8)} == INITIAL
    undo_to(page, canvas, INITIAL)


def test_plus_pipeline_and_plus_stage_respond_to_a_click(ui):
    page, canvas = ui
    n = canvas.locator(".hc-pipeline").count()
    act(page, canvas, lambda: canvas.locator(".hc-newpipe").click())
    assert canvas.locator(".hc-pipeline").count() == n + 1
    assert canvas.locator(f".hc-chip[data-drop='{n},0']").get_attribute("aria-pressed") == "true"  # selected
    first = canvas.locator(".hc-pipeline").first
    stages = first.locator(".hc-stage").count()
    act(page, canvas, lambda: first.locator(".hc-newstage").click())
    assert canvas.locator(".hc-pipeline").first.locator(".hc-stage").count() == stages + 1
    act(page, canvas, lambda: canvas.locator("button[data-op='undo']").click())
    act(page, canvas, lambda: canvas.locator("button[data-op='undo']").click())
    assert canvas.locator(".hc-pipeline").count() == n
    assert {r: stage_of(canvas, r) for r in range(8)} == INITIAL
    act(page, canvas, lambda: canvas.locator(".hc-chip[data-drop='0,0']").click())


def test_the_toolbar_wraps_at_550_px(session):
    page, errors = session
    start = len(errors)
    page.set_viewport_size({"width": 550, "height": 1000})
    try:
        canvas = page.locator(".hspmd-canvas").first
        canvas.scroll_into_view_if_needed()
        page.wait_for_timeout(600)  # the ResizeObserver re-lays the canvas out
        fit = canvas.evaluate("""c => { const t = c.querySelector('.hc-toolbar'), b = t.getBoundingClientRect();
            const out = [...t.querySelectorAll('button, select, input, label')].map(e => e.getBoundingClientRect())
              .filter(r => r.width && (r.right > b.right + 1 || r.left < b.left - 1)).length;
            const area = c.closest('.jp-OutputArea-output') || c.parentElement;
            return {out, scroll: t.scrollWidth - t.clientWidth, right: b.right, root: c.getBoundingClientRect().right,
                    spill: c.scrollWidth - c.clientWidth,
                    area: area.getBoundingClientRect().right, rows: new Set([...t.children].map(e => Math.round(e.getBoundingClientRect().top))).size}; }""")
        assert fit["out"] == 0 and fit["scroll"] <= 0, fit  # every control inside the toolbar: it wraps
        assert fit["root"] <= fit["area"] + 1 and fit["spill"] <= 1, fit  # the canvas inside its output, nothing
        # sticking out of it (the stage area scrolls inside itself)
        assert fit["rows"] >= 2, fit
        canvas.locator(".hc-toolbar").screenshot(path=str(ARTIFACTS / "editor_toolbar_550px.png"))
    finally:
        page.set_viewport_size({"width": 1600, "height": 1100})
    assert errors[start:] == []


def test_communication_arrows_match_the_programs_boundary_reshards(ui):
    page, canvas = ui
    from hspmd_sdk import Cluster
    from hspmd_sdk.viz import PlanEditor
    from hspmd_sdk.viz._units import fmt_bytes

    cluster = Cluster.mixed({"H800": 4, "H20": 4}, per_node=4)
    ref = PlanEditor(cluster, "tiny", STRATEGY, global_batch=8, seq_len=16, background=False)
    program, strategy = ref.program, ref.strategy
    want = []
    for name, plan in program.comm_plans.items():  # boundary Reshards: a subgroup moves to other devices
        for k, (a, b) in enumerate(zip(plan.src.dg_union, plan.dst.dg_union)):
            if set(a) == set(b):
                continue
            senders = set(a) | set(b)
            fwd = {r: v for r, v in plan.volume(cluster).items() if r in senders}
            bwd = {r: v for r, v in program.backward_plans[name].volume(cluster).items() if r in senders}
            per = {c: sum(v[c] for v in fwd.values()) + sum(v[c] for v in bwd.values()) for c in ("intra", "inter")}
            cls = "mixed" if all(per.values()) else "inter" if per["inter"] else "intra"
            want.append((name, f"{' + '.join(plan.kinds)} · {fmt_bytes(sum(per.values()))}/step", cls))
    labels = canvas.locator(".hc-arrow-label")
    got = labels.evaluate_all("els => els.map(e => [e.dataset.reshard, e.textContent.split('×')[0].trim(),"
                              " [...e.classList].find(c => ['hc-intra', 'hc-inter', 'hc-mixed'].includes(c))])")
    got = [(r, t, c.removeprefix("hc-")) for r, t, c in got]
    assert canvas.locator("polyline.hc-arrow").count() == len(want) == 2
    assert sorted(got) == sorted(want)
    routed = canvas.evaluate(CROSSING)  # the arrows run through the gaps: across no tile they do not connect
    assert routed["lines"] == 2 and routed["bad"] == [], routed
    n = len(page.locator(".jp-OutputArea-output .js-plotly-plot").all())
    labels.first.click()  # click-through to comm_figure below the canvas
    page.locator(".js-plotly-plot").nth(n).wait_for()
    assert strategy.num_ranks == 6


def test_pick_a_tensor_to_see_its_dg_union_and_shards(ui):
    page, canvas = ui
    canvas.locator("select[data-op='tgroup']").select_option("layers.0")  # the group: local to the page
    act(page, canvas, lambda: canvas.locator("select[data-op='tname']").select_option("layers.0.attn.wq"))
    assert canvas.locator("g.hc-union").count() == 2  # one dashed hull per DG Union subgroup ([4,5], [6,7])
    assert canvas.locator(".hc-tile .hc-grid").count() == 4  # a shard grid on each device that holds it
    legend = canvas.locator(".hc-tensor").inner_text()
    assert "HSize 2" in legend and "G0 [4,5]" in legend and "G1 [6,7]" in legend
    terms = canvas.locator(".hc-tensor .hc-terms").inner_text()  # HSize and HDim explained, in the paper's terms
    assert "Heterogeneous Size" in terms and "Heterogeneous Dimension" in terms and "DG Union" in terms
    canvas.screenshot(path=str(ARTIFACTS / "editor_tensor.png"))
    box = canvas.locator("input[data-op='tensor']")
    box.fill("lm_head")
    act(page, canvas, lambda: box.press("Enter"))
    assert "did you mean lm_head.weight" in canvas.locator(".hc-message").inner_text()
    assert canvas.locator("g.hc-union").count() == 2  # an unknown name changes nothing
    box.fill("layers.2.in")  # an activation (batch, seq, hidden) and its Reshard's messages
    act(page, canvas, lambda: box.press("Enter"))
    assert "dims 1, 2 held whole" in canvas.locator(".hc-tensor").inner_text()  # no dim silently left out
    routed = canvas.evaluate(CROSSING)
    assert routed["lines"] >= 1 and routed["bad"] == [], routed  # its lines cross no unrelated tile
    canvas.screenshot(path=str(ARTIFACTS / "editor_activation.png"))
    act(page, canvas, lambda: canvas.locator("button[data-op='untensor']").click())
    assert canvas.locator("g.hc-union").count() == 0 and canvas.locator("g.hc-hull").count() > 0


def test_the_zero_level_is_chosen_in_the_toolbar(ui):
    """The toolbar's ZeRO select (0-3) sets the level in the kernel's editor: the redraw it answers with shows the
    level chosen, and the plan's JSON has it; then back to ZeRO-1."""
    page, canvas = ui
    level = canvas.locator("select[data-op='zero']")
    assert level.input_value() == "1"  # the strategy's zero1
    assert [o.strip() for o in level.locator("option").all_inner_texts()] == [
        "0: none", "1: optimizer states", "2: + gradients", "3: + weights"]
    act(page, canvas, lambda: level.select_option("3"))
    assert canvas.locator("select[data-op='zero']").input_value() == "3"
    act(page, canvas, lambda: canvas.locator("select[data-op='zero']").select_option("1"))
    assert canvas.locator("select[data-op='zero']").input_value() == "1"


def test_launch_locally_and_follow_the_job_in_the_dashboard(session):
    page, errors = session
    start = len(errors)
    canvas = page.locator(".hspmd-canvas").nth(1)
    canvas.scroll_into_view_if_needed()
    wait_comm_ready(canvas)
    launch = canvas.locator("button[data-op='launch']")
    assert not launch.is_disabled(), launch.get_attribute("title")
    launch.click()
    # this editor's own output: the live editor and the DASH cell below show other (80-step) dashboards
    dash = canvas.locator("xpath=ancestor::div[contains(@class, 'jp-OutputArea')][1]").locator(".hspmd-dashboard")
    dash.wait_for(timeout=90_000)
    end = time.monotonic() + 150
    while dash.get_attribute("data-status") != "succeeded" and time.monotonic() < end:
        time.sleep(0.2)
    assert dash.get_attribute("data-status") == "succeeded"
    assert dash.get_attribute("data-step") == "3"
    assert dash.locator(".hd-loss circle").count() == 3 and dash.locator(".hd-rank").count() == 2
    assert "cannot switch" in dash.inner_text() or "events" in dash.inner_text()
    dash.screenshot(path=str(ARTIFACTS / "editor_dashboard.png"))
    assert errors[start:] == []


@pytest.mark.parametrize("width", [1024, 1280, 1600])
def test_responsive_from_1024_px(session, width):
    page, errors = session
    start = len(errors)
    page.set_viewport_size({"width": width, "height": 1000})
    canvas = page.locator(".hspmd-canvas").first
    canvas.scroll_into_view_if_needed()
    page.wait_for_timeout(600)  # the ResizeObserver re-lays the canvas out
    fit = canvas.evaluate("""c => { const a = c.querySelector('.hc-area'), s = c.querySelector('.hc-stagearea');
        const t = [...c.querySelectorAll('.hc-tile')].map(e => e.getBoundingClientRect());
        const overlap = t.some((p, i) => t.some((q, j) => i < j && p.left < q.right && q.left < p.right
                                                           && p.top < q.bottom && q.top < p.bottom));
        return {area: a.clientWidth, stage: s.scrollWidth, tile: t[0].width, overlap,
                page: document.scrollingElement.scrollWidth, view: window.innerWidth}; }""")
    assert fit["stage"] <= fit["area"] + 1, fit  # nothing clipped: no horizontal scrollbar in the canvas
    assert fit["page"] <= fit["view"], fit  # nor on the page
    assert fit["tile"] >= 58 and not fit["overlap"], fit  # legible tiles that do not overlap
    canvas.screenshot(path=str(ARTIFACTS / f"editor_{width}px.png"))
    page.set_viewport_size({"width": 1600, "height": 1100})
    assert errors[start:] == []


def test_reopening_the_saved_notebook_shows_no_widget_error(session, lab, browser):
    page, errors = session
    path = lab.root / "editor.ipynb"
    end = time.monotonic() + 120  # every job on the page has ended: no widget changes during or after the save
    while time.monotonic() < end:
        status = page.locator(".hspmd-dashboard").evaluate_all("els => els.map(e => e.dataset.status)")
        if status and all(s in ("succeeded", "failed", "cancelled") for s in status):
            break
        time.sleep(0.3)
    assert status and all(s in ("succeeded", "failed", "cancelled") for s in status), status
    page.wait_for_timeout(500)
    before = path.stat().st_mtime_ns
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    saved = {}
    end = time.monotonic() + 30
    while time.monotonic() < end:  # this save, not an earlier autosave
        if path.stat().st_mtime_ns != before:
            saved = json.loads(path.read_text())
            if saved.get("metadata", {}).get("widgets"):
                break
        time.sleep(0.3)
    state = saved["metadata"]["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    assert any(m.get("model_name") == "AnyModel" for m in state.values())  # the canvas is in the saved state
    shown = [o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] for c in saved["cells"]
             for o in c.get("outputs", []) if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    # the three editors and the dashboard (and a job's progress bar, where the runtime shows one)
    assert len(shown) >= 4 and all(m in state for m in shown)
    refs = {m: set(re.findall(r"IPY_MODEL_([0-9a-f]+)", json.dumps(v["state"]))) for m, v in state.items()}
    dangling = {(m, state[m].get("model_name"), r) for m, rs in refs.items() for r in rs if r not in state}
    assert not dangling, dangling  # every child a saved widget refers to is saved too
    assert errors == []
    page.close()  # the user closes the notebook (and JupyterLab), then comes back to it later
    # jupyterlab-manager 5 has a race of its own: a restore from the freshly started kernel alone can mark the
    # manager "restored" before the notebook's saved state is loaded, and a view that waited 2 s for its model then
    # shows "model not found" for good (seen here when the new kernel starts slowly on a loaded machine; reopening
    # is tracked upstream in jupyterlab/jupyterlab#15361).  The fresh kernel is therefore started (and idle) before
    # the notebook opens, and an attempt that still fails with exactly that race's signature and nothing else is
    # retried.  Our part -- a complete saved state that renders without errors -- fails every attempt if broken.
    race = "Error displaying widget: model not found"
    for attempt in range(3):
        lab.shutdown_kernels()
        lab.start_kernel("editor.ipynb")
        fresh = browser.new_page(viewport={"width": 1400, "height": 1000})
        errs: list[str] = []
        watch_console(fresh, errs)
        try:
            open_notebook(fresh, lab.url("editor.ipynb"))
            fresh.wait_for_function(  # the first editor drawn from the saved state, or the race seen
                "r => document.querySelectorAll('.hspmd-canvas .hc-tile').length >= 8"
                " || document.querySelector('.jp-Notebook').innerText.includes(r)", arg=race, timeout=60_000)
            fresh.wait_for_timeout(1500)
            text = fresh.locator(".jp-Notebook").inner_text()
            raced = (race in text and errs and all(e.startswith("console: Error: widget model not found") for e in errs)
                     and page_problems(fresh) == ["Error displaying widget"])
            if raced and attempt < 2:
                print(f"reopen attempt {attempt + 1}: jupyterlab-manager's restore race; retrying")
                continue
            assert "Error displaying widget" not in text, (errs, page_problems(fresh))
            assert fresh.locator(".hspmd-canvas .hc-tile").count() >= 8
            assert page_problems(fresh) == []
            fresh.screenshot(path=str(ARTIFACTS / "editor_reopened.png"))
            assert errs == [], errs
            break
        finally:
            fresh.close()
