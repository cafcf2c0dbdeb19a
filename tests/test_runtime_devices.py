"""The CUDA path, checked without a GPU: backend choice, device placement, step timing, and the launch-time check.

This machine (and CI) has no GPU, so NCCL and CUDA kernels never run here.  What can be checked on a CPU is:
``launch(..., device="cuda")`` picks NCCL and refuses before any worker starts when this machine cannot give one
GPU per worker; a worker's device is ``cuda:<its index among its host's ranks>``, made current with
``set_device`` (a stand-in for ``torch.cuda`` records the calls); the step clock uses CUDA events on a CUDA device
and the wall clock otherwise.
"""
from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import LlamaConfig  # noqa: E402
from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk.core.specialize import specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import PlanValidationError  # noqa: E402
from hspmd_sdk.runtime.workers.devices import (DeviceError, StepClock, backend_for_device, cuda_problems,  # noqa: E402
                                       worker_device)
from hspmd_sdk.runtime.spec import LaunchSpec  # noqa: E402


class FakeCuda:
    """A stand-in for ``torch.cuda`` with ``n`` devices: records ``set_device`` and events."""

    def __init__(self, n: int, available: bool = True) -> None:
        self.n, self.available, self.current, self.events = n, available, None, []
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.t, self.synced = None, False
                fake.events.append(self)

            def record(self) -> None:
                self.t = time.perf_counter()

            def synchronize(self) -> None:
                self.synced = True

            def elapsed_time(self, end: "Event") -> float:
                assert end.synced, "elapsed_time before the end event completed"
                return (end.t - self.t) * 1e3 + 500.0  # ms; +0.5 s of "GPU work still queued"

        self.Event = Event

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return self.n

    def set_device(self, device: Any) -> None:
        self.current = device


def _spec(hosts: list[str], backend: str = "nccl") -> LaunchSpec:
    n = len(hosts)
    return LaunchSpec(job_id="t", world_size=n, ranks=list(range(n)), hosts=hosts, devices=["H100"] * n,
                      master_addr="127.0.0.1", master_port=29500, backend=backend, entry="m:f")


def test_a_worker_takes_the_gpu_of_its_local_rank() -> None:
    spec = _spec(["a", "a", "b", "b", "b"])
    cuda = FakeCuda(3)
    for rank, index in [(0, 0), (1, 1), (2, 0), (3, 1), (4, 2)]:
        device = worker_device(spec, rank, cuda=cuda)
        assert device == torch.device("cuda", index) and cuda.current == device, rank
    with pytest.raises(DeviceError, match=r"rank 4 is worker 2 on b, which has 2 GPU\(s\): one GPU per worker"):
        worker_device(spec, 4, cuda=FakeCuda(2))
    with pytest.raises(DeviceError, match="rank 1 on a: .*torch.cuda.is_available\\(\\) is False"):
        worker_device(spec, 1, cuda=FakeCuda(8, available=False))
    cpu = FakeCuda(8)
    assert worker_device(_spec(["a", "a"], backend="gloo"), 1, cuda=cpu) == torch.device("cpu")
    assert cpu.current is None  # a gloo job never touches CUDA


