"""Launching jobs (launcher side): :func:`launch` trains a Program or runs any worker entry on a cluster, through
any transport; :func:`launch_remote` and :func:`launch_training_remote` do the same over SSH.  Every path ends in
:func:`~.start.start_workers`, the one place that starts workers."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ...errors import HSPMDError
from .faults import FailurePolicy
from .job import Job
from ..spec import Backend
from ..transports.ssh import HostsArg, SSHTransport
from .start import build_spec, hosts_of, launch_spec, start_workers
from ..transports.transport import LOCAL_NAMES, LocalTransport, Transport, free_port, is_local_host

__all__ = ["launch", "launch_remote", "launch_training_remote", "build_spec", "launch_spec", "hosts_of",
           "is_local_host", "LOCAL_NAMES", "LocalTransport", "Transport", "free_port"]


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
    :class:`~hspmd_sdk.runtime.workers.worker.WorkerState` and the :class:`~.spec.LaunchSpec` (``spec.payload`` carries
    ``payload``, ``spec.steps``/``spec.seed`` the run length and seed).  Returns the running :class:`Job`;
    ``job.wait()`` gives a result whose ``losses`` are the per-step losses the entry reported.  With ``entry``, a
    ``program`` travels in the payload as its JSON (``payload["program"]``, :meth:`Program.from_json` reads it).

    ``program`` without ``entry``: train it (:func:`hspmd_sdk.runtime.control.train.launch_training`, the default
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
    ``metrics.jsonl`` in its log folder.  Every transport goes the same way (:class:`~.transport.Transport`): its
    hosts checked (``preflight``: over SSH, reachable and the same versions; nothing for local processes), the
    rendezvous where rank 0 runs, the resources each host reports, then the workers (:func:`~.start.start_workers`).
    """
    if cluster is None:
        raise HSPMDError("launch() needs a cluster (e.g. Cluster.local(4))")
    if entry is None:
        if program is None:
            raise HSPMDError("launch(): pass a Program to train, or entry='module:function' to run")
        from .train import launch_training  # lazy: torch (train)

        return launch_training(program, cluster, steps=steps, seed=seed, transport=transport, slowdown=slowdown,
                               timeout_s=timeout_s, loss_rank=loss_rank, backend=backend, progress=progress,
                               echo=echo, log_dir=log_dir, heartbeat_s=heartbeat_s, stall_s=stall_s,
                               policy=policy, resource_check=resource_check, tensorboard=tensorboard,
                               **run_options)
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


def launch_remote(cluster: Any, *, entry: str, steps: int, hosts: HostsArg = None, seed: int = 0,
                  payload: Mapping[str, Any] | None = None, transport: SSHTransport | None = None,
                  preflight: bool = True, timeout_s: float = 120.0, slowdown: Mapping[int, float] | None = None,
                  loss_rank: int | None = None, backend: Any = None,
                  progress: bool | None = None, echo: bool = False, log_dir: str | Path | None = None,
                  heartbeat_s: float = 1.0, stall_s: float | None = 30.0, policy: Any = None,
                  resource_check: bool = True, memory_per_rank: Mapping[int, float] | None = None,
                  **ssh_options: Any) -> Any:
    """Run ``entry`` on one worker per rank of ``cluster``, on its hosts over SSH; returns the running Job.

    Checks every host first (``preflight``) and refuses to start if any fails (:class:`PreflightError`, one line
    per host problem).  The rendezvous store is on rank 0's host, at its ``address`` and a port free there
    (or ``master_port``).  Logs per rank go to ``log_dir`` (a temporary folder by default).  ``heartbeat_s``,
    ``stall_s``, ``policy``: fault detection and reaction, as for :func:`hspmd_sdk.runtime.control.launcher.launch`; the
    launcher and every host's agent watch each other, so a host cut off from the launcher stops its workers
    within ``10 * heartbeat_s`` seconds, and the launcher reports it as ``connection lost`` with its ranks.
    ``resource_check``/``memory_per_rank``: the resource preflight against what each host's probe found (cores,
    available RAM, CUDA devices), as for a local launch.
    """
    return start_workers(cluster, entry=entry, steps=steps, seed=seed, payload=payload,
                  transport=transport or SSHTransport(hosts, **ssh_options), preflight=preflight, timeout_s=timeout_s,
                  slowdown=slowdown, loss_rank=loss_rank, backend=backend, progress=progress, echo=echo,
                  log_dir=log_dir, heartbeat_s=heartbeat_s, stall_s=stall_s, policy=policy,
                  resource_check=resource_check, memory_per_rank=memory_per_rank)


def launch_training_remote(program: Any, cluster: Any = None, *, steps: int, seed: int = 0,
                           hosts: HostsArg = None, run_options: Mapping[str, Any] | None = None,
                           **launch_kwargs: Any) -> Any:
    """Train a specialized ``program`` on ``cluster``'s hosts over SSH: :func:`hspmd_sdk.runtime.control.train.launch_training`
    (the one training path: ``job.switch``, ``elastic=``, events) with an :class:`SSHTransport` to ``hosts``.

    ``run_options``: training options (``data``, ``lr``, ``seq_len``, ``elastic``, ...); ``launch_kwargs``: the SSH
    settings of :class:`SSHTransport` and the launch options (``log_dir``, ``progress``, ``timeout_s``, ...).
    """
    import inspect

    from .train import launch_training  # lazy: torch (train)

    ssh_names = set(inspect.signature(SSHTransport.__init__).parameters) - {"self", "hosts"}
    ssh = {k: launch_kwargs.pop(k) for k in list(launch_kwargs) if k in ssh_names}
    transport = launch_kwargs.pop("transport", None) or SSHTransport(hosts, **ssh)
    try:
        return launch_training(program, cluster, steps=steps, seed=seed, transport=transport,
                               **dict(run_options or {}), **launch_kwargs)
    except BaseException:
        transport.close()
        raise
