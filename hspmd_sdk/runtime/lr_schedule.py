"""Learning-rate schedules (SPEC §13): the multiplier of the base learning rate at each step of a run.

A :class:`Schedule` is a small typed value (the ``[schedule]`` section of a
:class:`~hspmd_sdk.runtime.train_config.TrainConfig`).  The learning rate of the 0-based step ``s`` of a run of ``T``
steps is ``base_lr * schedule.factor(s, T)``: a pure function of ``s``, ``T`` and the schedule's fields, so a run
that switches plans, recovers from a failure or resumes from a checkpoint continues on the same curve (nothing is
counted or stored beside the step).

The formulas (``W`` = ``warmup_steps``, ``S`` = the stable steps, ``D`` = the decay steps, ``m`` =
``min_lr_factor``):

* warmup, ``0 <= s < W``: ``f(s) = (s + 1) / (W + 1)`` — linear from ``1/(W+1)`` (step 0 never trains at lr 0)
  towards 1 (nanoGPT's and torchtitan's warmup);
* stable, ``W <= s < W + S``: ``f(s) = 1``;
* decay, ``W + S <= s < W + S + D``, with the progress ``p = (s - W - S) / D`` (0 at the decay's first step):
  ``linear`` and ``wsd``: ``f(s) = m + (1 - m) * (1 - p)``; ``cosine``: ``f(s) = m + (1 - m) * (1 + cos(pi * p)) / 2``;
* after, ``s >= W + S + D``: ``f(s) = m``.

So ``f`` follows the knots ``(-1, 0)``, ``(W, 1)``, ``(W + S, 1)``, ``(W + S + D, m)``: the first step after the
warmup is at the peak, and with the default decay (to the end of the run, ``W + S + D = T``) the run's last step is
one decay step above ``m`` (it still trains when ``m = 0``); ``m`` is reached at step ``T``, the first step after
the run.  Consecutive steps differ by at most one step of the steeper phase: ``1/(W+1)`` in the warmup,
``(1 - m)/D`` in a linear decay, ``pi (1 - m) / (2 D)`` in a cosine one.

The phases of each kind (``T`` = ``total_steps``):

* ``constant``: the warmup, then 1 to the end (no stable or decay phase: ``decay_steps``, ``stable_steps`` and
  ``min_lr_factor`` are refused);
* ``linear`` / ``cosine``: the warmup, then the decay at once (``S = 0``) over ``D = decay_steps``, or when it is
  ``None`` over the rest of the run, ``D = max(T - W, 1)``; ``stable_steps`` is refused;
* ``wsd`` (warmup-stable-decay, decaying linearly as torchtitan's default): ``stable_steps`` and ``decay_steps`` both
  given: those; only ``decay_steps``: the decay is the run's last ``D`` steps, ``S = max(T - W - D, 0)``; only
  ``stable_steps``: the decay takes the rest of the run, ``D = max(T - W - S, 1)``; neither: no stable phase and the
  decay takes the rest of the run (``S = 0``, ``D = max(T - W, 1)``; torchtitan without a ``decay_ratio``).

The factor lies in ``(0, 1]`` during the warmup and in ``[m, 1]`` after it.  Pure Python: no torch.
"""
from __future__ import annotations

import math
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import PlanValidationError
from .config_types import Int, Number

__all__ = ["Schedule", "Phases", "KINDS", "schedule_of", "schedule_json"]

#: The schedule kinds.
KINDS = ("constant", "linear", "cosine", "wsd")


class Phases(NamedTuple):
    """A schedule's phases over one run, in steps: ``warmup``, then ``stable`` steps at the peak, then ``decay``
    steps down to ``min_lr_factor`` (``constant``: ``stable`` is the rest of the run and ``decay`` is 0)."""

    warmup: int
    stable: int
    decay: int


