"""The planner (§8, Appendix A.1): the operator-centric cost model, the step simulator and the scenario planners
(heterogeneous devices: :func:`plan_hetero`; unstable devices: :func:`replan_elastic`; mixed-length data:
:func:`plan_mixed` and :func:`dispatch`).

Names are imported lazily, so ``import hspmd_sdk.planner`` is cheap; only :func:`profile_device` imports torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CostModel": "hspmd_sdk.planner.cost",
    "ComputeFit": "hspmd_sdk.planner.cost",
    "profile_device": "hspmd_sdk.planner.cost",
    "simulate": "hspmd_sdk.planner.simulator",
    "SimResult": "hspmd_sdk.planner.simulator",
    "Event": "hspmd_sdk.planner.simulator",
    "Transfer": "hspmd_sdk.planner.simulator",
    "plan_hetero": "hspmd_sdk.planner.hetero",
    "replan_elastic": "hspmd_sdk.planner.elastic",
    "survivor_cluster": "hspmd_sdk.planner.elastic",
    "plan_mixed": "hspmd_sdk.planner.mixed",
    "dispatch": "hspmd_sdk.planner.mixed",
    "simulate_mixed": "hspmd_sdk.planner.mixed",
    "packed_baseline": "hspmd_sdk.planner.mixed",
    "MixedPlan": "hspmd_sdk.planner.mixed",
    "MixedEntry": "hspmd_sdk.planner.mixed",
    "Dispatch": "hspmd_sdk.planner.mixed",
    "sample_lengths": "hspmd_sdk.planner.mixed",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hspmd_sdk.planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
