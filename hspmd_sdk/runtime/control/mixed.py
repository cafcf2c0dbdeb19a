"""Training on mixed-length data with per-step plans (SPEC §7; the paper's §9 (c), Appendix A.1 (c)).

``launch(programs, cluster, steps=N, tokens_per_step=T, data="stdlib-docs")`` with a list of candidate Programs
(:meth:`hspmd_sdk.planner.MixedPlan.programs`, one per maximum sequence length):

* **data** (:class:`~.data.LengthBatches`): documents of different lengths are cut into sequences of at most
  ``context`` tokens (longer documents into chunks, nothing dropped); step ``k`` takes the next sequences of a
  seeded permutation until ``tokens_per_step`` — a function of the data, the seed, the budget and the context
  only, never of the plans;
* **dispatch, ahead of the workers** (:class:`LengthPlanner`, a thread of the launcher): for each step,
  :class:`hspmd_sdk.planner.Dispatcher` assigns its sequences to the pipelines of every candidate, the cost model
  picks the cheapest (counting the switch from the running one), and the choice with its micro-batches is sent to
  every worker as a ``dispatch`` message, up to ``lookahead`` steps before they need it: every worker applies the
  same assignment, and the planning runs while earlier steps train.  When the choice changes, the launcher plans
  the fused BSR of parameters and Adam state between the two Programs once (cached per pair) and sends it along;
* **the workers** (:class:`MixedSession`): at a step whose candidate differs from the running one they switch
  (the graph-switching machinery of :class:`~.session.TrainSession`: new groups, fused BSR, new executor; groups of
  earlier candidates are kept for switching back) and report it (``Job.events``: ``reason="length"``); then each
  pipeline runs its own micro-batches at their own shapes (:meth:`~.executor.StepExecutor.step` with
  ``micro_batches=``): a micro-batch is one row packing its sequences (below), or its sequences padded on the
  right to its longest with padding targets ``-100`` (masked out of the loss), and the loss of the step is the
  mean over all its real target tokens (``loss_normalizer``), so gradients equal the single-device model's on the
  same sequences.  The commit
  all-gather also counts the real target tokens every loss rank trained; a step that did not train each of its
  tokens exactly once fails.

Checkpoints (``checkpoint_dir=``, ``resume_from=``; :mod:`.checkpoint`): each is written under the candidate that
ran its last step; the data position is the documents' digest, the token budget, the context and the seed (a
step's sequences depend on nothing else), so a resumed run continues at the checkpoint's step under whichever
candidate that step's dispatch picks -- or under another list of candidates -- reading only its boxes.

Any candidates (SPEC §9): a hand-made list of Programs made from strategies, or Strategies (specialized for the
Programs' model), is a candidate set; one that says nothing of its longest sequence takes what its memory holds
(:func:`~hspmd_sdk.planner.mixed.memory_windows`).  ``init=`` starts from Hugging Face weights, as for one Program.

Elastic (``elastic=True``): a worker that dies does not end the job.  The controller replans every candidate on the
survivors (:func:`~hspmd_sdk.planner.elastic.replan_elastic`, each from its own strategy; one with no plan there
is dropped), the survivors switch the state they hold by fused BSR to the replanned candidate they ran (or reload
a checkpoint, as for one Program), and the dispatch starts again at the interrupted step among the new candidates
(:meth:`LengthPlanner.restart`): every step still trains its sequences once, so the losses stay the
single-device reference's.  ``straggler=True`` (or a :class:`~.controller.StragglerWatch`): each rank's compute
is measured against what the dispatch estimated for it, and a rank that stays slower is priced slower from then on
(:meth:`LengthPlanner.reprice`): the candidates stay, the sequences go by the measured speeds (``reason=
"straggler"``).

Other candidates for a running job (``job.switch([...])``, :mod:`.candidates`): the dispatch of the first step not
dispatched yet chooses among them and carries them to the workers (:meth:`LengthPlanner.switch_candidates`).  A
grow (``job.grow(cluster, [...])``, :mod:`.grow`) is such a switch onto candidates for the larger cluster, its
dispatch carrying the grown world's rendezvous too; ``grow_back=`` (with ``elastic=True``) grows back onto candidates
planned for the capacity that came back.

Packing (default where the model allows it, ``packing=False`` pads): a micro-batch is one row holding its
sequences back to back, at most the pipeline's window in tokens, with no padding; the executor gives the kernels
the sequences' lengths (:attr:`~.kernels.KernelContext.documents`), attention runs within each sequence (one
``scaled_dot_product_attention`` per sequence: work ``sum(length**2)``, not ``row**2``) and RoPE /
learned positions restart at 0 at each, so each sequence is computed exactly as on its own.  A model with an op
whose kernel declares no packing rule (:func:`~.kernels.packing_problems`) gets padded micro-batches: ``rows x
longest``, padding targets ``-100``, and a causal mask over right padding leaves real positions as they are.

:func:`reference_mixed` trains the single-device reference on the same sequences, a step in one padded batch of
its own (whatever the dispatch), with the same normalisation: the independent reference.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ...errors import PlanValidationError, SwitchError
from ..data import LengthBatches, data_spec, documents_for
from ..protocol import pack_payload
from ..reference import reference_mixed
from ...core.reconfigure import plan_program_switch
from ...core.strategy_plan import strategy_of
from ...planner.mixed import Dispatcher
from ..checkpoints.checkpoint import run_fields
from .controller import Event, StragglerWatch, TrainingController
from .faults import Failure
from .growback import GrowBack
from .mixed_checks import candidate_programs, candidate_runs, checked_dispatch, launch_candidates, mixed_run, \
    resume_step
from .runs import checked_faults, start_runs
from .state import switch_bytes

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.specialize import Program
    from ...core.strategy import Strategy
    from ...planner.cost import CostModel
    from ...planner.mixed import Dispatch
    from ..lr_schedule import Schedule
    from .job import Job, JobResult

__all__ = ["launch_mixed", "LengthPlanner", "reference_mixed", "documents_for", "data_spec", "planning_summary"]


@dataclass
class _Moved:
    """A switch of candidates a dispatch carries (:meth:`LengthPlanner.switch_candidates`): the held Program, its
    index among the world's candidates, the seconds spent before, and for a grow its rendezvous and event."""

    held: "Program"
    index: int
    seconds: Mapping[str, float]
    grow: Mapping[str, Any] | None = None
    event: Event | None = None


