"""Growing a running job (SPEC §10, ``Job.grow``): new workers join it in memory.

The job goes on over a larger cluster: the one it runs on now (``job.cluster``, ranks ``0..n-1``, in the same
order) plus new ranks (more local processes, SSH hosts, scheduler nodes).  :func:`grow_job` starts one worker per
new rank (a *newcomer*: its :class:`~.spec.LaunchSpec` says ``joining``, so it forms no world of its own and holds
no state), and asks the :class:`~.controller.TrainingController` for a switch to the new Program at the next step
boundary.  There every running worker leaves its world, all of them (running and new) meet at a fresh rendezvous
on the host of rank 0, and the one fused BSR of every parameter and Adam moment that any switch uses gives the
newcomers their shards (:mod:`.session`).  Training goes on at the same step, with the losses a job that never
grew would have had.  The running workers keep their ranks: rank ``r < n`` of the larger cluster is rank ``r``
now, so the BSR is planned in one numbering.

The boundary waits for the newcomers (their start-up: imports, building their Program) at the rendezvous; the
event's ``seconds["switch"]`` includes that wait.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ...errors import RuntimeFailure, SwitchError
from ..spec import LaunchSpec

if TYPE_CHECKING:
    from ...core.cluster import Cluster

#: a Job and a controller Event (not imported: the job imports this module)
Job = Event = Any


def extend_cluster(cluster: "Cluster", more: "Cluster") -> "Cluster":
    """The cluster :meth:`Job.grow` takes: ``cluster`` (``job.cluster``: its nodes and ranks as they are) followed by
    the nodes of ``more`` (e.g. ``Cluster.from_slurm(nodes="n3")``, a node back from a failure), whose ranks are
    numbered after ``cluster``'s in their order.  Device specs of both are kept (``cluster``'s win)."""
    from ...core.cluster import Cluster

    if not isinstance(cluster, Cluster) or not isinstance(more, Cluster):
        raise SwitchError(f"extend_cluster takes two Clusters, not {type(cluster).__name__} and "
                          f"{type(more).__name__}")
    base, extra, n = cluster.model_dump(), more.model_dump(), cluster.num_ranks
    nodes = base["nodes"] + [{**node, "ranks": [n + int(r) for r in node["ranks"]]} for node in extra["nodes"]]
    return Cluster.load({**base, "nodes": nodes, "devices": {**extra.get("devices", {}), **base.get("devices", {})}})


def grow_job(job: Job, cluster: "Cluster", program: Any = None) -> Event:
    """See :meth:`Job.grow`."""
    from ...core.cluster import Cluster

    ctl = job.controller
    if ctl is None:
        raise RuntimeFailure(f"job {job.job_id} runs an entry that cannot grow (only training jobs launched with "
                             "hspmd_sdk.launch can)")
    if job._done.is_set():
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
    program = _program_for(ctl, cluster, program)
    if job.metrics.last_step() + 2 >= job.spec.steps:
        raise SwitchError(f"job {job.job_id} is in its last step ({job.metrics.last_step() + 1} of "
                          f"{job.spec.steps}): there is no step boundary left to grow at")
    first = max(job._ranks) + 1
    joiners = {n + j: first + j for j in range(cluster.num_ranks - n)}
    spec = _grown_spec(job, cluster, joiners)
    running = [l for l in ctl.current.to_launch.values()]
    job._add_workers(spec, joiners)
    try:
        event = ctl.grow(program, cluster, joiners)
    except BaseException as e:
        job.stop_ranks(sorted(joiners.values()))  # nothing will ask them to join: the job must not wait for them
        if job._done.is_set() or all(job._ranks[r].returncode is not None for r in running):
            raise RuntimeFailure(f"job {job.job_id} ended while it was asked to grow (its last steps ran "
                                 f"meanwhile); nothing was grown") from e
        raise
    threading.Thread(target=_stranded, args=(job, event, running, sorted(joiners.values())),
                     name=f"hspmd-grow-{job.job_id}", daemon=True).start()
    return event


def _stranded(job: Job, event: Event, running: list[int], new: list[int]) -> None:
    """If the running workers end (their last step came before the boundary the grow waited for) while the
    newcomers still wait to join, stop the newcomers: the job ends as it would have, the grow is ``superseded``."""
    while not event.done and not job._done.is_set():
        with job._lock:
            ended = all(job._ranks[r].returncode is not None for r in running)
        if ended:
            event.superseded = True
            job._note(f"the job ended before the step boundary where it would grow onto ranks {new}: stopped them")
            job.stop_ranks(new)
            return
        time.sleep(0.05)


def _program_for(ctl: Any, cluster: "Cluster", target: Any) -> Any:
    """The Program to grow onto: ``target`` (a Program on ``cluster``, or a Strategy specialized here), or the
    planner's plan for the larger cluster (:func:`~hspmd_sdk.planner.plan_hetero`) for the job's model, global
    batch and sequence length."""
    from ...core.specialize import Program, specialize
    from ...core.strategy import Strategy
    from ...core.strategy_plan import plan_from_strategy

    running = ctl.program
    model = running.model
    if target is None:
        from ...planner.hetero import plan_hetero

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


def _grown_spec(job: Job, cluster: "Cluster", joiners: dict[int, int]) -> LaunchSpec:
    """The job's spec with a launch rank per new rank (its host: this machine for local processes, else the
    node's host; its device kind)."""
    from ..transports.transport import LocalTransport

    spec = job.spec
    local = isinstance(job.transport, LocalTransport)
    hosts = list(spec.hosts) + ["localhost" if local else cluster.node_of(r).host for r in sorted(joiners)]
    devices = list(spec.devices) + [cluster.kind(r) for r in sorted(joiners)]
    world = len(hosts)
    return LaunchSpec.model_validate({**spec.model_dump(), "world_size": world, "ranks": list(range(world)),
                                      "hosts": hosts, "devices": devices})
