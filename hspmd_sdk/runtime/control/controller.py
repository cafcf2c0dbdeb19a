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

The controller is one state machine (:class:`~.state.ControlState`) with policies over it: the user switch and the
grow here, the elastic recovery in :mod:`.recovery` (:class:`~.recovery.Recovery`), the straggler watch in
:mod:`.stragglers` (:class:`~.stragglers.StragglerPolicy`) and a mixed-length job's switch to other candidates
(``Job.switch([...])``) in :mod:`.candidates` (:class:`~.candidates.CandidateSwitch`), each owned by the controller
and reading its state through a small interface (:class:`~.recovery.RecoveryHost`,
:class:`~.stragglers.StragglerHost`, :class:`~.candidates.CandidateHost`).

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
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ...errors import HSPMDError, SwitchError
from .faults import Failure, Reaction
from ...core.program_part import PlanParts
from ...core.reconfigure import plan_program_switch
from ...core.strategy_plan import strategy_of
from ..protocol import program_fields
from ..transports.transport import LocalTransport, is_local_host
from .candidates import CandidateSwitch
from .growback import GrowBack
from .recovery import Recovery
from .state import ControlState, Event, Reason, switch_bytes
from .stragglers import StragglerPolicy, StragglerWatch
from .versions import Numbering, Version, Versions

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.specialize import Program
    from ...core.strategy import Strategy
    from ...core.switch import SwitchPlan
    from ...planner.cost import CostModel
    from ...planner.mixed import Dispatcher
    from .job import Job

__all__ = ["Event", "TrainingController", "SwitchError", "StragglerWatch"]



