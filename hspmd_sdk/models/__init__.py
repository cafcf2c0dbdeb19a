"""Models in the SDK's graph API and their single-device references.

``build_llama_graph`` and ``param_shapes`` are pure Python; ``build_reference`` and ``init_parameter`` need torch
and are imported on first use.
"""
from __future__ import annotations

from .._lazy import lazy_exports

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

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
