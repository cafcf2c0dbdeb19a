"""Worker entry of ``test_zero2.py``: train runs and measure the gradient bytes each rank holds.

Payload: ``runs`` (name -> :func:`~hspmd_sdk.runtime.control.train.training_run` dict), ``bucket_bytes`` and
``first_bucket_bytes`` (the gradient buckets' caps), optionally ``zero3_unit_bytes`` (ZeRO-3's least unit).  Per run this rank reports the global loss of each step and,
for its last step, what its gradient synchronisation held (:meth:`GradBuckets.held_bytes`) at every event of the
step's backward and synchronisation (a use's gradient final, a bucket posted, a backward ended: the peak is at one of
them), the bytes of the gradients Adam reads (the masters' ``.grad``), and what is still held after the step; and
the gathered parameters it held (:meth:`StepExecutor.gathered_bytes`) at the most (at those events and whenever a
gather lands; ZeRO-3 counts its own peak), with ZeRO-3's number of gathers in the step.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hspmd_sdk.runtime.data import dataset_for
from hspmd_sdk.runtime.protocol import program_of_run, training_of
from hspmd_sdk.runtime.workers.comm import comm_groups
from hspmd_sdk.runtime.workers.executor import AdamConfig, StepExecutor, program_comm_plans


def entry(state: Any, spec: Any) -> dict[str, Any]:
    p = spec.payload
    out: dict[str, Any] = {}
    for name, run in p["runs"].items():
        program = program_of_run(run)
        state.create_groups(comm_groups(program_comm_plans(program)))
        held: list[int] = []
        gathered: list[int] = []
        ex: StepExecutor | None = None

        def measure(event: str, **info: Any) -> None:
            if ex is not None and event in ("grad_final", "bucket_start", "backward_end"):
                held.append(ex.grad_sync.held_bytes())
            if ex is not None and event in ("grad_final", "bucket_start", "backward_end", "param_ready"):
                gathered.append(ex.gathered_bytes())

        B, S, seed = int(run["global_batch"]), int(run["seq_len"]), int(run["seed"])
        if state.rank in program.ranks:
            ex = StepExecutor(program, state.rank, state, seed=seed, global_batch=B, seq_len=S,
                              adam=AdamConfig(lr=training_of(run).optimizer.lr), device=state.device,
                              bucket_bytes=int(p["bucket_bytes"]), first_bucket_bytes=int(p["first_bucket_bytes"]),
                              trace=measure, **({"zero3_unit_bytes": int(p["zero3_unit_bytes"])}
                                                if "zero3_unit_bytes" in p else {}))
        dataset = dataset_for(run["data"], program.model.vocab_size)
        losses, synced = [], 0
        for step in range(int(run["steps"])):
            held.clear()
            gathered.clear()
            local = 0.0
            if ex is not None:
                def before_update(loss: float) -> float:
                    nonlocal synced
                    synced = sum(t.grad.numel() * t.grad.element_size() for t in ex.params.values())
                    return 0.0
                local = ex.step(dataset.global_batch(step, B, S, seed) if ex.needs_data else None,
                                before_update=before_update)
            part = torch.tensor([local if ex is not None and ex.loss_contributor() else 0.0], dtype=torch.float64)
            dist.all_reduce(part)
            losses.append(float(part.item()))
        zero3 = ex.zero3 if ex is not None else None
        out[name] = {"losses": losses, "peak": max(held, default=0), "synced": synced,
                     "gathered_peak": max([*gathered, zero3.peak_bytes if zero3 is not None else 0], default=0),
                     "gathers": zero3.gathers if zero3 is not None else 0,
                     "after": ex.grad_sync.held_bytes() if ex is not None else 0,
                     "params": {k: t.numel() for k, t in ex.params.items()} if ex is not None else {}}
    return out