def test_a_worker_given_a_gpu_of_its_own_takes_that_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Slurm step with ``--gres=gpu:1`` sees only its GPU: rank 1 of a two-rank node uses cuda:0 (its local rank
    would be 1, past the one GPU it sees); an index it does not see is an error naming it."""
    from hspmd_sdk.runtime.workers.devices import CUDA_INDEX_ENV

    spec = _spec(["a", "a"])
    monkeypatch.setenv(CUDA_INDEX_ENV, "0")
    cuda = FakeCuda(1)
    assert worker_device(spec, 1, cuda=cuda) == torch.device("cuda", 0) and cuda.current == torch.device("cuda", 0)
    monkeypatch.setenv(CUDA_INDEX_ENV, "1")
    with pytest.raises(DeviceError, match=r"rank 1 on a was given GPU 1 \(HSPMD_CUDA_INDEX\) but sees 1 GPU"):
        worker_device(spec, 1, cuda=FakeCuda(1))


def test_device_picks_the_backend_and_a_local_cuda_launch_is_checked_first() -> None:
    cluster = Cluster.local(4)
    assert backend_for_device("cpu", cluster) == "gloo"
    remote = object()  # e.g. an SSH transport: the GPUs are on other hosts, each worker checks its own
    assert backend_for_device("cuda", cluster, transport=remote) == "nccl"
    with pytest.raises(PlanValidationError, match="device: must be one of"):
        backend_for_device("tpu", cluster)
    with pytest.raises(PlanValidationError, match="backend: 'gloo' does not run device='cuda'"):
        backend_for_device("cuda", cluster, "gloo", transport=remote)
    assert cuda_problems(4, cuda=FakeCuda(4)) == []
    (problem,) = cuda_problems(4, cuda=FakeCuda(2))
    assert problem[0] == "device" and "4 workers on this machine but it has 2 GPU(s)" in problem[1]
    (problem,) = cuda_problems(1, cuda=FakeCuda(0, available=False))
    assert "torch.cuda.is_available() is False" in problem[1]


def test_launch_on_cuda_without_a_gpu_starts_no_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    import hspmd_sdk.runtime.control.start as launcher  # where every worker start goes (launch_spec)
    from hspmd_sdk import launch

    specs: list = []

    def refuse(spec: Any, *args: Any, **kwargs: Any) -> None:
        specs.append(spec)
        raise RuntimeError("a worker would have started")

    monkeypatch.setattr(launcher, "launch_spec", refuse)
    config = LlamaConfig.preset("tiny")
    cluster = Cluster.local(2)
    program = specialize(config, plan_from_strategy(config, Strategy.load(
        {"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 3]}], "micro_batch_size": 8,
                        "num_micro_batches": 1}]}), cluster), cluster)
    if not torch.cuda.is_available():
        with pytest.raises(PlanValidationError, match="device: 'cuda' asks for one GPU per worker"):
            launch(program, cluster, steps=1, device="cuda", precision="bf16")
        assert specs == []
    with pytest.raises(RuntimeError, match="a worker would have started"):
        launch(program, cluster, steps=1, device="cpu")
    assert specs[-1].backend == "gloo"


def test_the_step_clock_uses_cuda_events_on_a_gpu_and_the_wall_clock_elsewhere() -> None:
    wall = StepClock(torch.device("cpu"))
    assert wall.kind == "wall" and wall.seconds() is None
    wall.start()
    time.sleep(0.02)
    assert 0.02 <= wall.seconds() < 5.0
    cuda = FakeCuda(1)
    clock = StepClock(torch.device("cuda", 0), cuda=cuda)
    assert clock.kind == "cuda-events"
    clock.start()
    took = clock.seconds()
    start, end = cuda.events
    assert end.synced and 0.5 <= took < 5.0  # the events' elapsed time, not the host's


def test_receives_are_posted_one_action_ahead_in_each_direction() -> None:
    from hspmd_sdk.core.schedule import build_schedule
    from hspmd_sdk.runtime.workers.executor import _next_receives

    actions = build_schedule("1f1b", 3, 1, 4)  # a middle stage: receives in both directions
    ahead = _next_receives(actions)
    posted = [j for later in ahead for j in later]
    receives = [j for j, a in enumerate(actions) if a.kind in ("RECV_F", "RECV_B")]
    assert sorted(posted) == receives                            # each receive posted exactly once
    for i, later in enumerate(ahead):
        for j in later:
            assert i < j or i == j == 0                           # before its own action
            same = [k for k in receives if actions[k].kind == actions[j].kind and i <= k < j]
            assert len(same) <= 1                                  # at most one earlier receive of its direction open
