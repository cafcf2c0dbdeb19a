"""Responsiveness of the plan editor in a real browser: milliseconds from a click on a device tile to the DOM
change, for the paper's largest setup (48 GPUs: ``Cluster.mixed({"H800": 16, "H20": 32})``, the 32B model,
Table 9's strategy), measured inside the page (``performance.now()`` at the pointer press, a MutationObserver
on the widget).

* **validated redraw**: the kernel has validated the edit (strategy checks, simulation) and the canvas shows it;
* **communication arrows**: the stage-boundary arrows of the new plan are drawn (its communication resolved by
  ``plan_from_strategy`` + ``specialize`` on the editor's background thread).

Peer, in the same run and the same JupyterLab: the previous editor (plotly ``FigureWidget`` tiles, ipywidgets
panel; the SDK at commit ``bfc15e5``, extracted with ``git archive``), whose redraw is its summary's text and
whose communication was text only ("stage boundary ...") -- the ~290 ms / ~520 ms of issue 16.

Each repeat selects pipeline 0's stage 1 (ranks 20-23, TP4) and clicks ranks out of it and back (on the canvas
Alt+click, the gesture that moves a device; a plain click only inspects it): removing one
gives TP3 (invalid: 64 heads), a second TP2 (valid, a plan not seen before: its communication is resolved anew),
putting them back TP3 then TP4 (valid, cached).  Run: ``python benchmarks/bench_editor_browser.py [repeats]``;
it prints a table and writes ``benchmarks/results/editor_browser.json`` with the load average.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _lab import CHROME_ARGS, CHROMIUM, jupyter_lab, notebook, open_notebook, run_all, watch_console  # noqa: E402

PEER_COMMIT = "bfc15e5"
EXAMPLES = ROOT / "hspmd_sdk" / "examples"
SETUP = """from hspmd_sdk import Cluster, LlamaConfig, Strategy
from hspmd_sdk.viz import PlanEditor
ed = PlanEditor(Cluster.mixed({{"H800": 16, "H20": 32}}), LlamaConfig.preset("llama-32b"),
                Strategy.load({path!r}), global_batch=64, seq_len=4096)"""
#: (rank clicked, a new valid plan is expected) -- from TP4 [20-23]: out 23 (TP3), out 22 (TP2 new), in, in.
SEQUENCES = [[(23, False), (22, True), (22, False), (23, False)], [(21, False), (20, True), (20, False), (21, False)],
             [(23, False), (21, True), (21, False), (23, False)], [(22, False), (20, True), (20, False), (22, False)]]

PROBE = """([kind, wantArrows]) => { window.__probe = new Promise((resolve) => {
  const root = kind === 'new' ? document.querySelector('.hspmd-canvas')
                              : document.querySelector('.hspmd-plan-editor .hspmd-summary-widget');
  const b = {t0: null, redraw: null, arrows: null};
  const before = kind === 'new' ? root.dataset.version : root.innerText;
  const done = () => { obs.disconnect(); clearTimeout(timer); document.removeEventListener('pointerdown', down, true);
                       resolve(b); };
  const down = () => { b.t0 = performance.now(); };
  document.addEventListener('pointerdown', down, true);
  const check = () => {
    if (b.t0 == null) return;
    const now = performance.now();
    if (kind === 'new') {
      if (b.redraw == null && root.dataset.version !== before) b.redraw = now - b.t0;
      if (b.redraw != null && wantArrows && b.arrows == null && root.dataset.comm === 'ready'
          && root.querySelectorAll('polyline.hc-arrow').length) b.arrows = now - b.t0;
    } else {
      const text = root.innerText;
      if (b.redraw == null && text !== before) b.redraw = now - b.t0;
      if (b.redraw != null && wantArrows && b.arrows == null && text.includes('stage boundary')
          && !text.includes('resolving')) b.arrows = now - b.t0;
    }
    if (b.redraw != null && (!wantArrows || b.arrows != null)) done();
  };
  const obs = new MutationObserver(check);
  obs.observe(kind === 'new' ? root : root.parentElement, {attributes: true, subtree: true, childList: true,
                                                          characterData: true});
  const timer = setTimeout(done, 20000);
}); }"""


def _peer_tree(dst: Path) -> Path:
    """The SDK as it was at PEER_COMMIT (``git archive``), importable from ``dst``."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", PEER_COMMIT, "hspmd_sdk"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=tar, check=True)
    return dst


def _tile_new(page, rank: int):
    return page.locator(f".hspmd-canvas .hc-tile[data-rank='{rank}']")


def _tile_old(page, rank: int):
    return page.locator(".hspmd-plan-editor .js-plotly-plot .scatterlayer .trace").first.locator("path.point").nth(rank)


