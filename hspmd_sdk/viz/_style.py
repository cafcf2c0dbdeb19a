"""Colours shared by the figures and the editor."""
from __future__ import annotations

from functools import lru_cache

from plotly.colors import qualitative, sample_colorscale

from .._palette import EVENT_COLOURS  # Gantt bar colours by simulator event kind (shared with the runtime)

__all__ = ["stage_colour", "pipeline_colour", "subgroup_colour", "UNUSED", "LINK_COLOURS", "EVENT_COLOURS",
           "ERROR", "SELECTED", "UNION_COLOURS", "WARNING", "ink"]

_PIPELINE_SCALES = ("Blues", "Oranges", "Greens", "Purples", "Reds", "Greys", "YlOrBr", "PuBuGn")
_PIPELINE_BASE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#d62728", "#7f7f7f", "#bcbd22", "#17becf")

#: Fill of a device that no stage uses.
UNUSED = "#eceff3"
#: Outline of devices of a stage with a problem, and of the selected stage.
ERROR = "#d62728"
SELECTED = "#111111"
WARNING = "#9a6700"
#: DG Union subgroups of a picked tensor: a palette of its own (saturated, unlike the pastel stage fills), drawn
#: dashed, so that a union can never be taken for a pipeline.
UNION_COLOURS = ("#c2185b", "#00897b", "#f57f17", "#3949ab", "#6d4c41", "#7cb342", "#00acc1", "#8e24aa")
#: Point-to-point sends by link class.
LINK_COLOURS = {"intra": "#159a8c", "inter": "#d1495b"}


def pipeline_colour(p: int) -> str:
    """The base colour of pipeline ``p`` (outlines, legends)."""
    return _PIPELINE_BASE[p % len(_PIPELINE_BASE)]


@lru_cache(maxsize=4096)
def stage_colour(p: int, s: int, num_stages: int) -> str:
    """Fill of stage ``s`` of pipeline ``p``: a shade of the pipeline's colour family, darker for later stages."""
    scale = _PIPELINE_SCALES[p % len(_PIPELINE_SCALES)]
    t = 0.35 if num_stages <= 1 else 0.25 + 0.4 * s / (num_stages - 1)
    return sample_colorscale(scale, [t])[0]


@lru_cache(maxsize=4096)
def ink(colour: str) -> str:
    """Text colour readable on ``colour`` (``"rgb(r, g, b)"`` or ``"#rrggbb"``): dark on light fills, white on
    dark ones."""
    if colour.startswith("#"):
        r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    else:
        r, g, b = (float(x) for x in colour[colour.index("(") + 1:colour.index(")")].split(",")[:3])
    return "#ffffff" if 0.299 * r + 0.587 * g + 0.114 * b < 140 else "#1b1f24"


def subgroup_colour(k: int) -> str:
    """Colour of sharding subgroup ``k`` of an annotation."""
    pal = qualitative.D3
    return pal[k % len(pal)]
