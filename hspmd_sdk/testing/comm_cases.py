"""Diagnostic entries for the communication executors (:mod:`.comm`, :mod:`.switch_exec`).

One entry, :func:`run_all`, runs several sections inside one job so that process start-up is paid once.  Every
section builds its inputs from seeded global tensors (``numpy.random.default_rng(seed)``) cut by ``local_view``,
runs real collectives, and writes what each rank ends up with to ``payload["out_dir"]/rank<r>.npz`` for the
caller to check against its own, independent expectation.  Payload sections (all optional):

* ``"cases"``: ``[{"src": Annotation JSON, "dst": ..., "shape": [...], "seed": int}]`` -- resolve, build the
  source tensors (random summands for Partial sources), :func:`~.comm.execute`; saves ``case<i>``.
* ``"megatron"``: ``{"seed": int}`` -- a two-layer MLP, tensor parallel over ranks 0, 1 with the f/g operators
  as :func:`~.comm.reshard`; saves the loss and the gradients (``mlp_*``).
* ``"bsr_grad"``: ``{"src", "dst", "shape", "seed"}`` -- a BSR reshard whose output is multiplied by a seeded
  tensor and summed; saves the output and the input's gradient (``bsr_out``, ``bsr_grad``).
* ``"switch"``: ``{"src": {name: [ann, shape]}, "dst": ..., "failed": [...], "seed": int}`` -- plan_switch and
  :func:`~.switch_exec.execute_switch` among the survivors; failed ranks sit it out; saves ``sw_<name>``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.spec import LaunchSpec
from ..runtime.workers.worker import WorkerState
from ..core.annotation import Annotation, DS, DUPLICATE, PARTIAL, local_view, local_views
from ..core.resolve import resolve
from ..core.switch import plan_switch


def _ann(data: Any) -> Any:
    return Annotation.model_validate(data)


def source_locals(src: Any, shape: tuple[int, ...], seed: int) -> dict[int, np.ndarray]:
    """Each source rank's tensor for ``value = default_rng(seed)`` draw: see :func:`decompose`."""
    rng = np.random.default_rng(seed)
    value = rng.standard_normal(shape)
    return decompose(src, shape, value, rng)


