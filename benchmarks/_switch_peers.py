"""Worker entry for bench_elastic.py: one reconfiguration moved four ways, on real processes.

``switch_methods_entry``: every rank builds its shards of the old Program (parameters from the seeded init, Adam
moments from seeded noise, equal on every replica), then moves the whole training state to the new Program by

* **fused BSR** (``plan_program_switch(..., fused=True)``: one table, one scheme, one packed message per rank pair),
* **unfused BSR** (one BSR per tensor, with the sender heuristics: the paper's "non-fused per-tensor BSR"),
* **unfused BSR without heuristics** (lowest surviving rank id sends: the paper's baseline),
* **gather-everything broadcast** (a torch-collectives peer: every survivor rebuilds each state tensor whole from
  broadcasts of each distinct surviving shard, then keeps its new box),

each timed between barriers, ``repeats`` times (median reported), and checks that every method gives every rank
exactly the shards the new Program, built directly, holds.  The failed ranks of the plan are alive processes that take part in nothing.
"""
from __future__ import annotations

import time
import zlib
from typing import Any

import torch
import torch.distributed as dist


def _program(payload: dict, key: str, cluster_key: str) -> Any:
    from hspmd_sdk.core.cluster import Cluster
    from hspmd_sdk.core.plan import AnnotationPlan
    from hspmd_sdk.core.specialize import specialize
    from hspmd_sdk.models.registry import model_from_class

    model = model_from_class(payload["model_class"], payload["model"])
    return specialize(model, AnnotationPlan.model_validate(payload[key]), Cluster.model_validate(payload[cluster_key]),
                      bindings=payload["bindings"])


def _state(program: Any, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """This rank's parameters (the seeded init) and Adam moments (seeded noise, equal on every replica)."""
    from hspmd_sdk.runtime.workers.params import init_local_parameters, shard_box

    if rank not in program.ranks:
        return {}
    out: dict[str, torch.Tensor] = {}
    for name, p in init_local_parameters(program, rank, seed).items():
        out[name] = p.detach()
        box = tuple(slice(a, b) for a, b in shard_box(program, name, rank))
        shape = tuple(int(d) for d in program.graph.tensors[name].shape)
        for k in ("exp_avg", "exp_avg_sq"):
            g = torch.Generator().manual_seed(zlib.crc32(f"{name}.{k}".encode()))
            out[f"{name}.{k}"] = torch.rand(shape, generator=g)[box].clone()
    return out


def _naive(src: Any, dst: Any, state: dict[str, torch.Tensor], me: int, dead: set[int], group: Any
           ) -> dict[str, torch.Tensor]:
    """Gather-everything: every survivor rebuilds each state tensor whole -- each distinct surviving shard
    broadcast from its lowest surviving holder -- and keeps its new box."""
    from hspmd_sdk.core.annotation import local_view, local_views

    out = {}
    for name, lay in src.state_layouts().items():
        full = tuple(lay.shape)
        roots: dict[tuple, int] = {}
        for v in local_views(lay.annotation, full):
            if v.rank not in dead:
                roots.setdefault(v.box, v.rank)
        whole = torch.empty(full, dtype=torch.float32)
        for box, root in sorted(roots.items()):
            part = tuple(slice(a, b) for a, b in box)
            buf = state[name].contiguous() if me == root else torch.empty(tuple(b - a for a, b in box))
            dist.broadcast(buf, src=root, group=group)
            whole[part] = buf
        view = local_view(dst.state_layouts()[name].annotation, full, me)
        if view is not None:
            out[name] = whole[view.slices].clone()
    return out


def switch_methods_entry(state: Any, spec: Any) -> dict[str, Any]:
    from hspmd_sdk.core.reconfigure import plan_program_switch
    from hspmd_sdk.runtime.workers.switch_exec import execute_switch

    p = spec.payload
    src, dst = _program(p, "src_plan", "cluster"), _program(p, "dst_plan", "dst_cluster")
    dead = set(p["failed"])
    me = state.rank
    tensors = _state(src, me, int(p["seed"])) if me not in dead else {}
    kinds = {"fused BSR": {}, "unfused BSR": {"fused": False},
             "unfused, no heuristics": {"fused": False, "heuristics": False}}
    plans, plan_s = {}, {}
    for name, kw in kinds.items():
        t0 = time.perf_counter()
        plans[name] = plan_program_switch(src, dst, failed=sorted(dead), **kw)
        plan_s[name] = time.perf_counter() - t0
    group = dist.new_group(sorted(set(range(dist.get_world_size())) - dead))  # every rank creates it
    times: dict[str, list[float]] = {k: [] for k in (*plans, "gather-everything broadcast")}
    results: dict[str, dict[str, torch.Tensor]] = {}
    for _ in range(int(p["repeats"])):
        for name in times:
            dist.barrier()
            t0 = time.perf_counter()
            if name in plans:
                got = execute_switch(plans[name], tensors, state) if me not in dead else {}  # the dead send nothing
            else:
                got = _naive(src, dst, tensors, me, dead, group) if me not in dead else {}
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
            results[name] = got
    want = _state(dst, me, int(p["seed"])) if me not in dead else {}  # the new layout built directly
    correct = {k: set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
               for k, got in results.items()}
    sent = {k: sum(m.nbytes for s in pl.steps for m in s.messages if m.src == me) for k, pl in plans.items()}
    return {"times": {k: sorted(v)[len(v) // 2] for k, v in times.items()}, "correct": correct,
            "sent": sent, "plan_s": plan_s,
            "messages": {k: sum(1 for s in pl.steps for m in s.messages if m.src == me) for k, pl in plans.items()}}
