"""Models in the SDK's graph API and their single-device references.

``build_llama_graph`` and ``param_shapes`` are pure Python; ``build_reference`` and ``init_parameter`` need torch
and are imported on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_llama_graph": ".llama",
    "param_shapes": ".llama",
    "layer_param_names": ".llama",
    "build_reference": ".reference",
    "init_parameter": ".reference",
    "parameter_seed": ".reference",
    "next_token_split": ".reference",
    "LlamaReference": ".reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hspmd_sdk.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
