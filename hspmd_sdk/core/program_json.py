"""The JSON form of a Program (SPEC §9): how a specialized Program travels between processes.

A Program is a tree of frozen value types of :mod:`hspmd_sdk.core` (dataclasses and Pydantic models: the graph,
annotations, communication plans and their operators, schedules' actions, gradient synchronisations, ...).  This
module writes such a tree as JSON and reads it back exactly:

* every object of a core class is written once, in ``objects``, and referred to as ``{"$ref": i}`` wherever it
  appears again (a Program shares one CommPlan between several names, one Annotation between many tensors), so
  the text stays small and the value read back shares what the original shared;
* tuples, frozensets, sets, dicts with keys that are not strings and fractions are tagged (``$t``, ``$fs``,
  ``$s``, ``$d``, ``$q``); JSON lists are lists, JSON objects with string keys are dicts (``$m``);
* a model config (``LlamaConfig``, ``GPTConfig``, a user's :class:`~hspmd_sdk.core.model_spec.ModelSpec`) is its
  class path and JSON (``model_json``), read back by that class's ``load``/``model_validate``;
* per-process caches (executable graphs, concrete plans, rank tables, micro-batch layouts) are not written: the
  reader fills them again on demand.

Reading constructs only dataclasses and Pydantic models defined in ``hspmd_sdk.core`` (and the model config's
class, which must be a Pydantic model): nothing in the text can name a function to call.  A Program specialized
with a custom ``resolver=`` cannot travel (the function is not data): :func:`program_to_json` says so.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from fractions import Fraction
from typing import Any

from pydantic import BaseModel

from ..errors import SpecializationError
from .gc_pause import gc_paused
from .model_spec import model_json

__all__ = ["FORMAT", "ProgramJSONError", "to_json_value", "from_json_value", "program_to_json", "program_from_json"]

#: The format tag of a Program's JSON; a reader refuses any other.
FORMAT = "hspmd-program/1"

#: Fields that are per-process caches or recomputed by the class itself: never written.
_SKIP = frozenset({"_cache", "_concrete", "_rank_tables", "_micro", "_resolver", "_producer", "_consumers"})
_CORE = "hspmd_sdk.core."


class ProgramJSONError(SpecializationError):
    """A Program's JSON cannot be written or read (a foreign object, another format, a damaged text)."""


def _is_core(cls: type) -> bool:
    return cls.__module__.startswith(_CORE)


_PRIMITIVE = (type(None), bool, int, str)


def _cannot_write(cls: type) -> "ProgramJSONError":
    """The error for a value of a type a Program's JSON does not carry."""
    return ProgramJSONError(f"cannot write a {cls.__module__}.{cls.__qualname__} into a Program's JSON: "
                            "only hspmd_sdk.core value types and model configs travel")


class _Writer:
    def __init__(self) -> None:
        self.objects: list[Any] = []
        self._ids: dict[int, int] = {}
        self._keep: list[Any] = []  # keeps every written object alive, so that its id() is not reused
        self._kinds: dict[type, tuple[str, str, tuple[str, ...]]] = {}  # class -> (tag, path, fields)

    def value(self, x: Any) -> Any:
        t = type(x)
        if t in _PRIMITIVE:
            return x
        if isinstance(x, int):  # an IntEnum (a DSKey such as PARTIAL): its plain value, read back equal
            return int(x)
        if isinstance(x, str):  # a StrEnum (an OpKind): its plain name, which the operator reads back typed
            return str(x)
        if t is tuple:
            return {"$t": [self.value(v) for v in x]}
        if t is list:
            return [self.value(v) for v in x]
        if t is dict:
            if all(type(k) is str for k in x):
                return {"$m": {k: self.value(v) for k, v in x.items()}}
            return {"$d": [[self.value(k), self.value(v)] for k, v in x.items()]}
        if t is float:
            return x if x == x and x not in (float("inf"), float("-inf")) else {"$f": repr(x)}
        if t is frozenset or t is set:
            items = [self.value(v) for v in x]
            if all(type(v) in _PRIMITIVE for v in items):  # the same text for the same set
                items.sort(key=lambda v: (type(v).__name__, v))
            return {"$fs" if t is frozenset else "$s": items}
        if t is Fraction:
            return {"$q": [x.numerator, x.denominator]}
        if t in self._kinds or dataclasses.is_dataclass(x) or isinstance(x, BaseModel):
            return {"$ref": self._object(x)}
        if hasattr(x, "keys") and hasattr(x, "items"):  # a read-only mapping
            return self.value(dict(x.items()))
        raise _cannot_write(t)

    def _kind(self, cls: type, x: Any) -> tuple[str, str, tuple[str, ...]]:
        got = self._kinds.get(cls)
        if got is None:
            path = f"{cls.__module__}:{cls.__qualname__}"
            if dataclasses.is_dataclass(x) and _is_core(cls):
                got = ("$c", path, tuple(f.name for f in dataclasses.fields(x) if f.name not in _SKIP))
            elif isinstance(x, BaseModel) and _is_core(cls):
                got = ("$p", path, tuple(type(x).model_fields))
            elif isinstance(x, BaseModel) and hasattr(x, "placements"):  # a model config (ModelSpec)
                if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
                    raise ProgramJSONError(f"the model config class {cls.__qualname__!r} is defined in a notebook "
                                           "cell or a function: another process cannot import it; put it in a "
                                           "module")
                got = ("$model", path, ())
            else:
                raise _cannot_write(cls)
            self._kinds[cls] = got
        return got

    def _object(self, x: Any) -> int:
        got = self._ids.get(id(x))
        if got is not None:
            return got
        tag, path, names = self._kind(type(x), x)
        index = len(self.objects)
        self.objects.append(None)  # reserved: children are written first, the index stays this object's
        self._ids[id(x)] = index
        self._keep.append(x)
        if tag == "$model":
            self.objects[index] = {"$model": path, "config": model_json(x)}
        else:
            self.objects[index] = {tag: path, "f": {k: self.value(getattr(x, k)) for k in names}}
        return index


