"""The annotation plan (paper §3): tensor name -> :class:`~hspmd_sdk.core.annotation.Annotation` for the leaf
operators (parameters, placeholders) and Reshard operators of the defined graph.

The plan is plain JSON that users edit; everything else (deduction, communication, executable graphs) follows
from it and the model graph.  How its Program runs (schedule, micro-batching, recomputation, a mixed-length
candidate's longest sequence and windows) is :class:`ExecutionSettings`, a typed part of the plan (SPEC §9);
``meta`` is free-form and nothing reads it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

from ..errors import PlanValidationError
from .annotation import Annotation, format_ranks
from .loading import load_model
from .schedule import ScheduleKind

if TYPE_CHECKING:
    from .cluster import Cluster

__all__ = ["AnnotationPlan", "ExecutionSettings"]


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"a ZeRO level is 0, 1, 2 or 3, not {value!r}")
    return value


#: what a strategy shards over each layer's data-parallel replicas (SPEC §15): 0 nothing, 1 optimizer states and fp32
#: masters (ZeRO-1), 2 also gradients (ZeRO-2), 3 also parameters (ZeRO-3)
ZeroLevel = Annotated[Literal[0, 1, 2, 3], BeforeValidator(_no_bool)]

#: ZeRO-3's least unit of parameters gathered together (bytes of their global sizes): consecutive layers' units of
#: one set of ranks are merged until they hold this much (FSDP's size-based wrapping; the runtime's
#: ``runtime.workers.zero3`` and the memory estimate read it).
ZERO3_UNIT_BYTES = 4 * 2**20


def agree_zero(data: Any) -> Any:
    """A model's input with ``zero`` and its alias ``zero1`` in agreement (a before-validator of
    :class:`~hspmd_sdk.core.strategy.Strategy` and :class:`ExecutionSettings`): ``zero1=True`` alone is ``zero=1``;
    ``zero >= 1`` alone sets ``zero1``; both given must agree (``ValueError`` naming both otherwise)."""
    if not isinstance(data, dict) or ("zero" not in data and "zero1" not in data):
        return data
    data = dict(data)
    level, flag = data.get("zero"), data.get("zero1")
    if "zero" not in data:
        data["zero"] = 1 if flag is True else 0
    elif "zero1" not in data:
        data["zero1"] = type(level) is int and level >= 1
    elif type(level) is int and type(flag) is bool and (level >= 1) != flag:
        raise ValueError(f"zero1: {flag} contradicts zero: {level} (zero1 means zero >= 1): give one of them")
    return data


class ExecutionSettings(BaseModel):
    """How a plan's Program runs, beside where its tensors live.  Specialization reads the schedule,
    micro-batching and recomputation; the runtime reads the strategy (to re-plan after a failure or a straggler)
    and a mixed-length candidate's ``max_seq_len`` and ``windows``.  :func:`~hspmd_sdk.core.strategy_plan.
    plan_from_strategy` fills every field from a :class:`~hspmd_sdk.core.strategy.Strategy`; a hand-written plan
    may leave them all at their defaults (one pipeline step of one micro-batch, 1F1B).

    >>> ExecutionSettings(schedule="gpipe", micro_batch_size=[2, 1], num_micro_batches=[4, 4]).batch
    12
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schedule: ScheduleKind = Field("1f1b", description="the pipeline schedule of every pipeline")
    micro_batch_size: tuple[PositiveInt, ...] | None = Field(
        None, description="samples per micro-batch, one per pipeline in the order of the plan's DG Unions")
    num_micro_batches: tuple[PositiveInt, ...] | PositiveInt = Field(
        1, description="micro-batches per step, one per pipeline (or one number for all)")
    recompute: tuple[NonNegativeInt, ...] = Field((), description="ranks that recompute activations in backward")
    zero: ZeroLevel = Field(  # 0 and 1 are in zero1: the JSON of a plan without ZeRO-2 is unchanged
        0, exclude_if=lambda v: v <= 1,
        description="what is sharded over each parameter's replicas: 1 optimizer states, 2 also "
                    "gradients, 3 also parameters")
    zero1: bool = Field(False, description="optimizer states sharded over each parameter's replicas (zero >= 1)")
    zero1_replicated: tuple[str, ...] = Field(
        (), description="parameters ZeRO-1 could not shard (their dims do not divide): kept replicated")
    strategy: dict[str, Any] | None = Field(None, description="the Strategy (its JSON) this plan realises")
    max_seq_len: PositiveInt | None = Field(
        None, description="a mixed-length candidate: the longest sequence it is planned for")
    windows: tuple[PositiveInt, ...] | None = Field(
        None, description="a mixed-length candidate: the tokens one micro-batch may hold, per pipeline")

    _zero_level = model_validator(mode="before")(classmethod(lambda cls, data: agree_zero(data)))

    @property
    def batch(self) -> int | None:
        """Samples per step that the micro-batches add up to, when ``micro_batch_size`` is given per pipeline."""
        mbs, nmb = self.micro_batch_size, self.num_micro_batches
        if mbs is None:
            return None
        nmb = nmb if isinstance(nmb, tuple) else (nmb,) * len(mbs)
        return sum(a * b for a, b in zip(mbs, nmb)) if len(nmb) == len(mbs) else None

    def micro_batches(self, pipeline: int) -> int:
        """Micro-batches per step of pipeline ``pipeline`` (by DG Union order)."""
        nmb = self.num_micro_batches
        if isinstance(nmb, int):
            return nmb
        return nmb[pipeline] if pipeline < len(nmb) else 1

    @property
    def is_candidate(self) -> bool:
        """A mixed-length candidate: the strategy, its longest sequence and its windows are all known."""
        return self.strategy is not None and self.max_seq_len is not None and self.windows is not None


#: The keys of ``meta`` that plans written before :class:`ExecutionSettings` existed used for its fields.
_LEGACY = tuple(ExecutionSettings.model_fields)


class AnnotationPlan(BaseModel):
    """Annotations of the leaf and Reshard operators of a defined graph, by tensor name, and the
    :class:`ExecutionSettings` its Program runs with.

    ``meta`` is free-form (where the plan came from, the strategy's name); nothing in the SDK reads it.  A plan
    that ``plan_from_strategy`` wrote before ``settings`` existed (its ``meta`` carried the schedule,
    micro-batching and the rest: old plan files and checkpoint manifests) loads with those keys moved into
    ``settings``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: Literal[1] = 1
    annotations: dict[str, Annotation] = Field(description="tensor name -> annotation")
    settings: ExecutionSettings = Field(default_factory=ExecutionSettings,
                                        description="how the plan's Program runs: schedule, micro-batching, "
                                                    "recomputation, ZeRO-1")
    meta: dict[str, Any] = Field(default_factory=dict, description="free-form notes; nothing reads them")

    @model_validator(mode="before")
    @classmethod
    def _legacy_meta(cls, data: Any) -> Any:
        if (isinstance(data, dict) and "settings" not in data and isinstance(data.get("meta"), dict)
                and data["meta"].get("source") == "plan_from_strategy"):
            meta = dict(data["meta"])
            moved = {k: meta.pop(k) for k in _LEGACY if k in meta}
            meta.pop("mixed_strategy", None)  # the candidate's strategy: the same as "strategy"
            if moved:
                data = {**data, "settings": moved, "meta": meta}
        return data

    @classmethod
    def load(cls, data: Any) -> "AnnotationPlan":
        """Validate a dict, JSON text, ``Path``/path string or plan; raises ``PlanValidationError`` with paths
        such as ``annotations.layers.0.attn.wq.ds_union[1]``."""
        return load_model(cls, data, what="annotation plan")

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The JSON Schema of an annotation-plan file."""
        return cls.model_json_schema()

    @classmethod
    def from_strategy(cls, *args: Any, **kwargs: Any) -> "AnnotationPlan":
        """Gone: the plan model knows no strategy.  The plan of a strategy is
        :func:`~hspmd_sdk.core.strategy_plan.plan_from_strategy` ``(model, strategy, cluster)``."""
        raise AttributeError("AnnotationPlan.from_strategy() is gone (the plan model imports nothing of the "
                             "strategy -> plan translation): use `from hspmd_sdk.core.strategy_plan import "
                             "plan_from_strategy` and `plan_from_strategy(model, strategy, cluster)`")

    # ---- context checks ------------------------------------------------------------------------------------
    def problems(self, cluster: "Cluster | None" = None) -> list[tuple[str, str]]:
        """Context-dependent problems as ``(field path, reason)``: ranks that ``cluster`` does not have."""
        out: list[tuple[str, str]] = []
        if cluster is not None:
            n = cluster.num_ranks
            for name, a in self.annotations.items():
                for k, dg in enumerate(a.dg_union):
                    for r in dg:
                        if r >= n:
                            out.append((f"annotations.{name}.dg_union[{k}]",
                                        f"rank {r} is not in the cluster ({n} ranks: 0..{n - 1})"))
        return out

    def check(self, cluster: "Cluster | None" = None) -> "AnnotationPlan":
        """Raise :class:`PlanValidationError` listing every problem against ``cluster``; return self."""
        found = self.problems(cluster)
        if found:
            raise PlanValidationError(found, what="annotation plan")
        return self

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        """Every rank named by some annotation, sorted."""
        return sorted({r for a in self.annotations.values() for r in a.ranks})

    def __getitem__(self, name: str) -> Annotation:
        try:
            return self.annotations[name]
        except KeyError:
            raise KeyError(f"no annotation for tensor {name!r} in this plan ({len(self.annotations)} tensors)") \
                from None

    def summary(self, limit: int = 40) -> str:
        """One line per tensor (the first ``limit``): name, HSize and the annotation in compact notation."""
        lines = [f"AnnotationPlan: {len(self.annotations)} tensors on ranks {format_ranks(self.ranks)}"]
        width = min(max((len(n) for n in self.annotations), default=0), 48)
        for n, (name, a) in enumerate(self.annotations.items()):
            if n == limit:
                lines.append(f"  ... {len(self.annotations) - limit} more")
                break
            lines.append(f"  {name:<{width}}  HSize {a.hsize}  {a}")
        for key, value in self.settings.model_dump(exclude_defaults=True, exclude={"strategy"}).items():
            lines.append(f"  settings.{key}: {value}")
        for key, value in self.meta.items():
            lines.append(f"  meta.{key}: {value}")
        return "\n".join(lines)
