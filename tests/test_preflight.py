"""Resource preflight and option checks: a run that cannot work is refused before any worker starts.

Expected memory figures are computed here from the model's parameter counts (an independent count: 16 bytes a
parameter for fp32 values, gradients and Adam's two moments), not from the estimator itself.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hspmd_sdk import Cluster, LlamaConfig, Strategy
from hspmd_sdk.core.specialize import specialize
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.runtime import launch
from hspmd_sdk.runtime.control import preflight
from hspmd_sdk.runtime.control.preflight import HostFacts, ResourceError, resource_problems, training_memory

SELFTEST = "hspmd_sdk.testing.entries"
PP2 = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}],
                      "micro_batch_size": 2, "num_micro_batches": 2}]}
BIG = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 39]}, {"devices": [1], "layers": [40, 79]}],
                      "micro_batch_size": 1, "num_micro_batches": 2}]}


def program(model: LlamaConfig, strategy: dict, n: int):
    cluster = Cluster.local(n)
    return specialize(model, plan_from_strategy(model, Strategy.load(strategy), cluster), cluster), cluster


def no_workers_started(before: set[str]) -> bool:
    for p in set(os.listdir("/proc")) - before:
        try:
            if b"hspmd_sdk.runtime.workers.worker" in Path(f"/proc/{p}/cmdline").read_bytes():
                return False
        except OSError:
            pass
    return True


def test_parameter_states_are_counted_exactly_per_shard() -> None:
    model = LlamaConfig.preset("llama-70b")
    prog, _ = program(model, BIG, 2)
    est = training_memory(prog, global_batch=2, seq_len=8)  # tiny activations: states dominate
    llama2_70b = 68_976_648_192  # Llama-2-70B's published parameter count
    assert sum(est.values()) == pytest.approx(16 * llama2_70b, rel=0.001)
    assert all(v > 500e9 for v in est.values())  # ~550 GB a rank: two ranks for 70B parameters


@pytest.mark.timeout(60)
def test_a_70b_plan_on_two_local_ranks_is_refused_before_any_worker() -> None:
    model = LlamaConfig.preset("llama-70b")
    prog, cluster = program(model, BIG, 2)
    before = set(os.listdir("/proc"))
    with pytest.raises(ResourceError) as info:
        launch(prog, cluster, steps=1, seq_len=128)
    text = str(info.value)
    assert "host localhost" in text and "GB of RAM" in text and "resource_check=False" in text
    assert no_workers_started(before)


@pytest.mark.timeout(60)
def test_a_huge_sequence_is_refused_by_its_activations() -> None:
    model = LlamaConfig.preset("tiny")
    prog, cluster = program(model, PP2, 2)
    small = training_memory(prog, global_batch=4, seq_len=64)
    huge = training_memory(prog, global_batch=4, seq_len=100_000_000)
    assert all(huge[r] > 1000 * small[r] for r in small)  # activations grow with the tokens
    with pytest.raises(ResourceError, match="GB of RAM"):
        launch(prog, cluster, steps=1, seq_len=100_000_000)


@pytest.mark.timeout(60)
def test_the_override_starts_what_the_check_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a host that (the check is told) has 100 MB free, a tiny job is refused; resource_check=False runs it."""
    monkeypatch.setattr(preflight, "local_facts", lambda cuda=False: HostFacts(cpus=2, mem_available=100 * 2**20))
    with pytest.raises(ResourceError, match="its 2 ranks need"):
        launch(cluster=Cluster.local(2), entry=f"{SELFTEST}:allreduce_check", steps=1)
    result = launch(cluster=Cluster.local(2), entry=f"{SELFTEST}:allreduce_check", steps=1,
                    resource_check=False).wait(timeout=60)
    assert result.results[0]["world_sum"] == 3.0