class _Reader:
    def __init__(self, objects: list[Any]) -> None:
        self.objects = objects
        self._done: dict[int, Any] = {}
        self._classes: dict[str, type] = {}

    def value(self, v: Any) -> Any:
        t = type(v)
        if t in _PRIMITIVE or t is float:
            return v
        if t is list:
            return [self.value(x) for x in v]
        if t is not dict or len(v) != 1:
            raise ProgramJSONError(f"unexpected value in a Program's JSON: {str(v)[:120]}")
        for tag, body in v.items():
            if tag == "$ref":
                got = self._done.get(body)
                return got if got is not None else self._object(int(body))
            if tag == "$t":
                return tuple([self.value(x) for x in body])
            if tag == "$m":
                return {k: self.value(x) for k, x in body.items()}
            if tag == "$fs":
                return frozenset([self.value(x) for x in body])
            if tag == "$d":
                return {self.value(k): self.value(x) for k, x in body}
            if tag == "$s":
                return {self.value(x) for x in body}
            if tag == "$q":
                return Fraction(int(body[0]), int(body[1]))
            if tag == "$f":
                return float(body)
            raise ProgramJSONError(f"unknown tag {tag!r} in a Program's JSON")

    def _object(self, index: int) -> Any:
        if index in self._done:
            return self._done[index]
        if not 0 <= index < len(self.objects):
            raise ProgramJSONError(f"reference to object {index}, but the text has {len(self.objects)}")
        rec = self.objects[index]
        if not isinstance(rec, dict):
            raise ProgramJSONError(f"object {index} of a Program's JSON is not an object")
        if "$model" in rec:
            out = _model_config(rec["$model"], rec["config"])
        else:
            dataclass_ = "$c" in rec
            path = rec.get("$c") or rec.get("$p")
            cls = self._classes.get(path)
            if cls is None:
                cls = self._classes[path] = _core_class(path, dataclass_)
            fields = {k: self.value(x) for k, x in rec["f"].items()}
            # Pydantic models: the values were validated where they were made
            out = cls(**fields) if dataclass_ else cls.model_construct(**fields)
        self._done[index] = out
        return out


def _core_class(path: Any, dataclass_: bool) -> type:
    """The class ``"module:Qualname"`` of hspmd_sdk.core: a dataclass (``dataclass_``) or a Pydantic model."""
    module, _, name = str(path).partition(":")
    if not module.startswith(_CORE) or not name or "<" in name:
        raise ProgramJSONError(f"a Program's JSON may only name classes of hspmd_sdk.core, not {path!r}")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ProgramJSONError(f"no class {path!r} in this version of hspmd_sdk")
    if not isinstance(obj, type):
        raise ProgramJSONError(f"{path!r} is not a class")
    if dataclass_ and not dataclasses.is_dataclass(obj):
        raise ProgramJSONError(f"{path!r} is not a dataclass")
    if not dataclass_ and not issubclass(obj, BaseModel):
        raise ProgramJSONError(f"{path!r} is not a Pydantic model")
    return obj


def _model_config(path: str, data: Any) -> Any:
    module, _, name = str(path).partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ProgramJSONError(f"cannot import the model config class {path!r} ({e}); the module must be "
                               "importable by this process") from None
    if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
        raise ProgramJSONError(f"{path!r} is not a model config class (a Pydantic model)")
    return cls.load(data) if hasattr(cls, "load") else cls.model_validate(data)


@gc_paused
def to_json_value(obj: Any) -> dict[str, Any]:
    """``obj`` (a tree of core value types) as a JSON-ready value: ``{"objects": [...], "root": ...}``."""
    w = _Writer()
    root = w.value(obj)
    return {"objects": w.objects, "root": root}


@gc_paused
def from_json_value(data: Any) -> Any:
    """The inverse of :func:`to_json_value`."""
    if not isinstance(data, dict) or "objects" not in data or "root" not in data:
        raise ProgramJSONError("not a JSON value written by to_json_value (no 'objects' and 'root')")
    return _Reader(list(data["objects"])).value(data["root"])


@gc_paused
def program_to_json(program: Any) -> str:
    """The JSON text of ``program`` (:meth:`Program.to_json`)."""
    if getattr(program, "_resolver", None) is not None:
        raise ProgramJSONError("this Program was specialized with a custom resolver=, a function, which cannot "
                               "travel as JSON; specialize it with the default resolver")
    return json.dumps({"format": FORMAT, **to_json_value(program)}, separators=(",", ":"))


@gc_paused
def program_from_json(text: str | bytes) -> Any:
    """The value written by :func:`program_to_json` (:meth:`Program.from_json` checks that it is a Program)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProgramJSONError(f"not a Program's JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ProgramJSONError(f"not a Program's JSON of format {FORMAT!r} (got {got!r})")
    return from_json_value(data)
