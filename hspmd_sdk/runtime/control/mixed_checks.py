"""What a mixed-length launch (:func:`~.mixed.launch_mixed`) checks before any worker starts, one step a function,
in the order the launch runs them: the candidates (:func:`launch_candidates`, :func:`candidate_programs`, which a
running job's new candidates go through too: :meth:`~.mixed.LengthPlanner.check_candidates`), the data and the
dispatcher (:func:`checked_dispatch`), the checkpoint's step (:func:`resume_step`), each candidate's run as the
workers will rebuild it (:func:`candidate_runs`) and the run the workers get, with its ``"mixed"`` section
(:func:`mixed_run`).  Each problem is a :class:`~hspmd_sdk.errors.PlanValidationError` naming the field.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ...core.specialize import specialize
from ...core.strategy import Strategy
from ...core.strategy_plan import plan_from_strategy
from ...errors import HSPMDError, PlanValidationError
from ...planner.mixed import Dispatcher
from ..checkpoints.checkpoint import load_checkpoint
from ..data import LengthBatches, documents_for, validation_of
from ..protocol import program_of_run
from ..workers.kernels import packing_problems
from .runs import checked_training_run

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.model_spec import ModelSpec
    from ...core.specialize import Program
    from ...planner.cost import CostModel

__all__ = ["launch_candidates", "candidate_programs", "checked_dispatch", "resume_step", "candidate_runs",
           "mixed_run"]


def launch_candidates(programs: list["Program | Strategy"], cluster: "Cluster | None", what: str
                      ) -> tuple["ModelSpec", "Cluster", list["Program"]]:
    """``(model, cluster, Programs)`` of a launch's candidates: at least one, the cluster given or the first
    Program's, and :func:`candidate_programs` on it."""
    if not programs:
        raise PlanValidationError([("programs", "no candidate program")], what=what)
    cluster = cluster if cluster is not None else next((p.cluster for p in programs if hasattr(p, "cluster")), None)
    if cluster is None:
        raise PlanValidationError([("cluster", "launch needs a cluster: pass cluster=")], what=what)
    model, out = candidate_programs(programs, cluster, what)
    return model, cluster, out


def candidate_programs(candidates: Sequence["Program | Strategy"], cluster: "Cluster", what: str, *,
                       model: "ModelSpec | None" = None, field: str = "programs"
                       ) -> tuple["ModelSpec", list["Program"]]:
    """``(model, Programs)`` of a list of candidates: Programs of one model (from :meth:`MixedPlan.programs` or
    any other), and Strategies, specialized here on ``cluster`` for the model of the Programs -- or, given
    ``model`` (a running job's, for ``job.switch([...])``), of that model.  Problems name ``field[i]``."""

    models = [(i, getattr(c, "model", None)) for i, c in enumerate(candidates) if not isinstance(c, Strategy)]
    bare = [i for i, m in models if m is None]
    if bare:
        raise PlanValidationError([(f"{field}[{bare[0]}]", f"is a {type(candidates[bare[0]]).__name__}, not a "
                                                           "Program specialized from a model config or a "
                                                           "Strategy")], what=what)
    if not candidates:
        raise PlanValidationError([(field, "is empty: give at least one candidate Program or Strategy")], what=what)
    if not models and model is None:
        raise PlanValidationError([(field, "are all Strategies: give at least one Program (specialize(model, "
                                           "...)) so that the model is known")], what=what)
    whose = "the job" if model is not None else f"{field}[{models[0][0]}]"
    model = model if model is not None else models[0][1]
    other = [i for i, m in models if m != model]
    if other:
        raise PlanValidationError([(f"{field}[{other[0]}]", f"trains {candidates[other[0]].model!r}, "
                                                           f"{whose} {model!r}: every candidate must "
                                                           "train the same model")], what=what)
    on = "the launch cluster" if field == "programs" else "the job's cluster (job.cluster)"
    out = []
    for i, c in enumerate(candidates):
        if isinstance(c, Strategy):
            try:
                c = specialize(model, plan_from_strategy(model, c, cluster), cluster)
            except HSPMDError as e:
                raise PlanValidationError([(f"{field}[{i}]", f"the strategy does not specialize on {on}: {e}")],
                                          what=what) from e
        if c.plan.settings.zero >= 3:  # each pipeline's micro-batches per step vary with the data
            raise PlanValidationError([(f"{field}[{i}]", "is at ZeRO-3 (zero: 3), which needs every replica of a "
                                                         "layer to run as many micro-batches a step; mixed-length "
                                                         "data changes them step by step: use zero: 2")], what=what)
        out.append(c)
    return model, out


