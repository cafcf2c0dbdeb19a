"""The controller's version bookkeeping (:mod:`hspmd_sdk.runtime.control.versions`): which plan versions a running
job's workers may hold, which one every worker applied, and which one the survivors of a failure recover from.
Pure values: stand-in Programs (strings) and clusters, no workers."""
from __future__ import annotations

import pytest

from hspmd_sdk.errors import HSPMDError
from hspmd_sdk.runtime.control.versions import (Numbering, Versions, common_previous, version_for_all,
                                                with_newcomers)


def _n(program: str, to_launch: dict[int, int], cluster: str = "c4") -> Numbering:
    return Numbering(program, cluster, dict(to_launch))


def test_numbering_maps_launch_ranks_back() -> None:
    n = _n("p", {0: 3, 1: 0, 2: 5})
    assert n.of_launch == {3: 0, 0: 1, 5: 2}


def test_a_new_job_holds_its_launch_plan_as_version_0_0() -> None:
    first = _n("p0", {0: 0, 1: 1})
    v = Versions(first)
    assert (v.current, v.world, v.switches, v.acked) == (first, 0, 0, None)
    assert v.held() == [(0, 0)] and v.get((0, 0)) is first and (0, 0) in v and (0, 1) not in v
    assert v.get((0, 1)) is None and v.candidate_count(0) == 0


def test_switches_and_reconfigurations_number_their_versions_in_the_order_made() -> None:
    v = Versions(_n("p0", {0: 0, 1: 1, 2: 2}))
    a, b = _n("p1", {0: 0, 1: 1, 2: 2}), _n("p2", {0: 0, 1: 1, 2: 2})
    assert v.open_switch(a) == (1, (0, 1)) and v.current is a
    assert v.open_switch(b) == (2, (0, 2)) and v.current is b
    survivors = _n("p3", {0: 0, 1: 2}, "c2")
    # a failure opens world 1; its switch floor is the 2 switches requested before it
    assert v.open_reconfiguration(survivors) == (1, 2, (1, 2)) and v.current is survivors
    assert (v.world, v.switches) == (1, 2)
    c = _n("p4", {0: 0, 1: 2}, "c2")
    assert v.open_switch(c) == (3, (1, 3))  # switch ids go on counting across worlds
    assert v.open_reconfiguration(_n("p5", {0: 2}, "c1")) == (2, 3, (2, 3))
    assert v.held() == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 3), (2, 3)]
    assert [v.get(k).program for k in v.held()] == ["p0", "p1", "p2", "p3", "p4", "p5"]  # type: ignore[union-attr]


def test_a_mixed_length_job_has_a_version_per_candidate() -> None:
    v = Versions(_n("launch", {0: 0, 1: 1}))
    v.use_candidates(["a", "b", "c"], 1)
    assert v.held() == [(0, 0), (0, 1), (0, 2)] and v.candidate_count(0) == 3
    assert v.current is v.get((0, 1)) and v.current.program == "b"
    assert [v.get((0, i)).to_launch for i in range(3)] == [{0: 0, 1: 1}] * 3  # type: ignore[union-attr]
    assert [v.get((0, i)).cluster for i in range(3)] == ["c4"] * 3  # type: ignore[union-attr]
    assert v.get((0, 0)).to_launch is not v.get((0, 1)).to_launch  # type: ignore[union-attr]
    # a recovery replans every candidate on the survivors: the world's versions are (1, j)
    survivors = _n("b'", {0: 1}, "c1")
    assert v.open_reconfiguration(survivors, ["a'", "b'"]) == (1, 0, None)
    assert v.current is survivors and v.candidate_count(1) == 2 and v.candidate_count(2) == 0
    assert [(k, v.get(k).program, v.get(k).cluster, v.get(k).to_launch)  # type: ignore[union-attr]
            for k in v.held() if k[0] == 1] == [((1, 0), "a'", "c1", {0: 1}), ((1, 1), "b'", "c1", {0: 1})]
    assert v.get((1, 1)) is not survivors


def test_the_newest_version_every_worker_applied_is_kept_with_its_first_step() -> None:
    v = Versions(_n("p0", {0: 0}))
    v.applied(None, 9)  # a change without a version of its own (a length switch)
    assert v.acked is None
    v.applied((0, 2), 5)
    assert v.acked == ((0, 2), 5)
    v.applied((0, 1), 7)  # older: reported late
    assert v.acked == ((0, 2), 5)
    v.applied((0, 2), 8)  # the same again: the first report stands
    assert v.acked == ((0, 2), 5)
    v.applied((1, 0), 6)
    assert v.acked == ((1, 0), 6)


def test_older_versions_go_once_a_step_of_the_applied_one_committed() -> None:
    v = Versions(_n("p0", {0: 0, 1: 1}))
    for p in ("p1", "p2", "p3"):
        v.open_switch(_n(p, {0: 0, 1: 1}))
    v.prune(100)  # nothing applied yet: everything may still be held
    assert v.held() == [(0, 0), (0, 1), (0, 2), (0, 3)]
    v.applied((0, 2), 10)
    v.prune(9)  # a step from before it: a worker may still hold the older ones
    assert v.held() == [(0, 0), (0, 1), (0, 2), (0, 3)]
    v.prune(10)
    assert v.held() == [(0, 2), (0, 3)]  # the applied one and the newer one stay
    v.prune(11)
    assert v.held() == [(0, 2), (0, 3)]


