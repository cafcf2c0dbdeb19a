"""GPT-2 as a defined graph (paper §3), from the viewpoint of one device.

Placeholders ``tokens``/``targets`` (``[B, S]`` int64).  Parameters (:func:`param_shapes`) are named for the
graph, not for Hugging Face (Q, K and V are three weights, so that TP splits heads; :mod:`.hf` maps them to
``c_attn``); weights are ``[in, out]``.  Reshards where a strategy may move data: ``embed.out``, ``layers.{i}.in``,
``layers.{i}.attn.out`` / ``layers.{i}.mlp.out`` (after the row-parallel Dots, before their biases),
``final_norm.in``, ``head.in`` (the head's input split along hidden inside a TP group), ``logits``, every
parameter's ``<param>.gather`` (ZeRO-1), and ``wte.weight.head`` — the tied embedding where the LM head reads it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...core import ops
from ...core.graph import Graph, GraphBuilder
from ...core.symbolic import sym

if TYPE_CHECKING:
    from ..base import ModelBase

__all__ = ["build_gpt_graph", "param_shapes", "layer_param_names"]


def layer_param_names(i: int) -> list[str]:
    p = f"layers.{i}"
    return [f"{p}.ln_1.weight", f"{p}.ln_1.bias", f"{p}.attn.wq", f"{p}.attn.bq", f"{p}.attn.wk", f"{p}.attn.bk",
            f"{p}.attn.wv", f"{p}.attn.bv", f"{p}.attn.wo", f"{p}.attn.bo", f"{p}.ln_2.weight", f"{p}.ln_2.bias",
            f"{p}.mlp.w_fc", f"{p}.mlp.b_fc", f"{p}.mlp.w_proj", f"{p}.mlp.b_proj"]


def param_shapes(config: "ModelBase") -> dict[str, tuple[int, ...]]:
    """Every parameter name -> full shape, in graph order."""
    h, v, f = config.hidden_size, config.vocab_size, config.ffn_hidden_size
    out: dict[str, tuple[int, ...]] = {"wte.weight": (v, h), "wpe.weight": (config.max_seq_len, h)}
    for i in range(config.num_layers):
        shapes = [(h,), (h,), (h, h), (h,), (h, h), (h,), (h, h), (h,), (h, h), (h,), (h,), (h,), (h, f), (f,),
                  (f, h), (h,)]
        out.update(zip(layer_param_names(i), shapes))
    out["ln_f.weight"] = (h,)
    out["ln_f.bias"] = (h,)
    return out


def build_gpt_graph(config: "ModelBase") -> Graph:
    """The defined graph of ``config``'s GPT-2 (a :class:`~.config.GPTConfig`) with symbolic batch ``B`` and sequence
    ``S`` (``S <= max_seq_len``)."""
    B, S = sym("B"), sym("S")
    nh, hd, eps = config.num_heads, config.head_dim, config.layer_norm_eps
    shapes = param_shapes(config)
    g = GraphBuilder(f"gpt[{config.name}]", hints={"S": config.max_seq_len})
    leaves = {}

    def param(name: str) -> ops.Tensor:
        leaves[name] = g.parameter(name, shapes[name])
        return g.reshard(leaves[name], f"{name}.gather")

    tokens = g.placeholder("tokens", (B, S), "int64")
    targets = g.placeholder("targets", (B, S), "int64")
    wte = param("wte.weight")
    h = ops.add(ops.embedding(tokens, wte, name="wte"),
                ops.embedding(ops.positions(tokens, name="positions"), param("wpe.weight"), name="wpe"),
                name="embed")
    h = g.reshard(h, "embed.out")
    for i in range(config.num_layers):
        p = f"layers.{i}"
        h = g.reshard(h, f"{p}.in")
        x = ops.layernorm(h, param(f"{p}.ln_1.weight"), param(f"{p}.ln_1.bias"), eps=eps, name=f"{p}.ln_1")
        heads = []
        for t in ("q", "k", "v"):
            y = ops.bias_add(ops.dot(x, param(f"{p}.attn.w{t}"), name=f"{p}.attn.{t}"), param(f"{p}.attn.b{t}"),
                             name=f"{p}.attn.{t}_bias")
            heads.append(ops.reshape(y, (B, S, nh, hd), name=f"{p}.attn.{t}_heads"))
        a = ops.reshape(ops.attention(*heads, name=f"{p}.attn.core"), (B, S, nh * hd), name=f"{p}.attn.merge")
        o = g.reshard(ops.dot(a, param(f"{p}.attn.wo"), name=f"{p}.attn.o"), f"{p}.attn.out")
        h = ops.add(h, ops.bias_add(o, param(f"{p}.attn.bo"), name=f"{p}.attn.o_bias"), name=f"{p}.attn.residual")
        x = ops.layernorm(h, param(f"{p}.ln_2.weight"), param(f"{p}.ln_2.bias"), eps=eps, name=f"{p}.ln_2")
        u = ops.bias_add(ops.dot(x, param(f"{p}.mlp.w_fc"), name=f"{p}.mlp.fc"), param(f"{p}.mlp.b_fc"),
                         name=f"{p}.mlp.fc_bias")
        u = ops.gelu(u, approximate="tanh", name=f"{p}.mlp.act")
        d = g.reshard(ops.dot(u, param(f"{p}.mlp.w_proj"), name=f"{p}.mlp.proj"), f"{p}.mlp.out")
        h = ops.add(h, ops.bias_add(d, param(f"{p}.mlp.b_proj"), name=f"{p}.mlp.proj_bias"),
                    name=f"{p}.mlp.residual")
    h = g.reshard(h, "final_norm.in")
    h = ops.layernorm(h, param("ln_f.weight"), param("ln_f.bias"), eps=eps, name="ln_f")
    h = g.reshard(h, "head.in")
    head_w = g.reshard(leaves["wte.weight"], "wte.weight.head")  # the tied weight where the LM head reads it
    logits = g.reshard(ops.linear(h, head_w, name="lm_head"), "logits")
    g.mark_loss(ops.cross_entropy(logits, targets, name="loss"))
    return g.build()
