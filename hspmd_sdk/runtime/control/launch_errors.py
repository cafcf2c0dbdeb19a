"""What ``launch`` says when it is given something it cannot train (issue 48 item 3).

``launch(program, cluster, ...)`` trains a :class:`~hspmd_sdk.core.specialize.Program` specialized from a model
config.  A Strategy (a plan's shape, no model), a Program specialized from a bare graph, or anything else gets one
:class:`~hspmd_sdk.errors.PlanValidationError` saying what it got, what launch needs and how to get it."""
from __future__ import annotations

from typing import Any

from ...errors import PlanValidationError

__all__ = ["not_a_program"]

_SPECIALIZE = "program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)"


def not_a_program(obj: Any, *, model_option: bool = False) -> PlanValidationError:
    """The error for ``launch(obj, ...)`` where ``obj`` has no model config to build the workers' model from.

    ``model_option``: the caller also takes the model beside a Strategy (``model=``): say so."""
    kind = type(obj).__name__
    if kind == "Strategy":
        ways = (f"specialize it for your model first ({_SPECIALIZE}; from hspmd_sdk.core.strategy_plan import "
                "plan_from_strategy)")
        if model_option:
            ways = f"pass the model with it (launch(strategy, cluster, model=model, ...)), or {ways}"
        reason = ("is a Strategy: it says how to split a model over the cluster, not which model to train; a "
                  f"Strategy needs a model: {ways}")
    elif hasattr(obj, "plan") and hasattr(obj, "bindings"):  # a Program, from a graph without a model config
        reason = ("was specialized from a bare graph; launch needs a Program specialized from a model config "
                  "(specialize(LlamaConfig..., plan, cluster)) so that workers can rebuild the model")
    else:
        reason = (f"is a {kind}, not a Program: launch trains a Program (specialize(model, plan, cluster)) made "
                  "from a model config and a plan or Strategy")
    return PlanValidationError([("program", reason)], what="training run")
