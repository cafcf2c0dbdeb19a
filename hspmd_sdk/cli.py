"""The ``hspmd`` command line.

Subcommands live in :data:`COMMANDS`; add one with the :func:`command` decorator::

    @command("train", "train a model", add_arguments=lambda p: p.add_argument("--steps", type=int))
    def _train(args: argparse.Namespace) -> int:
        ...
        return 0

A subcommand returns the exit status.  :class:`~hspmd_sdk.errors.HSPMDError` (e.g. a ``PlanValidationError``)
raised by it is printed to stderr, one problem a line as ``path: reason``, with exit status 1 and no traceback.
Any other exception is one ``error:`` line too (``hspmd --debug ...`` shows its traceback); Ctrl-C exits 130.
Argument values are checked by their types (:mod:`hspmd_sdk.cli_inputs`: finite numbers, bounded integers)
before anything runs.

FILE arguments are a path, or the name of a packaged example (``hspmd show table9_32b_16h800_16h20``).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from pydantic import ValidationError

from .cli_inputs import (EXAMPLES, MAX_SAMPLES, MAX_SEED, MAX_STEPS, MAX_TOKENS, add_fault_arguments, example_context,
                         int_in, load_cluster, number_above, read_json, resolve_file)
from .errors import HSPMDError, PlanValidationError
from .cli_checkpoint import add_training_checkpoint_arguments, training_checkpoint_options
from .cli_plan import _cost
from .core.annotation import Annotation, format_ranks
from .core.cluster import Cluster, MAX_RANKS, format_count, format_memory
from .core.plan import AnnotationPlan
from .core.resolve import itemsize_of, resolve
from .core.specialize import specialize
from .core.strategy import Strategy
from .core.strategy_plan import plan_from_strategy
from .models.registry import load_model_spec
from .planner.cost import CostModel

__all__ = ["main", "build_parser", "command", "COMMANDS", "resolve_file", "read_json", "EXIT_INTERRUPTED"]

#: Exit status after Ctrl-C (128 + SIGINT, what shells report).
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class Command:
    """One subcommand: its help line, a function adding its arguments, and the function running it."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], Any]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], Any] = lambda p: None
            ) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Register a subcommand ``name`` running the decorated function."""
    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = Command(help, add_arguments, run)
        return run
    return register


# ---- input helpers -------------------------------------------------------------------------------------------
def detect_kind(data: Any, path: Path) -> str:
    """``strategy`` / ``plan`` / ``cluster`` from the top-level keys of a JSON document."""
    if isinstance(data, dict):
        for key, kind in (("pipelines", "strategy"), ("annotations", "plan"), ("nodes", "cluster")):
            if key in data:
                return kind
    raise PlanValidationError([(str(path), "not a strategy, plan or cluster: expected a JSON object with "
                                           "'pipelines' (strategy), 'annotations' (plan) or 'nodes' (cluster)")],
                              what="input")


def load_context(args: argparse.Namespace, path: Path) -> tuple[Any, Any, int | None]:
    """Model, cluster and global batch from the arguments, else from the example index; each may be None."""

    ctx = example_context(path)
    model_name = args.model or ctx.get("model")
    cluster_file = args.cluster or (str(path.resolve().parent / ctx["cluster"]) if "cluster" in ctx else None)
    batch = getattr(args, "global_batch", None)
    if batch is None:
        batch = ctx.get("global_batch")
    model = load_model_spec(model_name) if model_name else None
    cluster = load_cluster(cluster_file) if cluster_file else None
    return model, cluster, batch


def cluster_summary(cluster: Any) -> str:
    """Nodes with their ranks and device kinds, and the device specs."""

    lines = [str(cluster)]
    for node in cluster.nodes:
        lines.append(f"  {node.host:<12} {node.kind:<6} ranks {format_ranks(node.ranks)}")
    for kind, spec in cluster.devices.items():
        lines.append(f"  {kind}: {spec.describe()}")
    lines.append(f"  inter-node: {cluster.inter_bandwidth_gbs:g} GB/s, {cluster.inter_latency_us:g} us")
    if cluster.host_bandwidth_gbs is not None:
        lines.append(f"  between the nodes of one host: {cluster.host_bandwidth_gbs:g} GB/s")
    return "\n".join(lines)


def describe_model(model: Any) -> str:
    """``tiny: 4 layers, hidden 64, 197K parameters`` (parameter counts in K/M/B, as every display writes them)."""

    hidden = getattr(model, "hidden_size", None)
    return (f"{getattr(model, 'name', type(model).__name__)}: {model.num_layers} layers"
            + (f", hidden {hidden}" if hidden else "") + f", {format_count(model.param_count())} parameters")


def _context_args(p: argparse.ArgumentParser, *, batch: bool) -> None:
    p.add_argument("file", metavar="FILE", help="strategy, annotation plan or cluster JSON (or an example name)")
    p.add_argument("--model", metavar="PRESET", help="model preset (tiny, llama-7b, llama-32b, llama-70b) or "
                                                      "model-config JSON")
    p.add_argument("--cluster", metavar="FILE|PRESET", help="cluster to check ranks against: JSON, packaged example "
                                                             "name, or counts like H800:16,H20:16")
    if batch:
        p.add_argument("--global-batch", type=int_in(1, MAX_SAMPLES), metavar="N", help="required samples per step")
        p.add_argument("--no-memory-check", action="store_true",
                       help="do not check the memory estimate of each rank against its device's memory")


def _load(args: argparse.Namespace) -> tuple[str, Any, Path]:
    path = resolve_file(args.file)
    data = read_json(path)
    kind = detect_kind(data, path)
    loader = {"strategy": Strategy.load, "plan": AnnotationPlan.load, "cluster": Cluster.load}[kind]
    return kind, loader(data), path


# ---- subcommands ---------------------------------------------------------------------------------------------
@command("validate", "check a strategy, annotation plan or cluster JSON: exit 1 with every problem found, else 0 "
                     "with what was checked and what could not be (a strategy's placement, TP and memory need "
                     "--model and --cluster)", lambda p: _context_args(p, batch=True))
def _validate(args: argparse.Namespace) -> int:
    kind, obj, path = _load(args)
    if kind == "strategy":
        _validate_strategy(args, obj, path)
    elif kind == "plan":
        cluster = load_cluster(args.cluster) if args.cluster else None
        obj.check(cluster=cluster)
        what = f"annotation plan {path.name}: {len(obj.annotations)} tensors on {len(obj.ranks)} ranks"
        if cluster is not None:
            print(f"OK: {what}; fits {cluster}")
        else:
            print(f"schema OK: {what}\nnot checked: ranks against a cluster (pass --cluster)")
    else:
        print(f"OK: cluster {path.name}: {obj}")
    return 0


def _validate_strategy(args: argparse.Namespace, strategy: Any, path: Path) -> None:
    """``hspmd validate`` of a strategy: every problem against the context given (structure, layers and TP,
    placement, global batch, memory) raised together; else "OK" only when nothing was left unchecked, and
    "schema OK" with a ``not checked:`` line naming what needs --model / --cluster."""

    model, cluster, batch = load_context(args, path)
    problems = strategy.problems(model, cluster, batch)
    memory = model is not None and cluster is not None and not args.no_memory_check
    if memory:
        problems += _memory_problems(strategy, model, cluster)
    if problems:
        raise PlanValidationError(problems, what="strategy")
    against = [str(x) for x in (model and model.name, cluster, batch and f"global batch {batch}") if x]
    what = (f"strategy {strategy.name or path.name!r}: {strategy.dp_degree} pipeline(s), {strategy.num_ranks} ranks"
            + (f"; fits {', '.join(against)}" if against else ""))
    missing = []
    if model is None:
        missing.append("layer coverage and TP degrees against a model (pass --model)")
    if cluster is None:
        missing.append("placement of the ranks on a cluster (pass --cluster)")
    if not memory:
        missing.append("memory per rank (--no-memory-check given)" if model is not None and cluster is not None
                       else "memory per rank (needs --model and --cluster)")
    if missing:
        print(f"schema OK: {what}\nnot checked: " + "; ".join(missing))
    else:
        peak = max(m.total for m in strategy.device_memory(model, cluster).values())
        print(f"OK: {what}; memory estimate at most {format_memory(peak)}/rank (with each device's runtime), "
              "within each rank's device")


def _memory_problems(strategy: Any, model: Any, cluster: Any) -> list[tuple[str, str]]:
    """Each stage whose memory estimate (bf16 mixed precision, plus each device's runtime: the figure ``hspmd show``
    prints, :meth:`Strategy.device_memory`) exceeds its devices' memory, as ``(field path, reason)``; ranks outside
    the cluster are skipped (placement reports them)."""

    mem = {r: m.total for r, m in strategy.device_memory(model, cluster).items()}
    problems = []
    for i, p in enumerate(strategy.pipelines):
        for j, s in enumerate(p.stages):
            inside = [r for r in s.devices if 0 <= r < cluster.num_ranks]
            if not inside:
                continue
            worst = max(inside, key=lambda r: mem[r] / cluster.spec(r).memory_bytes)
            cap = cluster.spec(worst).memory_bytes
            if mem[worst] > cap:
                problems.append((f"pipelines[{i}].stages[{j}]", f"needs ~{format_memory(mem[worst])}/rank (estimate: "
                                 f"bf16 parameters and gradients, fp32 Adam, activations at seq_len "
                                 f"{model.max_seq_len}, the device's runtime) but {cluster.kind(worst)} devices "
                                 f"have {format_memory(cap)}; "
                                 "shard it over more ranks (TP, more stages, ZeRO-1), or pass --no-memory-check"))
    return problems


@command("show", "print a readable summary of a strategy, annotation plan or cluster",
         lambda p: _context_args(p, batch=False))
def _show(args: argparse.Namespace) -> int:
    kind, obj, path = _load(args)
    if kind == "strategy":
        model, cluster, _ = load_context(args, path)
        print(obj.summary(model=model, cluster=cluster))
    elif kind == "plan":
        print(obj.summary())
    else:
        print(cluster_summary(obj))
    return 0


@command("examples", "list the packaged example strategies and clusters")
def _examples(args: argparse.Namespace) -> int:
    index = json.loads((EXAMPLES / "index.json").read_text())
    print("strategies (model, cluster, global batch):")
    for name, e in index["strategies"].items():
        print(f"  {name:<36} {e['model']:<10} {e['cluster']:<24} {e['global_batch']}")
    print("clusters:")
    for name, desc in index["clusters"].items():
        print(f"  {name:<36} {desc}")
    return 0


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int_in(1, MAX_STEPS), default=20, help="training steps (default 20)")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)


@command("demo", "the main job: train the heterogeneous tiny example on 4 local worker processes and compare "
                 "its losses with the single-device model", _demo_arguments)
def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo  # lazy: demo pulls the model configs, not loaded at `hspmd --help`

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


@command("run", "train a strategy on N local worker processes and print its losses next to the single-device "
                "model's", _run_arguments)
def _run(args: argparse.Namespace) -> int:
    from .runtime.control.progress import Phase

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
        from .runtime.control.train import launch, reference_training  # lazy: torch (train)
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

    from .runtime.control.progress import Phase

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
    cost = _cost(args.cost) or CostModel(cores=os.cpu_count() or 1)
    with Phase("loading PyTorch"):
        from .runtime.control.mixed import launch_mixed, planning_summary, reference_mixed  # lazy: torch (mixed)
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


def _resolve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="source annotation in the compact notation, e.g. \"[0,1] P2\"")
    p.add_argument("dst", help="destination annotation, e.g. \"[0,1] S0x2\"")
    p.add_argument("--shape", required=True, help="global tensor shape, comma separated (e.g. 64,64; each dim "
                                                   f"1..{MAX_DIM}, at most {MAX_ELEMENTS:.0e} elements)")
    p.add_argument("--dtype", default="float32", help="element type (float32, bfloat16, ...; default float32)")
    p.add_argument("--cluster", help="cluster JSON, packaged example or counts like H800:16,H20:16, for link classes "
                                     "and time estimates")


def _annotation(text: str, which: str) -> Annotation:
    """The annotation ``text`` (argument ``which``); its problems worded as every loader words them (no pydantic
    boilerplate)."""
    try:
        return Annotation(text)
    except ValidationError as e:
        raise PlanValidationError.from_pydantic(e, what="annotation", prefix=which) from None
    except (ValueError, TypeError) as e:  # the text itself cannot be read
        raise PlanValidationError([(which, str(e).splitlines()[-1].strip())], what="annotation") from None


@command("resolve", "resolve the communication that turns one annotation into another (§5)", _resolve_arguments)
def _resolve(args: argparse.Namespace) -> int:
    src, dst = _annotation(args.src, "SRC"), _annotation(args.dst, "DST")
    shape = _shape(args.shape)
    _check_dtype(args.dtype)
    cluster = load_cluster(args.cluster) if args.cluster else None
    plan = resolve(src, dst, shape, dtype=args.dtype, cluster=cluster)
    print(plan.render())
    if cluster is not None:
        print(f"  estimated time on {cluster}: {plan.estimated_time(cluster) * 1e3:.3f} ms")
    return 0


#: Bounds of a ``--shape``: each dimension, and all elements together (2**48: 1 PiB of fp32 values).
MAX_DIM = 1 << 40
MAX_ELEMENTS = float(1 << 48)


def _shape(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    if len(text) > 1000 or len(parts) > 16:
        raise PlanValidationError([("--shape", "at most 16 dimensions")], what="arguments")
    try:
        shape = tuple(int(x) for x in parts)
    except ValueError:
        raise PlanValidationError([("--shape", f"{text[:60]!r}: write integers separated by commas, e.g. 64,32")],
                                  what="arguments") from None
    bad = [d for d in shape if not 1 <= d <= MAX_DIM]
    if bad:
        raise PlanValidationError([("--shape", f"dimension {bad[0]} is out of range (1..{MAX_DIM})")],
                                  what="arguments")
    total = 1
    for d in shape:
        total *= d
    if total > MAX_ELEMENTS:
        raise PlanValidationError([("--shape", f"{total:.3g} elements is more than {MAX_ELEMENTS:.0e}")],
                                  what="arguments")
    return shape


def _check_dtype(dtype: str) -> None:
    try:
        itemsize_of(dtype)
    except (ValueError, TypeError, KeyError) as e:
        raise PlanValidationError([("--dtype", str(e))], what="arguments") from None


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """A function from ``module`` imported when called (keeps ``hspmd --help`` fast)."""
    def call(*args: Any) -> Any:
        import importlib

        return getattr(importlib.import_module(module), name)(*args)
    return call


COMMANDS["plan"] = Command("plan a strategy for a cluster and model (--scenario hetero|elastic|mixed)",
                           _lazy("hspmd_sdk.cli_plan", "add_plan_arguments"),
                           _lazy("hspmd_sdk.cli_plan", "run_plan"))
COMMANDS["simulate"] = Command("estimate one training step of a strategy (step time, bubble, peak memory)",
                               _lazy("hspmd_sdk.cli_plan", "add_simulate_arguments"),
                               _lazy("hspmd_sdk.cli_plan", "run_simulate"))


COMMANDS["launch"] = Command("train a strategy (or run an entry) on remote hosts over SSH or on a Slurm cluster",
                             _lazy("hspmd_sdk.cli_ssh", "add_launch_arguments"),
                             _lazy("hspmd_sdk.cli_ssh", "run_launch"))
COMMANDS["checkpoint"] = Command("show a sharded checkpoint (step, model, strategy, sizes, integrity) or export "
                                 "it to Hugging Face", _lazy("hspmd_sdk.cli_checkpoint",
                                                             "add_checkpoint_arguments"),
                                 _lazy("hspmd_sdk.cli_checkpoint", "run_checkpoint"))
COMMANDS["data"] = Command("prepare a token corpus from local text / JSON lines / parquet files, or show one",
                           _lazy("hspmd_sdk.cli_data", "add_data_arguments"), _lazy("hspmd_sdk.cli_data", "run_data"))
COMMANDS["train"] = Command("run a train config (TOML or JSON: the model, strategy and cluster, every option)",
                            _lazy("hspmd_sdk.cli_train", "add_train_arguments"),
                            _lazy("hspmd_sdk.cli_train", "run_train"))


# ---- entry point ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hspmd", description="HSPMD: heterogeneous SPMD training plans and tools")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hspmd``; returns the exit status (0 ok, 1 invalid input or error, 2 usage, 130 interrupted).

    Usage errors exit through argparse (``SystemExit(2)``, with its ``error:`` line); every other error is printed
    as ``error: ...`` on stderr, without a traceback unless ``--debug`` is given.  Run as the program itself
    (``argv`` None: the ``hspmd`` script, ``python -m hspmd_sdk.cli``) a command that loaded PyTorch leaves
    without PyTorch's teardown (:func:`leave_now`)."""
    status = _main(argv)
    if argv is None:
        leave_now(status)
    return status


