"""Uneven TP sharding ratios (HAP inside HSPMD; SPEC §12) against the single-device reference.

A stage with ``ratios`` splits every TP-split tensor in those proportions through the annotations' HDim ratios
(the TP ranks form the top tier; see :mod:`hspmd_sdk.core.strategy_plan`).  Checked here:

* the strategy: validation of ``ratios`` naming the field; ratios that would cut a head (or a GQA KV head) are
  refused naming the tensor and the nearest feasible ratios; uneven pipelines beside pipelines that split the
  same layer differently are refused (the two-tier annotation cannot express them);
* the plan: an even strategy's plan is unchanged by the feature; an uneven stage's annotations, local shapes
  (3 of 4 heads on one rank, 1 on the other) and communication kinds;
* training on worker processes (gloo, fp32) for both families: TP2 3:1, TP3 2:1:1, a pipeline whose first
  stage is uneven, and two uneven pipelines with ZeRO-1 — losses, every gradient of step 0 and every parameter
  after 3 steps equal the single-device model (tolerances of tests/test_runtime_train.py), and each rank holds
  exactly its share of the parameters;
* a checkpoint written under an even plan resumes under an uneven one; a running job switches even -> uneven ->
  even (Llama; GPT-2's under ``slow``).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from _equivalence import close_to_reference  # noqa: E402
from test_switching import switch_at_holds  # noqa: E402

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.annotation import Annotation  # noqa: E402
from hspmd_sdk.core.strategy import Stage  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.core.tp_ratios import feasible_ratios  # noqa: E402
from hspmd_sdk.errors import PlanValidationError  # noqa: E402
from hspmd_sdk.models import param_shapes  # noqa: E402
from hspmd_sdk.runtime.control.train import (assemble, start_runs, load_captured, reference_training,  # noqa: E402
                                     training_run)

STEPS, SEED, SEQ, LR = 3, 1, 16, 1e-3
TOL, PARAM_TOL = 1e-5, 2e-5
#: the parameter bounds below were measured on synthetic tokens: on real text Adam's first steps move a few
#: near-zero-gradient elements by 3.6e-4 of their matrix's largest (fp32 summation order), over the 3e-4 bound.
#: These tests are about plans giving the single device's numbers, so they name their data.
DATA = "synthetic"
FAMILIES = {"llama": LlamaConfig, "gpt": GPTConfig}


def _pipe(stages: list[tuple], mbs: int, n: int) -> dict:
    """``stages``: ``(devices, layers[, ratios])`` each."""
    return {"stages": [{"devices": s[0], "layers": s[1], **({"ratios": s[2]} if len(s) > 2 else {})}
                       for s in stages], "micro_batch_size": mbs, "num_micro_batches": n}


#: name -> strategy; every one trains global batch 8 on 4 local ranks (ranks a run does not use sit it out)
RUNS = {
    "tp2_3to1": {"pipelines": [_pipe([([0, 1], [0, 3], [3, 1])], 4, 2)]},
    "tp3_2to1to1": {"pipelines": [_pipe([([0, 1, 2], [0, 3], [2, 1, 1])], 4, 2)]},
    # an uneven first stage (3:1) -> an even TP1 last stage: BSR at the boundary, the LM head on rank 2
    "pp2_uneven_first": {"pipelines": [_pipe([([0, 1], [0, 1], [3, 1]), ([2], [2, 3])], 2, 4)]},
    # two pipelines with the same uneven stage (subgroup k = the k-th TP rank of both), ZeRO-1 inside
    "dp2_uneven_zero1": {"pipelines": [_pipe([([0, 1], [0, 3], [3, 1])], 2, 2),
                                       _pipe([([3, 2], [0, 3], [3, 1])], 2, 2)], "zero1": True},
}

#: Megatron TP split dim of each parameter (None: whole on every TP rank), as in tests/test_runtime_train.py
_TP_DIM = {
    "llama": {"attn_norm.weight": None, "attn.wq": 1, "attn.wk": 1, "attn.wv": 1, "attn.wo": 0,
              "mlp_norm.weight": None, "mlp.w1": 1, "mlp.w3": 1, "mlp.w2": 0,
              "embed.weight": 1, "final_norm.weight": None, "lm_head.weight": 1},
    "gpt": {"ln_1.weight": None, "ln_1.bias": None, "ln_2.weight": None, "ln_2.bias": None, "attn.wq": 1,
            "attn.bq": 0, "attn.wk": 1, "attn.bk": 0, "attn.wv": 1, "attn.bv": 0, "attn.wo": 0, "attn.bo": None,
            "mlp.w_fc": 1, "mlp.b_fc": 0, "mlp.w_proj": 0, "mlp.b_proj": None, "wte.weight": 1, "wpe.weight": 1,
            "ln_f.weight": None, "ln_f.bias": None},
}
_ENDS = {"llama": (["embed.weight"], ["final_norm.weight", "lm_head.weight"]),
         "gpt": (["wte.weight", "wpe.weight"], ["ln_f.weight", "ln_f.bias"])}


def _expected_param_bytes(data: dict, config, rank: int) -> int | None:
    """fp32 bytes ``rank`` should hold, from the strategy and the shapes alone: its stage's parameters, a TP-split
    one's split dim cut to ``size * ratio / sum(ratios)`` for the rank's ratio.  ``None``: in no stage.  (ZeRO-1
    runs are checked as a partition instead.)"""
    strategy = Strategy.load(data)
    shapes = param_shapes(config)
    tp_dim, (head, tail) = _TP_DIM[config.family], _ENDS[config.family]
    for pipe in strategy.pipelines:
        for k, stage in enumerate(pipe.stages):
            if rank not in stage.devices:
                continue
            ratios = stage.ratios or [1] * len(stage.devices)
            mine, total = ratios[stage.devices.index(rank)], sum(ratios)
            first, last = stage.layers
            names = [n for n in shapes if n.startswith("layers.") and first <= int(n.split(".")[1]) <= last]
            names += head * (k == 0) + tail * (k == len(pipe.stages) - 1)
            out = 0
            for n in names:
                dim = tp_dim[n.split(".", 2)[2] if n.startswith("layers.") else n]
                numel = math.prod(shapes[n])
                if dim is not None:
                    assert shapes[n][dim] * mine % total == 0, n
                    numel = numel // shapes[n][dim] * (shapes[n][dim] * mine // total)
                out += numel
            return 4 * out
    return None


# ---- the strategy ------------------------------------------------------------------------------------------------
def test_ratios_are_validated_naming_the_field() -> None:
    assert Stage(devices=[0, 1], layers=[0, 3], ratios=[6, 2]).tp_ratios == (3, 1)
    assert Stage(devices=[0, 1], layers=[0, 3], ratios=[2, 2]).tp_ratios is None       # all equal: even
    assert not Stage(devices=[0, 1], layers=[0, 3]).is_uneven
    for ratios, needle in (([3], "1 ratio(s) [3] for 2 device(s)"), ([3, 0], "0 in [3, 0] is not a positive"),
                           ([3, -1], "-1 in [3, -1]"), ([True, 1], "expected an integer")):
        with pytest.raises(PlanValidationError) as e:
            Strategy.load({"pipelines": [_pipe([([0, 1], [0, 3], ratios)], 4, 2)]})
        assert "pipelines[0].stages[0].ratios" in str(e.value) and needle in str(e.value), str(e.value)
    s = Strategy.load(RUNS["tp2_3to1"])
    assert s.name == "tp2-ratios3:1" and "ratios=3:1" in str(s)
    assert Strategy.load(s.to_json()) == s                               # JSON round trip
    assert "ratios 3:1" in s.summary(LlamaConfig.preset("tiny"))
    mem = s.memory_estimate(LlamaConfig.preset("tiny"))
    assert mem[0] > 2.5 * mem[1]                                         # 3/4 of the sharded states


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ratios_that_cut_a_head_are_refused_with_the_nearest_feasible_ones(family: str) -> None:
    model = FAMILIES[family].preset("tiny")                              # 4 heads
    with pytest.raises(PlanValidationError) as e:
        Strategy.load({"pipelines": [_pipe([([0, 1], [0, 3], [5, 3])], 4, 2)]}, model=model)
    msg = str(e.value)
    assert "pipelines[0].stages[0].ratios" in msg and "'layers.0.attn.q_heads' dim 2 of size 4" in msg, msg
    assert "2.5 : 1.5" in msg and "nearest feasible ratios: 3:1" in msg, msg
    with pytest.raises(PlanValidationError, match="nearest feasible ratios: 2:1:1"):  # 4 heads over TP3
        Strategy.load({"pipelines": [_pipe([([0, 1, 2], [0, 3], [3, 2, 2])], 4, 2)]}, model=model)


def test_gqa_kv_heads_must_split_whole() -> None:
    # 8 query heads, 2 KV heads: 3:1 gives 6:2 query heads but 1.5:0.5 KV heads
    model = LlamaConfig(name="gqa", vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2,
                        ffn_hidden_size=128, max_seq_len=64)
    with pytest.raises(PlanValidationError) as e:
        Strategy.load({"pipelines": [_pipe([([0, 1], [0, 1], [3, 1])], 4, 2)]}, model=model)
    assert "'layers.0.attn.k_heads' dim 2 of size 2" in str(e.value) and "nearest feasible ratios: 1:1" in str(e.value)
    model4 = LlamaConfig(name="gqa4", vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                         ffn_hidden_size=128, max_seq_len=64)
    Strategy.load({"pipelines": [_pipe([([0, 1], [0, 1], [3, 1])], 4, 2)]}, model=model4)   # 3:1 KV heads


def test_feasible_ratios() -> None:
    assert feasible_ratios([3, 1], 4) == [3, 1]
    assert feasible_ratios([5, 3], 4) == [3, 1]
    assert feasible_ratios([2, 1], 4) == [3, 1]
    assert feasible_ratios([2, 1], 6) == [2, 1]
    assert feasible_ratios([1, 1, 1], 2) is None


def test_uneven_pipelines_the_annotation_cannot_express_are_refused() -> None:
    beside_even = {"pipelines": [_pipe([([0, 1], [0, 3], [3, 1])], 2, 2), _pipe([([2, 3], [0, 3])], 2, 2)]}
    with pytest.raises(PlanValidationError) as e:
        Strategy.load(beside_even)
    msg = str(e.value)
    assert "pipelines[0].stages[0].ratios" in msg and "TP2 ratios 3:1" in msg and "TP2 even" in msg, msg
    other_ratios = {"pipelines": [_pipe([([0, 1], [0, 3], [3, 1])], 2, 2), _pipe([([2, 3], [0, 3], [1, 3])], 2, 2)]}
    with pytest.raises(PlanValidationError, match="cannot be expressed by one two-tier annotation"):
        Strategy.load(other_ratios)
    unequal_batch = {"pipelines": [_pipe([([0, 1], [0, 3], [3, 1])], 2, 3), _pipe([([2, 3], [0, 3], [3, 1])], 2, 1)]}
    with pytest.raises(PlanValidationError, match=r"pipelines\[1\]: 1 x bs2 beside pipelines\[0\]'s 3 x bs2"):
        Strategy.load(unequal_batch)


# ---- the plan ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_even_strategy_plans_exactly_as_before(family: str) -> None:
    """``ratios`` all equal (or absent) is the even plan, annotation for annotation, with the even layouts."""
    model = FAMILIES[family].preset("tiny")
    cluster = Cluster.local(4)
    for data in ({"pipelines": [_pipe([([0, 1], [0, 1]), ([2], [2, 3])], 2, 4)]},
                 {"pipelines": [_pipe([([0, 1], [0, 3])], 2, 2), _pipe([([2, 3], [0, 3])], 2, 2)], "zero1": True}):
        even = plan_from_strategy(model, Strategy.load(data), cluster)
        equal = {**data, "pipelines": [{**p, "stages": [{**s, "ratios": [2] * len(s["devices"])}
                                                        for s in p["stages"]]} for p in data["pipelines"]]}
        again = plan_from_strategy(model, Strategy.load(equal), cluster)
        assert again.annotations == even.annotations
        wq = even.annotations["layers.0.attn.wq"]
        assert all(len(g) in (1, 2) for g in wq.dg_union) and wq.hratios is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_uneven_stage_puts_its_tp_ranks_in_the_top_tier(family: str) -> None:
    model = FAMILIES[family].preset("tiny")
    cluster = Cluster.local(4)
    plan = plan_from_strategy(model, Strategy.load(RUNS["tp2_3to1"]), cluster)
    assert plan.annotations["layers.0.attn.wq"] == Annotation("[0] R | [1] R ; hdim=1 ratios=3:1")
    assert plan.annotations["layers.0.attn.wo"] == Annotation("[0] R | [1] R ; hdim=0 ratios=3:1")
    assert plan.annotations["layers.0.in"] == Annotation("[0] R | [1] R")
    prog = specialize(model, plan, cluster, bindings={"B": 8, "S": SEQ})
    assert prog.local_shape("layers.0.attn.q_heads", 0, {"B": 8, "S": SEQ})[2] == 3   # 3 of 4 heads
    assert prog.local_shape("layers.0.attn.q_heads", 1, {"B": 8, "S": SEQ})[2] == 1
    assert prog.comm_plans["layers.0.attn.out"].kinds == ["SplitAllReduce"]    # uneven row-parallel: summands
    # two uneven pipelines: subgroup k = the k-th TP rank of each; the batch split evenly inside; ZeRO-1 there too
    plan = plan_from_strategy(model, Strategy.load(RUNS["dp2_uneven_zero1"]), cluster)
    assert plan.annotations["layers.0.in"] == Annotation("[0,3] S0x2 | [1,2] S0x2")
    wq = plan.annotations["layers.0.attn.wq"]
    assert wq.dg_union == [[0, 3], [1, 2]] and wq.hdim == 1 and wq.hratios == [3, 1]
    assert {tuple(ds.states.items()) for ds in wq.ds_union} == {((0, 2),)}     # ZeRO-1: rows over the pipelines
    prog = specialize(model, plan, cluster, bindings={"B": 8, "S": SEQ})
    assert prog.comm_plans["layers.0.attn.wq.gather"].kinds == ["AllGather"]
    assert prog.grad_sync_plans["layers.0.attn.wq.grad_sync"].kinds == ["ReduceScatter"]


# ---- training ----------------------------------------------------------------------------------------------------
#: the checkpoint pair: an even TP2 run saves after every step; an uneven run resumes from its step-1 checkpoint
EVEN_TP2 = {"pipelines": [_pipe([([0, 1], [0, 3])], 4, 2)]}
RESUME_STEP = 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every (family, run) of :data:`RUNS` and both checkpoint pairs, in one job of 4 local ranks (one start-up)."""
    out = tmp_path_factory.mktemp("hap")
    cluster = Cluster.local(4)
    common = {"steps": STEPS, "seed": SEED, "seq_len": SEQ, "lr": LR, "capture_dir": out, "cluster": cluster,
              "data": DATA}
    keys, runs, programs = [], [], {}
    for family, cls in FAMILIES.items():
        config = cls.preset("tiny")
        for name, data in RUNS.items():
            programs[family, name] = specialize(config, plan_from_strategy(config, Strategy.load(data), cluster),
                                                cluster)
            keys.append((family, name))
            runs.append(training_run(programs[family, name], **common))
    for family, cls in FAMILIES.items():
        config = cls.preset("tiny")
        even = specialize(config, plan_from_strategy(config, Strategy.load(EVEN_TP2), cluster), cluster)
        keys.append((family, "saved_even"))
        runs.append(training_run(even, **common, checkpoint_dir=out / f"ckpt_{family}", checkpoint_every=1,
                                 checkpoint_async=False))
    results = [start_runs(runs, cluster, timeout_s=300).wait()]
    # a second job (a run checks its checkpoint exists when it is built): resume under the uneven plan
    resumed = []
    for family in FAMILIES:
        keys.append((family, "resumed_uneven"))
        programs[family, "resumed_uneven"] = programs[family, "tp2_3to1"]
        resumed.append(training_run(programs[family, "tp2_3to1"], **{**common, "capture_dir": out / "resumed"},
                                    resume_from=out / f"ckpt_{family}" / f"step-{RESUME_STEP:08d}"))
    results.append(start_runs(resumed, cluster, timeout_s=300).wait())
    got = {}
    for i, key in enumerate(keys):
        job, index = (0, i) if i < len(runs) else (1, i - len(runs))
        shapes = param_shapes(FAMILIES[key[0]].preset("tiny"))
        captured = load_captured(out if job == 0 else out / "resumed", index)
        grads, grad_spread = assemble(captured, "grads", shapes)
        params, param_spread = assemble(captured, "params", shapes)
        got[key] = {"program": programs.get(key), "losses": results[job].results[0]["runs"][index]["losses"],
                    "ranks": {r: res["runs"][index] for r, res in results[job].results.items()}, "grads": grads,
                    "params": params, "spread": max(grad_spread, param_spread)}
    return got


