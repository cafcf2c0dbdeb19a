"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of planner/simulator.py.

Each figure is worked out by hand from what the module's docstrings state: the summary's text, processor sharing
over a timeline (a rank's work progresses at ``min(1, cores / n)`` with ``n`` the ranks of its node computing), the
per-device memory parts (bf16 params and grads, 12 B of fp32 optimizer state a parameter divided by the holders
under ZeRO-1, activations of the micro-batches in flight plus the transient, the device's runtime), the buckets of
the gradient synchronisation (runs of model units held by the same stages, in model order) and the fixed point of
:func:`_shared_cores`.  Nothing is compared with another output of the simulator.
"""
from __future__ import annotations

import pytest

from hspmd_sdk.core.cluster import Cluster, Link
from hspmd_sdk.core.comm_ops import OpKind
from hspmd_sdk.core.schedule import Action
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.planner import simulate
from hspmd_sdk.planner.cost import CostModel, LinkOverride
from hspmd_sdk.planner.simulator import (Event, SimResult, _buckets, _formula_syncs, _group_link, _memory,
                                         _post_send, _processor_sharing, _run_syncs, _shared_cores, _StageCost,
                                         _with_idle)

GiB = 2**30
close = pytest.approx


def _result(step: float = 1.0, timeline: dict | None = None, **kw) -> SimResult:
    base = dict(step_time=step, timeline=timeline or {}, bubble_fraction=0.0, peak_memory={0: 1.0},
                memory={}, capacity={0: 2.0}, oom=[])
    return SimResult(**{**base, **kw})


# ---- SimResult --------------------------------------------------------------------------------------------------
def test_summary_text_with_label_pipelines_and_fit() -> None:
    """The summary's exact lines: label prefix, step/bubble/sync figures, one line a pipeline, the peak in GiB
    (2**30 B) and the fullest device by peak / capacity (device 0 at 2.0 of 1.0, not device 1 with the larger
    peak), and 'fits in memory' when nothing is OOM."""
    r = _result(1.23456, bubble_fraction=0.125, peak_memory={0: 2 * GiB, 1: 3 * GiB},
                capacity={0: 1 * GiB, 1: 4 * GiB}, pipeline_end=[0.5, 0.75], sync_time=0.25, label="x")
    assert r.summary() == ("x: step 1.235 s, bubble 12.5%, gradient sync + optimizer 0.250 s\n"
                           "  pipeline 0: last backward at 0.500 s\n"
                           "  pipeline 1: last backward at 0.750 s\n"
                           "  peak memory 3.0 GiB; fullest device 0: 2.0 / 1.0 GiB\n"
                           "  fits in memory")


def test_summary_text_without_label_and_with_oom() -> None:
    """No label: no prefix; an OOM list is printed as such."""
    r = _result(1.0, bubble_fraction=0.5, peak_memory={0: 1 * GiB, 1: 3 * GiB},
                capacity={0: 4 * GiB, 1: 2 * GiB}, oom=[1])
    assert r.summary() == ("step 1.000 s, bubble 50.0%, gradient sync + optimizer 0.000 s\n"
                           "  peak memory 3.0 GiB; fullest device 1: 3.0 / 2.0 GiB\n"
                           "  OOM on devices [1]")


def test_busy_sums_the_durations_of_the_kinds_asked() -> None:
    """busy(): the seconds of F and B events by default, of the kinds given otherwise."""
    r = _result(timeline={0: [Event(0.0, 1.0, "F", 0), Event(1.0, 1.5, "idle"), Event(1.5, 3.5, "B", 0),
                              Event(3.5, 3.75, "optim")]})
    assert r.busy(0) == 3.0
    assert r.busy(0, ("idle", "optim")) == 0.75


def test_with_idle_fills_the_gaps_and_sorts() -> None:
    """_with_idle: events sorted by start, idle events in the gaps of [0, end] (none for a gap of rounding size)."""
    evs = [Event(2.0, 3.0, "B", 0), Event(0.5, 1.0, "F", 0), Event(1.0, 2.0, "comm")]
    assert _with_idle(evs, 4.0) == [Event(0.0, 0.5, "idle"), Event(0.5, 1.0, "F", 0), Event(1.0, 2.0, "comm"),
                                    Event(2.0, 3.0, "B", 0), Event(3.0, 4.0, "idle")]
    assert _with_idle([Event(1e-13, 1.0, "F")], 1.0 + 1e-13) == [Event(1e-13, 1.0, "F")]


# ---- processor sharing --------------------------------------------------------------------------------------------
# node 0 holds ranks 0, 1, 2; node 1 rank 3.  Computing intervals (F, B, optim) of the others on rank 0's node:
# rank 1 [1, 3] (its comm [0, 1] does not compute), rank 2 [0.5, 1] (and a zero-length F at 1.0); rank 3 computes
# all the time on its own node.
SHARED = Cluster.load({"nodes": [{"host": "a", "kind": "cpu", "ranks": [0, 1, 2]},
                                 {"host": "b", "kind": "cpu", "ranks": [3]}]})
TIMELINE = {0: [Event(0.0, 2.0, "F", 0), Event(2.0, 4.0, "idle")],
            1: [Event(0.0, 1.0, "comm"), Event(1.0, 3.0, "B", 0), Event(3.0, 4.0, "idle")],
            2: [Event(0.0, 0.5, "idle"), Event(0.5, 1.0, "optim"), Event(1.0, 1.0, "F", 1),
                Event(1.0, 4.0, "idle")],
            3: [Event(0.0, 4.0, "F", 0)]}
STAGES = {(0, 0): [3, 0], (0, 1): [1], (0, 2): [2]}


def test_processor_sharing_on_one_core_by_hand() -> None:
    """One core: rank 0's others compute [0.5, 1] (one), [1, 3] (one): 2 s of work from t=0 run at 1 until 0.5,
    at 1/2 until 3 (1.25 s done), then 0.25 s at 1: 3.25 s; rank 3 (alone on its node) takes 2 s; the stage
    takes its slowest device.  Zero work takes 0."""
    s = _processor_sharing(_result(4.0, TIMELINE), STAGES, SHARED, CostModel(cores=1))
    assert s((0, 0), 0.0, 2.0) == close(3.25)
    assert s((0, 0), 0.0, 0.25) == close(0.25)  # ends before anyone else computes
    assert s((0, 0), 0.0, 0.5) == close(0.5)  # ends exactly where rank 2 starts
    assert s((0, 0), 2.0, 1.0) == close(1.5)  # 0.5 done at 1/2 by t=3, 0.5 alone
    assert s((0, 0), 0.0, 0.0) == 0.0
    # rank 1: the others compute [0, 2] (rank 0) and [0.5, 1] (rank 2): counts 1, 2, 1, 0 from 0, 0.5, 1, 2
    assert s((0, 1), 1.0, 1.0) == close(1.5)  # t on a cut: from 1 at 1/2 until 2 (0.5), then 0.5 alone
    assert s((0, 1), 0.5, 1.0) == close(0.5 + 1.0 + 1 / 3)  # 1/3 until 1, 1/2 until 2, then alone
    # rank 2: the others compute [0, 2] and [1, 3]: counts 1, 2, 1, 0 from 0, 1, 2, 3
    # 2 s from 0: 1/2 until 1 (0.5), 1/3 until 2, 1/2 until 3 (0.5), the remaining 2/3 alone
    assert s((0, 2), 0.0, 2.0) == close(3.0 + 2 / 3)


def test_processor_sharing_with_two_cores_by_hand() -> None:
    """Two cores: rank 1 from t=0 runs at 1 while at most one other computes, at 2/3 in [0.5, 1] (three ranks):
    1 s of work ends at 1 + 1/6; rank 3 alone runs at 1 (not 2: the rate is at most 1)."""
    s = _processor_sharing(_result(4.0, TIMELINE), STAGES, SHARED, CostModel(cores=2))
    assert s((0, 1), 0.0, 1.0) == close(1.0 + 1 / 6)
    assert s((0, 0), 0.0, 2.0) == close(2.0)


def test_processor_sharing_counts_after_every_change_at_one_instant() -> None:
    """Rank 1 computes [0, 1] and [2, 3], rank 2 [1, 2]: one other rank computes all of [0, 3] on rank 0's node
    (an end and a start at t=1 and at t=2 leave the count at 1), so 2 s of work on one core from t=0 get 1.5 s
    done by t=3 and end at 3.5."""
    timeline = {0: [Event(0.0, 4.0, "idle")], 1: [Event(0.0, 1.0, "F", 0), Event(2.0, 3.0, "B", 0)],
                2: [Event(1.0, 2.0, "F", 0)]}
    s = _processor_sharing(_result(4.0, timeline), {(0, 0): [0]}, Cluster.local(3), CostModel(cores=1))
    assert s((0, 0), 0.0, 2.0) == close(3.5)


# ---- _shared_cores: the fixed point ------------------------------------------------------------------------------
def _rounds(steps: list[float]):
    """A fake one(stretch): the i-th call returns a result of step time steps[i] whose timeline has rank 1 computing
    for its whole step; records what its stretch makes of 1 s of work on stage (0, 0) (rank 0) from t=0."""
    seen: list = []

    def one(stretch):
        i = len(seen)
        seen.append(None if stretch is None else stretch((0, 0), 0.0, 1.0))
        t = steps[i]
        return _result(t, {0: [Event(0.0, t, "idle")], 1: [Event(0.0, t / 2, "F", 0), Event(t / 2, t, "idle")]},
                       label=f"round {i}")
    return one, seen


TWO = {(0, 0): [0], (0, 1): [1]}


def test_shared_cores_stops_at_the_fixed_point() -> None:
    """First the bound (stretch None), then replays with processor sharing against the previous round's timeline,
    until a round moves the step time by at most 0.1% of the previous round (not of the one before)."""
    one, seen = _rounds([100.0, 50.0, 50.01, 7.0])
    r = _shared_cores(one, TWO, Cluster.local(2), CostModel(cores=1))
    assert r.label == "round 2"
    # round 1 replays against round 0 (rank 1 computing until 50: 1 s takes 2), round 2 against round 1 (until 25)
    assert seen == [None, 2.0, 2.0]


def test_shared_cores_a_change_of_exactly_the_tolerance_has_converged() -> None:
    """|1001 - 1000| = 1e-3 x 1000: converged (<=)."""
    one, seen = _rounds([1000.0, 1001.0, 5.0])
    assert _shared_cores(one, TWO, Cluster.local(2), CostModel(cores=1)).label == "round 1"
    assert len(seen) == 2


def test_shared_cores_not_oversubscribed_runs_once() -> None:
    """No node with more ranks than cores: the bound is the answer, one round."""
    for cost in (CostModel(cores=2), CostModel()):
        one, seen = _rounds([3.0, 2.0])
        assert _shared_cores(one, TWO, Cluster.local(2), cost).label == "round 0"
        assert seen == [None]


def test_shared_cores_not_converging_returns_the_slower_of_the_last_two() -> None:
    """20 rounds without converging: the slower of the last two rounds (not of the last three, nor of all)."""
    steps = [10.0 + 5.0 * (i % 2) for i in range(18)] + [1.0, 2.0]
    one, seen = _rounds(steps)
    r = _shared_cores(one, TWO, Cluster.local(2), CostModel(cores=1))
    assert r.label == "round 19" and len(seen) == 20


# ---- sends and memory ------------------------------------------------------------------------------------------
def test_post_send_keeps_the_sender_busy_for_the_send_overhead() -> None:
    """A measured send overhead (0.5 s x comm_scale 1) is a 'comm' event of the micro-batch on the sender and
    advances its clock; without one (0 s) nothing is added."""
    link = Link("intra", 1e9, 1e-6)
    cost = CostModel(link_overrides={"intra": LinkOverride(latency=0.0, bandwidth=1e9, send_overhead=0.5)})
    clock, events = {(0, 0): 2.0}, {(0, 0): []}
    _post_send(cost, link, (0, 0), Action("SEND_F", 3, 1), clock, events)
    assert events[(0, 0)] == [Event(2.0, 2.5, "comm", 3)] and clock[(0, 0)] == 2.5
    clock, events = {(0, 0): 2.0}, {(0, 0): []}
    _post_send(CostModel(), link, (0, 0), Action("SEND_F", 3, 1), clock, events)
    assert events[(0, 0)] == [] and clock[(0, 0)] == 2.0


def _sc(act: float, transient: float, units: tuple, memory_of: tuple = ()) -> _StageCost:
    return _StageCost(fwd=0.0, bwd=0.0, act_per_mb=act, transient=transient, units=units, memory_of=memory_of)


@pytest.mark.parametrize("zero1", [False, True])
def test_memory_counts_each_part_by_hand(zero1: bool) -> None:
    """_memory: params and grads 2 B and optimizer 12 B a parameter (divided by the number of stages holding the
    unit under ZeRO-1), activations = per micro-batch x in flight (1F1B: min(m, stages - s)) + transient, the
    runtime of the device's kind; a device of an uneven stage counts its own share (memory_of)."""
    cluster = Cluster.load({"nodes": [{"host": "a", "kind": "cpu", "ranks": [0, 1]},
                                      {"host": "b", "kind": "H20", "ranks": [2, 3]}]})
    strategy = Strategy.load({"zero1": zero1, "pipelines": [
        {"micro_batch_size": 1, "num_micro_batches": 4,
         "stages": [{"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}]},
        {"micro_batch_size": 1, "num_micro_batches": 4,
         "stages": [{"devices": [2, 3], "layers": [0, 3]}]}]})
    emb, l0, head = ("embedding",), ("layer", 0), ("head",)
    costs = {(0, 0): _sc(10.0, 3.0, ((emb, 100.0), (l0, 50.0))),
             (0, 1): _sc(20.0, 5.0, ((head, 30.0),)),
             (1, 0): _sc(7.0, 1.0, ((emb, 25.0), (l0, 25.0), (head, 40.0)),
                         memory_of=((3, 4.0, 2.0, ((emb, 75.0), (l0, 75.0), (head, 8.0))),))}
    devices = {(0, 0): [0], (0, 1): [1], (1, 0): [2, 3]}
    cost = CostModel(cpu_baseline_mb=1.0, memory_reserve_mb=2.0)
    got = _memory(strategy, cluster, costs, devices, cost)
    z = 2.0 if zero1 else 1.0  # every unit is held by two stages

    def want(params: float, act: float, reserve_mb: float) -> dict:
        return {"params": 2 * params, "grads": 2 * params, "optimizer": 12 * params / z, "activations": act,
                "reserve": reserve_mb * 2**20}
    assert got == {0: want(150.0, 10.0 * 2 + 3.0, 1.0),  # stage 0 of 2, 4 micro-batches: 2 in flight
                   1: want(30.0, 20.0 * 1 + 5.0, 1.0),
                   2: want(90.0, 7.0 * 1 + 1.0, 2.0),  # a one-stage pipeline: one in flight
                   3: want(158.0, 4.0 * 1 + 2.0, 2.0)}
    assert list(got) == [0, 1, 2, 3] and all(list(p) == ["params", "grads", "optimizer", "activations", "reserve"]
                                             for p in got.values())


# ---- gradient synchronisation ----------------------------------------------------------------------------------
def test_buckets_are_runs_of_units_in_model_order() -> None:
    """Units sorted embedding, layers by index (also past 90), head -- whatever order the stages list them in --
    and merged into runs held by the same stages, params summed per holder."""
    emb, head = ("embedding",), ("head",)
    L = lambda i: ("layer", i)  # noqa: E731
    costs = {(0, 1): _sc(0, 0, ((L(100), 4.0), (L(101), 4.0), (head, 9.0))),
             (1, 1): _sc(0, 0, ((L(99), 2.0), (L(100), 2.0), (L(101), 2.0), (head, 5.0))),
             (0, 0): _sc(0, 0, ((emb, 7.0), (L(98), 1.0), (L(99), 1.0))),
             (1, 0): _sc(0, 0, ((emb, 3.0), (L(98), 6.0)))}
    assert _buckets(costs) == [
        (((0, 0), (1, 0)), {(0, 0): 8.0, (1, 0): 9.0}),
        (((0, 0), (1, 1)), {(0, 0): 1.0, (1, 1): 2.0}),
        (((0, 1), (1, 1)), {(0, 1): 17.0, (1, 1): 9.0})]


def _cluster3() -> Cluster:
    """Ranks 0 and 2 on host a (two nodes linked at 64 GB/s), rank 1 alone on host b (25 GB/s network), 3 and 4
    on a node of their own (NVLink)."""
    return Cluster.load({"nodes": [{"host": "a", "kind": "H800", "ranks": [0]},
                                   {"host": "b", "kind": "H800", "ranks": [1]},
                                   {"host": "a", "kind": "H800", "ranks": [2]},
                                   {"host": "c", "kind": "H800", "ranks": [3, 4]}],
                        "host_bandwidth_gbs": 64.0, "inter_bandwidth_gbs": 10.0})


def test_group_link_is_the_slowest_of_the_ring_of_holders() -> None:
    """_group_link: the ring s0 -> s1 -> ... -> s0 over position-aligned devices (a narrower stage wraps)."""
    c = _cluster3()
    of = lambda link: (link.cls, link.bandwidth)  # noqa: E731
    assert of(_group_link(c, [[0], [2]])) == ("intra", 64e9)
    assert of(_group_link(c, [[0], [2], [1]])) == ("inter", 10e9)  # 2 -> 1 is the slow hop
    assert of(_group_link(c, [[3, 4], [0]])) == ("inter", 10e9)


# Overrides that make a ring collective's seconds its bytes on the wire / bandwidth: 2 B/s within a host, 1 B/s
# between hosts, no latency.
FLAT = CostModel(link_overrides={"intra": LinkOverride(latency=0.0, bandwidth=2.0),
                                 "inter": LinkOverride(latency=0.0, bandwidth=1.0)})


def _two_hosts() -> Cluster:
    """Ranks 0 and 2 on host a, 1 and 3 on host b, each rank a node of its own (a host link: 'intra')."""
    return Cluster.load({"nodes": [{"host": "a", "kind": "H800", "ranks": [0]},
                                   {"host": "b", "kind": "H800", "ranks": [1]},
                                   {"host": "a", "kind": "H800", "ranks": [2]},
                                   {"host": "b", "kind": "H800", "ranks": [3]}],
                        "host_bandwidth_gbs": 64.0})


def _run_collectives(op: OpKind, buckets: list, ready: dict, devices: dict, cluster: Cluster, cost: CostModel,
                     events: dict, kind: str, cps: dict | None = None) -> dict:
    """The strategy form's collectives of ``buckets`` (:func:`_formula_syncs`), list-scheduled (:func:`_run_syncs`)."""
    return _run_syncs(_formula_syncs(op, buckets, devices, cluster, cost, cps), ready, events, kind)


def test_run_collectives_skips_lone_holders_and_prices_the_dp_ring() -> None:
    """A bucket held by one stage (no CP) has no collective; the next bucket still runs: an all-reduce of 2 B a
    parameter over the 2 holders, whose ring is the DP link (A = [0, 1] and B = [2, 3] align 0-2 and 1-3, both
    within a host at 2 B/s, though A's own devices are hosts apart): 2(n-1)/n x bytes / 2 per holder, the slowest
    holder's (20 params: 40 B -> 20 s), from when both are free."""
    A, B = (0, 0), (1, 0)
    events = {A: [], B: []}
    clock = _run_collectives(OpKind.ALL_REDUCE, [((A,), {A: 100.0}), ((A, B), {A: 10.0, B: 20.0})],
                             {A: 1.0, B: 3.0}, {A: [0, 1], B: [2, 3]}, _two_hosts(), FLAT, events, "sync")
    assert clock == {A: 23.0, B: 23.0}
    assert events == {A: [Event(3.0, 23.0, "sync")], B: [Event(3.0, 23.0, "sync")]}


def test_run_collectives_counts_cp_replicas_and_their_ring() -> None:
    """A CP stage (cp 2) holds 2 replicas: a lone one synchronises over its own ring (A = [0, 2], within host a:
    2 B/s; n = 2), and beside a stage B = [1, 3] the ring spans 3 replicas at the slower of A's ring and the DP
    link (0-1, 2-3: between hosts, 1 B/s): 2(3-1)/3 x 2 B x 20 params = 53.33 s; then A's CP group all-reduces
    what reached one of its ranks (the Program's SplitAllReduce, then AllReduce), over its own ring:
    2(2-1)/2 x 2 B x 10 params / 2 B/s = 10 s, B not taking part."""
    A, B = (0, 0), (1, 0)
    events = {A: [], B: []}
    clock = _run_collectives(OpKind.ALL_REDUCE, [((A,), {A: 30.0}), ((A, B), {A: 10.0, B: 20.0})],
                             {A: 0.0, B: 0.0}, {A: [0, 2], B: [1, 3]}, _two_hosts(), FLAT, events, "sync",
                             {A: 2, B: 1})
    assert events[A] == [Event(0.0, 30.0, "sync"), Event(30.0, close(30.0 + 160 / 3), "sync"),
                         Event(close(30.0 + 160 / 3), close(40.0 + 160 / 3), "sync")]
    assert clock[B] == close(30.0 + 160 / 3) and clock[A] == close(40.0 + 160 / 3)


# ---- whole steps -------------------------------------------------------------------------------------------------
def _dp2(zero1: bool = False, **stage) -> Strategy:
    """Two pipelines of one stage each (ranks 0 and 1), the tiny model's 4 layers, 2 micro-batches."""
    return Strategy.load({"zero1": zero1, "pipelines": [
        {"micro_batch_size": 1, "num_micro_batches": 2, "stages": [{"devices": [d], "layers": [0, 3], **stage}]}
        for d in (0, 1)]})


def test_zero1_gathers_before_and_reduce_scatters_after() -> None:
    """ZeRO-1: the step starts with a 'comm' all-gather of the parameters and synchronises by reduce-scatter, the
    same bytes on the wire over the same ring ((n-1)/n of the buffer each) -- so its sync takes as long as the
    gather, where an all-reduce would take twice as long."""
    r = simulate("tiny", _dp2(zero1=True), Cluster.local(2), seq_len=16, cost=FLAT)
    for d in (0, 1):
        tl = r.timeline[d]
        assert tl[0].kind == "comm" and tl[0].start == 0.0 and tl[1].kind == "F" and tl[1].start == tl[0].end
        gather = sum(e.duration for e in tl if e.kind == "comm")
        sync = sum(e.duration for e in tl if e.kind == "sync")
        assert gather > 0 and sync == close(gather)
    plain = simulate("tiny", _dp2(), Cluster.local(2), seq_len=16, cost=FLAT)
    assert sum(e.duration for e in plain.timeline[0] if e.kind == "sync") == close(2 * gather)


def test_gradient_sync_runs_the_last_layers_first() -> None:
    """Pipeline 0 splits the layers over ranks 0 (embedding, 0-1) and 1 (2-3, head), pipeline 1 holds all on rank 2:
    two buckets, both held by rank 2, which synchronises the head side (with rank 1) first, then the embedding side
    (with rank 0)."""
    strategy = Strategy.load({"pipelines": [
        {"micro_batch_size": 1, "num_micro_batches": 2, "stages": [{"devices": [0], "layers": [0, 1]},
                                                                   {"devices": [1], "layers": [2, 3]}]},
        {"micro_batch_size": 1, "num_micro_batches": 2, "stages": [{"devices": [2], "layers": [0, 3]}]}]})
    r = simulate("tiny", strategy, Cluster.local(3), seq_len=16, cost=FLAT)
    syncs = {d: [(e.start, e.end) for e in r.timeline[d] if e.kind == "sync"] for d in (0, 1, 2)}
    assert len(syncs[2]) == 2 and syncs[2][0] == syncs[1][0] and syncs[2][1] == syncs[0][0], syncs


def test_shared_cores_in_a_step_slow_the_compute_of_ranks_computing_at_once() -> None:
    """cores=1 with two ranks on one node that compute at the same moments all step (two pipelines, one stage
    each, no communication): every compute interval takes twice as long (the bound and the fixed point agree);
    with a core each, or with each rank on a node of its own, nothing changes."""
    cost = CostModel(comm_scale=0.0)
    base = simulate("tiny", _dp2(), Cluster.local(2), seq_len=16, cost=cost)
    shared = simulate("tiny", _dp2(), Cluster.local(2), seq_len=16, cost=cost.model_copy(update={"cores": 1}))
    assert shared.step_time == close(2 * base.step_time)
    assert shared.busy(0) == close(2 * base.busy(0))
    assert simulate("tiny", _dp2(), Cluster.local(2), seq_len=16,
                    cost=cost.model_copy(update={"cores": 2})).step_time == close(base.step_time)
    apart = Cluster.load({"nodes": [{"host": "a", "kind": "cpu", "ranks": [0]}, {"host": "b", "kind": "cpu",
                                                                                "ranks": [1]}]})
    assert simulate("tiny", _dp2(), apart, seq_len=16, cost=cost.model_copy(update={"cores": 1})).step_time == \
        close(simulate("tiny", _dp2(), apart, seq_len=16, cost=cost).step_time)


def test_a_mixed_length_step_counts_memory_from_its_stage_costs() -> None:
    """simulate_shapes (memory=None: counted from the stage costs of the step's own micro-batches): with the
    strategy's own shapes its parameter, gradient and optimizer bytes are the core estimate's (simulate's)."""
    from hspmd_sdk.planner.mixed_sim import simulate_shapes

    strategy = _dp2(zero1=True)
    fixed = simulate("tiny", strategy, Cluster.local(2), seq_len=16)
    mixed = simulate_shapes("tiny", strategy, Cluster.local(2), [[(1, 16), (1, 16)], [(1, 16), (1, 16)]])
    for d in (0, 1):
        for part in ("params", "grads", "optimizer", "reserve"):
            assert mixed.memory[d][part] == close(fixed.memory[d][part]), (d, part)


def test_a_mixed_length_step_counts_the_micro_batches_it_runs() -> None:
    """simulate_shapes counts activations for the micro-batches the step runs (one, here), not the strategy's
    own count (4): the first of two 1F1B stages holds one in flight, as the core estimate of a 1-micro-batch
    strategy says."""
    from hspmd_sdk.planner.mixed_sim import simulate_shapes

    def two_stages(m: int) -> Strategy:
        return Strategy.load({"pipelines": [{"micro_batch_size": 1, "num_micro_batches": m, "stages": [
            {"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}]}]})
    one = simulate("tiny", two_stages(1), Cluster.local(2), seq_len=16)
    four = simulate("tiny", two_stages(4), Cluster.local(2), seq_len=16)
    assert four.memory[0]["activations"] > one.memory[0]["activations"]  # the reference differs
    mixed = simulate_shapes("tiny", two_stages(4), Cluster.local(2), [[(1, 16)]])
    assert mixed.memory[0]["activations"] == close(one.memory[0]["activations"])


def test_a_strategy_that_does_not_fit_the_model_is_refused() -> None:
    """simulate checks the strategy against the model: layers 0..5 of a 4-layer model are refused, saying so."""
    from hspmd_sdk.errors import PlanValidationError

    with pytest.raises(PlanValidationError, match=r"pipelines\[0\]: layers cover 0\.\.5 but the model has 4 layers"):
        simulate("tiny", {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 2, "stages": [
            {"devices": [0], "layers": [0, 5]}]}]}, Cluster.local(1), seq_len=16)


def test_a_cp_stage_pays_its_slowest_cp_ring_and_is_unbalanced_by_default() -> None:
    """A CP2 x TP2 stage (TP groups [0, 1] and [2, 3]; CP rings [0, 2] and [1, 3]) of the tiny model at length
    4096: its ring transfers outlast the attention they overlap, so the stage is slower where the CP ring [1, 3]
    runs between hosts than where both CP rings stay within a host -- the slowest of the rings sets the pace,
    whichever comes first; the TP links are the same in both clusters.  Without `balanced` the stage is priced
    with the plain chunk layout (balanced=False)."""
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.core.strategy import Stage
    from hspmd_sdk.planner.simulator import _stage_cost

    model = LlamaConfig.preset("tiny").model_copy(update={"max_seq_len": 4096})
    stage = Stage(devices=[0, 1, 2, 3], layers=[0, 3], cp=2)
    slow_ring = Cluster.load({"nodes": [{"host": "a", "kind": "H800", "ranks": [0, 2]},
                                        {"host": "b", "kind": "H800", "ranks": [1]},
                                        {"host": "c", "kind": "H800", "ranks": [3]}]})
    fast_rings = Cluster.load({"nodes": [{"host": "a", "kind": "H800", "ranks": [0, 2]},
                                         {"host": "b", "kind": "H800", "ranks": [1, 3]}]})
    cost = CostModel(include_embedding=False)
    slow = _stage_cost(model, stage, False, False, slow_ring, 1, 4096, cost, share=1.0)
    fast = _stage_cost(model, stage, False, False, fast_rings, 1, 4096, cost, share=1.0)
    assert slow.ring_gap_fwd > fast.ring_gap_fwd and slow.fwd > fast.fwd
    plain = _stage_cost(model, stage, False, False, fast_rings, 1, 4096, cost, share=1.0, balanced=False)
    balanced = _stage_cost(model, stage, False, False, fast_rings, 1, 4096, cost, share=1.0, balanced=True)
    assert plain.fwd != balanced.fwd and fast == plain


def test_the_slowest_kind_of_a_mixed_tp_group_sets_the_pace_whatever_its_place() -> None:
    """A TP2 group of an H800 and an H20 runs at the H20's pace whether the H20 is listed first or second."""
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.core.strategy import Stage
    from hspmd_sdk.planner.simulator import _stage_cost

    box = Cluster.load({"nodes": [{"host": "a", "kind": "H800", "ranks": [0]}, {"host": "b", "kind": "H20",
                                                                                 "ranks": [1]}]})
    model, cost = LlamaConfig.preset("tiny"), CostModel()
    fast_first = _stage_cost(model, Stage(devices=[0, 1], layers=[0, 3]), False, False, box, 1, 64, cost, share=1.0)
    slow_first = _stage_cost(model, Stage(devices=[1, 0], layers=[0, 3]), False, False, box, 1, 64, cost, share=1.0)
    h800 = _stage_cost(model, Stage(devices=[0, 1], layers=[0, 3]), False, False,
                       Cluster.load({"nodes": [{"host": "a", "kind": "H800", "ranks": [0]},
                                               {"host": "b", "kind": "H800", "ranks": [1]}]}), 1, 64, cost, share=1.0)
    assert slow_first.fwd == fast_first.fwd > h800.fwd and slow_first.bwd == fast_first.bwd


# ---- the step's end: the optimizer, the bubble, the sync time, the label ---------------------------------------
def _two_by_two(zero1: bool, name: str | None = "dp2pp2") -> Strategy:
    return Strategy.load({"pipelines": [{"stages": [{"devices": [2 * i], "layers": [0, 1]},
                                                    {"devices": [2 * i + 1], "layers": [2, 3]}],
                                         "micro_batch_size": 1, "num_micro_batches": 2} for i in range(2)],
                          "zero1": zero1, "name": name})


@pytest.mark.parametrize("zero1", [False, True])
def test_each_stage_updates_the_parameters_it_owns(zero1: bool) -> None:
    """``tiny`` (Llama: embedding 16,384, a layer 41,088, head 16,448 parameters) as two pipelines of two
    stages: the first stage holds the embedding and layers 0-1, the second layers 2-3 and the head; under ZeRO-1
    each of the two replicas updates half of them.  A stage's optimizer event lasts ``optimizer_time`` of those
    parameters on its device (one H800 node, no core sharing)."""
    cl = Cluster.mixed({"H800": 4})
    cost = CostModel()
    r = simulate("tiny", _two_by_two(zero1), cl, seq_len=16, cost=cost)
    share = 2 if zero1 else 1
    held = {0: 16384 + 2 * 41088, 1: 2 * 41088 + 16448}
    for d in range(4):
        (optim,) = [e for e in r.timeline[d] if e.kind == "optim"]
        want = cost.optimizer_time(held[d % 2] / share, cl.spec(d))
        assert optim.end - optim.start == close(want, rel=1e-12)


def test_bubble_sync_time_and_label_follow_their_definitions() -> None:
    """``bubble_fraction``: the idle share of the devices' time between the first forward and the last backward;
    ``sync_time``: the step after the last backward; the label: the one given, else the strategy's name (an
    unnamed strategy is named after its shape)."""
    cl = Cluster.mixed({"H800": 4})
    r = simulate("tiny", _two_by_two(False), cl, seq_len=16)
    events = [e for evs in r.timeline.values() for e in evs]
    first_f = min(e.start for e in events if e.kind == "F")
    last_b = max(e.end for e in events if e.kind == "B")
    busy = sum(e.end - e.start for e in events if e.kind in ("F", "B"))
    assert first_f == 0.0 and 0.0 < busy < (last_b - first_f) * 4
    assert r.bubble_fraction == close(1.0 - busy / ((last_b - first_f) * 4), rel=1e-12)
    assert r.sync_time == close(r.step_time - last_b, rel=1e-12) and r.sync_time > 0
    assert r.label == "dp2pp2"
    assert simulate("tiny", _two_by_two(False), cl, seq_len=16, label="mine").label == "mine"
    unnamed = _two_by_two(False, None)
    assert unnamed.name and simulate("tiny", unnamed, cl, seq_len=16).label == unnamed.name


# ---- the strategy form's per-pipeline choices: tied weights, CP balance, the TP collectives' dtype ----------------
# Measured-style overrides: a collective's seconds are its bytes on the wire / 2 B/s (no latency, no efficiency).
WIRE = CostModel(link_overrides={"intra": LinkOverride(latency=0.0, bandwidth=1.0, collective_bandwidth=2.0)})


def test_a_tied_weight_on_one_stage_is_synchronised_once() -> None:
    """GPT-2's embedding is also its LM head.  Two one-stage pipelines hold both uses on one stage, whose
    gradients add up there: the DP all-reduce moves every parameter once -- 2(n-1)/n = 1 x the model's own count
    (summed from its shapes), 4 bytes a value at float32, over 2 B/s."""
    import math

    from hspmd_sdk import GPTConfig

    gpt = GPTConfig.preset("tiny")
    s = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 2, "stages": [{"devices": [d], "layers": [0, 3]}]}
                       for d in (0, 1)]}
    r = simulate(gpt, s, Cluster.local(2), seq_len=32, cost=WIRE, dtype="float32")
    values = sum(math.prod(shape) for shape in gpt.param_shapes().values())
    assert sum(e.duration for e in r.timeline[0] if e.kind == "sync") == close(values * 4 / 2.0, rel=1e-12)


def test_cp_stages_are_priced_balanced_only_where_their_pipeline_is() -> None:
    """A pipeline whose stages all have cp=2 lays its micro-batches out in the balanced order (Pipeline.cp_balance):
    its stage is priced balanced; a pipeline mixing cp=2 and cp=1 stages keeps the contiguous split, so its cp=2
    stage is priced plain.  At length 4096 the two prices differ."""
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.core.strategy import Stage
    from hspmd_sdk.planner.simulator import _stage_cost

    model = LlamaConfig.preset("tiny").model_copy(update={"max_seq_len": 4096})
    cl, cost = Cluster.mixed({"H800": 8}), CostModel()
    s = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1,
                        "stages": [{"devices": [0, 1], "layers": [0, 3], "cp": 2}]},
                       {"micro_batch_size": 1, "num_micro_batches": 1,
                        "stages": [{"devices": [2, 3], "layers": [0, 1], "cp": 2}, {"devices": [4], "layers": [2, 3]}]}]}
    r = simulate(model, s, cl, seq_len=4096)
    whole, first = Stage(devices=[0, 1], layers=[0, 3], cp=2), Stage(devices=[2, 3], layers=[0, 1], cp=2)
    ((f0,),) = [[e.duration for e in r.timeline[0] if e.kind == "F"]]
    ((f2,),) = [[e.duration for e in r.timeline[2] if e.kind == "F"]]
    balanced = _stage_cost(model, whole, True, True, cl, 1, 4096, cost, balanced=True).fwd
    plain = _stage_cost(model, first, True, False, cl, 1, 4096, cost, balanced=False).fwd
    assert f0 == balanced != _stage_cost(model, whole, True, True, cl, 1, 4096, cost, balanced=False).fwd
    assert f2 == plain != _stage_cost(model, first, True, False, cl, 1, 4096, cost, balanced=True).fwd


def test_the_tp_collectives_are_priced_at_the_dtype_given() -> None:
    """A TP2 stage's forward includes its TP collectives, priced at the ``dtype`` on the wire: float32 takes longer
    than bfloat16, which is the cost model's own count (bf16 times a wire factor of 1)."""
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.core.strategy import Stage
    from hspmd_sdk.planner.simulator import _stage_cost

    model, cl, cost = LlamaConfig.preset("tiny"), Cluster.mixed({"H800": 2}), CostModel()
    s = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1, "stages": [{"devices": [0, 1],
                                                                                     "layers": [0, 3]}]}]}
    stage = Stage(devices=[0, 1], layers=[0, 3])
    fwd = {}
    for dtype in ("float32", "bfloat16", None):
        r = simulate(model, s, cl, seq_len=64, dtype=dtype)
        (fwd[dtype],) = [e.duration for e in r.timeline[0] if e.kind == "F"]
        assert fwd[dtype] == _stage_cost(model, stage, True, True, cl, 1, 64, cost, dtype=dtype).fwd
    assert fwd["float32"] > fwd["bfloat16"] == fwd[None]


