"""``hspmd demo`` and ``hspmd run``: train on local worker processes and print the losses beside the single-device
model's (:data:`DEMO`, :data:`RUN`).

``hspmd run STRATEGY --local N`` trains a strategy (fixed-length data); ``hspmd run --programs DIR --local N``
trains mixed-length data, each step on the cheapest of the candidate plans that ``hspmd plan --scenario mixed``
wrote.  PyTorch is imported only when a command runs (``hspmd --help`` stays fast).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from ..core.cluster import MAX_RANKS, Cluster
from ..core.plan import AnnotationPlan
from ..core.specialize import specialize
from ..core.strategy import Strategy
from ..core.strategy_plan import plan_from_strategy
from ..errors import PlanValidationError
from ..models.registry import load_model_spec
from ..planner.cost import CostModel
from .checkpoint import add_training_checkpoint_arguments, training_checkpoint_options
from .command import EXIT_INTERRUPTED, Command
from .inputs import (EXAMPLES, MAX_SAMPLES, MAX_SEED, MAX_STEPS, MAX_TOKENS, add_fault_arguments, describe_model,
                     example_context, int_in, number_above, resolve_file)
from .plan import read_cost

__all__ = ["DEMO", "RUN", "CauseFirstError"]


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int_in(1, MAX_STEPS), default=20, help="training steps (default 20)")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)


def _demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo  # lazy: demo pulls the model configs, not loaded at `hspmd --help`

    model, cluster = load_model_spec("llama:tiny"), Cluster.local(4)
    strategy = Strategy.load(EXAMPLES / "example_hetero_tiny.json", model=model, cluster=cluster)
    print(f"model:   {describe_model(model)}")
    print(f"cluster: {cluster}")
    print(strategy.summary(model=model, cluster=cluster))
    losses = run_demo(steps=args.steps, seed=args.seed, progress=True)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["hspmd"], losses["reference"]))
    print(f"\nlargest relative loss difference from the single-device model: {worst:.1e}")
    return 0


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="STRATEGY", nargs="?", help="strategy JSON (or packaged example name); or "
                                                               "--programs for mixed-length data")
    p.add_argument("--local", type=int_in(1, MAX_RANKS), required=True, metavar="N",
                   help="number of local worker processes")
    p.add_argument("--model", default="tiny", help="model preset (default tiny)")
    p.add_argument("--steps", type=int_in(1, MAX_STEPS), default=10)
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)
    p.add_argument("--data", default=None, help="a STRATEGY trains on stdlib (default) or synthetic; --programs "
                                                "on stdlib-docs (default) or a tokenized text file (a document a line)")
    p.add_argument("--lr", type=number_above(0), default=3e-3)
    p.add_argument("--seq-len", type=int_in(1, MAX_TOKENS), default=None,
                   help="sequence length (default: the model's max_seq_len)")
    p.add_argument("--programs", metavar="DIR", help="mixed-length data: the candidate plans that 'hspmd plan "
                                                     "--scenario mixed --programs DIR' wrote; per step the "
                                                     "cheapest candidate takes the step's sequences")
    p.add_argument("--tokens-per-step", type=int_in(1, MAX_TOKENS * MAX_SAMPLES), metavar="N",
                   help="--programs: the token budget of a step (required)")
    p.add_argument("--context", type=int_in(1, MAX_TOKENS), metavar="N",
                   help="--programs: the longest sequence; longer documents are cut (default: the model's)")
    p.add_argument("--cost", metavar="FILE", help="--programs: the dispatcher's cost model JSON (default: "
                                                  "analytic, with the node's cores)")
    p.add_argument("--padding", action="store_true", help="--programs: pad micro-batches (rows x longest) instead "
                                                          "of packing whole sequences into one row each")
    p.add_argument("--no-reference", action="store_true", help="skip the single-device comparison")
    p.add_argument("--log-dir", default=None, metavar="DIR", help="per-rank logs (default: a temporary folder)")
    p.add_argument("--elastic", action="store_true",
                   help="survive workers that die: replan for the survivors and switch in memory (graph switching)")
    p.add_argument("--straggler", action="store_true",
                   help="replan around a rank that stays slower than under its plan")
    add_fault_arguments(p)

    add_training_checkpoint_arguments(p)


def _run(args: argparse.Namespace) -> int:
    from ..runtime.control.progress import Phase

    model, cluster = load_model_spec(args.model), Cluster.local(args.local)
    if args.stall < 2 * args.heartbeat:
        raise PlanValidationError([("--stall", f"{args.stall:g} s must be at least two heartbeats (--heartbeat "
                                               f"{args.heartbeat:g})")], what="arguments")
    if args.programs or args.file is None:
        return _run_mixed(args, model, cluster)
    data = args.data or "stdlib"
    if data not in ("stdlib", "synthetic"):
        raise PlanValidationError([("--data", f"{data[:60]!r}: a STRATEGY trains on stdlib or synthetic "
                                              "(documents of different lengths need --programs)")], what="arguments")
    args.data = data
    if args.padding:
        raise PlanValidationError([("--padding", "pads the micro-batches of --programs (mixed-length data); a "
                                                 "STRATEGY trains fixed-length rows")], what="arguments")
    path = resolve_file(args.file)
    strategy = Strategy.load(path)
    _check_run_context(strategy, model, cluster, args, path)
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
    with Phase("loading PyTorch"):
        from ..runtime.control.train import launch, reference_training  # lazy: torch (train)
    job = launch(program, cluster, steps=args.steps, seed=args.seed, data=args.data, lr=args.lr,
                          seq_len=args.seq_len, progress=True,
                          timeout_s=args.timeout, stall_s=args.stall, heartbeat_s=args.heartbeat,
                          log_dir=args.log_dir, resource_check=not args.no_resource_check,
                          elastic=args.elastic, straggler=args.straggler, **training_checkpoint_options(args))
    _announce(job, args)
    try:
        result = job.wait()
    except KeyboardInterrupt:
        print(f"\ninterrupted: every worker was stopped; logs in {job.log_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    ref = None
    if not args.no_reference:
        with Phase("computing the single-device reference (one process, the same data)"):
            ref = reference_training(model, steps=args.steps, seed=args.seed, global_batch=program.bindings["B"],
                                     seq_len=args.seq_len, data=args.data, lr=args.lr)
    _print_losses(result.losses, args.steps, ref)
    for event in result.events:
        print(f"reconfigured at {event}\n  -> {event.strategy}")
    return 0


class CauseFirstError(PlanValidationError):
    """A :class:`PlanValidationError` whose one-line ``cause`` (plain words: what does not match and what to do)
    the CLI prints first, before the per-field details."""

    def __init__(self, cause: str, problems: Sequence[tuple[str, str]], *, what: str = "input") -> None:
        super().__init__(problems, what=what)
        self.cause = cause


def _check_run_context(strategy: Any, model: Any, cluster: Any, args: argparse.Namespace, path: Path) -> None:
    """``hspmd run``: the strategy against ``--local N`` and ``--model``; a mismatch of ranks or layers is named
    in one plain first line (needs, gives, what to do), the field problems follow."""
    problems = strategy.problems(model, cluster)
    if not problems:
        return
    causes = []
    need = max(strategy.ranks) + 1
    if need > cluster.num_ranks:
        causes.append(f"the strategy uses ranks 0..{need - 1} ({need} worker processes) but --local {args.local} "
                      f"gives {cluster.num_ranks}")
    covers = {p.num_layers for p in strategy.pipelines}
    layers = "/".join(map(str, sorted(covers)))
    if covers != {model.num_layers}:
        causes.append(f"{'it' if causes else 'the strategy'} splits {layers} layers but --model {args.model} has "
                      f"{model.num_layers}")
    if not causes:
        raise PlanValidationError(problems, what="strategy")
    ctx = example_context(path)
    made_for = (f" (it was written for {ctx['model']} on {ctx['cluster']})" if "model" in ctx and "cluster" in ctx
                else "")
    other_model = "" if covers == {model.num_layers} else (
        f" --model {ctx['model']}" if "model" in ctx else f" and a --model of {layers} layers")
    todo = (f"run it with --local {need}{other_model}"
            + f", or train a strategy written for {cluster.num_ranks} ranks and {model.num_layers} layers"
            + (" (e.g. 'hspmd run example_hetero_tiny --local 4')" if cluster.num_ranks == 4 and model.num_layers == 4
               else f" ('hspmd plan --cluster cpu:{cluster.num_ranks} --model {args.model} -o FILE' writes one)"))
    raise CauseFirstError("cannot run this strategy here: " + "; ".join(causes) + made_for + f". To fix: {todo}.",
                          problems, what="strategy")


def _live_progress() -> bool:
    """Whether ``hspmd run``'s progress redraws one line in place (stderr is a terminal); piped or redirected it
    prints plain lines instead (the workers' start-up phases, then at most a line a second)."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def _announce(job: Any, args: argparse.Namespace) -> None:
    """Without the live bar (stderr is not a terminal), one plain line on stderr saying what runs and where its
    logs are; the losses follow on stdout when the job ends."""
    if not _live_progress():
        print(f"training {args.steps} steps on {args.local} local worker processes (progress as plain lines: stderr "
              f"is not a terminal); logs in {job.log_dir}", file=sys.stderr, flush=True)


def _print_losses(losses: Sequence[float], steps: int, ref: Any, columns: dict[str, Sequence[Any]] | None = None
                  ) -> None:
    """``hspmd run``'s loss table: the step (a resumed run's first is its checkpoint's), ``columns`` (name -> a
    value per trained step), the loss, and the single-device model's beside it with the relative difference."""
    extra = columns or {}
    print(f"{'step':>4}  " + "".join(f"{name:>9}  " for name in extra) + f"{'HSPMD':>12}"
          + ("" if ref is None else f"  {'single device':>14}  {'rel. diff':>9}"))
    first = steps - len(losses)  # a resumed run trains steps first .. steps-1
    for k, loss in enumerate(losses):
        i = first + k
        line = f"{i:>4}  " + "".join(f"{values[k]:>9}  " for values in extra.values()) + f"{loss:>12.6f}"
        if ref is not None:
            line += f"  {ref.losses[i]:>14.6f}  {abs(loss - ref.losses[i]) / abs(ref.losses[i]):>9.1e}"
        print(line)


def _candidate_programs(folder: str, model: Any, cluster: Any) -> list[Any]:
    """The Programs of ``folder/candidate_<i>.json`` (what ``hspmd plan --scenario mixed --programs`` writes), in
    index order, each specialized for ``model`` on ``cluster``."""

    root = Path(folder)
    if not root.is_dir():
        raise PlanValidationError([("--programs", f"{folder[:200]}: not a folder")], what="arguments")
    files = sorted(root.glob("candidate_*.json"), key=lambda f: (len(f.stem), f.stem))
    if not files:
        raise PlanValidationError([("--programs", f"{folder[:200]} has no candidate_<i>.json (write them with "
                                                  "'hspmd plan --scenario mixed --programs DIR')")], what="arguments")
    out = []
    for f in files:
        plan = AnnotationPlan.load(Path(f))
        missing = [k for k in ("strategy", "max_seq_len", "windows") if getattr(plan.settings, k) is None]
        if missing:
            raise PlanValidationError([(f"--programs {f.name}", f"not a mixed-length candidate: its settings lack "
                                                                f"{missing}")], what="arguments")
        problems = plan.problems(cluster)
        if problems:
            raise PlanValidationError([(f"--programs {f.name}: {path}", why) for path, why in problems],
                                      what="arguments")
        out.append(specialize(model, plan, cluster))
    return out


def _run_mixed(args: argparse.Namespace, model: Any, cluster: Any) -> int:
    """``hspmd run --programs DIR``: mixed-length training with per-step candidates, losses beside the
    single-device model's on the same sequences."""
    import os

    from ..runtime.control.progress import Phase

    if args.file is not None:
        raise PlanValidationError([("STRATEGY", "give a STRATEGY or --programs, not both")], what="arguments")
    if not args.programs:
        raise PlanValidationError([("STRATEGY", "give a strategy file, or --programs DIR for mixed-length data")],
                                  what="arguments")
    if args.tokens_per_step is None:
        raise PlanValidationError([("--tokens-per-step", "--programs needs the token budget of a step")],
                                  what="arguments")
    data = args.data or "stdlib-docs"
    if data in ("stdlib", "synthetic"):
        raise PlanValidationError([("--data", f"{data}: fixed-length data; --programs trains on stdlib-docs or a "
                                              "tokenized text file")], what="arguments")
    programs = _candidate_programs(args.programs, model, cluster)
    cost = read_cost(args.cost) or CostModel(cores=os.cpu_count() or 1)
    with Phase("loading PyTorch"):
        from ..runtime.control.mixed import launch_mixed, planning_summary, reference_mixed  # lazy: torch (mixed)
    job = launch_mixed(programs, cluster, steps=args.steps, seed=args.seed, data=data, lr=args.lr,
                       tokens_per_step=args.tokens_per_step, context=args.context, cost=cost,
                       progress=True,
                       timeout_s=args.timeout, stall_s=args.stall, heartbeat_s=args.heartbeat, log_dir=args.log_dir,
                       resource_check=not args.no_resource_check, elastic=args.elastic, straggler=args.straggler,
                       packing=False if args.padding else None, **training_checkpoint_options(args))
    _announce(job, args)
    try:
        result = job.wait()
    except KeyboardInterrupt:
        print(f"\ninterrupted: every worker was stopped; logs in {job.log_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    summary = planning_summary(job, result)
    ref = None
    if not args.no_reference:
        with Phase("computing the single-device reference (one process, the same sequences)"):
            ref = reference_mixed(model, steps=args.steps, seed=args.seed, data=data,
                                  tokens_per_step=args.tokens_per_step, context=args.context, lr=args.lr)
    _print_losses(result.losses, args.steps, ref, {"candidate": summary["choices"]})
    for event in result.events:
        print(f"switched at {event}")
    print(f"planning {1e3 * sum(summary['plan_s']) / max(len(summary['plan_s']), 1):.2f} ms a step, "
          f"{summary['hidden']:.0%} hidden behind training")
    return 0


DEMO = Command("the main job: train the heterogeneous tiny example on 4 local worker processes and compare its "
               "losses with the single-device model", _demo_arguments, _demo)
RUN = Command("train a strategy on N local worker processes and print its losses next to the single-device model's",
              _run_arguments, _run)
