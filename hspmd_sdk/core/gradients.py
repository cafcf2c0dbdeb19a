"""Gradient layouts (paper §5, §6.1): in which layout the gradient of a tensor of a given layout comes back, and
the plan that moves a Reshard's output gradient back to its input.

Specialization decides every gradient's layout from the deduced annotations (:mod:`.deduction`:
``partial_as_duplicate``, ``weight_grad_annotation``, ``activation_grad_annotation``); this module states the
general convention those follow, for Reshards used outside a Program (the runtime's :func:`~hspmd_sdk.runtime.workers.comm.reshard`
defaults to it).  Pure Python.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ResolutionError
from .annotation import DS, DUPLICATE, PARTIAL, Annotation
from .resolve import resolve

if TYPE_CHECKING:
    from .comm_plan import CommPlan

__all__ = ["gradient_layout", "backward_plan_for"]


def gradient_layout(ann: Annotation, consumed: str = "redundant") -> Annotation:
    """The layout of the gradient of a tensor of layout ``ann`` (same DG Union, split dims and box per rank).

    The convention (per rank, the gradient autograd computes with respect to its *local* tensor):

    * **Split** stays Split: each rank's gradient is its box of the full gradient.
    * **Partial -> Duplicate**: ``T = sum_r x_r``, so ``dL/dx_r = dL/dT`` -- every summand's gradient is the whole
      gradient of its box.
    * **Duplicate**, ``consumed="redundant"`` (the default): every replica feeds the *same* computation (a
      LayerNorm or a loss repeated on each TP rank), so each rank computes the whole gradient: Duplicate.
      ``consumed="divergent"``: each replica feeds a *different* computation (the input of a column-parallel
      linear, each rank multiplying by its own weight shard; a weight replicated across data-parallel groups),
      so the replicas' gradients are summands: **Duplicate -> Partial** (and Partial -> Duplicate, a swap).

    Both tiers follow the rule (DS keys -2/-1 and HDim -2/-1).  A redundant Partial+Duplicate DS whose two keys
    are not adjacent in ``order`` has no single-DS gradient layout; that raises (pass the layout explicitly).
    """
    if consumed not in ("redundant", "divergent"):
        raise ValueError(f"consumed must be 'redundant' or 'divergent', not {consumed!r}")
    ds = [_grad_ds(d, consumed) for d in ann.ds_union]
    hdim = ann.hdim
    if hdim == PARTIAL or (consumed == "divergent" and hdim == DUPLICATE):
        hdim = DUPLICATE if hdim == PARTIAL else PARTIAL
    # With HSize 1 the Annotation normalises HDim to Duplicate; hratios come only with a split HDim, which stays.
    return Annotation(ann.dg_union, ds, hdim, ann.hratios)


def _grad_ds(ds: DS, consumed: str) -> DS:
    states, order = dict(ds.states), list(ds.order)
    if consumed == "divergent":
        swap = {PARTIAL: DUPLICATE, DUPLICATE: PARTIAL}
        return DS({swap.get(k, k): v for k, v in states.items()}, [swap.get(k, k) for k in order])
    if PARTIAL not in states:
        return ds
    if DUPLICATE not in states:
        return DS({(DUPLICATE if k == PARTIAL else k): v for k, v in states.items()},
                  [DUPLICATE if k == PARTIAL else k for k in order])
    i, j = order.index(PARTIAL), order.index(DUPLICATE)
    if abs(i - j) != 1:
        raise ResolutionError(f"gradient_layout: DS {ds} has Partial and Duplicate keys that are not adjacent "
                                 "in its order; its gradient has no single-DS layout, pass it explicitly")
    merged = {k: v for k, v in states.items() if k != PARTIAL}
    merged[DUPLICATE] = states[PARTIAL] * states[DUPLICATE]
    return DS(merged, [k for k in order if k != PARTIAL])


def backward_plan_for(plan: "CommPlan", *, grad_src: Annotation | None = None,
                      grad_dst: Annotation | None = None) -> "CommPlan":
    """The plan that moves the gradient of a Reshard's output back to its input: ``resolve(grad_dst, grad_src)``.

    ``grad_dst``: the layout in which the consumers deliver the output's gradient; ``grad_src``: the layout the
    input's producer expects its gradient in.  Both default to :func:`gradient_layout` with redundant
    consumption (Partial -> Duplicate, the rest unchanged).  The Megatron operators, TP group ``[0, 1]``:

    * *g* (row-parallel output): ``plan = resolve(P, D)`` is an AllReduce; the output is consumed redundantly so
      ``grad_dst = D``, and the Partial input's gradient is ``D``: the backward is ``Identity``.
    * *f* (column-parallel input): ``plan = resolve(D, D)`` is an Identity; the output feeds a column-parallel
      linear -- consumed divergently -- so pass ``grad_dst=gradient_layout(D, "divergent")`` (= ``P``); the
      input's producer (a replicated LayerNorm) expects ``D``: the backward is an ``AllReduce``.

    Choosing the gradient layouts is specialization's job (it passes ``grad_*`` from the backward graph's
    annotations); these defaults are the common convention.
    """
    gs = grad_src if grad_src is not None else gradient_layout(plan.src)
    gd = grad_dst if grad_dst is not None else gradient_layout(plan.dst)
    return resolve(gd, gs, plan.shape, plan.dtype, plan.cluster)
