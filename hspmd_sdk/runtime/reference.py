"""The independent references a distributed run must match, and the captured shards it is compared by.

* :func:`reference_training` — the plain single-device model (:func:`hspmd_sdk.models.build_reference`) trained
  with ``torch.optim.Adam`` on the same data as a run of :func:`~.train.launch`;
* :func:`reference_mixed` — the same on mixed-length data, a step in one padded batch of its own (whatever the
  dispatch), with the run's loss normalisation;
* :func:`load_captured` / :func:`assemble` — the shards each rank saved with ``capture_dir=``, as full tensors.

Neither side of a job: a notebook, a test or a benchmark calls them beside a launch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .data import LengthBatches, dataset_for, documents_for, padded_rows, validation_of
from .lr_schedule import schedule_of
from .spec import PRECISIONS
from .workers.executor import AdamConfig
from .workers.kernels import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

    from ..core.model_spec import ModelSpec
    from ..data.corpus import TokenCorpus
    from .lr_schedule import Schedule
    from .train_config import TrainConfig

__all__ = ["ReferenceResult", "reference_training", "reference_mixed", "reference_result", "load_captured",
           "assemble"]


def load_captured(capture_dir: str | Path, index: int = 0) -> list[dict[str, Any]]:
    """Every rank's saved shards of run ``index`` (``{"grads", "params", "exp_avg", "exp_avg_sq",
    "optimizer_step", "boxes"}`` each)."""
    import torch

    return [torch.load(p, map_location="cpu") for p in sorted(Path(capture_dir).glob(f"run{index}_rank*.pt"))]


def assemble(captured: Sequence[Mapping[str, Any]], which: str, shapes: Mapping[str, Sequence[int]]
             ) -> tuple[dict[str, "torch.Tensor"], float]:
    """Full tensors from the ranks' shards (``which``: ``"grads"``, ``"params"``, ``"exp_avg"`` or
    ``"exp_avg_sq"``) of the tensors ``shapes`` names, and the largest difference between two ranks' copies of the
    same element (replicas must agree)."""
    import torch

    full = {n: torch.full(tuple(s), float("nan")) for n, s in shapes.items()}
    worst = 0.0
    for cap in captured:
        for name, t in cap[which].items():
            if name not in full:
                continue
            idx = tuple(slice(a, b) for a, b in cap["boxes"][name])
            cur = full[name][idx]
            seen = ~torch.isnan(cur)
            if seen.any():
                worst = max(worst, float((cur[seen] - t[seen]).abs().max()))
            full[name][idx] = t
    return full, worst


@dataclass
class ReferenceResult:
    """Losses per step, the gradients of step 0, the parameters and Adam moments after the last step (full
    tensors)."""

    losses: list[float]
    grads: dict[str, Any]
    params: dict[str, Any]
    exp_avg: dict[str, Any] = field(default_factory=dict)
    exp_avg_sq: dict[str, Any] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)  # per step, before clipping (clip_grad_norm_'s)
    lrs: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)


def _loss_and_grads(work: "torch.nn.Module", feeds: Mapping[str, Any], copies: list["torch.nn.Parameter"] | None,
                    masters: list["torch.nn.Parameter"]) -> "torch.Tensor":
    """The step's loss of module ``work`` on ``feeds``, backward done; ``copies``: ``work``'s parameters when it is
    a bf16 copy of the fp32 ``masters`` (set from them first; their gradients become the masters', in fp32)."""
    import torch

    if copies is not None:
        with torch.no_grad():
            for c, m in zip(copies, masters):
                c.copy_(m)
                c.grad = None
    loss = work.loss(feeds["tokens"], feeds["targets"])
    loss.backward()
    if copies is not None:
        for c, m in zip(copies, masters):
            m.grad = c.grad.float() if c.grad is not None else torch.zeros_like(m)
    return loss


def reference_training(config: "ModelSpec", *, steps: int | None = None, seed: int = 0, global_batch: int | None = None,
                       seq_len: int | None = None,
                       data: str = "stdlib", lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999),
                       eps: float = 1e-8, weight_decay: float = 0.0,
                       init: Mapping[str, Any] | None = None, precision: str = "fp32",
                       schedule: "Schedule | dict | str | None" = None,
                       max_norm: float | None = None, decay: str = "matrices", optimizer: str = "adam",
                       eval_every: int | None = None,
                       eval_batches: int = 4, train_config: "TrainConfig | None" = None) -> ReferenceResult:
    """Train the model's single-device reference (``config.build_reference``) on one device with
    ``torch.optim.Adam`` (:meth:`~.executor.AdamConfig.build`: the ranks' kernel) on the same data (``config``
    is any :class:`~hspmd_sdk.models.ModelSpec`).
    ``init``: a state dict to start from instead of the seeded initialisation.

    ``precision="bf16"``: the distributed runtime's recipe on one device — a bf16 copy of the fp32 master module
    computes the step (bf16 parameters, activations and gradients, the loss in fp32), its gradients become the
    masters' (fp32) and Adam updates the masters with fp32 state.  ``grads`` and ``params`` are the masters'.

    ``schedule``, ``max_norm``, ``decay``, ``optimizer``, ``eval_every``/``eval_batches`` as for ``launch``: each step's learning
    rate from the schedule, the gradients clipped by ``torch.nn.utils.clip_grad_norm_`` (its norm, before
    clipping, is the step's ``grad_norms`` entry), weight decay on the parameter groups ``decay`` names, and the
    validation loss of the data's validation split (forward only, in eval mode) after every ``eval_every``-th
    step.

    ``train_config``: a :class:`~.train_config.TrainConfig` whose run, data, optimizer, schedule, clip and eval
    sections give those keywords instead (``global_batch`` from ``run.global_batch`` unless given)."""
    import copy

    import torch

    if train_config is not None:
        c = train_config
        return reference_training(
            config, steps=c.run.steps, seed=c.run.seed, global_batch=global_batch or c.run.global_batch,
            seq_len=c.run.seq_len, data=c.data.path, lr=c.optimizer.lr, betas=c.optimizer.betas,
            eps=c.optimizer.eps, weight_decay=c.optimizer.weight_decay, decay=c.optimizer.decay,
            optimizer=c.optimizer.kind, init=init,
            precision=c.run.precision, schedule=c.schedule, max_norm=c.clip.max_norm, eval_every=c.eval.every,
            eval_batches=c.eval.batches)
    if steps is None or global_batch is None:
        raise ValueError("reference_training needs steps= and global_batch= (or a train_config= that has them)")

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, not {precision!r}")
    seq_len = int(seq_len or config.max_seq_len)
    model = config.build_reference(seed)
    if init is not None:
        model.load_state_dict({k: v.detach().clone() for k, v in init.items()})
    work = model if precision == "fp32" else copy.deepcopy(model).to(torch.bfloat16)
    masters, copies = list(model.parameters()), list(work.parameters())
    opt = AdamConfig(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, decay=decay,
                     kind=optimizer).build(masters)
    sched = schedule_of(schedule)
    dataset = dataset_for(data, config.vocab_size)
    losses, grads, norms, lrs, vals = [], {}, [], [], {}
    for step in range(steps):
        lrs.append(sched.lr(step, lr, steps))
        for group in opt.param_groups:
            group["lr"] = lrs[-1]
        feeds = config.feeds(dataset.global_batch(step, global_batch, seq_len, seed))
        opt.zero_grad(set_to_none=True)
        loss = _loss_and_grads(work, feeds, copies if work is not model else None, masters)
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norms.append(_clip(masters, max_norm))
        opt.step()
        losses.append(float(loss.detach()))
        if eval_every and (step + 1) % eval_every == 0:
            vals[step] = _validation_loss(work, config, dataset, eval_batches, global_batch, seq_len)
    out = reference_result(model, opt, losses, grads)
    out.grad_norms, out.lrs, out.val_losses = norms, lrs, vals
    return out


