"""A worker's training session: steps, their commit point, graph switching and recovery from failures (§7, §9 (b)).

Each step runs the executor up to its gradient synchronisation, then **commits**: one tiny all-gather over the
world carries every rank's loss summand and the newest switch it has heard of, and only then does Adam change
parameters.  A step that fails before its commit has changed nothing on any rank, so it can be redone from its
start on another plan: no gradient counted twice, none lost, and the data of step ``k`` is step ``k``'s.

**Switching** (``Job.switch`` -> a ``switch`` control message): the commit tells every rank the newest switch any
rank has heard of; at that step boundary all of them switch together (waiting for their copy of the message if
it is still in flight): they create the process groups the new Program needs (only the new ones, in one order
on every rank), move every parameter and Adam moment by the fused BSR the launcher planned once for all ranks
(:func:`~hspmd_sdk.runtime.workers.switch_exec.execute_switch`), build the new executor from the moved shards, drop the
groups nobody uses any more and go on at the next step.

**Recovery** (``elastic``): a communication error (a peer died: gloo reports it within milliseconds) makes the
worker abandon every process group — so that peers blocked on it fail too and every survivor notices — and tell
the launcher where it stands (``halted``: its last committed step).  The launcher's controller
(:mod:`.controller`) replans for the survivors and answers with a ``reconfigure`` message: the new world (size,
this process's new rank, the rendezvous), the new Program and the fused BSR from the surviving replicas.  The
worker rejoins, switches, reports ``switched`` and redoes the interrupted step.  Until the first step after a
switch commits, the previous state is kept: a second failure during the switch replans from it.  Around a grow the
survivors may hold different versions (the running ranks the state from before it, the newcomers only the grown one,
or nothing yet): the launcher picks one every running rank can offer, and tells each what to switch from
(``offer``: its running state, the kept one, or nothing: it only receives).  When some state
has no surviving copy the message says ``source="checkpoint"``: the worker drops its state and reads its shards of
the new Program from that checkpoint (the reader a resumed run uses), and the run goes on from the checkpoint's
step.

**Holds** (``hold_at=``, a test hook): every rank waits at the start of a held step, before any of its work, until
``Job.release``; a request made meanwhile is heard by every rank at that step's commit, so a test races a switch,
a grow, a stop or a kill against a known step boundary instead of stretched compute (:meth:`TrainSession._hold`).

Nothing here names a model; the session reads the Program.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ...core.slices import box_numel
from ...errors import HSPMDError
from .liveness import CommFailure, waits
from ..protocol import Reconfigure, pack_payload, program_of_run, training_of, unpack_payload
from ...models.hf import shard_reader
from ..trace import StepRecorder
from .checkpoint_worker import CheckpointSaver, load_resume, restore_rng
from .session_growth import SessionGrowth
from .session_recovery import SessionRecovery
from .session_switching import SessionSwitching
from .worker import RendezvousAbandoned

if TYPE_CHECKING:
    import torch

    from ...core.specialize import Program
    from .executor import AdamConfig, StepExecutor
    from .worker import WorkerState

__all__ = ["TrainSession", "pack_payload", "unpack_payload", "Reconfigure", "CommFailure"]


class TrainSession(SessionRecovery, SessionGrowth, SessionSwitching):
    """One run of ``train_entry`` on one worker: see the module docstring.  Its parts, each in a module of its own:
    switching (:class:`~.session_switching.SessionSwitching`), growing (:class:`~.session_growth.SessionGrowth`) and
    recovery from failures (:class:`~.session_recovery.SessionRecovery`)."""

    def __init__(self, state: "WorkerState", run: Mapping[str, Any], index: int, offset: int) -> None:
        from ..data import dataset_for  # lazy: torch (data)

        self.state, self.run, self.index, self.offset = state, run, index, offset
        self.elastic = bool(run.get("elastic"))
        # fault injection (tests): [{"rank": launch rank, "step": s, "at": point}] -> a real SIGKILL there
        self.faults = [f for f in run.get("faults") or () if int(f["rank"]) == state.launch_rank]
        # holds (tests, ``hold_at=``): job steps at whose start every rank waits for the launcher's ``release``
        self.holds = {int(s) for s in run.get("holds") or ()}
        self.released: set[int] = set()  # the holds the launcher released (a rank reaching one later goes on)
        self.B, self.S, self.seed = int(run["global_batch"]), int(run["seq_len"]), int(run["seed"])
        self.steps = int(run["steps"])
        self.total_steps = self.steps  # what the learning-rate schedule counts against (a stop does not change it)
        self.train_config = training_of(run)  # the optimizer, schedule, clip and eval sections, validated
        self.program = program_of_run(run)
        self.dataset = dataset_for(run["data"], self.program.model.vocab_size)
        self.capture = run.get("capture_dir")
        self.switch_heard = 0      # the newest switch id received
        self.stop_heard = False    # Job.stop(): end after the step whose commit carries it (every rank at once)
        self.stopped_at: int | None = None  # the steps done when a Job.stop() ended the run early
        self.switch_done = 0       # the newest switch id applied
        self.reconfigured = 0      # the newest reconfigure id applied
        # the version of the state this rank holds: (reconfiguration, switch) applied, as the launcher numbers them
        self.version: tuple[int, int] = (0, 0)
        self.committed = -1        # the last step this rank committed
        self.adam_steps = 0        # Adam updates so far (every rank counts them, holding state or not)
        # (program, state by name, Adam step count, version) from before the switches of the last step boundary (or
        # the last reconfiguration), kept until a step commits after them
        self.previous: tuple[Any, dict[str, Any], float, tuple[int, int]] | None = None
        # whether this rank's running state is whole at ``version`` (false while it is between worlds: a newcomer
        # before it joined, a rank leaving for a grown or re-formed world until its switch there completed)
        self.whole = not state.spec.joining
        self._messages: list[dict[str, Any]] = []
        self._switch_agreed = 0
        self._in_commit: int | None = None  # the step whose commit this rank has entered (grads synchronised)
        self.ex = None
        self.state.program = self.program
        self.joining = bool(state.spec.joining)  # started to grow the running job: no world, no state yet
        if not self.joining:
            self._make_groups(self.program)
        # a resumed run (resume_from=) starts from its checkpoint's shards, at its step (:mod:`.checkpoint`)
        params, opt_state, self.resumed = _initial_state(self.program, state.rank, run) \
            if state.rank in self.program.ranks and not self.joining else (None, None, None)
        self.start, self.adam_steps = _resume_point(run)
        self.committed = self.start - 1
        self.saver = _checkpoint_saver(state, run, index)
        self.recorder = StepRecorder(run.get("profile") or ())
        self._make_executor(params, opt_state)
        if self.ex is None:  # a spare rank may get state in a switch: pay torch.optim's first-use import now
            import torch

            torch.optim.Adam([torch.zeros(1, requires_grad=True)])

    # ---- building -----------------------------------------------------------------------------------------
    def _adam(self) -> "AdamConfig":
        from .executor import AdamConfig  # lazy: torch (executor)

        o = self.train_config.optimizer
        return AdamConfig(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, decay=o.decay,
                          kind=o.kind)

    def _make_groups(self, program: "Program") -> None:
        from .executor import pipeline_groups  # lazy: torch (executor)

        self.state.create_groups(_groups_of(program))
        if program.plan.settings.zero >= 3:  # ZeRO-3's gathers on groups of their own (.zero3)
            self.state.create_twin_groups(_groups_of(program))
        # NCCL: stage-boundary messages on a group per rank pair and direction (executor.pipeline_groups)
        # (a part, SPEC §16, carries the whole Program's pairs)
        self.p2p = pipeline_groups(program, self.state.spec.timeout_s) if self.state.spec.backend == "nccl" else None

    def _drop_unused_groups(self, program: "Program") -> None:
        """Destroy the process groups the running Program does not use (every rank does the same)."""
        import torch.distributed as dist

        keep = set(_groups_of(program))
        twins = keep if program.plan.settings.zero >= 3 else set()
        for groups, kept in ((self.state.groups, keep), (self.state.twins, twins)):
            for key in sorted(set(groups) - kept):
                g = groups.pop(key)
                if g is not dist.group.WORLD and g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(g)

    def _make_executor(self, params: "Mapping[str, torch.Tensor] | None",
                       optimizer_state: Mapping[str, Mapping[str, Any]] | None) -> None:
        from .executor import StepExecutor  # lazy: torch (executor)

        rank, program = self.state.rank, self.program
        self.ex = None
        if rank in program.ranks:
            rc = self.run.get("recompute")
            self.ex = StepExecutor(program, rank, self.state, seed=self.seed, global_batch=self.B, seq_len=self.S,
                                   adam=self._adam(),
                                   recompute=(rank in program.recompute) if rc is None else (rank in rc),
                                   device=self.state.device, params=params, optimizer_state=optimizer_state,
                                   emulate=self.state.emulate if self.state.launch_rank in self.state.spec.slowdown
                                   else None, precision=self.run.get("precision", "fp32"), p2p_groups=self.p2p,
                                   probe=self._probe if self.faults else None,
                                   max_norm=self.train_config.clip.max_norm)
            self.state.params, self.state.optimizer = self.ex.params, self.ex.optimizer
        else:
            self.state.params, self.state.optimizer = {}, None
        self.state.program = program

    def _probe(self, point: str) -> None:
        """Kill this process (SIGKILL) if a fault is injected at ``point`` of the current step."""
        import os
        import signal

        for f in self.faults:
            if f["at"] == point and int(f.get("step", self.state.step)) == self.state.step:
                os.kill(os.getpid(), signal.SIGKILL)

    # ---- the loop -----------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        import torch.distributed as dist

        started = time.perf_counter()
        self.state.channel.send("phase", name="built")  # the run's Program, executor and state are ready
        losses: dict[int, float] = {}
        self.grad_norms: dict[int, float] = {}
        self.lrs: dict[int, float] = {}
        self.val_losses: dict[int, float] = {}
        self.data_rows: dict[int, list[int]] = {}  # step -> the rows [a, b) of its global batch this rank read
        step, reason = self.start, None
        if self.joining:
            try:
                step = self._join()
            except Exception as e:  # noqa: BLE001 - a peer died while this newcomer joined: recover (below)
                if not (self.elastic and _is_comm_failure(e)):
                    raise
                reason = f"{type(e).__name__}: {str(e)[:300]}"
        while reason is not None or step < self.steps:
            try:
                if reason is not None:  # outside the handler: its traceback (whose frames hold the broken world's
                    step, reason = self._recover(reason), None  # process groups) is gone, so destroying them
                    continue                                     # closes them
                self._hold(step)
                self._maybe_switch(step)
                with self.recorder.step(step) as spans:  # the torch profiler on a chosen step (:mod:`.trace`)
                    losses[step] = self._step(step)
                if spans:
                    self.state.channel.send("trace", step=step, program_rank=self.state.rank,
                                            version=list(self.version), spans=spans,
                                            collect_s=self.recorder.collect_s)
                step += 1
            except Exception as e:  # noqa: BLE001 - a peer's failure (also while re-forming), or a genuine error
                if not (self.elastic and _is_comm_failure(e)):
                    raise
                reason = f"{type(e).__name__}: {str(e)[:300]}"
                done = getattr(e, "completed", None)
                if done is not None:  # the step committed; its synchronous checkpoint could not complete
                    losses[done[0]] = done[1]
                    step = done[0] + 1
        # every step is done on this rank, and so committed everywhere: a loss of this rank from now on is after
        # the end of training, which an elastic job does not recover from (there is nothing left to run)
        self.state.channel.send("trained", step=self.offset + self.steps - 1)
        self._probe("end")
        out: dict[str, Any] = {"losses": [losses[s] for s in sorted(losses)],
                               "grad_norms": [self.grad_norms[s] for s in sorted(self.grad_norms)],
                               "lrs": [self.lrs[s] for s in sorted(self.lrs)],
                               "val_losses": {str(s): v for s, v in sorted(self.val_losses.items())},
                               "data_rows": {str(s): v for s, v in sorted(self.data_rows.items())},
                               "rank": self.state.rank,
                               "launch_rank": self.state.launch_rank, "active": self.ex is not None,
                               "seconds": round(time.perf_counter() - started, 3),
                               "switches": self.switch_done, "reconfigurations": self.reconfigured,
                               "stopped_at": self.stopped_at}
        if self.saver is not None:
            out["checkpoint"] = self.saver.close()
        if self.resumed is not None:
            out["resumed"] = self.resumed
        if self.ex is not None:
            out.update(_memory_summary(self.ex, self.program, self.state.rank))
            if self.capture:
                _save_capture(self.ex, self.program, self.state.rank,
                              Path(self.capture) / f"run{self.index}_rank{self.state.launch_rank}.pt")
        try:
            dist.barrier()
        except Exception as e:  # noqa: BLE001 - a peer lost after the last step: every step is done, nothing to redo
            if not (self.elastic and _is_comm_failure(e)):
                raise
            out["peer_lost_after_end"] = f"{type(e).__name__}: {str(e)[:300]}"
        return out

    def _step(self, step: int) -> float:
        state, ex = self.state, self.ex
        state.step = self.offset + step
        state.begin_step()
        agreed: dict[str, float] = {}
        lr = self._set_lr(step)

        def commit(mine: float) -> float:
            agreed.update(self._agree(step, loss=(mine, "sum"), switch=(float(self.switch_heard), "max"),
                                      stop=(float(self.stop_heard), "max")))
            return agreed["grad_norm"]

        if ex is not None:  # a rank reads only its pipeline's rows of the step's samples
            batch = self.dataset.global_batch(step, self.B, self.S, self.seed, rows=ex.chunk) \
                if ex.needs_data else None
            if batch is not None:
                self.data_rows[step] = list(ex.chunk)
            ex.step(batch, capture_grads=bool(self.capture) and step == 0, before_update=commit,
                    batch_rows=ex.chunk)
        else:
            commit(0.0)
        self._in_commit = None
        self.committed = step
        self.adam_steps += 1
        if self.previous is not None:  # the first step after a switch committed everywhere: the old state can go
            self.previous = None
        self._switch_agreed = int(agreed["switch"])
        self._maybe_stop(step, agreed)
        val, cut = self._after_commit(step)
        tokens = ex.micro_size * ex.num_micro * self.S if ex is not None and ex.stage == 0 else None
        self._record(step, agreed, lr, val)
        state.report(self.offset + step, loss=agreed["loss"], tokens=tokens, run=self.index,
                     compute_s=round(ex.compute_s, 6) if ex is not None else None, grad_norm=agreed["grad_norm"],
                     lr=lr, val_loss=val)
        if cut is not None:
            cut.completed = (step, agreed["loss"])  # the step itself is done: the train loop keeps its loss
            raise cut
        return agreed["loss"]

    def _after_commit(self, step: int) -> tuple[float | None, Exception | None]:
        """What follows a committed step, before its report: its checkpoint (if one is due) and its validation (if
        due).  Returns the validation loss and, when a peer died meanwhile (elastic), the failure to raise after
        the report: the step itself is done, so the train loop keeps its loss (``completed``) and recovers."""
        cut: Exception | None = None
        if self.saver is not None:  # before the report: the step's time includes what saving blocked
            try:
                self.saver.after_step(step + 1, last=step + 1 == self.steps, program=self.program, ex=self.ex,
                                      generation=self.reconfigured)
            except CommFailure as e:  # a peer died while a synchronous checkpoint waited for it
                cut = e
        val = None
        if cut is None:
            try:
                val = self._maybe_evaluate(step)
            except Exception as e:  # noqa: BLE001 - a peer died during validation: the step itself is done
                if not (self.elastic and _is_comm_failure(e)):
                    raise
                cut = e
        return val, cut

    # ---- the commit, the schedule, validation ---------------------------------------------------------------
    def _agree(self, step: int, **columns: tuple[float, str]) -> dict[str, float]:
        """The step's commit: one all-gather over the world of this rank's ``columns`` (name -> (value, ``"sum"``
        or ``"max"``)) and of the squared norm of the gradient elements it owns; returns each column reduced over
        the world, and ``grad_norm``, the global gradient norm (every element of the model counted once).  Only
        after it does Adam change anything (see the module docstring)."""
        import torch
        import torch.distributed as dist

        self._in_commit = step  # this rank's gradients of the step are synchronised: it could finish it
        self._collect()
        names = list(columns)
        grad_sq = self.ex.grad_sq if self.ex is not None else 0.0
        mine = torch.tensor([*(columns[n][0] for n in names), grad_sq], dtype=torch.float64,
                            device=self.state.device)
        everyone = torch.empty(self.state.world_size * mine.numel(), dtype=torch.float64, device=self.state.device)
        dist.all_gather_into_tensor(everyone, mine)
        rows = everyone.view(-1, mine.numel())
        out = {n: float(rows[:, i].sum() if columns[n][1] == "sum" else rows[:, i].max())
               for i, n in enumerate(names)}
        out["grad_norm"] = math.sqrt(float(rows[:, -1].sum()))
        return out

    def _set_lr(self, step: int) -> float:
        """The learning rate of ``step`` by the run's schedule (a pure function of the step: the same after a
        switch, a recovery or a resume), set on this rank's optimizer."""
        lr = self.train_config.schedule.lr(step, self.train_config.optimizer.lr, self.total_steps)
        if self.ex is not None:
            self.ex.set_lr(lr)
        return lr

    def _maybe_evaluate(self, step: int) -> float | None:
        """The validation loss at the end of ``step`` when it is an ``eval.every``-th step: ``eval.batches``
        batches of the data's validation split, forward only under the running plan (never training data), each
        batch's loss summed over the world; their mean.  Every rank takes part (those without a stage add 0)."""
        import torch
        import torch.distributed as dist

        every = self.train_config.eval.every
        if not every or (step + 1) % every:
            return None
        batches = self.train_config.eval.batches
        total = sum(self._validation_summand(i) for i in range(batches))
        summed = torch.tensor([total], dtype=torch.float64, device=self.state.device)
        dist.all_reduce(summed)
        return float(summed[0]) / batches

    def _validation_summand(self, index: int) -> float:
        """This rank's summand of validation batch ``index``'s loss: the batch's rows its pipeline takes, forward
        only (0 on a rank without a stage)."""
        ex = self.ex
        if ex is None:
            return 0.0
        batch = self.dataset.val_batch(index, self.B, self.S, rows=ex.chunk) if ex.needs_data else None
        return ex.evaluate(batch, ex.chunk)

    def _record(self, step: int, agreed: Mapping[str, float], lr: float, val: float | None) -> None:
        """Keep the step's agreed gradient norm, learning rate and validation loss for the run's result."""
        self.grad_norms[step], self.lrs[step] = agreed["grad_norm"], lr
        if val is not None:
            self.val_losses[step] = val

    def _maybe_stop(self, step: int, agreed: Mapping[str, float]) -> None:
        """End the run after ``step`` when some rank had heard ``Job.stop()`` at its commit (all of them agree: the
        commit carried it); the step's checkpoint, if one is configured, is then the run's last."""
        if agreed.get("stop") and step + 1 < self.steps:
            self.steps = self.stopped_at = step + 1

    # ---- control messages ---------------------------------------------------------------------------------
    def _collect(self) -> None:
        for msg in self.state.poll_control():
            if msg.get("type") == "stop":
                self.stop_heard = True
                continue
            if msg.get("type") == "release":  # Job.release(step): the hold at that step is over
                self.released.add(int(msg["step"]))
                continue
            if msg.get("type") == "switch":
                if int(msg["id"]) <= self.switch_done:
                    continue  # cancelled by a reconfiguration that came first
                self.switch_heard = max(self.switch_heard, int(msg["id"]))
            self._messages.append(msg)

    @waits
    def _hold(self, step: int) -> None:
        """``hold_at=`` (a test hook): wait at the start of ``step``, before any of its work and so before its
        commit, until the launcher releases it (``Job.release``).  The rank reports ``held`` when it gets here and
        again whenever it hears a request meanwhile (``switch``: the newest switch id heard; ``stop``), so that the
        launcher knows every rank will agree that request at this step's commit (``Job.wait_held``).  Heartbeats go
        on (their own thread) and the wait is marked :func:`waits` (never taken for a hang).  A peer's death
        (``halt``) ends the wait as a peer's failure (an elastic job recovers, then holds here again until
        released); no release within the job's ``timeout_s`` fails the rank with a message saying so."""
        at = self.offset + step
        if at not in self.holds or at in self.released:
            return
        me, limit = self.state.launch_rank, float(self.state.spec.timeout_s)
        end, said = time.monotonic() + limit, None
        while True:
            self._collect()
            if at in self.released:
                return
            heard = (self.switch_heard, self.stop_heard)
            if heard != said:
                self.state.channel.send("held", step=at, switch=heard[0], stop=heard[1])
                said = heard
            if self.state.peer_failed():
                self.state.channel.send("unheld", step=at)
                raise CommFailure(f"rank {me}: a peer died while this rank was held at step {at}")
            if time.monotonic() > end:
                raise HSPMDError(f"rank {me}: held at the start of step {at} (hold_at=, a test hook) and not "
                                 f"released within the job's timeout_s={limit:g} s: call job.release({at}) once "
                                 "the request the hold is for was made")
            time.sleep(0.005)

    @waits
    def _take(self, kind: str, ident: int, timeout: float) -> dict[str, Any]:
        """The control message of ``kind`` with ``id == ident`` (waiting for it up to ``timeout`` seconds)."""
        end = time.monotonic() + timeout
        while True:
            self._collect()
            for i, msg in enumerate(self._messages):
                if msg.get("type") == kind and int(msg.get("id", -1)) == ident:
                    return self._messages.pop(i)
            if time.monotonic() > end:
                raise HSPMDError(f"rank {self.state.launch_rank}: no {kind} message {ident} from the launcher within "
                                 f"{timeout:.0f} s")
            time.sleep(0.005)

    @waits
    def _newest(self, kind: str, after: int, timeout: float) -> dict[str, Any]:
        """The newest control message of ``kind`` with an id above ``after`` (waiting up to ``timeout``); older
        ones of that kind are dropped."""
        end = time.monotonic() + timeout
        while True:
            self._collect()
            found = [m for m in self._messages if m.get("type") == kind and int(m.get("id", -1)) > after]
            if found:
                msg = max(found, key=lambda m: int(m["id"]))
                self._messages = [m for m in self._messages if m.get("type") != kind or int(m["id"]) > int(msg["id"])]
                return msg
            if time.monotonic() > end:
                raise HSPMDError(f"rank {self.state.launch_rank}: the launcher sent no {kind} within {timeout:.0f} s "
                                 "after this worker halted")
            time.sleep(0.005)