# ---- simulate(program): what it cannot simulate, in words -----------------------------------------------------------
def _dp2_program(strategy: dict | None = None, cluster: Cluster | None = None):  # type: ignore[no-untyped-def]
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.core.specialize import specialize
    from hspmd_sdk.core.strategy_plan import plan_from_strategy

    model = LlamaConfig.preset("tiny")
    cluster = cluster or Cluster.local(2)
    s = Strategy.load(strategy or {"pipelines": [
        {"micro_batch_size": 1, "num_micro_batches": 2, "stages": [{"devices": [d], "layers": [0, 3]}]}
        for d in (0, 1)]}, model=model, cluster=cluster)
    plan = plan_from_strategy(model, s, cluster)
    return model, s, cluster, plan, specialize(model, plan, cluster)


def _with_strategy(plan, strategy: dict | None):  # type: ignore[no-untyped-def]
    return plan.model_copy(update={"settings": plan.settings.model_copy(update={"strategy": strategy})})


def test_a_program_without_what_simulate_needs_is_refused_naming_each_part() -> None:
    """A bare graph's Program (no model), one specialized without a cluster, one whose plan has no strategy: each
    missing part is named with what to do, all at once, as an invalid 'Program for simulate()'."""
    from hspmd_sdk.core.specialize import specialize
    from hspmd_sdk.core.strategy_plan import graph_of
    from hspmd_sdk.errors import PlanValidationError

    model, _, cluster, plan, _ = _dp2_program()
    model_why = ("program.model", "a bare graph has no cost counts: specialize a model config")
    cluster_why = ("program.cluster", "specialize(model, plan, cluster) with the cluster")
    strategy_why = ("program.plan.settings.strategy",
                    "none: specialize a plan made by plan_from_strategy(model, strategy, cluster)")
    for program, problems in ((specialize(graph_of(model), plan, cluster), [model_why]),
                              (specialize(model, plan), [cluster_why]),
                              (specialize(model, _with_strategy(plan, None), cluster), [strategy_why]),
                              (specialize(graph_of(model), _with_strategy(plan, None)),
                               [model_why, cluster_why, strategy_why])):
        with pytest.raises(PlanValidationError) as info:
            simulate(program)
        assert (info.value.what, info.value.problems) == ("Program for simulate()", problems)
    assert str(info.value).startswith("invalid Program for simulate():\n  program.model: a bare graph")


