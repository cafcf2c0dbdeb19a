"""The plan editor's working copy of a strategy, and its validation in plain words.

A :class:`Draft` is a mutable, possibly invalid strategy (a stage may have no devices yet, layer ranges may not
meet).  :func:`check_draft` turns it into a :class:`~hspmd_sdk.core.strategy.Strategy` with the core's own
checks (:meth:`Strategy.load`, :meth:`Strategy.problems`) and reports every problem as a :class:`Problem`
located at a pipeline, a stage or a tensor, so that the editor shows it where it belongs.
"""
from __future__ import annotations

import copy
import re
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..core.strategy import Strategy, parallel_text
from ..errors import PlanValidationError
from ._tp_grid import cp_divisors

if TYPE_CHECKING:
    from ..core.cluster import Cluster

__all__ = ["StageDraft", "PipelineDraft", "Draft", "Problem", "check_draft", "locate"]


@dataclass
class StageDraft:
    """A stage being edited: its ranks (TP group), inclusive layer range, and its uneven TP ratios if any (one per
    rank; a stage whose devices change keeps them, and the check names a count that no longer matches)."""

    devices: list[int]
    layers: list[int]
    recompute: bool = False
    ratios: list[int] | None = None
    cp: int = 1  #: context-parallel groups (SPEC §11): ``devices`` form ``cp`` groups of TP ranks

    @property
    def parallel_text(self) -> str:
        """``TP2``, ``CP2`` or ``CP2×TP2`` (``cp 0?`` for a cp below 1, an error the check names)."""
        if self.cp < 1:
            return f"cp {self.cp}?"
        return parallel_text(len(self.devices), self.cp)

    @property
    def tp(self) -> int | None:
        """TP ranks per context-parallel group, or ``None`` when ``cp`` does not divide the devices."""
        n = len(self.devices)
        return n // self.cp if self.cp >= 1 and n % self.cp == 0 else None


@dataclass
class PipelineDraft:
    """A pipeline being edited: stages, micro-batch size and count."""

    stages: list[StageDraft]
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    zero_share: float | None = None  #: this pipeline's share of the ZeRO-sharded state (SPEC §15; None: even)


