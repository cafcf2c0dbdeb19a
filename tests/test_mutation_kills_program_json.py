"""Kills for the mutants of hspmd_sdk/core/program_json.py (issue 49): the exact JSON of small values (tags, key
names, nesting, sharing), round trips that compare every field and type, and the errors for malformed or foreign
input with their text."""
from __future__ import annotations

import json
import math
from fractions import Fraction
from types import MappingProxyType, SimpleNamespace

import pytest
from pydantic import BaseModel, ConfigDict

from hspmd_sdk.core.cluster import DeviceSpec
from hspmd_sdk.core.graph import TensorSpec
from hspmd_sdk.core.program_json import (FORMAT, ProgramJSONError, from_json_value, program_from_json,
                                         program_to_json, to_json_value)

_TS = "hspmd_sdk.core.graph:TensorSpec"


def _ts(name: str = "x") -> TensorSpec:
    return TensorSpec(name, (2, 3), "float32")


def _rec(name: str = "x") -> dict:
    return {"$c": _TS, "f": {"name": name, "shape": {"$t": [2, 3]}, "dtype": "float32"}}


# ---- model configs defined in this (importable) module --------------------------------------------------------
class CfgNoLoad(BaseModel):
    """A model config without ``load``: read back by ``model_validate`` (extra keys such as family ignored)."""
    n: int

    def placements(self) -> list:
        return []


class CfgWithLoad(BaseModel):
    """A model config whose ``load`` must be used: ``model_validate`` refuses the ``family`` key."""
    model_config = ConfigDict(extra="forbid")
    n: int

    def placements(self) -> list:
        return []

    @classmethod
    def load(cls, data):
        return cls.model_validate({k: v for k, v in data.items() if k != "family"})


class CfgMain(BaseModel):
    n: int

    def placements(self) -> list:
        return []


CfgMain.__module__ = "__main__"  # as if defined in a notebook cell


# ---- the writer's exact JSON ----------------------------------------------------------------------------------
def test_exact_json_of_containers_and_scalars() -> None:
    """Pins every tag the writer emits: $m for string-keyed dicts, $d otherwise, $t, $s vs $fs, $q, lists plain,
    finite floats plain, non-finite floats as $f with their repr."""
    assert to_json_value({"a": 1}) == {"objects": [], "root": {"$m": {"a": 1}}}
    assert to_json_value({1: "a"}) == {"objects": [], "root": {"$d": [[1, "a"]]}}
    assert to_json_value((1, [2])) == {"objects": [], "root": {"$t": [1, [2]]}}
    assert to_json_value({2, 1}) == {"objects": [], "root": {"$s": [1, 2]}}
    assert to_json_value(frozenset({2, 1})) == {"objects": [], "root": {"$fs": [1, 2]}}
    assert to_json_value(Fraction(3, 4)) == {"objects": [], "root": {"$q": [3, 4]}}
    assert to_json_value(1.5) == {"objects": [], "root": 1.5}
    assert to_json_value(float("inf")) == {"objects": [], "root": {"$f": "inf"}}
    assert to_json_value(float("-inf")) == {"objects": [], "root": {"$f": "-inf"}}
    assert to_json_value(float("nan")) == {"objects": [], "root": {"$f": "nan"}}


def test_set_items_sorted_by_type_name_then_value() -> None:
    """Pins the sort key of primitive set items (type name, value): mixed int/str sets are ordered, not refused;
    sets of non-primitive items (tuples, written as dicts) are left unsorted rather than compared."""
    assert to_json_value(frozenset({"b", 2, "a", 1})) == {"objects": [], "root": {"$fs": [1, 2, "a", "b"]}}
    got = to_json_value(frozenset({(1, 2), (3, 4)}))["root"]["$fs"]
    assert sorted(map(json.dumps, got)) == ['{"$t": [1, 2]}', '{"$t": [3, 4]}']
    assert from_json_value(to_json_value(frozenset({(1, 2), (3, 4)}))) == frozenset({(1, 2), (3, 4)})


def test_read_only_mapping_is_written_as_a_dict() -> None:
    """Pins the read-only mapping branch: a mappingproxy is written as its items ($m), read back as a dict."""
    v = to_json_value(MappingProxyType({"a": 1}))
    assert v == {"objects": [], "root": {"$m": {"a": 1}}}
    assert from_json_value(v) == {"a": 1}