def test_a_programs_strategy_is_checked_against_its_model_and_cluster() -> None:
    """The strategy a Program records is checked as the Program's: layers its model does not have, ranks its
    cluster does not have -- the strategy's own errors, before its stages are compared with the Program's."""
    from hspmd_sdk.core.specialize import specialize
    from hspmd_sdk.errors import PlanValidationError

    model, s, cluster, plan, _ = _dp2_program()
    deeper = s.model_dump(mode="json")
    for p in deeper["pipelines"]:
        p["stages"][0]["layers"] = [0, 5]
    with pytest.raises(PlanValidationError) as info:
        simulate(specialize(model, _with_strategy(plan, deeper), cluster))
    assert info.value.problems == [(f"pipelines[{i}]", "layers cover 0..5 but the model has 4 layers (0..3)")
                                   for i in (0, 1)]
    elsewhere = s.model_dump(mode="json")
    elsewhere["pipelines"][1]["stages"][0]["devices"] = [5]
    with pytest.raises(PlanValidationError) as info:
        simulate(specialize(model, _with_strategy(plan, elsewhere), cluster))
    assert info.value.problems == [("pipelines[1].stages[0].devices", "rank 5 is not in the cluster (2 ranks: 0..1)")]
    swapped = s.model_dump(mode="json")
    swapped["pipelines"].reverse()
    with pytest.raises(PlanValidationError) as info:
        simulate(specialize(model, _with_strategy(plan, swapped), cluster))
    assert (info.value.what, info.value.problems) == ("Program for simulate()", [
        ("program.pipelines", "[[[0]], [[1]]] are not the stages of its strategy [[[1]], [[0]]]")])


