"""The state machine of a training job's controller (:mod:`.controller`): its events and what its policies share.

The :class:`~.controller.TrainingController` runs every plan change of a job; its policies -- the user switch and
the grow (in the controller), the elastic recovery (:mod:`.recovery`) and the straggler watch (:mod:`.stragglers`)
-- read and change one :class:`ControlState`, under its ``lock``.  Every reconfiguration is an :class:`Event`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.strategy import Strategy
    from ...core.switch import SwitchPlan

__all__ = ["Event", "Reason", "ControlState", "switch_bytes"]

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


@dataclass
class ControlState:
    """What the controller's policies share, read and changed under ``lock`` (an ``RLock``)."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    dead: set[int] = field(default_factory=set)           #: launch ranks lost so far
    pending_dead: set[int] = field(default_factory=set)   #: lost, not yet planned around
    evidence: float | None = None  #: when the first evidence of the failure being recovered from came
    halted: dict[int, dict[str, Any]] = field(default_factory=dict)  #: launch rank -> its last ``halted`` report
    #: ``(what, id)`` -> launch rank -> its ``switched`` report
    switched: dict[tuple[str, int], dict[int, dict[str, Any]]] = field(default_factory=dict)
    open: dict[tuple[str, int], Event] = field(default_factory=dict)  #: reconfigurations not every worker applied
    busy: bool = False  #: a recovery after a failure is under way (its loop clears it, under the lock)
    trained: set[int] = field(default_factory=set)  #: launch ranks past their last step (a loss then is after the end)
    after_end: bool = False  #: a recovery found every survivor past the last step: there was nothing to recover

    def reconfiguring(self) -> bool:
        """Under the lock: a recovery or a switch or grow (not a length switch) is under way."""
        return self.busy or any(k[0] != "length" for k in self.open)


def switch_bytes(plan: "SwitchPlan", cluster: "Cluster | None") -> dict[str, int]:
    """The bytes a switch ``plan`` moves, ``{"intra": ..., "inter": ...}`` node (an :class:`Event`'s ``bytes``)."""
    vol = plan.volume()
    return {"intra": int(sum(v.get("intra", 0) for v in vol.values())),
            "inter": int(sum(v.get("inter", 0) for v in vol.values()))}
