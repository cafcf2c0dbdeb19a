"""Training on CUDA GPUs (NCCL between ranks) against the single-device reference: the GPU half of issue 26 item 6.

Every test here is marked ``gpu`` and skips, naming why, where ``torch.cuda.is_available()`` is False or the
machine has fewer GPUs than the test needs; ``scripts/gpu_check.sh`` runs them (``pytest -m gpu``) on a GPU
machine.  Checked, on the tiny Llama, fp32, from the same seed and data as
:func:`~hspmd_sdk.runtime.control.train.reference_training` (the plain module with ``torch.optim.Adam``, on the CPU):

* one GPU: a one-rank pipeline of two micro-batches (NCCL initialised, no peer);
* two GPUs: DP2, TP2 (all-reduces inside the layers), CP2 (the key/value ring, balanced layout) and PP2 1F1B
  (NCCL send/recv on the executor's per-pair groups);
* four GPUs: a TP2 -> TP1 pipeline beside a one-rank pipeline (BSR between stages of different TP degree,
  uneven micro-batching) and a CP2 stage feeding a CP1 stage beside a one-rank pipeline;
* the device itself: the reference module trained on one GPU (TF32 off) matches the CPU reference, and a worker
  process computes fp32 matmuls without TF32.

TF32: the workers (``hspmd_sdk/runtime``) never touch ``torch.backends.cuda.matmul.allow_tf32`` or
``torch.backends.cudnn.allow_tf32``; torch's default leaves matmuls in full fp32 (``allow_tf32`` False,
``float32_matmul_precision`` "highest") and cuDNN's flag, on by default, only reaches convolutions, which these
models have none of.  So that no library default can change that, the jobs here run their workers with
``NVIDIA_TF32_OVERRIDE=0`` (cuBLAS and cuDNN then never use TF32, whatever a program asks for), and
:func:`test_a_worker_computes_fp32_matmuls_without_tf32` measures it in a worker's environment (what torch
defaults to without the override is recorded, not asserted).

Tolerances (GPU against the CPU reference; the CPU tests use 1e-5 and 2e-5): losses and step-0 gradients 1e-4
relative (gradients against a floor of 1e-4 of the model's largest, as in ``tests/_equivalence.py``); parameters
after the last Adam step 1e-4 norm-relative and 1e-3 element-wise (both scaled for tensors smaller than a typical
matrix).  Without TF32 every kernel rounds like fp32, but cuBLAS picks other reduction orders (split-K, tiles)
than the CPU's BLAS and attention runs other kernels (memory-efficient attention accumulates in fp32 through
3xTF32 products), so each tensor carries a few ulps more of rounding than two CPU summation orders do (~1e-6
relative); Adam divides each element's update by the root of its own second moment, which turns that rounding,
in elements whose gradient nearly cancels, into parts of an lr-sized move (~1e-4 of the element on the CPU, see
``tests/test_runtime_train.py``): hence 10x the CPU bounds.  Replicas (DP copies, TP-duplicated norms) must still
agree exactly: NCCL hands every rank the same reduced values and the same kernels run on the same inputs.

Each test records what it measured (``record_property``: the JUnit XML that ``scripts/gpu_check.sh`` asks for
carries the figures into ``benchmarks/results/gpu_check_<host>.json``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import pytest

torch = pytest.importorskip("torch")

from _equivalence import rms  # noqa: E402

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.models import param_shapes  # noqa: E402
from hspmd_sdk.runtime.workers.devices import backend_for_device  # noqa: E402
from hspmd_sdk.runtime.reference import reference_result  # noqa: E402
from hspmd_sdk.runtime.control.train import (ReferenceResult, assemble, dataset_for, start_runs, load_captured,  # noqa: E402
                                     reference_training, training_run)
from hspmd_sdk.runtime.transports.transport import LocalTransport  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "hspmd_sdk" / "examples"
STEPS, SEED, SEQ, LR, BATCH = 3, 1, 24, 1e-3, 8  # SEQ: whole chunks for CP2's balanced layout (4 x 6 tokens)
LOSS_TOL, GRAD_TOL, PARAM_TOL, PARAM_ELEM_TOL = 1e-4, 1e-4, 1e-4, 1e-3  # why: the module docstring
#: every worker of these jobs: cuBLAS and cuDNN in full fp32, whatever torch's flags say
WORKER_ENV = {"NVIDIA_TF32_OVERRIDE": "0"}
JOB_TIMEOUT_S = 240


def need_gpus(n: int) -> None:
    """Skip the calling test (or fixture) unless torch sees at least ``n`` CUDA GPUs, saying what is missing."""
    if not torch.cuda.is_available():
        pytest.skip(f"needs {n} CUDA GPU(s): torch.cuda.is_available() is False here (torch {torch.__version__}, "
                    f"CUDA build {torch.version.cuda}); scripts/gpu_check.sh runs these on a GPU machine")
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"needs {n} CUDA GPUs (one per rank); this machine has {have}")


def _pipe(stages: list[tuple], mbs: int, n: int) -> dict[str, Any]:
    """A pipeline of ``stages`` (``(devices, layers[, cp])`` each), ``n`` micro-batches of ``mbs`` samples."""
    return {"stages": [{"devices": s[0], "layers": s[1], **({"cp": s[2]} if len(s) > 2 else {})} for s in stages],
            "micro_batch_size": mbs, "num_micro_batches": n}


#: name -> strategy, by the number of GPUs (= ranks) its job needs; every one trains a global batch of 8
ONE = {"one_rank": {"pipelines": [_pipe([([0], [0, 3])], 4, 2)]}}
TWO = {
    "dp2": {"pipelines": [_pipe([([0], [0, 3])], 2, 2), _pipe([([1], [0, 3])], 2, 2)]},
    # ZeRO-1: the parameters' gathers in buckets (broadcasts over NCCL), the gradients reduce-scattered
    "dp2_zero1": {"pipelines": [_pipe([([0], [0, 3])], 2, 2), _pipe([([1], [0, 3])], 2, 2)], "zero1": True},
    "tp2": {"pipelines": [_pipe([([0, 1], [0, 3])], 4, 2)]},
    "cp2": {"pipelines": [_pipe([([0, 1], [0, 3], 2)], 4, 2)]},
    "pp2_1f1b": {"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 2, 4)], "schedule": "1f1b"},
}
FOUR = {
    "hetero_tp": json.loads((EXAMPLES / "example_hetero_tiny.json").read_text()),
    "cp2_pipeline_beside_cp1": {"pipelines": [_pipe([([0, 1], [0, 1], 2), ([2], [2, 3])], 2, 2),
                                              _pipe([([3], [0, 3])], 2, 2)]},
}


# ---- the references -------------------------------------------------------------------------------------------
def _model() -> LlamaConfig:
    return LlamaConfig.preset("tiny")


def cuda_reference(config: LlamaConfig, device: str = "cuda:0") -> ReferenceResult:
    """The single-device reference trained on one GPU as :func:`reference_training` trains it on the CPU (the
    same data, ``AdamConfig.build``'s Adam: torch's fused kernel on CUDA), with TF32 off; results on the CPU.

    The forward runs under ``torch.device(device)``: :func:`hspmd_sdk.models.llama.reference.rope` builds its
    rotation with factory calls that name no device (on the CPU, which a CUDA tensor cannot be multiplied with)."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return _train_reference_on(config, device)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def _train_reference_on(config: LlamaConfig, device: str) -> ReferenceResult:
    """:func:`cuda_reference`'s training loop (the TF32 flags set by the caller)."""
    from hspmd_sdk.runtime.workers.executor import AdamConfig

    model = config.build_reference(SEED).to(device)
    opt = AdamConfig(lr=LR).build(list(model.parameters()))
    data = dataset_for("synthetic", config.vocab_size)
    losses, grads = [], {}
    for step in range(STEPS):
        feeds = config.feeds(data.global_batch(step, BATCH, SEQ, SEED))  # on the CPU: the data's own generator
        opt.zero_grad(set_to_none=True)
        with torch.device(device):
            loss = model.loss(feeds["tokens"].to(device), feeds["targets"].to(device))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    done = reference_result(model, opt, losses, grads)
    return ReferenceResult(done.losses, done.grads, {n: t.cpu() for n, t in done.params.items()},
                           {n: t.cpu() for n, t in done.exp_avg.items()},
                           {n: t.cpu() for n, t in done.exp_avg_sq.items()})


