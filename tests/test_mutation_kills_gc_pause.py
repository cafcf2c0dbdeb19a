"""Kills for the mutants of hspmd_sdk/core/gc_pause.py (issue 49): the wrapped call gets every argument as given,
positional and keyword, on both paths (collector on, and already off), and the wrapper is the wrapped function's
``functools.wraps`` twin (``__wrapped__``, name, docstring).  In-process and fast."""
from __future__ import annotations

import gc

from hspmd_sdk.core.gc_pause import gc_paused


def _target(a: int, b: int = 10, *, c: int = 100) -> tuple[int, int, int, bool]:
    """The target's own docstring."""
    return a, b, c, gc.isenabled()


def test_gc_pause_passes_positional_and_keyword_arguments_with_the_collector_on() -> None:
    wrapped = gc_paused(_target)
    assert gc.isenabled()
    assert wrapped(1, 2, c=3) == (1, 2, 3, False) and gc.isenabled()
    assert wrapped(4, b=5) == (4, 5, 100, False) and gc.isenabled()


def test_gc_pause_passes_positional_and_keyword_arguments_with_the_collector_already_off() -> None:
    wrapped = gc_paused(_target)
    gc.disable()
    try:
        assert wrapped(1, 2, c=3) == (1, 2, 3, False)
        assert wrapped(4, b=5) == (4, 5, 100, False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_gc_pause_wrapper_carries_the_wrapped_functions_identity() -> None:
    wrapped = gc_paused(_target)
    assert wrapped.__wrapped__ is _target  # type: ignore[attr-defined]
    assert wrapped.__name__ == "_target" and wrapped.__qualname__ == "_target"
    assert wrapped.__doc__ == "The target's own docstring." and wrapped.__module__ == __name__
    assert wrapped is not _target
