"""Kills for the mutants of hspmd_sdk/runtime/lr_schedule.py (issue 49): the phases of each kind at their edges,
the checks' messages, ``describe``'s text, ``schedule_of`` / ``schedule_json``.  All fast and in-process."""
from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.runtime.lr_schedule import Phases, Schedule, schedule_json, schedule_of


def _refused(**fields) -> str:
    with pytest.raises(ValidationError) as e:
        Schedule(**fields)
    return str(e.value)


def test_lr_schedule_kind_checks_say_what_to_do() -> None:
    """Each field a kind does not use is refused with its own message (users read them)."""
    for name in ("decay_steps", "stable_steps"):
        assert (f"{name}: a 'constant' schedule has no decay; leave {name} out or choose kind 'linear', 'cosine' "
                "or 'wsd'") in _refused(**{name: 3})
    assert ("min_lr_factor: a 'constant' schedule never decays to it; leave it out or choose kind 'linear', "
            "'cosine' or 'wsd'") in _refused(min_lr_factor=0.5)
    for kind in ("linear", "cosine"):
        assert (f"stable_steps: only a 'wsd' schedule has a stable phase, not '{kind}'; leave it out or choose kind "
                "'wsd'") in _refused(kind=kind, stable_steps=0)
    # what each kind does accept
    assert Schedule(kind="wsd", stable_steps=0).stable_steps == 0
    assert Schedule(kind="linear", decay_steps=2, min_lr_factor=0.5).min_lr_factor == 0.5
    assert Schedule(kind="constant", min_lr_factor=0.0, warmup_steps=2).warmup_steps == 2


@pytest.mark.parametrize("schedule,total,phases", [
    (Schedule(warmup_steps=3), 10, (3, 7, 0)),
    (Schedule(warmup_steps=12), 10, (12, 0, 0)),                     # the warmup longer than the run
    (Schedule(kind="linear", warmup_steps=3), 10, (3, 0, 7)),
    (Schedule(kind="linear", warmup_steps=10), 10, (10, 0, 1)),      # at least one decay step
    (Schedule(kind="cosine", warmup_steps=3, decay_steps=4), 10, (3, 0, 4)),
    (Schedule(kind="wsd", warmup_steps=2), 10, (2, 0, 8)),
    (Schedule(kind="wsd", warmup_steps=12), 10, (12, 0, 1)),
    (Schedule(kind="wsd", warmup_steps=2, decay_steps=3), 10, (2, 5, 3)),
    (Schedule(kind="wsd", warmup_steps=2, decay_steps=9), 10, (2, 0, 9)),  # the stable phase never negative
    (Schedule(kind="wsd", warmup_steps=2, decay_steps=8), 10, (2, 0, 8)),
    (Schedule(kind="wsd", warmup_steps=2, stable_steps=3), 10, (2, 3, 5)),
    (Schedule(kind="wsd", warmup_steps=2, stable_steps=9), 10, (2, 9, 1)),
    (Schedule(kind="wsd", warmup_steps=2, stable_steps=7), 10, (2, 7, 1)),
    (Schedule(kind="wsd", warmup_steps=2, stable_steps=6), 10, (2, 6, 2)),
    (Schedule(kind="wsd", warmup_steps=1, stable_steps=2, decay_steps=4), 10, (1, 2, 4)),
])
def test_lr_schedule_phases_of_every_kind(schedule: Schedule, total: int, phases: tuple) -> None:
    """The documented phase rules, at the edges where a max() floor starts to matter."""
    assert schedule.phases(total) == Phases(*phases)


def test_lr_schedule_phases_checks_the_run_length() -> None:
    """``phases`` refuses a run of no steps, naming total_steps with its message."""
    with pytest.raises(PlanValidationError) as e:
        Schedule().phases(0)
    assert e.value.problems == [("total_steps", "must be a whole number of steps >= 1, not 0")]
    assert str(e.value) == ("invalid learning-rate schedule query: total_steps: must be a whole number of steps >= 1, "
                            "not 0")