@pytest.fixture(scope="module")
def reference() -> ReferenceResult:
    """The CPU reference (:func:`reference_training`), with ``initial``: the starting state dict (only where a
    GPU test can run: every test here compares with it)."""
    need_gpus(1)
    config = _model()
    ref = reference_training(config, steps=STEPS, seed=SEED, global_batch=BATCH, seq_len=SEQ, lr=LR)
    ref.initial = dict(config.build_reference(SEED).state_dict())
    return ref


# ---- measuring a run against the reference ----------------------------------------------------------------------
def errors(run: Mapping[str, Any], reference: Any) -> dict[str, Any]:
    """What separates ``run`` (``losses``, ``spread`` and assembled ``grads``/``params``; ``grads`` may be
    empty) from ``reference`` (with ``initial``): the largest relative loss error, the largest floor-relative
    gradient error, the largest scaled norm-wise and element-wise parameter errors (each with the parameter it
    was found in), the largest move of a parameter whose update is rounding alone (in units of lr), and elements
    no rank held."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference.losses))
    floor = 1e-4 * max(float(g.abs().max()) for g in reference.grads.values())
    out: dict[str, Any] = {"loss": loss, "steps": len(run["losses"]), "spread": float(run.get("spread", 0.0)),
                           "grad": (0.0, ""), "param_norm": (0.0, ""), "param_elem": (0.0, ""),
                           "rounding_move_lr": (0.0, ""), "unheld": []}

    def worst(key: str, value: float, name: str) -> None:
        if value > out[key][0]:
            out[key] = (value, name)

    for name, full in reference.grads.items() if run.get("grads") else ():
        got = run["grads"][name]
        if torch.isnan(got).any():
            out["unheld"].append(f"grads:{name}")
            continue
        worst("grad", float((got - full).abs().max()) / max(float(full.abs().max()), floor), name)
    mats = sorted(rms(t) for t in reference.initial.values() if t.dim() == 2)
    typical = mats[len(mats) // 2]  # the median initial RMS of the matrices
    for name, full in reference.params.items():
        got = run["params"][name]
        if torch.isnan(got).any():
            out["unheld"].append(f"params:{name}")
            continue
        if float(reference.grads[name].abs().max()) < floor * 1e-3 or not bool(reference.initial[name].any()):
            # no gradient in exact arithmetic, or a zero start: the value is Adam's moves of rounding noise
            worst("rounding_move_lr", float((got - full).abs().max()) / LR, name)
            continue
        scale = max(1.0, typical / rms(reference.initial[name]))
        worst("param_norm", float((got - full).norm() / full.norm()) / scale, name)
        worst("param_elem", float((got - full).abs().max() / full.abs().max()) / scale, name)
    return out


def check(measured: Mapping[str, Any], record: Callable[[str, Any], None], *, steps: int = STEPS,
          spread: bool = True) -> None:
    """Record ``measured`` (from :func:`errors`) and assert the GPU tolerances, each failure naming its figure."""
    for key, value in measured.items():
        record(key, json.dumps(value))
    assert measured["steps"] == steps, f"{measured['steps']} losses for {steps} steps"
    assert not measured["unheld"], f"elements held by no rank: {measured['unheld']}"
    if spread:
        assert measured["spread"] == 0.0, f"replicas disagree by up to {measured['spread']:.3g}"
    assert measured["loss"] <= LOSS_TOL, f"loss relative error {measured['loss']:.3g} > {LOSS_TOL}"
    assert measured["grad"][0] <= GRAD_TOL, f"gradient error {measured['grad']} > {GRAD_TOL}"
    assert measured["param_norm"][0] <= PARAM_TOL, f"parameter norm error {measured['param_norm']} > {PARAM_TOL}"
    assert measured["param_elem"][0] <= PARAM_ELEM_TOL, \
        f"parameter element error {measured['param_elem']} > {PARAM_ELEM_TOL}"
    assert measured["rounding_move_lr"][0] <= 1e-2, \
        f"a parameter without gradient moved {measured['rounding_move_lr']} lr (> 0.01)"


# ---- training on the GPUs -------------------------------------------------------------------------------------
def train_on_gpus(table: Mapping[str, Mapping[str, Any]], world: int, out: Path) -> dict[str, dict[str, Any]]:
    """Train every strategy of ``table`` for :data:`STEPS` steps in one NCCL job of ``world`` ranks (one GPU
    each, :data:`WORKER_ENV` in their environment); per strategy its losses, assembled step-0 gradients and final
    parameters, and the largest disagreement between copies of an element."""
    config, cluster = _model(), Cluster.local(world)
    backend = backend_for_device("cuda", cluster)  # refuses here, naming what is missing, before any worker
    runs = [training_run(specialize(config, plan_from_strategy(config, Strategy.load(data), cluster), cluster),
                         steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, capture_dir=out, cluster=cluster)
            for data in table.values()]
    result = start_runs(runs, cluster, backend=backend, timeout_s=JOB_TIMEOUT_S,
                         transport=LocalTransport(env=WORKER_ENV)).wait()
    shapes = param_shapes(config)
    got = {}
    for i, name in enumerate(table):
        captured = load_captured(out, i)
        grads, grad_spread = assemble(captured, "grads", shapes)
        params, param_spread = assemble(captured, "params", shapes)
        got[name] = {"losses": result.results[0]["runs"][i]["losses"], "grads": grads, "params": params,
                     "spread": max(grad_spread, param_spread)}
    return got


@pytest.fixture(scope="module")
def trained_one(tmp_path_factory: pytest.TempPathFactory) -> dict:
    need_gpus(1)
    return train_on_gpus(ONE, 1, tmp_path_factory.mktemp("gpu1"))


@pytest.fixture(scope="module")
def trained_two(tmp_path_factory: pytest.TempPathFactory) -> dict:
    need_gpus(2)
    return train_on_gpus(TWO, 2, tmp_path_factory.mktemp("gpu2"))


@pytest.fixture(scope="module")
def trained_four(tmp_path_factory: pytest.TempPathFactory) -> dict:
    need_gpus(4)
    return train_on_gpus(FOUR, 4, tmp_path_factory.mktemp("gpu4"))


@pytest.mark.gpu
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_one_gpu_trains_like_the_single_device_model(trained_one: dict, reference: ReferenceResult,
                                                     record_property: Callable[[str, Any], None]) -> None:
    check(errors(trained_one["one_rank"], reference), record_property)


@pytest.mark.gpu
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(TWO))
def test_two_gpus_over_nccl_train_like_the_single_device_model(name: str, trained_two: dict,
                                                               reference: ReferenceResult,
                                                               record_property: Callable[[str, Any], None]) -> None:
    check(errors(trained_two[name], reference), record_property)


@pytest.mark.gpu
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(FOUR))
def test_four_gpus_mixed_plans_train_like_the_single_device_model(name: str, trained_four: dict,
                                                                  reference: ReferenceResult,
                                                                  record_property: Callable[[str, Any], None]
                                                                  ) -> None:
    check(errors(trained_four[name], reference), record_property)


# ---- the device itself ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_the_reference_trained_on_a_gpu_matches_the_cpu_reference(reference: ReferenceResult,
                                                                  record_property: Callable[[str, Any], None]
                                                                  ) -> None:
    """The device's own share of the error budget: the plain module on one GPU (TF32 off) against the CPU."""
    need_gpus(1)
    on_gpu = cuda_reference(_model())
    check(errors({"losses": on_gpu.losses, "grads": on_gpu.grads, "params": on_gpu.params}, reference),
          record_property, spread=False)


