"""A running job in the editor and in the dashboard: progress from the job's public API, "Apply to running job"
(enabled only for a job that can switch; it calls ``job.switch(editor.program)``), reconfigurations that update the
canvas, and a real local training job launched from the editor."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

from hspmd_sdk import Cluster, Strategy  # noqa: E402
from hspmd_sdk.errors import HSPMDError  # noqa: E402
from hspmd_sdk.runtime.metrics import MetricsHistory, StepMetrics  # noqa: E402
from hspmd_sdk.viz import JobDashboard, PlanEditor  # noqa: E402
from hspmd_sdk.viz._canvas_view import canvas_view  # noqa: E402
from hspmd_sdk.viz._job import SWITCH_NEEDS  # noqa: E402

CL = Cluster.local(4)
PLAN = {"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 1]}, {"devices": [2, 3], "layers": [2, 3]}],
                       "micro_batch_size": 1, "num_micro_batches": 4}]}
SHRUNK = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]}, {"devices": [2], "layers": [2, 3]}],
                         "micro_batch_size": 1, "num_micro_batches": 4}]}


class FakeJob:
    """The public surface of a running Job (status, job_id, spec.steps, metrics, pids), without workers."""

    def __init__(self, steps: int = 5) -> None:
        self.job_id = "fake-1"
        self.status = "running"
        self.spec = SimpleNamespace(steps=steps)
        self.metrics = MetricsHistory()

    def pids(self) -> dict[int, int]:
        return {r: 1000 + r for r in range(4)}

    def step(self, k: int, loss: float, times: dict[int, float]) -> None:
        for r, t in times.items():
            self.metrics.add(StepMetrics(rank=r, step=k, step_time=t, loss=loss if r == 0 else None))


class SwitchingJob(FakeJob):
    """A job of an SDK with graph switching: records every switch and exposes its events."""

    def __init__(self, steps: int = 5) -> None:
        super().__init__(steps)
        self.events: list[dict] = []
        self.switched: list = []

    def switch(self, program) -> None:
        self.switched.append(program)


def _editor(job=None) -> PlanEditor:
    return PlanEditor(CL, "tiny", PLAN, seq_len=16, background=False, job=job)


def test_apply_is_disabled_with_a_reason_for_a_job_that_cannot_switch():
    job = FakeJob()
    ed = _editor(job)
    assert ed.blocked("apply") == SWITCH_NEEDS
    view = canvas_view(ed)
    assert view["can"]["job"] and not view["can"]["apply"] and "Job.switch" in view["can"]["apply_why"]
    with pytest.raises(HSPMDError, match="switching needs a job launched from an SDK version with Job.switch"):
        ed.apply_to_job()


def test_apply_calls_switch_with_the_editors_program_after_validation():
    job = SwitchingJob()
    ed = _editor(job)
    ed.set_devices(0, 0, [0, 1, 2])  # TP3: invalid, the switch is refused
    with pytest.raises(HSPMDError, match="TP degree 3"):
        ed.apply_to_job()
    assert job.switched == []
    ed.undo()
    ed.unassign_devices([1, 3])  # a valid new plan: TP1 stages on ranks 0 and 2
    assert ed.is_valid and canvas_view(ed)["can"]["apply"]
    ed.apply_to_job()
    assert job.switched == [ed.program]  # the very Program the editor resolved for the draft shown
    assert ed.program.pipelines == [[[0], [2]]]
    assert "switch to this plan" in ed.message
    job.status = "succeeded"
    ed.poll_job()
    assert "is succeeded" in ed.blocked("apply")


def test_a_job_that_reconfigured_itself_updates_the_canvas():
    job = SwitchingJob()
    ed = _editor(job)
    job.step(0, 5.5, {0: 0.2, 1: 0.21, 2: 0.3, 3: 0.31})
    job.events.append({"step": 1, "reason": "failure", "failed_ranks": [1, 3], "strategy": Strategy.load(SHRUNK),
                       "seconds": {"detect": 0.05, "plan": 0.4, "specialize": 0.1, "switch": 0.2, "total": 0.75},
                       "bytes": {"intra": 1000, "inter": 0}})
    snap = ed.poll_job()
    assert snap.step == 1 and snap.losses == (5.5,)
    assert ed.draft.pipelines[0].stages[0].devices == [0] and ed.is_valid
    assert ed.strategy == Strategy.load(SHRUNK)
    assert ed.failed_ranks == [1, 3] and "reconfigured itself" in ed.message and "failure" in ed.message
    tiles = {t["r"]: t for t in canvas_view(ed)["tiles"]}
    assert tiles[1]["failed"] and tiles[3]["failed"] and not tiles[0]["failed"]
    assert ed.undo() and ed.draft.pipelines[0].stages[0].devices == [0, 1]  # undoable like any change
    ed.poll_job()  # no new event: nothing changes
    assert ed.draft.pipelines[0].stages[0].devices == [0, 1]


def test_dashboard_shows_progress_step_times_and_events():
    job = SwitchingJob(steps=4)
    dash = JobDashboard(job, watch=False)
    assert dash.state["step"] == 0 and dash.state["losses"] == [] and dash.state["can_switch"]
    job.step(0, 5.5, {0: 0.2, 1: 0.5})
    job.step(1, 5.1, {0: 0.25, 1: 0.6})
    job.events.append({"step": 2, "reason": "user", "failed_ranks": [], "strategy": None,
                       "seconds": {"total": 0.3}, "bytes": {"intra": 2_000_000, "inter": 500_000}})
    dash.refresh()
    s = dash.state
    assert s["step"] == 2 and s["steps"] == 4 and s["losses"] == [5.5, 5.1]
    assert s["step_times"] == [[0, 0.25], [1, 0.6]] and s["slowest"] == 1  # each rank's last step
    [ev] = s["events"]
    assert ev["reason"] == "user" and ev["text"] == "step 2 · user · 0.30 s · moved 2.5 MB"
    assert FakeJob().__class__ is not SwitchingJob and not JobDashboard(FakeJob(), watch=False).state["can_switch"]


@pytest.mark.timeout(180)
def test_launch_locally_trains_the_plan_and_the_dashboard_follows_it():
    ed = PlanEditor(Cluster.local(2), "tiny", {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]},
                                                                         {"devices": [1], "layers": [2, 3]}],
                                                              "micro_batch_size": 1, "num_micro_batches": 2}]},
                    seq_len=16, background=False)
    assert ed.blocked("launch") == ""
    job = ed.launch(steps=3, timeout_s=60)
    try:
        result = job.wait(timeout=150)
    finally:
        job.cancel()
    assert len(result.losses) == 3 and ed.job is job
    snap = ed.poll_job()
    assert snap.status == "succeeded" and snap.step == 3 and list(snap.losses) == result.losses
    assert set(snap.step_times) == {0, 1}
    assert "Job.switch" in ed.blocked("apply") or "succeeded" in ed.blocked("apply")
