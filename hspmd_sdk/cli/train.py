"""``hspmd train FILE.toml``: run a training config (SPEC §13), :data:`TRAIN`.

``FILE`` is a :class:`~hspmd_sdk.runtime.train_config.TrainConfig` in TOML or JSON.  Its ``[plan]`` section names
what to train and where: ``model`` (a preset such as ``llama:tiny`` or ``gpt:tiny``, or a model-config JSON),
``cluster`` (``local:N`` worker processes on this machine, or a cluster JSON) and ``strategy`` (a strategy JSON or a
packaged example; left out: :func:`data_parallel_strategy`, every rank a data-parallel replica of the whole model).
The strategy is specialized on the cluster and the Program launched with ``hspmd_sdk.launch(program, cluster,
config=cfg)``; the command waits and prints each step's loss, with its learning rate, gradient norm and validation
loss where the run reports them.

* ``--steps N`` replaces ``run.steps``;
* ``--dry-run`` prints the plan's summary and the resolved config (``cfg.to_toml()``) and exits 0 without starting
  a worker;
* ``--template`` prints a commented TOML config holding every default (``hspmd train --template > run.toml``).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from .command import EXIT_INTERRUPTED, Command
from .inputs import MAX_STEPS, describe_model, int_in, resolve_file
from ..errors import PlanValidationError

__all__ = ["TRAIN", "add_train_arguments", "run_train", "TrainPlan", "resolve_plan", "data_parallel_strategy",
           "SAMPLES_PER_RANK"]

#: The default strategy's samples per rank and step when ``run.global_batch`` is not given (the packaged tiny
#: examples' micro-batch).
SAMPLES_PER_RANK = 2


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``hspmd train``."""
    p.add_argument("file", metavar="FILE", nargs="?", help="train config, .toml or .json ('hspmd train --template' "
                                                           "prints one)")
    p.add_argument("--steps", type=int_in(1, MAX_STEPS), metavar="N", help="train N steps (replaces run.steps)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the resolved config, launch nothing")
    p.add_argument("--template", action="store_true", help="print a commented TOML config with every default")


@dataclass(frozen=True)
class TrainPlan:
    """What a config's ``[plan]`` resolves to: the model config, the cluster, the strategy and the Program
    specialized from them."""

    model: Any
    cluster: Any
    strategy: Any
    program: Any


def run_train(args: argparse.Namespace) -> int:
    """``hspmd train``: the template, a dry run, or a training run; returns the exit status."""
    from ..runtime.train_config import TrainConfig, template_toml

    if args.template:
        if args.file is not None or args.steps is not None or args.dry_run:
            raise PlanValidationError([("--template", "prints the default config and takes no FILE, --steps or "
                                                      "--dry-run")], what="arguments")
        print(template_toml(), end="")
        return 0
    if args.file is None:
        raise PlanValidationError([("FILE", "give a train config (.toml or .json); 'hspmd train --template > "
                                            "run.toml' writes one to start from")], what="arguments")
    cfg = TrainConfig.from_file(args.file)
    if args.steps is not None:
        cfg = cfg.updated({"run.steps": args.steps})
    plan = resolve_plan(cfg)
    print(plan_summary(cfg, plan))
    if args.dry_run:
        print("\n# the resolved config\n" + cfg.to_toml(), end="")
        print("dry run: nothing was launched")
        return 0
    return _train(cfg, plan)


def resolve_plan(cfg: Any) -> TrainPlan:
    """The model, cluster and strategy ``cfg.plan`` names, checked together, and the Program specialized from
    them.  Problems are :class:`~hspmd_sdk.errors.PlanValidationError` naming the ``plan.*`` field they come from."""
    from ..core.specialize import specialize
    from ..core.strategy import Strategy
    from ..core.strategy_plan import plan_from_strategy
    from ..models.registry import load_model_spec

    model = _under("plan.model", lambda: load_model_spec(cfg.plan.model))
    cluster = _under("plan.cluster", lambda: _cluster(cfg.plan.cluster))
    if cfg.plan.strategy is None:
        strategy = _under("run.global_batch", lambda: data_parallel_strategy(model.num_layers, cluster.num_ranks,
                                                                              cfg.run.global_batch))
    else:
        strategy = _under("plan.strategy", lambda: Strategy.load(resolve_file(cfg.plan.strategy), model=model,
                                                                 cluster=cluster, global_batch=cfg.run.global_batch))
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
    return TrainPlan(model, cluster, strategy, program)


