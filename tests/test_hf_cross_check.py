"""Cross-implementation check of a whole training run (issue 44): the SDK against Hugging Face ``transformers``
trained by a plain PyTorch loop.

Both sides start from the same GPT-2 (the tiny preset, fp32): the SDK's seeded initialisation, exported with
``to_hf`` and loaded by ``transformers.GPT2LMHeadModel.from_pretrained``.  They read the same batches (the SDK's
dataset, ``global_batch(step, B, S, seed)``, cut into inputs and targets as ``model.feeds`` cuts them: ``seq[:,
:-1]`` and ``seq[:, 1:]``), and run the same recipe written out here by hand on the Hugging Face side:

* ``torch.optim.Adam`` (torch's default implementation for these tensors, not the SDK's fused kernel) with the
  same betas, eps and coupled weight decay, on the same parameter groups: tensors of 2 dims or more decayed, the
  rest not.  Hugging Face's ``lm_head.weight`` *is* ``transformer.wte.weight`` (tied), so it is one parameter in
  ``hf.parameters()``: counted once by Adam and by the clipping norm, as the SDK counts ``wte.weight`` once;
* the learning rate of each step from :meth:`Schedule.lr` (warmup, then cosine to 0.1x);
* ``torch.nn.utils.clip_grad_norm_`` over Hugging Face's parameters, with ``max_norm`` set so that about half
  of the steps are clipped (asserted: some are, some are not).

Over 100 steps at lr 3e-4 the Hugging Face loop, the SDK's single-device ``reference_training`` and the SDK's
4-rank heterogeneous run (``example_hetero_tiny``: a TP2 stage then a TP1 stage beside a 1-rank pipeline,
uneven micro-batches) give the same loss curve and the same global gradient norms, within 1e-4 relative
(measured: ~2e-7).  Every in-process loop runs with one torch thread (with two, on 2 shared cores, a step of this
model costs 20x more).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch.nn.functional as F  # noqa: E402

from hspmd_sdk import Cluster, GPTConfig, Strategy, launch, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.models import to_hf  # noqa: E402
from hspmd_sdk.runtime.control.train import reference_training  # noqa: E402
from hspmd_sdk.runtime.data import dataset_for  # noqa: E402
from hspmd_sdk.runtime.lr_schedule import Schedule  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"
STEPS, SEED, B, S = 100, 3, 8, 64
LR, BETAS, EPS, WD, MAX_NORM = 3e-4, (0.9, 0.95), 1e-8, 0.1, 2.2
SCHEDULE = Schedule(kind="cosine", warmup_steps=10, min_lr_factor=0.1)
DATA = "stdlib"  # the standard library's bytes (vocabulary 256): real text, no preparation
TOL = 1e-4


@pytest.fixture(scope="module")
def config() -> GPTConfig:
    return GPTConfig.preset("tiny")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _hf_model(config: GPTConfig, directory: Path) -> Any:
    to_hf(config, config.build_reference(SEED).state_dict(), directory)
    hf = transformers.GPT2LMHeadModel.from_pretrained(directory)
    hf.train()  # the written config has every dropout at 0
    return hf


def hf_training(config: GPTConfig, directory: Path) -> dict[str, list[float]]:
    """The plain PyTorch loop over Hugging Face's GPT-2: nothing of the SDK but its data and schedule formula."""
    hf = _hf_model(config, directory)
    params = list(hf.parameters())  # unique tensors: the tied lm_head.weight is transformer.wte.weight
    groups = [{"params": [p for p in params if p.dim() >= 2]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.Adam(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    data = dataset_for(DATA, config.vocab_size)
    out: dict[str, list[float]] = {"losses": [], "grad_norms": [], "lrs": []}
    for step in range(STEPS):
        lr = SCHEDULE.lr(step, LR, STEPS)
        for g in opt.param_groups:
            g["lr"] = lr
        seq = data.global_batch(step, B, S, SEED)
        tokens, targets = seq[:, :-1], seq[:, 1:]
        opt.zero_grad(set_to_none=True)
        logits = hf(input_ids=tokens).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        out["grad_norms"].append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
        out["losses"].append(float(loss.detach()))
        out["lrs"].append(lr)
    return out


RECIPE = dict(seed=SEED, seq_len=S, data=DATA, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, decay="matrices",
              schedule=SCHEDULE, max_norm=MAX_NORM)


@pytest.fixture(scope="module")
def hf_run(config: GPTConfig, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    return hf_training(config, tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def reference(config: GPTConfig) -> Any:
    return reference_training(config, steps=STEPS, global_batch=B, **RECIPE)


@pytest.fixture(scope="module")
def distributed(config: GPTConfig) -> Any:
    cluster = Cluster.local(4)
    strategy = Strategy.load(json.loads((EXAMPLES / "example_hetero_tiny.json").read_text()))
    program = specialize(config, plan_from_strategy(config, strategy, cluster), cluster)
    return launch(program, cluster, steps=STEPS, timeout_s=300, **RECIPE).wait()


def _rel(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) == STEPS, (len(got), len(want))
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def test_the_two_models_are_the_same_parameters(config: GPTConfig, tmp_path: Path) -> None:
    """Hugging Face's model holds the SDK's elements once each (its LM head is its token embedding), in the
    same decay groups by size: what makes the two optimizers and the two norms comparable."""
    hf = _hf_model(config, tmp_path)
    assert hf.lm_head.weight is hf.transformer.wte.weight
    assert next(hf.parameters()).dtype == torch.float32
    ours = config.build_reference(SEED).state_dict()
    for dims in (lambda d: d >= 2, lambda d: d < 2):
        assert sum(p.numel() for p in hf.parameters() if dims(p.dim())) == \
            sum(t.numel() for t in ours.values() if dims(t.dim()))
    assert sum(p.numel() for p in hf.parameters()) == config.param_count()


def test_the_recipe_is_active(hf_run: dict[str, list[float]]) -> None:
    """The check is not vacuous: some steps are clipped and some are not, the learning rate warms up and decays,
    and the model learns (the loss falls well below its start, ln 256 = 5.55)."""
    clipped = sum(n > MAX_NORM for n in hf_run["grad_norms"])
    assert 10 <= clipped <= STEPS - 10, clipped
    assert hf_run["lrs"][0] < hf_run["lrs"][10] == pytest.approx(LR) and hf_run["lrs"][-1] < 0.2 * LR
    assert sum(hf_run["losses"][-10:]) / 10 < hf_run["losses"][0] - 1.0


def test_reference_training_equals_hugging_face(reference: Any, hf_run: dict[str, list[float]]) -> None:
    assert reference.lrs == pytest.approx(hf_run["lrs"], rel=1e-12)
    assert _rel(reference.losses, hf_run["losses"]) <= TOL
    assert _rel(reference.grad_norms, hf_run["grad_norms"]) <= TOL


def test_heterogeneous_four_ranks_equal_hugging_face(distributed: Any, hf_run: dict[str, list[float]]) -> None:
    assert distributed.lrs == pytest.approx(hf_run["lrs"], rel=1e-6)
    assert _rel(distributed.losses, hf_run["losses"]) <= TOL
    assert _rel(distributed.grad_norms, hf_run["grad_norms"]) <= TOL