def decompose(src: Any, shape: tuple[int, ...], value: np.ndarray,
              rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Each source rank's local tensor: its box of a random decomposition of ``value`` into summands.

    Summands of one family (every rank when HDim is -2, else one subgroup) are random but for the last, which is
    the value minus the others; ranks with equal family, box and summand index get identical data.  Test inputs
    only (the property tests share it); expected outputs are computed from ``value`` independently.
    """

    summands: dict[tuple[int, int], list[np.ndarray]] = {}
    out = {}
    for v in local_views(src, shape):
        key = (-1 if src.hdim == PARTIAL else v.subgroup, v.partial_count)  # -1: one family, every rank
        if key not in summands:
            parts = [rng.standard_normal(shape) for _ in range(v.partial_count - 1)]
            parts.append(value - sum(parts, np.zeros(shape)))
            summands[key] = parts
        out[v.rank] = summands[key][v.partial_index][v.slices].copy()
    return out


def run_all(state: WorkerState, spec: LaunchSpec) -> dict[str, Any]:
    """Run every section of the payload; returns per-section timings and, for cases, the plans' kinds."""
    import torch

    from ..runtime.workers.comm import comm_groups  # lazy: torch (comm)

    torch.set_num_threads(1)
    p = spec.payload
    t0 = time.perf_counter()
    cases = [(_ann(c["src"]), _ann(c["dst"]), tuple(c["shape"]), int(c["seed"])) for c in p.get("cases", [])]
    plans = [resolve(s, d, shape, "float64") for s, d, shape, _ in cases]
    extra = _section_plans(p)
    sets = comm_groups(plans + extra) + [(0, 1)]
    if "switch" in p:
        sets += [_survivors(state.world_size, p["switch"]["failed"], shift) for _, _, shift in SWITCH_MODES]
    t1 = time.perf_counter()
    state.create_groups(sets)
    t2 = time.perf_counter()
    saved: dict[str, np.ndarray] = {}
    _run_cases(state, cases, plans, saved)
    t3 = time.perf_counter()
    if "megatron" in p and state.rank in (0, 1):
        saved.update(_megatron(state, int(p["megatron"]["seed"])))
    if "bsr_grad" in p:
        saved.update(_bsr_grad(state, p["bsr_grad"]))
    if "switch" in p:
        saved.update(_switch(state, p["switch"]))
    t4 = time.perf_counter()
    np.savez(Path(p["out_dir"]) / f"rank{state.rank}.npz", **saved)
    return {"kinds": [pl.kinds for pl in plans], "groups": len(sets),
            "seconds": {"resolve": t1 - t0, "groups": t2 - t1, "cases": t3 - t2, "autograd_switch": t4 - t3}}


def _section_plans(p: dict[str, Any]) -> list[Any]:
    """The CommPlans of the bsr_grad section (forward and backward), for group creation."""
    from ..runtime.workers.comm import backward_plan_for  # lazy: torch (comm)

    if "bsr_grad" not in p:
        return []
    b = p["bsr_grad"]
    fwd = resolve(_ann(b["src"]), _ann(b["dst"]), tuple(b["shape"]), "float64")
    return [fwd, backward_plan_for(fwd)]


def _run_cases(state: WorkerState, cases: list[Any], plans: list[Any], saved: dict[str, np.ndarray]) -> None:
    import torch

    from ..runtime.workers.comm import execute  # lazy: torch (comm)

    for i, ((src, dst, shape, seed), plan) in enumerate(zip(cases, plans)):
        if state.rank not in src.ranks and state.rank not in dst.ranks:
            continue
        local = None
        if state.rank in src.ranks:
            local = torch.from_numpy(source_locals(src, shape, seed)[state.rank])
        out = execute(plan, local, state)
        if out is not None:
            saved[f"case{i}"] = out.numpy()


def _megatron(state: WorkerState, seed: int) -> dict[str, np.ndarray]:
    """``loss = sum((g(gelu(f(X) @ W1_r) @ W2_r) + X)**2)``, ``X = tanh(x0)``, TP over ranks 0, 1."""
    import torch

    from ..runtime.workers.comm import backward_plan_for, gradient_layout, reshard  # lazy: torch (comm)

    rng = np.random.default_rng(seed)
    x0, w1, w2 = (rng.standard_normal(s) for s in ((4, 6), (6, 8), (8, 6)))
    r = state.rank
    dup = Annotation([[0, 1]], [DS({DUPLICATE: 2})])
    part = Annotation([[0, 1]], [DS({PARTIAL: 2})])
    f_plan = resolve(dup, dup, (4, 6), "float64")
    f_back = backward_plan_for(f_plan, grad_dst=gradient_layout(dup, "divergent"))
    g_plan = resolve(part, dup, (4, 6), "float64")
    g_back = backward_plan_for(g_plan)
    x0_t = torch.tensor(x0, requires_grad=True)
    w1_t = torch.tensor(w1[:, 4 * r:4 * r + 4].copy(), requires_grad=True)
    w2_t = torch.tensor(w2[4 * r:4 * r + 4, :].copy(), requires_grad=True)
    x = torch.tanh(x0_t)
    h = torch.nn.functional.gelu(reshard(x, f_plan, f_back, state) @ w1_t)
    y = reshard(h @ w2_t, g_plan, g_back, state)
    loss = ((y + x) ** 2).sum()
    loss.backward()
    kinds = np.array([",".join(k) for k in (f_plan.kinds, f_back.kinds, g_plan.kinds, g_back.kinds)])
    return {"mlp_loss": loss.detach().numpy(), "mlp_dx0": x0_t.grad.numpy(), "mlp_dw1": w1_t.grad.numpy(),
            "mlp_dw2": w2_t.grad.numpy(), "mlp_kinds": kinds}


def _bsr_grad(state: WorkerState, b: dict[str, Any]) -> dict[str, np.ndarray]:
    """Forward BSR, ``loss = sum(out * C)`` on destination ranks, backward by the reverse plan."""
    import torch

    from ..runtime.workers.comm import backward_plan_for, reshard  # lazy: torch (comm)

    src, dst, shape, seed = _ann(b["src"]), _ann(b["dst"]), tuple(b["shape"]), int(b["seed"])
    if state.rank not in src.ranks and state.rank not in dst.ranks:
        return {}
    plan = resolve(src, dst, shape, "float64")
    back = backward_plan_for(plan)
    x = None
    if state.rank in src.ranks:
        x = torch.from_numpy(source_locals(src, shape, seed)[state.rank]).requires_grad_(True)
    out = reshard(x, plan, back, state)
    res: dict[str, np.ndarray] = {"bsr_kinds": np.array([",".join(plan.kinds), ",".join(back.kinds)])}
    if state.rank in dst.ranks:
        c = np.random.default_rng(seed + 1).standard_normal(shape)
        v = local_view(dst, shape, state.rank)
        (out * torch.from_numpy(c[v.slices].copy())).sum().backward()
        res["bsr_out"] = out.detach().numpy()
    else:
        out.backward(out.new_empty(0))
    if x is not None:
        res["bsr_grad"] = x.grad.numpy()
    return res


#: ``(name, fused, shift)``: the switch runs fused and unfused, and once more with plan rank ``p`` played by
#: process ``(p + shift) % world`` (the survivors' world renumbered: ``execute_switch(..., ranks=...)``).
SWITCH_MODES = (("fused", True, 0), ("unfused", False, 0), ("shift3", True, 3))


def _survivors(world: int, failed: list[int], shift: int) -> tuple[int, ...]:
    """The processes that play the surviving plan ranks."""
    return tuple(sorted((r + shift) % world for r in range(world) if r not in failed))


def _switch(state: WorkerState, s: dict[str, Any]) -> dict[str, np.ndarray]:
    """Plan the switch (failed ranks excluded) and execute it on the survivors' group, in every mode."""

    failed = [int(r) for r in s["failed"]]
    src = {n: (_ann(a), tuple(sh)) for n, (a, sh) in s["src"].items()}
    dst = {n: (_ann(a), tuple(sh)) for n, (a, sh) in s["dst"].items()}
    saved = {}
    for mode, fused, shift in SWITCH_MODES:
        me = (state.rank - shift) % state.world_size  # the plan rank this process plays
        if me in failed:
            continue
        plan = plan_switch(src, dst, None, dtype="float64", failed=failed, fused=fused)
        out = _switch_once(state, plan, src, int(s["seed"]), me, shift, failed)
        saved.update({f"sw_{mode}_{n}": t.numpy() for n, t in out.items()})
    return saved


def _switch_once(state: WorkerState, plan: Any, src: dict[str, Any], seed: int, me: int, shift: int,
                 failed: list[int]) -> dict[str, Any]:
    import torch

    from ..runtime.workers.switch_exec import execute_switch  # lazy: torch (switch_exec)

    world = state.world_size
    mine = {}
    for i, (name, (ann, shape)) in enumerate(src.items()):
        if me in ann.ranks:
            mine[name] = torch.from_numpy(source_locals(ann, shape, seed + i)[me])
    group = state.group(_survivors(world, failed, shift))
    return execute_switch(plan, mine, rank=me, ranks={p: (p + shift) % world for p in range(world)}, group=group)