def test_processor_sharing_stretches_the_optimizer_by_the_others_computing() -> None:
    """Two ranks of one node with one core, PP2: the first stage's optimizer starts while the second stage's runs
    and progresses at half speed until that one ends, then alone at full speed: it ends at the other's end plus
    the work left, not after twice its time (the bound of every rank computing at once)."""
    one_core = Cluster.load({"nodes": [{"host": "a", "kind": "cpu", "ranks": [0, 1]}]})
    pp2 = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 2, "stages": [
        {"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}]}]}
    cost = CostModel(cores=1)
    r = simulate("tiny", pp2, one_core, seq_len=16, cost=cost)
    (mine,) = [e for e in r.timeline[0] if e.kind == "optim"]
    (other,) = [e for e in r.timeline[1] if e.kind == "optim"]
    work = cost.optimizer_time(16384 + 2 * 41088, one_core.spec(0))  # the embedding and layers 0-1
    assert mine.start < other.end < mine.end
    assert mine.end == close(other.end + (work - (other.end - mine.start) / 2), rel=1e-9)
    assert mine.end - mine.start < 2 * work


@pytest.mark.parametrize("zero, grads", [(1, 2), (2, 1)])
def test_a_zero2_step_counts_the_gradients_sharded(zero: int, grads: int) -> None:
    """DP2 of ``tiny`` (197,184 parameters): bf16 weights 2 B each; bf16 gradients 2 B each, halved over the two
    replicas from ZeRO-2; fp32 optimizer states 12 B each, halved from ZeRO-1."""
    n = 16384 + 4 * 41088 + 16448
    s = {"zero": zero, "pipelines": [{"micro_batch_size": 1, "num_micro_batches": 2,
                                      "stages": [{"devices": [d], "layers": [0, 3]}]} for d in (0, 1)]}
    r = simulate("tiny", s, Cluster.local(2), seq_len=16)
    for d in (0, 1):
        assert {k: r.memory[d][k] for k in ("params", "grads", "optimizer")} == {
            "params": 2.0 * n, "grads": float(grads * n), "optimizer": 6.0 * n}


def test_a_program_prices_its_own_gradient_sync_and_gathers_not_its_strategys() -> None:
    """A plan edited to shard the optimizer states (ZeRO-1 annotations: a reduce-scatter after the step, the
    parameters gathered before it) under a strategy that says no ZeRO: simulate(program) prices the Program's own
    collectives -- those of the ZeRO-1 Program -- not the strategy's all-reduce."""
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.core.specialize import specialize
    from hspmd_sdk.core.strategy_plan import plan_from_strategy

    model, cl = LlamaConfig.preset("tiny"), Cluster.local(2)
    dp2 = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 2,
                          "stages": [{"devices": [d], "layers": [0, 3]}]} for d in (0, 1)]}
    plain, sharded = Strategy.load(dp2), Strategy.load({**dp2, "zero1": True})
    plan = plan_from_strategy(model, sharded, cl)
    edited = specialize(model, _with_strategy(plan, plain.model_dump(mode="json")), cl)

    def collectives(result: SimResult) -> list:
        return [(e.kind, e.duration) for e in result.timeline[0] if e.kind in ("comm", "sync")]

    got = collectives(simulate(edited))
    assert got == collectives(simulate(specialize(model, plan, cl)))
    assert [k for k, _ in got] == ["comm", "sync"]
    assert got != collectives(simulate(model, plain, cl, seq_len=edited.bindings["S"], dtype="float32"))


