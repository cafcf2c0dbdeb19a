"""Recovery from a peer's failure (``elastic``, §9 (b)), a part of the worker's training session (:mod:`.session`,
whose docstring tells the protocol): the rank abandons the broken world, tells the launcher what it holds and can
offer (``halted``), waits for the launcher's ``reconfigure``, takes the state the launcher chose, rejoins the new
world and switches (or reloads a checkpoint), then reports ``switched``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ...errors import HSPMDError
from ..protocol import Reconfigure
from .checkpoint_worker import load_resume

if TYPE_CHECKING:
    import torch

    from ...core.specialize import Program
    from .worker import WorkerState

__all__ = ["SessionRecovery", "Holding", "RECONFIGURE_WAIT_S"]

#: Seconds a worker waits for the launcher's answer after it halted (then it fails: nobody is coordinating).
RECONFIGURE_WAIT_S = 120.0

#: A state a rank holds: (program, tensors by :meth:`Program.state_layouts` name, Adam's step count, version).
State = tuple[Any, dict[str, Any], float, tuple[int, int]]
#: A step finished on a rank whose commit the failure hit: (program, tensors by name, Adam's step count).
Finished = tuple[Any, dict[str, Any], float]


@dataclass
class Holding:
    """What a halted rank holds and offers the launcher (``halted``), then the state it switches from.

    ``program``, ``tensors``, ``count`` (Adam's step count) and ``version`` (reconfiguration, switch): the state;
    ``source``: which one it is (``"live"``: the running state, ``"previous"``: the one kept from before the last
    switches, ``"nothing"``: none, it only receives); ``empty``: a newcomer whose grow did not complete, holding
    nothing from any plan version; ``kept``: the state from before the last switches (``None`` on an empty rank);
    ``whole``: the running state when it is whole while ``source`` is ``"previous"`` (after a grow the launcher may
    choose it); ``whole_at``: the running state's version when it is whole."""

    program: Any
    tensors: dict[str, Any]
    count: float
    version: tuple[int, int]
    source: str
    empty: bool
    kept: State | None
    whole: State | None
    whole_at: list[int] | None


def _cloned(tensors: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    return {k: v.detach().clone() for k, v in tensors.items()}


class SessionRecovery:
    """The recovery part of :class:`~.session.TrainSession` (its methods run on the session).

    It reads the session's ``state``, ``saver``, ``program``, ``ex``, ``whole``, ``joining``, ``previous``,
    ``version``, ``committed``, ``adam_steps``, ``reconfigured``, the switches heard and done, ``offset``, the step
    whose commit it entered (``_in_commit``), the control messages it collected (``_messages``), and its
    ``_state_by_name``, ``_newest``, ``_switch_to``, ``_make_groups``, ``_drop_unused_groups`` and
    ``_make_executor``; it sets all of those (but ``state``, ``saver`` and ``offset``), ``_switch_agreed``,
    ``last_switch`` (a reload's timings) and ``last_reconfigure`` (the launcher's raw message, which a subclass
    reads more of)."""

    state: "WorkerState"
    saver: Any
    program: Any
    ex: Any
    whole: bool
    joining: bool
    previous: State | None
    version: tuple[int, int]
    committed: int
    adam_steps: int
    reconfigured: int
    switch_done: int
    switch_heard: int
    offset: int
    last_switch: dict[str, float]
    last_reconfigure: dict[str, Any]
    _in_commit: int | None
    _switch_agreed: int
    _messages: list[dict[str, Any]]
    _state_by_name: Callable[[], dict[str, "torch.Tensor"]]
    _newest: Callable[[str, int, float], dict[str, Any]]
    _switch_to: Callable[..., int]
    _make_groups: Callable[["Program"], None]
    _drop_unused_groups: Callable[["Program"], None]
    _make_executor: Callable[..., None]

    def _recover(self, reason: str) -> int:
        """After a peer's failure: abandon the world, report, wait for the launcher's plan, rejoin, switch;
        returns the step to go on from."""
        t0 = time.perf_counter()
        if self.saver is not None:  # a checkpoint in flight cannot complete in the broken world
            self.saver.abandon()
        finish, self._in_commit = self._in_commit, None
        live, finished = self._finish_interrupted(finish)
        holding = self._holding(finish, live)
        self._abandon_world(holding)
        self._report_halted(reason, holding, finish, finished)
        msg = self._await_reconfigure()
        self._choose_state(msg, holding, finished)
        return self._rejoin_and_switch(msg, holding, t0)

    def _finish_interrupted(self, finish: int | None) -> tuple[dict[str, "torch.Tensor"] | None, Finished | None]:
        """``(running state, finished state)`` when the failure hit the commit of step ``finish`` (else
        ``(None, None)``): other ranks may have completed it.  Keep the step finished too (the gradients are
        synchronised: Adam on them is what they did) for the launcher to choose."""
        if finish is None:
            return None, None
        if self.ex is None:  # a rank without state in the running Program: finishing the step is counting it
            return None, (self.program, {}, float(self.adam_steps + 1))
        live = _cloned(self._state_by_name())
        self.ex.optimizer.step()
        return live, (self.program, _cloned(self._state_by_name()), float(self.adam_steps + 1))

    def _holding(self, finish: int | None, live: dict[str, "torch.Tensor"] | None) -> Holding:
        """What this rank holds and offers (not yet cloned): the state from before the switches when it failed
        during or right after one (``previous``: that one is whole), else its running state (``live``: the one from
        before finishing the interrupted step, when it was inside a commit)."""
        empty = self.joining  # a newcomer whose grow did not complete: it holds nothing, from no plan version
        kept = self.previous if not empty else None  # the state from before the last switches, until a step
        # the running state, when whole: after a grow, the newcomers hold only that one (no state from before it),
        # so the launcher recovers from it when every survivor completed the grow's switch
        whole_at = list(self.version) if self.whole else None
        if kept is not None and finish is None:  # failed during or right after a switch: the state from
            program, tensors, count, held = kept   # before it is whole
            whole = (self.program, _cloned(self._state_by_name()), float(self.adam_steps), self.version) \
                if self.whole else None
            return Holding(program, tensors, count, held, "previous", empty, kept, whole, whole_at)
        tensors = live if finish is not None and self.ex is not None else self._state_by_name()
        return Holding(self.program, tensors, float(self.adam_steps), self.version, "live", empty, kept, None,
                       whole_at)

    def _abandon_world(self, holding: Holding) -> None:
        """Drop everything that holds the broken world's process groups (the executor's pending sends, the failed
        step's autograd graph), so that destroying them really closes their connections: peers still blocked on
        this process get an error at once, and every survivor halts.  The state offered is cloned first."""
        import gc

        self.ex = None
        self.whole = False
        self.state.params, self.state.optimizer = {}, None
        holding.tensors = _cloned(holding.tensors)
        gc.collect()
        self.state.abandon_groups()
        gc.collect()

    def _report_halted(self, reason: str, holding: Holding, finish: int | None, finished: Finished | None) -> None:
        """Tell the launcher where this rank stands (``halted``): its last committed step, what it holds and
        offers, the step it could finish."""
        kept = holding.kept
        # a rank inside the first commit after a switch also still holds the state from before it: when no rank
        # completed that commit, the launcher may choose that one for everyone (``previous_held``)
        self.state.channel.send("halted", step=self.committed, source=holding.source, after=self.reconfigured,
                                error=reason, finish=finish if finished is not None else None,
                                held=list(holding.version),
                                previous_held=list(kept[3]) if kept is not None and holding.source == "live" else None,
                                whole=holding.whole_at, empty=holding.empty)

    def _await_reconfigure(self) -> Reconfigure:
        """The launcher's newest ``reconfigure`` after this rank halted (kept raw in ``last_reconfigure``)."""
        raw = self._newest("reconfigure", self.reconfigured, RECONFIGURE_WAIT_S)
        self.last_reconfigure = raw  # what a subclass reads more of (a mixed-length job's new candidates)
        return Reconfigure.decode(raw)

    def _choose_state(self, msg: Reconfigure, holding: Holding, finished: Finished | None) -> None:
        """Make ``holding`` the state the launcher asked this rank to switch from (``msg.offer``: its running
        state, the kept one, nothing; or the step it finishes, ``msg.finish``), with the committed step and Adam's
        count that go with it; fails if this rank does not hold it or is left out of the new world."""
        me = self.state.launch_rank
        want = msg.offer.get(me, "nothing" if holding.empty else holding.source)
        if want == "nothing":  # the launcher's reconfiguration gives this rank all its shards: it sends nothing
            holding.program, holding.tensors, holding.count = msg.program, {}, float(msg.resume_step)
            holding.source, holding.empty = want, True
            self.committed, self.adam_steps = msg.resume_step - 1, msg.resume_step  # one Adam update a step
            self.joining = True  # until the switch completed: a failure meanwhile finds this rank holding nothing
        elif want == "previous" and holding.source == "live":
            if holding.kept is None:
                raise HSPMDError(f"rank {me}: the launcher asked for the state from before the switch, but this "
                                 "rank no longer holds it")
            # the launcher chose the state from before the switches
            holding.program, tensors, holding.count, holding.version = holding.kept
            holding.tensors = _cloned(tensors)
            holding.source = "previous"
        elif want == "live" and holding.source == "previous":  # the launcher chose the running state (after a grow)
            if holding.whole is None:
                raise HSPMDError(f"rank {me}: the launcher asked for the running state, but this rank's is not "
                                 "whole (it failed while switching)")
            holding.program, holding.tensors, holding.count, holding.version = holding.whole
            holding.source = "live"
        elif me in msg.finish:
            if finished is None:
                raise HSPMDError(f"rank {self.state.launch_rank}: told to finish step {self.committed + 1}, whose "
                                 "gradients it does not hold")
            holding.program, holding.tensors, holding.count = finished
            holding.version = self.version
            self.committed += 1
            self.adam_steps += 1
        if me not in msg.ranks:
            raise HSPMDError(f"rank {me}: left out of the re-formed world (treated as failed by the launcher)")

    def _rejoin_and_switch(self, msg: Reconfigure, holding: Holding, t0: float) -> int:
        """Rejoin the new world and switch to ``msg.program`` from the state chosen (or reload the checkpoint
        ``msg`` names), report ``switched`` (``t0``: when the recovery began); returns the step to go on from."""
        me = self.state.launch_rank
        # from here on, a peer's death (while rejoining, creating groups, switching) is a failure *during*
        # reconfiguration ``msg.id``: this rank then halts again reporting it, with the state it started from
        self.reconfigured = self.state.generation = msg.id
        if msg.source != "checkpoint" and not holding.empty:
            self.previous = (holding.program, holding.tensors, holding.count, holding.version)
        t1 = time.perf_counter()
        self.state.rejoin(msg.master_addr, msg.master_port, msg.world, msg.ranks[me])
        t2 = time.perf_counter()
        self.program = holding.program
        read: dict[str, Any] = {}
        if msg.source == "checkpoint":
            holding.tensors = {}  # the state some of which has no surviving copy: the checkpoint replaces all of it
            nbytes, read = 0, self._reload(msg)
        else:
            to_proc = {msg.src_ranks[l]: msg.ranks[l] for l in msg.ranks}  # source-numbering rank -> new rank
            nbytes = self._switch_to(msg.program, msg.plan, source=holding.tensors,
                                     src_rank=msg.src_ranks[me], to_proc=to_proc, step_count=holding.count)
        self.reconfigured = msg.id
        self.joining = False
        # switches requested before the failure are cancelled (the launcher planned them for a world that is gone)
        self.switch_done = self.switch_heard = max(self.switch_done, self.switch_heard, msg.switch_floor)
        self._switch_agreed = self.switch_done
        self.version = (msg.id, msg.switch_floor)
        self._messages = [m for m in self._messages if m.get("type") != "switch" or int(m["id"]) > self.switch_done]
        self.state.channel.send("switched", id=msg.id, what="reconfigure", step=self.offset + msg.resume_step,
                                seconds=round(time.perf_counter() - t2, 6), rejoin_s=round(t2 - t1, 6),
                                wait_s=round(t1 - t0, 6), bytes=nbytes, **read, **self.last_switch)
        if self.saver is not None and msg.retake_checkpoint:
            self.saver.retake = True
        return msg.resume_step

    def _reload(self, msg: Reconfigure) -> dict[str, Any]:
        """Go back to the checkpoint ``msg`` names under ``msg.program``: its groups, this rank's shards read from
        the checkpoint (only the boxes it holds, by :func:`~.checkpoint_worker.load_resume`, as a resumed run),
        Adam's step count and the committed step of the checkpoint; returns ``bytes_read`` and ``checkpoint_step``
        for the ``switched`` report (``last_switch`` gets ``load_s``, the read alone)."""

        t0 = time.perf_counter()
        program, ck = msg.program, msg.checkpoint
        self.previous = None  # nothing from before the failure can be replanned from any more
        self._make_groups(program)
        self.program = program
        self._drop_unused_groups(program)
        t1 = time.perf_counter()
        params = opt = None
        stats: dict[str, Any] = {"bytes_read": 0}
        if self.state.rank in program.ranks:
            params, opt, stats = load_resume(ck, program, self.state.rank)
        t2 = time.perf_counter()
        self.committed, self.adam_steps = msg.resume_step - 1, int(ck["optimizer_step"])
        self._make_executor(params, opt)
        self.whole = True
        self.last_switch = {"groups_s": round(t1 - t0, 6), "load_s": round(t2 - t1, 6),
                            "build_s": round(time.perf_counter() - t2, 6)}
        return {"bytes_read": int(stats["bytes_read"]), "checkpoint_step": int(ck["step"])}