def _clip(params: Sequence["torch.nn.Parameter"], max_norm: float | None) -> float:
    """``torch.nn.utils.clip_grad_norm_`` over ``params`` (only measuring the norm when ``max_norm`` is None);
    returns the norm before clipping."""
    import torch

    grads = [p for p in params if p.grad is not None]
    if max_norm is None:
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads])))
    return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))


def _validation_loss(model: "torch.nn.Module", config: "ModelSpec", dataset: "TokenCorpus", batches: int,
                     global_batch: int, seq_len: int) -> float:
    """The mean loss of the first ``batches`` validation batches, forward only."""
    import torch

    total = 0.0
    with torch.no_grad():
        for i in range(batches):
            feeds = config.feeds(dataset.val_batch(i, global_batch, seq_len))
            total += float(model.loss(feeds["tokens"], feeds["targets"]))
    return total / batches


def reference_result(model: "torch.nn.Module", opt: "torch.optim.Optimizer", losses: list[float],
                     grads: dict[str, "torch.Tensor"]) -> "ReferenceResult":
    """A finished single-device run as a :class:`ReferenceResult`: its losses, step-0 gradients, and the final
    parameters and Adam moments of ``model`` under ``opt`` (copies)."""
    named = dict(model.named_parameters())
    state = {n: opt.state.get(p, {}) for n, p in named.items()}
    return ReferenceResult(losses, grads, {n: p.detach().clone() for n, p in named.items()},
                           {n: s["exp_avg"].clone() for n, s in state.items() if "exp_avg" in s},
                           {n: s["exp_avg_sq"].clone() for n, s in state.items() if "exp_avg_sq" in s})