def _pipeline(stages: list, mbs: int = 1, nmb: int = 2) -> dict:
    return {"micro_batch_size": mbs, "num_micro_batches": nmb,
            "stages": [{"devices": d, "layers": l} for d, l in stages]}


#: strategies beyond test_simulate_program's cases: ZeRO-3 (the gathers before every forward and backward), ZeRO-2
#: over heterogeneous pipelines, TP2 stages of two kinds in PP2 x DP2
MORE_CASES = {
    "zero3 dp2 gpipe": ({"zero": 3, "schedule": "gpipe", "pipelines": [_pipeline([([0], [0, 3])]),
                                                                       _pipeline([([1], [0, 3])])]}, 2),
    "zero2 tp2+tp1 beside tp1": ({"zero": 2, "pipelines": [_pipeline([([0, 1], [0, 1]), ([2], [2, 3])], 1, 3),
                                                           _pipeline([([3], [0, 3])], 1, 1)]}, 4),
    "tp2 pp2 dp2, two kinds": ({"pipelines": [_pipeline([([0, 1], [0, 1]), ([4, 5], [2, 3])]),
                                              _pipeline([([2, 3], [0, 1]), ([6, 7], [2, 3])])]}, 0),
}


@pytest.mark.parametrize("include_embedding", [True, False])
@pytest.mark.parametrize("case", sorted(MORE_CASES))
def test_more_programs_and_their_strategies_give_the_same_step(case: str, include_embedding: bool) -> None:
    """simulate(program) equals simulate(model, strategy) at one dtype (every event, transfer and the memory), with
    and without the embedding and head in the gradient synchronisation (CostModel.include_embedding)."""
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.core.specialize import specialize
    from hspmd_sdk.core.strategy_plan import plan_from_strategy

    model = LlamaConfig.preset("tiny")
    data, ranks = MORE_CASES[case]
    cl = Cluster.local(ranks) if ranks else Cluster.mixed({"H800": 4, "H20": 4})
    s = Strategy.load(data, model=model, cluster=cl)
    program = specialize(model, plan_from_strategy(model, s, cl), cl)
    cost = CostModel(include_embedding=include_embedding)
    got = simulate(program, seq_len=32, cost=cost, dtype="float32")
    want = simulate(model, s, cl, seq_len=32, cost=cost, dtype="float32")
    assert (got.timeline, got.transfers, got.memory) == (want.timeline, want.transfers, want.memory)
    assert any(e.kind == "sync" for e in got.timeline[0])


