"""The planner's subcommands (:data:`PLAN`, :data:`SIMULATE`, listed by :mod:`hspmd_sdk.cli.entry`)::

    hspmd plan --cluster FILE|PRESET --model PRESET --scenario hetero|elastic|mixed
               [--strategy FILE --failed RANKS] [--lengths FILE [--programs DIR]] -o strategy.json
    hspmd simulate STRATEGY --model PRESET --cluster FILE --global-batch N --seq-len N

A cluster is a JSON file, a packaged example name (``paper_16h800_32h20``) or counts of device kinds
(``H800:16,H20:32``, eight to a node, ranks in the order given).  Ranks are written ``31``, ``24-31`` or
``5,7,24-31``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .command import Command
from .inputs import (MAX_SAMPLES, MAX_TOKENS, check_output, example_context, int_in, load_cluster, read_json,
                         read_text, resolve_file, write_output)
from ..core.annotation import parse_ranks as parse
from ..errors import PlanValidationError
from ..models.registry import load_model_spec
from ..planner.cost import CostModel
from ..planner.simulator import simulate

__all__ = ["PLAN", "SIMULATE", "add_plan_arguments", "run_plan", "add_simulate_arguments", "run_simulate",
           "parse_ranks", "load_cluster", "read_lengths", "read_cost"]


# ---- argument helpers -----------------------------------------------------------------------------------------
def parse_ranks(text: str, cluster: Any = None) -> list[int]:
    """``"5,7,24-31"`` -> ``[5, 7, 24, ..., 31]`` (the core's rank notation; errors name ``--failed``); with a
    ``cluster``, every rank must be one of its ranks."""

    try:
        ranks = sorted(set(parse(text))) if len(text) <= 10_000 else None
    except (ValueError, OverflowError, MemoryError):
        ranks = None
    if ranks is None:
        raise PlanValidationError([("--failed", f"cannot read {text[:60]!r}; write ranks as 31, 24-31 or 5,7")],
                                  what="arguments")
    if cluster is not None:
        outside = [r for r in ranks if not 0 <= r < cluster.num_ranks]
        if outside:
            raise PlanValidationError([("--failed", f"rank {outside[0]} is not in the cluster ({cluster.num_ranks} "
                                                    f"ranks: 0..{cluster.num_ranks - 1})")], what="arguments")
        if len(ranks) == cluster.num_ranks:
            raise PlanValidationError([("--failed", "every rank of the cluster failed: nothing to plan on")],
                                      what="arguments")
    return ranks


def read_lengths(path: str) -> list[int]:
    """Sequence lengths: a JSON list, or one integer a line (each 1..2**24)."""
    file = resolve_file(path)
    text = read_text(file)
    try:
        if text.lstrip().startswith("["):
            raw = read_json(file)
            if not isinstance(raw, list):
                raise ValueError("not a list")
            values = [int(x) if isinstance(x, int) and not isinstance(x, bool) else _no_int(x) for x in raw]
        else:
            values = [int(line.split()[0]) for line in text.splitlines() if line.strip() and not
                      line.startswith("#")]
    except (ValueError, TypeError) as e:
        raise PlanValidationError([(str(file), f"expected sequence lengths (a JSON list of integers, or one "
                                               f"integer a line): {str(e)[:80]}")], what="lengths") from None
    bad = [v for v in values if not 1 <= v <= MAX_TOKENS]
    if not values or bad:
        raise PlanValidationError([(str(file), f"length {bad[0]} is out of range (1..{MAX_TOKENS})" if bad
                                   else "no sequence lengths")], what="lengths")
    return values


def _no_int(x: Any) -> int:
    raise ValueError(f"{str(x)[:40]!r} is not an integer")


def read_cost(path: str | None) -> Any:


    if not path:
        return None
    file = resolve_file(path)
    try:
        return CostModel.model_validate_json(read_text(file, what="cost model"))
    except ValidationError as e:
        raise PlanValidationError.from_pydantic(e, what="cost model") from None


# ---- plan ----------------------------------------------------------------------------------------------------
def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``hspmd plan``."""
    p.add_argument("--cluster", required=True, metavar="FILE|PRESET",
                   help="cluster JSON, packaged example name, or counts like H800:16,H20:32")
    p.add_argument("--model", required=True, metavar="PRESET", help="model preset or model-config JSON")
    p.add_argument("--scenario", choices=("hetero", "elastic", "mixed"), default="hetero")
    p.add_argument("--global-batch", type=int_in(1, MAX_SAMPLES), metavar="N",
                   help="samples per step (hetero: default 64; elastic: default the running strategy's)")
    p.add_argument("--seq-len", type=int_in(1, MAX_TOKENS), metavar="N", help="sequence length (default: the "
                                                                              "model's)")
    p.add_argument("--strategy", metavar="FILE", help="elastic: the strategy running before the failure")
    p.add_argument("--failed", metavar="RANKS", help="elastic: failed ranks, e.g. 31 or 24-31")
    p.add_argument("--lengths", metavar="FILE", help="mixed: sequence lengths (JSON list or one a line)")
    p.add_argument("--tokens-per-batch", type=int_in(1, MAX_TOKENS * MAX_SAMPLES), default=200_000, metavar="N",
                   help="mixed: tokens a batch")
    p.add_argument("--context-len", type=int_in(1, MAX_TOKENS), metavar="N",
                   help="mixed: context length (default: longest)")
    p.add_argument("--programs", metavar="DIR", help="mixed: specialize every candidate and write its annotation "
                                                      "plan (settings: max_seq_len, windows) to DIR/candidate_<i>.json")
    p.add_argument("--packing", action="store_true", help="mixed: price micro-batches as packed rows of whole "
                                                          "sequences (what 'hspmd run --programs' runs unless "
                                                          "--padding); windows may then exceed the context")
    p.add_argument("--cost", metavar="FILE", help="cost model JSON (default: the analytic defaults)")
    p.add_argument("--no-zero1", action="store_true", help="hetero: disable ZeRO-1")
    p.add_argument("-o", "--output", metavar="FILE", help="write the strategy (mixed: the plan) as JSON")


def run_plan(args: argparse.Namespace) -> int:
    """Run ``hspmd plan``; prints the plan, its simulated step time and the planning time."""
    output = check_output(args.output) if args.output else None  # before minutes of planning, not after
    model = load_model_spec(args.model)
    cluster = load_cluster(args.cluster)
    seq = args.seq_len or model.max_seq_len
    cost = read_cost(args.cost)
    t0 = time.perf_counter()
    if args.scenario == "mixed":
        if not args.lengths:
            raise PlanValidationError([("--lengths", "the mixed scenario needs a file of sequence lengths")],
                                      what="arguments")
        # lazy: a planner is loaded only to plan (this module loads at `hspmd --help`)
        from ..planner.mixed import plan_mixed

        plan = plan_mixed(model, cluster, read_lengths(args.lengths), tokens_per_batch=args.tokens_per_batch,
                          context_len=args.context_len, cost=cost, packing=args.packing)
        print(plan.summary())
        print(f"planned in {time.perf_counter() - t0:.2f} s")
        if output is not None:
            write_output(output, plan.to_json())
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
        # lazy: a planner is loaded only to plan (this module loads at `hspmd --help`)
        from ..planner.elastic import replan_elastic

        strategy = replan_elastic(model, cluster, resolve_file(args.strategy), parse_ranks(args.failed, cluster),
                                  seq_len=seq, global_batch=args.global_batch, cost=cost)
    else:
        # lazy: a planner is loaded only to plan (this module loads at `hspmd --help`)
        from ..planner.hetero import plan_hetero

        strategy = plan_hetero(model, cluster, global_batch=args.global_batch or 64, seq_len=seq, cost=cost,
                               zero1=not args.no_zero1)
    elapsed = time.perf_counter() - t0

    res = simulate(model, strategy, cluster, global_batch=strategy.global_batch, seq_len=seq, cost=cost)
    print(strategy.summary(cluster=cluster))
    print(res.summary())
    print(f"planned in {elapsed:.2f} s")
    if output is not None:
        write_output(output, strategy.to_json())
        print(f"wrote {args.output}")
    return 0


# ---- simulate ------------------------------------------------------------------------------------------------
def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``hspmd simulate``."""
    p.add_argument("strategy", metavar="STRATEGY", help="strategy JSON or packaged example name")
    p.add_argument("--model", metavar="PRESET", help="model preset (default: from the example index)")
    p.add_argument("--cluster", metavar="FILE|PRESET", help="cluster (default: from the example index)")
    p.add_argument("--global-batch", type=int_in(1, MAX_SAMPLES), metavar="N", help="check the strategy's global "
                                                                                   "batch")
    p.add_argument("--seq-len", type=int_in(1, MAX_TOKENS), metavar="N", help="sequence length (default: the "
                                                                              "model's)")
    p.add_argument("--cost", metavar="FILE", help="cost model JSON")
    p.add_argument("--timeline", action="store_true", help="print each device's busy time by kind")


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``hspmd simulate``; prints the step time, bubble, memory and (``--timeline``) per-device busy time.
    Exit status 1 (with an ``error:`` line) when a device runs out of memory."""
    import sys


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
                   cost=read_cost(args.cost))
    print(res.summary())
    if args.timeline:
        kinds = ("F", "B", "comm", "sync", "optim", "idle")
        print("  device " + " ".join(f"{k:>7}" for k in kinds))
        for d in res.timeline:
            print(f"  {d:>6} " + " ".join(f"{res.busy(d, (k,)):7.2f}" for k in kinds))
    if res.oom:
        print(f"error: the strategy does not fit: devices {res.oom} run out of memory (see the peak above)",
              file=sys.stderr)
        return 1
    return 0


PLAN = Command("plan a strategy for a cluster and model (--scenario hetero|elastic|mixed)", add_plan_arguments,
               run_plan)
SIMULATE = Command("estimate one training step of a strategy (step time, bubble, peak memory)",
                   add_simulate_arguments, run_simulate)
