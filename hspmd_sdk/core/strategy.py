"""The high-level parallel strategy, as the paper's Tables 9-16 write it.

A :class:`Strategy` is a list of pipelines (data parallel across them).  A :class:`Pipeline` is a list of stages
and its own micro-batch size and number of micro-batches (heterogeneous pipelines may differ in both).  A
:class:`Stage` is a tensor-parallel group of ranks (``devices``; the TP degree is their number) holding the
inclusive layer range ``layers = [first, last]``.

Numbers and flags are strict: ``true`` is not a rank, ``"2"`` is not a micro-batch size, ``1`` is not ``zero1``.

Two kinds of checks:

* context-free ones run whenever a model is built (a rank used twice, a bad layer range, non-contiguous stages);
* context-dependent ones need the model, the cluster or the global batch: :meth:`Strategy.check` and
  :meth:`Strategy.load` with those arguments.  All raise :class:`~hspmd_sdk.errors.PlanValidationError` whose
  problems are ``(field path, reason)``, e.g.
  ``pipelines[1].stages[2].devices: rank 31 is not in the cluster (31 ranks: 0..30)``.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, model_validator

from ..errors import PlanValidationError
from .annotation import MAX_RANK, format_ranks
from .cluster import format_memory
from .plan import ZeroLevel, agree_zero
from .memory import OPTIMIZER_BYTES, PARAM_GRAD_BYTES, DeviceMemory, device_memory
from .loading import load_model
from .tp_ratios import ratio_problem

if TYPE_CHECKING:
    from .cluster import Cluster
    from .model_spec import ModelSpec

__all__ = ["Stage", "Pipeline", "Strategy", "memory_estimate"]

def _no_bool_or_text(value: Any) -> Any:
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


#: An integer that is not spelled as a bool or a string (numpy integers and 2.0 are accepted).
StrictInt = Annotated[int, BeforeValidator(_no_bool_or_text)]


def _no_bool_or_text_number(value: Any) -> Any:
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"expected a number, got {value!r}")
    return value

#: Bytes per parameter in the paper's mixed precision with Adam: bf16 parameter and gradient (2 + 2), and the
#: fp32 master copy, first and second moments (4 + 4 + 4), which ZeRO-1 shards across data-parallel replicas.
BF16_PARAM_GRAD_BYTES = PARAM_GRAD_BYTES
FP32_OPTIMIZER_BYTES = OPTIMIZER_BYTES


def parallel_text(devices: int, cp: int = 1) -> str:
    """A stage of ``devices`` devices in ``cp`` context-parallel groups, for people: ``TP2``, ``CP2`` or
    ``CP2×TP2`` (``cp`` groups of TP ranks)."""
    if cp <= 1:
        return f"TP{devices}"
    tp = devices // cp if devices % cp == 0 else None
    return f"CP{cp}×TP{tp}" if tp and tp > 1 else f"CP{cp}" if tp == 1 else f"CP{cp} of {devices} devices"


class _Worded(BaseModel):
    """Built directly (``Stage(devices=..., layers=...)``), a model words its errors as :meth:`Strategy.load` does:
    :class:`PlanValidationError` with ``(field path, reason)`` problems, not pydantic's text and links."""

    _what: ClassVar[str] = "input"

    def __init__(self, /, **data: Any) -> None:
        __tracebackhide__ = True  # pytest: the error is the caller's, not this frame's
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise PlanValidationError.from_pydantic(e, what=self._what) from None

    # pydantic calls a model's own __init__ for every nested value too (a Strategy's pipelines), which would turn a
    # nested problem into one at its parent's path; marked as the base __init__, it runs only for a direct call
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]