def _click(page, loc, alt: bool = False) -> None:
    """Click the centre of ``loc`` (``alt``: Alt+click, the canvas's gesture that moves a device in or out of the
    selected stage; a plain click only inspects it)."""
    box = loc.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.wait_for_timeout(120)
    if alt:
        page.keyboard.down("Alt")
    page.mouse.click(x, y)
    if alt:
        page.keyboard.up("Alt")


def _measure(page, kind: str, repeats: int) -> dict[str, list[float]]:
    if kind == "new":
        page.locator(".hspmd-canvas .hc-chip[data-drop='0,1']").click()
    else:
        page.locator(".hspmd-plan-editor button:has-text('S1')").first.click()
    page.wait_for_timeout(1500)
    out: dict[str, list[float]] = {"redraw": [], "arrows": [], "redraw_valid_new": []}
    for k in range(repeats):
        for rank, new_plan in SEQUENCES[k % len(SEQUENCES)]:
            page.evaluate(PROBE, [kind, new_plan])  # arms the observer; the promise waits in window.__probe
            _click(page, (_tile_new if kind == "new" else _tile_old)(page, rank), alt=kind == "new")
            b = page.evaluate("() => window.__probe")
            if b["redraw"] is None:
                raise RuntimeError(f"{kind}: no redraw after clicking rank {rank}")
            out["redraw"].append(b["redraw"])
            if new_plan:
                out["redraw_valid_new"].append(b["redraw"])
                if b["arrows"] is not None:
                    out["arrows"].append(b["arrows"])
            page.wait_for_timeout(400)
    return out


def _summary(xs: list[float]) -> str:
    if not xs:
        return "-"
    q = sorted(xs)
    return f"{statistics.median(q):7.0f} ms (p90 {q[min(len(q) - 1, int(0.9 * len(q)))]:.0f}, n={len(q)})"


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    from playwright.sync_api import sync_playwright

    load_before = os.getloadavg()
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "peer").mkdir()
        peer = _peer_tree(tmp / "peer")
        with jupyter_lab(tmp / "lab", save_widget_state=False) as lab:
            table9 = str(EXAMPLES / "table9_32b_16h800_32h20.json")
            notebook([SETUP.format(path=table9), "ed.widget"], lab.root / "new.ipynb")
            notebook([f"import sys; sys.path.insert(0, {str(peer)!r})\n" + SETUP.format(path=table9)
                      + "\nimport hspmd_sdk; assert hspmd_sdk.__file__.startswith(" + repr(str(peer)) + ")",
                      "ed.widget"], lab.root / "old.ipynb")
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
                for kind, name in (("new", "new.ipynb"), ("old", "old.ipynb")):
                    page = browser.new_page(viewport={"width": 1600, "height": 1200})
                    page.set_default_timeout(90_000)
                    errors: list[str] = []
                    watch_console(page, errors)
                    open_notebook(page, lab.url(name, workspace=kind))
                    run_all(page, 240)
                    page.wait_for_timeout(3000)
                    (_tile_new if kind == "new" else _tile_old)(page, 47).wait_for(state="attached")
                    t0 = time.monotonic()
                    results[kind] = _measure(page, kind, repeats)
                    print(f"{kind}: measured in {time.monotonic() - t0:.0f} s; console errors: {errors or 'none'}")
                    page.close()
                    lab.shutdown_kernels()
                browser.close()
    load_after = os.getloadavg()
    print(f"\n48 GPUs (16 H800 + 32 H20), llama-32b, Table 9; {repeats} repeats of 4 clicks; in-page timing")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} (2 cores)")
    print(f"{'':44s} {'canvas (this SDK)':>28s} {'peer: FigureWidget editor':>30s}")
    rows = [("click -> validated redraw, any edit", "redraw"),
            ("click -> validated redraw, new valid plan", "redraw_valid_new"),
            ("click -> communication of a new plan drawn", "arrows")]
    for label, key in rows:
        print(f"{label:44s} {_summary(results['new'][key]):>28s} {_summary(results['old'][key]):>30s}")
    med = {k: {m: statistics.median(v) if v else None for m, v in r.items()} for k, r in results.items()}
    for _, key in rows:
        if med["new"][key] and med["old"][key]:
            print(f"  ratio {key}: peer / canvas = {med['old'][key] / med['new'][key]:.2f}")
    print("goals (issue 16): median validated redraw < 150 ms; communication arrows < 500 ms")
    out = ROOT / "benchmarks" / "results" / "editor_browser.json"
    out.write_text(json.dumps({"setup": "48 GPUs (16 H800 + 32 H20), llama-32b, Table 9", "repeats": repeats,
                               "loadavg_before": load_before, "loadavg_after": load_after, "ms": results,
                               "median_ms": med, "peer": f"editor at {PEER_COMMIT} (plotly FigureWidget)"},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