class TrainingController:
    """See the module docstring.  Made by :func:`~hspmd_sdk.runtime.control.train.launch`."""

    def __init__(self, program: "Program", cluster: "Cluster", *, global_batch: int, seq_len: int,
                 elastic: bool = False, straggler: StragglerWatch | None = None, cost: "CostModel | None" = None,
                 checkpoint_dir: str | None = None, resumed_from: str | None = None,
                 checkpoint_every: int | None = None, debounce_s: float = 0.3, halt_timeout_s: float = 60.0,
                 grow_back: GrowBack | None = None, grow_back_default: bool = False) -> None:
        #: every version the workers may still hold, the newest requested as its ``current`` (:mod:`.versions`)
        self.versions = Versions(Numbering(program, cluster, {r: r for r in cluster.ranks}))
        self.global_batch, self.seq_len = int(global_batch), int(seq_len)
        self.elastic, self.cost = elastic, cost
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
        self.state = ControlState()  #: what the policies share, under ``state.lock``
        self.recovery = Recovery(self)  #: elastic recovery after failures (:mod:`.recovery`)
        self.stragglers = StragglerPolicy(self, straggler)  #: the straggler watch (:mod:`.stragglers`)
        self._warmed = False  # the planners imported ahead of the first replan (:func:`_warm_planners`)
        self.mixed = False  # a mixed-length job (:mod:`.mixed`): its plan changes per step, by length
        self.length_planner: Any = None  # its dispatch (:class:`~.mixed.LengthPlanner`)
        #: a mixed-length job's switches to other candidates (``Job.switch([...])``, :mod:`.candidates`)
        self.candidate_switch = CandidateSwitch(self)
        #: newcomers of an announced grow that are still starting: launch rank -> (its event, the world it grows)
        self._joining: dict[int, tuple[Event, int]] = {}
        #: an announced grow's switch, ready to send: id(event) -> (the grown numbering, its plan, its payload
        #: when the workers hold the whole Program, rendezvous)
        self._prepared: dict[int, tuple[Numbering, Any, dict[str, Any] | None, dict[str, Any]]] = {}
        #: a mixed-length job's announced grow: id(event) -> (its candidates on the grown cluster, their dispatcher)
        self._grown_candidates: dict[int, tuple[list["Program"], Any]] = {}

    @property
    def straggler(self) -> StragglerWatch | None:
        """The straggler watch (``straggler=``), or ``None``."""
        return self.stragglers.watch

    # the state's lock, the ranks lost and not yet planned around, and the mixed-length dispatch's pricing, by the
    # names tests read them
    @property
    def _lock(self) -> threading.RLock:
        return self.state.lock

    @property
    def _pending_dead(self) -> set[int]:
        return self.state.pending_dead

    @property
    def _slow(self) -> dict[int, float]:
        return self.stragglers.slow

    def use_candidates(self, programs: Sequence["Program"], first: int, planner: Any) -> None:
        """Make this the controller of a mixed-length job choosing per step among ``programs`` (``first`` runs
        first), dispatched by ``planner``.  Its versions are ``(reconfiguration id, candidate)``: a worker holds
        the state of the candidate it last switched to, and an elastic recovery replans every candidate on the
        survivors (:meth:`.recovery.Recovery.replan_candidates`)."""
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
        with self.state.lock:
            never = [e for e in self.state.open.values() if not e.done]
            self.state.open.clear()
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
        return sorted(set(self.current.to_launch.values()) - self.state.dead)

    # ---- Job.switch -----------------------------------------------------------------------------------------
    def switch(self, program: "Program", *, reason: Reason = "user") -> Event:
        """Move the running job to ``program`` at the next step boundary (``Job.switch``)."""

        if self.mixed:
            raise SwitchError("this job trains on mixed-length data: it chooses its plan per step among its "
                              "candidate programs (Job.events shows the length switches); to switch it, pass a "
                              "list of candidates: job.switch([program_or_strategy, ...])")
        self.acquire_quiet("switch")
        try:
            cur = self.current
            self._check_switchable(program, cur)
            t0 = time.perf_counter()
            plan = plan_program_switch(cur.program, program, cur.cluster)
            t_plan = time.perf_counter() - t0
            event = Event(self._next_step(), reason, [], strategy_of(program), {"detect": 0.0, "plan": t_plan,
                          "specialize": 0.0}, switch_bytes(plan, cur.cluster), dict(cur.of_launch), program=program)
            self.events.append(event)
            # planned from the newest version requested: the workers apply the switches in order
            ident = self._open_switch(event, Numbering(program, cur.cluster, dict(cur.to_launch)))
        finally:
            self.state.lock.release()
        # each its parts by its rank, which the new Program keeps, or the whole
        self.send_program({"type": "switch", "id": ident}, program, plan, self.alive, version=ident,
                          rank_of=cur.of_launch)
        return event

    def _open_switch(self, event: Event, numbering: Numbering) -> int:
        """Under the lock: a new switch id for ``event``, awaited until every worker switched, and ``numbering``
        the job's current version from now on; returns the id."""
        ident, event.version = self.versions.open_switch(numbering)
        self.state.open[("switch", ident)] = event
        self.stragglers.reset()
        return ident

    # ---- Job.switch([...]) of a mixed-length job (:mod:`.candidates`) -------------------------------------------
    def switch_candidates(self, candidates: Sequence["Program | Strategy"]) -> Event:
        """Move a mixed-length job to another candidate set (``Job.switch([...])``, SPEC §9): see
        :meth:`~.candidates.CandidateSwitch.switch`."""
        return self.candidate_switch.switch(candidates)

    def numbering_of(self, version: Version) -> Numbering | None:
        """The Program and numbering of ``version``: the versions' own, or a mixed-length job's candidate added
        by a switch of candidates (:class:`~.candidates.CandidateSets`)."""
        got = self.versions.get(version)
        return got if got is not None else self.candidate_switch.sets.get(version)

    def candidate_versions(self, version: Version) -> list[Version]:
        """A mixed-length job's versions of the candidate set ``version`` belongs to (a world's first set: its
        ``candidate_count`` candidates from 0; a set added by a switch of candidates)."""
        return self.candidate_switch.sets.members(version, self.versions.candidate_count(version[0]))

    def acquire_quiet(self, what: str, outer: threading.Lock | None = None) -> None:
        """Take the lock once no reconfiguration after a failure is under way (a switch or a grow follows it);
        ``outer``: a lock taken before it each time (released with it while waiting), held on return too."""
        st = self.state
        deadline = time.monotonic() + self.halt_timeout_s + 30.0
        while True:
            if outer is not None:
                outer.acquire()
            st.lock.acquire()
            if not st.busy and not any(k[0] == "reconfigure" for k in st.open):
                return
            st.lock.release()
            if outer is not None:
                outer.release()
            if self.job is not None and self.job.ended:
                raise SwitchError(f"job {self.job.job_id} ended while reconfiguring after a failure; there is "
                                  f"nothing to {what}")
            if time.monotonic() > deadline:
                raise SwitchError(f"the job is still reconfiguring after a failure; {what} again when it is done "
                                  "(Job.events shows when)")
            time.sleep(0.01)

    # ---- Job.grow -------------------------------------------------------------------------------------------
    def announce_grow(self, program: "Program | Sequence[Program]", cluster: "Cluster", joiners: Mapping[int, int],
                      dispatcher: "Dispatcher | None" = None) -> Event:
        """The event of a grow onto ``cluster`` and ``program`` whose newcomers are starting (``joiners``: rank of
        ``cluster`` -> launch rank; :mod:`.grow`).  It is in :attr:`events` at once, and the switch is prepared
        now (its BSR planned, its payload packed unless each worker gets its parts, the grown world's rendezvous
        chosen); :meth:`grow` sends it once
        every newcomer is ready, so the job trains on while they start.  A newcomer lost before then gives the grow
        up (:meth:`give_up_grow`): the running job is untouched.  A mixed-length job grows onto a candidate set
        (``program``: its Programs on ``cluster``, ``dispatcher``: theirs, :meth:`~.mixed.LengthPlanner.
        check_candidates`), chosen among per step from the grow on; its switch is planned when it is sent, to the
        candidate the grow's step is dispatched to (:meth:`~.candidates.CandidateSwitch.grow`).  Refuses another
        model, another global batch, and a cluster that is not the running one plus new ranks."""
        programs = list(program) if self.mixed else [program]
        if self.mixed and dispatcher is None:
            raise SwitchError("growing a mixed-length job takes its candidates' dispatcher (grow_job makes it)")
        with self.state.lock:
            cur, reconf = self.current, self.versions.world
            dead = sorted(l for l in cur.to_launch.values() if l in self.state.dead)
        if dead:
            raise SwitchError(f"launch ranks {dead} of the job failed and are not replanned yet; grow once the job "
                              "recovered (Job.events shows when)")
        for p in programs:
            if p.model != cur.program.model:
                raise SwitchError(f"the new program trains {p.model!r}, the job {cur.program.model!r}: "
                                  "growing keeps the model")
        if not self.mixed and program.bindings.get("B") != cur.program.bindings.get("B"):
            raise SwitchError(f"the new program's global batch is {program.bindings.get('B')}, the job's "
                              f"{cur.program.bindings.get('B')}: growing keeps the data of every step")
        n = cur.cluster.num_ranks
        to_launch = {**{r: cur.to_launch[r] for r in range(n)}, **{int(r): int(l) for r, l in joiners.items()}}
        if sorted(to_launch) != list(range(cluster.num_ranks)):
            raise SwitchError(f"the grown cluster has ranks 0..{cluster.num_ranks - 1}; the job runs "
                              f"0..{n - 1} and new workers are to start for {sorted(joiners)}")
        t0 = time.perf_counter()
        # cur's ranks keep their numbers; a mixed-length job's plan waits for the grow's step to be dispatched
        plan = None if self.mixed else plan_program_switch(cur.program, program, cluster)
        # packed now (each worker's parts are written when it is sent: they depend on the rank)
        whole = None if self._each_part or plan is None else program_fields(program, plan)
        launch_of = {l: r for r, l in to_launch.items()}
        event = Event(self._next_step(), "grow", [], strategy_of(programs[0]),
                      {"detect": 0.0, "plan": time.perf_counter() - t0, "specialize": 0.0},
                      switch_bytes(plan, cluster) if plan is not None else {"intra": 0, "inter": 0}, launch_of,
                      program=programs[0])
        addr, port = self.rendezvous(to_launch[0])
        grow = {"master_addr": addr, "master_port": port, "world": cluster.num_ranks,
                "ranks": {str(l): r for l, r in launch_of.items()}, "reconfigured": reconf}
        with self.state.lock:
            self.events.append(event)
            for launch in joiners.values():
                self._joining[int(launch)] = (event, reconf)
            self._prepared[id(event)] = (Numbering(programs[0], cluster, to_launch), plan, whole, grow)
            if self.mixed:
                self._grown_candidates[id(event)] = (programs, dispatcher)
        return event

    def give_up_grow(self, event: Event, why: str) -> list[int]:
        """Give an announced grow up before it started (a newcomer was lost, or the job changed meanwhile): its
        event is ``superseded``; returns the launch ranks of its newcomers (the caller stops them)."""
        with self.state.lock:
            new = sorted(l for l, (e, _) in self._joining.items() if e is event)
            for launch in new:
                del self._joining[launch]
            self._prepared.pop(id(event), None)
            self._grown_candidates.pop(id(event), None)
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
        same.  A mixed-length job grows at the first step not dispatched yet, onto its new candidates
        (:meth:`~.candidates.CandidateSwitch.grow`).  Refused when the job reconfigured after a failure since the
        grow was announced."""
        sending = self.length_planner.sending if self.mixed else None
        self.acquire_quiet("grow", outer=sending)
        try:
            prepared = self._prepared.pop(id(event), None)
            candidates = self._grown_candidates.pop(id(event), None)
            joining = {l: reconf for l, (e, reconf) in self._joining.items() if e is event}
            if event.superseded or prepared is None or set(joining.values()) != {self.versions.world}:
                raise SwitchError("the job reconfigured after a failure while the newcomers started: grow it again "
                                  "onto job.cluster plus new ranks")
            numbering, plan, whole, grow = prepared
            dead = sorted(l for l in self.current.to_launch.values() if l in self.state.dead)
            if dead:
                raise SwitchError(f"launch ranks {dead} of the job failed and are not replanned yet; grow once the "
                                  "job recovered (Job.events shows when)")
            if candidates is not None:  # sent by the dispatch of the grow's step (under both locks)
                self.candidate_switch.grow(event, *candidates, numbering, grow)
            for launch in joining:
                del self._joining[launch]
            if candidates is not None:
                return event
            event.step = self._next_step()
            ident = self._open_switch(event, numbering)
        finally:
            self.state.lock.release()
            if sending is not None:
                sending.release()
        # each its parts by its rank in the grown Program (the running ranks keep theirs), or the whole packed before
        self.send_program({"type": "switch", "id": ident, "grow": grow}, numbering.program, plan, self.alive,
                          version=ident, rank_of=numbering.of_launch, whole=whole)
        return event

    def record_event(self, key: tuple[str, int], event: Event, *, listed: bool = False) -> None:
        """Record a reconfiguration planned elsewhere (a length switch, :mod:`.mixed`): it is ``done`` once every
        worker reported ``switched`` with ``what, id = key`` (``listed``: the event is in :attr:`events` already,
        a grow's)."""
        with self.state.lock:
            self.state.open[key] = event
            if not listed:
                self.events.append(event)
            got = self.state.switched.get(key)
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
        dead = sorted(r for r in program.ranks if cur.to_launch[r] in self.state.dead)
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
        st = self.state
        lost = {int(r) for r in failure.ranks}
        with st.lock:
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
        with st.lock:
            after_end = lost <= st.trained
        if after_end:  # every step is done (the last one committed everywhere): nothing to recover, the others end
            self.recovery.note_after_end(lost, f" ({failure.message})")
            return Reaction.CONTINUE
        with st.lock:
            fresh = lost - st.dead
            if not fresh:
                return Reaction.CONTINUE
            st.dead |= fresh
            st.pending_dead |= fresh
            st.evidence = min(st.evidence or failure.time, failure.time)
            world = self.versions.world
        # every survivor learns it now: one waiting for the dead rank outside a collective stops waiting and halts
        self._send({"type": "halt", "after": world, "ranks": sorted(fresh)}, self.alive)
        self.recovery.start()
        return Reaction.CONTINUE

    def _on_trained(self, rank: int, msg: dict[str, Any]) -> None:
        with self.state.lock:
            self.state.trained.add(rank)

    def _on_halted(self, rank: int, msg: dict[str, Any]) -> None:
        st = self.state
        with st.lock:
            st.halted[rank] = {**msg, "at": time.time()}
            if int(msg.get("after", -1)) != self.versions.world:
                return  # about a world already replaced
            if st.evidence is None:
                st.evidence = time.time()
            unexplained = self.elastic and not st.busy and not st.pending_dead
        if unexplained:
            threading.Thread(target=self._answer_halt, args=(rank, msg, self.versions.world), name="hspmd-halt",
                             daemon=True).start()

    def _answer_halt(self, rank: int, msg: dict[str, Any], reconf_id: int) -> None:
        """A worker halted and no worker is known dead: wait as long as the launcher needs to notice a silent
        one (its heartbeats), then end the job with the worker's own reason rather than leave it waiting."""
        job, st = self.job, self.state
        grace = (job.spec.silent_s if job is not None else 10.0) + 1.0
        end = time.monotonic() + grace
        # a silent rank under investigation (its stack asked for, then stopped) is a failure about to be reported:
        # its peers' connections to it may have failed first (its host died while the transport's link to it, a
        # Slurm step's srun, still stands)
        cap = end + self.halt_timeout_s
        while True:
            with st.lock:
                if st.busy or st.pending_dead or self.versions.world != reconf_id:
                    return  # a failure explains it: the recovery answers
                now = time.monotonic()
                waiting = now < end or (now < cap and job is not None and _investigating(job, st.dead))
            if job is not None and job.ended:
                return
            if not waiting:
                break
            time.sleep(0.05)
        self.recovery.give_up(HSPMDError(f"rank {rank} stopped on an error it took for a peer's failure, but no "
                                         f"worker died within {grace:.0f} s: {msg.get('error')}"), rank=rank)

    def _on_switched(self, rank: int, msg: dict[str, Any]) -> None:
        key = (str(msg.get("what")), int(msg.get("id", 0)))
        st = self.state
        with st.lock:
            got = st.switched.setdefault(key, {})
            got[rank] = msg
            event = st.open.get(key)
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
        del self.state.open[key]
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
        with self.state.lock:
            self.versions.prune(int(msg.get("step", -1)))
            warm, self._warmed = not self._warmed and (self.elastic or self.straggler is not None), True
        if warm:  # once the job trains (not while its workers start): the first replan finds its solvers loaded
            threading.Thread(target=_warm_planners, name="hspmd-warm-planners", daemon=True).start()
        self.stragglers.on_metric(rank, msg)

    # ---- sending --------------------------------------------------------------------------------------------
    def rendezvous(self, launch_rank: int) -> tuple[str, int]:
        """Where the new world meets: on the host of its new rank 0, at a port free there."""

        job = self.job
        host = job.spec.hosts[launch_rank] if job is not None else "localhost"
        transport = getattr(job, "transport", None)
        if transport is None or is_local_host(host):
            return LocalTransport().rendezvous(host)
        return transport.rendezvous(host, fresh=True)

    @property
    def _each_part(self) -> bool:
        """Whether each worker gets its own parts of a new Program and of the switch plan to it (SPEC §16) rather
        than the whole: a run whose workers hold their parts, unless it trains on mixed-length data."""
        return self.parts and not self.mixed

    def send_program(self, msg: Mapping[str, Any], program: "Program", plan: "SwitchPlan | None",
                     to: Sequence[int], *, version: int, rank_of: Mapping[int, int],
                     plan_rank_of: Mapping[int, int] | None = None,
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
            self.job.send_control(msg, [r for r in ranks if r not in self.state.dead])

    def _send_each(self, msg_of: Callable[[int], dict[str, Any]], ranks: Sequence[int]) -> None:
        """:meth:`_send` of a message of each rank's own (``msg_of(launch rank)``)."""
        if self.job is not None:
            for r in ranks:
                if r not in self.state.dead:
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


#: What a replan imports (the same modules as the replans' own imports in :mod:`.recovery` and :mod:`.stragglers`;
#: the solvers the planners use).
_REPLAN_MODULES = ("hspmd_sdk.core.reconfigure", "hspmd_sdk.core.specialize", "hspmd_sdk.core.strategy_plan",
                   "hspmd_sdk.planner.elastic", "hspmd_sdk.planner.hetero", "hspmd_sdk.planner.simulator", "pulp",
                   "pyomo.environ", "pyomo.contrib.appsi")


def _investigating(job: "Job", dead: set[int]) -> bool:
    """Whether the job's watchdog is reporting a silent rank: ``suspect``, and not yet among the ``dead`` (its
    failure is still on its way: its stack asked for, then the rank stopped, then the policy told)."""
    suspects = getattr(job, "suspects", None)
    if suspects is None:  # a job without a watchdog (a stand-in): nobody is being reported
        return False
    return bool(suspects() - dead)
