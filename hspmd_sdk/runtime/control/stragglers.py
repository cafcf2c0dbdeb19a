"""The straggler watch of a training job's controller (``straggler=``, paper §9 (b)).

:class:`StragglerWatch` follows each rank's compute seconds per step; a rank slower than it was under the plan by
the margin for several steps is a straggler.  :class:`StragglerPolicy` answers one: it replans with the rank's
measured speed (:func:`hspmd_sdk.planner.elastic.replan_straggler`) and switches the job through its controller
(``Job.switch``'s path, reason ``"straggler"``); a mixed-length job keeps its candidates and its dispatch prices
them with the measured speeds instead (:meth:`StragglerPolicy.reprice`).
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from ...core.specialize import specialize
from ...core.strategy_plan import plan_from_strategy, strategy_of
from ...errors import SwitchError
from .state import ControlState, Event

if TYPE_CHECKING:
    from ...core.specialize import Program
    from ...planner.cost import CostModel
    from .job import Job
    from .state import Reason
    from .versions import Numbering

__all__ = ["StragglerWatch", "StragglerPolicy"]


class StragglerWatch:
    """Per-rank compute seconds per step, as a share: a rank's compute over the median of the other ranks' in the
    same step, against that rank's own share in the first ``warmup`` complete steps after each (re)configuration
    (its baseline: what the running plan gives it).  A rank whose share stayed ``margin`` times its baseline for
    the last ``steps`` steps is a straggler; its measured factor is the median ratio.  Shares cancel what slows
    every rank alike (background load on a shared machine, a first step's set-up); a 1-rank job has none."""

    def __init__(self, margin: float = 1.5, steps: int = 3, warmup: int = 2) -> None:
        self.margin, self.steps, self.warmup = float(margin), int(steps), int(warmup)
        self.reset()

    def reset(self) -> None:
        self._steps: dict[int, dict[int, float]] = {}   # step -> rank -> compute seconds (incomplete steps)
        self._shares: dict[int, list[float]] = {}       # rank -> its share in each complete step, in order

    def add(self, rank: int, compute_s: float, *, step: int, ranks: Sequence[int]) -> tuple[int, float] | None:
        """Record ``rank``'s compute seconds of ``step`` (``ranks``: every rank the step waits for); returns
        ``(rank, factor)`` when that step completes and shows a rank that has just become a straggler."""
        got = self._steps.setdefault(int(step), {})
        got[int(rank)] = float(compute_s)
        if not set(ranks) <= set(got) or len(got) < 2:
            return None
        del self._steps[int(step)]
        for old in [s for s in self._steps if s < step]:  # steps that never completed (a rank was lost)
            del self._steps[old]
        found = None
        for r, x in got.items():
            ref = _median([v for q, v in got.items() if q != r])
            if ref <= 0:
                continue
            shares = self._shares.setdefault(r, [])
            shares.append(x / ref)
            if len(shares) < self.warmup + self.steps:
                continue
            base = _median(shares[: self.warmup])  # of an even count, the mean of the middle two: one noisy
            recent = shares[-self.steps:]          # warm-up step (a loaded machine) must not halve the baseline
            if base > 0 and all(v > self.margin * base for v in recent):
                factor = _median([v / base for v in recent])
                if found is None or factor > found[1]:
                    found = (r, factor)
        return found


def _median(values: Sequence[float]) -> float:
    """The median; of an even count, the mean of the middle two."""
    v = sorted(values)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


class StragglerHost(Protocol):
    """What the straggler policy reads of its controller, and the switch it asks for."""

    state: ControlState
    events: list[Event]
    job: "Job | None"
    mixed: bool
    length_planner: Any
    seq_len: int
    global_batch: int
    cost: "CostModel | None"

    @property
    def current(self) -> "Numbering": ...

    def switch(self, program: "Program", *, reason: "Reason" = "user") -> Event: ...


class StragglerPolicy:
    """Watches the compute seconds the workers report (``watch``: ``None``, no watch) and switches away from a
    straggler (see the module docstring)."""

    def __init__(self, host: StragglerHost, watch: StragglerWatch | None) -> None:
        self.host, self.watch = host, watch
        self.watches: dict[int, StragglerWatch] = {}  # mixed: a watch per candidate (its ranks' shares differ)
        self.slow: dict[int, float] = {}  # mixed: launch rank -> the slowdown the dispatch is priced for

    def reset(self) -> None:
        """Under the host's lock: a switch opened, every rank's baseline is measured anew."""
        if self.watch is not None:
            self.watch.reset()

    def restart(self) -> None:
        """Under the host's lock: a recovery opened a new world, priced for the survivors as launched."""
        self.reset()
        self.watches.clear()
        self.slow.clear()  # the dispatch restarts priced for the survivors as launched

    def on_metric(self, rank: int, msg: dict[str, Any]) -> None:
        """A worker's ``metric`` message: its compute seconds of a step, when the job is not reconfiguring."""
        host, watch = self.host, self.watch
        extra = msg.get("extra") or {}
        compute = extra.get("compute_s")
        if watch is None or compute is None:
            return
        step = int(msg.get("step", -1))
        with host.state.lock:
            if host.state.reconfiguring():
                return
            cur = host.current  # the ranks that compute in the running Program
            if host.mixed:
                measured = self.measured_share(rank, float(compute), step, cur)
                if measured is None:
                    return
                watch, compute, working = measured
            else:
                working = [cur.to_launch[r] for r in cur.program.ranks if cur.to_launch[r] not in host.state.dead]
            found = watch.add(rank, float(compute), step=step, ranks=working)
        if found is not None:
            threading.Thread(target=self.straggler, args=found, name="hspmd-straggler", daemon=True).start()

    def measured_share(self, rank: int, compute: float, step: int, cur: "Numbering"
                       ) -> tuple[StragglerWatch, float, list[int]] | None:
        """A mixed-length step's compute seconds of launch rank ``rank`` as a multiple of what the dispatch
        estimated for it (each step gives each pipeline other sequences), the candidate's own watch (its stages'
        estimates err differently) and the ranks that step waits for; ``None`` for a step not dispatched under
        the current pricing (dispatched ahead before a repricing, or in a world since replaced)."""
        planner = self.host.length_planner
        rec = planner.record(step)
        if rec is None or rec.get("pricing") != planner.pricing:
            return None
        estimates = rec.get("rank_seconds") or {}
        mine = estimates.get(cur.of_launch.get(rank, -1), 0.0)
        if mine <= 0:
            return None
        base = self.watch
        watch = self.watches.setdefault(int(rec["choice"]),
                                        StragglerWatch(base.margin, base.steps, base.warmup))  # type: ignore[union-attr]
        working = [cur.to_launch[r] for r, t in estimates.items() if t > 0 and r in cur.to_launch
                   and cur.to_launch[r] not in self.host.state.dead]
        return watch, compute / mine, working

    def straggler(self, launch_rank: int, factor: float) -> None:
        """Launch rank ``launch_rank`` computes ``factor`` times slower than under its plan: replan and switch."""
        from ...planner.elastic import replan_straggler  # lazy: planner, only an elastic/straggler/grow replan needs it

        host = self.host
        if host.mixed:
            self.reprice(launch_rank, factor)
            return
        with host.state.lock:
            if host.state.busy or host.state.open:
                return
            cur = host.current
        rank = cur.of_launch.get(launch_rank)
        if rank is None:
            return
        model = cur.program.model
        t0 = time.perf_counter()
        strategy = replan_straggler(model, cur.cluster, strategy_of(cur.program), {rank: factor},
                                    seq_len=host.seq_len, global_batch=host.global_batch, cost=host.cost)
        t1 = time.perf_counter()
        program = specialize(model, plan_from_strategy(model, strategy, cur.cluster), cur.cluster,
                             bindings=dict(cur.program.bindings))
        t2 = time.perf_counter()
        try:
            event = host.switch(program, reason="straggler")
        except SwitchError:
            return
        event.seconds.update({"plan": t1 - t0 + event.seconds["plan"], "specialize": t2 - t1})
        event.failed_ranks = []
        if host.job is not None:
            host.job.note(f"rank {launch_rank} is {factor:.2f}x slower than under its plan: switching to {strategy}")

    def reprice(self, launch_rank: int, factor: float) -> None:
        """A straggler in a mixed-length job: its candidates stay, and the dispatch prices them from the next
        step with the rank ``factor`` times slower (compounding an earlier factor), so each step's sequences go
        to the pipelines, and the step to the candidate, by the measured speeds.  Nothing moves between workers:
        the event is done at once.  A recovery after a failure prices its survivors afresh."""
        host = self.host
        with host.state.lock:
            if host.state.reconfiguring():
                return
            cur = host.current
            if launch_rank not in cur.of_launch:
                return
            self.slow[launch_rank] = self.slow.get(launch_rank, 1.0) * factor
            slow = {cur.of_launch[l]: k for l, k in self.slow.items() if l in cur.of_launch}
            t0 = time.perf_counter()
            step = host.length_planner.reprice(slow)
            event = Event(step, "straggler", [], strategy_of(cur.program), {"detect": 0.0,
                          "plan": time.perf_counter() - t0, "specialize": 0.0, "switch": 0.0},
                          {"intra": 0, "inter": 0}, dict(cur.of_launch), done=True, program=cur.program)
            event.seconds["total"] = event.seconds["plan"]
            host.events.append(event)
            self.watches.clear()
        if host.job is not None:
            host.job.note(f"rank {launch_rank} is {factor:.2f}x slower than the dispatch estimated: from step {step} "
                          f"each step's sequences are shared by the measured speeds (rank {launch_rank} priced "
                          f"{self.slow[launch_rank]:.2f}x slower)")
