"""The sections of a :class:`~.train_config.TrainConfig` (SPEC §13): one strict, frozen Pydantic model a section
(``[run]``, ``[data]``, ``[optimizer]``, ``[clip]``, ``[eval]``, ``[checkpoint]``, ``[reconfigure]``, ``[launcher]``,
``[plan]``; ``[schedule]`` is :class:`~.lr_schedule.Schedule`), each field with its default, its range, a title and
a description of what it allows (what :func:`~.train_config.template_toml` writes and the errors quote), and
:data:`SECTIONS`, their table in file order.

The config as a whole (reading and writing files, the flat keywords of ``launch``, errors by dotted path) is
:mod:`.train_config`'s, which re-exports every name here.  Pure Pydantic: importing this module loads neither torch
nor either side of the runtime.
"""
from __future__ import annotations

import re
from types import MappingProxyType
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from ..core.cluster import MAX_RANKS
from .config_types import Bool, Int, Number, PathText
from .lr_schedule import Schedule
from .spec import PRECISIONS
from .workers.devices import DEVICES

__all__ = ["RunSection", "DataSection", "OptimizerSection", "ClipSection", "EvalSection", "CheckpointSection",
           "ReconfigureSection", "LauncherSection", "PlanSection", "SECTIONS", "SEED_LIMIT"]

#: Seeds are what numpy's seeding takes: ``0 <= seed < 2**32`` (as :class:`~.control.run_config.RunConfig`).
SEED_LIMIT = 2 ** 32

_LOCAL = re.compile(r"local:(\d{1,7})")


class _Section(BaseModel):
    """A section of a :class:`~.train_config.TrainConfig`: frozen, strict, no unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)


class RunSection(_Section):
    """The run: its length, seed, shapes, precision and device."""

    steps: Int = Field(default=100, ge=1, title="training steps", description="a whole number of steps >= 1")
    seed: Int = Field(default=0, ge=0, lt=SEED_LIMIT, title="the seed of the data order and the initial parameters",
                      description="a whole number in [0, 2**32) (numpy seeds)")
    seq_len: Int | None = Field(default=None, ge=1, title="tokens per sample",
                                description="a whole number of tokens >= 1, or None (the model's max_seq_len)")
    global_batch: Int | None = Field(default=None, ge=1, title="samples per step where the plan does not fix "
                                                               "it",
                                     description="a whole number of samples >= 1, or None (the plan's)")
    precision: Literal[PRECISIONS] = Field(default="fp32", title="compute precision",
                                           description=" or ".join(map(repr, PRECISIONS)))
    device: Literal[DEVICES] | None = Field(default=None, title="where the workers compute",
                                            description=" or ".join(map(repr, DEVICES)) + ", or None (from the "
                                                                                          "cluster's device kinds)")
    recompute: list[Annotated[Int, Field(ge=0)]] | None = Field(
        default=None, title="ranks that recompute activations",
        description="a list of ranks (whole numbers >= 0), or None (the program's)")
    init: PathText | None = Field(default=None, title="a Hugging Face directory to start from (None: "
                                                      "the seed's initialization)",
                                  description="a directory (str or Path), or None (a state dict stays a keyword of "
                                              "launch)")


class DataSection(_Section):
    """The training data: where it is, and for mixed-length data the token budget of a step."""

    path: PathText = Field(default="stdlib", title="the training data",
                           description="'stdlib', 'synthetic', 'stdlib-docs' or a prepared corpus directory (str or "
                                       "Path); token arrays and Documents stay a keyword of launch")
    tokens_per_step: Int | None = Field(default=None, ge=1, title="mixed-length data: the token budget of a step",
                                        description="a whole number of tokens >= 1, or None")
    context: Int | None = Field(default=None, ge=1, title="mixed-length data: the longest sequence",
                                description="a whole number of tokens >= 1, or None (the model's max_seq_len)")
    lookahead: Int = Field(default=2, ge=0, title="mixed-length data: steps planned ahead",
                           description="a whole number of steps >= 0")
    packing: Bool | None = Field(default=None, title="mixed-length data: pack whole sequences into "
                                                     "rows",
                                 description="True, False or None (packed where the model allows)")


#: One of Adam's betas: ``[0, 1)``.
_Beta = Annotated[Number, Field(ge=0, lt=1)]


class OptimizerSection(_Section):
    """Adam (``torch.optim.Adam``, as every rank and the single-device reference run it) and which parameters
    weight decay applies to."""

    lr: Number = Field(default=1e-3, gt=0, title="the base learning rate (the schedule multiplies it)",
                       description="a finite number > 0")
    betas: tuple[_Beta, _Beta] = Field(default=(0.9, 0.999), title="Adam's betas",
                                       description="two finite numbers in [0, 1)")
    eps: Number = Field(default=1e-8, gt=0, title="Adam's epsilon", description="a finite number > 0")
    kind: Literal["adam", "adamw"] = Field(default="adam", title="'adam' (torch.optim.Adam: weight decay added to "
                                                                 "the gradients) or 'adamw' (decoupled weight decay, "
                                                                 "torch.optim.AdamW)",
                                           description="'adam' or 'adamw'")
    weight_decay: Number = Field(default=0.0, ge=0, title="weight decay (Adam's: added to the gradients; AdamW's: "
                                                          "decoupled, the parameters shrunk by lr * weight_decay)",
                                 description="a finite number >= 0")
    decay: Literal["matrices", "all"] = Field(default="matrices", title="the parameters weight decay applies to: "
                                                                        "'matrices' (2+ dimensions: none on norms "
                                                                        "and biases) or 'all' (every one)",
                                              description="'matrices' or 'all'")


class ClipSection(_Section):
    """Gradient clipping by the global L2 norm (SPEC §13)."""

    max_norm: Number | None = Field(default=None, gt=0, title="scale gradients by min(1, max_norm / (norm + "
                                                              "1e-6)), norm: their global L2 norm",
                                    description="a finite number > 0, or None (no clipping)")


class EvalSection(_Section):
    """Validation loss on the data's validation split, forward only."""

    every: Int | None = Field(default=None, ge=1, title="validate at the end of every N-th step",
                              description="a whole number of steps >= 1, or None (never)")
    batches: Int = Field(default=4, ge=1, title="validation batches each time",
                         description="a whole number of batches >= 1")


