"""The worker side's execution error: what the step executor and its parts (:mod:`.optimizer`, :mod:`.feeds`,
:mod:`.p2p`) raise when a program cannot run on a rank."""
from __future__ import annotations

from ...errors import HSPMDError

__all__ = ["ExecutorError"]


class ExecutorError(HSPMDError):
    """The executor cannot run this program on this rank (names the rank and what is missing)."""
