"""What one worker receives (SPEC §16): :meth:`Program.part(rank) <hspmd_sdk.core.specialize.Program.part>`.

A :class:`~hspmd_sdk.core.specialize.ProgramPart` (defined beside :class:`~hspmd_sdk.core.specialize.Program`,
which it extends: this module imports nothing of ``specialize``, so that ``Program.part`` can call it) is a
Program cut down to what rank ``rank`` executes:

* its executable graph's inputs: the defined graph and every tensor's annotation (the model's size, not the
  world's), its own compute operators, which nodes and gradient synchronisations it takes part in;
* its own pipeline stage and schedule (the other pipelines are empty lists; their micro-batch counts 0, but at
  ZeRO-3, where a replica running fewer micro-batches joins the others' gathers);
* the communication plans its executable graph runs, each reduced to the rank's own part: a collective keeps
  only the group the rank is in, a top-tier collective the slice collectives the rank is in, a point-to-point
  operator the messages the rank sends or receives — the others are replaced by one empty placeholder
  message (:func:`no_message`), so that a message keeps its index, which is its tag on the wire — and the
  boxes of the rank;
* the Program's digest (:meth:`~hspmd_sdk.core.specialize.ProgramPart.digest`, SHA-256 of the whole Program's
  JSON: what the peers agree on), the number of ranks of the whole Program, the whole Program's process groups
  and stage-boundary pairs (torch creates a group with every rank of the job) and a ``version`` (the
  launcher's numbering of switches).

Asked about another rank, a part raises :class:`ProgramPartError` naming both ranks.  What it answers for its
own rank is what the whole Program answers, with communication plans restricted as above (the operator kinds
and the bytes the rank sends are unchanged).  The cluster and the annotation plan (both the size of the world)
are left out: a part's ``cluster`` is ``None`` and its ``plan`` keeps only the world-independent execution
settings.

The JSON of a part (:func:`part_to_json`) is the Program JSON form (:mod:`.program_json`) with two
further steps that make it independent of the world size for a fixed model and stage shape: equal objects are
written once (a data-parallel replica's ``DS`` is one object, not one per replica), and runs inside lists are
written compactly — ``{"$A": [start, step, n]}`` for an arithmetic run of integers (``(0, 4, 8, ...)``, the
ranks of a data-parallel group), ``{"$P": [block, shift, n]}`` for a block of integers repeated ``n`` times,
each time shifted by ``shift`` (``[0, 3, 4, 7, 8, 11]``), ``{"$L": [first, deltas, n]}`` for ``n`` values of one
shape whose integers each change by a constant from one to the next (a DG Union ``[[0, 1], [4, 5], ...]``,
the consecutive boxes of ZeRO's shards, consecutive object references and records), ``{"$R": [value, n]}`` for
``n`` equal values.  Reading expands them back first: the round trip is exact (``==``).

What still grows with the world: the rank lists of a group that spans replicas when they are irregular (a
heterogeneous layout whose ranks form no arithmetic run), and the boxes of a collective whose members hold
different boxes (ZeRO's reduce-scatter over data-parallel replicas: one box per replica).  What does not shrink
with the stage: a part holds the whole defined graph and every tensor's annotation (the model's size: 1.9 MB of
JSON for Llama-70B, whose whole Program is 3.4 MB at 48 ranks and 10 MB at 1,024).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import SpecializationError
from .annotation import Annotation
from .comm_ops import CollectiveOp, Message, PointToPointOp, SplitCollectiveOp
from .gc_pause import gc_paused

if TYPE_CHECKING:
    from .comm_plan import CommPlan

__all__ = ["ProgramPartError", "PART_FORMAT", "no_message", "make_part", "restrict_plan", "program_digest",
           "PlanParts",
           "world_groups", "world_pipeline_pairs", "part_to_json", "part_json", "part_from_json", "pack_json",
           "unpack_json"]

#: The format tag of a part's JSON; a reader refuses any other.
PART_FORMAT = "hspmd-program-part/1"


def no_message(ndim: int) -> Message:
    """The placeholder for a message of a point-to-point operator that the part's rank neither sends nor
    receives: ranks ``-1``, an empty box of ``ndim`` dims at the origin (no elements: it meets no batch chunk when
    a plan is micro-batched), no bytes (no transfer, no edge).  Messages keep their index: it is their tag."""
    return Message(-1, -1, ((0, 0),) * ndim, 0)


class ProgramPartError(SpecializationError):
    """A part was asked about another rank, or its JSON cannot be read; the message names the ranks."""


# ---- the part's JSON ---------------------------------------------------------------------------------------------
@gc_paused
def part_to_json(part: Any) -> str:
    """The JSON text of ``part`` (:meth:`ProgramPart.to_json <hspmd_sdk.core.specialize.ProgramPart.to_json>`):
    the Program form, equal objects once, runs compact."""
    from .program_json import to_json_value

    data = to_json_value(part)
    objects, root, _ = _dedup(data["objects"], data["root"])
    body = {"format": PART_FORMAT, "rank": part.rank, "digest": part.program_digest, "version": part.version,
            "objects": pack_json(objects), "root": root}
    return json.dumps(body, separators=(",", ":"))


@gc_paused
def part_json(program: Any, rank: int, *, version: int = 0) -> str:
    """Rank ``rank``'s part of ``program`` as JSON text, for a launcher that writes every rank's: read back by
    ``ProgramPart.from_json`` it equals ``program.part(rank)``, but what every part holds alike (the defined
    graph, the model config, the annotations, the gradient synchronisations, the shape constraints) is written
    once per Program (cached on it) and reused; each rank's own objects follow."""
    part = program.part(rank, version=version)
    key = ("part_shared",)
    shared = program._micro.get(key)
    if shared is None:
        shared = program._micro[key] = _shared_section(program)
    objects, root = _section_text(shared, part)
    head = json.dumps({"format": PART_FORMAT, "rank": part.rank, "digest": part.program_digest,
                       "version": part.version}, separators=(",", ":"))[:-1]
    return head + ',"objects":[' + objects + '],"root":' + json.dumps(root, separators=(",", ":")) + "}"


