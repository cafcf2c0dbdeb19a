"""Sharded parameters: every rank materialises only its own shards.

:func:`init_local_parameters` gives, for one rank, each parameter leaf of its executable graph as the rank's
:func:`~hspmd_sdk.core.annotation.local_view` of the model's initial value (``model.init_parameter``, a pure
function of ``(name, shape, seed)``, so every plan starts from the same model as the single-device reference).
Only the shard is kept (a contiguous copy); the full value is a temporary.  :func:`load_local_parameters` reads
the shards from another source instead (a state dict, or a Hugging Face directory read slice by slice:
:mod:`hspmd_sdk.models.hf`), and :func:`check_local_parameters` checks shards handed in against the boxes.

For the small models this project trains on CPU the temporary full tensor of the seeded initialisation is
harmless.  A large model would need a generator that draws one shard directly (e.g. a counter-based generator
indexed by global element position); the sharding logic here would stay the same.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

import torch

from ...core.annotation import local_view
from ...core.slices import box_shape, format_box
from ...errors import HSPMDError

if TYPE_CHECKING:
    from ...core.specialize import Program

__all__ = ["init_local_parameters", "load_local_parameters", "check_local_parameters", "parameter_bytes",
           "shard_box", "ShardReader"]

#: ``reader(name, full_shape, box) -> tensor of the box``: where a rank's parameter shards come from.
ShardReader = Callable[[str, tuple[int, ...], tuple[tuple[int, int], ...]], torch.Tensor]


def shard_box(program: "Program", name: str, rank: int) -> tuple[tuple[int, int], ...]:
    """The global box of parameter ``name`` that ``rank`` holds under the program's annotation."""
    shape = tuple(int(d) for d in program.graph.tensors[name].shape)
    view = local_view(program.annotations[name], shape, rank)
    if view is None:
        raise KeyError(f"rank {rank} holds no shard of parameter {name!r} (annotation {program.annotations[name]})")
    return view.box


def load_local_parameters(program: "Program", rank: int, reader: ShardReader) -> dict[str, torch.Tensor]:
    """Parameter name -> this rank's shard read by ``reader`` (float32 leaf with ``requires_grad``), for every
    parameter leaf of ``rank``'s executable graph."""
    out: dict[str, torch.Tensor] = {}
    for name in program.executable_graph(rank).parameters:
        shape = tuple(int(d) for d in program.graph.tensors[name].shape)
        box = shard_box(program, name, rank)
        shard = reader(name, shape, box)
        if tuple(shard.shape) != box_shape(box):
            raise HSPMDError(f"rank {rank}: the shard of {name!r} read for box {format_box(box)} has shape "
                             f"{tuple(shard.shape)}, not {box_shape(box)}")
        out[name] = shard.to(torch.float32).contiguous().requires_grad_(True)
    return out


def init_local_parameters(program: "Program", rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Parameter name -> this rank's shard of the model's seeded initial value."""
    model = program.model
    if model is None:
        raise HSPMDError("the program was specialized from a bare graph: it has no model to initialise parameters; "
                         "specialize a model config, or pass the shards (params=)")

    def seeded(name: str, shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        full = model.init_parameter(name, shape, seed)
        return full[tuple(slice(a, b) for a, b in box)].clone()

    return load_local_parameters(program, rank, seeded)


def state_dict_reader(state_dict: Mapping[str, torch.Tensor]) -> ShardReader:
    """A :data:`ShardReader` slicing full tensors of an in-memory state dict (names = the model's)."""
    def read(name: str, shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        if name not in state_dict:
            raise HSPMDError(f"the state dict has no parameter {name!r}")
        t = state_dict[name]
        if tuple(t.shape) != shape:
            raise HSPMDError(f"parameter {name!r}: the state dict holds shape {tuple(t.shape)}, the model {shape}")
        return t[tuple(slice(a, b) for a, b in box)].detach().clone()

    return read


def check_local_parameters(program: "Program", rank: int,
                           params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` (this rank's shards, by name) checked against the boxes the program places on ``rank``."""
    want = program.executable_graph(rank).parameters
    missing = sorted(set(want) - set(params))
    if missing:
        raise HSPMDError(f"rank {rank}: no shard given for parameter(s) {missing[:5]}")
    out = {}
    for name in want:
        box = shard_box(program, name, rank)
        t = params[name]
        if tuple(t.shape) != box_shape(box):
            raise HSPMDError(f"rank {rank}: the shard given for {name!r} has shape {tuple(t.shape)}, but the program "
                             f"places {format_box(box)} (shape {box_shape(box)}) here")
        out[name] = t
    return out


def parameter_bytes(params: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the parameter tensors a rank holds."""
    return sum(p.numel() * p.element_size() for p in params.values())
