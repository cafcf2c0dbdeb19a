"""What model families share: the layered placement rule, the language-model data convention, seeded
initialisation and the preset/loading plumbing.  Pure Python (torch is imported inside the functions that use it).
"""
from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..core.model_spec import Placement, Where
from ..errors import PlanValidationError

if TYPE_CHECKING:
    import torch

    from ..core.graph import Graph

__all__ = ["layered_placements", "next_token_feeds", "next_token_split", "parameter_seed", "seeded_normal",
           "INIT_STD", "layer_of", "TPSplit"]

INIT_STD = 0.02
_LAYER = re.compile(r"^layers\.(\d+)\.")

#: ``tp_split(tensor) -> dim | None``, or a mapping from a name suffix (the part after ``layers.{i}.``, or the
#: whole name outside layers) to the dim.
TPSplit = Callable[[str], "int | None"] | Mapping[str, "int | None"]


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor belongs to by its name ``layers.{i}.…`` (``None`` outside the layers)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


_ABSENT = object()


def _split_fn(tp_split: TPSplit) -> Callable[[str, str], "int | None"]:
    """``fn(tensor, root parameter) -> dim``: a callable gets the tensor's name; a mapping is looked up by the
    tensor's key, else (a Reshard of a parameter: ZeRO gathering, a tied use) by its parameter's key."""
    if callable(tp_split):
        return lambda name, root: tp_split(name)  # type: ignore[operator]
    table = dict(tp_split)

    def key(name: str) -> str:
        m = _LAYER.match(name)
        return name[m.end():] if m else name

    def look(name: str, root: str) -> int | None:
        got = table.get(key(name), _ABSENT)
        return table.get(key(root)) if got is _ABSENT else got  # type: ignore[return-value]

    return look


def layered_placements(graph: "Graph", tp_split: TPSplit) -> list[Placement]:
    """The placement table of a layered model (SPEC §4's strategy → plan rule for the families here, and for a
    user's model whose tensors are named ``layers.{i}.…``).

    * a tensor named ``layers.{i}.…`` lives on the stage of layer ``i``; every other leaf and Reshard on the first
      stage if the graph reads it before the first layer, else on the last stage (the embedding and the data on
      the first, the head, the targets and a tied LM-head weight on the last);
    * placeholders are ``data``, Reshards of data are ``activation``, parameters and Reshards of parameters are
      ``parameter``;
    * ``tp_split`` gives each parameter's (and its Reshards') TP split dim; data and activations are Duplicate
      inside a stage.
    """
    split = _split_fn(tp_split)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    first_layer = next((i for i, n in enumerate(graph.nodes) if layer_of(n.name) is not None), len(graph.nodes))
    out: list[Placement] = []
    for node in graph.nodes:
        if not (node.is_leaf or node.is_reshard):
            continue
        name = node.outputs[0]
        root = node
        while root.is_reshard:
            root = graph.producer(root.inputs[0])
        if root.kind == "parameter":
            kind, tp = "parameter", split(name, root.outputs[0])
        else:
            kind, tp = ("data" if node.is_leaf else "activation"), None
        layer = layer_of(name)
        where: Where
        if layer is not None:
            where = layer
        else:
            readers = [order[c.name] for c in graph.consumers(name)]
            at = min(readers) if readers else order[node.name]
            where = "first" if at <= first_layer else "last"
        out.append(Placement(name, kind, where, tp))  # type: ignore[arg-type]
    return out


def next_token_split(seq: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """``seq[B, S+1]`` -> ``(tokens, targets) = (seq[:, :-1], seq[:, 1:])``."""
    return seq[:, :-1], seq[:, 1:]


def next_token_feeds(batch: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """The causal-LM data convention: token sequences ``[B, S+1]`` -> ``{"tokens", "targets"}``."""
    tokens, targets = next_token_split(batch)
    return {"tokens": tokens, "targets": targets}


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name``: sha256 of ``f"{seed}:{name}"``, first 8 bytes, 63 bits."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def seeded_normal(name: str, shape: Sequence[int], seed: int, std: float = INIT_STD) -> "torch.Tensor":
    """``std * N(0, 1)`` of ``shape`` (float32, CPU) from a generator seeded by :func:`parameter_seed`: the same
    full value on every process."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    return torch.randn(tuple(int(s) for s in shape), generator=gen, dtype=torch.float32) * std


def preset_of(cls: Any, presets: Mapping[str, Mapping[str, Any]], name: str, family: str) -> Any:
    """``cls(name=name, **presets[name])``; an unknown name is a :class:`PlanValidationError` listing them."""
    if name not in presets:
        raise PlanValidationError([("model", f"unknown {family} preset {name!r}; presets are "
                                             f"{', '.join(presets)}")], what="model config")
    return cls(name=name, **presets[name])


def tp_divisibility(degree: int, dims: Mapping[str, int]) -> list[str]:
    """``"TP degree t does not divide name=value"`` for every dim in ``dims`` that ``degree`` does not divide."""
    return [f"TP degree {degree} does not divide {k}={v}" for k, v in dims.items() if v % degree]
