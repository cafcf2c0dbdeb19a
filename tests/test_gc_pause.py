"""``core.gc_pause.gc_paused``: the cyclic collector is off while the wrapped call runs and as it was after, also
when the call raises or is nested; the planners that allocate millions of objects are wrapped."""
from __future__ import annotations

import gc

import pytest

from hspmd_sdk.core.gc_pause import gc_paused


def test_the_collector_is_off_inside_and_restored_after() -> None:
    seen: list[bool] = []

    @gc_paused
    def inner() -> int:
        seen.append(gc.isenabled())
        return 7

    @gc_paused
    def outer() -> int:
        seen.append(gc.isenabled())
        value = inner()
        seen.append(gc.isenabled())  # the nested call left it off: its caller still runs
        return value

    assert gc.isenabled()
    assert outer() == 7 and seen == [False, False, False] and gc.isenabled()


def test_a_raising_call_restores_it_and_a_disabled_collector_stays_disabled() -> None:
    @gc_paused
    def boom() -> None:
        raise ValueError("x")

    with pytest.raises(ValueError):
        boom()
    assert gc.isenabled()
    gc.disable()
    try:
        boom_free = gc_paused(lambda: gc.isenabled())
        assert boom_free() is False and not gc.isenabled()  # the caller's choice is kept
    finally:
        gc.enable()


def test_the_large_planning_calls_are_wrapped() -> None:
    import importlib

    for path, name in (("core.switch", "plan_switch"), ("core.specialize", "specialize"),
                       ("core.strategy_plan", "plan_from_strategy"), ("core.program_json", "program_to_json"),
                       ("core.program_json", "program_from_json"), ("core.program_part", "part_json"),
                       ("core.program_part", "make_part"), ("planner.elastic", "replan_elastic")):
        fn = getattr(importlib.import_module(f"hspmd_sdk.{path}"), name)
        assert getattr(fn, "__wrapped__", None) is not None, (path, name)