class Schedule(BaseModel):
    """A learning-rate schedule: the multiplier :meth:`factor` of the base learning rate at each step (the
    formulas are in the module docstring).  ``Schedule()`` is the constant learning rate.

    >>> s = Schedule(kind="cosine", warmup_steps=2, min_lr_factor=0.1)
    >>> [round(s.factor(step, 6), 4) for step in range(6)]
    [0.3333, 0.6667, 1.0, 0.8682, 0.55, 0.2318]
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal[KINDS] = Field(default="constant", title="the shape of the curve after the warmup",
                                 description=" or ".join(map(repr, KINDS)))
    warmup_steps: Int = Field(default=0, ge=0, title="steps of linear warmup: step s < W at (s+1)/(W+1)",
                              description="a whole number of steps >= 0")
    decay_steps: Int | None = Field(default=None, ge=1, title="steps of the decay to min_lr_factor (None: to the end "
                                                              "of the run); not for 'constant'",
                                    description="a whole number of steps >= 1, or None (to the end of the run)")
    stable_steps: Int | None = Field(default=None, ge=0, title="wsd only: steps at the peak between the warmup and "
                                                               "the decay (None: what decay_steps leaves)",
                                     description="a whole number of steps >= 0, or None (what the run's other "
                                                 "phases leave)")
    min_lr_factor: Number = Field(default=0.0, ge=0, le=1, title="the factor the decay ends at (a fraction of the "
                                                                 "base lr); not for 'constant'",
                                  description="a finite number in [0, 1]")

    @model_validator(mode="after")
    def _fields_of_the_kind(self) -> "Schedule":
        """Each field only where the kind uses it: a constant schedule has no decay, only WSD a stable phase."""
        if self.kind == "constant":
            for name in ("decay_steps", "stable_steps"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: a 'constant' schedule has no decay; leave {name} out or choose "
                                     "kind 'linear', 'cosine' or 'wsd'")
            if self.min_lr_factor != 0.0:
                raise ValueError("min_lr_factor: a 'constant' schedule never decays to it; leave it out or choose "
                                 "kind 'linear', 'cosine' or 'wsd'")
        elif self.kind != "wsd" and self.stable_steps is not None:
            raise ValueError(f"stable_steps: only a 'wsd' schedule has a stable phase, not {self.kind!r}; leave "
                             "it out or choose kind 'wsd'")
        return self

    # ---- the curve -----------------------------------------------------------------------------------------
    def phases(self, total_steps: int) -> Phases:
        """The warmup, stable and decay steps of a run of ``total_steps`` steps (the rules in the module
        docstring)."""
        _check_steps(0, total_steps)
        w, t = self.warmup_steps, total_steps
        if self.kind == "constant":
            return Phases(w, max(t - w, 0), 0)
        if self.kind != "wsd":
            return Phases(w, 0, self.decay_steps if self.decay_steps is not None else max(t - w, 1))
        stable, decay = self.stable_steps, self.decay_steps
        if stable is None and decay is None:
            return Phases(w, 0, max(t - w, 1))
        if stable is None:
            return Phases(w, max(t - w - decay, 0), decay)
        return Phases(w, stable, decay if decay is not None else max(t - w - stable, 1))

    def factor(self, step: int, total_steps: int) -> float:
        """The multiplier of the base learning rate at the 0-based ``step`` of a run of ``total_steps`` steps
        (``step`` may lie past the run: the curve goes on as the formulas say)."""
        _check_steps(step, total_steps)
        w = self.warmup_steps
        if step < w:
            return (step + 1) / (w + 1)
        if self.kind == "constant":
            return 1.0
        _, stable, decay = self.phases(total_steps)
        into = step - w - stable
        if into < 0:
            return 1.0
        if into >= decay:
            return self.min_lr_factor
        p = into / decay
        shape = (1.0 + math.cos(math.pi * p)) / 2.0 if self.kind == "cosine" else 1.0 - p
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * shape

    def lr(self, step: int, base_lr: float, total_steps: int) -> float:
        """The learning rate of the 0-based ``step`` of a run of ``total_steps`` steps: ``base_lr *
        factor(step, total_steps)``."""
        return base_lr * self.factor(step, total_steps)

    def describe(self, total_steps: int) -> str:
        """One line saying what the schedule does over a run of ``total_steps`` steps, e.g. ``cosine: warmup 10,
        decay 90 steps to 0.1x``."""
        w, stable, decay = self.phases(total_steps)
        parts = [f"warmup {w}"] if w else []
        if self.kind == "constant":
            return "constant" + (f": warmup {w}" if w else "")
        if stable:
            parts.append(f"stable {stable}")
        parts.append(f"decay {decay} steps to {self.min_lr_factor:g}x")
        return f"{self.kind}: " + ", ".join(parts)


def _check_steps(step: int, total_steps: int) -> None:
    """``step`` a whole number >= 0 and ``total_steps`` one >= 1, else a PlanValidationError naming them."""
    problems = []
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        problems.append(("step", f"must be a whole number >= 0 (a 0-based step), not {step!r}"))
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        problems.append(("total_steps", f"must be a whole number of steps >= 1, not {total_steps!r}"))
    if problems:
        raise PlanValidationError(problems, what="learning-rate schedule query")


def schedule_of(value: "Schedule | dict | str | None") -> Schedule:
    """A run's ``schedule=`` as a :class:`Schedule`: a Schedule, its dict, its ``kind`` name, or ``None`` (the
    constant learning rate).  A bad one raises pydantic's ``ValidationError`` naming the field."""
    if isinstance(value, Schedule):
        return value
    if value is None:
        return Schedule()
    return Schedule.model_validate({"kind": value} if isinstance(value, str) else value)


def schedule_json(value: "Schedule | dict | str | None") -> dict | None:
    """``schedule=`` as a run carries it to the workers: the :class:`Schedule`'s dict, ``None`` for none given."""
    return None if value is None else schedule_of(value).model_dump(mode="json")

