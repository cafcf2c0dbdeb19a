"""The optimizer of a rank's shards (paper §6.3): Adam's options, the optimizer over the fp32 master shards, its state
by parameter name, and clipping by the global gradient norm.

:class:`torch.optim.Adam` runs on the shards (elementwise, so shard-wise Adam is Adam); :func:`state_by_name` /
:func:`load_state_by_name` give its state by parameter name (what checkpoints and switches move).  The global norm
counts every element of the model once: each rank sums the squares of the elements it owns (:func:`owned_slices`,
:func:`owned_grad_sq`), the world sums those, and :func:`clip_gradients` scales every gradient by
:func:`clip_coefficient` of the result, as ``torch.nn.utils.clip_grad_norm_`` does on one device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ...errors import PlanValidationError
from .errors import ExecutorError

if TYPE_CHECKING:
    from ...core.specialize import Program

__all__ = ["AdamConfig", "DECAY_RULES", "OPTIMIZERS", "clip_coefficient", "fused_adam_available", "adam_step_state",
           "adam_problems", "state_by_name", "load_state_by_name", "owned_slices", "owned_parts", "owned_grad_sq",
           "clip_gradients"]


@dataclass(frozen=True)
class AdamConfig:
    """``torch.optim.Adam`` hyper-parameters, checked when made (so a bad value fails before any worker runs)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: which parameters ``weight_decay`` applies to: ``"matrices"`` (those of 2 dimensions or more: none on norms
    #: and biases, nanoGPT's and Megatron's rule) or ``"all"``
    decay: str = "matrices"
    #: ``"adam"`` (``torch.optim.Adam``: weight decay added to the gradients) or ``"adamw"`` (``torch.optim.AdamW``:
    #: decoupled weight decay, what GPT training usually means by it)
    kind: str = "adam"

    def __post_init__(self) -> None:
        problems = adam_problems(self.lr, self.betas, self.eps, self.weight_decay)
        if self.decay not in DECAY_RULES:
            problems.append(("decay", f"must be one of {list(DECAY_RULES)}, not {self.decay!r}"))
        if self.kind not in OPTIMIZERS:
            problems.append(("optimizer", f"must be one of {list(OPTIMIZERS)}, not {self.kind!r}"))
        if problems:
            raise PlanValidationError(problems, what="optimizer options")

    def groups(self, params: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
        """The parameter groups: one, or with ``weight_decay`` under the ``"matrices"`` rule the parameters of 2
        dimensions or more (decayed) and the rest (norms, biases: ``weight_decay=0``).  A shard has its tensor's
        number of dimensions, so every rank splits its shards as the single-device model splits its tensors."""
        params = list(params)
        if self.weight_decay == 0.0 or self.decay == "all":
            return [{"params": params}]
        return [g for g in ({"params": [p for p in params if p.dim() >= 2]},
                            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}) if g["params"]]

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Adam:
        """``torch.optim.Adam`` over ``params`` (fp32, one device, contiguous) with these options, as every rank
        and the single-device reference run it: torch's fused kernel where this torch has one for the device
        (:func:`fused_adam_available`: CPU since torch 2.4, CUDA), else the for-loop implementation.  One kernel
        for all: the update is elementwise, so a shard's update is the full tensor's on those elements (the fused
        kernel's vector tail may round one element of an odd-sized shard differently by an ulp; measured 5x
        faster on this CPU than the loop for the bench model's 38 tensors, 1.8 vs 9.3 ms).  The fused kernel
        ignores strides: parameters, gradients and state must be contiguous (the executor makes them so)."""
        params = list(params)
        kw = dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        groups = self.groups(params)
        cls = torch.optim.AdamW if self.kind == "adamw" else torch.optim.Adam
        if params and all(fused_adam_available(p) for p in params):
            return cls(groups, fused=True, **kw)
        return cls(groups, foreach=False, **kw)


#: ``AdamConfig.decay``: which parameters weight decay applies to.
DECAY_RULES = ("matrices", "all")
#: ``AdamConfig.kind``: the optimizers.
OPTIMIZERS = ("adam", "adamw")


def clip_coefficient(norm: float, max_norm: float) -> torch.Tensor:
    """The factor gradients are scaled by for a global ``norm``: ``min(1, max_norm / (norm + 1e-6))``, in fp32
    exactly as ``torch.nn.utils.clip_grad_norm_`` computes it (so a clipped step is the single-device one)."""
    total = torch.tensor(norm, dtype=torch.float32)
    return torch.clamp(torch.tensor(max_norm, dtype=torch.float32) / (total + 1e-6), max=1.0)


def fused_adam_available(t: torch.Tensor) -> bool:
    """Whether this torch has a fused Adam kernel for ``t``'s device and dtype (checked here: torch itself only
    checks at the first ``step()``)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        devices = _get_fused_kernels_supported_devices()
    except ImportError:  # a torch without the helper has no CPU kernel; CUDA's is older than the helper
        devices = ["cuda"]
    return t.device.type in devices and t.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def adam_step_state(step: float, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Adam's ``step`` entry for ``param`` as ``optimizer`` keeps it (fused: fp32 on the parameter's device)."""
    fused = bool(optimizer.defaults.get("fused"))
    return torch.tensor(float(step), dtype=torch.float32, device=param.device if fused else "cpu")


def adam_problems(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> list[tuple[str, str]]:
    """Adam's options as ``(field, reason)`` problems: finite, ``lr > 0``, ``0 <= beta < 1``, ``eps > 0``,
    ``weight_decay >= 0`` (checked by the launcher before any worker starts, and by :class:`AdamConfig`)."""
    def bad(value: Any) -> bool:
        return isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)

    out = []
    for name, v, strict in (("lr", lr, True), ("eps", eps, True), ("weight_decay", weight_decay, False)):
        if bad(v) or (v <= 0 if strict else v < 0):
            out.append((name, f"must be a finite number {'>' if strict else '>='} 0, not {v!r}"))
    betas = tuple(betas) if isinstance(betas, (tuple, list)) else (betas,)
    if len(betas) != 2 or any(bad(b) or not 0.0 <= b < 1.0 for b in betas):
        out.append(("betas", f"must be two finite numbers in [0, 1), not {betas!r}"))
    return out


def state_by_name(params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """Adam's state of ``params`` (a rank's shards) by parameter name: ``{"exp_avg", "exp_avg_sq"}`` (tensors of the
    parameter's box) and ``"step"`` (a float) — empty dicts before the first step."""
    out: dict[str, dict[str, Any]] = {}
    for name, p in params.items():
        st = optimizer.state.get(p, {})
        out[name] = {k: (float(v) if k == "step" else v) for k, v in st.items()}
    return out


def load_state_by_name(params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                       state: Mapping[str, Mapping[str, Any]], *, rank: int) -> None:
    """Set Adam's state of ``params`` from :func:`state_by_name`'s form (every local parameter, shards of its box);
    the errors name ``rank``."""
    missing = sorted(set(params) - set(state))
    if missing:
        raise ExecutorError(f"rank {rank}: optimizer state lacks parameter(s) {missing[:5]}")
    for name, p in params.items():
        st = state[name]
        if not st:
            continue
        new: dict[str, Any] = {"step": adam_step_state(st["step"], p, optimizer)}
        for k in ("exp_avg", "exp_avg_sq"):
            t = st[k]
            if tuple(t.shape) != tuple(p.shape):
                raise ExecutorError(f"rank {rank}: optimizer state {name}.{k} has shape {tuple(t.shape)}, "
                                    f"the parameter's shard {tuple(p.shape)}")
            new[k] = t.detach().to(device=p.device, dtype=torch.float32).clone(
                memory_format=torch.contiguous_format)  # the fused kernel ignores strides
        optimizer.state[p] = new


def owned_slices(program: "Program", params: Mapping[str, torch.Tensor], rank: int
                 ) -> dict[str, tuple[tuple[slice, ...], ...]]:
    """Parameter name -> the slices of ``rank``'s shard whose elements it owns (each element of the model is owned
    by exactly one rank: :func:`~hspmd_sdk.core.ownership.owned_boxes`), for sums that must count every element
    once (the gradient's global norm)."""
    from ...core.ownership import owned_boxes

    out = {}
    for name in params:
        shape = tuple(int(d) for d in program.graph.tensors[name].shape)
        boxes = owned_boxes(program.annotations[name], shape, rank)
        out[name] = tuple(tuple(slice(a, b) for a, b in box) for box in boxes)
    return out


def owned_parts(params: Mapping[str, torch.Tensor], slices: Mapping[str, tuple[tuple[slice, ...], ...]]
                ) -> list[tuple[torch.Tensor, tuple[slice, ...] | None]]:
    """``(parameter, slice)`` per owned part of :func:`owned_slices` (``None``: the whole shard), worked out once."""
    return [(params[name], None if _whole(sl, params[name]) else sl) for name, sls in slices.items() for sl in sls]


def owned_grad_sq(parts: Sequence[tuple[torch.Tensor, tuple[slice, ...] | None]]) -> float:
    """The squared L2 norm of the gradient elements of ``parts`` (:func:`owned_parts`): the norm of each part in the
    gradient's dtype as ``clip_grad_norm_`` computes a tensor's, their squares summed in fp64.  Summed over the
    world, the squared global norm of the single-device model."""
    grads = [g if sl is None else g[sl] for p, sl in parts if (g := p.grad) is not None]
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads)  # one kernel launch for all of them
    return float(torch.stack(norms).to(torch.float64).pow(2).sum())


def clip_gradients(params: Sequence[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale every gradient of ``params`` by :func:`clip_coefficient` of the global ``norm``; a coefficient of
    exactly 1 (a norm within ``max_norm``) leaves them as they are, as a product by 1 would."""
    coefficient = clip_coefficient(norm, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    if grads and float(coefficient) < 1.0:
        torch._foreach_mul_(grads, coefficient.to(grads[0].device))


def _whole(slices: tuple[slice, ...], t: torch.Tensor) -> bool:
    """Whether ``slices`` select all of ``t``."""
    return all(sl.start in (0, None) and sl.stop in (n, None) for sl, n in zip(slices, t.shape))
