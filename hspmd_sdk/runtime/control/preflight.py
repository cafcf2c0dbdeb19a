"""Resource preflight: before any worker starts, what each rank will need against what its host or device has.

* :func:`training_memory` -- the bytes each rank of a :class:`~hspmd_sdk.core.specialize.Program` needs to train in
  fp32: its parameter shards with their gradients and Adam moments (16 bytes an element, exact: from the
  annotations) and the activations of the micro-batches its schedule keeps in flight (every forward tensor's local
  shape at the run's batch and sequence length).  Model-agnostic: it reads only the Program.
* :func:`resource_problems` -- every problem as ``(where, reason)``: a GPU rank whose estimate exceeds its device's
  memory, a host whose ranks (estimate plus :data:`WORKER_BASE_BYTES` a process) exceed its available RAM, more
  ranks on a host than it has GPUs, or more than :data:`MAX_RANKS_PER_CORE` CPU ranks per core.
* :func:`check_resources` raises :class:`ResourceError` listing them; ``resource_check=False`` on the launch (CLI
  ``--no-resource-check``) starts anyway.

Pure Python (no torch): facts about this machine come from ``os`` and ``/proc/meminfo``; about remote hosts from
the SSH preflight probe.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from ...core.memory import CPU_PROCESS_BASELINE_MB
from ...errors import PlanValidationError

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.specialize import Program

#: Resident memory of one worker process before any tensor (Python, torch, gloo): the core's measured CPU process
#: baseline (:data:`hspmd_sdk.core.memory.CPU_PROCESS_BASELINE_MB`), the same figure the memory estimates add.
WORKER_BASE_BYTES = int(CPU_PROCESS_BASELINE_MB * 2**20)
#: CPU ranks allowed per core of a host (oversubscription is fine for CPU tests and demos, up to a point).
MAX_RANKS_PER_CORE = 8
#: Bytes per parameter element in fp32 training: the value, its gradient, Adam's two moments.
FP32_STATE_BYTES = 16
FP32_BYTES = 4
OVERRIDE = "pass resource_check=False (CLI: --no-resource-check) to start anyway"


class ResourceError(PlanValidationError):
    """The job would not fit its hosts or devices; nothing was started."""

    def __init__(self, problems: Sequence[tuple[str, str]]) -> None:
        super().__init__([*problems, ("what to do", f"use a plan that shards more, or fewer/shorter samples; "
                                                    f"{OVERRIDE}")], what="resources")


@dataclass(frozen=True)
class HostFacts:
    """What a host offers: CPU cores, available RAM (bytes), CUDA devices (``None``: unknown)."""

    cpus: int | None = None
    mem_available: int | None = None
    gpus: int | None = None


def local_facts(*, cuda: bool = False) -> HostFacts:
    """This machine: ``os.cpu_count()``, ``MemAvailable`` from ``/proc/meminfo``, CUDA devices if ``cuda``."""
    gpus = None
    if cuda:
        try:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:  # noqa: BLE001 - no torch, no driver: unknown
            gpus = None
    return HostFacts(cpus=os.cpu_count(), mem_available=mem_available(), gpus=gpus)


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of RAM available for new processes (Linux ``MemAvailable``), ``None`` elsewhere."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def training_memory(program: "Program", *, global_batch: int, seq_len: int,
                    recompute: Sequence[int] = ()) -> dict[int, float]:
    """Estimated bytes each rank of ``program`` needs to train in fp32 (see the module docstring).

    Activations: every forward output of the rank's executable graph at ``B = global_batch``, ``S = seq_len``
    (the pipeline's rows of the batch), divided by its micro-batches and times those in flight (GPipe: all; 1F1B:
    ``stages - stage``); a ``recompute`` rank keeps one micro-batch's and, per micro-batch in flight, its largest
    tensor.  An estimate: allocator slack and kernel workspaces are not counted, so it errs on the low side."""
    bindings = {"B": int(global_batch), "S": int(seq_len)}
    out: dict[int, float] = {}
    for p, stages in enumerate(program.pipelines):
        n_micro = max(1, int(program.num_micro_batches(p)))
        for j, ranks in enumerate(stages):
            gpipe = str(getattr(program, "schedule_kind", "1f1b")).lower() == "gpipe"
            in_flight = n_micro if gpipe else min(len(stages) - j, n_micro)
            for r in ranks:
                out[r] = _rank_bytes(program, r, bindings, n_micro, in_flight, r in recompute)
    return out


def _rank_bytes(program: "Program", rank: int, bindings: Mapping[str, int], n_micro: int, in_flight: int,
                recompute: bool) -> float:
    eg = program.executable_graph(rank)
    params = set(eg.parameters)
    states = sum(_numel(program, name, rank, bindings) for name in params) * FP32_STATE_BYTES
    sizes = [_numel(program, t, rank, bindings) * FP32_BYTES / n_micro
             for op in eg.forward for t in op.outputs if t not in params]
    per_micro = sum(sizes)
    acts = per_micro + in_flight * max(sizes, default=0.0) if recompute else per_micro * in_flight
    return float(states + acts)


def _numel(program: "Program", tensor: str, rank: int, bindings: Mapping[str, int]) -> int:
    try:
        return math.prod(int(d) for d in program.local_shape(tensor, rank, bindings))
    except KeyError:  # the rank holds no shard of it (e.g. the receiving side of a Reshard)
        return 0


def resource_problems(cluster: "Cluster", facts: Mapping[str, HostFacts], memory: Mapping[int, float] | None = None,
                      *, hosts: Mapping[str, Sequence[int]] | None = None, gpu: bool | None = None
                      ) -> list[tuple[str, str]]:
    """Every way the job does not fit (see the module docstring).  ``hosts``: host -> ranks it will run (default:
    the cluster's nodes); ``facts``: per host (missing facts are not checked); ``memory``: rank -> bytes;
    ``gpu``: whether the workers run on CUDA devices (default: the ranks' device kinds; ``False`` for a GPU
    cluster emulated by CPU processes)."""
    memory = memory or {}
    if hosts is None:
        grouped: dict[str, list[int]] = {}
        for node in cluster.nodes:
            grouped.setdefault(node.host, []).extend(node.ranks)
        hosts = grouped
    out: list[tuple[str, str]] = []
    for host, ranks in hosts.items():
        f = facts.get(host, HostFacts())
        on_gpu = [r for r in ranks if (cluster.kind(r).lower() != "cpu" if gpu is None else gpu)]
        cpu = [r for r in ranks if r not in on_gpu]
        for r in on_gpu:
            cap = cluster.spec(r).memory_mb * 2**20
            if memory.get(r, 0.0) > cap:
                out.append((f"rank {r}", f"needs ~{_gb(memory[r])} (estimate) but a {cluster.kind(r)} device has "
                                         f"{_gb(cap)}"))
        if on_gpu and f.gpus is not None and len(on_gpu) > f.gpus:
            out.append((f"host {host}", f"runs {len(on_gpu)} GPU ranks but has {f.gpus} CUDA devices"))
        if cpu and f.cpus and len(cpu) > MAX_RANKS_PER_CORE * f.cpus:
            out.append((f"host {host}", f"runs {len(cpu)} CPU ranks on {f.cpus} cores (at most "
                                        f"{MAX_RANKS_PER_CORE} a core)"))
        if f.mem_available is not None:
            need = len(ranks) * WORKER_BASE_BYTES + sum(memory.get(r, 0.0) for r in cpu)
            if need > f.mem_available:
                worst = max(cpu, key=lambda r: memory.get(r, 0.0), default=None)
                detail = (f"; rank {worst} alone ~{_gb(memory[worst])}" if worst is not None and memory.get(worst)
                          else "")
                out.append((f"host {host}", f"its {len(ranks)} ranks need ~{_gb(need)} of RAM (estimate, "
                                            f"{_gb(WORKER_BASE_BYTES)} a process{detail}) but "
                                            f"{_gb(f.mem_available)} is available"))
    return out


def check_resources(cluster: "Cluster", facts: Mapping[str, HostFacts], memory: Mapping[int, float] | None = None,
                    *, hosts: Mapping[str, Sequence[int]] | None = None, gpu: bool | None = None) -> None:
    """Raise :class:`ResourceError` if the job does not fit (:func:`resource_problems`)."""
    found = resource_problems(cluster, facts, memory, hosts=hosts, gpu=gpu)
    if found:
        raise ResourceError(found)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.0f} MB"
