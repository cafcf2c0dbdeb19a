"""Pipeline schedules as data (App. A.2): GPipe and 1F1B orders, and the replay proof of deadlock freedom."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd_sdk.core.schedule import (Action, ScheduleError, build_schedule, compute_order, format_schedule,
                                     in_flight, replay, warmup_count)

COMBOS = [(p, m) for p in range(1, 7) for m in range(1, 11)]


def _compute(actions: list[Action]) -> list[tuple[str, int]]:
    return [(a.kind, a.micro_batch) for a in actions if a.kind in ("F", "B")]  # type: ignore[misc]


@pytest.mark.parametrize("p,m", COMBOS)
def test_gpipe_is_all_forwards_then_all_backwards(p: int, m: int) -> None:
    for s in range(p):
        order = _compute(build_schedule("gpipe", p, s, m))
        assert order == [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


@pytest.mark.parametrize("p,m", COMBOS)
def test_1f1b_warmup_steady_cooldown(p: int, m: int) -> None:
    for s in range(p):
        order = _compute(build_schedule("1f1b", p, s, m))
        w = min(m, p - s - 1)
        assert warmup_count("1f1b", p, s, m) == w
        # warm-up: w forwards before the first backward
        assert [k for k, _ in order].index("B") == w + (1 if w < m else 0)
        assert order[:w] == [("F", i) for i in range(w)]
        # steady state: F(w+k) then B(k), alternating, until every forward ran
        steady = order[w:w + 2 * (m - w)]
        assert steady == [x for k in range(m - w) for x in (("F", w + k), ("B", k))]
        # cool-down: the remaining backwards in order
        assert order[w + 2 * (m - w):] == [("B", i) for i in range(m - w, m)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", COMBOS)
def test_each_micro_batch_forward_precedes_its_backward(kind: str, p: int, m: int) -> None:
    for s in range(p):
        order = _compute(build_schedule(kind, p, s, m))
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        for i in range(m):
            assert order.index(("F", i)) < order.index(("B", i))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", COMBOS)
def test_in_flight_is_the_peak_of_stored_activations(kind: str, p: int, m: int) -> None:
    for s in range(p):
        live = peak = 0
        for op, _ in compute_order(kind, p, s, m):
            live += 1 if op == "F" else -1
            peak = max(peak, live)
        assert in_flight(kind, p, s, m) == peak


def test_transfers_wrap_compute_with_neighbours() -> None:
    acts = build_schedule("1f1b", 3, 1, 2)
    assert acts[0] == Action("PRE") and acts[-1] == Action("POST")
    for i, a in enumerate(acts):
        if a.kind == "F":
            assert acts[i - 1] == Action("RECV_F", a.micro_batch, 0)
            assert acts[i + 1] == Action("SEND_F", a.micro_batch, 2)
        if a.kind == "B":
            assert acts[i - 1] == Action("RECV_B", a.micro_batch, 2)
            assert acts[i + 1] == Action("SEND_B", a.micro_batch, 0)
    first, last = build_schedule("1f1b", 3, 0, 2), build_schedule("1f1b", 3, 2, 2)
    assert not any(a.kind in ("RECV_F", "SEND_B") for a in first)
    assert not any(a.kind in ("SEND_F", "RECV_B") for a in last)


def test_paper_figure21_1f1b_strings() -> None:
    # Figure 21 (right): the last stage runs Pre,FB...FB,Post; the first stage Pre,FFB...FB,Post.
    assert format_schedule(build_schedule("1f1b", 2, 1, 3)) == "Pre F0 B0 F1 B1 F2 B2 Post"
    assert format_schedule(build_schedule("1f1b", 2, 0, 3)) == "Pre F0 F1 B0 F2 B1 B2 Post"


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", COMBOS)
def test_replay_of_one_pipeline_completes(kind: str, p: int, m: int) -> None:
    scheds = {(0, s): build_schedule(kind, p, s, m) for s in range(p)}
    result = replay(scheds)
    assert len(result.order) == sum(len(v) for v in scheds.values())
    for key, acts in scheds.items():
        assert result.steps(key) == acts


def test_replay_of_heterogeneous_pipelines_with_own_micro_batch_counts() -> None:
    # Table 11 C2: 33 micro-batches on a 4-stage pipeline, 31 on a 5-stage one, run together.
    scheds = {(0, s): build_schedule("1f1b", 4, s, 33) for s in range(4)}
    scheds |= {(1, s): build_schedule("1f1b", 5, s, 31) for s in range(5)}
    replay(scheds)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 12)), min_size=1, max_size=4),
       st.sampled_from(["gpipe", "1f1b"]))
def test_replay_any_set_of_pipelines(pipes: list[tuple[int, int]], kind: str) -> None:
    scheds = {(i, s): build_schedule(kind, p, s, m) for i, (p, m) in enumerate(pipes) for s in range(p)}
    replay(scheds)


def test_replay_detects_deadlock() -> None:
    # stage 0 waits for a gradient before it sent the activation the gradient depends on
    s0 = [Action("PRE"), Action("F", 0), Action("RECV_B", 0, 1), Action("SEND_F", 0, 1), Action("B", 0),
          Action("POST")]
    s1 = build_schedule("1f1b", 2, 1, 1)
    s0_bad = [Action("PRE"), Action("RECV_B", 0, 1), Action("F", 0), Action("SEND_F", 0, 1), Action("B", 0),
              Action("POST")]
    with pytest.raises(ScheduleError, match="deadlock"):
        replay({0: s0_bad, 1: s1})
    with pytest.raises(ScheduleError, match="deadlock"):
        replay({0: s0, 1: s1})


def test_replay_detects_mismatched_and_unmatched_sends() -> None:
    s0 = build_schedule("gpipe", 2, 0, 2)
    i, j = s0.index(Action("SEND_F", 0, 1)), s0.index(Action("SEND_F", 1, 1))
    swapped = list(s0)
    swapped[i], swapped[j] = Action("SEND_F", 1, 1), Action("SEND_F", 0, 1)
    with pytest.raises(ScheduleError, match="out of order"):
        replay({0: swapped, 1: build_schedule("gpipe", 2, 1, 2)})
    extra = s0[:-1] + [Action("SEND_F", 5, 1), s0[-1]]
    with pytest.raises(ScheduleError, match="unmatched"):
        replay({0: extra, 1: build_schedule("gpipe", 2, 1, 2)})
    with pytest.raises(ScheduleError, match="no schedule"):
        replay({0: s0})


def test_replay_checks_local_order() -> None:
    bad = [Action("PRE"), Action("B", 0), Action("F", 0), Action("POST")]
    with pytest.raises(ScheduleError, match="before F0"):
        replay({0: bad})


@pytest.mark.parametrize("args", [("zb", 2, 0, 1), ("1f1b", 0, 0, 1), ("1f1b", 2, 2, 1), ("gpipe", 2, 0, 0)])
def test_bad_arguments(args: tuple) -> None:
    with pytest.raises(ScheduleError):
        build_schedule(*args)

