"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/bsr.py.

References written again from §5.3: the BSR table by a per-element scan of small tensors (which ranks own and
which need each element), the scheme by a scan over every owner with the paper's rules in order -- (i) a receiver
that owns the slice copies it locally, (ii) else the owner over the highest-bandwidth link (``Cluster.link``),
(iii) at equal bandwidth the owner with the least bytes sent so far, then the lowest rank -- and the baseline
(``heuristics=False``): the lowest-rank surviving owner.
"""
from __future__ import annotations

import itertools
import random

import pytest

from hspmd_sdk.core.bsr import Assignment, BSREntry, LinkModel, bsr_scheme, bsr_table
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.errors import ResolutionError


def _scan(entries, cluster, load, heuristics=True, failed=()):
    out = []
    for e in entries:
        alive = [o for o in e.owners if o not in failed]
        for r in e.receivers:
            if r in alive:
                out.append((e.key, r, r))
                continue
            if heuristics:
                src = min(alive, key=lambda o: ((-cluster.link(o, r).bandwidth if cluster else 0.0), load.get(o, 0), o))
            else:
                src = min(alive)
            load[src] = load.get(src, 0) + e.nbytes
            out.append((e.key, src, r))
    return out


def _random_box(rng, shape):
    box = []
    for n in shape:
        a = rng.randint(0, n - 1)
        b = rng.randint(a + 1, n)
        box.append((a, b))
    return tuple(box)


def _cells(box):
    return itertools.product(*(range(a, b) for a, b in box))


def test_bsr_table_equals_a_per_element_scan() -> None:
    rng = random.Random(11)
    for trial in range(40):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 5) for _ in range(ndim))
        owners = [(r, _random_box(rng, shape)) for r in rng.sample(range(8), rng.randint(1, 4))]
        receivers = [(r, _random_box(rng, shape)) for r in rng.sample(range(8), rng.randint(1, 4))]
        itemsize = rng.choice([1, 2, 4])
        table = bsr_table(owners, receivers, shape, itemsize, key=("t", trial))
        want = {}
        for idx in itertools.product(*(range(n) for n in shape)):
            need = tuple(sorted(r for r, b in receivers if all(a <= i < z for i, (a, z) in zip(idx, b))))
            if need:
                own = tuple(sorted(r for r, b in owners if all(a <= i < z for i, (a, z) in zip(idx, b))))
                want[idx] = (own, need)
        got = {}
        for e in table:
            assert e.key == ("t", trial)
            n = 1
            for a, b in e.box:
                n *= b - a
            assert e.nbytes == n * itemsize
            for idx in _cells(e.box):
                assert idx not in got, "two entries cover one element"
                got[idx] = (tuple(e.owners), tuple(e.receivers))
        assert got == want, trial


def test_bsr_scheme_equals_the_rules_in_order() -> None:
    rng = random.Random(3)
    for trial in range(40):
        kinds = rng.sample(["H800", "H20", "A100", "cpu"], rng.randint(1, 3))
        cluster = Cluster.mixed({k: rng.randint(1, 6) for k in kinds}, per_node=rng.choice([1, 2, 4]))
        n = cluster.num_ranks
        entries = [BSREntry(i, ((0, 1),), tuple(sorted(rng.sample(range(n), rng.randint(1, n)))),
                            tuple(sorted(rng.sample(range(n), rng.randint(1, n)))), rng.choice([1, 2, 64]))
                   for i in range(rng.randint(1, 6))]
        start = {r: rng.randint(0, 8) for r in rng.sample(range(n), n // 2)}
        heur = trial % 4 != 0
        failed = set()
        if trial % 3 == 0:  # fail some ranks, keeping a surviving owner of every entry
            failed = {r for r in range(n) if rng.random() < 0.3} - {e.owners[-1] for e in entries}
        load_a, load_b = dict(start), dict(start)
        got = bsr_scheme(entries, LinkModel(cluster), load_a, heuristics=heur, failed=failed)
        assert [(a.key, a.src, a.dst) for a in got] == _scan(entries, cluster, load_b, heur, failed), trial
        assert load_a == load_b
        for a in got:
            assert isinstance(a, Assignment) and a.nbytes == entries[a.key].nbytes and a.box == ((0, 1),)


def test_scheme_without_cluster_balances_load_then_lowest_rank() -> None:
    e = [BSREntry("w", ((0, 4),), (0, 1, 2), (3, 4, 5, 6), 10)]
    load: dict[int, int] = {1: 5}
    got = [(a.src, a.dst) for a in bsr_scheme(e, LinkModel(None), load)]
    # equal links: least loaded first (0 and 2 at 0, rank 0 first), then 2, then 1 (5) vs 0 (10): 1, then 2 (10)...
    assert got == [(0, 3), (2, 4), (1, 5), (0, 6)]
    assert load == {0: 20, 1: 15, 2: 10}
    base: dict[int, int] = {}
    assert [(a.src, a.dst) for a in bsr_scheme(e, LinkModel(None), base, heuristics=False)] == \
        [(0, 3), (0, 4), (0, 5), (0, 6)]
    assert base == {0: 40}
    local = bsr_scheme([BSREntry("x", ((0, 1),), (0, 1), (1,), 4)], LinkModel(None), {})
    assert [(a.src, a.dst) for a in local] == [(1, 1)]


def test_failed_owners_are_skipped_or_named() -> None:
    e = [BSREntry("w", ((0, 2),), (0, 1), (2,), 8)]
    assert [a.src for a in bsr_scheme(e, LinkModel(None), {}, failed=[0])] == [1]
    with pytest.raises(ResolutionError, match="failed"):
        bsr_scheme(e, LinkModel(None), {}, failed=[0, 1])
    with pytest.raises(ResolutionError) as e:
        bsr_scheme([BSREntry("w", ((0, 2),), (), (2,), 8)], LinkModel(None), {})
    assert " of tensor 'w' is held by no source rank; receivers" in str(e.value)


def test_the_table_lists_its_slices_in_box_order() -> None:
    # rank 0 owns [0, 3), rank 1 only [1, 2); rank 2 needs all: the middle slice has other owners than its
    # neighbours, and the table (which the scheme scans, balancing load as it goes) runs in box order
    table = bsr_table([(0, ((0, 3),)), (1, ((1, 2),))], [(2, ((0, 3),))], (3,), 4, key="t")
    assert [(e.box, e.owners, e.receivers, e.nbytes) for e in table] == [
        (((0, 1),), (0,), (2,), 4), (((1, 2),), (0, 1), (2,), 4), (((2, 3),), (0,), (2,), 4)]
    rng = random.Random(5)
    for _ in range(20):
        shape = (rng.randint(2, 6), rng.randint(1, 4))
        owners = [(r, _random_box(rng, shape)) for r in range(4)]
        table = bsr_table(owners, [(9, tuple((0, n) for n in shape))], shape, 1)
        assert [e.box for e in table] == sorted(e.box for e in table)


def test_link_model_answers_as_the_cluster() -> None:
    cluster = Cluster.mixed({"H800": 4, "H20": 3}, per_node=2)
    lm = LinkModel(cluster)
    for a in range(cluster.num_ranks):
        assert lm.node(a) == cluster.node_index(a)
        assert lm.node_kind(lm.node(a)) == cluster.kind(a)
        for b in range(cluster.num_ranks):
            if a != b:
                assert lm.bandwidth(a, b) == cluster.link(a, b).bandwidth, (a, b)
    with pytest.raises(ResolutionError):
        lm.node(cluster.num_ranks)
    none = LinkModel(None)
    assert none.node(7) == 0 and none.node_kind(0) == "" and none.bandwidth(0, 5) == 1.0


def _hosted_cluster(rng):
    """A cluster of boxes: hosts holding one to three nodes of random kinds (a box of mixed kinds), with or
    without a host link, whose bandwidth falls below, between or above the kinds' NVLink and the network."""
    nodes, rank = [], 0
    for h in range(rng.randint(1, 4)):
        for _ in range(rng.randint(1, 3)):
            size = rng.randint(1, 3)
            nodes.append({"host": f"box{h}", "kind": rng.choice(["H800", "H20", "cpu"]),
                          "ranks": list(range(rank, rank + size))})
            rank += size
    rng.shuffle(nodes)  # hosts interleave in node order
    return Cluster.load({"nodes": nodes, "host_bandwidth_gbs": rng.choice([None, 3.0, 64.0, 1000.0]),
                         "inter_bandwidth_gbs": rng.choice([2.0, 25.0, 100.0])})


