"""The job dashboard's state model on real jobs (local gloo workers): what it would draw for a job with a killed
rank (the rank marked dead, its time frozen, the failure an event), a failed job (the failure listed, not
"none"), an elastic job that shrank (the removed rank gone from the world, the failure and the reconfiguration in
order, the new plan), the stop button (the job cancelled through the Job's API), elapsed time, ETA, tokens/s,
memory and a rank's log one click away.

Each expectation is checked against what the test itself injected (which rank, how, at which step) and the raw
records the workers sent (their metrics, the log files), not against the dashboard's own arithmetic.  Every job
is short (a few seconds of work) with heartbeats of 0.5-1 s; each test is bounded.
"""
from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("anywidget")
torch = pytest.importorskip("torch")

from _procs import wait_for  # noqa: E402
from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import RuntimeFailure  # noqa: E402
from hspmd_sdk.runtime import JobStatus, launch  # noqa: E402
from hspmd_sdk.runtime.control.faults import Reaction  # noqa: E402
from hspmd_sdk.runtime.control.job import JobCancelled  # noqa: E402
from hspmd_sdk.viz import JobDashboard  # noqa: E402

SELFTEST = "hspmd_sdk.testing.entries"
#: failures here are processes that exit (seen at once), not silence: heartbeats slow enough for a loaded machine
FAST = {"heartbeat_s": 1.0, "timeout_s": 60}


class GoOn:
    """A policy that lets the other ranks go on after a failure (the job keeps running)."""

    def on_failure(self, job, failure) -> Reaction:
        return Reaction.CONTINUE


def _view(dash: JobDashboard) -> dict:
    dash.refresh()
    return dash.state


def _rank(view: dict, r: int) -> dict:
    return next(x for x in view["ranks"] if x["rank"] == r)


@pytest.mark.timeout(90)
def test_a_killed_rank_is_marked_dead_and_the_stop_button_stops_the_others() -> None:
    """Rank 1 of a running job is SIGKILLed by the test; a policy lets ranks 0 and 2 go on.  While they run, the
    dashboard marks rank 1 dead ("killed (SIGKILL)", the step it was in), keeps its last step time as it was and
    lists the failure; the others keep reporting, with an ETA of the steps left at the newest steps' pace.  A
    click on rank 1 shows the end of its log file.  Then the stop button's message cancels the job
    (``job.wait()`` raises JobCancelled): ranks 0 and 2 are shown stopped, rank 1 still dead, and the events say
    the dashboard stopped it."""
    steps = 300
    job = launch(cluster=Cluster.local(3), entry=f"{SELFTEST}:fail_alone", steps=steps, policy=GoOn(),
                 payload={"rank": -1, "steps_each": steps, "pause": 0.05}, **FAST)
    try:
        dash = JobDashboard(job, watch=False)
        v0 = dash.state  # just launched: no step yet, the workers are starting
        assert v0["step"] == 0 and v0["starting"].startswith("starting 3 workers: "), v0["starting"]
        assert {x["state"] for x in v0["ranks"]} == {"starting"}
        wait_for(lambda: all(len(job.metrics.rank(r)) >= 3 for r in range(3)), 60)
        os.kill(job.pids()[1], signal.SIGKILL)
        wait_for(lambda: job.failures, 30)
        v = _view(dash)
        assert v["status"] == "running" and v["can_stop"] and v["elapsed_s"] > 0 and v["starting"] == ""
        dead = _rank(v, 1)
        reports = job.metrics.rank(1)  # what rank 1 sent before it died: the reference for the frozen values
        assert dead["state"] == "dead" and dead["why"] == "killed (SIGKILL)", dead
        assert dead["died_step"] == reports[-1].step + 1 and dead["step"] == reports[-1].step
        assert dead["time"] == round(reports[-1].step_time, 4)
        assert _rank(v, 0)["state"] == _rank(v, 2)["state"] == "running"
        [ev] = v["events"]
        assert ev["reason"] == "failure" and ev["failed"] == [1] and "rank 1 exited with status -9" in ev["text"]
        before = _rank(v, 0)["step"]
        wait_for(lambda: job.metrics.rank(0)[-1].step >= before + 3, 30)
        v2 = _view(dash)
        assert _rank(v2, 0)["step"] >= before + 3  # the others go on ...
        assert _rank(v2, 1) == dead  # ... the dead rank's bar and time stay where it died
        assert v2["slowest"] != 1  # a dead rank is not "the slowest"
        per_step: dict[int, float] = {}
        for r in (0, 2):
            for m in job.metrics.rank(r):
                if m.step_time is not None:
                    per_step[m.step] = max(per_step.get(m.step, 0.0), m.step_time)
        newest = [per_step[s] for s in sorted(per_step)[-5:]]
        assert v2["eta_s"] == pytest.approx((steps - v2["step"]) * statistics.median(newest), rel=0.05, abs=0.2)
        assert v2["eta_s"] >= (steps - v2["step"]) * 0.05 * 0.9  # at least the pause of every step left
        time.sleep(0.2)
        assert _view(dash)["elapsed_s"] > v2["elapsed_s"]
        dash._on_front_end(dash, {"type": "logs", "rank": 1}, [])  # a click on R1
        log, path = dash.log, Path(job.log_dir) / "rank1.log"
        assert log["rank"] == 1 and log["path"] == str(path)
        shown = log["text"].splitlines()
        assert shown and shown == path.read_text().splitlines()[-len(shown):]
        assert "metric: step 0" in log["text"] and "killed by SIGKILL" in log["text"]
        t0 = time.monotonic()
        dash._on_front_end(dash, {"type": "stop"}, [])  # what the button sends (after its confirming click)
        with pytest.raises(JobCancelled):
            job.wait(timeout=30)
        assert time.monotonic() - t0 < 20
    finally:
        job.cancel()
    wait_for(lambda: dash.state["status"] == "cancelled", 10)
    v3 = dash.state
    assert job.status is JobStatus.CANCELLED and not v3["can_stop"] and v3["stopped_by_user"]
    assert [(x["rank"], x["state"]) for x in v3["ranks"]] == [(0, "stopped"), (1, "dead"), (2, "stopped")]
    assert [e["reason"] for e in v3["events"]] == ["failure", "stopped"]
    assert "stopped from the dashboard" in v3["events"][-1]["text"]