def _is_comm_failure(e: BaseException) -> bool:
    """Whether ``e`` is what a peer's death looks like from here (gloo/NCCL errors, our wrappers of them)."""
    from .comm import CommExecutionError  # lazy: torch (comm)

    if isinstance(e, (CommFailure, RendezvousAbandoned)):
        return True
    if isinstance(e, CommExecutionError):  # a wrapped torch error is a peer's failure; a plan that does not fit the
        return e.__cause__ is not None and _is_comm_failure(e.__cause__)  # tensors here is a bug: said as such
    if any(c.__name__ in ("DistNetworkError", "DistStoreError", "DistBackendError") for c in type(e).__mro__):
        return True  # torch.distributed's own: a peer (or the rendezvous store's host) is gone
    if isinstance(e, RuntimeError):
        text = str(e)
        return any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "gloo", "NCCL",
                                       "timed out", "Timed out", "connection", "ProcessGroup", "peer"))
    return False


def _initial_shards(program: "Program", rank: int,
                    init: Mapping[str, Any] | None) -> "dict[str, torch.Tensor] | None":
    """This rank's parameter shards read from the run's ``init`` (``None``: the seeded initialisation)."""
    if not init:
        return None
    from .params import load_local_parameters  # lazy: torch (params)

    return load_local_parameters(program, rank, shard_reader(init["hf"], program.model))


