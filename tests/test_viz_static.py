"""The front-end modules ship inside the package (``hspmd_sdk/viz/static/``, their one source), listed as package
data, and are plain ES modules that need no build step."""
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
def test_modules_need_no_build_step(src):
    text = src.read_text()
    assert "export default" in text
    assert not re.search(r"^\s*import\s", text, re.M), "a widget module must not import packages (no bundler)"


def test_the_widgets_load_their_shipped_modules():
    pytest.importorskip("anywidget")
    from hspmd_sdk.viz._canvas import PlanCanvas
    from hspmd_sdk.viz.dashboard import JobDashboard

    assert PlanCanvas()._esm == (STATIC / "plan_canvas.js").read_text()
    assert "class Canvas" in PlanCanvas()._esm
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
