"""Per-step metrics: what a worker measures and what the launcher keeps.

A worker reports one :class:`StepMetrics` per step (``WorkerState.report``); the launcher appends it to a
:class:`MetricsHistory`.  Emulated slowdown (CPU demos) is always visible: ``emulated_slowdown`` is the factor and
``emulated_s`` the seconds the worker slept to emulate it; both are absent on a real run.
"""
from __future__ import annotations

import resource
import sys
import threading
import copy
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class StepMetrics:
    """One step of one rank."""

    rank: int
    step: int
    step_time: float | None = None
    loss: float | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    memory_mb: float | None = None
    emulated_slowdown: float | None = None
    emulated_s: float | None = None
    grad_norm: float | None = None  # the gradient's global L2 norm, before clipping
    lr: float | None = None         # the learning rate the step's update used
    val_loss: float | None = None   # the validation loss at the end of the step (validation steps only)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_message(self) -> dict[str, Any]:
        """The fields a ``metric`` message carries: every set one but ``rank`` (``extra`` copied, not shared).
        Read field by field: the launcher makes one for every rank's every step."""
        out = {k: v for k in _MESSAGE_FIELDS if (v := getattr(self, k)) is not None}
        if self.extra:
            out["extra"] = copy.deepcopy(self.extra)
        return out

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> "StepMetrics":
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kw = {k: msg[k] for k in known if k in msg}
        return cls(**kw, extra=dict(msg.get("extra", {})))

    def describe(self) -> str:
        """A short human line, e.g. ``step 3: loss 2.4130, 0.21 s, 9.8k tok/s (emulated 3.0x slower)``."""
        parts = [f"step {self.step}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.step_time is not None:
            parts.append(f"{self.step_time:.2f} s")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s / 1e3:.1f}k tok/s")
        if self.val_loss is not None:
            parts.append(f"val {self.val_loss:.4f}")
        text = parts[0] + (": " + ", ".join(parts[1:]) if len(parts) > 1 else "")
        if self.emulated_slowdown:
            text += f" (emulated {self.emulated_slowdown:g}x slower)"
        return text


#: :meth:`StepMetrics.to_message`'s fields, in order
_MESSAGE_FIELDS = tuple(f.name for f in fields(StepMetrics) if f.name not in ("rank", "extra"))


def memory_mb(device: "torch.device | None" = None) -> float:
    """Peak memory of this process in MB: CUDA peak allocated on a GPU device, peak RSS otherwise."""
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KB on Linux


class MetricsHistory:
    """Every rank's reported steps, in arrival order (thread-safe: reader threads append)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_rank: dict[int, list[StepMetrics]] = {}

    def add(self, m: StepMetrics) -> None:
        with self._lock:
            self._by_rank.setdefault(m.rank, []).append(m)

    def rank(self, rank: int) -> list[StepMetrics]:
        """The steps ``rank`` reported (a copy)."""
        with self._lock:
            return list(self._by_rank.get(rank, []))

    def ranks(self) -> list[int]:
        with self._lock:
            return sorted(self._by_rank)

    def last_step(self) -> int:
        """The highest step any rank reported (-1 before the first)."""
        with self._lock:
            return max((m.step for ms in self._by_rank.values() for m in ms), default=-1)

    def step_seconds(self, step: int) -> float | None:
        """The slowest rank's time of ``step`` (each rank's newest report of it), or ``None`` before any."""
        with self._lock:
            newest = {r: next((m.step_time for m in reversed(ms) if m.step == step and m.step_time is not None),
                              None) for r, ms in self._by_rank.items()}
        times = [t for t in newest.values() if t is not None]
        return float(max(times)) if times else None

    def loss_rank(self, preferred: int | None = None) -> int | None:
        """``preferred`` if given, else the lowest rank that reported a loss."""
        if preferred is not None:
            return preferred
        with self._lock:
            return min((r for r, ms in self._by_rank.items() if any(m.loss is not None for m in ms)),
                       default=None)

    def series(self, what: str, preferred: int | None = None) -> dict[int, float]:
        """Step -> the value of field ``what`` (``"loss"``, ``"grad_norm"``, ``"lr"``, ``"val_loss"``: what every
        rank of a training job reports alike) by the same rule as :meth:`losses`: ``preferred``'s reports, else
        each step's newest attempt, the lowest rank's among those that reported it."""
        if preferred is not None:
            return dict(sorted({m.step: float(getattr(m, what)) for m in self.rank(preferred)
                                if getattr(m, what) is not None}.items()))
        best: dict[int, tuple[int, int, float]] = {}  # step -> (attempt, -rank, value): the largest wins
        for r in self.ranks():
            attempt: dict[int, int] = {}
            for m in self.rank(r):
                if m.loss is None:
                    continue
                k = attempt[m.step] = attempt.get(m.step, -1) + 1
                value = getattr(m, what)
                if value is not None:
                    best[m.step] = max(best.get(m.step, (k, -r, value)), (k, -r, value))
        return {s: float(best[s][2]) for s in sorted(best)}

    def losses(self, preferred: int | None = None) -> list[float]:
        """Per-step losses, ordered by step.  With ``preferred``: that rank's reports (a later report of a step
        replaces an earlier one).  Otherwise, for each step, the newest attempt of it — the most times any one
        rank reported it: a step recomputed after a reconfiguration (a reload from a checkpoint redoes several)
        counts, not what a rank that failed since reported — and among the ranks that reported that attempt,
        the lowest one's (every rank of a training job reports the same global loss)."""
        return list(self.series("loss", preferred).values())

    def as_records(self) -> list[dict[str, Any]]:
        """Flat records (rank, step, ...), handy for a DataFrame."""
        with self._lock:
            return [{"rank": m.rank, **m.to_message()} for ms in self._by_rank.values() for m in ms]
