"""Pipeline construction (paper Appendix A.2, Figure 21).

Start with one pipeline of one stage per device.  Scan the Reshards of the forward and backward executable
subgraphs in order and split each one's communication into collective and point-to-point parts:

* devices in one collective (e.g. the TP all-reduce, a CP all-gather) are merged into one stage of one pipeline,
  and so are the devices of each of ``kernel_groups`` (those that exchange data inside a kernel: the ranks of a
  context-parallel group, whose attention rings keys and values between them);
* a point-to-point message ``src -> dst`` (SendRecv, BSR) of a *forward* Reshard makes the stage of ``dst`` the
  stage after the stage of ``src`` (backward messages flow the other way and add nothing new); the devices
  one stage sends to in one Reshard form one stage.

The result must be chains: a stage with two successors or two predecessors is an error naming them.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from ..errors import SpecializationError
from .annotation import format_ranks
from .comm_ops import OpKind

__all__ = ["build_pipelines", "collective_groups", "p2p_edges", "rank_kinds", "op_ranks"]

def op_ranks(op: Any) -> set[int]:
    """Every rank that takes part in one communication operator of a ``CommPlan`` (its ``ranks()``)."""
    return set(op.ranks())


def rank_kinds(plan: Any, rank: int) -> tuple[OpKind, ...]:
    """The communication kinds ``rank`` executes for ``plan`` (e.g. ``("ReduceScatter",)`` on GPU 0 and
    ``("BSR",)`` on GPU 6 for the paper's Reshard id=2); ``()`` when it takes no part."""
    return tuple(op.kind for op in plan.ops if rank in op_ranks(op))


def collective_groups(plan: Any) -> Iterable[tuple[int, ...]]:
    """Rank groups of every collective of ``plan`` (bottom- and top-tier), excluding local ops."""
    for op in plan.ops:
        yield from op.collective_groups()


def p2p_edges(plan: Any) -> Iterable[tuple[int, int]]:
    """``(src, dst)`` of every point-to-point message of ``plan`` between different ranks."""
    for op in plan.ops:
        yield from op.p2p_edges()


class _UnionFind:
    def __init__(self, items: Iterable[int]) -> None:
        self.parent = {i: i for i in items}

    def find(self, x: int) -> int:
        p = self.parent.setdefault(x, x)
        while p != self.parent[p]:
            self.parent[p] = self.parent[self.parent[p]]
            p = self.parent[p]
        self.parent[x] = p
        return p

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _merge_peers(uf: _UnionFind, msgs: Sequence[tuple[int, int]]) -> None:
    """The devices one stage sends a Reshard's activations to form one next stage (GPU 5 and 6 after GPU 1 in
    Figure 21), and the devices that send to one stage form one stage."""
    changed = True
    while changed:
        changed = False
        for a_of, b_of in ((0, 1), (1, 0)):
            groups: dict[int, list[int]] = {}
            for m in msgs:
                groups.setdefault(uf.find(m[a_of]), []).append(m[b_of])
            for peers in groups.values():
                root = uf.find(peers[0])
                for q in peers[1:]:
                    if uf.find(q) != root:
                        uf.union(root, q)
                        root = uf.find(root)
                        changed = True


def build_pipelines(ranks: Iterable[int], forward_plans: Sequence[Any], backward_plans: Sequence[Any],
                    order_key: Any = None,
                    kernel_groups: Iterable[Sequence[int]] = ()) -> list[list[list[int]]]:
    """Pipelines (each a list of stages, each a sorted list of ranks) from the forward / backward CommPlans.

    ``ranks``: every device that runs part of the forward pass.  ``order_key(first_stage) -> sortable`` orders
    the pipelines (default: by the smallest rank of the first stage).  ``kernel_groups``: groups of devices that
    communicate inside a kernel (merged like a collective's).
    """
    uf = _UnionFind(ranks)
    for group in kernel_groups:
        for r in list(group)[1:]:
            uf.union(group[0], r)
    seen: set[int] = set()
    for plan in list(forward_plans) + list(backward_plans):
        if id(plan) in seen:
            continue
        seen.add(id(plan))
        for group in collective_groups(plan):
            for r in group[1:]:
                uf.union(group[0], r)
    seen.clear()
    edges: list[tuple[int, int]] = []
    for plan in forward_plans:
        if id(plan) in seen:
            continue
        seen.add(id(plan))
        msgs = list(p2p_edges(plan))
        _merge_peers(uf, msgs)
        edges += msgs
    succ: dict[int, set[int]] = {}
    pred: dict[int, set[int]] = {}
    for src, dst in edges:
        a, b = uf.find(src), uf.find(dst)
        if a != b:
            succ.setdefault(a, set()).add(b)
            pred.setdefault(b, set()).add(a)
    stages: dict[int, list[int]] = {}
    for r in sorted(uf.parent):
        stages.setdefault(uf.find(r), []).append(r)
    for root, nxt in succ.items():
        if len(nxt) > 1:
            raise SpecializationError(
                f"stage {format_ranks(stages[root])} sends activations to several stages "
                f"({'; '.join(format_ranks(stages[n]) for n in sorted(nxt))}); HSPMD pipelines are chains — make "
                "each stage feed exactly one next stage")
    for root, prv in pred.items():
        if len(prv) > 1:
            raise SpecializationError(
                f"stage {format_ranks(stages[root])} receives activations from several stages "
                f"({'; '.join(format_ranks(stages[p]) for p in sorted(prv))}); HSPMD pipelines are chains")
    pipelines: list[list[list[int]]] = []
    for root in sorted(stages):
        if root in pred:
            continue
        # no stage has two predecessors and ``root`` has none, so the walk cannot come back to a stage it left
        chain, cur = [], root
        while True:
            chain.append(stages[cur])
            nxt = succ.get(cur)
            if not nxt:
                break
            cur = next(iter(nxt))
        pipelines.append(chain)
    covered = {r for p in pipelines for s in p for r in s}
    if covered != set(uf.parent):
        missing = sorted(set(uf.parent) - covered)
        raise SpecializationError(f"ranks {format_ranks(missing)} lie on a cycle of stages; pipelines must be chains")
    key = order_key or (lambda first: min(first))
    pipelines.sort(key=lambda p: key(p[0]))
    return pipelines