def test_a_programs_gradient_sync_without_the_embedding_moves_the_layers_only() -> None:
    """CostModel(include_embedding=False): the Program's all-reduce of DP2 moves the four layers' parameters only
    (41,088 each), 2(n-1)/n = 1 x the buffer, 4 bytes a float32 value, over 2 B/s."""
    from hspmd_sdk import LlamaConfig

    *_, program = _dp2_program()
    cost = CostModel(include_embedding=False, link_overrides=WIRE.link_overrides)
    r = simulate(program, seq_len=32, cost=cost)
    assert sum(e.duration for e in r.timeline[0] if e.kind == "sync") == close(4 * 41088 * 4 / 2.0, rel=1e-12)
    assert LlamaConfig.preset("tiny").layer_param_count() == 41088


def test_zero3_gathers_a_stages_parameters_before_every_forward_and_backward() -> None:
    """ZeRO-3 (DP2, GPipe, 2 micro-batches): no gather before the step, but before each of the 2 forwards and 2
    backwards a `comm` event of that micro-batch lasting ZeRO-1's one gather of the same parameters; everything
    else as at ZeRO-1, so the step is ZeRO-1's plus three gathers."""
    def dp2(zero: int) -> dict:
        return {"zero": zero, "schedule": "gpipe", "pipelines": [_pipeline([([0], [0, 3])]), _pipeline([([1], [0, 3])])]}

    one = simulate("tiny", dp2(1), Cluster.local(2), seq_len=16)
    three = simulate("tiny", dp2(3), Cluster.local(2), seq_len=16)
    (gather,) = [e for e in one.timeline[0] if e.kind == "comm"]
    assert gather.start == 0.0 and gather.duration > 0
    work = [e for e in three.timeline[0] if e.kind in ("comm", "F", "B")]
    assert [(e.kind, e.micro_batch) for e in work] == [("comm", 0), ("F", 0), ("comm", 1), ("F", 1),
                                                       ("comm", 0), ("B", 0), ("comm", 1), ("B", 1)]
    for before, after in zip(work[::2], work[1::2]):
        assert before.duration == close(gather.duration, rel=1e-12) and before.end == after.start
    assert three.step_time == close(one.step_time + 3 * gather.duration, rel=1e-9)


