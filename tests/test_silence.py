"""No silence over 2 s where a user waits (issue 48 item 2): the silence checker (:mod:`hspmd_sdk.testing.silence`)
and what it finds.

The checker runs a command under a pseudo-terminal and timestamps every chunk it writes; a notebook's cells through
nbclient, timestamping every message that changes what a cell shows.  It is tested on commands whose silences are
known by construction (a silent sleep is reported, steady output and a counting phase line are not, a redraw of the
same text is no output), then run over ``hspmd demo``.

``hspmd demo``'s bound here is :data:`CI_BOUND_S`, not the goal of 2 s: this suite shares two cores with other
work, and a phase's counter (redrawn every second by a daemon thread) can be starved for a moment while the
workers import PyTorch.  The figure measured on an idle machine is in the note of the change that added this file.
"""
from __future__ import annotations

import io
import sys
import textwrap
import time

import pytest

from hspmd_sdk.runtime.control.progress import LineProgress, Phase
from hspmd_sdk.testing.silence import END, START, longest_gaps, run_notebook, run_under_pty

GOAL_S = 2.0
#: ``hspmd demo``'s bound in this suite: the goal times 1.5 (the suite's load; see the module's docstring).
CI_BOUND_S = GOAL_S * 1.5


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


# ---- the checker on outputs whose silences are known -------------------------------------------------------------
def test_longest_gaps_counts_start_between_and_end() -> None:
    gaps = longest_gaps([(0.5, "a\n"), (3.5, "b\n"), (3.9, "c\n")], wall_s=6.0)
    assert [(round(g.seconds, 2), g.before, g.after) for g in gaps] == [
        (0.5, START, "a"), (3.0, "a", "b"), (0.4, "b", "c"), (2.1, "c", END)]


def test_a_redraw_of_the_same_text_and_blank_chunks_are_not_output() -> None:
    chunks = [(0.1, "\rstep 1"), (1.0, "\rstep 1"), (2.0, "\r\n"), (3.0, "\x1b[K"), (3.3, "\rstep 2\n")]
    gaps = longest_gaps(chunks, wall_s=3.3)
    assert [(round(g.seconds, 2), g.before, g.after) for g in gaps] == [
        (0.1, START, "step 1"), (3.2, "step 1", "step 2"), (0.0, "step 2", END)]


def test_a_silent_sleep_is_reported_with_the_line_before_it() -> None:
    out = run_under_pty(_py("""
        import time
        print("working on it", flush=True)
        time.sleep(3)
        print("done", flush=True)
    """), timeout_s=60)
    assert out.returncode == 0
    (gap,) = out.over(GOAL_S)
    assert 2.9 <= gap.seconds < 10 and gap.before == "working on it" and gap.after == "done"


def test_a_silent_start_is_reported() -> None:
    out = run_under_pty(_py("import time; time.sleep(2.5); print('late')"), timeout_s=60)
    assert out.longest.before == START and out.longest.seconds >= 2.4 and out.longest.after == "late"


def test_output_every_half_second_is_not_a_silence() -> None:
    out = run_under_pty(_py("""
        import time
        for i in range(7):
            print(i, flush=True)
            time.sleep(0.5)
    """), timeout_s=60)
    assert out.returncode == 0 and out.over(GOAL_S) == [] and out.text.split() == [str(i) for i in range(7)]


def test_a_counting_phase_keeps_a_terminal_informed() -> None:
    """A phase line counts its seconds in place on a terminal: 3 s of work without a silence over 2 s."""
    out = run_under_pty(_py("""
        import time
        from hspmd_sdk.runtime.control.progress import Phase
        with Phase("computing"):
            time.sleep(3)
    """), timeout_s=60)
    assert out.returncode == 0 and out.over(GOAL_S) == [], out.gaps
    assert "computing ... 2 s" in out.text and "computing ... done in 3." in out.text


def test_a_job_bar_says_how_long_it_has_not_changed() -> None:
    buf = io.StringIO()
    bar = LineProgress(3, "job", stream=buf, width=4, tty=True, tick_s=0.05)
    bar.update(0, "starting 2 workers: processes 0/2")
    time.sleep(2.3)
    bar.update(1, "loss 1.0")
    bar.close("succeeded")
    out = buf.getvalue()
    assert "processes 0/2 · 1 s" in out and "processes 0/2 · 2 s" in out and out.endswith("[succeeded]\n")
    assert "loss 1.0 ·" not in out  # a fresh state says nothing about seconds


def test_piped_the_phase_is_two_plain_lines() -> None:
    buf = io.StringIO()
    with Phase("computing", stream=buf):
        time.sleep(0.05)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "computing ..." and lines[1].startswith("computing ... done in ") and "\r" not in buf.getvalue()


