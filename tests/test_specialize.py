"""Graph specialization (§6, Appendix A.2): the paper's running example and the Table 9 / Table 11 strategies."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hspmd_sdk.core import ops
from hspmd_sdk.core.annotation import Annotation
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.graph import GraphBuilder
from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.specialize import specialize
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.errors import ShapeError, SpecializationError

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"


# ---- the running example: Figures 4, 12, 21 -------------------------------------------------------------------
def figure12(with_cp_gather: bool):
    """X -> Gelu -> Dot(., W') -> Reshard id=2 -> Y'; W -> Reshard id=1 (ZeRO gather) -> W'.

    TP between GPUs 0,3 (row-parallel: Y is Partial), PP between GPU 1 and GPUs 5,6, CP between GPUs 2,4 (the
    sequence is split), DP across the three (X HDim 0).  W is ZeRO-sharded across the subgroups (HDim 1)."""
    g = GraphBuilder("figure12")
    x = g.placeholder("X", ("B", "S", 8))
    w1 = g.reshard(g.parameter("W", (8, 12)), "W'")            # Reshard id=1
    y2 = g.reshard(ops.dot(ops.gelu(x, name="X_gelu"), w1, name="Y"), "Y'")  # Reshard id=2
    plan = {
        "X": Annotation("[0,3] S2x2 | [1] R | [2,4] S1x2 ; hdim=0"),
        "W": Annotation("[0,3] S0x2 | [1] R | [2,4] D2 ; hdim=1"),
        "W'": Annotation("[0,3] S0x2 | [1] R | [2,4] D2"),
        "Y'": Annotation("[0,3] S2x2 | [5,6] S2x2 | [2,4] S1x2 ; hdim=0"),
    }
    if with_cp_gather:
        g.reshard(y2, "Z")                                         # gathers the CP sequence split on 2,4
        plan["Z"] = Annotation("[0,3] S2x2 | [5,6] S2x2 | [2,4] D2 ; hdim=0")
    return specialize(g.build(), plan, Cluster.local(7))


def test_running_example_deduces_x_and_y() -> None:
    prog = figure12(False)
    assert prog.annotations["X_gelu"] == prog.annotations["X"]          # Gelu propagates
    assert prog.annotations["Y"] == Annotation("[0,3] P2 | [1] R | [2,4] S1x2 ; hdim=0")  # Dot: Partial on 0,3


def test_running_example_reshard_instantiation() -> None:
    prog = figure12(False)
    # Reshard id=1 is top-tier: SplitAG, instantiated uniformly on GPUs 0-4 (in the Pre subgraph)
    assert prog.comm_plans["W'"].kinds == ["SplitAllGather"]
    for r in range(5):
        (op,) = [o for o in prog.executable_graph(r).pre if o.name == "W'"]
        assert op.comm_kinds == ("SplitAllGather",)
    # Reshard id=2 is bottom-tier: RS on GPU 0 (and 3), BSR on GPU 6 (and 1, 5), nothing on 2, 4
    kinds = {r: next(o for o in prog.executable_graph(r).forward if o.name == "Y'").comm_kinds
             for r in (0, 1, 2, 3, 4, 5, 6)}
    assert kinds[0] == kinds[3] == ("ReduceScatter",)
    assert kinds[6] == kinds[5] == kinds[1] == ("BSR",)
    assert kinds[2] == kinds[4] == ()


def test_running_example_non_local_operator_removal() -> None:
    prog = figure12(False)
    eg6 = prog.executable_graph(6)
    assert [o.name for o in eg6.ops if o.phase == "F"] == ["Y'"]     # everything before Y' is removed
    assert eg6.leaves == () and eg6.pre == ()
    eg1 = prog.executable_graph(1)
    assert [o.name for o in eg1.forward] == ["X_gelu", "Y", "Y'"]
    assert [o.name for o in eg1.backward] == ["Y'.bwd", "Y.bwd", "X_gelu.bwd"]
    assert eg1.leaves == ("X", "W")


def test_running_example_pipelines_figure21() -> None:
    prog = figure12(False)
    # GPUs 0 and 3 merge into one pipeline (RS); GPUs 5,6 become the stage after GPU 1 (BSR)
    assert [[0, 3]] in prog.pipelines
    assert [[1], [5, 6]] in prog.pipelines
    assert prog.stage_of(6) == prog.stage_of(5) and prog.stage_of(6)[1] == 1
    prog = figure12(True)                          # an all-gather in F merges the CP pair too
    assert prog.pipelines == [[[0, 3]], [[1], [5, 6]], [[2, 4]]]
    text = prog.describe(6)
    assert "pipeline 1, stage 1" in text and "BSR" in text


def test_running_example_symbolic_constraints() -> None:
    prog = figure12(False)
    assert prog.bind({"B": 6, "S": 4})["Y'"] == (6, 4, 12)
    with pytest.raises(ShapeError, match=r"S ≡ 0 \(mod 2\)"):          # CP splits S in two on GPUs 2,4
        prog.bind({"B": 6, "S": 5})
    with pytest.raises(ShapeError, match=r"B ≡ 0 \(mod 3\)"):          # HDim 0 over three subgroups
        prog.bind({"B": 4, "S": 4})
    assert prog.local_shape("Y'", 6, {"B": 6, "S": 4}) == (2, 4, 6)


# ---- the paper's strategies on the 32B model --------------------------------------------------------------------
CASES = {
    "table9_32b_16h800_16h20": {"H800": 16, "H20": 16},
    "table9_32b_16h800_24h20": {"H800": 16, "H20": 24},
    "table9_32b_16h800_32h20": {"H800": 16, "H20": 32},
    "table11_c1": {"H20": 32},
    "table11_c2": {"H20": 31},
    "table11_c3": {"H20": 24},
}


@pytest.fixture(scope="module")
def model() -> LlamaConfig:
    return LlamaConfig.preset("llama-32b")


@pytest.fixture(scope="module")
def programs(model: LlamaConfig) -> dict:
    out = {}
    for name, kinds in CASES.items():
        strategy = Strategy.load(EXAMPLES / f"{name}.json")
        cluster = Cluster.mixed(kinds)
        plan = plan_from_strategy(model, strategy, cluster)
        out[name] = (strategy, specialize(model, plan, cluster))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_pipelines_found_by_construction_equal_the_strategy(programs: dict, name: str) -> None:
    strategy, prog = programs[name]
    assert prog.pipelines == [[sorted(s.devices) for s in p.stages] for p in strategy.pipelines]
    assert [prog.num_micro_batches(i) for i in range(len(prog.pipelines))] == \
        [p.num_micro_batches for p in strategy.pipelines]


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_holds_exactly_its_layers(programs: dict, name: str, model: LlamaConfig) -> None:
    strategy, prog = programs[name]
    for i, p in enumerate(strategy.pipelines):
        for j, s in enumerate(p.stages):
            for r in s.devices:
                eg = prog.executable_graph(r)
                assert (eg.pipeline, eg.stage) == (i, j)
                layers = {int(m.group(1)) for o in eg.forward for m in [re.match(r"layers\.(\d+)\.", o.name)]
                          if m and o.kind != "Reshard"}
                assert layers == set(range(s.layers[0], s.layers[1] + 1)), (name, r)
                names = {o.name for o in eg.forward}
                assert ("embed" in names) == (j == 0) and ("loss" in names) == (j == p.num_stages - 1)
                assert set(eg.parameters) == {n for n in eg.leaves if n not in ("tokens", "targets")}


@pytest.mark.parametrize("name", list(CASES))
def test_stage_boundaries_resolve_to_sendrecv_or_bsr(programs: dict, name: str) -> None:
    strategy, prog = programs[name]
    for p in strategy.pipelines:
        for prev, s in zip(p.stages, p.stages[1:]):
            want = ("SendRecv",) if len(prev.devices) == len(s.devices) else ("BSR",)
            boundary = f"layers.{s.layers[0]}.in"
            assert want[0] in prog.comm_plans[boundary].kinds
            for r in s.devices:
                (op,) = [o for o in prog.executable_graph(r).forward if o.name == boundary]
                assert op.comm_kinds == want, (name, boundary, r)


def test_c2_has_a_tp2_and_a_tp1_stage_and_bsr_between_them(programs: dict) -> None:
    _, prog = programs["table11_c2"]
    assert prog.pipelines[1][3:] == [[28, 29], [30]]
    assert prog.comm_plans["layers.48.in"].kinds == ["BSR"]       # TP4 -> TP2
    assert prog.comm_plans["layers.56.in"].kinds == ["BSR"]       # TP2 -> TP1
    assert prog.comm_plans["layers.15.in"].kinds == ["SendRecv"]  # pipeline 0 moves, pipeline 1 stays


def test_c2_gradient_sync_is_split_allreduce_across_tp_degrees(programs: dict) -> None:
    _, prog = programs["table11_c2"]
    for i in (50, 57):  # TP4 in pipeline 0 against TP2 / TP1 in pipeline 1
        plan = prog.grad_sync_plans[f"layers.{i}.attn.wq.grad_sync"]
        assert plan.kinds == ["SplitAllReduce"]
        assert plan.src.hdim == -2 and plan.dst.hdim == -1
        assert len(plan.src.ds_union[0].order) and plan.src.ds_union[0] != plan.src.ds_union[1]
    assert {k for p in prog.grad_sync_plans.values() for k in p.kinds} == {"SplitAllReduce"}
    (op,) = [o for o in prog.executable_graph(30).post if o.name == "layers.57.attn.wq.grad_sync"]
    assert op.comm_kinds == ("SplitAllReduce",) and op.bytes_sent > 0


def test_zero1_gathers_with_split_allgather_and_syncs_with_split_reduce_scatter(programs: dict) -> None:
    strategy, prog = programs["table9_32b_16h800_16h20"]
    assert strategy.zero1
    assert prog.comm_plans["layers.20.attn.wq.gather"].kinds == ["SplitAllGather"]
    assert prog.grad_sync_plans["layers.20.attn.wq.grad_sync"].kinds == ["SplitReduceScatter"]
    eg = prog.executable_graph(0)
    assert any(o.name == "layers.20.attn.wq.gather" and o.comm_kinds == ("SplitAllGather",) for o in eg.pre)


def test_tensor_parallel_comms_inside_a_stage(programs: dict) -> None:
    _, prog = programs["table11_c1"]
    eg = prog.executable_graph(5)
    kinds = {o.name: o.comm_kinds for o in eg.forward + eg.backward if o.is_comm}
    assert kinds["layers.20.attn.out"] == ("AllReduce",) and kinds["layers.20.mlp.out"] == ("AllReduce",)
    assert kinds["layers.20.attn_norm.grad_reduce"] == ("AllReduce",)   # Megatron's f in backward
    assert kinds["layers.20.in"] == ()                                   # inside the stage: Identity


def test_schedule_and_describe(programs: dict) -> None:
    strategy, prog = programs["table11_c2"]
    actions = prog.schedule(30)
    assert actions[0].kind == "PRE" and actions[-1].kind == "POST"
    assert sum(a.kind == "F" for a in actions) == strategy.pipelines[1].num_micro_batches
    whole = prog.describe()
    assert "pipeline 1 (31 micro-batches): [16-19] -> [20-23] -> [24-27] -> [28,29] -> [30]" in whole
    assert "SplitAllReduce" in whole
    one = prog.describe(28)
    assert "pipeline 1, stage 3" in one and "layers.48.in [BSR]" in one and "bytes sent per step" in one


def test_specialize_errors_name_the_tensor(model: LlamaConfig) -> None:
    strategy = Strategy.load(EXAMPLES / "table11_c1.json")
    plan = plan_from_strategy(model, strategy, Cluster.mixed({"H20": 32}))
    anns = dict(plan.annotations)
    del anns["layers.3.attn.wq"]
    with pytest.raises(SpecializationError, match=r"'layers.3.attn.wq' has no annotation"):
        specialize(model, anns, None)
    anns = dict(plan.annotations)
    anns["layers.3.mlp_norm.weight"] = Annotation("[4-7] D4 | [20-23] D4")  # on another stage, no Reshard
    with pytest.raises(SpecializationError, match=r"'layers.3.mlp_norm'.*'layers.3.attn.residual'.*"
                                                  r"'layers.3.mlp_norm.weight.gather'.*insert a Reshard"):
        specialize(model, anns, None)
    anns = dict(plan.annotations)
    anns["bogus"] = anns["tokens"]
    with pytest.raises(SpecializationError, match="bogus"):
        specialize(model, anns, None)


# ---- numerics: every rank's forward, communication by the CommPlans, equals the single-device model -------------
def simulate_forward(prog, feeds: dict, params: dict, bindings: dict):
    """Run every rank's executable forward graph in one process: kernels on local shards, Reshards by
    ``CommPlan.simulate``.  Returns the loss assembled from its (Partial) shards."""
    import torch

    from hspmd_sdk.core.annotation import local_view
    from hspmd_sdk.runtime.workers.kernels import KERNELS

    graph, anns = prog.graph, prog.annotations
    local: dict[int, dict[str, torch.Tensor]] = {r: {} for r in prog.plan.ranks}
    total_tokens = bindings["B"] * bindings["S"]
    for node in graph.nodes:
        out = node.outputs[0]
        if node.is_leaf:
            full = feeds[out] if node.kind == "placeholder" else params[out]
            for r in anns[out].ranks:
                local[r][out] = full[local_view(anns[out], tuple(full.shape), r).slices]
        elif node.is_reshard:
            src = node.inputs[0]
            plan = prog.concrete_plan(node.name, bindings)
            result = plan.simulate({r: local[r][src] for r in anns[src].ranks})
            for r in anns[out].ranks:
                local[r][out] = result[r] if r in result else local[r][src]
        else:
            for r in anns[out].ranks:
                attrs = node.attr
                if node.kind == "reshape":
                    attrs["shape"] = prog.local_shape(out, r, bindings)
                if node.kind == "cross_entropy":
                    attrs["total_count"] = total_tokens
                local[r][out] = KERNELS[node.kind](*(local[r][t] for t in node.inputs), **attrs)
    ann = anns["loss"]
    summands = {}
    for r in ann.ranks:
        v = local_view(ann, (), r)
        summands.setdefault(v.partial_index, local[r]["loss"])
    assert len(summands) == max(local_view(ann, (), r).partial_count for r in ann.ranks)
    return sum(summands.values())


@pytest.mark.parametrize("strategy_data", [
    "example_hetero_tiny.json",
    {"pipelines": [  # TP2 -> TP1 vs TP4 -> TP2 -> TP1, uneven micro-batching, ZeRO-1
        {"stages": [{"devices": [0, 1], "layers": [0, 1]}, {"devices": [2], "layers": [2, 3]}],
         "micro_batch_size": 3, "num_micro_batches": 1},
        {"stages": [{"devices": [3, 4, 5, 6], "layers": [0, 0]}, {"devices": [7, 8], "layers": [1, 2]},
                    {"devices": [9], "layers": [3, 3]}], "micro_batch_size": 1, "num_micro_batches": 1}],
     "zero1": True},
])
def test_simulated_distributed_forward_equals_the_reference(strategy_data) -> None:
    import torch

    from hspmd_sdk.models import build_reference, next_token_split

    config = LlamaConfig.preset("tiny")
    data = EXAMPLES / strategy_data if isinstance(strategy_data, str) else strategy_data
    strategy = Strategy.load(data)
    cluster = Cluster.local(max(strategy.ranks) + 1)
    prog = specialize(config, plan_from_strategy(config, strategy, cluster), cluster)
    assert prog.pipelines == [[sorted(s.devices) for s in p.stages] for p in strategy.pipelines]
    model = build_reference(config, seed=11)
    b = strategy.global_batch
    tokens, targets = next_token_split(torch.randint(0, config.vocab_size, (b, 17),
                                                     generator=torch.Generator().manual_seed(2)))
    params = {n: p.detach() for n, p in model.named_parameters()}
    loss = simulate_forward(prog, {"tokens": tokens, "targets": targets}, params, {"B": b, "S": 16})
    torch.testing.assert_close(loss, model.loss(tokens, targets).detach(), rtol=1e-5, atol=1e-6)


def _fixture_strategies() -> list[tuple[str, str, str]]:
    import json

    index = json.loads((EXAMPLES / "index.json").read_text())["strategies"]
    return [(f, info["model"], info["cluster"]) for f, info in index.items()]


@pytest.mark.parametrize("fname, model_name, cluster_file", _fixture_strategies())
def test_every_fixture_strategy_specializes_to_its_own_pipelines(fname: str, model_name: str,
                                                                  cluster_file: str) -> None:
    strategy = Strategy.load(EXAMPLES / fname)
    cluster = Cluster.load(EXAMPLES / cluster_file)
    model = LlamaConfig.preset(model_name)
    prog = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
    assert prog.pipelines == [[sorted(s.devices) for s in p.stages] for p in strategy.pipelines]
    sync = {k for p in prog.grad_sync_plans.values() for k in p.kinds}
    if len(strategy.pipelines) == 1:
        assert sync == {"Identity"}
    else:
        assert sync == ({"SplitReduceScatter"} if strategy.zero1 else {"SplitAllReduce"})


def test_a_parameter_used_through_an_op_is_synchronised_across_data_parallel_pipelines() -> None:
    """Found by mutation testing (stop 38): a parameter reaching a weight input through another op (V -> gelu ->
    dot's weight) got no gradient synchronisation across data-parallel pipelines; its gradient was read as laid
    out like V itself.  ``test_model_contract`` trains such a model against its reference."""
    g = GraphBuilder("through")
    x = g.placeholder("X", ("B", 4))
    v = ops.gelu(g.parameter("V", (4, 4)), name="Vg")
    ops.dot(ops.dot(x, g.parameter("W", (4, 4)), name="Y"), v, name="O")
    anns = {"X": Annotation("[0] R | [1] R ; hdim=0"), "W": Annotation("[0] R | [1] R"),
            "V": Annotation("[0] R | [1] R")}
    prog = specialize(g.build(), anns, Cluster.local(2))
    # each pipeline's gradient of W and of V covers its own half of the batch: both must be summed across them
    assert prog.grad_sync_plans["W.grad_sync"].kinds != ["Identity"]
    assert prog.grad_sync_plans["V.grad_sync"].kinds == prog.grad_sync_plans["W.grad_sync"].kinds
    # without data parallelism (one pipeline of both ranks, data duplicate) nothing is summed
    dup = {"X": Annotation("[0, 1] D2"), "W": Annotation("[0, 1] D2"), "V": Annotation("[0, 1] D2")}
    alone = specialize(g.build(), dup, Cluster.local(2))
    assert alone.grad_sync_plans["V.grad_sync"].kinds == alone.grad_sync_plans["W.grad_sync"].kinds == ["Identity"]


def test_a_parameter_reshaped_under_data_parallelism_is_passed_on_unless_a_dim_is_split() -> None:
    """V (2, 2) reshaped into a bias: its gradient is Partial across the pipelines.  A reshape's backward is linear,
    so while no plan splits V its gradient is Partial like the bias's (SplitAllReduce; before stop 56 this was
    refused).  Split by TP inside each pipeline (V's rows, the bias's halves) the reshape moves elements between
    the shards: the specializer names the op instead of guessing V's synchronisation."""
    def graph():
        g = GraphBuilder("reshaped")
        x = g.placeholder("X", ("B", 4))
        b = ops.reshape(g.parameter("V", (2, 2)), (4,), name="Vflat")
        ops.bias_add(ops.dot(x, g.parameter("W", (4, 4)), name="Y"), b, name="O")
        return g.build()

    anns = {"X": Annotation("[0] R | [1] R ; hdim=0"), "W": Annotation("[0] R | [1] R"),
            "V": Annotation("[0] R | [1] R")}
    assert specialize(graph(), anns, Cluster.local(2)).grad_sync_plans["V.grad_sync"].kinds == ["SplitAllReduce"]
    tp = {"X": Annotation("[0,1] D2 | [2,3] D2 ; hdim=0"), "W": Annotation("[0,1] S1x2 | [2,3] S1x2"),
          "V": Annotation("[0,1] S0x2 | [2,3] S0x2")}
    with pytest.raises(SpecializationError, match=r"'V' is read through op 'Vflat' \(reshape\)"):
        specialize(graph(), tp, Cluster.local(4))
