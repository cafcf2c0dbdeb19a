"""Starting workers (launcher side): build a :class:`~.spec.LaunchSpec` for a cluster, start one worker process
per rank through a :class:`~.transport.Transport`, return the running :class:`~.job.Job`.

:func:`start_workers` is the one function that starts workers, for every kind of job and every transport (local
processes, SSH, Slurm): :func:`hspmd_sdk.runtime.control.launcher.launch_entry`, training (:func:`~.runs.start_runs`) and the
SSH and mixed-length paths all end here.
"""
from __future__ import annotations

import os
from collections import Counter
import random
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from pydantic import ValidationError

from ...errors import HSPMDError, PlanValidationError
from .faults import FailurePolicy
from .job import Job
from ..protocol import PartPayloads
from ..spec import Backend, LaunchSpec, backend_for
from ..transports.transport import LocalTransport, Transport, free_port, is_local_host
from .preflight import check_resources
from .tensorboard import TensorBoardLogger, check_tensorboard, check_tensorboard_dir

if TYPE_CHECKING:
    from ...core.cluster import Cluster

__all__ = ["start_workers", "build_spec", "launch_spec", "hosts_of"]


def hosts_of(spec: LaunchSpec) -> dict[str, list[int]]:
    """Host -> its ranks, hosts in order of their first rank."""
    out: dict[str, list[int]] = {}
    for r, h in enumerate(spec.hosts):
        out.setdefault(h, []).append(r)
    return out


