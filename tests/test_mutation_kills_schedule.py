"""Kills for the mutants of ``hspmd_sdk/core/schedule.py`` that ``tests/test_schedule.py`` and
``tests/test_action_text.py`` let live (``scripts/mutation.sh schedule``; issue 49): the exact
``compute_order`` lists (the steady and cool-down backwards are ``"B"``), ``Action.is_compute``, the local-order
errors for a misplaced ``PRE``/``POST``, the ``execute`` callback of :func:`replay` (who it is called for, with
which action and which payload, in which order), ``ReplayResult.max_pending`` and the exact text of the deadlock,
unmatched-send and parse errors.  Expected values are worked out by hand for one- to three-stage pipelines."""
from __future__ import annotations

from typing import Any, Hashable

import pytest

from hspmd_sdk.core.schedule import Action, ScheduleError, build_schedule, compute_order, replay


def _error(schedules: dict) -> str:
    with pytest.raises(ScheduleError) as info:
        replay(schedules)
    return str(info.value)


# ---- compute_order ------------------------------------------------------------------------------------------
def test_compute_order_1f1b_names_every_backward_b() -> None:
    """1F1B on stage 0 of 3 with 4 micro-batches: 2 warm-up forwards, two steady (F, B) pairs, two cool-down
    backwards -- every backward (steady and cool-down) is the tuple ``("B", mb)``, not another spelling."""
    assert compute_order("1f1b", 3, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                              ("B", 2), ("B", 3)]
    # the last stage: no warm-up, only steady pairs
    assert compute_order("1f1b", 3, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


def test_compute_order_gpipe_exact() -> None:
    """GPipe: every forward, then every backward (all of them the cool-down's ``("B", mb)``)."""
    assert compute_order("gpipe", 2, 1, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


# ---- Action -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["PRE", "F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "POST"])
def test_is_compute_only_for_f_and_b(kind: str) -> None:
    """``Action.is_compute`` is true exactly for the compute kinds F and B."""
    assert Action(kind, 0).is_compute is (kind in ("F", "B"))  # type: ignore[arg-type]


def test_text_of_no_action_error_names_it_and_the_forms() -> None:
    """The parse error quotes the text and lists the action forms a user may write."""
    with pytest.raises(ScheduleError) as info:
        Action.from_str("X1")
    assert str(info.value) == ("'X1' is not a schedule action (one of Pre, Post, F<mb>, B<mb>, sF<mb>@<peer>, "
                               "rF<mb>@<peer>, sB<mb>@<peer>, rB<mb>@<peer>)")


# ---- replay: local order ------------------------------------------------------------------------------------
def test_pre_not_first_is_refused_naming_the_stage_key() -> None:
    """A PRE anywhere but first is an error naming the stage by its key and the position."""
    bad = [Action("F", 0), Action("PRE"), Action("B", 0), Action("POST")]
    assert _error({(1, 0): bad}) == "stage (1, 0): PRE at position 1; it must come first"


def test_post_not_last_is_refused_naming_the_stage_key() -> None:
    """A POST anywhere but last is an error naming the stage by its key and the position."""
    bad = [Action("PRE"), Action("F", 0), Action("POST"), Action("B", 0)]
    assert _error({(1, 0): bad}) == "stage (1, 0): POST at position 2; it must come last"
    assert _error({3: bad}) == "stage 3: POST at position 2; it must come last"


def test_other_local_order_errors_text() -> None:
    """The texts of a forward run twice, a backward before its forward, and a forward never backed."""
    f_twice = [Action("PRE"), Action("F", 0), Action("F", 0), Action("B", 0), Action("POST")]
    assert _error({(0, 0): f_twice}) == "stage (0, 0): F0 runs twice"
    b_first = [Action("PRE"), Action("B", 1), Action("F", 1), Action("POST")]
    assert _error({(0, 0): b_first}) == "stage (0, 0): B1 runs before F1"
    b_twice = [Action("PRE"), Action("F", 0), Action("B", 0), Action("B", 0), Action("POST")]
    assert _error({(0, 0): b_twice}) == "stage (0, 0): B0 runs twice"
    no_b = [Action("PRE"), Action("F", 2), Action("F", 0), Action("B", 0), Action("POST")]
    assert _error({(0, 0): no_b}) == "stage (0, 0): micro-batches [2] run F but never B"


# ---- replay: execute and max_pending ------------------------------------------------------------------------
def test_execute_sees_every_action_with_its_key_and_the_sends_payload() -> None:
    """``execute(stage_key, action, payload)`` runs for every action in replay order; what it returns for a send
    is the payload of the matching receive; every other action gets ``None``.  Stage 0 runs until it blocks on
    rB0, stage 1 then runs to the end, then stage 0 finishes."""
    calls: list[tuple[Hashable, str, Any]] = []

    def execute(key: Hashable, action: Action, payload: Any) -> Any:
        calls.append((key, str(action), payload))
        return f"sent by {key} {action}" if action.kind.startswith("SEND") else "ignored"

    scheds = {(0, s): build_schedule("gpipe", 2, s, 1) for s in range(2)}
    result = replay(scheds, execute)
    assert calls == [((0, 0), "Pre", None), ((0, 0), "F0", None), ((0, 0), "sF0@1", None),
                     ((0, 1), "Pre", None), ((0, 1), "rF0@0", "sent by (0, 0) sF0@1"), ((0, 1), "F0", None),
                     ((0, 1), "B0", None), ((0, 1), "sB0@0", None), ((0, 1), "Post", None),
                     ((0, 0), "rB0@1", "sent by (0, 1) sB0@0"), ((0, 0), "B0", None), ((0, 0), "Post", None)]
    assert [(k, str(a)) for k, a in result.order] == [(k, t) for k, t, _ in calls]


def test_max_pending_is_the_busiest_channels_backlog() -> None:
    """GPipe's stage 0 posts all three activations before stage 1 receives one (backlog 3); 1F1B's stage 0 posts
    two (its warm-up forward and the first steady one) before it blocks on a gradient (backlog 2)."""
    gpipe = replay({s: build_schedule("gpipe", 2, s, 3) for s in range(2)})
    assert gpipe.max_pending == 3
    one_f_one_b = replay({s: build_schedule("1f1b", 2, s, 3) for s in range(2)})
    assert one_f_one_b.max_pending == 2
    single = replay({0: build_schedule("1f1b", 1, 0, 3)})
    assert single.max_pending == 0


# ---- replay: error texts ------------------------------------------------------------------------------------
def test_deadlock_message_lists_every_blocked_stage() -> None:
    """Both stages start with a receive: the error names each stage and the action it waits at, in stage order."""
    s0 = [Action("PRE"), Action("RECV_B", 0, 1), Action("F", 0), Action("SEND_F", 0, 1), Action("B", 0),
          Action("POST")]
    s1 = [Action("PRE"), Action("RECV_F", 0, 0), Action("F", 0), Action("B", 0), Action("SEND_B", 0, 0),
          Action("POST")]
    assert _error({0: s0, 1: s1}) == "deadlock: stage 0 waits at rB0@1, stage 1 waits at rF0@0"


def test_unmatched_sends_message_names_each_channel_its_kind_and_micro_batches() -> None:
    """Extra sends left in two channels: each is named ``src->dst`` with the transfer's kind letter (F/B) and the
    micro-batches still queued, channels in the order they were opened."""
    s0 = build_schedule("gpipe", 2, 0, 1)
    s1 = build_schedule("gpipe", 2, 1, 1)
    s0 = s0[:3] + [Action("SEND_F", 5, 1)] + s0[3:]
    s1 = s1[:-1] + [Action("SEND_B", 7, 0), Action("SEND_B", 8, 0), s1[-1]]
    assert _error({0: s0, 1: s1}) == "unmatched sends (never received): 0->1 F[5], 1->0 B[7, 8]"
