"""The planner (§8, Appendix A.1): the operator-centric cost model, the step simulator and the scenario planners
(heterogeneous devices: :func:`plan_hetero`; unstable devices: :func:`replan_elastic`; mixed-length data:
:func:`plan_mixed`, :meth:`MixedPlan.programs` and the per-step :func:`dispatch`, simulated by
:func:`simulate_dispatch`, with the :func:`packed_baseline` and HotSPa (:func:`plan_hotspa`) baselines).

Names are imported lazily, so ``import hspmd_sdk.planner`` is cheap.  The planner measures nothing: the profilers
that give it a :class:`CostModel` (:func:`hspmd_sdk.runtime.profile_device`, :func:`~hspmd_sdk.runtime.profile_model`,
:func:`~hspmd_sdk.runtime.profile_link`) are the runtime's, and the planner imports nothing of the runtime.
"""
from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "CostModel": "hspmd_sdk.planner.cost",
    "ComputeFit": "hspmd_sdk.planner.cost",
    "fit_link": "hspmd_sdk.planner.cost",
    "OperatorProfile": "hspmd_sdk.planner.cost",
    "LinkOverride": "hspmd_sdk.planner.cost",
    "simulate": "hspmd_sdk.planner.simulator",
    "SimResult": "hspmd_sdk.planner.simulator",
    "Event": "hspmd_sdk.planner.simulator",
    "Transfer": "hspmd_sdk.planner.simulator",
    "plan_hetero": "hspmd_sdk.planner.hetero",
    "replan_elastic": "hspmd_sdk.planner.elastic",
    "survivor_cluster": "hspmd_sdk.planner.elastic",
    "replan_straggler": "hspmd_sdk.planner.elastic",
    "slowed_cluster": "hspmd_sdk.planner.elastic",
    "plan_mixed": "hspmd_sdk.planner.mixed",
    "dispatch": "hspmd_sdk.planner.mixed",
    "Dispatcher": "hspmd_sdk.planner.mixed",
    "MixedPlan": "hspmd_sdk.planner.mixed",
    "MixedEntry": "hspmd_sdk.planner.mixed",
    "Dispatch": "hspmd_sdk.planner.mixed",
    "sample_lengths": "hspmd_sdk.planner.mixed",
    "sample_batch": "hspmd_sdk.planner.mixed_sim",
    "simulate_mixed": "hspmd_sdk.planner.mixed",
    "simulate_dispatch": "hspmd_sdk.planner.mixed",
    "simulate_shapes": "hspmd_sdk.planner.mixed_sim",
    "packed_baseline": "hspmd_sdk.planner.mixed_sim",
    "plan_hotspa": "hspmd_sdk.planner.mixed_sim",
    "simulate_hotspa": "hspmd_sdk.planner.mixed_sim",
    "HotSPaPlan": "hspmd_sdk.planner.mixed_sim",
    "switch_estimate": "hspmd_sdk.planner.mixed_cost",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
