"""The step interpreter (paper §6.3, Appendix A.2): a stage's schedule replayed action by action.

A schedule is data (:class:`~hspmd_sdk.core.schedule.Action`s, :meth:`Program.schedule`); each action is run by
the handler of its kind in a table (:attr:`StepInterpreter._TRAIN` for a training step, :attr:`StepInterpreter._EVAL`
for a forward-only pass), one dict lookup per action.  Under gloo the receives of the next actions are posted ahead
(:func:`~.p2p.next_receives`): each when the previous receive of its direction runs, waited for at its own action.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .errors import ExecutorError
from .p2p import next_receives
from ..trace import span

if TYPE_CHECKING:
    from ...core.schedule import Action
    from .p2p import StageTransfers

__all__ = ["StepInterpreter"]


class StepInterpreter:
    """The interpreter part of :class:`~.executor.StepExecutor` (its methods run on the executor, whose action
    methods the tables name: ``pre``, ``recv_forward``, ``forward``, ``send_forward``, ``recv_backward``,
    ``backward``, ``send_backward``, ``post``; its ``transfers`` post receives ahead where ``post_ahead``)."""

    rank: int
    post_ahead: bool
    roles: dict[str, str]
    transfers: "StageTransfers"
    records: dict[int, Any]
    _step_loss: float
    _plan: Callable[..., Any]
    _event: Callable[..., None]
    forward: Callable[[int], None]
    backward: Callable[..., float]

    #: The schedule actions a forward-only pass keeps (validation).
    FORWARD_ACTIONS = frozenset({"PRE", "RECV_F", "F", "SEND_F"})

    def _interpret(self, actions: Sequence["Action"], handlers: Mapping[str, Callable[..., None]], *,
                   capture_grads: bool = False, span_prefix: str = "") -> float:
        """Run ``actions`` (a stage's schedule) in order, each by its kind's handler in ``handlers`` (:attr:`_TRAIN`
        for a training step, :attr:`_EVAL` for a forward-only pass); the receives of the next actions are posted
        ahead where the backend allows.  Returns the pass's loss summand (:attr:`_step_loss`)."""
        last_b = max((i for i, a in enumerate(actions) if a.kind == "B"), default=-1)
        ahead = next_receives(actions) if self.post_ahead else None
        self._step_loss = 0.0
        for i, action in enumerate(actions):
            kind, mb = action.kind, action.micro_batch
            handler = handlers.get(kind)
            if handler is None:  # the schedule IR has exactly the kinds of the tables
                raise ExecutorError(f"rank {self.rank}: schedule action {action} has no handler in this pass")
            if not span_prefix:
                self._event("action", kind=kind, mb=mb)
            if ahead is not None:
                for j in ahead[i]:
                    self._post_receives(actions[j].kind, actions[j].micro_batch)
            with span(span_prefix + (kind if mb is None else f"{kind} mb{mb}")):  # the profiler's name (.trace)
                handler(self, mb, i == last_b, capture_grads)
        return self._step_loss

    def _backward_summed(self, mb: int, last: bool) -> None:
        self._step_loss += self.backward(mb, last=last)

    def _forward_summed(self, mb: int) -> None:
        self.forward(mb)
        self._step_loss += self.records[mb].loss_value

    #: What each schedule action does in a training step: ``handler(executor, micro_batch, is_last_B, capture)``.
    _TRAIN: Mapping[str, Callable[..., None]] = {
        "PRE": lambda ex, mb, last, cap: ex.pre(),
        "RECV_F": lambda ex, mb, last, cap: ex.recv_forward(mb),
        "F": lambda ex, mb, last, cap: ex.forward(mb),
        "SEND_F": lambda ex, mb, last, cap: ex.send_forward(mb),
        "RECV_B": lambda ex, mb, last, cap: ex.recv_backward(mb),
        "B": lambda ex, mb, last, cap: ex._backward_summed(mb, last),
        "SEND_B": lambda ex, mb, last, cap: ex.send_backward(mb),
        "POST": lambda ex, mb, last, cap: ex.post(capture_grads=cap),
    }
    #: A forward-only pass (validation): the forward actions, each forward's loss summed.
    _EVAL: Mapping[str, Callable[..., None]] = {
        "PRE": _TRAIN["PRE"], "RECV_F": _TRAIN["RECV_F"], "SEND_F": _TRAIN["SEND_F"],
        "F": lambda ex, mb, last, cap: ex._forward_summed(mb),
    }

    def _post_receives(self, kind: str, mb: int) -> None:
        """Post the receives of action ``kind`` (``RECV_F`` / ``RECV_B``) of micro-batch ``mb`` ahead of it, for
        each of its plans that starts with its point-to-point operator (:meth:`.p2p.StageTransfers.post_ahead`)."""
        names = [n for n, r in self.roles.items() if r == ("recv" if kind == "RECV_F" else "send")]
        d = 0 if kind == "RECV_F" else 1
        for name in names:
            plan = self._plan(name if kind == "RECV_F" else f"{name}.bwd", mb)
            if self.transfers.post_ahead((kind, mb, name), plan, mb, d):
                self._event("recv_posted", kind=kind, mb=mb, name=name)