def test_resource_problems_name_each_host_and_rank() -> None:
    gpus = Cluster.mixed({"H800": 2, "H20": 2}, per_node=2)
    need = {0: 90e9, 1: 1e9, 2: 1e9, 3: 110e9}
    found = dict(resource_problems(gpus, {"node0": HostFacts(gpus=1), "node1": HostFacts(gpus=2)}, need))
    assert "rank 0" in found and "H800 device has 85.5 GB" in found["rank 0"]
    assert "rank 3" in found and "rank 1" not in found and "rank 2" not in found
    assert found["host node0"] == "runs 2 GPU ranks but has 1 CUDA devices"
    cpus = Cluster.local(40)
    found = dict(resource_problems(cpus, {"localhost": HostFacts(cpus=2, mem_available=64 * 2**30)}))
    assert found == {"host localhost": "runs 40 CPU ranks on 2 cores (at most 8 a core)"}
    # a GPU cluster emulated by CPU processes: host RAM counts, device memory and GPU count do not
    found = dict(resource_problems(gpus, {"node0": HostFacts(gpus=0, mem_available=10 * 2**30)}, need, gpu=False))
    want = (90e9 + 1e9 + 2 * preflight.WORKER_BASE_BYTES) / 1e9  # ranks 0 and 1 and two processes
    assert list(found) == ["host node0"] and f"{want:.1f} GB of RAM" in found["host node0"]


@pytest.mark.parametrize("option, value, fragment", [
    ("lr", float("nan"), "lr: must be a finite number > 0"),
    ("lr", -1.0, "lr: must be a finite number > 0"),
    ("lr", float("inf"), "lr: must be a finite number > 0"),
    ("eps", 0.0, "eps: must be a finite number > 0"),
    ("weight_decay", -0.1, "weight_decay: must be a finite number >= 0"),
    ("betas", (1.5, 0.999), "betas: must be two finite numbers in [0, 1)"),
    ("betas", (0.9,), "betas: must be two"),
    ("recompute", [7], "recompute: ranks [7] run no stage"),
    ("seq_len", 0, "seq_len: must be a whole number of tokens >= 1"),
])
def test_training_options_are_checked_before_launch(option: str, value, fragment: str) -> None:
    model = LlamaConfig.preset("tiny")
    prog, cluster = program(model, PP2, 2)
    before = set(os.listdir("/proc"))
    with pytest.raises(PlanValidationError) as info:
        launch(prog, cluster, steps=1, **{option: value})
    assert fragment in str(info.value)
    assert no_workers_started(before)


def test_launch_options_are_checked_before_launch() -> None:
    for kwargs, fragment in (({"entry": "os:system;x"}, "entry"), ({"heartbeat_s": 0}, "heartbeat_s"),
                             ({"heartbeat_s": 1.0, "stall_s": 1.0}, "at least two heartbeats"),
                             ({"timeout_s": -1}, "timeout_s"), ({"steps": -1}, "steps")):
        kw = {"entry": f"{SELFTEST}:allreduce_check", "steps": 1, **kwargs}
        with pytest.raises(PlanValidationError, match=fragment):
            launch(cluster=Cluster.local(1), **kw)


def test_size_bounds() -> None:
    from hspmd_sdk.core.annotation import Annotation
    from hspmd_sdk.core.cluster import MAX_RANKS

    with pytest.raises(PlanValidationError, match="ranks is more than"):
        Cluster.mixed({"H800": 100_000_000})
    with pytest.raises(PlanValidationError, match="whole number"):
        Cluster.mixed({"H800": 0})
    assert Cluster.local(MAX_RANKS).num_ranks == MAX_RANKS
    with pytest.raises(ValueError, match="out of range"):
        Annotation("[0-99999999] D1")
    with pytest.raises(PlanValidationError, match="out of range"):
        Strategy.load({"pipelines": [{"stages": [{"devices": [10**12], "layers": [0, 1]}], "micro_batch_size": 1,
                                      "num_micro_batches": 1}]})
