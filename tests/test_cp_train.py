"""Context parallelism in plans (SPEC §11) trained on worker processes against the single-device reference.

A stage with ``cp > 1`` splits the sequence dim of data and activations over its CP coordinate (a DS split of
dim 1, the slowest digit; TP the fastest), duplicates the parameters over it (their gradients are Partial there
and the gradient synchronisation sums them), and its attention runs context-parallel
(:mod:`hspmd_sdk.runtime.workers.cp_attention`: keys and values ring between the CP ranks); RoPE and learned positions
take each rank's global offset.  Checked here: the plan's annotations, and training (gloo, fp32, 2 steps) equal
to the single-device model — losses, every gradient of step 0, every parameter after the last step — with the
criteria of ``tests/test_hap_ratios.py``, for CP2, CP2 x TP2, and a CP2 pipeline (whose last stage has no CP)
beside a CP1 pipeline, for Llama and GPT-2 (ZeRO-1 too, under ``slow``).

A pipeline whose every attention is CP2 lays its sequences out in the balanced order (rank ``i`` of the CP group
holds global chunks ``i`` and ``3-i``: the executor reorders the data, positions and attention read global
positions); the pipeline whose last stage has no CP keeps the contiguous split.  The default suite trains one of
each (Llama contiguous, GPT-2 balanced: learned positions) and a CP3 pipeline (Llama, balanced over six chunks)
beside a one-rank pipeline, ``slow`` the rest.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from _equivalence import close_to_reference  # noqa: E402

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.annotation import Annotation, DS  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import PlanValidationError  # noqa: E402
from hspmd_sdk.models import param_shapes  # noqa: E402
from hspmd_sdk.runtime.workers.executor import sequence_balance  # noqa: E402
from hspmd_sdk.runtime.control.train import assemble, start_runs, load_captured, reference_training, training_run  # noqa: E402

STEPS, SEED, SEQ, LR, BATCH = 2, 1, 24, 1e-3, 8  # SEQ: whole chunks for CP2, CP3 and CP2 x 2
TOL, PARAM_TOL = 1e-5, 2e-5
FAMILIES = {"llama": LlamaConfig, "gpt": GPTConfig}


def _pipe(stages: list[tuple], mbs: int, n: int) -> dict:
    """``stages``: ``(devices, layers[, cp])`` each."""
    return {"stages": [{"devices": s[0], "layers": s[1], **({"cp": s[2]} if len(s) > 2 else {})} for s in stages],
            "micro_batch_size": mbs, "num_micro_batches": n}


#: name -> strategy (tiny presets: 4 layers); global batch 8 on 4 local ranks
RUNS = {
    "cp2": {"pipelines": [_pipe([([0, 1], [0, 3], 2)], 4, 2)]},
    "cp2xtp2": {"pipelines": [_pipe([([0, 1, 2, 3], [0, 3], 2)], 4, 2)]},
    # a CP2 first stage -> a CP1 last stage (BSR gathers the sequence), beside a one-rank CP1 pipeline
    "cp2_pipeline_beside_cp1": {"pipelines": [_pipe([([0, 1], [0, 1], 2), ([2], [2, 3])], 2, 2),
                                              _pipe([([3], [0, 3])], 2, 2)]},
    "cp2_dp2_zero1": {"pipelines": [_pipe([([0, 1], [0, 3], 2)], 2, 2), _pipe([([2, 3], [0, 3], 2)], 2, 2)],
                      "zero1": True},
    # an odd degree: six chunks of 4 tokens, rank i holding chunks i and 5 - i; beside a one-rank pipeline
    "cp3_beside_one": {"pipelines": [_pipe([([0, 1, 2], [0, 3], 3)], 4, 1), _pipe([([3], [0, 3])], 4, 1)]},
}
#: the runs of the default suite (one job); the others run with -m slow
DEFAULT = [("llama", "cp2_pipeline_beside_cp1"), ("gpt", "cp2xtp2"), ("llama", "cp3_beside_one")]
SLOW = [(f, n) for f in FAMILIES for n in RUNS if (f, n) not in DEFAULT]


# ---- the strategy and the plan ----------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_stage_cp_is_validated_and_named() -> None:
    s = Strategy.load(RUNS["cp2xtp2"])
    stage = s.pipelines[0].stages[0]
    assert (stage.cp, stage.tp_degree, stage.tp_groups) == (2, 2, [[0, 1], [2, 3]])
    assert s.name == "tp2-cp2" and "cp=2" in str(s)
    assert Strategy.load(s.to_json()) == s
    assert "cp" not in Strategy.load({"pipelines": [_pipe([([0, 1], [0, 3])], 4, 2)]}).to_json()  # JSON unchanged
    with pytest.raises(PlanValidationError, match=r"stages\[0\]\.cp: 2 context-parallel groups cannot share 3"):
        Strategy.load({"pipelines": [_pipe([([0, 1, 2], [0, 3], 2)], 4, 2)]})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cp_annotations_split_the_sequence_and_duplicate_parameters(family: str) -> None:
    model, cluster = FAMILIES[family].preset("tiny"), Cluster.local(4)
    plan = plan_from_strategy(model, Strategy.load(RUNS["cp2xtp2"]), cluster)
    a = plan.annotations
    assert a["tokens"] == Annotation([[0, 1, 2, 3]], [DS({1: 2, -1: 2}, [1, -1])], 0, [8])
    assert a["layers.0.in"] == a["tokens"]
    assert a["layers.0.attn.wq"] == Annotation([[0, 1, 2, 3]], [DS({-1: 2, 1: 2}, [-1, 1])])    # TP columns
    prog = specialize(model, plan, cluster, bindings={"B": 8, "S": SEQ})
    assert prog.pipelines == [[[0, 1, 2, 3]]]  # the CP x TP grid is one stage (the ring runs inside attention)
    # rank 2 = CP coordinate 1, TP coordinate 0: the second half of the sequence, the first half of the heads
    assert prog.local_shape("layers.0.attn.q_heads", 2, {"B": 8, "S": SEQ}) == (8, SEQ // 2, 2, 16)


@pytest.mark.timeout(60)
def test_uniform_cp_pipelines_lay_sequences_out_balanced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The balanced order where every attention of a pipeline is CP2, the contiguous split where a stage has no CP
    (or the environment asks for it)."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(4)

    def balance(name: str) -> list[int]:
        prog = specialize(model, plan_from_strategy(model, Strategy.load(RUNS[name]), cluster), cluster,
                          bindings={"B": 8, "S": SEQ})
        return [sequence_balance(prog, p) for p in range(len(prog.pipelines))]

    assert balance("cp2") == [2] and balance("cp2xtp2") == [2]  # a CP group: one stage
    assert balance("cp2_pipeline_beside_cp1") == [1, 1] and balance("cp3_beside_one") == [3, 1]
    for name, data in RUNS.items():  # the planner's view of the same rule (what the simulator prices)
        assert [p.cp_balance for p in Strategy.load(data).pipelines] == balance(name), name
    monkeypatch.setenv("HSPMD_CP_LAYOUT", "contiguous")
    assert balance("cp2xtp2") == [1]


# ---- training ----------------------------------------------------------------------------------------------------
def _train(tmp: "pytest.TempPathFactory", keys: list[tuple[str, str]]) -> dict:
    out = tmp.mktemp("cp")
    cluster = Cluster.local(4)
    common = {"steps": STEPS, "seed": SEED, "seq_len": SEQ, "lr": LR, "capture_dir": out, "cluster": cluster}
    runs = []
    for family, name in keys:
        config = FAMILIES[family].preset("tiny")
        program = specialize(config, plan_from_strategy(config, Strategy.load(RUNS[name]), cluster), cluster)
        runs.append(training_run(program, **common))
    result = start_runs(runs, cluster, timeout_s=300).wait()
    got = {}
    for i, (family, name) in enumerate(keys):
        shapes = param_shapes(FAMILIES[family].preset("tiny"))
        captured = load_captured(out, i)
        grads, grad_spread = assemble(captured, "grads", shapes)
        params, param_spread = assemble(captured, "params", shapes)
        got[family, name] = {"losses": result.results[0]["runs"][i]["losses"], "grads": grads, "params": params,
                             "spread": max(grad_spread, param_spread)}
    return got


@pytest.fixture(scope="module")
def references() -> dict:
    out = {}
    for family, cls in FAMILIES.items():
        config = cls.preset("tiny")
        ref = reference_training(config, steps=STEPS, seed=SEED, global_batch=BATCH, seq_len=SEQ, lr=LR)
        ref.initial = dict(config.build_reference(SEED).state_dict())
        out[family] = ref
    return out


def _close_to_reference(run: dict, reference, *, grads: bool = True) -> None:
    close_to_reference(run, reference, steps=STEPS, lr=LR, tol=TOL, param_tol=PARAM_TOL, grads=grads)


@pytest.fixture(scope="module")
def trained_default(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _train(tmp_path_factory, DEFAULT)


@pytest.fixture(scope="module")
def trained_slow(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _train(tmp_path_factory, SLOW)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,name", DEFAULT)
def test_cp_training_equals_the_single_device_reference(family: str, name: str, trained_default: dict,
                                                        references: dict) -> None:
    _close_to_reference(trained_default[family, name], references[family])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,name", SLOW)
def test_cp_training_equals_the_single_device_reference_slow(family: str, name: str, trained_slow: dict,
                                                             references: dict) -> None:
    _close_to_reference(trained_slow[family, name], references[family])


@pytest.mark.timeout(60)
def test_the_simulator_prices_a_cp_stage() -> None:
    """The simulator prices context parallelism (it refused CP stages before): per rank, a CP2 stage keeps the
    activations of half the tokens of a one-rank stage (hand figures in tests/test_simulator.py)."""
    from hspmd_sdk.planner import simulate

    def strategy(devices: list[int], cp: int) -> dict:
        return {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 2,
                               "stages": [{"devices": devices, "layers": [0, 3], "cp": cp}]}]}

    cp2 = simulate("tiny", strategy([0, 1], 2), Cluster.local(2), seq_len=1024)
    one = simulate("tiny", strategy([0], 1), Cluster.local(1), seq_len=1024)
    assert cp2.step_time > 0 and cp2.memory[0]["activations"] == pytest.approx(one.memory[0]["activations"] / 2)


@pytest.mark.timeout(60)
def test_the_planner_prices_the_balanced_layout_of_uniform_cp_pipelines() -> None:
    """A pipeline of CP2 stages runs the balanced order (``Pipeline.cp_balance``), so the simulator and the
    mixed-length pricer charge each rank the balanced share of causal attention, less than the contiguous
    split's last rank at a long sequence."""
    from hspmd_sdk.models.registry import load_model_spec
    from hspmd_sdk.planner.cost import CostModel
    from hspmd_sdk.planner.mixed_cost import PipelineCost
    from hspmd_sdk.planner.simulator import _stage_cost

    model, cluster, cost = load_model_spec("tiny"), Cluster.local(4), CostModel()
    uniform = Strategy.load(RUNS["cp2"]).pipelines[0]
    mixed = Strategy.load(RUNS["cp2_pipeline_beside_cp1"]).pipelines[0]
    assert (uniform.cp_balance, mixed.cp_balance) == (2, 1)
    stage = uniform.stages[0]
    bal, contig = (_stage_cost(model, stage, True, True, cluster, 1, 8192, cost, balanced=b) for b in (True, False))
    assert bal.fwd < contig.fwd and bal.bwd < contig.bwd
    assert PipelineCost.of(model, uniform, cluster, cost).stages[0].times(1, 8192) == \
        pytest.approx((bal.fwd, bal.bwd))
