"""The pure-Python core of hspmd_sdk: annotations, cluster, plans, communication resolution, specialization.

Imports no torch.distributed, widgets or plotting; fast to import.
"""
from ..errors import (HSPMDError, PlanValidationError, ResolutionError, ShapeError, SpecializationError)
from .annotation import (DS, DUPLICATE, PARTIAL, Annotation, LocalView, format_ranks, local_view, local_views,
                         parse_ranks)
from .cluster import DEVICE_PRESETS, Cluster, DeviceSpec, Link, Node

__all__ = [
    "DS", "Annotation", "LocalView", "local_view", "local_views", "PARTIAL", "DUPLICATE", "parse_ranks",
    "format_ranks", "Cluster", "DeviceSpec", "Node", "Link", "DEVICE_PRESETS",
    "HSPMDError", "PlanValidationError", "ResolutionError", "ShapeError", "SpecializationError",
]
