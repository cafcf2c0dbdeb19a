"""The plain single-device Llama (fp32) that every distributed run must match.

In bf16 (``module.to(torch.bfloat16)``, what ``reference_training(..., precision="bf16")`` runs) it follows the
SDK's mixed-precision recipe: RMSNorm, RoPE and the loss compute in fp32, everything else in bf16.

Parameters have the names of :func:`hspmd_sdk.models.llama.param_shapes` (``embed.weight``,
``layers.{i}.attn.wq``, ..., ``final_norm.weight``, ``lm_head.weight``); linear weights are ``[in, out]``.

Initialisation (:meth:`LlamaConfig.init_parameter`): every parameter is a pure function of ``(seed, name,
shape)``, so the distributed runtime builds exactly the same full value on any rank and keeps its shard with
``hspmd_sdk.core.local_view``.  RMSNorm weights are ones; every other parameter is ``0.02 * N(0, 1)`` drawn on
CPU in float32 by a ``torch.Generator`` seeded with the first 8 bytes (little endian, top bit cleared) of
``sha256(f"{seed}:{name}")``.

The module is layered for the profiler (:func:`hspmd_sdk.runtime.profile_model`): ``embed_tokens``,
``block(i, h)`` and ``head(h)`` compose ``forward``.

Data convention: a training sample is a token sequence ``seq[B, S+1]``; the model reads ``tokens = seq[:, :-1]``
and predicts ``targets = seq[:, 1:]`` (:func:`next_token_split`).  ``loss(tokens, targets)`` is the mean
cross-entropy over all ``B*S`` target positions — exactly the graph's ``loss`` tensor.

The forward uses plain torch (``scaled_dot_product_attention``, a complex-number RoPE), not the SDK's kernels,
so it is an independent reference for them.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..common import next_token_split, parameter_seed
from ..reference_base import DecoderReference
from .graph import layer_param_names, param_shapes

if TYPE_CHECKING:
    from ..base import ModelBase

__all__ = ["parameter_seed", "next_token_split", "LlamaReference", "rmsnorm", "rope"]


class _Params(nn.Module):
    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for k, v in values.items():
            self.register_parameter(k, nn.Parameter(v))


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs ``(i, i + hd/2)`` of ``x[B, S, H, hd]`` by ``pos * theta^(-2i/hd)`` (complex form)."""
    b, s, h, hd = x.shape
    freqs = 1.0 / (theta ** (torch.arange(0, hd // 2, dtype=torch.float64) * 2 / hd))
    angles = torch.outer(torch.arange(s, dtype=torch.float64), freqs)
    rot = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(x.device)  # tables on the CPU, fp64
    z = torch.complex(x[..., : hd // 2].float(), x[..., hd // 2:].float()) * rot[None, :, None, :]
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 (bf16 in, bf16 out: the mixed-precision recipe)."""
    xf = x.float()
    return (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


class LlamaReference(DecoderReference):
    """Single-device Llama of a :class:`~.config.LlamaConfig`; ``forward(tokens) -> logits``,
    ``loss(tokens, targets)``."""

    def __init__(self, config: "ModelBase", seed: int = 0) -> None:
        super().__init__()
        self.config = config
        shapes = param_shapes(config)
        init = {n: config.init_parameter(n, s, seed) for n, s in shapes.items()}
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
        q, k = rope(q, c.rope_theta), rope(k, c.rope_theta)
        rep = c.num_heads // c.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=1.0 / math.sqrt(c.head_dim))
        return o.transpose(1, 2).reshape(b, s, c.num_heads * c.head_dim) @ layer.attn.wo

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed.weight)

    def block(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Decoder layer ``i``."""
        c, layer = self.config, self.layers[i]
        h = h + self._attention(layer, rmsnorm(h, layer.attn_norm.weight, c.rms_eps))
        x = rmsnorm(h, layer.mlp_norm.weight, c.rms_eps)
        return h + (F.silu(x @ layer.mlp.w1) * (x @ layer.mlp.w3)) @ layer.mlp.w2

    def replicated(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """The part of layer ``i`` that tensor parallelism (without sequence parallelism) leaves whole on every
        device of the group: its two RMSNorms and two residual adds (timed by the cost model's profile)."""
        c, layer = self.config, self.layers[i]
        h = h + rmsnorm(h, layer.attn_norm.weight, c.rms_eps)
        return h + rmsnorm(h, layer.mlp_norm.weight, c.rms_eps)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: logits."""
        return rmsnorm(h, self.final_norm.weight, self.config.rms_eps) @ self.lm_head.weight
