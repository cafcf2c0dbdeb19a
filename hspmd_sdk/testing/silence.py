"""How long a user waits with nothing on the screen: the silence checker.

A command runs under a pseudo-terminal (so that it behaves as it does in a user's terminal: live bars, line
buffering); every chunk it writes is timestamped, and the silences are the gaps between the start and the first
chunk, between consecutive chunks, and between the last chunk and the command's exit.  A notebook is executed
with nbclient and every message that changes what its cells show (a stream, a display, a result, an error, a
widget's state update) is timestamped the same way, per cell: from the cell's start to its first output, between
outputs, and from the last output to the cell's end.

From the command line::

    python -m hspmd_sdk.testing.silence [--over 2] [--timeout S] -- hspmd demo --steps 3
    python -m hspmd_sdk.testing.silence [--over 2] --notebook tutorials/08_elastic.ipynb
    python -m hspmd_sdk.testing.silence [--over 2] --editor-launch

prints every silence longer than ``--over`` seconds, with the line shown before it (where the user was left
waiting) and the line that ended it, then the longest; the exit status is 1 when one is longer, else 0.
"""
from __future__ import annotations

import argparse
import codecs
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Gap", "Silences", "longest_gaps", "run_under_pty", "run_notebook", "editor_launch_notebook", "main"]

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[@-Z\\-_]")
START, END = "<start>", "<exit>"


@dataclass(frozen=True)
class Gap:
    """``seconds`` of silence beginning ``at`` seconds after the start: ``before`` is the last line shown when it
    began (``<start>`` for the wait before any output), ``after`` the first line that ended it (``<exit>`` when
    the command ended without another word)."""

    seconds: float
    at: float
    before: str
    after: str

    def __str__(self) -> str:
        return f"{self.seconds:6.2f} s at {self.at:7.2f} s  after {self.before[:90]!r}  until {self.after[:60]!r}"


@dataclass
class Silences:
    """The output times of one case (a command, or one notebook cell): ``chunks`` is ``[(seconds since the
    start, text)]``; ``wall_s`` the case's whole duration."""

    name: str
    wall_s: float
    chunks: list[tuple[float, str]] = field(default_factory=list)
    returncode: int | None = None

    @property
    def gaps(self) -> list[Gap]:
        return longest_gaps(self.chunks, self.wall_s)

    @property
    def longest(self) -> Gap:
        return max(self.gaps, key=lambda g: g.seconds)

    def over(self, seconds: float) -> list[Gap]:
        return [g for g in self.gaps if g.seconds > seconds]

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.chunks)


def _last_line(text: str) -> str:
    """The line a terminal shows last after ``text``: escapes stripped, a ``\\r`` redraw keeps its last segment."""
    lines = [seg.split("\r")[-1].strip() for seg in _ANSI.sub("", text).replace("\r\n", "\n").split("\n")]
    shown = [ln for ln in lines if ln]
    return shown[-1] if shown else ""


def _first_line(text: str) -> str:
    for line in _ANSI.sub("", text).replace("\r", "\n").split("\n"):
        if line.strip():
            return line.strip()
    return ""


def longest_gaps(chunks: Sequence[tuple[float, str]], wall_s: float) -> list[Gap]:
    """Every silence of a case whose output arrived at ``chunks`` (``[(t, text)]``, ``t`` seconds since its
    start, in order) and that ended at ``wall_s``: start -> first chunk, chunk -> chunk, last chunk -> end.  A
    chunk of only whitespace or escapes (nothing a user would read), or one that redraws the line shown with the
    same text, does not end a silence."""
    gaps, prev_t, prev_line, seen = [], 0.0, START, ""
    for t, text in chunks:
        shown_before = _last_line(seen)
        seen = (seen + text)[-4000:]
        if not _ANSI.sub("", text).strip():
            continue
        if "\n" not in text and _last_line(seen) == shown_before:
            continue  # a redraw of the same line: nothing changed on the screen
        gaps.append(Gap(t - prev_t, prev_t, prev_line, _first_line(text)))
        prev_t, prev_line = t, _last_line(seen) or prev_line
    gaps.append(Gap(max(0.0, wall_s - prev_t), prev_t, prev_line, END))
    return gaps


