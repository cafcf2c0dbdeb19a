"""What a training job adds (:class:`JobTraining`, a part of :class:`~.job.Job`): its controller's view (the
Program and cluster it runs now, its reconfiguration events, what it trains on), graph switching and growing
(SPEC §6, §9, §10), and the questions about its ranks that grow and the controller ask."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Sequence

from ...errors import RuntimeFailure, SwitchError
from ..spec import LaunchSpec

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.specialize import Program
    from ...core.strategy import Strategy
    from .job_stream import RankRecord
    from .state import Event

__all__ = ["JobTraining"]


class JobTraining:
    """The job's training side; the state it keeps is the job's own (:class:`~.job.Job` sets every attribute below;
    ``controller`` once :meth:`~.job.Job.use_controller` handed it)."""

    spec: LaunchSpec
    controller: Any
    _lock: threading.RLock
    _done: threading.Event
    _ranks: dict[int, "RankRecord"]

    # ---- graph switching (a training job's controller) -----------------------------------------------------
    def switch(self, program_or_strategy: "Program | Strategy | Sequence[Program | Strategy]") -> "Event":
        """Move the running job to a Program or a Strategy at the next step boundary (SPEC §6, §9): every
        parameter and Adam moment moves by one fused BSR, no process restarts, training goes on at the same step.

        A :class:`~hspmd_sdk.core.specialize.Program` trains the same model on ranks the job runs
        (``job.cluster``).  A :class:`~hspmd_sdk.core.strategy.Strategy` is specialized here for the job's model
        on its current cluster (``job.cluster``: after an elastic recovery, the survivors' numbering) with the
        running Program's bindings (the global batch stays).  Anything else raises
        :class:`~.controller.SwitchError` naming its type.  Called while the job reconfigures itself after a
        failure, it waits for that to finish first.  Returns the :class:`~.controller.Event`; it is ``done`` once
        every worker switched.

        A job training on mixed-length data (launched with a list of candidates) takes a list, as ``launch``
        does: ``job.switch([program_or_strategy, ...])`` (SPEC §9).  From the first step not dispatched yet
        (the launcher dispatches up to ``lookahead`` steps ahead of the workers) the dispatcher chooses among the
        new candidates, and the workers move from the running candidate to the chosen one by one fused BSR at that
        step boundary (``Event.reason == "user"``); the global batch and the data order stay, so the losses stay
        the single-device reference's.  The list is checked before anything changes: a
        :class:`~.controller.SwitchError` names an empty list, an entry that is not a Program or Strategy,
        another model, ranks the job does not run (or lost), a ZeRO-3 candidate, candidates whose longest
        sequence is shorter than the data's context, and a job whose every remaining step is dispatched already.
        A single Program or Strategy is refused for a mixed-length job (pass a one-element list), and a list for
        a job that trains one Program.  With ``elastic=True``, a failure before the first step under the new
        candidates committed recovers from the state held before the switch (as for one Program: the event is
        then ``superseded`` unless every survivor had switched)."""
        # lazy: core, loaded only to switch (the launcher imports job without loading core)
        from ...core.specialize import Program, specialize
        from ...core.strategy import Strategy
        from ...core.strategy_plan import plan_from_strategy

        if self.controller is None:
            raise RuntimeFailure(f"job {self.job_id} runs an entry that cannot switch plans (only training jobs "
                                 "launched with hspmd_sdk.launch can)")
        if self._done.is_set():
            raise RuntimeFailure(f"job {self.job_id} has finished ({self.status.value}); there is nothing to switch")
        target = program_or_strategy
        if isinstance(target, (list, tuple)):  # a mixed-length job's new candidates
            return self.controller.switch_candidates(list(target))
        if not isinstance(target, (Program, Strategy)):
            raise SwitchError(f"job.switch takes a Program or a Strategy, not {type(target).__name__} "
                              f"({target!r:.80}); specialize(model, plan, cluster) gives a Program, "
                              "Strategy.load(...) a Strategy")
        if isinstance(target, Strategy) and not getattr(self.controller, "mixed", False):
            running, cluster = self.controller.program, self.controller.cluster
            model = running.model
            target = specialize(model, plan_from_strategy(model, target, cluster), cluster,
                                bindings=dict(running.bindings))
        return self.controller.switch(target)

    def grow(self, cluster: "Cluster", program: "Program | Strategy | Sequence[Program | Strategy] | None" = None
             ) -> "Event":
        """Grow the running job onto ``cluster`` in memory (SPEC §10): ``cluster`` is ``job.cluster`` (the ranks
        it runs on now, in the same order) plus new ranks; one worker is started per new rank, the job trains on
        while they start, and at the first step boundary after every one is ready all workers meet in the larger
        world and the job switches to ``program`` (a Program on
        ``cluster`` or a Strategy; default: the planner's plan for ``cluster``) by one fused BSR that gives the
        new workers their parameters and Adam moments.  Training goes on at the same step with the same losses.
        Returns the :class:`~.controller.Event` (``reason="grow"``) at once; it is ``done`` once every worker
        switched, ``superseded`` if the grow was given up (a newcomer lost while starting, the job reconfigured or
        ended first: :attr:`notes` says why).  A job that trains on mixed-length data grows onto a list of
        candidates for ``cluster`` (Programs and Strategies, as ``launch`` takes them; default: the mixed-length
        planner's for ``cluster`` on the job's data): the dispatch of the first step not dispatched yet chooses
        among them and carries the grow (:mod:`.candidates`)."""
        from .grow import grow_job  # lazy: core (grow): the launcher imports job without loading core

        return grow_job(self, cluster, program)

    def launch_ranks(self) -> list[int]:
        """Every launch rank the job has started a worker for (live or not), ascending."""
        with self._lock:
            return sorted(self._ranks)

    def reached(self, ranks: Sequence[int], phase: str) -> bool:
        """Whether every worker of ``ranks`` (launch ranks) has reported start-up ``phase`` (``"built"``...)."""
        with self._lock:
            return all(phase in self._ranks[r].phases for r in ranks)

    def exited(self, ranks: Sequence[int]) -> bool:
        """Whether the worker process of every one of ``ranks`` (launch ranks) has exited."""
        with self._lock:
            return all(self._ranks[r].returncode is not None for r in ranks)

    def suspects(self) -> set[int]:
        """The launch ranks the watchdog is reporting as silent now (its ``suspect`` state)."""
        with self._lock:
            return {r for r, rec in self._ranks.items() if rec.suspect}

    @property
    def events(self) -> list["Event"]:
        """Every reconfiguration so far (:class:`~.controller.Event`; live)."""
        return list(self.controller.events) if self.controller is not None else []

    @property
    def program(self) -> "Program | None":
        """The Program the job runs now (``None`` for a job that does not train one)."""
        return self.controller.program if self.controller is not None else None

    @property
    def cluster(self) -> "Cluster | None":
        """The cluster the job runs on now (after an elastic recovery: the survivors, renumbered)."""
        return self.controller.cluster if self.controller is not None else None

    @property
    def data(self) -> str | None:
        """What the job trains on, in a few words (``"stdlib source (bytes)"``, ``"synthetic random tokens ..."``,
        ``"corpus NAME"``): shown by the progress line and the dashboard; ``None`` for a job that does not train."""
        runs = [r for r in self.spec.payload.get("runs") or () if isinstance(r, dict) and "data" in r]
        if not runs:
            return None
        from ..data import describe_data  # lazy: numpy/torch (data); the launcher imports job without them

        return describe_data(runs[0]["data"])
