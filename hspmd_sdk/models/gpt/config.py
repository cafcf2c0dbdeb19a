"""The GPT-2 family: GPT-2 as Hugging Face's ``GPT2LMHeadModel`` computes it (learned absolute position
embeddings, pre-LayerNorm with biases, attention and MLP with biases, GELU with the tanh approximation, input and
output embeddings **tied**), its presets, cost counts and the model contract
(:class:`~hspmd_sdk.core.model_spec.ModelSpec`).

The tied embedding ``wte.weight`` is one parameter with two uses: the token embedding on the first stage and the
LM head (``logits = h @ wte^T``) on the last.  The graph reads it there through the Reshard ``wte.weight.head``;
when the two stages differ, the plan gives that Reshard the LM head's layout and specialization resolves the
move (BSR) and sends the head's gradient back to be added to the embedding's — no special case.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Sequence

from pydantic import Field, model_validator

from ...core.cluster import format_count
from ..base import ModelBase
from ..common import preset_of, seeded_normal, tp_divisibility
from .graph import build_gpt_graph, param_shapes as gpt_param_shapes

if TYPE_CHECKING:
    from ...core.graph import Graph
    from ...core.model_spec import Placement

__all__ = ["GPTConfig", "GPT_PRESETS", "TP_SPLIT", "init_parameter"]

#: ``tiny``: small enough for CPU tests; ``gpt2``: the 124M model, Hugging Face's numbers.
GPT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, ffn_hidden_size=256, max_seq_len=64),
    "gpt2": dict(vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12, ffn_hidden_size=3072,
                 max_seq_len=1024),
}

#: Megatron TP inside a stage (names after ``layers.{i}.``, or whole outside the layers): Q/K/V and the MLP's first
#: linear column-split with their biases, the attention output and the MLP's second linear row-split (their
#: biases are added after the all-reduce, Duplicate); the tied embedding split along hidden on both uses (so any
#: TP degree that divides hidden works, whatever the vocabulary: the LM head contracts over the split hidden dim
#: and all-reduces its logits); the position embedding along hidden; norms Duplicate.
TP_SPLIT: dict[str, int | None] = {
    "wte.weight": 1, "wpe.weight": 1, "ln_f.weight": None, "ln_f.bias": None,
    "ln_1.weight": None, "ln_1.bias": None, "ln_2.weight": None, "ln_2.bias": None,
    "attn.wq": 1, "attn.bq": 0, "attn.wk": 1, "attn.bk": 0, "attn.wv": 1, "attn.bv": 0,
    "attn.wo": 0, "attn.bo": None, "mlp.w_fc": 1, "mlp.b_fc": 0, "mlp.w_proj": 0, "mlp.b_proj": None,
}


def init_parameter(name: str, shape: Sequence[int], seed: int, num_layers: int = 1) -> Any:
    """GPT-2's initialisation (Hugging Face's ``_init_weights``): LayerNorm weights ones, biases zeros, weights and
    embeddings ``0.02 * N(0, 1)``, the residual projections (``attn.wo``, ``mlp.w_proj``) scaled by
    ``1 / sqrt(2 * num_layers)``; every draw a pure function of ``(seed, name, shape)``."""
    import torch

    shape = tuple(int(s) for s in shape)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith(".weight") and (".ln_" in f".{name}" or name.startswith("ln_")):
        return torch.ones(shape, dtype=torch.float32)
    if name.endswith(".bias") or leaf.startswith("b"):
        return torch.zeros(shape, dtype=torch.float32)
    std = 0.02 / math.sqrt(2 * num_layers) if leaf in ("wo", "w_proj") else 0.02
    return seeded_normal(name, shape, seed, std)


class GPTConfig(ModelBase):
    """Shape of a GPT-2 model.

    >>> GPTConfig.preset("gpt2").param_count()
    124439808
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = GPT_PRESETS
    TP_SPLIT: ClassVar[dict[str, int | None]] = TP_SPLIT

    family: Literal["gpt"] = "gpt"
    name: str = "custom"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0, description="the MLP's inner width (Hugging Face n_inner; 4 x hidden)")
    max_seq_len: int = Field(default=1024, gt=0, description="positions of the learned position embedding")
    layer_norm_eps: float = Field(default=1e-5, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "GPTConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} is not divisible by num_heads={self.num_heads}")
        return self

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "GPTConfig":
        """One of :data:`GPT_PRESETS`: ``tiny`` or ``gpt2`` (124M)."""
        return preset_of(cls, GPT_PRESETS, name, "GPT")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    # ---- the model contract --------------------------------------------------------------------------------
    def build_graph(self) -> "Graph":
        return build_gpt_graph(self)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return gpt_param_shapes(self)

    def placements(self) -> list["Placement"]:
        """Layers on their stages; embeddings and data on the first stage; the final norm, the tied LM head use
        of ``wte.weight`` and the targets on the last; Megatron TP (:data:`TP_SPLIT`)."""
        from dataclasses import replace

        out = super().placements()
        # the LM head's input split along hidden inside the TP group (a LocalSplit): the head contracts over it
        return [replace(p, tp_split=2) if p.tensor == "head.in" else p for p in out]

    def tp_problems(self, degree: int) -> list[str]:
        return tp_divisibility(degree, {"num_heads": self.num_heads, "hidden_size": self.hidden_size,
                                        "ffn_hidden_size": self.ffn_hidden_size})

    def init_parameter(self, name: str, shape: Sequence[int], seed: int) -> Any:
        return init_parameter(name, shape, seed, self.num_layers)

    def build_reference(self, seed: int = 0) -> Any:
        from .reference import GPTReference  # lazy: torch

        return GPTReference(self, seed)


    # ---- parameters ----------------------------------------------------------------------------------------
    def layer_param_count(self) -> int:
        """One block: Q/K/V/O with biases, the MLP with biases, two LayerNorms with biases."""
        h, f = self.hidden_size, self.ffn_hidden_size
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    def embedding_param_count(self) -> int:
        """Token and position embeddings (the token embedding is also the LM head: counted once, here)."""
        return (self.vocab_size + self.max_seq_len) * self.hidden_size

    def head_param_count(self) -> int:
        """The final LayerNorm (the LM head is the tied token embedding)."""
        return 2 * self.hidden_size

    def param_count(self) -> int:
        return self.embedding_param_count() + self.num_layers * self.layer_param_count() + self.head_param_count()

    def param_bytes(self, dtype_bytes: int = 2) -> int:
        return self.param_count() * dtype_bytes

    # ---- compute and memory --------------------------------------------------------------------------------
    def layer_flops(self, tokens: int, seq_len: int | None = None) -> int:
        """Forward FLOPs of one block: ``2 * tokens * (4h^2 + 2h*ffn)`` for the matmuls plus
        ``4 * tokens * seq_len * h`` for attention scores and values (Megatron's full count)."""
        s = self.max_seq_len if seq_len is None else seq_len
        h, f = self.hidden_size, self.ffn_hidden_size
        return 2 * tokens * (4 * h * h + 2 * h * f) + 4 * tokens * s * h

    def head_flops(self, tokens: int) -> int:
        """Forward FLOPs of the LM head: ``2 * tokens * hidden * vocab``."""
        return 2 * tokens * self.hidden_size * self.vocab_size

    def layer_activation_bytes(self, tokens: int, dtype_bytes: int = 2) -> int:
        """Activation bytes one block keeps for backward (Korthikanti et al. without dropout, flash attention):
        per token two LayerNorm inputs and outputs (4h), Q, K, V and the attention output (4h), the MLP's inner
        activation before and after GELU (2 ffn)."""
        h = self.hidden_size
        return tokens * (8 * h + 2 * self.ffn_hidden_size) * dtype_bytes

    def __str__(self) -> str:
        return (f"GPTConfig({self.name}: {self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} "
                f"heads, ffn {self.ffn_hidden_size}, vocab {self.vocab_size}, {format_count(self.param_count())} params)")
