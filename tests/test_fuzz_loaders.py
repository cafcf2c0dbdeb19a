"""Fuzzing the loaders: whatever JSON a user hands in, ``Strategy.load``, ``AnnotationPlan.load`` and
``Cluster.load`` either load it or raise ``PlanValidationError`` whose problems all name a path -- never another
exception (no ``TypeError``, ``KeyError``, ``IndexError`` from deep inside a validator)."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.plan import AnnotationPlan
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.errors import PlanValidationError

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

STRATEGY_SEEDS = [json.loads((EXAMPLES / n).read_text()) for n in
                  ("table11_c2.json", "example_hetero_tiny.json", "table9_32b_16h800_24h20.json")]
CLUSTER_SEEDS = [json.loads((EXAMPLES / n).read_text()) for n in ("h20_31.json", "local_4.json")]
PLAN_SEEDS = [{"format_version": 1, "meta": {"from": "fuzz"}, "annotations": {
    "wte": {"dg_union": [[0, 1], [2]], "ds_union": [{"states": {"0": 2}, "order": [0]}, {"states": {}}],
            "hdim": 0, "hratios": [1, 3]},
    "layers.0.wq": {"dg_union": [[0, 3], [5, 6]], "ds_union": [{"states": {"-1": 1, "1": 2}},
                                                               {"states": {"-2": 2}}], "hdim": -1},
    "x": "[0-3] D2 S0x2"}}]

json_scalars = st.none() | st.booleans() | st.integers(-3, 70) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=6) | st.sampled_from(["1f1b", "gpipe", "H20", "cpu", "0", "-1", "S0x2", "[0,1] D2"])
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8) | st.sampled_from(
                               ["pipelines", "stages", "devices", "layers", "nodes", "ranks", "kind", "host",
                                "annotations", "dg_union", "ds_union", "states", "order", "hdim", "devices"]),
                               inner, max_size=4), max_leaves=20)
# The replacements a mutation puts in place of a value: wrong types, out-of-range numbers, odd structures.
replacements = st.one_of(json_values, st.sampled_from([-1, 0, 1, 10**9, 31, 48, 2.5, True, "", [], {}, None,
                                                       [0], [0, 0], [5, 3], {"1": 2}]))


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location inside a JSON value."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, prefix + (i,))
    return out


@st.composite
def mutated(draw: Any, seeds: list[Any]) -> Any:
    """A valid document with 1-3 mutations: delete a key or item, replace a value, nudge a number."""
    doc = copy.deepcopy(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 3))):
        locs = paths(doc)[1:]
        if not locs:
            break
        loc = draw(st.sampled_from(locs))
        parent = doc
        for part in loc[:-1]:
            parent = parent[part]
        key = loc[-1]
        action = draw(st.sampled_from(["delete", "replace", "nudge"]))
        if action == "delete":
            del parent[key]
        elif action == "nudge" and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] += draw(st.integers(-40, 40))
        else:
            parent[key] = copy.deepcopy(draw(replacements))  # sampled values are shared: never alias them
    return doc


def loads_or_explains(load: Callable[[Any], Any], value: Any) -> None:
    for form in (value, json.dumps(value)) if isinstance(value, dict) else (value,):
        try:
            load(form)
        except PlanValidationError as e:
            assert e.problems and all(p and r for p, r in e.problems), e.problems


def _cluster_load_explains_everything() -> bool:
    """Whether ``Cluster.load`` already turns a non-object ``devices`` and a non-JSON string into
    ``PlanValidationError`` (two known gaps in cluster.py, reported to the lead; the tests below are expected
    failures until they are fixed, and run normally afterwards)."""
    for bad in ({"nodes": [{"host": "a", "kind": "cpu", "ranks": [0]}], "devices": -1}, "0"):
        try:
            Cluster.load(bad)
        except PlanValidationError:
            pass
        except Exception:
            return False
    return True


CLUSTER_GAPS = pytest.mark.xfail(not _cluster_load_explains_everything(), strict=True,
                                 reason="Cluster.load raises TypeError for a non-object 'devices' and "
                                        "FileNotFoundError/IsADirectoryError for a string that is not JSON")

CONTEXT = dict(model=LlamaConfig.preset("llama-32b"), cluster=Cluster.homogeneous("H20", 31), global_batch=64)


@SETTINGS
@given(json_values)
def test_strategy_random_json(value: Any) -> None:
    loads_or_explains(Strategy.load, value)


@SETTINGS
@given(mutated(STRATEGY_SEEDS))
def test_strategy_mutations(value: Any) -> None:
    loads_or_explains(lambda v: Strategy.load(v, **CONTEXT), value)


@SETTINGS
@given(json_values)
def test_plan_random_json(value: Any) -> None:
    loads_or_explains(AnnotationPlan.load, value)


@SETTINGS
@given(mutated(PLAN_SEEDS))
def test_plan_mutations(value: Any) -> None:
    loads_or_explains(AnnotationPlan.load, value)


@CLUSTER_GAPS
@SETTINGS
@given(json_values)
def test_cluster_random_json(value: Any) -> None:
    loads_or_explains(Cluster.load, value)


@CLUSTER_GAPS
@SETTINGS
@given(mutated(CLUSTER_SEEDS))
def test_cluster_mutations(value: Any) -> None:
    loads_or_explains(Cluster.load, value)


def test_seeds_are_valid() -> None:
    for s in STRATEGY_SEEDS:
        Strategy.load(s)
    for c in CLUSTER_SEEDS:
        Cluster.load(c)
    AnnotationPlan.load(PLAN_SEEDS[0])
