"""The pure-Python core of hspmd_sdk: annotations, cluster, plans, communication resolution, specialization.

Imports no torch.distributed, widgets or plotting; fast to import.
"""
from ..errors import HSPMDError, PlanValidationError, ResolutionError, ShapeError, SpecializationError
from .annotation import (DS, DUPLICATE, PARTIAL, Annotation, LocalView, format_ranks, local_view, local_views,
                         parse_ranks)
from .cluster import DEVICE_PRESETS, Cluster, DeviceSpec, Link, Node
from .loading import load_model
from .model_config import MODEL_PRESETS, LlamaConfig
from .plan import AnnotationPlan
from .schedule import (SCHEDULE_KINDS, Action, ReplayResult, ScheduleError, build_schedule, compute_order,
                       format_schedule, in_flight, replay, warmup_count)
from .strategy import Pipeline, Stage, Strategy, memory_estimate

__all__ = [
    "DS", "Annotation", "LocalView", "local_view", "local_views", "PARTIAL", "DUPLICATE", "parse_ranks",
    "format_ranks", "Cluster", "DeviceSpec", "Node", "Link", "DEVICE_PRESETS", "load_model",
    "LlamaConfig", "MODEL_PRESETS", "Strategy", "Pipeline", "Stage", "memory_estimate", "AnnotationPlan",
    "Action", "build_schedule", "replay", "ReplayResult", "ScheduleError", "compute_order", "warmup_count",
    "in_flight", "format_schedule", "SCHEDULE_KINDS",
    "HSPMDError", "PlanValidationError", "ResolutionError", "ShapeError", "SpecializationError",
]
