"""A cluster figure is as tall as its legend (tutorial 09: one row of 4 local devices, 4 pipelines, had its legend
clipped to a scroll box): drawn by plotly.js in headless Chromium, the legend fits inside the figure and needs
no scroll bar; the tiles keep their size."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hspmd_sdk import Cluster, Strategy
from hspmd_sdk.viz import cluster_figure
from hspmd_sdk.viz._geometry import MARGIN, geometry

CHROMIUM = "/usr/bin/chromium"
FOUR = Strategy.load({"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 1,
                                     "num_micro_batches": 2} for r in range(4)]})
PAIRS = Strategy.load({"pipelines": [{"stages": [{"devices": [2 * p], "layers": [0, 1]},
                                                 {"devices": [2 * p + 1], "layers": [2, 3]}],
                                      "micro_batch_size": 1, "num_micro_batches": 2} for p in range(2)]})


def _px_per_unit_y(fig) -> float:
    bottom, top = fig.layout.yaxis.range
    inner = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    return inner / (bottom - top)


@pytest.mark.parametrize("strategy", [FOUR, PAIRS], ids=["4 pipelines", "2x2 stages"])
def test_the_figure_grows_for_its_legend_and_the_tiles_keep_their_scale(strategy):
    cluster = Cluster.local(4)
    fig = cluster_figure(cluster, strategy)
    geom = geometry(cluster)
    assert fig.layout.height > geom.px_height  # a one-row cluster is shorter than 4 legend groups
    plain = (geom.px_height - MARGIN["t"] - MARGIN["b"]) / (geom.height + 0.1)
    assert _px_per_unit_y(fig) == pytest.approx(plain, rel=1e-6)  # the tiles are not stretched


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path(CHROMIUM).exists() and not os.environ.get("CI"), reason="no /usr/bin/chromium")
def test_plotly_draws_the_legend_inside_the_figure_without_a_scroll_bar(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    fig = cluster_figure(Cluster.local(4), FOUR, title="max_seq_len <= 128: windows [512, 512, 256, 128]")
    page_file = tmp_path / "fig.html"
    page_file.write_text(fig.to_html(include_plotlyjs=True, full_html=True))
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 800})
            page.goto(page_file.as_uri())
            page.wait_for_selector(".legend")
            legend = page.locator(".legend").bounding_box()
            svg = page.locator(".main-svg").first.bounding_box()
            entries = page.locator(".legend .traces").count()
            scroll = page.locator(".legend .scrollbar").evaluate_all(
                "els => els.filter(e => Number(e.getAttribute('height') || 0) > 0).length")
        finally:
            browser.close()
    assert entries >= 4 and scroll == 0  # every stage listed (plotly also counts group titles)
    assert legend["y"] + legend["height"] <= svg["y"] + svg["height"] + 1