def test_a_programs_step_carries_the_label_given() -> None:
    *_, program = _dp2_program()
    assert simulate(program, label="mine").label == "mine"


def test_a_pp2_replay_times_its_actions_and_records_its_transfers() -> None:
    """PP2 of ``tiny`` (1F1B, 2 micro-batches of 1 x 16 tokens) on two local ranks whose link has a measured send
    overhead of 1 us: every F lasts the stage's forward and every B its backward (_stage_cost); each send keeps
    the sender busy 1 us (a `comm` event of its micro-batch right after the F or B it follows) and is recorded as a
    transfer (pipeline, source and destination stage, F or B, micro-batch, start, end, bytes): 1 x 16 x 64 bf16
    values = 2,048 bytes, starting when posted and lasting p2p_seconds over the link."""
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.planner.simulator import Transfer, _stage_cost

    model, cl = LlamaConfig.preset("tiny"), Cluster.local(2)
    cost = CostModel(link_overrides={"intra": LinkOverride(latency=1e-6, bandwidth=1e9, send_overhead=1e-6)})
    s = Strategy.load({"pipelines": [_pipeline([([0], [0, 1]), ([1], [2, 3])])]})
    r = simulate(model, s, cl, seq_len=16, cost=cost)
    link = cl.link(0, 1)
    wire = cost.p2p_seconds(16 * 64, link)
    for d, (first, last) in ((0, (True, False)), (1, (False, True))):
        sc = _stage_cost(model, s.pipelines[0].stages[d], first, last, cl, 1, 16, cost)
        events = [e for e in r.timeline[d] if e.kind != "idle"]
        assert [e.duration for e in events if e.kind == "F"] == [close(sc.fwd, rel=1e-9)] * 2
        assert [e.duration for e in events if e.kind == "B"] == [close(sc.bwd, rel=1e-9)] * 2
        posts = [(events[i - 1], e) for i, e in enumerate(events) if e.kind == "comm"]
        assert len(posts) == 2 and all(e.duration == close(1e-6, rel=1e-9) and before.end == e.start
                                       and before.micro_batch == e.micro_batch
                                       and before.kind == ("F" if d == 0 else "B") for before, e in posts)
    assert sorted(r.transfers, key=lambda t: (t.kind != "F", t.micro_batch)) == [
        Transfer(0, src, dst, kind, mb, t.start, t.start + wire, 2048)
        for (src, dst, kind, mb), t in zip(((0, 1, "F", 0), (0, 1, "F", 1), (1, 0, "B", 0), (1, 0, "B", 1)),
                                           sorted(r.transfers, key=lambda t: (t.kind != "F", t.micro_batch)))]
    sent = {(t.kind, t.micro_batch): t.start for t in r.transfers}
    for d, kind in ((0, "F"), (1, "B")):
        for e in r.timeline[d]:
            if e.kind == "comm":
                assert sent[(kind, e.micro_batch)] == e.end  # the transfer goes once posted


def test_processor_sharing_slows_the_compute_of_a_tp_group_not_its_collectives() -> None:
    """A TP2 stage on a node of two ranks and one core: both ranks compute at once, so the compute part of each F
    (B) takes twice its time while its TP collectives (fwd_comm, bwd_comm: the waits) take theirs."""
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.core.strategy import Stage
    from hspmd_sdk.planner.simulator import _stage_cost

    model = LlamaConfig.preset("tiny")
    one_core = Cluster.load({"nodes": [{"host": "a", "kind": "cpu", "ranks": [0, 1]}]})
    cost = CostModel(cores=1)
    sc = _stage_cost(model, Stage(devices=[0, 1], layers=[0, 3]), True, True, one_core, 1, 16, cost, share=1.0)
    assert sc.fwd_comm > 0 and sc.bwd_comm > 0 and sc.fwd_comm != sc.bwd_comm
    r = simulate(model, {"pipelines": [_pipeline([([0, 1], [0, 3])], 1, 1)]}, one_core, seq_len=16, cost=cost)
    (f,) = [e.duration for e in r.timeline[0] if e.kind == "F"]
    (b,) = [e.duration for e in r.timeline[0] if e.kind == "B"]
    assert f == close(2 * (sc.fwd - sc.fwd_comm) + sc.fwd_comm, rel=1e-9)
    assert b == close(2 * (sc.bwd - sc.bwd_comm) + sc.bwd_comm, rel=1e-9)


def test_the_bubble_window_starts_at_the_first_forward_after_a_gather() -> None:
    """Under ZeRO-1 the step begins with the parameters' all-gather, so the first forward starts after it: the
    bubble is the idle share of the devices' time from that first forward to the last backward."""
    r = simulate("tiny", {"zero1": True, "pipelines": [_pipeline([([0], [0, 1]), ([1], [2, 3])]),
                                                       _pipeline([([2], [0, 1]), ([3], [2, 3])])]},
                 Cluster.mixed({"H800": 4}), seq_len=16)
    events = [e for evs in r.timeline.values() for e in evs]
    first_f = min(e.start for e in events if e.kind == "F")
    last_b = max(e.end for e in events if e.kind == "B")
    busy = sum(e.duration for e in events if e.kind in ("F", "B"))
    (gather,) = [e for e in r.timeline[0] if e.kind == "comm" and e.start == 0.0]
    assert first_f == gather.end > 0
    assert r.bubble_fraction == close(1.0 - busy / ((last_b - first_f) * 4), rel=1e-12)


def test_a_strategy_named_empty_gives_an_empty_label() -> None:
    """The label is the one given, else the strategy's name -- an empty name gives an empty label, no made-up one
    (a strategy copied with name '' keeps it)."""
    s = Strategy.load({"pipelines": [_pipeline([([0], [0, 3])], 1, 1)]}).model_copy(update={"name": ""})
    assert s.name == "" and simulate("tiny", s, Cluster.local(1), seq_len=16).label == ""


def test_a_busy_channel_holds_the_next_transfer_until_the_last_one_ends() -> None:
    """One transfer at a time per direction: over a slow link (1 MB/s: 2 ms for 2,048 bytes, far longer than a
    forward) the second micro-batch's activation, posted right after its forward, waits for the first's transfer
    to end and then takes its own time."""
    cost = CostModel(link_overrides={"intra": LinkOverride(latency=0.0, bandwidth=1e6)})
    r = simulate("tiny", {"schedule": "gpipe", "pipelines": [_pipeline([([0], [0, 1]), ([1], [2, 3])])]},
                 Cluster.local(2), seq_len=16, cost=cost)
    first, second = sorted((t for t in r.transfers if t.kind == "F"), key=lambda t: t.micro_batch)
    (f1,) = [e for e in r.timeline[0] if e.kind == "F" and e.micro_batch == 1]
    assert f1.end < first.end == second.start
    assert second.end - second.start == close(2048 / 1e6, rel=1e-9) == first.end - first.start


def test_with_idle_adds_no_gap_of_rounding_size_at_the_end() -> None:
    assert _with_idle([Event(0.0, 1.0, "F", 0)], 1.0 + 1e-12) == [Event(0.0, 1.0, "F", 0)]


def test_simulate_says_which_arguments_it_takes() -> None:
    """A Program alone (anything else beside it is refused, each on its own); a model needs a strategy, a cluster
    and seq_len (each missing one is refused); a strategy is checked against the cluster (a rank it lacks)."""
    from hspmd_sdk.errors import PlanValidationError

    model, s, cl, _, program = _dp2_program()
    for extra in ({"strategy": s}, {"cluster": cl}, {"global_batch": 4}):
        with pytest.raises(TypeError, match="takes the Program alone"):
            simulate(program, **extra)
    for args, kw in (((s, None), {"seq_len": 16}), ((None, cl), {"seq_len": 16}), ((s, cl), {})):
        with pytest.raises(TypeError, match=r"needs a strategy, a cluster and seq_len \(or a specialized Program "
                                            r"alone: simulate\(program\)\)"):
            simulate(model, *args, **kw)
    with pytest.raises(PlanValidationError) as info:
        simulate(model, {"pipelines": [_pipeline([([0], [0, 3])]), _pipeline([([5], [0, 3])])]}, cl, seq_len=16)
    assert info.value.problems == [("pipelines[1].stages[0].devices", "rank 5 is not in the cluster (2 ranks: 0..1)")]


