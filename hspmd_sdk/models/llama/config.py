"""The Llama model configuration: its presets, its size/cost arithmetic (parameters, FLOPs, activation memory)
and the model contract (:class:`~hspmd_sdk.core.model_spec.ModelSpec`) that points the engine at the family's
graph (:mod:`.graph`), placement rule, initialisation and reference (:mod:`.reference`).

A Llama decoder layer (the paper's Table 6: SwiGLU, RMSNorm, RoPE, no dropout, no biases) holds:

* attention: ``W_q`` and ``W_o`` of ``hidden x hidden``; ``W_k`` and ``W_v`` of ``hidden x kv_dim`` where
  ``kv_dim = num_kv_heads * head_dim`` (grouped-query attention; "query groups" in Megatron's words);
* MLP: ``W_gate`` and ``W_up`` of ``hidden x ffn``, ``W_down`` of ``ffn x hidden``;
* two RMSNorm weights of ``hidden``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal, Sequence

from pydantic import Field, model_validator

from ...core.cluster import format_count
from ..base import ModelBase
from ..common import preset_of, seeded_normal, tp_divisibility
from .graph import build_llama_graph, param_shapes as llama_param_shapes

if TYPE_CHECKING:
    from ...core.graph import Graph

__all__ = ["LlamaConfig", "MODEL_PRESETS", "TP_SPLIT", "init_parameter"]

#: Megatron TP: the split dim of each parameter inside a stage (``None``: Duplicate).  Names are the part after
#: ``layers.{i}.`` (or the whole name outside the layers).  The embedding is split along hidden (all-gathered at
#: ``embed.out``), the LM head along the vocabulary (all-gathered at ``logits``).
TP_SPLIT: dict[str, int | None] = {
    "embed.weight": 1, "attn_norm.weight": None, "attn.wq": 1, "attn.wk": 1, "attn.wv": 1, "attn.wo": 0,
    "mlp_norm.weight": None, "mlp.w1": 1, "mlp.w3": 1, "mlp.w2": 0, "final_norm.weight": None,
    "lm_head.weight": 1,
}

#: Preset name -> constructor arguments.  ``llama-32b`` is the paper's Table 6.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4,
                 ffn_hidden_size=128, max_seq_len=64),
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                     ffn_hidden_size=11008, max_seq_len=4096),
    "llama-32b": dict(vocab_size=50304, hidden_size=6656, num_layers=60, num_heads=64, num_kv_heads=64,
                      ffn_hidden_size=17920, max_seq_len=4096),
    "llama-70b": dict(vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                      ffn_hidden_size=28672, max_seq_len=4096),
}


def init_parameter(name: str, shape: Sequence[int], seed: int) -> Any:
    """The full initial value (float32, CPU) of Llama parameter ``name``, the same on every process: RMSNorm
    weights are ones, every other parameter ``0.02 * N(0, 1)`` (:func:`~hspmd_sdk.models.common.seeded_normal`)."""
    if name.endswith("norm.weight"):
        import torch

        return torch.ones(tuple(int(s) for s in shape), dtype=torch.float32)
    return seeded_normal(name, shape, seed)


class LlamaConfig(ModelBase):
    """Shape of a Llama model.  ``num_kv_heads=None`` means plain multi-head attention (= ``num_heads``).

    >>> LlamaConfig.preset("llama-32b").num_layers
    60
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = MODEL_PRESETS
    TP_SPLIT: ClassVar[dict[str, int | None]] = TP_SPLIT  # placements(): the layered rule with Megatron TP

    family: Literal["llama"] = "llama"
    name: str = "custom"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int | None = Field(default=None, gt=0, description="query groups; None = num_heads")
    ffn_hidden_size: int = Field(gt=0)
    max_seq_len: int = Field(default=4096, gt=0)
    rms_eps: float = Field(default=1e-5, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "LlamaConfig":
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads: num_heads={self.num_heads} is not divisible by "
                             f"num_kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"num_heads: head_dim = {self.hidden_size}/{self.num_heads} = {self.head_dim} "
                             "must be even for RoPE")
        return self

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "LlamaConfig":
        """One of :data:`MODEL_PRESETS`: ``tiny``, ``llama-7b``, ``llama-32b`` (Table 6), ``llama-70b``."""
        return preset_of(cls, MODEL_PRESETS, name, "Llama")

    # ---- the model contract --------------------------------------------------------------------------------
    def build_graph(self) -> "Graph":
        """The defined graph (:func:`.graph.build_llama_graph`)."""
        return build_llama_graph(self)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return llama_param_shapes(self)

    def tp_problems(self, degree: int) -> list[str]:
        """Heads, KV heads, hidden, FFN and the vocabulary (the LM head is vocab-split) must divide by ``degree``."""
        return tp_divisibility(degree, {"num_heads": self.num_heads, "num_kv_heads": self.kv_heads,
                                        "hidden_size": self.hidden_size, "ffn_hidden_size": self.ffn_hidden_size,
                                        "vocab_size": self.vocab_size})

    def init_parameter(self, name: str, shape: Sequence[int], seed: int) -> Any:
        """See :func:`init_parameter`."""
        return init_parameter(name, shape, seed)

    def build_reference(self, seed: int = 0) -> Any:
        """The plain single-device Llama (:class:`.reference.LlamaReference`)."""
        from .reference import LlamaReference  # lazy: torch

        return LlamaReference(self, seed)


    # ---- shapes --------------------------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """``num_kv_heads`` as an int (it is never ``None`` after validation)."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of K and V: ``num_kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    # ---- parameters ----------------------------------------------------------------------------------------
    def layer_param_count(self) -> int:
        """Parameters of one decoder layer: attention, SwiGLU MLP and two RMSNorm weights (no biases)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        attention = 2 * h * h + 2 * h * self.kv_dim
        mlp = 3 * h * f
        return attention + mlp + 2 * h

    def embedding_param_count(self) -> int:
        """The token embedding: ``vocab x hidden``."""
        return self.vocab_size * self.hidden_size

    def head_param_count(self) -> int:
        """The final RMSNorm and the (untied) LM head: ``hidden + hidden x vocab``."""
        return self.hidden_size + self.hidden_size * self.vocab_size

    def param_count(self) -> int:
        """All parameters: embedding + layers + final norm and LM head."""
        return (self.embedding_param_count() + self.num_layers * self.layer_param_count()
                + self.head_param_count())

    def param_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of all parameters stored at ``dtype_bytes`` each."""
        return self.param_count() * dtype_bytes

    # ---- compute and memory --------------------------------------------------------------------------------
    def layer_flops(self, tokens: int, seq_len: int | None = None) -> int:
        """Forward FLOPs of one decoder layer for ``tokens`` tokens in sequences of ``seq_len``.

        Matmuls count ``2*m*n*k``: ``2 * tokens * (2h^2 + 2h*kv_dim + 3h*ffn)``.  Attention scores
        (``Q K^T``) and values (``softmax V``) add ``4 * tokens * seq_len * hidden``, the full (not causally
        halved) count, as Megatron's and the paper's MFU accounting do.  Backward is about twice this.
        """
        s = self.max_seq_len if seq_len is None else seq_len
        h, f = self.hidden_size, self.ffn_hidden_size
        matmul = 2 * tokens * (2 * h * h + 2 * h * self.kv_dim + 3 * h * f)
        attention = 4 * tokens * s * h
        return matmul + attention

    def head_flops(self, tokens: int) -> int:
        """Forward FLOPs of the LM head: ``2 * tokens * hidden * vocab``."""
        return 2 * tokens * self.hidden_size * self.vocab_size

    def layer_activation_bytes(self, tokens: int, dtype_bytes: int = 2) -> int:
        """Activation bytes one decoder layer keeps for backward, for ``tokens`` tokens, no TP, no recompute.

        A Megatron-style estimate (Korthikanti et al. 2022, "Reducing Activation Recomputation") adapted to
        Llama: no dropout masks, flash attention (no ``a*s^2`` score matrix kept), SwiGLU.  Per token it keeps
        ``6h + 2*kv_dim + 3*ffn`` values: attention norm input and output (2h), Q, K, V (h + 2 kv_dim),
        attention output (h); MLP norm input and output (2h), gate and up outputs (2 ffn), their product
        (ffn).  With tensor + sequence parallelism of degree t every term divides by t.
        """
        h = self.hidden_size
        per_token = 6 * h + 2 * self.kv_dim + 3 * self.ffn_hidden_size
        return tokens * per_token * dtype_bytes

    def __str__(self) -> str:
        return (f"LlamaConfig({self.name}: {self.num_layers} layers, hidden {self.hidden_size}, "
                f"{self.num_heads} heads / {self.kv_heads} kv, ffn {self.ffn_hidden_size}, "
                f"vocab {self.vocab_size}, {format_count(self.param_count())} params)")
