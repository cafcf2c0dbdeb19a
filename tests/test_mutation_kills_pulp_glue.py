"""Tests that kill the surviving mutants of :mod:`hspmd_sdk.planner._pulp` (issue 49, mutation testing): the
variables the planners' ILPs are built of, and the CBC solver they are solved with."""
from __future__ import annotations

import warnings

import pulp
import pytest

from hspmd_sdk.planner._pulp import _cbc, _variable


def _fields(v: pulp.LpVariable) -> tuple:
    return (v.name, v.lowBound, v.upBound, v.cat)


def test_a_variable_of_a_problem_is_attached_to_it_with_its_name_bounds_and_category() -> None:
    """PuLP 3's add_variable: the variable has the given name, bounds and category."""
    prob = pulp.LpProblem("p", pulp.LpMinimize)
    x = _variable(prob, "x0", 1, 7, "Integer")
    t = _variable(prob, "tau", 0, None, "Continuous")
    assert _fields(x) == ("x0", 1, 7, "Integer") and _fields(t) == ("tau", 0, None, "Continuous")


def test_a_free_standing_variable_keeps_its_name_bounds_and_category() -> None:
    """Without a problem (prob=None, no add_variable): a plain LpVariable."""
    v = _variable(None, "share_1", 0.5, 2.0, "Continuous")
    assert isinstance(v, pulp.LpVariable) and _fields(v) == ("share_1", 0.5, 2.0, "Continuous")
    w = _variable(None, "part", None, None, "Integer")
    assert _fields(w) == ("part", None, None, "Integer")


def test_cbc_is_quiet_with_the_time_limit_and_solves() -> None:
    """The solver: PuLP's bundled CBC, no log, the given time limit, and it solves a small integer program."""
    solver = _cbc(2.5)
    assert isinstance(solver, pulp.PULP_CBC_CMD) and solver.msg is False and solver.timeLimit == 2.5
    prob = pulp.LpProblem("q", pulp.LpMinimize)
    x = _variable(prob, "x", 0, 10, "Integer")
    prob += x
    prob += x >= 2.5
    assert prob.solve(_cbc(5.0)) == pulp.LpStatusOptimal and x.value() == 3


def test_cbc_makes_no_deprecation_warning_reach_the_caller() -> None:
    """PuLP 3 flags PULP_CBC_CMD as deprecated: the helper keeps that warning from the planners' callers."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _cbc(1.0)


@pytest.mark.parametrize("limit", [0.5, 30.0])
def test_cbc_time_limit_is_passed_through(limit: float) -> None:
    assert _cbc(limit).timeLimit == limit


def test_a_variable_of_a_problem_comes_without_pulps_deprecation_warning() -> None:
    """With a PuLP 3 problem the helper uses prob.add_variable: the direct LpVariable constructor (deprecated in
    PuLP 3, a DeprecationWarning) is not reached."""
    prob = pulp.LpProblem("p", pulp.LpMinimize)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = _variable(prob, "y", 0, 1, "Integer")
    assert _fields(v) == ("y", 0, 1, "Integer")
