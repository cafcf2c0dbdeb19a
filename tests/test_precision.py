"""bf16 training (SPEC §8) against the single-device reference with the same recipe.

``launch(..., precision="bf16")``: every step computes with bf16 copies of the fp32 master weights (bf16
activations and gradients, the loss in fp32), each use's gradient is summed over the micro-batches in fp32 and
synchronised in bf16, and Adam updates the fp32 masters with fp32 state.  ``reference_training(...,
precision="bf16")`` runs the same recipe on one device (a bf16 copy of the fp32 module, its gradients applied to
the fp32 masters).  Every strategy class trains the tiny Llama and the tiny GPT-2 (tied embeddings) for 3 steps
in one 4-rank job per family; bf16 matmuls are slow on this CPU, hence the tiny models only.

Tolerances, and why.  bf16 keeps 8 significant bits: one rounding errs by up to ``u = 2**-8`` relative (0.39%).
Two correct bf16 executions of the same step differ wherever they round at different places — a TP
row-parallel matmul rounds its partial sums before the all-reduce adds them, a data-parallel gradient is rounded
per rank and summed in bf16 on the wire, micro-batches are summed in fp32 — so distributed bf16 equals the bf16
reference only up to a few such roundings per value, the same order as the bf16 reference's own distance from fp32
(measured on both families: per-tensor gradient error 1.5e-2..2.4e-2 of the tensor's largest element, parameters
after 3 Adam steps 0.75e-2..1.9e-2 norm-wise).  Measured distances of the distributed runs to the bf16 reference
(7 strategies x 2 families): losses <= 4.1e-5 relative, gradients <= 3.4e-2 (max) / 1.6e-2 (norm), parameters
<= 1.5e-2 (norm).  The bounds: losses 2e-4 (the loss is an fp32 mean over 128 tokens, whose roundings average
out), gradients ``20 u`` = 7.8e-2 element-wise against the tensor's largest element and ``10 u`` = 3.9e-2
norm-wise, parameters ``10 u`` norm-wise.  A real error — a gradient missing a micro-batch, a pipeline, a use of a
tied weight or a shard — is off by tens of percent, far outside.  As in fp32, a gradient that is zero in exact
arithmetic (GPT-2's key bias) is rounding noise, bounded absolutely; a parameter it updates is nothing but Adam's
``lr``-sized steps on such noise: for it only the recipe's bound (lr and step count) is checked (no step moves an
element by more than ~1.004 ``lr`` with these betas).  A parameter that starts at zero is nothing but Adam's
updates: the sign of each element's update must be the reference's (for at least 90% of the elements).  Element-wise parameter errors are not
bounded otherwise: where a
gradient element is within rounding of zero, its sign — and so Adam's ``lr``-sized step — may differ (measured up
to 4.4 ``lr`` after 3 steps), as between any two bf16 runs.

That the recipe is bf16, not fp32 in disguise: gradients that crossed the wire (data parallelism) are exactly
bf16 values, the master weights are not (fp32), and Adam's state is two fp32 tensors per parameter shard.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import GPTConfig, LlamaConfig  # noqa: E402
from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk.core.specialize import specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import PlanValidationError  # noqa: E402
from hspmd_sdk.models import param_shapes  # noqa: E402
from hspmd_sdk.runtime.control.train import (assemble, start_runs, load_captured, reference_training,  # noqa: E402
                                     training_run)
from test_runtime_train import _HETERO, _expected_param_bytes, _pipe  # noqa: E402

STEPS, SEED, SEQ, LR = 3, 1, 16, 1e-3
U = 2.0 ** -8                       # bf16 unit roundoff
LOSS_TOL, GRAD_TOL, GRAD_NORM_TOL, PARAM_NORM_TOL = 2e-4, 20 * U, 10 * U, 10 * U

#: name -> (strategy, ranks that recompute): one of each strategy class
TABLE = {
    "single": ({"pipelines": [_pipe([([0], [0, 3])], 8, 1)]}, ()),
    "dp2": ({"pipelines": [_pipe([([0], [0, 3])], 2, 2), _pipe([([1], [0, 3])], 2, 2)]}, ()),
    "tp2": ({"pipelines": [_pipe([([0, 1], [0, 3])], 4, 2)]}, ()),
    "pp2_gpipe": ({"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 2, 4)], "schedule": "gpipe"}, ()),
    "pp2_1f1b_recompute": ({"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 2, 4)]}, (0, 1)),
    "dp2xtp2": ({"pipelines": [_pipe([([0, 1], [0, 3])], 2, 2), _pipe([([2, 3], [0, 3])], 2, 2)]}, ()),
    # TP2 -> TP1 stage boundary (BSR) beside a 1-rank pipeline, ZeRO-1 across the pipelines (uneven batches)
    "hetero_tp_zero1": ({**_HETERO, "zero1": True, "name": "hetero-tiny + ZeRO-1"}, ()),
}
FAMILIES = {"llama": LlamaConfig, "gpt": GPTConfig}


@pytest.fixture(scope="module", params=list(FAMILIES))
def config(request: pytest.FixtureRequest) -> LlamaConfig | GPTConfig:
    return FAMILIES[request.param].preset("tiny")


@pytest.fixture(scope="module")
def references(config: LlamaConfig | GPTConfig) -> dict:
    kw = dict(steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    return {"bf16": reference_training(config, precision="bf16", **kw), "fp32": reference_training(config, **kw),
            "initial": dict(config.build_reference(SEED).state_dict())}


@pytest.fixture(scope="module")
def trained(config: LlamaConfig | GPTConfig, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bf16")
    cluster = Cluster.local(4)
    programs = {n: specialize(config, plan_from_strategy(config, Strategy.load(d), cluster), cluster)
                for n, (d, _) in TABLE.items()}
    runs = [training_run(programs[n], steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, capture_dir=out,
                         recompute=TABLE[n][1], cluster=cluster, precision="bf16") for n in TABLE]
    result = start_runs(runs, cluster, timeout_s=300).wait()
    shapes = param_shapes(config)
    got = {}
    for i, name in enumerate(TABLE):
        captured = load_captured(Path(out), i)
        grads, grad_spread = assemble(captured, "grads", shapes)
        params, param_spread = assemble(captured, "params", shapes)
        got[name] = {"losses": result.results[0]["runs"][i]["losses"], "grads": grads, "params": params,
                     "spread": max(grad_spread, param_spread),
                     "ranks": {r: res["runs"][i] for r, res in result.results.items()}}
    return got


def _norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", list(TABLE))
def test_bf16_training_equals_the_bf16_reference(name: str, trained: dict, references: dict) -> None:
    run, ref, exact = trained[name], references["bf16"], references["fp32"]
    assert len(run["losses"]) == STEPS
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref.losses))
    assert loss_err <= LOSS_TOL, (run["losses"], ref.losses)
    assert run["spread"] == 0.0  # replicas agree exactly (the same bf16 operations on the same values)
    top = max(float(g.abs().max()) for g in exact.grads.values())
    floor = 1e-4 * top
    for pname, full in ref.grads.items():
        got = run["grads"][pname]
        assert not torch.isnan(got).any(), f"{pname}: some element held by no rank"
        if float(exact.grads[pname].abs().max()) < 1e-7 * top:
            # zero in exact arithmetic (GPT-2's key bias: softmax ignores a constant added to a row): bf16 noise
            assert float((got - full).abs().max()) <= 2 * floor, pname
            continue
        err = float((got - full).abs().max()) / max(float(full.abs().max()), floor)
        assert err <= GRAD_TOL, (pname, err)
        assert _norm_rel(got, full) <= GRAD_NORM_TOL, (pname, _norm_rel(got, full))
    for pname, full in ref.params.items():
        got = run["params"][pname]
        assert torch.isfinite(got).all(), pname
        no_grad = float(exact.grads[pname].abs().max()) < 1e-7 * top
        initial = references["initial"][pname]
        if no_grad:
            # Adam on rounding noise: nothing to compare with the reference (whose noise differs); the recipe's own
            # bound, from the configured lr and step count: each step moves an element by at most ~lr (1.1 lr from
            # Adam's bias corrections with these betas) -- a wrong lr or an extra update exceeds it
            assert float((got - initial).abs().max()) <= STEPS * 1.1 * LR, pname
            continue
        if not bool(initial.any()):
            # nothing but Adam's lr-sized updates (zero init), whose sizes Adam normalises (their gradients are
            # checked above): the direction of each element's update is the reference's (measured >= 96.9% of
            # the elements on every strategy; a near-zero gradient element may flip), and each element moved
            # by at most the recipe's bound.  A missing, misplaced or negated update fails here.
            agree = float((torch.sign(got) == torch.sign(full)).float().mean())
            assert agree >= 0.9 and float(got.abs().max()) <= STEPS * 1.1 * LR, (pname, agree)
            continue
        assert _norm_rel(got, full) <= PARAM_NORM_TOL, (pname, _norm_rel(got, full))


def test_bf16_on_the_wire_and_fp32_master_weights_and_adam_state(trained: dict,
                                                                 config: LlamaConfig | GPTConfig) -> None:
    # data parallelism synchronises every gradient across the pipelines: the sums came over the wire in bf16
    for pname, g in trained["dp2"]["grads"].items():
        assert torch.equal(g, g.bfloat16().float()), f"{pname}: a gradient that is not a bf16 value"
    # the masters are fp32: after 3 updates of lr 1e-3 almost no element is a bf16 value (an fp32 number is one
    # with probability 2**-16, plus parameters that are exactly 0 or 1)
    for name in TABLE:
        params = trained[name]["params"]
        total = sum(p.numel() for p in params.values())
        bf16_valued = sum(int((p == p.bfloat16().float()).sum()) for p in params.values())
        assert bf16_valued < 0.01 * total, (name, bf16_valued, total)
    # Adam's state: two fp32 tensors of each shard, and the shards are fp32 (bytes = 4 * elements of the box)
    run = trained["dp2xtp2"]
    for rank, res in run["ranks"].items():
        want = _expected_param_bytes(TABLE["dp2xtp2"][0], config, rank)
        assert res["param_bytes"] == want and res["optimizer_bytes"] == 2 * want, rank


def test_the_bf16_reference_is_the_bf16_recipe(references: dict) -> None:
    """The reference itself: bf16 gradients (exact bf16 values) on fp32 masters, close to fp32 but not equal."""
    ref, exact = references["bf16"], references["fp32"]
    for pname, g in ref.grads.items():
        assert g.dtype == torch.float32 and torch.equal(g, g.bfloat16().float()), pname
    assert all(p.dtype == torch.float32 for p in ref.params.values())
    assert ref.losses != exact.losses
    assert max(abs(a - b) / b for a, b in zip(ref.losses, exact.losses)) < 1e-3  # bf16 rounding, no more
    assert math.isfinite(sum(ref.losses))


def test_a_bad_precision_starts_no_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    import hspmd_sdk.runtime.control.start as launcher  # where every worker start goes (launch_spec)
    from hspmd_sdk import launch

    monkeypatch.setattr(launcher, "launch_spec", lambda *a, **k: pytest.fail("a worker would have started"))
    config = LlamaConfig.preset("tiny")
    cluster = Cluster.local(2)
    program = specialize(config, plan_from_strategy(config, Strategy.load(TABLE["dp2"][0]), cluster), cluster)
    with pytest.raises(PlanValidationError, match=r"precision: must be 'fp32' or 'bf16', not 'fp16'"):
        launch(program, cluster, steps=1, precision="fp16")
    with pytest.raises(ValueError, match="precision"):
        reference_training(config, steps=1, global_batch=8, precision="half")


def test_adam_is_torchs_fused_kernel_and_shard_wise_it_is_the_full_tensors_adam() -> None:
    """Every rank and the references build Adam with :meth:`AdamConfig.build`: torch's fused kernel on this CPU;
    its update on the shards of a tensor equals the update of the whole tensor (elementwise; an odd-sized shard's
    vector tail may round by an ulp), and agrees with torch's for-loop Adam to rounding; a state handed in (a
    switch, a checkpoint) gets its step count where the fused kernel reads it."""
    from hspmd_sdk.runtime.workers.executor import AdamConfig, adam_step_state, fused_adam_available

    cfg = AdamConfig(lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    full0 = torch.randn(64, 96, generator=gen)
    grads = [torch.randn(64, 96, generator=gen) for _ in range(5)]

    def train(split: int | None, **kw: object) -> torch.Tensor:
        parts = [full0.clone()] if split is None else [c.contiguous() for c in full0.split(split, dim=1)]
        params = [p.requires_grad_() for p in parts]
        opt = cfg.build(params) if not kw else torch.optim.Adam(params, lr=cfg.lr, weight_decay=0.01, **kw)
        for g in grads:
            for p, gp in zip(params, [g] if split is None else g.split(split, dim=1)):
                p.grad = gp.contiguous()
            opt.step()
        return torch.cat([p.detach() for p in params], dim=1)

    opt = cfg.build([torch.zeros(3, requires_grad=True)])
    assert bool(opt.defaults.get("fused")) == fused_adam_available(full0)  # torch 2.4+ has the CPU kernel
    if not opt.defaults.get("fused"):
        pytest.skip(f"torch {torch.__version__} has no fused CPU Adam: the for-loop one runs")
    assert not fused_adam_available(torch.zeros(3, dtype=torch.int64))
    whole = train(None)
    assert torch.equal(train(32), whole)  # shards of 32 columns: bit for bit
    assert float((train(None, foreach=False) - whole).abs().max()) <= 1e-6  # the loop: same math, rounding
    step = adam_step_state(3, full0, opt)
    assert step.dtype == torch.float32 and step.device == full0.device and float(step) == 3.0
