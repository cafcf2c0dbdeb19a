"""The plain single-device Llama (fp32) that every distributed run must match.

Parameters have the names of :func:`hspmd_sdk.models.llama.param_shapes` (``embed.weight``,
``layers.{i}.attn.wq``, ..., ``final_norm.weight``, ``lm_head.weight``); linear weights are ``[in, out]``.

Initialisation (:func:`init_parameter`): every parameter is a pure function of ``(seed, name, shape)``, so the
distributed runtime builds exactly the same full value on any rank and keeps its shard with
``hspmd_sdk.core.local_view``.  RMSNorm weights are ones; every other parameter is ``0.02 * N(0, 1)`` drawn on
CPU in float32 by a ``torch.Generator`` seeded with the first 8 bytes (little endian, top bit cleared) of
``sha256(f"{seed}:{name}")``.

Data convention: a training sample is a token sequence ``seq[B, S+1]``; the model reads ``tokens = seq[:, :-1]``
and predicts ``targets = seq[:, 1:]`` (:func:`next_token_split`).  ``loss(tokens, targets)`` is the mean
cross-entropy over all ``B*S`` target positions — exactly the graph's ``loss`` tensor.

The forward uses plain torch (``scaled_dot_product_attention``, a complex-number RoPE), not the SDK's kernels,
so it is an independent reference for them.
"""
from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .llama import layer_param_names, param_shapes

if TYPE_CHECKING:
    from ..core.model_config import LlamaConfig

__all__ = ["build_reference", "init_parameter", "parameter_seed", "next_token_split", "LlamaReference"]

INIT_STD = 0.02


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name``: sha256 of ``f"{seed}:{name}"``, first 8 bytes, 63 bits."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def init_parameter(name: str, shape: Sequence[int], seed: int) -> torch.Tensor:
    """The full initial value (float32, CPU) of parameter ``name``; the same on every process."""
    shape = tuple(int(s) for s in shape)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * INIT_STD


def next_token_split(seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq[B, S+1]`` -> ``(tokens, targets) = (seq[:, :-1], seq[:, 1:])``."""
    return seq[:, :-1], seq[:, 1:]


class _Params(nn.Module):
    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for k, v in values.items():
            self.register_parameter(k, nn.Parameter(v))


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs ``(i, i + hd/2)`` of ``x[B, S, H, hd]`` by ``pos * theta^(-2i/hd)`` (complex form)."""
    b, s, h, hd = x.shape
    freqs = 1.0 / (theta ** (torch.arange(0, hd // 2, dtype=torch.float64) * 2 / hd))
    angles = torch.outer(torch.arange(s, dtype=torch.float64), freqs)
    rot = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    z = torch.complex(x[..., : hd // 2].float(), x[..., hd // 2:].float()) * rot[None, :, None, :]
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class LlamaReference(nn.Module):
    """Single-device Llama; ``forward(tokens) -> logits``, ``loss(tokens, targets)``."""

    def __init__(self, config: "LlamaConfig", seed: int = 0) -> None:
        super().__init__()
        self.config = config
        shapes = param_shapes(config)
        init = {n: init_parameter(n, s, seed) for n, s in shapes.items()}
        self.embed = _Params({"weight": init["embed.weight"]})
        layers = []
        for i in range(config.num_layers):
            layer = nn.Module()
            vals = {n.split(".", 2)[2]: init[n] for n in layer_param_names(i)}
            layer.attn_norm = _Params({"weight": vals["attn_norm.weight"]})
            layer.attn = _Params({k: vals[f"attn.{k}"] for k in ("wq", "wk", "wv", "wo")})
            layer.mlp_norm = _Params({"weight": vals["mlp_norm.weight"]})
            layer.mlp = _Params({k: vals[f"mlp.{k}"] for k in ("w1", "w3", "w2")})
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.final_norm = _Params({"weight": init["final_norm.weight"]})
        self.lm_head = _Params({"weight": init["lm_head.weight"]})

    def _attention(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, s, _ = x.shape
        q = (x @ layer.attn.wq).view(b, s, c.num_heads, c.head_dim)
        k = (x @ layer.attn.wk).view(b, s, c.kv_heads, c.head_dim)
        v = (x @ layer.attn.wv).view(b, s, c.kv_heads, c.head_dim)
        q, k = _rope(q, c.rope_theta), _rope(k, c.rope_theta)
        rep = c.num_heads // c.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=1.0 / math.sqrt(c.head_dim))
        return o.transpose(1, 2).reshape(b, s, c.num_heads * c.head_dim) @ layer.attn.wo

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        c = self.config
        h = F.embedding(tokens, self.embed.weight)
        for layer in self.layers:
            h = h + self._attention(layer, _rmsnorm(h, layer.attn_norm.weight, c.rms_eps))
            x = _rmsnorm(h, layer.mlp_norm.weight, c.rms_eps)
            h = h + (F.silu(x @ layer.mlp.w1) * (x @ layer.mlp.w3)) @ layer.mlp.w2
        return _rmsnorm(h, self.final_norm.weight, c.rms_eps) @ self.lm_head.weight

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all ``B*S`` positions."""
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_reference(config: "LlamaConfig", seed: int = 0) -> LlamaReference:
    """The plain single-device Llama initialised from ``seed`` (see :func:`init_parameter`)."""
    return LlamaReference(config, seed)
