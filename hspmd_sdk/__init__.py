"""hspmd_sdk: HSPMD (Hierarchical and Heterogeneous SPMD, the Hetu v2 paper) on PyTorch.

Public names are imported lazily so that ``import hspmd_sdk`` stays fast and pulls in torch only when a name
that needs it is used.
"""
from __future__ import annotations

from ._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "DS": "hspmd_sdk.core.annotation",
    "Annotation": "hspmd_sdk.core.annotation",
    "local_view": "hspmd_sdk.core.annotation",
    "Cluster": "hspmd_sdk.core.cluster",
    "LlamaConfig": "hspmd_sdk.models.llama.config",
    "GPTConfig": "hspmd_sdk.models.gpt.config",
    "ModelSpec": "hspmd_sdk.core.model_spec",
    "Strategy": "hspmd_sdk.core.strategy",
    "Pipeline": "hspmd_sdk.core.strategy",
    "Stage": "hspmd_sdk.core.strategy",
    "AnnotationPlan": "hspmd_sdk.core.plan",
    "ExecutionSettings": "hspmd_sdk.core.plan",
    "specialize": "hspmd_sdk.core.specialize",
    "Program": "hspmd_sdk.core.specialize",
    "GraphBuilder": "hspmd_sdk.core.graph",
    "sym": "hspmd_sdk.core.symbolic",
    "resolve": "hspmd_sdk.core.resolve",
    "plan_switch": "hspmd_sdk.core.switch",
    "build_reference": "hspmd_sdk.models",
    "build_llama_graph": "hspmd_sdk.models",
    "to_hf": "hspmd_sdk.models",
    "from_hf": "hspmd_sdk.models",
    "launch": "hspmd_sdk.runtime.control.train",
    "TrainConfig": "hspmd_sdk.runtime.train_config",
    "HSPMDError": "hspmd_sdk.errors",
    "PlanValidationError": "hspmd_sdk.errors",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
__all__ = __all__ + ["__version__"]