def _shared_section(program: Any) -> tuple[int, dict[int, int], str, list[Any]]:
    """What every part of ``program`` holds alike, written once: ``(records, id -> index, the records' packed
    JSON text without its brackets, the objects kept alive)``."""
    # every annotation any part may hold: the tensors', and the ends of every communication plan (a part keeps a
    # plan's annotations as they are while it restricts the plan's operators to its rank)
    plans = (*program.comm_plans.values(), *program.backward_plans.values(), *program.grad_reduce_plans.values(),
             *program.grad_sync_plans.values())
    ends = [a for p in plans for a in (p.src, p.dst)]
    # and the annotations in the plans' keys (the layouts a micro-batch plan is looked up by)
    keyed = [a for key in program._plan_keys.values() for a in key if isinstance(a, Annotation)]
    distinct = list({id(a): a for a in (*program.annotations.values(), *ends, *keyed)}.values())
    return _shared_records((program.graph, program.model, tuple(distinct), program.grad_syncs, program.constraints))


def _shared_records(value: Any) -> tuple[int, dict[int, int], str, list[Any]]:
    """The object records of ``value``, written once for many texts that refer to them (:func:`_section_text`):
    ``(records, id -> index, the records' packed JSON text without its brackets, the objects kept alive)``."""
    from .program_json import _Writer

    w = _Writer()
    w.value(value)
    objects, _, index = _dedup(w.objects, [{"$ref": k} for k in range(len(w.objects))])  # every record
    ids = {oid: index[i] for oid, i in w._ids.items()}
    return len(objects), ids, json.dumps(pack_json(objects), separators=(",", ":"))[1:-1], w._keep


def _section_text(shared: tuple[int, dict[int, int], str, list[Any]], value: Any) -> tuple[str, Any]:
    """``value``'s object records after the ``shared`` ones (:func:`_shared_records`), which it refers to by
    index: ``(the records' text, the shared ones first, without brackets; the root)``, packed compact."""
    from .program_json import _Writer

    count, ids, text, _ = shared
    w = _Writer()
    w.objects, w._ids = [None] * count, dict(ids)
    root = w.value(value)
    objects, root, _ = _dedup(w.objects, root, fixed=count)
    own = json.dumps(pack_json(objects[count:]), separators=(",", ":"))[1:-1]
    return ",".join(t for t in (text, own) if t), root


