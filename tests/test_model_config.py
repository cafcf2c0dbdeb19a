"""LlamaConfig: presets, validation, and size arithmetic against published parameter counts and hand sums."""
from __future__ import annotations

import pytest

from hspmd_sdk.models.llama.config import MODEL_PRESETS, LlamaConfig
from hspmd_sdk.errors import PlanValidationError


def test_presets_match_the_paper_and_published_models() -> None:
    m32 = LlamaConfig.preset("llama-32b")  # Table 6
    assert (m32.num_layers, m32.hidden_size, m32.num_heads, m32.kv_heads, m32.ffn_hidden_size, m32.vocab_size,
            m32.max_seq_len) == (60, 6656, 64, 64, 17920, 50304, 4096)
    # Published parameter counts of Llama-2 7B and 70B (Hugging Face model cards / safetensors index).
    assert LlamaConfig.preset("llama-7b").param_count() == 6_738_415_616
    assert LlamaConfig.preset("llama-70b").param_count() == 68_976_648_192
    assert LlamaConfig.preset("llama-70b").kv_heads == 8


def test_tiny_counts_by_hand() -> None:
    tiny = LlamaConfig.preset("tiny")
    # layer: Wq, Wo 64x64, Wk, Wv 64x64 (4 kv heads of 16), 3 MLP 64x128, 2 norms of 64
    assert tiny.layer_param_count() == 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64 == 41088
    assert tiny.embedding_param_count() == 256 * 64
    assert tiny.head_param_count() == 64 + 64 * 256
    assert tiny.param_count() == 4 * 41088 + 2 * 16384 + 64 == 197184
    assert tiny.param_bytes(4) == 4 * 197184
    for tp in (1, 2, 4):  # the tiny model must allow TP 1, 2, 4
        assert tiny.num_heads % tp == 0 and tiny.kv_heads % tp == 0 and tiny.ffn_hidden_size % tp == 0


def test_flops_and_activation_formulas() -> None:
    m = LlamaConfig(vocab_size=100, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=12)
    # kv_dim = 1 * 4 = 4.  Matmuls per token: Wq 8x8, Wo 8x8, Wk 8x4, Wv 8x4, 3 x 8x12
    #   -> 64+64+32+32+288 = 480 MACs = 960 FLOPs.
    # Attention: 4 * seq * hidden per token = 4 * 5 * 8 = 160.
    assert m.layer_flops(tokens=3, seq_len=5) == 3 * (960 + 160)
    # Per token 6h + 2 kv_dim + 3 ffn = 48 + 8 + 36 = 92 values.
    assert m.layer_activation_bytes(tokens=10, dtype_bytes=2) == 10 * 92 * 2
    assert m.head_flops(7) == 2 * 7 * 8 * 100


def test_kv_heads_default_and_round_trip() -> None:
    m = LlamaConfig(vocab_size=10, hidden_size=16, num_layers=2, num_heads=4, ffn_hidden_size=8)
    assert m.num_kv_heads == 4 and m.head_dim == 4
    assert LlamaConfig.model_validate_json(m.model_dump_json()) == m
    for name in MODEL_PRESETS:
        p = LlamaConfig.preset(name)
        assert LlamaConfig.model_validate_json(p.model_dump_json()) == p and p.name == name


@pytest.mark.parametrize("kwargs, path, fragment", [
    (dict(hidden_size=10, num_heads=4), "hidden_size", "not divisible by num_heads=4"),
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads", "not divisible by num_kv_heads=3"),
    (dict(num_layers=0), "num_layers", "greater than 0"),
    (dict(vocab_size=-1), "vocab_size", "greater than 0"),
])
def test_bad_configs(kwargs: dict, path: str, fragment: str) -> None:
    data = dict(vocab_size=10, hidden_size=16, num_layers=2, num_heads=4, ffn_hidden_size=8) | kwargs
    with pytest.raises(PlanValidationError) as info:
        LlamaConfig.load(data)
    assert any(p == path and fragment in r for p, r in info.value.problems), info.value.problems


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(PlanValidationError, match="unknown Llama preset .llama-13b..*tiny, llama-7b, llama-32b, llama-70b"):
        LlamaConfig.preset("llama-13b")
    assert LlamaConfig.load("tiny") == LlamaConfig.preset("tiny")