def test_scheme_prefers_the_owner_on_the_receivers_host() -> None:
    """Rule (ii) across boxes: two hosts, each an H800 node and an H20 node, joined by a 64 GB/s host link and a
    25 GB/s network.  Each H20 receiver gets the slice from the H800 owner on its own host, whatever the order of
    the receivers and the load (a link memo keyed without the host gave the first answer, 25 GB/s, to both)."""
    c = Cluster.load({"nodes": [{"host": "A", "kind": "H800", "ranks": [0]}, {"host": "A", "kind": "H20", "ranks": [1]},
                                {"host": "B", "kind": "H800", "ranks": [2]}, {"host": "B", "kind": "H20", "ranks": [3]}],
                      "host_bandwidth_gbs": 64})
    for receivers in ((1, 3), (3, 1)):
        for load in ({}, {0: 100}, {2: 100}):
            got = bsr_scheme([BSREntry("w", ((0, 1),), (0, 2), receivers, 4)], LinkModel(c), dict(load))
            assert sorted((a.src, a.dst) for a in got) == [(0, 1), (2, 3)], (receivers, load)
    lm = LinkModel(c)
    assert [lm.node_host(i) for i in range(4)] == [0, 0, 1, 1]
    assert [lm.host_nodes(h) for h in range(2)] == [[0, 1], [2, 3]]
    none = LinkModel(None)  # one node (0), of no kind, on one host (0)
    assert (none.node(9), none.node_kind(0), none.node_host(0), none.host_nodes(0)) == (0, "", 0, [0])
    assert (lm.bandwidth(0, 1), lm.bandwidth(2, 1), lm.bandwidth(2, 3), lm.bandwidth(0, 3)) == (64e9, 25e9, 64e9, 25e9)


