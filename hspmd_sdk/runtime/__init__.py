"""The runtime: worker processes, launch, jobs, and the training data.

``launch(...) -> Job`` starts one worker process per rank (:mod:`.worker`), each calling an entry function
``fn(state, spec) -> dict``; ``Job.wait()`` returns a :class:`JobResult` (per-step ``losses``, per-rank results,
metrics) or raises :class:`~hspmd_sdk.errors.RuntimeFailure` naming the first failing rank.
``load_checkpoint(DIR)`` opens a sharded checkpoint (:mod:`.checkpoint`).  Transports start the
workers (:class:`LocalTransport`: local processes).  :mod:`.data` is the deterministic byte-level dataset, and documents of different lengths in token-budget steps
(:class:`Documents`, :class:`LengthBatches`; training on them: :mod:`.mixed`).

Faults (:mod:`.faults`, :mod:`.liveness`): workers and agents beat, the job's watchdog names a rank that stops
beating or hangs outside communication while its peers wait, and a lost host as ``connection lost``; each
:class:`Failure` goes to the job's :class:`FailurePolicy` (default :class:`StopOnFailure`).  Resources are checked
before any worker starts (:mod:`.preflight`, :class:`ResourceError`), and so is every training option, by type and
range (:class:`RunConfig`, :func:`check_run_options`: a bad one is a ``PlanValidationError`` naming it).

The modules are split by side, as the processes are: the launcher's (:mod:`.launcher`, :mod:`.train`,
:mod:`.mixed`, :mod:`.runs`, :mod:`.start`, :mod:`.job`, :mod:`.controller`, :mod:`.faults`, :mod:`.run_config`,
preflight, progress), the worker's (:mod:`.worker_entry`, :mod:`.session`, :mod:`.mixed_worker`,
:mod:`.checkpoint_worker`, the executor, kernels and communication), what both read (:mod:`.protocol`,
:mod:`.spec`, :mod:`.data`, checkpoints' files) and transports (local, SSH, Slurm); the two sides talk through the
protocol's values only (a test of the import graph keeps it so).

Names are imported lazily so that ``import hspmd_sdk.runtime`` does not pull in torch.
"""
from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "launch": ".launcher",
    "launch_training": ".train",
    "RunConfig": ".run_config",
    "check_run_options": ".run_config",
    "SSHTransport": ".ssh",
    "SSHHost": ".hosts",
    "check_hosts": ".ssh",
    "launch_remote": ".launcher",
    "launch_training_remote": ".launcher",
    "PreflightError": ".ssh",
    "SSHError": ".ssh",
    "SlurmTransport": ".slurm",
    "StepExecutor": ".executor",
    "launch_spec": ".start",
    "build_spec": ".start",
    "start_workers": ".start",
    "free_port": ".transport",
    "LaunchSpec": ".spec",
    "backend_for": ".spec",
    "Job": ".job",
    "JobResult": ".job",
    "JobStatus": ".job",
    "JobCancelled": ".job",
    "Failure": ".faults",
    "FailurePolicy": ".faults",
    "Reaction": ".faults",
    "StopOnFailure": ".faults",
    "ResourceError": ".preflight",
    "check_resources": ".preflight",
    "Transport": ".transport",
    "WorkerGroup": ".transport",
    "LocalTransport": ".transport",
    "WorkerState": ".worker",
    "StepMetrics": ".metrics",
    "load_checkpoint": ".checkpoint",
    "break_checkpoint_lock": ".checkpoint",
    "Checkpoint": ".checkpoint",
    "CheckpointError": ".checkpoint_io",
    "Documents": ".data",
    "LengthBatches": ".data",
    "length_distribution": ".data",
    "launch_mixed": ".mixed",
    "profile_device": ".profile",
    "profile_model": ".profile",
    "profile_link": ".profile",
    "collective_sweep": ".profile",
    "reference_mixed": ".reference",
    "reference_training": ".reference",
    "planning_summary": ".mixed",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