class PlanParts:
    """Every rank's part of the switch ``plan`` (``plan.part(rank)``), each as the compact payload text of
    :func:`hspmd_sdk.runtime.protocol.pack_payload` (``compact=True``), which ``unpack_payload`` reads back equal.
    What every part holds alike (the tensors' layouts, the cluster) is written once, at the first part asked, and
    reused, so that writing every rank's part costs the launcher the world once, not once a rank: whoever sends a
    plan's parts makes one of these for the plan and asks it for each rank's (it lives as long as they keep it)."""

    __slots__ = ("plan", "_shared")

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self._shared: tuple[int, dict[int, int], str, list[Any]] | None = None

    @property
    def shared(self) -> tuple[int, dict[int, int], str, list[Any]]:
        """The records every part holds alike (:func:`_shared_records` of the plan's tensors and cluster), written
        the first time they are asked for."""
        if self._shared is None:
            self._shared = _shared_records((self.plan.tensors, self.plan.cluster))
        return self._shared

    @gc_paused
    def json(self, rank: int) -> str:
        """Rank ``rank``'s part of the plan as compact payload text: the shared records, then its own."""
        from .program_json import FORMAT

        objects, root = _section_text(self.shared, self.plan.part(rank))
        return ('{"format":' + json.dumps(FORMAT) + ',"packed":{"objects":[' + objects + '],"root":'
                + json.dumps(pack_json(root), separators=(",", ":")) + "}}")