def _resume_point(run: Mapping[str, Any]) -> tuple[int, int]:
    """``(first step, Adam updates done)`` of a run: the resumed checkpoint's, else ``(0, 0)``."""
    resume = run.get("resume")
    return (int(resume["step"]), int(resume["optimizer_step"])) if resume else (0, 0)


def _initial_state(program: "Program", rank: int, run: Mapping[str, Any]) -> tuple[
        "dict[str, torch.Tensor] | None", dict[str, dict[str, Any]] | None, dict[str, Any] | None]:
    """``(params, optimizer_state, resume stats)`` of this rank: read from the resumed checkpoint (its RNG state
    restored too), else the ``init`` weights or the seeded initialisation and a fresh optimizer."""
    resume = run.get("resume")
    if not resume:
        return _initial_shards(program, rank, run.get("init")), None, None

    params, opt_state, stats = load_resume(resume, program, rank)
    stats["rng_restored"] = restore_rng(resume, rank)
    return params, opt_state, stats


def _checkpoint_saver(state: "WorkerState", run: Mapping[str, Any], index: int) -> CheckpointSaver | None:
    """The run's :class:`~.checkpoint_worker.CheckpointSaver`, or ``None`` without ``checkpoint_dir``."""
    if not run.get("checkpoint"):
        return None

    return CheckpointSaver(state, run, index)


