"""Where a worker computes and how its steps are timed: one GPU per worker with NCCL, or the CPU with gloo.

* :func:`backend_for_device` — ``launch(..., device="cuda")`` -> ``"nccl"``, ``device="cpu"`` -> ``"gloo"``;
  a local CUDA launch is checked before any worker starts (:func:`cuda_problems`).
* :func:`worker_device` — a worker's ``torch.device``: ``cuda:<local rank>`` (its index among the ranks on its
  host) with ``torch.cuda.set_device``, or the CPU; the error says what is missing on which host.
* :class:`StepClock` — a step's seconds: CUDA events on a GPU (the device's own clock, kernels queued
  asynchronously included), the wall clock on a CPU.

``cuda=`` arguments default to :mod:`torch.cuda`; the tests pass a stand-in to check the logic on a machine
without GPUs.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ...errors import HSPMDError, PlanValidationError

if TYPE_CHECKING:
    import torch

    from ...core.cluster import Cluster
    from ..spec import LaunchSpec

__all__ = ["backend_for_device", "cuda_problems", "worker_device", "StepClock", "DeviceError"]

DEVICES = ("cpu", "cuda")


class DeviceError(HSPMDError):
    """A worker cannot use the device it was launched for (names the rank, its host and what is missing)."""


def _torch_cuda() -> Any:
    import torch

    return torch.cuda


def cuda_problems(ranks_per_host: int, *, cuda: Any = None) -> list[tuple[str, str]]:
    """Why this machine cannot run ``ranks_per_host`` CUDA workers (one GPU each); empty when it can."""
    cuda = cuda if cuda is not None else _torch_cuda()
    if not cuda.is_available():
        return [("device", "'cuda' asks for one GPU per worker, but torch.cuda.is_available() is False on this "
                           "machine (a CPU-only torch build, or no GPU): use device='cpu'")]
    n = int(cuda.device_count())
    if n < ranks_per_host:
        return [("device", f"'cuda' needs one GPU per worker: {ranks_per_host} workers on this machine but it has "
                           f"{n} GPU(s); launch on fewer ranks per host or more hosts")]
    return []


def backend_for_device(device: str, cluster: "Cluster", backend: str | None = None, transport: Any = None) -> str:
    """The process-group backend of ``device`` (``"cuda"`` -> ``"nccl"``, ``"cpu"`` -> ``"gloo"``).

    Raises :class:`~hspmd_sdk.errors.PlanValidationError` (before any worker starts) for an unknown device, a
    ``backend`` that contradicts it, or — when every worker runs on this machine (no ``transport``, or a
    :class:`~.transport.LocalTransport`) — a CUDA launch this machine has too few GPUs for."""
    if device not in DEVICES:
        raise PlanValidationError([("device", f"must be one of {list(DEVICES)}, not {device!r}")], what="launch")
    want = "nccl" if device == "cuda" else "gloo"
    if backend is not None and backend != want:
        raise PlanValidationError([("backend", f"{backend!r} does not run device={device!r} workers here; use "
                                               f"{want!r} (or leave backend out)")], what="launch")
    if device == "cuda" and _is_local(transport):
        problems = cuda_problems(cluster.num_ranks)
        if problems:
            raise PlanValidationError(problems, what="launch")
    return want


def _is_local(transport: Any) -> bool:
    """No transport (local processes by default), or one whose workers run on this machine."""
    return transport is None or bool(getattr(transport, "local", False))


#: set by a transport that gives each worker one GPU of its own (the CUDA index it sees it at)
CUDA_INDEX_ENV = "HSPMD_CUDA_INDEX"


def worker_device(spec: "LaunchSpec", rank: int, *, cuda: Any = None) -> "torch.device":
    """This worker's ``torch.device``: the CPU under gloo; under NCCL ``cuda:<local rank>`` (the rank's index
    among the ranks of its host, :meth:`~.spec.LaunchSpec.local_rank`), made current with ``set_device``; where the
    transport gave the worker a GPU of its own (a Slurm step's ``--gres=gpu:1``: it sees only that one), the
    index it says in ``HSPMD_CUDA_INDEX``."""
    import os

    import torch

    if spec.backend != "nccl":
        return torch.device("cpu")
    cuda = cuda if cuda is not None else _torch_cuda()
    host = spec.hosts[rank]
    if not cuda.is_available():
        raise DeviceError(f"rank {rank} on {host}: the job runs on CUDA (nccl) but torch.cuda.is_available() is "
                          "False there; install a CUDA build of torch on that host, or launch with device='cpu'")
    own = os.environ.get(CUDA_INDEX_ENV)
    index, n = (int(own) if own else spec.local_rank(rank)), int(cuda.device_count())
    if own and index >= n:
        raise DeviceError(f"rank {rank} on {host} was given GPU {index} ({CUDA_INDEX_ENV}) but sees {n} GPU(s)")
    if index >= n:
        raise DeviceError(f"rank {rank} is worker {index} on {host}, which has {n} GPU(s): one GPU per worker; "
                          "put fewer ranks on that host")
    device = torch.device("cuda", index)
    cuda.set_device(device)
    return device


class StepClock:
    """Seconds of a step: ``start()`` then ``seconds()``.  On a CUDA device two CUDA events on the current
    stream (``elapsed_time`` after synchronising the end event), so work still queued on the GPU is counted; on
    the CPU ``time.perf_counter``.  ``kind`` says which (``"cuda-events"`` / ``"wall"``)."""

    def __init__(self, device: "torch.device | None" = None, *, cuda: Any = None) -> None:
        self.on_cuda = getattr(device, "type", None) == "cuda"
        self.cuda = (cuda if cuda is not None else _torch_cuda()) if self.on_cuda else None
        self.kind = "cuda-events" if self.on_cuda else "wall"
        self._t0: float | None = None
        self._event: Any = None

    def start(self) -> None:
        self._t0 = time.perf_counter()
        if self.cuda is not None:
            self._event = self.cuda.Event(enable_timing=True)
            self._event.record()

    def seconds(self) -> float | None:
        """Seconds since :meth:`start` (``None`` before it)."""
        if self._t0 is None:
            return None
        if self._event is None:
            return time.perf_counter() - self._t0
        end = self.cuda.Event(enable_timing=True)  # type: ignore[union-attr]
        end.record()
        end.synchronize()
        return float(self._event.elapsed_time(end)) / 1e3
