"""Kills for the mutants of hspmd_sdk/core/pipelines.py (issue 49): the pipeline builder of Appendix A.2 on
hand-made CommPlans (collectives merge a stage, a forward Reshard's messages link stages, a backward one's do not),
its error messages, and the order of pipelines, stages and ranks."""
from __future__ import annotations

import pytest

from hspmd_sdk.core.pipelines import _merge_peers, _UnionFind, build_pipelines, rank_kinds
from hspmd_sdk.errors import SpecializationError


class Op:
    """A stand-in communication operator: a kind, collective groups and point-to-point messages."""

    def __init__(self, kind: str = "X", groups=(), edges=()) -> None:
        self.kind, self.groups, self.edges = kind, tuple(groups), tuple(edges)

    def collective_groups(self):
        return self.groups

    def p2p_edges(self):
        return self.edges

    def ranks(self):
        return {r for g in self.groups for r in g} | {r for e in self.edges for r in e}


class Plan:
    def __init__(self, *ops: Op) -> None:
        self.ops = ops


def P(groups=(), edges=()) -> Plan:
    return Plan(Op(groups=groups, edges=edges))


def test_one_stage_per_device_and_a_chain_of_sends() -> None:
    """No communication: one pipeline of one stage per rank, ordered by rank; sends chain them."""
    assert build_pipelines([2, 0, 1], [], []) == [[[0]], [[1]], [[2]]]
    assert build_pipelines(range(4), [P(edges=[(2, 3)]), P(edges=[(0, 1)]), P(edges=[(1, 2)])], []) == \
        [[[0], [1], [2], [3]]]


def test_collectives_merge_stages_forward_and_backward() -> None:
    """TP groups (in a forward or a backward plan) form stages; the forward sends link them."""
    fwd = [P(groups=[(2, 3)], edges=[(0, 2), (1, 3)])]
    bwd = [P(groups=[(1, 0)])]
    assert build_pipelines(range(4), fwd, bwd) == [[[0, 1], [2, 3]]]
    # without the backward group, 0 and 1 still form one stage: both send to the stage {2, 3}
    assert build_pipelines(range(4), fwd, []) == [[[0, 1], [2, 3]]]


def test_backward_messages_add_no_edge() -> None:
    """A backward plan's point-to-point messages link nothing."""
    assert build_pipelines([0, 1], [], [P(edges=[(1, 0)])]) == [[[0]], [[1]]]
    assert build_pipelines([0, 1], [P(edges=[(0, 1)])], [P(edges=[(1, 0)])]) == [[[0], [1]]]


def test_kernel_groups_merge_like_collectives() -> None:
    """Every rank of a kernel group joins the group's first rank's stage."""
    assert build_pipelines(range(6), [P(edges=[(0, 3), (1, 4), (2, 5)])], [],
                           kernel_groups=[(2, 1, 0), [5, 4, 3]]) == [[[0, 1, 2], [3, 4, 5]]]
    assert build_pipelines(range(3), [], [], kernel_groups=[(1, 2)]) == [[[0]], [[1, 2]]]
    assert build_pipelines(range(3), [], [], kernel_groups=[(0,)]) == [[[0]], [[1]], [[2]]]


def test_the_devices_one_stage_sends_to_form_one_stage() -> None:
    """Figure 21: GPU 1 sends to 5 and 6 in one Reshard, so 5 and 6 are one stage; and two senders to one
    device form one stage."""
    assert build_pipelines([1, 5, 6], [P(edges=[(1, 5), (1, 6)])], []) == [[[1], [5, 6]]]
    assert build_pipelines([0, 1, 2], [P(edges=[(0, 2), (1, 2)])], []) == [[[0, 1], [2]]]
    # the same messages in two Reshards: two successors
    with pytest.raises(SpecializationError):
        build_pipelines([1, 5, 6], [P(edges=[(1, 5)]), P(edges=[(1, 6)])], [])


def test_merge_peers_repeats_until_nothing_changes() -> None:
    """Merging senders can make new receiver groups: repeated until stable."""
    uf = _UnionFind(range(6))
    # 0 and 1 both send to 2 -> one stage; then that stage sends to 3 and 4 -> one stage; 4 and 5 receive from
    # one stage; 5 is sent to by 1 only
    _merge_peers(uf, [(0, 2), (1, 2), (0, 3), (1, 5), (4, 4)])
    roots = {r: uf.find(r) for r in range(6)}
    assert roots == {0: 0, 1: 0, 2: 2, 3: 2, 4: 4, 5: 2}


def test_merge_peers_needs_a_second_round() -> None:
    """A receiver is also a sender: its merge in the second direction makes new peers in the first."""
    uf = _UnionFind(range(6))
    _merge_peers(uf, [(0, 3), (1, 4), (3, 5), (4, 5)])
    # round 1 merges the senders 3 and 4 of 5; only round 2 sees 0 and 1 send to that one stage
    assert {r: uf.find(r) for r in range(6)} == {0: 0, 1: 0, 2: 2, 3: 3, 4: 3, 5: 5}


