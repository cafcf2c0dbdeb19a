"""Kills of hspmd_sdk/core/graph.py's mutants (issue 49): the defined graph's builder, naming, queries, binding
and printing, each pinned by exact values and error texts written out by hand."""
from __future__ import annotations

import pytest

from hspmd_sdk.core import ops
from hspmd_sdk.core.graph import Graph, GraphBuilder, Node, TensorSpec, _dims
from hspmd_sdk.core.symbolic import sym
from hspmd_sdk.errors import ShapeError, SpecializationError


def _mlp() -> tuple[GraphBuilder, Graph]:
    """x[B, S] (bfloat16) @ w[S, 8] in a scope, three auto-named dots and an explicit one, then a sum."""
    g = GraphBuilder("m", hints={"B": 4}, meta={"k": 1})
    x = g.placeholder("x", ("B", "S"), dtype="bfloat16")
    w = g.parameter("w", ("S", 8))
    with g.scope("blk"):
        ops.dot(x, w)
        ops.dot(x, w)
        ops.dot(x, w)
        z = ops.dot(x, w, name="z")
    ops.sum(z, 0)
    return g, g.build()


def test_builder_names_auto_and_explicit_in_scope_and_numbers_repeats():
    """Auto names are ``<scope>.<kind>`` then ``_1``, ``_2``; an explicit name gets the scope in front; outside the
    scope names are bare."""
    _, gr = _mlp()
    assert [n.name for n in gr.nodes] == ["x", "w", "blk.dot", "blk.dot_1", "blk.dot_2", "blk.z", "sum"]
    assert [n.outputs for n in gr.nodes][2:] == [("blk.dot",), ("blk.dot_1",), ("blk.dot_2",), ("blk.z",),
                                                  ("sum",)]


def test_auto_name_without_scope_is_the_lower_case_kind():
    g = GraphBuilder()
    x = g.placeholder("x", (2, 3))
    y = g.add("gelu", [x], {"approximate": "none"})[0]
    assert y.name == "gelu"
    assert g.add("gelu", [x], {"approximate": "none"})[0].name == "gelu_1"


def test_explicit_name_taken_twice_is_refused_with_the_full_name():
    g = GraphBuilder("m")
    x = g.placeholder("x", (2,))
    with g.scope("a"):
        ops.gelu(x, name="y")
        with pytest.raises(SpecializationError, match=r"^graph 'm': tensor name 'a\.y' is already used$"):
            ops.gelu(x, name="y")
    assert ops.gelu(x, name="y").name == "y"  # outside the scope the bare name is free


def test_builder_defaults_and_build_carry_name_hints_meta_loss():
    """build() hands over the name, hints, meta and the marked loss; the default name is 'graph'."""
    assert GraphBuilder().build().name == "graph"
    g, gr = _mlp()
    assert (gr.name, dict(gr.hints), dict(gr.meta), gr.loss) == ("m", {"B": 4}, {"k": 1}, None)
    assert gr.tensors["sum"] == TensorSpec("sum", (8,), "bfloat16")
    loss = ops.sum(g.placeholder("u", (2, 3)), (0, 1), name="loss")
    assert g.mark_loss(loss) is loss
    assert g.build().loss == "loss"


def test_leaf_dtypes_default_to_float32_and_are_recorded_in_attrs():
    g = GraphBuilder()
    x = g.placeholder("x", ("B", 4))
    w = g.parameter("w", (4, 2))
    h = g.placeholder("h", (2,), dtype="float16")
    p = g.parameter("p", (2,), dtype="bfloat16")
    assert (x.dtype, w.dtype, h.dtype, p.dtype) == ("float32", "float32", "float16", "bfloat16")
    gr = g.build()
    assert gr.node("x").attr == {"shape": (sym("B"), 4), "dtype": "float32"}
    assert gr.node("p").attr == {"shape": (2,), "dtype": "bfloat16"}
    assert gr.tensors["h"] == TensorSpec("h", (2,), "float16")
    assert gr.tensors["p"] == TensorSpec("p", (2,), "bfloat16")


def test_op_dtype_follows_the_input_and_an_explicit_dtype_wins():
    """dot of bfloat16 inputs is bfloat16 (infer_dtype from the inputs); cross_entropy passes dtype explicitly."""
    _, gr = _mlp()
    assert gr.tensors["blk.dot"] == TensorSpec("blk.dot", (sym("B"), 8), "bfloat16")
    g = GraphBuilder()
    x = g.placeholder("x", (2, 3), dtype="float16")
    y = g.add("gelu", [x], {"approximate": "none"}, dtype="float64")[0]
    assert y.dtype == "float64" and g.build().tensors[y.name].dtype == "float64"
    z = g.add("gelu", [x], {"approximate": "none"})[0]
    assert z.dtype == "float16"


def test_shape_error_names_the_node():
    g = GraphBuilder()
    x = g.placeholder("x", ("B", 16))
    w = g.parameter("w", (15, 8))
    with pytest.raises(ShapeError, match=r"^op 'dot': contracted dims differ: X \[B, 16\] vs W \[15, 8\]$"):
        ops.dot(x, w)
    with pytest.raises(ShapeError, match=r"^op 'bad': "):
        ops.dot(x, w, name="bad")


