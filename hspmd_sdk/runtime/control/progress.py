"""A small progress display for jobs: an ipywidgets bar in a notebook, one updating stderr line in a terminal, and
plain lines (no carriage returns) when stderr is a pipe or a file.

:func:`step_rates` is the one computation of a job's pace (seconds a step, tokens/s) that every display shows: this
progress line and the dashboard (:mod:`hspmd_sdk.viz._job`) alike."""
from __future__ import annotations

import statistics
import sys
import threading
import time
import weakref
from typing import IO, TYPE_CHECKING, Any, Iterable, Protocol

if TYPE_CHECKING:
    from ..metrics import MetricsHistory

#: Steps a job's pace (seconds a step, tokens/s, ETA) is measured over: the newest ones.
RATE_STEPS = 5
#: How often a display that has not changed checks whether to say for how long (it says so once a second).
TICK_S = 0.25


def step_tokens(controller: Any) -> float | None:
    """The tokens of one step of a training job: its global batch times its sequence length; ``None`` when the
    job says none (another entry) or its steps differ (mixed-length data)."""
    batch, seq = getattr(controller, "global_batch", None), getattr(controller, "seq_len", None)
    if batch and seq and not getattr(controller, "mixed", False):
        return float(batch) * float(seq)
    return None


def step_rates(metrics: "MetricsHistory", ranks: Iterable[int], tokens_per_step: float | None = None
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
                 tty: bool | None = None, tick_s: float | None = TICK_S) -> None:
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
        self._changed = time.monotonic()
        self._drawn: tuple[int, str] | None = None
        self._drawn_quiet = 0
        self._closed = False
        self._ticker = Ticker(self, tick_s) if tty and tick_s else None

    def render(self, done: int, text: str) -> str:
        filled = int(self.width * min(done, self.total) / self.total)
        return f"{self.title} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {text}".strip()

    def update(self, done: int, text: str = "") -> None:
        if self._ticker is not None:
            self._ticker.start()
        with self._lock:
            now = time.monotonic()
            if (done, text) != self._state:
                self._state, self._changed = (done, text), now
            elif self.tty and now - self._changed >= 1:
                return  # unchanged for a second: the ticker's line (with its seconds) stays
            if now - self._last >= self._every or done >= self.total:
                self._last, self._drawn, self._drawn_quiet = now, self._state, 0
                self._write(self.render(done, text))

    def tick(self) -> None:
        """Redraw the line with how long it has not changed (``... processes 0/4 · 3 s``): a terminal user sees
        that the job is alive while a phase or a step takes longer than a second (:class:`Ticker` calls it).
        An update the rate limit held back is drawn here too."""
        with self._lock:
            now = time.monotonic()
            quiet = int(now - self._changed)
            if self._closed or (quiet == self._drawn_quiet and self._drawn == self._state) or \
                    now - self._last < self._every:
                return
            self._last, self._drawn, self._drawn_quiet = now, self._state, quiet
            self._write(self.render(*self._state) + (f" · {quiet} s" if quiet >= 1 else ""))

    def note(self, text: str) -> None:
        """A line of its own above the bar (a reconfiguration, as it happens)."""
        with self._lock:
            self._write(text)
            if self.tty:
                self.stream.write("\n")
                self._len = 0
                self._write(self.render(*self._state))

    def close(self, status: str = "done") -> None:
        if self._ticker is not None:
            self._ticker.stop()
        with self._lock:
            self._closed = True
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


class Ticker:
    """Calls ``display.tick()`` every ``period_s`` seconds from a daemon thread, from :meth:`start` until
    :meth:`stop` (or until the display is garbage: the thread holds it only weakly), so that a display whose
    state has not changed for a while still says so instead of falling silent."""

    def __init__(self, display: Any, period_s: float) -> None:
        self._display = weakref.ref(display)
        self.period_s = period_s
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None and not self._stopped.is_set():
                self._thread = threading.Thread(target=self._run, name="progress-ticker", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.period_s):
            display = self._display()
            if display is None:
                return
            try:
                display.tick()
            except Exception:  # noqa: BLE001 - a closed terminal or kernel must not raise in a daemon thread
                return
            del display