@dataclass
class Draft:
    """A strategy being edited (possibly invalid)."""

    pipelines: list[PipelineDraft] = field(default_factory=list)
    schedule: str = "1f1b"
    zero1: bool = False
    name: str | None = None
    zero: int = 0  #: the ZeRO level (SPEC §15); ``zero1`` is ``zero >= 1``

    @classmethod
    def from_strategy(cls, strategy: "Strategy") -> "Draft":
        return cls([PipelineDraft([StageDraft(list(s.devices), list(s.layers), s.recompute,
                                              list(s.ratios) if s.ratios is not None else None, s.cp)
                                   for s in p.stages],
                                  p.micro_batch_size, p.num_micro_batches, p.zero_share) for p in strategy.pipelines],
                   strategy.schedule, strategy.zero1, strategy.name, strategy.zero)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form :meth:`Strategy.load` reads (``ratios`` and ``cp`` only where a stage has them, a
        pipeline's ``zero_share`` where it has one, ``zero`` from level 2: levels 0 and 1 are ``zero1``)."""
        out = asdict(self)
        if out["zero"] <= 1 or not out["zero1"]:
            del out["zero"]
        for p in out["pipelines"]:
            if p["zero_share"] is None:
                del p["zero_share"]
            for st in p["stages"]:
                if st["ratios"] is None:
                    del st["ratios"]
                if st["cp"] == 1:
                    del st["cp"]
        return out

    def copy(self) -> "Draft":
        return copy.deepcopy(self)

    def owner(self, rank: int) -> tuple[int, int] | None:
        """``(pipeline, stage)`` whose devices include ``rank``, or ``None``."""
        for i, p in enumerate(self.pipelines):
            for j, s in enumerate(p.stages):
                if rank in s.devices:
                    return i, j
        return None

    def stage(self, p: int, s: int) -> StageDraft:
        if not 0 <= p < len(self.pipelines):
            raise IndexError(f"there is no pipeline {p} (pipelines 0..{len(self.pipelines) - 1})")
        stages = self.pipelines[p].stages
        if not 0 <= s < len(stages):
            raise IndexError(f"pipeline {p} has no stage {s} (stages 0..{len(stages) - 1})")
        return stages[s]


@dataclass(frozen=True)
class Problem:
    """One problem, in plain words, with where it belongs: ``pipeline``/``stage`` indices or a ``tensor``.

    ``level`` is ``"error"`` (the plan cannot be used) or ``"warning"`` (e.g. a device would run out of memory).
    """

    path: str
    message: str
    pipeline: int | None = None
    stage: int | None = None
    tensor: str | None = None
    level: str = "error"

    @property
    def where(self) -> str:
        if self.tensor:
            return f"tensor {self.tensor}"
        if self.stage is not None:
            return f"pipeline {self.pipeline} · stage {self.stage}"
        if self.pipeline is not None:
            return f"pipeline {self.pipeline}"
        return "strategy"

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


_PATH = re.compile(r"pipelines\[(\d+)\](?:\.stages\[(\d+)\])?")
_TENSOR = re.compile(r"tensor '([^']+)'")
_PYDANTIC_WORDS = {"List should have at least 1 item after validation, not 0": "is empty"}
#: Pydantic's words for a field of a stage, in the editor's: ``(field, message) -> words``.
_FIELD_WORDS = {("cp", "Input should be greater than or equal to 1"):
                "cp must be at least 1 (the number of context-parallel groups the stage's devices form; 1: none)"}


def locate(path: str, message: str, level: str = "error") -> Problem:
    """A :class:`Problem` for a core ``(field path, reason)`` pair (or an error message naming a tensor).  A path
    that names a stage places it at the stage even when the reason names a tensor (a stage's ratios that cut a
    tensor's heads are the stage's to fix); else a tensor named in the reason places it at the tensor."""
    m = _PATH.search(path)
    at_stage = m is not None and m[2] is not None
    t = None if at_stage else _TENSOR.search(message)
    msg = _FIELD_WORDS.get((path.rsplit(".", 1)[-1], message)) or _PYDANTIC_WORDS.get(message, message)
    return Problem(path, msg, int(m[1]) if m else None, int(m[2]) if at_stage else None, t[1] if t else None, level)


def _draft_problems(draft: Draft) -> list[Problem]:
    """What the core would reject with less helpful words: no pipelines, a stage without devices."""
    out: list[Problem] = []
    if not draft.pipelines:
        out.append(Problem("pipelines", "there are no pipelines; add one"))
    for i, p in enumerate(draft.pipelines):
        if not p.stages:
            out.append(Problem(f"pipelines[{i}].stages", "this pipeline has no stages; add one", i))
        for j, s in enumerate(p.stages):
            if not s.devices:
                out.append(Problem(f"pipelines[{i}].stages[{j}].devices",
                                   "no devices yet: drag device tiles onto this stage (or select it, then "
                                   "Alt+click tiles)", i, j))
    return out


def check_draft(draft: Draft, model: Any = None, cluster: "Cluster | None" = None,
                global_batch: int | None = None) -> tuple["Strategy | None", list[Problem]]:
    """The :class:`Strategy` of ``draft`` and ``[]``, or ``None`` and every problem found (core checks)."""
    early = _draft_problems(draft)
    if early:
        return None, early
    try:
        strategy = Strategy.load(draft.to_dict())
    except PlanValidationError as e:
        return None, [_cp_choices(locate(p, r), draft) for p, r in e.problems]
    found = strategy.problems(model, cluster, global_batch)
    if found:
        return None, [locate(p, r) for p, r in found]
    return strategy, []


def _cp_choices(p: Problem, draft: Draft) -> Problem:
    """A stage's cp problem with the values it can take (the divisors of its device count)."""
    if not p.path.endswith(".cp") or p.stage is None:
        return p
    n = len(draft.stage(p.pipeline, p.stage).devices)
    options = cp_divisors(n)
    words = ", ".join(map(str, options[:-1])) + (" or " if len(options) > 1 else "") + str(options[-1])
    return replace(p, message=f"{p.message}; its {n} device{'s' if n != 1 else ''} can take cp {words}")