def build_spec(cluster: "Cluster", *, entry: str, steps: int = 1, seed: int = 0,
               payload: Mapping[str, Any] | None = None, timeout_s: float = 120.0,
               slowdown: Mapping[int, float] | None = None, loss_rank: int | None = None,
               backend: Backend | None = None, local: bool = True, master_port: int | None = None,
               num_threads: int | None = None, job_id: str | None = None, heartbeat_s: float = 1.0,
               stall_s: float | None = 30.0) -> LaunchSpec:
    """The spec of a job on ``cluster`` (a :class:`~hspmd_sdk.Cluster`).

    ``local``: every rank runs on this machine (hosts ``localhost``, master on loopback at a free port, CUDA device
    = rank), whatever hosts the cluster names; otherwise the master is rank 0's host.  ``backend`` defaults to
    gloo for CPU clusters and nccl for GPU clusters (pass ``"gloo"`` to emulate a GPU cluster on CPU processes).
    ``heartbeat_s``/``stall_s``: fault detection (see :class:`LaunchSpec`).  A bad value raises
    :class:`~hspmd_sdk.errors.PlanValidationError` naming the field.
    """
    n = cluster.num_ranks
    hosts = ["localhost"] * n if local else [cluster.node_of(r).host for r in range(n)]
    kinds = [cluster.kind(r) for r in range(n)]
    if local:
        master_addr, port = "127.0.0.1", master_port or free_port()
    else:
        master_addr, port = hosts[0], master_port or random.randint(20000, 40000)
    per_host = n if local else max(Counter(hosts).values())
    try:
        return LaunchSpec(
            job_id=job_id or f"{time.strftime('%H%M%S')}-{secrets.token_hex(3)}", world_size=n,
            ranks=list(range(n)), hosts=hosts, devices=kinds, master_addr=master_addr, master_port=port,
            backend=backend or backend_for(kinds), timeout_s=timeout_s, seed=seed, steps=steps, entry=entry,
            payload=dict(payload or {}), loss_rank=loss_rank,
            slowdown={int(r): (float(k) if isinstance(k, (int, float)) else [(int(a), float(b)) for a, b in k])
                      for r, k in (slowdown or {}).items()},
            num_threads=num_threads or max(1, (os.cpu_count() or 1) // per_host), heartbeat_s=heartbeat_s,
            stall_s=stall_s)
    except ValidationError as e:
        raise PlanValidationError.from_pydantic(e, what="launch") from None


def launch_spec(spec: LaunchSpec, cluster: "Cluster | None" = None, transport: Transport | None = None, *,
                log_dir: str | Path | None = None, progress: bool | None = None, echo: bool = False,
                policy: FailurePolicy | None = None) -> Job:
    """Start the workers of ``spec`` and return the running :class:`Job`.

    ``transport``: how to start workers; default :class:`LocalTransport` when every host is this machine.
    ``progress``: show a progress bar (a widget in a notebook, a line on stderr in a terminal, plain lines when
    stderr is a file or a pipe): the workers' start-up phases (processes, imports, rendezvous, build), then the
    steps; by default (``None``) in a notebook or a terminal.  ``job.startup()`` says where the start-up's time
    went.
    ``echo``: also print every worker line, prefixed by its rank, as it arrives.
    ``policy``: what the job does about a failure (:mod:`.faults`; default: stop everything, fail naming it).
    """
    if cluster is not None and cluster.num_ranks != spec.world_size:
        raise HSPMDError(f"the spec is for {spec.world_size} ranks but the cluster has {cluster.num_ranks}; "
                         "build the spec from this cluster")
    hosts = hosts_of(spec)
    if transport is None:
        remote = [h for h in hosts if not is_local_host(h)]
        if remote:
            raise HSPMDError(f"hosts {remote} are not this machine: pass transport= (e.g. an SSH transport), or "
                             "transport=LocalTransport() to run every rank on this machine")
        transport = LocalTransport()
    if isinstance(transport, LocalTransport):
        hosts = {"localhost": list(spec.ranks)}
    echo_fn = (lambda line: print(line, file=sys.stdout, flush=True)) if echo else None
    try:
        job = Job(spec, hosts, transport, log_dir=log_dir, progress=progress, echo=echo_fn, policy=policy)
    except BaseException:
        transport.close()
        raise
    return job.start()


def start_workers(cluster: "Cluster | None", *, entry: str, steps: int, seed: int = 0, payload: Mapping[str, Any] | None = None,
                  transport: Transport | None = None, slowdown: Mapping[int, Any] | None = None,
                  timeout_s: float = 120.0, loss_rank: int | None = None, backend: Backend | None = None,
                  progress: bool | None = None, echo: bool = False, log_dir: str | Path | None = None,
                  heartbeat_s: float = 1.0, stall_s: float | None = 30.0, policy: FailurePolicy | None = None,
                  resource_check: bool = True, memory_per_rank: Mapping[int, float] | None = None,
                  preflight: bool = True, tensorboard: str | Path | None = None) -> Job:
    """Run ``entry`` (``"module:function"``) on one worker process per rank of ``cluster``; the running
    :class:`Job`.  The options are :func:`hspmd_sdk.runtime.control.launcher.launch_entry`'s (which documents them): every
    transport goes the same way -- its hosts checked (``preflight``), the rendezvous where rank 0 runs, the
    resources each host reports against ``memory_per_rank``, then the workers (:func:`launch_spec`)."""
    if cluster is None:
        raise HSPMDError("launch() needs a cluster (e.g. Cluster.local(4))")
    if tensorboard is not None:
        check_tensorboard()
        check_tensorboard_dir(tensorboard)
    if transport is None:
        remote = [n.host for n in cluster.nodes if not is_local_host(n.host)]
        if remote:
            raise HSPMDError(f"hosts {remote} are not this machine: pass transport= (e.g. an SSH transport), or "
                             "transport=LocalTransport() to run every rank on this machine")
        transport = LocalTransport()
    try:
        if preflight:
            transport.preflight(cluster)
        addr, port = transport.rendezvous("localhost" if transport.local else cluster.node_of(0).host)
        spec = build_spec(cluster, entry=entry, steps=steps, seed=seed, payload=payload, timeout_s=timeout_s,
                          slowdown=slowdown, loss_rank=loss_rank, backend=backend, local=transport.local,
                          master_port=port, num_threads=transport.threads_per_worker(cluster),
                          heartbeat_s=heartbeat_s, stall_s=stall_s).model_copy(update={"master_addr": addr})
        # each worker of a training run gets its own part of the Program (SPEC §16); the launcher keeps the whole
        spec = spec.with_rank_payload(PartPayloads.of(spec.payload))
        if resource_check:
            gpu = spec.backend == "nccl"
            hosts = hosts_of(spec)
            check_resources(cluster, {h: transport.host_facts(h, cuda=gpu) for h in hosts}, memory_per_rank,
                            hosts=hosts, gpu=gpu)
    except BaseException:
        transport.close()  # nothing was started: release its connections
        raise
    job = launch_spec(spec, cluster, transport, log_dir=log_dir, progress=progress, echo=echo, policy=policy)
    if tensorboard is not None:
        TensorBoardLogger(job, tensorboard)
    return job
