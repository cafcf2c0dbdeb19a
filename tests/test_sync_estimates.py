"""``sync_estimates`` (every pipeline's gradient-sync estimate at once, linear in the pipelines) gives exactly the
figures of ``_sync_estimate`` (one pipeline, a link to every other pipeline): random clusters of nodes of mixed
kinds on shared or separate hosts, with and without a host link, random pipelines (overlapping ranks too), with
equal links on different places (ties, where the first holder's link must win)."""
from __future__ import annotations

import random

import pytest

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.models.llama import LlamaConfig
from hspmd_sdk.planner.hetero import PipelinePlan, PlanContext, TPGroup, _sync_estimate, sync_estimates

MODEL = LlamaConfig(vocab_size=32000, hidden_size=4096, num_layers=8, num_heads=32, ffn_hidden_size=11008)


def _cluster(rng: random.Random) -> Cluster:
    nodes, rank = [], 0
    for k in range(rng.randint(1, 6)):
        size = rng.choice([1, 2, 4])
        nodes.append({"host": f"h{rng.randint(0, 2)}", "kind": rng.choice(["H800", "H20"]),
                      "ranks": list(range(rank, rank + size))})
        rank += size
    extra = {}
    if rng.random() < 0.5:  # a host link, sometimes as fast as the network or a node's own (ties of bandwidth)
        extra["host_bandwidth_gbs"] = rng.choice([25.0, 64.0, 900.0])
    return Cluster.load({"nodes": nodes, "inter_bandwidth_gbs": rng.choice([25.0, 64.0]), **extra})


def _pipelines(rng: random.Random, cl: Cluster) -> list[PipelinePlan]:
    out = []
    for _ in range(rng.randint(1, 5)):
        cuts = sorted(rng.sample(range(1, MODEL.num_layers), rng.randint(0, 3)))
        layers = tuple(b - a for a, b in zip([0] + cuts, cuts + [MODEL.num_layers]))
        groups = []
        for _ in layers:
            node = rng.randrange(len(cl.nodes))
            ranks = cl.nodes[node].ranks
            tp = rng.choice([t for t in (1, 2, 4) if t <= len(ranks)])
            start = rng.randrange(0, len(ranks) - tp + 1)
            groups.append(TPGroup(tuple(ranks[start:start + tp]), cl.nodes[node].kind, node))
        out.append(PipelinePlan(tuple(groups), layers, (1.0,) * len(layers), 0.0))
    return out


@pytest.mark.parametrize("seed", range(300))
def test_sync_estimates_equal_the_one_by_one_estimate(seed: int) -> None:
    rng = random.Random(seed)
    cl = _cluster(rng)
    pipes = _pipelines(rng, cl)
    ctx = PlanContext(MODEL, cl, global_batch=8, seq_len=128, zero1=rng.random() < 0.5)
    assert sync_estimates(ctx, pipes) == [_sync_estimate(ctx, i, pipes) for i in range(len(pipes))]


def test_the_first_of_equal_links_wins() -> None:
    """Equal bandwidths, different latencies: the host link (64 GB/s, intra latency) and the network (64 GB/s, inter
    latency).  The one-by-one form keeps the link of the first holder in pipeline order; so must the fast one,
    whichever place comes first."""
    nodes = [{"host": "a", "kind": "H20", "ranks": [0]}, {"host": "a", "kind": "H20", "ranks": [1]},
             {"host": "b", "kind": "H20", "ranks": [2]}]
    cl = Cluster.load({"nodes": nodes, "inter_bandwidth_gbs": 64.0, "host_bandwidth_gbs": 64.0,
                       "inter_latency_us": 50.0})
    ctx = PlanContext(MODEL, cl, global_batch=8, seq_len=128)
    one = lambda r: PipelinePlan((TPGroup((r,), "H20", r),), (MODEL.num_layers,), (1.0,), 0.0)  # noqa: E731
    for order in ([0, 1, 2], [0, 2, 1]):
        pipes = [one(r) for r in order]
        got = sync_estimates(ctx, pipes)
        assert got == [_sync_estimate(ctx, i, pipes) for i in range(3)]
    assert sync_estimates(ctx, [one(0), one(1), one(2)])[0] != sync_estimates(ctx, [one(0), one(2), one(1)])[0]