class Stage(_Worded):
    """A pipeline stage: a TP group of ranks (``devices``) holding layers ``first..last`` (inclusive).

    ``ratios`` (HAP's uneven TP, cited in the paper's §12.1): one positive integer per TP rank, in ``devices``
    order; every TP-split tensor of the stage is split in those proportions (the annotations' HDim ratios).
    ``None`` or all equal: the even split.  ``Stage(devices=[0, 1], layers=[0, 3], ratios=[3, 1])`` gives rank 0
    three quarters of every TP-split tensor (3 of 4 heads) and rank 1 one quarter."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    _what: ClassVar[str] = "stage"

    devices: list[StrictInt] = Field(min_length=1, description="ranks of the stage's tensor-parallel group")
    layers: list[StrictInt] = Field(min_length=2, max_length=2, description="[first, last] layer, inclusive")
    recompute: StrictBool = Field(default=False, description="activation recomputation (checkpointing)")
    ratios: list[StrictInt] | None = Field(default=None, exclude_if=lambda v: v is None,  # even: JSON unchanged
                                           description="uneven TP sharding (HAP): one positive integer per rank "
                                                       "of devices; None or all equal = even")
    cp: StrictInt = Field(default=1, ge=1, exclude_if=lambda v: v == 1,  # no CP: JSON unchanged
                          description="context parallelism: devices form cp groups of "
                                      "len(devices) // cp TP ranks each (a cp x tp grid, TP fastest)")

    @model_validator(mode="after")
    def _check(self) -> "Stage":
        seen: set[int] = set()
        for r in self.devices:
            if r < 0:
                raise ValueError(f"devices: rank {r} is negative")
            if r > MAX_RANK:
                raise ValueError(f"devices: rank {r} is out of range (a cluster has at most {MAX_RANK + 1} ranks)")
            if r in seen:
                raise ValueError(f"devices: rank {r} is listed twice")
            seen.add(r)
        if len(self.devices) % self.cp:
            raise ValueError(f"cp: {self.cp} context-parallel groups cannot share {len(self.devices)} device(s) "
                             f"{self.devices} evenly; give a cp that divides the number of devices")
        if self.cp > 1 and self.ratios is not None and len(set(self.ratios)) > 1:
            raise ValueError(f"ratios: uneven TP ratios {self.ratios} with cp={self.cp} are not supported yet; "
                             "use cp=1 or even ratios")
        if self.ratios is not None:
            if len(self.ratios) != len(self.devices):
                raise ValueError(f"ratios: {len(self.ratios)} ratio(s) {self.ratios} for {len(self.devices)} "
                                 f"device(s) {self.devices}; give one positive integer per TP rank, or none")
            bad = [r for r in self.ratios if r < 1]
            if bad:
                raise ValueError(f"ratios: {bad[0]} in {self.ratios} is not a positive integer; every TP rank "
                                 "holds a share of at least 1")
        first, last = self.layers
        if first < 0:
            raise ValueError(f"layers: first layer {first} is negative")
        if first > last:
            raise ValueError(f"layers: [{first}, {last}] is empty; give [first, last] with first <= last")
        return self

    @property
    def tp_degree(self) -> int:
        """Tensor-parallel degree: the number of ranks in one context-parallel group (all of them without CP)."""
        return len(self.devices) // self.cp

    @property
    def parallel_text(self) -> str:
        """The stage's parallelism for people: ``TP2``, ``CP2`` or ``CP2×TP2`` (:func:`parallel_text`)."""
        return parallel_text(len(self.devices), self.cp)

    @property
    def tp_groups(self) -> list[list[int]]:
        """The stage's TP groups, one per context-parallel coordinate in CP order: ``devices`` cut into ``cp``
        consecutive runs of ``tp_degree`` ranks (rank ``t`` of each run forms CP group ``t``)."""
        t = self.tp_degree
        return [list(self.devices[c * t:(c + 1) * t]) for c in range(self.cp)]

    @property
    def tp_ratios(self) -> tuple[int, ...] | None:
        """The TP split ratios in lowest terms (``[6, 2]`` -> ``(3, 1)``); ``None`` for an even split."""
        if self.ratios is None or len(set(self.ratios)) <= 1:
            return None
        g = math.gcd(*self.ratios)
        return tuple(r // g for r in self.ratios)

    @property
    def is_uneven(self) -> bool:
        """Whether the stage splits its TP-split tensors unevenly (``ratios`` not all equal)."""
        return self.tp_ratios is not None

    def share(self, rank: int) -> float:
        """The fraction of every TP-split tensor of the stage that ``rank`` holds (``1 / tp_degree`` if even)."""
        i = self.devices.index(rank)
        ratios = self.tp_ratios
        return 1 / self.tp_degree if ratios is None else ratios[i] / sum(ratios)

    @property
    def first_layer(self) -> int:
        return self.layers[0]

    @property
    def last_layer(self) -> int:
        return self.layers[1]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0] + 1

    def __str__(self) -> str:
        rc = " +recompute" if self.recompute else ""
        ratios = self.tp_ratios
        rt = f" ratios={':'.join(map(str, ratios))}" if ratios else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return f"R{format_ranks(self.devices)} L{self.layers[0]}-{self.layers[1]}{cp}{rt}{rc}"


