"""The plain single-device GPT-2 (fp32) that every distributed run must match, written with plain torch
(``F.layer_norm``, ``scaled_dot_product_attention``, ``F.gelu(approximate="tanh")``) — not the SDK's kernels — and
checked against Hugging Face's ``GPT2LMHeadModel`` in the tests.  ``state_dict()`` keys are
:func:`.graph.param_shapes`; the LM head is the token embedding (tied).  In bf16 the loss is computed in fp32
(``F.layer_norm`` and ``F.gelu`` accumulate in fp32 by themselves), the SDK's mixed-precision recipe."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..reference_base import DecoderReference
from .graph import layer_param_names, param_shapes

if TYPE_CHECKING:
    from ..base import ModelBase

__all__ = ["GPTReference"]


class _Params(nn.Module):
    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for k, v in values.items():
            self.register_parameter(k, nn.Parameter(v))


class GPTReference(DecoderReference):
    """Single-device GPT-2 of a :class:`~.config.GPTConfig`; ``forward(tokens) -> logits``,
    ``loss(tokens, targets)``."""

    def __init__(self, config: "ModelBase", seed: int = 0) -> None:
        super().__init__()
        self.config = config
        init = {n: config.init_parameter(n, s, seed) for n, s in param_shapes(config).items()}
        self.wte = _Params({"weight": init["wte.weight"]})
        self.wpe = _Params({"weight": init["wpe.weight"]})
        layers = []
        for i in range(config.num_layers):
            vals = {n.split(".", 2)[2]: init[n] for n in layer_param_names(i)}
            layer = nn.Module()  # registered in graph order: state_dict() keys = param_shapes() in order
            layer.ln_1 = _Params({k: vals[f"ln_1.{k}"] for k in ("weight", "bias")})
            layer.attn = _Params({k: vals[f"attn.{k}"] for k in ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo")})
            layer.ln_2 = _Params({k: vals[f"ln_2.{k}"] for k in ("weight", "bias")})
            layer.mlp = _Params({k: vals[f"mlp.{k}"] for k in ("w_fc", "b_fc", "w_proj", "b_proj")})
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.ln_f = _Params({"weight": init["ln_f.weight"], "bias": init["ln_f.bias"]})

    def _ln(self, p: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), p.weight, p.bias, self.config.layer_norm_eps)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte.weight[tokens] + self.wpe.weight[pos][None]

    def block(self, i: int, h: torch.Tensor) -> torch.Tensor:
        c, layer = self.config, self.layers[i]
        b, s, _ = h.shape
        x = self._ln(layer.ln_1, h)
        a = layer.attn
        q, k, v = ((x @ w + bias).view(b, s, c.num_heads, c.head_dim).transpose(1, 2)
                   for w, bias in ((a.wq, a.bq), (a.wk, a.bk), (a.wv, a.bv)))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(c.head_dim))
        h = h + (o.transpose(1, 2).reshape(b, s, c.hidden_size) @ a.wo + a.bo)   # residual + c_proj(x)
        m = layer.mlp
        u = F.gelu(self._ln(layer.ln_2, h) @ m.w_fc + m.b_fc, approximate="tanh")
        return h + (u @ m.w_proj + m.b_proj)

    def replicated(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """What TP (without sequence parallelism) leaves whole on every device of a group in block ``i``: its two
        LayerNorms and two residual adds (timed by the cost model's profile)."""
        layer = self.layers[i]
        h = h + self._ln(layer.ln_1, h)
        return h + self._ln(layer.ln_2, h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self._ln(self.ln_f, h) @ self.wte.weight.t()
