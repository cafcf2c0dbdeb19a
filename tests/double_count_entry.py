"""Worker entry of ``test_training_recipe.py``: the training entry with a wrong global norm -- every rank sums the
squares of its whole shards, so an element held by several ranks (a data-parallel replica) is counted once per
holder.  The test shows that its comparison with the single-device norm fails for it."""
from __future__ import annotations

from typing import Any

from hspmd_sdk.runtime.workers import executor
from hspmd_sdk.runtime.workers.worker_entry import train_entry


def _whole_shards(self: Any) -> dict[str, Any]:
    return {n: (tuple(slice(None) for _ in p.shape),) for n, p in self.params.items()}


def entry(state: Any, spec: Any) -> dict[str, Any]:
    executor.StepExecutor.owned_slices = _whole_shards  # this worker process only
    return train_entry(state, spec)
