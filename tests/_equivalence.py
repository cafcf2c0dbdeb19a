"""The comparison of a distributed training run with the single-device reference, shared by the equality tests of
uneven TP ratios (test_hap_ratios.py) and context parallelism (test_cp_train.py), as tests/test_runtime_train.py
does it: losses relative; gradients relative to a floor of 1e-4 of the largest; parameters norm-relative, scaled
for tensors much smaller than a typical matrix, and those with (almost) no gradient to within 1e-2 lr."""
from __future__ import annotations

from typing import Any


def rms(t: Any) -> float:
    return float(t.double().pow(2).mean().sqrt())


def close_to_reference(run: dict, reference: Any, *, steps: int, lr: float, tol: float = 1e-5,
                       param_tol: float = 2e-5, grads: bool = True) -> None:
    """``run``: ``losses``, ``spread`` (disagreement between copies), assembled ``grads`` and ``params``;
    ``reference``: a ``reference_training`` result with ``initial`` (the starting state dict) set."""
    import torch

    loss_err = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference.losses))
    assert len(run["losses"]) == steps and loss_err <= tol, (run["losses"], reference.losses)
    assert run["spread"] == 0.0
    floor = 1e-4 * max(float(g.abs().max()) for g in reference.grads.values())
    for pname, full in reference.grads.items() if grads else ():
        assert not torch.isnan(run["grads"][pname]).any(), f"{pname}: some element held by no rank"
        err = float((run["grads"][pname] - full).abs().max()) / max(float(full.abs().max()), floor)
        assert err <= tol, (pname, err)
    mats = sorted(rms(t) for t in reference.initial.values() if t.dim() == 2)
    typical = mats[len(mats) // 2]
    for pname, full in reference.params.items():
        got = run["params"][pname]
        if float(reference.grads[pname].abs().max()) < floor * 1e-3 or not bool(reference.initial[pname].any()):
            assert float((got - full).abs().max()) <= 1e-2 * lr, pname
            continue
        scale = max(1.0, typical / rms(reference.initial[pname]))
        norm = float((got - full).norm() / full.norm()) / scale
        elem = float((got - full).abs().max() / full.abs().max()) / scale
        assert norm <= param_tol and elem <= 3e-4, (pname, norm, elem)


def captured_close_to_reference(capture_dir: Any, losses: list[float], model: Any, reference: Any, *, seed: int,
                                steps: int, lr: float, index: int = 0) -> None:
    """:func:`close_to_reference` for run ``index`` of a ``capture_dir=``: its losses, step 0's gradients and the
    final parameters.  The losses alone cannot tell: Adam's step is scale-free, and a random model's loss is
    ln(vocab) to six digits (a TP2 stage once gave about half of every gradient below the LM head; the losses
    agreed to 1e-7)."""
    from hspmd_sdk.runtime.reference import assemble, load_captured

    shapes = {k: tuple(v.shape) for k, v in reference.params.items()}
    captured = load_captured(capture_dir, index)
    grads, _ = assemble(captured, "grads", shapes)
    params, spread = assemble(captured, "params", shapes)
    reference.initial = dict(model.build_reference(seed).state_dict())
    close_to_reference({"losses": losses, "spread": spread, "grads": grads, "params": params}, reference,
                       steps=steps, lr=lr)


def final_state_matches(capture_dir: Any, reference: Any, *, index: int = 0, tol: float = 1e-4,
                        ranks: int | None = None) -> None:
    """The final parameters and Adam moments that the ranks of run ``index`` saved in ``capture_dir`` (a run's
    ``capture_dir=``) against ``reference`` (a ``reference_training`` result): every replica of an element agrees
    exactly, each tensor is within ``tol`` of its norm.  For runs whose state moved (a switch, a grow, a recovery
    from memory or a checkpoint): the losses would hardly show a lost Adam moment, the moments do.  ``ranks``: the
    number of ranks expected to have saved (the survivors)."""
    from hspmd_sdk.runtime.reference import assemble, load_captured

    captured = load_captured(capture_dir, index)
    assert captured and (ranks is None or len(captured) == ranks), (len(captured), ranks)
    shapes = {k: tuple(v.shape) for k, v in reference.params.items()}
    for kind, want in (("params", reference.params), ("exp_avg", reference.exp_avg),
                       ("exp_avg_sq", reference.exp_avg_sq)):
        full, spread = assemble(captured, kind, shapes)
        assert spread == 0.0, kind  # the replicas agree exactly
        err = {k: float((full[k] - w).norm() / w.norm()) for k, w in want.items() if float(w.norm()) > 0}
        assert err and max(err.values()) < tol, (kind, {k: e for k, e in err.items() if e >= tol})
