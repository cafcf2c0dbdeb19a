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

A launcher writes every rank's part with :func:`part_json`, through the Program's :class:`ProgramParts`: what all
parts share is written once, what the ranks of one class (the same operators placed, the same gradient reductions
and synchronisations) share once for the class, and each rank's own restricted plans by index; the text is byte
for byte that of the part made whole and written object by object (the class's first part is checked against it).

What still grows with the world: the rank lists of a group that spans replicas when they are irregular (a
heterogeneous layout whose ranks form no arithmetic run), and the boxes of a collective whose members hold
different boxes (ZeRO's reduce-scatter over data-parallel replicas: one box per replica).  What does not shrink
with the stage: a part holds the whole defined graph and every tensor's annotation (the model's size: 1.9 MB of
JSON for Llama-70B, whose whole Program is 3.4 MB at 48 ranks and 10 MB at 1,024).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import SpecializationError
from .annotation import Annotation
from .comm_ops import CollectiveGroup, CollectiveOp, Message, PointToPointOp, SliceCollective, SplitCollectiveOp
from .gc_pause import gc_paused

if TYPE_CHECKING:
    from .comm_plan import CommPlan

__all__ = ["ProgramPartError", "PART_FORMAT", "no_message", "make_part", "restrict_plan", "program_digest",
           "PlanParts", "ProgramParts", "switch_index",
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
    once per Program and reused; each rank's own objects follow.  Written by the Program's
    :class:`ProgramParts` (cached on it), which writes what ranks of one class share once for the class."""
    key = ("part_writer",)
    parts = program._micro.get(key)
    if parts is None:
        parts = program._micro[key] = ProgramParts(program)
    return parts.json(rank, version=version)


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

    __slots__ = ("plan", "_shared", "_index")

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self._shared: tuple[int, dict[int, int], str, list[Any]] | None = None
        self._index: list[Any] | None = None

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

        if self._index is None:  # each step's messages, copies and zero fills by rank, listed once for all parts
            self._index = switch_index(self.plan)
        objects, root = _section_text(self.shared, self.plan.part(rank, index=self._index))
        return ('{"format":' + json.dumps(FORMAT) + ',"packed":{"objects":[' + objects + '],"root":'
                + json.dumps(pack_json(root), separators=(",", ":")) + "}}")


def _part_json_reference(program: Any, rank: int, *, version: int = 0) -> str:
    """Rank ``rank``'s part JSON as :func:`part_json` writes it, by the general way: ``program.part(rank)`` made
    whole, then written object by object after the Program's shared section.  What :class:`ProgramParts` checks
    each class's first part against."""
    part = program.part(rank, version=version)
    objects, root = _section_text(_program_shared(program), part)
    head = json.dumps({"format": PART_FORMAT, "rank": part.rank, "digest": part.program_digest,
                       "version": part.version}, separators=(",", ":"))[:-1]
    return head + ',"objects":[' + objects + '],"root":' + json.dumps(root, separators=(",", ":")) + "}"


def _program_shared(program: Any) -> tuple[int, dict[int, int], str, list[Any]]:
    """:func:`_shared_section` of ``program``, written once per Program (cached on it)."""
    key = ("part_shared",)
    shared = program._micro.get(key)
    if shared is None:
        shared = program._micro[key] = _shared_section(program)
    return shared


def _dumps(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"))


def _plain_text(value: Any) -> str:
    """The packed JSON text of ``value``, a value holding no object of a core class (ints, strings, sets ...)."""
    from .program_json import _Writer

    return _dumps(pack_json(_Writer().value(value)))


#: A rank id no Program holds: a class's rank-only fields are written once with it, and it is then replaced.
_SENTINEL = 918_273_645_546_372_819_000_001


class _PartClass:
    """What the parts of ranks of one class (:meth:`ProgramParts._key`) share: the representative's part, the
    texts of the fields equal for the class, the templates of the rank-only fields (their text split where the
    rank is written), and whether the class's parts are written by the general way (its check failed)."""

    __slots__ = ("part", "keys", "plan_keys", "node_ranks", "sync_ranks", "general")

    def __init__(self, part: Any) -> None:
        self.part = part
        #: the names of the plans the class's ranks run, per plan table (in the Program's order)
        self.keys = tuple(tuple(getattr(part, f)) for f in _PLAN_TABLES)
        self.plan_keys = ""
        self.node_ranks: list[str] | None = None
        self.sync_ranks: list[str] | None = None
        self.general = False


#: the fields of a part that hold its restricted communication plans, in the record's order
_PLAN_TABLES = ("comm_plans", "backward_plans", "grad_reduce_plans", "grad_sync_plans")
#: the fields of a part whose value is the Program's, whatever the rank
_CONST_FIELDS = frozenset({"graph", "cluster", "annotations", "bindings", "constraints", "schedule_kind",
                           "pre_reshards", "grad_syncs", "model", "program_digest", "world_ranks",
                           "_group_families", "_pair_families"})


class ProgramParts:
    """Every rank's part of ``program`` as the JSON text of :func:`part_json`, for a launcher that writes every
    rank's (launch, switch, recovery): what all parts share is written once per Program, what the parts of one
    *class* of ranks share once for the class, and for each rank only what is its own, so that writing every
    rank's part costs about the world once, not once a rank.

    A class: the ranks that place the same operators and take part in the same gradient reductions and
    synchronisations (:meth:`_key`) — their executable graphs hold the same operators, so their parts hold the
    same compute operators, plan keys and plan names and differ in the rank, its stage, and the restricted
    communication plans.  The first part of a class is made whole (:meth:`Program.part`) and written by the
    general way; the fast text of that rank is checked against it (a class whose check fails is written by the
    general way).  A rank's own communication plans are restricted by index (each operator's groups, slices,
    messages and boxes listed by rank once per plan) and written as one section of records.

    The text is byte for byte that of the general way: the part's records are its object (first), its
    ``AnnotationPlan`` and settings, the records of its plans, its schedule's actions, its compute operators; no
    two sections hold records of one class, so equal records and compact runs never span two sections, and each
    section is written (deduplicated, packed) alone at its place."""

    def __init__(self, program: Any) -> None:
        self.program = program
        self._node_sets = tuple(program._node_ranks.values())
        self._reduced = tuple(program.grad_reduce_plans)
        self._classes: dict[Any, _PartClass] = {}
        self._sections: dict[Any, tuple[str, str, int]] = {}
        self._templates: dict[Any, tuple[str, list[str], list[int], int]] = {}
        self._dependent: set[Any] = set()
        self._indexes: dict[int, list[Any]] = {}
        self._fields: dict[Any, str] = {}
        self._fillers: dict[int, Message] = {}
        #: the records of the plans' leaves (messages, groups, slices: the Program's objects, kept alive here),
        #: written once: id(object) -> (object, record); id(record) -> its JSON text; id(record) -> packed;
        #: id(packed) -> its skeleton
        self._leaves: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._leaf_keys: dict[int, str] = {}
        self._leaf_packed: dict[int, Any] = {}
        self._leaf_skeletons: dict[int, tuple[str, list[int]]] = {}
        #: how many classes failed their check (written by the general way)
        self.fallbacks = 0

    @property
    def shared(self) -> tuple[int, dict[int, int], str, list[Any]]:
        """The records every part holds alike (:func:`_shared_section`), cached on the Program."""
        return _program_shared(self.program)

    def _key(self, rank: int) -> tuple[Any, ...]:
        """What rank ``rank``'s executable graph's operators are a function of (``_instantiate``): which nodes
        it is placed on, which gradient synchronisations it takes part in, which reduced gradients it holds."""
        p = self.program
        anns = p.annotations
        return (tuple(rank in s for s in self._node_sets), tuple(rank in s for s in p._sync_ranks),
                tuple(t in anns and anns[t].locate(rank) is not None for t in self._reduced))

    @gc_paused
    def json(self, rank: int, *, version: int = 0) -> str:
        """Rank ``rank``'s part of the Program as JSON text, byte for byte :func:`_part_json_reference`'s.  Raises
        ``ProgramPartError`` naming the rank if it takes part in no operator."""
        rank = int(rank)
        key = self._key(rank)
        cls = self._classes.get(key)
        if cls is None:
            cls = self._classes[key] = self._new_class(rank)
            if self._text(cls, rank, version) != _part_json_reference(self.program, rank, version=version):
                cls.general = True
                self.fallbacks += 1
        if cls.general:
            return _part_json_reference(self.program, rank, version=version)
        return self._text(cls, rank, version)

    # ---- a class ---------------------------------------------------------------------------------------------
    def _new_class(self, rank: int) -> _PartClass:
        part = self.program.part(rank)  # raises naming the rank if it takes part in nothing
        cls = _PartClass(part)
        cls.plan_keys = self._const_text(part._plan_keys)
        cls.node_ranks = _template(part._node_ranks, rank)
        cls.sync_ranks = _template(part._sync_ranks, rank)
        return cls

    def _const_text(self, value: Any) -> str:
        """The packed text of a value that refers to shared records only."""
        count, ids, _, _ = self.shared
        from .program_json import _Writer

        w = _Writer()
        w.objects, w._ids = [None] * count, dict(ids)
        out = _dumps(pack_json(w.value(value)))
        if len(w.objects) != count:
            raise ProgramPartError("a part's field that every class shares holds records of its own")
        return out

    # ---- a rank's text ---------------------------------------------------------------------------------------
    def _text(self, cls: _PartClass, rank: int, version: int) -> str:
        p, part = self.program, cls.part
        count = self.shared[0]
        where = p._where.get(rank)
        own = where[0] if where is not None else None
        mine: dict[int, Any] = {}
        tables = tuple({k: self._restricted(getattr(p, f)[k], rank, mine) for k in keys}
                       for f, keys in zip(_PLAN_TABLES, cls.keys))
        head_text, plan_field, heads = self._section(("head",), part.plan, count + 1)
        plans_text, plans_root, plans = self._write_plans(tables, count + 1 + heads)
        acts = count + 1 + heads + plans
        acts_text, schedules, nacts = self._section(("acts", where), _part_schedules(p, where), acts)
        ops = acts + nacts
        ops_text, compute_ops, _ = self._section(("ops", id(cls)), part._compute_ops, ops)
        pipelines, micro, sizes = self._pipeline_fields(own)
        values: dict[str, str] = {
            "plan": plan_field, "schedules": schedules, "_compute_ops": compute_ops, "_plan_keys": cls.plan_keys,
            "pipelines": pipelines, "micro_batches": micro, "micro_batch_sizes": sizes,
            "recompute": _plain_text(p.recompute & frozenset({rank})),
            "_node_ranks": str(rank).join(cls.node_ranks) if cls.node_ranks is not None
            else _plain_text(_own_sets(p._node_ranks, rank)),
            "_sync_ranks": str(rank).join(cls.sync_ranks) if cls.sync_ranks is not None
            else _plain_text(_own_sets(p._sync_ranks, rank)),
            "_where": _plain_text({rank: where} if where is not None else {}), "rank": str(rank),
            "version": str(int(version))}
        for f, v in zip(_PLAN_TABLES, plans_root["$t"]):
            values[f] = _dumps(pack_json(v))
        record = '{"$c":' + _dumps(self._path(part)) + ',"f":{' + ",".join(
            _dumps(name) + ":" + (values[name] if name in values else self._const(name, part))
            for name in self._names(part)) + "}}"
        objects = ",".join(t for t in (self.shared[2], record, head_text, plans_text, acts_text, ops_text) if t)
        head = _dumps({"format": PART_FORMAT, "rank": rank, "digest": part.program_digest, "version": int(version)})
        return head[:-1] + ',"objects":[' + objects + '],"root":' + _dumps({"$ref": count}) + "}"

    def _names(self, part: Any) -> tuple[str, ...]:
        from .program_json import _Writer

        return _Writer()._kind(type(part), part)[2]

    def _path(self, part: Any) -> str:
        from .program_json import _Writer

        return _Writer()._kind(type(part), part)[1]

    def _const(self, name: str, part: Any) -> str:
        """The text of field ``name``, the same in every part (:data:`_CONST_FIELDS`), written once."""
        got = self._fields.get(name)
        if got is None:
            if name not in _CONST_FIELDS:
                raise ProgramPartError(f"ProgramParts does not know how to write the part's field {name!r}")
            got = self._fields[name] = self._const_text(getattr(part, name))
        return got

    def _pipeline_fields(self, own: int | None) -> tuple[str, str, str]:
        """The texts of the part's ``pipelines``, ``micro_batches`` and ``micro_batch_sizes`` for a rank of
        pipeline ``own`` (:func:`_part_pipelines`): each list is the others' empty value (``[]``, ``0``) but at
        ``own``, so that its packed text is the runs of that value before and after ``own``'s
        (:func:`_runs_around`), written without walking every pipeline."""
        p = self.program
        zero3 = p.plan.settings.zero >= 3
        out = []
        for name, values, empty in (("pipelines", p.pipelines, []), ("micro_batches", p.micro_batches, 0),
                                    ("micro_batch_sizes", p.micro_batch_sizes, 0)):
            mine = None if own is None or own >= len(values) else values[own]
            if name == "micro_batches" and zero3:  # every pipeline's count, whatever the rank
                mine = None
            if mine is None or (empty == 0 and (type(mine) is not int or mine == 0)):
                key = (name, None if name == "micro_batches" and zero3 else own)
                got = self._fields.get(key)
                if got is None:
                    got = self._fields[key] = _plain_text(_part_pipelines(p, own)[_PIPELINE_FIELDS.index(name)])
                out.append(got)
                continue
            if name == "pipelines":
                mine = list(map(list, mine))
            packed = _runs_around(len(values), own, pack_json(_as_written(mine)), empty)
            out.append(_dumps(packed if name == "pipelines" else {"$t": packed}))
        return out[0], out[1], out[2]

    def _section(self, key: Any, value: Any, base: int) -> tuple[str, str, int]:
        """:meth:`_write` of ``value`` at ``base``: ``(its records' text, its root's packed text, how many)``.
        Written once for ``key`` when its records refer to no record of their own (actions, compute operators):
        for another ``base`` only the root's references to them are renumbered (packing depends on their
        differences only); else written once for ``key`` at each ``base``."""
        got = self._templates.get(key)
        if got is not None:
            text, pieces, rels, n = got
            return text, pieces[0] + "".join(str(base + r) + q for r, q in zip(rels, pieces[1:])), n
        out = self._sections.get((key, base))
        if out is None:
            text, root, n = self._write(value, base)
            packed = pack_json(root)
            out = self._sections[(key, base)] = (text, _dumps(packed), n)
            if key not in self._dependent:
                if _refers_from(_unpack_records(text), base):
                    self._dependent.add(key)
                else:
                    self._templates[key] = (text, *_ref_template(packed, base), n)
        return out

    def _write(self, value: Any, base: int) -> tuple[str, Any, int]:
        """``value``'s own records written after ``base`` records (the shared ones, then the part's earlier
        sections, none of which ``value`` refers to): ``(their packed text without brackets, the root, how
        many)``."""
        from .program_json import _Writer

        count, ids, _, _ = self.shared
        w = _Writer()
        w.objects, w._ids = [None] * base, dict(ids)
        root = w.value(value)
        objects, root, _ = _dedup(w.objects, root, fixed=base)
        return _dumps(pack_json(objects[base:]))[1:-1], root, len(objects) - base

    def _write_plans(self, value: Any, base: int) -> tuple[str, Any, int]:
        """:meth:`_write` of a rank's restricted plans, each leaf's record (a message, a group, a slice: objects of
        the Program that every part restricted from its plans shares) made, keyed and packed once per Program."""
        count, ids, _, _ = self.shared
        w = _leaf_writer_class()(self._leaves, self._leaf_keys)
        w.objects, w._ids = [None] * base, dict(ids)
        root = w.value(value)
        objects, root, _ = _dedup(w.objects, root, fixed=base, known=self._leaf_keys)
        own = objects[base:]
        packed, skeletons = [], {}
        for k, rec in enumerate(own):
            p = self._leaf_packed.get(id(rec))
            if p is None:
                p = pack_json(rec)
                if id(rec) in self._leaf_keys:
                    p = self._leaf_packed[id(rec)] = p
                    self._leaf_skeletons[id(p)] = _skeleton(p)
            got = self._leaf_skeletons.get(id(p))
            if got is not None:
                skeletons[k] = got
            packed.append(p)
        return _dumps(_pack_runs(packed, skeletons))[1:-1], root, len(own)

    def _restricted(self, plan: "CommPlan", rank: int, memo: dict[int, Any]) -> "CommPlan":
        """:func:`restrict_plan` of ``plan`` to ``rank`` (once per plan in a part, as :func:`make_part`), by the
        plan's operators' items listed by rank (:func:`_op_index`, once per plan)."""
        got = memo.get(id(plan))
        if got is None:
            index = self._indexes.get(id(plan))
            if index is None:
                index = self._indexes[id(plan)] = [_op_index(op) for op in plan.ops]
            filler = self._fillers.get(len(plan.shape))
            if filler is None:  # one placeholder object per rank of dims: its record is written once per part
                filler = self._fillers[len(plan.shape)] = no_message(len(plan.shape))
            got = memo[id(plan)] = dataclasses.replace(
                plan, ops=tuple(_restrict_indexed(op, i, rank, filler) for op, i in zip(plan.ops, index)),
                cluster=None)
        return got


@functools.cache
def _leaf_writer_class() -> type:
    """The writer of a rank's restricted plans (:meth:`ProgramParts._write_plans`), made once."""
    from .program_json import _Writer

    class _LeafWriter(_Writer):
        """A writer that writes a leaf of the plans (:data:`_LEAVES`) from ``leaves`` if written before, and adds
        the ones it writes (with their JSON text to ``keys``)."""

        def __init__(self, leaves: dict[int, tuple[Any, dict[str, Any]]], keys: dict[int, str]) -> None:
            super().__init__()
            self.leaves, self.keys = leaves, keys

        def _object(self, x: Any) -> int:
            got = self._ids.get(id(x))
            if got is not None:
                return got
            leaf = self.leaves.get(id(x))
            if leaf is not None:
                index = self._ids[id(x)] = len(self.objects)
                self.objects.append(leaf[1])
                return index
            index = super()._object(x)
            rec = self.objects[index]
            if type(x) in _LEAVES and not _refers(rec["f"]):
                self.leaves[id(x)] = (x, rec)
                self.keys[id(rec)] = json.dumps(rec, separators=(",", ":"))
            return index

    return _LeafWriter


#: the classes of a plan's leaves: records that refer to no other record, shared by the parts of many ranks
_LEAVES = (Message, CollectiveGroup, SliceCollective)


def _refers(v: Any) -> bool:
    """Whether the JSON value ``v`` holds a ``$ref``."""
    if type(v) is list:
        return any(_refers(x) for x in v)
    if type(v) is dict:
        return "$ref" in v or any(_refers(x) for x in v.values())
    return False


#: added to a reference's offset from its section's first record, to find it again in the section's root text
_REF_MARK = 10 ** 40


def _ref_template(packed: Any, base: int) -> tuple[list[str], list[int]]:
    """The text of ``packed`` (a section's packed root, its records from ``base``) as pieces between its references
    to its own records, and each reference's offset from ``base``: joined with ``base + offset`` for another base,
    it is the text the root would have there (references below ``base`` -- shared records -- stay)."""
    def mark(v: Any) -> Any:
        if type(v) is list:
            return [mark(x) for x in v]
        if type(v) is dict:
            if len(v) == 1 and type(v.get("$ref")) is int and v["$ref"] >= base:
                return {"$ref": _REF_MARK + v["$ref"] - base}
            return {k: mark(x) for k, x in v.items()}
        return v

    text = _dumps(mark(packed))
    head = '{"$ref":'
    pieces, rels = [], []
    at = start = 0
    while True:
        i = text.find(head, at)
        if i < 0:
            break
        j = i + len(head)
        k = text.index("}", j)
        at = k
        value = int(text[j:k])
        if value >= _REF_MARK:
            rels.append(value - _REF_MARK)
            pieces.append(text[start:j])
            start = k
    pieces.append(text[start:])
    return pieces, rels


def _unpack_records(text: str) -> Any:
    return unpack_json(json.loads("[" + text + "]"))


def _refers_from(v: Any, base: int) -> bool:
    """Whether the JSON value ``v`` refers to a record at or above ``base``."""
    if type(v) is list:
        return any(_refers_from(x, base) for x in v)
    if type(v) is dict:
        if len(v) == 1 and type(v.get("$ref")) is int:
            return v["$ref"] >= base
        return any(_refers_from(x, base) for x in v.values())
    return False


#: the fields :func:`_part_pipelines` returns, in its order
_PIPELINE_FIELDS = ("pipelines", "micro_batches", "micro_batch_sizes")


def _as_written(value: Any) -> Any:
    """``value`` as the Program JSON form writes it (a value holding no object of a core class)."""
    from .program_json import _Writer

    return _Writer().value(value)


def _runs_around(n: int, own: int, mine: Any, empty: Any) -> list[Any]:
    """:func:`_pack_list` of a list of ``n`` values, all ``empty`` (``[]``, or the integer 0) but the one at
    ``own``, whose packed value is ``mine`` (a list of another length than ``empty``'s, or a non-zero integer):
    the runs of ``empty`` before and after it and ``mine`` alone between them (a run of ``[]`` is ``$R`` from two
    values; of 0, ``$A`` from three; ``mine`` starts no run: it differs from both neighbours in shape, or its
    steps to them differ)."""
    def run(k: int) -> list[Any]:
        if empty == []:
            return [] if k == 0 else [[]] if k == 1 else [{"$R": [[], k]}]
        return [0] * k if k < 3 else [{"$A": [0, 0, k]}]

    return run(own) + [mine] + run(n - own - 1)


def _template(value: Any, rank: int) -> list[str] | None:
    """The text of ``value`` (rank ``rank``'s rank sets, :func:`_own_sets`) written with the rank ``_SENTINEL``
    instead, split where the sentinel is written — if joining it with ``rank`` gives ``value``'s text; else
    ``None`` (the field is then written for each rank)."""
    mark = frozenset({_SENTINEL})
    marked = ({n: mark if r else r for n, r in value.items()} if isinstance(value, Mapping)
              else tuple(mark if r else r for r in value))
    pieces = _plain_text(marked).split(str(_SENTINEL))
    return pieces if str(rank).join(pieces) == _plain_text(value) else None


def _by_rank(items: Any, ranks_of: Any) -> dict[int, list[int]]:
    """rank -> the indices of ``items`` it is in (``ranks_of(item)``: the item's distinct ranks), ascending."""
    out: dict[int, list[int]] = {}
    for i, x in enumerate(items):
        for r in ranks_of(x):
            out.setdefault(r, []).append(i)
    return out


def _op_index(op: Any) -> Any:
    """The items of operator ``op`` that :func:`_restrict_op` keeps for a rank, listed by rank."""
    def first(b: Any) -> tuple[int]:
        return (b[0],)

    if isinstance(op, CollectiveOp):
        return _by_rank(op.groups, lambda g: set(g.ranks))
    if isinstance(op, SplitCollectiveOp):
        return (_by_rank(op.slices, lambda s: set(s.ranks)), _by_rank(op.in_boxes, first),
                _by_rank(op.out_boxes, first))
    if isinstance(op, PointToPointOp):
        return (_by_rank(op.messages, lambda m: {m.src, m.dst}), _by_rank(op.copies, first),
                _by_rank(op.in_boxes, first), _by_rank(op.out_boxes, first), _by_rank(op.zero_fill, lambda r: (r,)))
    return None


def _restrict_indexed(op: Any, index: Any, rank: int, filler: Message) -> Any:
    """:func:`_restrict_op` of ``op`` to ``rank`` by ``index`` (:func:`_op_index`): the same operator."""
    def pick(items: Any, by: dict[int, list[int]]) -> tuple[Any, ...]:
        return tuple(items[i] for i in by.get(rank, ()))

    if isinstance(op, CollectiveOp):
        return dataclasses.replace(op, groups=pick(op.groups, index))
    if isinstance(op, SplitCollectiveOp):
        return dataclasses.replace(op, slices=pick(op.slices, index[0]), in_boxes=pick(op.in_boxes, index[1]),
                                   out_boxes=pick(op.out_boxes, index[2]))
    if isinstance(op, PointToPointOp):
        messages = [filler] * len(op.messages)
        for i in index[0].get(rank, ()):
            messages[i] = op.messages[i]
        return dataclasses.replace(op, messages=tuple(messages), copies=pick(op.copies, index[1]),
                                   in_boxes=pick(op.in_boxes, index[2]), out_boxes=pick(op.out_boxes, index[3]),
                                   zero_fill=pick(op.zero_fill, index[4]))
    return op


def switch_index(plan: Any) -> list[tuple[dict[int, list[int]], ...]]:
    """Per step of the switch ``plan``: rank -> the indices of the messages it sends or receives, of its local
    copies and of its zero fills (what :meth:`SwitchPlan.part <hspmd_sdk.core.switch.SwitchPlan.part>` keeps of a
    step), for its ``index``."""
    return [(_by_rank(s.messages, lambda m: {m.src, m.dst}), _by_rank(s.copies, lambda c: (c[1],)),
             _by_rank(s.zero_fill, lambda z: (z[1],))) for s in plan.steps]


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
    pipelines, micro, sizes = _part_pipelines(program, where[rank][0] if where else None)
    mine = frozenset({rank})
    s = program.plan.settings
    settings = ExecutionSettings(schedule=s.schedule, zero=s.zero, zero1=s.zero1, zero1_replicated=s.zero1_replicated,
                                 max_seq_len=s.max_seq_len)
    return cls(
        graph=program.graph, plan=AnnotationPlan(annotations={}, settings=settings), cluster=None,
        annotations=program.annotations, comm_plans=comm, backward_plans=back, grad_reduce_plans=reduce,
        grad_sync_plans=sync, pipelines=pipelines, bindings=program.bindings, constraints=program.constraints,
        schedule_kind=program.schedule_kind, micro_batches=micro, micro_batch_sizes=sizes,
        pre_reshards=program.pre_reshards, grad_syncs=program.grad_syncs,
        schedules=_part_schedules(program, where.get(rank)),
        recompute=program.recompute & mine, model=program.model,
        _node_ranks=_own_sets(program._node_ranks, rank),
        _where=where, _compute_ops={n: o for n, o in program._compute_ops.items() if rank in program._node_ranks[n]},
        _plan_keys={n: k for n, k in program._plan_keys.items() if n in names},
        _sync_ranks=_own_sets(program._sync_ranks, rank),
        rank=rank, program_digest=program_digest(program), world_ranks=len(program.ranks),
        version=int(version), _group_families=_group_families(world_groups(program)),
        _pair_families=_pair_families(world_pipeline_pairs(program)))


def _part_pipelines(program: Any, own: int | None) -> tuple[list[Any], tuple[int, ...], tuple[Any, ...]]:
    """A part's ``pipelines``, ``micro_batches`` and ``micro_batch_sizes`` for a rank of pipeline ``own`` (``None``:
    of none): its own pipeline's lists, the others' empty, their counts 0 — but at ZeRO-3 every pipeline's count
    (a replica running fewer micro-batches joins the others' gathers: ``.zero3``)."""
    every = program.plan.settings.zero >= 3
    pipelines = [list(map(list, p)) if i == own else [] for i, p in enumerate(program.pipelines)]
    micro = tuple(m if i == own or every else 0 for i, m in enumerate(program.micro_batches))
    sizes = tuple(m if i == own else 0 for i, m in enumerate(program.micro_batch_sizes))
    return pipelines, micro, sizes


def _part_schedules(program: Any, where: tuple[int, int] | None) -> dict[tuple[int, int], Any]:
    """A part's ``schedules``: its stage's (``where``: ``(pipeline, stage)``, ``None`` for a rank of no stage)."""
    return {where: program.schedules[where]} if where is not None else {}


def _own_sets(sets: Any, rank: int) -> Any:
    """``sets`` (a mapping name -> rank set, or a tuple of rank sets) as a part of ``rank`` holds them: ``{rank}``
    where ``rank`` is in the set, else the empty set."""
    mine, none = frozenset({rank}), frozenset()
    if isinstance(sets, Mapping):
        return {n: mine if rank in r else none for n, r in sets.items()}
    return tuple(mine if rank in r else none for r in sets)


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
def _dedup(objects: list[Any], root: Any, fixed: int = 0,
           known: Mapping[int, str] | None = None) -> tuple[list[Any], Any, dict[int, int]]:
    """Equal object records written once: every ``$ref`` points at the first record of its value.  Records
    below index ``fixed`` are kept as they are, at their indices (a section written before).  ``known``: the
    JSON text of records (by ``id``) that refer to no record at or above ``fixed``, written before; such a record
    is kept as the same object.  Returns the records, the root and the new index of every old one."""
    canon: dict[int, int] = {}
    seen: dict[str, int] = {}
    recs: dict[int, Any] = {}
    known = known or {}

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
        key = known.get(id(rec))
        if key is None:
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

    out = objects[:fixed] + [recs[i] if "$model" in recs[i] or id(recs[i]) in known
                             else {**recs[i], "f": renumber(recs[i]["f"])} for i in sorted(recs)]
    return out, renumber(root), {i: order[c] for i, c in canon.items()}


def _skeleton(v: Any) -> tuple[str, list[int]]:
    """``v``'s shape with its integers taken out (a key: equal for values that differ only in integers) and its
    integers in walk order."""
    if type(v) is dict and len(v) == 1 and type(v.get("$ref")) is int:  # a reference: the commonest value
        return _REF_SKELETON, [v["$ref"]]
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
#: the skeleton of ``{"$ref": i}`` (what :func:`_skeleton` writes for it)
_REF_SKELETON = json.dumps({"$ref": _HOLE}, separators=(",", ":"), default=lambda _: "\u0000int")


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
    return _pack_runs([x if type(x) is int else pack_json(x) for x in items], {})


def _pack_runs(items: list[Any], skeletons: dict[int, tuple[str, list[int]]]) -> list[Any]:
    """:func:`_pack_list` of ``items``, each packed already; ``skeletons``: index -> :func:`_skeleton` of the
    item, where known (filled as needed)."""
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
