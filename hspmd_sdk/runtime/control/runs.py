"""Runs: the JSON description of one training run that a launcher sends every worker, checked before any worker
starts, and the start of a job that executes runs one after the other (launcher side).

* :func:`training_run` -- one run of a Program (options checked by :func:`~.run_config.check_run_options`, then
  what needs the Program and the cluster); :func:`checked_training_run` for options a launch checked already;
* :func:`start_runs` -- one job executing runs in order in the same processes (tests train several plans while
  paying process start-up once), through the one worker entry :data:`ENTRY`: the runtime's own (``launch`` and the
  mixed-length launch start their jobs with it), not part of ``hspmd_sdk``'s API.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..lr_schedule import schedule_json
from ..train_config import TrainConfig
from ..protocol import program_of_run
from ...core.model_spec import model_json
from ...errors import HSPMDError, PlanValidationError
from ...models.hf import init_directory
from ...models.registry import class_path
from ..checkpoints.checkpoint import run_fields
from ..checkpoints.checkpoint_io import WRITE_POINTS
from ..checkpoints.checkpoint_lock import launch_holding_locks  # a checkpoint_dir is one job's at a time
from .launch_errors import not_a_program
from .preflight import training_memory  # what each rank will need, for the launcher's resource preflight
from .start import start_workers

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.model_spec import ModelSpec
    from ...core.specialize import Program
    from ...core.strategy import Strategy
    from ..lr_schedule import Schedule
    from .job import Job

__all__ = ["ENTRY", "training_run", "checked_training_run", "checked_faults", "checked_profile",
           "recompute_ranks", "start_runs"]

#: The worker entry of every training job (:func:`~.worker_entry.train_entry`).
ENTRY = "hspmd_sdk.runtime.workers.worker_entry:train_entry"


def training_run(program: "Program", *, steps: int, seed: int = 0, data: str = "stdlib", lr: float = 1e-3,
                 betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 seq_len: int | None = None, recompute: Sequence[int] | None = None,
                 capture_dir: str | Path | None = None, cluster: "Cluster | None" = None,
                 init: str | Path | Mapping[str, Any] | None = None,
                 checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, keep: int = 3,
                 checkpoint_async: bool = True, resume_from: str | Path | None = None,
                 precision: str = "fp32", schedule: "Schedule | dict | str | None" = None,
                 max_norm: float | None = None,
                 eval_every: int | None = None, eval_batches: int = 4, decay: str = "matrices", optimizer: str = "adam") -> dict[str, Any]:
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

    The optimizer: ``schedule`` — the learning rate of each step (:class:`~hspmd_sdk.runtime.lr_schedule.Schedule`,
    its dict or its ``kind``; default constant ``lr``); ``max_norm`` — clip the gradients by their global norm
    (every element of the model counted once, whatever the plan; ``None``: no clipping); ``decay`` — which
    parameters ``weight_decay`` applies to (``"matrices"``: none on norms and biases; ``"all"``).  Validation:
    every ``eval_every`` steps, the mean loss of ``eval_batches`` batches of the data's validation split, forward
    only under the running plan.

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
    # lazy: tests patch run_config.check_run_options
    from .run_config import check_run_options  # types and ranges first: nothing below rounds or parses a value

    check_run_options(_model_of(program), steps=steps, seed=seed, data=data, lr=lr, betas=betas, eps=eps,
                      weight_decay=weight_decay, seq_len=seq_len, recompute=recompute, capture_dir=capture_dir,
                      init=init, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, keep=keep,
                      checkpoint_async=checkpoint_async, resume_from=resume_from, precision=precision,
                      schedule=schedule, max_norm=max_norm, eval_every=eval_every, eval_batches=eval_batches,
                      decay=decay,
                                optimizer=optimizer)
    return checked_training_run(program, steps=steps, seed=seed, data=data, lr=lr, betas=betas, eps=eps,
                                weight_decay=weight_decay, seq_len=seq_len, recompute=recompute,
                                capture_dir=capture_dir, cluster=cluster, init=init, checkpoint_dir=checkpoint_dir,
                                checkpoint_every=checkpoint_every, keep=keep, checkpoint_async=checkpoint_async,
                                resume_from=resume_from, precision=precision, schedule=schedule,
                                max_norm=max_norm, eval_every=eval_every, eval_batches=eval_batches, decay=decay,
                                optimizer=optimizer)


def _model_of(program: "Program") -> "ModelSpec":
    config = getattr(program, "model", None)
    if config is None:
        raise not_a_program(program, model_option=True)
    return config


def checked_training_run(program: "Program", *, steps: int, seed: int = 0, data: str = "stdlib", lr: float = 1e-3,
                         betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                         seq_len: int | None = None, recompute: Sequence[int] | None = None,
                         capture_dir: str | Path | None = None, cluster: "Cluster | None" = None,
                         init: str | Path | Mapping[str, Any] | None = None,
                         checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None,
                         keep: int = 3, checkpoint_async: bool = True, resume_from: str | Path | None = None,
                         precision: str = "fp32", schedule: "Schedule | dict | str | None" = None,
                         max_norm: float | None = None,
                         eval_every: int | None = None, eval_batches: int = 4,
                         decay: str = "matrices", optimizer: str = "adam") -> dict[str, Any]:
    """:func:`training_run` for options that :func:`~.run_config.check_run_options` has already checked (each
    launch checks them once, first): the checks that need the program and the cluster, then the run."""

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
        # the training settings in their typed sections (optimizer, schedule, clip, eval), as JSON: each worker
        # reads them back with validation (protocol.training_of)
        "train": TrainConfig.from_launch_kwargs(
            steps=int(steps), seed=int(seed), lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            decay=decay, optimizer=optimizer, schedule=schedule_json(schedule), max_norm=max_norm,
            eval_every=eval_every, eval_batches=eval_batches, precision=precision).to_json(),
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

    run.update(run_fields(run, program, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                          keep=keep, checkpoint_async=checkpoint_async, resume_from=resume_from))

    run["memory_estimate"] = {str(r): b for r, b in training_memory(
        program, global_batch=run["global_batch"], seq_len=run["seq_len"], recompute=run["recompute"]).items()}
    return run


def _init_source(init: str | Path | Mapping[str, Any] | None, config: "ModelSpec") -> dict[str, Any] | None:
    """The JSON form of ``init=`` for the workers: a Hugging Face directory, checked against the model here (a
    state dict is written to a temporary safetensors file first, so that no worker ever receives it whole)."""
    if init is None:
        return None

    return {"hf": str(init_directory(init, config))}


def _validate_run(run: Mapping[str, Any], program: "Program", cluster: "Cluster", config: "ModelSpec"
                  ) -> "Program":
    """Raise :class:`~hspmd_sdk.errors.PlanValidationError` for a run that would fail only in the workers: what
    needs the program and the cluster (each option's type and range, the data source and the model's position
    limit were checked first, by :func:`~.run_config.check_run_options`).  Returns the Program the workers run:
    ``program`` itself when it was specialized for ``cluster``, else its plan specialized on ``cluster``."""

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
    problems += _corpus_problems(run["data"], run["global_batch"], run["seq_len"], config.vocab_size)
    if problems:
        raise PlanValidationError(problems, what=what)
    if program.cluster is not None and program.cluster == cluster and program.default_resolver:
        return program
    try:  # specialized for another cluster: the plan on the launch cluster, once, here
        again = program_of_run({k: v for k, v in run.items() if k != "program"})
    except (HSPMDError, ValueError) as e:
        raise PlanValidationError([("plan", f"does not specialize on the launch cluster: {e}")], what=what) from e
    if sorted(again.ranks) != sorted(program.ranks):
        raise PlanValidationError([("cluster", f"the plan specialized on the launch cluster uses ranks "
                                               f"{sorted(again.ranks)}, not the program's {sorted(program.ranks)}")],
                                  what=what)
    return again


def _corpus_problems(data: Any, global_batch: int, seq_len: int, vocab_size: int) -> list[tuple[str, str]]:
    """A prepared corpus (``data=DIR``) that cannot feed this run: its tokenizer larger than the model's
    vocabulary, a split shorter than one batch (:meth:`~hspmd_sdk.data.TokenCorpus.check`)."""
    if not isinstance(data, (str, Path)) or not Path(data).expanduser().is_dir():
        return []
    from ...data.corpus import TokenCorpus

    return [("data", p) for p in TokenCorpus(data).check(global_batch, seq_len, vocab_size)]


def start_runs(runs: Sequence[Mapping[str, Any]], cluster: "Cluster", **launch_kwargs: Any) -> "Job":
    """Start one job that executes ``runs`` (from :func:`training_run`) one after the other on ``cluster``'s
    ranks (ranks a run's program does not use sit it out).  Each rank's result is ``{"runs": [...]}``.

    Every run must have been built (and so checked) for this ``cluster``."""

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

    return launch_holding_locks(runs, lambda: start_workers(
        cluster, steps=total, seed=int(runs[0]["seed"]), entry=ENTRY, payload={"runs": [dict(r) for r in runs]},
        **launch_kwargs))


def checked_faults(faults: Sequence[Mapping[str, Any]], ranks: Sequence[int], whose: str,
                   what: str) -> list[dict[str, Any]]:
    """``fault_injection`` (tests and demos of failures), each at a known point of a step on one of ``ranks``
    (``whose`` ranks, for the message), as the workers take it; else a
    :class:`~hspmd_sdk.errors.PlanValidationError` naming the first bad one."""

    points = {"forward", "backward", "grad_sync", "optimizer", "switch", "end", *WRITE_POINTS}

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


def recompute_ranks(strategy: "Strategy") -> list[int]:
    """Ranks of the stages a :class:`~hspmd_sdk.core.strategy.Strategy` marks ``recompute`` (for ``recompute=``)."""
    return sorted(r for p in strategy.pipelines for s in p.stages if s.recompute for r in s.devices)