def test_tensorspec_and_node_print():
    """TensorSpec prints name[shape]:dtype; a node prints outputs = kind(inputs, attrs but the shape)."""
    _, gr = _mlp()
    assert str(gr.tensors["x"]) == "x[B, S]:bfloat16"
    assert str(gr.node("x")) == "x = placeholder(dtype=bfloat16)"
    assert str(gr.node("blk.z")) == "blk.z = dot(x, w)"
    assert str(gr.node("sum")) == "sum = sum(blk.z, dims=(0,), keepdim=False)"
    two = Node("s", "split", ("a",), ("s.0", "s.1"), (("dim", 0), ("parts", 2)))
    assert str(two) == "s.0, s.1 = split(a, dim=0, parts=2)"
    assert Node("n", "k", (), ("n",), (("a", 1), ("b", "c"))).attr == {"a": 1, "b": "c"}


def test_summary_exact():
    _, gr = _mlp()
    assert gr.summary() == "\n".join([
        "Graph 'm': 7 nodes, 1 parameters, 0 Reshards, symbols ['B', 'S']",
        "  x[B, S]:bfloat16 = placeholder()",
        "  w[S, 8]:float32 = parameter()",
        "  blk.dot[B, 8]:bfloat16 = dot(x, w)",
        "  blk.dot_1[B, 8]:bfloat16 = dot(x, w)",
        "  blk.dot_2[B, 8]:bfloat16 = dot(x, w)",
        "  blk.z[B, 8]:bfloat16 = dot(x, w)",
        "  sum[8]:bfloat16 = sum(blk.z)"])


def test_queries_producer_consumers_node_leaves():
    _, gr = _mlp()
    assert gr.producer("blk.z") is gr.nodes[5]
    assert gr.producer("x") is gr.nodes[0]
    assert gr.consumers("x") == gr.nodes[2:6]
    assert gr.consumers("blk.z") == (gr.nodes[6],)
    assert gr.consumers("sum") == () and gr.consumers("nope") == ()
    assert gr.node("blk.dot_1") is gr.nodes[3]
    assert gr.node("x") is gr.nodes[0]
    with pytest.raises(KeyError, match="graph 'm' has no node 'q'"):
        gr.node("q")
    with pytest.raises(KeyError, match="graph 'm' has no tensor 'q'"):
        gr.producer("q")
    assert [n.name for n in gr.parameters] == ["w"]
    assert [n.name for n in gr.placeholders] == ["x"]
    assert gr.symbols == {"B", "S"}


def test_symbols_collects_every_factor_of_a_product():
    g = GraphBuilder()
    g.placeholder("x", (sym("B") * sym("S"), 4))
    assert g.build().symbols == {"B", "S"}


def test_graph_checks_the_loss_and_the_order():
    x = Node("x", "placeholder", (), ("x",))
    y = Node("y", "gelu", ("x",), ("y",))
    tensors = {"x": TensorSpec("x", ()), "y": TensorSpec("y", ())}
    assert Graph("g", (x, y), tensors, loss="y").loss == "y"
    with pytest.raises(SpecializationError, match=r"^graph 'g': the loss tensor 'z' is not in the graph$"):
        Graph("g", (x, y), tensors, loss="z")
    with pytest.raises(SpecializationError, match=r"reads tensor 'x' before any node produces it"):
        Graph("g", (y, x), tensors)
    with pytest.raises(SpecializationError, match=r"^graph 'g': tensor 'x' is produced twice$"):
        Graph("g", (x, x), tensors)


def test_infer_bindings_checks_a_symbol_seen_twice():
    g = GraphBuilder("m")
    g.placeholder("a", ("B", "S"))
    g.placeholder("b", ("B", 4))
    gr = g.build()
    assert gr.infer_bindings({"a": (3, 5), "b": (3, 4)}) == {"B": 3, "S": 5}
    with pytest.raises(ShapeError, match=r"^tensor 'b' dim 0: symbol B is 2 here but 3 elsewhere$"):
        gr.infer_bindings({"a": (3, 5), "b": (2, 4)})


def test_mark_loss_checks_the_builder_and_the_shape():
    g, other = GraphBuilder("g"), GraphBuilder("o")
    x = other.placeholder("x", ())
    with pytest.raises(SpecializationError, match=r"^tensor 'x' belongs to another graph$"):
        g.mark_loss(x)
    v = g.placeholder("v", (2,))
    with pytest.raises(ShapeError, match=r"^the loss must be a scalar; 'v' has shape \[2\]$"):
        g.mark_loss(v)
    s = g.placeholder("s", ())
    assert g.mark_loss(s) is s and g.build().loss == "s"


def test_dims_accepts_zero_and_rejects_negative_bool_and_float():
    assert _dims(["B", 0, 3, sym("S")]) == (sym("B"), 0, 3, sym("S"))
    with pytest.raises(ShapeError, match=r"^dimension -1 is negative$"):
        _dims([-1])
    with pytest.raises(ShapeError, match=r"^dimension True must be an int, a symbol name or a Sym$"):
        _dims([True])
    with pytest.raises(ShapeError, match=r"^dimension 1\.5 must be an int, a symbol name or a Sym$"):
        _dims([1.5])
