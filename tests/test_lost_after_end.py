"""A worker lost after the last step of an elastic job (SIGKILL at the fault point ``"end"``: after its last step,
before the final barrier).  Every step was committed everywhere, so there is nothing to recover: the survivors
finish without it, the job succeeds with every loss equal to the single-device run, the failure is recorded (not a
recovery event), the final checkpoint is complete, and no process is left.  Rank 0 hosts the rendezvous store; rank
3 holds the last stage of the second pipeline."""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime.checkpoints.checkpoint import list_checkpoints, load_checkpoint  # noqa: E402
from hspmd_sdk.runtime.control.train import launch, reference_training  # noqa: E402
from _procs import assert_no_workers_left  # noqa: E402

SEED, SEQ, LR, STEPS = 5, 16, 1e-3, 4


def _pipe(stages: list) -> dict:
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": 2, "num_micro_batches": 2}


DP2_PP2 = {"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])]), _pipe([([2], [0, 1]), ([3], [2, 3])])]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [0, 3])
def test_a_worker_lost_after_the_last_step_leaves_a_finished_job(tmp_path: Path, rank: int) -> None:
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(4)
    program = specialize(model, plan_from_strategy(model, Strategy.load(DP2_PP2), cluster), cluster,
                         bindings={"B": 8, "S": SEQ})
    job = launch(program, cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, elastic=True,
                          fault_injection=[{"rank": rank, "step": STEPS - 1, "at": "end"}],
                          checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, checkpoint_async=False, keep=STEPS,
                          timeout_s=60, heartbeat_s=0.5)
    pids = job.pids()
    result = job.wait(timeout=100)
    ref = reference_training(model, steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)

    assert len(result.losses) == STEPS
    assert max(abs(a - b) / b for a, b in zip(result.losses, ref.losses)) <= 1e-5, (result.losses, ref.losses)
    assert [f.rank for f in result.failures] == [rank]  # recorded, survived
    assert not [e for e in result.events if e.reason == "failure"]  # nothing was recovered: nothing was left
    assert any("after the last step" in n for n in job.notes), job.notes
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [2, 4]
    assert load_checkpoint(tmp_path / "ckpt" / list_checkpoints(tmp_path / "ckpt")[-1][1].name).manifest.step == 4
    assert_no_workers_left(list(pids.values()), within=10)
