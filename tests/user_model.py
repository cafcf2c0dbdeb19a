"""A model of a user's own, written only against the public graph API and :class:`hspmd_sdk.models.base.ModelBase`:
a small MLP language model with a custom op (``square_relu``, registered here with its rules and its kernel) —
what ``tutorials/06_your_model.ipynb`` shows.  Importable by worker processes (the tests put this folder on
``PYTHONPATH``)."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from hspmd_sdk.core import ops
from hspmd_sdk.core.graph import GraphBuilder
from hspmd_sdk.core.ops import OPS, OpDef, register_op
from hspmd_sdk.core.symbolic import sym
from hspmd_sdk.models.base import ModelBase
from hspmd_sdk.runtime.workers.kernels import KERNELS, register_kernel

if "square_relu" not in OPS:  # an elementwise op: the built-in "same key in, same key out" rule
    register_op(OpDef("square_relu", OPS["gelu"].shape, OPS["gelu"].axis))
if "square_relu" not in KERNELS:
    register_kernel("square_relu", lambda x: torch.relu(x) ** 2)


class MLPLM(ModelBase):
    """Embedding -> ``num_layers`` residual blocks ``h + W2 square_relu(W1 layernorm(h))`` -> LM head."""

    TP_SPLIT: ClassVar[dict[str, int | None]] = {"embed.weight": 1, "norm.weight": None, "norm.bias": None,
                                                 "w1": 1, "w2": 0, "head.weight": 1}
    W2_THROUGH_GELU: ClassVar[bool] = False  # see ReparamMLPLM
    FUSED_W1: ClassVar[bool] = False  # see FusedMLPLM
    family: Literal["mlp-lm"] = "mlp-lm"
    name: str = "mlp-lm"
    vocab_size: int = Field(default=256, gt=0)
    hidden_size: int = Field(default=32, gt=0)
    inner_size: int = Field(default=64, gt=0)
    num_layers: int = Field(default=4, gt=0)
    max_seq_len: int = Field(default=32, gt=0)

    def build_graph(self) -> Any:
        B, S = sym("B"), sym("S")
        h_, v, f = self.hidden_size, self.vocab_size, self.inner_size
        g = GraphBuilder("mlp-lm", hints={"S": self.max_seq_len})

        def param(name: str, shape: tuple[int, ...]) -> Any:
            return g.reshard(g.parameter(name, shape), f"{name}.gather")

        tokens = g.placeholder("tokens", (B, S), "int64")
        targets = g.placeholder("targets", (B, S), "int64")
        h = g.reshard(ops.embedding(tokens, param("embed.weight", (v, h_)), name="embed"), "embed.out")
        for i in range(self.num_layers):
            p = f"layers.{i}"
            h = g.reshard(h, f"{p}.in")
            x = ops.layernorm(h, param(f"{p}.norm.weight", (h_,)), param(f"{p}.norm.bias", (h_,)), name=f"{p}.norm")
            if self.FUSED_W1:  # u = sq(x a) + sq(x b), [a | b] = w1
                a, b = ops.split(param(f"{p}.w1", (h_, 2 * f)), 1, 2, name=f"{p}.w1.split")
                u = ops.add(*(g.add("square_relu", [ops.dot(x, w, name=f"{p}.fc{k}")], {}, name=f"{p}.act{k}")[0]
                              for k, w in enumerate((a, b))), name=f"{p}.act")
            else:
                u = g.add("square_relu", [ops.dot(x, param(f"{p}.w1", (h_, f)), name=f"{p}.fc")], {},
                          name=f"{p}.act")[0]
            w2 = param(f"{p}.w2", (f, h_))
            if self.W2_THROUGH_GELU:
                w2 = ops.gelu(w2, name=f"{p}.w2.gelu")
            d = g.reshard(ops.dot(u, w2, name=f"{p}.proj"), f"{p}.out")
            h = ops.add(h, d, name=f"{p}.residual")
        h = g.reshard(h, "head.in")
        logits = g.reshard(ops.dot(h, param("head.weight", (h_, v)), name="head"), "logits")
        g.mark_loss(ops.cross_entropy(logits, targets, name="loss"))
        return g.build()

    def build_reference(self, seed: int = 0) -> Any:
        return MLPLMReference(self, seed)


class ReparamMLPLM(MLPLM):
    """:class:`MLPLM` with its projection weights reparametrised: each ``proj`` reads ``gelu(w2)``, so a parameter
    reaches a weight input through another op (what weight normalisation or a LoRA merge do)."""

    W2_THROUGH_GELU: ClassVar[bool] = True
    family: Literal["mlp-lm-reparam"] = "mlp-lm-reparam"  # type: ignore[assignment]
    name: str = "mlp-lm-reparam"


class FusedMLPLM(MLPLM):
    """:class:`MLPLM` with a fused input weight ``w1 = [a | b]`` (``[hidden, 2 * inner]``) that the graph splits in
    two, each half a Dot's weight: ``u = sq(x a) + sq(x b)`` (a fused gate/up or QKV weight).  No TP plan splits
    ``w1`` (a split along a split dim is refused)."""

    TP_SPLIT: ClassVar[dict[str, int | None]] = {**MLPLM.TP_SPLIT, "w1": None, "w2": None}
    FUSED_W1: ClassVar[bool] = True
    family: Literal["mlp-lm-fused"] = "mlp-lm-fused"  # type: ignore[assignment]
    name: str = "mlp-lm-fused"


class MLPLMReference(torch.nn.Module):
    """The same model in plain torch (the independent reference); ``state_dict()`` keys = ``param_shapes()``."""

    def __init__(self, config: MLPLM, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        init = {n: torch.nn.Parameter(config.init_parameter(n, s, seed)) for n, s in config.param_shapes().items()}
        self.embed, self.head = torch.nn.Module(), torch.nn.Module()
        self.embed.weight, self.head.weight = init["embed.weight"], init["head.weight"]
        self.layers = torch.nn.ModuleList()
        for i in range(config.num_layers):
            layer, layer.norm = torch.nn.Module(), torch.nn.Module()
            layer.norm.weight, layer.norm.bias = init[f"layers.{i}.norm.weight"], init[f"layers.{i}.norm.bias"]
            layer.w1, layer.w2 = init[f"layers.{i}.w1"], init[f"layers.{i}.w2"]
            self.layers.append(layer)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = F.embedding(tokens, self.embed.weight)
        for layer in self.layers:
            x = F.layer_norm(h, (h.shape[-1],), layer.norm.weight, layer.norm.bias)
            w2 = F.gelu(layer.w2) if self.config.W2_THROUGH_GELU else layer.w2
            if self.config.FUSED_W1:
                a, b = layer.w1.chunk(2, dim=1)
                u = torch.relu(x @ a) ** 2 + torch.relu(x @ b) ** 2
            else:
                u = torch.relu(x @ layer.w1) ** 2
            h = h + u @ w2
        return h @ self.head.weight

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
