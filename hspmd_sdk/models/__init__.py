"""Models: the model contract (:class:`ModelSpec`, SPEC §4) and one folder per family — ``llama/``
(:class:`LlamaConfig`) and ``gpt/`` (:class:`GPTConfig`, GPT-2) — each with its config, defined graph, strategy →
plan rule (placements), parameter init, cost counts, single-device reference and Hugging Face interop.

The engine (core, runtime, planner, viz) only ever talks to a ``ModelSpec``.  Generic entry points here:
:func:`build_reference` ``(model, seed)``, :func:`param_shapes` ``(model)``, :func:`load_model_spec` (presets,
JSON), :func:`to_hf` / :func:`from_hf`.  Pure Python at import; torch is imported on first use.
"""
from __future__ import annotations

from typing import Any

from .._lazy import lazy_exports

_EXPORTS = {
    "ModelSpec": "hspmd_sdk.core.model_spec",
    "Placement": "hspmd_sdk.core.model_spec",
    "LlamaConfig": ".llama.config",
    "GPTConfig": ".gpt.config",
    "build_llama_graph": ".llama.graph",
    "build_gpt_graph": ".gpt.graph",
    "layered_placements": ".common",
    "next_token_feeds": ".common",
    "next_token_split": ".common",
    "parameter_seed": ".common",
    "seeded_normal": ".common",
    "register_family": ".registry",
    "model_from_json": ".registry",
    "load_model_spec": ".registry",
    "to_hf": ".hf",
    "from_hf": ".hf",
    "HFError": ".hf",
}

_lazy_all, __getattr__, _lazy_dir = lazy_exports(__name__, _EXPORTS, globals())
__all__ = sorted(_lazy_all + ["build_reference", "param_shapes"])


def __dir__() -> list[str]:
    return __all__


def build_reference(model: Any, seed: int = 0) -> Any:
    """The plain single-device ``torch.nn.Module`` of ``model`` (any :class:`ModelSpec`), initialised from
    ``seed`` exactly like the distributed parameters; ``forward(tokens) -> logits``, ``loss(tokens, targets)``,
    ``state_dict()`` keys = ``model.param_shapes()``."""
    return model.build_reference(seed)


def param_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter name of ``model`` -> its full shape, in graph order."""
    return model.param_shapes()
