"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/ops.py.

Each builder function appends one node to its input's graph: these tests pin the node each one appends (kind,
inputs, attributes with their types, name, output shapes and dtype) as the function's docstring states it.
"""
from __future__ import annotations

import pytest

from hspmd_sdk.core import ops
from hspmd_sdk.core.graph import GraphBuilder
from hspmd_sdk.core.symbolic import sym


def _node(t):
    """The node that produced tensor handle ``t`` (in the graph built so far)."""
    return t.builder.build().producer(t.name)


def _check(t, kind, inputs, attrs, shape, dtype="float32"):
    n = _node(t)
    assert (n.kind, n.inputs, n.attrs) == (kind, inputs, attrs)
    assert (t.shape, t.dtype) == (shape, dtype)
    for a, b in zip(n.attrs, attrs):  # 1.0 == 1 and True == 1: the attribute's type is pinned too
        assert type(a[1]) is type(b[1])


@pytest.fixture
def b():
    return GraphBuilder("g")


def test_embedding_and_positions(b):
    """Embedding: weight[tokens], dtype of the weight; positions: int64 of the same shape."""
    tok = b.placeholder("tok", [2, 4], "int64")
    w = b.parameter("wte", [32, 8], "bfloat16")
    e = ops.embedding(tok, w, name="emb")
    assert e.name == "emb"
    _check(e, "embedding", ("tok", "wte"), (), (2, 4, 8), "bfloat16")
    assert ops.embedding(tok, w).name == "embedding"
    p = ops.positions(tok, name="pos")
    assert p.name == "pos"
    _check(p, "positions", ("tok",), (), (2, 4), "int64")
    assert ops.positions(tok).name == "positions"


def test_dot_linear_bias(b):
    x = b.placeholder("x", [2, 8])
    w = b.parameter("w", [8, 16])
    wt = b.parameter("wt", [16, 8])
    bias = b.parameter("bias", [16])
    y = ops.dot(x, w, name="mm")
    assert y.name == "mm"
    _check(y, "dot", ("x", "w"), (), (2, 16))
    z = ops.linear(x, wt, name="lin")
    assert z.name == "lin"
    _check(z, "linear", ("x", "wt"), (), (2, 16))
    c = ops.bias_add(z, bias, name="ba")
    assert c.name == "ba"
    _check(c, "bias_add", ("lin", "bias"), (), (2, 16))
    assert [ops.dot(x, w).name, ops.linear(x, wt).name, ops.bias_add(z, bias).name] == ["dot", "linear", "bias_add"]


def test_norms_store_eps_as_float(b):
    """layernorm / rmsnorm: ``eps`` (default 1e-5) stored as a float attribute."""
    x = b.placeholder("x", [2, 8])
    w, bias = b.parameter("w", [8]), b.parameter("b", [8])
    ln = ops.layernorm(x, w, bias, eps=1, name="ln")
    assert ln.name == "ln"
    _check(ln, "layernorm", ("x", "w", "b"), (("eps", 1.0),), (2, 8))
    _check(ops.layernorm(x, w, bias), "layernorm", ("x", "w", "b"), (("eps", 1e-5),), (2, 8))
    rn = ops.rmsnorm(x, w, eps=2, name="rn")
    assert rn.name == "rn"
    _check(rn, "rmsnorm", ("x", "w"), (("eps", 2.0),), (2, 8))
    _check(ops.rmsnorm(x, w), "rmsnorm", ("x", "w"), (("eps", 1e-5),), (2, 8))


def test_rope_and_attention(b):
    """rope: ``theta`` (default 10000.0) as a float; attention: causal."""
    q = b.placeholder("q", [2, 4, 8, 16])
    kv = b.placeholder("kv", [2, 4, 2, 16])
    r = ops.rope(q, theta=500, name="rq")
    assert r.name == "rq"
    _check(r, "rope", ("q",), (("theta", 500.0),), (2, 4, 8, 16))
    _check(ops.rope(q), "rope", ("q",), (("theta", 10000.0),), (2, 4, 8, 16))
    a = ops.attention(q, kv, kv, name="att")
    assert a.name == "att"
    _check(a, "attention", ("q", "kv", "kv"), (("causal", True),), (2, 4, 8, 16))
    assert ops.attention(q, kv, kv).name == "attention"


def test_elementwise(b):
    """swiglu, gelu (``approximate`` stored only when not "none"), add, mul."""
    x, y = b.placeholder("x", [2, 8]), b.placeholder("y", [2, 8])
    s = ops.swiglu(x, y, name="sw")
    assert s.name == "sw"
    _check(s, "swiglu", ("x", "y"), (), (2, 8))
    g = ops.gelu(x, name="g")
    assert g.name == "g"
    _check(g, "gelu", ("x",), (), (2, 8))
    _check(ops.gelu(x, approximate="tanh"), "gelu", ("x",), (("approximate", "tanh"),), (2, 8))
    _check(ops.gelu(x, approximate="none"), "gelu", ("x",), (), (2, 8))
    a = ops.add(x, y, name="res")
    assert a.name == "res"
    _check(a, "add", ("x", "y"), (), (2, 8))
    m = ops.mul(x, y, name="prod")
    assert m.name == "prod"
    _check(m, "mul", ("x", "y"), (), (2, 8))
    assert [ops.swiglu(x, y).name, ops.add(x, y).name, ops.mul(x, y).name] == ["swiglu", "add", "mul"]


def test_reshape_turns_names_into_symbols(b):
    x = b.placeholder("x", ["S", 8])
    r = ops.reshape(x, ["S", 2, 4], name="rs")
    assert r.name == "rs"
    S = sym("S")
    _check(r, "reshape", ("x",), (("shape", (S, 2, 4)),), (S, 2, 4))
    assert ops.reshape(x, [S, 8]).name == "reshape"


def test_sum_dims_and_keepdim(b):
    """sum: an int dim becomes a 1-tuple, a list a tuple; keepdim stored as a bool (default False)."""
    x = b.placeholder("x", [2, 3, 4])
    s = ops.sum(x, 1, name="s1")
    assert s.name == "s1"
    _check(s, "sum", ("x",), (("dims", (1,)), ("keepdim", False)), (2, 4))
    _check(ops.sum(x, [0, 2], keepdim=1), "sum", ("x",), (("dims", (0, 2)), ("keepdim", True)), (1, 3, 1))
    assert ops.sum(x, -1).shape == (2, 3)


def test_split_normalises_the_dim(b):
    """split: a negative dim counts from the end; ``parts`` outputs ``name.i``; parts stored as an int."""
    x = b.placeholder("x", [2, 6])
    parts = ops.split(x, -1, 3, name="sp")
    assert [p.name for p in parts] == ["sp.0", "sp.1", "sp.2"]
    assert [p.shape for p in parts] == [(2, 2)] * 3
    n = _node(parts[0])
    assert (n.kind, n.inputs, n.attrs) == ("split", ("x",), (("dim", 1), ("parts", 3)))
    two = ops.split(x, 0, 2)
    assert [p.name for p in two] == ["split.0", "split.1"]
    assert _node(two[0]).attrs == (("dim", 0), ("parts", 2))


def test_concat_normalises_the_dim(b):
    x, y = b.placeholder("x", [2, 3]), b.placeholder("y", [2, 5])
    c = ops.concat([x, y], -1, name="cat")
    assert c.name == "cat"
    _check(c, "concat", ("x", "y"), (("dim", 1),), (2, 8))
    _check(ops.concat([x, x], 0), "concat", ("x", "x"), (("dim", 0),), (4, 3))
    _check(ops.concat([y], -1), "concat", ("y",), (("dim", 1),), (2, 5))  # one input: the builder of xs[0]


def test_cross_entropy_keeps_the_logits_dtype(b):
    """The loss has the logits' dtype (the first input's, infer_dtype's default), not the int64 targets' nor
    float32."""
    lg = b.placeholder("lg", [2, 4, 32], "bfloat16")
    tg = b.placeholder("tg", [2, 4], "int64")
    loss = ops.cross_entropy(lg, tg, name="ce")
    assert loss.name == "ce"
    _check(loss, "cross_entropy", ("lg", "tg"), (), (), "bfloat16")
    assert ops.cross_entropy(lg, tg).name == "cross_entropy"
