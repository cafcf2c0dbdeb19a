"""The pure-Python core of hspmd_sdk: annotations, cluster, plans, communication resolution, specialization.

Imports no torch.distributed, widgets or plotting; fast to import.
"""
from ..errors import HSPMDError, PlanValidationError, ResolutionError, ShapeError, SpecializationError
from .annotation import (DS, DUPLICATE, PARTIAL, Annotation, DSKey, LocalView, format_ranks, is_split, local_view,
                         local_views, parse_ranks)
from .bsr import Assignment, BSREntry, LinkModel, bsr_scheme, bsr_table
from .cluster import DEVICE_PRESETS, Cluster, DeviceSpec, Link, Node
from .comm_ops import (CollectiveGroup, CollectiveOp, IdentityOp, Message, PointToPointOp, SliceCollective,
                       SplitCollectiveOp)
from .comm_plan import CommPlan, volume_table
from .deduction import deduce
from .graph import Graph, GraphBuilder, Node as GraphNode, Tensor, TensorSpec
from .loading import load_model
from .model_spec import ModelSpec, Placement
from .plan import AnnotationPlan, ExecutionSettings
from .resolve import itemsize_of, resolve, split_kind
from .schedule import (SCHEDULE_KINDS, Action, ReplayResult, ScheduleError, build_schedule, compute_order,
                       format_schedule, in_flight, replay, warmup_count)
from .slices import Box
from .specialize import ExecOp, ExecutableGraph, GradSync, Program, StateLayout, specialize
from .strategy import Pipeline, Stage, Strategy, memory_estimate
from .strategy_plan import plan_from_strategy
from .symbolic import Sym, sym
from .switch import PackedItem, PackedMessage, SwitchPlan, SwitchStep, TensorMove, plan_switch, switch_table

__all__ = [
    "DS", "Annotation", "LocalView", "local_view", "local_views", "DSKey", "PARTIAL", "DUPLICATE", "is_split",
    "parse_ranks", "format_ranks", "Cluster", "DeviceSpec", "Node", "Link", "DEVICE_PRESETS", "load_model",
    "ModelSpec", "Placement", "Strategy", "Pipeline", "Stage", "memory_estimate", "AnnotationPlan", "ExecutionSettings",
    "Action", "build_schedule", "replay", "ReplayResult", "ScheduleError", "compute_order", "warmup_count",
    "in_flight", "format_schedule", "SCHEDULE_KINDS",
    "resolve", "CommPlan", "itemsize_of", "split_kind", "volume_table", "CollectiveOp", "CollectiveGroup",
    "SplitCollectiveOp", "SliceCollective", "PointToPointOp", "Message", "IdentityOp", "Box",
    "BSREntry", "Assignment", "bsr_table", "bsr_scheme", "LinkModel",
    "plan_switch", "SwitchPlan", "switch_table", "SwitchStep", "PackedMessage", "PackedItem", "TensorMove",
    "Graph", "GraphBuilder", "GraphNode", "Tensor", "TensorSpec", "deduce", "Sym", "sym",
    "specialize", "Program", "ExecutableGraph", "ExecOp", "GradSync", "StateLayout", "plan_from_strategy",
    "HSPMDError", "PlanValidationError", "ResolutionError", "ShapeError", "SpecializationError",
]
