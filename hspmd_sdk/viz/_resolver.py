"""Communication resolution for the editor: ``plan_from_strategy`` + ``specialize`` + what the canvas
draws of it (:func:`._comm_view.comm_view`), inline or on one background thread (the newest request wins), with a
small cache keyed by the strategy so that undo and redo are instant.

On the background thread the result comes in two deliveries: first the program and its stage-boundary arrows, then
(after summing every operator's transfers) the busiest link -- so the arrows are drawn without waiting for it.  The
thread shares the kernel's GIL with the editor's redraws, so it starts only once the redraw of its edit is sent
(:meth:`Resolver.request` returns the start; in a Jupyter kernel the thread first waits until the kernel's IOPub
thread has put that redraw on the wire, :func:`iopub_drained`) and stops between its steps once a newer draft
superseded it."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from ..core.strategy_plan import plan_from_strategy
from ..errors import HSPMDError
from ._comm_view import busiest_link, comm_view
from .draft import Problem, locate

__all__ = ["Resolved", "Resolver", "iopub_drained"]

_CACHE = 16


def iopub_drained(timeout: float = 0.25) -> bool:
    """Wait until the Jupyter kernel's IOPub thread has sent every message queued before this call (a widget's
    new state among them); ``False`` outside a kernel or after ``timeout`` seconds.

    ipykernel sends IOPub messages from a thread of its own, which needs the GIL: a CPU-bound Python thread
    started right after a trait change delays that send by the interpreter's switch interval, several times
    over (measured in the editor: 10-26 ms instead of 4-7 ms from a click's message to its redraw leaving)."""
    try:
        from IPython import get_ipython

        io = getattr(getattr(get_ipython(), "kernel", None), "iopub_thread", None)
        alive = io is not None and io.thread.is_alive()
    except Exception:  # noqa: BLE001 - no IPython, no kernel, or another kernel: nothing to wait for
        return False
    if not alive:
        return False
    sent = threading.Event()
    io.schedule(sent.set)  # the IO thread runs its queue in order: set once the earlier sends are done
    return sent.wait(timeout)


@dataclass(frozen=True)
class Resolved:
    """The core's resolution of one strategy: its annotation plan, specialized program and communication view
    (or the problem that stopped it)."""

    plan: Any = None
    program: Any = None
    comm: Any = None
    problem: Problem | None = None
    seconds: float = 0.0


class Resolver:
    def __init__(self, model: Any, cluster: Any, background: bool) -> None:
        self.model, self.cluster, self.background = model, cluster, background
        self._cache: OrderedDict[str, Resolved] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._wanted: str | None = None
        self._queued: str | None = None  # requested, its start not called yet

    @property
    def busy(self) -> bool:
        """Whether the newest request is still being resolved (or about to be)."""
        if self._queued is not None and self._queued == self._wanted:
            return True
        fut = self._pending
        return fut is not None and not fut.done()

    def cached(self, key: str) -> Resolved | None:
        with self._lock:
            return self._cache.get(key)

    def request(self, key: str, strategy: Any,
                done: Callable[[Resolved, bool], None]) -> Callable[[], None] | None:
        """Resolve ``strategy`` (cached under ``key``) and call ``done(result, later)`` -- now when inline or
        cached (``later=False``; returns ``None``), else on the background thread (``later=True``: the caller's
        redraw has gone, so ``done`` redraws) unless a newer request superseded this one: then it returns the
        function that starts that work, for the caller to call once its redraw is sent (the resolution holds the
        GIL for most of a second and would slow the redraw down)."""
        self._wanted = key
        got = self.cached(key)
        if got is not None:
            done(got, False)
            return None
        if not self.background:
            res = self._compute(key, strategy)
            assert res is not None  # always wanted inline
            done(res, False)
            return None

        def job() -> None:
            iopub_drained()
            if self._wanted != key:  # superseded before it started
                return
            res = self._compute(key, strategy, busiest=False, wanted=lambda: self._wanted == key)
            if res is None:  # superseded on the way: its result would be thrown away, so it stopped early
                return
            if self._wanted == key:
                done(res, True)
            if res.program is not None and self._wanted == key:
                res = self._add_busiest(key, res)
                if self._wanted == key:
                    done(res, True)

        def start() -> None:
            if self._queued == key:
                self._queued = None
            if self._wanted != key:  # superseded before it was started
                return
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hspmd-editor")
            self._pending = self._executor.submit(job)
        self._queued = key
        return start

    def cancel(self) -> None:
        """Forget the newest request (a newer draft has nothing to resolve)."""
        self._wanted = None

    def wait(self, timeout: float | None = 60.0) -> None:
        fut = self._pending
        if fut is not None:
            fut.result(timeout=timeout)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _add_busiest(self, key: str, res: Resolved) -> Resolved:
        from dataclasses import replace

        full = replace(res, comm=replace(res.comm, busiest=busiest_link(res.program, self.cluster)))
        with self._lock:
            self._cache[key] = full
            while len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
        return full

    def _compute(self, key: str, strategy: Any, busiest: bool = True,
                 wanted: Callable[[], bool] = lambda: True) -> Resolved | None:
        """Resolve ``strategy``; ``None`` when ``wanted()`` turns false between the steps (a newer draft
        superseded it: the background thread then stops burning the GIL that the editor's next redraw needs)."""
        from ..core.specialize import specialize  # lazy: tests patch core.specialize.specialize at call time

        t0 = time.perf_counter()
        try:
            plan = plan_from_strategy(self.model, strategy, self.cluster)
            if not wanted():
                return None
            program = specialize(self.model, plan, self.cluster)
            if not wanted():
                return None
            res = Resolved(plan, program, comm_view(program, strategy, self.cluster, busiest=busiest), None,
                           time.perf_counter() - t0)
        except HSPMDError as e:
            problems = getattr(e, "problems", None)
            prob = locate(*problems[0]) if problems else locate("", str(e))
            if prob.tensor is None and prob.pipeline is None:
                prob = Problem(prob.path or "communication", f"communication resolution failed: {prob.message}")
            res = Resolved(problem=prob, seconds=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - shown in plain words, never as a traceback
            res = Resolved(problem=Problem("communication", f"communication resolution failed "
                                                            f"({type(e).__name__}): {e}"),
                           seconds=time.perf_counter() - t0)
        if busiest or res.program is None:  # a partial result is never cached
            with self._lock:
                self._cache[key] = res
                while len(self._cache) > _CACHE:
                    self._cache.popitem(last=False)
        return res
