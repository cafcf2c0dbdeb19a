"""Worker entry of ``test_overlap.py``: train runs with the executor's ``trace`` hook and report the events.

Payload: ``runs`` (name -> :func:`~hspmd_sdk.runtime.control.train.training_run` dict), ``bucket_bytes`` and
``first_bucket_bytes`` (the gradient buckets' caps), ``capture_dir`` (where each rank saves, per run, step 0's
gradients and its final parameter shards: ``run<index>_rank<r>.pt``), ``pair_groups`` (runs whose stage-boundary messages travel on
:func:`~hspmd_sdk.runtime.workers.executor.pipeline_groups`, the NCCL layout, here on gloo).  Returns, per run, the global losses of each step and the
events this rank's executor reported during the last step, in order (``{"event", ...info}``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hspmd_sdk.runtime.workers.comm import comm_groups
from hspmd_sdk.runtime.workers.executor import AdamConfig, StepExecutor, pipeline_groups, program_comm_plans
from hspmd_sdk.runtime.data import dataset_for
from hspmd_sdk.runtime.protocol import program_of_run as _program_of, training_of
from hspmd_sdk.runtime.workers.session import _save_capture


def entry(state: Any, spec: Any) -> dict[str, Any]:
    p = spec.payload
    out: dict[str, Any] = {}
    for index, (name, run) in enumerate(p["runs"].items()):
        program = _program_of(run)
        state.create_groups(comm_groups(program_comm_plans(program)))
        pairs = pipeline_groups(program) if name in p.get("pair_groups", ()) else None  # every rank
        events: list[dict[str, Any]] = []
        ex = None
        B, S, seed = int(run["global_batch"]), int(run["seq_len"]), int(run["seed"])
        if state.rank in program.ranks:
            ex = StepExecutor(program, state.rank, state, seed=seed, global_batch=B, seq_len=S,
                              adam=AdamConfig(lr=training_of(run).optimizer.lr), device=state.device,
                              precision=run.get("precision", "fp32"), bucket_bytes=int(p["bucket_bytes"]),
                              first_bucket_bytes=int(p["first_bucket_bytes"]),
                              trace=lambda event, **info: events.append({"event": event, **info}),
                              p2p_groups=pairs)
        dataset = dataset_for(run["data"], program.model.vocab_size)
        losses = []
        for step in range(int(run["steps"])):
            events.clear()
            local = 0.0
            if ex is not None:
                local = ex.step(dataset.global_batch(step, B, S, seed) if ex.needs_data else None,
                                capture_grads=step == 0)
            part = torch.tensor([local if ex is not None and ex.loss_contributor() else 0.0], dtype=torch.float64)
            dist.all_reduce(part)
            losses.append(float(part.item()))
        if ex is not None and p.get("capture_dir"):  # step 0's gradients and the final shards, as session saves them
            _save_capture(ex, program, state.rank, Path(p["capture_dir"]) / f"run{index}_rank{state.rank}.pt")
        out[name] = {"losses": losses, "events": list(events)}
    return out
