"""Kills for the mutants of ``hspmd_sdk/core/specialize.py`` that ``test_specialize.py`` lets live
(``scripts/mutation.sh specialize``; issue 29).  ``test_specialize.py`` builds its big programs once per module, so
mutmut credits them to the first test only; every test here specializes its own small program (one to four ranks,
a few ops) and checks what a rank runs, the plans, the pipelines, the micro-batching and the printed accounts
against values worked out by hand:

- an AllReduce of ``n`` bytes over 2 ranks sends ``2 (2-1)/2 n = n`` bytes per rank (ring), a SendRecv of a
  ``rows x 4`` float32 block ``16 rows`` bytes;
- Megatron's MLP (``X`` Duplicate, ``W1`` column-split, ``W2`` row-split) gives a Partial ``Y2`` (the forward
  all-reduce) and a Partial gradient of the first dot's input (the backward all-reduce, "f");
- data parallelism by HDim 0 over two pipelines makes every Duplicate weight's gradient Partial across them
  (HDim -2: SplitAllReduce), and splits the step's ``B`` rows 1:1 between the pipelines.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from hspmd_sdk.core import ops
from hspmd_sdk.core.annotation import Annotation
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.graph import GraphBuilder
from hspmd_sdk.core.plan import AnnotationPlan, ExecutionSettings
from hspmd_sdk.core.resolve import resolve
from hspmd_sdk.core.specialize import ExecOp, Program, specialize
from hspmd_sdk.core.symbolic import sym
from hspmd_sdk.errors import ResolutionError, ShapeError, SpecializationError


def _ops(prog: Program, rank: int, phase: str) -> list[tuple]:
    return [(o.name, o.kind, o.phase, o.inputs, o.outputs, o.comm_kinds, o.bytes_sent)
            for o in prog.executable_graph(rank).phase(phase)]


# ---- Megatron's MLP on two ranks -----------------------------------------------------------------------------
def mlp(resolver=None, cluster=None, **kw):
    """X (Duplicate) -> dot(X, W0 Duplicate) = H -> gelu -> dot(., W1 column-split) -> gelu -> dot(., W2 row-split)
    = Y2 (Partial) -> Reshard Z (Duplicate: all-reduce) -> Reshard Z2 (row split: a local split, no message)
    -> gelu; and Xr, a Reshard of X to its own layout (nothing moves)."""
    g = GraphBuilder("mlp")
    x = g.placeholder("X", ("B", 4))
    h = ops.dot(x, g.parameter("W0", (4, 4)), name="H")
    y1 = ops.dot(ops.gelu(h, name="Hg"), g.parameter("W1", (4, 8)), name="Y1")
    y2 = ops.dot(ops.gelu(y1, name="Y1g"), g.parameter("W2", (8, 4)), name="Y2")
    ops.gelu(g.reshard(g.reshard(y2, "Z"), "Z2"), name="Out")
    g.reshard(x, "Xr")
    plan = {"X": Annotation("[0,1] D2"), "W0": Annotation("[0,1] D2"), "W1": Annotation("[0,1] S1x2"),
            "W2": Annotation("[0,1] S0x2"), "Z": Annotation("[0,1] D2"), "Z2": Annotation("[0,1] S0x2"),
            "Xr": Annotation("[0,1] D2")}
    return specialize(g.build(), plan, cluster if cluster is not None else Cluster.local(2), resolver=resolver,
                      **kw)


def test_megatron_mlp_forward_backward_and_post_of_each_rank() -> None:
    prog = mlp(bindings={"B": 2})
    assert prog.annotations["Y2"] == Annotation("[0,1] P2")
    # Y2 is 2 x 4 float32 = 32 B: a ring all-reduce over 2 ranks sends 32 B per rank
    for r in (0, 1):
        eg = prog.executable_graph(r)
        assert eg.rank == r and (eg.pipeline, eg.stage) == (0, 0)
        assert eg.leaves == ("X", "W0", "W1", "W2") and eg.parameters == ("W0", "W1", "W2")
        assert _ops(prog, r, "Pre") == []
        assert _ops(prog, r, "F") == [
            ("H", "dot", "F", ("X", "W0"), ("H",), (), 0),
            ("Hg", "gelu", "F", ("H",), ("Hg",), (), 0),
            ("Y1", "dot", "F", ("Hg", "W1"), ("Y1",), (), 0),
            ("Y1g", "gelu", "F", ("Y1",), ("Y1g",), (), 0),
            ("Y2", "dot", "F", ("Y1g", "W2"), ("Y2",), (), 0),
            ("Z", "Reshard", "F", ("Y2",), ("Z",), ("AllReduce",), 32),
            ("Z2", "Reshard", "F", ("Z",), ("Z2",), ("LocalSplit",), 0),
            ("Out", "gelu", "F", ("Z2",), ("Out",), (), 0),
            ("Xr", "Reshard", "F", ("X",), ("Xr",), (), 0)]
        # backward: reverse order; Hg (2 x 4) comes back Partial from the column-split dot: an all-reduce of 32 B
        assert _ops(prog, r, "B") == [
            ("Xr.bwd", "ReshardBwd", "B", ("Xr",), ("X",), (), 0),
            ("Out.bwd", "geluBwd", "B", ("Out",), ("Z2",), (), 0),
            ("Z2.bwd", "ReshardBwd", "B", ("Z2",), ("Z",), ("AllGather",), 16),
            ("Z.bwd", "ReshardBwd", "B", ("Z",), ("Y2",), (), 0),
            ("Y2.bwd", "dotBwd", "B", ("Y2",), ("Y1g", "W2"), (), 0),
            ("Y1g.bwd", "geluBwd", "B", ("Y1g",), ("Y1",), (), 0),
            ("Y1.bwd", "dotBwd", "B", ("Y1",), ("Hg", "W1"), (), 0),
            ("Hg.grad_reduce", "GradReduce", "B", ("Hg",), ("Hg",), ("AllReduce",), 32),
            ("Hg.bwd", "geluBwd", "B", ("Hg",), ("H",), (), 0),
            ("H.bwd", "dotBwd", "B", ("H",), ("X", "W0"), (), 0)]
        # one data-parallel replica: every gradient is already where its parameter is (no message)
        assert _ops(prog, r, "Post") == [
            ("W0.grad_sync", "GradSync", "Post", ("W0",), ("W0",), (), 0),
            ("W1.grad_sync", "GradSync", "Post", ("W1",), ("W1",), (), 0),
            ("W2.grad_sync", "GradSync", "Post", ("W2",), ("W2",), (), 0),
            ("optimizer", "OptimizerStep", "Post", ("W0", "W1", "W2"), (), (), 0)]
        assert prog.executable_graph(r) is eg                    # built once per rank
    assert set(prog.grad_reduce_plans) == {"Hg"}                 # X's gradient is not needed (a leaf)
    assert prog.grad_reduce_plans["Hg"].kinds == ["AllReduce"]
    assert str(prog.grad_reduce_plans["Hg"].src) == "[0,1] P2" and str(prog.grad_reduce_plans["Hg"].dst) == "[0,1] D2"


def test_the_plans_of_equal_layouts_are_identities_at_the_program_shapes() -> None:
    cluster = Cluster.local(2)
    prog = mlp(cluster=cluster, bindings={"B": 6})
    assert prog.cluster is cluster
    ident = prog.grad_sync_plans["W1.grad_sync"]
    assert ident.kinds == ["Identity"] and ident.src == ident.dst == Annotation("[0,1] S1x2")
    assert ident.shape == (4, 8) and ident.dtype == "float32" and ident.itemsize == 4 and ident.cluster is cluster
    assert prog.comm_plans["Xr"].shape == (6, 4) and prog.comm_plans["Xr"].kinds == ["Identity"]
    moved = prog.comm_plans["Z"]
    assert moved.shape == (6, 4) and moved.cluster is cluster
    # at other values of B the plans are resolved again (and kept)
    other = prog.concrete_plan("Z", {"B": 2})
    assert other.shape == (2, 4) and other.kinds == ["AllReduce"] and other.cluster is cluster
    assert prog.concrete_plan("Z", {"B": 2}) is other
    assert prog.concrete_plan("Z", {"B": 6}) is moved
    same = prog.concrete_plan("Xr", {"B": 2})
    assert same.kinds == ["Identity"] and same.shape == (2, 4) and same.cluster is cluster
    assert prog.concrete_plan("Hg.grad_reduce", {"B": 2}).shape == (2, 4)
    assert prog.concrete_plan("Z.bwd", {"B": 4}).shape == (4, 4)
    assert prog.concrete_plan("W2.grad_sync", {"B": 4}).shape == (8, 4)
    with pytest.raises(ShapeError, match=r"tensor 'Y2' dim 0 = B: symbol 'B' is not bound"):
        prog.concrete_plan("Z", {"S": 2})
    with pytest.raises(KeyError, match="no communication named 'nope'"):
        prog.concrete_plan("nope", {"B": 2})


class _Recorder:
    """A resolver that records the pairs it is asked about (and the cluster), and can fail on one pair."""

    def __init__(self, fail: tuple[str, str] | None = None) -> None:
        self.calls: list[tuple[str, str, tuple[int, ...], str, object]] = []
        self.fail = fail

    def __call__(self, src, dst, shape, dtype, cluster):
        self.calls.append((str(src), str(dst), tuple(shape), str(dtype), cluster))
        if self.fail == (str(src), str(dst)):
            raise ResolutionError("no way")
        return resolve(src, dst, shape, dtype, cluster)


def test_the_resolver_is_asked_only_about_layouts_that_differ_and_gets_the_cluster() -> None:
    cluster = Cluster.local(2)
    rec = _Recorder()
    prog = mlp(resolver=rec, cluster=cluster, bindings={"B": 2})
    pairs = {(s, d) for s, d, *_ in rec.calls}
    # forward Z (P2 -> D2), Z2 (D2 -> S0x2), Z2's backward (S0x2 -> D2) and Hg's gradient reduction (P2 -> D2);
    # Z.bwd, Xr, Xr.bwd and the gradient syncs have equal layouts
    assert pairs == {("[0,1] P2", "[0,1] D2"), ("[0,1] D2", "[0,1] S0x2"), ("[0,1] S0x2", "[0,1] D2")}
    assert all(c is cluster for *_, c in rec.calls) and all(s == (2, 4) for _, _, s, _, _ in rec.calls)
    n = len(rec.calls)
    assert prog.concrete_plan("Z", {"B": 4}).shape == (4, 4)      # re-resolved with the program's resolver
    assert len(rec.calls) == n + 1 and rec.calls[-1][2] == (4, 4) and rec.calls[-1][4] is cluster
    assert prog.concrete_plan("Xr", {"B": 8}).kinds == ["Identity"] and len(rec.calls) == n + 1  # not asked


@pytest.mark.parametrize("fail, label", [
    (("[0,1] P2", "[0,1] D2"), "Reshard 'Y2'"),                   # the first Partial -> Duplicate: Z's forward
    (("[0,1] S0x2", "[0,1] D2"), "backward of Reshard 'Z2'"),
])
def test_a_resolution_failure_names_the_communication(fail, label) -> None:
    with pytest.raises(ResolutionError) as e:
        mlp(resolver=_Recorder(fail))
    assert str(e.value) == f"{label}: no way"


def test_a_failing_gradient_reduction_or_sync_is_named() -> None:
    # only the gradient reduction of Hg goes P2 -> D2 when the forward has no Partial Reshard
    g = GraphBuilder("f")
    x = g.placeholder("X", ("B", 4))
    y1 = ops.dot(ops.gelu(x, name="Xg"), g.parameter("W1", (4, 8)), name="Y1")
    ops.gelu(y1, name="Out")
    plan = {"X": Annotation("[0,1] D2"), "W1": Annotation("[0,1] S1x2")}
    with pytest.raises(ResolutionError) as e:
        specialize(g.build(), plan, Cluster.local(2), resolver=_Recorder(("[0,1] P2", "[0,1] D2")))
    assert str(e.value) == "gradient reduction of 'Xg': no way"
    # two data-parallel pipelines: W's gradient is Partial across them (HDim -2)
    with pytest.raises(ResolutionError) as e:
        pp(resolver=_Recorder(("[0] R | [1] R ; hdim=-2", "[0] R | [1] R")))
    assert str(e.value) == "gradient synchronisation 'W.grad_sync': no way"


# ---- two data-parallel pipelines of two stages -------------------------------------------------------------------
def pp(settings: ExecutionSettings | None = None, **kw):
    """X split by HDim 0 over ranks 0 and 1 (two pipelines), Y = X.W there, Reshard Z to ranks 2 and 3 (the
    second stages), O = Z.V there."""
    g = GraphBuilder("pp", hints=kw.pop("hints", None))
    x = g.placeholder("X", ("B", 4))
    y = ops.dot(x, g.parameter("W", (4, 4)), name="Y")
    ops.dot(g.reshard(y, "Z"), g.parameter("V", (4, 2)), name="O")
    anns = {"X": Annotation("[0] R | [1] R ; hdim=0"), "W": Annotation("[0] R | [1] R"),
            "Z": Annotation("[2] R | [3] R ; hdim=0"), "V": Annotation("[2] R | [3] R")}
    anns.update(kw.pop("extra", {}))
    plan = AnnotationPlan(annotations=anns, settings=settings or ExecutionSettings(), meta={"who": "test"})
    return specialize(g.build(), plan, Cluster.local(4), **kw)


GPIPE = ExecutionSettings(schedule="gpipe", micro_batch_size=(3, 1), num_micro_batches=(1, 3), recompute=(2,))


def test_pipelines_micro_batches_and_schedules_come_from_the_settings() -> None:
    prog = pp(GPIPE)
    assert prog.pipelines == [[[0], [2]], [[1], [3]]]
    assert prog.bindings == {"B": 6}                        # 3 x 1 + 1 x 3 samples per step
    assert [prog.num_micro_batches(i) for i in (0, 1)] == [1, 3]
    assert [prog.micro_batch_size(i) for i in (0, 1)] == [3, 1]
    assert prog.schedule_kind == "gpipe" and prog.recompute == frozenset({2})
    assert prog.plan.meta == {"who": "test"}
    # GPipe: all forwards, then all backwards; a second stage receives each forward input and sends each gradient
    kinds = [a.kind for a in prog.schedule(3)]
    assert kinds == ["PRE"] + ["RECV_F", "F"] * 3 + ["B", "SEND_B"] * 3 + ["POST"]
    assert [a.kind for a in prog.schedule(0)].count("F") == 1
    assert prog.stage_of(3) == (1, 1) and prog.stage_ranks(1, 1) == [3] and prog.num_stages(0) == 2
    with pytest.raises(KeyError, match=r"rank 7 runs no forward operator of this program \(ranks 0-3\)"):
        prog.stage_of(7)


def test_a_plan_without_micro_batch_sizes_and_the_defaults_of_a_program() -> None:
    prog = pp()
    assert prog.schedule_kind == "1f1b" and prog.recompute == frozenset()
    assert prog.micro_batch_size(0) is None and prog.num_micro_batches(1) == 1
    bare = dataclasses.replace(prog, micro_batches=(), micro_batch_sizes=())
    assert bare.num_micro_batches(0) == 1 and bare.micro_batch_size(0) is None
    assert dataclasses.replace(prog, micro_batches=(4,)).num_micro_batches(1) == 1
    assert dataclasses.replace(prog, micro_batch_sizes=(4,)).micro_batch_size(1) is None


def test_batch_rows_and_micro_batch_plans_per_pipeline() -> None:
    prog = pp(GPIPE)
    b = {"B": 6}
    # HDim 0 in ratios 1:1: pipeline 0 (ranks 0, 2) trains rows [0, 3), pipeline 1 (ranks 1, 3) rows [3, 6)
    assert [prog.batch_rows(r, b) for r in range(4)] == [(0, 3), (3, 6), (0, 3), (3, 6)]
    assert prog.batch_rows(1, {"B": 8}) == (4, 8)
    step = prog.comm_plans["Z"]
    assert [(m.src, m.dst) for op in step.ops for m in op.messages] == [(0, 2), (1, 3)]
    mb = prog.micro_batch_plan("Z", 3, b, 1)
    # rank 3's pipeline: its rows [3, 6) become one micro-batch row [0, 1): a 1 x 4 float32 message of 16 B
    msgs = {(m.src, m.dst): m for op in mb.ops for m in op.messages}
    assert msgs[(1, 3)].box == ((0, 1), (0, 4)) and msgs[(1, 3)].nbytes == 16
    assert prog.micro_batch_plan("Z", 3, b, 1) is mb
    mb0 = prog.micro_batch_plan("Z", 2, b, 2)
    msgs0 = {(m.src, m.dst): m for op in mb0.ops for m in op.messages}
    assert msgs0[(0, 2)].box == ((0, 2), (0, 4)) and msgs0[(0, 2)].nbytes == 32
    assert prog.micro_batch_plan("Z", 3, {"B": 8}, 2) is not mb
    # a plan of a tensor without a batch dim is the step's plan
    assert prog.micro_batch_plan("W.grad_sync", 0, b, 1) is prog.grad_sync_plans["W.grad_sync"]
    back = prog.micro_batch_plan("Z.bwd", 2, b, 1)
    assert {(m.src, m.dst): m.box for op in back.ops for m in op.messages}[(2, 0)] == ((0, 1), (0, 4))


def test_batch_rows_skip_tensors_without_a_batch_dim_or_off_the_rank() -> None:
    # rank 2's first forward op is gelu(V): V has no batch dim; the Reshard's input Y is not on rank 2
    g = GraphBuilder("pp2")
    x = g.placeholder("X", ("B", 4))
    v = ops.gelu(g.parameter("V", (4, 2)), name="Vg")
    y = ops.dot(x, g.parameter("W", (4, 4)), name="Y")
    ops.dot(g.reshard(y, "Z"), v, name="O")
    anns = {"X": Annotation("[0] R | [1] R ; hdim=0"), "W": Annotation("[0] R | [1] R"),
            "Z": Annotation("[2] R | [3] R ; hdim=0"), "V": Annotation("[2] R | [3] R")}
    prog = specialize(g.build(), anns, Cluster.local(4))
    assert [o.name for o in prog.executable_graph(2).forward] == ["Vg", "Z", "O"]
    assert prog.batch_rows(2, {"B": 4}) == (0, 2) and prog.batch_rows(3, {"B": 4}) == (2, 4)
    with pytest.raises(SpecializationError, match="rank 0: no activation"):
        _no_batch().batch_rows(0, {"N": 2})
    with pytest.raises(ShapeError, match=r"tensor 'Z' dim 0 = B: symbol 'B' is not bound"):
        prog.batch_rows(2, {"S": 4})


def _no_batch() -> Program:
    g = GraphBuilder("nb")
    ops.gelu(g.placeholder("X", ("N", 4)), name="Y")
    return specialize(g.build(), {"X": Annotation("[0] R")}, Cluster.local(1))


def test_data_parallel_pipelines_sync_their_weights_and_the_stages_exchange_activations() -> None:
    prog = pp(GPIPE)
    assert prog.comm_plans["Z"].kinds == ["SendRecv"] and prog.backward_plans["Z"].kinds == ["SendRecv"]
    for name in ("W.grad_sync", "V.grad_sync"):
        assert prog.grad_sync_plans[name].kinds == ["SplitAllReduce"]
    # step shapes: B = 6, pipeline rows 3: Z moves 3 x 4 float32 = 48 B per pipeline, forward and backward
    assert _ops(prog, 0, "F")[-1] == ("Z", "Reshard", "F", ("Y",), ("Z",), ("SendRecv",), 48)
    assert _ops(prog, 2, "F")[0] == ("Z", "Reshard", "F", ("Y",), ("Z",), ("SendRecv",), 0)
    assert _ops(prog, 3, "B")[-1] == ("Z.bwd", "ReshardBwd", "B", ("Z",), ("Y",), ("SendRecv",), 48)
    assert _ops(prog, 1, "B")[0] == ("Z.bwd", "ReshardBwd", "B", ("Z",), ("Y",), ("SendRecv",), 0)
    # W (4 x 4, 64 B) all-reduced over ranks 0, 1: 64 B each; V (4 x 2, 32 B) over ranks 2, 3
    assert _ops(prog, 1, "Post") == [("W.grad_sync", "GradSync", "Post", ("W",), ("W",), ("SplitAllReduce",), 64),
                                     ("optimizer", "OptimizerStep", "Post", ("W",), (), (), 0)]
    assert _ops(prog, 2, "Post") == [("V.grad_sync", "GradSync", "Post", ("V",), ("V",), ("SplitAllReduce",), 32),
                                     ("optimizer", "OptimizerStep", "Post", ("V",), (), (), 0)]
    assert str(prog).splitlines() == [
        "Program of graph 'pp': 4 ranks in 2 pipeline(s), schedule gpipe, symbols B=6",
        "  pipeline 0 (1 micro-batches): [0] -> [2]",
        "  pipeline 1 (3 micro-batches): [1] -> [3]",
        "  forward/Pre Reshards by kind: SendRecv x1",
        "    Z: SendRecv  [0] R | [1] R ; hdim=0 -> [2] R | [3] R ; hdim=0",
        "  gradient synchronisation by kind: SplitAllReduce x2",
        "  shape constraints: B ≡ 0 (mod 2)"]


def test_describe_a_reshard_of_two_operators() -> None:
    # a Partial Y on ranks 0, 1 to ranks 2, 3: all-reduce, then the rows travel (BSR)
    g = GraphBuilder("two")
    y = ops.dot(g.placeholder("X", ("B", 4)), g.parameter("W", (4, 4)), name="Y")
    ops.gelu(g.reshard(y, "Z"), name="O")
    prog = specialize(g.build(), {"X": Annotation("[0,1] S1x2"), "W": Annotation("[0,1] S0x2"),
                                  "Z": Annotation("[2,3] D2")}, Cluster.local(4))
    assert prog.comm_plans["Z"].kinds == ["AllReduce", "BSR"]
    assert "    Z: AllReduce + BSR  [0,1] P2 -> [2,3] D2" in str(prog).splitlines()
    assert prog.pipelines == [[[0, 1], [2, 3]]]


def test_a_grad_sync_annotation_in_the_plan_is_where_the_gradient_goes() -> None:
    # ZeRO-like: the gradient, Partial across the two pipelines, is reduce-scattered to half rows each
    prog = pp(extra={"W.grad_sync": Annotation("[0] R | [1] R ; hdim=0")})
    plan = prog.grad_sync_plans["W.grad_sync"]
    assert plan.dst == Annotation("[0] R | [1] R ; hdim=0") and plan.kinds == ["SplitReduceScatter"]
    assert prog.concrete_plan("W.grad_sync", {"B": 4}).dst == Annotation("[0] R | [1] R ; hdim=0")


def test_bindings_are_checked_against_the_settings_and_the_constraints() -> None:
    prog = pp(GPIPE, bindings={"B": 6})
    assert prog.bindings == {"B": 6}
    with pytest.raises(ShapeError, match=r"bindings: B=8 but the plan's micro-batches add up to 6 samples"):
        pp(GPIPE, bindings={"B": 8})
    with pytest.raises(ShapeError, match=r"tensor 'X' dim 0 .* = B/2 requires B ≡ 0 \(mod 2\)"):
        pp(bindings={"B": 3})
    g = GraphBuilder("two")
    ops.gelu(g.placeholder("X", ("B", "S")), name="Y")
    with pytest.raises(ShapeError, match=r"bindings lack symbol\(s\) \['S'\] of graph 'two'"):
        specialize(g.build(), {"X": Annotation("[0] R")}, Cluster.local(1), bindings={"B": 2})
    assert pp(bindings={"B": 10}).bindings == {"B": 10}
    assert pp().bindings == {"B": 2}                              # the least B that HDim 0 over two divides
    assert pp(hints={"B": 8}).bindings == {"B": 8}                # the graph's hint
    # a batch size fixed by the settings but a graph whose batch symbol is not B: nothing to compare
    g = GraphBuilder("n")
    ops.gelu(g.placeholder("X", ("N", 4)), name="Y")
    plan = AnnotationPlan(annotations={"X": Annotation("[0] R")}, settings=GPIPE.model_copy(
        update={"micro_batch_size": (2,), "num_micro_batches": (1,), "recompute": (0,)}))
    assert specialize(g.build(), plan, Cluster.local(1), bindings={"N": 4}).bindings == {"N": 4}


def test_recompute_ranks_must_run_a_stage() -> None:
    with pytest.raises(SpecializationError, match=r"recompute names rank\(s\) \[9\] .* \(stage ranks 0-3\)"):
        pp(GPIPE.model_copy(update={"recompute": (9,)}))


def test_the_data_placeholder_numbers_the_pipelines() -> None:
    # subgroup 0 of the data is rank 1: it is pipeline 0 although rank 0 is smaller
    g = GraphBuilder("order")
    ops.dot(g.placeholder("X", ("B", 4)), g.parameter("W", (4, 4)), name="Y")
    anns = {"X": Annotation("[1] R | [0] R ; hdim=0"), "W": Annotation("[1] R | [0] R")}
    settings = ExecutionSettings(micro_batch_size=(1, 2), num_micro_batches=(3, 1))
    prog = specialize(g.build(), AnnotationPlan(annotations=anns, settings=settings), Cluster.local(2))
    assert prog.pipelines == [[[1]], [[0]]]
    assert [prog.num_micro_batches(i) for i in (0, 1)] == [3, 1] and prog.micro_batch_size(0) == 1


def test_a_graph_of_parameters_only() -> None:
    # no placeholder: pipelines are ordered by their smallest rank
    g = GraphBuilder("params")
    ops.gelu(g.parameter("A", (4,)), name="Ag")
    ops.gelu(g.parameter("C", (4,)), name="Cg")
    prog = specialize(g.build(), {"A": Annotation("[1] R"), "C": Annotation("[0] R")}, Cluster.local(2))
    assert prog.pipelines == [[[0]], [[1]]]
    assert _ops(prog, 0, "Post") == [("C.grad_sync", "GradSync", "Post", ("C",), ("C",), (), 0),
                                     ("optimizer", "OptimizerStep", "Post", ("C",), (), (), 0)]


def test_context_parallel_attention_is_one_stage() -> None:
    # attention mixes the sequence: ranks 0, 1 that split S hold one kernel together (one stage, one pipeline)
    g = GraphBuilder("cp")
    x = g.placeholder("X", ("B", "S", 2, 4))
    ops.attention(ops.gelu(x, name="Q"), x, x, name="O")
    prog = specialize(g.build(), {"X": Annotation("[0,1] S1x2")}, Cluster.local(2))
    assert prog.pipelines == [[[0, 1]]]
    # without a mixing op the same layout is two independent pipelines
    g = GraphBuilder("nocp")
    ops.gelu(g.placeholder("X", ("B", "S", 2, 4)), name="Q")
    assert specialize(g.build(), {"X": Annotation("[0,1] S1x2")}, Cluster.local(2)).pipelines == [[[0]], [[1]]]


# ---- gradient synchronisation of parameters used twice ----------------------------------------------------------
def test_a_weight_tied_across_stages_has_two_grad_syncs() -> None:
    g = GraphBuilder("tied")
    x = g.placeholder("X", ("B", 4))
    w = g.parameter("W", (4, 4))
    z = g.reshard(ops.dot(x, w, name="Y"), "Z")
    ops.dot(z, g.reshard(w, "W'"), name="O")
    anns = {"X": Annotation("[0] R"), "W": Annotation("[0] R"), "Z": Annotation("[1] R"), "W'": Annotation("[1] R")}
    prog = specialize(g.build(), anns, Cluster.local(2))
    assert prog.pipelines == [[[0], [1]]] and prog.pre_reshards == frozenset({"W'"})
    assert [(s.param, s.name, s.uses) for s in prog.grad_syncs] == [("W", "W.grad_sync", ("W",)),
                                                                   ("W", "W.grad_sync.1", ("W'",))]
    assert prog.grad_sync_plans["W.grad_sync"].kinds == ["Identity"]
    second = prog.grad_sync_plans["W.grad_sync.1"]
    assert second.kinds == ["SendRecv"] and second.src == Annotation("[1] R") and second.dst == Annotation("[0] R")
    # W (4 x 4 float32, 64 B) goes 0 -> 1 in Pre and its second gradient 1 -> 0 in Post
    assert _ops(prog, 0, "Pre") == [("W'", "Reshard", "Pre", ("W",), ("W'",), ("SendRecv",), 64)]
    assert _ops(prog, 0, "Post") == [("W.grad_sync", "GradSync", "Post", ("W",), ("W",), (), 0),
                                     ("W.grad_sync.1", "GradSync", "Post", ("W'",), ("W",), ("SendRecv",), 0),
                                     ("optimizer", "OptimizerStep", "Post", ("W",), (), (), 0)]
    assert _ops(prog, 1, "Post") == [("W.grad_sync.1", "GradSync", "Post", ("W'",), ("W",), ("SendRecv",), 64)]
    assert prog.executable_graph(1).leaves == () and prog.executable_graph(1).parameters == ()
    assert prog.concrete_plan("W.grad_sync.1", {"B": 4}).kinds == ["SendRecv"]
    assert "W'" not in prog.backward_plans and set(prog.backward_plans) == {"Z"}
    assert "  gradient synchronisation by kind: Identity x1, SendRecv x1" in str(prog).splitlines()


def test_two_uses_with_one_gradient_layout_share_one_grad_sync() -> None:
    g = GraphBuilder("twice")
    x = g.placeholder("X", ("B", 4))
    w = g.parameter("W", (4, 4))
    ops.linear(ops.dot(x, w, name="Y"), g.reshard(w, "W'"), name="O")   # two op kinds: equal, distinct layouts
    prog = specialize(g.build(), {"X": Annotation("[0,1] S0x2"), "W": Annotation("[0,1] D2"),
                                  "W'": Annotation("[0,1] D2")}, Cluster.local(2))
    assert [(s.param, s.name, s.uses) for s in prog.grad_syncs] == [("W", "W.grad_sync", ("W", "W'"))]
    # batch split over a Duplicate weight: the summed gradient is Partial, all-reduced (64 B per rank)
    assert prog.grad_sync_plans["W.grad_sync"].kinds == ["AllReduce"]
    assert _ops(prog, 1, "Post")[0] == ("W.grad_sync", "GradSync", "Post", ("W", "W'"), ("W",), ("AllReduce",), 64)


def test_a_parameter_read_by_an_op_that_has_no_weight_input() -> None:
    g = GraphBuilder("bias")
    ops.add(g.placeholder("X", (2, 4)), g.parameter("P", (2, 4)), name="Y")
    prog = specialize(g.build(), {"X": Annotation("[0] R"), "P": Annotation("[0] R")}, Cluster.local(1))
    plan = prog.grad_sync_plans["P.grad_sync"]
    assert plan.kinds == ["Identity"] and plan.src == plan.dst == Annotation("[0] R")


def test_a_rank_that_only_holds_a_zero_shard_has_no_pipeline() -> None:
    # W is sharded over ranks 0-2 (ZeRO) and gathered onto 0, 1 in Pre; rank 2 computes nothing
    g = GraphBuilder("zero")
    x = g.placeholder("X", ("B", 6))
    ops.dot(x, g.reshard(g.parameter("W", (6, 6)), "W'"), name="Y")
    prog = specialize(g.build(), {"X": Annotation("[0,1] S0x2"), "W": Annotation("[0-2] S0x3"),
                                  "W'": Annotation("[0,1] D2")}, Cluster.local(3))
    assert prog.pipelines == [[[0]], [[1]]] and prog.ranks == [0, 1]
    eg = prog.executable_graph(2)
    assert (eg.rank, eg.pipeline, eg.stage) == (2, None, None)
    assert eg.leaves == ("W",) and eg.forward == () and eg.backward == ()
    # W (6 x 6 float32 = 144 B) in three 48 B row blocks: rank 2 sends its block to ranks 0 and 1
    assert _ops(prog, 2, "Pre") == [("W'", "Reshard", "Pre", ("W",), ("W'",), ("BSR",), 96)]
    sync = prog.grad_sync_plans["W.grad_sync"]
    assert sync.kinds == ["AllReduce", "BSR"] and sync.dst == Annotation("[0-2] S0x3")
    assert _ops(prog, 2, "Post") == [("W.grad_sync", "GradSync", "Post", ("W'",), ("W",), ("BSR",), 0),
                                     ("optimizer", "OptimizerStep", "Post", ("W",), (), (), 0)]
    text = prog.describe(2)
    assert text.splitlines() == [
        "Executable graph of rank 2: no pipeline (takes part only in Pre/Post communication)",
        "  leaves: 1 (1 parameters)",
        "  Pre: 1 ops, 1 communicating",
        "    Reshard W' [BSR] sends 96 B",
        "  F: 0 ops, 0 communicating",
        "  B: 0 ops, 0 communicating",
        "  Post: 2 ops, 1 communicating",
        "    GradSync W.grad_sync [BSR]",
        "    OptimizerStep optimizer",
        "  bytes sent per step: 96 B (activations at the step's shapes B=2)"]
    line = [ln for ln in prog.describe(0).splitlines() if "W.grad_sync" in ln]
    assert line == ["    GradSync W.grad_sync [AllReduce + BSR] sends 192 B"]


# ---- constraints ----------------------------------------------------------------------------------------------
def test_constraints_name_the_tensor_that_needs_them() -> None:
    # X (B x 4) is Duplicate: no constraint; Z, the same shape, splits B in two
    g = GraphBuilder("c")
    ops.gelu(g.reshard(g.placeholder("X", ("B", 4)), "Z"), name="Y")
    prog = specialize(g.build(), {"X": Annotation("[0,1] D2"), "Z": Annotation("[0,1] S0x2")}, Cluster.local(2))
    assert [(c.tensor, c.dim, str(c.expr)) for c in prog.constraints] == [("Z", 0, "B/2")]
    with pytest.raises(ShapeError, match=r"tensor 'Z' dim 0 .*B ≡ 0 \(mod 2\)"):
        prog.bind({"B": 3})


def test_a_global_dim_that_must_be_integral_is_a_constraint() -> None:
    # X's dim 1 is S/2 globally and S/4 on each of ranks 0, 1
    g = GraphBuilder("glob", hints={"S": 8})
    ops.gelu(g.placeholder("X", (2, sym("S") / 2, 4)), name="Y")
    prog = specialize(g.build(), {"X": Annotation("[0,1] S1x2")}, Cluster.local(2))
    got = {(c.tensor, c.dim, str(c.expr), c.where) for c in prog.constraints}
    assert ("X", 1, "S/2", "global shape") in got and ("X", 1, "S/4") in {t[:3] for t in got}
    assert prog.bindings == {"S": 8}
    assert "  shape constraints: S ≡ 0 (mod 2); S ≡ 0 (mod 4)" in str(prog).splitlines()


# ---- training state -------------------------------------------------------------------------------------------
def test_state_layouts_of_parameters_and_adam_moments() -> None:
    g = GraphBuilder("state")
    ops.dot(g.placeholder("X", ("B", 4)), g.parameter("W", (4, 6), dtype="bfloat16"), name="Y")
    prog = specialize(g.build(), {"X": Annotation("[0,1] D2"), "W": Annotation("[0,1] S1x2")}, Cluster.local(2))
    assert prog.parameters == ["W"]
    ann = Annotation("[0,1] S1x2")
    got = {k: (v.name, v.param, v.kind, v.annotation, v.shape, v.dtype) for k, v in prog.state_layouts().items()}
    assert got == {"W": ("W", "W", "param", ann, (4, 6), "bfloat16"),
                   "W.exp_avg": ("W.exp_avg", "W", "exp_avg", ann, (4, 6), "float32"),
                   "W.exp_avg_sq": ("W.exp_avg_sq", "W", "exp_avg_sq", ann, (4, 6), "float32")}
    assert all(type(d) is int for v in prog.state_layouts().values() for d in v.shape)
    ident = prog.grad_sync_plans["W.grad_sync"]
    assert ident.dtype == "bfloat16" and ident.itemsize == 2


def test_local_shapes_name_the_rank_and_tensor() -> None:
    prog = pp()
    assert prog.local_shape("X", 1, {"B": 6}) == (3, 4)
    assert str(prog.local_shape("X", 1)[0]) == "B/2"
    with pytest.raises(ShapeError, match=r"tensor 'X' dim 0 \(local shard on rank 1\) = B/2: symbol 'B' is not"):
        prog.local_shape("X", 1, {"S": 2})
    with pytest.raises(KeyError, match=r"rank 2 holds no shard of tensor 'X'"):
        prog.local_shape("X", 2)


# ---- plans given as mappings or plan-like objects ---------------------------------------------------------------
def test_plans_as_mappings_of_text_and_as_plan_like_objects() -> None:
    g = GraphBuilder("m")
    ops.gelu(g.placeholder("X", ("B", 4)), name="Y")
    graph = g.build()
    prog = specialize(graph, {"X": "[0,1] S0x2"}, Cluster.local(2))
    assert isinstance(prog.plan, AnnotationPlan) and prog.plan.annotations == {"X": Annotation("[0,1] S0x2")}
    assert prog.annotations["Y"] == Annotation("[0,1] S0x2")
    duck = SimpleNamespace(annotations={"X": Annotation("[0] R")})       # no settings: the defaults
    assert specialize(graph, duck, Cluster.local(1)).schedule_kind == "1f1b"
    duck = SimpleNamespace(annotations={"X": Annotation("[0] R")}, settings=ExecutionSettings(schedule="gpipe"))
    prog = specialize(graph, duck, Cluster.local(1))
    assert prog.schedule_kind == "gpipe" and prog.plan.settings.schedule == "gpipe"
    assert isinstance(prog.plan, AnnotationPlan) and prog.plan.annotations == {"X": Annotation("[0] R")}
    duck = SimpleNamespace(annotations={"X": Annotation("[0] R")}, settings={"schedule": "gpipe"})
    assert specialize(graph, duck, Cluster.local(1)).schedule_kind == "1f1b"  # not ExecutionSettings: ignored
    plan = AnnotationPlan(annotations={"X": Annotation("[0] R")}, meta={"from": "here"})
    assert specialize(graph, plan, Cluster.local(1)).plan is plan
    with pytest.raises(SpecializationError, match="plan must be an AnnotationPlan or a mapping"):
        specialize(graph, 3, Cluster.local(1))


def test_a_model_config_is_kept_with_its_program() -> None:
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.core.strategy import Strategy
    from hspmd_sdk.core.strategy_plan import plan_from_strategy

    config = LlamaConfig.preset("tiny")
    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [0], "layers": [0, config.num_layers - 1]}],
                                             "micro_batch_size": 1, "num_micro_batches": 1}]})
    cluster = Cluster.local(1)
    prog = specialize(config, plan_from_strategy(config, strategy, cluster), cluster)
    assert prog.model is config and prog.graph.name and prog.pipelines == [[[0]]]
    assert specialize(prog.graph, prog.plan, cluster).model is None       # a bare graph has none
    with pytest.raises(SpecializationError, match="not int"):
        specialize(3, prog.plan, cluster)


def test_a_program_travels_as_json() -> None:
    prog = pp(GPIPE)
    back = Program.from_json(prog.to_json())
    assert back == prog and back.pipelines == prog.pipelines
    assert back.executable_graph(3).phase("B") == prog.executable_graph(3).phase("B")


# ---- printing -------------------------------------------------------------------------------------------------
def test_exec_op_text_and_byte_units() -> None:
    plan = mlp().comm_plans["Z"]
    assert str(ExecOp("Z", "Reshard", "F", comm=plan, comm_kinds=("AllReduce",), bytes_sent=16)) == \
        "Reshard Z [AllReduce] sends 16 B"
    assert str(ExecOp("Z", "Reshard", "F", comm=plan)) == "Reshard Z [nothing on this rank]"
    assert str(ExecOp("H", "dot", "F", bytes_sent=10)) == "dot H"
    cases = {999: "999 B", 1000: "1.00 KB", 1500: "1.50 KB", 10 ** 6: "1.00 MB", 2_500_000: "2.50 MB",
             10 ** 9: "1.00 GB", 3 * 10 ** 9: "3.00 GB"}
    for n, text in cases.items():
        assert str(ExecOp("x", "Reshard", "F", comm=plan, comm_kinds=("SendRecv", "BSR"), bytes_sent=n)) == \
            f"Reshard x [SendRecv + BSR] sends {text}", n


def test_describe_a_program() -> None:
    prog = _mlp_two_symbols()
    lines = str(prog).splitlines()
    assert lines[0] == ("Program of graph 'mlp2': 2 ranks in 1 pipeline(s), schedule 1f1b, symbols B=2, S=4")
    assert lines[1] == "  pipeline 0 (1 micro-batches): [0,1]"
    assert lines[2] == "  forward/Pre Reshards by kind: AllReduce x1, Identity x1, LocalSplit x2"
    # the moving Reshards, those that are not all-reduces first (Z is before Z2 and Z3 in the graph)
    assert lines[3:6] == ["    Z2: LocalSplit  [0,1] D2 -> [0,1] S0x2",
                          "    Z3: LocalSplit  [0,1] D2 -> [0,1] S1x2",
                          "    Z: AllReduce  [0,1] P2 -> [0,1] D2"]
    assert lines[6] == "  gradient synchronisation by kind: Identity x1"
    assert lines[7] == "  shape constraints: B ≡ 0 (mod 2); S ≡ 0 (mod 2)"
    assert len(lines) == 8 and prog.describe() == str(prog)


def _mlp_two_symbols() -> Program:
    g = GraphBuilder("mlp2", hints={"S": 4})
    x = g.placeholder("X", ("B", "S", 4))
    y = ops.dot(ops.gelu(x, name="Xg"), g.parameter("W", (4, 4)), name="Y")
    z = g.reshard(y, "Z")
    g.reshard(z, "Z2")
    g.reshard(z, "Z3")
    g.reshard(x, "Xr")
    plan = {"X": Annotation("[0,1] S2x2"), "W": Annotation("[0,1] S0x2"), "Z": Annotation("[0,1] D2"),
            "Z2": Annotation("[0,1] S0x2"), "Z3": Annotation("[0,1] S1x2"), "Xr": Annotation("[0,1] S2x2")}
    return specialize(g.build(), plan, Cluster.local(2))


def _chain(moves: int, computes: int = 0) -> Program:
    """``computes`` gelus on one tensor, then ``moves`` Reshards alternating its row / column split on ranks 0, 1."""
    g = GraphBuilder("chain")
    t = g.placeholder("X", (4, 4))
    for i in range(computes):
        t = ops.gelu(t, name=f"g{i}")
    plan = {"X": Annotation("[0,1] S0x2")}
    for i in range(moves):
        t = g.reshard(t, f"R{i}")
        plan[f"R{i}"] = Annotation("[0,1] S1x2" if i % 2 == 0 else "[0,1] S0x2")
    return specialize(g.build(), plan, Cluster.local(2))


@pytest.mark.parametrize("moves", [24, 25, 27])
def test_describe_lists_24_moving_reshards_and_counts_the_rest(moves: int) -> None:
    lines = str(_chain(moves)).splitlines()
    assert lines[2] == f"  forward/Pre Reshards by kind: AllToAll x{moves}"
    listed = [ln for ln in lines if ln.startswith("    R")]
    assert listed == [f"    R{i}: AllToAll  [0,1] {a} -> [0,1] {b}"
                      for i, (a, b) in zip(range(24), [("S0x2", "S1x2"), ("S1x2", "S0x2")] * 12)]
    more = [ln for ln in lines if ln.startswith("    ...")]
    assert more == ([] if moves == 24 else [f"    ... {moves - 24} more"])
    assert lines[-1] == "  gradient synchronisation by kind: "       # no parameters


@pytest.mark.parametrize("computes, shown", [(39, True), (40, False)])
def test_describe_a_rank_hides_compute_ops_of_a_phase_over_40(computes: int, shown: bool) -> None:
    prog = _chain(1, computes)                                  # F: the gelus and R0 (one AllToAll)
    lines = prog.describe(0).splitlines()
    assert f"  F: {computes + 1} ops, 1 communicating" in lines
    gelus = [ln for ln in lines if ln.startswith("    gelu ")]
    assert gelus == ([f"    gelu g{i}" for i in range(computes)] if shown else [])
    backward = [f"    geluBwd g{i}.bwd" for i in reversed(range(computes))]
    assert [ln for ln in lines if ln.startswith("    geluBwd")] == (backward if shown else [])
    # 4 x 4 float32 in two row halves -> two column halves: each rank sends a 2 x 2 block (16 B), both ways
    assert "    Reshard R0 [AllToAll] sends 16 B" in lines and "    ReshardBwd R0.bwd [AllToAll] sends 16 B" in lines
    assert lines[-1] == "  bytes sent per step: 32 B (activations at the step's shapes )"


def test_describe_a_rank() -> None:
    prog = _mlp_two_symbols()
    lines = prog.describe(1).splitlines()
    # Y (2 x 4 x 4 float32 = 128 B) all-reduced; Z2 / Z3 / Xr move nothing; Z's backward moves nothing (D2 -> D2)
    assert lines == [
        "Executable graph of rank 1: pipeline 0, stage 0 of 1 (stage ranks 0,1), 1 micro-batch(es)",
        "  leaves: 2 (1 parameters)",
        "  Pre: 0 ops, 0 communicating",
        "  F: 6 ops, 3 communicating",
        "    gelu Xg",
        "    dot Y",
        "    Reshard Z [AllReduce] sends 128 B",
        "    Reshard Z2 [LocalSplit]",
        "    Reshard Z3 [LocalSplit]",
        "  B: 6 ops, 2 communicating",
        "    ReshardBwd Z3.bwd [AllGather] sends 64 B",
        "    ReshardBwd Z2.bwd [AllGather] sends 64 B",
        "    dotBwd Y.bwd",
        "    geluBwd Xg.bwd",
        "  Post: 2 ops, 0 communicating",
        "    OptimizerStep optimizer",
        "  bytes sent per step: 256 B (activations at the step's shapes B=2, S=4)"]


# ---- issue 49: survivors of the second run ---------------------------------------------------------------------
_DP = {"X": Annotation("[0] R | [1] R ; hdim=0"), "W": Annotation("[0] R | [1] R"), "V": Annotation("[0] R | [1] R")}


def test_a_parameter_reparametrised_twice_is_synchronised_across_data_parallel_pipelines() -> None:
    """V -> gelu -> gelu -> dot's weight: the second gelu reads a tensor computed from parameters alone (not V
    itself), so its gradient is passed on through both ops: Partial across the pipelines like W's, not read as laid
    out like V (pins _of_parameters' "computed from parameters alone" and the recursion of _use_grad)."""
    g = GraphBuilder("twice_through")
    x = g.placeholder("X", ("B", 4))
    v = ops.gelu(ops.gelu(g.parameter("V", (4, 4)), name="Vg"), name="Vgg")
    ops.dot(ops.dot(x, g.parameter("W", (4, 4)), name="Y"), v, name="O")
    prog = specialize(g.build(), _DP, Cluster.local(2))
    assert prog.grad_sync_plans["W.grad_sync"].kinds == ["SplitAllReduce"]
    assert prog.grad_sync_plans["V.grad_sync"].kinds == ["SplitAllReduce"]


def test_a_parameter_reshaped_into_a_weight_without_data_parallelism_is_not_refused() -> None:
    """V (2, 2) reshaped into a bias on one rank: the bias's gradient is laid out like the bias (no Partial), so V's
    gradient is V's own layout although the reshape changes the shape -- only a gradient unlike its output's layout
    is refused (pins the early return of _use_grad)."""
    g = GraphBuilder("reshaped1")
    x = g.placeholder("X", ("B", 4))
    b = ops.reshape(g.parameter("V", (2, 2)), (4,), name="Vflat")
    ops.bias_add(ops.dot(x, g.parameter("W", (4, 4)), name="Y"), b, name="O")
    prog = specialize(g.build(), {"X": Annotation("[0] R"), "W": Annotation("[0] R"), "V": Annotation("[0] R")},
                      Cluster.local(1))
    plan = prog.grad_sync_plans["V.grad_sync"]
    assert plan.kinds == ["Identity"] and plan.src == plan.dst == Annotation("[0] R")


def _register(monkeypatch: pytest.MonkeyPatch, op) -> None:
    from hspmd_sdk.core.op_registry import OPS

    monkeypatch.setitem(OPS, op.kind, op)


def _wux_rule(keys, shapes, attrs):
    wk, uk, xk = keys
    if wk != -1 or uk != -1:  # DUPLICATE
        raise ops.RuleError("W and U must be Duplicate")
    return (xk,)


def test_a_user_op_whose_weight_is_its_first_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """register_op: "wux"(W, U, X) = X @ W with its weight at input 0 and its activation last.  The weight's
    gradient faces the activation X (inputs[-1]), not the weight itself nor U (inputs[1], inputs[-2], here data laid
    out Duplicate in both pipelines): X's batch split across the pipelines makes W's gradient Partial
    (SplitAllReduce).  Its batch_dims reads both shapes, the activation's and the weight's: they must both arrive.
    A parameter at U's place (no weight input, beside X) is refused: nothing says which gradients to sum (before
    stop 56 it kept its own layout, an Identity synchronisation, and the pipelines trained apart)."""
    from hspmd_sdk.core.op_registry import OpDef

    seen = []

    def batch_dims(shapes):
        seen.append(tuple(tuple(s) for s in shapes))
        return tuple(range(len(shapes[0]) - len(shapes[1]) + 1))

    _register(monkeypatch, OpDef("wux", lambda shapes, attrs, node: [tuple(shapes[2])], _wux_rule,
                                 weight_inputs=(0,), batch_dims=batch_dims))
    plan = {"X": Annotation("[0] R | [1] R ; hdim=0"), "W": Annotation("[0] R | [1] R"),
            "U": Annotation("[0] R | [1] R")}
    g = GraphBuilder("wux")
    x = g.placeholder("X", ("B", 4))
    g.add("wux", [g.parameter("W", (4, 4)), g.placeholder("U", (4, 4)), x], {}, name="O")
    prog = specialize(g.build(), plan, Cluster.local(2))
    assert prog.grad_sync_plans["W.grad_sync"].kinds == ["SplitAllReduce"]
    assert seen and all(len(s) == 2 and s[1] == (4, 4) and len(s[0]) == 2 for s in seen)
    g = GraphBuilder("wux")
    g.add("wux", [g.parameter("W", (4, 4)), g.parameter("U", (4, 4)), g.placeholder("X", ("B", 4))], {}, name="O")
    with pytest.raises(SpecializationError, match=r"^parameter tensor 'U' is input 1 of op 'O' \(wux\) beside "
                                                  r"activations, which is not one of the op's weight inputs"):
        specialize(g.build(), plan, Cluster.local(2))


def test_a_fused_weight_split_in_two_is_synchronised_across_data_parallel_pipelines() -> None:
    """V (4, 8) split into two Dot weights (a fused gate/up weight): V's gradient is the concatenation of both
    halves' gradients, each Partial across the pipelines, so V's is too (before stop 56 a parameter read through an
    op with several outputs kept an Identity synchronisation).  Split along a dim the plan splits (TP on dim 1):
    refused by the op's rule; on one rank the layout passes through unchanged."""
    def graph():
        g = GraphBuilder("fused")
        x = g.placeholder("X", ("B", 4))
        a, b = ops.split(g.parameter("V", (4, 8)), 1, 2, name="Vs")
        ops.add(ops.dot(x, a, name="Ya"), ops.dot(x, b, name="Yb"), name="O")
        return g.build()

    prog = specialize(graph(), {k: v for k, v in _DP.items() if k != "W"}, Cluster.local(2))
    assert prog.grad_sync_plans["V.grad_sync"].kinds == ["SplitAllReduce"]
    one = specialize(graph(), {"X": Annotation("[0] R"), "V": Annotation("[0] R")}, Cluster.local(1))
    assert one.grad_sync_plans["V.grad_sync"].kinds == ["Identity"]


def test_a_parameter_beside_activations_keeps_its_layout_only_where_all_are_laid_out_alike() -> None:
    """P (4, 4) multiplied into a data tensor of its shape, every tensor laid out alike (Duplicate on both ranks of
    one stage): every holder computes the same gradient, P's layout is its gradient's.  P as a Dot's first input
    (not its weight input) facing data X (4, B) whose columns (the batch) are split across two pipelines: P's
    gradient would be Partial across them, and is refused rather than left unsynchronised."""
    g = GraphBuilder("scale")
    ops.mul(g.placeholder("X", (4, 4)), g.parameter("P", (4, 4)), name="O")
    prog = specialize(g.build(), {"X": Annotation("[0,1] D2"), "P": Annotation("[0,1] D2")}, Cluster.local(2))
    assert prog.grad_sync_plans["P.grad_sync"].kinds == ["Identity"]
    g = GraphBuilder("left")
    ops.dot(g.parameter("P", (4, 4)), g.placeholder("X", (4, "B")), name="O")
    with pytest.raises(SpecializationError, match=r"^parameter tensor 'P' is input 0 of op 'O' \(dot\) beside "
                                                  r"activations.*Read the parameter through a weight input"):
        specialize(g.build(), {"X": Annotation("[0] R | [1] R ; hdim=1"), "P": Annotation("[0] R | [1] R")},
                   Cluster.local(2))


def test_a_user_op_of_one_input_that_mixes_a_split_dim_is_one_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered op with ``mixes`` and a single input: the ranks holding the chunks of its mixed dim of input 0
    run one kernel together, one stage (the kernel groups come from input 0)."""
    _register(monkeypatch, dataclasses.replace(ops.OPS["gelu"], kind="mix1", mixes=(1,)))
    g = GraphBuilder("mix1")
    g.add("mix1", [g.placeholder("X", ("B", "S", 4))], {}, name="O")
    prog = specialize(g.build(), {"X": Annotation("[0,1] S1x2")}, Cluster.local(2))
    assert prog.pipelines == [[[0, 1]]]


def test_local_shape_errors_name_the_tensor() -> None:
    """Program.local_shape passes the tensor's name to the local-shape derivation: a Program whose annotation
    splits a concrete dim that does not divide (here 3 rows over 2 ranks, set by hand) names the tensor."""
    g = GraphBuilder("odd")
    ops.gelu(g.placeholder("X", (4, 4)), name="Y")
    prog = specialize(g.build(), {"X": Annotation("[0,1] D2")}, Cluster.local(2))
    g2 = GraphBuilder("odd")
    ops.gelu(g2.placeholder("X", (3, 4)), name="Y")
    bad = dataclasses.replace(prog, graph=g2.build(), annotations={**prog.annotations, "X": Annotation("[0,1] S0x2")})
    with pytest.raises(ShapeError, match="'X'"):
        bad.local_shape("X", 0)


def test_a_bound_symbol_that_is_not_positive_names_the_tensor_whose_plan_needs_it() -> None:
    """bindings B=0: the first shape evaluated at the bindings names its tensor -- the Reshard's input when
    communication is planned, the input of a mixing op (attention) when the kernel groups are derived."""
    g = GraphBuilder("r")
    ops.gelu(g.reshard(g.placeholder("X", ("B", 4)), "Z"), name="O")
    with pytest.raises(ShapeError) as e:
        specialize(g.build(), {"X": Annotation("[0] R"), "Z": Annotation("[0] R")}, Cluster.local(1),
                   bindings={"B": 0})
    assert str(e.value) == "tensor 'X' dim 0: symbol 'B' must be bound to a positive int, got 0"
    g = GraphBuilder("cp0")
    q = g.placeholder("Q", ("B", "S", 2, 4))
    ops.attention(q, q, q, name="O")
    with pytest.raises(ShapeError) as e:
        specialize(g.build(), {"Q": Annotation("[0,1] S1x2")}, Cluster.local(2), bindings={"B": 0, "S": 2})
    assert str(e.value) == "tensor 'Q' dim 0: symbol 'B' must be bound to a positive int, got 0"


# ---- issue 49: survivors of the run after Program.part ---------------------------------------------------------
@pytest.mark.parametrize("what, call", [
    ("executable_graph", lambda part: part.executable_graph(1)),
    ("schedule", lambda part: part.schedule(1)),
    ("stage_of", lambda part: part.stage_of(1)),
    ("batch_rows", lambda part: part.batch_rows(1, {"B": 2})),
    ("micro_batch_plan", lambda part: part.micro_batch_plan("X", 1, {"B": 2}, 1)),
    ("local_shape", lambda part: part.local_shape("X", 1)),
    ("part", lambda part: part.part(1)),
])
def test_a_part_asked_about_another_rank_names_the_method(what, call) -> None:
    """Rank 0's part of the two-rank MLP, made at version 3 (Program.part passes the version on), refuses rank 1
    with a message that starts with the method asked."""
    from hspmd_sdk.core.program_part import ProgramPartError

    prog = mlp()
    part = prog.part(0, version=3)
    assert part.version == 3 and prog.part(0).version == 0
    with pytest.raises(ProgramPartError) as e:
        call(part)
    assert str(e.value) == (f"{what}: this is rank 0's part of Program {prog.digest()[:12]} (version 3); rank 1 is "
                            "not in it — ask the whole Program, or that rank's part")


def test_the_planner_keeps_the_annotations_whose_ids_it_remembers_alive() -> None:
    """The planner's fast path keys plans by the annotation objects' ids: it keeps every pair it was asked about
    alive, even one whose plan it found by value (equal annotations, other objects) and whose name was asked again
    since, so that no later annotation can take such an id and get another layout's plan."""
    import gc
    import weakref

    from hspmd_sdk.core.specialize import _Planner

    g = GraphBuilder("one")
    g.placeholder("X", (4, 4))
    planner = _Planner(g.build(), {}, lambda src, dst, shape, dtype, cluster: (str(src), str(dst)), None)
    a, b = Annotation("[0,1] D2"), Annotation("[0,1] S0x2")
    assert planner.plan(a, b, "X", name="n") == ("[0,1] D2", "[0,1] S0x2")
    a2, b2 = Annotation("[0,1] D2"), Annotation("[0,1] S0x2")
    refs = [weakref.ref(a2), weakref.ref(b2)]
    assert planner.plan(a2, b2, "X", name="m") == ("[0,1] D2", "[0,1] S0x2")  # found by value
    assert planner.plan(a, b, "X", name="m") == ("[0,1] D2", "[0,1] S0x2")  # "m" names the first pair now
    del a2, b2
    gc.collect()
    assert all(r() is not None for r in refs)
    assert planner.keys == {"n": (a, b, "X"), "m": (a, b, "X")}