def test_core_object_written_once_and_shared() -> None:
    """Pins sharing: one core object appearing twice is one entry of `objects` referred to by $ref twice, with its
    exact record ($c class path, f fields); it reads back as one shared object."""
    a = _ts()
    v = to_json_value((a, a))
    assert v == {"objects": [_rec()], "root": {"$t": [{"$ref": 0}, {"$ref": 0}]}}
    back = from_json_value(v)
    assert back == (a, a) and back[0] is back[1] and type(back[0]) is TensorSpec


class _FreshMapping:
    """A read-only mapping whose items() makes new core objects on every call (they die after being written)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def keys(self):
        return ["t"]

    def items(self):
        return [("t", _ts(self.name))]


def test_written_objects_kept_alive_so_ids_are_not_reused() -> None:
    """Pins the writer's keep-alive list: temporaries written from a mapping stay alive during the write, so a
    later object cannot reuse a freed one's id() and be written as a wrong $ref."""
    names = [f"n{i}" for i in range(200)]
    back = from_json_value(to_json_value([_FreshMapping(n) for n in names]))
    assert [d["t"].name for d in back] == names


def test_program_to_json_exact_text() -> None:
    """Pins the compact text (no spaces), the format tag first, and that any value without _resolver is written."""
    text = program_to_json(_ts())
    assert text == ('{"format":"hspmd-program/1","objects":[{"$c":"hspmd_sdk.core.graph:TensorSpec","f":'
                    '{"name":"x","shape":{"$t":[2,3]},"dtype":"float32"}}],"root":{"$ref":0}}')
    assert program_from_json(text) == _ts()


# ---- round trips ----------------------------------------------------------------------------------------------
def test_round_trip_of_sets_and_non_finite_floats() -> None:
    """Pins the reader's $s (a set, not a frozenset) and $f (float from its repr) tags."""
    back = from_json_value(to_json_value([{2, 1}, float("inf"), float("-inf"), float("nan")]))
    assert back[0] == {1, 2} and type(back[0]) is set
    assert back[1] == math.inf and back[2] == -math.inf and math.isnan(back[3])
    back = program_from_json(program_to_json({"s": {"a"}, "f": float("-inf")}))
    assert back == {"s": {"a"}, "f": -math.inf} and type(back["s"]) is set


def test_model_config_read_back_by_load_or_model_validate() -> None:
    """Pins _model_config: a class with ``load`` is read by load, one without by model_validate of the data."""
    for cfg in (CfgNoLoad(n=3), CfgWithLoad(n=4)):
        v = to_json_value(cfg)
        assert v["objects"][0]["$model"].endswith(f":{type(cfg).__qualname__}")
        assert v["objects"][0]["config"] == {"n": cfg.n, "family": type(cfg).__name__}
        back = from_json_value(v)
        assert type(back) is type(cfg) and back == cfg


def test_pydantic_core_model_read_by_model_construct_not_validated() -> None:
    """Pins that core Pydantic models are rebuilt with model_construct (validated where they were made)."""
    v = {"objects": [{"$p": "hspmd_sdk.core.cluster:DeviceSpec",
                      "f": {"kind": "", "memory_mb": 1, "bf16_tflops": 1.0, "intra_bandwidth_gbs": 1.0}}],
         "root": {"$ref": 0}}
    back = from_json_value(v)
    assert type(back) is DeviceSpec and back.kind == ""


# ---- writer errors ----------------------------------------------------------------------------------------------
def test_foreign_objects_are_refused_with_their_class() -> None:
    """Pins the 'cannot write' message naming the foreign class (also for one with `placements` that is not a
    Pydantic model, one with only `keys`, a non-core dataclass with a mapping interface, and a non-core dataclass
    with `placements`: only a Pydantic model with `placements` is a model config)."""
    import dataclasses

    @dataclasses.dataclass
    class DC:
        a: int = 1

        def keys(self):
            return ["a"]

        def items(self):
            return [("a", 1)]

    class KeysOnly:
        def keys(self):
            return []

    @dataclasses.dataclass
    class Placed:  # a dataclass outside the core with a model config's `placements`: still not a model config
        placements: int = 1

    cases = [(SimpleNamespace(placements=1), "types.SimpleNamespace"), (KeysOnly(), "KeysOnly"), (DC(), "DC"),
             (Placed(), "Placed")]
    for obj, name in cases:
        with pytest.raises(ProgramJSONError, match=r"cannot write a .*" + name + r" into a Program's JSON: only "
                           r"hspmd_sdk.core value types and model configs travel"):
            to_json_value(obj)


