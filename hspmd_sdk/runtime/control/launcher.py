"""Launching jobs (launcher side): :func:`launch_entry` runs any worker entry (or trains a Program) on a cluster,
through any transport; users reach it through the one public ``launch`` (:func:`~.train.launch`: ``entry=``,
``hosts=`` for SSH).  Every path ends in :func:`~.start.start_workers`, the one place that starts workers."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ...errors import HSPMDError
from .faults import FailurePolicy
from .job import Job
from ..spec import Backend
from .start import build_spec, hosts_of, launch_spec, start_workers
from ..transports.transport import LOCAL_NAMES, LocalTransport, Transport, free_port, is_local_host

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.specialize import Program

__all__ = ["launch_entry", "build_spec", "launch_spec", "hosts_of",
           "is_local_host", "LOCAL_NAMES", "LocalTransport", "Transport", "free_port"]


def launch_entry(program: "Program | None" = None, cluster: "Cluster | None" = None, *, steps: int, seed: int = 0, entry: str | None = None,
                 payload: Mapping[str, Any] | None = None, transport: Transport | None = None,
                 slowdown: Mapping[int, float] | None = None, timeout_s: float = 120.0, loss_rank: int | None = None,
                 backend: Backend | None = None, progress: bool | None = None, echo: bool = False,
                 log_dir: str | Path | None = None, heartbeat_s: float = 1.0, stall_s: float | None = 30.0,
                 policy: FailurePolicy | None = None, resource_check: bool = True,
                 memory_per_rank: Mapping[int, float] | None = None, preflight: bool = True,
                 tensorboard: str | Path | None = None, **run_options: Any) -> Job:
    """The general launcher: run ``entry`` (``"module:function"``) on one worker process per rank of ``cluster``.

    Each worker calls ``function(state, spec) -> dict`` with its
    :class:`~hspmd_sdk.runtime.workers.worker.WorkerState` and the :class:`~.spec.LaunchSpec` (``spec.payload`` carries
    ``payload``, ``spec.steps``/``spec.seed`` the run length and seed).  Returns the running :class:`Job`;
    ``job.wait()`` gives a result whose ``losses`` are the per-step losses the entry reported.  With ``entry``, a
    ``program`` travels in the payload as its JSON (``payload["program"]``, :meth:`Program.from_json` reads it).

    (Users call the one public ``launch`` — :func:`hspmd_sdk.runtime.control.train.launch` — which trains a Program
    without ``entry`` and comes here with one.)  ``slowdown={rank: k}`` emulates a ``k``-times slower device on that rank (CPU
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
    ``metrics.jsonl`` in its log folder.  Every transport goes the same way (:class:`~.transport.Transport`): its
    hosts checked (``preflight``: over SSH, reachable and the same versions; nothing for local processes), the
    rendezvous where rank 0 runs, the resources each host reports, then the workers (:func:`~.start.start_workers`).
    """
    if cluster is None:
        raise HSPMDError("launch() needs a cluster (e.g. Cluster.local(4))")
    if entry is None:
        raise HSPMDError("launch(): pass a Program to train, or entry='module:function' to run")
    if run_options:
        raise HSPMDError(f"launch(): {sorted(run_options)} are training options; they need no entry= (train "
                         "a Program), the entry gets its settings from payload=")
    if program is not None:
        if not callable(getattr(program, "to_json", None)):
            raise HSPMDError(f"launch(program, entry=...): a Program travels as its JSON; "
                             f"{type(program).__name__} has no to_json()")
        payload = {"program": program.to_json(), **(payload or {})}
    return start_workers(cluster, entry=entry, steps=steps, seed=seed, payload=payload, transport=transport,
                         slowdown=slowdown, timeout_s=timeout_s, loss_rank=loss_rank, backend=backend,
                         progress=progress, echo=echo, log_dir=log_dir, heartbeat_s=heartbeat_s, stall_s=stall_s,
                         policy=policy, resource_check=resource_check, memory_per_rank=memory_per_rank,
                         preflight=preflight, tensorboard=tensorboard)
