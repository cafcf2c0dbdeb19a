"""Schedule actions print and parse back (issue 47 item 2): ``Action.from_str(str(a)) == a`` for every action of
every packaged example strategy's stage schedules, and for every schedule shape; text of no action is refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from hspmd_sdk import Strategy
from hspmd_sdk.core.schedule import SCHEDULE_KINDS, Action, ScheduleError, build_schedule

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"


def _strategies() -> list[Path]:
    """Every packaged example that is a strategy (the others are clusters and the index)."""
    return [p for p in sorted(EXAMPLES.glob("*.json")) if "pipelines" in json.loads(p.read_text())]


def test_every_packaged_schedule_round_trips() -> None:
    seen = 0
    paths = _strategies()
    assert len(paths) >= 10
    for path in paths:
        strategy = Strategy.load(path)
        for pipe in strategy.pipelines:
            n = len(pipe.stages)
            for stage in range(n):
                for a in build_schedule(strategy.schedule, n, stage, pipe.num_micro_batches):
                    assert Action.from_str(str(a)) == a, (path.name, a)
                    seen += 1
    assert seen > 1000


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(SCHEDULE_KINDS), stages=st.integers(1, 6), data=st.data())
def test_any_schedule_round_trips(kind: str, stages: int, data: st.DataObject) -> None:
    stage = data.draw(st.integers(0, stages - 1))
    mbs = data.draw(st.integers(1, 12))
    actions = build_schedule(kind, stages, stage, mbs)
    assert [Action.from_str(str(a)) for a in actions] == actions
    assert [Action.from_str(t) for t in " ".join(map(str, actions)).split()] == actions


@pytest.mark.parametrize("text", ["", "X1", "F-1", "sF1@", "Pre Post", "f1", "B1@x"])
def test_text_of_no_action_is_refused_naming_it(text: str) -> None:
    with pytest.raises(ScheduleError, match="is not a schedule action"):
        Action.from_str(text)
