"""The front-end modules ship inside the package (``hspmd_sdk/viz/static/``), listed as package data: each one
ES module, bundled from ``widgets/src`` (``tests/test_widgets.py`` checks it is the build of the sources), that
imports nothing at run time (users need no Node and no bundler)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "hspmd_sdk" / "viz" / "static"
SOURCES = sorted(STATIC.glob("*.js")) + sorted(STATIC.glob("*.css"))


def test_every_front_end_file_is_package_data():
    assert {p.name for p in SOURCES} == {"plan_canvas.js", "plan_canvas.css", "job_dashboard.js",
                                         "job_dashboard.css"}
    line = next(ln for ln in (ROOT / "pyproject.toml").read_text().splitlines() if ln.startswith("hspmd_sdk = ["))
    assert '"viz/static/*.js"' in line and '"viz/static/*.css"' in line


@pytest.mark.parametrize("src", [p for p in SOURCES if p.suffix == ".js"], ids=lambda p: p.name)
def test_the_shipped_modules_are_self_contained_bundles(src):
    text = src.read_text()
    assert text.startswith("// GENERATED FILE: do not edit. Built from widgets/src")
    assert re.search(r"export\s*\{[^}]*\bas default\b", text), "an anywidget module exports a default (render)"
    assert not re.search(r"^\s*import\s", text, re.M), "a shipped module must import nothing at run time"


def test_the_widgets_load_their_shipped_modules():
    pytest.importorskip("anywidget")
    from hspmd_sdk.viz._canvas import PlanCanvas
    from hspmd_sdk.viz.dashboard import JobDashboard

    assert PlanCanvas()._esm == (STATIC / "plan_canvas.js").read_text()
    assert re.search(r"\bclass Canvas\b|\bCanvas = class\b", PlanCanvas()._esm)
    assert JobDashboard(_NoJob(), watch=False)._css == (STATIC / "job_dashboard.css").read_text()


class _NoJob:
    job_id, status = "none", "succeeded"

    class metrics:  # noqa: N801 - the public surface a dashboard reads
        @staticmethod
        def ranks():
            return []

        @staticmethod
        def last_step():
            return -1

        @staticmethod
        def losses():
            return []

    def pids(self):
        return {}
