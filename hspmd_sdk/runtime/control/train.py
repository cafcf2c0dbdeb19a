"""Training a specialized Program on worker processes: the public ``launch`` (launcher side).

* :func:`launch` ``(program, cluster, *, steps, seed=0, data="stdlib", lr=..., config=None) -> Job`` — the
  one public ``launch`` (``hspmd_sdk.launch`` and ``hspmd_sdk.runtime.launch``; with ``entry=`` it runs any worker
  entry, with ``hosts=`` on SSH hosts): one worker per rank; each worker receives the Program as JSON (SPEC §9), creates the process groups
  the plan's communication needs, builds its parameter shards and runs :class:`~.executor.StepExecutor` for
  ``steps`` steps.  ``Job.wait().losses`` are the per-step losses of the global batch.  A list of candidate
  Programs trains on mixed-length data (:func:`~.mixed.launch_mixed`).
* The runs a job executes (:func:`~.runs.training_run`, ``runs.start_runs``) and the worker entry
  (:func:`~.worker_entry.train_entry`) have modules of their own; :func:`~.reference.reference_training` is the
  plain single-device model trained with ``torch.optim.Adam`` on the same data: the independent reference.  The
  names stay importable from here.

Data: ``"stdlib"`` by default (the Python standard library's source, byte-level: real text on any machine,
vocabulary 256, a held-out validation split), a prepared corpus directory (``hspmd data prepare``), or
``"synthetic"`` (uniform random tokens: the loss cannot fall below ln(vocabulary); for tests); step ``s`` always
reads ``global_batch(s, ...)`` of the same seed, so every plan sees the same samples (:func:`~.data.dataset_for`).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..data import DEFAULT_DATA, dataset_for
from ..reference import ReferenceResult, assemble, load_captured, reference_training
from .runs import (checked_faults, checked_profile, checked_training_run, start_runs, recompute_ranks,
                   training_run)
from ...errors import PlanValidationError
from ..workers.devices import backend_for_device
from ..protocol import sends_parts
from .controller import StragglerWatch, TrainingController
from .growback import GrowBack

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.model_spec import ModelSpec
    from ...core.specialize import Program
    from ...core.strategy import Strategy
    from ...planner.cost import CostModel
    from ..lr_schedule import Schedule
    from ..train_config import TrainConfig
    from .job import Job

__all__ = ["launch", "recompute_ranks", "training_run", "reference_training",
           "ReferenceResult", "dataset_for", "load_captured", "assemble"]


def _launch_training(program: "Program | Strategy | Sequence[Program | Strategy]", cluster: "Cluster | None" = None,
                    *, steps: int, seed: int = 0, data: Any = None,
                    lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0, seq_len: int | None = None, recompute: Sequence[int] | None = None,
                    capture_dir: str | Path | None = None, init: str | Path | Mapping[str, Any] | None = None,
                    elastic: bool = False, straggler: bool | StragglerWatch | None = None,
                    grow_back: bool | GrowBack | None = None, cost: "CostModel | None" = None,
                    fault_injection: Sequence[Mapping[str, Any]] = (), hold_at: Sequence[int] = (),
                    checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, keep: int = 3,
                    checkpoint_async: bool = True, resume_from: str | Path | None = None,
                    precision: str = "fp32", device: str | None = None,
                    profile: int | Sequence[int] | None = None, schedule: "Schedule | dict | str | None" = None,
                    max_norm: float | None = None, eval_every: int | None = None, eval_batches: int = 4,
                    decay: str = "matrices", optimizer: str = "adam", **launch_kwargs: Any) -> "Job":
    """The training run of :func:`launch`, from its flat keywords (documented there; ``launch_kwargs`` go to
    :func:`~.launcher.launch_entry`): every option checked by type and range before anything else, then a list of
    candidate Programs trains on mixed-length data (:func:`_launch_mixed_training`), one Program under its
    :class:`~.controller.TrainingController` (:func:`_training_controller`)."""
    import time

    from .run_config import check_run_options  # lazy: tests patch run_config.check_run_options

    begun = time.monotonic()

    # every option, by type and range, before anything else (SPEC §9): one RunConfig for both forms
    mixed = isinstance(program, (list, tuple))
    if data is None and not mixed:
        data = DEFAULT_DATA
    # what both forms pass on alike: the run's optimizer, schedule, clipping, validation and checkpoints
    recipe = dict(steps=steps, seed=seed, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, precision=precision,
                  capture_dir=capture_dir, init=init, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                  keep=keep, checkpoint_async=checkpoint_async, resume_from=resume_from, schedule=schedule,
                  max_norm=max_norm, eval_every=eval_every, eval_batches=eval_batches, decay=decay,
                  optimizer=optimizer)
    check_run_options(getattr(program[0] if mixed and program else program, "model", None), mixed=mixed,
                      what="mixed-length training run" if mixed else "training run", data=data, seq_len=seq_len,
                      recompute=recompute, elastic=elastic, straggler=straggler, grow_back=grow_back, cost=cost,
                      fault_injection=fault_injection, hold_at=hold_at, device=device, **recipe, **launch_kwargs)
    if mixed:  # candidate Programs: mixed-length data (SPEC §7)
        return _launch_mixed_training(program, cluster, begun, recipe, launch_kwargs, data=data, seq_len=seq_len,
                                      recompute=recompute, profile=profile, grow_back=grow_back, device=device,
                                      cost=cost, elastic=elastic, straggler=straggler,
                                      fault_injection=fault_injection, hold_at=hold_at)
    cluster = cluster if cluster is not None else program.cluster
    run = checked_training_run(program, data=data, seq_len=seq_len, recompute=recompute, cluster=cluster, **recipe)
    if device is not None:
        launch_kwargs["backend"] = backend_for_device(device, cluster, launch_kwargs.get("backend"),
                                                      launch_kwargs.get("transport"))
    run["elastic"] = bool(elastic)
    run["faults"] = checked_faults(fault_injection, program.ranks, "the program", "training run")
    run["holds"] = sorted({int(s) for s in hold_at})
    run["profile"] = checked_profile(profile, steps)
    controller = _training_controller(program, cluster, run, elastic=elastic, straggler=straggler,
                                      grow_back=grow_back, cost=cost)
    if elastic and launch_kwargs.get("policy") is None:
        launch_kwargs["policy"] = controller
    job = start_runs([run], cluster, **launch_kwargs)
    job.prepared_s = job.started_at - begun  # option checks, specialization on the launch cluster, preflight
    job.controller = controller
    controller.attach(job)
    return job


def _launch_mixed_training(program: "Sequence[Program | Strategy]", cluster: "Cluster | None", begun: float,
                           recipe: dict[str, Any], launch_kwargs: dict[str, Any], *, data: Any,
                           seq_len: int | None, recompute: Sequence[int] | None,
                           profile: int | Sequence[int] | None, grow_back: bool | GrowBack | None,
                           device: str | None, cost: "CostModel | None", elastic: bool,
                           straggler: bool | StragglerWatch | None, fault_injection: Sequence[Mapping[str, Any]],
                           hold_at: Sequence[int]) -> "Job":
    """Train on mixed-length data (SPEC §7) under the candidate Programs ``program`` (:func:`~.mixed.launch_mixed`),
    its options checked (``recipe``: those both forms pass on); an option mixed-length training does not take yet
    is an error naming it.  ``begun``: when the launch began (``job.prepared_s`` counts from it)."""
    from .mixed import launch_mixed  # lazy: mixed-length runs only (loads the mixed planner)

    given = {"data": data, "seq_len": seq_len, "recompute": recompute, "profile": profile}
    bad = [k for k, v in given.items() if k not in ("data",) and v not in (None, False)]
    if bad:
        raise PlanValidationError([(bad[0], "is not supported with a list of candidate programs (mixed-length "
                                            "training) yet")], what="mixed-length training run")
    if device is not None:
        launch_kwargs["backend"] = backend_for_device(device, cluster or program[0].cluster,
                                                      launch_kwargs.get("backend"), launch_kwargs.get("transport"))
    job = launch_mixed(program, cluster, data="stdlib-docs" if data in (None, "synthetic") else data, cost=cost,
                       elastic=elastic, straggler=straggler, fault_injection=fault_injection, hold_at=hold_at,
                       grow_back=grow_back, _checked=True, **recipe, **launch_kwargs)
    job.prepared_s = job.started_at - begun  # checks, dispatch of the first step, specialization, preflight
    return job


def _training_controller(program: "Program", cluster: "Cluster", run: Mapping[str, Any], *, elastic: bool,
                         straggler: bool | StragglerWatch | None, grow_back: bool | GrowBack | None,
                         cost: "CostModel | None") -> TrainingController:
    """The controller of the one-Program training ``run``: its reconfigurations (``straggler=True``: a default
    :class:`~.controller.StragglerWatch`; ``grow_back=True``: a default :class:`~.growback.GrowBack`, ``None``: the
    transport's default), the run's checkpoints, and the part of the Program each worker gets (SPEC §16)."""
    watch = StragglerWatch() if straggler is True else (straggler or None)
    controller = TrainingController(program, cluster, global_batch=run["global_batch"], seq_len=run["seq_len"],
                                    elastic=bool(elastic), straggler=watch, cost=cost,
                                    grow_back=GrowBack() if grow_back is True else (grow_back or None),
                                    grow_back_default=grow_back is None,
                                    checkpoint_dir=(run.get("checkpoint") or {}).get("dir"),
                                    checkpoint_every=(run.get("checkpoint") or {}).get("every"),
                                    resumed_from=(run.get("resume") or {}).get("dir"))
    controller.parts = sends_parts(run)  # the workers get their parts (SPEC §16): switches send parts too
    return controller


def launch(program: "Program | Strategy | Sequence[Program | Strategy] | None" = None, cluster: "Cluster | None" = None,
           *, config: "TrainConfig | str | Path | None" = None, model: "ModelSpec | None" = None,
           **options: Any) -> "Job":
    """Train ``program`` (a Program, or a list of candidate Programs for mixed-length data) on ``cluster``, one
    worker process per rank: the public ``hspmd_sdk.launch`` (SPEC §3, §13).  Returns the running
    :class:`~.job.Job` (``job.wait().losses``: the loss of each step's global batch).

    ``config``: a :class:`~hspmd_sdk.runtime.train_config.TrainConfig` (or the path of its TOML / JSON file): the
    run in sections (run, data, optimizer, schedule, clip, eval, checkpoint, reconfigure, launcher).  ``options``:
    the same settings as flat keywords (``steps=``, ``lr=``, ``max_norm=``, ... below; without a config ``steps``
    is required and the others take their defaults), and what no file holds (a ``transport``, a ``policy``, a
    ``cost`` model, a state dict as ``init``, token arrays as ``data``).  A keyword and a config field that set the
    same thing to different values are an error naming it, before any worker starts.

    ``model``: with a :class:`~hspmd_sdk.core.strategy.Strategy` (or a list of them) as ``program``, the model
    config it splits: the strategy is specialized for it on ``cluster`` here.

    The optimizer is Adam (``lr``, ``betas``, ``eps``, ``weight_decay`` on the parameters ``decay`` names:
    ``"matrices"``, none on norms and biases, or ``"all"``; ``optimizer="adamw"``: decoupled weight decay), its
    learning rate by ``schedule`` (a :class:`~hspmd_sdk.runtime.lr_schedule.Schedule`, its dict or kind; default
    constant), the gradients clipped
    to the global norm ``max_norm`` (every element of the model counted once, whatever the plan; ``None``: no
    clipping).  ``eval_every``: every that many steps, the validation loss of ``eval_batches`` batches of the
    data's validation split, forward only under the running plan.  ``job.wait()`` has ``losses``, ``grad_norms``
    (before clipping), ``lrs`` and ``val_losses``.

    ``precision``: ``"fp32"`` or ``"bf16"`` (see :func:`training_run`).  ``device``: ``"cpu"`` (gloo) or
    ``"cuda"`` (NCCL, one GPU per worker: ``torch.cuda.set_device`` to the worker's local rank on its host);
    default: from the cluster's device kinds (``cpu`` kinds run on the CPU).  A local CUDA launch is checked
    before any worker starts (enough GPUs on this machine).

    The same ``seed`` gives the same data and the same initial parameters whatever the plan, so a 1-rank and an
    N-rank program of one model produce the same losses.  ``init``: a Hugging Face directory or a state dict to
    start from (see :func:`training_run`).

    Checkpoints (SPEC §5, :mod:`.checkpoint`): ``checkpoint_dir``/``checkpoint_every``/``keep``/
    ``checkpoint_async`` save sharded checkpoints; ``resume_from`` continues from one under this program, whatever
    plan and world size saved it (``job.wait().losses`` then has ``steps - s`` entries, s the checkpoint's step);
    see :func:`training_run`.

    Graph switching (SPEC §6): ``job.switch(program)`` moves the running job to another plan.  ``elastic=True``: a
    worker that dies does not end the job — the survivors replan, switch by fused BSR and redo the interrupted step
    (:mod:`.controller`); state with no surviving copy is reloaded from the newest complete checkpoint under
    ``checkpoint_dir`` in the same processes (the run goes back to its step), else the job fails naming it.
    ``grow_back`` (with ``elastic``): once it recovered, the job grows back onto the hosts it lost ranks on as soon as
    the transport says they can take workers again (:mod:`.growback`; ``job.grow`` does it on demand).  ``None``
    (default): where the transport's capacity comes back by itself (Slurm: a restarted node, a freed one; not local
    processes, whose machine a killed one did not leave); ``True`` (or a :class:`~.growback.GrowBack`, its timing): on
    every transport; ``False``: never.  ``straggler=True`` (or a :class:`~.controller.StragglerWatch`): a rank that
    stays slower than under its plan is replanned around; ``cost``: the :class:`~hspmd_sdk.planner.CostModel` those
    replans use.  ``job.events`` lists every reconfiguration.  ``fault_injection`` (for tests and demos of failures):
    ``[{"rank": r, "step": s, "at": point}]`` makes rank ``r`` SIGKILL itself at ``point`` of step ``s``
    (``"forward"``, ``"backward"``, ``"grad_sync"``, ``"optimizer"``, ``"switch"`` during a switch, or ``"end"`` after
    the last step, where an elastic job's survivors finish without recovering: every step is done), or at a point of
    the write of the checkpoint of step ``s`` (steps completed; :data:`~.checkpoint_io.WRITE_POINTS`).  ``hold_at`` (a
    test hook, for tests that race a request against the running job): ``[s, ...]`` makes every worker wait at the
    start of step ``s``, before any of its work, until ``job.release(s)``; ``job.wait_held(s)`` returns once every
    rank of the running world waits there.  A switch, grow or stop made meanwhile is heard by every rank at step
    ``s``'s commit (so it lands at a known boundary, deterministically); a kill made meanwhile lands between two
    steps.  A hold nobody releases fails the job after ``timeout_s``, naming it.  ``profile``: steps (an index or a
    list) every rank records with the torch profiler; ``job.trace()`` merges them into one Chrome/Perfetto trace and
    ``job.timeline()`` draws each rank's measured phases beside the simulator's prediction (:mod:`.trace`,
    :mod:`.timeline`).  The other keywords go to :func:`hspmd_sdk.runtime.control.launcher.launch_entry`
    (``progress``, ``echo``, ``slowdown`` — a factor or a schedule ``{rank: [(step, factor), ...]}`` —, ``timeout_s``,
    ``transport``, ``log_dir``, ...).

    Mixed-length data (SPEC §7): ``program`` may be a list of candidate Programs (``MixedPlan.programs``) with
    ``tokens_per_step=`` (and ``data=`` documents of different lengths, ``context=``, ``lookahead=``): each step
    runs under the cheapest candidate for its sequences, switching by length (:func:`~.mixed.launch_mixed`)."""
    if model is not None:
        program = _specialized(program, model, cluster)
    if config is not None:
        options = _with_config(config, program, options)
    return _launch(program, cluster, options)


def _with_config(config: "TrainConfig | str | Path",
                 program: "Program | Strategy | Sequence[Program | Strategy] | None",
                 options: dict[str, Any]) -> dict[str, Any]:
    """The keywords of the run ``config`` (a :class:`~hspmd_sdk.runtime.train_config.TrainConfig` or its file) says,
    ``options`` laid over it: those a config can hold merged into it (a keyword and a field that set the same thing
    differently is an error naming it), runtime objects as they are given.  For one Program, the mixed-length
    options are not its."""
    from ..train_config import FLAT_KEYWORDS, TrainConfig

    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_file(config)
    plain = {k: v for k, v in options.items() if k in FLAT_KEYWORDS and _plain(v)}
    others = {k: v for k, v in options.items() if k not in plain}
    flat = cfg.merged(plain).launch_kwargs()
    if not isinstance(program, (list, tuple)):  # one Program: the mixed-length options are not its
        from .run_config import MIXED_OPTIONS

        flat = {k: v for k, v in flat.items() if k not in MIXED_OPTIONS}
    return {**flat, **others}


def _launch(program: "Program | Strategy | Sequence[Program | Strategy] | None", cluster: "Cluster | None",
            options: dict[str, Any]) -> "Job":
    """Start the job: a worker entry's (``entry=``: the general launcher, :mod:`.launcher`), else the training
    run's; ``hosts=`` (with the SSH settings of :class:`~..transports.ssh.SSHTransport`) reaches remote hosts."""
    import inspect

    from ..transports.ssh import SSHTransport

    ssh_names = set(inspect.signature(SSHTransport.__init__).parameters) - {"self", "hosts"}
    ssh = {k: options.pop(k) for k in list(options) if k in ssh_names}
    hosts = options.pop("hosts", None)
    made = None
    if hosts is not None or ssh:
        if options.get("transport") is not None:
            raise PlanValidationError([("hosts", "give the SSH hosts and settings or a transport=, not both")],
                                      what="launch")
        made = options["transport"] = SSHTransport(hosts, **ssh)
    try:
        if program is None or options.get("entry") is not None:
            from .launcher import launch_entry

            return launch_entry(program, cluster, **options)
        return _launch_training(program, cluster, **options)
    except BaseException:
        if made is not None:  # nothing started: the connections go
            made.close()
        raise


def _specialized(program: "Program | Strategy | Sequence[Program | Strategy] | None", model: "ModelSpec",
                 cluster: "Cluster | None") -> "Program | list[Program] | None":
    """``program`` with every :class:`~hspmd_sdk.core.strategy.Strategy` in it specialized for ``model`` on
    ``cluster`` (Programs stay as they are)."""
    from ...core.specialize import specialize
    from ...core.strategy import Strategy
    from ...core.strategy_plan import plan_from_strategy

    def one(p: "Program | Strategy | None") -> "Program | None":
        if not isinstance(p, Strategy):
            return p
        if cluster is None:
            raise PlanValidationError([("cluster", "launch(strategy, model=...) needs the cluster to specialize the "
                                                   "strategy on")], what="training run")
        return specialize(model, plan_from_strategy(model, p, cluster), cluster)

    return [one(p) for p in program] if isinstance(program, (list, tuple)) else one(program)


def _plain(value: Any) -> bool:
    """Whether ``value`` is what a config file can hold (numbers, strings, paths, flags, lists and dicts of
    them), not a runtime object (a Documents, a state dict of tensors, a StragglerWatch)."""
    if value is None or isinstance(value, (str, int, float, bool, Path)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return hasattr(value, "model_dump") and type(value).__name__ == "Schedule"
