"""The runtime: worker processes, launch, jobs, and the training data.

``launch(...) -> Job`` starts one worker process per rank (:mod:`.workers.worker`), each calling an entry function
``fn(state, spec) -> dict``; ``Job.wait()`` returns a :class:`JobResult` (per-step ``losses``, per-rank results,
metrics) or raises :class:`~hspmd_sdk.errors.RuntimeFailure` naming the first failing rank.
``load_checkpoint(DIR)`` opens a sharded checkpoint (:mod:`.checkpoints`).  Transports start the workers
(:class:`LocalTransport`: local processes; :class:`SSHTransport`, :class:`SlurmTransport`).  :mod:`.data` is the
deterministic byte-level dataset, and documents of different lengths in token-budget steps (:class:`Documents`,
:class:`LengthBatches`; training on them: :mod:`.control.mixed`).

Faults (:mod:`.control.faults`, :mod:`.workers.liveness`): workers and agents beat, the job's watchdog names a rank
that stops beating or hangs outside communication while its peers wait, and a lost host as ``connection lost``;
each :class:`Failure` goes to the job's :class:`FailurePolicy` (default :class:`StopOnFailure`).  Resources are
checked before any worker starts (:mod:`.control.preflight`, :class:`ResourceError`), and so is every training
option, by type and range (:class:`RunConfig`, :func:`check_run_options`: a bad one is a ``PlanValidationError``
naming it).

The modules are split by side, one folder a side, as the processes are:

* :mod:`.control` -- the launcher's side: launch, the job, its controller and policies, preflight, progress,
  faults, grow-back, profiling, TensorBoard and timelines;
* :mod:`.workers` -- the worker's side: the entry, the training session, executor, kernels, communication,
  buckets, switch execution, parameters, liveness, devices, the rendezvous store;
* :mod:`.transports` -- local processes (and their fork server), SSH (transport, agent, hosts), Slurm;
* :mod:`.checkpoints` -- checkpoint files, manifests, their plan and lock;
* at the top, what both sides read: the protocol's values (:mod:`.protocol`), the launch spec (:mod:`.spec`),
  the data, metrics, traces and the single-device references.

The worker's side imports nothing of the launcher's side or of the transports (a test of the import graph keeps
it so): the two sides talk through the protocol's values only.

Names are imported lazily so that ``import hspmd_sdk.runtime`` does not pull in torch.
"""
from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "launch": ".control.train",
    "RunConfig": ".control.run_config",
    "TrainConfig": ".train_config",
    "Schedule": ".lr_schedule",
    "check_run_options": ".control.run_config",
    "SSHTransport": ".transports.ssh",
    "SSHHost": ".transports.hosts",
    "check_hosts": ".transports.ssh",
    "PreflightError": ".transports.ssh_probe",
    "SSHError": ".transports.hosts",
    "SlurmTransport": ".transports.slurm",
    "StepExecutor": ".workers.executor",
    "launch_spec": ".control.start",
    "build_spec": ".control.start",
    "start_workers": ".control.start",
    "free_port": ".transports.transport",
    "LaunchSpec": ".spec",
    "backend_for": ".spec",
    "Job": ".control.job",
    "JobResult": ".control.job",
    "JobStatus": ".control.job",
    "JobCancelled": ".control.job",
    "Failure": ".control.faults",
    "FailurePolicy": ".control.faults",
    "Reaction": ".control.faults",
    "StopOnFailure": ".control.faults",
    "ResourceError": ".control.preflight",
    "check_resources": ".control.preflight",
    "Transport": ".transports.transport",
    "WorkerGroup": ".transports.transport",
    "LocalTransport": ".transports.transport",
    "WorkerState": ".workers.worker",
    "StepMetrics": ".metrics",
    "load_checkpoint": ".checkpoints.checkpoint",
    "break_checkpoint_lock": ".checkpoints.checkpoint",
    "Checkpoint": ".checkpoints.checkpoint",
    "CheckpointError": ".checkpoints.checkpoint_io",
    "Documents": ".data",
    "LengthBatches": ".data",
    "length_distribution": ".data",
    "launch_mixed": ".control.mixed",
    "profile_device": ".control.profile",
    "profile_model": ".control.profile",
    "profile_link": ".control.profile",
    "collective_sweep": ".control.profile",
    "reference_mixed": ".reference",
    "reference_training": ".reference",
    "planning_summary": ".control.mixed",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