def _halted(source: str, held: tuple[int, int], step: int = 4, **kw: object) -> dict[str, object]:
    return {"source": source, "held": list(held), "step": step, **kw}


def test_common_previous_is_the_version_all_kept_from_before_the_switch() -> None:
    inside = _halted("live", (0, 2), previous_held=[0, 1])
    before = _halted("previous", (0, 1))
    assert common_previous({0: inside, 1: before}) == (0, 1)
    assert common_previous({0: inside, 1: dict(inside)}) == (0, 1)
    # one survivor completed the commit (no previous kept): the others must finish it
    assert common_previous({0: _halted("live", (0, 2)), 1: before}) is None
    # they kept different versions, or halted at different steps
    assert common_previous({0: inside, 1: _halted("previous", (0, 0))}) is None
    assert common_previous({0: inside, 1: _halted("previous", (0, 1), step=5)}) is None
    assert common_previous({}) is None


def test_with_newcomers_puts_the_held_plan_on_the_grown_numbering() -> None:
    src = _n("p", {0: 0, 1: 1}, "c2")
    grown = _n("q", {0: 0, 1: 1, 2: 7}, "c3")
    out = with_newcomers(src, grown)
    assert (out.program, out.cluster, out.to_launch) == ("p", "c3", {0: 0, 1: 1, 2: 7})
    assert out.to_launch is not grown.to_launch
    with pytest.raises(HSPMDError) as e:
        with_newcomers(_n("p", {0: 1, 1: 0}), grown)
    assert str(e.value) == ("the survivors hold the state of a plan whose ranks {0: 1, 1: 0} are not the first ranks "
                            "of the newest one {0: 0, 1: 1, 2: 7}: its newcomers cannot join a switch from it")


def test_version_for_all_around_a_grow_lets_the_newcomers_hold_nothing() -> None:
    before = _n("p", {0: 0, 1: 1})
    grown = _n("q", {0: 0, 1: 1, 2: 2})
    versions = {(0, 0): before, (0, 1): grown}
    # the running ranks went back to the state from before the grow; the newcomer holds the grown one
    halted = {0: _halted("previous", (0, 0), whole=[0, 1]), 1: _halted("previous", (0, 0), whole=[0, 1]),
              2: _halted("live", (0, 1), whole=[0, 1])}
    assert version_for_all(halted, versions) == ((0, 1), {0: "live", 1: "live", 2: "live"})
    # without the newcomer's whole state, the pre-grow version: the newcomer takes part holding nothing
    halted[2] = _halted("live", (0, 1))
    assert version_for_all(halted, versions) == ((0, 0), {0: "previous", 1: "previous", 2: "nothing"})
    # a version the launcher no longer keeps is never chosen
    assert version_for_all(halted, {(0, 1): grown}) is None


def test_version_for_all_prefers_fewest_given_up_then_the_older() -> None:
    a = _n("a", {0: 0, 1: 1})
    b = _n("b", {0: 0, 1: 1})
    halted = {0: _halted("live", (0, 2), whole=[0, 2], previous_held=[0, 1]),
              1: _halted("previous", (0, 1), whole=[0, 2])}
    # both offer both: no one gives anything up either way; the older wins
    assert version_for_all(halted, {(0, 1): a, (0, 2): b}) == ((0, 1), {0: "previous", 1: "previous"})
    assert version_for_all(halted, {(0, 2): b}) == ((0, 2), {0: "live", 1: "live"})
    # a member of the version's ranks who does not offer it rules it out
    lone = {0: _halted("live", (0, 2), whole=[0, 2]), 1: _halted("previous", (0, 1))}
    assert version_for_all(lone, {(0, 1): a, (0, 2): b}) is None
    # ruled out by one member, the newer one still wins
    partly = {0: _halted("previous", (0, 1), whole=[0, 2]), 1: _halted("live", (0, 2), whole=[0, 2])}
    assert version_for_all(partly, {(0, 1): a, (0, 2): b}) == ((0, 2), {0: "live", 1: "live"})
    # a version none of whose ranks survived is not a source
    assert version_for_all({5: _halted("live", (0, 2), whole=[0, 2])}, {(0, 2): b}) is None
    # a running state whose whole version is not the one it holds offers nothing live
    assert version_for_all({0: _halted("live", (0, 2), whole=[0, 1])}, {(0, 2): b, (0, 1): a}) is None


def test_versions_for_all_reads_the_versions_kept() -> None:
    v = Versions(_n("a", {0: 0, 1: 1}))
    v.open_switch(_n("b", {0: 0, 1: 1}))
    halted = {0: _halted("live", (0, 1), whole=[0, 1], previous_held=[0, 0]),
              1: _halted("previous", (0, 0), whole=[0, 1])}
    assert v.for_all(halted) == ((0, 0), {0: "previous", 1: "previous"})
    v.applied((0, 1), 3)
    v.prune(3)
    assert v.for_all(halted) == ((0, 1), {0: "live", 1: "live"})