@pytest.mark.timeout(60)
def test_a_failed_job_lists_its_failure_in_events_and_marks_the_rank() -> None:
    """The default policy: rank 1 SIGKILLs itself at step 2, the job fails.  The events list the failure (the
    header's error is not the only place), rank 1 is dead at step 2, rank 0 stopped."""
    job = launch(cluster=Cluster.local(2), entry=f"{SELFTEST}:fail_on_rank", steps=1000,
                 payload={"rank": 1, "step": 2, "how": "kill"}, **FAST)
    dash = JobDashboard(job, watch=False)
    with pytest.raises(RuntimeFailure):
        job.wait(timeout=45)
    v = _view(dash)
    assert v["status"] == "failed" and "rank 1" in v["error"] and not v["can_stop"]
    assert _rank(v, 1) | {"time": None, "memory_mb": None} == {
        "rank": 1, "state": "dead", "time": None, "step": 1, "memory_mb": None, "why": "killed (SIGKILL)",
        "died_step": 2, "memory_estimate_mb": None}  # an entry job trains no plan: no memory estimate
    assert _rank(v, 0)["state"] == "stopped"
    first = v["events"][0]
    assert first["reason"] == "failure" and first["failed"] == [1] and first["step"] == 2
    assert "exited with status -9 (killed by SIGKILL)" in first["text"]
    assert all(e["reason"] == "consequence" for e in v["events"][1:])
    assert v["eta_s"] is None and v["elapsed_s"] > 0


def _pipe(devices: list[int], mbs: int, n: int) -> dict:
    return {"stages": [{"devices": devices, "layers": [0, 3]}], "micro_batch_size": mbs, "num_micro_batches": n}


