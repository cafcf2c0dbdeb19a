"""Launching jobs: build a :class:`LaunchSpec` for a cluster, start its workers, return a :class:`Job`."""
from __future__ import annotations

import os
import random
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from pydantic import ValidationError

from ..errors import HSPMDError, PlanValidationError
from .faults import FailurePolicy
from .job import Job
from .spec import Backend, LaunchSpec, backend_for
from .transport import LocalTransport, Transport, free_port

#: Host names that mean "this machine".
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_local_host(host: str) -> bool:
    return host in LOCAL_NAMES or host == socket.gethostname()


def hosts_of(spec: LaunchSpec) -> dict[str, list[int]]:
    """Host -> its ranks, hosts in order of their first rank."""
    out: dict[str, list[int]] = {}
    for r, h in enumerate(spec.hosts):
        out.setdefault(h, []).append(r)
    return out


def build_spec(cluster: Any, *, entry: str, steps: int = 1, seed: int = 0,
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
    per_host = n if local else max(hosts.count(h) for h in set(hosts))
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


def launch_spec(spec: LaunchSpec, cluster: Any = None, transport: Transport | None = None, *,
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


def launch(program: Any = None, cluster: Any = None, *, steps: int, seed: int = 0, entry: str | None = None,
           payload: Mapping[str, Any] | None = None, transport: Transport | None = None,
           slowdown: Mapping[int, float] | None = None, timeout_s: float = 120.0, loss_rank: int | None = None,
           backend: Backend | None = None, progress: bool | None = None, echo: bool = False,
           log_dir: str | Path | None = None, heartbeat_s: float = 1.0, stall_s: float | None = 30.0,
           policy: FailurePolicy | None = None, resource_check: bool = True,
           memory_per_rank: Mapping[int, float] | None = None, preflight: bool = True,
           tensorboard: str | Path | None = None, **run_options: Any) -> Job:
    """The general launcher: run ``entry`` (``"module:function"``) on one worker process per rank of ``cluster``.

    Each worker calls ``function(state, spec) -> dict`` with its
    :class:`~hspmd_sdk.runtime.worker.WorkerState` and the :class:`LaunchSpec` (``spec.payload`` carries
    ``payload``, ``spec.steps``/``spec.seed`` the run length and seed).  Returns the running :class:`Job`;
    ``job.wait()`` gives a result whose ``losses`` are the per-step losses the entry reported.

    ``program`` without ``entry``: train it (:func:`hspmd_sdk.runtime.train.launch_training`, the default
    training entry); ``run_options`` go to it and are checked there before any worker starts (they are an error
    with ``entry``): the run (``seq_len``, ``lr``, ``betas``, ``eps``, ``weight_decay``, ``data``, ``recompute``,
    ``capture_dir``, ``init`` — Hugging Face weights or a state dict), precision and placement (``precision="bf16"``,
    ``device="cuda"``), checkpoints (``checkpoint_dir``, ``checkpoint_every``, ``keep``, ``checkpoint_async``,
    ``resume_from``: :mod:`.checkpoint`) and reconfiguration (``elastic=True``: survive a dead worker by an
    in-memory switch; ``straggler=True``: replan around a slow rank; then ``job.switch(program)`` and
    ``job.events``: :mod:`.controller`).  ``slowdown={rank: k}`` emulates a ``k``-times slower device on that rank (CPU
    demos; labelled as emulation in metrics and progress).  ``transport``: local processes by default when every
    host of the cluster is this machine.

    Faults: every worker beats every ``heartbeat_s`` seconds; a rank silent for 10 beats (stopped, frozen, its host
    cut off), or out of communication for ``stall_s`` seconds while peers wait in communication for it, is named
    as the culprit with its stack, long before the collective timeout ``timeout_s`` would end the job
    (``stall_s=None``: only silence).  ``policy``: what the job does about a failure (:mod:`.faults`; default:
    stop every worker and fail naming the culprit).

    Resources (:mod:`.preflight`) are checked before any worker starts: ``memory_per_rank`` (bytes, rank -> estimate;
    training computes it from the Program) against each GPU's memory or the host's available RAM, ranks against
    GPUs and cores.  A job that does not fit raises :class:`~.preflight.ResourceError`; ``resource_check=False``
    starts it anyway.  ``tensorboard``: a directory where the launcher writes the loss, tokens/s, each rank's step
    time and memory, and the events, for TensorBoard (:mod:`.tensorboard`); every job also writes its metrics as
    ``metrics.jsonl`` in its log folder.  Every transport goes the same way (:class:`~.transport.Transport`): its hosts checked
    (``preflight``: over SSH, reachable and the same versions; nothing for local processes), the rendezvous where
    rank 0 runs, the resources each host reports, then the workers.
    """
    if cluster is None:
        raise HSPMDError("launch() needs a cluster (e.g. Cluster.local(4))")
    if entry is None:
        if program is None:
            raise HSPMDError("launch(): pass a Program to train, or entry='module:function' to run")
        from .train import launch_training

        return launch_training(program, cluster, steps=steps, seed=seed, transport=transport, slowdown=slowdown,
                               timeout_s=timeout_s, loss_rank=loss_rank, backend=backend, progress=progress,
                               echo=echo, log_dir=log_dir, heartbeat_s=heartbeat_s, stall_s=stall_s,
                               policy=policy, resource_check=resource_check, tensorboard=tensorboard,
                               **run_options)
    if run_options:
        raise HSPMDError(f"launch(): {sorted(run_options)} are training options; they need no entry= (train "
                         "a Program), the entry gets its settings from payload=")
    if program is not None:
        payload = {"program": _program_payload(program), **(payload or {})}
    if tensorboard is not None:
        from .tensorboard import check_tensorboard

        check_tensorboard()
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
        if resource_check:
            from .preflight import check_resources

            gpu = spec.backend == "nccl"
            hosts = hosts_of(spec)
            check_resources(cluster, {h: transport.host_facts(h, cuda=gpu) for h in hosts}, memory_per_rank,
                            hosts=hosts, gpu=gpu)
    except BaseException:
        transport.close()  # nothing was started: release its connections
        raise
    job = launch_spec(spec, cluster, transport, log_dir=log_dir, progress=progress, echo=echo, policy=policy)
    if tensorboard is not None:
        from .tensorboard import TensorBoardLogger

        TensorBoardLogger(job, tensorboard)
    return job


def _program_payload(program: Any) -> Any:
    """The JSON form of a Program for ``spec.payload["program"]`` (its ``model_dump`` / ``to_json``)."""
    for name in ("model_dump", "to_json", "to_dict"):
        fn = getattr(program, name, None)
        if callable(fn):
            return fn(mode="json") if name == "model_dump" else fn()
    raise HSPMDError(f"cannot serialize {type(program).__name__} for the workers: it has no model_dump/to_json")
