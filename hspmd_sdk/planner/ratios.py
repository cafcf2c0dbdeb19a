"""HAP's sharding ratios (SPEC §12): which share of a stage's TP-split tensors each device of a mixed group holds.

A TP group of devices of different speeds runs at the pace of its slowest member when it splits evenly.  HAP
(EuroSys'24) gives each device a share proportional to what it can do, chosen by a linear program; this module is
that program over the cost model's (or measured) per-device speeds and memories:

* variables ``x_i >= 0`` (device ``i``'s share of the split work and bytes, ``sum x_i = 1``) and the step time
  ``T``; minimise ``T`` subject to ``x_i * W / s_i + R / s_i <= T`` (``W``: the split work, ``R``: the work every
  device repeats whole, ``s_i``: device ``i``'s speed) and ``x_i * B + B_rep <= M_i`` (memory);
* the shares must also cut the model's tensors into whole heads, KV heads and rows: with ``units`` (the gcd of
  every size the stage's split reaches, :func:`hspmd_sdk.core.tp_ratios.ratio_units`) the same program runs
  over integer parts ``n_i >= 1``, ``sum n_i = units`` (an ILP; CBC), and the ratios are ``n`` in lowest terms.

Without memory limits the LP optimum is ``x_i = s_i / sum s`` (speeds proportional), at the ideal time
``W / sum s``; the ILP is its rounding.

Data-parallel ratios: several such groups (replicas) sharing a step's batch, group ``g`` taking the share ``y_g``.
The joint LP over ``y_g`` and ``z_gi = y_g x_gi`` (``sum_g y_g = 1``, ``sum_i z_gi = y_g``, ``(z_gi W + y_g R) /
s_gi <= T``, ``z_gi B <= y_g (M_gi - B_rep)``) decomposes: for fixed ``x_g`` its optimum is ``y_g`` proportional
to ``1 / tau_g`` with ``tau_g = max_i (x_gi W + R) / s_gi`` the group's time for the whole batch, at ``T = 1 /
sum_g 1 / tau_g``, which every group lowers by lowering its own ``tau_g``; so the joint optimum is each group's
own LP (:func:`solve_ratios`) and batch shares by the groups' speeds (``tests/test_ratio_joint.py`` solves the
joint LP and checks this).  Integrally, equal jobs go to workers so that the slowest finishes first
(:func:`~.hetero_mixed._shares`, which splits a pipeline's layers over unlike mixed stages; for pipelines with
bubbles, the two-level planner's micro-batch ILP, which the straggler replan uses with measured speeds, minimises
the same makespan).  Pipelines of uneven stages take equal micro-batches: the two-tier annotation splits the
batch evenly over them (:func:`~hspmd_sdk.core.strategy._uneven_pipelines_problem`), so ``plan_hetero`` makes
them alike.  :func:`plan_ratios` prices a stage of a model on a cluster with the cost model; :func:`solve_ratios`
takes speeds directly (e.g. measured: ``work / compute seconds`` of each rank).
Pure Python plus PuLP (imported when solving).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from ..core.strategy import BF16_PARAM_GRAD_BYTES, FP32_OPTIMIZER_BYTES
from ..core.tp_ratios import stage_units
from ..errors import PlanValidationError
from ._pulp import _cbc, _variable
from .cost import CostModel

if TYPE_CHECKING:  # pragma: no cover
    from ..core.cluster import Cluster
    from ..core.model_spec import ModelSpec
    from ..core.strategy import Stage

__all__ = ["RatioPlan", "solve_ratios", "plan_ratios", "split_units"]


@dataclass(frozen=True)
class RatioPlan:
    """The ratio planner's answer for one TP group.

    ``shares``: the LP's continuous optimum; ``ratios``: the integral ratios (lowest terms) the stage takes;
    ``step_time`` / ``even_time`` / ``ideal_time``: the estimated seconds of the group's work with ``ratios``, with
    the even split and at ``W / sum(speeds)`` (every device busy all the time)."""

    speeds: tuple[float, ...]
    shares: tuple[float, ...]
    ratios: tuple[int, ...]
    step_time: float
    even_time: float
    ideal_time: float

    @property
    def speedup(self) -> float:
        """``even_time / step_time``: what the uneven split gains over the even one."""
        return self.even_time / self.step_time if self.step_time > 0 else 1.0

    def summary(self) -> str:
        return (f"ratios {':'.join(map(str, self.ratios))} (LP shares "
                f"{', '.join(f'{x:.3f}' for x in self.shares)}) for speeds "
                f"{', '.join(f'{s:.3g}' for s in self.speeds)}: est. {self.step_time:.4g} s vs {self.even_time:.4g} s "
                f"even ({self.speedup:.2f}x), ideal {self.ideal_time:.4g} s")


def _times(parts: Sequence[float], speeds: Sequence[float], work: float, repeated: float) -> float:
    total = sum(parts)
    return max((p / total * work + repeated) / s for p, s in zip(parts, speeds))


def _problem(speeds: Sequence[float], work: float, repeated: float, memory: Sequence[float] | None,
             sharded_bytes: float, replicated_bytes: float, units: int | None, time_limit: float
             ) -> list[float] | None:
    """Solve the LP (``units=None``) or its integral form; ``None`` when nothing fits in memory."""
    import pulp

    n = len(speeds)
    prob = pulp.LpProblem("hap_ratios", pulp.LpMinimize)
    T = _variable(prob, "T", 0, None, "Continuous")
    if units is None:
        x = [_variable(prob, f"x{i}", 0, 1, "Continuous") for i in range(n)]
        prob += pulp.lpSum(x) == 1
        scale = 1.0
    else:
        x = [_variable(prob, f"n{i}", 1, units, "Integer") for i in range(n)]
        prob += pulp.lpSum(x) == units
        scale = 1.0 / units
    prob += T
    for i, s in enumerate(speeds):
        prob += (x[i] * scale * work + repeated) * (1.0 / s) <= T
        if memory is not None:
            prob += x[i] * scale * sharded_bytes + replicated_bytes <= memory[i]
    prob.solve(_cbc(time_limit))
    if pulp.LpStatus[prob.status] != "Optimal":
        return None
    return [float(v.value()) for v in x]


def solve_ratios(speeds: Sequence[float], *, work: float = 1.0, repeated_work: float = 0.0,
                 memory: Sequence[float] | None = None, sharded_bytes: float = 0.0, replicated_bytes: float = 0.0,
                 units: int | None = None, time_limit: float = 10.0) -> RatioPlan:
    """HAP's ratio LP for one TP group (see the module docstring).

    ``speeds``: work per second of each device (any unit; measured ``1 / seconds`` of equal work will do);
    ``work``: the split work of a step; ``repeated_work``: work each device does whole (norms, residuals);
    ``memory``: bytes each device may use, for ``sharded_bytes`` split in the ratios plus ``replicated_bytes``
    whole on each; ``units``: the number of whole parts the split must respect (heads...; ``None``: any ratios
    of up to 64 parts).  Raises :class:`PlanValidationError` naming what does not fit."""
    speeds = tuple(float(s) for s in speeds)
    if not speeds or any(not s > 0 for s in speeds):
        raise PlanValidationError([("speeds", f"need one positive speed per device, got {list(speeds)}")],
                                  what="ratio plan")
    if memory is not None and len(memory) != len(speeds):
        raise PlanValidationError([("memory", f"{len(memory)} entries for {len(speeds)} devices")], what="ratio plan")
    n = len(speeds)
    if units is not None and units < n:
        raise PlanValidationError([("units", f"{units} whole parts cannot give each of {n} devices one")],
                                  what="ratio plan")
    shares = _problem(speeds, work, repeated_work, memory, sharded_bytes, replicated_bytes, None, time_limit)
    if shares is None:
        raise PlanValidationError([("memory", f"no split of {sharded_bytes:.4g} bytes (+{replicated_bytes:.4g} "
                                              f"on each) fits devices of {list(memory or [])} bytes")],
                                  what="ratio plan")
    parts = _problem(speeds, work, repeated_work, memory, sharded_bytes, replicated_bytes, units or 64, time_limit)
    if parts is None:
        raise PlanValidationError([("units", f"no split into {units} whole parts fits the devices' memory")],
                                  what="ratio plan")
    ints = [int(round(p)) for p in parts]
    g = math.gcd(*ints)
    ratios = tuple(i // g for i in ints)
    return RatioPlan(speeds, tuple(shares), ratios, _times(ratios, speeds, work, repeated_work),
                     _times([1] * n, speeds, work, repeated_work), (work + n * repeated_work) / sum(speeds))


def split_units(model: "ModelSpec", stage: "Stage", *, first: bool = False, last: bool = False) -> int:
    """The whole parts a stage's TP split must respect: the gcd of every size its split reaches (heads, KV heads,
    hidden, FFN, vocabulary rows; :func:`hspmd_sdk.core.tp_ratios.stage_units`)."""
    sizes = [size for _, _, size in stage_units(model, stage, first=first, last=last)]
    return math.gcd(*sizes) if sizes else 1


def plan_ratios(model: "ModelSpec", cluster: "Cluster", stage: "Stage", *, micro_batch: int = 1,
                seq_len: int | None = None, first: bool = True, last: bool = True,
                speeds: Sequence[float] | None = None, cost: "CostModel | None" = None,
                time_limit: float = 10.0) -> RatioPlan:
    """Ratios for ``stage``'s devices (its ``ratios`` are ignored) on ``cluster``: speeds from the cost model
    (the seconds of the stage's layer FLOPs on each device's kind) unless ``speeds`` are given (measured), memory
    from each device's capacity against the stage's model states and activations (as
    :func:`~hspmd_sdk.core.strategy.memory_estimate`, split in the ratios), units from the model
    (:func:`split_units`).  ``first`` / ``last``: the stage holds the embedding / the head."""
    cost = cost or CostModel()
    seq = seq_len or model.max_seq_len
    tokens = micro_batch * seq
    flops = stage.num_layers * model.layer_flops(tokens, seq) * (1 + cost.backward_factor)
    if speeds is None:  # stages per second: the work of the whole stage is 1
        speeds = [1.0 / cost.compute_time(flops, cluster.spec(r)) for r in stage.devices]
    params = stage.num_layers * model.layer_param_count() + (model.embedding_param_count() if first else 0) \
        + (model.head_param_count() if last else 0)
    sharded = params * (BF16_PARAM_GRAD_BYTES + FP32_OPTIMIZER_BYTES) \
        + stage.num_layers * model.layer_activation_bytes(tokens, 2)
    memory = [float(cluster.spec(r).memory_bytes) for r in stage.devices]
    units = split_units(model, stage, first=first, last=last)
    return solve_ratios(speeds, work=1.0, memory=memory, sharded_bytes=sharded, units=units,
                        time_limit=time_limit)