def test_union_find_roots_at_the_smallest() -> None:
    """Union makes the smaller root the root; find compresses paths and adds unknown items."""
    uf = _UnionFind([3, 1, 2])
    uf.union(3, 2)
    assert uf.parent == {3: 2, 1: 1, 2: 2}
    uf.union(2, 1)
    assert uf.find(3) == 1 and uf.parent[3] == 1
    uf.union(1, 1)
    assert uf.parent == {3: 1, 1: 1, 2: 1}
    assert uf.find(9) == 9 and uf.parent[9] == 9
    uf = _UnionFind(range(5))
    for a, b in ((4, 3), (3, 2), (2, 1), (1, 0)):
        uf.parent[a] = b  # a long chain: find flattens it
    assert uf.find(4) == 0 and uf.parent == {0: 0, 1: 0, 2: 1, 3: 1, 4: 0}  # path halving


def test_a_stage_with_two_successors_is_refused_naming_them() -> None:
    """The message names the stage and its successors, sorted."""
    with pytest.raises(SpecializationError) as info:
        build_pipelines(range(8), [P(groups=[(0, 1, 2)], edges=[(0, 7)]), P(edges=[(2, 3)]),
                                   P(groups=[(4, 5)], edges=[(1, 4)])], [])
    assert str(info.value) == ("stage 0-2 sends activations to several stages (3; 4,5; 7); HSPMD pipelines are "
                               "chains — make each stage feed exactly one next stage")


def test_a_stage_with_two_predecessors_is_refused_naming_them() -> None:
    """The message names the stage and its predecessors, sorted."""
    with pytest.raises(SpecializationError) as info:
        build_pipelines(range(6), [P(edges=[(5, 0)]), P(groups=[(3, 4)], edges=[(3, 0)]), P(edges=[(1, 0)])], [])
    assert str(info.value) == ("stage 0 receives activations from several stages (1; 3,4; 5); HSPMD pipelines "
                               "are chains")


def test_two_successors_or_two_predecessors_are_already_too_many() -> None:
    """Exactly two next (or previous) stages is refused with the chain message, not only three."""
    with pytest.raises(SpecializationError) as info:
        build_pipelines(range(3), [P(edges=[(0, 2)]), P(edges=[(0, 1)])], [])
    assert str(info.value) == ("stage 0 sends activations to several stages (1; 2); HSPMD pipelines are chains — "
                               "make each stage feed exactly one next stage")
    with pytest.raises(SpecializationError) as info:
        build_pipelines(range(3), [P(edges=[(1, 2)]), P(edges=[(0, 2)])], [])
    assert str(info.value) == "stage 2 receives activations from several stages (0; 1); HSPMD pipelines are chains"


def test_a_cycle_of_stages_is_refused_naming_its_ranks() -> None:
    """Stages that send round in a ring have no first stage: their ranks are named."""
    with pytest.raises(SpecializationError) as info:
        build_pipelines(range(5), [P(edges=[(0, 1)]), P(edges=[(1, 2)]), P(edges=[(2, 0)])], [])
    assert str(info.value) == "ranks 0-2 lie on a cycle of stages; pipelines must be chains"


def test_a_plan_given_twice_counts_once() -> None:
    """The same plan object twice (forward, or forward and backward) is read once: its sends do not make a
    stage its own successor twice, and backward repeats are harmless."""
    plan = P(groups=[(2, 3)], edges=[(0, 2)])
    assert build_pipelines(range(4), [plan, plan], [plan]) == [[[0], [2, 3]], [[1]]]
    # a repeat skips only itself: the plans after it are still read (collectives and sends)
    later = P(groups=[(4, 5)], edges=[(2, 4)])
    assert build_pipelines(range(6), [plan, plan, later], []) == [[[0], [2, 3], [4, 5]], [[1]]]
    assert build_pipelines(range(6), [plan], [plan, P(groups=[(0, 1)])]) == [[[0, 1], [2, 3]], [[4]], [[5]]]


def test_pipelines_are_ordered_by_order_key_else_smallest_first_rank() -> None:
    """order_key(first stage) sorts the pipelines; by default the first stage's smallest rank."""
    fwd = [P(edges=[(3, 0), (2, 1)])]
    assert build_pipelines(range(4), fwd, []) == [[[2], [1]], [[3], [0]]]
    assert build_pipelines(range(4), fwd, [], order_key=lambda first: -first[0]) == [[[3], [0]], [[2], [1]]]
    # equal keys keep the order of the stages' roots (their smallest ranks)
    assert build_pipelines([5, 4, 3], [], [], order_key=lambda first: 0) == [[[3]], [[4]], [[5]]]


def test_ranks_outside_the_forward_set_join_through_messages() -> None:
    """A rank only named by a message becomes a stage too."""
    assert build_pipelines([0], [P(edges=[(0, 1)])], []) == [[[0], [1]]]


def test_rank_kinds_in_op_order() -> None:
    """The kinds of the ops rank takes part in, in the plan's order; () when none."""
    plan = Plan(Op("A", groups=[(0, 1)]), Op("B", edges=[(2, 0)]), Op("C", edges=[(3, 4)]))
    assert rank_kinds(plan, 0) == ("A", "B") and rank_kinds(plan, 4) == ("C",) and rank_kinds(plan, 9) == ()
