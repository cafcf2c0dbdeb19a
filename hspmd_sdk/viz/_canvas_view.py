"""The JSON the cluster canvas draws, built from the editor's state (pure Python: tested without a browser).

:func:`cluster_view` is sent once (nodes, devices, links); :func:`canvas_view` after every change: the draft's
stages (fill, hull, layers, memory, problems), the verdict and what blocks Save/Launch/Apply, the resolved
communication (stage-boundary arrows with bytes per step, the busiest link), and the picked tensor's annotation
(DG Union subgroups, each device's shard from :func:`~hspmd_sdk.core.annotation.local_view`).  Each function reads
the state of ``ed``, the :class:`~hspmd_sdk.viz.editor.PlanEditor` (typed ``Any``: this module sits below the editor,
which uses it).
"""
from __future__ import annotations

from typing import Any

from ..core.annotation import format_ranks, local_view
from ._units import fmt_bytes, fmt_memory, fmt_node_devices
from ._model import model_name
from ._editor_view import comm_state, general_problems, kinds_text, stage_memory, stage_messages, verdict
from ._style import UNION_COLOURS, ink, pipeline_colour, stage_colour
from ._tp_grid import DevicePlace, cp_divisors, ratios_text, share_text, stage_places, uneven
from .cluster_fig import grid_axes, grid_axis, grid_words, hdim_words
from .comm_fig import _group_rings, p2p_messages

__all__ = ["cluster_view", "canvas_view", "tensor_view", "shard_grid", "MAX_MESSAGES", "TERMS"]

#: A picked Reshard draws at most this many point-to-point arrows (the rest are counted in the legend).
MAX_MESSAGES = 96


def cluster_view(ed: Any) -> dict[str, Any]:
    """The static part: nodes (host, kind, ranks, memory, NVLink bandwidth) and the inter-node links."""
    c = ed.cluster
    nodes = []
    for i, n in enumerate(c.nodes):
        spec = c.devices[n.kind]
        nodes.append({"i": i, "host": n.host, "kind": n.kind, "ranks": list(n.ranks),
                      "mem_gib": round(spec.memory_mb / 1024, 1), "nvlink_gbs": spec.intra_bandwidth_gbs,
                      "sub": fmt_node_devices(spec)})
    return {"nodes": nodes, "num_ranks": c.num_ranks, "inter_gbs": c.inter_bandwidth_gbs,
            "inter_us": c.inter_latency_us, "intra_us": c.intra_latency_us,
            "title": f"{model_name(ed.model)} on {c}", "num_layers": int(ed.model.num_layers)}


def _short_memory(need: float, cap: float) -> str:
    """``43.9/79.6 GiB`` (or ``12.0 MiB/8.0 GiB`` for small needs): fits a tile; the capacity as everywhere else."""
    head = f"{need / 2**30:.1f}" if min(need, cap) >= 0.1 * 2**30 else fmt_memory(need)
    return f"{head}/{fmt_memory(cap)}"


def _problem(p: Any) -> dict[str, Any]:
    return {"level": p.level, "where": p.where, "text": p.message, "p": p.pipeline, "s": p.stage,
            "tensor": p.tensor}


def _tiles(ed: Any, flagged: dict[int, str]) -> list[dict[str, Any]]:
    c, d = ed.cluster, ed._draft
    where: dict[int, tuple[int, int]] = {}
    places: dict[int, DevicePlace] = {}  # each device's share and CP x TP coordinates in its stage
    for i, p in enumerate(d.pipelines):
        for j, s in enumerate(p.stages):
            for r in s.devices:
                where[r] = (i, j)
            places.update(stage_places(s.devices, s.ratios, s.cp))
    kind = ("simulated" if ed._memory_kind == "simulated"
            else "estimate: Strategy.device_memory, the device's runtime included (not simulated: the plan has errors)")
    out = []
    for r in range(c.num_ranks):
        spec = c.spec(r)
        cap = spec.memory_mb * 2.0**20
        title = [f"rank {r} · {spec.kind} · {c.node_of(r).host}", f"memory {fmt_memory(cap)}"]
        tile: dict[str, Any] = {"r": r, "kind": spec.kind, "p": -1, "s": -1, "flag": flagged.get(r, ""),
                                "failed": r in ed._failed, **_place(None, None, title)}
        if r in where:
            i, j = where[r]
            st = d.pipelines[i].stages[j]
            fill = stage_colour(i, j, len(d.pipelines[i].stages))
            tile.update(p=i, s=j, fill=fill, ink=ink(fill), line=pipeline_colour(i),
                        layers=f"L{st.layers[0]}–{st.layers[1]}")
            title.append(f"pipeline {i}, stage {j}: layers {st.layers[0]}–{st.layers[1]}, {st.parallel_text}")
            tile.update(_place(st, places.get(r), title))
        else:
            title.append("unused")
        if r in ed._memory:
            need = ed._memory[r]
            tile.update(mem=round(need / cap, 4), mem_text=_short_memory(need, cap))
            title.append(f"needs ~{fmt_memory(need)} of {fmt_memory(cap)} ({need / cap:.0%}), {kind}")
        if r in ed._failed:
            title.append("FAILED in the attached job")
        tile["title"] = "\n".join(title)
        out.append(tile)
    return out