@pytest.mark.timeout(120)
def test_notebook_cells_silent_and_counting() -> None:
    """A cell that sleeps silently is reported; one whose phase counts (a display updated each second, stopped
    by the cell's end) is not."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (
        "import time\nprint('sleeping')\ntime.sleep(3)",
        "from hspmd_sdk.runtime.control.progress import Phase\nwait = Phase('profiling').start()\ntime.sleep(3)",
        "assert not wait._running, 'the phase outlived its cell'\nprint('ok')",
    )])
    silent, counting, after = run_notebook(nb, timeout_s=60)
    assert [round(g.seconds) for g in silent.over(GOAL_S)] == [3] and silent.over(GOAL_S)[0].before == "sleeping"
    assert counting.over(GOAL_S) == [], counting.gaps
    assert "profiling ... done in 3." in counting.text
    assert after.text.strip() == "ok"


def test_the_silence_before_the_exit_ends_when_the_command_exits() -> None:
    """A child that keeps the terminal open after the command exits (as a fork server does) does not lengthen the
    last silence: the shell's prompt returns when the command exits."""
    out = run_under_pty(_py("""
        import subprocess, sys
        print("bye", flush=True)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    """), timeout_s=60)
    assert out.returncode == 0 and out.over(GOAL_S) == [], out.gaps
    assert out.gaps[-1].after == END and out.gaps[-1].before == "bye"


# ---- the commands ------------------------------------------------------------------------------------------------
def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hspmd_sdk.cli", *args]


def _no_long_silence(out) -> None:
    assert out.returncode == 0, out.text[-2000:]
    assert out.over(CI_BOUND_S) == [], "\n".join(map(str, out.over(CI_BOUND_S)))


@pytest.mark.timeout(180)
def test_hspmd_demo_is_never_silent_for_long() -> None:
    out = run_under_pty(_cli("demo", "--steps", "2"), timeout_s=170)
    assert "largest relative loss difference" in out.text
    assert "computing the single-device reference (one process, the same data) ... done in" in out.text
    _no_long_silence(out)


@pytest.mark.timeout(180)
def test_hspmd_run_is_never_silent_for_long() -> None:
    """``hspmd run`` with its single-device reference (15.8 s of silence before the phase line)."""
    out = run_under_pty(_cli("run", "example_hetero_tiny", "--local", "4", "--steps", "2"), timeout_s=170)
    assert "loading PyTorch ... done in" in out.text
    assert "computing the single-device reference (one process, the same data) ... done in" in out.text
    _no_long_silence(out)


@pytest.mark.timeout(180)
def test_hspmd_train_is_never_silent_for_long(tmp_path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[run]\nsteps = 2\n\n[plan]\ncluster = "local:2"\n')
    out = run_under_pty(_cli("train", str(config)), timeout_s=170)
    assert "loading PyTorch ... done in" in out.text and "training 2 steps on 2 worker processes" in out.text
    assert "logs in " in out.text.split("grad norm", 1)[-1]  # after the table, not into the bar's line
    _no_long_silence(out)


@pytest.mark.timeout(120)
def test_leave_now_runs_the_exit_handlers_and_keeps_the_status() -> None:
    """The CLI's way out once PyTorch is loaded (its teardown is seconds of silence before the prompt): the exit
    handlers still run, the streams are flushed, the status is kept."""
    out = run_under_pty(_py("""
        import atexit, sys
        import torch
        from hspmd_sdk.cli import leave_now
        atexit.register(lambda: print("exit handler ran"))
        sys.stdout.write("unflushed line")
        leave_now(3)
        print("not reached")
    """), timeout_s=100)
    assert out.returncode == 3, out.text
    assert "unflushed line" in out.text and "exit handler ran" in out.text and "not reached" not in out.text


# ---- the plan editor's first launch ------------------------------------------------------------------------------
def test_a_launch_click_disables_launch_and_says_starting_before_the_runtime_loads(monkeypatch) -> None:
    """What the canvas is sent when its Launch button is clicked, before the runtime starts anything (the first
    launch loads PyTorch and starts processes: seconds with the kernel busy): the button disabled, "starting 2
    workers…", then the seconds counting; a failed launch gives the button back with the reason."""
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    import hspmd_sdk.runtime as runtime
    from hspmd_sdk import Cluster
    from hspmd_sdk.viz import PlanEditor

    ed = PlanEditor(Cluster.local(2), "tiny", {"pipelines": [{"stages": [
        {"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}],
        "micro_batch_size": 1, "num_micro_batches": 2}]}, seq_len=16, background=False)
    ed.widget  # builds the canvas
    ui = ed._ui
    assert ui.canvas.view["can"]["launch"] and not ui.canvas.view["can"]["launching"]
    seen = []

    def slow_launch(program, cluster, **kw):  # the runtime loading and the workers starting, then a failure
        seen.append((dict(ui.canvas.view["can"]), ui.canvas.view["message"]))
        time.sleep(1.6)
        seen.append((dict(ui.canvas.view["can"]), ui.canvas.view["message"]))
        raise RuntimeError("no workers in this test")

    monkeypatch.setattr(runtime, "launch", slow_launch)
    ui._on_msg(None, {"op": "launch"}, None)  # what a click on "▶ Launch locally" sends
    (can0, message0), (can1, message1) = seen
    assert can0["launching"] and not can0["launch"] and can0["launch_why"] == "a launch is starting"
    assert message0.startswith("starting 2 workers…")
    assert can1["launching"] and message1.startswith("starting 2 workers… 1 s")
    after = ui.canvas.view
    assert after["can"]["launch"] and not after["can"]["launching"] and not ed.launching
    assert after["message"] == "launch failed: no workers in this test"
