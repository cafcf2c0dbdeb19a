"""Each local kernel (hspmd_sdk.runtime.workers.kernels) against a direct torch computation."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hspmd_sdk.core.ops import OPS
from hspmd_sdk.runtime.workers import kernels as K

GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN, dtype=torch.float64)


def test_every_compute_op_has_a_kernel() -> None:
    compute = {k for k in OPS if k not in ("placeholder", "parameter", "Reshard")}
    assert compute == set(K.KERNELS)


def test_dot() -> None:
    x, w = randn(2, 3, 4), randn(4, 5)
    torch.testing.assert_close(K.KERNELS["dot"](x, w), torch.einsum("bsk,kn->bsn", x, w))


def test_embedding_and_vocab_parallel_summands() -> None:
    w, t = randn(10, 4), torch.tensor([[0, 3, 9], [5, 5, 1]])
    torch.testing.assert_close(K.KERNELS["embedding"](t, w), w[t])
    parts = [K.KERNELS["embedding"](t, w[a:b], vocab_start=a) for a, b in ((0, 4), (4, 10))]
    torch.testing.assert_close(parts[0] + parts[1], w[t])
    assert torch.all(parts[0][0, 2] == 0)


def test_rmsnorm() -> None:
    x, w = randn(2, 3, 8), randn(8)
    torch.testing.assert_close(K.KERNELS["rmsnorm"](x, w, eps=1e-6), F.rms_norm(x, (8,), w, eps=1e-6))


def _rope_loop(x: torch.Tensor, theta: float, offset: int = 0) -> torch.Tensor:
    out = x.clone()
    hd = x.shape[-1]
    for s in range(x.shape[1]):
        for i in range(hd // 2):
            a = (s + offset) * theta ** (-2 * i / hd)
            x1, x2 = x[:, s, :, i], x[:, s, :, i + hd // 2]
            out[:, s, :, i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[:, s, :, i + hd // 2] = x1 * math.sin(a) + x2 * math.cos(a)
    return out


@pytest.mark.parametrize("offset", [0, 3])
def test_rope(offset: int) -> None:
    x = randn(2, 5, 3, 8)
    torch.testing.assert_close(K.KERNELS["rope"](x, theta=100.0, position_offset=offset), _rope_loop(x, 100.0, offset))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_matches_sdpa(kv_heads: int) -> None:
    q, k, v = randn(2, 6, 4, 8), randn(2, 6, kv_heads, 8), randn(2, 6, kv_heads, 8)
    rep = 4 // kv_heads
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
                                         v.repeat_interleave(rep, 2).transpose(1, 2), is_causal=True)
    torch.testing.assert_close(K.KERNELS["attention"](q, k, v, causal=True), ref.transpose(1, 2))


def test_elementwise() -> None:
    a, b = randn(3, 4), randn(3, 4)
    torch.testing.assert_close(K.KERNELS["swiglu"](a, b), a * torch.sigmoid(a) * b)
    torch.testing.assert_close(K.KERNELS["gelu"](a), 0.5 * a * (1 + torch.erf(a / math.sqrt(2))))
    torch.testing.assert_close(K.KERNELS["add"](a, b), a + b)
    torch.testing.assert_close(K.KERNELS["mul"](a, b), a * b)


def test_shape_ops() -> None:
    x = randn(2, 6, 4)
    torch.testing.assert_close(K.KERNELS["reshape"](x, shape=(2, 6, 2, 2)), x.view(2, 6, 2, 2))
    torch.testing.assert_close(K.KERNELS["sum"](x, dims=(1,), keepdim=False), x.sum(1))
    a, b = K.KERNELS["split"](x, dim=1, parts=2)
    torch.testing.assert_close(a, x[:, :3])
    torch.testing.assert_close(K.KERNELS["concat"](a, b, dim=1), x)
    with pytest.raises(ValueError, match="not divisible"):
        K.KERNELS["split"](x, dim=2, parts=3)


def test_cross_entropy_mean_and_partial_summands() -> None:
    logits, t = randn(2, 3, 7), torch.randint(0, 7, (2, 3), generator=GEN)
    ref = F.cross_entropy(logits.reshape(-1, 7), t.reshape(-1))
    torch.testing.assert_close(K.KERNELS["cross_entropy"](logits, t), ref)
    parts = [K.KERNELS["cross_entropy"](logits[i:i + 1], t[i:i + 1], total_count=6) for i in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], ref)
