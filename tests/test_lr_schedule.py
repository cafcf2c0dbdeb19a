"""Learning-rate schedules (SPEC §13, ``hspmd_sdk.runtime.lr_schedule``): each kind against reference formulas
written here independently (numpy's piecewise-linear interpolation through the schedule's knots for the linear
shapes, the cosine formula for cosine, and hand-computed values), continuity at phase boundaries, bounds, and the
checks of the fields."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.runtime.lr_schedule import Schedule


# ---- the references ----------------------------------------------------------------------------------------------
def knots(warmup: int, stable: int, decay: int, m: float) -> tuple[list[float], list[float]]:
    """The curve's corners: lr 0 at the virtual step -1, the peak at the warmup's end, the peak kept for the
    stable steps, then ``m`` after the decay."""
    return [-1, warmup, warmup + stable, warmup + stable + decay], [0.0, 1.0, 1.0, m]


def reference_linear(steps: int, warmup: int, stable: int, decay: int, m: float) -> np.ndarray:
    x, y = knots(warmup, stable, decay, m)
    return np.interp(np.arange(steps), x, y, right=m)


def reference_cosine(steps: int, warmup: int, decay: int, m: float) -> list[float]:
    out = []
    for s in range(steps):
        if s < warmup:
            out.append((s + 1) / (warmup + 1))
        elif s >= warmup + decay:
            out.append(m)
        else:
            out.append(m + (1 - m) * 0.5 * (1 + math.cos(math.pi * (s - warmup) / decay)))
    return out


def curve(schedule: Schedule, steps: int, *, past: int = 0) -> np.ndarray:
    return np.array([schedule.factor(s, steps) for s in range(steps + past)])


# ---- every kind equals its formula ---------------------------------------------------------------------------------
def test_hand_computed_values() -> None:
    assert curve(Schedule(), 4).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert curve(Schedule(warmup_steps=3), 6).tolist() == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert curve(Schedule(kind="linear"), 4).tolist() == [1.0, 0.75, 0.5, 0.25]
    assert curve(Schedule(kind="linear", warmup_steps=1, min_lr_factor=0.5), 5).tolist() == \
        [0.5, 1.0, 0.875, 0.75, 0.625]
    np.testing.assert_allclose(curve(Schedule(kind="cosine"), 4), [1.0, (1 + math.sqrt(0.5)) / 2, 0.5,
                                                                  (1 - math.sqrt(0.5)) / 2], rtol=0, atol=1e-15)
    # WSD: 1 warmup step, then a 2-step decay at the end of a 6-step run (3 stable steps)
    assert curve(Schedule(kind="wsd", warmup_steps=1, decay_steps=2), 6).tolist() == [0.5, 1, 1, 1, 1, 0.5]


@pytest.mark.parametrize("steps", [1, 2, 7, 40])
@pytest.mark.parametrize("warmup", [0, 1, 5, 39, 60])
@pytest.mark.parametrize("m", [0.0, 0.1])
def test_linear_and_cosine_decay_to_the_end_of_the_run(steps: int, warmup: int, m: float) -> None:
    decay = max(steps - warmup, 1)
    np.testing.assert_allclose(curve(Schedule(kind="linear", warmup_steps=warmup, min_lr_factor=m), steps, past=3),
                               reference_linear(steps + 3, warmup, 0, decay, m), rtol=0, atol=1e-12)
    np.testing.assert_allclose(curve(Schedule(kind="cosine", warmup_steps=warmup, min_lr_factor=m), steps, past=3),
                               reference_cosine(steps + 3, warmup, decay, m), rtol=0, atol=1e-12)


@pytest.mark.parametrize("steps,warmup,decay", [(10, 0, 3), (10, 2, 3), (10, 2, 8), (10, 2, 20), (5, 5, 1)])
def test_an_explicit_decay_ends_at_the_floor_and_stays_there(steps: int, warmup: int, decay: int) -> None:
    m = 0.2
    np.testing.assert_allclose(curve(Schedule(kind="linear", warmup_steps=warmup, decay_steps=decay,
                                              min_lr_factor=m), steps, past=2),
                               reference_linear(steps + 2, warmup, 0, decay, m), rtol=0, atol=1e-12)
    np.testing.assert_allclose(curve(Schedule(kind="cosine", warmup_steps=warmup, decay_steps=decay,
                                              min_lr_factor=m), steps, past=2),
                               reference_cosine(steps + 2, warmup, decay, m), rtol=0, atol=1e-12)


@pytest.mark.parametrize("steps,warmup,stable,decay,expect", [
    # (run, warmup, stable_steps, decay_steps, (W, S, D) the run gets)
    (20, 2, None, 5, (2, 13, 5)),    # the decay is the run's last 5 steps
    (20, 2, 4, None, (2, 4, 14)),    # the decay takes what the stable phase leaves
    (20, 2, 4, 5, (2, 4, 5)),        # both: the floor after step 11
    (20, 2, None, None, (2, 0, 18)),  # neither: no stable phase, decay to the end
    (6, 2, None, 9, (2, 0, 9)),      # a decay longer than the run: it starts after the warmup
    (6, 2, 9, None, (2, 9, 1)),      # a stable phase past the run's end
])
def test_wsd_phases_and_curve(steps: int, warmup: int, stable: int | None, decay: int | None,
                              expect: tuple[int, int, int]) -> None:
    s = Schedule(kind="wsd", warmup_steps=warmup, stable_steps=stable, decay_steps=decay, min_lr_factor=0.1)
    assert tuple(s.phases(steps)) == expect
    np.testing.assert_allclose(curve(s, steps, past=2), reference_linear(steps + 2, *expect, 0.1), rtol=0,
                               atol=1e-12)


def test_constant_after_warmup_and_past_the_run() -> None:
    np.testing.assert_allclose(curve(Schedule(warmup_steps=4), 10, past=5), reference_linear(15, 4, 10 ** 6, 1, 1.0))


def test_lr_is_the_base_times_the_factor() -> None:
    s = Schedule(kind="cosine", warmup_steps=3, min_lr_factor=0.1)
    assert [s.lr(i, 3e-3, 12) for i in range(12)] == [3e-3 * s.factor(i, 12) for i in range(12)]


def test_the_default_decay_never_trains_a_step_at_lr_zero_and_reaches_the_floor_after_the_run() -> None:
    for kind in ("linear", "cosine", "wsd"):
        s = Schedule(kind=kind, warmup_steps=2)
        assert min(curve(s, 10)) > 0
        assert s.factor(10, 10) == 0.0


# ---- properties over many schedules ------------------------------------------------------------------------------
@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    kind = draw(st.sampled_from(["constant", "linear", "cosine", "wsd"]))
    fields = {"kind": kind, "warmup_steps": draw(st.integers(0, 50))}
    if kind != "constant":
        fields["decay_steps"] = draw(st.none() | st.integers(1, 80))
        fields["min_lr_factor"] = draw(st.floats(0, 1))
    if kind == "wsd":
        fields["stable_steps"] = draw(st.none() | st.integers(0, 80))
    return Schedule(**fields)


def max_slope(s: Schedule, steps: int) -> float:
    """The steepest change of one step in any phase of ``s`` over a run of ``steps`` steps."""
    w, _, d = s.phases(steps)
    decay = 0.0 if s.kind == "constant" else (1 - s.min_lr_factor) / d * (math.pi / 2 if s.kind == "cosine" else 1)
    return max(1 / (w + 1), decay)


@settings(max_examples=300, deadline=None)
@given(s=schedules(), steps=st.integers(1, 120))
def test_bounds_and_continuity(s: Schedule, steps: int) -> None:
    f = curve(s, steps, past=3)
    w = s.warmup_steps
    assert np.all((f[:w] > 0) & (f[:w] <= 1))
    assert np.all((f[w:] >= s.min_lr_factor - 1e-15) & (f[w:] <= 1))
    # no jump at a phase boundary beyond one step's slope of the steeper phase
    assert np.max(np.abs(np.diff(f)), initial=0.0) <= max_slope(s, steps) + 1e-12
    # the curve never rises after the warmup
    assert np.all(np.diff(f[w:]) <= 1e-15)


@settings(max_examples=100, deadline=None)
@given(s=schedules(), steps=st.integers(1, 120), at=st.integers(0, 119))
def test_a_resumed_run_continues_on_the_same_curve(s: Schedule, steps: int, at: int) -> None:
    """The factor depends on the step, the run's length and the fields only: a schedule read back from its JSON
    (a checkpoint, a switch, a recovery) gives the same value at every later step."""
    again = Schedule.model_validate_json(s.model_dump_json())
    assert [again.factor(i, steps) for i in range(at, at + 5)] == [s.factor(i, steps) for i in range(at, at + 5)]


# ---- the fields are checked ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,field", [
    ({"kind": "constant", "decay_steps": 3}, "decay_steps"),
    ({"kind": "constant", "min_lr_factor": 0.1}, "min_lr_factor"),
    ({"kind": "cosine", "stable_steps": 3}, "stable_steps"),
    ({"kind": "step"}, "kind"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"warmup_steps": 2.0}, "warmup_steps"),
    ({"warmup_steps": True}, "warmup_steps"),
    ({"kind": "linear", "decay_steps": 0}, "decay_steps"),
    ({"kind": "linear", "min_lr_factor": 1.5}, "min_lr_factor"),
    ({"kind": "linear", "min_lr_factor": math.nan}, "min_lr_factor"),
    ({"kind": "linear", "warmup": 3}, "warmup"),
])
def test_bad_fields_are_refused_naming_the_field(fields: dict, field: str) -> None:
    from hspmd_sdk.runtime.train_config import TrainConfig

    with pytest.raises(PlanValidationError) as err:
        TrainConfig.from_dict({"schedule": fields})
    assert [p for p, _ in err.value.problems] == [f"schedule.{field}"]


@pytest.mark.parametrize("step,total,name", [(-1, 10, "step"), (1.0, 10, "step"), (0, 0, "total_steps"),
                                             (True, 10, "step")])
def test_bad_queries_name_the_argument(step: object, total: object, name: str) -> None:
    with pytest.raises(PlanValidationError) as err:
        Schedule().factor(step, total)  # type: ignore[arg-type]
    assert err.value.problems[0][0] == name


def test_the_module_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, hspmd_sdk.runtime.lr_schedule, hspmd_sdk.runtime.train_config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