def checked_dispatch(programs: list["Program"], model: "ModelSpec", cluster: "Cluster", what: str, *, data: Any,
                     context: int, tokens_per_step: int, seed: int, packing: bool | None,
                     cost: "CostModel | None") -> tuple[Any, LengthBatches, Dispatcher]:
    """``(documents, batches, dispatcher)`` of a launch: the data read (:func:`~..data.documents_for`) and cut at
    ``context``, packing decided (``None``: where the model's graph allows it) and the
    :class:`~hspmd_sdk.planner.Dispatcher` of the candidates, whose longest must take the data's ``context``."""
    try:
        docs = documents_for(data, model.vocab_size)
        batches = LengthBatches(docs, context=context, tokens_per_step=tokens_per_step, seed=seed)
    except ValueError as e:
        raise PlanValidationError([("data", str(e))], what=what) from e

    problems = packing_problems(programs[0].graph)
    if packing and problems:
        raise PlanValidationError([("packing", f"the model's graph cannot keep packed sequences apart: "
                                               f"{'; '.join(problems)}; pass packing=False (padded micro-batches)")],
                                  what=what)
    packing = not problems if packing is None else bool(packing)
    try:
        dispatcher = Dispatcher(programs, model, cluster, cost=cost, packing=packing)
    except PlanValidationError as e:
        raise PlanValidationError([("programs", str(e))], what=what) from e
    if dispatcher.max_seq_len < context:
        raise PlanValidationError([("programs", f"the longest candidate takes sequences of {dispatcher.max_seq_len} "
                                                f"tokens, the data's context is {context}: pass context="
                                                f"{dispatcher.max_seq_len} or add a candidate for {context}")],
                                  what=what)
    return docs, batches, dispatcher


def resume_step(resume_from: str | Path | None, steps: int, what: str) -> int:
    """The step a resumed mixed-length run starts at (its checkpoint's), checked against ``steps``; 0 without one
    (the checkpoint itself is checked against the run by :func:`~.checkpoint.run_fields`)."""
    if resume_from is None:
        return 0

    step = int(load_checkpoint(resume_from).step)
    if step >= steps:
        raise PlanValidationError([("steps", f"is the total step count ({steps}) but the checkpoint has already "
                                             f"completed {step}; pass steps > {step}")], what=what)
    return step


def candidate_runs(programs: list["Program"], cluster: "Cluster", first: int, what: str, *, seq_len: int,
                   init: Any, **training: Any) -> list[dict[str, Any]]:
    """Each candidate's training run (:func:`~.runs.checked_training_run` with the launch's ``training`` options),
    checked as the workers will rebuild it: its Program specializes to the same pipelines on the launch cluster.
    ``init=`` goes to the ``first`` candidate's run only (the one the workers start under)."""
    runs = []
    for i, p in enumerate(programs):  # each candidate checked as the workers will rebuild it
        run = checked_training_run(p, seq_len=seq_len, cluster=cluster, init=init if i == first else None,
                                   **training)
        again = program_of_run(run)
        if again.pipelines != p.pipelines:
            raise PlanValidationError([(f"programs[{i}]", "does not specialize to the same pipelines on the "
                                                          "launch cluster")], what=what)
        runs.append(run)
    return runs


def mixed_run(runs: list[dict[str, Any]], first: int, data: dict[str, Any], dispatcher: Dispatcher, what: str, *,
              eval_every: int | None) -> dict[str, Any]:
    """The run the workers get: the ``first`` candidate's (``init=``, a Hugging Face directory, read once, by it)
    with the ``data`` spec, the validation window (``eval_every=``: the shortest window of every candidate's
    pipelines, which the validation split must fill) and the ``"mixed"`` section (every candidate's plan,
    bindings, recomputation and Program, and ``first``)."""
    run = dict(runs[first])
    run["data"] = data
    if eval_every:  # validation sequences every pipeline of every candidate takes
        run["eval_context"] = min(min(c.windows) for c in dispatcher.candidates)
        try:
            validation_of(data, run["eval_context"])
        except ValueError as e:
            raise PlanValidationError([("eval_every", str(e))], what=what) from e
    run["mixed"] = {"candidates": [{"plan": r["plan"], "bindings": r["bindings"], "recompute": r["recompute"],
                                    "program": r["program"]} for r in runs], "first": first}
    return run