def run_under_pty(cmd: Sequence[str], *, timeout_s: float = 600.0, cwd: str | Path | None = None,
                  env: dict[str, str] | None = None, columns: int = 120, rows: int = 40) -> Silences:
    """Run ``cmd`` with a pseudo-terminal as its stdin, stdout and stderr (``columns`` x ``rows``) and timestamp
    each chunk it writes.  Past ``timeout_s`` its process group is killed (``returncode`` then negative)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                            start_new_session=True, close_fds=True)
    os.close(slave)
    out = Silences(" ".join(cmd), 0.0)
    exited: list[float] = []  # when the command itself exited: what a shell waits for before its prompt

    def watch() -> None:
        proc.wait()
        exited.append(time.monotonic() - t0)

    threading.Thread(target=watch, name="silence-wait", daemon=True).start()
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    try:
        while True:
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            ready, _, _ = select.select([master], [], [], min(left, 0.5))
            if not ready:
                if proc.poll() is not None and _drained(master):
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal's other end has closed it
                break
            if not data:
                break
            out.chunks.append((time.monotonic() - t0, decoder.decode(data)))
    finally:
        os.close(master)
        try:
            out.returncode = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out.returncode = proc.wait()
    # the silence before the exit ends when the command exits, not when the last process it started (a fork
    # server, a worker) lets go of the terminal
    out.wall_s = exited[0] if exited else time.monotonic() - t0
    return out


def _drained(fd: int) -> bool:
    ready, _, _ = select.select([fd], [], [], 0)
    return not ready


_SHOWN = {"stream", "display_data", "update_display_data", "execute_result", "error"}


def _widget_text(state: dict[str, Any]) -> str:
    """A widget's state update in a line: its values, a view's ``message`` (the plan editor's canvas) in full."""
    parts = []
    for key, value in list(state.items())[:3]:
        if isinstance(value, dict) and "message" in value:
            value = f"message {value['message']!r}"
        parts.append(f"{key}={str(value)[:80]}")
    return "[widget " + ", ".join(parts) + "]\n"


def _client_class() -> type:
    from nbclient import NotebookClient

    class TimedClient(NotebookClient):
        """An nbclient that notes when each cell starts and ends and when each message that changes what the
        cell shows arrives."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.cases: list[Silences] = []
            self._t0 = 0.0

        async def async_execute_cell(self, cell: Any, cell_index: int, *args: Any, **kwargs: Any) -> Any:
            runs = cell.cell_type == "code" and cell.source.strip()
            if runs:
                self._t0 = time.monotonic()
                self.cases.append(Silences(f"cell {cell_index}: {_first_line(cell.source)[:60]}", 0.0))
            try:
                return await super().async_execute_cell(cell, cell_index, *args, **kwargs)
            finally:
                if runs:
                    self.cases[-1].wall_s = time.monotonic() - self._t0

        def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
            kind, content = msg["msg_type"], msg["content"]
            text = None
            if kind == "stream":
                text = content.get("text", "")
            elif kind in _SHOWN:
                data = content.get("data") or {}
                text = (data.get("text/plain") or content.get("ename") or f"[{kind}]") + "\n"
            elif kind == "comm_msg" and (content.get("data") or {}).get("method") == "update":
                text = _widget_text(content["data"].get("state") or {})
            if text is not None and self.cases:
                self.cases[-1].chunks.append((time.monotonic() - self._t0, text))
            return super().process_message(msg, cell, cell_index)

    return TimedClient


def run_notebook(path: "str | Path | Any", *, timeout_s: float = 600.0, cwd: str | Path | None = None,
                 kernel_name: str = "python3") -> list[Silences]:
    """Execute the notebook at ``path`` (or an nbformat notebook; in ``cwd``, default its folder, else this one;
    ``timeout_s`` per cell) and return one :class:`Silences` per code cell run.  A cell that raises stops the run;
    the cells run until then are returned with the error as the last cell's last chunk."""
    import nbformat
    from nbclient.exceptions import CellExecutionError

    if isinstance(path, (str, Path)):
        nb, where = nbformat.read(Path(path), as_version=4), Path(path).parent
    else:
        nb, where = path, Path.cwd()
    client = _client_class()(nb, timeout=int(timeout_s), kernel_name=kernel_name,
                             resources={"metadata": {"path": str(cwd or where)}})
    try:
        client.execute()
    except CellExecutionError as e:
        if client.cases:
            client.cases[-1].chunks.append((client.cases[-1].wall_s, f"[stopped: {str(e).splitlines()[0]}]\n"))
    return client.cases


#: The first "▶ Launch locally" of a plan editor, as a notebook: a fresh kernel builds and shows the editor, then
#: the next cell hands its canvas the message a click sends (the same routing, ``EditorUI._on_msg``) and waits for
#: the job.  What a user sees meanwhile is the canvas's view updates (widget state) and the job's dashboard.
EDITOR_LAUNCH_CELLS = (
    """from hspmd_sdk import Cluster
from hspmd_sdk.viz import PlanEditor
ed = PlanEditor(Cluster.local(2), "tiny", {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]},
    {"devices": [1], "layers": [2, 3]}], "micro_batch_size": 1, "num_micro_batches": 2}]}, seq_len=16)
ed.launch_steps = 3
assert not ed.blocked("launch"), ed.blocked("launch")
ed""",
    """ui = ed._ui
ui._on_msg(ui.canvas, {"op": "launch"}, [])   # what the canvas sends when its Launch button is clicked
assert ed.job is not None, ed._message
ed.job.wait()""")


def editor_launch_notebook() -> Any:
    """:data:`EDITOR_LAUNCH_CELLS` as an nbformat notebook (for :func:`run_notebook`)."""
    import nbformat

    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in EDITOR_LAUNCH_CELLS])


