"""``Job.stop()``: a training job ends gracefully at a step boundary every rank agrees on (the commit of a step
carries the request), with the losses of the steps done, its last checkpoint at that step, and a resume from that
checkpoint going on with the single-device losses.  A job of another entry is cancelled instead."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from _procs import assert_no_workers_left, wait_for  # noqa: E402
from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime.control.job import JobCancelled, JobStatus  # noqa: E402
from hspmd_sdk.runtime import launch  # noqa: E402
from hspmd_sdk.runtime.control.train import reference_training  # noqa: E402

SEQ, SEED, LR, STEPS = 16, 5, 1e-3, 40
#: pipeline (two stages) beside a replica: the stop must reach every stage of every pipeline at one boundary
PLAN = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}],
                       "micro_batch_size": 2, "num_micro_batches": 2},
                      {"stages": [{"devices": [2], "layers": [0, 3]}], "micro_batch_size": 4,
                       "num_micro_batches": 1}]}


def _dashboard(job):
    """The job's dashboard state model (no front end), where the notebook extras are installed."""
    try:
        from hspmd_sdk.viz import JobDashboard
    except ImportError:
        return None
    return JobDashboard(job, watch=False)


def _tensorboard_texts(path, tag: str) -> list[str]:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(path), size_guidance={"tensors": 0})
    acc.Reload()
    name = f"{tag}/text_summary"
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(name)] if name in acc.Tags()["tensors"] else []


def _program(cluster: Cluster):
    model = LlamaConfig.preset("tiny")
    return specialize(model, plan_from_strategy(model, Strategy.load(PLAN), cluster), cluster,
                      bindings={"B": 8, "S": SEQ})


@pytest.mark.timeout(180)
def test_stop_ends_a_training_job_at_a_step_boundary_and_it_resumes_from_there(tmp_path, capsys) -> None:
    """...and the job reads "stopped at step N" everywhere: its status and repr, the dashboard's badge (whose stop
    button says it stops gracefully), the result, the progress line and TensorBoard's text (issue 48 item 2)."""
    cluster = Cluster.local(3)
    reference = reference_training(LlamaConfig.preset("tiny"), steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ,
                                   lr=LR)
    job = launch(_program(cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                 checkpoint_dir=tmp_path / "ck", checkpoint_every=100, progress=True, tensorboard=tmp_path / "tb",
                 hold_at=[2])
    pids = job.pids()
    job.wait_held(2)  # every rank waits at the start of step 2: the stop is requested while the job runs
    dash = _dashboard(job)
    if dash is not None:
        assert "job.stop()" in dash.state["stop_hint"] and "job.cancel()" not in dash.state["stop_hint"]
    job.stop()
    job.release(2)  # the stop is heard at step 2's commit: the job ends after it, 3 steps done
    result = job.wait(timeout=120)
    done = result.stopped_at
    assert job.status is JobStatus.STOPPED and done == 3, done
    said = f"stopped at step {done}"
    assert job.status_text == said and said in repr(job) and "succeeded" not in repr(job)
    progress = capsys.readouterr().err.splitlines()
    assert progress and progress[-1].endswith(f"[{said}]"), progress[-3:]
    if dash is not None:
        dash.refresh()
        assert dash.state["status"] == "stopped" and dash.state["status_text"] == said
        assert {x["state"] for x in dash.state["ranks"]} == {"done"}
    texts = _tensorboard_texts(tmp_path / "tb", "job")
    assert texts and texts[-1] == f"job {job.job_id}: {said}", texts
    assert len(result.losses) == done and result.losses == pytest.approx(reference.losses[:done], rel=1e-5, abs=0)
    for r in range(3):  # every rank stopped after the same step
        assert max(m.step for m in job.metrics.rank(r)) == done - 1, r
    from hspmd_sdk.runtime.checkpoints.checkpoint import list_checkpoints

    saved = list_checkpoints(tmp_path / "ck")
    assert [s for s, _ in saved] == [done]  # every 100 steps, and the step it stopped at (the run's last)
    assert_no_workers_left(list(pids.values()), within=10)
    again = launch(_program(cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                            resume_from=saved[0][1]).wait(timeout=120)
    assert again.losses == pytest.approx(reference.losses[done:], rel=1e-5, abs=0)


@pytest.mark.timeout(60)
def test_stop_cancels_a_job_that_has_no_step_boundary() -> None:
    job = launch(cluster=Cluster.local(2), entry="hspmd_sdk.testing.entries:fail_on_rank", steps=1000,
                 payload={"rank": 9, "step": 10**6, "how": "kill"}, timeout_s=30, heartbeat_s=0.5)
    wait_for(lambda: job.metrics.last_step() >= 1)
    job.stop()
    with pytest.raises(JobCancelled):
        job.wait(timeout=30)
