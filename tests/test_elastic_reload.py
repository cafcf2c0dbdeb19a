"""Elastic recovery when some state has no surviving copy (SPEC §6): the survivors reload it from the job's
checkpoint in the same processes, or the job fails naming it.

Two pipelines of three stages on 6 ranks with ZeRO-1: each pipeline holds only its shard of every Adam moment, so a
SIGKILLed rank takes state nobody else has.  With ``checkpoint_dir`` the launcher's controller picks the newest
complete checkpoint of the job, the 5 survivors (same PIDs) read their shards of ``replan_elastic``'s plan from it
and go back to its step: the steps after it are recomputed on the same data, and every loss equals the
single-device reference's (fp32, rel 1e-5), the final parameters and Adam moments too.  A kill before the first
checkpoint was committed fails cleanly, naming the tensors and saying no checkpoint was complete.  (Without
``checkpoint_dir`` the failure naming the tensors is tests/test_switching.py's
``test_state_with_no_surviving_copy_fails_naming_the_tensors``.)
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import RuntimeFailure  # noqa: E402
from hspmd_sdk.runtime.checkpoints.checkpoint import list_checkpoints  # noqa: E402
from hspmd_sdk.runtime.control.train import assemble, launch, load_captured, reference_training  # noqa: E402

SEED, SEQ, LR, STEPS = 3, 16, 1e-3, 6


def _pipe(stages: list, mbs: int, n: int) -> dict:
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": mbs,
            "num_micro_batches": n}


#: ZeRO-1 over two pipelines: the Adam moments of every parameter are split between its two replicas
SIX_ZERO1 = {"pipelines": [_pipe([([0], [0, 0]), ([1], [1, 2]), ([2], [3, 3])], 2, 2),
                           _pipe([([3], [0, 1]), ([4], [2, 2]), ([5], [3, 3])], 2, 2)], "zero1": True}


def _launch(tmp_path: Path, faults: list[dict], every: int, zero: int = 1):
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(6)
    strategy = Strategy.load({**SIX_ZERO1, "zero": zero, **({"schedule": "gpipe"} if zero == 3 else {})})
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster,
                         bindings={"B": 8, "S": SEQ})
    job = launch(program, cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, elastic=True,
                          fault_injection=faults, capture_dir=tmp_path / "capture", checkpoint_dir=tmp_path / "ckpt",
                          checkpoint_every=every, checkpoint_async=False, keep=STEPS, timeout_s=60, heartbeat_s=0.5)
    return model, job, job.pids()


def _gone(pids: dict[int, int], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        alive = []
        for p in pids.values():
            try:
                os.kill(p, 0)
                if Path(f"/proc/{p}/stat").read_text().split(") ")[1][0] != "Z":
                    alive.append(p)
            except (ProcessLookupError, OSError):
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(150)
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_lost_state_is_reloaded_from_the_checkpoint_in_the_running_survivors(tmp_path: Path, zero: int) -> None:
    """Checkpoints after steps 2, 4, 6 (synchronous, so the one of step 2 is committed before step 3 can start);
    rank 2 dies in step 3's backward (0-based), taking its ZeRO shards of layer 3 and the head (ZeRO-2: its
    gradient shards too, rebuilt by the redone steps; ZeRO-3 under GPipe, whose pipelines may split the layers
    differently, its gathered parameters too)."""
    model, job, pids = _launch(tmp_path, [{"rank": 2, "step": 3, "at": "backward"}], every=2, zero=zero)
    result = job.wait(timeout=130)
    ref = reference_training(model, steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)

    assert len(result.losses) == STEPS
    assert max(abs(a - b) / b for a, b in zip(result.losses, ref.losses)) <= 1e-5, (result.losses, ref.losses)
    # the steps after the checkpoint were run again (rank 0 reported step 2 twice; the later report is the loss)
    steps0 = [m.step for m in job.metrics.rank(0)]
    assert steps0.count(2) == 2 and steps0.count(1) == 1, steps0

    survivors = {r: p for r, p in pids.items() if r != 2}
    assert {r: p for r, p in job.pids().items() if r != 2} == survivors  # the same processes: nothing relaunched
    (event,) = [e for e in result.events if e.reason == "failure"]
    assert event.done and event.failed_ranks == [2] and event.source == "checkpoint"
    assert event.checkpoint_step == 2 and event.step == 2
    assert set(event.seconds) >= {"detect", "plan", "specialize", "verify", "switch", "load", "total"}
    assert 0 < event.seconds["load"] <= event.seconds["switch"] <= event.seconds["total"]
    assert event.bytes["intra"] == event.bytes["inter"] == 0
    assert event.bytes["read"] > 0 and "reloaded from the checkpoint of step 2" in str(event)
    assert sorted(d for p in event.strategy.pipelines for s in p.stages for d in s.devices) == list(range(5))
    assert event.strategy.zero == zero

    # the final state (assembled from the survivors' shards) is the reference's, and so is the last checkpoint,
    # written by the new 5-rank world after the reload
    shards = load_captured(tmp_path / "capture")
    assert len(shards) == 5
    for which, want in (("params", ref.params), ("exp_avg", ref.exp_avg), ("exp_avg_sq", ref.exp_avg_sq)):
        got, spread = assemble(shards, which, model.param_shapes())
        assert spread == 0.0
        worst = max(float((got[n] - w).norm() / w.norm()) for n, w in want.items())
        assert worst <= 5e-5, (which, worst)
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [2, 4, 6]
    assert _gone(pids)


@pytest.mark.timeout(120)
def test_lost_state_before_the_first_checkpoint_fails_naming_the_tensors(tmp_path: Path) -> None:
    """The first checkpoint comes after step 4; rank 2 dies in step 1: nothing to reload from."""
    _, job, pids = _launch(tmp_path, [{"rank": 2, "step": 1, "at": "backward"}], every=4)
    with pytest.raises(RuntimeFailure, match=r"no surviving copy of .*layers\.3\..*held only by the failed "
                                             r"rank\(s\) \[2\], and no checkpoint of this job in .* was complete yet"):
        job.wait(timeout=100)
    assert list_checkpoints(tmp_path / "ckpt") == []
    assert _gone(pids)


def test_losses_take_each_steps_newest_attempt_whoever_reported_it() -> None:
    """A reload redoes steps 2-3: rank 0 (the lowest, which reported them first) died; the survivors' recomputed
    losses are the job's, not rank 0's stale ones.  Steps attempted once keep the lowest rank's report."""
    from hspmd_sdk.runtime.metrics import MetricsHistory, StepMetrics

    h = MetricsHistory()
    for step, loss in enumerate([5.0, 4.0, 3.0, 2.0]):
        for r in (0, 1, 2):
            h.add(StepMetrics(rank=r, step=step, loss=loss + (0.25 if r == 0 and step >= 2 else 0.0)))
    for step, loss in ((2, 3.0), (3, 2.0), (4, 1.0)):  # after the reload, without rank 0
        for r in (2, 1):
            h.add(StepMetrics(rank=r, step=step, loss=loss))
    assert h.losses() == [5.0, 4.0, 3.0, 2.0, 1.0]
    assert h.losses(preferred=0) == [5.0, 4.0, 3.25, 2.25]