def test_lr_schedule_bad_queries_list_every_problem_with_its_message() -> None:
    """Both arguments checked, each problem with its text; bools and floats are not steps."""
    with pytest.raises(PlanValidationError) as e:
        Schedule().factor(-1, 0)
    assert e.value.problems == [("step", "must be a whole number >= 0 (a 0-based step), not -1"),
                                ("total_steps", "must be a whole number of steps >= 1, not 0")]
    assert str(e.value).startswith("invalid learning-rate schedule query:\n  step: ")
    for bad in (True, 2.0):
        with pytest.raises(PlanValidationError) as e:
            Schedule().factor(0, bad)
        assert e.value.problems == [("total_steps", f"must be a whole number of steps >= 1, not {bad!r}")]
    with pytest.raises(PlanValidationError) as e:
        Schedule().factor(False, 3)
    assert e.value.problems == [("step", "must be a whole number >= 0 (a 0-based step), not False")]
    assert Schedule().factor(0, 1) == 1.0  # both bounds allowed


def test_lr_schedule_factor_at_every_phase_edge() -> None:
    """Exact values: the warmup's last step, the stable steps, the decay's first and last steps, past the decay,
    for linear, cosine and wsd (min factor 0.2)."""
    wsd = Schedule(kind="wsd", warmup_steps=1, stable_steps=2, decay_steps=4, min_lr_factor=0.2)
    got = [wsd.factor(s, 10) for s in range(9)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2], abs=1e-12)
    assert wsd.factor(4, 10) == 0.2 + 0.8 * 0.75
    cos = Schedule(kind="cosine", warmup_steps=1, decay_steps=4, min_lr_factor=0.2)
    vals = [cos.factor(s, 10) for s in range(7)]
    ref = [0.5] + [0.2 + 0.8 * (1 + math.cos(math.pi * p / 4)) / 2 for p in range(4)] + [0.2, 0.2]
    assert vals == pytest.approx(ref, abs=1e-15)
    lin = Schedule(kind="linear", decay_steps=2, min_lr_factor=0.5)
    assert [lin.factor(s, 5) for s in range(4)] == [1.0, 0.75, 0.5, 0.5]
    # a constant schedule stays at 1 past the run (its phases have no decay)
    assert Schedule(warmup_steps=1).factor(5, 3) == 1.0
    assert Schedule(warmup_steps=4).factor(3, 10) == 0.8


def test_lr_schedule_lr_is_the_base_times_the_factor() -> None:
    """``lr`` multiplies (not adds, not divides) the base rate by the factor."""
    s = Schedule(kind="linear")
    assert s.lr(1, 0.5, 4) == 0.5 * 0.75
    assert s.lr(0, 3.0, 4) == 3.0


def test_lr_schedule_describe_texts() -> None:
    """The one line a run prints: each phase named, zeros left out, the floor with :g."""
    assert Schedule().describe(10) == "constant"
    assert Schedule(warmup_steps=3).describe(10) == "constant: warmup 3"
    assert Schedule(kind="cosine", warmup_steps=10, min_lr_factor=0.1).describe(100) == \
        "cosine: warmup 10, decay 90 steps to 0.1x"
    assert Schedule(kind="linear").describe(5) == "linear: decay 5 steps to 0x"
    assert Schedule(kind="wsd", warmup_steps=2, decay_steps=3, min_lr_factor=0.25).describe(10) == \
        "wsd: warmup 2, stable 5, decay 3 steps to 0.25x"
    assert Schedule(kind="wsd", decay_steps=3).describe(10) == "wsd: stable 7, decay 3 steps to 0x"


def test_lr_schedule_schedule_of_and_json() -> None:
    """A Schedule as is, None as the constant one, a kind name, a dict; the JSON a run carries (None for none)."""
    s = Schedule(kind="cosine", warmup_steps=2)
    assert schedule_of(s) is s
    assert schedule_of(None) == Schedule()
    assert schedule_of("wsd") == Schedule(kind="wsd")
    assert schedule_of({"kind": "linear", "decay_steps": 4}) == Schedule(kind="linear", decay_steps=4)
    with pytest.raises(ValidationError, match="kind"):
        schedule_of("step")
    assert schedule_json(None) is None
    assert schedule_json("cosine") == {"kind": "cosine", "warmup_steps": 0, "decay_steps": None,
                                       "stable_steps": None, "min_lr_factor": 0.0}
    assert schedule_json(Schedule()) == {"kind": "constant", "warmup_steps": 0, "decay_steps": None,
                                         "stable_steps": None, "min_lr_factor": 0.0}
