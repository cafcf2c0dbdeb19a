"""A base class for model configs: everything of the model contract that follows from the defined graph, so that a
new model (a family of the SDK, or a user's own in a notebook's module) writes only its fields, its graph and its
single-device reference.

Subclass :class:`ModelBase` (a frozen pydantic model), give it a ``family`` tag field, a ``TP_SPLIT`` table
(parameter name after ``layers.{i}.`` -> the dim tensor parallelism splits, ``None`` for Duplicate) and the two
methods :meth:`build_graph` and :meth:`build_reference`.  The defaults:

* :meth:`placements`: :func:`~hspmd_sdk.models.common.layered_placements` (tensors named ``layers.{i}.…`` on the
  stage of layer ``i``, the rest on the first or last stage) with ``TP_SPLIT``;
* :meth:`param_shapes` from the graph; :meth:`feeds`: the causal-LM convention (``tokens``, ``targets``);
* :meth:`init_parameter`: ``*norm*.weight`` / ``ln*.weight`` ones, ``*.bias`` zeros, the rest ``0.02 * N(0, 1)``;
* :meth:`tp_problems`: every TP-split parameter dim must divide by the degree;
* cost counts from the parameter shapes (matmul FLOPs ``2 * tokens * parameters``; a family refines them).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from ..core.loading import load_model
from ..core.strategy_plan import graph_of
from .common import layer_of, layered_placements, next_token_feeds, preset_of, seeded_normal

if TYPE_CHECKING:
    from ..core.graph import Graph
    from ..core.model_spec import Placement

__all__ = ["ModelBase"]


class ModelBase(BaseModel):
    """Defaults of the model contract (see the module docstring).  Subclasses set ``family``, ``TP_SPLIT``,
    ``PRESETS`` (optional), the fields ``name``, ``vocab_size``, ``hidden_size``, ``num_layers``,
    ``max_seq_len``, and :meth:`build_graph` / :meth:`build_reference`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}
    TP_SPLIT: ClassVar[Mapping[str, int | None]] = {}

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> Any:
        return preset_of(cls, cls.PRESETS, name, cls.__name__)

    @classmethod
    def load(cls, data: Any) -> Any:
        """A preset name, a dict, a JSON string or a path; raises ``PlanValidationError`` with field paths."""
        if isinstance(data, str) and data in cls.PRESETS:
            return cls.preset(data)
        return load_model(cls, data, what="model config")

    def with_layers(self, num_layers: int) -> Any:
        """The same model with ``num_layers`` layers (profiling one layer)."""
        return self.model_copy(update={"num_layers": int(num_layers)})

    # ---- the model contract --------------------------------------------------------------------------------
    def build_graph(self) -> "Graph":  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.build_graph")

    def build_reference(self, seed: int = 0) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.build_reference")

    def graph(self) -> "Graph":
        """The defined graph, built once per config."""
        return graph_of(self)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        g = self.graph()
        return {n.outputs[0]: tuple(int(d) for d in g.tensors[n.outputs[0]].shape) for n in g.parameters}

    def placements(self) -> list["Placement"]:
        return layered_placements(self.graph(), self.TP_SPLIT)

    def tp_problems(self, degree: int) -> list[str]:
        shapes = self.param_shapes()
        out = []
        for p in self.placements():
            if p.kind == "parameter" and p.tp_split is not None and p.tensor in shapes:
                size = shapes[p.tensor][p.tp_split]
                if size % degree:
                    out.append(f"TP degree {degree} does not divide dim {p.tp_split} ({size}) of {p.tensor!r}")
        return out

    def feeds(self, batch: Any) -> Mapping[str, Any]:
        """Token sequences ``[B, S+1]`` -> ``tokens = seq[:, :-1]``, ``targets = seq[:, 1:]``."""
        return next_token_feeds(batch)

    def init_parameter(self, name: str, shape: Sequence[int], seed: int) -> Any:
        import torch

        last = name.rsplit(".", 2)
        if name.endswith(".bias"):
            return torch.zeros(tuple(int(s) for s in shape), dtype=torch.float32)
        if name.endswith(".weight") and len(last) > 1 and ("norm" in last[-2] or last[-2].startswith("ln")):
            return torch.ones(tuple(int(s) for s in shape), dtype=torch.float32)
        return seeded_normal(name, shape, seed)

    # ---- cost counts (estimates from the parameter shapes; families refine them) ---------------------------
    def _counts(self) -> tuple[int, int, int]:
        layer = embed = head = 0
        where = {p.tensor: p.where for p in self.placements()}
        for name, shape in self.param_shapes().items():
            n = math.prod(shape)
            i = layer_of(name)
            if i == 0:
                layer += n
            elif i is None:
                if where.get(name) == "first":
                    embed += n
                else:
                    head += n
        return layer, embed, head

    def layer_param_count(self) -> int:
        return self._counts()[0]

    def embedding_param_count(self) -> int:
        return self._counts()[1]

    def head_param_count(self) -> int:
        return self._counts()[2]

    def param_count(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())

    def param_bytes(self, dtype_bytes: int = 2) -> int:
        return self.param_count() * dtype_bytes

    def layer_flops(self, tokens: int, seq_len: int | None = None) -> int:
        """Forward FLOPs of one layer: ``2 * tokens * parameters`` (its matmuls)."""
        return 2 * tokens * self.layer_param_count()

    def head_flops(self, tokens: int) -> int:
        return 2 * tokens * self.hidden_size * self.vocab_size  # type: ignore[attr-defined]

    def layer_activation_bytes(self, tokens: int, dtype_bytes: int = 2) -> int:
        """A rough estimate: eight hidden-sized values per token."""
        return tokens * 8 * self.hidden_size * dtype_bytes  # type: ignore[attr-defined]