#: run in a fresh interpreter with a worker's modules imported: how a worker's fp32 matmul rounds on cuda:0
_MATMUL_PROBE = """
import json, torch
import hspmd_sdk.runtime.workers.worker, hspmd_sdk.runtime.workers.session, hspmd_sdk.runtime.workers.executor  # what a worker imports
g = torch.Generator().manual_seed(0)
a, b = torch.randn(2048, 2048, generator=g), torch.randn(2048, 2048, generator=g)
exact = a.double() @ b.double()
got = (a.cuda() @ b.cuda()).double().cpu()
print(json.dumps({"rel_err": float((got - exact).abs().max() / exact.abs().max()),
                  "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                  "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                  "float32_matmul_precision": torch.get_float32_matmul_precision()}))
"""


def _probe(env: Mapping[str, str | None]) -> dict[str, Any]:
    """:data:`_MATMUL_PROBE`'s figures in a child process with this one's environment changed by ``env`` (a
    ``None`` value removes the variable)."""
    child = {**os.environ, **{k: v for k, v in env.items() if v is not None}}
    for k in [k for k, v in env.items() if v is None]:
        child.pop(k, None)
    done = subprocess.run([sys.executable, "-c", _MATMUL_PROBE], capture_output=True, text=True, timeout=90,
                          env=child, cwd=str(REPO))
    assert done.returncode == 0, f"the matmul probe failed (exit {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.timeout(200)
def test_a_worker_computes_fp32_matmuls_without_tf32(record_property: Callable[[str, Any], None]) -> None:
    """A 2048^3 fp32 matmul's largest error against fp64, relative to the largest element: ~3e-7 in IEEE fp32,
    ~3e-4 with TF32's 10-bit mantissa (both measured on the CPU, TF32 by rounding the inputs).  With the jobs'
    environment it must be fp32's; torch's default (no override) is recorded."""
    need_gpus(1)
    forced = _probe(dict(WORKER_ENV))
    default = _probe({"NVIDIA_TF32_OVERRIDE": None})
    record_property("with_override", json.dumps(forced))
    record_property("torch_default", json.dumps(default))
    assert forced["rel_err"] < 1e-5, f"fp32 matmul with NVIDIA_TF32_OVERRIDE=0 rounds like TF32: {forced}"
    assert not forced["allow_tf32"], f"a worker's torch enables TF32 matmuls on import: {forced}"