def leave_now(status: int) -> None:
    """End this process with ``status`` at once when PyTorch is loaded and nothing else still runs: the exit
    handlers run (a job's kill-at-exit, a checkpoint lock's release, logging's flush), the streams are flushed,
    then ``os._exit``.  PyTorch's own teardown at interpreter exit takes 1-4 s on a busy CPU machine, a silence
    after the last line before the prompt returns.  Otherwise (no PyTorch, or a non-daemon thread that the
    interpreter would wait for) it returns and the ordinary exit follows."""
    import atexit
    import os
    import threading

    if "torch" not in sys.modules or any(t is not threading.main_thread() and t.is_alive() and not t.daemon
                                         for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("\nerror: interrupted (Ctrl-C); nothing was left running", file=sys.stderr)
        return EXIT_INTERRUPTED
    except PlanValidationError as e:
        if args.debug:
            raise
        cause = getattr(e, "cause", None)
        if cause:
            print(f"error: {cause}\ndetails (invalid {e.what}):", file=sys.stderr)
        else:
            print(f"error: invalid {e.what}:", file=sys.stderr)
        for path, reason in e.problems:
            print(f"  {path}: {reason}", file=sys.stderr)
        return 1
    except HSPMDError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a bug must still be one line, not a traceback
        if args.debug:
            raise
        text = " ".join(str(e).split())[:500]
        print(f"error: {type(e).__name__}: {text} (unexpected: rerun with --debug for the traceback and report "
              "it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
