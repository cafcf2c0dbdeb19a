"""The single-device reference Llama, and the defined graph executed op by op: the same model."""
from __future__ import annotations

import math

import pytest
import torch

from hspmd_sdk import LlamaConfig
from hspmd_sdk.models import build_llama_graph, build_reference, next_token_split, param_shapes
from hspmd_sdk.models.llama.config import init_parameter
from hspmd_sdk.runtime.workers.kernels import run_graph


@pytest.fixture(scope="module")
def tiny() -> LlamaConfig:
    return LlamaConfig.preset("tiny")


def batch(config: LlamaConfig, b: int = 2, s: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(0, config.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return next_token_split(seq)


def test_parameter_names_and_shapes_match_the_graph(tiny: LlamaConfig) -> None:
    model = build_reference(tiny, seed=0)
    names = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert names == param_shapes(tiny)
    graph = build_llama_graph(tiny)
    assert {p.outputs[0]: graph.tensors[p.outputs[0]].shape for p in graph.parameters} == param_shapes(tiny)
    assert "layers.3.attn.wq" in names and "lm_head.weight" in names and "final_norm.weight" in names


def test_init_is_a_pure_function_of_seed_and_name(tiny: LlamaConfig) -> None:
    a, b = build_reference(tiny, seed=7), build_reference(tiny, seed=7)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
        assert torch.equal(p.detach(), init_parameter(n, p.shape, 7)), n
    other = build_reference(tiny, seed=8)
    assert not torch.equal(a.layers[0].attn.wq, other.layers[0].attn.wq)
    assert not torch.equal(init_parameter("layers.0.attn.wq", (64, 64), 7),
                           init_parameter("layers.1.attn.wq", (64, 64), 7))
    assert torch.all(init_parameter("layers.0.attn_norm.weight", (64,), 7) == 1)


def test_reference_forward_and_loss_are_sane(tiny: LlamaConfig) -> None:
    model = build_reference(tiny, seed=0)
    tokens, targets = batch(tiny)
    logits = model(tokens)
    assert logits.shape == (2, 16, tiny.vocab_size) and logits.dtype == torch.float32
    loss = model.loss(tokens, targets)
    assert abs(loss.item() - math.log(tiny.vocab_size)) < 0.3  # near-uniform predictions at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # causality: changing a later token does not change earlier logits
    t2 = tokens.clone()
    t2[:, -1] = (t2[:, -1] + 1) % tiny.vocab_size
    torch.testing.assert_close(model(t2)[:, :-1], logits[:, :-1])


def test_a_few_steps_of_sgd_reduce_the_loss(tiny: LlamaConfig) -> None:
    model = build_reference(tiny, seed=0)
    tokens, targets = batch(tiny, b=2, s=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model.loss(tokens, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("config", [
    LlamaConfig.preset("tiny"),
    LlamaConfig(name="gqa", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                ffn_hidden_size=48, max_seq_len=32),
])
def test_graph_run_op_by_op_equals_the_reference(config: LlamaConfig) -> None:
    model = build_reference(config, seed=3)
    tokens, targets = batch(config, b=3, s=12, seed=5)
    params = dict(model.named_parameters())
    values = run_graph(build_llama_graph(config), {"tokens": tokens, "targets": targets}, params)
    ref = model.loss(tokens, targets)
    torch.testing.assert_close(values["loss"], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values["logits"], model(tokens), rtol=1e-5, atol=1e-5)
    g_graph = torch.autograd.grad(values["loss"], [params["layers.0.attn.wq"], params["embed.weight"]])
    g_ref = torch.autograd.grad(model.loss(tokens, targets), [params["layers.0.attn.wq"], params["embed.weight"]])
    for a, b in zip(g_graph, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
