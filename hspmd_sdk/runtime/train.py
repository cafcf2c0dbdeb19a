"""Training a specialized Program on worker processes, and the single-device reference it must match.

* :func:`launch_training` ``(program, cluster, *, steps, seed=0, data="synthetic", lr=...) -> Job`` — the public
  ``launch``: one worker per rank; each worker re-specializes the same annotation plan (every process keeps its own
  copy of the plan and its executable graph, §6.4), creates the process groups the plan's communication needs,
  builds its parameter shards and runs :class:`~.executor.StepExecutor` for ``steps`` steps.  ``Job.wait().losses``
  are the per-step losses of the global batch.
* :func:`train_entry` — the worker entry (``"hspmd_sdk.runtime.train:train_entry"``).  Its payload is a list of
  *runs* (:func:`training_run`), executed one after the other in the same processes (tests train several plans
  while paying process start-up once).
* :func:`reference_training` — the plain single-device model (:func:`hspmd_sdk.models.build_reference`) trained
  with ``torch.optim.Adam`` on the same data: the independent reference.

Data: ``"synthetic"`` (uniform random tokens of the model's vocabulary) or ``"stdlib"`` (bytes of the Python
standard library, vocabulary 256); step ``s`` always reads ``global_batch(s, ...)`` of the same seed, so every plan
sees the same samples.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..core.slices import box_numel

__all__ = ["launch", "launch_training", "launch_runs", "recompute_ranks", "training_run", "train_entry",
           "reference_training", "ReferenceResult", "dataset_for", "load_captured", "assemble"]

ENTRY = "hspmd_sdk.runtime.train:train_entry"

#: ``precision=`` choices (SPEC §8); the executor's :data:`~.executor.PRECISIONS` maps them to dtypes.
PRECISIONS = ("fp32", "bf16")


# ---- the launcher side --------------------------------------------------------------------------------------
def training_run(program: Any, *, steps: int, seed: int = 0, data: str = "synthetic", lr: float = 1e-3,
                 betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 seq_len: int | None = None, recompute: Sequence[int] | None = None,
                 capture_dir: str | Path | None = None, cluster: Any = None, init: Any = None,
                 checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, keep: int = 3,
                 checkpoint_async: bool = True, resume_from: str | Path | None = None,
                 precision: str = "fp32") -> dict[str, Any]:
    """The JSON description of one training run of ``program`` (what a worker needs to rebuild it).

    ``seq_len``: tokens per sample (default: the model's ``max_seq_len``); the global batch is the program's
    ``B`` (the strategy's samples per step).  ``recompute``: ranks that recompute activations in backward
    (default: the program's — the strategy's stages marked ``recompute``).  ``capture_dir``: each rank saves its
    synchronised gradients of step 0 and its final parameter shards there (``run<i>_rank<r>.pt``, for
    :func:`load_captured`).  ``init``: start from these weights instead of the seeded initialisation — a Hugging
    Face directory (``config.json`` + ``model.safetensors``) or a state dict (names = the model's); each rank
    reads only its own slices (:mod:`hspmd_sdk.models.hf`).  ``precision``: ``"fp32"`` (default) or ``"bf16"``
    (SPEC §8: bf16 parameters, activations, gradients and messages; fp32 master weights and Adam state; see
    :class:`~.executor.StepExecutor`).

    Checkpoints (:mod:`.checkpoint`): ``checkpoint_dir`` saves the sharded parameters, Adam state, data position
    and RNG after every ``checkpoint_every``-th step and after the last (only after the last by default), keeping
    the newest ``keep``; ``checkpoint_async`` writes in the background (the step waits only for copies of the
    shards).  ``resume_from``: a checkpoint root (its latest complete checkpoint) or one step directory to continue
    from, under this program whatever plan and world size saved it: the run executes steps ``s .. steps-1``.

    The run is checked here, before any worker starts: every option by type and range first
    (:class:`~.run_config.RunConfig`: ``steps`` a whole number >= 1, ``seed`` in ``[0, 2**32)``, ``seq_len`` at
    most what a learned position table embeds, the optimizer options, a known ``data`` source for the model's
    vocabulary, ...), then (:func:`_validate_run`) the ranks of ``recompute``, every rank of the program in
    ``cluster``, the init weights against the model, and the plan specialized once, as each worker
    will, against ``cluster``.  A bad run raises :class:`~hspmd_sdk.errors.PlanValidationError` naming the field."""
    from .run_config import check_run_options  # types and ranges first: nothing below rounds or parses a value

    check_run_options(_model_of(program), steps=steps, seed=seed, data=data, lr=lr, betas=betas, eps=eps,
                      weight_decay=weight_decay, seq_len=seq_len, recompute=recompute, capture_dir=capture_dir,
                      init=init, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, keep=keep,
                      checkpoint_async=checkpoint_async, resume_from=resume_from, precision=precision)
    return checked_training_run(program, steps=steps, seed=seed, data=data, lr=lr, betas=betas, eps=eps,
                                weight_decay=weight_decay, seq_len=seq_len, recompute=recompute,
                                capture_dir=capture_dir, cluster=cluster, init=init, checkpoint_dir=checkpoint_dir,
                                checkpoint_every=checkpoint_every, keep=keep, checkpoint_async=checkpoint_async,
                                resume_from=resume_from, precision=precision)


def _model_of(program: Any) -> Any:
    from ..errors import PlanValidationError

    config = getattr(program, "model", None)
    if config is None:
        raise PlanValidationError([("program", "was specialized from a bare graph; launch needs a Program "
                                               "specialized from a model config (specialize(LlamaConfig..., plan, "
                                               "cluster)) so that workers can rebuild the model")],
                                  what="training run")
    return config


def checked_training_run(program: Any, *, steps: int, seed: int = 0, data: str = "synthetic", lr: float = 1e-3,
                         betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                         seq_len: int | None = None, recompute: Sequence[int] | None = None,
                         capture_dir: str | Path | None = None, cluster: Any = None, init: Any = None,
                         checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None,
                         keep: int = 3, checkpoint_async: bool = True, resume_from: str | Path | None = None,
                         precision: str = "fp32") -> dict[str, Any]:
    """:func:`training_run` for options that :func:`~.run_config.check_run_options` has already checked (each
    launch checks them once, first): the checks that need the program and the cluster, then the run."""
    from ..core.model_spec import model_json
    from ..errors import PlanValidationError
    from ..models.registry import class_path

    config = _model_of(program)
    plan = program.plan
    cluster = cluster if cluster is not None else program.cluster
    if cluster is None:
        raise PlanValidationError([("cluster", "launch needs a cluster: pass cluster= or specialize with one")],
                                  what="training run")
    rc = sorted(program.recompute) if recompute is None else sorted(int(r) for r in recompute)
    run = {
        "config": model_json(config),
        "model_class": class_path(config),
        "plan": plan.model_dump(mode="json"),
        "cluster": cluster.model_dump(mode="json"),
        "bindings": dict(program.bindings),
        "steps": int(steps), "seed": int(seed), "data": data,
        "seq_len": int(config.max_seq_len if seq_len is None else seq_len),
        "global_batch": int(program.bindings["B"]),
        "adam": {"lr": lr, "betas": list(betas) if isinstance(betas, (list, tuple)) else betas, "eps": eps,
                 "weight_decay": weight_decay},
        "recompute": rc,
        "capture_dir": str(capture_dir) if capture_dir is not None else None,
        "init": _init_source(init, config),
        "precision": precision,
    }
    # the Program as the workers get it: its JSON (SPEC §9), specialized on the launch cluster
    run["program"] = _validate_run(run, program, cluster, config).to_json()
    if resume_from is not None and init is not None:
        raise PlanValidationError([("init", "resume_from= already gives the weights (and the optimizer state); "
                                            "pass one of init= and resume_from=")], what="training run")
    from .checkpoint import run_fields

    run.update(run_fields(run, program, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                          keep=keep, checkpoint_async=checkpoint_async, resume_from=resume_from))
    from .preflight import training_memory  # what each rank will need, for the launcher's resource preflight

    run["memory_estimate"] = {str(r): b for r, b in training_memory(
        program, global_batch=run["global_batch"], seq_len=run["seq_len"], recompute=run["recompute"]).items()}
    return run


def _validate_run(run: Mapping[str, Any], program: Any, cluster: Any, config: Any) -> Any:
    """Raise :class:`~hspmd_sdk.errors.PlanValidationError` for a run that would fail only in the workers: what
    needs the program and the cluster (each option's type and range, the data source and the model's position
    limit were checked first, by :func:`~.run_config.check_run_options`).  Returns the Program the workers run:
    ``program`` itself when it was specialized for ``cluster``, else its plan specialized on ``cluster``."""
    from ..errors import HSPMDError, PlanValidationError

    what = "training run"
    problems = []
    unknown = sorted(set(run["recompute"]) - set(program.ranks))
    if unknown:
        problems.append(("recompute", f"ranks {unknown} run no stage of the program (ranks {sorted(program.ranks)})"))
    outside = sorted(r for r in program.ranks if not 0 <= r < cluster.num_ranks)
    if outside:
        problems.append(("cluster", f"the program uses ranks {outside} but the cluster has only "
                                    f"{cluster.num_ranks} (0..{cluster.num_ranks - 1}); launch it on the cluster it "
                                    "was specialized for"))
    if problems:
        raise PlanValidationError(problems, what=what)
    if program.cluster is not None and program.cluster == cluster and program._resolver is None:
        return program
    try:  # specialized for another cluster: the plan on the launch cluster, once, here
        again = _program_of({k: v for k, v in run.items() if k != "program"})
    except (HSPMDError, ValueError) as e:
        raise PlanValidationError([("plan", f"does not specialize on the launch cluster: {e}")], what=what) from e
    if sorted(again.ranks) != sorted(program.ranks):
        raise PlanValidationError([("cluster", f"the plan specialized on the launch cluster uses ranks "
                                               f"{sorted(again.ranks)}, not the program's {sorted(program.ranks)}")],
                                  what=what)
    return again


def launch_runs(runs: Sequence[Mapping[str, Any]], cluster: Any, **launch_kwargs: Any) -> Any:
    """Start one job that executes ``runs`` (from :func:`training_run`) one after the other on ``cluster``'s
    ranks (ranks a run's program does not use sit it out).  Each rank's result is ``{"runs": [...]}``.

    Every run must have been built (and so checked) for this ``cluster``."""
    from ..errors import PlanValidationError
    from .launcher import launch

    if not runs:
        raise PlanValidationError([("runs", "no run to launch")], what="training job")
    want = cluster.model_dump(mode="json")
    wrong = [(f"runs[{i}].cluster", "was built for another cluster than the launch cluster; "
                                    "pass training_run(..., cluster=<the launch cluster>)")
             for i, r in enumerate(runs) if r.get("cluster") != want]
    if wrong:
        raise PlanValidationError(wrong, what="training job")

    total = sum(int(r["steps"]) for r in runs)
    memory: dict[int, float] = {}  # the runs follow one another: a rank needs the most any run needs
    for r in runs:
        for rank, need in (r.get("memory_estimate") or {}).items():
            memory[int(rank)] = max(memory.get(int(rank), 0.0), float(need))
    launch_kwargs.setdefault("memory_per_rank", memory)
    from .checkpoint_lock import launch_holding_locks  # a checkpoint_dir is one job's at a time

    return launch_holding_locks(runs, lambda: launch(None, cluster, steps=total, seed=int(runs[0]["seed"]) if runs
                                                     else 0, entry=ENTRY, payload={"runs": [dict(r) for r in runs]},
                                                     **launch_kwargs))


def launch_training(program: Any, cluster: Any = None, *, steps: int, seed: int = 0, data: str = "synthetic",
                    lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0, seq_len: int | None = None, recompute: Sequence[int] | None = None,
                    capture_dir: str | Path | None = None, init: Any = None, elastic: bool = False,
                    straggler: Any = None, grow_back: Any = None, cost: Any = None,
                    fault_injection: Sequence[Mapping[str, Any]] = (),
                    checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, keep: int = 3,
                    checkpoint_async: bool = True, resume_from: str | Path | None = None,
                    precision: str = "fp32", device: str | None = None,
                    profile: int | Sequence[int] | None = None, **launch_kwargs: Any) -> Any:
    """Train ``program`` for ``steps`` steps on one worker process per rank of ``cluster``; returns the running
    :class:`~.job.Job` (``job.wait().losses``: the loss of each step's global batch).

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

    Graph switching (SPEC §6): ``job.switch(program)`` moves the running job to another plan.  ``elastic=True``:
    a worker that dies does not end the job — the survivors replan, switch by fused BSR and redo the interrupted
    step (:mod:`.controller`); state with no surviving copy is reloaded from the newest complete checkpoint under
    ``checkpoint_dir`` in the same processes (the run goes back to its step), else the job fails naming it.
    ``grow_back`` (with ``elastic``): once it recovered, the job grows back onto the hosts it lost ranks on as soon
    as the transport says they can take workers again (:mod:`.growback`; ``job.grow`` does it on demand).  ``None``
    (default): where the transport's capacity comes back by itself (Slurm: a restarted node, a freed one; not
    local processes, whose machine a killed one did not leave); ``True`` (or a :class:`~.growback.GrowBack`, its
    timing): on every transport; ``False``: never.  ``straggler=True`` (or a :class:`~.controller.StragglerWatch`): a rank that stays
    slower than under its plan is replanned around; ``cost``: the :class:`~hspmd_sdk.planner.CostModel` those
    replans use.  ``job.events`` lists every reconfiguration.  ``fault_injection`` (for tests and demos of
    failures): ``[{"rank": r, "step": s, "at": point}]`` makes rank ``r`` SIGKILL itself at ``point`` of step ``s``
    (``"forward"``, ``"backward"``, ``"grad_sync"``, ``"optimizer"``, or ``"switch"`` during a switch), or at a
    point of the write of the checkpoint of step ``s`` (steps completed; :data:`~.checkpoint_io.WRITE_POINTS`).
    ``profile``: steps (an index or a list) every rank records with the torch profiler; ``job.trace()`` merges
    them into one Chrome/Perfetto trace and ``job.timeline()`` draws each rank's measured phases beside the
    simulator's prediction (:mod:`.trace`, :mod:`.timeline`).  ``launch_kwargs`` go to
    :func:`hspmd_sdk.runtime.launcher.launch` (``progress``, ``echo``, ``slowdown`` — a factor or a schedule
    ``{rank: [(step, factor), ...]}`` —, ``timeout_s``, ``transport``, ``log_dir``, ...).

    Mixed-length data (SPEC §7): ``program`` may be a list of candidate Programs (``MixedPlan.programs``) with
    ``tokens_per_step=`` (and ``data=`` documents of different lengths, ``context=``, ``lookahead=``): each step
    runs under the cheapest candidate for its sequences, switching by length (:func:`~.mixed.launch_mixed`)."""
    import time

    from .controller import StragglerWatch, TrainingController
    from .growback import GrowBack
    from .devices import backend_for_device
    from .run_config import check_run_options

    begun = time.monotonic()

    # every option, by type and range, before anything else (SPEC §9): one RunConfig for both forms
    mixed = isinstance(program, (list, tuple))
    check_run_options(getattr(program[0] if mixed and program else program, "model", None), mixed=mixed,
                      what="mixed-length training run" if mixed else "training run", steps=steps, seed=seed,
                      data=data, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, seq_len=seq_len,
                      recompute=recompute, capture_dir=capture_dir, init=init, elastic=elastic, straggler=straggler,
                      grow_back=grow_back, cost=cost, fault_injection=fault_injection, checkpoint_dir=checkpoint_dir,
                      checkpoint_every=checkpoint_every, keep=keep, checkpoint_async=checkpoint_async,
                      resume_from=resume_from, precision=precision, device=device, **launch_kwargs)
    if mixed:  # candidate Programs: mixed-length data (SPEC §7)
        from .mixed import launch_mixed

        given = {"data": data, "seq_len": seq_len, "recompute": recompute, "straggler": straggler,
                 "profile": profile, "grow_back": grow_back}
        default = {"data": "synthetic"}
        bad = [k for k, v in given.items() if k not in ("data",) and v not in (None, False, default.get(k))]
        if bad:
            from ..errors import PlanValidationError

            raise PlanValidationError([(bad[0], "is not supported with a list of candidate programs (mixed-length "
                                                "training) yet")], what="mixed-length training run")
        if device is not None:
            launch_kwargs["backend"] = backend_for_device(device, cluster or program[0].cluster,
                                                          launch_kwargs.get("backend"), launch_kwargs.get("transport"))
        job = launch_mixed(program, cluster, steps=steps, seed=seed,
                           data="stdlib-docs" if data == "synthetic" else data, lr=lr, betas=betas, eps=eps,
                           weight_decay=weight_decay, precision=precision, cost=cost, capture_dir=capture_dir,
                           checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, keep=keep,
                           checkpoint_async=checkpoint_async, resume_from=resume_from, init=init,
                           elastic=elastic, fault_injection=fault_injection, _checked=True, **launch_kwargs)
        job.prepared_s = job._t0 - begun  # checks, dispatch of the first step, specialization, preflight
        return job
    cluster = cluster if cluster is not None else program.cluster
    run = checked_training_run(program, steps=steps, seed=seed, data=data, lr=lr, betas=betas, eps=eps,
                       weight_decay=weight_decay, seq_len=seq_len, recompute=recompute, capture_dir=capture_dir,
                       cluster=cluster, init=init, checkpoint_dir=checkpoint_dir,
                       checkpoint_every=checkpoint_every, keep=keep, checkpoint_async=checkpoint_async,
                       resume_from=resume_from, precision=precision)
    if device is not None:
        launch_kwargs["backend"] = backend_for_device(device, cluster, launch_kwargs.get("backend"),
                                                      launch_kwargs.get("transport"))
    run["elastic"] = bool(elastic)
    run["faults"] = checked_faults(fault_injection, program.ranks, "the program", "training run")
    run["profile"] = checked_profile(profile, steps)
    watch = StragglerWatch() if straggler is True else (straggler or None)
    controller = TrainingController(program, cluster, global_batch=run["global_batch"], seq_len=run["seq_len"],
                                    elastic=bool(elastic), straggler=watch, cost=cost,
                                    grow_back=GrowBack() if grow_back is True else (grow_back or None),
                                    grow_back_default=grow_back is None,
                                    checkpoint_dir=(run.get("checkpoint") or {}).get("dir"),
                                    checkpoint_every=(run.get("checkpoint") or {}).get("every"),
                                    resumed_from=(run.get("resume") or {}).get("dir"))
    if elastic and launch_kwargs.get("policy") is None:
        launch_kwargs["policy"] = controller
    job = launch_runs([run], cluster, **launch_kwargs)
    job.prepared_s = job._t0 - begun  # option checks, specialization on the launch cluster, preflight
    job.controller = controller
    controller.attach(job)
    return job


def checked_faults(faults: Sequence[Mapping[str, Any]], ranks: Sequence[int], whose: str,
                   what: str) -> list[dict[str, Any]]:
    """``fault_injection`` (tests and demos of failures), each at a known point of a step on one of ``ranks``
    (``whose`` ranks, for the message), as the workers take it; else a
    :class:`~hspmd_sdk.errors.PlanValidationError` naming the first bad one."""
    from ..errors import PlanValidationError
    from .checkpoint_io import WRITE_POINTS

    points = {"forward", "backward", "grad_sync", "optimizer", "switch", *WRITE_POINTS}

    def known(f: Mapping[str, Any]) -> bool:  # a switch may also be a grow's, whose newcomers get the next ranks
        rank = int(f.get("rank", -1))
        return rank in set(ranks) or (f.get("at") == "switch" and rank > max(ranks, default=-1))

    bad = [f for f in faults if f.get("at") not in points or not known(f)]
    if bad:
        raise PlanValidationError([("fault_injection", f"{bad[0]}: 'at' must be one of {sorted(points)} and 'rank' "
                                                       f"a rank of {whose} (at 'switch': or of a newcomer the job "
                                                       "grows onto)")], what=what)
    return [dict(f) for f in faults]


def checked_profile(profile: int | Sequence[int] | None, steps: int) -> list[int]:
    """``profile=`` as the workers take it: the sorted steps to record, each in ``[0, steps)``; else a
    :class:`~hspmd_sdk.errors.PlanValidationError` naming the bad one."""
    from ..errors import PlanValidationError

    if profile is None:
        return []
    given = [profile] if isinstance(profile, int) and not isinstance(profile, bool) else profile
    try:
        chosen = list(given)  # type: ignore[arg-type]
    except TypeError:
        chosen = [profile]
    bad = [s for s in chosen if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < steps]
    if bad:
        raise PlanValidationError([("profile", f"{bad[0]!r} is not a step of this run: pass step indices in "
                                               f"0..{steps - 1} (an int or a list)")], what="training run")
    return sorted(set(chosen))


def recompute_ranks(strategy: Any) -> list[int]:
    """Ranks of the stages a :class:`~hspmd_sdk.core.strategy.Strategy` marks ``recompute`` (for ``recompute=``)."""
    return sorted(r for p in strategy.pipelines for s in p.stages if s.recompute for r in s.devices)


# ---- the worker side ----------------------------------------------------------------------------------------
def dataset_for(data: Any, vocab_size: int) -> Any:
    """The token source of a run: ``"synthetic"`` or ``"stdlib"`` (needs a vocabulary of at least 256), or a
    mixed-length source (:func:`~.mixed.data_spec`: :class:`~.data.LengthBatches`)."""
    from .data import VOCAB_SIZE, StdlibBytes, SyntheticTokens

    if isinstance(data, Mapping) and data.get("kind") == "mixed":
        from .mixed import batches_of

        return batches_of(data)
    if data == "synthetic":
        return SyntheticTokens(vocab_size)
    if data == "stdlib":
        if vocab_size < VOCAB_SIZE:
            raise ValueError(f"data='stdlib' is byte-level (256 tokens) but the model's vocabulary has {vocab_size}")
        return StdlibBytes()
    raise ValueError(f"data must be 'synthetic' or 'stdlib', not {data!r}")


def train_entry(state: Any, spec: Any) -> dict[str, Any]:
    """Worker entry: run every run of ``spec.payload["runs"]`` in order (a :class:`~.session.TrainSession`
    each); returns ``{"runs": [...], "losses"}``."""
    from .session import TrainSession

    results, offset = [], 0
    for i, run in enumerate(spec.payload["runs"]):
        if run.get("mixed"):  # mixed-length data: per-step plans (SPEC §7)
            from .mixed import MixedSession

            results.append(MixedSession(state, run, i, offset).train())
        else:
            results.append(TrainSession(state, run, i, offset).train())
        offset += int(run["steps"])
        if results[-1].get("stopped_at") is not None:  # Job.stop(): the runs after it do not start
            break
    return {"runs": results, "losses": results[0]["losses"] if len(results) == 1 else None}


def _program_of(run: Mapping[str, Any]) -> Any:
    """The run's Program: read from its JSON (``run["program"]``, how a launcher sends it), or specialized from
    the run's model, plan and cluster (a run built without one)."""
    from ..core.cluster import Cluster
    from ..core.plan import AnnotationPlan
    from ..core.specialize import Program, specialize
    from ..models.registry import model_from_class

    if run.get("program") is not None:
        return Program.from_json(run["program"])

    config = model_from_class(run.get("model_class"), run["config"])
    plan = AnnotationPlan.model_validate(run["plan"])
    cluster = Cluster.model_validate(run["cluster"])
    return specialize(config, plan, cluster, bindings=run.get("bindings"))


def _init_source(init: Any, config: Any) -> dict[str, Any] | None:
    """The JSON form of ``init=`` for the workers: a Hugging Face directory, checked against the model here (a
    state dict is written to a temporary safetensors file first, so that no worker ever receives it whole)."""
    if init is None:
        return None
    from ..models.hf import init_directory

    return {"hf": str(init_directory(init, config))}


def _initial_shards(program: Any, rank: int, init: Mapping[str, Any] | None) -> Any:
    """This rank's parameter shards read from the run's ``init`` (``None``: the seeded initialisation)."""
    if not init:
        return None
    from ..models.hf import shard_reader
    from .params import load_local_parameters

    return load_local_parameters(program, rank, shard_reader(init["hf"], program.model))


# ---- checkpoint hooks (:mod:`.checkpoint`; called by :class:`~.session.TrainSession`) -------------------------
def _resume_point(run: Mapping[str, Any]) -> tuple[int, int]:
    """``(first step, Adam updates done)`` of a run: the resumed checkpoint's, else ``(0, 0)``."""
    resume = run.get("resume")
    return (int(resume["step"]), int(resume["optimizer_step"])) if resume else (0, 0)


def _initial_state(program: Any, rank: int, run: Mapping[str, Any]) -> tuple[Any, Any, dict[str, Any] | None]:
    """``(params, optimizer_state, resume stats)`` of this rank: read from the resumed checkpoint (its RNG state
    restored too), else the ``init`` weights or the seeded initialisation and a fresh optimizer."""
    resume = run.get("resume")
    if not resume:
        return _initial_shards(program, rank, run.get("init")), None, None
    from .checkpoint_worker import load_resume, restore_rng

    params, opt_state, stats = load_resume(resume, program, rank)
    stats["rng_restored"] = restore_rng(resume, rank)
    return params, opt_state, stats


def _checkpoint_saver(state: Any, run: Mapping[str, Any], index: int) -> Any:
    """The run's :class:`~.checkpoint_worker.CheckpointSaver`, or ``None`` without ``checkpoint_dir``."""
    if not run.get("checkpoint"):
        return None
    from .checkpoint_worker import CheckpointSaver

    return CheckpointSaver(state, run, index)


def _memory_summary(ex: Any, program: Any, rank: int) -> dict[str, Any]:
    """Bytes of the rank's parameters, of its Adam state, and of its shards by the annotations."""
    import torch

    from .params import parameter_bytes, shard_box

    return {"param_bytes": parameter_bytes(ex.params),
            "optimizer_bytes": sum(t.numel() * t.element_size() for st in ex.optimizer.state.values()
                                   for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0),
            "shard_bytes": sum(4 * box_numel(shard_box(program, n, rank)) for n in ex.params),
            "pipeline": ex.pipeline, "stage": ex.stage, "micro_batches": [ex.num_micro, ex.micro_size]}


def _save_capture(ex: Any, program: Any, rank: int, path: Path) -> None:
    """Save the rank's synchronised gradients of step 0, its final parameter shards and their boxes."""
    import torch

    from .params import shard_box

    path.parent.mkdir(parents=True, exist_ok=True)
    opt = ex.optimizer_state()
    torch.save({"grads": {k: v.cpu() for k, v in (ex.captured_grads or {}).items()},
                "params": {k: v.detach().cpu().clone() for k, v in ex.params.items()},
                "exp_avg": {k: st["exp_avg"].detach().cpu().clone() for k, st in opt.items() if "exp_avg" in st},
                "exp_avg_sq": {k: st["exp_avg_sq"].detach().cpu().clone() for k, st in opt.items()
                               if "exp_avg_sq" in st},
                "optimizer_step": {k: st.get("step") for k, st in opt.items()},
                "boxes": {k: shard_box(program, k, rank) for k in ex.params}}, path)




# ---- captured shards -> full tensors ------------------------------------------------------------------------
def load_captured(capture_dir: str | Path, index: int = 0) -> list[dict[str, Any]]:
    """Every rank's saved shards of run ``index`` (``{"grads", "params", "exp_avg", "exp_avg_sq",
    "optimizer_step", "boxes"}`` each)."""
    import torch

    return [torch.load(p, map_location="cpu") for p in sorted(Path(capture_dir).glob(f"run{index}_rank*.pt"))]


def assemble(captured: Sequence[Mapping[str, Any]], which: str, shapes: Mapping[str, Sequence[int]]
             ) -> tuple[dict[str, Any], float]:
    """Full tensors from the ranks' shards (``which``: ``"grads"``, ``"params"``, ``"exp_avg"`` or
    ``"exp_avg_sq"``) and the largest difference
    between two ranks' copies of the same element (replicas must agree)."""
    import torch

    full = {n: torch.full(tuple(s), float("nan")) for n, s in shapes.items()}
    worst = 0.0
    for cap in captured:
        for name, t in cap[which].items():
            idx = tuple(slice(a, b) for a, b in cap["boxes"][name])
            cur = full[name][idx]
            seen = ~torch.isnan(cur)
            if seen.any():
                worst = max(worst, float((cur[seen] - t[seen]).abs().max()))
            full[name][idx] = t
    return full, worst


# ---- the single-device reference ----------------------------------------------------------------------------
@dataclass
class ReferenceResult:
    """Losses per step, the gradients of step 0, the parameters and Adam moments after the last step (full
    tensors)."""

    losses: list[float]
    grads: dict[str, Any]
    params: dict[str, Any]
    exp_avg: dict[str, Any] = field(default_factory=dict)
    exp_avg_sq: dict[str, Any] = field(default_factory=dict)


def reference_training(config: Any, *, steps: int, seed: int = 0, global_batch: int, seq_len: int | None = None,
                       data: str = "synthetic", lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999),
                       eps: float = 1e-8, weight_decay: float = 0.0,
                       init: Mapping[str, Any] | None = None, precision: str = "fp32") -> ReferenceResult:
    """Train the model's single-device reference (``config.build_reference``) on one device with
    ``torch.optim.Adam`` (:meth:`~.executor.AdamConfig.build`: the ranks' kernel) on the same data (``config``
    is any :class:`~hspmd_sdk.models.ModelSpec`).
    ``init``: a state dict to start from instead of the seeded initialisation.

    ``precision="bf16"``: the distributed runtime's recipe on one device — a bf16 copy of the fp32 master module
    computes the step (bf16 parameters, activations and gradients, the loss in fp32), its gradients become the
    masters' (fp32) and Adam updates the masters with fp32 state.  ``grads`` and ``params`` are the masters'."""
    import copy

    import torch

    from .executor import AdamConfig

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, not {precision!r}")
    seq_len = int(seq_len or config.max_seq_len)
    model = config.build_reference(seed)
    if init is not None:
        model.load_state_dict({k: v.detach().clone() for k, v in init.items()})
    work = model if precision == "fp32" else copy.deepcopy(model).to(torch.bfloat16)
    masters, copies = list(model.parameters()), list(work.parameters())
    opt = AdamConfig(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay).build(masters)
    dataset = dataset_for(data, config.vocab_size)
    losses, grads = [], {}
    for step in range(steps):
        feeds = config.feeds(dataset.global_batch(step, global_batch, seq_len, seed))
        opt.zero_grad(set_to_none=True)
        if work is not model:
            with torch.no_grad():
                for c, m in zip(copies, masters):
                    c.copy_(m)
                    c.grad = None
        loss = work.loss(feeds["tokens"], feeds["targets"])
        loss.backward()
        if work is not model:
            for c, m in zip(copies, masters):
                m.grad = c.grad.float() if c.grad is not None else torch.zeros_like(m)
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    return reference_result(model, opt, losses, grads)


def reference_result(model: Any, opt: Any, losses: list[float], grads: dict[str, Any]) -> "ReferenceResult":
    """A finished single-device run as a :class:`ReferenceResult`: its losses, step-0 gradients, and the final
    parameters and Adam moments of ``model`` under ``opt`` (copies)."""
    named = dict(model.named_parameters())
    state = {n: opt.state.get(p, {}) for n, p in named.items()}
    return ReferenceResult(losses, grads, {n: p.detach().clone() for n, p in named.items()},
                           {n: s["exp_avg"].clone() for n, s in state.items() if "exp_avg" in s},
                           {n: s["exp_avg_sq"].clone() for n, s in state.items() if "exp_avg_sq" in s})


#: The public ``hspmd_sdk.launch`` (SPEC §3): train a specialized Program.
launch = launch_training
