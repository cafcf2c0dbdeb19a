"""Where each device of a stage sits in its CP × TP grid and what share of every TP-split tensor it holds (SPEC §11
and §12), for the editor's tiles, its summary and the figures' hovers.

Read from a stage's ``devices``, ``ratios`` and ``cp`` exactly as the core defines them: ``Stage.tp_groups`` (the
devices cut into ``cp`` consecutive runs of ``len(devices) // cp`` TP ranks, TP fastest) and ``Stage.share`` (the
ratios in lowest terms over their sum; ``1 / tp`` when even).  A draft's stage may be invalid (a cp that does not
divide its devices, a ratio count that no longer matches): nothing is then made up -- the places or the shares are
left out, and the draft's check names the problem.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

__all__ = ["DevicePlace", "stage_places", "share_text", "ratios_text", "cp_divisors", "uneven"]


@dataclass(frozen=True)
class DevicePlace:
    """One device of a stage: its context-parallel group ``cp`` and its rank ``tp`` inside that TP group, and its
    ``share`` of every TP-split tensor of the stage (``None`` when the stage's ratios do not define one)."""

    rank: int
    cp: int
    tp: int
    share: Fraction | None

    @property
    def grid_text(self) -> str:
        """``cp0·tp1``."""
        return f"cp{self.cp}·tp{self.tp}"


def uneven(ratios: Sequence[int] | None) -> bool:
    """Whether ``ratios`` split unevenly (not ``None`` and not all equal), as ``Stage.is_uneven``."""
    return ratios is not None and len(set(ratios)) > 1


def _shares(devices: Sequence[int], ratios: Sequence[int] | None, cp: int) -> list[Fraction] | None:
    tp = len(devices) // cp
    if not uneven(ratios):
        if ratios is not None and (len(ratios) != len(devices) or min(ratios, default=1) < 1):
            return None
        return [Fraction(1, tp)] * len(devices)
    if cp != 1 or len(ratios) != len(devices) or min(ratios) < 1:  # uneven with CP: refused by the core
        return None
    total = sum(ratios)
    return [Fraction(r, total) for r in ratios]


def stage_places(devices: Sequence[int], ratios: Sequence[int] | None = None, cp: int = 1) -> dict[int, DevicePlace]:
    """``rank -> DevicePlace`` for every device of a stage; ``{}`` when ``cp`` does not cut the devices into equal
    TP groups (below 1, or not a divisor of their number)."""
    n = len(devices)
    if not n or cp < 1 or n % cp:
        return {}
    tp = n // cp
    shares = _shares(devices, ratios, cp)
    return {r: DevicePlace(r, i // tp, i % tp, shares[i] if shares is not None else None)
            for i, r in enumerate(devices)}


def share_text(share: Fraction) -> str:
    """``3/4`` (``1`` for a whole tensor)."""
    return str(share)


def ratios_text(ratios: Sequence[int] | None) -> str:
    """``3:1`` (``""`` for none)."""
    return ":".join(str(r) for r in ratios) if ratios is not None else ""


def cp_divisors(n: int) -> list[int]:
    """The cp values a stage of ``n`` devices can take: the divisors of ``n`` (``[1]`` for no devices)."""
    return [d for d in range(1, n + 1) if n % d == 0] or [1]