class CheckpointSection(_Section):
    """Sharded checkpoints that load under any plan (SPEC §5)."""

    dir: PathText | None = Field(default=None, title="where to save checkpoints",
                                 description="a directory (str or Path), or None (no checkpoints)")
    every: Int | None = Field(default=None, ge=1, title="save every N steps",
                              description="a whole number of steps >= 1, or None (only after the last step)")
    keep: Int = Field(default=3, ge=1, title="checkpoints kept", description="a whole number of checkpoints >= 1")
    async_: Bool = Field(default=True, alias="async", title="write checkpoints in the background",
                         description="True or False")
    resume_from: PathText | None = Field(default=None, title="a checkpoint directory to continue from",
                                         description="a checkpoint directory (str or Path), or None")


class ReconfigureSection(_Section):
    """Graph switching on its own: surviving failures, replanning around stragglers, growing back."""

    elastic: Bool = Field(default=False, title="survive workers that die: replan for the survivors and switch",
                          description="True or False")
    straggler: Bool | None = Field(default=None, title="replan around a rank that stays slower than its plan",
                                   description="True, False or None (a StragglerWatch object stays a keyword of "
                                               "launch)")
    grow_back: Bool | None = Field(default=None, title="grow back onto lost hosts once they return (needs "
                                                       "elastic)",
                                   description="True, False or None (the transport's default; a GrowBack object "
                                               "stays a keyword of launch)")

    @model_validator(mode="after")
    def _grow_back_needs_elastic(self) -> "ReconfigureSection":
        """Growing back follows failures the job survived: only an elastic job has any."""
        if self.grow_back is True and not self.elastic:
            raise ValueError("grow_back: grows the job back after failures it survived: it needs elastic = true")
        return self


def _off(value: Any) -> Any:
    """``False`` as ``None`` (TOML has no ``null``: ``stall_s = false`` switches stall detection off)."""
    return None if value is False else value


class LauncherSection(_Section):
    """The launcher: timeouts, fault detection, logs, progress and profiling."""

    timeout_s: Number = Field(default=120.0, gt=0, title="collective and rendezvous timeout, seconds",
                              description="a finite number of seconds > 0")
    heartbeat_s: Number = Field(default=1.0, gt=0, le=60, title="heartbeat period, seconds",
                                description="a finite number of seconds in (0, 60]")
    stall_s: Annotated[Number | None, BeforeValidator(_off)] = Field(
        default=30.0, gt=0, title="a rank outside communication while a peer waited this long is hung",
        description="a finite number of seconds > 0, or None / false (only silence is detected)")
    log_dir: PathText | None = Field(default=None, title="per-rank logs",
                                     description="a directory (str or Path), or None (a temporary folder)")
    tensorboard: PathText | None = Field(default=None, title="write TensorBoard events here",
                                         description="a directory (str or Path), or None")
    progress: Bool | None = Field(default=None, title="show progress",
                                  description="True, False or None (a notebook or a terminal)")
    profile: list[Annotated[Int, Field(ge=0)]] = Field(default_factory=list, title="steps every rank records with "
                                                                                   "the torch profiler",
                                                       description="a list of steps (whole numbers >= 0)")
    echo: Bool = Field(default=False, title="echo the workers' output", description="True or False")
    resource_check: Bool = Field(default=True, title="check memory and ports before any worker starts",
                                 description="True or False")


class PlanSection(_Section):
    """What ``hspmd train FILE.toml`` trains, and where (``launch`` takes the Program and cluster as arguments)."""

    model: Annotated[str, Field(strict=True, min_length=1)] = Field(
        default="llama:tiny", title="the model",
        description="a model preset such as 'llama:tiny' or 'gpt:tiny', or a model-config JSON path")
    strategy: PathText | None = Field(default=None, title="the strategy: which ranks hold which layers",
                                      description="a strategy JSON path or packaged example name, or None (every "
                                                  "rank a data-parallel replica of the whole model)")
    cluster: Annotated[str, Field(strict=True, min_length=1)] = Field(
        default="local:1", title="where the workers run",
        description=f"'local:N' (N local worker processes, 1..{MAX_RANKS}) or a cluster "
                    "JSON path")

    @model_validator(mode="after")
    def _local_count(self) -> "PlanSection":
        """``local:N``: a count of local workers the SDK can run."""
        if self.cluster.startswith("local:"):
            m = _LOCAL.fullmatch(self.cluster)
            if not m or not 1 <= int(m[1]) <= MAX_RANKS:
                raise ValueError(f"cluster: write 'local:N' with N in 1..{MAX_RANKS} local worker processes, not "
                                 f"{self.cluster[:60]!r}")
        return self


#: The sections of a :class:`~.train_config.TrainConfig`, in file order.
SECTIONS: Mapping[str, type[BaseModel]] = MappingProxyType({
    "run": RunSection, "data": DataSection, "optimizer": OptimizerSection, "schedule": Schedule, "clip": ClipSection,
    "eval": EvalSection, "checkpoint": CheckpointSection, "reconfigure": ReconfigureSection,
    "launcher": LauncherSection, "plan": PlanSection})
