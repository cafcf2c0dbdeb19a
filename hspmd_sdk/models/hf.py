"""Hugging Face interop (SPEC §4), without any download: a model directory (``config.json`` +
``model.safetensors``) in, a model config and state dict out, and back.

* :func:`to_hf` ``(model, state_dict, directory)`` writes a directory that
  ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` loads and that computes the same logits.
* :func:`from_hf` ``(directory) -> (model, state_dict)`` reads one (Llama and GPT-2 architectures).
* :func:`shard_reader` ``(directory, model)`` reads one box of one parameter straight from the safetensors file
  (``safe_open(...).get_slice``): what ``launch(..., init=directory)`` gives each worker, so that a rank reads only
  its own slices and no process ever loads the whole file.

Each family says how its parameters map to Hugging Face tensors (:class:`HFTensor`: a name, whether the weight is
stored transposed — ``nn.Linear`` keeps ``[out, in]``, the SDK ``[in, out]`` — and an offset when several SDK
parameters are slices of one Hugging Face tensor, GPT-2's fused ``c_attn``), and how the configs translate
(``hf.py`` in the family's folder).  Needs ``safetensors`` (the ``hf`` extra); ``transformers`` only in tests.
"""
from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import HSPMDError

__all__ = ["to_hf", "from_hf", "shard_reader", "init_directory", "HFTensor", "HFError", "WEIGHTS", "CONFIG"]

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


class HFError(HSPMDError):
    """A Hugging Face directory cannot be read or does not match the model (names the file and the tensor)."""


@dataclass(frozen=True)
class HFTensor:
    """Where an SDK parameter lives in a Hugging Face checkpoint: tensor ``name``; ``transpose`` when Hugging Face
    stores the 2-D weight the other way round; ``offset``: the SDK parameter's first index along each of *its*
    dims inside the Hugging Face tensor (read in the SDK's orientation)."""

    name: str
    transpose: bool = False
    offset: tuple[int, ...] = ()


def _family(model: Any) -> Any:
    import importlib

    try:
        return importlib.import_module(f"hspmd_sdk.models.{model.family}.hf")
    except ModuleNotFoundError:
        raise HFError(f"model family {model.family!r} has no Hugging Face mapping") from None


def _families() -> dict[str, Any]:
    """Hugging Face ``model_type`` -> the family module that reads it."""
    import importlib

    out = {}
    for tag in ("llama", "gpt"):
        mod = importlib.import_module(f"hspmd_sdk.models.{tag}.hf")
        for t in mod.MODEL_TYPES:
            out[t] = mod
    return out


def _sdk_box(ref: HFTensor, box: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The box in the Hugging Face tensor's own orientation holding the SDK box ``box``."""
    off = ref.offset or (0,) * len(box)
    shifted = tuple((a + o, b + o) for (a, b), o in zip(box, off))
    return tuple(reversed(shifted)) if ref.transpose else shifted


def to_hf(model: Any, state_dict: Mapping[str, Any], directory: str | Path) -> Path:
    """Write ``state_dict`` (full tensors, the SDK's names: ``model.param_shapes()``) of ``model`` as a Hugging Face
    model directory; returns its path.  The tensors are written as float32 (``torch_dtype`` in the config)."""
    import torch
    from safetensors.torch import save_file

    fam = _family(model)
    shapes = model.param_shapes()
    missing = sorted(set(shapes) - set(state_dict))
    if missing:
        raise HFError(f"to_hf: the state dict lacks parameter(s) {missing[:5]} of model {model.name!r}")
    for name, shape in shapes.items():
        if tuple(state_dict[name].shape) != tuple(shape):
            raise HFError(f"to_hf: parameter {name!r} has shape {tuple(state_dict[name].shape)}, the model {shape}")
    refs = fam.tensor_map(model)
    sizes = fam.hf_shapes(model)
    out: dict[str, torch.Tensor] = {n: torch.zeros(s, dtype=torch.float32) for n, s in sizes.items()}
    for name, ref in refs.items():
        t = state_dict[name].detach().to("cpu", torch.float32)
        box = tuple((0, int(d)) for d in t.shape)
        idx = tuple(slice(a, b) for a, b in _sdk_box(ref, box))
        out[ref.name][idx] = t.t() if ref.transpose else t
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(fam.hf_config(model), indent=2) + "\n")
    return directory