class Pipeline(_Worded):
    """Stages in pipeline order, and this pipeline's ``num_micro_batches`` micro-batches of ``micro_batch_size``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    _what: ClassVar[str] = "pipeline"

    stages: list[Stage] = Field(min_length=1)
    micro_batch_size: StrictInt = Field(ge=1)
    num_micro_batches: StrictInt = Field(ge=1)
    zero_share: Annotated[float, BeforeValidator(_no_bool_or_text_number)] | None = Field(
        default=None, gt=0, exclude_if=lambda v: v is None,  # not given: JSON unchanged
        description="with ZeRO (Strategy.zero >= 1): this pipeline's share of each sharded tensor relative to the "
                    "other pipelines' (a pipeline without one counts 1; none given: even shares)")

    @model_validator(mode="after")
    def _check(self) -> "Pipeline":
        expected = 0
        for j, stage in enumerate(self.stages):
            first, last = stage.layers
            if first != expected:
                where = "the first stage must start at layer 0" if j == 0 else \
                    f"stages[{j - 1}] ends at layer {expected - 1}, so this stage must start at {expected}"
                raise ValueError(f"stages[{j}].layers: starts at layer {first} but {where} (stages hold "
                                 "contiguous layer ranges in order)")
            expected = last + 1
        return self

    @property
    def batch(self) -> int:
        """Samples per step: ``micro_batch_size * num_micro_batches``."""
        return self.micro_batch_size * self.num_micro_batches

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def cp_balance(self) -> int:
        """The CP degree whose balanced sequence order the runtime lays this pipeline's micro-batches out in
        (rank ``i`` of a CP group holding global chunks ``i`` and ``2N-1-i``: even causal work): the stages'
        common ``cp`` when every stage has the same ``cp > 1``, else 1 (the contiguous split).  The runtime's
        rule, read from the Program's annotations: :func:`hspmd_sdk.runtime.workers.executor.sequence_balance`."""
        cps = {st.cp for st in self.stages}
        return cps.pop() if len(cps) == 1 and min(cps) > 1 else 1

    @property
    def num_layers(self) -> int:
        """Layers covered: ``last layer of the last stage + 1``."""
        return self.stages[-1].layers[1] + 1

    @property
    def ranks(self) -> list[int]:
        return [r for s in self.stages for r in s.devices]

    def __str__(self) -> str:
        return f"{self.num_micro_batches} x bs{self.micro_batch_size}: " + " | ".join(map(str, self.stages))


