"""The Llama decoder as a defined graph (paper §3), written from the viewpoint of one device.

``build_llama_graph(config)`` gives the logical single-program model: placeholders ``tokens`` and ``targets``
(``[B, S]`` int64, symbolic ``B`` and ``S``), the parameters named exactly like the reference module's
(:func:`param_shapes`), and Reshard markers wherever a parallel strategy may need to move data:

* ``embed.out`` — after the embedding (e.g. all-gather a hidden-split embedding inside a TP group);
* ``layers.{i}.in`` — the hidden state entering layer ``i`` (a pipeline-stage boundary when ``i`` starts a
  stage: SendRecv or BSR; Identity inside a stage);
* ``layers.{i}.attn.out`` / ``layers.{i}.mlp.out`` — after the row-parallel Dots (the TP all-reduce);
* ``final_norm.in`` — the hidden state entering the head; ``logits`` — before the loss (all-gather of a
  vocab-split LM head);
* ``<param>.gather`` — after every parameter (the paper's Reshard id=1: ZeRO-1 parameter gathering, a
  SplitAllGather in the pre-processing subgraph when the plan shards the parameter across pipelines).

A Reshard the plan does not annotate is the identity.  Weights are stored ``[in, out]`` (``y = x @ W``).
The loss (the graph's marked loss tensor ``loss``) is the mean next-token cross-entropy over all ``B*S``
positions of ``targets`` (see :mod:`.reference` for the data convention).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...core import ops
from ...core.graph import Graph, GraphBuilder
from ...core.symbolic import sym

if TYPE_CHECKING:
    from ..base import ModelBase

__all__ = ["build_llama_graph", "param_shapes", "layer_param_names"]


def layer_param_names(i: int) -> list[str]:
    """Parameter names of decoder layer ``i``, in graph order."""
    p = f"layers.{i}"
    return [f"{p}.attn_norm.weight", f"{p}.attn.wq", f"{p}.attn.wk", f"{p}.attn.wv", f"{p}.attn.wo",
            f"{p}.mlp_norm.weight", f"{p}.mlp.w1", f"{p}.mlp.w3", f"{p}.mlp.w2"]


def param_shapes(config: "ModelBase") -> dict[str, tuple[int, ...]]:
    """Every parameter name -> full shape, in graph order (the single source of parameter names)."""
    h, v, f = config.hidden_size, config.vocab_size, config.ffn_hidden_size
    q, kv = config.num_heads * config.head_dim, config.kv_heads * config.head_dim
    out: dict[str, tuple[int, ...]] = {"embed.weight": (v, h)}
    for i in range(config.num_layers):
        names = layer_param_names(i)
        shapes = [(h,), (h, q), (h, kv), (h, kv), (q, h), (h,), (h, f), (h, f), (f, h)]
        out.update(zip(names, shapes))
    out["final_norm.weight"] = (h,)
    out["lm_head.weight"] = (h, v)
    return out


def build_llama_graph(config: "ModelBase") -> Graph:
    """The defined graph of ``config``'s Llama (a :class:`~.config.LlamaConfig`) with symbolic batch ``B`` and
    sequence ``S``."""
    B, S = sym("B"), sym("S")
    nh, nkv, hd = config.num_heads, config.kv_heads, config.head_dim
    shapes = param_shapes(config)
    g = GraphBuilder(f"llama[{config.name}]", hints={"S": config.max_seq_len})

    def param(name: str) -> ops.Tensor:
        return g.reshard(g.parameter(name, shapes[name]), f"{name}.gather")

    tokens = g.placeholder("tokens", (B, S), "int64")
    targets = g.placeholder("targets", (B, S), "int64")
    h = ops.embedding(tokens, param("embed.weight"), name="embed")
    h = g.reshard(h, "embed.out")
    for i in range(config.num_layers):
        p = f"layers.{i}"
        h = g.reshard(h, f"{p}.in")
        x = ops.rmsnorm(h, param(f"{p}.attn_norm.weight"), eps=config.rms_eps, name=f"{p}.attn_norm")
        q = ops.reshape(ops.dot(x, param(f"{p}.attn.wq"), name=f"{p}.attn.q"), (B, S, nh, hd),
                        name=f"{p}.attn.q_heads")
        k = ops.reshape(ops.dot(x, param(f"{p}.attn.wk"), name=f"{p}.attn.k"), (B, S, nkv, hd),
                        name=f"{p}.attn.k_heads")
        v = ops.reshape(ops.dot(x, param(f"{p}.attn.wv"), name=f"{p}.attn.v"), (B, S, nkv, hd),
                        name=f"{p}.attn.v_heads")
        q = ops.rope(q, theta=config.rope_theta, name=f"{p}.attn.q_rope")
        k = ops.rope(k, theta=config.rope_theta, name=f"{p}.attn.k_rope")
        a = ops.attention(q, k, v, name=f"{p}.attn.core")
        a = ops.reshape(a, (B, S, nh * hd), name=f"{p}.attn.merge")
        o = g.reshard(ops.dot(a, param(f"{p}.attn.wo"), name=f"{p}.attn.o"), f"{p}.attn.out")
        h = ops.add(h, o, name=f"{p}.attn.residual")
        x = ops.rmsnorm(h, param(f"{p}.mlp_norm.weight"), eps=config.rms_eps, name=f"{p}.mlp_norm")
        gate = ops.dot(x, param(f"{p}.mlp.w1"), name=f"{p}.mlp.gate")
        up = ops.dot(x, param(f"{p}.mlp.w3"), name=f"{p}.mlp.up")
        act = ops.swiglu(gate, up, name=f"{p}.mlp.act")
        d = g.reshard(ops.dot(act, param(f"{p}.mlp.w2"), name=f"{p}.mlp.down"), f"{p}.mlp.out")
        h = ops.add(h, d, name=f"{p}.mlp.residual")
    h = g.reshard(h, "final_norm.in")
    h = ops.rmsnorm(h, param("final_norm.weight"), eps=config.rms_eps, name="final_norm")
    logits = g.reshard(ops.dot(h, param("lm_head.weight"), name="lm_head"), "logits")
    g.mark_loss(ops.cross_entropy(logits, targets, name="loss"))
    return g.build()