def read_config(directory: str | Path) -> tuple[Any, Any]:
    """``(model, family module)`` from ``directory/config.json``."""
    path = Path(directory) / CONFIG
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFError(f"{path}: cannot read a Hugging Face config ({e})") from None
    kind = cfg.get("model_type")
    fam = _families().get(kind)
    if fam is None:
        raise HFError(f"{path}: model_type {kind!r} is not supported (supported: {', '.join(sorted(_families()))})")
    try:
        return fam.from_hf_config(cfg), fam
    except (KeyError, ValueError, TypeError) as e:
        raise HFError(f"{path}: {e}") from None


def from_hf(directory: str | Path) -> tuple[Any, dict[str, Any]]:
    """``(model, state_dict)`` from a Hugging Face model directory (full tensors, the SDK's names)."""
    model, _ = read_config(directory)
    read = shard_reader(directory, model)
    state = {}
    for name, shape in model.param_shapes().items():
        state[name] = read(name, tuple(shape), tuple((0, int(d)) for d in shape))
    return model, state


def shard_reader(directory: str | Path, model: Any) -> Callable[[str, tuple[int, ...], tuple[tuple[int, int], ...]], Any]:
    """``read(name, shape, box) -> float32 tensor`` of one box of SDK parameter ``name``, read as a slice of the
    directory's safetensors file (only those bytes)."""
    import torch
    from safetensors import safe_open

    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise HFError(f"{path}: no safetensors weights (expected {WEIGHTS} in {directory})")
    refs = _family(model).tensor_map(model)
    handle = safe_open(str(path), framework="pt")
    stored = set(handle.keys())

    def read(name: str, shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> Any:
        ref = refs.get(name)
        if ref is None:
            raise HFError(f"{path}: model {model.name!r} has no Hugging Face tensor for parameter {name!r}")
        if ref.name not in stored:
            raise HFError(f"{path}: tensor {ref.name!r} (parameter {name!r}) is missing")
        part = handle.get_slice(ref.name)[tuple(slice(a, b) for a, b in _sdk_box(ref, box))]
        part = part.t() if ref.transpose else part
        return part.to(torch.float32).contiguous()

    return read


def check_directory(directory: str | Path, model: Any) -> Path:
    """``directory`` if it holds a checkpoint of ``model`` (same architecture and sizes, every tensor present
    with the right shape); else :class:`HFError` naming the file and what differs."""
    from safetensors import safe_open

    directory = Path(directory)
    theirs, fam = read_config(directory)
    if theirs.model_dump(exclude={"name"}) != model.model_dump(exclude={"name"}):
        diff = {k: (v, model.model_dump()[k]) for k, v in theirs.model_dump().items()
                if k != "name" and model.model_dump().get(k) != v}
        raise HFError(f"{directory / CONFIG}: the checkpoint's model differs from the program's: "
                      + ", ".join(f"{k} {a} (checkpoint) != {b} (program)" for k, (a, b) in diff.items()))
    path = directory / WEIGHTS
    if not path.is_file():
        raise HFError(f"{path}: no safetensors weights")
    want = fam.hf_shapes(model)
    with safe_open(str(path), framework="pt") as f:
        for name, shape in want.items():
            if name not in f.keys():
                if fam.optional(name):
                    continue
                raise HFError(f"{path}: tensor {name!r} is missing")
            got = tuple(f.get_slice(name).get_shape())
            if got != tuple(shape):
                raise HFError(f"{path}: tensor {name!r} has shape {got}, the model needs {tuple(shape)}")
    return directory


def init_directory(init: Any, model: Any) -> Path:
    """What ``launch(..., init=...)`` hands the workers: a checked Hugging Face directory.  A state dict (the
    SDK's names, full tensors) is first written to a temporary directory (removed when this process exits)."""
    if isinstance(init, (str, Path)):
        return check_directory(init, model).resolve()
    if isinstance(init, Mapping):
        tmp = Path(tempfile.mkdtemp(prefix="hspmd-init-"))
        atexit.register(shutil.rmtree, tmp, True)
        return to_hf(model, init, tmp).resolve()
    raise HFError(f"init= takes a Hugging Face model directory or a state dict, not {type(init).__name__}")
