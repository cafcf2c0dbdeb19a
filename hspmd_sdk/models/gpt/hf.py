"""GPT-2 <-> Hugging Face ``GPT2LMHeadModel``: config fields and tensor names.  Hugging Face's ``Conv1D`` stores
``[in, out]`` like the SDK; its fused ``c_attn`` ``[h, 3h]`` holds the SDK's ``wq | wk | wv`` side by side (and
``c_attn.bias`` ``bq | bk | bv``); the LM head is the tied ``wte`` (``lm_head.weight`` is not stored)."""
from __future__ import annotations

from typing import Any

from ..hf import HFTensor
from .config import GPTConfig

MODEL_TYPES = ("gpt2",)

_PLAIN = {"ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias", "ln_2.weight": "ln_2.weight",
          "ln_2.bias": "ln_2.bias", "attn.wo": "attn.c_proj.weight", "attn.bo": "attn.c_proj.bias",
          "mlp.w_fc": "mlp.c_fc.weight", "mlp.b_fc": "mlp.c_fc.bias", "mlp.w_proj": "mlp.c_proj.weight",
          "mlp.b_proj": "mlp.c_proj.bias"}


def tensor_map(model: GPTConfig) -> dict[str, HFTensor]:
    h = model.hidden_size
    out = {"wte.weight": HFTensor("transformer.wte.weight"), "wpe.weight": HFTensor("transformer.wpe.weight"),
           "ln_f.weight": HFTensor("transformer.ln_f.weight"), "ln_f.bias": HFTensor("transformer.ln_f.bias")}
    for i in range(model.num_layers):
        p, q = f"layers.{i}", f"transformer.h.{i}"
        for ours, theirs in _PLAIN.items():
            out[f"{p}.{ours}"] = HFTensor(f"{q}.{theirs}")
        for k, t in enumerate("qkv"):
            out[f"{p}.attn.w{t}"] = HFTensor(f"{q}.attn.c_attn.weight", offset=(0, k * h))
            out[f"{p}.attn.b{t}"] = HFTensor(f"{q}.attn.c_attn.bias", offset=(k * h,))
    return out


def hf_shapes(model: GPTConfig) -> dict[str, tuple[int, ...]]:
    refs, shapes = tensor_map(model), model.param_shapes()
    out: dict[str, tuple[int, ...]] = {}
    for name, ref in refs.items():
        s = shapes[name]
        off = ref.offset or (0,) * len(s)
        full = tuple(o + d for o, d in zip(off, s))
        prev = out.get(ref.name, (0,) * len(s))
        out[ref.name] = tuple(max(a, b) for a, b in zip(prev, full))
    return out


def optional(name: str) -> bool:
    return name == "lm_head.weight"


def hf_config(model: GPTConfig) -> dict[str, Any]:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": model.vocab_size,
            "n_positions": model.max_seq_len, "n_embd": model.hidden_size, "n_layer": model.num_layers,
            "n_head": model.num_heads, "n_inner": model.ffn_hidden_size, "activation_function": "gelu_new",
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": model.layer_norm_eps,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "torch_dtype": "float32", "hspmd_name": model.name}


def from_hf_config(cfg: dict[str, Any]) -> GPTConfig:
    if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function {cfg['activation_function']!r} is not supported (GPT-2 uses "
                         "gelu_new)")
    if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn") or \
            cfg.get("scale_attn_weights") is False:
        raise ValueError("non-default GPT-2 attention scaling is not supported")
    if cfg.get("tie_word_embeddings") is False:
        raise ValueError("an untied GPT-2 LM head is not supported (the SDK's GPT-2 ties it to wte)")
    n_embd = cfg["n_embd"]
    return GPTConfig(name=cfg.get("hspmd_name", "hf"), vocab_size=cfg["vocab_size"], hidden_size=n_embd,
                     num_layers=cfg["n_layer"], num_heads=cfg["n_head"], ffn_hidden_size=cfg.get("n_inner") or 4 * n_embd,
                     max_seq_len=cfg.get("n_positions", 1024), layer_norm_eps=cfg.get("layer_norm_epsilon", 1e-5))
