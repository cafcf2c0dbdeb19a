"""The worker's training entry (worker side): ``"hspmd_sdk.runtime.workers.worker_entry:train_entry"``, what every
training job's workers run (:data:`~.runs.ENTRY`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .session import TrainSession

if TYPE_CHECKING:
    from ..spec import LaunchSpec
    from .worker import WorkerState

__all__ = ["train_entry"]


def train_entry(state: "WorkerState", spec: "LaunchSpec") -> dict[str, Any]:
    """Worker entry: run every run of ``spec.payload["runs"]`` in order (a :class:`~.session.TrainSession`
    each); returns ``{"runs": [...], "losses"}``."""

    results, offset = [], 0
    for i, run in enumerate(spec.payload["runs"]):
        if run.get("mixed"):  # mixed-length data: per-step plans (SPEC §7)
            from .mixed_worker import MixedSession  # lazy: numpy (mixed_worker)

            results.append(MixedSession(state, run, i, offset).train())
        else:
            results.append(TrainSession(state, run, i, offset).train())
        offset += int(run["steps"])
        if results[-1].get("stopped_at") is not None:  # Job.stop(): the runs after it do not start
            break
    return {"runs": results, "losses": results[0]["losses"] if len(results) == 1 else None}
