"""CPython's cyclic garbage collector paused around the core's large, allocation-heavy computations.

A plan at thousands of ranks allocates millions of small objects (assignments, boxes, messages) that all live until
the call returns.  Meanwhile the collector, triggered by allocation counts, scans the caller's whole heap again
and again -- a notebook's heap holds the Programs and layouts the call reads -- and finds no cycle to free:
``plan_switch`` of Llama-70B at 2,048 ranks spent 0.7-1.0 s of 2.6-3.0 s in it.  Reference counting still frees
everything that is not a cycle; cycles made meanwhile wait for the collector's next run.
"""
from __future__ import annotations

import functools
import gc
from typing import Any, Callable, TypeVar

__all__ = ["gc_paused"]

F = TypeVar("F", bound=Callable[..., Any])


def gc_paused(fn: F) -> F:
    """``fn`` with the cyclic collector disabled while it runs (and enabled again after, if it was)."""

    def paused(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():  # already paused (by an outer call, or by the caller)
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    # functools.wraps(fn)(paused), written as the call it is: a nested decorated function is one that mutmut skips
    return functools.update_wrapper(paused, fn)  # type: ignore[return-value]
