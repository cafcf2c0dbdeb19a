"""The defined graph (paper §3): one logical program, written from the viewpoint of one device.

Three kinds of operators:

* leaf operators — ``placeholder`` (data) and ``parameter`` (model weights) — whose output annotation the
  annotation plan gives;
* ``Reshard`` markers, whose *output* annotation the plan gives (a Reshard the plan does not name keeps its
  input's annotation, i.e. it resolves to ``Identity``);
* every other operator (:mod:`hspmd_sdk.core.ops`), whose annotation is deduced (§6.1).

A :class:`Graph` is an immutable value: nodes in topological order and a table of tensors with symbolic shapes
(:mod:`hspmd_sdk.core.symbolic`).  Build one with :class:`GraphBuilder` and the functions of
:mod:`hspmd_sdk.core.ops`::

    g = GraphBuilder("mlp")
    x = g.placeholder("x", (sym("B"), 16))
    w = g.parameter("w", (16, 8))
    y = ops.dot(x, w, name="y")
    graph = g.build()
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from ..errors import ShapeError, SpecializationError
from .op_registry import RESHARD, infer_dtype, infer_shapes
from .symbolic import Dim, Sym, evaluate_dim, shape_str, sym

__all__ = ["TensorSpec", "Node", "Graph", "GraphBuilder", "Tensor", "LEAF_KINDS", "RESHARD"]

PLACEHOLDER = "placeholder"
PARAMETER = "parameter"
LEAF_KINDS = (PLACEHOLDER, PARAMETER)


@dataclass(frozen=True)
class TensorSpec:
    """A logical (global) tensor: its name, symbolic shape and dtype."""

    name: str
    shape: tuple[Dim, ...]
    dtype: str = "float32"

    def __str__(self) -> str:
        return f"{self.name}{shape_str(self.shape)}:{self.dtype}"


@dataclass(frozen=True)
class Node:
    """One operator of the defined graph.  ``attrs`` is a sorted tuple of ``(key, value)`` pairs (hashable)."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...] = ()

    @property
    def attr(self) -> dict[str, Any]:
        return dict(self.attrs)

    @property
    def is_leaf(self) -> bool:
        return self.kind in LEAF_KINDS

    @property
    def is_reshard(self) -> bool:
        return self.kind == RESHARD

    def __str__(self) -> str:
        args = ", ".join([*self.inputs, *(f"{k}={v}" for k, v in self.attrs if k != "shape")])
        return f"{', '.join(self.outputs)} = {self.kind}({args})"