def same_layouts(programs: Sequence["Program"]) -> list[int]:
    """For each candidate, the first candidate that runs the same Program (the same annotation plan, pipelines,
    recomputation and bindings; only the windows, maximum length and strategy name of ``plan.settings`` differ):
    moving between such candidates changes only the dispatch, not the plan, so nothing is switched."""
    keys: list[Any] = []
    out = []
    for p in programs:
        data = p.plan.model_dump(mode="json", exclude={"meta": True, "settings": {
            "windows": True, "max_seq_len": True, "strategy": {"name"}}})
        key = (repr(data), repr(p.pipelines), repr(sorted(p.recompute)), repr(sorted(p.bindings.items())))
        out.append(keys.index(key) if key in keys else len(keys))
        if key not in keys:
            keys.append(key)
    return out


class LengthPlanner:
    """The launcher's dispatch thread: per step, :class:`~hspmd_sdk.planner.Dispatcher` on the step's lengths
    (``current``: the previous step's choice, so a switch must pay for itself), the chosen candidate and its
    micro-batches sent to every worker as a ``dispatch`` message, at most ``lookahead`` steps ahead of the
    workers' last finished step; a change of candidate also carries the fused BSR between the two Programs
    (planned once per pair) and opens an :class:`~.controller.Event` (``reason="length"``).

    ``records``: per step ``{"step", "choice", "estimate", "plan_s", "switch_plan_s", "lengths", "shapes",
    "micro_batches", "padding", "switch_from", "rank_seconds", "pricing", "factors"}`` (``switch_from``: the candidate
    switched away from, ``None`` where the Program stays; ``rank_seconds``: each rank's estimated compute, against
    which the straggler watch measures it; ``pricing``: how often the dispatcher had been repriced around
    stragglers; ``factors``: each candidate's measured / estimated step time the choice weighed, from the steps
    finished so far).  After a user's switch of candidates (:meth:`switch_candidates`) :attr:`programs` are the
    new ones, candidates :attr:`base` on of the world, and the ``switch_from`` of its first record is the held
    candidate's number in the world.  After an elastic recovery (:meth:`restart`) the dispatch goes on among the
    candidates replanned on the survivors, from the step they resume at; its messages carry the recovery's id
    (``generation``), so a worker never applies a dispatch made for a world that is gone."""

    def __init__(self, programs: Sequence["Program"], cluster: "Cluster", batches: LengthBatches,
                 dispatcher: Dispatcher, *, steps: int,
                 lookahead: int = 2, start: int = 0) -> None:
        self.programs, self.cluster, self.batches, self.dispatcher = list(programs), cluster, batches, dispatcher
        self.layouts = same_layouts(self.programs)
        self.steps, self.lookahead = int(steps), max(0, int(lookahead))
        self.records: list[dict[str, Any]] = []
        self.job: Any = None
        self.controller: Any = None
        self._plans: dict[tuple[int, int], Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.current: int | None = None
        self.start_step = int(start)  # a resumed run's first step (its checkpoint's)
        self.generation = 0  # the controller's reconfiguration id the candidates belong to
        self.pricing = 0  # how often the dispatcher was repriced around stragglers (:meth:`reprice`)
        self.base_cost = dispatcher.cost  # the job's cost model (a repriced dispatcher's holds slowed kinds too)
        self._lock = threading.Lock()  # a dispatch and a repricing, one at a time
        #: one step's dispatch planned and sent at a time, or a switch of candidates (:meth:`switch_candidates`)
        self.sending = threading.Lock()
        self.base = 0  # the index of programs[0] among its world's candidates (past the sets of earlier switches)
        self._learned = 0  # records[:_learned] were measured against their estimates (_learn)
        self.first = self._plan_step(self.start_step)  # before any worker starts: the Program it runs under

    def restart(self, programs: Sequence["Program"], cluster: "Cluster", *, start: int, current: int,
                generation: int) -> None:
        """Dispatch again, from step ``start``, among ``programs`` on ``cluster`` (an elastic recovery's
        candidates, numbered on the survivors; ``current``: the one they hold)."""

        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
        old = self.dispatcher
        with self.sending:
            self._take(programs, cluster, Dispatcher(list(programs), old.model, cluster, cost=self.base_cost,
                                                     packing=old.packing), start=start, current=int(current), base=0)
            self.generation = int(generation)
            self._send(self._plan_step(start))
        self._start_loop()

    def _take(self, programs: Sequence["Program"], cluster: "Cluster", dispatcher: Dispatcher, *, start: int,
              current: int | None, base: int) -> None:
        """Dispatch from step ``start`` among ``programs`` on ``cluster`` by ``dispatcher`` (``current``: the one
        held, ``None``: none; ``base``: the world's number of ``programs[0]``): :meth:`restart` and
        :meth:`switch_candidates` share it."""
        with self._lock:
            self.programs, self.cluster, self.dispatcher, self.base = list(programs), cluster, dispatcher, int(base)
            self.pricing += 1  # a straggler's pricing ends with the candidates it was measured under
            self.layouts = same_layouts(self.programs)
            self._plans = {}
            self.current, self.start_step = current, int(start)
            self.records = [r for r in self.records if r["step"] < start]
            self._learned = len(self.records)

    def check_candidates(self, candidates: Sequence["Program | Strategy"], cluster: "Cluster"
                         ) -> tuple[list["Program"], Dispatcher]:
        """The Programs of a user's new ``candidates`` (``job.switch([...])``: Programs of this job's model and
        Strategies, specialized on ``cluster``, the job's) and their dispatcher, checked as ``launch`` checks
        its candidates (one model, no ZeRO-3, the longest takes the data's context) before anything changes:
        :class:`~hspmd_sdk.errors.SwitchError` naming ``candidates[i]`` and what is wrong."""
        what = "switch of a mixed-length job's candidates"
        model = self.dispatcher.model
        try:
            _, programs = candidate_programs(candidates, cluster, what, model=model, field="candidates")
            dispatcher = Dispatcher(programs, model, cluster, cost=self.base_cost, packing=self.dispatcher.packing)
        except PlanValidationError as e:
            raise SwitchError(str(e)) from e
        context = self.batches.context
        if dispatcher.max_seq_len < context:
            raise SwitchError(f"invalid {what}: candidates: the longest takes sequences of {dispatcher.max_seq_len} "
                              f"tokens, the job's data has sequences of up to {context}: add a candidate for "
                              f"{context}")
        runs = self.job.spec.payload.get("runs") if self.job is not None else None
        evaluated = int((runs[0] if runs else {}).get("eval_context") or 0)  # eval_every=: validation sequences
        shortest = min(min(c.windows) for c in dispatcher.candidates)
        if shortest < evaluated:
            raise SwitchError(f"invalid {what}: candidates: a pipeline takes sequences of {shortest} tokens, the "
                              f"job's validation sequences (eval_every=) have {evaluated}: every pipeline of every "
                              "candidate must take them")
        return programs, dispatcher

    def next_step(self) -> int:
        """The first step not dispatched yet (the workers run no step before its dispatch)."""
        return self.records[-1]["step"] + 1 if self.records else self.start_step

    def boundary(self) -> int:
        """The step a switch of candidates requested now lands at: the first one not dispatched yet (under
        :attr:`sending`); :class:`~hspmd_sdk.errors.SwitchError` when every step is dispatched already."""
        step = self.next_step()
        if step >= self.steps:
            raise SwitchError(f"every remaining step of the job (up to {self.steps - 1}) is dispatched already "
                              f"(lookahead={self.lookahead}): there is no step boundary left to switch at")
        return step

    def switch_candidates(self, programs: Sequence["Program"], dispatcher: Dispatcher, *, base: int,
                          seconds: Mapping[str, float], cluster: "Cluster | None" = None,
                          grow: Mapping[str, Any] | None = None, event: Event | None = None) -> Event:
        """``job.switch([...])`` (the caller holds :attr:`sending` and the controller's lock): the first step not
        dispatched yet (:meth:`boundary`) and the ones after are dispatched among ``programs`` by ``dispatcher``
        (``base``: the world's number of ``programs[0]``); that step's message carries them and the fused BSR from
        the running candidate, and every worker switches there.  Returns the :class:`~.controller.Event`
        (``reason="user"``; ``seconds``: the caller's ``plan`` and ``specialize`` seconds).  A grow
        (:meth:`~.candidates.CandidateSwitch.grow`): ``programs`` are on the larger ``cluster``, the message also
        carries the grown world's rendezvous (``grow``), and ``event`` is the grow's, announced before."""
        step = self.boundary()
        held = self.current if self.current is not None else 0
        old, old_index = self.programs[held], self.base + held
        self._take(programs, cluster or self.cluster, dispatcher, start=step, current=None, base=base)
        rec = self._plan_step(step)
        rec["switch_from"] = old_index  # among the world's candidates: the held one is in no new one's numbering
        moved = _Moved(old, old_index, seconds, grow, event)
        event = self._send(rec, moved=moved)
        assert event is not None
        return event

    def reprice(self, slow: Mapping[int, float]) -> int:
        """Dispatch from now on as if the ranks of ``slow`` (rank of the current candidates -> factor, measured
        stragglers) were that many times slower (:func:`~hspmd_sdk.planner.elastic.slowed_cluster`): each step's
        sequences go to the pipelines, and the step to the candidate, by the measured speeds.  Returns the first
        step dispatched so (the steps dispatched ahead already keep theirs)."""
        from ...planner.elastic import slowed_cluster  # lazy: planner, only an elastic/straggler/grow replan needs it

        old = self.dispatcher
        cluster, cost = slowed_cluster(self.cluster, dict(slow), self.base_cost)
        new = Dispatcher(self.programs, old.model, cluster, cost=cost, packing=old.packing)
        with self._lock:
            self.dispatcher = new
            self.pricing += 1
            return self.records[-1]["step"] + 1 if self.records else self.start_step

    def record(self, step: int) -> dict[str, Any] | None:
        """What was dispatched for ``step`` (the newest record of it), or ``None``."""
        with self._lock:
            return next((r for r in reversed(self.records) if r["step"] == step), None)

    def _rank_seconds(self, d: "Dispatch") -> dict[int, float]:
        """Each rank's estimated compute seconds of a dispatch: its stage's cost of its pipeline's micro-batches."""
        cand = self.dispatcher.candidates[d.choice]
        out: dict[int, float] = {}
        for pipe, cost, shapes in zip(cand.strategy.pipelines, cand.pipes, d.cost_shapes()):
            for stage, stage_cost in zip(pipe.stages, cost.stages):
                seconds = sum(stage_cost.time(*shape) for shape in shapes)
                out.update({int(r): seconds for r in stage.devices})
        return out

    def _plan_step(self, step: int) -> dict[str, Any]:
        with self._lock:  # not while the dispatcher is repriced
            return self._dispatch(step)

    def _learn(self) -> None:
        """Tell the dispatcher what each finished step took against its estimate (:meth:`Dispatcher.observe`):
        steps dispatched under the current pricing, after the run's first, without a switch."""
        done = self.job.metrics.last_step() - 1 if self.job is not None else -1  # every rank is past it
        while self._learned < len(self.records) and self.records[self._learned]["step"] <= done:
            rec = self.records[self._learned]
            self._learned += 1
            if rec["switch_from"] is None and rec["step"] > self.start_step and rec["pricing"] == self.pricing:
                measured = self.job.metrics.step_seconds(rec["step"])
                if measured is not None:
                    self.dispatcher.observe(rec["choice"], rec["estimate"], measured)

    def _dispatch(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        self._learn()
        lengths = self.batches.step_lengths(step)
        d = self.dispatcher(lengths, current=self.current)
        t1 = time.perf_counter()
        rec = {"step": step, "choice": d.choice, "estimate": d.estimate, "plan_s": t1 - t0, "switch_plan_s": 0.0,
               "lengths": list(d.lengths), "shapes": d.shapes(), "micro_batches": [[list(mb) for mb in p]
                                                                                  for p in d.micro_batches],
               "padding": d.padding_fraction(), "packed": d.packed, "cost_shapes": d.cost_shapes(),
               "switch_from": self.current if self.current is not None and
               self.layouts[self.current] != self.layouts[d.choice] else None,
               "rank_seconds": self._rank_seconds(d), "pricing": self.pricing, "factors": list(d.factors)}
        self.current = d.choice
        self.records.append(rec)
        return rec

    def start(self, job: "Job", controller: TrainingController) -> None:
        self.job, self.controller = job, controller
        with self.sending:
            self._send(self.first)
        self._start_loop()

    def _start_loop(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(self._stop,), name="hspmd-length-dispatch",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self, stop: threading.Event) -> None:
        """Dispatch the next step once the workers are within ``lookahead`` steps of it, until every step is
        dispatched or ``stop`` (a recovery restarts the dispatch; a user's switch of candidates changes what the
        next dispatch chooses among, under :attr:`sending`)."""
        try:
            while not stop.is_set():
                with self.sending:
                    if stop.is_set():
                        return
                    step = self.next_step()
                    if step >= self.steps:
                        return
                    if step <= self.job.metrics.last_step() + 1 + self.lookahead:
                        self._send(self._plan_step(step))
                        continue
                if self.job.ended:
                    return
                time.sleep(0.002)
        except Exception as e:  # noqa: BLE001 - the job must end with the reason, not hang
            self.error = e

            self.job.report_failure(Failure(0, f"length dispatch failed: {type(e).__name__}: {e}", kind="error"))

    def _send(self, rec: dict[str, Any], moved: "_Moved | None" = None) -> Event | None:
        """Send ``rec``'s dispatch to every worker (indices among the world's candidates: ``base`` added) with the
        switch it needs: a length switch's fused BSR (planned once per pair), or -- ``moved``: a user's switch of
        candidates or a grow -- the new candidates and the BSR from the held one.  Returns the switch's event
        (``None``: nothing moves)."""
        choice = rec["choice"]
        msg: dict[str, Any] = {"type": "dispatch", "id": rec["step"], "gen": self.generation,
                               "choice": self.base + choice, "lengths": rec["lengths"],
                               "micro_batches": rec["micro_batches"], "packed": rec["packed"]}
        program, event = self.programs[choice], None
        ranks = {l: r for r, l in self.controller.current.to_launch.items()}
        src = rec["switch_from"]
        if moved is not None:
            t0 = time.perf_counter()
            plan = plan_program_switch(moved.held, program, self.cluster)  # a grow: the held ranks keep theirs
            rec["switch_plan_s"] = time.perf_counter() - t0
            msg.update({"plan": pack_payload(plan), "from": moved.index, "candidates": pack_payload(self.programs),
                        "base": self.base})
            seconds = {"detect": 0.0, "plan": float(moved.seconds.get("plan", 0.0)) + rec["plan_s"],
                       "specialize": float(moved.seconds.get("specialize", 0.0)) + rec["switch_plan_s"]}
            version = (self.generation, self.base + choice)
            if moved.grow is not None and moved.event is not None:  # the grow's event, announced before
                msg["grow"] = dict(moved.grow)
                event = moved.event
                event.step, event.strategy, event.program, event.version = rec["step"], strategy_of(program), \
                    program, version
                event.seconds.update(seconds)
                event.bytes = switch_bytes(plan, self.cluster)
            else:
                event = Event(rec["step"], "user", [], strategy_of(program), seconds, switch_bytes(plan, self.cluster),
                              ranks, program=program, version=version)
            self.controller.record_event(("candidates", rec["step"]), event, listed=moved.event is not None)
        elif src is not None:
            key = (src, choice)
            first = key not in self._plans
            if first:
                t0 = time.perf_counter()
                self._plans[key] = plan_program_switch(self.programs[src], program, self.cluster)
                rec["switch_plan_s"] = time.perf_counter() - t0
                msg["plan"] = pack_payload(self._plans[key])
            msg["from"] = self.base + src
            event = Event(rec["step"], "length", [], strategy_of(program),
                          {"detect": 0.0, "plan": rec["plan_s"], "specialize": rec["switch_plan_s"]},
                          switch_bytes(self._plans[key], self.cluster), ranks, program=program)
            self.controller.record_event(("length", rec["step"]), event)
        self.job.send_control(msg)
        return event


def launch_mixed(programs: Sequence["Program | Strategy"], cluster: "Cluster | None" = None, *, steps: int,
                 tokens_per_step: int, data: Any = "stdlib-docs", context: int | None = None, seed: int = 0,
                 lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 precision: str = "fp32", lookahead: int = 2, cost: "CostModel | None" = None,
                 capture_dir: str | Path | None = None, checkpoint_dir: str | Path | None = None,
                 checkpoint_every: int | None = None, keep: int = 3, checkpoint_async: bool = True,
                 resume_from: str | Path | None = None, packing: bool | None = None,
                 init: str | Path | Mapping[str, Any] | None = None, schedule: "Schedule | dict | str | None" = None,
                 max_norm: float | None = None, decay: str = "matrices", optimizer: str = "adam",
                 eval_every: int | None = None, eval_batches: int = 4,
                 _checked: bool = False, **launch_kwargs: Any) -> "Job":
    """Train on mixed-length data, choosing per step among candidate ``programs`` (``launch(programs, ...)``;
    see the module docstring).  Returns the running :class:`~.job.Job`; ``job.wait().losses`` are the steps'
    losses (mean over each step's real target tokens), ``job.events`` the length switches, and
    ``job.length_planner.records`` what was dispatched per step.

    ``programs``: candidates for one model: :meth:`hspmd_sdk.planner.MixedPlan.programs` (each Program's
    ``plan.settings`` has its ``max_seq_len`` and pipeline windows), or any Programs made from strategies and
    :class:`~hspmd_sdk.core.strategy.Strategy` values (specialized here for the Programs' model): such a candidate
    takes the longest micro-batch its memory holds (:func:`~hspmd_sdk.planner.mixed.memory_windows`, at most the
    model's ``max_seq_len``); ``init``: start from these weights (a Hugging Face directory or a state dict, as for
    one Program); ``data``: ``"stdlib-docs"`` (default), a list of
    token arrays, :class:`~.data.Documents` or a tokenized text file; ``tokens_per_step``: the global batch as a
    token budget; ``context``: the longest sequence (default: the model's ``max_seq_len``; longer documents are cut
    into chunks) — the largest candidate must take it; ``lookahead``: how many steps the launcher dispatches ahead
    of the workers; ``cost``: the :class:`~hspmd_sdk.planner.CostModel` of the dispatcher.  Checkpoints as for one
    Program (``checkpoint_dir``, ``checkpoint_every``, ``keep``, ``checkpoint_async``; each saved under the
    candidate running at that step), and ``resume_from`` continues at the checkpoint's step with the same data,
    seed, budget and context, under whichever candidate that step's dispatch picks.  ``schedule``, ``max_norm``
    and ``decay``: the learning-rate schedule, clipping by global norm and weight-decay rule, as for one Program.
    ``eval_every`` / ``eval_batches``: the validation loss of a prepared corpus's validation split (``data=DIR``),
    its documents cut at the shortest window of every candidate's pipelines (so that any candidate runs any of
    its sequences; :class:`~..data.ValidationSequences`), forward only under the running candidate.  ``packing``: micro-batches
    are single rows packing whole sequences (no padding; attention within each sequence, positions restarting):
    default when every op of the model's graph has a packing rule (:func:`~.kernels.packing_problems`; both
    built-in families do), ``False`` pads them instead.  Everything is checked before any worker starts (a
    :class:`~hspmd_sdk.errors.PlanValidationError` names the field)."""

    what = "mixed-length training run"
    programs = list(programs)
    straggler = launch_kwargs.pop("straggler", None)
    elastic = bool(launch_kwargs.pop("elastic", False))
    faults = [dict(f) for f in launch_kwargs.pop("fault_injection", None) or ()]
    holds = launch_kwargs.pop("hold_at", None) or []
    grow_back = launch_kwargs.pop("grow_back", None)
    training = dict(steps=steps, seed=seed, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                    precision=precision, capture_dir=capture_dir, init=init, schedule=schedule, max_norm=max_norm,
                    decay=decay, optimizer=optimizer, eval_every=eval_every, eval_batches=eval_batches)
    saving = dict(checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, keep=keep,
                  checkpoint_async=checkpoint_async, resume_from=resume_from)
    if not _checked:  # launch() has checked them already
        _check_options(programs, what, tokens_per_step=tokens_per_step, data=data, context=context,
                       lookahead=lookahead, cost=cost, packing=packing, straggler=straggler, hold_at=holds,
                       grow_back=grow_back, elastic=elastic, **training, **saving, **launch_kwargs)
    model, cluster, programs = launch_candidates(programs, cluster, what)
    context = int(model.max_seq_len if context is None else context)
    docs, batches, dispatcher = checked_dispatch(programs, model, cluster, what, data=data, context=context,
                                                 tokens_per_step=tokens_per_step, seed=seed, packing=packing, cost=cost)
    if steps < 1:
        raise PlanValidationError([("steps", f"must be >= 1, not {steps}")], what=what)
    data = data_spec(docs, context=context, tokens_per_step=tokens_per_step, seed=seed)
    start = resume_step(resume_from, steps, what)
    planner = LengthPlanner(programs, cluster, batches, dispatcher, steps=steps, lookahead=lookahead, start=start)
    first = planner.first["choice"]
    runs = candidate_runs(programs, cluster, first, what, seq_len=context, **training)
    run = mixed_run(runs, first, data, dispatcher, what, eval_every=eval_every)
    run.update(run_fields(run, programs[first], **saving))
    run["elastic"] = elastic
    run["faults"] = checked_faults(faults, range(cluster.num_ranks), "the cluster", what)
    run["holds"] = sorted({int(s) for s in holds})  # hold_at= (a test hook): as for one Program
    controller = _controller(programs[first], cluster, run, context, elastic=elastic, straggler=straggler,
                             cost=cost, grow_back=grow_back)
    controller.use_candidates(programs, first, planner)
    if elastic and launch_kwargs.get("policy") is None:
        launch_kwargs["policy"] = controller
    job = start_runs([run], cluster, **launch_kwargs)
    job.use_controller(controller, length_planner=planner)
    planner.start(job, controller)
    return job


def _check_options(programs: list["Program | Strategy"], what: str, /, **options: Any) -> None:
    """The launch's options checked as one Program's are (:func:`~.run_config.check_run_options`, SPEC §9), for
    the model of the first candidate (none: its checks are skipped)."""
    # lazy: tests patch run_config.check_run_options
    from .run_config import check_run_options  # the same typed options as one Program's (SPEC §9)

    check_run_options(getattr(programs[0], "model", None) if programs else None, mixed=True, what=what, **options)


def _controller(program: "Program", cluster: "Cluster", run: Mapping[str, Any], seq_len: int, *, elastic: bool,
                straggler: Any, cost: "CostModel | None", grow_back: Any) -> TrainingController:
    """The job's :class:`~.controller.TrainingController` under the ``first`` candidate's ``program``: the run's
    checkpoints, ``straggler=`` (``True``: a default :class:`~.controller.StragglerWatch`) and ``grow_back=``
    (``True``: a default :class:`~.growback.GrowBack`; ``None``: the default's choice)."""
    watch = StragglerWatch() if straggler is True else (straggler or None)
    return TrainingController(program, cluster, global_batch=run["global_batch"], seq_len=seq_len,
                              elastic=elastic, straggler=watch, cost=cost,
                              checkpoint_dir=(run.get("checkpoint") or {}).get("dir"),
                              checkpoint_every=(run.get("checkpoint") or {}).get("every"),
                              resumed_from=(run.get("resume") or {}).get("dir"),
                              grow_back=GrowBack() if grow_back is True else (grow_back or None),
                              grow_back_default=grow_back is None)


def planning_summary(job: "Job", result: "JobResult") -> dict[str, Any]:
    """How much of the per-step planning the workers waited for, from a finished mixed-length job.

    ``plan_s[k]``: the launcher's seconds for step ``k`` (dispatch over every candidate, and the switch's BSR plan
    when the choice changed); ``wait_s[k]``: the longest any worker waited for step ``k``'s dispatch message;
    ``hidden``: ``1 - sum(min(wait, plan)) / sum(plan)`` over steps ``1..`` (step 0 is planned before the workers
    start: ``first_s``); ``choices`` and ``step_s`` (the slowest rank's step time, switches included)."""
    recs = job.length_planner.records
    plan = [float(r["plan_s"]) + float(r["switch_plan_s"]) for r in recs]
    runs = [r["runs"][0] for r in result.results.values() if r and r.get("runs")]
    wait = [max(float(run["dispatch_wait_s"][k]) for run in runs) for k in range(len(recs))]
    total = sum(plan[1:])
    exposed = sum(min(w, p) for w, p in zip(wait[1:], plan[1:]))
    steps: dict[int, float] = {}
    for ms in result.metrics.values():
        for m in ms:
            if m.step_time is not None:
                steps[m.step] = max(steps.get(m.step, 0.0), float(m.step_time))
    return {"plan_s": plan, "wait_s": wait, "first_s": plan[0] if plan else 0.0,
            "hidden": 1.0 - exposed / total if total > 0 else 1.0, "choices": [r["choice"] for r in recs],
            "estimates": [float(r["estimate"]) for r in recs], "padding": [float(r["padding"]) for r in recs],
            "step_s": [steps[k] for k in sorted(steps)]}


