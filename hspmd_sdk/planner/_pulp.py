"""PuLP helpers the planners share (imported when solving)."""
from __future__ import annotations


def _variable(prob, name: str, low: float | None, up: float | None, cat: str):
    """A PuLP variable attached to ``prob`` (PuLP 3's ``add_variable`` where it exists)."""
    import pulp

    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, lowBound=low, upBound=up, cat=cat)


def _cbc(time_limit: float):
    """PuLP's bundled CBC, quiet (PuLP 3 flags the class as deprecated in favour of a separately installed CBC)."""
    import warnings

    import pulp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)
