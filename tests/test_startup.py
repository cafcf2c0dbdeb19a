"""The time from ``launch()`` to the first step, shown while it passes and accounted for after (``job.startup()``):
the launcher's preparation, then each worker's processes, imports, rendezvous, build and first step.  Checked
against the test's own clock around the call and the arrival of the first step's metrics, and against the order
of the milestones on every rank."""
from __future__ import annotations

import io
import threading
import time

import pytest

from hspmd_sdk import Cluster, LlamaConfig, specialize
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.runtime import launch
from hspmd_sdk.runtime.control.job import STARTUP_PHASES, Job
from hspmd_sdk.runtime.control.progress import LineProgress


def _program(n: int = 2):
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(n)
    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [r], "layers": [2 * r, 2 * r + 1]}
                                                        for r in range(n)],
                                             "micro_batch_size": 2, "num_micro_batches": 2}]})
    return specialize(model, plan_from_strategy(model, strategy, cluster), cluster), cluster


@pytest.mark.timeout(120)
def test_startup_phases_add_up_to_the_time_from_launch_to_the_first_step() -> None:
    program, cluster = _program()
    first: list[float] = []
    arrived = threading.Event()
    t_call = time.monotonic()
    job = launch(program, cluster, steps=3, seq_len=16, progress=False)
    job.on_message("metric", lambda rank, msg: (first.append(time.monotonic()), arrived.set()))
    job.wait()
    t_end = time.monotonic()
    s = job.startup()
    assert [name for name, _ in STARTUP_PHASES] == list(s.phases)
    assert all(v is not None and v >= 0 for v in s.phases.values()), s.phases
    assert s.prepare_s is not None and 0 < s.prepare_s < t_end - t_call
    # every rank reached every milestone in order, after its spawn
    order = [m for _, m in STARTUP_PHASES]
    for rank, times in s.per_rank.items():
        assert list(times) == order or sorted(times, key=times.get) == order, (rank, times)
        assert all(times[a] <= times[b] for a, b in zip(order, order[1:])), (rank, times)
    # the critical path ends at the last rank's first step: no earlier than the first metric the test saw (the
    # observer may have been attached after it arrived) and no later than the job's end
    assert s.total_s <= t_end - t_call
    if first:
        assert s.total_s >= min(first) - t_call - 0.05 or arrived.is_set()
    assert "launch to first step" in str(s) and "rendezvous" in str(s)


@pytest.mark.timeout(120)
def test_progress_shows_the_startup_then_the_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every update as a plain line (stderr not a terminal): the start-up phases appear before the first step."""
    stream = io.StringIO()
    monkeypatch.setattr("hspmd_sdk.runtime.control.job.make_progress",
                        lambda total, title="": LineProgress(total, title, stream=stream, tty=False))
    monkeypatch.setattr(LineProgress, "update", _every_update(LineProgress.update))
    program, cluster = _program()
    job = launch(program, cluster, steps=2, seq_len=16, progress=True)
    job.wait()
    lines = stream.getvalue().splitlines()
    starting = [i for i, line in enumerate(lines) if "starting 2 workers:" in line]
    stepped = [i for i, line in enumerate(lines) if " 1/2 " in line or " 2/2 " in line]
    assert starting and stepped and max(starting) < min(stepped), lines
    seen = " ".join(lines[i] for i in starting)
    for phase in ("processes 0/2", "imports", "rendezvous", "build", "first step"):
        assert phase in seen, (phase, lines)
    assert job.startup_text() is None  # every rank has stepped


def _every_update(update):
    def unthrottled(self, done: int, text: str = "") -> None:
        self._last = 0.0  # no once-a-second limit: the test reads every phase
        update(self, done, text)
    return unthrottled


def test_progress_defaults_to_where_someone_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    made: list[int] = []
    monkeypatch.setattr("hspmd_sdk.runtime.control.job.make_progress", lambda total, title="": made.append(total) or None)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    cluster = Cluster.local(1)
    from hspmd_sdk.runtime.control.launcher import build_spec
    from hspmd_sdk.runtime.transports.transport import LocalTransport

    spec = build_spec(cluster, entry="hspmd_sdk.testing.entries:allreduce_check", steps=1, local=True)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    Job(spec, {"localhost": [0]}, LocalTransport())._kill_at_exit()
    assert made == []  # a pipe or a file: no bar unless asked
    monkeypatch.setattr(sys, "stderr", Tty())
    Job(spec, {"localhost": [0]}, LocalTransport())._kill_at_exit()
    assert made == [1]  # a terminal
    Job(spec, {"localhost": [0]}, LocalTransport(), progress=False)._kill_at_exit()
    assert made == [1]
