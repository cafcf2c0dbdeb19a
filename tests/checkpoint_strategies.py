"""Random training strategies for the checkpoint tests: any subset of a cluster's ranks cut into 1-3 pipelines
(data parallel across them), each of 1-2 stages with a TP degree of 1, 2 or 4 per stage and its own layer range,
the global batch split unevenly across pipelines into each pipeline's own micro-batching, ZeRO-1 on or off.

Every draw is specialized once; draws that the SDK rejects (a TP degree the model does not divide, a layer count
that does not fit) are redrawn, so a seed always gives the same strategies.
"""
from __future__ import annotations

import random
from typing import Any

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.specialize import specialize
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.errors import HSPMDError

TP_DEGREES = (1, 2, 4)
GLOBAL_BATCH = 8


def _cuts(rng: random.Random, n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` non-empty consecutive pieces of ``n``."""
    points = sorted(rng.sample(range(1, n), parts - 1)) if parts > 1 else []
    bounds = [0, *points, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _pipeline(rng: random.Random, devices: list[int], rows: int, layers: int) -> dict[str, Any] | None:
    stages_n = rng.choice([1, 2]) if len(devices) >= 2 else 1
    sizes = _cuts(rng, len(devices), stages_n)
    if any(s not in TP_DEGREES for s in sizes):
        return None
    spans = _cuts(rng, layers, stages_n)
    stages, d0, l0 = [], 0, 0
    for size, span in zip(sizes, spans):
        stages.append({"devices": devices[d0:d0 + size], "layers": [l0, l0 + span - 1]})
        d0, l0 = d0 + size, l0 + span
    nmb = rng.choice([d for d in range(1, rows + 1) if rows % d == 0])
    return {"stages": stages, "micro_batch_size": rows // nmb, "num_micro_batches": nmb}


def random_strategy(rng: random.Random, model: Any, world: int, *, ranks: tuple[int, int] | None = None,
                    tries: int = 200) -> tuple[dict[str, Any], Any]:
    """``(strategy JSON, Program)`` on ``Cluster.local(world)``, drawn from ``rng``; ``ranks``: the least and most
    ranks it may use (default 1 and ``world``)."""
    cluster = Cluster.local(world)
    lo, hi = ranks or (1, world)
    for _ in range(tries):
        k = rng.randint(lo, hi)
        devices = sorted(rng.sample(range(world), k))
        pipes_n = rng.randint(1, min(3, k))
        sizes = _cuts(rng, k, pipes_n)
        rows = _cuts(rng, GLOBAL_BATCH, pipes_n)
        pipes, d0 = [], 0
        for size, r in zip(sizes, rows):
            p = _pipeline(rng, devices[d0:d0 + size], r, model.num_layers)
            d0 += size
            if p is None:
                break
            pipes.append(p)
        else:
            data = {"pipelines": pipes, "zero1": pipes_n > 1 and rng.random() < 0.5}
            try:
                strategy = Strategy.load(data)
                program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
            except HSPMDError:
                continue
            return data, program
    raise AssertionError(f"no valid strategy in {tries} draws")


def features(data: dict[str, Any]) -> dict[str, Any]:
    """What distinguishes a strategy: its ranks, pipelines, TP degrees per stage, ZeRO-1."""
    return {"ranks": sorted(r for p in data["pipelines"] for s in p["stages"] for r in s["devices"]),
            "pipelines": len(data["pipelines"]),
            "tp": [[len(s["devices"]) for s in p["stages"]] for p in data["pipelines"]],
            "zero1": bool(data.get("zero1"))}