def _groups_of(program: "Program") -> list[tuple[int, ...]]:
    """The process groups every rank creates for ``program``: a part's (SPEC §16) are the whole Program's, which
    the part carries (:attr:`~hspmd_sdk.core.specialize.ProgramPart.world_groups`: torch creates a group with
    every rank of the job), a whole Program's come from its plans."""
    from .comm import comm_groups  # lazy: torch (comm)
    from .executor import program_comm_plans  # lazy: torch (executor)

    world = getattr(program, "world_groups", None)
    return list(world) if world is not None else comm_groups(program_comm_plans(program))


def _memory_summary(ex: "StepExecutor", program: "Program", rank: int) -> dict[str, Any]:
    """Bytes of the rank's parameters, of its Adam state, and of its shards by the annotations."""
    import torch

    from .params import parameter_bytes, shard_box  # lazy: torch (params)

    return {"param_bytes": parameter_bytes(ex.params),
            "optimizer_bytes": sum(t.numel() * t.element_size() for st in ex.optimizer.state.values()
                                   for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0),
            "shard_bytes": sum(4 * box_numel(shard_box(program, n, rank)) for n in ex.params),
            "pipeline": ex.pipeline, "stage": ex.stage, "micro_batches": [ex.num_micro, ex.micro_size]}


def _save_capture(ex: "StepExecutor", program: "Program", rank: int, path: Path) -> None:
    """Save the rank's synchronised gradients of step 0, its final parameter shards and their boxes."""
    import torch

    from .params import shard_box  # lazy: torch (params)

    path.parent.mkdir(parents=True, exist_ok=True)
    opt = ex.optimizer_state()
    torch.save({"grads": {k: v.cpu() for k, v in (ex.captured_grads or {}).items()},
                "params": {k: v.detach().cpu().clone() for k, v in ex.params.items()},
                "exp_avg": {k: st["exp_avg"].detach().cpu().clone() for k, st in opt.items() if "exp_avg" in st},
                "exp_avg_sq": {k: st["exp_avg_sq"].detach().cpu().clone() for k, st in opt.items()
                               if "exp_avg_sq" in st},
                "optimizer_step": {k: st.get("step") for k, st in opt.items()},
                "boxes": {k: shard_box(program, k, rank) for k in ex.params}}, path)