@pytest.fixture(scope="module")
def references() -> dict:
    out = {}
    for family, cls in FAMILIES.items():
        config = cls.preset("tiny")
        ref = reference_training(config, steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR, data=DATA)
        ref.initial = dict(config.build_reference(SEED).state_dict())
        out[family] = ref
    return out


def _close_to_reference(run: dict, reference, *, grads: bool = True) -> None:
    close_to_reference(run, reference, steps=STEPS, lr=LR, tol=TOL, param_tol=PARAM_TOL, grads=grads)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", list(RUNS))
def test_uneven_training_equals_the_single_device_reference(family: str, name: str, trained: dict,
                                                             references: dict) -> None:
    _close_to_reference(trained[family, name], references[family])


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", list(RUNS))
def test_each_rank_holds_exactly_its_share(family: str, name: str, trained: dict) -> None:
    run, config = trained[family, name], FAMILIES[family].preset("tiny")
    strategy = Strategy.load(RUNS[name])
    zero = strategy.dp_degree if strategy.zero1 else 1     # ZeRO-1 halves every shard (the tiny dims are even)
    if strategy.zero1:
        assert not run["program"].plan.settings.zero1_replicated
    for rank, res in run["ranks"].items():
        expected = _expected_param_bytes(RUNS[name], config, rank)
        assert res["active"] == (expected is not None), rank
        if res["active"]:
            assert res["param_bytes"] == res["shard_bytes"] == expected // zero, (rank, res["param_bytes"], expected)
            assert res["optimizer_bytes"] == 2 * res["param_bytes"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_checkpoint_saved_under_an_even_plan_resumes_under_an_uneven_one(family: str, trained: dict,
                                                                          references: dict) -> None:
    saved, resumed, ref = trained[family, "saved_even"], trained[family, "resumed_uneven"], references[family]
    assert saved["losses"] == pytest.approx(ref.losses, rel=TOL)
    assert len(resumed["losses"]) == STEPS - RESUME_STEP
    assert resumed["losses"] == pytest.approx(ref.losses[RESUME_STEP:], rel=TOL)
    for rank in (0, 1):   # each rank reads back only its uneven share
        assert resumed["ranks"][rank]["param_bytes"] == \
            _expected_param_bytes(RUNS["tp2_3to1"], FAMILIES[family].preset("tiny"), rank)
    # the resumed run's final parameters are the reference's (and the even run's) after all the steps
    _close_to_reference({**resumed, "losses": ref.losses, "grads": None}, ref, grads=False)


# ---- graph switching -----------------------------------------------------------------------------------------------
#: even TP2 -> uneven TP2 3:1 on the same ranks -> two uneven pipelines with ZeRO-1 -> even TP2 again
SWITCH_TOUR = [EVEN_TP2, RUNS["tp2_3to1"], RUNS["dp2_uneven_zero1"], EVEN_TP2]
STATE_TOL = 5e-5


def _state_err(run_dir: Path, model, ref) -> dict[str, float]:
    """Largest norm-relative difference of the final parameters and of each Adam moment (as
    tests/test_switching.py: GPT-2's gradient-free key bias and zero-initialised biases measured apart)."""
    captured = load_captured(run_dir)
    largest = max(float(g.abs().max()) for g in ref.grads.values())
    noise = {n for n, g in ref.grads.items() if float(g.abs().max()) < 1e-7 * largest}
    zero = {n for n, v in model.build_reference(SEED).state_dict().items() if not bool(v.any())}
    worst: dict[str, float] = {}
    for which, want in (("params", ref.params), ("exp_avg", ref.exp_avg), ("exp_avg_sq", ref.exp_avg_sq)):
        got, spread = assemble(captured, which, model.param_shapes())
        assert spread == 0.0, which
        skip = noise | (zero if which == "params" else set())
        worst[which] = max(float((got[n] - w).norm() / w.norm()) for n, w in want.items() if n not in skip)
        if which == "params" and zero - noise:
            moves = max(float((got[n] - want[n]).abs().max()) for n in zero - noise)
            worst["zero-init params / lr"] = moves / LR * STATE_TOL / 1e-2
    return worst


def _switch_tour(family: str, tour: list[dict], tmp_path: Path) -> None:
    from hspmd_sdk.runtime.control.train import launch

    model = FAMILIES[family].preset("tiny")
    cluster = Cluster.local(4)
    programs = [specialize(model, plan_from_strategy(model, Strategy.load(d), cluster), cluster,
                           bindings={"B": 8, "S": SEQ}) for d in tour]
    steps = 2 * len(tour) + 3  # steps after the last switch's request: it applies before the run ends
    # switch k is requested while every rank is held at the start of step 2k - 1 and released once all heard it:
    # it lands at the boundary before step 2k, whatever the machine's load
    holds = [2 * k - 1 for k in range(1, len(tour))]
    job = launch(programs[0], cluster, steps=steps, seed=SEED, seq_len=SEQ, lr=LR, capture_dir=tmp_path,
                 timeout_s=60, hold_at=holds)
    switch_at_holds(job, holds, programs[1:])
    result = job.wait(timeout=120)
    ref = reference_training(model, steps=steps, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    assert [e.reason for e in result.events] == ["user"] * (len(tour) - 1)
    assert all(e.done for e in result.events)
    moved = [e.bytes["intra"] + e.bytes["inter"] for e in result.events]
    assert all(m > 0 for m in moved), moved   # even <-> 3:1 moves a quarter of every TP-split tensor
    assert len(result.losses) == steps
    assert max(abs(a - b) / abs(b) for a, b in zip(result.losses, ref.losses)) <= TOL, (result.losses, ref.losses)
    err = _state_err(tmp_path, model, ref)
    assert max(err.values()) <= STATE_TOL, err


@pytest.mark.timeout(240)
def test_a_running_job_switches_from_even_to_uneven_and_back(tmp_path: Path) -> None:
    _switch_tour("llama", [EVEN_TP2, RUNS["tp2_3to1"], EVEN_TP2], tmp_path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_running_job_switches_through_uneven_pipelines_and_zero1(family: str, tmp_path: Path) -> None:
    _switch_tour(family, SWITCH_TOUR, tmp_path)


# ---- the ratio planner -------------------------------------------------------------------------------------------
def test_the_ratio_lp_gives_shares_proportional_to_speed_within_memory() -> None:
    from hspmd_sdk.planner.ratios import solve_ratios

    plan = solve_ratios([3.0, 1.0], units=4)
    assert plan.shares == pytest.approx((0.75, 0.25)) and plan.ratios == (3, 1)
    assert plan.step_time == pytest.approx(plan.ideal_time) and plan.speedup == pytest.approx(2.0)
    assert solve_ratios([2.0, 1.0, 1.0], units=4).ratios == (2, 1, 1)
    # memory binds: the fast device can hold at most 62.5% of the states, and 4 parts allow only 2 of them
    tight = solve_ratios([3.0, 1.0], memory=[1.0, 1.0], sharded_bytes=1.6, units=4)
    assert tight.shares[0] == pytest.approx(0.625) and tight.ratios == (1, 1)
    with pytest.raises(PlanValidationError, match="memory"):
        solve_ratios([3.0, 1.0], memory=[1.0, 1.0], sharded_bytes=2.5)


def test_plan_ratios_prices_a_mixed_group_with_the_cost_model() -> None:
    from hspmd_sdk.planner.ratios import plan_ratios

    model = LlamaConfig.preset("llama-7b")
    cluster = Cluster.mixed({"H800": 8, "H20": 8})
    plan = plan_ratios(model, cluster, Stage(devices=[0, 8], layers=[0, 31]), seq_len=4096)
    assert plan.ratios[0] > plan.ratios[1] and plan.speedup > 1.2
    Strategy.load({"pipelines": [_pipe([([0, 8], [0, 31], list(plan.ratios))], 1, 8)]}, model=model)  # feasible


@pytest.mark.timeout(180)
def test_the_ratio_lp_matches_the_measured_speed_of_an_emulated_slow_rank() -> None:
    """Rank 1 emulates a 3x slower device (``slowdown=``); the even TP2 run measures each rank's compute seconds
    for the same work; the LP's shares are the measured speeds normalised and its ratios their rounding to the
    model's 4 heads (3:1)."""
    from hspmd_sdk.planner.ratios import solve_ratios, split_units
    from hspmd_sdk.runtime.control.train import launch

    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    program = specialize(model, plan_from_strategy(model, Strategy.load(EVEN_TP2), cluster), cluster)
    job = launch(program, cluster, steps=4, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=60,
                          slowdown={1: 3.0})
    job.wait(timeout=150)
    compute = {r: sorted(m.extra["compute_s"] for m in job.metrics.rank(r)[1:])[1] for r in (0, 1)}  # median
    measured = compute[1] / compute[0]
    assert 2.0 <= measured <= 4.5, compute          # the emulation is visible (loose: a loaded CPU)
    speeds = [1 / compute[0], 1 / compute[1]]
    units = split_units(model, Strategy.load(EVEN_TP2).pipelines[0].stages[0], first=True, last=True)
    plan = solve_ratios(speeds, units=units)
    assert units == 4
    assert plan.shares == pytest.approx((speeds[0] / sum(speeds), speeds[1] / sum(speeds)), abs=1e-6)
    assert abs(plan.ratios[0] / sum(plan.ratios) - plan.shares[0]) <= 1 / units     # within its rounding
    assert plan.ratios == (3, 1)


# ---- more layouts (slow: 6 ranks) ----------------------------------------------------------------------------------
SLOW_RUNS = {
    # two pipelines of two stages, uneven first stages (the k-th TP rank form) then even TP1 stages (the pipeline
    # form), ZeRO-1 in both forms
    "dp2_pp2_uneven_first_zero1": {"pipelines": [_pipe([([0, 1], [0, 1], [3, 1]), ([2], [2, 3])], 1, 4),
                                                 _pipe([([3, 4], [0, 1], [3, 1]), ([5], [2, 3])], 1, 4)],
                                   "zero1": True},
    # 3:1 then 1:3: the stage boundary moves every activation by BSR between two uneven top tiers
    "pp2_two_uneven_stages": {"pipelines": [_pipe([([0, 1], [0, 1], [3, 1]), ([2, 3], [2, 3], [1, 3])], 2, 4)]},
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_uneven_stages_beside_even_ones_in_pipelines_and_data_parallel(family: str, references: dict,
                                                                       tmp_path: Path) -> None:
    config, cluster = FAMILIES[family].preset("tiny"), Cluster.local(6)
    programs = {n: specialize(config, plan_from_strategy(config, Strategy.load(d), cluster), cluster)
                for n, d in SLOW_RUNS.items()}
    runs = [training_run(programs[n], steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, capture_dir=tmp_path,
                         cluster=cluster, data=DATA) for n in SLOW_RUNS]
    result = start_runs(runs, cluster, timeout_s=300).wait()
    shapes = param_shapes(config)
    for i, name in enumerate(SLOW_RUNS):
        captured = load_captured(tmp_path, i)
        grads, grad_spread = assemble(captured, "grads", shapes)
        params, param_spread = assemble(captured, "params", shapes)
        run = {"losses": result.results[0]["runs"][i]["losses"], "grads": grads, "params": params,
               "spread": max(grad_spread, param_spread)}
        _close_to_reference(run, references[family])


def test_the_editor_keeps_a_stages_ratios() -> None:
    """A strategy with an uneven stage goes through the editor's draft and back unchanged (and an even one gets no
    ratios field)."""
    from hspmd_sdk.viz.draft import Draft

    uneven = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 1], "ratios": [3, 1]},
                                                      {"devices": [2], "layers": [2, 3]}],
                                           "micro_batch_size": 1, "num_micro_batches": 2}]})
    back = Strategy.load(Draft.from_strategy(uneven).to_dict())
    assert back.pipelines[0].stages[0].ratios == [3, 1] and back == uneven
    assert "ratios" not in Draft.from_strategy(uneven).to_dict()["pipelines"][0]["stages"][1]
