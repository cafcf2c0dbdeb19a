"""Llama <-> Hugging Face ``LlamaForCausalLM``: config fields and tensor names.  The SDK stores linear weights
``[in, out]``; Hugging Face's ``nn.Linear`` stores ``[out, in]`` (transposed here).  Both use the half-split
("rotate_half") RoPE, so Q and K need no permutation."""
from __future__ import annotations

from typing import Any

from ..hf import HFTensor
from .config import LlamaConfig

MODEL_TYPES = ("llama",)

_LAYER = {"attn_norm.weight": ("input_layernorm.weight", False), "attn.wq": ("self_attn.q_proj.weight", True),
          "attn.wk": ("self_attn.k_proj.weight", True), "attn.wv": ("self_attn.v_proj.weight", True),
          "attn.wo": ("self_attn.o_proj.weight", True), "mlp_norm.weight": ("post_attention_layernorm.weight", False),
          "mlp.w1": ("mlp.gate_proj.weight", True), "mlp.w3": ("mlp.up_proj.weight", True),
          "mlp.w2": ("mlp.down_proj.weight", True)}


def tensor_map(model: LlamaConfig) -> dict[str, HFTensor]:
    out = {"embed.weight": HFTensor("model.embed_tokens.weight"), "final_norm.weight": HFTensor("model.norm.weight"),
           "lm_head.weight": HFTensor("lm_head.weight", transpose=True)}
    for i in range(model.num_layers):
        for ours, (theirs, t) in _LAYER.items():
            out[f"layers.{i}.{ours}"] = HFTensor(f"model.layers.{i}.{theirs}", transpose=t)
    return out


def hf_shapes(model: LlamaConfig) -> dict[str, tuple[int, ...]]:
    refs = tensor_map(model)
    return {refs[n].name: (tuple(reversed(s)) if refs[n].transpose else tuple(s))
            for n, s in model.param_shapes().items()}


def optional(name: str) -> bool:
    return False


def hf_config(model: LlamaConfig) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": model.vocab_size,
            "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
            "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
            "num_key_value_heads": model.kv_heads, "head_dim": model.head_dim, "hidden_act": "silu",
            "max_position_embeddings": model.max_seq_len, "rms_norm_eps": model.rms_eps,
            "rope_theta": model.rope_theta, "rope_parameters": {"rope_theta": model.rope_theta, "rope_type": "default"},
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "attention_dropout": 0.0,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "torch_dtype": "float32",
            "hspmd_name": model.name}


def from_hf_config(cfg: dict[str, Any]) -> LlamaConfig:
    if cfg.get("tie_word_embeddings"):
        raise ValueError("tied input/output embeddings are not supported for Llama (use GPTConfig for a tied model)")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ValueError(f"{flag}=true is not supported by the SDK's Llama")
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    heads = cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, cfg["hidden_size"] // heads):
        raise ValueError(f"head_dim {cfg['head_dim']} != hidden_size / num_attention_heads is not supported")
    return LlamaConfig(name=cfg.get("hspmd_name", "hf"), vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                       num_layers=cfg["num_hidden_layers"], num_heads=heads,
                       num_kv_heads=cfg.get("num_key_value_heads") or heads, ffn_hidden_size=cfg["intermediate_size"],
                       max_seq_len=cfg.get("max_position_embeddings", 4096), rms_eps=cfg.get("rms_norm_eps", 1e-6),
                       rope_theta=theta)
