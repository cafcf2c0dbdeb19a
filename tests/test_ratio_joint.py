"""Data-parallel and tensor-parallel ratios together (issue 28 item 2): groups of mixed devices sharing a step's
batch.  The joint linear program over every group's batch share and every device's share of its group's split
work is solved here with PuLP, written from its definition (not the planner's code), and its optimum is checked
against the planner's decomposition: each group's own ratio LP (``solve_ratios``) and batch shares by the groups'
speeds.  The integral micro-batch shares (``hetero_mixed._shares``) are checked against exhaustive search."""
from __future__ import annotations

import itertools
import random

import pulp
import pytest

from hspmd_sdk.planner._pulp import _cbc
from hspmd_sdk.planner.hetero_mixed import _shares
from hspmd_sdk.planner.ratios import solve_ratios


def _joint_lp(groups: list[list[float]], work: float, repeated: float, memory: list[list[float]] | None,
              sharded: float, replicated: float) -> float:
    """min T over y_g (batch shares) and z_gi = y_g * x_gi (device i's share of the whole batch's split work)."""
    prob = pulp.LpProblem("joint", pulp.LpMinimize)
    T = pulp.LpVariable("T", 0)
    prob += T
    ys = [pulp.LpVariable(f"y{g}", 0, 1) for g in range(len(groups))]
    prob += pulp.lpSum(ys) == 1
    for g, speeds in enumerate(groups):
        zs = [pulp.LpVariable(f"z{g}_{i}", 0, 1) for i in range(len(speeds))]
        prob += pulp.lpSum(zs) == ys[g]
        for i, s in enumerate(speeds):
            prob += (zs[i] * work + ys[g] * repeated) * (1.0 / s) <= T
            if memory is not None:
                prob += zs[i] * sharded <= ys[g] * (memory[g][i] - replicated)
    prob.solve(_cbc(10.0))
    assert pulp.LpStatus[prob.status] == "Optimal"
    return float(T.value())


def _group_time(shares: tuple[float, ...], speeds: tuple[float, ...], work: float, repeated: float) -> float:
    """A group's time for the whole batch with these shares of its split work."""
    return max((x * work + repeated) / s for x, s in zip(shares, speeds))


@pytest.mark.parametrize("seed", range(6))
def test_the_joint_lp_is_each_groups_lp_with_batch_shares_by_speed(seed: int) -> None:
    rng = random.Random(seed)
    groups = [[rng.uniform(0.5, 4.0) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(2, 3))]
    work, repeated = 1.0, rng.choice([0.0, 0.05])
    limited = seed % 2 == 1  # every other case with memory that binds the fast devices' shares
    sharded, replicated = 10.0, 1.0
    memory = [[replicated + sharded * rng.uniform(0.3, 1.2) for _ in g] for g in groups] if limited else None
    if memory is not None:  # the devices of each group can hold the whole split between them
        for g in memory:
            while sum(m - replicated for m in g) < sharded * 1.05:
                g[:] = [m * 1.3 for m in g]
    joint = _joint_lp(groups, work, repeated, memory, sharded, replicated)
    taus = []
    for g, speeds in enumerate(groups):
        plan = solve_ratios(speeds, work=work, repeated_work=repeated, memory=None if memory is None else memory[g],
                            sharded_bytes=sharded, replicated_bytes=replicated)
        taus.append(_group_time(plan.shares, plan.speeds, work, repeated))
    decomposed = 1.0 / sum(1.0 / t for t in taus)
    assert decomposed == pytest.approx(joint, rel=1e-6)
    if memory is None and repeated == 0:  # the ideal: every device busy all the time
        assert joint == pytest.approx(work / sum(sum(g) for g in groups), rel=1e-6)


def _best_makespan(total: int, times: list[float]) -> float:
    return min(max(m * t for m, t in zip(c, times))
               for c in itertools.product(range(1, total + 1), repeat=len(times)) if sum(c) == total)


def test_micro_batch_shares_are_the_least_makespan_of_exhaustive_search() -> None:
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(2, 4)
        times = [round(rng.uniform(0.5, 4.0), 2) for _ in range(n)]
        total = rng.randint(n, 11)
        got = _shares(total, times)
        assert got is not None and sum(got) == total and min(got) >= 1
        assert max(m * t for m, t in zip(got, times)) == pytest.approx(_best_makespan(total, times)), (total, times)
    # the case that shares in proportion to speed (largest remainders: [2, 3, 1], 6.36) got wrong
    assert max(m * t for m, t in zip(_shares(6, [3.18, 1.54, 3.34]), [3.18, 1.54, 3.34])) == pytest.approx(6.16)
    assert _shares(2, [1.0, 2.0, 3.0]) is None  # fewer micro-batches than groups
