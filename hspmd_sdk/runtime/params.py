"""Sharded parameters: every rank materialises only its own shards.

:func:`init_local_parameters` gives, for one rank, each parameter leaf of its executable graph as the rank's
:func:`~hspmd_sdk.core.annotation.local_view` of the full initial value (:func:`hspmd_sdk.models.init_parameter`,
a pure function of ``(seed, name, shape)``, so every plan starts from the same model as the single-device
reference).  Only the shard is kept (a contiguous copy); the full value is a temporary.

For the small models this project trains on CPU the temporary full tensor is harmless.  A large model would need
a generator that draws one shard directly (e.g. a counter-based generator indexed by global element position);
the sharding logic here would stay the same.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..core.annotation import local_view

__all__ = ["init_local_parameters", "parameter_bytes", "shard_box"]


def shard_box(program: Any, name: str, rank: int) -> tuple[tuple[int, int], ...]:
    """The global box of parameter ``name`` that ``rank`` holds under the program's annotation."""
    shape = tuple(int(d) for d in program.graph.tensors[name].shape)
    view = local_view(program.annotations[name], shape, rank)
    if view is None:
        raise KeyError(f"rank {rank} holds no shard of parameter {name!r} (annotation {program.annotations[name]})")
    return view.box


def init_local_parameters(program: Any, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Parameter name -> this rank's shard (float32 leaf tensor with ``requires_grad``), for every parameter leaf
    of ``rank``'s executable graph."""
    from ..models import init_parameter

    out: dict[str, torch.Tensor] = {}
    for name in program.executable_graph(rank).parameters:
        shape = tuple(int(d) for d in program.graph.tensors[name].shape)
        box = shard_box(program, name, rank)
        full = init_parameter(name, shape, seed)
        shard = full[tuple(slice(a, b) for a, b in box)].clone().contiguous()
        del full
        out[name] = shard.requires_grad_(True)
    return out


def parameter_bytes(params: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the parameter tensors a rank holds."""
    return sum(p.numel() * p.element_size() for p in params.values())
