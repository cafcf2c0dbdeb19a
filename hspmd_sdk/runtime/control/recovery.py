"""The elastic recovery of a training job's controller (``elastic=True``, paper §9 (b)).

When a worker died the controller (:mod:`.controller`, the job's :class:`~.faults.FailurePolicy`) starts
:meth:`Recovery.start`: after a short debounce (a host's other ranks are reported within moments) every survivor's
``halted`` report is awaited, and one recovery runs in steps:

* :meth:`Recovery.agree`: the state every survivor holds (its plan version, its step, what each offers);
* :meth:`Recovery.plan`: the running strategy replanned on the survivors (:func:`hspmd_sdk.planner.replan_elastic`);
* :meth:`Recovery.specialize`: the new strategy specialized on the survivors renumbered ``0..n-1``, and the fused
  BSR from the surviving replicas planned (``failed=``) -- or, for state with no surviving copy, the job's newest
  complete checkpoint found instead (:meth:`Recovery.checkpoint_for`, the fallback);
* :meth:`Recovery.send`: the event, the new world's version, and to each survivor its new rank, the rendezvous of
  the new world and the plan.

More failures meanwhile make the loop plan again, for all of them; a recovery that cannot be made ends the job
with its reason (:meth:`Recovery.give_up`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence

from ...core.reconfigure import LostStateError, plan_program_switch
from ...core.specialize import specialize as specialize_program
from ...core.strategy_plan import plan_from_strategy, strategy_of
from ...errors import HSPMDError
from ..checkpoints.checkpoint import list_checkpoints, load_checkpoint, resume_payload
from ..checkpoints.checkpoint_io import CheckpointError
from ..protocol import pack_payload
from .faults import Failure
from .state import ControlState, Event, switch_bytes
from .versions import Numbering, Version, Versions, common_previous, with_newcomers

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.specialize import Program
    from ...core.strategy import Strategy
    from ...core.switch import SwitchPlan
    from ...planner.cost import CostModel
    from ..checkpoints.checkpoint import Checkpoint
    from .job import Job
    from .stragglers import StragglerPolicy

__all__ = ["Recovery", "RecoveryHost", "Held", "Replanned"]


class RecoveryHost(Protocol):
    """What the recovery reads of its controller, and how it sends."""

    state: ControlState
    versions: Versions
    events: list[Event]
    job: "Job | None"
    stragglers: "StragglerPolicy"
    mixed: bool
    length_planner: Any
    seq_len: int
    global_batch: int
    cost: "CostModel | None"
    checkpoint_dir: str | None
    checkpoint_every: int | None
    resumed_from: str | None
    debounce_s: float
    halt_timeout_s: float

    @property
    def current(self) -> Numbering: ...

    def rendezvous(self, launch_rank: int) -> tuple[str, int]: ...

    def numbering_of(self, version: Version) -> Numbering | None: ...

    def candidate_versions(self, version: Version) -> list[Version]: ...

    def send_program(self, msg: Mapping[str, Any], program: "Program", plan: "SwitchPlan | None",
                     to: Sequence[int], *, version: int, rank_of: Mapping[int, int],
                     plan_rank_of: Mapping[int, int] | None = None,
                     whole: Mapping[str, Any] | None = None, after: Mapping[str, Any] | None = None) -> None: ...


@dataclass
class Held:
    """The state every survivor of a failure holds, agreed from their ``halted`` reports (:meth:`Recovery.agree`)."""

    version: Version       #: the plan version of that state
    step: int              #: the step they halted in: the run goes on from the next (or from a checkpoint's)
    finish: list[int]      #: launch ranks to finish the step's commit (the others completed it)
    offer: dict[int, str]  #: launch rank -> what it offers of the state: its ``source``, or ``"nothing"``
    src: Numbering         #: the version's numbering (with a grow's newcomers, when they hold nothing of it)
    replan: Numbering      #: the numbering whose strategy is replanned
    base: Numbering        #: the newest version requested when the recovery started
    dead: list[int]        #: the lost ranks, in ``src``'s numbering


@dataclass
class Replanned:
    """The survivors' new plan (:meth:`Recovery.specialize`)."""

    strategy: "Strategy"      #: replanned, in the numbering of the state held
    program: "Program"        #: specialized on the survivors renumbered ``0..n-1``
    cluster: "Cluster"        #: the survivors renumbered
    mapping: dict[int, int]   #: rank of the state held -> rank of ``program``
    plan: "SwitchPlan | None"  #: the fused BSR from the state held; ``None``: reloaded from ``checkpoint``
    checkpoint: "Checkpoint | None"  #: the checkpoint reloaded (state with no surviving copy), or ``None``
    candidates: list["Program"]  #: a mixed-length job's candidates replanned (else ``[program]``)
    choice: int               #: the index of ``program`` among them
    seconds: dict[str, float]  #: ``plan``, ``specialize`` and, from a checkpoint, ``verify``