class Phase:
    """A phase the user waits through, said as it starts and counted while it lasts: on a terminal its line
    (``computing the reference ... 3 s``) counts the seconds in place; in a notebook a display of the same text
    does; piped, one line as it starts.  Each ends with ``... done in 2.4 s`` (``... failed after 2.4 s`` when its
    ``with`` block raises).

    ``with Phase("computing the reference"): ...``, or ``wait = Phase("profiling").start()`` and later
    ``wait.next("planning")`` (the first ends, the second starts) and ``wait.stop()``; in a notebook a phase
    still running when its cell ends stops there."""

    def __init__(self, text: str, stream: IO[str] | None = None, tick_s: float | None = TICK_S,
                 tty: bool | None = None) -> None:
        self.text = text
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.tty, self.notebook = tty, not tty and in_notebook()
        self.tick_s = tick_s
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._handle: Any = None
        self._shown = ""
        self._ticker: Ticker | None = None
        self._running = False

    def start(self) -> "Phase":
        with self._lock:
            self._t0, self._running = time.monotonic(), True
            if self.notebook:
                from IPython import get_ipython  # lazy: only in a kernel
                from IPython.display import display

                self._handle = display({"text/plain": f"{self.text} ..."}, raw=True, display_id=True)
                shell = get_ipython()
                if shell is not None:
                    shell.events.register("post_run_cell", self._cell_ended)
            else:
                self._show(f"{self.text} ...", end="" if self.tty else "\n")
            if self.tick_s and (self.tty or self.notebook):
                self._ticker = Ticker(self, self.tick_s)
                self._ticker.start()
        return self

    def next(self, text: str) -> "Phase":
        """End this phase (``... done in``) and start the next one, ``text``, on a line of its own."""
        self.stop()
        self.text = text
        return self.start()

    def tick(self) -> None:
        with self._lock:
            took = int(time.monotonic() - self._t0)
            if self._running and took >= 1:
                self._show(f"{self.text} ... {took} s")

    def stop(self, failed: bool = False) -> None:
        with self._lock:
            if not self._running:
                return
            self._running = False
            if self._ticker is not None:
                self._ticker.stop()
                self._ticker = None
            took = time.monotonic() - self._t0
            self._show(f"{self.text} ... {'failed after' if failed else 'done in'} {took:.1f} s", end="\n")
            self._handle = None

    def _cell_ended(self, *_: Any) -> None:
        from IPython import get_ipython

        self.stop()
        shell = get_ipython()
        if shell is not None and self._cell_ended in shell.events.callbacks["post_run_cell"]:
            shell.events.unregister("post_run_cell", self._cell_ended)

    def __enter__(self) -> "Phase":
        return self.start()

    def __exit__(self, kind: Any, *_: Any) -> None:
        self.stop(failed=kind is not None)

    def _show(self, line: str, end: str = "") -> None:
        if line == self._shown and not end:
            return  # nothing new to say (the ticker runs faster than the seconds change)
        self._shown = line
        if self._handle is not None:
            self._handle.update({"text/plain": line}, raw=True)
        elif self.tty:
            self.stream.write("\r" + line + end)
            self.stream.flush()
        elif end:
            self.stream.write(line + end)
            self.stream.flush()


class WidgetProgress:
    """An ``ipywidgets.IntProgress`` and a label, displayed in the current cell; while the label has not changed
    for a second or more it says for how long (``... processes 0/4 · 3 s``, every ``tick_s``)."""

    def __init__(self, total: int, title: str = "", tick_s: float | None = TICK_S) -> None:
        import ipywidgets as w  # lazy: only in a kernel
        from IPython.display import display

        self.bar = w.IntProgress(value=0, min=0, max=max(total, 1), description=title[:20])
        self.label = w.Label(value=f"0/{total}")
        self.notes = w.HTML(value="")
        self.total = total
        self._text, self._changed, self._closed = self.label.value, time.monotonic(), False
        self._lock = threading.Lock()
        self._ticker = Ticker(self, tick_s) if tick_s else None
        display(w.VBox([w.HBox([self.bar, self.label]), self.notes]))
        if self._ticker is not None:
            self._ticker.start()

    def tick(self) -> None:
        with self._lock:
            quiet = int(time.monotonic() - self._changed)
            if quiet >= 1 and not self._closed:
                self.label.value = f"{self._text} · {quiet} s"

    def note(self, text: str) -> None:
        import html

        self.notes.value += f"<div>{html.escape(text)}</div>"

    def update(self, done: int, text: str = "") -> None:
        self.bar.value = min(done, self.bar.max)
        label = f"{done}/{self.total} {text}".strip()
        with self._lock:
            if label != self._text:
                self._text, self._changed = label, time.monotonic()
                self.label.value = label

    def close(self, status: str = "done") -> None:
        if self._ticker is not None:
            self._ticker.stop()
        with self._lock:
            self._closed = True
            self.bar.bar_style = {"succeeded": "success", "stopped": "info", "failed": "danger",
                                  "cancelled": "warning"}.get(status.split(" ", 1)[0], "")  # "stopped at step N"
            self.label.value = f"{self._text} [{status}]"