class Strategy(_Worded):
    """Data parallelism over heterogeneous pipelines; ``schedule`` and ``zero1`` apply to all of them.

    >>> s = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 3]}],
    ...                                   "micro_batch_size": 1, "num_micro_batches": 4}]})
    >>> s.dp_degree, s.stage_of(1)
    (1, (0, 0))
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    _what: ClassVar[str] = "strategy"

    pipelines: list[Pipeline] = Field(min_length=1)
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    zero: ZeroLevel = Field(  # 0 and 1 are in zero1: the JSON of a strategy without ZeRO-2 is unchanged
        default=0, exclude_if=lambda v: v <= 1,
        description="sharding over each layer's data-parallel replicas: 1 the fp32 master weights and "
                    "Adam states (ZeRO-1), 2 also the gradients (ZeRO-2), 3 also the parameters, gathered "
                    "around each use (ZeRO-3)")
    zero1: StrictBool = Field(default=False, description="ZeRO-1 or more: the same as zero >= 1 (zero1=True given "
                                                         "alone is zero=1)")
    name: str | None = Field(default=None, description="free text; Strategy.load gives a strategy without one the "
                                                     "name of its shape (shape_name)")

    _zero_level = model_validator(mode="before")(classmethod(lambda cls, data: agree_zero(data)))

    @model_validator(mode="after")
    def _check(self) -> "Strategy":
        if self.zero == 3:
            problem = self._zero3_problem()
            if problem:
                raise ValueError(problem)
        shared = [i for i, p in enumerate(self.pipelines) if p.zero_share is not None]
        if shared and not self.zero1:
            raise ValueError(f"pipelines[{shared[0]}].zero_share: a share of the sharded state needs ZeRO "
                             "(zero >= 1; it is 0)")
        if shared and any(s.is_uneven for p in self.pipelines for s in p.stages):
            raise ValueError(f"pipelines[{shared[0]}].zero_share: uneven ZeRO shares beside uneven TP ratios are "
                             "not supported yet (their ZeRO split stays even): leave zero_share out")
        owner: dict[int, tuple[int, int]] = {}
        for i, p in enumerate(self.pipelines):
            for j, s in enumerate(p.stages):
                for r in s.devices:
                    if r in owner:
                        a, b = owner[r]
                        raise ValueError(f"pipelines[{i}].stages[{j}].devices: rank {r} is already in "
                                         f"pipelines[{a}].stages[{b}]")
                    owner[r] = (i, j)
        problem = _uneven_pipelines_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    # ---- loading -------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, data: Any, *, model: "ModelSpec | None" = None, cluster: "Cluster | None" = None,
             global_batch: int | None = None) -> "Strategy":
        """Validate a dict, JSON text, ``Path``/path string or ``Strategy``; then :meth:`check` the context given.

        A strategy without a ``name`` gets the name of its shape (:meth:`named`), so that every strategy the SDK
        reports (``plan.settings``, ``Job.events``) says what it is.

        Raises :class:`PlanValidationError` with every problem found as ``(field path, reason)``.
        """
        strategy = load_model(cls, data, what="strategy").named()
        strategy.check(model=model, cluster=cluster, global_batch=global_batch)
        return strategy

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> "Strategy":
        """A copy with ``update``'s fields; when it changes ``zero`` or ``zero1`` (pydantic's copy would not validate),
        the copy is validated, the level given winning over the other field: ``{"zero1": False}`` turns sharding
        off, ``{"zero1": True}`` is ``zero=1``, ``{"zero": 2}`` sets ``zero1`` too."""
        if not update or not {"zero", "zero1"} & update.keys():
            return super().model_copy(update=update, deep=deep)
        data = {k: v for k, v in self.model_dump().items() if k not in ("zero", "zero1")}
        return type(self).model_validate({**data, **update})

    def _zero3_problem(self) -> str | None:
        """Why ZeRO-3 cannot run this strategy, or ``None``.  ZeRO-3 gathers a layer's parameters for every
        forward and backward of every micro-batch, with collectives over the layer's replicas: every replica must
        gather in the same order.  GPipe runs every forward, then every backward, whatever the stages, and a
        replica with fewer micro-batches joins the others' extra gathers after its own; under 1F1B the pipelines
        need as many micro-batches and the same split of the layers into stages.  A recomputed stage gathers its
        layers again inside its backward (its forward rerun): the replicas of its layers must then sit in stages of
        the same layers that recompute too, so that each gathers in the same order within its pipeline's
        backward."""
        first = self.pipelines[0]

        def form(p: Pipeline) -> list[list[Any]]:
            return [[*s.layers] + (["recompute"] if s.recompute else []) for s in p.stages]

        if any(st.recompute for p in self.pipelines for st in p.stages):
            for i, p in enumerate(self.pipelines):
                if form(p) != form(first):
                    j = next((j for j, st in enumerate(p.stages) if st.recompute), 0)
                    return (f"pipelines[{i}].stages[{j}].recompute: activation recomputation under ZeRO-3 (zero: 3) "
                            "gathers a stage's parameters again inside its backward, so every pipeline must split "
                            f"the layers into the same stages and recompute the same ones (pipelines[0]: "
                            f"{form(first)}, pipelines[{i}]: {form(p)}); recompute alike in every pipeline, leave "
                            "recompute out or use zero: 2")
        for i, p in enumerate(self.pipelines[1:], 1):
            if self.schedule == "1f1b" and p.num_micro_batches != first.num_micro_batches:
                return (f"pipelines[{i}].num_micro_batches: under 1F1B, ZeRO-3 (zero: 3) needs every pipeline to "
                        "run as many micro-batches, so that the replicas of a layer gather its parameters in the "
                        f"same order: pipelines[0] runs {first.num_micro_batches}, pipelines[{i}] "
                        f"{p.num_micro_batches}; use schedule: gpipe (a replica running fewer joins the others' "
                        "gathers after its own) or give the pipelines different micro_batch_size")
            split = [tuple(s.layers) for s in p.stages]
            if self.schedule == "1f1b" and split != [tuple(s.layers) for s in first.stages]:
                return (f"pipelines[{i}].stages: under 1F1B, ZeRO-3 (zero: 3) needs every pipeline to split the "
                        f"layers into the same stages (pipelines[0]: {[list(s.layers) for s in first.stages]}, "
                        f"pipelines[{i}]: {[list(x) for x in split]}), so that the replicas of a layer run its "
                        "forwards and backwards in the same order; use schedule: gpipe for pipelines of different "
                        "shapes")
        return None

    def zero_shares(self) -> list[float] | None:
        """Per pipeline, its share of each ZeRO-sharded tensor (``Pipeline.zero_share``; 1 where not given), or
        ``None`` when no pipeline gives one (even shares)."""
        if all(p.zero_share is None for p in self.pipelines):
            return None
        return [1.0 if p.zero_share is None else p.zero_share for p in self.pipelines]

    def named(self) -> "Strategy":
        """This strategy if it has a ``name``, else a copy named by :meth:`shape_name`."""
        return self if self.name is not None else self.model_copy(update={"name": self.shape_name()})

    def shape_name(self) -> str:
        """A short name of the strategy's shape: ``dp2``, ``tp2``, ``pp2-gpipe``, ``dp2-tp2-pp2-zero1``,
        ``tp2/1-pp2`` (stages of different TP degrees); pipelines of different shapes:
        ``hetero(tp2+tp1 | tp1)`` (each pipeline's stages by TP degree).  ``single-device`` for one rank."""
        forms = [tuple(s.tp_degree for s in p.stages) for p in self.pipelines]
        if len(set(forms)) == 1:
            tps = forms[0]
            parts = [f"dp{len(forms)}"] if len(forms) > 1 else []
            if len(set(tps)) > 1:
                parts.append("tp" + "/".join(map(str, tps)))
            elif tps[0] > 1:
                parts.append(f"tp{tps[0]}")
            if len(tps) > 1:
                parts.append(f"pp{len(tps)}")
            head = "-".join(parts) or "single-device"
        else:
            head = "hetero(" + " | ".join("+".join(f"tp{t}" for t in f) for f in forms) + ")"
        uneven = list(dict.fromkeys(s.tp_ratios for p in self.pipelines for s in p.stages if s.tp_ratios))
        if uneven:
            head += "-ratios" + ",".join(":".join(map(str, r)) for r in uneven)
        cps = list(dict.fromkeys(s.cp for p in self.pipelines for s in p.stages if s.cp > 1))
        if cps:
            cp = "cp" + "/".join(map(str, cps))
            head = cp if head == "single-device" else f"{head}-{cp}"
        if self.schedule == "gpipe" and any(len(f) > 1 for f in forms):
            head += "-gpipe"
        if self.zero1 and len(forms) > 1:
            head += f"-zero{max(self.zero, 1)}"
        return head

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The JSON Schema of a strategy file."""
        return cls.model_json_schema()

    # ---- context checks ------------------------------------------------------------------------------------
    def problems(self, model: "ModelSpec | None" = None, cluster: "Cluster | None" = None,
                 global_batch: int | None = None) -> list[tuple[str, str]]:
        """Every context-dependent problem as ``(field path, reason)``; empty when the strategy fits."""
        out: list[tuple[str, str]] = []
        if model is not None:
            out += _model_problems(self, model)
        if cluster is not None:
            out += _cluster_problems(self, cluster)
        if global_batch is not None and self.global_batch != global_batch:
            out.append(("pipelines", _batch_problem(self, global_batch)))
        return out

    def check(self, model: "ModelSpec | None" = None, cluster: "Cluster | None" = None,
              global_batch: int | None = None) -> "Strategy":
        """Raise :class:`PlanValidationError` listing every problem against the context given; return self."""
        found = self.problems(model, cluster, global_batch)
        if found:
            raise PlanValidationError(found, what="strategy")
        return self

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        """Every rank used, sorted."""
        return sorted(r for p in self.pipelines for r in p.ranks)

    @property
    def num_ranks(self) -> int:
        return sum(len(p.ranks) for p in self.pipelines)

    @property
    def dp_degree(self) -> int:
        """Data-parallel degree: the number of pipelines."""
        return len(self.pipelines)

    @property
    def global_batch(self) -> int:
        """Samples per step over all pipelines."""
        return sum(p.batch for p in self.pipelines)

    def stage_of(self, rank: int) -> tuple[int, int]:
        """``(pipeline index, stage index)`` of ``rank``; ``KeyError`` if the strategy does not use it."""
        for i, p in enumerate(self.pipelines):
            for j, s in enumerate(p.stages):
                if rank in s.devices:
                    return i, j
        raise KeyError(f"rank {rank} is not used by this strategy (ranks {format_ranks(self.ranks)})")

    def stage(self, rank: int) -> Stage:
        i, j = self.stage_of(rank)
        return self.pipelines[i].stages[j]

    def tp_degree(self, rank: int) -> int:
        """TP degree of the stage holding ``rank``."""
        return self.stage(rank).tp_degree

    def tp_degrees(self) -> list[list[int]]:
        """TP degree of every stage, per pipeline."""
        return [[s.tp_degree for s in p.stages] for p in self.pipelines]

    # ---- reporting -----------------------------------------------------------------------------------------
    def memory_estimate(self, model: "ModelSpec", seq_len: int | None = None) -> dict[int, float]:
        """Estimated bytes of the plan's tensors per rank, no runtime (see :func:`memory_estimate`)."""
        return memory_estimate(self, model, seq_len=seq_len)

    def device_memory(self, model: "ModelSpec", cluster: "Cluster | None" = None, *,
                      seq_len: int | None = None, **options: Any) -> dict[int, DeviceMemory]:
        """The estimated memory of each rank on its device, runtime included: the one estimate every display shows
        (:func:`hspmd_sdk.core.memory.device_memory`; ``options``: its keywords)."""
        return device_memory(self, model, cluster, seq_len=seq_len, **options)

    def summary(self, model: "ModelSpec | None" = None, cluster: "Cluster | None" = None) -> str:
        """A readable description: pipelines, stages (ranks, device kinds, layers, TP), micro-batches and,
        when ``model`` is given, the estimated memory each rank needs on its device (:meth:`device_memory`: the
        plan's tensors, plus with ``cluster`` the device's runtime -- a GPU's CUDA context, a CPU worker's process
        baseline -- the figure the plan editor and the job dashboard show too)."""
        head = f"Strategy {self.name!r}" if self.name else "Strategy"
        lines = [f"{head}: {_n(self.dp_degree, 'pipeline')}, {_n(self.num_ranks, 'rank')}, schedule {self.schedule}, "
                 f"ZeRO-{max(self.zero, 1)} {'on' if self.zero1 else 'off'}, global batch {self.global_batch}"]
        est = device_memory(self, model, cluster) if model is not None else {}
        mem = {r: m.total for r, m in est.items()}
        for i, p in enumerate(self.pipelines):
            lines.append(f"  pipeline {i}: {_n(p.num_micro_batches, 'micro-batch', 'micro-batches')} x "
                         f"bs{p.micro_batch_size} ({_n(p.batch, 'sample')}), {_n(p.num_stages, 'stage')}"
                         + (f", ZeRO share {p.zero_share:g}" if p.zero_share is not None else ""))
            for j, s in enumerate(p.stages):
                kinds = _kinds(s.devices, cluster)
                line = (f"    stage {j}: ranks {format_ranks(s.devices):<10} TP{s.tp_degree:<2} "
                        f"layers {s.layers[0]}-{s.layers[1]} ({s.num_layers})")
                if kinds:
                    line += f"  [{kinds}]"
                if s.tp_ratios:
                    line += f"  ratios {':'.join(map(str, s.tp_ratios))}"
                if s.recompute:
                    line += "  recompute"
                if mem:
                    worst = max(s.devices, key=lambda r: mem[r])
                    tensors = f" (tensors {_gb(est[worst].tensors)})" if est[worst].runtime else ""
                    line += f"  ~{_gb(mem[worst])}/rank{tensors}{_over_memory(s.devices, mem, cluster)}"
                lines.append(line)
        if model is not None:  # (mem then has every rank)
            lines.append(f"  memory: estimate of bf16 params+grads, fp32 Adam states"
                         f"{f' (ZeRO-{max(self.zero, 1)} over DP)' if self.zero1 else ''} and in-flight activations at "
                         f"seq_len {model.max_seq_len}{_runtime_text(est)}; peak {_gb(max(mem.values()))}"
                         + _over_footer(self, mem, cluster))
        return "\n".join(lines)

    def __str__(self) -> str:
        return "Strategy(" + " || ".join(map(str, self.pipelines)) + ")"


# ---- helpers -------------------------------------------------------------------------------------------------
def _n(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else (many or one + 's')}"


def _gb(nbytes: float) -> str:
    return format_memory(nbytes)


def _runtime_text(est: dict[int, DeviceMemory]) -> str:
    """``, plus each device's runtime (CUDA context 2.0 GiB a GPU; process baseline 280.0 MiB a CPU worker)``;
    ``(no cluster: tensors only)`` without device kinds."""
    seen: dict[str, float] = {}
    for m in est.values():
        if m.kind:
            seen.setdefault("process baseline" if m.on_cpu else "CUDA context", m.runtime)
    if not seen:
        return " (no cluster given: tensors only, no device runtime)"
    what = "; ".join(f"{k} {_gb(b)}{' a CPU worker' if k == 'process baseline' else ' a GPU'}"
                     for k, b in sorted(seen.items()))
    return f", plus each device's runtime ({what})"


def _over_footer(strategy: Strategy, mem: dict[int, float], cluster: "Cluster | None") -> str:
    """``; 2 stages exceed their devices' memory (marked)`` when some do."""
    over = sum(1 for p in strategy.pipelines for s in p.stages if _over_memory(s.devices, mem, cluster))
    if not over:
        return ""
    verb = "exceeds its" if over == 1 else "exceed their"
    return f"; {_n(over, 'stage')} {verb} devices' memory (marked)"


def _over_memory(ranks: list[int], mem: dict[int, float], cluster: "Cluster | None") -> str:
    """`` — exceeds H800's 79.6 GiB`` when the estimate of a rank of the stage is above its device's memory."""
    if cluster is None:
        return ""
    for r in ranks:
        if 0 <= r < cluster.num_ranks and mem[r] > cluster.spec(r).memory_bytes:
            return f" — exceeds {cluster.kind(r)}'s {_gb(cluster.spec(r).memory_bytes)}"
    return ""


#: Where a required global batch is set, named by every message about it.
_WHERE_BATCH = ("the editor's global batch box (PlanEditor.set_global_batch), global_batch= of Strategy.load/check, "
                "--global-batch of hspmd validate/plan/simulate")


def _batch_problem(strategy: Strategy, global_batch: int) -> str:
    """Why the pipelines' samples do not make ``global_batch``, and what can change: the micro-batches when they
    can add up to it, else (fewer samples than pipelines, each of which takes at least one) the global batch."""
    dp = strategy.dp_degree
    parts = ", ".join(f"pipeline {i}: {p.num_micro_batches} x bs{p.micro_batch_size}"
                      for i, p in enumerate(strategy.pipelines))
    head = f"micro-batches sum to {strategy.global_batch} samples ({parts}) but the global batch is {global_batch}"
    if global_batch < dp:
        return (f"{head}; every pipeline takes at least one sample, so {_n(dp, 'pipeline')} cannot share "
                f"{_n(global_batch, 'sample')} whatever their micro-batches: raise the global batch to at least {dp} "
                f"in {_WHERE_BATCH}, or remove pipelines")
    even = (f"e.g. {global_batch // dp} x bs1 in each pipeline" if global_batch % dp == 0
            else f"e.g. {global_batch // dp + 1} x bs1 in {global_batch % dp} pipeline(s) and "
                 f"{global_batch // dp} x bs1 in the others")
    return (f"{head}; change num_micro_batches or micro_batch_size so the pipelines add up to {global_batch} "
            f"({even}), or change the global batch in {_WHERE_BATCH}")


def _kinds(ranks: list[int], cluster: "Cluster | None") -> str:
    if cluster is None:
        return ""
    counts: dict[str, int] = {}
    for r in ranks:
        k = cluster.kind(r) if 0 <= r < cluster.num_ranks else "?"
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{n}x{k}" for k, n in counts.items())


def _stages_at(p: Pipeline, layer: int) -> tuple[int, Stage]:
    """``(index, stage)`` of pipeline ``p`` holding ``layer``."""
    return next((j, s) for j, s in enumerate(p.stages) if s.layers[0] <= layer <= s.layers[1])


def _uneven_pipelines_problem(strategy: Strategy) -> str | None:
    """What the two-tier annotation cannot express about uneven stages beside other pipelines, or ``None``.

    An uneven stage puts its TP ranks in the top tier (one subgroup per TP rank, HDim = the TP split dim, HDim
    ratios = the stage's ratios).  With several pipelines, subgroup ``k`` is then the ``k``-th TP rank of every
    pipeline and the pipelines sit in the bottom tier, where a DS splits the batch evenly and cannot hold a
    second, different TP split.  So every pipeline's stage holding the same layer must have the same TP degree
    and ratios (all uneven alike, or all even), and the pipelines the same micro-batching."""
    if len(strategy.pipelines) < 2 or not any(s.is_uneven for p in strategy.pipelines for s in p.stages):
        return None
    p0 = strategy.pipelines[0]
    for i, p in enumerate(strategy.pipelines[1:], start=1):
        if (p.micro_batch_size, p.num_micro_batches) != (p0.micro_batch_size, p0.num_micro_batches):
            return (f"pipelines[{i}]: {p.num_micro_batches} x bs{p.micro_batch_size} beside pipelines[0]'s "
                    f"{p0.num_micro_batches} x bs{p0.micro_batch_size}: with a stage of uneven ratios, every "
                    "pipeline takes an equal batch share in the same micro-batches (the HSPMD annotation splits "
                    "the batch evenly inside an uneven TP subgroup); give the pipelines the same micro-batching")
    layers = min(p.num_layers for p in strategy.pipelines)
    for layer in range(layers):
        at = [_stages_at(p, layer) for p in strategy.pipelines]
        j0, s0 = at[0]
        for i, (j, s) in enumerate(at[1:], start=1):
            if (s.tp_degree, s.tp_ratios) == (s0.tp_degree, s0.tp_ratios) or not (s.is_uneven or s0.is_uneven):
                continue
            where = f"pipelines[{i}].stages[{j}]" if s.is_uneven else f"pipelines[0].stages[{j0}]"
            return (f"{where}.ratios: layer {layer} is {_tp_form(s0)} in pipelines[0].stages[{j0}] but "
                    f"{_tp_form(s)} in pipelines[{i}].stages[{j}]; an uneven TP stage beside a pipeline that splits "
                    "the same layer differently cannot be expressed by one two-tier annotation (the top tier holds "
                    "the uneven TP split, the bottom tier the pipelines); give every pipeline the same TP degree "
                    "and ratios on that layer, or train the pipelines separately")
    return None


def _tp_form(stage: Stage) -> str:
    """``TP2 ratios 3:1`` or ``TP2 even``."""
    ratios = stage.tp_ratios
    return f"TP{stage.tp_degree} " + (f"ratios {':'.join(map(str, ratios))}" if ratios else "even")


def _model_problems(strategy: Strategy, model: "ModelSpec") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    n = model.num_layers
    for i, p in enumerate(strategy.pipelines):
        if p.num_layers != n:
            out.append((f"pipelines[{i}]", f"layers cover 0..{p.num_layers - 1} but the model has {n} layers "
                                            f"(0..{n - 1})"))
        for j, s in enumerate(p.stages):
            if s.is_uneven:
                reason = ratio_problem(model, s, first=j == 0, last=j == len(p.stages) - 1)
                if reason:
                    out.append((f"pipelines[{i}].stages[{j}].ratios", reason))
                continue
            reasons = model.tp_problems(s.tp_degree) if s.tp_degree > 1 else []
            if reasons:
                out.append((f"pipelines[{i}].stages[{j}].devices", reasons[0]))
    return out


def _cluster_problems(strategy: Strategy, cluster: "Cluster") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    n = cluster.num_ranks
    for i, p in enumerate(strategy.pipelines):
        for j, s in enumerate(p.stages):
            outside = [r for r in s.devices if not 0 <= r < n]
            if outside:
                what = (f"rank {outside[0]} is" if len(outside) == 1 else
                        f"ranks {format_ranks(outside)} are")
                out.append((f"pipelines[{i}].stages[{j}].devices",
                            f"{what} not in the cluster ({n} ranks: 0..{n - 1})"))
    return out


def memory_estimate(strategy: Strategy, model: "ModelSpec", *, seq_len: int | None = None) -> dict[int, float]:
    """Estimated bytes of the plan's tensors each rank holds for training: an *estimate*, not a measurement, and
    without the device's runtime (the CUDA context of a GPU, a CPU worker's process baseline), which
    :func:`~hspmd_sdk.core.memory.device_memory` adds -- this is its :attr:`~.memory.DeviceMemory.tensors`.

    * Model states, the paper's mixed precision: bf16 parameters and gradients (2 + 2 bytes per parameter) and
      fp32 master weights, Adam m and v (12 bytes).  The stage's parameters (its layers, plus the embedding on
      the first stage and the final norm and LM head on the last) are divided by its TP degree.  With ZeRO-1
      a unit's 12 bytes are divided by the number of stages holding it (the DP degree for homogeneous pipelines).
      A stage with ``ratios`` gives each rank its share (:meth:`Stage.share`) instead of ``1 / TP degree``.
    * Activations: the model's ``layer_activation_bytes`` (bf16) for ``micro_batch_size * seq_len`` tokens
      per layer divided by the TP degree (sequence parallel), and the head's input on a last stage, times the
      micro-batches in flight (:func:`~hspmd_sdk.core.schedule.in_flight`); plus the largest transient buffer
      (the fp32 logits and their gradient on a last stage).  With ``recompute`` a layer keeps only its input
      (``hidden`` values a token) and one layer's full activations are rebuilt at a time.  ``seq_len`` defaults to ``model.max_seq_len``.
    """
    return {r: m.tensors for r, m in device_memory(strategy, model, seq_len=seq_len).items()}
