"""Checkpoints across an elastic reconfiguration (SPEC §5 with §6): a worker dies mid-run, the survivors replan
and go on, and the checkpoints keep coming — written by the new world under the new plan, complete, verified, and
holding exactly the state the run has.

Two pipelines of three stages on 6 ranks save after every step (in the background); rank 4 is SIGKILLed in the
backward of step 2.  A checkpoint in flight at the failure is given up (never half-committed), the step is redone
on 5 ranks, and every later checkpoint is the 5-rank plan's.  The final checkpoint equals the survivors' final
shards bit for bit, and the single-device model's within the tolerances of ``test_checkpoint_resume``.
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import LlamaConfig  # noqa: E402
from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk.core.specialize import specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.models import param_shapes  # noqa: E402
from hspmd_sdk.runtime import load_checkpoint  # noqa: E402
from hspmd_sdk.runtime.checkpoints.checkpoint import list_checkpoints  # noqa: E402
from hspmd_sdk.runtime.control.train import assemble, launch, load_captured, reference_training  # noqa: E402

SEED, SEQ, LR, STEPS = 3, 16, 1e-3, 6


def _pipe(stages: list, mbs: int, n: int) -> dict:
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": mbs,
            "num_micro_batches": n}


SIX = {"pipelines": [_pipe([([0], [0, 0]), ([1], [1, 2]), ([2], [3, 3])], 2, 2),
                     _pipe([([3], [0, 1]), ([4], [2, 2]), ([5], [3, 3])], 2, 2)]}


@pytest.mark.timeout(240)
def test_checkpoints_follow_an_elastic_reconfiguration(tmp_path: Path) -> None:
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(6)
    program = specialize(model, plan_from_strategy(model, Strategy.load(SIX), cluster), cluster)
    root, capture = tmp_path / "ckpt", tmp_path / "capture"
    job = launch(program, cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, elastic=True,
                          fault_injection=[{"rank": 4, "step": 2, "at": "backward"}], capture_dir=capture,
                          checkpoint_dir=root, checkpoint_every=1, keep=STEPS, timeout_s=60, heartbeat_s=0.5)
    result = job.wait(timeout=200)
    ref = reference_training(model, steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    assert len(result.losses) == STEPS
    assert max(abs(a - b) / b for a, b in zip(result.losses, ref.losses)) <= 1e-5
    assert [e.reason for e in result.events if e.done] == ["failure"]

    found = dict(list_checkpoints(root))
    # step 2's checkpoint was in flight when rank 4 died: committed by the 6 ranks, or given up — never partial
    assert set(found) - {2} == {1, 3, 4, 5, 6}
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # nothing left of a given-up write
    for step, path in found.items():
        ck = load_checkpoint(path)  # complete and verified
        assert ck.manifest.world_size == (6 if step <= 2 else 5) and ck.step == step
        writers = {f.rank for f in ck.manifest.files.values()}
        assert writers == set(range(ck.manifest.world_size))  # the new world's ranks wrote the new plan's pieces

    final = load_checkpoint(root)
    shards = load_captured(capture)
    assert len(shards) == 5  # the survivors
    shapes = param_shapes(model)
    for kind, saved in (("params", final.state_dict()),
                        ("exp_avg", {n: s["exp_avg"] for n, s in final.optimizer_state_dict().items()})):
        full, spread = assemble(shards, kind, shapes)
        assert spread == 0.0
        for name, t in saved.items():
            assert torch.equal(t, full[name]), (kind, name)
    for name, t in final.state_dict().items():
        w = ref.params[name]
        assert float((t - w).norm() / w.norm()) <= 2e-5, name