@pytest.mark.timeout(150)
def test_an_elastic_job_that_shrank_shows_its_current_world_and_plan() -> None:
    """Three data-parallel ranks (batches 2, 2, 4: global batch 8), rank 2 killed in step 1's forward.  The job
    goes on with ranks 0 and 1: the dashboard lists those two only, rank 2 apart as removed (killed at step 1),
    the failure then the reconfiguration it caused, the plan drawn anew on ranks 0 and 1; tokens/s is the tokens
    the workers reported for a step over the step's time; each rank's memory is its process's."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(3)
    data = {"pipelines": [_pipe([0], 2, 1), _pipe([1], 2, 1), _pipe([2], 2, 2)]}
    program = specialize(model, plan_from_strategy(model, Strategy.load(data), cluster), cluster,
                         bindings={"B": 8, "S": 16})
    job = launch(program, cluster, steps=3, seed=0, seq_len=16, elastic=True, timeout_s=60,
                          heartbeat_s=0.5, fault_injection=[{"rank": 2, "step": 1, "at": "forward"}])
    try:
        dash = JobDashboard(job, watch=False)
        v0 = dash.state
        assert [[s["ranks"] for s in p["stages"]] for p in v0["plan"]["pipelines"]] == [[[0]], [[1]], [[2]]]
        assert v0["plan"]["since"] == "the start"
        result = job.wait(timeout=120)
    finally:
        job.cancel()
    v = _view(dash)
    assert v["status"] == "succeeded" and len(result.losses) == 3
    assert v["world"] == [0, 1] and v["removed"] == [2]
    assert [x["rank"] for x in v["ranks"] if x["state"] != "removed"] == [0, 1]
    gone = _rank(v, 2)
    assert gone["state"] == "removed" and gone["died_step"] == 1
    assert gone["why"] == "killed (SIGKILL) at step 1; the job went on without it"
    reasons = [(e["reason"], e["failed"]) for e in v["events"]]
    assert reasons == [("failure", [2]), ("failure", [2])], v["events"]
    assert "rank 2 exited" in v["events"][0]["text"] and "world now 2 ranks" in v["events"][1]["text"]
    plan = v["plan"]
    assert plan["since"] == "step 1 (failure)"
    assert sorted(r for p in plan["pipelines"] for s in p["stages"] for r in s["ranks"]) == [0, 1]
    assert all(s["layers"] == "0-3" for p in plan["pipelines"] for s in p["stages"])
    # tokens/s: the tokens every rank reported for one step (each is a whole pipeline's first stage here), over
    # the median of the newest steps' slowest rank
    steps = {m.step for r in (0, 1) for m in job.metrics.rank(r)}
    last = max(steps)
    tokens = sum(m.tokens for r in (0, 1) for m in job.metrics.rank(r) if m.step == last and m.tokens)
    assert tokens == 8 * 16
    slowest = [max(m.step_time for r in (0, 1) for m in job.metrics.rank(r) if m.step == s) for s in sorted(steps)]
    assert v["tokens_per_s"] == pytest.approx(tokens / statistics.median(slowest[-5:]), rel=1e-3)
    for r in (0, 1):
        assert _rank(v, r)["memory_mb"] == job.metrics.rank(r)[-1].memory_mb and _rank(v, r)["memory_mb"] > 50


def test_the_progress_line_and_the_dashboard_show_one_tokens_per_s_computation() -> None:
    """Issue 48 item 5 (tutorial 08's bar said 0.6k tok/s where its dashboard said 985): on the same metrics, the text
    progress line and the dashboard show the same pace, the reference's: a step's global batch × sequence length
    over the median of the newest steps' slowest rank — not the loss rank's own pipeline's tokens over its own time.

    Two pipelines: rank 0 (loss rank, 6 of the 8 sequences of a step, fast) and rank 1 (2 sequences, slower)."""
    from types import SimpleNamespace

    from hspmd_sdk.runtime.control.job import Job
    from hspmd_sdk.runtime.metrics import MetricsHistory, StepMetrics
    from hspmd_sdk.viz._job import snapshot

    batch, seq = 8, 16
    times = {0: [0.10, 0.11, 0.12, 0.10, 0.13, 0.10], 1: [0.20, 0.25, 0.22, 0.30, 0.21, 0.24]}
    metrics = MetricsHistory()
    for step in range(6):
        for r, own in ((0, 6), (1, 2)):  # each rank's reported tokens: its own pipeline's, over its own time
            t = times[r][step]
            metrics.add(StepMetrics(rank=r, step=step, step_time=t, loss=5.0 - step if r == 0 else None,
                                    tokens=own * seq, tokens_per_s=own * seq / t))
    slowest = [max(times[0][s], times[1][s]) for s in range(6)]
    want = batch * seq / statistics.median(slowest[-5:])  # the reference, by hand
    controller = SimpleNamespace(global_batch=batch, seq_len=seq, mixed=False)
    job = SimpleNamespace(job_id="fake", status="running", metrics=metrics, controller=controller,
                          spec=SimpleNamespace(steps=10, ranks=[0, 1], slowdown={}), events=[], failures=[],
                          pids=lambda: {0: 1, 1: 2}, _lock=threading.RLock(), _absorbed=[], _failures=[],
                          _ranks={0: SimpleNamespace(returncode=None), 1: SimpleNamespace(returncode=None)},
                          _data_label="stdlib source (bytes)")
    shown = snapshot(job).tokens_per_s
    assert shown == pytest.approx(want, rel=1e-9)
    line = Job._progress_text(job, metrics.rank(0)[-1])
    assert f"{want:.0f} tok/s" in line, line  # 1,000 tok/s and more are written in k: this case stays below
    assert want < 1e3 and "loss 0.0000" in line
    assert line.endswith(" | stdlib source (bytes)"), line  # the data it trains on, named on every line


def test_the_dashboard_shows_validation_losses_the_learning_rate_and_the_gradient_norm() -> None:
    """A training job's ranks report each step's learning rate and gradient norm, and on validation steps the
    validation loss: the snapshot carries them to the front end (squares on the loss curve, figures beside it)."""
    from types import SimpleNamespace

    from hspmd_sdk.runtime.metrics import MetricsHistory, StepMetrics
    from hspmd_sdk.viz._job import snapshot

    metrics = MetricsHistory()
    for step in range(4):
        for r in (0, 1):
            metrics.add(StepMetrics(rank=r, step=step, step_time=0.1, loss=5.0 - step, lr=1e-3 * (step + 1),
                                    grad_norm=2.0 - 0.1 * step, val_loss=4.6 - step if step % 2 else None))
    job = SimpleNamespace(job_id="fake", status="running", metrics=metrics, controller=None,
                          spec=SimpleNamespace(steps=10, ranks=[0, 1], slowdown={}), events=[], failures=[],
                          pids=lambda: {0: 1, 1: 2}, _lock=threading.RLock(), _absorbed=[], _failures=[],
                          _ranks={0: SimpleNamespace(returncode=None), 1: SimpleNamespace(returncode=None)})
    view = snapshot(job).to_view()
    assert view["val_losses"] == [[1, 3.6], [3, 1.6]]
    assert view["lr"] == pytest.approx(4e-3) and view["grad_norm"] == pytest.approx(1.7)
