"""Real text by default (issue 48, item 3): a launch that names no data trains on the standard library's source,
equal to the single-device reference on the same bytes, with a held-out validation split; progress and the
dashboard say what the job trains on, and random tokens say they are random."""
from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, launch, specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import PlanValidationError  # noqa: E402
from hspmd_sdk.runtime.control.run_config import RunConfig  # noqa: E402
from hspmd_sdk.runtime.control.train import reference_training  # noqa: E402
from hspmd_sdk.runtime.data import StdlibBytes, describe_data  # noqa: E402
from hspmd_sdk.viz._job import snapshot  # noqa: E402

STEPS, SEQ, LR = 6, 32, 1e-2
DP2 = {"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 2,
                      "num_micro_batches": 2} for r in (0, 1)]}


def _program(model: Any, cluster: Cluster) -> Any:
    return specialize(model, plan_from_strategy(model, Strategy.load(DP2), cluster), cluster)


@pytest.fixture(scope="module")
def default_job() -> Any:
    """DP2 on the tiny Llama, no ``data=``, validation every 3 steps (one job for the tests below)."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    job = launch(_program(model, cluster), cluster, steps=STEPS, seq_len=SEQ, lr=LR, eval_every=3, eval_batches=2,
                 timeout_s=120, progress=False)
    return job, job.wait()


def test_the_default_is_the_standard_library(default_job: Any) -> None:
    job, result = default_job
    model = LlamaConfig.preset("tiny")
    ref = reference_training(model, steps=STEPS, seq_len=SEQ, global_batch=8, lr=LR, eval_every=3, eval_batches=2)
    stdlib = reference_training(model, steps=STEPS, seq_len=SEQ, global_batch=8, lr=LR, data="stdlib")
    synthetic = reference_training(model, steps=STEPS, seq_len=SEQ, global_batch=8, lr=LR, data="synthetic")
    assert ref.losses == pytest.approx(stdlib.losses, rel=0, abs=0)  # the reference's default is the same data
    assert result.losses == pytest.approx(ref.losses, rel=1e-5)
    assert abs(result.losses[0] - synthetic.losses[0]) > 1e-3  # not random tokens
    # real text is learnable: six steps at lr 1e-2 go well below a uniform guess over 256 bytes
    assert result.losses[-1] < math.log(256) - 1.0, result.losses
    assert job.data == "stdlib source (bytes)"


def test_validation_of_the_default_is_the_held_out_tail(default_job: Any) -> None:
    _, result = default_job
    ref = reference_training(LlamaConfig.preset("tiny"), steps=STEPS, seq_len=SEQ, global_batch=8, lr=LR,
                             eval_every=3, eval_batches=2)
    assert sorted(result.val_losses) == sorted(ref.val_losses) and result.val_losses
    for step, loss in ref.val_losses.items():
        assert result.val_losses[step] == pytest.approx(loss, rel=1e-5)
    ds = StdlibBytes()
    assert ds.num_samples(SEQ) * (SEQ + 1) <= ds.train_bytes < ds.size  # training never reads the tail


def test_progress_and_dashboard_name_the_data(default_job: Any) -> None:
    job, _ = default_job
    assert snapshot(job).to_view()["data"] == "stdlib source (bytes)"
    m = job.metrics.rank(0)[-1]
    assert job._progress_text(m).endswith("| stdlib source (bytes)")


def test_random_tokens_say_so() -> None:
    assert "random" in describe_data("synthetic")
    assert describe_data("/some/where/wiki103") == "/some/where/wiki103"  # not a directory: the name as given


def test_a_model_too_small_for_bytes_is_told_what_to_pass() -> None:
    model = GPTConfig.preset("tiny").model_copy(update={"vocab_size": 64})
    cluster = Cluster.local(2)
    with pytest.raises(PlanValidationError, match="data='synthetic'"):
        launch(_program(model, cluster), cluster, steps=1, timeout_s=30)


def test_run_config_default() -> None:
    assert RunConfig.model_fields["data"].default == "stdlib"
