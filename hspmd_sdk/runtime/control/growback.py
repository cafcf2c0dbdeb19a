"""Growing back automatically (SPEC §10, issue 25 item 4): an elastic job that lost ranks takes its capacity back.

``launch(..., elastic=True)`` on a transport whose capacity comes back by itself (``Transport.grows_back``: Slurm),
or ``grow_back=True`` (or a :class:`GrowBack` with other timings) on any transport: after each recovery from
a failure, a thread of the launcher compares the cluster the job was launched on with the one it runs on now
(:func:`lost_capacity`: per host, the ranks it lost), asks the transport which of those hosts can take workers
again (:meth:`~.transport.Transport.available`: this machine at once; a Slurm node once it answers the scheduler
and no allocation of the job still holds it) and grows the job onto them (:meth:`Job.grow`): a ``grow`` event like
any other.  The plan is the one the job was launched with (:func:`plan_back`: its devices matched host by host;
with capacity still missing, that plan replanned around it as after a failure, ``replan_elastic``) -- no solver
that redirects the process's output runs on this thread (Pyomo's HiGHS interface does, so ``plan_hetero`` is
left to ``job.grow`` called by the user).  It tries again every ``poll_s`` until the job has its launch
capacity back or ends; a grow refused because the job is busy (a switch or another recovery under way) is retried.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...core.cluster import Cluster
from ...core.specialize import specialize
from ...core.strategy_plan import plan_from_strategy, strategy_of
from ...errors import HSPMDError, SwitchError
from .grow import extend_cluster

if TYPE_CHECKING:
    from collections.abc import Container

    from ...core.specialize import Program
    from .job import Job

__all__ = ["GrowBack", "lost_capacity", "plan_back"]


def lost_capacity(launched: "Cluster", current: "Cluster", hosts: Container[str] | None = None) -> "Cluster | None":
    """The ranks ``current`` lacks of ``launched``, per host (each host's first nodes as ``launched`` lists them;
    the device kind and spec of ``launched``), as a Cluster to extend ``current`` by; only on ``hosts`` when given;
    ``None`` when nothing is missing."""
    have: dict[str, int] = {}
    for node in current.nodes:
        have[node.host] = have.get(node.host, 0) + len(node.ranks)
    nodes, n = [], 0
    for node in launched.nodes:
        keep = min(have.get(node.host, 0), len(node.ranks))
        have[node.host] = have.get(node.host, 0) - keep
        missing = len(node.ranks) - keep
        if missing > 0 and (hosts is None or node.host in hosts):
            nodes.append({**node.model_dump(), "ranks": list(range(n, n + missing))})
            n += missing
    if not nodes:
        return None
    data = launched.model_dump()
    return Cluster.load({**data, "nodes": nodes})


@dataclass
class GrowBack:
    """When an elastic job grows back onto the capacity it lost: ``after_s`` seconds after a recovery completed
    (a host that just failed is given time to settle), then every ``poll_s`` seconds while some lost host is not
    available yet."""

    after_s: float = 1.0
    poll_s: float = 0.5

    def __post_init__(self) -> None:
        if not (self.after_s >= 0 and self.poll_s > 0):
            raise ValueError(f"GrowBack needs after_s >= 0 and poll_s > 0 (got {self.after_s}, {self.poll_s})")

    def watch(self, job: "Job", launched: "Cluster") -> None:
        """Start growing ``job`` back towards ``launched`` (a thread; one at a time per job)."""
        with _lock:
            if _watching.get(id(job)):
                return
            _watching[id(job)] = True
        threading.Thread(target=self._run, args=(job, launched), name=f"hspmd-grow-back-{job.job_id}",
                         daemon=True).start()

    def _run(self, job: "Job", launched: "Cluster") -> None:
        try:
            if job.wait_ended(self.after_s):
                return
            while not job.ended:
                current = job.cluster
                missing = lost_capacity(launched, current)
                if missing is None:
                    return
                ready = [n.host for n in missing.nodes if _available(job, n.host)]
                more = lost_capacity(launched, current, ready) if ready else None
                if more is not None:
                    try:
                        grown = extend_cluster(current, more)
                        # a mixed-length job: candidates planned for the grown cluster (grow_job)
                        back = None if job.controller.mixed else plan_back(job.controller, launched, grown)
                        event = job.grow(grown, back)
                    except Exception as e:  # noqa: BLE001 - a daemon thread: said in the job's log, never raised
                        if not (isinstance(e, HSPMDError) and _busy(e)) or job.ended:  # its last steps,
                            # no plan fits, the host refused the workers: give up
                            job.note(f"grow_back: not growing back onto {ready}: {e}")
                            return
                    else:
                        job.note(f"grew back onto {ready} (grow_back)")
                        while not (event.done or event.superseded or job.ended):
                            time.sleep(0.05)
                        continue
                if job.wait_ended(self.poll_s):
                    return
        finally:
            with _lock:
                _watching.pop(id(job), None)


def plan_back(ctl: Any, launched: "Cluster", grown: "Cluster") -> "Program":
    """The Program a job grows back under: the one it was launched with (``ctl.launch_program`` on ``launched``),
    its devices matched to ``grown``'s: a launch rank still running keeps its process (``ctl.current``: the running
    numbering), the others take the new ranks host by host (same host and kind, in rank order); launched devices that
    ``grown`` still lacks are planned around as after their failure
    (:func:`~hspmd_sdk.planner.elastic.replan_elastic`)."""
    # lazy: planner, only an elastic/straggler/grow replan needs it
    from ...planner.elastic import renumber, replan_elastic

    program = ctl.launch_program
    strategy = strategy_of(program)
    if strategy is None:
        raise SwitchError("the job's launch plan has no strategy to grow back to")
    running = {l: r for r, l in ctl.current.to_launch.items() if l < launched.num_ranks}  # launch -> grown rank
    spots: dict[tuple[str, str], list[int]] = {}
    for r in grown.ranks:
        if r not in running.values():
            spots.setdefault((grown.node_of(r).host, grown.kind(r)), []).append(r)
    mapping, missing = dict(running), []
    for r in launched.ranks:
        if r in mapping:
            continue
        free = spots.get((launched.node_of(r).host, launched.kind(r)))
        if free:
            mapping[r] = free.pop(0)
        else:
            missing.append(r)
    model = program.model
    if missing:
        alone = 1 if launched.num_ranks - len(missing) == 1 else None
        strategy = replan_elastic(model, launched, strategy, missing, seq_len=ctl.seq_len,
                                  global_batch=ctl.global_batch, cost=ctl.cost, min_pipelines=alone)
    moved = renumber(strategy, mapping)
    return specialize(model, plan_from_strategy(model, moved, grown), grown, bindings=dict(program.bindings))


def _busy(error: Exception) -> bool:
    """Whether a refused grow may succeed later: the job was reconfiguring (a recovery, a switch under way) or
    some rank's failure was not replanned yet."""
    text = str(error)
    return any(s in text for s in ("still reconfiguring", "not replanned yet", "is in progress", "pending"))


def _available(job: "Job", host: str) -> bool:
    check = getattr(job.transport, "available", None)
    try:
        return bool(check(host)) if check is not None else True
    except Exception:  # noqa: BLE001 - cannot tell: try again later
        return False


_lock = threading.Lock()
_watching: dict[int, bool] = {}
