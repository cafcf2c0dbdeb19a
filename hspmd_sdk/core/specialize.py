"""Progressive graph specialization (paper §6, Appendix A.2): defined graph + annotation plan -> :class:`Program`.

``specialize(model, plan, cluster)``

1. deduces every tensor's annotation (§6.1, :mod:`.deduction`);
2. resolves every Reshard with :func:`hspmd_sdk.core.resolve.resolve` — the same ``CommPlan`` objects the editor
   shows and the runtime executes — plus the backward communication of forward Reshards, the gradient
   reductions of Duplicate activations (Megatron's "f"), and each parameter's gradient synchronisation
   ``<param>.grad_sync`` (§5);
3. builds the pipelines from the forward/backward communication (Figure 21, :mod:`.pipelines`);
4. on demand, per rank, drops the non-local operators (§6.2) and splits what is left into the ``Pre``, ``F``,
   ``B`` and ``Post`` executable subgraphs (:meth:`Program.executable_graph`).

Shapes stay symbolic (``B``, ``S``).  Communication is planned on *representative* values of the symbols
(``bindings=`` if given, else the graph's hints — ``S = max_seq_len`` for Llama — and the smallest values that
satisfy every divisibility constraint); the operator kinds, groups and messages do not depend on the values,
only the byte counts do.  :meth:`Program.bind` checks concrete values against every constraint.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Sequence

from ..errors import ResolutionError, ShapeError, SpecializationError
from .annotation import Annotation, format_ranks, is_split, local_view, subgroup_views
from .comm_ops import OpKind
from .deduction import (activation_grad_annotation, deduce, local_constraints, local_shape, partial_as_duplicate,
                        weight_grad_annotation)
from .gc_pause import gc_paused
from .graph import Graph, Node
from .microbatch import batch_dim, micro_batch_plan
from .ops import op_def
from .pipelines import build_pipelines, op_ranks
from .plan import AnnotationPlan, ExecutionSettings
from .schedule import Action, build_schedule
from .symbolic import Constraint, Dim, evaluate_shape, representative_value

if TYPE_CHECKING:
    from .cluster import Cluster
    from .comm_plan import CommPlan
    from .model_spec import ModelSpec

__all__ = ["specialize", "Program", "ProgramPart", "ExecutableGraph", "ExecOp", "GradSync", "StateLayout", "PHASES",
           "OPTIMIZER_STATES"]

#: Adam's per-parameter state tensors, laid out like the parameter (ZeRO-1 shards them with it).
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")

PHASES = ("Pre", "F", "B", "Post")


@dataclass(frozen=True)
class ExecOp:
    """One operator of a rank's executable graph.

    ``kind``: the op kind (``dot``...), ``Reshard``, ``<kind>Bwd``, ``ReshardBwd``, ``GradReduce``, ``GradSync``
    or ``OptimizerStep``.  ``comm``: the ``CommPlan`` of a communication op; ``comm_kinds``: the operators of it
    this rank executes (e.g. ``("ReduceScatter",)``); ``bytes_sent``: bytes this rank sends per execution at the
    program's representative shapes.
    """

    name: str
    kind: str
    phase: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    comm: "CommPlan | None" = None
    comm_kinds: tuple[str, ...] = ()
    bytes_sent: int = 0

    @property
    def is_comm(self) -> bool:
        return self.comm is not None

    def __str__(self) -> str:
        s = f"{self.kind} {self.name}"
        if self.comm is not None:
            s += f" [{' + '.join(self.comm_kinds) or 'nothing on this rank'}]"
            if self.bytes_sent:
                s += f" sends {_fmt_bytes(self.bytes_sent)}"
        return s


@dataclass(frozen=True)
class ExecutableGraph:
    """What one rank runs (§6.2): its leaves and its Pre / F / B / Post executable subgraphs (Figure 21)."""

    rank: int
    pipeline: int | None
    stage: int | None
    leaves: tuple[str, ...]
    pre: tuple[ExecOp, ...]
    forward: tuple[ExecOp, ...]
    backward: tuple[ExecOp, ...]
    post: tuple[ExecOp, ...]

    def phase(self, name: str) -> tuple[ExecOp, ...]:
        """The subgraph ``"Pre"``, ``"F"``, ``"B"`` or ``"Post"``."""
        return {"Pre": self.pre, "F": self.forward, "B": self.backward, "Post": self.post}[name]

    @property
    def ops(self) -> tuple[ExecOp, ...]:
        return self.pre + self.forward + self.backward + self.post

    @property
    def op_names(self) -> set[str]:
        return {o.name for o in self.ops}

    @property
    def parameters(self) -> tuple[str, ...]:
        return tuple(n for n in self.leaves if n in self._params)

    _params: frozenset[str] = field(default=frozenset(), repr=False, compare=False)


@dataclass(frozen=True)
class GradSync:
    """One gradient synchronisation of parameter ``param``: on each rank the gradients of ``uses`` (tensors through
    which the graph reads the parameter, whose gradients have one layout) are summed, then the plan ``name``
    moves the sum onto the parameter's layout.  A parameter's gradient is the sum over its GradSyncs (a tied
    weight used on two stages has two)."""

    param: str
    name: str
    uses: tuple[str, ...]


@dataclass(frozen=True)
class StateLayout:
    """The layout of one tensor of training state: a parameter (``kind="param"``) or one of its Adam moments."""

    name: str
    param: str
    kind: Literal["param", "exp_avg", "exp_avg_sq"]
    annotation: Annotation
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, kw_only=True)
class Program:
    """The result of specialization: every rank's executable graph, the pipelines and their schedules — the one
    artifact the runtime, the planner's simulator and the editor read.

    ``model``: the :class:`~hspmd_sdk.core.model_spec.ModelSpec` it was specialized from (``None`` for a bare
    graph).  ``comm_plans``: Reshard name -> ``CommPlan`` (forward); ``backward_plans``: the same names -> the
    plan of the gradient's way back; ``grad_reduce_plans``: activation name -> all-reduce of its Partial
    gradient; ``grad_sync_plans``: ``<param>.grad_sync[.k]`` -> gradient synchronisation, used as
    ``grad_syncs`` says.  ``pipelines``: list of pipelines, each a list of stages, each a sorted list of ranks.
    ``schedules``: ``(pipeline, stage)`` -> the actions that stage replays every step (compute and transfers).
    ``bindings``: the representative symbol values the plans were resolved at.  ``recompute``: ranks that
    recompute activations in backward.
    """

    graph: Graph
    plan: AnnotationPlan
    cluster: "Cluster | None"
    annotations: Mapping[str, Annotation]
    comm_plans: Mapping[str, "CommPlan"]
    backward_plans: Mapping[str, "CommPlan"]
    grad_reduce_plans: Mapping[str, "CommPlan"]
    grad_sync_plans: Mapping[str, "CommPlan"]
    pipelines: list[list[list[int]]]
    bindings: Mapping[str, int]
    constraints: tuple[Constraint, ...]
    schedule_kind: str = "1f1b"
    micro_batches: tuple[int, ...] = ()
    micro_batch_sizes: tuple[int, ...] = ()
    pre_reshards: frozenset[str] = frozenset()
    grad_syncs: tuple[GradSync, ...] = ()
    schedules: Mapping[tuple[int, int], tuple[Action, ...]] = field(default_factory=dict)
    recompute: frozenset[int] = frozenset()
    model: "ModelSpec | None" = None
    _node_ranks: Mapping[str, frozenset[int]] = field(default_factory=dict, repr=False, compare=False)
    _where: Mapping[int, tuple[int, int]] = field(default_factory=dict, repr=False, compare=False)
    _cache: dict[int, ExecutableGraph] = field(default_factory=dict, repr=False, compare=False)
    _concrete: dict[tuple[str, tuple[int, ...]], Any] = field(default_factory=dict, repr=False, compare=False)
    _rank_tables: dict[int, dict[int, tuple[tuple[str, ...], int]]] = field(default_factory=dict, repr=False,
                                                                             compare=False)
    _compute_ops: Mapping[str, tuple[ExecOp, ExecOp]] = field(default_factory=dict, repr=False, compare=False)
    _plan_keys: Mapping[str, tuple[Annotation, Annotation, str]] = field(default_factory=dict, repr=False,
                                                                         compare=False)
    _resolver: Any = field(default=None, repr=False, compare=False)
    _micro: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False, compare=False)
    _sync_ranks: tuple[frozenset[int], ...] = field(default=(), repr=False, compare=False)

    # ---- pipelines and stages ------------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        """Every rank that runs part of the program, sorted."""
        return sorted(self._where)

    def stage_of(self, rank: int) -> tuple[int, int]:
        """``(pipeline index, stage index)`` of ``rank``; ``KeyError`` naming the rank if it runs nothing."""
        try:
            return self._where[rank]
        except KeyError:
            raise KeyError(f"rank {rank} runs no forward operator of this program (ranks "
                           f"{format_ranks(self.ranks)})") from None

    def stage_ranks(self, pipeline: int, stage: int) -> list[int]:
        return list(self.pipelines[pipeline][stage])

    def num_stages(self, pipeline: int) -> int:
        return len(self.pipelines[pipeline])

    def num_micro_batches(self, pipeline: int) -> int:
        return self.micro_batches[pipeline] if pipeline < len(self.micro_batches) else 1

    def micro_batch_size(self, pipeline: int) -> int | None:
        return self.micro_batch_sizes[pipeline] if pipeline < len(self.micro_batch_sizes) else None

    def schedule(self, rank: int) -> list[Action]:
        """The list of actions (``Pre``, ``F``/``B`` per micro-batch with their sends/receives, ``Post``) ``rank``
        replays every step: the stored schedule of its pipeline's stage (:func:`~.schedule.build_schedule` with the
        pipeline's own number of micro-batches)."""
        return list(self.schedules[self.stage_of(rank)])

    # ---- training state --------------------------------------------------------------------------------------
    @property
    def parameters(self) -> list[str]:
        """Every parameter of the graph, in graph order."""
        return [n.outputs[0] for n in self.graph.parameters]

    def state_layouts(self) -> dict[str, StateLayout]:
        """Every parameter's and every Adam moment's layout: ``name`` (``<param>``, ``<param>.exp_avg``,
        ``<param>.exp_avg_sq``) -> annotation, full shape and dtype.  A switch between two Programs, or a checkpoint
        written under one and read under another, is a function of two such tables."""
        out: dict[str, StateLayout] = {}
        for name in self.parameters:
            spec = self.graph.tensors[name]
            shape = tuple(int(d) for d in spec.shape)
            ann = self.annotations[name]
            out[name] = StateLayout(name, name, "param", ann, shape, spec.dtype)
            for kind in OPTIMIZER_STATES:
                out[f"{name}.{kind}"] = StateLayout(f"{name}.{kind}", name, kind, ann, shape, "float32")
        return out

    # ---- micro-batches ---------------------------------------------------------------------------------------
    def batch_rows(self, rank: int, bindings: Mapping[str, int]) -> tuple[int, int]:
        """The rows ``[a, b)`` of the step's global batch that ``rank``'s pipeline trains, from the annotation of
        an activation of its executable graph."""
        key = ("rows", rank, tuple(sorted(bindings.items())))
        got = self._micro.get(key)
        if got is not None:
            return got
        for op in self.executable_graph(rank).forward:
            for t in op.outputs + op.inputs:
                d = batch_dim(self.graph.tensors[t].shape)
                if d is not None and rank in self.annotations[t].ranks:
                    shape = tuple(int(x) for x in evaluate_shape(self.graph.tensors[t].shape, bindings, tensor=t))
                    got = self._micro[key] = local_view(self.annotations[t], shape, rank).box[d]
                    return got
        raise SpecializationError(f"rank {rank}: no activation of its executable graph has a batch dim")

    def micro_batch_plan(self, name: str, rank: int, bindings: Mapping[str, int], micro_size: int) -> "CommPlan":
        """The plan of communication ``name`` at one micro-batch of ``micro_size`` rows of ``rank``'s pipeline
        (the step-level plan with the pipeline's batch rows rewritten to ``[0, micro_size)``; see
        :mod:`.microbatch`).  Cached."""
        key = (name, rank, micro_size, tuple(sorted(bindings.items())))
        got = self._micro.get(key)
        if got is None:
            plan = self.concrete_plan(name, bindings)
            d = batch_dim(self.graph.tensors[self._plan_keys[name][2]].shape)
            got = plan if d is None else micro_batch_plan(plan, d, self.batch_rows(rank, bindings), micro_size)
            self._micro[key] = got
        return got

    # ---- executable graphs ---------------------------------------------------------------------------------
    def executable_graph(self, rank: int) -> ExecutableGraph:
        """Rank ``rank``'s executable graph: the defined graph without the operators not placed on it (§6.2)."""
        got = self._cache.get(rank)
        if got is None:
            got = _instantiate(self, rank)
            self._cache[rank] = got
        return got

    def local_shape(self, tensor: str, rank: int, bindings: Mapping[str, int] | None = None) -> tuple[Dim, ...]:
        """Shape of ``rank``'s shard of ``tensor``: symbolic, or concrete when ``bindings`` are given."""
        ann = self.annotations[tensor]
        loc = ann.locate(rank)
        if loc is None:
            raise KeyError(f"rank {rank} holds no shard of tensor {tensor!r} (annotation {ann})")
        shape = local_shape(ann, self.graph.tensors[tensor].shape, loc[0], tensor)
        if bindings is None:
            return shape
        return evaluate_shape(shape, bindings, tensor=tensor, where=f"local shard on rank {rank}")

    def concrete_plan(self, name: str, bindings: Mapping[str, int]) -> Any:
        """The ``CommPlan`` of communication ``name`` resolved at concrete symbol values (the program's own plans
        are at :attr:`bindings`).  ``name``: a Reshard, ``<reshard>.bwd``, ``<tensor>.grad_reduce`` or
        ``<param>.grad_sync``.  Plans at the program's bindings are returned as they are."""
        try:
            src, dst, tensor = self._plan_keys[name]
        except KeyError:
            raise KeyError(f"no communication named {name!r} in this program") from None
        if dict(bindings) == dict(self.bindings):
            return self._plans_by_name()[name]
        shape = evaluate_shape(self.graph.tensors[tensor].shape, bindings, tensor=tensor)
        key = (name, shape)
        got = self._concrete.get(key)
        if got is None:
            dtype = self.graph.tensors[tensor].dtype
            got = _identity_plan(src, shape, dtype, self.cluster) if src == dst else \
                (self._resolver or _default_resolver())(src, dst, shape, dtype, self.cluster)
            self._concrete[key] = got
        return got

    def _plans_by_name(self) -> dict[str, Any]:
        out = dict(self.comm_plans)
        out.update({f"{k}.bwd": v for k, v in self.backward_plans.items()})
        out.update({f"{k}.grad_reduce": v for k, v in self.grad_reduce_plans.items()})
        out.update(self.grad_sync_plans)
        return out

    def bind(self, bindings: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        """Check concrete symbol values against every constraint; return every tensor's global shape.

        Raises :class:`ShapeError` naming the tensor, the dim and the constraint that fails."""
        shapes = self.graph.bind(bindings)
        for c in self.constraints:
            c.check(bindings)
        return shapes

    # ---- travelling (SPEC §9) -----------------------------------------------------------------------------
    def to_json(self) -> str:
        """This Program as JSON text: per-rank executable graphs' inputs, pipelines, schedules, communication
        plans, annotations, bindings and the model config — everything but per-process caches.  The one form in
        which a Program reaches another process; :meth:`from_json` reads it back equal (``==``)."""
        from .program_json import program_to_json

        return program_to_json(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Program":
        """The Program written by :meth:`to_json` (no re-specialization: the plans are read, not resolved
        again).  Constructs only hspmd_sdk.core value types and the model config's class."""
        from .program_json import ProgramJSONError, program_from_json

        out = program_from_json(text)
        if not isinstance(out, cls):
            raise ProgramJSONError(f"the JSON holds a {type(out).__name__}, not a Program")
        return out

    # ---- what a worker receives (SPEC §16) ---------------------------------------------------------------------
    def part(self, rank: int, *, version: int = 0) -> "ProgramPart":
        """What rank ``rank`` executes: its executable graph's inputs, its stage's schedule, the communication
        plans it runs (restricted to its own groups and messages) and state layouts, plus this Program's
        :meth:`digest` and ``version`` (:class:`ProgramPart`).  For a fixed model and stage shape its JSON does
        not grow with the number of ranks.  Raises ``ProgramPartError`` naming the rank if it takes part in no
        operator."""
        from .program_part import make_part

        return make_part(self, rank, ProgramPart, version=version)

    def digest(self) -> str:
        """SHA-256 (hex) of this Program's JSON: what every rank's part carries to agree on the Program."""
        from .program_part import program_digest

        return program_digest(self)

    def digest_is_that_of(self, text: str) -> None:
        """This Program was read from ``text``, its own ``to_json()``: its :meth:`digest` is that text's (not
        written again to be hashed: 10 s at 10,240 ranks of Llama-70B)."""
        self._micro[("digest",)] = hashlib.sha256(text.encode("utf-8")).hexdigest()

    @property
    def default_resolver(self) -> bool:
        """Whether specialization resolved its communication with the SDK's own resolver (not one given to
        :func:`specialize`)."""
        return self._resolver is None

    # ---- printing ------------------------------------------------------------------------------------------
    def describe(self, rank: int | None = None) -> str:
        """A readable account of the whole program (``rank=None``) or of one rank's executable graph."""
        return _describe_rank(self, rank) if rank is not None else _describe_program(self)

    def __str__(self) -> str:
        return _describe_program(self)


@dataclass(frozen=True, kw_only=True)
class ProgramPart(Program):
    """Rank :attr:`rank`'s part of a Program (SPEC §16; :mod:`.program_part` says what it holds and how it
    travels): a :class:`Program` that answers for that rank only, and raises ``ProgramPartError`` naming both
    ranks when asked about another.  ``program_digest``: the whole Program's digest (also :meth:`digest`, as on
    the Program); ``world_ranks``: how many ranks run a stage of the whole Program; ``version``: the launcher's
    version of the Program (0 at launch); :attr:`world_groups`: every process group of the whole Program (torch
    creates each group with every rank of the job, so every rank lists them all; stored by shape, compact in the
    JSON); :attr:`world_pipeline_pairs`: the whole Program's stage-boundary rank pairs (the NCCL point-to-point
    groups).

    Made by :meth:`Program.part`; travels as :meth:`to_json` / :meth:`from_json`."""

    rank: int
    program_digest: str
    world_ranks: int
    version: int = 0
    #: the whole Program's groups by shape: (offsets from the first rank, first ranks) — compact in the JSON
    _group_families: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    #: the whole Program's stage-boundary pairs: (direction, high - low, low ranks)
    _pair_families: tuple[tuple[int, int, tuple[int, ...]], ...] = ()

    @property
    def world_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every process group of the whole Program, sorted (:func:`~.program_part.world_groups`)."""
        from .program_part import world_groups_of

        return world_groups_of(self._group_families)

    @property
    def world_pipeline_pairs(self) -> tuple[tuple[int, int, int], ...]:
        """The whole Program's stage-boundary pairs ``(direction, low, high)``, sorted
        (:func:`~.program_part.world_pipeline_pairs`)."""
        from .program_part import world_pairs_of

        return world_pairs_of(self._pair_families)

    def digest(self) -> str:
        """The whole Program's digest (:meth:`Program.digest`): peers with equal digests run one Program."""
        return self.program_digest

    # ---- the rank guard ------------------------------------------------------------------------------------
    def _own(self, rank: int, what: str) -> None:
        from .program_part import rank_guard

        rank_guard(self, rank, what)

    def executable_graph(self, rank: int) -> "ExecutableGraph":
        """Rank :attr:`rank`'s executable graph (the whole Program's, with its plans restricted to the rank)."""
        self._own(rank, "executable_graph")
        return super().executable_graph(rank)

    def schedule(self, rank: int) -> "list[Action]":
        """The actions rank :attr:`rank` replays every step (as :meth:`Program.schedule`)."""
        self._own(rank, "schedule")
        return super().schedule(rank)

    def stage_of(self, rank: int) -> tuple[int, int]:
        """``(pipeline, stage)`` of rank :attr:`rank`."""
        self._own(rank, "stage_of")
        return super().stage_of(rank)

    def batch_rows(self, rank: int, bindings: Mapping[str, int]) -> tuple[int, int]:
        """The rows of the global batch rank :attr:`rank`'s pipeline trains (as :meth:`Program.batch_rows`)."""
        self._own(rank, "batch_rows")
        return super().batch_rows(rank, bindings)

    def micro_batch_plan(self, name: str, rank: int, bindings: Mapping[str, int], micro_size: int) -> "CommPlan":
        """As :meth:`Program.micro_batch_plan`, for rank :attr:`rank` only."""
        self._own(rank, "micro_batch_plan")
        return super().micro_batch_plan(name, rank, bindings, micro_size)

    def local_shape(self, tensor: str, rank: int, bindings: Mapping[str, int] | None = None) -> Any:
        """As :meth:`Program.local_shape`, for rank :attr:`rank` only."""
        self._own(rank, "local_shape")
        return super().local_shape(tensor, rank, bindings)

    def part(self, rank: int, *, version: int | None = None) -> "ProgramPart":
        """A part of a part is itself (for its own rank; with ``version``, a copy of that version)."""
        import dataclasses

        self._own(rank, "part")
        return self if version is None or version == self.version else dataclasses.replace(self, version=version)

    # ---- travelling ------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        """This part as JSON text (the Program form, equal objects once, runs compact:
        :func:`~.program_part.part_to_json`); :meth:`from_json` reads it back equal (``==``).  Its size does not
        grow with the world for a fixed model and stage shape."""
        from .program_part import part_to_json

        return part_to_json(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> "ProgramPart":
        """The part written by :meth:`to_json`: constructs only hspmd_sdk.core value types and the model config."""
        from .program_part import part_from_json

        return part_from_json(text, cls)


# ---- specialization --------------------------------------------------------------------------------------------
@gc_paused
def specialize(model: Any, plan: Any, cluster: "Cluster | None" = None, *, bindings: Mapping[str, int] | None = None,
               resolver: Callable[..., Any] | None = None) -> Program:
    """Specialize ``model`` (a :class:`~hspmd_sdk.core.model_spec.ModelSpec` such as ``LlamaConfig`` or
    ``GPTConfig``, or a bare :class:`Graph`) under ``plan`` (an ``AnnotationPlan`` or a mapping name ->
    Annotation) for ``cluster`` (§6).  ``bindings``: symbol values for planning communication volumes (optional;
    a ``B`` that contradicts the plan's micro-batches is an error).  Raises :class:`SpecializationError` /
    :class:`ShapeError` naming the tensor, op or rank at fault."""
    graph, spec = _as_graph(model)
    given, settings = _plan_parts(plan)
    plan = plan if isinstance(plan, AnnotationPlan) else AnnotationPlan(annotations=given, settings=settings)
    unknown = sorted(n for n in given if n not in graph.tensors and ".grad_sync" not in n)
    if unknown:
        raise SpecializationError(f"the plan annotates {len(unknown)} tensor(s) the graph does not have: "
                                  f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''} (graph {graph.name!r})")
    _check_batch_binding(bindings, settings)
    anns = deduce(graph, given)
    constraints = _constraints(graph, anns)
    reps = _representative(graph, constraints, bindings, _batch_hints(settings))
    planner = _Planner(graph, reps, resolver or _default_resolver(), cluster)
    plan_of = planner.plan
    pre = frozenset(n.name for n in graph.reshards if _from_parameter(graph, n))
    comm, back = {}, {}
    for n in graph.reshards:
        src, dst = anns[n.inputs[0]], anns[n.outputs[0]]
        comm[n.name] = plan_of(src, dst, n.inputs[0], name=n.name)
        if n.name not in pre:
            back[n.name] = plan_of(partial_as_duplicate(dst), partial_as_duplicate(src), n.inputs[0],
                                   f"backward of Reshard {n.name!r}", f"{n.name}.bwd")
    reduce_plans = _grad_reduce_plans(graph, anns, plan_of)
    sync, syncs = _grad_sync_plans(graph, anns, given, plan_of)
    fwd_anns = {id(anns[t]): anns[t] for n in graph.nodes if not n.is_leaf and n.name not in pre for t in n.outputs}
    fwd_ranks = {r for a in fwd_anns.values() for r in a.ranks}
    order_key = _pipeline_order(graph, anns)
    f_plans = [comm[n.name] for n in graph.reshards if n.name not in pre]
    b_plans = list(back.values()) + list(reduce_plans.values())
    pipelines = build_pipelines(fwd_ranks, f_plans, b_plans, order_key, _kernel_groups(graph, anns, reps))
    micro, sizes = _micro_batching(settings, pipelines, order_key)
    kind = settings.schedule
    schedules = _schedules(kind, pipelines, micro)
    where = {r: (i, j) for i, p in enumerate(pipelines) for j, s in enumerate(p) for r in s}
    recompute = frozenset(settings.recompute)
    unknown_rc = sorted(recompute - set(where))
    if unknown_rc:
        raise SpecializationError(f"plan.settings.recompute names rank(s) {unknown_rc} that run no stage of this "
                                  f"program (stage ranks {format_ranks(sorted(where))})")
    node_ranks = _node_rank_sets(graph, anns)
    compute = {n.name: (ExecOp(n.name, n.kind, "F", n.inputs, n.outputs),
                        ExecOp(f"{n.name}.bwd", f"{n.kind}Bwd", "B", n.outputs, n.inputs))
               for n in graph.nodes if not n.is_leaf and not n.is_reshard}
    return Program(graph=graph, plan=plan, cluster=cluster, annotations=anns, comm_plans=comm,
                   backward_plans=back, grad_reduce_plans=reduce_plans, grad_sync_plans=sync, pipelines=pipelines,
                   bindings=reps, constraints=tuple(constraints), schedule_kind=kind, micro_batches=micro,
                   micro_batch_sizes=sizes, pre_reshards=pre, grad_syncs=syncs, schedules=schedules,
                   recompute=recompute, model=spec, _node_ranks=node_ranks, _where=where, _compute_ops=compute,
                   _plan_keys=planner.keys, _resolver=resolver, _sync_ranks=_sync_rank_sets(syncs, sync))


def _sync_rank_sets(syncs: Sequence[GradSync], plans: Mapping[str, Any]) -> tuple[frozenset[int], ...]:
    """Per gradient synchronisation, the ranks its plan touches (computed once per distinct plan)."""
    by_plan: dict[int, frozenset[int]] = {}
    out = []
    for gs in syncs:
        plan = plans[gs.name]
        got = by_plan.get(id(plan))
        if got is None:
            got = by_plan[id(plan)] = frozenset(plan.src.ranks) | frozenset(plan.dst.ranks)
        out.append(got)
    return tuple(out)


def _schedules(kind: str, pipelines: list[list[list[int]]], micro: Sequence[int]
               ) -> dict[tuple[int, int], tuple[Action, ...]]:
    """Every stage's schedule, built once per distinct ``(stages, stage, micro-batches)`` and shared."""
    built: dict[tuple[int, int, int], tuple[Action, ...]] = {}
    out: dict[tuple[int, int], tuple[Action, ...]] = {}
    for i, p in enumerate(pipelines):
        m = micro[i]  # one entry per pipeline (_micro_batching)
        for j in range(len(p)):
            key = (len(p), j, m)
            if key not in built:
                built[key] = tuple(build_schedule(kind, len(p), j, m))
            out[(i, j)] = built[key]
    return out


def _check_batch_binding(bindings: Mapping[str, int] | None, settings: ExecutionSettings) -> None:
    """A ``B`` in ``bindings`` must be the step's batch that the plan's micro-batches add up to."""
    want = settings.batch
    if bindings is None or want is None or "B" not in bindings or int(bindings["B"]) == want:
        return
    raise ShapeError(f"bindings: B={bindings['B']} but the plan's micro-batches add up to {want} samples per step "
                     f"(micro_batch_size {list(settings.micro_batch_size or ())} x num_micro_batches "
                     f"{settings.num_micro_batches}); pass B={want} or change the strategy's micro-batches")


class _Planner:
    """Resolves communication at the representative shapes, once per distinct ``(src, dst, shape, dtype)``, and
    remembers which annotations each named communication came from (for :meth:`Program.concrete_plan`)."""

    def __init__(self, graph: Graph, reps: Mapping[str, int], resolve: Callable[..., Any], cluster: Any) -> None:
        self.graph, self.reps, self.resolve, self.cluster = graph, reps, resolve, cluster
        self.keys: dict[str, tuple[Annotation, Annotation, str]] = {}
        self._by_value: dict[tuple[Any, ...], Any] = {}
        self._by_id: dict[tuple[Any, ...], Any] = {}  # fast path: the same annotation objects recur per layer
        self._alive: list[Any] = []  # keeps the annotations whose ids key ``_by_id`` alive

    def plan(self, src: Annotation, dst: Annotation, tensor: str, label: str = "", name: str = "") -> Any:
        self.keys[name] = (src, dst, tensor)
        spec = self.graph.tensors[tensor]
        fast = (id(src), id(dst), spec.shape, spec.dtype)
        got = self._by_id.get(fast)
        if got is not None:
            return got
        shape = evaluate_shape(spec.shape, self.reps, tensor=tensor)
        key = (src, dst, shape, spec.dtype)
        if key not in self._by_value:
            try:
                self._by_value[key] = _identity_plan(src, shape, spec.dtype, self.cluster) if src == dst else \
                    self.resolve(src, dst, shape, spec.dtype, self.cluster)
            except (ResolutionError, ShapeError, SpecializationError) as e:  # name the tensor, keep the reason
                raise type(e)(f"{label or 'Reshard ' + repr(tensor)}: {e}") from e
        self._alive.append((src, dst))
        self._by_id[fast] = self._by_value[key]
        return self._by_value[key]


def _identity_plan(ann: Annotation, shape: tuple[int, ...], dtype: str, cluster: Any) -> Any:
    """The plan ``resolve`` gives for equal annotations (nothing moves), without re-deriving the views."""
    from .comm_ops import IdentityOp
    from .comm_plan import CommPlan
    from .resolve import itemsize_of

    ann.check_shape(shape)
    return CommPlan(src=ann, dst=ann, shape=shape, dtype=str(dtype), itemsize=itemsize_of(dtype),
                    ops=(IdentityOp(),), cluster=cluster)


def _default_resolver() -> Callable[..., Any]:
    from .resolve import resolve

    return resolve


def _as_graph(model: Any) -> tuple[Graph, Any]:
    """The defined graph of ``model`` and the model spec (``None`` for a bare graph)."""
    if isinstance(model, Graph):
        return model, None
    if hasattr(model, "build_graph"):
        from .strategy_plan import graph_of

        return graph_of(model), model
    raise SpecializationError(f"specialize() takes a model config (a ModelSpec: LlamaConfig, GPTConfig, ...) or a "
                              f"Graph, not {type(model).__name__}")


def _plan_parts(plan: Any) -> tuple[dict[str, Annotation], ExecutionSettings]:
    if hasattr(plan, "annotations"):
        settings = getattr(plan, "settings", None)
        return dict(plan.annotations), settings if isinstance(settings, ExecutionSettings) else ExecutionSettings()
    if isinstance(plan, Mapping):
        return {k: v if isinstance(v, Annotation) else Annotation(v) for k, v in plan.items()}, ExecutionSettings()
    raise SpecializationError(f"plan must be an AnnotationPlan or a mapping name -> Annotation, not "
                              f"{type(plan).__name__}")


def _from_parameter(graph: Graph, node: Node) -> bool:
    """A Reshard fed (through other Reshards) by a parameter: it belongs to the Pre subgraph."""
    src = graph.producer(node.inputs[0])
    while src.is_reshard:
        src = graph.producer(src.inputs[0])
    return src.kind == "parameter"


def _constraints(graph: Graph, anns: Mapping[str, Annotation]) -> list[Constraint]:
    seen: dict[Any, Constraint] = {}
    memo: dict[tuple[int, tuple[Dim, ...]], list[Constraint]] = {}
    for name, spec in graph.tensors.items():
        ann = anns[name]
        key = (id(ann), spec.shape)
        if key not in memo:
            memo[key] = local_constraints(ann, spec.shape, name)
        for c in memo[key]:
            if c.expr not in seen:  # one constraint per expression, naming the first tensor that needs it
                seen[c.expr] = c
    for name, spec in graph.tensors.items():  # global dims (e.g. a split of S in two)
        for i, d in enumerate(spec.shape):
            if not isinstance(d, int) and not d.is_integral and d not in seen:
                seen[d] = Constraint(name, i, d, "global shape")
    return list(seen.values())


def _batch_hints(settings: ExecutionSettings) -> dict[str, int]:
    """``B`` = the global batch of one step when the plan comes from a strategy (its HDim ratios are per step)."""
    return {} if settings.batch is None else {"B": settings.batch}


def _representative(graph: Graph, constraints: Sequence[Constraint], bindings: Mapping[str, int] | None,
                    hints: Mapping[str, int]) -> dict[str, int]:
    if bindings is not None:
        for c in constraints:
            c.check(bindings)
        missing = graph.symbols - set(bindings)
        if missing:
            raise ShapeError(f"bindings lack symbol(s) {sorted(missing)} of graph {graph.name!r}")
        return dict(bindings)
    exprs = [c.expr for c in constraints]
    all_hints = {**graph.hints, **hints}
    reps = {s: representative_value(s, exprs, all_hints.get(s)) for s in sorted(graph.symbols)}
    for c in constraints:
        try:
            c.check(reps)
        except ShapeError as e:
            raise ShapeError(f"{e} (while choosing representative values {reps}; pass specialize(..., "
                             "bindings={...}) with values that satisfy every constraint)") from None
    return reps


def _grad_reduce_plans(graph: Graph, anns: Mapping[str, Annotation], plan_of: Callable[..., Any]) -> dict[str, Any]:
    """Activations whose gradient comes back Partial where the tensor is Duplicate (Megatron's "f")."""
    out: dict[str, Any] = {}
    for node in graph.nodes:
        # leaves and Reshards have no input_grad rule; without one the gradient is laid out like the input
        if op_def(node.kind).input_grad is None:
            continue
        x = node.inputs[0]
        if graph.producer(x).is_leaf:
            continue
        in_anns = [anns[t] for t in node.inputs]
        shapes = [graph.tensors[t].shape for t in node.inputs]
        grad = activation_grad_annotation(node.kind, in_anns, shapes, 0)
        want = partial_as_duplicate(anns[x])
        if grad != want and x not in out:
            out[x] = plan_of(grad, want, x, f"gradient reduction of {x!r}", f"{x}.grad_reduce")
    return out


def _parameter_uses(graph: Graph, param: str) -> list[tuple[str, Node]]:
    """Every tensor through which the graph reads parameter ``param`` (the parameter itself or the end of a chain
    of its Reshards), each with its first compute consumer, in graph order.  A tied weight (GPT-2's embedding,
    also its LM head) has two."""
    out: list[tuple[str, Node]] = []
    todo = [param]
    while todo:
        t = todo.pop(0)
        compute = [c for c in graph.consumers(t) if not c.is_reshard]
        if compute:
            out.append((t, compute[0]))
        todo.extend(c.outputs[0] for c in graph.consumers(t) if c.is_reshard)
    return out


def _use_grad(graph: Graph, anns: Mapping[str, Annotation], used: str, consumer: Node,
              of_parameters: frozenset[str]) -> Annotation:
    """The deduced layout of the gradient that ``consumer``'s backward gives the parameter tensor ``used``.

    A weight input (a Dot's, a norm's) gets :func:`weight_grad_annotation`.  A parameter read through an op of
    parameters only (a reparametrised weight: ``V -> gelu -> a dot's weight``; a fused weight ``split`` into two)
    gets, through that op's backward (linear in its outputs' gradients), its outputs' gradient layout: Partial
    wherever their uses make it so (data parallelism), since every holder computes the op on the same values.
    Such an op passes the layout on where its outputs are laid out like ``used`` (and, if it changes the shape,
    ``used`` splits no dim); otherwise it is refused where a gradient is not laid out like its output, rather
    than left unsynchronised.  Any other input beside activations keeps its own layout only where the op's
    inputs and outputs are all laid out like it (every holder then computes the same gradient), and is refused
    otherwise: the specializer cannot tell which devices' gradients must be summed."""
    idx = consumer.inputs.index(used)
    if idx in _weight_inputs(consumer.kind):
        act = consumer.inputs[0] if idx != 0 else consumer.inputs[-1]
        return weight_grad_annotation(consumer.kind, anns[act], anns[used], graph.tensors[act].shape,
                                      graph.tensors[used].shape)
    own = partial_as_duplicate(anns[used])
    shape = graph.tensors[used].shape
    if not all(t in of_parameters for t in consumer.inputs):
        if all(anns[t] == anns[used] and graph.tensors[t].shape == shape
               for t in (*consumer.inputs, *consumer.outputs)):
            return own
        raise SpecializationError(
            f"parameter tensor {used!r} is input {idx} of op {consumer.name!r} ({consumer.kind}) beside "
            "activations, which is not one of the op's weight inputs, and the op's tensors are not all laid out "
            f"like it: the specializer cannot tell how {used!r}'s gradient must be synchronised.  Read the "
            "parameter through a weight input (dot, linear, embedding, bias_add, a norm's weight), or register "
            "the op with weight_inputs")
    uses = [(out, _use_grad(graph, anns, t, c, of_parameters))
            for out in consumer.outputs for t, c in _parameter_uses(graph, out)]
    if all(g == partial_as_duplicate(anns[out]) for out, g in uses):
        return own
    grads = [g for _, g in uses]
    splits = is_split(anns[used].hdim) or any(ds.split_dims for ds in anns[used].ds_union)
    if all(anns[out] == anns[used] and (graph.tensors[out].shape == shape or not splits) for out, _ in uses) \
            and all(g == grads[0] for g in grads):
        return grads[0]
    outs = sorted({out for out, _ in uses})
    alike = all(anns[out] == anns[used] for out in outs)
    raise SpecializationError(
        f"parameter tensor {used!r} is read through op {consumer.name!r} ({consumer.kind}), whose output(s) "
        f"{outs} are laid out {'like it' if alike else 'unlike the input'} and whose uses give their gradients the "
        f"layouts {sorted({str(g) for g in grads})}: the specializer cannot tell how {used!r}'s gradient must be "
        "synchronised.  Annotate the op's outputs like its input (an elementwise op or a split of a weight no "
        "plan splits, each output used as a weight), or apply the op to the weight inside the consuming op's "
        "kernel")


def _of_parameters(graph: Graph) -> frozenset[str]:
    """The tensors computed from parameters alone (no placeholder feeds them); ``graph.nodes`` is in order."""
    out: set[str] = set()
    for n in graph.nodes:
        if n.kind == "parameter" or (not n.is_leaf and all(t in out for t in n.inputs)):
            out.update(n.outputs)
    return frozenset(out)


def _grad_sync_plans(graph: Graph, anns: Mapping[str, Annotation], given: Mapping[str, Annotation],
                     plan_of: Callable[..., Any]) -> tuple[dict[str, Any], tuple["GradSync", ...]]:
    """Each parameter's gradient synchronisation: per group of uses whose gradients have the same deduced layout,
    the local sum of their gradients moves to the plan's ``<param>.grad_sync`` annotation (default: the
    parameter's).  The first group's plan is ``<param>.grad_sync``, further groups' ``<param>.grad_sync.<k>``
    (a tied weight used on two stages: its second use's gradient travels back to the parameter by BSR and is
    added there — the gradient is the sum of both uses)."""
    plans: dict[str, Any] = {}
    syncs: list[GradSync] = []
    of_parameters = _of_parameters(graph)
    for p in graph.parameters:
        name = p.outputs[0]
        groups: list[tuple[Annotation, list[str]]] = []  # one or two uses: a list beats hashing annotations
        for used, consumer in _parameter_uses(graph, name):
            grad = _use_grad(graph, anns, used, consumer, of_parameters)
            same = next((g for g in groups if g[0] is grad or g[0] == grad), None)
            if same is None:
                groups.append((grad, [used]))
            else:
                same[1].append(used)
        dst = given.get(f"{name}.grad_sync", anns[name])
        for k, (grad, uses) in enumerate(groups):
            sync = f"{name}.grad_sync" if k == 0 else f"{name}.grad_sync.{k}"
            plans[sync] = plan_of(grad, dst, name, f"gradient synchronisation {sync!r}", sync)
            syncs.append(GradSync(name, sync, tuple(uses)))
    return plans, tuple(syncs)


def _weight_inputs(kind: str) -> tuple[int, ...]:
    from .ops import OPS

    return OPS[kind].weight_inputs


def _kernel_groups(graph: Graph, anns: Mapping[str, Annotation], bindings: Mapping[str, int]) -> list[list[int]]:
    """The devices that communicate inside a kernel: for every op whose kind mixes a dim of its first input that
    the plan splits (:attr:`~.ops.OpDef.mixes`, e.g. attention's sequence under context parallelism), the ranks
    holding the same box of that input but for those dims."""
    out: list[list[int]] = []
    for n in graph.nodes:
        mixes = op_def(n.kind).mixes  # every kind is known: deduction has looked each one up
        if not mixes or not n.inputs:
            continue
        t = n.inputs[0]
        shape = tuple(int(d) for d in evaluate_shape(graph.tensors[t].shape, bindings, tensor=t))
        kept = [d for d in range(len(shape)) if d not in mixes]
        rest: Callable[[Any], Any] = itemgetter(*kept) if kept else (lambda box: ())  # the box but the mixed dims
        groups: dict[Any, list[int]] = {}
        for dg, boxes in zip(anns[t].dg_union, subgroup_views(anns[t], shape).boxes):
            for r, box in zip(dg, boxes):
                groups.setdefault(rest(box), []).append(r)
        out.extend(g for g in groups.values() if len(g) > 1 and len(set(g)) > 1)
    return out


def _node_rank_sets(graph: Graph, anns: Mapping[str, Annotation]) -> dict[str, frozenset[int]]:
    """Per node, the ranks of its tensors' annotations: one set per distinct set of ranks, worked out once per
    distinct tuple of annotations (the nodes of a layer share a few)."""
    interned: dict[tuple[int, ...], frozenset[int]] = {}
    by_anns: dict[tuple[int, ...], frozenset[int]] = {}  # the ids of annotations that ``anns`` keeps alive
    out: dict[str, frozenset[int]] = {}
    for n in graph.nodes:
        tensors = n.inputs + n.outputs
        ids = tuple(id(anns[t]) for t in tensors)
        got = by_anns.get(ids)
        if got is None:
            key = tuple(sorted({r for t in tensors for r in anns[t].ranks}))
            got = by_anns[ids] = interned.setdefault(key, frozenset(key))
        out[n.name] = got
    return out


def _pipeline_order(graph: Graph, anns: Mapping[str, Annotation]) -> Callable[[list[int]], tuple[int, int]]:
    """Pipelines are numbered like the subgroups of the first placeholder (the data), then by smallest rank."""
    first = graph.placeholders[0].outputs[0] if graph.placeholders else None
    data = anns[first] if first else None

    def key(stage: list[int]) -> tuple[int, int]:
        """(the first subgroup of the data that holds a rank of ``stage``, or HSize if none; its smallest rank)"""
        if data is None:
            return 0, min(stage)
        held = [loc[0] for loc in map(data.locate, stage) if loc is not None]
        return min(held, default=data.hsize), min(stage)

    return key


def _micro_batching(settings: ExecutionSettings, pipelines: list[list[list[int]]],
                    order_key: Callable[[list[int]], tuple[int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    mbs = settings.micro_batch_size or ()
    micro, sizes = [], []
    for p in pipelines:
        k = order_key(p[0])[0]
        micro.append(settings.micro_batches(k))
        if k < len(mbs):
            sizes.append(mbs[k])
    return tuple(micro), tuple(sizes)


# ---- instantiation (§6.2) -----------------------------------------------------------------------------------
def _rank_table(plan: Any) -> dict[int, tuple[tuple[str, ...], int]]:
    """rank -> (communication kinds it executes, bytes it sends) for one plan."""
    kinds: dict[int, list[str]] = {}
    for op in plan.ops:
        for r in op_ranks(op):
            kinds.setdefault(r, []).append(op.kind)
    sent: dict[int, int] = {}
    for transfers in plan.transfers():
        for src, _, b, _ in transfers:
            sent[src] = sent.get(src, 0) + b
    return {r: (tuple(k), sent.get(r, 0)) for r, k in kinds.items()}


def _comm_op(prog: "Program", name: str, kind: str, phase: str, plan: Any, rank: int,
             inputs: tuple[str, ...] = (), outputs: tuple[str, ...] = ()) -> ExecOp:
    table = prog._rank_tables.get(id(plan))
    if table is None:
        table = prog._rank_tables[id(plan)] = _rank_table(plan)
    kinds, sent = table.get(rank, ((), 0))
    return ExecOp(name, kind, phase, inputs, outputs, plan, kinds, sent)


def _instantiate(prog: Program, rank: int) -> ExecutableGraph:
    g, anns = prog.graph, prog.annotations
    local = [n for n in g.nodes if rank in prog._node_ranks[n.name]]
    leaves = tuple(n.outputs[0] for n in local if n.is_leaf)
    params = frozenset(n.outputs[0] for n in local if n.kind == "parameter")
    pre, fwd = [], []
    for n in local:
        if n.is_leaf:
            continue
        if n.is_reshard:
            phase = "Pre" if n.name in prog.pre_reshards else "F"
            op = _comm_op(prog, n.name, "Reshard", phase, prog.comm_plans[n.name], rank, n.inputs, n.outputs)
            (pre if phase == "Pre" else fwd).append(op)
        else:
            fwd.append(prog._compute_ops[n.name][0])
    bwd: list[ExecOp] = []
    for op in reversed(fwd):
        for t in op.outputs:
            rp = prog.grad_reduce_plans.get(t)
            if rp is not None and anns[t].locate(rank) is not None:
                bwd.append(_comm_op(prog, f"{t}.grad_reduce", "GradReduce", "B", rp, rank, (t,), (t,)))
        if op.kind == "Reshard":
            bwd.append(_comm_op(prog, f"{op.name}.bwd", "ReshardBwd", "B", prog.backward_plans[op.name], rank,
                                op.outputs, op.inputs))
        else:
            bwd.append(prog._compute_ops[op.name][1])
    post = []
    for gs, ranks in zip(prog.grad_syncs, prog._sync_ranks):  # the uses' ranks send, the parameter's receive
        if rank in ranks:
            post.append(_comm_op(prog, gs.name, "GradSync", "Post", prog.grad_sync_plans[gs.name], rank, gs.uses,
                                 (gs.param,)))
    if params:
        post.append(ExecOp("optimizer", "OptimizerStep", "Post", tuple(sorted(params))))
    p, s = prog._where.get(rank, (None, None))
    return ExecutableGraph(rank, p, s, leaves, tuple(pre), tuple(fwd), tuple(bwd), tuple(post), params)


# ---- printing --------------------------------------------------------------------------------------------------
def _fmt_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def _step_bytes(eg: ExecutableGraph) -> int:
    """Bytes per step: the representative ``B`` is a whole step's batch (the HDim ratios are per step), so the
    F/B figures already cover all micro-batches."""
    return sum(o.bytes_sent for o in eg.ops)


def _describe_rank(prog: Program, rank: int) -> str:
    eg = prog.executable_graph(rank)
    where = (f"pipeline {eg.pipeline}, stage {eg.stage} of {prog.num_stages(eg.pipeline)} "
             f"(stage ranks {format_ranks(prog.stage_ranks(eg.pipeline, eg.stage))}), "
             f"{prog.num_micro_batches(eg.pipeline)} micro-batch(es)") if eg.pipeline is not None else \
        "no pipeline (takes part only in Pre/Post communication)"
    lines = [f"Executable graph of rank {rank}: {where}",
             f"  leaves: {len(eg.leaves)} ({len(eg.parameters)} parameters)"]
    for phase in PHASES:
        ops = eg.phase(phase)
        comms = [o for o in ops if o.is_comm and o.comm_kinds]  # an Identity op has no ranks (op_ranks)
        lines.append(f"  {phase}: {len(ops)} ops, {len(comms)} communicating")
        for o in ops:
            if o.is_comm and not o.comm_kinds:
                continue
            if not o.is_comm and len(ops) > 40:
                continue
            lines.append(f"    {o}")
    lines.append(f"  bytes sent per step: {_fmt_bytes(_step_bytes(eg))} (activations at the step's shapes "
                 + ", ".join(f"{k}={v}" for k, v in prog.bindings.items()) + ")")
    return "\n".join(lines)


def _describe_program(prog: Program) -> str:
    lines = [f"Program of graph {prog.graph.name!r}: {len(prog.ranks)} ranks in {len(prog.pipelines)} pipeline(s), "
             f"schedule {prog.schedule_kind}, symbols " + ", ".join(f"{k}={v}" for k, v in prog.bindings.items())]
    for i, p in enumerate(prog.pipelines):
        stages = " -> ".join(f"[{format_ranks(s)}]" for s in p)
        lines.append(f"  pipeline {i} ({prog.num_micro_batches(i)} micro-batches): {stages}")
    kinds: dict[str, int] = {}
    for plan in prog.comm_plans.values():
        for k in plan.kinds:
            kinds[k] = kinds.get(k, 0) + 1
    lines.append("  forward/Pre Reshards by kind: " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())))
    moving = [(name, plan) for name, plan in prog.comm_plans.items() if plan.kinds != [OpKind.IDENTITY]]
    moving.sort(key=lambda item: item[1].kinds == [OpKind.ALL_REDUCE])  # boundaries and gathers before TP all-reduces
    for name, plan in moving[:24]:
        lines.append(f"    {name}: {' + '.join(plan.kinds)}  {plan.src} -> {plan.dst}")
    if len(moving) > 24:
        lines.append(f"    ... {len(moving) - 24} more")
    sync: dict[str, int] = {}
    for plan in prog.grad_sync_plans.values():
        for k in plan.kinds:
            sync[k] = sync.get(k, 0) + 1
    lines.append("  gradient synchronisation by kind: " + ", ".join(f"{k} x{n}" for k, n in sorted(sync.items())))
    if prog.constraints:
        lines.append("  shape constraints: " + "; ".join(sorted({c.expr.constraint_text() for c in prog.constraints})))
    return "\n".join(lines)

