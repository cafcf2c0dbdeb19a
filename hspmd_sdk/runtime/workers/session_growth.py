"""Growing the running job onto new workers (``Job.grow``), a part of the worker's training session
(:mod:`.session`): every running rank leaves its world for the grown one at a step boundary, a newcomer joins it
and receives its shards of the new Program by the grow's fused BSR (it holds nothing, so it sends nothing).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ...errors import HSPMDError
from ..protocol import switch_of
from .liveness import waits

if TYPE_CHECKING:
    from .worker import WorkerState

__all__ = ["SessionGrowth"]


class SessionGrowth:
    """The growing part of :class:`~.session.TrainSession` (its methods run on the session).

    It reads the session's ``state``, ``offset``, ``adam_steps``, the switches agreed (``_switch_agreed``), the
    control messages it collected (``_messages``, by ``_collect``), and its ``_switch_to``; it sets ``ex``,
    ``whole``, ``rejoin_s``, ``reconfigured``, ``committed``, ``adam_steps``, ``joining``, the switches heard and
    done, ``_switch_agreed``, ``_messages`` and ``version``."""

    state: "WorkerState"
    ex: Any
    whole: bool
    offset: int
    adam_steps: int
    committed: int
    reconfigured: int
    joining: bool
    switch_done: int
    switch_heard: int
    version: tuple[int, int]
    last_switch: dict[str, float]
    rejoin_s: float
    _switch_agreed: int
    _messages: list[dict[str, Any]]
    _collect: Callable[[], None]
    _switch_to: Callable[..., int]

    def _enter_grown_world(self, grow: Mapping[str, Any], step: int | None) -> tuple[int, float, int]:
        """Leave the running world (a running worker, at the step boundary ``step``) and join the grown one at
        its rank there; rank 0 (a running worker) tells the newcomers (``step=None``) the step the job goes on
        from, Adam's step count and the newest switch every running worker agreed to apply at this boundary.
        Returns those three."""
        import torch
        import torch.distributed as dist

        self.ex = None  # the running world's executor and groups go: nothing may use them any more
        self.whole = False
        self.state.params, self.state.optimizer = {}, None
        self.state.leave_world()
        me = str(self.state.launch_rank)
        if me not in grow["ranks"]:
            raise HSPMDError(f"rank {me}: not in the grown world of ranks {sorted(grow['ranks'], key=int)}")
        t0 = time.perf_counter()
        self.state.rejoin(str(grow["master_addr"]), int(grow["master_port"]), int(grow["world"]),
                          int(grow["ranks"][me]))
        self.rejoin_s = time.perf_counter() - t0
        where = torch.tensor([-1 if step is None else step, self.adam_steps, self._switch_agreed],
                             dtype=torch.float64, device=self.state.device)
        dist.broadcast(where, src=0)
        return int(where[0]), float(where[1]), int(where[2])

    #: the kind of control message that grows the job onto a newcomer (a mixed-length job's: its ``dispatch``)
    GROWS_BY = "switch"

    @waits
    def _grow_message(self, timeout: float) -> dict[str, Any]:
        """A newcomer's first control message: the switch that grows the job onto it (waiting up to
        ``timeout``)."""
        end = time.monotonic() + timeout
        while True:
            self._collect()
            for i, msg in enumerate(self._messages):
                if msg.get("type") == self.GROWS_BY and str(self.state.launch_rank) in (msg.get("grow") or {}).get(
                        "ranks", {}):
                    return self._messages.pop(i)
            if time.monotonic() > end:
                raise HSPMDError(f"rank {self.state.launch_rank}: started to grow the job, but the launcher sent "
                                 f"no grow switch within {timeout:.0f} s")
            time.sleep(0.005)

    def _join(self) -> int:
        """A newcomer joins the running job (``Job.grow``): the grown world, its shards of the new Program by the
        grow's fused BSR (it sends nothing: it holds nothing), Adam's step count; returns the step to go on
        from."""
        msg = self._grow_message(self.state.spec.timeout_s)
        program, plan = switch_of(msg)
        grow, ident = msg["grow"], int(msg["id"])
        t0 = time.perf_counter()
        # a failure from here on is one of the grown world (the launcher's reconfiguration after it answers this
        # newcomer too, holding nothing: ``joining`` stays set until a switch gave it its state)
        self.reconfigured = self.state.generation = int(grow["reconfigured"])
        step, count, agreed = self._enter_grown_world(grow, None)
        self.committed, self.adam_steps = step - 1, int(count)
        nbytes = self._switch_to(program, plan, source={}, step_count=count)
        self.joining = False
        self.switch_done = self.switch_heard = ident
        self._switch_agreed = max(ident, agreed)  # switches requested after the grow, due at the same boundary
        self._messages = [m for m in self._messages if m.get("type") != "switch" or int(m["id"]) > ident]
        self.version = (self.reconfigured, ident)
        self.state.channel.send("switched", id=ident, what="switch", step=self.offset + step,
                                seconds=round(time.perf_counter() - t0, 6), bytes=nbytes, **self.last_switch)
        return step