def _report(cases: Sequence[Silences], over: float) -> int:
    worst = None
    for case in cases:
        longest = case.longest
        worst = longest if worst is None or longest.seconds > worst.seconds else worst
        status = "" if case.returncode in (None, 0) else f"  (exit {case.returncode})"
        print(f"{case.name[:70]}: {case.wall_s:.1f} s, longest silence {longest.seconds:.2f} s{status}")
        for gap in case.over(over):
            print(f"  {gap}")
    if worst is not None and len(cases) > 1:
        print(f"longest silence of all: {worst}")
    return int(any(case.over(over) for case in cases))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, cmd = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m hspmd_sdk.testing.silence",
                                description="find the silences over --over seconds of a command (after --, run "
                                            "under a pseudo-terminal) or of a notebook's cells")
    p.add_argument("--over", type=float, default=2.0, help="report silences longer than this (default 2 s)")
    p.add_argument("--timeout", type=float, default=600.0, help="kill the command (a notebook: a cell) after this")
    p.add_argument("--notebook", action="append", default=[], metavar="IPYNB", help="execute this notebook")
    p.add_argument("--editor-launch", action="store_true",
                   help="a plan editor's first 'Launch locally' in a fresh kernel (EDITOR_LAUNCH_CELLS)")
    p.add_argument("--echo", action="store_true", help="also print the command's output as it was captured")
    args = p.parse_args(argv)
    if not cmd and not args.notebook and not args.editor_launch:
        p.error("give a command after --, --notebook IPYNB or --editor-launch")
    cases: list[Silences] = []
    if cmd:
        cases.append(run_under_pty(cmd, timeout_s=args.timeout))
        if args.echo:
            print(_ANSI.sub("", cases[-1].text))
    status = _report(cases, args.over)
    for nb in args.notebook:
        print(f"== {nb}")
        status |= _report(run_notebook(nb, timeout_s=args.timeout), args.over)
    if args.editor_launch:
        print("== the plan editor's first launch")
        status |= _report(run_notebook(editor_launch_notebook(), timeout_s=args.timeout), args.over)
    return status


if __name__ == "__main__":
    sys.exit(main())