@gc_paused
def part_from_json(text: str | bytes, cls: type) -> Any:
    """The part (of class ``cls``) that :func:`part_to_json` wrote."""
    from .program_json import from_json_value

    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProgramPartError(f"not a Program part's JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != PART_FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ProgramPartError(f"not a Program part's JSON of format {PART_FORMAT!r} (got {got!r})")
    out = from_json_value({"objects": unpack_json(data["objects"]), "root": data["root"]})
    if not isinstance(out, cls):
        raise ProgramPartError(f"the JSON holds a {type(out).__name__}, not a ProgramPart")
    if out.rank != data.get("rank") or out.program_digest != data.get("digest"):
        raise ProgramPartError(f"damaged part: its header says rank {data.get('rank')} of "
                               f"{str(data.get('digest'))[:12]}, its body rank {out.rank} of "
                               f"{out.program_digest[:12]}")
    return out


def rank_guard(part: Any, rank: int, what: str) -> None:
    """Raise :class:`ProgramPartError` naming both ranks if ``rank`` is not ``part``'s rank."""
    if int(rank) != part.rank:
        raise ProgramPartError(f"{what}: this is rank {part.rank}'s part of Program {part.program_digest[:12]} "
                               f"(version {part.version}); rank {rank} is not in it — ask the whole Program, or "
                               "that rank's part")


def world_groups_of(families: Any) -> tuple[tuple[int, ...], ...]:
    """The groups that :func:`_group_families` wrote by shape, sorted."""
    return tuple(sorted(tuple(a + d for d in offsets) for offsets, firsts in families for a in firsts))


def world_pairs_of(families: Any) -> tuple[tuple[int, int, int], ...]:
    """The pairs that :func:`_pair_families` wrote by direction and distance, sorted."""
    return tuple(sorted((direction, low, low + gap) for direction, gap, lows in families for low in lows))


# ---- making a part -----------------------------------------------------------------------------------------------
def program_digest(program: Any) -> str:
    """SHA-256 (hex) of ``program``'s JSON: what every rank's part carries, so that peers can check that they run
    parts of one Program.  Cached on the Program."""
    key = ("digest",)
    got = program._micro.get(key)
    if got is None:
        got = program._micro[key] = hashlib.sha256(program.to_json().encode("utf-8")).hexdigest()
    return got


def _all_plans(program: Any) -> list[Any]:
    return (list(program.comm_plans.values()) + list(program.backward_plans.values())
            + list(program.grad_reduce_plans.values()) + list(program.grad_sync_plans.values()))


def world_groups(program: Any) -> tuple[tuple[int, ...], ...]:
    """Every rank set (sorted, >= 2 ranks) that a collective of ``program`` runs on, sorted: the process groups
    every rank of the job creates (the runtime's ``comm_groups`` of the Program's plans).  Cached."""
    from .comm_ops import OpKind

    key = ("world_groups",)
    got = program._micro.get(key)
    if got is None:
        sets: set[tuple[int, ...]] = set()
        seen: set[int] = set()
        for plan in _all_plans(program):
            if id(plan) in seen:
                continue
            seen.add(id(plan))
            for op in plan.ops:
                if getattr(op, "kind", None) is not OpKind.LOCAL_SPLIT:
                    sets.update(tuple(sorted(g)) for g in op.collective_groups() if len(g) >= 2)
        got = program._micro[key] = tuple(sorted(sets))
    return got


def world_pipeline_pairs(program: Any) -> tuple[tuple[int, int, int], ...]:
    """``(direction, low rank, high rank)`` of every pair of ranks of ``program`` that exchanges stage-boundary
    messages (the runtime's ``pipeline_pairs``: a rank holding only the source of a Reshard with one holding
    only its destination; direction 0 activations, 1 gradients), sorted.  Cached."""
    key = ("world_pipeline_pairs",)
    got = program._micro.get(key)
    if got is not None:
        return got
    out: set[tuple[int, int, int]] = set()
    for op in program.graph.nodes:
        if op.kind != "Reshard" or op.name not in program.comm_plans:
            continue
        if program.graph.producer(op.inputs[0]).kind == "parameter":
            continue
        src, dst = set(program.annotations[op.inputs[0]].ranks), set(program.annotations[op.outputs[0]].ranks)
        only = (src - dst, dst - src)
        for direction, plan in ((0, program.comm_plans[op.name]), (1, program.backward_plans.get(op.name))):
            senders, receivers = only if direction == 0 else only[::-1]
            for o in plan.ops if plan is not None else ():
                if isinstance(o, PointToPointOp):
                    out.update((direction, min(m.src, m.dst), max(m.src, m.dst)) for m in o.messages
                               if m.src in senders and m.dst in receivers)
    got = program._micro[key] = tuple(sorted(out))
    return got


def restrict_plan(plan: "CommPlan", rank: int) -> "CommPlan":
    """``plan`` as rank ``rank`` executes it: each operator reduced to the rank's own groups, slices, messages
    and boxes (see the module docstring); no cluster.  The kinds and the bytes ``rank`` sends are unchanged."""
    filler = no_message(len(plan.shape))
    return dataclasses.replace(plan, ops=tuple(_restrict_op(op, rank, filler) for op in plan.ops), cluster=None)


def _restrict_op(op: Any, rank: int, filler: Message) -> Any:
    if isinstance(op, CollectiveOp):
        return dataclasses.replace(op, groups=tuple(g for g in op.groups if rank in g.ranks))
    if isinstance(op, SplitCollectiveOp):
        return dataclasses.replace(op, slices=tuple(s for s in op.slices if rank in s.ranks),
                                   in_boxes=tuple(b for b in op.in_boxes if b[0] == rank),
                                   out_boxes=tuple(b for b in op.out_boxes if b[0] == rank))
    if isinstance(op, PointToPointOp):
        return dataclasses.replace(
            op, messages=tuple(m if rank in (m.src, m.dst) else filler for m in op.messages),
            copies=tuple(c for c in op.copies if c[0] == rank), in_boxes=tuple(b for b in op.in_boxes if b[0] == rank),
            out_boxes=tuple(b for b in op.out_boxes if b[0] == rank),
            zero_fill=tuple(r for r in op.zero_fill if r == rank))
    return op  # Identity: nothing moves, nothing to restrict


@gc_paused
def make_part(program: Any, rank: int, cls: type, *, version: int = 0) -> Any:
    """Rank ``rank``'s part of ``program`` (:meth:`Program.part`), of class ``cls`` (``ProgramPart``)."""
    from .plan import AnnotationPlan, ExecutionSettings

    rank = int(rank)
    if not any(rank in s for s in program._node_ranks.values()):
        raise ProgramPartError(f"rank {rank} takes part in no operator of this program (ranks "
                               f"{program.ranks[:8]}{' ...' if len(program.ranks) > 8 else ''}); it has no part")
    eg = program.executable_graph(rank)
    used = {op.name for op in eg.ops if op.comm is not None}
    restricted: dict[int, Any] = {}

    def keep(plans: Mapping[str, Any], name_of: Any) -> dict[str, Any]:
        out = {}
        for key, plan in plans.items():
            if name_of(key) in used:
                got = restricted.get(id(plan))
                if got is None:
                    got = restricted[id(plan)] = restrict_plan(plan, rank)
                out[key] = got
        return out

    comm = keep(program.comm_plans, lambda k: k)
    back = keep(program.backward_plans, lambda k: f"{k}.bwd")
    reduce = keep(program.grad_reduce_plans, lambda k: f"{k}.grad_reduce")
    sync = keep(program.grad_sync_plans, lambda k: k)
    names = set(comm) | {f"{k}.bwd" for k in back} | {f"{k}.grad_reduce" for k in reduce} | set(sync)
    where = {rank: program._where[rank]} if rank in program._where else {}
    own_p = where[rank][0] if where else None
    pipelines = [list(map(list, p)) if i == own_p else [] for i, p in enumerate(program.pipelines)]
    # at ZeRO-3 every pipeline's count: a replica running fewer micro-batches joins the others' gathers (.zero3)
    every = program.plan.settings.zero >= 3
    micro = tuple(m if i == own_p or every else 0 for i, m in enumerate(program.micro_batches))
    sizes = tuple(m if i == own_p else 0 for i, m in enumerate(program.micro_batch_sizes))
    mine, none = frozenset({rank}), frozenset()
    s = program.plan.settings
    settings = ExecutionSettings(schedule=s.schedule, zero=s.zero, zero1=s.zero1, zero1_replicated=s.zero1_replicated,
                                 max_seq_len=s.max_seq_len)
    return cls(
        graph=program.graph, plan=AnnotationPlan(annotations={}, settings=settings), cluster=None,
        annotations=program.annotations, comm_plans=comm, backward_plans=back, grad_reduce_plans=reduce,
        grad_sync_plans=sync, pipelines=pipelines, bindings=program.bindings, constraints=program.constraints,
        schedule_kind=program.schedule_kind, micro_batches=micro, micro_batch_sizes=sizes,
        pre_reshards=program.pre_reshards, grad_syncs=program.grad_syncs,
        schedules={where[rank]: program.schedules[where[rank]]} if where else {},
        recompute=program.recompute & mine, model=program.model,
        _node_ranks={n: mine if rank in r else none for n, r in program._node_ranks.items()},
        _where=where, _compute_ops={n: o for n, o in program._compute_ops.items() if rank in program._node_ranks[n]},
        _plan_keys={n: k for n, k in program._plan_keys.items() if n in names},
        _sync_ranks=tuple(mine if rank in r else none for r in program._sync_ranks),
        rank=rank, program_digest=program_digest(program), world_ranks=len(program.ranks),
        version=int(version), _group_families=_group_families(world_groups(program)),
        _pair_families=_pair_families(world_pipeline_pairs(program)))


def _group_families(groups: Any) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Groups by their shape (offsets from their first rank): ``((offsets, first ranks), ...)``.  A regular
    layout's first ranks form arithmetic or periodic runs, which the part's JSON writes in constant size."""
    out: dict[tuple[int, ...], list[int]] = {}
    for g in groups:
        out.setdefault(tuple(r - g[0] for r in g), []).append(g[0])
    return tuple((k, tuple(v)) for k, v in sorted(out.items()))


def _pair_families(pairs: Any) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    out: dict[tuple[int, int], list[int]] = {}
    for direction, low, high in pairs:
        out.setdefault((direction, high - low), []).append(low)
    return tuple((d, gap, tuple(v)) for (d, gap), v in sorted(out.items()))


# ---- the compact JSON --------------------------------------------------------------------------------------------
def _dedup(objects: list[Any], root: Any, fixed: int = 0) -> tuple[list[Any], Any, dict[int, int]]:
    """Equal object records written once: every ``$ref`` points at the first record of its value.  Records
    below index ``fixed`` are kept as they are, at their indices (a section written before).  Returns the
    records, the root and the new index of every old one."""
    canon: dict[int, int] = {}
    seen: dict[str, int] = {}
    recs: dict[int, Any] = {}

    def refs(v: Any) -> Any:
        if type(v) is list:
            return [refs(x) for x in v]
        if type(v) is dict:
            if len(v) == 1 and "$ref" in v:
                return {"$ref": visit(int(v["$ref"]))}
            return {k: refs(x) for k, x in v.items()}
        return v

    def visit(i: int) -> int:
        if i < fixed:
            return i
        got = canon.get(i)
        if got is not None:
            return got
        rec = objects[i]
        rec = rec if "$model" in rec else {**rec, "f": refs(rec["f"])}
        key = json.dumps(rec, separators=(",", ":"))
        first = seen.setdefault(key, i)
        canon[i] = first
        recs.setdefault(first, rec)
        return first

    root = refs(root)
    order = {i: fixed + k for k, i in enumerate(sorted(recs))}

    def renumber(v: Any) -> Any:
        if type(v) is list:
            return [renumber(x) for x in v]
        if type(v) is dict:
            if len(v) == 1 and "$ref" in v:
                i = v["$ref"]
                return v if i < fixed else {"$ref": order[i]}
            return {k: renumber(x) for k, x in v.items()}
        return v

    out = objects[:fixed] + [recs[i] if "$model" in recs[i] else {**recs[i], "f": renumber(recs[i]["f"])}
                             for i in sorted(recs)]
    return out, renumber(root), {i: order[c] for i, c in canon.items()}


def _skeleton(v: Any) -> tuple[str, list[int]]:
    """``v``'s shape with its integers taken out (a key: equal for values that differ only in integers) and its
    integers in walk order."""
    ints: list[int] = []

    def walk(x: Any) -> Any:
        t = type(x)
        if t is int:
            ints.append(x)
            return _HOLE
        if t is list:
            return [walk(y) for y in x]
        if t is dict:
            return {k: walk(y) for k, y in x.items()}
        return x

    return json.dumps(walk(v), separators=(",", ":"), default=lambda _: "\u0000int"), ints


def _fill(v: Any, ints: Any) -> Any:
    """``v`` with its integers, in walk order, replaced by those of ``ints`` (an iterator)."""
    t = type(v)
    if t is int:
        return next(ints)
    if t is list:
        return [_fill(y, ints) for y in v]
    if t is dict:
        return {k: _fill(y, ints) for k, y in v.items()}
    return v


class _Hole:
    """Where an integer was, in a :func:`_skeleton`."""


_HOLE = _Hole()


def pack_json(v: Any) -> Any:
    """``v`` (a JSON value of :mod:`.program_json`'s form) with its lists' runs written compactly (``$A``,
    ``$P``, ``$L``, ``$R``; module docstring).  A model config's record (``$model``) is left as it is.
    :func:`unpack_json` is its inverse."""
    t = type(v)
    if t is list:
        return _pack_list(v)
    if t is dict:
        return v if "$model" in v else {k: pack_json(x) for k, x in v.items()}
    return v


def _pack_list(items: list[Any]) -> list[Any]:
    """Runs are found among the values as written (each packed first): a run's integers are few even where the
    values expand to many (a DG Union of every replica)."""
    items = [x if type(x) is int else pack_json(x) for x in items]
    skeletons: dict[int, tuple[str, list[int]]] = {}
    out: list[Any] = []
    i, n = 0, len(items)
    while i < n:
        x = items[i]
        if type(x) is int:
            j = i + 1
            if j < n and type(items[j]) is int:
                step = items[j] - x
                while j < n and type(items[j]) is int and items[j] - items[j - 1] == step:
                    j += 1
            if j - i >= 3:
                out.append({"$A": [x, step, j - i]})
                i = j
                continue
            block, shift, count = _period(items, i)
            if count >= 3:
                out.append({"$P": [block, shift, count]})
                i += len(block) * count
                continue
            out.append(x)
            i += 1
            continue
        j, deltas = _linear_run(items, i, skeletons)
        if j - i >= 2:
            out.append({"$R": [x, j - i]} if not any(deltas) else {"$L": [x, deltas, j - i]})
        elif type(x) is dict and len(x) == 1 and next(iter(x)) in _MARKERS:
            out.append({"$R": [x, 1]})  # a value that reads as a run: written as a run of itself
        else:
            out.append(x)
        i = j
    return out


#: the keys of a one-key object that :func:`unpack_json` reads as a run inside a list
_MARKERS = frozenset({"$A", "$P", "$L", "$R"})


def _linear_run(items: list[Any], i: int, skeletons: dict[int, tuple[str, list[int]]]) -> tuple[int, list[int]]:
    """The end of the run of values from ``items[i]`` of one shape whose integers each change by a constant
    from one value to the next (``deltas``, in walk order): equal values, shifted rank lists, consecutive
    boxes, consecutive references.  ``skeletons``: index -> :func:`_skeleton`, filled as needed."""
    x = items[i]
    if i + 1 == len(items) or (type(x) is dict and "$model" in x):
        return i + 1, []

    def skeleton(k: int) -> tuple[str, list[int]]:
        got = skeletons.get(k)
        if got is None:
            got = skeletons[k] = _skeleton(items[k])
        return got

    if _outline(x) != _outline(items[i + 1]):  # a cheap look first: most neighbours differ in kind
        return i + 1, []
    key, prev = skeleton(i)
    deltas: list[int] | None = None
    j = i + 1
    while j < len(items) and type(items[j]) is not int:
        if _outline(items[j]) != _outline(x):
            break
        k, ints = skeleton(j)
        if k != key:
            break
        d = [b - a for a, b in zip(prev, ints)]
        if deltas is not None and d != deltas:
            break
        deltas, prev = d, ints
        j += 1
    return j, deltas or [0] * len(prev)


def _outline(v: Any) -> Any:
    """A cheap necessary condition for two values to have one :func:`_skeleton`: type, keys (and an object
    record's class), length."""
    t = type(v)
    if t is dict:
        return tuple(v), v.get("$c") or v.get("$p")
    if t is list:
        return len(v)
    return t


def _period(items: list[Any], i: int, longest: int = 8) -> tuple[list[int], int, int]:
    """The block of ``L <= longest`` ints at ``items[i:]`` repeated, each repeat shifted by one non-zero
    ``shift``, the most times (``[0, 1, 4, 5, 8, 9]``: block ``[0, 1]``, shift 4, 3 times)."""
    best: tuple[list[int], int, int] = ([], 0, 0)
    n = len(items)
    for size in range(2, longest + 1):
        if i + 2 * size > n or any(type(items[k]) is not int for k in range(i, i + 2 * size)):
            break
        shift = items[i + size] - items[i]
        if shift == 0:
            continue
        count = 1
        while i + (count + 1) * size <= n and all(
                type(items[i + count * size + k]) is int and items[i + count * size + k] - items[i + k] == count * shift
                for k in range(size)):
            count += 1
        if count * size > len(best[0]) * best[2]:
            best = (list(items[i:i + size]), shift, count)
    return best


def unpack_json(v: Any) -> Any:
    """The inverse of :func:`pack_json`."""
    t = type(v)
    if t is dict:
        return v if "$model" in v else {k: unpack_json(x) for k, x in v.items()}
    if t is not list:
        return v
    out: list[Any] = []
    for x in v:
        if type(x) is dict and len(x) == 1:
            if "$A" in x:
                a, step, count = (int(y) for y in x["$A"])
                out.extend(a + k * step for k in range(count))
                continue
            if "$P" in x:
                block, shift, count = [int(y) for y in x["$P"][0]], int(x["$P"][1]), int(x["$P"][2])
                out.extend(e + k * shift for k in range(count) for e in block)
                continue
            if "$L" in x:  # the run's values as written (packed): each is unpacked after its integers are set
                first, deltas, count = x["$L"][0], [int(d) for d in x["$L"][1]], int(x["$L"][2])
                ints = _skeleton(first)[1]
                if len(ints) != len(deltas):
                    raise ProgramPartError(f"damaged part: a run of {str(first)[:60]} with {len(deltas)} deltas "
                                           f"for {len(ints)} integers")
                out.extend(unpack_json(_fill(first, iter([a + k * d for a, d in zip(ints, deltas)])))
                           for k in range(count))
                continue
            if "$R" in x:
                value, count = unpack_json(x["$R"][0]), int(x["$R"][1])
                out.extend(value for _ in range(count))
                continue
        out.append(unpack_json(x))
    return out