def _place(st: Any, place: DevicePlace | None, title: list[str]) -> dict[str, Any]:
    """A stage tile's place in its stage: its share of every TP-split tensor (``share``: ``3/4``; ``uneven``: the
    stage's ratios are not all equal) and its CP × TP coordinates (``cp``: ``[c, t]``; ``grid``: ``cp0·tp1``, only
    with context parallelism); the hover's words are added to ``title``.  Left out where the draft's stage does
    not define them (its check says why)."""
    out: dict[str, Any] = {"share": "", "share_pct": None, "uneven": False, "cp": None, "grid": ""}
    if place is None:
        return out
    out["cp"] = [place.cp, place.tp]
    if st.cp > 1:
        out["grid"] = place.grid_text
        title.append(f"CP group {place.cp} of {st.cp} (sequence chunk {place.cp}), TP rank {place.tp} of {st.tp}")
    if place.share is not None:
        out.update(share=share_text(place.share), share_pct=round(float(place.share) * 100, 2),
                   uneven=uneven(st.ratios))
        if out["uneven"]:
            title.append(f"holds {out['share']} ({float(place.share):.0%}) of every TP-split tensor "
                         f"(ratios {ratios_text(st.ratios)})")
    return out


def _pipelines(ed: Any) -> list[dict[str, Any]]:
    d = ed._draft
    mem_kind = "simulated" if ed._memory_kind == "simulated" else "estimate"
    out = []
    for i, p in enumerate(d.pipelines):
        stages = []
        for j, s in enumerate(p.stages):
            mem = stage_memory(ed, s.devices)
            nodes = sorted({ed.cluster.node_index(r) for r in s.devices if 0 <= r < ed.cluster.num_ranks})
            stages.append({"p": i, "s": j, "ranks": list(s.devices),
                           "ranks_text": format_ranks(s.devices) if s.devices else "no devices",
                           "tp": s.tp, "cp": s.cp, "shape": s.parallel_text,
                           **_stage_grid(s),
                           "layers": list(s.layers), "recompute": s.recompute,
                           "fill": stage_colour(i, j, len(p.stages)), "line": pipeline_colour(i),
                           "ink": ink(stage_colour(i, j, len(p.stages))),
                           "kinds": kinds_text(ed, s.devices), "nodes": len(nodes),
                           "mem": round(mem[0] / mem[1], 4) if mem else None,
                           "mem_text": f"{fmt_memory(mem[0])} of {fmt_memory(mem[1])}" if mem else "",
                           "mem_kind": mem_kind if mem else "",
                           "problems": [_problem(x) for x in stage_messages(ed, i, j)],
                           "selected": ed._selected == (i, j)})
        out.append({"p": i, "mbs": p.micro_batch_size, "nmb": p.num_micro_batches,
                    "samples": p.micro_batch_size * p.num_micro_batches, "colour": pipeline_colour(i),
                    "problems": [_problem(x) for x in stage_messages(ed, i, None)], "stages": stages})
    return out


def _stage_grid(s: Any) -> dict[str, Any]:
    """A stage's ratios (``ratios``, ``ratios_text``: ``3:1``; ``uneven``; ``shares``: each device's, in device
    order, or ``None``) and its CP grid (``cp_groups``: the TP group of each CP coordinate, or ``None``;
    ``cp_options``: the cp values its device count takes)."""
    places = stage_places(s.devices, s.ratios, s.cp)
    shares = [places[r].share for r in s.devices] if places else None
    return {"ratios": list(s.ratios) if s.ratios is not None else None, "ratios_text": ratios_text(s.ratios),
            "uneven": uneven(s.ratios),
            "shares": [share_text(x) for x in shares] if shares and None not in shares else None,
            "cp_groups": [list(s.devices[c * s.tp:(c + 1) * s.tp]) for c in range(s.cp)] if places else None,
            "cp_options": cp_divisors(len(s.devices))}


