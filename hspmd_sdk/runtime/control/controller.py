"""The launcher's side of graph switching (paper §7, §9 (b)): ``Job.switch``, elastic recovery, stragglers.

A :class:`TrainingController` rides along every training job (``launch`` attaches one).  It knows the Program
the workers run, its cluster and how its ranks map to the processes the launcher started (*launch ranks*, which
never change; a Program's ranks are renumbered when the survivors of a failure form a smaller world).  Every plan
change is computed here, once, and sent to the workers (:mod:`.session` executes it):

* ``switch(program)`` (``Job.switch``): the fused BSR of every parameter and Adam moment from the running
  Program to ``program`` (:func:`hspmd_sdk.core.reconfigure.plan_program_switch`), applied by all workers at the
  same step boundary;
* with ``elastic=True`` it is also the job's :class:`~.faults.FailurePolicy`: a worker that died (any signal, a
  lost host, a hung rank it stops) does not end the job.  The survivors halt at their next communication, the
  controller replans for them (:func:`hspmd_sdk.planner.replan_elastic`), specializes the new strategy on the
  survivors renumbered ``0..n-1``, plans the fused BSR from the surviving replicas (``failed=``), and sends each
  survivor its new rank, the rendezvous of the new world and the plan; they redo the interrupted step.  State
  with no surviving copy is reloaded from the job's newest complete checkpoint (``checkpoint_dir``): the same
  survivors, the same new plan, but each reads its shards of it from the checkpoint instead of a BSR, and the run
  goes on from the checkpoint's step (the steps after it are recomputed on the same data).  Without a checkpoint
  (none given, or none complete yet) the job fails naming the lost tensors and ranks.  A second failure while
  reconfiguring replans from the state every survivor still holds;
* ``grow(program, cluster, joiners)`` (``Job.grow``, :mod:`.grow`): the same switch onto a larger world, the
  running workers keeping their ranks and new workers joining at the step boundary;
* with ``straggler=`` it watches each rank's compute seconds per step: a rank slower than it was under the plan by
  the margin for several steps triggers a replan with its measured speed (:func:`hspmd_sdk.planner.elastic.
  replan_straggler`) and a switch.

Every reconfiguration is an :class:`Event` in ``Job.events`` (live) and ``JobResult.events``.

**What the workers hold.**  Every plan starts from a layout the workers will really hold, never from one merely
requested.  Each state is a *version* ``(reconfiguration, switch)``: a user switch is planned from the newest
version requested (what the switch before it will leave; the workers apply every switch in order, none is
skipped), a recovery from the version the survivors report in their ``halted`` messages (what they hold: the
running state, or the state from before the switches of the last step boundary when one of those was cut).  A
recovery cancels the switches requested before it (their events are ``superseded``; the workers skip them).  When
the launcher learns of a dead worker it tells every survivor (``halt``), so that a survivor waiting for the dead
one outside a collective (rank 0 collecting a synchronous checkpoint's records) halts too instead of being taken
for a hung rank.  A worker that halts when no worker died (a genuine error mistaken for a peer's) gets a clear end
of the job, never silence.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Mapping, Sequence

from ...errors import HSPMDError, SwitchError
from .faults import Failure, Reaction
from ...core.program_part import PlanParts
from ...core.reconfigure import LostStateError, plan_program_switch
from ...core.specialize import specialize
from ...core.strategy_plan import plan_from_strategy, strategy_of
from ..checkpoints.checkpoint import list_checkpoints, load_checkpoint, resume_payload
from ..checkpoints.checkpoint_io import CheckpointError
from ..protocol import pack_payload, program_fields
from ..transports.transport import LocalTransport, is_local_host
from .growback import GrowBack
from .versions import Numbering, Versions, common_previous, with_newcomers

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.specialize import Program
    from ...core.strategy import Strategy
    from .job import Job

__all__ = ["Event", "TrainingController", "SwitchError", "StragglerWatch"]

Reason = Literal["user", "failure", "straggler", "length", "grow"]


@dataclass
class Event:
    """One reconfiguration of a running job (SPEC §6).

    ``step``: the first step run under the new ``strategy``; ``reason``: ``"user"``, ``"failure"``,
    ``"straggler"``, ``"length"`` or ``"grow"`` (new workers joined: :mod:`.grow`); ``failed_ranks``: launch ranks lost (for a failure); ``seconds``: ``detect``
    (from the first evidence of the failure to the start of replanning), ``plan``, ``specialize``, ``switch`` (the
    slowest worker's fused BSR, rejoining included) and ``total``; ``bytes``: moved by the switch, ``"intra"`` /
    ``"inter"`` node (by the cluster's link classes).  ``done``: every worker reported the switch.
    ``ranks``: launch rank -> rank in the new Program.  ``source``: where the state came from — ``"memory"`` (the
    surviving replicas, by fused BSR) or ``"checkpoint"`` (state with no surviving copy: every survivor reloaded
    its shards of the new plan from the checkpoint of step ``checkpoint_step``; the run went back to that step,
    ``seconds["switch"]`` is then the slowest worker's rejoin and read, ``seconds["load"]`` its read alone,
    ``seconds["verify"]`` the launcher's check of the checkpoint, and ``bytes["read"]`` the bytes all survivors
    read)."""

    step: int
    reason: Reason
    failed_ranks: list[int]
    strategy: "Strategy | None"
    seconds: dict[str, float]
    bytes: dict[str, int]
    ranks: dict[int, int] = field(default_factory=dict)
    done: bool = False
    superseded: bool = False  #: another failure came before every worker switched: the next event replaced it
    program: Any = field(default=None, repr=False)
    source: Literal["memory", "checkpoint"] = "memory"
    checkpoint_step: int | None = None
    version: tuple[int, int] | None = field(default=None, repr=False)  #: the workers' state after it (controller)

    def __str__(self) -> str:
        s = self.seconds
        keys = ("detect", "plan", "verify", "specialize", "switch", "load", "total")
        parts = ", ".join(f"{k} {s[k]:.3f} s" for k in keys if k in s)
        lost = f", lost ranks {self.failed_ranks}" if self.failed_ranks else ""
        moved = f"{(self.bytes.get('intra', 0) + self.bytes.get('inter', 0)) / 1e6:.2f} MB moved"
        if self.source == "checkpoint":
            moved = (f"reloaded from the checkpoint of step {self.checkpoint_step}, "
                     f"{self.bytes.get('read', 0) / 1e6:.2f} MB read")
        return f"step {self.step}: {self.reason}{lost}; {parts}; {moved}"


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


class TrainingController:
    """See the module docstring.  Made by :func:`~hspmd_sdk.runtime.control.train.launch`."""

    def __init__(self, program: "Program", cluster: "Cluster", *, global_batch: int, seq_len: int,
                 elastic: bool = False, straggler: StragglerWatch | None = None, cost: Any = None,
                 checkpoint_dir: str | None = None, resumed_from: str | None = None,
                 checkpoint_every: int | None = None, debounce_s: float = 0.3, halt_timeout_s: float = 60.0, grow_back: Any = None,
                 grow_back_default: bool = False) -> None:
        #: every version the workers may still hold, the newest requested as its ``current`` (:mod:`.versions`)
        self.versions = Versions(Numbering(program, cluster, {r: r for r in cluster.ranks}))
        self.global_batch, self.seq_len = int(global_batch), int(seq_len)
        self.elastic, self.straggler, self.cost = elastic, straggler, cost
        #: the workers hold their parts of the Program (SPEC §16; ``protocol.sends_parts`` of the run): a switch
        #: sends each its part of the new one; set by ``launch``
        self.parts = False
        self.grow_back, self.launched = grow_back, cluster  # (:mod:`.growback`: after a recovery, towards this)
        self.launch_program = program  # the plan the job was launched with (growing back returns to it)
        self.grow_back_default = grow_back_default  # none chosen: the transport's own (``Transport.grows_back``)
        self.debounce_s, self.halt_timeout_s = debounce_s, halt_timeout_s
        # where lost state is reloaded from: this job's checkpoints (and the one it resumed from)
        self.checkpoint_dir, self.resumed_from = checkpoint_dir, resumed_from
        self.checkpoint_every = checkpoint_every
        self.events: list[Event] = []
        self.job: "Job | None" = None
        self._lock = threading.RLock()
        self._dead: set[int] = set()          # launch ranks lost so far
        self._pending_dead: set[int] = set()  # lost, not yet planned around
        self._evidence: float | None = None
        self._halted: dict[int, dict[str, Any]] = {}
        self._switched: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
        self._open: dict[tuple[str, int], Event] = {}
        self._busy = False
        self._thread: threading.Thread | None = None
        self._warmed = False  # the planners imported ahead of the first replan (:func:`_warm_planners`)
        self._watches: dict[int, StragglerWatch] = {}  # mixed: a watch per candidate (its ranks' shares differ)
        self._slow: dict[int, float] = {}  # mixed: launch rank -> the slowdown the dispatch is priced for
        self._trained: set[int] = set()  # launch ranks past their last step (a loss from then on is after the end)
        self._after_end = False  # a recovery found every survivor past the last step: there was nothing to recover
        self.mixed = False  # a mixed-length job (:mod:`.mixed`): its plan changes per step, by length
        self.length_planner: Any = None  # its dispatch (:class:`~.mixed.LengthPlanner`)
        #: newcomers of an announced grow that are still starting: launch rank -> (its event, the world it grows)
        self._joining: dict[int, tuple[Event, int]] = {}
        #: an announced grow's switch, ready to send: id(event) -> (the grown numbering, its plan, its payload
        #: when the workers hold the whole Program, rendezvous)
        self._prepared: dict[int, tuple[Numbering, Any, dict[str, Any] | None, dict[str, Any]]] = {}

    def use_candidates(self, programs: Sequence["Program"], first: int, planner: Any) -> None:
        """Make this the controller of a mixed-length job choosing per step among ``programs`` (``first`` runs
        first), dispatched by ``planner``.  Its versions are ``(reconfiguration id, candidate)``: a worker holds
        the state of the candidate it last switched to, and an elastic recovery replans every candidate on the
        survivors (:meth:`_replan_candidates`)."""
        self.mixed, self.length_planner = True, planner
        self.versions.use_candidates(programs, first)

    # ---- wiring ---------------------------------------------------------------------------------------------
    def attach(self, job: "Job") -> None:
        self.job = job
        job.on_message("halted", self._on_halted)
        job.on_message("switched", self._on_switched)
        job.on_message("metric", self._on_metric)
        job.on_message("trained", self._on_trained)
        job.on_finish(self._ended)

    def _ended(self, job: "Job") -> None:
        """The job ended: a switch or grow it never reached (its last step came first) is ``superseded``, said."""
        with self._lock:
            never = [e for e in self._open.values() if not e.done]
            self._open.clear()
        for event in never:
            event.superseded = True
            job.note(f"the job ended before the step boundary of the {event.reason} requested at step {event.step}: "
                      "it was not applied")

    @property
    def current(self) -> Numbering:
        """The newest version requested: its Program, cluster and launch ranks."""
        return self.versions.current

    @property
    def program(self) -> "Program":
        """The Program the job runs now (ranks in the current world's numbering)."""
        return self.current.program

    @property
    def cluster(self) -> "Cluster":
        """The cluster the job runs on now (after failures: the survivors, renumbered)."""
        return self.current.cluster

    @property
    def alive(self) -> list[int]:
        return sorted(set(self.current.to_launch.values()) - self._dead)

    # ---- Job.switch -----------------------------------------------------------------------------------------
    def switch(self, program: "Program", *, reason: Reason = "user") -> Event:
        """Move the running job to ``program`` at the next step boundary (``Job.switch``)."""

        if self.mixed:
            raise SwitchError("this job trains on mixed-length data: it chooses its plan per step among its "
                              "candidate programs (Job.events shows the length switches)")
        self._acquire_quiet("switch")
        try:
            cur = self.current
            self._check_switchable(program, cur)
            t0 = time.perf_counter()
            plan = plan_program_switch(cur.program, program, cur.cluster)
            t_plan = time.perf_counter() - t0
            event = Event(self._next_step(), reason, [], strategy_of(program), {"detect": 0.0, "plan": t_plan,
                          "specialize": 0.0}, _bytes(plan, cur.cluster), dict(cur.of_launch), program=program)
            self.events.append(event)
            # planned from the newest version requested: the workers apply the switches in order
            ident = self._open_switch(event, Numbering(program, cur.cluster, dict(cur.to_launch)))
        finally:
            self._lock.release()
        # each its parts by its rank, which the new Program keeps, or the whole
        self._send_program({"type": "switch", "id": ident}, program, plan, self.alive, version=ident,
                           rank_of=cur.of_launch)
        return event

    def _open_switch(self, event: Event, numbering: Numbering) -> int:
        """Under the lock: a new switch id for ``event``, awaited until every worker switched, and ``numbering``
        the job's current version from now on; returns the id."""
        ident, event.version = self.versions.open_switch(numbering)
        self._open[("switch", ident)] = event
        if self.straggler is not None:
            self.straggler.reset()
        return ident

    def _acquire_quiet(self, what: str) -> None:
        """Take the lock once no reconfiguration after a failure is under way (a switch or a grow follows it)."""
        deadline = time.monotonic() + self.halt_timeout_s + 30.0
        while True:
            self._lock.acquire()
            if not self._busy and not any(k[0] == "reconfigure" for k in self._open):
                return
            self._lock.release()
            if self.job is not None and self.job.ended:
                raise SwitchError(f"job {self.job.job_id} ended while reconfiguring after a failure; there is "
                                  f"nothing to {what}")
            if time.monotonic() > deadline:
                raise SwitchError(f"the job is still reconfiguring after a failure; {what} again when it is done "
                                  "(Job.events shows when)")
            time.sleep(0.01)

    # ---- Job.grow -------------------------------------------------------------------------------------------
    def announce_grow(self, program: "Program", cluster: "Cluster", joiners: Mapping[int, int]) -> Event:
        """The event of a grow onto ``cluster`` and ``program`` whose newcomers are starting (``joiners``: rank of
        ``cluster`` -> launch rank; :mod:`.grow`).  It is in :attr:`events` at once, and the switch is prepared
        now (its BSR planned, its payload packed unless each worker gets its parts, the grown world's rendezvous
        chosen); :meth:`grow` sends it once
        every newcomer is ready, so the job trains on while they start.  A newcomer lost before then gives the grow
        up (:meth:`give_up_grow`): the running job is untouched.  Refuses a mixed-length job, another model, another
        global batch, and a cluster that is not the running one plus new ranks."""
        if self.mixed:
            raise SwitchError("growing a mixed-length job (per-step candidates) is not supported yet; grow a job "
                              "that trains one Program")
        with self._lock:
            cur, reconf = self.current, self.versions.world
            dead = sorted(l for l in cur.to_launch.values() if l in self._dead)
        if dead:
            raise SwitchError(f"launch ranks {dead} of the job failed and are not replanned yet; grow once the job "
                              "recovered (Job.events shows when)")
        if program.model != cur.program.model:
            raise SwitchError(f"the new program trains {program.model!r}, the job {cur.program.model!r}: "
                              "growing keeps the model")
        if program.bindings.get("B") != cur.program.bindings.get("B"):
            raise SwitchError(f"the new program's global batch is {program.bindings.get('B')}, the job's "
                              f"{cur.program.bindings.get('B')}: growing keeps the data of every step")
        n = cur.cluster.num_ranks
        to_launch = {**{r: cur.to_launch[r] for r in range(n)}, **{int(r): int(l) for r, l in joiners.items()}}
        if sorted(to_launch) != list(range(cluster.num_ranks)):
            raise SwitchError(f"the grown cluster has ranks 0..{cluster.num_ranks - 1}; the job runs "
                              f"0..{n - 1} and new workers are to start for {sorted(joiners)}")
        t0 = time.perf_counter()
        plan = plan_program_switch(cur.program, program, cluster)  # cur's ranks keep their numbers
        # packed now (each worker's parts are written when it is sent: they depend on the rank)
        whole = None if self._each_part else program_fields(program, plan)
        launch_of = {l: r for r, l in to_launch.items()}
        event = Event(self._next_step(), "grow", [], strategy_of(program),
                      {"detect": 0.0, "plan": time.perf_counter() - t0, "specialize": 0.0}, _bytes(plan, cluster),
                      launch_of, program=program)
        addr, port = self._rendezvous(to_launch[0])
        grow = {"master_addr": addr, "master_port": port, "world": cluster.num_ranks,
                "ranks": {str(l): r for l, r in launch_of.items()}, "reconfigured": reconf}
        with self._lock:
            self.events.append(event)
            for launch in joiners.values():
                self._joining[int(launch)] = (event, reconf)
            self._prepared[id(event)] = (Numbering(program, cluster, to_launch), plan, whole, grow)
        return event

    def give_up_grow(self, event: Event, why: str) -> list[int]:
        """Give an announced grow up before it started (a newcomer was lost, or the job changed meanwhile): its
        event is ``superseded``; returns the launch ranks of its newcomers (the caller stops them)."""
        with self._lock:
            new = sorted(l for l, (e, _) in self._joining.items() if e is event)
            for launch in new:
                del self._joining[launch]
            self._prepared.pop(id(event), None)
            event.superseded = True
        if self.job is not None:
            self.job.note(f"the grow onto launch ranks {new} was given up: {why}")
        return new

    def grow(self, event: Event) -> Event:
        """Send an announced grow (:meth:`announce_grow`) once its newcomers are ready: the running job moves onto
        the larger cluster (the one it runs on now, ranks ``0..n-1`` in the same order, plus new ranks) and the
        new Program at the next step boundary.  The running workers leave their world there, every worker joins
        the larger one (rendezvous on the host of the new rank 0), and one fused BSR moves every parameter and Adam
        moment to the new layout: the newcomers get their shards from the running ranks, whose numbering stays the
        same.  Refused when the job reconfigured after a failure since the grow was announced."""
        self._acquire_quiet("grow")
        try:
            prepared = self._prepared.pop(id(event), None)
            joining = {l: reconf for l, (e, reconf) in self._joining.items() if e is event}
            if event.superseded or prepared is None or set(joining.values()) != {self.versions.world}:
                raise SwitchError("the job reconfigured after a failure while the newcomers started: grow it again "
                                  "onto job.cluster plus new ranks")
            numbering, plan, whole, grow = prepared
            dead = sorted(l for l in self.current.to_launch.values() if l in self._dead)
            if dead:
                raise SwitchError(f"launch ranks {dead} of the job failed and are not replanned yet; grow once the "
                                  "job recovered (Job.events shows when)")
            for launch in joining:
                del self._joining[launch]
            event.step = self._next_step()
            ident = self._open_switch(event, numbering)
        finally:
            self._lock.release()
        # each its parts by its rank in the grown Program (the running ranks keep theirs), or the whole packed before
        self._send_program({"type": "switch", "id": ident, "grow": grow}, numbering.program, plan, self.alive,
                           version=ident, rank_of=numbering.of_launch, whole=whole)
        return event

    def record_event(self, key: tuple[str, int], event: Event) -> None:
        """Record a reconfiguration planned elsewhere (a length switch, :mod:`.mixed`): it is ``done`` once every
        worker reported ``switched`` with ``what, id = key``."""
        with self._lock:
            self._open[key] = event
            self.events.append(event)
            got = self._switched.get(key)
        if got:
            for rank, msg in list(got.items()):
                self._on_switched(rank, msg)

    def _check_switchable(self, program: "Program", cur: Numbering) -> None:
        if program.model != cur.program.model:
            raise SwitchError(f"the new program trains {program.model!r}, the job {cur.program.model!r}: a switch "
                              "keeps the model")
        outside = sorted(set(program.ranks) - set(cur.to_launch))
        if outside:
            raise SwitchError(f"the new program uses ranks {outside} that the job does not run (its ranks now: "
                              f"{sorted(cur.to_launch)}); specialize it on job.cluster")
        dead = sorted(r for r in program.ranks if cur.to_launch[r] in self._dead)
        if dead:
            raise SwitchError(f"the new program uses ranks {dead}, which failed")
        if program.bindings.get("B") != cur.program.bindings.get("B"):
            raise SwitchError(f"the new program's global batch is {program.bindings.get('B')}, the job's "
                              f"{cur.program.bindings.get('B')}: a switch keeps the data of every step")

    def _next_step(self) -> int:
        job = self.job
        return (job.metrics.last_step() + 1) if job is not None else 0

    # ---- the failure policy ---------------------------------------------------------------------------------
    def on_failure(self, job: "Job", failure: Failure) -> Reaction:
        lost = {int(r) for r in failure.ranks}
        with self._lock:
            starting = {id(e): e for r, (e, _) in self._joining.items() if r in lost}
            only_newcomers = bool(starting) and lost <= set(self._joining)
        if only_newcomers:  # in no world yet: the running job is untouched, only their grow is off
            for event in starting.values():
                job.stop_ranks(self.give_up_grow(event, f"newcomer(s) {sorted(lost)} failed while starting: "
                                                        f"{failure.message}"))
            return Reaction.CONTINUE
        if not self.elastic or failure.kind == "error":
            return Reaction.STOP  # a worker raised: a bug or a bad input, not a lost device
        if failure.kind == "hung":
            job.stop_ranks(sorted(lost))  # a frozen worker is as good as dead: make it so, then go on without it
        with self._lock:
            after_end = lost <= self._trained
        if after_end:  # every step is done (the last one committed everywhere): nothing to recover, the others end
            self._note_after_end(lost, f" ({failure.message})")
            return Reaction.CONTINUE
        with self._lock:
            fresh = lost - self._dead
            if not fresh:
                return Reaction.CONTINUE
            self._dead |= fresh
            self._pending_dead |= fresh
            self._evidence = min(self._evidence or failure.time, failure.time)
            world = self.versions.world
        # every survivor learns it now: one waiting for the dead rank outside a collective stops waiting and halts
        self._send({"type": "halt", "after": world, "ranks": sorted(fresh)}, self.alive)
        with self._lock:
            if not self._busy:  # the loop clears it, under the lock, when it stops looking for failures
                self._thread = threading.Thread(target=self._reconfigure_loop, name="hspmd-reconfigure",
                                                daemon=True)
                self._busy = True
                self._thread.start()
        return Reaction.CONTINUE

    def _note_after_end(self, lost: Iterable[int], why: str = "") -> None:
        if self.job is not None:
            self.job.note(f"ranks {sorted(lost)} lost after the last step{why}: every step was done; the other "
                           "ranks finish without them")

    def _on_trained(self, rank: int, msg: dict[str, Any]) -> None:
        with self._lock:
            self._trained.add(rank)

    def _on_halted(self, rank: int, msg: dict[str, Any]) -> None:
        with self._lock:
            self._halted[rank] = {**msg, "at": time.time()}
            if int(msg.get("after", -1)) != self.versions.world:
                return  # about a world already replaced
            if self._evidence is None:
                self._evidence = time.time()
            unexplained = self.elastic and not self._busy and not self._pending_dead
        if unexplained:
            threading.Thread(target=self._answer_halt, args=(rank, msg, self.versions.world), name="hspmd-halt",
                             daemon=True).start()

    def _answer_halt(self, rank: int, msg: dict[str, Any], reconf_id: int) -> None:
        """A worker halted and no worker is known dead: wait as long as the launcher needs to notice a silent
        one (its heartbeats), then end the job with the worker's own reason rather than leave it waiting."""
        job = self.job
        grace = (job.spec.silent_s if job is not None else 10.0) + 1.0
        end = time.monotonic() + grace
        # a silent rank under investigation (its stack asked for, then stopped) is a failure about to be reported:
        # its peers' connections to it may have failed first (its host died while the transport's link to it, a
        # Slurm step's srun, still stands)
        cap = end + self.halt_timeout_s
        while True:
            with self._lock:
                if self._busy or self._pending_dead or self.versions.world != reconf_id:
                    return  # a failure explains it: the recovery answers
                now = time.monotonic()
                waiting = now < end or (now < cap and job is not None and _investigating(job, self._dead))
            if job is not None and job.ended:
                return
            if not waiting:
                break
            time.sleep(0.05)
        self._give_up(HSPMDError(f"rank {rank} stopped on an error it took for a peer's failure, but no worker died "
                                 f"within {grace:.0f} s: {msg.get('error')}"), rank=rank)

    def _on_switched(self, rank: int, msg: dict[str, Any]) -> None:
        key = (str(msg.get("what")), int(msg.get("id", 0)))
        with self._lock:
            got = self._switched.setdefault(key, {})
            got[rank] = msg
            event = self._open.get(key)
            if event is None:
                return
            expected = set(event.ranks)
            if expected <= set(got) or (self.alive and set(self.alive) <= set(got)):
                self._finish(key, event, got)

    def _finish(self, key: tuple[str, int], event: Event, got: dict[int, dict[str, Any]]) -> None:
        event.seconds["switch"] = max(float(m.get("seconds", 0.0)) + float(m.get("rejoin_s", 0.0))
                                      for m in got.values())
        event.seconds["total"] = sum(event.seconds.get(k, 0.0)
                                     for k in ("detect", "plan", "verify", "specialize", "switch"))
        event.step = min(int(m.get("step", event.step)) for m in got.values())
        if event.source == "checkpoint":
            event.seconds["load"] = max(float(m.get("load_s", 0.0)) for m in got.values())
            event.bytes["read"] = sum(int(m.get("bytes_read", 0)) for m in got.values())
        event.done = True
        del self._open[key]
        self.versions.applied(event.version, event.step)
        if self.job is not None:
            self.job.note(f"reconfigured ({event.reason}): {event}")
            if event.reason == "failure" and self.elastic:
                policy = self.grow_back
                if policy is None and self.grow_back_default and getattr(self.job.transport, "grows_back", False):
                    policy = GrowBack()
                if policy is not None:
                    policy.watch(self.job, self.launched)

    def _on_metric(self, rank: int, msg: dict[str, Any]) -> None:
        with self._lock:
            self.versions.prune(int(msg.get("step", -1)))
            warm, self._warmed = not self._warmed and (self.elastic or self.straggler is not None), True
        if warm:  # once the job trains (not while its workers start): the first replan finds its solvers loaded
            threading.Thread(target=_warm_planners, name="hspmd-warm-planners", daemon=True).start()
        watch = self.straggler
        extra = msg.get("extra") or {}
        compute = extra.get("compute_s")
        if watch is None or compute is None:
            return
        step = int(msg.get("step", -1))
        with self._lock:
            if self._busy or any(k[0] != "length" for k in self._open):
                return
            cur = self.current  # the ranks that compute in the running Program
            if self.mixed:
                measured = self._measured_share(rank, float(compute), step, cur)
                if measured is None:
                    return
                watch, compute, working = measured
            else:
                working = [cur.to_launch[r] for r in cur.program.ranks if cur.to_launch[r] not in self._dead]
            found = watch.add(rank, float(compute), step=step, ranks=working)
        if found is not None:
            threading.Thread(target=self._straggler, args=found, name="hspmd-straggler", daemon=True).start()

    def _measured_share(self, rank: int, compute: float, step: int, cur: Numbering
                        ) -> tuple[StragglerWatch, float, list[int]] | None:
        """A mixed-length step's compute seconds of launch rank ``rank`` as a multiple of what the dispatch
        estimated for it (each step gives each pipeline other sequences), the candidate's own watch (its stages'
        estimates err differently) and the ranks that step waits for; ``None`` for a step not dispatched under
        the current pricing (dispatched ahead before a repricing, or in a world since replaced)."""
        rec = self.length_planner.record(step)
        if rec is None or rec.get("pricing") != self.length_planner.pricing:
            return None
        estimates = rec.get("rank_seconds") or {}
        mine = estimates.get(cur.of_launch.get(rank, -1), 0.0)
        if mine <= 0:
            return None
        base = self.straggler
        watch = self._watches.setdefault(int(rec["choice"]),
                                         StragglerWatch(base.margin, base.steps, base.warmup))  # type: ignore[union-attr]
        working = [cur.to_launch[r] for r, t in estimates.items() if t > 0 and r in cur.to_launch
                   and cur.to_launch[r] not in self._dead]
        return watch, compute / mine, working

    # ---- reconfiguring after failures -----------------------------------------------------------------------
    def _reconfigure_loop(self) -> None:
        try:
            while True:
                time.sleep(self.debounce_s)  # a host's other ranks are reported within moments: plan once for all
                with self._lock:
                    if not self._pending_dead:
                        self._busy = False
                        return
                    self._pending_dead.clear()
                try:
                    self._reconfigure()
                except Exception as e:  # noqa: BLE001 - the job must end with the reason, not hang
                    self._give_up(e)
                    return
        finally:
            with self._lock:
                if not self._pending_dead:
                    self._busy = False

    def _wait_halted(self, survivors: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Every survivor's ``halted`` report sent since it applied the latest reconfiguration (a survivor that
        does not halt within ``halt_timeout_s`` fails the recovery, naming it)."""
        end = time.monotonic() + self.halt_timeout_s
        while True:
            with self._lock:
                got = {r: m for r, m in self._halted.items()
                       if r in survivors and int(m.get("after", -1)) == self.versions.world}
                if set(survivors) - self._dead <= set(got):
                    return {r: got[r] for r in survivors if r not in self._dead}
                if self._pending_dead:
                    return {}
                if set(survivors) - self._dead <= self._trained:  # they all ran every step: the loss came after
                    self._after_end = True                         # the last commit, nothing is left to recover
                    return {}
            if time.monotonic() > end:
                missing = sorted(set(survivors) - set(got) - self._dead)
                raise HSPMDError(f"ranks {missing} did not halt within {self.halt_timeout_s:.0f} s after the failure "
                                 f"of ranks {sorted(self._dead)}")
            time.sleep(0.01)

    def _reconfigure(self) -> None:
        # lazy: planner, only an elastic/straggler/grow replan needs it
        from ...planner.elastic import renumber, replan_elastic, survivor_cluster

        t_start = time.time()
        with self._lock:
            evidence = self._evidence or t_start
            base = self.current
            survivors = [l for l in base.to_launch.values() if l not in self._dead]
        halted = self._wait_halted(survivors)
        if self._after_end:
            self._note_after_end(self._dead)
            return
        if not halted:
            return  # more ranks failed meanwhile: the loop plans again for all of them
        with self._lock:
            self._evidence = None  # this failure's evidence is used up: the next failure's detection starts anew
        # newcomers whose grow did not complete hold nothing: the others' state decides, and they get their shards
        joining = {r for r, m in halted.items() if m.get("empty")}
        halted = {r: m for r, m in halted.items() if r not in joining}
        if not halted:
            raise HSPMDError(f"only newcomers that had not joined yet survived (launch ranks {sorted(joining)}): "
                             "they hold no state; resume from a checkpoint")
        sources = {m.get("source") for m in halted.values()}
        steps = {int(m.get("step", -1)) for m in halted.values()}
        held = {tuple(int(x) for x in m.get("held", (0, 0))) for m in halted.values()}
        before = common_previous(halted)
        if sources == {"live", "previous"} and before is not None:
            # some ranks were inside the first commit after a switch (a rank with no state there gets there at
            # once), none completed it: everyone still holds the state from before the switch; recover from it
            sources, held = {"previous"}, {before}  # (their steps agree: nobody is told to finish one)
        last = max(steps)
        # the failure hit a step's commit: some ranks completed it, the others hold its synchronised gradients
        finish = sorted(r for r, m in halted.items() if int(m.get("step", -1)) == last - 1
                        and m.get("finish") is not None and int(m["finish"]) == last)
        if len(steps) > 1 and {int(halted[r]["step"]) for r in set(halted) - set(finish)} == {last}:
            steps, sources = {last}, {"live"}
        offer: dict[int, str] = {}
        if (len(sources) != 1 or len(held) != 1) and len(steps) == 1:
            # around a grow, the running ranks and the newcomers offer different versions: one that every running
            # rank offers, whose ranks the others are not among (they take part holding nothing)
            with self._lock:
                found = self.versions.for_all(halted)
            if found is not None:
                version, offer = found
                sources, held = set(offer.values()) - {"nothing"}, {version}
        if len(sources) != 1 and not offer or len(steps) != 1 or len(held) != 1:
            raise HSPMDError(f"the survivors disagree on their state after the failure (steps {sorted(steps)}, "
                             f"sources {sorted(sources)}, plan versions {sorted(held)}); resume from a checkpoint")
        finish = finish if last in steps and finish and any(int(m["step"]) == last for m in halted.values()) else []
        version = held.pop()
        offer = {**{r: next(iter(sources)) for r in halted}, **offer, **{r: "nothing" for r in joining}}
        empty = {r for r, kind in offer.items() if kind == "nothing"}
        with self._lock:
            src = self.versions.get(version)
        if src is None:
            raise HSPMDError(f"the survivors hold the state of plan version {version}, which the launcher no longer "
                             "has")
        replan = src
        if empty - set(src.to_launch.values()):  # the state is from before the grow those ranks came with:
            src, replan = with_newcomers(src, base), base  # replan the grown one, they hold nothing
        dead_src = sorted(r for r, l in src.to_launch.items() if l in self._dead)
        model = src.program.model
        strategy = strategy_of(replan.program)
        t0 = time.perf_counter()
        # a single survivor runs a single pipeline (the planner's default keeps two replicas when the running
        # strategy had them, which one device cannot hold)
        alone = 1 if src.cluster.num_ranks - len(dead_src) == 1 else None
        new_strategy = replan_elastic(model, src.cluster, strategy, dead_src, seq_len=self.seq_len,
                                      global_batch=self._replan_batch(src.cluster, dead_src), cost=self.cost,
                                      min_pipelines=alone)
        t1 = time.perf_counter()
        cluster, mapping = survivor_cluster(src.cluster, dead_src)
        program = specialize(model, plan_from_strategy(model, renumber(new_strategy, mapping), cluster), cluster,
                             bindings=None if self.mixed else dict(src.program.bindings))  # mixed: B per step
        t2 = time.perf_counter()
        inverse = {new: old for old, new in mapping.items()}
        checkpoint = None
        try:
            plan = plan_program_switch(src.program, program, src.cluster, dst_to_src=inverse, failed=dead_src,
                                       empty=[r for r, l in src.to_launch.items() if l in empty])
            t3 = t_verified = time.perf_counter()
        except LostStateError as lost:  # no survivor holds it: the survivors read the new plan's shards instead
            t3, plan = time.perf_counter(), None
            checkpoint = self._checkpoint_for(lost, max(steps) + 1)
            t_verified = time.perf_counter()
        launch_of_new = {new: src.to_launch[old] for old, new in mapping.items()}
        candidates, choice = ([program], 0) if not self.mixed else \
            self._replan_candidates(version, program, dead_src, mapping, cluster)
        leader = launch_of_new[0]
        addr, port = self._rendezvous(leader)
        with self._lock:
            # a failure came mid-reconfiguration, or before switches the user requested were applied: the new plan
            # replaces them (the workers skip the switches up to ``switch_floor``)
            for key in list(self._open):
                if key[0] in ("reconfigure", "switch"):
                    self._open.pop(key).superseded = True
            ranks = {l: n for n, l in launch_of_new.items()}
            resume = steps.pop() + 1 if checkpoint is None else checkpoint.step
            src_ranks = {l: r for r, l in src.to_launch.items() if l in ranks}
            # the lost ranks of the state the survivors hold and of the newest plan (a newcomer that died in the first
            # step after a grow is only in the latter: the survivors went back to the state from before it)
            lost = sorted(l for l in set(src.to_launch.values()) | set(base.to_launch.values()) if l in self._dead)
            event = Event(resume, "failure", lost,
                          strategy_of(program), {"detect": max(0.0, t_start - evidence), "plan": t1 - t0,
                                                 "specialize": t2 - t1 + (t3 - t2)},
                          _bytes(plan, src.cluster) if plan is not None else {"intra": 0, "inter": 0},
                          ranks, program=program, source="memory" if checkpoint is None else "checkpoint",
                          checkpoint_step=None if checkpoint is None else checkpoint.step)
            if checkpoint is not None:
                event.seconds["verify"] = t_verified - t3
                finish = []  # the running state is given up: nothing from before this can be replanned
            # the new world's version (mixed: one per candidate, each replanned on the survivors)
            ident, floor, event.version = self.versions.open_reconfiguration(
                Numbering(program, cluster, launch_of_new), candidates if self.mixed else None)
            self._open[("reconfigure", ident)] = event
            self.events.append(event)
            if self.mixed:
                self._switched = {k: v for k, v in self._switched.items() if k[0] != "length"}
            if self.straggler is not None:
                self.straggler.reset()
            self._watches.clear()
            self._slow.clear()  # the dispatch restarts priced for the survivors as launched
        msg = {"type": "reconfigure", "id": ident, "world": len(launch_of_new), "ranks": ranks,
               "src_ranks": src_ranks, "master_addr": addr, "master_port": port, "resume_step": resume,
               "source": "memory" if checkpoint is None else "checkpoint", "finish": finish,
               "offer": {str(l): kind for l, kind in offer.items()},
               "checkpoint": None if checkpoint is None else resume_payload(checkpoint),
               "switch_floor": floor, "retake_checkpoint": self._checkpoint_missed(resume)}
        # each survivor its parts: of the new Program by its new rank, of the plan by its rank in the numbering of
        # the state it switches from; a mixed-length job's candidates follow the whole
        self._send_program(msg, program, plan, sorted(ranks), version=ident, rank_of=ranks, plan_rank_of=src_ranks,
                           after={"candidates": pack_payload(candidates), "choice": choice} if self.mixed else None)
        if self.mixed:  # dispatch again from the step the survivors go on from, among the new candidates
            self.length_planner.restart(candidates, cluster, start=resume, current=choice, generation=ident)
        if self.job is not None:
            how = "switching" if checkpoint is None else f"reloading the checkpoint of step {resume} under"
            self.job.note(f"ranks {event.failed_ranks} lost: {how} {new_strategy}")

    def _replan_batch(self, cluster: "Cluster", dead: Sequence[int]) -> int:
        """The global batch a replan after a failure keeps: the job's; for mixed-length data, whose steps the
        dispatch cuts into micro-batches itself, at least one sample per survivor (any data-parallel degree)."""
        return max(self.global_batch, cluster.num_ranks - len(dead)) if self.mixed else self.global_batch

    def _replan_candidates(self, version: tuple[int, int], held: "Program", dead: Sequence[int],
                           mapping: Mapping[int, int], cluster: "Cluster") -> tuple[list["Program"], int]:
        """Every candidate of a mixed-length job's world ``version[0]`` replanned on the survivors (``held``: the
        one the survivors hold, already replanned) the way :func:`~hspmd_sdk.planner.elastic.replan_elastic`
        replans one; a candidate with no plan on the survivors is dropped.  Returns the candidates and the index
        of ``held`` among them."""
        # lazy: planner, only an elastic/straggler/grow replan needs it
        from ...planner.elastic import renumber, replan_elastic

        out: list["Program"] = []
        choice = 0
        for j in range(self.versions.candidate_count(version[0])):
            if j == version[1]:
                choice = len(out)
                out.append(held)
                continue
            src = self.versions.get((version[0], j))
            if src is None:
                continue
            model = src.program.model
            try:
                strategy = replan_elastic(model, src.cluster, strategy_of(src.program), list(dead),
                                          seq_len=self.seq_len, global_batch=self._replan_batch(src.cluster, dead), cost=self.cost)
                out.append(specialize(model, plan_from_strategy(model, renumber(strategy, dict(mapping)), cluster),
                                      cluster))  # the dispatch gives each step's micro-batches
            except HSPMDError:
                continue  # no plan of this candidate fits the survivors: the others do its steps
        return out, choice

    def _checkpoint_missed(self, resume: int) -> bool:
        """Whether the newest checkpoint the schedule wanted by step ``resume`` (the steps the survivors go on
        from) is not committed: the failure interrupted its write.  The survivors then save after their next step
        instead of waiting ``checkpoint_every`` steps more (decided here, once: every survivor gets the same)."""
        if self.checkpoint_dir is None or not self.checkpoint_every:
            return False

        due = resume // self.checkpoint_every * self.checkpoint_every
        return due > 0 and due not in {s for s, _ in list_checkpoints(self.checkpoint_dir)}

    def _checkpoint_for(self, lost: Any, before: int) -> Any:
        """The newest complete (verified) checkpoint of this job at a step up to ``before`` to reload the state
        ``lost`` (a :class:`~hspmd_sdk.core.reconfigure.LostStateError`) from; without one, the error naming the
        tensors and ranks."""

        if self.checkpoint_dir is None:
            raise lost
        job_id = self.job.spec.job_id if self.job is not None else None
        mine = [(s, p) for s, p in list_checkpoints(self.checkpoint_dir) if s <= before]
        for _, path in reversed(mine):
            try:
                ck = load_checkpoint(path)  # verified, checksums included: nothing is reloaded silently wrong
            except CheckpointError:
                continue  # damaged: an older one may do
            if ck.manifest.job_id == job_id or (self.resumed_from is not None
                                                and ck.path.resolve() == Path(self.resumed_from).resolve()):
                return ck
        raise HSPMDError(f"{lost.what}, and no checkpoint of this job in {self.checkpoint_dir} was complete yet (the "
                         f"failure came at step {before}, before the first checkpoint was committed): nothing to "
                         "reload it from")

    def _rendezvous(self, launch_rank: int) -> tuple[str, int]:
        """Where the new world meets: on the host of its new rank 0, at a port free there."""

        job = self.job
        host = job.spec.hosts[launch_rank] if job is not None else "localhost"
        transport = getattr(job, "transport", None)
        if transport is None or is_local_host(host):
            return LocalTransport().rendezvous(host)
        return transport.rendezvous(host, fresh=True)

    def _give_up(self, error: BaseException, rank: int | None = None) -> None:
        """End the job with the reason the reconfiguration failed (lost state, no plan fits, ...); ``rank``: the
        worker whose halt could not be answered (no worker died)."""
        job = self.job
        if job is None:
            return
        lost = sorted(self._dead)
        if rank is not None:
            job.report_failure(Failure(rank, str(error), kind="error"))
            return
        job.report_failure(Failure(lost[0] if lost else 0, f"elastic recovery after the failure of ranks {lost} failed: "
                                                  f"{error}", kind="error"))

    # ---- stragglers -----------------------------------------------------------------------------------------
    def _straggler(self, launch_rank: int, factor: float) -> None:
        from ...planner.elastic import replan_straggler  # lazy: planner, only an elastic/straggler/grow replan needs it

        if self.mixed:
            self._reprice(launch_rank, factor)
            return
        with self._lock:
            if self._busy or self._open:
                return
            cur = self.current
        rank = cur.of_launch.get(launch_rank)
        if rank is None:
            return
        model = cur.program.model
        t0 = time.perf_counter()
        strategy = replan_straggler(model, cur.cluster, strategy_of(cur.program), {rank: factor},
                                    seq_len=self.seq_len, global_batch=self.global_batch, cost=self.cost)
        t1 = time.perf_counter()
        program = specialize(model, plan_from_strategy(model, strategy, cur.cluster), cur.cluster,
                             bindings=dict(cur.program.bindings))
        t2 = time.perf_counter()
        try:
            event = self.switch(program, reason="straggler")
        except SwitchError:
            return
        event.seconds.update({"plan": t1 - t0 + event.seconds["plan"], "specialize": t2 - t1})
        event.failed_ranks = []
        if self.job is not None:
            self.job.note(f"rank {launch_rank} is {factor:.2f}x slower than under its plan: switching to {strategy}")

    def _reprice(self, launch_rank: int, factor: float) -> None:
        """A straggler in a mixed-length job: its candidates stay, and the dispatch prices them from the next
        step with the rank ``factor`` times slower (compounding an earlier factor), so each step's sequences go
        to the pipelines, and the step to the candidate, by the measured speeds.  Nothing moves between workers:
        the event is done at once.  A recovery after a failure prices its survivors afresh."""
        with self._lock:
            if self._busy or any(k[0] != "length" for k in self._open):
                return
            cur = self.current
            if launch_rank not in cur.of_launch:
                return
            self._slow[launch_rank] = self._slow.get(launch_rank, 1.0) * factor
            slow = {cur.of_launch[l]: k for l, k in self._slow.items() if l in cur.of_launch}
            t0 = time.perf_counter()
            step = self.length_planner.reprice(slow)
            event = Event(step, "straggler", [], strategy_of(cur.program), {"detect": 0.0,
                          "plan": time.perf_counter() - t0, "specialize": 0.0, "switch": 0.0},
                          {"intra": 0, "inter": 0}, dict(cur.of_launch), done=True, program=cur.program)
            event.seconds["total"] = event.seconds["plan"]
            self.events.append(event)
            self._watches.clear()
        if self.job is not None:
            self.job.note(f"rank {launch_rank} is {factor:.2f}x slower than the dispatch estimated: from step {step} "
                           f"each step's sequences are shared by the measured speeds (rank {launch_rank} priced "
                           f"{self._slow[launch_rank]:.2f}x slower)")

    # ---- sending --------------------------------------------------------------------------------------------
    @property
    def _each_part(self) -> bool:
        """Whether each worker gets its own parts of a new Program and of the switch plan to it (SPEC §16) rather
        than the whole: a run whose workers hold their parts, unless it trains on mixed-length data."""
        return self.parts and not self.mixed

    def _send_program(self, msg: Mapping[str, Any], program: "Program", plan: Any, to: Sequence[int], *,
                      version: int, rank_of: Mapping[int, int], plan_rank_of: Mapping[int, int] | None = None,
                      whole: Mapping[str, Any] | None = None, after: Mapping[str, Any] | None = None) -> None:
        """Send the launch ranks ``to`` ``msg`` with ``program`` and the switch ``plan`` to it (``None``: a reload
        from a checkpoint) in :func:`~..protocol.program_fields`, then ``after``'s fields.  When
        :attr:`_each_part`, each worker its own part of each, numbered ``version`` (``rank_of``: launch rank -> its
        rank in ``program``; ``plan_rank_of``: -> its rank in the plan's numbering, default ``rank_of``), what the
        plan's parts share written once for all (:class:`~hspmd_sdk.core.program_part.PlanParts`); otherwise the
        whole of both to all (``whole``: their fields, if packed before)."""
        tail = after or {}
        if not self._each_part:
            self._send({**msg, **(program_fields(program, plan) if whole is None else whole), **tail}, to)
            return
        parts = None if plan is None else PlanParts(plan)
        of_plan = rank_of if plan_rank_of is None else plan_rank_of
        self._send_each(lambda l: {**msg, **program_fields(program, plan, rank_of[l], of_plan[l], version=version,
                                                           plan_parts=parts), **tail}, to)

    def _send(self, msg: dict[str, Any], ranks: Sequence[int]) -> None:
        if self.job is not None:
            self.job.send_control(msg, [r for r in ranks if r not in self._dead])

    def _send_each(self, msg_of: Callable[[int], dict[str, Any]], ranks: Sequence[int]) -> None:
        """:meth:`_send` of a message of each rank's own (``msg_of(launch rank)``)."""
        if self.job is not None:
            for r in ranks:
                if r not in self._dead:
                    self.job.send_control(msg_of(r), [r])


def _warm_planners() -> None:
    """Import what a replan after a failure or a straggler runs (the planners, PuLP, Pyomo and its HiGHS
    interface: about 1 s the first time, which the first recovery would otherwise spend).  Never raises."""
    import importlib

    for name in _REPLAN_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a replan imports it again and reports what is missing
            pass


#: What a replan imports (the same modules as the replan's own imports in this file; the solvers the planners use).
_REPLAN_MODULES = ("hspmd_sdk.core.reconfigure", "hspmd_sdk.core.specialize", "hspmd_sdk.core.strategy_plan",
                   "hspmd_sdk.planner.elastic", "hspmd_sdk.planner.hetero", "hspmd_sdk.planner.simulator", "pulp",
                   "pyomo.environ", "pyomo.contrib.appsi")





def _investigating(job: "Job", dead: set[int]) -> bool:
    """Whether the job's watchdog is reporting a silent rank: ``suspect``, and not yet among the ``dead`` (its
    failure is still on its way: its stack asked for, then the rank stopped, then the policy told)."""
    ranks, lock = getattr(job, "_ranks", None), getattr(job, "_lock", None)
    if ranks is None or lock is None:  # a job without a watchdog (a stand-in): nobody is being reported
        return False
    with lock:
        return any(rec.suspect and r not in dead for r, rec in ranks.items())


def _bytes(plan: Any, cluster: Any) -> dict[str, int]:
    vol = plan.volume()
    return {"intra": int(sum(v.get("intra", 0) for v in vol.values())),
            "inter": int(sum(v.get("inter", 0) for v in vol.values()))}


Waiter = Callable[[], bool]
