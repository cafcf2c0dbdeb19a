"""A small progress display for jobs: an ipywidgets bar in a notebook, one updating stderr line in a terminal, and
plain lines (no carriage returns) when stderr is a pipe or a file."""
from __future__ import annotations

import sys
import threading
import time
from typing import IO, Protocol


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
        self.bar.bar_style = {"succeeded": "success", "failed": "danger", "cancelled": "warning"}.get(status, "")
        self.label.value = f"{self.label.value} [{status}]"