class Recovery:
    """Reconfigures a job after failures (see the module docstring), over its controller's state."""

    def __init__(self, host: RecoveryHost) -> None:
        self.host = host
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the recovery loop unless one runs (it plans for every ``pending_dead`` rank)."""
        st = self.host.state
        with st.lock:
            if not st.busy:  # the loop clears it, under the lock, when it stops looking for failures
                self.thread = threading.Thread(target=self.loop, name="hspmd-reconfigure", daemon=True)
                st.busy = True
                self.thread.start()

    def loop(self) -> None:
        st = self.host.state
        try:
            while True:
                time.sleep(self.host.debounce_s)  # a host's other ranks are reported within moments: plan once for all
                with st.lock:
                    if not st.pending_dead:
                        st.busy = False
                        return
                    st.pending_dead.clear()
                try:
                    self.reconfigure()
                except Exception as e:  # noqa: BLE001 - the job must end with the reason, not hang
                    self.give_up(e)
                    return
        finally:
            with st.lock:
                if not st.pending_dead:
                    st.busy = False

    def wait_halted(self, survivors: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Every survivor's ``halted`` report sent since it applied the latest reconfiguration (a survivor that
        does not halt within ``halt_timeout_s`` fails the recovery, naming it)."""
        host, st = self.host, self.host.state
        end = time.monotonic() + host.halt_timeout_s
        while True:
            with st.lock:
                got = {r: m for r, m in st.halted.items()
                       if r in survivors and int(m.get("after", -1)) == host.versions.world}
                if set(survivors) - st.dead <= set(got):
                    return {r: got[r] for r in survivors if r not in st.dead}
                if st.pending_dead:
                    return {}
                if set(survivors) - st.dead <= st.trained:  # they all ran every step: the loss came after
                    st.after_end = True                      # the last commit, nothing is left to recover
                    return {}
            if time.monotonic() > end:
                missing = sorted(set(survivors) - set(got) - st.dead)
                raise HSPMDError(f"ranks {missing} did not halt within {host.halt_timeout_s:.0f} s after the failure "
                                 f"of ranks {sorted(st.dead)}")
            time.sleep(0.01)

    def reconfigure(self) -> None:
        """One recovery for every rank lost so far: once the survivors halted, agree, plan, specialize, send."""
        # lazy: planner, only an elastic/straggler/grow replan needs it (imported before the clock starts)
        from ...planner.elastic import replan_elastic  # noqa: F401

        st = self.host.state
        t_start = time.time()
        with st.lock:
            evidence = st.evidence or t_start
            base = self.host.current
            survivors = [l for l in base.to_launch.values() if l not in st.dead]
        halted = self.wait_halted(survivors)
        if st.after_end:
            self.note_after_end(st.dead)
            return
        if not halted:
            return  # more ranks failed meanwhile: the loop plans again for all of them
        with st.lock:
            st.evidence = None  # this failure's evidence is used up: the next failure's detection starts anew
        held = self.agree(halted, base)
        strategy, t_plan, t1 = self.plan(held)
        new = self.specialize(held, strategy, t_plan, t1)
        self.send(held, new, max(0.0, t_start - evidence))

    def agree(self, halted: dict[int, dict[str, Any]], base: Numbering) -> Held:
        """The state the survivors recover from, read from their ``halted`` reports (``base``: the newest version
        requested); :class:`~hspmd_sdk.errors.HSPMDError` when they disagree."""
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
            with self.host.state.lock:
                found = self.host.versions.for_all(halted)
            if found is not None:
                version, offer = found
                sources, held = set(offer.values()) - {"nothing"}, {version}
        if len(sources) != 1 and not offer or len(steps) != 1 or len(held) != 1:
            raise HSPMDError(f"the survivors disagree on their state after the failure (steps {sorted(steps)}, "
                             f"sources {sorted(sources)}, plan versions {sorted(held)}); resume from a checkpoint")
        finish = finish if last in steps and finish and any(int(m["step"]) == last for m in halted.values()) else []
        offer = {**{r: next(iter(sources)) for r in halted}, **offer, **{r: "nothing" for r in joining}}
        return self.held(held.pop(), steps.pop(), finish, offer, base)  # type: ignore[arg-type]

    def held(self, version: Version, step: int, finish: list[int], offer: dict[int, str],
             base: Numbering) -> Held:
        """The survivors' agreed state of ``version``, with the numbering it is held and replanned in."""
        st = self.host.state
        empty = {r for r, kind in offer.items() if kind == "nothing"}
        with st.lock:
            src = self.host.numbering_of(version)
        if src is None:
            raise HSPMDError(f"the survivors hold the state of plan version {version}, which the launcher no longer "
                             "has")
        replan = src
        if empty - set(src.to_launch.values()):  # the state is from before the grow those ranks came with:
            src, replan = with_newcomers(src, base), base  # replan the grown one, they hold nothing
        dead = sorted(r for r, l in src.to_launch.items() if l in st.dead)
        return Held(version, step, finish, offer, src, replan, base, dead)

    def plan(self, held: Held) -> tuple["Strategy", float, float]:
        """The running strategy replanned on the survivors (in ``held.src``'s numbering); returns it, the seconds it
        took and when it was done (``time.perf_counter``)."""
        from ...planner.elastic import replan_elastic  # lazy: planner, only an elastic/straggler/grow replan needs it

        src, host = held.src, self.host
        strategy = strategy_of(held.replan.program)
        t0 = time.perf_counter()
        # a single survivor runs a single pipeline (the planner's default keeps two replicas when the running
        # strategy had them, which one device cannot hold)
        alone = 1 if src.cluster.num_ranks - len(held.dead) == 1 else None
        new_strategy = replan_elastic(src.program.model, src.cluster, strategy, held.dead, seq_len=host.seq_len,
                                      global_batch=self.replan_batch(src.cluster, held.dead), cost=host.cost,
                                      min_pipelines=alone)
        t1 = time.perf_counter()
        return new_strategy, t1 - t0, t1

    def specialize(self, held: Held, strategy: "Strategy", plan_s: float, t1: float) -> Replanned:
        """``strategy`` specialized on the survivors renumbered ``0..n-1`` (``t1``: when it was planned, in
        ``plan_s`` seconds), and the fused BSR to it from the state held -- or, when no survivor holds some of
        it, the checkpoint to reload instead."""
        from ...planner.elastic import renumber, survivor_cluster  # lazy: planner (see :meth:`plan`)

        src, mixed = held.src, self.host.mixed
        model = src.program.model
        cluster, mapping = survivor_cluster(src.cluster, held.dead)
        program = specialize_program(model, plan_from_strategy(model, renumber(strategy, mapping), cluster), cluster,
                                     bindings=None if mixed else dict(src.program.bindings))  # mixed: B per step
        t2 = time.perf_counter()
        inverse = {new: old for old, new in mapping.items()}
        checkpoint = None
        try:
            plan = plan_program_switch(src.program, program, src.cluster, dst_to_src=inverse, failed=held.dead,
                                       empty=[r for r, l in src.to_launch.items() if held.offer.get(l) == "nothing"])
            t3 = t_verified = time.perf_counter()
        except LostStateError as lost:  # no survivor holds it: the survivors read the new plan's shards instead
            t3, plan = time.perf_counter(), None
            checkpoint = self.checkpoint_for(lost, held.step + 1)
            t_verified = time.perf_counter()
        seconds = {"plan": plan_s, "specialize": t2 - t1 + (t3 - t2)}
        if checkpoint is not None:
            seconds["verify"] = t_verified - t3
        candidates, choice = ([program], 0) if not mixed else \
            self.replan_candidates(held.version, program, held.dead, mapping, cluster)
        return Replanned(strategy, program, cluster, mapping, plan, checkpoint, candidates, choice, seconds)

    def send(self, held: Held, new: Replanned, detect_s: float) -> None:
        """Record the recovery's event and the new world's version, and send each survivor its part."""
        host, st, src, checkpoint = self.host, self.host.state, held.src, new.checkpoint
        launch_of_new = {n: src.to_launch[o] for o, n in new.mapping.items()}
        addr, port = host.rendezvous(launch_of_new[0])
        finish = held.finish
        with st.lock:
            # a failure came mid-reconfiguration, or before switches the user requested were applied: the new plan
            # replaces them (the workers skip the switches up to ``switch_floor``)
            for key in list(st.open):
                if key[0] in ("reconfigure", "switch"):
                    st.open.pop(key).superseded = True
                elif key[0] == "candidates":  # a mixed-length job's switch of candidates (Job.switch([...])):
                    event = st.open.pop(key)   # applied if the survivors recover from a candidate of its set
                    applied = held.version in self.host.candidate_versions(event.version or (-1, -1))
                    event.done, event.superseded = applied, not applied
            ranks = {l: n for n, l in launch_of_new.items()}
            resume = held.step + 1 if checkpoint is None else checkpoint.step
            src_ranks = {l: r for r, l in src.to_launch.items() if l in ranks}
            # the lost ranks of the state the survivors hold and of the newest plan (a newcomer that died in the first
            # step after a grow is only in the latter: the survivors went back to the state from before it)
            lost = sorted(l for l in set(src.to_launch.values()) | set(held.base.to_launch.values()) if l in st.dead)
            event = Event(resume, "failure", lost, strategy_of(new.program),
                          {"detect": detect_s, "plan": new.seconds["plan"], "specialize": new.seconds["specialize"]},
                          switch_bytes(new.plan, src.cluster) if new.plan is not None else {"intra": 0, "inter": 0},
                          ranks, program=new.program, source="memory" if checkpoint is None else "checkpoint",
                          checkpoint_step=None if checkpoint is None else checkpoint.step)
            if checkpoint is not None:
                event.seconds["verify"] = new.seconds["verify"]
                finish = []  # the running state is given up: nothing from before this can be replanned
            # the new world's version (mixed: one per candidate, each replanned on the survivors)
            ident, floor, event.version = host.versions.open_reconfiguration(
                Numbering(new.program, new.cluster, launch_of_new), new.candidates if host.mixed else None)
            st.open[("reconfigure", ident)] = event
            host.events.append(event)
            if host.mixed:
                st.switched = {k: v for k, v in st.switched.items() if k[0] not in ("length", "candidates")}
            host.stragglers.restart()
        msg = {"type": "reconfigure", "id": ident, "world": len(launch_of_new), "ranks": ranks,
               "src_ranks": src_ranks, "master_addr": addr, "master_port": port, "resume_step": resume,
               "source": "memory" if checkpoint is None else "checkpoint", "finish": finish,
               "offer": {str(l): kind for l, kind in held.offer.items()},
               "checkpoint": None if checkpoint is None else resume_payload(checkpoint),
               "switch_floor": floor, "retake_checkpoint": self.checkpoint_missed(resume)}
        # each survivor its parts: of the new Program by its new rank, of the plan by its rank in the numbering of
        # the state it switches from; a mixed-length job's candidates follow the whole
        host.send_program(msg, new.program, new.plan, sorted(ranks), version=ident, rank_of=ranks,
                          plan_rank_of=src_ranks, after={"candidates": pack_payload(new.candidates),
                                                         "choice": new.choice} if host.mixed else None)
        if host.mixed:  # dispatch again from the step the survivors go on from, among the new candidates
            host.length_planner.restart(new.candidates, new.cluster, start=resume, current=new.choice, generation=ident)
        if host.job is not None:
            how = "switching" if checkpoint is None else f"reloading the checkpoint of step {resume} under"
            host.job.note(f"ranks {event.failed_ranks} lost: {how} {new.strategy}")

    def replan_batch(self, cluster: "Cluster", dead: Sequence[int]) -> int:
        """The global batch a replan after a failure keeps: the job's; for mixed-length data, whose steps the
        dispatch cuts into micro-batches itself, at least one sample per survivor (any data-parallel degree)."""
        host = self.host
        return max(host.global_batch, cluster.num_ranks - len(dead)) if host.mixed else host.global_batch

    def replan_candidates(self, version: Version, held: "Program", dead: Sequence[int],
                          mapping: Mapping[int, int], cluster: "Cluster") -> tuple[list["Program"], int]:
        """Every candidate of the mixed-length job's candidate set ``version`` belongs to (its world's first set,
        or one a ``Job.switch([...])`` added: :meth:`~.controller.TrainingController.candidate_versions`)
        replanned on the survivors (``held``: the one the survivors hold, already replanned) the way
        :func:`~hspmd_sdk.planner.elastic.replan_elastic` replans one; a candidate with no plan on the survivors is
        dropped.  Returns the candidates and the index of ``held`` among them."""
        # lazy: planner, only an elastic/straggler/grow replan needs it
        from ...planner.elastic import renumber, replan_elastic

        out: list["Program"] = []
        choice = 0
        for member in self.host.candidate_versions(version):
            if member == version:
                choice = len(out)
                out.append(held)
                continue
            src = self.host.numbering_of(member)
            if src is None:
                continue
            model = src.program.model
            try:
                strategy = replan_elastic(model, src.cluster, strategy_of(src.program), list(dead),
                                          seq_len=self.host.seq_len, global_batch=self.replan_batch(src.cluster, dead),
                                          cost=self.host.cost)
                out.append(specialize_program(model, plan_from_strategy(model, renumber(strategy, dict(mapping)),
                                                                        cluster), cluster))  # the dispatch: micro-batches
            except HSPMDError:
                continue  # no plan of this candidate fits the survivors: the others do its steps
        return out, choice

    def checkpoint_missed(self, resume: int) -> bool:
        """Whether the newest checkpoint the schedule wanted by step ``resume`` (the steps the survivors go on
        from) is not committed: the failure interrupted its write.  The survivors then save after their next step
        instead of waiting ``checkpoint_every`` steps more (decided here, once: every survivor gets the same)."""
        directory, every = self.host.checkpoint_dir, self.host.checkpoint_every
        if directory is None or not every:
            return False

        due = resume // every * every
        return due > 0 and due not in {s for s, _ in list_checkpoints(directory)}

    def checkpoint_for(self, lost: LostStateError, before: int) -> "Checkpoint":
        """The newest complete (verified) checkpoint of this job at a step up to ``before`` to reload the state
        ``lost`` (a :class:`~hspmd_sdk.core.reconfigure.LostStateError`) from; without one, the error naming the
        tensors and ranks."""
        host = self.host
        if host.checkpoint_dir is None:
            raise lost
        job_id = host.job.spec.job_id if host.job is not None else None
        mine = [(s, p) for s, p in list_checkpoints(host.checkpoint_dir) if s <= before]
        for _, path in reversed(mine):
            try:
                ck = load_checkpoint(path)  # verified, checksums included: nothing is reloaded silently wrong
            except CheckpointError:
                continue  # damaged: an older one may do
            if ck.manifest.job_id == job_id or (host.resumed_from is not None
                                                and ck.path.resolve() == Path(host.resumed_from).resolve()):
                return ck
        raise HSPMDError(f"{lost.what}, and no checkpoint of this job in {host.checkpoint_dir} was complete yet (the "
                         f"failure came at step {before}, before the first checkpoint was committed): nothing to "
                         "reload it from")

    def note_after_end(self, lost: Iterable[int], why: str = "") -> None:
        """Say that ranks ``lost`` were lost after the job's last step (nothing to recover)."""
        if self.host.job is not None:
            self.host.job.note(f"ranks {sorted(lost)} lost after the last step{why}: every step was done; the other "
                               "ranks finish without them")

    def give_up(self, error: BaseException, rank: int | None = None) -> None:
        """End the job with the reason the reconfiguration failed (lost state, no plan fits, ...); ``rank``: the
        worker whose halt could not be answered (no worker died)."""
        job = self.host.job
        if job is None:
            return
        lost = sorted(self.host.state.dead)
        if rank is not None:
            job.report_failure(Failure(rank, str(error), kind="error"))
            return
        job.report_failure(Failure(lost[0] if lost else 0, f"elastic recovery after the failure of ranks {lost} failed: "
                                                  f"{error}", kind="error"))
