"""The model contract (SPEC §4): any model through one ModelSpec — the two families and a user's own model with a
custom op — and the checks that used to be missing (issue 11, item 6)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.model_spec import ModelSpec  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy, zero_shard  # noqa: E402
from hspmd_sdk.errors import PlanValidationError, ShapeError  # noqa: E402
from hspmd_sdk.models import build_reference, load_model_spec, model_from_json  # noqa: E402
from hspmd_sdk.models.registry import class_path  # noqa: E402
from hspmd_sdk.runtime.workers.kernels import run_graph  # noqa: E402

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import user_model  # noqa: E402
from _equivalence import captured_close_to_reference  # noqa: E402

MODELS = {"llama": LlamaConfig.preset("tiny"), "gpt": GPTConfig.preset("tiny"), "user": user_model.MLPLM()}


def _pipe(stages, mbs, n):
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": mbs,
            "num_micro_batches": n}


@pytest.mark.parametrize("key", [*MODELS, "fused"])
def test_the_defined_graph_is_the_reference_model(key: str) -> None:
    """Executed op by op with the SDK's kernels, the graph gives the reference's loss and gradients."""
    model = user_model.FusedMLPLM() if key == "fused" else MODELS[key]
    assert isinstance(model, ModelSpec)
    ref = build_reference(model, 4)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    params = {n: p.detach().clone().requires_grad_(True) for n, p in ref.named_parameters()}
    assert set(params) == set(model.param_shapes())
    seq = torch.randint(0, model.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    feeds = model.feeds(seq)
    loss = run_graph(model.build_graph(), feeds, params)[model.build_graph().loss]
    want = ref.loss(feeds["tokens"], feeds["targets"])
    assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item())
    loss.backward()
    want.backward()
    for n, p in ref.named_parameters():
        scale = max(float(p.grad.abs().max()), 1e-8)
        assert float((params[n].grad - p.grad).abs().max()) <= 1e-5 * scale, n


@pytest.mark.parametrize("key", list(MODELS))
def test_placements_cover_every_leaf_and_put_layers_on_their_stages(key: str) -> None:
    model = MODELS[key]
    graph = model.build_graph()
    table = {p.tensor: p for p in model.placements()}
    for leaf in graph.leaves:
        assert leaf.outputs[0] in table, leaf.outputs[0]
    for name, p in table.items():
        if name.startswith("layers."):
            assert p.where == int(name.split(".")[1]), name
    assert table["tokens"].kind == "data" and table["tokens"].where == "first"
    assert table["targets"].where == "last"
    if key == "gpt":  # the tied embedding: a parameter placed first, its LM-head use placed last
        assert (table["wte.weight"].where, table["wte.weight.head"].where) == ("first", "last")
        assert table["wte.weight.head"].kind == "parameter" and table["head.in"].tp_split == 2


def test_presets_json_and_class_paths() -> None:
    assert load_model_spec("tiny") == LlamaConfig.preset("tiny")          # unqualified: Llama first
    assert load_model_spec("gpt:tiny") == GPTConfig.preset("tiny")
    assert load_model_spec("gpt2").param_count() == 124_439_808          # Hugging Face's GPT-2 (tied)
    for model in MODELS.values():
        data = json.loads(json.dumps(model.model_dump(mode="json")))
        if model.family in ("llama", "gpt"):
            assert model_from_json(data) == model
    assert model_from_json({k: v for k, v in LlamaConfig.preset("tiny").model_dump().items() if k != "family"}) \
        == LlamaConfig.preset("tiny")                                     # configs from before families
    with pytest.raises(PlanValidationError, match="unknown model preset 'gpt3'.*gpt:gpt2"):
        load_model_spec("gpt3")
    with pytest.raises(PlanValidationError, match="unknown model family 'mamba'"):
        model_from_json({"family": "mamba"})
    assert class_path(MODELS["user"]) == "user_model:MLPLM"

    class Local(user_model.MLPLM):
        pass
    with pytest.raises(PlanValidationError, match="worker processes cannot import it"):
        class_path(Local())


def test_a_users_model_with_its_own_op_trains_like_its_reference(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """A heterogeneous plan (a TP2 -> TP1 pipeline beside a one-rank pipeline) of the user's model, on real
    worker processes that import the model's module (and with it the custom op and kernel)."""
    from hspmd_sdk.runtime.control.train import launch, reference_training

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    model = MODELS["user"]
    cluster = Cluster.local(4)
    strategy = Strategy.load({"pipelines": [_pipe([([0, 1], [0, 1]), ([2], [2, 3])], 2, 3),
                                            _pipe([([3], [0, 3])], 2, 1)]})
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
    assert program.comm_plans["layers.2.in"].kinds == ["BSR"]
    result = launch(program, cluster, steps=3, seq_len=16, seed=2, capture_dir=tmp_path).wait()
    ref = reference_training(model, steps=3, seed=2, global_batch=8, seq_len=16)
    captured_close_to_reference(tmp_path, result.losses, model, ref, seed=2, steps=3, lr=1e-3)


