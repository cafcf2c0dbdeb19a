"""``hspmd validate``, ``hspmd show`` and ``hspmd examples``: check, summarize and list strategies, annotation plans
and clusters (:data:`VALIDATE`, :data:`SHOW`, :data:`EXAMPLES_LIST`).

FILE arguments are a path, or the name of a packaged example (``hspmd show table9_32b_16h800_16h20``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..core.annotation import format_ranks
from ..core.cluster import Cluster, format_memory
from ..core.plan import AnnotationPlan
from ..core.strategy import Strategy
from ..errors import PlanValidationError
from ..models.registry import load_model_spec
from .command import Command
from .inputs import EXAMPLES, MAX_SAMPLES, example_context, int_in, load_cluster, read_json, resolve_file

__all__ = ["VALIDATE", "SHOW", "EXAMPLES_LIST", "detect_kind", "load_context", "cluster_summary"]


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


def _examples(args: argparse.Namespace) -> int:
    index = json.loads((EXAMPLES / "index.json").read_text())
    print("strategies (model, cluster, global batch):")
    for name, e in index["strategies"].items():
        print(f"  {name:<36} {e['model']:<10} {e['cluster']:<24} {e['global_batch']}")
    print("clusters:")
    for name, desc in index["clusters"].items():
        print(f"  {name:<36} {desc}")
    return 0


VALIDATE = Command("check a strategy, annotation plan or cluster JSON: exit 1 with every problem found, else 0 with "
                   "what was checked and what could not be (a strategy's placement, TP and memory need --model and "
                   "--cluster)", lambda p: _context_args(p, batch=True), _validate)
SHOW = Command("print a readable summary of a strategy, annotation plan or cluster",
               lambda p: _context_args(p, batch=False), _show)
EXAMPLES_LIST = Command("list the packaged example strategies and clusters", lambda p: None, _examples)
