"""Model families by their JSON tag, and loading a model config from a preset name, a dict, JSON or a file.

A worker process, a checkpoint or the CLI gets a model as data; the ``family`` field says which config class
reads it.  The SDK's families are ``"llama"`` (:class:`~hspmd_sdk.models.llama.LlamaConfig`) and ``"gpt"``
(:class:`~hspmd_sdk.models.gpt.GPTConfig`); :func:`register_family` adds one (a user's model config must be
importable by the workers: define it in a module, not in a notebook cell).
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from ..errors import PlanValidationError

__all__ = ["register_family", "family_class", "model_from_json", "load_model_spec", "FAMILIES", "preset_names",
           "class_path", "model_from_class"]

#: family tag -> "module:Class" of its config (imported on first use).
FAMILIES: dict[str, str] = {
    "llama": "hspmd_sdk.models.llama.config:LlamaConfig",
    "gpt": "hspmd_sdk.models.gpt.config:GPTConfig",
}


def register_family(tag: str, cls: type | str) -> None:
    """Make ``model_from_json`` read configs tagged ``family=tag`` with ``cls`` (a class or "module:Class")."""
    FAMILIES[tag] = cls if isinstance(cls, str) else f"{cls.__module__}:{cls.__qualname__}"


def family_class(tag: str) -> type:
    """The config class of family ``tag``."""
    target = FAMILIES.get(tag)
    if target is None:
        raise PlanValidationError([("family", f"unknown model family {tag!r}; known: {', '.join(FAMILIES)} "
                                              "(register one with hspmd_sdk.models.register_family)")],
                                  what="model config")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def model_from_json(data: Any) -> Any:
    """A model config from its JSON form (a dict or text with a ``family`` tag; no tag: Llama, for configs
    written before there were families)."""
    if isinstance(data, str):
        data = _parse(data, "model")
    if not isinstance(data, dict):
        raise PlanValidationError([("model", f"expected a JSON object, not {type(data).__name__}")],
                                  what="model config")
    cls = family_class(str(data.get("family", "llama")))
    return cls.load(data)


def preset_names() -> dict[str, list[str]]:
    """Family tag -> its preset names."""
    return {tag: list(getattr(family_class(tag), "PRESETS", {})) for tag in FAMILIES}


def load_model_spec(data: Any) -> Any:
    """A model config from a preset name (``"llama-32b"``, ``"tiny"`` = the Llama one, ``"gpt2"``, or
    ``"family:preset"`` such as ``"gpt:tiny"``), a config object, a dict, JSON text or a JSON file.

    Raises :class:`~hspmd_sdk.errors.PlanValidationError` naming the problem."""
    if hasattr(data, "build_graph"):
        return data
    if isinstance(data, str) and not data.lstrip().startswith("{") and not Path(data).suffix == ".json":
        tag, sep, name = data.partition(":")
        if sep:
            return family_class(tag).preset(name)
        for tag in FAMILIES:
            cls = family_class(tag)
            if data in getattr(cls, "PRESETS", {}):
                return cls.preset(data)
        known = ", ".join(f"{t}:{p}" for t, ps in preset_names().items() for p in ps)
        raise PlanValidationError([("model", f"unknown model preset {data!r}; presets are {known} (or give a "
                                             "model config JSON file)")], what="model config")
    if isinstance(data, (str, Path)):
        from ..core.loading import read_json_text  # lazy: keeps runtime.protocol free of all of core

        where = str(data)[:200]
        data = _parse(read_json_text(data, what="model config"), where)
    return model_from_json(data)


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise PlanValidationError([(where, "JSON nested too deeply")], what="model config") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more than 4300 digits
        raise PlanValidationError([(where, f"not valid JSON: {e}")], what="model config") from None


def class_path(model: Any) -> str:
    """``"module:Class"`` of a model config, for processes that rebuild it from JSON (workers, checkpoints).  A
    class defined in a notebook cell (module ``__main__``) cannot be imported there: that is an error naming the
    class and what to do."""
    cls = type(model)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise PlanValidationError([("model", f"the model config class {cls.__qualname__!r} is defined in "
                                             f"{'a notebook cell or script' if cls.__module__ == '__main__' else 'a function'}; "
                                             "worker processes cannot import it. Put it in a module (a .py file "
                                             "next to the notebook, e.g. with %%writefile) and import it from there")],
                                  what="model config")
    return f"{cls.__module__}:{cls.__qualname__}"


def model_from_class(path: str | None, data: Any) -> Any:
    """A model config from its JSON ``data`` read by the class at ``path`` (``"module:Class"``); without a path,
    by its ``family`` tag (:func:`model_from_json`)."""
    if not path:
        return model_from_json(data)
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise PlanValidationError([("model", f"cannot import the model config class {path!r} ({e}); the module "
                                             "must be importable by this process")], what="model config") from None
    return cls.load(data) if hasattr(cls, "load") else cls.model_validate(data)