def test_model_config_defined_in_a_function_or_main_is_refused() -> None:
    """Pins the notebook/function model-config error, for a <locals> class and a __main__ class."""
    class Local(BaseModel):
        n: int = 1

        def placements(self) -> list:
            return []

    for obj, name in ((Local(), "test_model_config_defined_in_a_function_or_main_is_refused.<locals>.Local"),
                      (CfgMain(n=1), "CfgMain")):
        with pytest.raises(ProgramJSONError) as e:
            to_json_value(obj)
        assert str(e.value) == (f"the model config class {name!r} is defined in a notebook cell or a function: "
                                "another process cannot import it; put it in a module")


# ---- reader errors ----------------------------------------------------------------------------------------------
def _read_root(root, objects=()) -> object:
    return from_json_value({"objects": list(objects), "root": root})


def test_reader_refuses_malformed_values() -> None:
    """Pins the messages for a dict with several keys, a dangling reference, and a missing 'root'."""
    with pytest.raises(ProgramJSONError, match=r"^unexpected value in a Program's JSON: \{'\$t': \[1\], '\$q'"):
        _read_root({"$t": [1], "$q": [1, 2]})
    with pytest.raises(ProgramJSONError, match=r"^reference to object 0, but the text has 0$"):
        _read_root({"$ref": 0})
    with pytest.raises(ProgramJSONError, match=r"^reference to object 1, but the text has 1$"):
        _read_root({"$ref": 1}, [_rec()])
    msg = r"^not a JSON value written by to_json_value \(no 'objects' and 'root'\)$"
    for bad in ({"objects": []}, {"root": 1}, "objects root", []):
        with pytest.raises(ProgramJSONError, match=msg):
            from_json_value(bad)


@pytest.mark.parametrize("path, msg", [
    ("hspmd_sdk.core.graph:<locals>", "a Program's JSON may only name classes of hspmd_sdk.core, not "
                                      "'hspmd_sdk.core.graph:<locals>'"),
    ("hspmd_sdk.core.graph:Te<x", "a Program's JSON may only name classes of hspmd_sdk.core, not "
                                  "'hspmd_sdk.core.graph:Te<x'"),
    ("hspmd_sdk.core.graph:Nope", "no class 'hspmd_sdk.core.graph:Nope' in this version of hspmd_sdk"),
    ("hspmd_sdk.core.graph:TensorSpec:x", "no class 'hspmd_sdk.core.graph:TensorSpec:x' in this version of "
                                          "hspmd_sdk"),
    ("hspmd_sdk.core.graph:TensorSpec.__class__", "'hspmd_sdk.core.graph:TensorSpec.__class__' is not a "
                                                  "dataclass"),
])
def test_reader_refuses_bad_class_paths(path: str, msg: str) -> None:
    """Pins _core_class's messages: '<' in a name, a missing attribute, a second ':' (partition, not rpartition)
    and a dotted qualname walked part by part."""
    with pytest.raises(ProgramJSONError) as e:
        _read_root({"$ref": 0}, [{"$c": path, "f": {}}])
    assert str(e.value) == msg


def test_reader_refuses_bad_model_config_paths() -> None:
    """Pins _model_config's messages: the import error of 'module:name' split at the first ':', a function and a
    class that is not a Pydantic model."""
    with pytest.raises(ProgramJSONError) as e:
        _read_root({"$ref": 0}, [{"$model": "hspmd_sdk.core.graph:TensorSpec:x", "config": {}}])
    assert str(e.value) == ("cannot import the model config class 'hspmd_sdk.core.graph:TensorSpec:x' (module "
                            "'hspmd_sdk.core.graph' has no attribute 'TensorSpec:x'); the module must be importable "
                            "by this process")
    for path in ("json:dumps", "fractions:Fraction"):
        with pytest.raises(ProgramJSONError) as e:
            _read_root({"$ref": 0}, [{"$model": path, "config": {}}])
        assert str(e.value) == f"{path!r} is not a model config class (a Pydantic model)"


def test_program_from_json_names_the_wrong_format() -> None:
    """Pins the format error's 'got': the format found in a dict, else the JSON value's type name."""
    with pytest.raises(ProgramJSONError) as e:
        program_from_json('{"format":"other/2","objects":[],"root":1}')
    assert str(e.value) == f"not a Program's JSON of format {FORMAT!r} (got 'other/2')"
    with pytest.raises(ProgramJSONError) as e:
        program_from_json("[1]")
    assert str(e.value) == f"not a Program's JSON of format {FORMAT!r} (got 'list')"
    with pytest.raises(ProgramJSONError) as e:
        program_from_json('{"objects":[]}')
    assert str(e.value) == f"not a Program's JSON of format {FORMAT!r} (got None)"
