"""Growing a running job (SPEC §10, ``Job.grow``): new workers join it in memory.

The job goes on over a larger cluster: the one it runs on now (``job.cluster``, ranks ``0..n-1``, in the same
order) plus new ranks (more local processes, SSH hosts, scheduler nodes).  :func:`grow_job` starts one worker per
new rank (a *newcomer*: its :class:`~.spec.LaunchSpec` says ``joining``, so it forms no world of its own and holds
no state).  The job trains on while they start (imports, their session): only once every newcomer is ready does
the :class:`~.controller.TrainingController` ask for the switch to the new Program, at the next step boundary.
There every running worker leaves its world, all of them (running and new) meet at a fresh rendezvous on the host
of rank 0, and the one fused BSR of every parameter and Adam moment that any switch uses gives the newcomers their
shards (:mod:`.session`).  Training goes on at the same step, with the losses a job that never grew would have
had.  The running workers keep their ranks: rank ``r < n`` of the larger cluster is rank ``r`` now, so the BSR is
planned in one numbering.

Near the job's end (:data:`NEAR_THE_END` steps before it) the switch is asked for at once and the running workers
wait for the newcomers at the boundary, as a job too short to train on while they start must.  A newcomer lost
while starting gives the grow up (its event is ``superseded``) and leaves the running job as it was; so does a
failure of the running job meanwhile (grow again after its recovery).  The event's ``seconds["switch"]`` is the
slowest worker's rendezvous and BSR (and the wait for the newcomers, near the end).

A mixed-length job (:mod:`.mixed`) grows onto a list of candidates for the larger cluster (given, or planned by
:func:`~hspmd_sdk.planner.plan_mixed` on the job's data): the dispatch of the first step not dispatched yet chooses
among them and carries the grow (:meth:`~.candidates.CandidateSwitch.grow`), the newcomers join at that step, and
"near the end" counts the dispatch's lookahead too.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

from ...errors import RuntimeFailure, SwitchError
from ..spec import LaunchSpec
from ...core.cluster import Cluster
from ...core.specialize import Program, specialize
from ...core.strategy import Strategy
from ...core.strategy_plan import plan_from_strategy
from ..transports.transport import LocalTransport

if TYPE_CHECKING:
    from ...planner.mixed import Dispatcher
    from .state import Event

#: a Job (not imported: the job imports this module)
Job = Any

#: Steps before the job's end from which a grow no longer waits for its newcomers to be ready: the switch is asked
#: for at once and the running workers wait for them at the next boundary, so that a grow asked for in time is
#: never overtaken by the job's end (a boundary, and a step or two for the request to reach every worker).
NEAR_THE_END = 4


def extend_cluster(cluster: "Cluster", more: "Cluster") -> "Cluster":
    """The cluster :meth:`Job.grow` takes: ``cluster`` (``job.cluster``: its nodes and ranks as they are) followed by
    the nodes of ``more`` (e.g. ``Cluster.from_slurm(nodes="n3")``, a node back from a failure), whose ranks are
    numbered after ``cluster``'s in their order.  Device specs of both are kept (``cluster``'s win)."""
    if not isinstance(cluster, Cluster) or not isinstance(more, Cluster):
        raise SwitchError(f"extend_cluster takes two Clusters, not {type(cluster).__name__} and "
                          f"{type(more).__name__}")
    base, extra, n = cluster.model_dump(), more.model_dump(), cluster.num_ranks
    nodes = base["nodes"] + [{**node, "ranks": [n + int(r) for r in node["ranks"]]} for node in extra["nodes"]]
    return Cluster.load({**base, "nodes": nodes, "devices": {**extra.get("devices", {}), **base.get("devices", {})}})


def grow_job(job: Job, cluster: "Cluster", program: "Program | Strategy | list[Program | Strategy] | None" = None
             ) -> Event:
    """See :meth:`Job.grow`."""
    ctl = job.controller
    if ctl is None:
        raise RuntimeFailure(f"job {job.job_id} runs an entry that cannot grow (only training jobs launched with "
                             "hspmd_sdk.launch can)")
    if job.ended:
        raise RuntimeFailure(f"job {job.job_id} has finished ({job.status.value}); there is nothing to grow")
    if len(job.spec.payload.get("runs", ())) != 1:
        raise SwitchError("only a job of one run can grow (this one runs several in sequence)")
    if not isinstance(cluster, Cluster):
        raise SwitchError(f"job.grow takes the larger Cluster, not {type(cluster).__name__} ({cluster!r:.80})")
    cur = ctl.cluster
    n = cur.num_ranks
    if cluster.num_ranks <= n:
        raise SwitchError(f"job.grow needs a larger cluster: the job runs {n} ranks, the cluster given has "
                          f"{cluster.num_ranks}")
    for r in range(n):
        if cluster.kind(r) != cur.kind(r) or cluster.node_of(r).host != cur.node_of(r).host:
            raise SwitchError(f"rank {r} of the grown cluster is a {cluster.kind(r)} on {cluster.node_of(r).host}, "
                              f"but the job's rank {r} is a {cur.kind(r)} on {cur.node_of(r).host}: the grown "
                              "cluster is job.cluster with new ranks after its own (Cluster.load(...) of "
                              "job.cluster's nodes plus new ones)")
    if ctl.mixed:  # a candidate set on the larger cluster, and its dispatcher
        program, dispatcher = _candidates_for(ctl, cluster, program)
    else:
        program, dispatcher = _program_for(ctl, cluster, program), None
    if job.metrics.last_step() + 2 >= job.spec.steps:
        raise SwitchError(f"job {job.job_id} is in its last step ({job.metrics.last_step() + 1} of "
                          f"{job.spec.steps}): there is no step boundary left to grow at")
    if ctl.mixed:
        ctl.length_planner.boundary()  # a step is left to dispatch the grow with
    first = max(job.launch_ranks()) + 1
    joiners = {n + j: first + j for j in range(cluster.num_ranks - n)}
    spec = _grown_spec(job, cluster, joiners)
    running = [l for l in ctl.current.to_launch.values()]
    event = ctl.announce_grow(program, cluster, joiners, dispatcher)
    try:
        job.add_workers(spec, joiners)
    except BaseException:
        job.stop_ranks(ctl.give_up_grow(event, "its workers could not be started"))
        raise
    threading.Thread(target=_grow_when_ready, args=(job, event, joiners, running),
                     name=f"hspmd-grow-{job.job_id}", daemon=True).start()
    return event


def _grow_when_ready(job: Job, event: Event, joiners: dict[int, int], running: list[int]) -> None:
    """Wait until every newcomer is ready (its session built: the ``built`` phase), then have the controller
    switch the job onto the grown cluster; give the grow up if a newcomer is lost (the controller does), the job
    ends first, a newcomer is not ready within the job's start timeout, or the switch is refused (the job
    reconfigured meanwhile)."""
    ctl, new = job.controller, sorted(joiners.values())
    deadline = time.monotonic() + job.spec.timeout_s
    # a mixed-length job grows at the first step not dispatched yet: up to its lookahead past the next boundary
    near = NEAR_THE_END + (ctl.length_planner.lookahead if ctl.mixed else 0)
    while not event.superseded:
        ready = job.reached(new, "built")
        if ready or job.metrics.last_step() + near >= job.spec.steps:
            break  # ready; or so near the job's end that it waits for them at a boundary rather than end first
        if _ended(job, running):
            return _stop(job, event, new, "the job ended before its newcomers were ready")
        if time.monotonic() > deadline:
            return _stop(job, event, new, f"its newcomers were not ready within {job.spec.timeout_s:.0f} s")
        time.sleep(0.02)
    else:
        return  # given up by the controller (a newcomer was lost); it stopped them
    try:
        ctl.grow(event)
    except BaseException as e:  # noqa: BLE001 - refused or failed: the running job goes on as it was
        return _stop(job, event, new, f"{type(e).__name__}: {e}")
    # the running workers may end (their last step came before the boundary) while the newcomers wait to join
    while not event.done and not job.ended:
        if _ended(job, running):
            event.superseded = True
            job.note(f"the job ended before the step boundary where it would grow onto ranks {new}: stopped them")
            job.stop_ranks(new)
            return
        time.sleep(0.05)


def _ended(job: Job, running: list[int]) -> bool:
    return job.ended or job.exited(running)


def _stop(job: Job, event: Event, new: list[int], why: str) -> None:
    job.stop_ranks(job.controller.give_up_grow(event, why) or new)


def _program_for(ctl: Any, cluster: "Cluster", target: "Program | Strategy | None") -> "Program":
    """The Program to grow onto: ``target`` (a Program on ``cluster``, or a Strategy specialized here), or the
    planner's plan for the larger cluster (:func:`~hspmd_sdk.planner.plan_hetero`) for the job's model, global
    batch and sequence length."""

    running = ctl.program
    model = running.model
    if target is None:
        from ...planner.hetero import plan_hetero  # lazy: planner, only an elastic/straggler/grow replan needs it

        target = plan_hetero(model, cluster, global_batch=ctl.global_batch, seq_len=ctl.seq_len, cost=ctl.cost,
                             name=f"grown onto {cluster.num_ranks} ranks")
    if isinstance(target, Strategy):
        return specialize(model, plan_from_strategy(model, target, cluster), cluster,
                          bindings=dict(running.bindings))
    if not isinstance(target, Program):
        raise SwitchError(f"job.grow takes a Program or a Strategy for the larger cluster, not "
                          f"{type(target).__name__} ({target!r:.80})")
    outside = sorted(set(target.ranks) - set(cluster.ranks))
    if outside:
        raise SwitchError(f"the program uses ranks {outside}, which the grown cluster does not have")
    return target


def _candidates_for(ctl: Any, cluster: "Cluster", target: "Sequence[Program | Strategy] | Program | Strategy | None"
                    ) -> tuple[list["Program"], "Dispatcher"]:
    """A mixed-length job's candidates to grow onto and their dispatcher: ``target`` (a list of Programs on
    ``cluster`` and Strategies, as ``launch`` takes them), or the mixed-length planner's plan for the larger
    cluster (:func:`~hspmd_sdk.planner.plan_mixed`) on the job's data (its sequences' lengths, token budget and
    context); checked as ``job.switch([...])`` checks a list (:meth:`~.mixed.LengthPlanner.check_candidates`)."""
    planner = ctl.length_planner
    if isinstance(target, (Program, Strategy)):
        raise SwitchError("this job trains on mixed-length data: grow it onto a list of candidates for the larger "
                          "cluster (job.grow(cluster, [program_or_strategy, ...])), or none to have them planned")
    if target is None:
        from ...planner.mixed import plan_mixed  # lazy: planner, only a grow's plan needs it

        model, batches = ctl.program.model, planner.batches
        lengths = [int(x) for x in batches.lengths]
        target = plan_mixed(model, cluster, lengths, tokens_per_batch=batches.tokens_per_step,
                            context_len=batches.context, cost=ctl.cost).programs(model, cluster)
    if not isinstance(target, (list, tuple)):
        raise SwitchError(f"job.grow of a mixed-length job takes a list of candidates for the larger cluster, not "
                          f"{type(target).__name__} ({target!r:.80})")
    return planner.check_candidates(list(target), cluster)


def _grown_spec(job: Job, cluster: "Cluster", joiners: dict[int, int]) -> LaunchSpec:
    """The job's spec with a launch rank per new rank (its host: this machine for local processes, else the
    node's host; its device kind)."""

    spec = job.spec
    local = isinstance(job.transport, LocalTransport)
    hosts = list(spec.hosts) + ["localhost" if local else cluster.node_of(r).host for r in sorted(joiners)]
    devices = list(spec.devices) + [cluster.kind(r) for r in sorted(joiners)]
    world = len(hosts)
    return LaunchSpec.model_validate({**spec.model_dump(), "world_size": world, "ranks": list(range(world)),
                                      "hosts": hosts, "devices": devices})
