"""The planner's subcommands, for :mod:`hspmd_sdk.cli` to register::

    hspmd plan --cluster FILE|PRESET --model PRESET --scenario hetero|elastic|mixed
               [--strategy FILE --failed RANKS] [--lengths FILE [--programs DIR]] -o strategy.json
    hspmd simulate STRATEGY --model PRESET --cluster FILE --global-batch N --seq-len N

A cluster is a JSON file, a packaged example name (``paper_16h800_32h20``) or counts of device kinds
(``H800:16,H20:32``, eight to a node, ranks in the order given).  Ranks are written ``31``, ``24-31`` or
``5,7,24-31``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

__all__ = ["add_plan_arguments", "run_plan", "add_simulate_arguments", "run_simulate", "parse_ranks",
           "load_cluster", "read_lengths"]


# ---- argument helpers -----------------------------------------------------------------------------------------
def parse_ranks(text: str) -> list[int]:
    """``"5,7,24-31"`` -> ``[5, 7, 24, ..., 31]`` (the core's rank notation; errors name ``--failed``)."""
    from ..core.annotation import parse_ranks as parse
    from ..errors import PlanValidationError

    try:
        return sorted(set(parse(text)))
    except ValueError:
        raise PlanValidationError([("--failed", f"cannot read {text!r}; write ranks as 31, 24-31 or 5,7")],
                                  what="arguments") from None


def load_cluster(text: str) -> Any:
    """A cluster from a JSON path, a packaged example name, or ``KIND:COUNT,...``."""
    from ..cli import resolve_file
    from ..core.cluster import Cluster

    if ":" in text and not Path(text).exists() and "{" not in text:
        counts = {}
        for part in text.split(","):
            kind, _, n = part.partition(":")
            counts[kind.strip()] = int(n)
        return Cluster.mixed(counts)
    return Cluster.load(resolve_file(text))


def read_lengths(path: str) -> list[int]:
    """Sequence lengths: a JSON list, or one integer a line."""
    from ..cli import resolve_file

    text = resolve_file(path).read_text()
    if text.lstrip().startswith("["):
        return [int(x) for x in json.loads(text)]
    return [int(line.split()[0]) for line in text.splitlines() if line.strip() and not line.startswith("#")]


def _cost(path: str | None) -> Any:
    from .cost import CostModel

    return CostModel.load(path) if path else None


# ---- plan ----------------------------------------------------------------------------------------------------
def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``hspmd plan``."""
    p.add_argument("--cluster", required=True, metavar="FILE|PRESET",
                   help="cluster JSON, packaged example name, or counts like H800:16,H20:32")
    p.add_argument("--model", required=True, metavar="PRESET", help="model preset or model-config JSON")
    p.add_argument("--scenario", choices=("hetero", "elastic", "mixed"), default="hetero")
    p.add_argument("--global-batch", type=int, metavar="N",
                   help="samples per step (hetero: default 64; elastic: default the running strategy's)")
    p.add_argument("--seq-len", type=int, metavar="N", help="sequence length (default: the model's)")
    p.add_argument("--strategy", metavar="FILE", help="elastic: the strategy running before the failure")
    p.add_argument("--failed", metavar="RANKS", help="elastic: failed ranks, e.g. 31 or 24-31")
    p.add_argument("--lengths", metavar="FILE", help="mixed: sequence lengths (JSON list or one a line)")
    p.add_argument("--tokens-per-batch", type=int, default=200_000, metavar="N", help="mixed: tokens a batch")
    p.add_argument("--context-len", type=int, metavar="N", help="mixed: context length (default: longest)")
    p.add_argument("--programs", metavar="DIR", help="mixed: specialize every candidate and write its annotation "
                                                      "plan (meta: max_seq_len, windows) to DIR/candidate_<i>.json")
    p.add_argument("--cost", metavar="FILE", help="cost model JSON (default: the analytic defaults)")
    p.add_argument("--no-zero1", action="store_true", help="hetero: disable ZeRO-1")
    p.add_argument("-o", "--output", metavar="FILE", help="write the strategy (mixed: the plan) as JSON")


def run_plan(args: argparse.Namespace) -> int:
    """Run ``hspmd plan``; prints the plan, its simulated step time and the planning time."""
    from ..models.registry import load_model_spec
    from ..errors import PlanValidationError

    model = load_model_spec(args.model)
    cluster = load_cluster(args.cluster)
    seq = args.seq_len or model.max_seq_len
    cost = _cost(args.cost)
    t0 = time.perf_counter()
    if args.scenario == "mixed":
        if not args.lengths:
            raise PlanValidationError([("--lengths", "the mixed scenario needs a file of sequence lengths")],
                                      what="arguments")
        from .mixed import plan_mixed

        plan = plan_mixed(model, cluster, read_lengths(args.lengths), tokens_per_batch=args.tokens_per_batch,
                          context_len=args.context_len, cost=cost)
        print(plan.summary())
        print(f"planned in {time.perf_counter() - t0:.2f} s")
        if args.output:
            Path(args.output).write_text(plan.to_json())
            print(f"wrote {args.output}")
        if args.programs:
            out = Path(args.programs)
            out.mkdir(parents=True, exist_ok=True)
            for i, program in enumerate(plan.programs(model, cluster)):
                (out / f"candidate_{i}.json").write_text(program.plan.to_json())
            print(f"wrote {len(plan.entries)} specialized candidates to {out}")
        return 0
    if args.scenario == "elastic":
        if not args.strategy or not args.failed:
            raise PlanValidationError([("--strategy/--failed", "the elastic scenario needs the running strategy "
                                                               "and the failed ranks")], what="arguments")
        from ..cli import resolve_file
        from .elastic import replan_elastic

        strategy = replan_elastic(model, cluster, resolve_file(args.strategy), parse_ranks(args.failed),
                                  seq_len=seq, global_batch=args.global_batch, cost=cost)
    else:
        from .hetero import plan_hetero

        strategy = plan_hetero(model, cluster, global_batch=args.global_batch or 64, seq_len=seq, cost=cost,
                               zero1=not args.no_zero1)
    elapsed = time.perf_counter() - t0
    from .simulator import simulate

    res = simulate(model, strategy, cluster, global_batch=strategy.global_batch, seq_len=seq, cost=cost)
    print(strategy.summary(cluster=cluster))
    print(res.summary())
    print(f"planned in {elapsed:.2f} s")
    if args.output:
        Path(args.output).write_text(strategy.to_json())
        print(f"wrote {args.output}")
    return 0


# ---- simulate ------------------------------------------------------------------------------------------------
def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``hspmd simulate``."""
    p.add_argument("strategy", metavar="STRATEGY", help="strategy JSON or packaged example name")
    p.add_argument("--model", metavar="PRESET", help="model preset (default: from the example index)")
    p.add_argument("--cluster", metavar="FILE|PRESET", help="cluster (default: from the example index)")
    p.add_argument("--global-batch", type=int, metavar="N", help="check the strategy's global batch")
    p.add_argument("--seq-len", type=int, metavar="N", help="sequence length (default: the model's)")
    p.add_argument("--cost", metavar="FILE", help="cost model JSON")
    p.add_argument("--timeline", action="store_true", help="print each device's busy time by kind")


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``hspmd simulate``; prints the step time, bubble, memory and (``--timeline``) per-device busy time."""
    from ..cli import example_context, resolve_file
    from ..models.registry import load_model_spec
    from ..errors import PlanValidationError
    from .simulator import simulate

    path = resolve_file(args.strategy)
    ctx = example_context(path)
    model_name = args.model or ctx.get("model")
    cluster_name = args.cluster or (str(path.resolve().parent / ctx["cluster"]) if "cluster" in ctx else None)
    if not model_name or not cluster_name:
        raise PlanValidationError([("--model/--cluster", "give the model and the cluster of this strategy")],
                                  what="arguments")
    model = load_model_spec(model_name)
    cluster = load_cluster(cluster_name)
    batch = args.global_batch if args.global_batch is not None else ctx.get("global_batch")
    res = simulate(model, path, cluster, global_batch=batch, seq_len=args.seq_len or model.max_seq_len,
                   cost=_cost(args.cost))
    print(res.summary())
    if args.timeline:
        kinds = ("F", "B", "comm", "sync", "optim", "idle")
        print("  device " + " ".join(f"{k:>7}" for k in kinds))
        for d in res.timeline:
            print(f"  {d:>6} " + " ".join(f"{res.busy(d, (k,)):7.2f}" for k in kinds))
    return 0
