"""The model contract (SPEC §4), as the engine sees it: what every model config offers the core, the runtime,
the planner and the editor.  Re-exported as :class:`hspmd_sdk.models.ModelSpec`.

The engine never names a model family or a parameter: it asks the model.  A family (``hspmd_sdk/models/<family>/``)
implements this protocol on its config object (a frozen pydantic model, so it travels to workers as JSON with a
``family`` tag):

* **the defined graph** (:meth:`build_graph`, with its placeholders, parameters, Reshards and its loss tensor),
  and the parameters' full shapes (:meth:`param_shapes`, names = the reference module's ``state_dict`` keys);
* **the strategy → annotation-plan rule** as data: :meth:`placements` says, for every leaf and Reshard of the
  graph, which stage of a strategy holds it (a layer index, or the first / last stage), whether it is data, an
  activation or a parameter (or a parameter's other use: ZeRO gathering, a tied weight's second placement), and
  which dim tensor parallelism splits; :func:`hspmd_sdk.core.strategy_plan.plan_from_strategy` turns that table
  and a :class:`~hspmd_sdk.core.strategy.Strategy` into an annotation plan.  :meth:`tp_problems` says which TP
  degrees the model cannot take (heads, vocabulary, ...);
* **parameter initialisation** (:meth:`init_parameter`: a pure function of ``(name, shape, seed)``) and **the
  data convention** (:meth:`feeds`: a batch of token sequences → the graph's placeholders);
* **cost counts** for the planner: parameters, FLOPs and activation bytes per layer, embedding and head;
* **the single-device reference** ``nn.Module`` (:meth:`build_reference`), the independent check of every
  distributed run.

Methods that need torch import it themselves; declaring them here imports nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping, Protocol, Sequence, runtime_checkable

from ..errors import SpecializationError

if TYPE_CHECKING:
    from .graph import Graph

__all__ = ["ModelSpec", "Placement", "PlacementKind", "Where"]

#: ``"data"``: a placeholder, split along the batch across pipelines; ``"activation"``: a Reshard of data,
#: likewise; ``"parameter"``: a parameter leaf (replicated across pipelines, or ZeRO-1-sharded) or a Reshard of a
#: parameter (its full layout on the stage that uses it: ZeRO gathering, a tied weight's second placement).
PlacementKind = Literal["data", "activation", "parameter"]
#: The stage that holds a tensor: the stage of layer ``i``, or the first / last stage of each pipeline.
Where = int | Literal["first", "last"]


@dataclass(frozen=True)
class Placement:
    """Where one leaf or Reshard tensor of the defined graph lives under any strategy.

    ``tp_split``: the dim that tensor parallelism splits inside a stage (``None``: Duplicate on the stage's
    ranks).  For data and activations it is normally ``None`` (Megatron TP splits weights, not activations)."""

    tensor: str
    kind: PlacementKind
    where: Where
    tp_split: int | None = None


@runtime_checkable
class ModelSpec(Protocol):
    """What a model config offers the engine (see the module docstring).  ``LlamaConfig`` and ``GPTConfig``
    implement it; so can a user's own config (``tutorials/06_your_model.ipynb``)."""

    name: str
    num_layers: int
    vocab_size: int
    hidden_size: int
    max_seq_len: int

    @property
    def family(self) -> str:
        """The family tag the config's JSON carries (``"llama"``, ``"gpt"``, ...)."""
        ...

    # ---- graph and plan rule -----------------------------------------------------------------------------
    def build_graph(self) -> "Graph":
        """The defined graph (symbolic batch ``B`` and sequence ``S``), with its loss tensor marked."""
        ...

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter name -> full shape, in graph order (= the reference module's ``state_dict`` keys)."""
        ...

    def placements(self) -> Sequence[Placement]:
        """One :class:`Placement` for every leaf and for every Reshard a strategy must annotate."""
        ...

    def tp_problems(self, degree: int) -> list[str]:
        """Why tensor parallelism of ``degree`` cannot shard this model (empty: it can)."""
        ...

    # ---- data and initialisation (torch) --------------------------------------------------------------------
    def feeds(self, batch: Any) -> Mapping[str, Any]:
        """The graph's placeholders for a batch of token sequences ``[B, S+1]`` (e.g. tokens and targets)."""
        ...

    def init_parameter(self, name: str, shape: Sequence[int], seed: int) -> Any:
        """The full initial value of parameter ``name`` (a pure function of name, shape and seed)."""
        ...

    def build_reference(self, seed: int = 0) -> Any:
        """The plain single-device ``torch.nn.Module``: ``forward(tokens) -> logits``, ``loss(tokens, targets)``."""
        ...

    # ---- cost counts (the planner's) ------------------------------------------------------------------------
    def layer_param_count(self) -> int: ...
    def embedding_param_count(self) -> int: ...
    def head_param_count(self) -> int: ...
    def param_count(self) -> int: ...
    def layer_flops(self, tokens: int, seq_len: int | None = None) -> int: ...
    def head_flops(self, tokens: int) -> int: ...
    def layer_activation_bytes(self, tokens: int, dtype_bytes: int = 2) -> int: ...

    # ---- serialisation -------------------------------------------------------------------------------------
    def model_dump(self, *, mode: str = "python") -> dict[str, Any]: ...


def model_json(model: Any) -> dict[str, Any]:
    """The JSON form of a model config, with its family tag (what workers and checkpoints store)."""
    data = model.model_dump(mode="json")
    data.setdefault("family", getattr(model, "family", type(model).__name__))
    return data


def placements_by_tensor(model: Any) -> Mapping[str, Placement]:
    """``model.placements()`` keyed by tensor name; a tensor placed twice is an error naming it."""
    out: dict[str, Placement] = {}
    for p in model.placements():
        if p.tensor in out:
            raise SpecializationError(f"model {getattr(model, 'name', model)!r} places tensor {p.tensor!r} twice")
        out[p.tensor] = p
    return out