def test_a_transfer_lasts_as_long_as_its_busiest_sender() -> None:
    """TP2 -> TP2 where sender 0 reaches its receiver (rank 2) across nodes and sender 1 its receiver (rank 3) inside
    its node: each sends one 1 x 16 x 64 activation, so the transfer lasts sender 0's time over the slower link."""
    cl = Cluster.load({"nodes": [{"host": "a", "kind": "H800", "ranks": [0, 1, 3]},
                                 {"host": "b", "kind": "H800", "ranks": [2]}]})
    cost = CostModel()
    r = simulate("tiny", {"pipelines": [_pipeline([([0, 1], [0, 1]), ([2, 3], [2, 3])], 1, 1)]}, cl, seq_len=16,
                 cost=cost)
    (fwd,) = [t for t in r.transfers if t.kind == "F"]
    slow, fast = cost.p2p_seconds(16 * 64, cl.link(0, 2)), cost.p2p_seconds(16 * 64, cl.link(1, 3))
    assert slow > fast and fwd.end - fwd.start == close(slow, rel=1e-9) and fwd.nbytes == 16 * 64 * 2


def test_a_gpt_programs_zero1_gathers_match_its_strategys() -> None:
    """GPT-2 (its embedding tied to the LM head) in PP2 x DP2 under ZeRO-1: the parameters' all-gathers before the
    step move each parameter once -- the tied weight's use on the last stage is gathered with the parameter, not
    again -- in the Program and in the strategy's formulas alike."""
    from hspmd_sdk import GPTConfig
    from hspmd_sdk.core.specialize import specialize
    from hspmd_sdk.core.strategy_plan import plan_from_strategy

    gpt, cl = GPTConfig.preset("tiny"), Cluster.local(4)
    s = Strategy.load({"zero1": True, "pipelines": [_pipeline([([0], [0, 1]), ([1], [2, 3])]),
                                                    _pipeline([([2], [0, 1]), ([3], [2, 3])])]}, model=gpt, cluster=cl)
    program = specialize(gpt, plan_from_strategy(gpt, s, cl), cl)
    got, want = simulate(program, seq_len=32, dtype="float32"), simulate(gpt, s, cl, seq_len=32, dtype="float32")
    for d in range(4):
        gathers = [(e.start, e.end) for e in got.timeline[d] if e.kind == "comm"]
        assert len(gathers) == 1 and gathers == [(e.start, e.end) for e in want.timeline[d] if e.kind == "comm"]


def test_a_stage_costs_its_parts_compute_and_collectives() -> None:
    """_stage_cost of a first-and-last stage (embedding, layers 0-3, head) sums each part's cost from the cost
    model (at the stage's TP degree, context parallelism and link): forward = compute + TP collectives, backward
    likewise, and the collectives' parts on their own; a CP2 stage prices the embedding and head at cp=2 too."""
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.core.strategy import Stage
    from hspmd_sdk.planner.cost import embedding_cost, head_cost, layer_cost
    from hspmd_sdk.planner.simulator import _stage_cost

    model, cl, cost = LlamaConfig.preset("tiny"), Cluster.mixed({"H800": 4}), CostModel()
    spec = cl.spec(0)
    for devices, cp in (([0, 1], 1), ([0, 1, 2, 3], 2)):
        stage = Stage(devices=devices, layers=[0, 3], cp=cp)
        link = cl.link(0, 1)
        cp_link = cl.link(0, 2) if cp > 1 else None
        sc = _stage_cost(model, stage, True, True, cl, 1, 64, cost, share=1.0)
        lay = layer_cost(model, spec, 2, link, 1, 64, cost, cp=cp, cp_link=cp_link)
        parts = [embedding_cost(model, spec, 2, link, 1, 64, cost, cp=cp)] + [lay] * 4 + \
            [head_cost(model, spec, 2, link, 1, 64, cost, cp=cp)]
        assert sc.fwd == close(sum(c.fwd_compute + c.fwd_comm for c in parts), rel=1e-12)
        assert sc.bwd == close(sum(c.bwd_compute + c.bwd_comm for c in parts), rel=1e-12)
        assert (sc.fwd_comm, sc.bwd_comm) == (close(sum(c.fwd_comm for c in parts), rel=1e-12),
                                              close(sum(c.bwd_comm for c in parts), rel=1e-12))
        assert sc.bwd_comm > 0


def test_an_uneven_stage_runs_the_collectives_of_its_tp_ranks_at_the_dtype_given() -> None:
    """A 3:1 TP2 stage computes its shares but its collectives span the two ranks: the same TP collectives as an
    even TP2 stage, forward and backward; priced at the dtype given (float32 above bfloat16)."""
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.core.strategy import Stage
    from hspmd_sdk.planner.simulator import _stage_cost

    model, cl, cost = LlamaConfig.preset("tiny"), Cluster.mixed({"H800": 2}), CostModel()
    uneven, even = Stage(devices=[0, 1], layers=[0, 3], ratios=[3, 1]), Stage(devices=[0, 1], layers=[0, 3])
    for dtype in ("float32", "bfloat16"):
        u = _stage_cost(model, uneven, True, True, cl, 1, 16, cost, share=1.0, dtype=dtype)
        e = _stage_cost(model, even, True, True, cl, 1, 16, cost, share=1.0, dtype=dtype)
        assert (u.fwd_comm, u.bwd_comm) == (e.fwd_comm, e.bwd_comm) and u.bwd_comm > 0
    u32, u16 = (_stage_cost(model, uneven, True, True, cl, 1, 16, cost, share=1.0, dtype=dt) for dt in
                ("float32", "bfloat16"))
    assert u32.fwd > u16.fwd and u32.bwd_comm > u16.bwd_comm
    # recomputing, the backward repeats the forward's collectives: alike for the uneven and the even stage
    u_rc = _stage_cost(model, uneven.model_copy(update={"recompute": True}), True, True, cl, 1, 16, cost, share=1.0)
    e_rc = _stage_cost(model, even.model_copy(update={"recompute": True}), True, True, cl, 1, 16, cost, share=1.0)
    assert (u_rc.fwd_comm, u_rc.bwd_comm) == (e_rc.fwd_comm, e_rc.bwd_comm) and e_rc.bwd_comm > u16.bwd_comm


@pytest.mark.parametrize("recompute", [False, True])
def test_a_cp_stage_cost_carries_its_ring_gaps_and_recompute_flag(recompute: bool) -> None:
    """What the mixed-length cost model reads off a stage cost (mixed_cost.StageCost): the layers' CP ring gaps
    summed over the stage (signed: here, over NVLink, the attention outlasts the ring) and whether the stage
    recomputes."""
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.core.strategy import Stage
    from hspmd_sdk.planner.cost import layer_cost
    from hspmd_sdk.planner.simulator import _stage_cost

    model = LlamaConfig.preset("tiny").model_copy(update={"max_seq_len": 4096})
    cl, cost = Cluster.mixed({"H800": 4}), CostModel(include_embedding=False)
    stage = Stage(devices=[0, 1, 2, 3], layers=[0, 3], cp=2, recompute=recompute)
    sc = _stage_cost(model, stage, False, False, cl, 1, 4096, cost, share=1.0)
    lay = layer_cost(model, cl.spec(0), 2, cl.link(0, 1), 1, 4096, cost, recompute=recompute, cp=2,
                     cp_link=cl.link(0, 2))
    assert lay.ring_gap_fwd != 0 and lay.ring_gap_bwd != 0
    assert (sc.ring_gap_fwd, sc.ring_gap_bwd, sc.recompute) == (close(4 * lay.ring_gap_fwd, rel=1e-12),
                                                                close(4 * lay.ring_gap_bwd, rel=1e-12), recompute)