def test_bsr_scheme_on_boxes_equals_the_rules_in_order() -> None:
    """The per-node, per-(host, kind) and per-kind heaps pick the sender of the scan over every owner
    (``_scan``: ``Cluster.link``, load, rank) on clusters of boxes (hosts of several nodes), load carried over
    entries; and LinkModel's memoised bandwidth is ``Cluster.link``'s for every pair, asked in any order."""
    rng = random.Random(7)
    for trial in range(60):
        cluster = _hosted_cluster(rng)
        n = cluster.num_ranks
        pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
        rng.shuffle(pairs)
        lm = LinkModel(cluster)
        assert [lm.bandwidth(a, b) for a, b in pairs] == [cluster.link(a, b).bandwidth for a, b in pairs], trial
        entries = [BSREntry(i, ((0, 1),), tuple(sorted(rng.sample(range(n), rng.randint(1, n)))),
                            tuple(rng.sample(range(n), rng.randint(1, n))), rng.choice([1, 2, 64]))
                   for i in range(rng.randint(1, 6))]
        start = {r: rng.randint(0, 8) for r in rng.sample(range(n), n // 2)}
        load_a, load_b = dict(start), dict(start)
        got = bsr_scheme(entries, LinkModel(cluster), load_a)
        assert [(a.key, a.src, a.dst) for a in got] == _scan(entries, cluster, load_b), trial
        assert load_a == load_b


def test_link_model_without_a_cluster_gives_every_pair_of_nodes_bandwidth_one() -> None:
    """Without a cluster every link is alike: 1.0, by ranks (``bandwidth``) and by their nodes (``node_bandwidth``,
    what the scheme's owner pool asks), asked again or not; and the placement of a tuple of ranks is node 0, of no
    kind, on host 0, the same answer when asked again."""
    none = LinkModel(None)
    assert [none.node_bandwidth(0, 0, 0, 1), none.node_bandwidth(0, 0, 3, 2), none.node_bandwidth(0, 0, 0, 1)] == \
        [1.0, 1.0, 1.0]
    assert none.bandwidth(0, 1) == 1.0
    assert none.placement((0, 2)) == ({0: 0, 2: 0}, {0: "", 2: ""}, {0: 0, 2: 0}) == none.placement((0, 2))
