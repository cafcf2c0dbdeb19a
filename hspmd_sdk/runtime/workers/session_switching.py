"""Graph switching at a step boundary (``Job.switch``, §7), a part of the worker's training session
(:mod:`.session`): apply every switch the commit agreed, move the state by the launcher's fused BSR and build the
new Program's executor, keeping the state from before the switches until a step commits after them.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..protocol import switch_of

if TYPE_CHECKING:
    import torch

    from ...core.specialize import Program
    from ...core.switch import SwitchPlan
    from .worker import WorkerState

__all__ = ["SessionSwitching"]


class SessionSwitching:
    """The switching part of :class:`~.session.TrainSession` (its methods run on the session).

    It reads the session's ``state``, ``program``, ``ex``, ``offset``, ``version``, ``reconfigured``,
    ``adam_steps``, ``faults``, the switches agreed (``_switch_agreed``) and done (``switch_done``), and its
    ``_take``, ``_make_groups``, ``_drop_unused_groups``, ``_make_executor``, ``_probe`` and (a grow)
    ``_enter_grown_world``; it sets ``program``, ``whole``, ``previous``, ``switch_done``, ``version`` and
    ``last_switch`` (the switch's timings)."""

    state: "WorkerState"
    program: Any
    ex: Any
    offset: int
    version: tuple[int, int]
    reconfigured: int
    adam_steps: int
    faults: list[Any]
    whole: bool
    previous: tuple[Any, dict[str, Any], float, tuple[int, int]] | None
    switch_done: int
    last_switch: dict[str, float]
    _take: Callable[[str, int, float], dict[str, Any]]
    _make_groups: Callable[["Program"], None]
    _drop_unused_groups: Callable[["Program"], None]
    _make_executor: Callable[..., None]
    _probe: Callable[[str], None]
    _enter_grown_world: Callable[[Mapping[str, Any], "int | None"], tuple[int, float, int]]

    def _maybe_switch(self, step: int) -> None:
        """Apply every switch up to the newest any rank has heard of, in the order they were requested: each was
        planned from the layout the one before it leaves (the launcher's :meth:`~.controller.TrainingController.
        switch` composes them), so none is skipped.  The state from before the first is kept until a step commits:
        a failure during any of them replans from it."""
        target = getattr(self, "_switch_agreed", 0)
        if target <= self.switch_done:
            return
        self._keep_previous()
        for ident in range(self.switch_done + 1, target + 1):
            msg = self._take("switch", ident, self.state.spec.timeout_s)
            program, plan = switch_of(msg)  # parts, or the whole (SPEC §16)
            t0 = time.perf_counter()
            if msg.get("grow") is not None:  # the job grows: new workers join the world, then the same BSR
                tensors = self._state_by_name()
                self._enter_grown_world(msg["grow"], step)
                nbytes = self._switch_to(program, plan, source=tensors)
            else:
                nbytes = self._switch_to(program, plan)
            self.switch_done = ident
            self.version = (self.reconfigured, ident)
            self.state.channel.send("switched", id=ident, what="switch", step=self.offset + step,
                                    seconds=round(time.perf_counter() - t0, 6), bytes=nbytes, **self.last_switch)

    def _keep_previous(self) -> None:
        """Keep the state held now (until a step commits): what a failure in the switches that follow recovers
        from."""
        self.previous = (self.program, self._state_by_name(), float(self.adam_steps), self.version)

    def _state_by_name(self) -> dict[str, "torch.Tensor"]:
        """This rank's training state by :meth:`Program.state_layouts` name (parameters and Adam moments)."""
        import torch

        out: dict[str, Any] = {}
        if self.ex is None:
            return out
        opt = self.ex.optimizer_state()
        for name, p in self.ex.params.items():
            out[name] = p.detach()
            st = opt.get(name) or {}
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{k}"] = st[k] if k in st else torch.zeros_like(p.detach())
        return out

    def _switch_to(self, program: "Program", plan: "SwitchPlan", *, source: Mapping[str, "torch.Tensor"] | None = None,
                   src_rank: int | None = None, to_proc: Mapping[int, int] | None = None,
                   step_count: float | None = None) -> int:
        """Move the state to ``program`` by ``plan`` and build its executor; returns the bytes this rank sent."""
        import torch.distributed as dist

        from .switch_exec import execute_switch  # lazy: torch (switch_exec)

        t0 = time.perf_counter()
        tensors = dict(source) if source is not None else self._state_by_name()
        count = float(self.adam_steps) if step_count is None else step_count
        self._make_groups(program)
        t1 = time.perf_counter()
        if self.faults:
            self._probe("switch")
        me = self.state.rank if src_rank is None else src_rank
        out = execute_switch(plan, tensors, self.state, rank=me, ranks=to_proc, group=dist.group.WORLD)
        t2 = time.perf_counter()
        self.program = program  # every rank has its new state: drop what the old Program needed
        self._drop_unused_groups(program)
        params = {n: out[n] for n in program.executable_graph(self.state.rank).parameters} \
            if self.state.rank in program.ranks else None
        opt = None
        if params is not None:
            opt = {n: ({"exp_avg": out[f"{n}.exp_avg"], "exp_avg_sq": out[f"{n}.exp_avg_sq"], "step": count}
                       if count > 0 else {}) for n in params}
        self._make_executor(params, opt)
        self.whole = True
        self.last_switch = {"groups_s": round(t1 - t0, 6), "bsr_s": round(t2 - t1, 6),
                            "build_s": round(time.perf_counter() - t2, 6)}
        return int(sum(m.nbytes for s in plan.steps for m in s.messages if m.src == me))
