"""The widgets' front ends (``widgets/``): their JavaScript unit tests pass (Node's test runner: hit tests, box and
lasso selection, hulls, arrow routing, the keyboard's undo/redo and moves, the dashboard's helpers), and the
bundles shipped in ``hspmd_sdk/viz/static/`` are exactly what esbuild builds from ``widgets/src`` (so an edit of
the sources without ``npm run build``, or an edit of a bundle by hand, fails here).

Both need Node and ``widgets/node_modules`` (``npm ci`` in ``widgets/``; the test command does it): without them
the tests are skipped, unless ``CI`` is set, where that is a failure.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WIDGETS = ROOT / "widgets"
STATIC = ROOT / "hspmd_sdk" / "viz" / "static"


def _node() -> str:
    """The node executable; skips (fails in CI) without it or without widgets/node_modules."""
    node = shutil.which("node")
    why = None
    if node is None:
        why = "no `node` on PATH (Node >= 18 runs the widgets' tests and build)"
    elif not (WIDGETS / "node_modules" / "esbuild").is_dir():
        why = "no widgets/node_modules (run `npm ci` in widgets/, as scripts/test.sh does)"
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI is set, so this is a failure")
        pytest.skip(why)
    return node


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=110)


@pytest.mark.timeout(120)
def test_the_widgets_javascript_unit_tests_pass():
    node = _node()
    r = _run([node, "--test", "test/"], WIDGETS)
    assert r.returncode == 0, f"node --test test/ (in widgets/) failed:\n{r.stdout}\n{r.stderr}"
    assert "# fail 0" in r.stdout and "# pass 0" not in r.stdout, r.stdout


@pytest.mark.timeout(120)
def test_the_shipped_bundles_are_the_build_of_the_sources(tmp_path):
    node = _node()
    r = _run([node, str(WIDGETS / "build.mjs"), "--outdir", str(tmp_path)], ROOT)
    assert r.returncode == 0, f"node widgets/build.mjs failed:\n{r.stdout}\n{r.stderr}"
    built = sorted(p.name for p in tmp_path.glob("*.js"))
    shipped = sorted(p.name for p in STATIC.glob("*.js"))
    assert built == ["job_dashboard.js", "plan_canvas.js"], built
    assert shipped == built, f"hspmd_sdk/viz/static/ ships {shipped}, the build writes {built}"
    stale = [name for name in built if (tmp_path / name).read_bytes() != (STATIC / name).read_bytes()]
    assert not stale, (f"the shipped bundle is not the build of the sources: {', '.join(stale)}; "
                       "run `npm run build` in widgets/")
