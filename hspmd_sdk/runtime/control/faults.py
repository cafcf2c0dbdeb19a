"""What a job detects when something goes wrong (:class:`Failure`), and what it does about it (a policy).

The job (:mod:`.job`) turns everything it observes into typed failures:

============== ===================================================================================================
kind           when
============== ===================================================================================================
``error``      the entry raised; ``traceback`` is the rank's; ``collateral``: the error looks like the consequence
               of a peer's death (a closed connection)
``exited``     the process ended without a traceback (``returncode``; negative: killed by that signal)
``hung``       the rank stopped beating (SIGSTOP, frozen, starved), or stayed out of communication for ``stall_s``
               while peers waited in communication for it; ``traceback`` is its stack (faulthandler)
``connection   the host's agent or its SSH connection is gone (agent killed, partition, host down); ``ranks``:
lost``         every rank it carried, whose exit statuses are unknown
============== ===================================================================================================

Then it asks its :class:`FailurePolicy`.  The default, :class:`StopOnFailure`, is the classic reaction: stop every
worker and fail the job naming the culprit (a genuine failure wins over the connection errors its peers raise
afterwards, then the earliest).  Another policy can let the job go on -- the hook an elastic job plugs into: it
returns :attr:`Reaction.CONTINUE`, may stop ranks itself (``job.stop_ranks``) and tell the survivors
(``job.send_control``); the failure is then kept in ``job.failures`` / ``JobResult.failures`` and does not fail
the job.  ``on_failure`` runs on the thread that detected the failure (a reader or the watchdog): keep it short.
"""
from __future__ import annotations

import enum
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


FailureKind = Literal["error", "exited", "hung", "connection lost"]


@dataclass
class Failure:
    """One failure as the launcher saw it: which rank (``ranks``: every rank concerned), what, and the evidence."""

    rank: int
    message: str
    traceback: str = ""
    collateral: bool = False
    time: float = field(default_factory=time.time)
    kind: FailureKind = "error"
    ranks: tuple[int, ...] = ()
    host: str | None = None
    returncode: int | None = None

    def __post_init__(self) -> None:
        self.ranks = tuple(self.ranks) or (self.rank,)

    def sort_key(self) -> tuple[bool, float, int]:
        """A genuine failure before a collateral one, then the earliest, then the lowest rank."""
        return (self.collateral, self.time, self.rank)

    @property
    def signal(self) -> str | None:
        """The name of the signal that ended the process (``"SIGKILL"``), if one did."""
        if self.returncode is None or self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"

    def evidence_title(self) -> str:
        return "stack (faulthandler)" if self.kind == "hung" else "traceback"


class Reaction(str, enum.Enum):
    """A policy's answer to a failure."""

    STOP = "stop"  #: stop every worker; the job fails naming its first failure
    CONTINUE = "continue"  #: the job goes on; the failure is recorded in ``job.failures``


class FailurePolicy(Protocol):
    """Decides what a :class:`~.job.Job` does about each failure it detects (see the module docstring)."""

    def on_failure(self, job: Any, failure: Failure) -> Reaction: ...


class StopOnFailure:
    """The default policy: any failure stops every worker and fails the job."""

    def on_failure(self, job: Any, failure: Failure) -> Reaction:
        return Reaction.STOP


def describe_returncode(rc: int) -> str:
    """``-9 (killed by SIGKILL)``, ``7``."""
    if rc < 0:
        try:
            return f"{rc} (killed by {signal.Signals(-rc).name})"
        except ValueError:
            return f"{rc} (killed by signal {-rc})"
    return str(rc)
