

# ---- added by scripts/mutation.sh in its work copy only ------------------------------------------------------------
@pytest.fixture(autouse=True)
def _mutation_empty_caches():
    """Every test starts with the SDK's lru_caches empty: mutmut forks each mutant from a process whose first pass
    filled them, and a cached answer would keep the mutated code from running."""
    import functools
    import sys

    for name, module in list(sys.modules.items()):
        if not name.startswith("hspmd_sdk"):
            continue
        for value in list(vars(module).values()):
            targets = [value] + (list(vars(value).values()) if isinstance(value, type) else [])
            for t in targets:
                t = getattr(t, "__func__", t)
                if isinstance(t, functools._lru_cache_wrapper):
                    t.cache_clear()
    yield


@pytest.fixture(autouse=True)
def _mutation_pyomo_log_stream():
    """mutmut runs pytest several times in one process: pyomo's log handler keeps the stdout of the run that
    imported pyomo, which the next run closes (its solvers then fail on ``fileno()``).  Point it at the process's
    own stdout before each test, once pyomo is loaded (without flushing the closed one)."""
    import logging
    import sys

    if "pyomo.common.log" in sys.modules:
        for handler in logging.getLogger("pyomo").handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is not sys.__stdout__:
                with handler.lock:  # not setStream: it flushes the old stream first, which may be closed
                    handler.stream = sys.__stdout__
    yield
