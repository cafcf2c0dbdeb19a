"""Checkpoints of mixed-length runs (SPEC §5 with §7): each saved under the candidate running at that step, a resumed
run continues at the checkpoint's step -- under whichever candidate that step's dispatch picks, or under other
candidates altogether -- with the losses of the uninterrupted run; other data is refused before workers start."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hspmd_sdk import Cluster, LlamaConfig, launch
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.runtime.checkpoints.checkpoint import load_checkpoint

from test_mixed_runtime import BUDGET, CONTEXT, DOCS, ENTRIES, SEED, STEPS, TOL, _programs, _rel  # noqa: E402

MODEL = LlamaConfig.preset("tiny")
KW = dict(steps=STEPS, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT, timeout_s=120)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    root = tmp_path_factory.mktemp("mixed-ck") / "ck"
    job = launch(_programs(MODEL), Cluster.local(4), checkpoint_dir=root, checkpoint_every=2, **KW)
    return root, job, job.wait()


@pytest.mark.timeout(240)
def test_a_switching_run_saves_under_the_running_candidate(saved) -> None:
    root, job, result = saved
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]
    choices = [rec["choice"] for rec in job.length_planner.records]
    assert len(set(choices)) >= 2 and result.events  # it did switch between candidates
    for step in (2, 4, 6):
        ck = load_checkpoint(root / f"step-{step:08d}")
        assert ck.step == step and ck.manifest.data.next_step == step
        assert ck.manifest.data.source.startswith("mixed:") and ck.manifest.data.global_batch == BUDGET
        # the plan of the candidate that ran the checkpoint's last step
        assert ck.manifest.plan == job.length_planner.programs[choices[step - 1]].plan.model_dump(mode="json")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("step,entries", [(2, None), (4, [ENTRIES[2]])], ids=["same-candidates", "other-candidate"])
def test_resuming_gives_the_uninterrupted_losses(saved, step: int, entries) -> None:
    root, _, uninterrupted = saved
    programs = _programs(MODEL) if entries is None else _programs(MODEL, entries)
    job = launch(programs, Cluster.local(4), resume_from=root / f"step-{step:08d}", **KW)
    resumed = job.wait()
    assert job.length_planner.records[0]["step"] == step
    assert len(resumed.losses) == STEPS - step and _rel(resumed.losses, uninterrupted.losses[step:]) < TOL


def test_other_data_or_too_few_steps_are_refused_before_workers_start(saved) -> None:
    root, _, _ = saved
    other = [np.asarray(d)[::-1].copy() for d in DOCS]  # the same lengths, other tokens
    with pytest.raises(PlanValidationError, match="data"):
        launch(_programs(MODEL), Cluster.local(4), resume_from=root / "step-00000004", **{**KW, "data": other})
    with pytest.raises(PlanValidationError, match="steps"):
        launch(_programs(MODEL), Cluster.local(4), resume_from=root, **KW)  # its latest: all 6 steps done
    with pytest.raises(PlanValidationError, match="seed"):
        launch(_programs(MODEL), Cluster.local(4), resume_from=root / "step-00000002", **{**KW, "seed": SEED + 1})