def data_parallel_strategy(num_layers: int, num_ranks: int, global_batch: int | None = None) -> Any:
    """The default strategy: ``num_ranks`` pipelines of one stage holding all ``num_layers`` layers on one rank
    each (pure data parallelism), one micro-batch each.  ``global_batch`` samples a step are shared as evenly as
    whole samples allow (the first ``global_batch % num_ranks`` ranks take one more); ``None``:
    :data:`SAMPLES_PER_RANK` samples per rank."""
    from ..core.strategy import Strategy

    batch = SAMPLES_PER_RANK * num_ranks if global_batch is None else global_batch
    if batch < num_ranks:
        raise PlanValidationError([("run.global_batch", f"{batch} samples cannot give each of the {num_ranks} ranks "
                                                        "of the default data-parallel strategy one; give at least "
                                                        f"{num_ranks}, or a plan.strategy")], what="train config")
    shares = [batch // num_ranks + (1 if r < batch % num_ranks else 0) for r in range(num_ranks)]
    return Strategy.load({"pipelines": [{"stages": [{"devices": [r], "layers": [0, num_layers - 1]}],
                                         "micro_batch_size": b, "num_micro_batches": 1}
                                        for r, b in enumerate(shares)]})


def plan_summary(cfg: Any, plan: TrainPlan) -> str:
    """What will run: the model, the cluster, the strategy, the global batch and the learning-rate schedule."""
    steps = cfg.run.steps
    return "\n".join([f"model:    {describe_model(plan.model)}",
                      f"cluster:  {plan.cluster}",
                      ("strategy: the default, every rank a data-parallel replica of the whole model (no "
                       "plan.strategy)" if cfg.plan.strategy is None else f"strategy: {cfg.plan.strategy}"),
                      plan.strategy.summary(model=plan.model, cluster=plan.cluster),
                      f"global batch {plan.program.bindings['B']}, {steps} steps, lr {cfg.optimizer.lr:g}, "
                      f"schedule {cfg.schedule.describe(steps)}"])


def _train(cfg: Any, plan: TrainPlan) -> int:
    """Launch the Program with the config, wait, print the steps."""
    from ..runtime.control.progress import Phase

    with Phase("loading PyTorch"):
        from ..runtime.control.train import launch  # lazy: torch

    # said before the launch: on a terminal the job's bar then redraws its own line, which a line printed after
    # the launch (while the bar counts the workers' start) would be written into
    print(f"training {cfg.run.steps} steps on {plan.cluster.num_ranks} worker processes", file=sys.stderr,
          flush=True)
    job = launch(plan.program, plan.cluster, config=cfg)
    try:
        result = job.wait()
    except KeyboardInterrupt:
        print(f"\ninterrupted: every worker was stopped; logs in {getattr(job, 'log_dir', '?')}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(step_table(result, cfg.run.steps))
    print(f"logs in {getattr(job, 'log_dir', '?')}", file=sys.stderr, flush=True)
    for event in getattr(result, "events", ()):
        print(f"reconfigured at {event}")
    return 0


def step_table(result: Any, steps: int) -> str:
    """One line a trained step: its loss, and its learning rate, gradient norm (before clipping) and validation
    loss where ``result`` has them (``lrs``, ``grad_norms``: a value a step; ``val_losses``: step -> loss).  A
    resumed run's first step is its checkpoint's."""
    losses: Sequence[float] = result.losses
    lrs: Sequence[float] = getattr(result, "lrs", None) or []
    norms: Sequence[float] = getattr(result, "grad_norms", None) or []
    vals: dict[int, float] = getattr(result, "val_losses", None) or {}
    first = steps - len(losses)
    lines = [f"{'step':>6}  {'loss':>10}" + (f"  {'lr':>10}" if lrs else "") + (f"  {'grad norm':>10}" if norms else "")
             + (f"  {'val loss':>10}" if vals else "")]
    for k, loss in enumerate(losses):
        step = first + k
        line = f"{step:>6}  {loss:>10.6f}"
        if lrs:
            line += f"  {lrs[k]:>10.3e}" if k < len(lrs) else f"  {'':>10}"
        if norms:
            line += f"  {norms[k]:>10.4f}" if k < len(norms) else f"  {'':>10}"
        if vals:
            line += f"  {vals[step]:>10.6f}" if step in vals else ""
        lines.append(line)
    return "\n".join(lines)


# ---- helpers -----------------------------------------------------------------------------------------------------
def _cluster(text: str) -> Any:
    """``local:N``: N local worker processes (CPU); else a cluster JSON file or packaged example."""
    from ..core.cluster import Cluster

    if text.startswith("local:"):
        return Cluster.local(int(text.partition(":")[2]))  # the config checked N
    return Cluster.load(resolve_file(text))


def _under(field: str, make: Any) -> Any:
    """``make()``, its :class:`~hspmd_sdk.errors.PlanValidationError` re-raised with each problem under the config
    field ``field`` it comes from."""
    try:
        return make()
    except PlanValidationError as e:
        leaf = field.rpartition(".")[2]
        problems = [(field if p in ("<root>", leaf) else p if p.startswith(field) else f"{field}: {p}", r)
                    for p, r in e.problems]
        raise PlanValidationError(problems, what=e.what) from None


TRAIN = Command("run a train config (TOML or JSON: the model, strategy and cluster, every option)",
                add_train_arguments, run_train)

