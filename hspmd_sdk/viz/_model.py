"""The one place where the viz touches a model: it treats the model as an opaque config.

The viz reads only ``model.num_layers``, ``model.name`` and ``model.max_seq_len`` (when present), asks the core and
the planner for memory and time (``Strategy.memory_estimate``, ``planner.simulate``) and gets parameter names and
shapes through :func:`param_shapes`.  Nothing here names a parameter or a model family's internals.
"""
from __future__ import annotations

from typing import Any

from ..models.registry import load_model_spec

__all__ = ["load_model", "param_shapes", "model_name", "default_seq_len"]


def load_model(model: Any) -> Any:
    """A model config as given, or the preset a name stands for (``"tiny"``, ``"llama-7b"``, ``"gpt:tiny"``)."""
    return load_model_spec(model)


def param_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Parameter name -> full shape (the model contract's ``param_shapes()``)."""
    return {k: tuple(v) for k, v in model.param_shapes().items()}


def model_name(model: Any) -> str:
    return str(getattr(model, "name", None) or type(model).__name__)


def default_seq_len(model: Any) -> int | None:
    seq = getattr(model, "max_seq_len", None)
    return int(seq) if seq else None