def test_a_parameter_read_through_an_op_trains_like_the_reference_across_data_parallel_pipelines(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each layer's ``proj`` reads ``gelu(w2)``: every pipeline's gradient of ``w2`` covers its own part of the
    batch and must be summed across the pipelines (a TP2 pipeline beside a one-rank one).  Before stop 39 it was
    not (found by mutation testing): from the second step the pipelines held different ``w2``.  Checking the
    gradients found a second bug: the TP2 stage's LM head reads a Reshard's output (``head.in``) through a
    column-split weight, and the executor skipped the gradient reduction (Megatron's f) of a Reshard's output,
    which halved every gradient below the head."""
    from hspmd_sdk.runtime.control.train import launch, reference_training

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    model = user_model.ReparamMLPLM()
    cluster = Cluster.local(3)
    strategy = Strategy.load({"pipelines": [_pipe([([0, 1], [0, 3])], 2, 2), _pipe([([2], [0, 3])], 2, 2)]})
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
    assert program.grad_sync_plans["layers.0.w2.grad_sync"].kinds != ["Identity"]
    result = launch(program, cluster, steps=3, seq_len=16, seed=2, capture_dir=tmp_path).wait()
    ref = reference_training(model, steps=3, seed=2, global_batch=8, seq_len=16)
    # unsynchronised, w2 differed by 6e-3
    captured_close_to_reference(tmp_path, result.losses, model, ref, seed=2, steps=3, lr=1e-3)


def test_a_fused_weight_split_in_the_graph_trains_like_the_reference_across_data_parallel_pipelines(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each layer's ``w1 = [a | b]`` is split in the graph, each half a Dot's weight (a fused gate/up weight).  The
    pipelines' gradients of ``w1`` cover their own parts of the batch and must be summed: before stop 56 a
    parameter read through an op with several outputs kept an Identity synchronisation, and from the second step
    the pipelines held different ``w1`` (a two-stage pipeline beside a one-rank one, uneven micro-batches)."""
    from hspmd_sdk.runtime.control.train import launch, reference_training

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    model = user_model.FusedMLPLM()
    cluster = Cluster.local(3)
    strategy = Strategy.load({"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 2, 3),
                                            _pipe([([2], [0, 3])], 2, 1)]})
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
    assert {program.grad_sync_plans[f"layers.{i}.w1.grad_sync"].kinds[0] for i in range(4)} == {"SplitAllReduce"}
    result = launch(program, cluster, steps=3, seq_len=16, seed=2, capture_dir=tmp_path).wait()
    ref = reference_training(model, steps=3, seed=2, global_batch=8, seq_len=16)
    captured_close_to_reference(tmp_path, result.losses, model, ref, seed=2, steps=3, lr=1e-3)


# ---- issue 11, item 6 ----------------------------------------------------------------------------------------------
def test_a_tp_degree_that_does_not_divide_the_vocabulary_fails_validation_at_the_stage() -> None:
    model = LlamaConfig(name="v", vocab_size=250, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=128)
    strategy = Strategy.load({"pipelines": [_pipe([([0, 1, 2, 3], [0, 1])], 1, 1)]})
    with pytest.raises(PlanValidationError, match=r"pipelines\[0\]\.stages\[0\]\.devices: TP degree 4 does not "
                                                  r"divide vocab_size=250"):
        strategy.check(model=model)


@pytest.mark.parametrize("key", ["llama", "gpt"])
def test_zero1_over_three_pipelines_shards_every_parameter_unevenly_where_it_must(key: str) -> None:
    model = MODELS[key]
    cluster = Cluster.local(3)
    strategy = Strategy.load({"pipelines": [_pipe([([r], [0, 3])], 1, 1) for r in range(3)], "zero1": True})
    plan = plan_from_strategy(model, strategy, cluster)
    assert not plan.settings.zero1_replicated
    for name in model.param_shapes():
        ann = plan.annotations[name]
        assert ann.hsize == 3 and ann.hdim >= 0, (name, ann)
    # 64 rows over 3 pipelines: 22 / 21 / 21 (HAP-style hratios); a dim 3 divides stays even
    assert zero_shard((64, 64), None, [[0], [1], [2]]) == (0, [22, 21, 21])
    assert zero_shard((64, 96), None, [[0], [1], [2]]) == (1, None)
    assert zero_shard((2,), None, [[0], [1], [2]]) is None
    program = specialize(model, plan, cluster)
    assert {k for p in program.grad_sync_plans.values() for k in p.kinds} <= {"SplitReduceScatter", "BSR",
                                                                              "SplitAllReduce"}


def test_a_global_batch_that_contradicts_the_micro_batches_fails_at_specialize() -> None:
    model, cluster = MODELS["llama"], Cluster.local(2)
    strategy = Strategy.load({"pipelines": [_pipe([([0], [0, 3])], 2, 2), _pipe([([1], [0, 3])], 2, 2)]})
    plan = plan_from_strategy(model, strategy, cluster)
    with pytest.raises(ShapeError, match=r"bindings: B=6 but the plan's micro-batches add up to 8 samples"):
        specialize(model, plan, cluster, bindings={"B": 6, "S": 64})
    assert specialize(model, plan, cluster, bindings={"B": 8, "S": 16}).bindings["B"] == 8


def test_optimizer_options_and_recompute_ranks_are_checked_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import hspmd_sdk.runtime.control.start as launcher  # where every worker start goes (launch_spec)
    from hspmd_sdk import launch

    started: list = []
    monkeypatch.setattr(launcher, "launch_spec", lambda spec, *a, **k: started.append(spec) or (_ for _ in ()).throw(
        RuntimeError("a worker would have started")))
    model, cluster = MODELS["gpt"], Cluster.local(2)
    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1], "recompute": True},
                                                        {"devices": [1], "layers": [2, 3]}],
                                             "micro_batch_size": 2, "num_micro_batches": 2}]})
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
    bad = [({"lr": -1.0}, "lr: must be a finite number > 0"), ({"lr": float("nan")}, "lr: must be a finite number"),
           ({"betas": (1.5, 0.999)}, r"betas: must be two finite numbers in \[0, 1\)"),
           ({"eps": 0.0}, "eps: must be a finite number > 0"),
           ({"weight_decay": -0.1}, "weight_decay: must be a finite number >= 0"),
           ({"recompute": [7]}, r"recompute: ranks \[7\]")]
    for options, message in bad:
        with pytest.raises(PlanValidationError, match=message):
            launch(program, cluster, steps=1, **options)
    assert started == []
    # Stage.recompute reaches the workers on the Python path (no recompute= given)
    assert program.recompute == {0}
    with pytest.raises(RuntimeError, match="a worker would have started"):
        launch(program, cluster, steps=1)
    assert started[0].payload["runs"][0]["recompute"] == [0]
