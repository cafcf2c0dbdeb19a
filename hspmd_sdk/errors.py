"""The package's exception hierarchy.

Every error says *what* went wrong, *where* (field path, tensor name, rank) and, when there is one, what to do.

``PlanValidationError`` is what every loader raises for bad input.  It wraps pydantic's ``ValidationError`` so
that users catch one type, and it keeps each problem as ``(path, reason)`` so editors can show the error at the
place it concerns.
"""
from __future__ import annotations

import re
from typing import Any, Iterable

_HEAD = re.compile(r"^(?P<head>[A-Za-z_]\w*(?:\[\d+\]|\.[A-Za-z_]\w*)*): (?P<rest>.*)$", re.S)


#: The line under an SDK error in a notebook, saying where its traceback is.
TRACEBACK_HINT = "(an hspmd_sdk error: its message says what to fix; %tb in a cell shows the full traceback)"


class HSPMDError(Exception):
    """Base class of every error raised by hspmd_sdk.

    In IPython and Jupyter (``_render_traceback_``, the hook IPython asks an exception for the lines to show) an SDK
    error shows as its message, since that says what, where and what to do, with one line saying how to see the
    full traceback: ``%tb`` (which shows it in full, as does any later rendering of the same error)."""

    def _render_traceback_(self) -> list[str]:
        if getattr(self, "_hspmd_shown", False):  # asked again (%tb, the history): the full traceback
            return _full_traceback(self)
        self._hspmd_shown = True
        return [f"{type(self).__name__}: {self}", TRACEBACK_HINT]


def _full_traceback(err: BaseException) -> list[str]:
    """The traceback IPython would have shown (its own formatter, colours and all), else Python's."""
    try:
        from IPython import get_ipython  # lazy: only ever called from IPython

        shell = get_ipython()
        if shell is not None:
            return list(shell.InteractiveTB.structured_traceback(type(err), err, err.__traceback__))
    except Exception:  # noqa: BLE001 - no formatter: Python's own below
        pass
    import traceback

    return traceback.format_exception(type(err), err, err.__traceback__)


class PlanValidationError(HSPMDError, ValueError):
    """A strategy, plan, annotation or cluster is invalid.

    ``problems`` is a list of ``(path, reason)``; ``str(err)`` renders one problem a line as ``path: reason``.
    """

    def __init__(self, problems: Iterable[tuple[str, str]], *, what: str = "input") -> None:
        self.problems: list[tuple[str, str]] = [(p or "<root>", r) for p, r in problems]
        self.what = what
        lines = [f"{p}: {r}" for p, r in self.problems]
        super().__init__(f"invalid {what}:\n  " + "\n  ".join(lines) if len(lines) > 1
                         else f"invalid {what}: {lines[0]}" if lines else f"invalid {what}")

    @classmethod
    def from_pydantic(cls, err: Any, *, what: str = "input", prefix: str = "") -> "PlanValidationError":
        """Convert a ``pydantic.ValidationError`` into this error with dotted/indexed field paths."""
        problems = []
        for e in err.errors(include_url=False):
            path = format_path(e.get("loc", ()))
            if prefix:
                path = f"{prefix}.{path}" if path and not path.startswith("[") else f"{prefix}{path}"
            msg = str(e.get("msg", "invalid"))
            for head in ("Value error, ", "Assertion failed, "):
                if msg.startswith(head):
                    msg = msg[len(head):]
            m = _HEAD.match(msg)
            if m:  # a model-level check that names the field path below it: move it into the path
                head = m["head"]
                path = head if not path else f"{path}{head}" if head.startswith("[") else f"{path}.{head}"
                msg = m["rest"]
            problems.append((path, msg))
        return cls(problems, what=what)


class ResolutionError(HSPMDError):
    """A Reshard between two annotations cannot be resolved into communication."""


class SpecializationError(HSPMDError):
    """Graph specialization failed (deduction mismatch, missing annotation, shape constraint)."""


class ShapeError(HSPMDError, ValueError):
    """A tensor shape does not fit an annotation (e.g. a split that does not divide a dimension)."""


class SwitchError(HSPMDError):
    """A switch (or a grow) of a running job cannot be done: another model, ranks that are not running, a
    reconfiguration under way, a cluster that is not the running one plus new ranks."""


class RuntimeFailure(HSPMDError, RuntimeError):
    """A worker failed; ``rank`` and ``traceback`` tell which and why."""

    def __init__(self, message: str, *, rank: int | None = None, traceback: str = "") -> None:
        self.rank = rank
        self.traceback = traceback
        super().__init__(message)


def format_path(loc: Iterable[Any]) -> str:
    """``("pipelines", 1, "stages", 2, "devices")`` -> ``pipelines[1].stages[2].devices``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("function-", "json-or-python", "lax-or-strict", "tagged-union")):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out