def _arrows(ed: Any, comm: Any) -> list[dict[str, Any]]:
    out = []
    for a in comm.arrows:
        v = a.per_step
        cls = "mixed" if v["intra"] and v["inter"] else "inter" if v["inter"] else "intra"
        out.append({"id": f"{a.reshard}#{a.pipeline}", "reshard": a.reshard, "p": a.pipeline, "from": a.src_stage,
                    "to": a.dst_stage, "src": list(a.src_ranks), "dst": list(a.dst_ranks), "kinds": list(a.kinds),
                    "label": a.label(), "op": " + ".join(a.kinds),
                    "bytes": " + ".join(f"{fmt_bytes(n)} {c}" for c, n in v.items() if n) or "0 B",
                    "short": (" + ".join(f"{fmt_bytes(n)} {c}" for c, n in v.items() if n) if cls == "mixed"
                              else fmt_bytes(v["intra"] + v["inter"])),
                    "intra": v["intra"], "inter": v["inter"], "cls": cls,
                    "redundant": round(a.redundancy, 2) if a.redundant else 0,
                    "fix": a.fix.describe() if a.fix is not None else ""})
    return out


def _comm(ed: Any) -> dict[str, Any]:
    state = comm_state(ed)
    valid = ed._valid
    out: dict[str, Any] = {"state": state, "arrows": [], "busiest": None, "sync": "", "stale": False}
    if valid is None or valid.comm is None or state == "none":
        return out
    comm = valid.comm
    out["arrows"] = _arrows(ed, comm)
    out["stale"] = state != "ready"
    if comm.busiest is not None:
        b = comm.busiest
        out["busiest"] = {"src": b.src, "dst": b.dst, "cls": b.cls, "text": b.describe()}
    out["sync"] = ", ".join(f"{n}× {k}" for k, n in comm.grad_sync)
    out["bindings"] = ", ".join(f"{k}={v}" for k, v in valid.program.bindings.items())
    return out


#: The paper's terms, as the canvas explains them next to a picked tensor (Hetu v2, §4: the two-tier annotation).
TERMS = {
    "DG Union": "the device groups that hold the tensor, one per sharding subgroup",
    "HSize": "Heterogeneous Size: how many sharding subgroups the DG Union has (HSize 1 is plain SPMD)",
    "HDim": "Heterogeneous Dimension: how the subgroups share the tensor -- d >= 0: subgroup k holds the k-th "
            "chunk along dim d; -1: each holds all of it (duplicate); -2: each holds a summand (partial)",
    "DS": "inside a subgroup, how its part is laid over its devices: S d×n splits dim d in n, D n duplicates "
          "on n devices, P n holds n partial sums, R replicates",
}


def _reshard_part(ed: Any, name: str) -> dict[str, Any] | None:
    prog = ed._valid.program if ed._valid else None
    plans = {} if prog is None else {**prog.grad_sync_plans, **prog.comm_plans}
    if name not in plans:
        return None
    plan = plans[name]
    c = ed.cluster
    msgs = [[s, d, n, "inter" if c.link(s, d).cls == "inter" else "intra"] for s, d, n in p2p_messages(plan)]
    vol = plan.volume(c)
    intra, inter = sum(v["intra"] for v in vol.values()), sum(v["inter"] for v in vol.values())
    groups = [{"kind": label.split(": ")[0], "ranks": [list(g) for g in gs]} for label, gs in _group_rings(plan)]
    return {"kinds": list(plan.kinds), "src": str(plan.src), "messages": msgs[:MAX_MESSAGES],
            "more": max(0, len(msgs) - MAX_MESSAGES), "groups": groups,
            "text": f"Reshard {' → '.join(plan.kinds)}: {fmt_bytes(intra)} intra-node, {fmt_bytes(inter)} "
                    f"inter-node sent (at the program's bindings)"}


def tensor_view(ed: Any, name: str) -> dict[str, Any]:
    """The picked tensor: its DG Union subgroups (own palette), HSize/HDim (with the paper's terms explained), and
    every device's shard as rectangles on a grid of the dims that are split (:func:`grid_axes`)."""
    ann = ed._valid.plan.annotations[name]
    shape = tuple(ed.tensor_shape(name))
    return {"name": name, **shard_grid(ann, shape), "reshard": _reshard_part(ed, name)}


