"""The training executor against the single-device reference (paper §6.3, Appendix A.2).

Every strategy trains the tiny Llama and the tiny GPT-2 for 3 steps on real worker processes (gloo, fp32) from
the same seed and data as :func:`~hspmd_sdk.runtime.control.train.reference_training` (the plain ``torch.nn.Module`` with
``torch.optim.Adam``).  GPT-2 ties its embeddings: on pipelines of several stages the weight's two uses, the
embedding and the LM head, sit on different ranks.  Checked per strategy: the loss of every step, every
synchronised gradient of step 0 and every parameter after step 3, each assembled from the ranks' shards (replicas
must agree), and that each rank holds only its shards.

Two jobs per family keep process start-up to few payments: the 2-rank strategies, then the 4- to 7-rank ones
(sitting-out ranks of a run just join its loss reduction).

Relative error of a tensor: ``max|a - b| / max|b|`` for losses and gradients (1e-5).  For parameters after Adam
the norm-wise ``||a - b|| / ||b||`` (2e-5): Adam divides each element's update by its own gradient's magnitude,
so elements whose gradient is ~1e-8 (sums that nearly cancel) turn fp32 rounding differences of the summation
order into ``lr``-sized update differences; the element-wise figure (measured ~6e-5..9e-5 with lr 1e-3) is also
what a single device gets from merely accumulating the batch in micro-batches (~1e-5) plus the SDK kernels' own
rounding, not a difference of the computation.  Zero-initialised parameters and gradients that vanish in exact
arithmetic get absolute bounds (see the test).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk import GPTConfig, LlamaConfig  # noqa: E402
from hspmd_sdk.core.specialize import specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import PlanValidationError  # noqa: E402
from hspmd_sdk.models import param_shapes  # noqa: E402
from hspmd_sdk.runtime.control.train import (assemble, start_runs, load_captured, reference_training,  # noqa: E402
                                     training_run)

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"
STEPS, SEED, SEQ, LR = 3, 1, 16, 1e-3
TOL = 1e-5
PARAM_TOL = 2e-5
#: Uniform random tokens (not the default standard-library text): the parameter bounds below were measured on them.
#: On real bytes a few elements' gradients nearly cancel (a byte's rows seen once in a batch), and Adam's
#: element-wise division turns fp32 summation-order differences there into larger relative parameter differences
#: (2.7e-5 norm-wise on ``layers.3.mlp.w1`` under TP2 after 3 steps), not a difference of the computation.
DATA = "synthetic"


def _pipe(stages: list[tuple[list[int], list[int]]], mbs: int, n: int) -> dict:
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": mbs,
            "num_micro_batches": n}


_HETERO = json.loads((EXAMPLES / "example_hetero_tiny.json").read_text())

#: name -> (strategy, ranks that recompute activations)
SMALL = {
    "single": ({"pipelines": [_pipe([([0], [0, 3])], 8, 1)]}, ()),   # 1 rank (rank 1 sits it out)
    "dp2": ({"pipelines": [_pipe([([0], [0, 3])], 2, 2), _pipe([([1], [0, 3])], 2, 2)]}, ()),
    "tp2": ({"pipelines": [_pipe([([0, 1], [0, 3])], 4, 2)]}, ()),
    "pp2_gpipe": ({"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 2, 4)], "schedule": "gpipe"}, ()),
    "pp2_1f1b": ({"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 2, 4)], "schedule": "1f1b"}, ()),
    "pp2_1f1b_recompute": ({"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 2, 4)]}, (0, 1)),
}
LARGE = {
    "dp2xtp2": ({"pipelines": [_pipe([([0, 1], [0, 3])], 2, 2), _pipe([([2, 3], [0, 3])], 2, 2)]}, ()),
    # TP2 -> TP1 (BSR between stages of different TP degree), 3 micro-batches, beside a 1-rank pipeline with 1
    "hetero_tp": (_HETERO, ()),
    # different stage boundaries (after layer 0 / after layer 2) and micro-batch counts and sizes (4x1 / 2x2)
    "hetero_boundaries": ({"pipelines": [_pipe([([0], [0, 0]), ([1], [1, 3])], 1, 4),
                                         _pipe([([2], [0, 2]), ([3], [3, 3])], 2, 2)]}, ()),
    # C2-like: a TP4 pipeline beside a TP2 -> TP1 pipeline (stages of 4, 2 and 1 ranks; 7 ranks)
    "c2_like": ({"pipelines": [_pipe([([0, 1, 2, 3], [0, 3])], 2, 2),
                               _pipe([([4, 5], [0, 1]), ([6], [2, 3])], 1, 4)]}, (4, 5)),
    # three stages: the middle one reads no data and only relays activations and gradients
    "pp3_1f1b": ({"pipelines": [_pipe([([0], [0, 0]), ([1], [1, 2]), ([2], [3, 3])], 2, 4)]}, ()),
    "hetero_tp_zero1": ({**_HETERO, "zero1": True, "name": "hetero-tiny + ZeRO-1"}, ()),
    # ZeRO-1 over 3 pipelines: 64 does not divide by 3, so most shards are uneven (hratios 22:21:21)
    "dp3_zero1": ({"pipelines": [_pipe([([0], [0, 3])], 4, 1), _pipe([([1], [0, 3])], 2, 1),
                                 _pipe([([2], [0, 3])], 2, 1)], "zero1": True}, ()),
}
#: strategies whose ZeRO-1 shards are uneven: their per-rank bytes are checked as a partition of the model
UNEVEN = {"dp3_zero1"}
STRATEGIES = {**SMALL, **LARGE}


FAMILIES = {"llama": LlamaConfig, "gpt": GPTConfig}


@pytest.fixture(scope="module", params=list(FAMILIES))
def config(request: pytest.FixtureRequest) -> LlamaConfig | GPTConfig:
    return FAMILIES[request.param].preset("tiny")


def _programs(config: LlamaConfig, table: dict, cluster: Cluster) -> dict:
    return {name: specialize(config, plan_from_strategy(config, Strategy.load(data), cluster), cluster)
            for name, (data, _) in table.items()}


def _run_job(config: LlamaConfig, table: dict, world: int, out: Path) -> dict:
    cluster = Cluster.local(world)
    programs = _programs(config, table, cluster)
    runs = [training_run(programs[n], steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, data=DATA, capture_dir=out,
                         recompute=table[n][1], cluster=cluster) for n in table]
    result = start_runs(runs, cluster, timeout_s=120).wait()
    shapes = param_shapes(config)
    got = {}
    for i, name in enumerate(table):
        captured = load_captured(out, i)
        grads, grad_spread = assemble(captured, "grads", shapes)
        params, param_spread = assemble(captured, "params", shapes)
        got[name] = {"program": programs[name], "ranks": {r: res["runs"][i] for r, res in result.results.items()},
                     "losses": result.results[0]["runs"][i]["losses"], "grads": grads, "params": params,
                     "spread": max(grad_spread, param_spread)}
    return got


@pytest.fixture(scope="module")
def trained(config: LlamaConfig, tmp_path_factory: pytest.TempPathFactory) -> dict:
    got = _run_job(config, SMALL, 2, tmp_path_factory.mktemp("small"))
    got.update(_run_job(config, LARGE, 7, tmp_path_factory.mktemp("large")))
    return got


@pytest.fixture(scope="module")
def reference(config: LlamaConfig | GPTConfig) -> object:
    ref = reference_training(config, steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR, data=DATA)
    ref.initial = dict(config.build_reference(SEED).state_dict())
    return ref


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


def _norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_training_equals_the_single_device_reference(name: str, trained: dict, reference: object) -> None:
    run = trained[name]
    assert run["program"].bindings["B"] == 8
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference.losses))
    assert len(run["losses"]) == STEPS and loss_err <= TOL, (run["losses"], reference.losses)
    assert run["spread"] == 0.0  # replicas (TP-duplicated norms, DP copies) agree exactly
    # a gradient that is zero in exact arithmetic (GPT-2's key bias: softmax ignores a constant added to every
    # score of a row) is rounding noise on both sides; measure every gradient against at least 1e-4 of the
    # model's largest gradient
    floor = 1e-4 * max(float(g.abs().max()) for g in reference.grads.values())
    for pname, full in reference.grads.items():
        assert not torch.isnan(run["grads"][pname]).any(), f"{pname}: some element held by no rank"
        err = float((run["grads"][pname] - full).abs().max()) / max(float(full.abs().max()), floor)
        assert err <= TOL, (pname, err)
    typical = sorted(_rms(t) for t in reference.initial.values() if t.dim() == 2)[
        sum(t.dim() == 2 for t in reference.initial.values()) // 2]  # the median initial RMS of the matrices
    for pname, full in reference.params.items():
        if float(reference.grads[pname].abs().max()) < floor * 1e-3:
            # no gradient in exact arithmetic: Adam turns the rounding noise (|g| ~ 1e-11 << eps) into moves of
            # ~1e-3 lr on both sides; they must stay that small, not agree
            assert float((run["params"][pname] - full).abs().max()) <= 1e-2 * LR, pname
            continue
        if not bool(reference.initial[pname].any()):
            # a parameter that starts at zero (GPT-2's biases) is nothing but its Adam updates, each element's
            # lr * m / sqrt(v): a gradient element 1000x below the tensor's largest carries its rounding (4e-5 of
            # itself on the 1-rank SDK run) undiluted into an lr-sized step.  The moves must agree to 1% of lr.
            assert float((run["params"][pname] - full).abs().max()) <= 1e-2 * LR, pname
            continue
        # GPT-2's residual projections start at 0.02 / sqrt(2 * layers) (2.8x below the other weights here): the
        # same rounding of the updates is 2.8x larger against their norm (1.3e-5 with TP2's all-reduce order,
        # 2.03e-5 with the hetero layout on an AVX-512 EPYC), so every weight is measured against at least the
        # scale it would have at the model's typical initial RMS (like the gradients' floor above)
        scale = max(1.0, typical / _rms(reference.initial[pname]))
        err = _norm_rel(run["params"][pname], full) / scale, _max_rel(run["params"][pname], full) / scale
        assert err[0] <= PARAM_TOL and err[1] <= 3e-4, (pname, err)


#: Megatron TP split dim of each parameter (None: whole on every TP rank), per family: Llama's wq/wk/wv/w1/w3
#: column-parallel (output dim), wo/w2 row-parallel (input dim), the embedding (vocab, hidden) split along hidden,
#: the LM head (hidden, vocab) along vocab; GPT-2's Q/K/V/fc weights and their biases column-parallel, the
#: output projections row-parallel with whole biases, the tied embedding and the position embedding along hidden.
_TP_DIM = {
    "llama": {"attn_norm.weight": None, "attn.wq": 1, "attn.wk": 1, "attn.wv": 1, "attn.wo": 0,
              "mlp_norm.weight": None, "mlp.w1": 1, "mlp.w3": 1, "mlp.w2": 0,
              "embed.weight": 1, "final_norm.weight": None, "lm_head.weight": 1},
    "gpt": {"ln_1.weight": None, "ln_1.bias": None, "ln_2.weight": None, "ln_2.bias": None, "attn.wq": 1,
            "attn.bq": 0, "attn.wk": 1, "attn.bk": 0, "attn.wv": 1, "attn.bv": 0, "attn.wo": 0, "attn.bo": None,
            "mlp.w_fc": 1, "mlp.b_fc": 0, "mlp.w_proj": 0, "mlp.b_proj": None, "wte.weight": 1, "wpe.weight": 1,
            "ln_f.weight": None, "ln_f.bias": None},
}
#: Parameters outside the layers held by a pipeline's first and last stage (GPT-2's LM head is the tied ``wte``,
#: held by the first stage; the last stage only receives it each step).
_ENDS = {"llama": (["embed.weight"], ["final_norm.weight", "lm_head.weight"]),
         "gpt": (["wte.weight", "wpe.weight"], ["ln_f.weight", "ln_f.bias"])}


def _expected_param_bytes(data: dict, config: LlamaConfig | GPTConfig, rank: int) -> int | None:
    """fp32 bytes of the parameters ``rank`` should hold under the strategy ``data``, from the strategy and the
    model's parameter shapes alone: the layers of its stage (plus the embedding on a first stage, the final norm
    and LM head on a last one), TP-split weights divided by the stage's TP degree, and under ZeRO-1 everything
    also divided among the pipelines (the tiny model's dims are all even).  ``None``: the rank is in no stage."""
    strategy = Strategy.load(data)
    shapes = param_shapes(config)
    tp_dim, (head, tail) = _TP_DIM[config.family], _ENDS[config.family]
    zero = len(strategy.pipelines) if strategy.zero1 else 1
    for pipe in strategy.pipelines:
        for k, stage in enumerate(pipe.stages):
            if rank not in stage.devices:
                continue
            first, last = stage.layers
            names = [n for n in shapes if n.startswith("layers.") and first <= int(n.split(".")[1]) <= last]
            names += head * (k == 0) + tail * (k == len(pipe.stages) - 1)
            tp, total = len(stage.devices), 0
            for n in names:
                dim = tp_dim[n.split(".", 2)[2] if n.startswith("layers.") else n]
                numel = math.prod(shapes[n])
                if dim is not None:
                    assert shapes[n][dim] % tp == 0, (n, tp)
                    numel //= tp
                assert numel % zero == 0, (n, zero)
                total += numel // zero
            return 4 * total
    return None


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_rank_holds_only_its_shards(name: str, trained: dict, config: LlamaConfig | GPTConfig) -> None:
    run = trained[name]
    full = 4 * sum(torch.Size(s).numel() for s in param_shapes(config).values())
    if name in UNEVEN:  # three single-rank pipelines: together they hold every element exactly once
        held = [res for res in run["ranks"].values() if res["active"]]
        assert len(held) == 3 and sum(r["param_bytes"] for r in held) == full
        assert all(r["shard_bytes"] == r["param_bytes"] and r["optimizer_bytes"] == 2 * r["param_bytes"]
                   and r["param_bytes"] < 0.4 * full for r in held)
        return
    for rank, res in run["ranks"].items():
        expected = _expected_param_bytes(STRATEGIES[name][0], config, rank)
        assert res["active"] == (expected is not None), rank
        if not res["active"]:
            continue
        assert res["param_bytes"] == expected, (rank, res["param_bytes"], expected)  # nothing gathered or extra
        assert res["shard_bytes"] == expected, rank                 # the annotations say the same
        assert res["optimizer_bytes"] == 2 * res["param_bytes"]   # Adam moments of exactly the shards
        prog = run["program"]
        p, st = prog.stage_of(rank)
        whole = prog.num_stages(p) == 1 and len(prog.stage_ranks(p, st)) == 1 and not prog.plan.settings.zero1
        assert (res["param_bytes"] == full) if whole else (res["param_bytes"] < full), rank


def test_heterogeneous_runs_use_their_own_micro_batching(trained: dict) -> None:
    ranks = trained["hetero_boundaries"]["ranks"]
    assert ranks[0]["micro_batches"] == [4, 1] and ranks[3]["micro_batches"] == [2, 2]
    prog = trained["hetero_tp"]["program"]
    assert prog.comm_plans["layers.2.in"].kinds == ["BSR"]           # TP2 -> TP1 stage boundary
    prog = trained["c2_like"]["program"]
    first_use = {g.name for g in prog.grad_syncs if g.name.endswith(".grad_sync")}
    assert {k for n in first_use for k in prog.grad_sync_plans[n].kinds} == {"SplitAllReduce"}
    others = [g for g in prog.grad_syncs if g.name not in first_use]   # GPT-2's LM-head use of the tied wte
    assert [g.param for g in others] == (["wte.weight"] if "wte.weight" in prog.parameters else [])


def test_zero1_shards_parameters_and_optimizer_state_across_pipelines(trained: dict) -> None:
    zero, plain = trained["hetero_tp_zero1"], trained["hetero_tp"]
    prog = zero["program"]
    assert prog.comm_plans["layers.0.attn.wq.gather"].kinds == ["SplitAllGather"]
    assert prog.grad_sync_plans["layers.0.attn.wq.grad_sync"].kinds == ["SplitReduceScatter"]
    assert not prog.plan.settings.zero1_replicated  # every parameter is sharded
    for rank in (0, 1, 2, 3):
        z, p = zero["ranks"][rank], plain["ranks"][rank]
        assert z["param_bytes"] < p["param_bytes"] and z["optimizer_bytes"] < p["optimizer_bytes"], rank


def test_tied_embedding_uses_on_two_stages_move_by_bsr_and_sum_their_gradients(trained: dict,
                                                                               config: LlamaConfig | GPTConfig) -> None:
    if config.family != "gpt":
        pytest.skip("only GPT-2 ties its embeddings")
    prog = trained["pp2_1f1b"]["program"]
    assert prog.comm_plans["wte.weight.head"].kinds == ["SendRecv"]   # rank 0's embedding to rank 1's LM head
    syncs = [g for g in prog.grad_syncs if g.param == "wte.weight"]
    assert [g.uses for g in syncs] == [("wte.weight.gather",), ("wte.weight.head",)]
    assert prog.grad_sync_plans[syncs[1].name].kinds == ["SendRecv"]  # the head's gradient back to rank 0
    prog = trained["hetero_tp"]["program"]                           # TP2 first stage -> TP1 last stage
    assert prog.comm_plans["wte.weight.head"].kinds == ["BSR"]
    single = trained["dp2"]["program"]                                 # one stage: one use group, summed locally
    (sync,) = [g for g in single.grad_syncs if g.param == "wte.weight"]
    assert sync.uses == ("wte.weight.gather", "wte.weight.head")


def test_launch_training_returns_a_job_with_the_step_losses(config: LlamaConfig, reference: object) -> None:
    from hspmd_sdk import launch  # the public name (SPEC §3)

    cluster = Cluster.local(2)
    strategy = Strategy.load({"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 4, 2)]})
    program = specialize(config, plan_from_strategy(config, strategy, cluster), cluster)
    result = launch(program, cluster, steps=2, seed=SEED, seq_len=SEQ, lr=LR, data=DATA).wait()
    assert len(result.losses) == 2
    assert max(abs(a - b) / abs(b) for a, b in zip(result.losses, reference.losses)) <= TOL


def test_micro_batch_plans_keep_the_operators_at_the_micro_batch_shape(config: LlamaConfig) -> None:
    from hspmd_sdk.core.microbatch import MicroBatchError, micro_batch_plan

    cluster = Cluster.local(4)
    prog = specialize(config, plan_from_strategy(config, Strategy.load(_HETERO), cluster), cluster)
    plan = prog.comm_plans["layers.2.in"]                   # BSR [0,1] D2 | [3] R -> [2] R | [3] R, rows 0:6 | 6:8
    small = micro_batch_plan(plan, 0, (0, 6), 2)             # pipeline 0: 3 micro-batches of 2 rows
    assert small.kinds == plan.kinds
    for m, m2 in zip(plan.ops[0].messages, small.ops[0].messages):
        assert (m.src, m.dst) == (m2.src, m2.dst) and m2.box[0] == (0, 2) and m2.box[1:] == m.box[1:]
        assert m2.nbytes * 3 == m.nbytes
    with pytest.raises(MicroBatchError, match="covers part"):
        micro_batch_plan(plan, 0, (0, 3), 1)                 # a chunk the plan's boxes straddle


# ---- a bad run fails in the caller: no worker starts -----------------------------------------------------------
@pytest.fixture()
def no_workers(monkeypatch: pytest.MonkeyPatch) -> list:
    """``launch_spec`` (what starts the workers) replaced by a stub that records its spec and refuses."""
    import hspmd_sdk.runtime.control.start as launcher  # where every worker start goes (launch_spec)

    calls: list = []

    def refuse(spec, *args, **kwargs):
        calls.append(spec)
        raise RuntimeError("a worker would have started")

    monkeypatch.setattr(launcher, "launch_spec", refuse)
    return calls


def test_a_bad_plan_or_run_option_starts_no_worker(config: LlamaConfig, no_workers: list) -> None:
    from hspmd_sdk import launch
    from hspmd_sdk.runtime import launch as general_launch

    four = Cluster.local(4)
    program = specialize(config, plan_from_strategy(config, Strategy.load(_HETERO), four), four)
    with pytest.raises(PlanValidationError, match=r"cluster: the program uses ranks \[2, 3\]"):
        launch(program, Cluster.local(2), steps=1)                  # specialized for 4 ranks, launched on 2
    bad = [({"data": "bogus"}, "data"), ({"steps": 0}, "steps"), ({"steps": -1}, "steps"),
           ({"seq_len": 0}, "seq_len")]
    for options, field in bad:
        kwargs = {"steps": 1, **options}
        with pytest.raises(PlanValidationError, match=rf"{field}: "):
            launch(program, four, **kwargs)
        with pytest.raises(PlanValidationError, match=rf"{field}: "):
            general_launch(program, four, **kwargs)                # the general launcher forwards them
    other = training_run(program, steps=1, cluster=Cluster.local(5))
    with pytest.raises(PlanValidationError, match=r"runs\[0\]\.cluster"):
        start_runs([other], four)                                  # a run built for another cluster
    assert no_workers == []


def test_the_general_launcher_forwards_the_run_options(config: LlamaConfig, no_workers: list) -> None:
    from hspmd_sdk.runtime import launch as general_launch

    cluster = Cluster.local(2)
    program = specialize(config, plan_from_strategy(config, Strategy.load(SMALL["pp2_1f1b"][0]), cluster), cluster)
    with pytest.raises(RuntimeError, match="a worker would have started"):
        general_launch(program, cluster, steps=2, seq_len=SEQ, lr=0.5, data="stdlib", recompute=[1],
                       capture_dir="/tmp/x")
    (spec,) = no_workers
    (run,) = spec.payload["runs"]
    from hspmd_sdk.runtime.protocol import training_of

    assert (run["steps"], run["seq_len"], training_of(run).optimizer.lr, run["data"], run["recompute"],
            run["capture_dir"]) == (2, SEQ, 0.5, "stdlib", [1], "/tmp/x")