@dataclass(frozen=True)
class Graph:
    """An immutable defined graph: ``nodes`` in topological order, ``tensors`` by name.

    ``hints`` gives a typical value of each symbol (e.g. ``{"S": 4096}``), used for representative shapes when
    communication volumes are estimated; ``meta`` is free-form.  ``loss``: the scalar tensor training minimises
    (:meth:`GraphBuilder.mark_loss`); the runtime reads it from here, never by a conventional name.
    """

    name: str
    nodes: tuple[Node, ...]
    tensors: Mapping[str, TensorSpec]
    hints: Mapping[str, int] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    loss: str | None = None
    _producer: Mapping[str, Node] = field(default_factory=dict, repr=False, compare=False)
    _consumers: Mapping[str, tuple[Node, ...]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        producer: dict[str, Node] = {}
        consumers: dict[str, list[Node]] = {}
        for n in self.nodes:
            for t in n.inputs:
                if t not in producer:
                    raise SpecializationError(f"graph {self.name!r}: node {n.name!r} reads tensor {t!r} before "
                                              "any node produces it (nodes must be in topological order)")
                consumers.setdefault(t, []).append(n)
            for t in n.outputs:
                if t in producer:
                    raise SpecializationError(f"graph {self.name!r}: tensor {t!r} is produced twice")
                producer[t] = n
        if self.loss is not None and self.loss not in producer:
            raise SpecializationError(f"graph {self.name!r}: the loss tensor {self.loss!r} is not in the graph")
        object.__setattr__(self, "_producer", producer)
        object.__setattr__(self, "_consumers", {k: tuple(v) for k, v in consumers.items()})

    # ---- queries -------------------------------------------------------------------------------------------
    def producer(self, tensor: str) -> Node:
        try:
            return self._producer[tensor]
        except KeyError:
            raise KeyError(f"graph {self.name!r} has no tensor {tensor!r}") from None

    def consumers(self, tensor: str) -> tuple[Node, ...]:
        return self._consumers.get(tensor, ())

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"graph {self.name!r} has no node {name!r}")

    @property
    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if n.is_leaf]

    @property
    def parameters(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == PARAMETER]

    @property
    def placeholders(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == PLACEHOLDER]

    @property
    def reshards(self) -> list[Node]:
        return [n for n in self.nodes if n.is_reshard]

    @property
    def symbols(self) -> set[str]:
        out: set[str] = set()
        for t in self.tensors.values():
            for d in t.shape:
                if isinstance(d, Sym):
                    out.update(d.factors)
        return out

    def shape(self, tensor: str) -> tuple[Dim, ...]:
        return self.tensors[tensor].shape

    # ---- binding -------------------------------------------------------------------------------------------
    def infer_bindings(self, feeds: Mapping[str, Sequence[int]]) -> dict[str, int]:
        """Bind symbols from the concrete shapes of placeholders (``{"tokens": (4, 64)}`` -> ``{"B": 4, "S": 64}``)."""
        out: dict[str, int] = {}
        for name, concrete in feeds.items():
            spec = self.tensors.get(name)
            if spec is None:
                raise ShapeError(f"graph {self.name!r} has no tensor {name!r} to feed")
            if len(concrete) != len(spec.shape):
                raise ShapeError(f"tensor {name!r}: expected {len(spec.shape)} dims {shape_str(spec.shape)}, "
                                 f"got {tuple(concrete)}")
            for i, (d, c) in enumerate(zip(spec.shape, concrete)):
                if isinstance(d, Sym) and len(d.factors) == 1 and d.coef == 1:
                    prev = out.get(d.factors[0])
                    if prev is not None and prev != c:
                        raise ShapeError(f"tensor {name!r} dim {i}: symbol {d} is {c} here but {prev} elsewhere")
                    out[d.factors[0]] = int(c)
        return out

    def bind(self, bindings: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        """Concrete global shape of every tensor; ``ShapeError`` names the tensor, dim and failed constraint."""
        return {name: tuple(evaluate_dim(d, bindings, tensor=name, dim=i) for i, d in enumerate(t.shape))
                for name, t in self.tensors.items()}

    def summary(self) -> str:
        lines = [f"Graph {self.name!r}: {len(self.nodes)} nodes, {len(self.parameters)} parameters, "
                 f"{len(self.reshards)} Reshards, symbols {sorted(self.symbols)}"]
        for n in self.nodes:
            outs = ", ".join(str(self.tensors[t]) for t in n.outputs)
            lines.append(f"  {outs} = {n.kind}({', '.join(n.inputs)})")
        return "\n".join(lines)


@dataclass(frozen=True)
class Tensor:
    """A handle on a tensor of a graph under construction (what :mod:`ops` functions take and return)."""

    builder: "GraphBuilder" = field(repr=False, compare=False)
    name: str
    shape: tuple[Dim, ...]
    dtype: str = "float32"

    @property
    def ndim(self) -> int:
        return len(self.shape)


class GraphBuilder:
    """Mutable builder of a :class:`Graph`.  Names: explicit where given, else ``<scope>.<kind>[_<n>]``."""

    def __init__(self, name: str = "graph", *, hints: Mapping[str, int] | None = None,
                 meta: Mapping[str, Any] | None = None) -> None:
        self.name = name
        self.hints = dict(hints or {})
        self.meta = dict(meta or {})
        self._nodes: list[Node] = []
        self._tensors: dict[str, TensorSpec] = {}
        self._scope: list[str] = []
        self._loss: str | None = None

    # ---- naming --------------------------------------------------------------------------------------------
    def scope(self, prefix: str) -> "_Scope":
        """Context manager: auto-generated names inside get ``prefix.`` in front."""
        return _Scope(self, prefix)

    def _fresh(self, base: str) -> str:
        full = ".".join([*self._scope, base])
        if full not in self._tensors:
            return full
        i = 1
        while f"{full}_{i}" in self._tensors:
            i += 1
        return f"{full}_{i}"

    def _explicit(self, name: str) -> str:
        full = ".".join([*self._scope, name])
        if full in self._tensors:
            raise SpecializationError(f"graph {self.name!r}: tensor name {full!r} is already used")
        return full

    # ---- leaves and Reshard --------------------------------------------------------------------------------
    def placeholder(self, name: str, shape: Sequence[Dim | str], dtype: str = "float32") -> Tensor:
        """Input data (a leaf whose annotation the plan gives).  String dims become symbols."""
        return self.add("placeholder", [], {"shape": _dims(shape), "dtype": dtype}, name=name, dtype=dtype)[0]

    def parameter(self, name: str, shape: Sequence[Dim], dtype: str = "float32") -> Tensor:
        """A model parameter (a leaf whose annotation the plan gives)."""
        return self.add("parameter", [], {"shape": _dims(shape), "dtype": dtype}, name=name, dtype=dtype)[0]

    def reshard(self, x: Tensor, name: str) -> Tensor:
        """A Reshard marker: the plan's annotation for ``name`` says where ``x`` must be after it (§3)."""
        return self.add(RESHARD, [x], {}, name=name)[0]

    def mark_loss(self, x: Tensor) -> Tensor:
        """Declare ``x`` (a scalar) the loss that training minimises; returns it."""
        if x.builder is not self:
            raise SpecializationError(f"tensor {x.name!r} belongs to another graph")
        if x.shape:
            raise ShapeError(f"the loss must be a scalar; {x.name!r} has shape {shape_str(x.shape)}")
        self._loss = x.name
        return x

    # ---- generic -------------------------------------------------------------------------------------------
    def add(self, kind: str, inputs: Sequence[Tensor], attrs: Mapping[str, Any], *, name: str | None = None,
            num_outputs: int = 1, dtype: str | None = None) -> list[Tensor]:
        """Append a node; output shapes and dtype come from the op's rules (:func:`~.op_registry.infer_shapes`,
        :func:`~.op_registry.infer_dtype`); ``dtype`` overrides the dtype."""
        for t in inputs:
            if t.builder is not self:
                raise SpecializationError(f"tensor {t.name!r} belongs to another graph")
        node_name = self._explicit(name) if name else self._fresh(kind.lower())
        in_shapes = [t.shape for t in inputs]
        out_shapes = infer_shapes(kind, in_shapes, attrs, node_name)
        if len(out_shapes) != num_outputs:
            raise SpecializationError(f"op {kind} {node_name!r} has {len(out_shapes)} outputs, not {num_outputs}")
        outs = [node_name] if len(out_shapes) == 1 else [f"{node_name}.{i}" for i in range(len(out_shapes))]
        out_dtype = dtype or infer_dtype(kind, [t.dtype for t in inputs])
        for o, s in zip(outs, out_shapes):
            self._tensors[o] = TensorSpec(o, tuple(s), out_dtype)
        self._nodes.append(Node(node_name, kind, tuple(t.name for t in inputs), tuple(outs),
                                tuple(sorted(attrs.items()))))
        return [Tensor(self, o, tuple(s), out_dtype) for o, s in zip(outs, out_shapes)]

    def build(self) -> Graph:
        return Graph(self.name, tuple(self._nodes), dict(self._tensors), dict(self.hints), dict(self.meta),
                     loss=self._loss)


class _Scope:
    def __init__(self, builder: GraphBuilder, prefix: str) -> None:
        self.builder, self.prefix = builder, prefix

    def __enter__(self) -> GraphBuilder:
        self.builder._scope.append(self.prefix)
        return self.builder

    def __exit__(self, *exc: object) -> None:
        self.builder._scope.pop()


def _dims(shape: Iterable[Dim | str]) -> tuple[Dim, ...]:
    out: list[Dim] = []
    for d in shape:
        if isinstance(d, str):
            out.append(sym(d))
        elif isinstance(d, (int, Sym)) and not isinstance(d, bool):
            if isinstance(d, int) and d < 0:
                raise ShapeError(f"dimension {d} is negative")
            out.append(d)
        else:
            raise ShapeError(f"dimension {d!r} must be an int, a symbol name or a Sym")
    return tuple(out)
