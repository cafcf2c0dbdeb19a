"""The annotation plan (paper §3): tensor name -> :class:`~hspmd_sdk.core.annotation.Annotation` for the leaf
operators (parameters, placeholders) and Reshard operators of the defined graph.

The plan is plain JSON that users edit; everything else (deduction, communication, executable graphs) follows
from it and the model graph.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import PlanValidationError
from .annotation import Annotation, format_ranks
from .loading import load_model

if TYPE_CHECKING:
    from .cluster import Cluster
    from .model_spec import ModelSpec
    from .strategy import Strategy

__all__ = ["AnnotationPlan"]


class AnnotationPlan(BaseModel):
    """Annotations of the leaf and Reshard operators of a defined graph, by tensor name.

    ``meta`` is free-form (e.g. the strategy it came from); nothing in the SDK depends on it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: Literal[1] = 1
    annotations: dict[str, Annotation] = Field(description="tensor name -> annotation")
    meta: dict[str, Any] = Field(default_factory=dict)

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
    def from_strategy(cls, model: "ModelSpec", strategy: "Strategy", cluster: "Cluster") -> "AnnotationPlan":
        """The annotation plan that realises a high-level :class:`Strategy` for ``model`` on ``cluster``."""
        from .strategy_plan import plan_from_strategy  # type: ignore[import-not-found]

        return plan_from_strategy(model, strategy, cluster)

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
        for key, value in self.meta.items():
            lines.append(f"  meta.{key}: {value}")
        return "\n".join(lines)
