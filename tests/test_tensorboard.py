"""``launch(..., tensorboard=DIR)``: the launcher writes each step's loss, tokens/s, every rank's step time and memory,
and the events, read back here with TensorBoard's own event reader and compared with what the job returned; every
job also keeps ``metrics.jsonl`` in its log folder."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hspmd_sdk import Cluster, LlamaConfig, specialize
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.errors import HSPMDError
from hspmd_sdk.runtime import launch

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

STEPS, SEQ = 3, 16


def _program(pipes):
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": d, "layers": l} for d, l in p],
                                             "micro_batch_size": 2, "num_micro_batches": 4 // (2 * len(pipes))}
                                            for p in pipes]})
    return specialize(model, plan_from_strategy(model, strategy, cluster), cluster), cluster


@pytest.mark.timeout(120)
def test_tensorboard_has_the_jobs_losses_step_times_memory_throughput_and_events(tmp_path: Path) -> None:
    pp2, cluster = _program([[([0], [0, 1]), ([1], [2, 3])]])
    dp2, _ = _program([[([0], [0, 3])], [([1], [0, 3])]])
    job = launch(pp2, cluster, steps=STEPS, seq_len=SEQ, tensorboard=tmp_path / "tb", log_dir=tmp_path / "logs",
                 schedule={"kind": "linear", "warmup_steps": 1}, max_norm=0.5, eval_every=2, eval_batches=1)
    job.switch(dp2)  # a reconfiguration for the events
    result = job.wait()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == list(range(STEPS))
    assert all(e.value == pytest.approx(x, rel=1e-6) for e, x in zip(loss, result.losses))  # float32 in the file
    for tag, want in (("grad_norm", result.grad_norms), ("lr", result.lrs)):  # the training recipe's figures
        got = acc.Scalars(tag)
        assert [e.step for e in got] == list(range(STEPS)) and len(want) == STEPS
        assert all(e.value == pytest.approx(x, rel=1e-6) for e, x in zip(got, want))
    val = acc.Scalars("val_loss")
    assert {e.step: pytest.approx(v, rel=1e-6) for e, v in zip(val, result.val_losses.values())} == \
        {s: v for s, v in result.val_losses.items()} and sorted(result.val_losses) == list(range(1, STEPS, 2))
    slowest = {}
    for rank in (0, 1):
        times = {e.step: e.value for e in acc.Scalars(f"step_time/rank{rank}")}
        want = {m.step: m.step_time for m in result.metrics[rank]}
        assert times.keys() == want.keys() and all(times[k] == pytest.approx(want[k], rel=1e-6) for k in want)
        for k, v in want.items():
            slowest[k] = max(slowest.get(k, 0.0), v)
        assert [e.step for e in acc.Scalars(f"memory_mb/rank{rank}")] == list(range(STEPS))
    rate = {e.step: e.value for e in acc.Scalars("tokens_per_s")}
    assert rate.keys() == set(range(STEPS))
    for k, v in rate.items():  # the global batch's tokens over the step's slowest rank
        assert v == pytest.approx(4 * SEQ / slowest[k], rel=1e-5)
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("events/text_summary")] \
        if "events/text_summary" in tags["tensors"] else []
    assert any(t.startswith("reconfiguration: step") and "user" in t for t in texts), texts
    # metrics.jsonl: one line per rank and step, the same figures
    lines = [json.loads(x) for x in (job.log_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted((d["rank"], d["step"]) for d in lines) == [(r, s) for r in (0, 1) for s in range(STEPS)]
    by = {(d["rank"], d["step"]): d for d in lines}
    assert all(by[(r, m.step)]["step_time"] == m.step_time for r in (0, 1) for m in result.metrics[r])


def test_a_missing_tensorboard_is_refused_before_any_worker_starts(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    import builtins

    real = builtins.__import__

    def no_tensorboard(name, *a, **k):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    program, cluster = _program([[([0], [0, 1]), ([1], [2, 3])]])
    with pytest.raises(HSPMDError, match="pip install tensorboard"):
        launch(program, cluster, steps=1, seq_len=SEQ, tensorboard=tmp_path / "tb")


class _Job:
    """What :class:`TensorBoardLogger` reads of a job: two ranks, a batch of 4 x 16 tokens, messages fed by hand."""

    def __init__(self, log_dir: Path) -> None:
        from types import SimpleNamespace

        self.job_id, self.log_dir, self.failures, self.events = "fake", log_dir, [], []
        self.spec = SimpleNamespace(world_size=2, steps=3, ranks=[0, 1], loss_rank=None)
        self.controller = SimpleNamespace(global_batch=4, seq_len=16, alive=[0, 1])
        self.metrics = SimpleNamespace(rank=lambda r: [])
        self.handlers: list = []

    def on_message(self, kind: str, fn) -> None:
        self.handlers.append(fn)

    def on_finish(self, fn) -> None:
        pass


def test_tokens_per_s_waits_for_the_steps_slowest_rank_whatever_order_the_ranks_report_in(tmp_path: Path) -> None:
    """Each rank's reports arrive in order, not in step with the other ranks': rank 0 can report the loss of step 1
    before rank 1's time of step 0 arrives.  Step 0's tokens/s is written once both have (it took the fast rank's
    time: the suite caught 1,770 tokens/s for 1,264); a rank the job no longer runs is not waited for."""
    from hspmd_sdk.runtime.control.tensorboard import TensorBoardLogger

    job = _Job(tmp_path)
    logger = TensorBoardLogger(job, tmp_path / "tb")
    send = job.handlers[0]
    send(0, {"step": 0, "step_time": 0.1, "loss": 5.0})
    send(0, {"step": 1, "step_time": 0.1, "loss": 4.0})
    send(0, {"step": 2, "step_time": 0.1, "loss": 3.0})
    send(1, {"step": 0, "step_time": 0.4, "loss": 5.0})
    job.controller.alive = [0]  # rank 1 is lost after step 0: steps 1 and 2 do not wait for it
    send(0, {"step": 3, "step_time": 0.2, "loss": 2.0})
    logger.writer.flush()
    rate = {e.step: e.value for e in _reader(tmp_path / "tb").Scalars("tokens_per_s")}
    assert rate == {0: pytest.approx(64 / 0.4), 1: pytest.approx(64 / 0.1), 2: pytest.approx(64 / 0.1),
                    3: pytest.approx(64 / 0.2)}
    logger.close()


def _reader(path: Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


@pytest.mark.parametrize("where", ["under a file", "in /proc"])
def test_an_unwritable_tensorboard_folder_is_refused_before_any_worker_starts(where: str, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48 item 4: the folder is checked before the workers start, and the error names ``tensorboard``
    (it was a bare FileNotFoundError from TensorBoard's writer, with the workers already running)."""
    import hspmd_sdk.runtime.control.start as start

    if where == "under a file":
        (tmp_path / "a-file").write_text("not a folder")
        folder = tmp_path / "a-file" / "tb"
    else:
        if not Path("/proc/self").exists():
            pytest.skip("no /proc here")
        folder = Path("/proc/hspmd-no-such/tb")
    started = []
    monkeypatch.setattr(start, "launch_spec", lambda *a, **k: started.append(a) or pytest.fail("a worker started"))
    program, cluster = _program([[([0], [0, 1]), ([1], [2, 3])]])
    with pytest.raises(HSPMDError, match=r"^tensorboard=.*cannot write TensorBoard's files there .*Nothing was "
                                         r"started"):
        launch(program, cluster, steps=1, seq_len=SEQ, tensorboard=folder)
    assert started == []