def shard_grid(ann: Any, shape: tuple[int, ...]) -> dict[str, Any]:
    """What the canvas draws of an annotation on a tensor of ``shape``: subgroups, HSize/HDim and the paper's terms,
    and each device's shard as rectangles (fractions ``[row0, row1, col0, col1]``) on the grid of
    :func:`grid_axes`, from :func:`~hspmd_sdk.core.annotation.local_view`."""
    shape = tuple(shape)
    ann.check_shape(shape, "")
    views = []
    subgroups = []
    for k, (dg, ds) in enumerate(zip(ann.dg_union, ann.ds_union)):
        subgroups.append({"k": k, "ranks": list(dg), "ranks_text": format_ranks(dg), "ds": str(ds),
                          "colour": UNION_COLOURS[k % len(UNION_COLOURS)]})
        views += [(k, ds, r, local_view(ann, shape, r)) for r in dg]
    boxes = [tuple(tuple(x) for x in v.box) for _, _, _, v in views]
    rows, cols = grid_axes(shape, boxes)
    cuts_r, rows_of = grid_axis(rows, shape, boxes)
    cuts_c, cols_of = grid_axis(cols, shape, boxes)
    shards = {}
    for (k, ds, r, v), box in zip(views, boxes):
        rects = [[round(x, 5) for x in (r0, r1, c0, c1)] for r0, r1 in rows_of(box) for c0, c1 in cols_of(box)]
        text = ", ".join(f"dim {i} {a}:{b}" for i, (a, b) in enumerate(v.box))
        shards[str(r)] = {"k": k, "box": rects[0], "rects": rects,
                          "partial": f"Σ{v.partial_index}/{v.partial_count}" if v.partial_count > 1 else "",
                          "dup": ds.duplicate if ds.duplicate > 1 else 0,
                          "text": f"holds {text} (local shape {v.shape})"
                                  + (f", summand {v.partial_index} of {v.partial_count}"
                                     if v.partial_count > 1 else "")}
    return {"shape": list(shape), "hsize": ann.hsize, "hdim": ann.hdim, "words": hdim_words(ann),
            "grid": grid_words(shape, rows, cols), "rows": rows, "cols": cols, "terms": TERMS,
            "annotation": str(ann), "subgroups": subgroups, "shards": shards, "cuts_r": cuts_r, "cuts_c": cuts_c}


def _can(ed: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"undo": ed.can_undo, "redo": ed.can_redo, "job": ed._job is not None,
                           "launching": ed.launching}
    for action in ("save", "launch", "apply"):
        why = ed._blocked_now(action)
        out[action], out[f"{action}_why"] = not why, why
    out["timeline"] = ed._current is not None and ed._sim is not None
    return out


def canvas_view(ed: Any, *, timeline_key: str | None = None, version: int = 0) -> dict[str, Any]:
    """Everything the canvas draws for the draft shown (``version``: the redraw's number, for the front end)."""
    flagged: dict[int, str] = {}
    for p in ed._problems:
        if p.stage is not None and p.pipeline is not None:
            try:
                ranks = ed._draft.stage(p.pipeline, p.stage).devices
            except IndexError:
                continue
            for r in ranks:
                if flagged.get(r) != "error":
                    flagged[r] = p.level
    level, text = verdict(ed)
    d = ed._draft
    tensor, tensor_error = None, ""
    if ed._tensor and ed._valid is not None and ed._valid.plan is not None and ed._tensor in ed._valid.plan.annotations:
        try:
            tensor = tensor_view(ed, ed._tensor)
        except Exception as e:  # noqa: BLE001 - said in words next to the picker
            tensor_error = f"tensor {ed._tensor}: {e}"
    key = ed._current.model_dump_json() if ed._current is not None else None
    return {
        "version": version, "selected": list(ed._selected) if ed._selected else None,
        "tiles": _tiles(ed, flagged), "pipelines": _pipelines(ed), "schedule": d.schedule, "zero1": d.zero1,
        "zero": d.zero if d.zero1 else 0,
        "name": d.name or "", "global_batch": ed.global_batch, "batch_source": ed.batch_source,
        "verdict": {"level": level, "text": text},
        "problems": [_problem(p) for p in general_problems(ed)],
        "counts": {"errors": sum(p.level == "error" for p in ed._problems),
                   "warnings": sum(p.level == "warning" for p in ed._problems)},
        "comm": _comm(ed), "tensor": tensor, "tensor_name": ed._tensor or "", "tensor_error": tensor_error,
        "message": ed._message, "can": _can(ed),
        "timeline_stale": timeline_key is not None and timeline_key != key,
        "failed": sorted(ed._failed),
    }