def reference_mixed(model: "ModelSpec", *, steps: int, tokens_per_step: int, data: Any = "stdlib-docs",
                    context: int | None = None, seed: int = 0, lr: float = 1e-3,
                    betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                    init: Mapping[str, Any] | None = None, schedule: "Schedule | dict | str | None" = None,
                    max_norm: float | None = None,
                    decay: str = "matrices", optimizer: str = "adam", eval_every: int | None = None,
                    eval_batches: int = 4,
                    eval_context: int | None = None) -> "ReferenceResult":
    """The model's single-device reference (``model.build_reference(seed)``, ``torch.optim.Adam``) on the same
    steps of mixed-length data: all of a step's sequences in one batch, padded on the right with target ``-100``
    (which the reference's ``loss`` ignores: the mean over the step's real target tokens; causal attention keeps
    padding out of real positions) — independent of how the dispatcher cut the step into micro-batches; ``init``: a
    state dict to start from instead of the seeded initialisation; ``eval_every`` / ``eval_batches`` /
    ``eval_context``: the validation loss of a prepared corpus's validation split cut at ``eval_context`` tokens
    (:class:`~.data.ValidationSequences`, what the distributed run reads), each batch padded, after every
    ``eval_every``-th step.  Returns
    a :class:`ReferenceResult` (``grads`` of step 0, final ``params`` and Adam moments)."""

    context = int(model.max_seq_len if context is None else context)
    batches = LengthBatches(documents_for(data, model.vocab_size), context=context, tokens_per_step=tokens_per_step,
                            seed=seed)
    ref = model.build_reference(seed)
    if init is not None:
        ref.load_state_dict({k: v.detach().clone() for k, v in init.items()})
    params = list(ref.parameters())
    opt = AdamConfig(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, decay=decay,
                     kind=optimizer).build(params)
    sched = schedule_of(schedule)
    losses, grads, norms, lrs, vals = [], {}, [], [], {}
    for step in range(steps):
        lrs.append(sched.lr(step, lr, steps))
        for group in opt.param_groups:
            group["lr"] = lrs[-1]
        rows = padded_rows(batches.step_sequences(step), IGNORE_INDEX)
        tokens, targets = rows[:, :-1].clamp(min=0), rows[:, 1:]
        opt.zero_grad(set_to_none=True)
        loss = ref.loss(tokens, targets)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        norms.append(_clip(params, max_norm))
        opt.step()
        losses.append(float(loss.detach()))
        if eval_every and (step + 1) % eval_every == 0:
            vals[step] = _mixed_validation_loss(ref, data, eval_context or context, tokens_per_step, eval_batches)
    out = reference_result(ref, opt, losses, grads)
    out.grad_norms, out.lrs, out.val_losses = norms, lrs, vals
    return out


def _mixed_validation_loss(model: "torch.nn.Module", data: "str | Path", context: int, tokens_per_step: int, batches: int) -> float:
    """The mean over ``batches`` validation batches (:func:`~.data.validation_of` of ``data``, a prepared corpus)
    of each batch's loss, its sequences in one padded batch."""
    import torch

    spec = {"source": {"corpus": str(Path(data).expanduser().resolve())}, "tokens_per_step": tokens_per_step}
    val = validation_of(spec, context)
    total = 0.0
    with torch.no_grad():
        for i in range(batches):
            rows = padded_rows(val.batch(i), IGNORE_INDEX)
            total += float(model.loss(rows[:, :-1].clamp(min=0), rows[:, 1:]))
    return total / batches
