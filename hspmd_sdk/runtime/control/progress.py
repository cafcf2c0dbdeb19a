"""A small progress display for jobs: an ipywidgets bar in a notebook, one updating stderr line in a terminal, and
plain lines (no carriage returns) when stderr is a pipe or a file.

:func:`step_rates` is the one computation of a job's pace (seconds a step, tokens/s) that every display shows: this
progress line and the dashboard (:mod:`hspmd_sdk.viz._job`) alike."""
from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import IO, Any, Iterable, Protocol

#: Steps a job's pace (seconds a step, tokens/s, ETA) is measured over: the newest ones.
RATE_STEPS = 5


def step_tokens(controller: Any) -> float | None:
    """The tokens of one step of a training job: its global batch times its sequence length; ``None`` when the
    job says none (another entry) or its steps differ (mixed-length data)."""
    batch, seq = getattr(controller, "global_batch", None), getattr(controller, "seq_len", None)
    if batch and seq and not getattr(controller, "mixed", False):
        return float(batch) * float(seq)
    return None


def step_rates(metrics: Any, ranks: Iterable[int], tokens_per_step: float | None = None
               ) -> tuple[float | None, float | None]:
    """``(seconds a step takes, tokens/s)`` of a job now: the median, over the newest :data:`RATE_STEPS` steps, of
    each step's slowest rank among ``ranks`` (the ranks still in the job); tokens/s is ``tokens_per_step`` (the whole
    step's, :func:`step_tokens`) over it, else (no such figure) the median of what the lowest rank reporting losses
    measured itself.  ``metrics``: a :class:`~hspmd_sdk.runtime.metrics.MetricsHistory` (``rank(r)``)."""
    ranks = list(ranks)
    per_step: dict[int, float] = {}
    tokens_loss: list[float] = []
    loss_rank = min((r for r in ranks if any(m.loss is not None for m in metrics.rank(r)[-3 * RATE_STEPS:])),
                    default=None)
    for r in ranks:
        for m in metrics.rank(r)[-3 * RATE_STEPS:]:  # the newest reports suffice (a long job has many)
            if m.step_time is not None:
                per_step[m.step] = max(per_step.get(m.step, 0.0), float(m.step_time))
            if r == loss_rank and m.tokens_per_s:
                tokens_loss.append(float(m.tokens_per_s))
    newest = [per_step[s] for s in sorted(per_step)[-RATE_STEPS:]]
    if not newest:
        return None, None
    step_s = statistics.median(newest)
    if tokens_per_step and step_s > 0:
        return step_s, tokens_per_step / step_s
    return step_s, statistics.median(tokens_loss[-RATE_STEPS:]) if tokens_loss else None


def format_rate(tokens_per_s: float) -> str:
    """``985 tok/s``, ``12.3k tok/s``, ``1.23M tok/s`` (as the dashboard writes it)."""
    t = tokens_per_s
    return f"{t / 1e6:.2f}M tok/s" if t >= 1e6 else f"{t / 1e3:.1f}k tok/s" if t >= 1e3 else f"{t:.0f} tok/s"


class Progress(Protocol):
    def update(self, done: int, text: str = "") -> None: ...

    def note(self, text: str) -> None: ...

    def close(self, status: str = "done") -> None: ...


def in_notebook() -> bool:
    """Whether we run inside an IPython kernel (Jupyter), where widgets can be shown."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None) if ipython else None
    shell = get() if get else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def make_progress(total: int, title: str = "") -> Progress:
    """A notebook bar if we are in a kernel and ipywidgets imports, else a terminal line on stderr."""
    if in_notebook():
        try:
            return WidgetProgress(total, title)
        except ImportError:
            pass
    return LineProgress(total, title)


class LineProgress:
    """``title [#####.....] 5/10 text`` rewritten in place on ``stream`` (at most 10 times a second) when it is a
    terminal; otherwise (a pipe, a log file) one plain line per update, at most one a second, so that a log reads
    line by line instead of piling every update onto one.  ``tty``: force either behaviour."""

    def __init__(self, total: int, title: str = "", stream: IO[str] | None = None, width: int = 24,
                 tty: bool | None = None) -> None:
        self.total, self.title, self.width = max(total, 1), title, width
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.tty = tty
        self._every = 0.1 if tty else 1.0
        self._last = 0.0
        self._len = 0
        self._lock = threading.Lock()
        self._state = (0, "")

    def render(self, done: int, text: str) -> str:
        filled = int(self.width * min(done, self.total) / self.total)
        return f"{self.title} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {text}".strip()

    def update(self, done: int, text: str = "") -> None:
        with self._lock:
            self._state = (done, text)
            now = time.monotonic()
            if now - self._last >= self._every or done >= self.total:
                self._last = now
                self._write(self.render(done, text))

    def note(self, text: str) -> None:
        """A line of its own above the bar (a reconfiguration, as it happens)."""
        with self._lock:
            self._write(text)
            if self.tty:
                self.stream.write("\n")
                self._len = 0
                self._write(self.render(*self._state))

    def close(self, status: str = "done") -> None:
        with self._lock:
            done, text = self._state
            self._write(self.render(done, f"{text} [{status}]".strip()))
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()

    def _write(self, line: str) -> None:
        if not self.tty:
            self.stream.write(line + "\n")
            self.stream.flush()
            return
        pad = " " * max(0, self._len - len(line))
        self.stream.write("\r" + line + pad)
        self.stream.flush()
        self._len = len(line)


class WidgetProgress:
    """An ``ipywidgets.IntProgress`` and a label, displayed in the current cell."""

    def __init__(self, total: int, title: str = "") -> None:
        import ipywidgets as w  # lazy: only in a kernel
        from IPython.display import display

        self.bar = w.IntProgress(value=0, min=0, max=max(total, 1), description=title[:20])
        self.label = w.Label(value=f"0/{total}")
        self.notes = w.HTML(value="")
        self.total = total
        display(w.VBox([w.HBox([self.bar, self.label]), self.notes]))

    def note(self, text: str) -> None:
        import html

        self.notes.value += f"<div>{html.escape(text)}</div>"

    def update(self, done: int, text: str = "") -> None:
        self.bar.value = min(done, self.bar.max)
        self.label.value = f"{done}/{self.total} {text}".strip()

    def close(self, status: str = "done") -> None:
        self.bar.bar_style = {"succeeded": "success", "stopped": "info", "failed": "danger",
                              "cancelled": "warning"}.get(status.split(" ", 1)[0], "")  # "stopped at step N"
        self.label.value = f"{self.label.value} [{status}]"
