"""The typed run configuration of ``launch``: every training option checked by type and range in one place, before
anything else happens (SPEC §9: before the plan is specialized on the launch cluster, before any worker starts).

* :class:`RunConfig` — a strict Pydantic model of the options of :func:`~.train.launch` (the public
  ``hspmd_sdk.launch``), of :func:`~.mixed.launch_mixed` (a list of candidate Programs) and of the launcher they
  pass on (:func:`~hspmd_sdk.runtime.control.launcher.launch_entry`): integers are integers (``steps=2.5``, ``steps="3"`` and ``steps=True`` are
  refused, never rounded or parsed), flags are ``bool``, numbers are finite and in range.  Options that depend on
  the model are checked against it (``model=`` in the validation context): ``seq_len`` / ``context`` against the
  longest sequence a model with a learned position table can embed (:func:`position_limit`: GPT-2's
  ``max_seq_len``; a RoPE model such as Llama has no such limit), ``data`` against its vocabulary.
* :func:`check_run_options` — validate keyword options, raise :class:`~hspmd_sdk.errors.PlanValidationError` listing
  *every* bad option at once, each as ``(option, "must be <what is allowed>, not <the value>")``; an unknown option
  name is one of them.

What needs the Program or the cluster (the ranks of ``recompute`` and ``fault_injection``, the plan specialized on
the launch cluster, a writable ``checkpoint_dir``, a checkpoint the run can resume from) is checked right after, by
:func:`~.runs.training_run` and :func:`~.checkpoint.run_fields`, still before any worker starts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ...errors import PlanValidationError
from ..config_types import Bool, Int, Number, PathLike
from ..workers.devices import DEVICES
from ..spec import PRECISIONS
from ...core.strategy_plan import graph_of
from ...planner.cost import CostModel
from .controller import StragglerWatch
from .growback import GrowBack

if TYPE_CHECKING:
    from ...core.model_spec import ModelSpec

__all__ = ["RunConfig", "check_run_options", "position_limit", "SEED_LIMIT", "MIXED_OPTIONS"]

#: Seeds are what numpy's seeding takes: ``0 <= seed < 2**32``.
SEED_LIMIT = 2 ** 32

#: Options only a list of candidate Programs (mixed-length data, :mod:`.mixed`) takes.
MIXED_OPTIONS = frozenset({"tokens_per_step", "context", "lookahead", "packing"})

#: Adam's defaults, to check one option of :func:`~.executor.adam_problems` at a time.
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


class RunConfig(BaseModel):
    """The options of one training launch, typed and range-checked (see the module docstring).

    Build it with :func:`check_run_options` (errors as :class:`~hspmd_sdk.errors.PlanValidationError`), or with
    ``RunConfig.model_validate(options, context={"model": config, "mixed": False})``.  Each field's description
    says what is allowed; it is the text of the error for a bad value."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    # ---- the run --------------------------------------------------------------------------------------------
    steps: Int = Field(ge=1, description="a whole number of steps >= 1")
    seed: Int = Field(default=0, ge=0, lt=SEED_LIMIT, description="a whole number in [0, 2**32) (numpy seeds)")
    data: Any = Field(default="stdlib", description="'stdlib', 'synthetic' or a prepared corpus directory (a list of Programs: "
                                                       "'stdlib-docs', token arrays, Documents or a file)")
    seq_len: Int | None = Field(default=None, ge=1, description="a whole number of tokens >= 1, or None (the "
                                                                "model's max_seq_len)")
    recompute: list[Annotated[Int, Field(ge=0)]] | None = Field(
        default=None, description="a list of ranks (whole numbers >= 0), or None (the program's)")
    capture_dir: PathLike | None = Field(default=None, description="a directory (str or Path), or None")
    init: PathLike | Mapping[str, Any] | None = Field(default=None, description="a Hugging Face directory (str or "
                                                                              "Path) or a state dict, or None")
    precision: Literal[PRECISIONS] = Field(default="fp32", description=" or ".join(map(repr, PRECISIONS)))
    device: Literal[DEVICES] | None = Field(default=None, description=" or ".join(map(repr, DEVICES))
                                            + ", or None (from the cluster's device kinds)")
    # ---- Adam (ranges: executor.adam_problems) -------------------------------------------------------------
    lr: Number = Field(default=1e-3, description="a finite number > 0")
    betas: tuple[Number, Number] = Field(default=(0.9, 0.999), description="two finite numbers in [0, 1)")
    eps: Number = Field(default=1e-8, description="a finite number > 0")
    weight_decay: Number = Field(default=0.0, description="a finite number >= 0")
    optimizer: Literal["adam", "adamw"] = Field(default="adam", description="'adam' or 'adamw' (decoupled weight "
                                                                          "decay)")
    decay: Literal["matrices", "all"] = Field(default="matrices", description="'matrices' (no weight decay on "
                                                                            "norms and biases) or 'all'")
    schedule: Any = Field(default=None, description="a learning-rate Schedule, its dict or its kind ('constant', "
                                                    "'linear', 'cosine', 'wsd'), or None (constant)")
    max_norm: Number | None = Field(default=None, gt=0, description="a finite number > 0 (clip the gradients to "
                                                                     "this global norm), or None")
    # ---- validation ------------------------------------------------------------------------------------------
    eval_every: Int | None = Field(default=None, ge=1, description="a whole number of steps >= 1, or None (no "
                                                                   "validation)")
    eval_batches: Int = Field(default=4, ge=1, description="a whole number of batches >= 1")
    # ---- checkpoints ---------------------------------------------------------------------------------------
    checkpoint_dir: PathLike | None = Field(default=None, description="a directory (str or Path), or None")
    checkpoint_every: Int | None = Field(default=None, ge=1, description="a whole number of steps >= 1, or None "
                                                                         "(only after the last step)")
    keep: Int = Field(default=3, ge=1, description="a whole number of checkpoints >= 1")
    checkpoint_async: Bool = Field(default=True, description="True or False")
    resume_from: PathLike | None = Field(default=None, description="a checkpoint directory (str or Path), or None")
    # ---- reconfiguration -----------------------------------------------------------------------------------
    elastic: Bool = Field(default=False, description="True or False")
    straggler: Any = Field(default=None, description="True, False, None or a StragglerWatch")
    grow_back: Any = Field(default=None, description="True, False, None (the transport's default) or a GrowBack "
                                                     "(True or a GrowBack with elastic=True)")
    cost: Any = Field(default=None, description="a planner CostModel, or None")
    fault_injection: list[dict[str, Any]] = Field(default_factory=list, description="a list of {'rank', 'step', "
                                                                                    "'at'} dicts")
    #: a test hook: every worker waits at the start of each of these steps until ``job.release(step)``
    hold_at: list[Annotated[Int, Field(ge=0)]] = Field(
        default_factory=list, description="a list of steps (whole numbers >= 0, each below steps)")
    # ---- mixed-length data (a list of candidate Programs) ----------------------------------------------------
    tokens_per_step: Int | None = Field(default=None, ge=1, description="a whole number of tokens >= 1")
    context: Int | None = Field(default=None, ge=1, description="a whole number of tokens >= 1, or None (the "
                                                                "model's max_seq_len)")
    lookahead: Int = Field(default=2, ge=0, description="a whole number of steps >= 0")
    packing: Bool | None = Field(default=None, description="True, False or None (packed where the model allows)")
    # ---- the launcher --------------------------------------------------------------------------------------
    timeout_s: Number = Field(default=120.0, gt=0, description="a finite number of seconds > 0")
    heartbeat_s: Number = Field(default=1.0, gt=0, le=60, description="a finite number of seconds in (0, 60]")
    stall_s: Number | None = Field(default=30.0, gt=0, description="a finite number of seconds > 0, or None")
    loss_rank: Int | None = Field(default=None, ge=0, description="a rank (whole number >= 0), or None")
    progress: Bool | None = Field(default=None, description="True, False or None (a notebook or a terminal)")
    echo: Bool = Field(default=False, description="True or False")
    resource_check: Bool = Field(default=True, description="True or False")
    preflight: Bool = Field(default=True, description="True or False (check the hosts before starting workers)")
    log_dir: PathLike | None = Field(default=None, description="a directory (str or Path), or None")
    tensorboard: PathLike | None = Field(default=None, description="a directory (str or Path), or None")
    transport: Any = Field(default=None, description="a Transport, or None")
    slowdown: Any = Field(default=None, description="{rank: factor >= 1 or [(step, factor), ...]}, or None")
    backend: Literal["gloo", "nccl"] | None = Field(default=None, description="'gloo' or 'nccl', or None")
    policy: Any = Field(default=None, description="a FailurePolicy, or None")
    memory_per_rank: Any = Field(default=None, description="{rank: bytes}, or None")

    # ---- checks that need more than the type ---------------------------------------------------------------
    @field_validator("lr", "betas", "eps", "weight_decay", mode="before")
    @classmethod
    def _adam(cls, value: Any, info: ValidationInfo) -> Any:
        """Adam's ranges, as the launcher and :class:`~.executor.AdamConfig` check them."""
        from ..workers.executor import adam_problems  # lazy: torch (executor)

        found = [r for f, r in adam_problems(**{**_ADAM_DEFAULTS, info.field_name: value}) if f == info.field_name]
        if found:
            raise ValueError(found[0])
        return value  # betas: a list or tuple (adam_problems takes no other), a tuple once the type is checked

    @field_validator("seq_len", "context")
    @classmethod
    def _positions(cls, value: int | None, info: ValidationInfo) -> int | None:
        """At most the longest sequence the model's learned position table embeds."""
        model = (info.context or {}).get("model")
        limit = position_limit(model)
        if value is not None and limit is not None and value > limit:
            raise ValueError(f"must be at most {limit} for {type(model).__name__} {getattr(model, 'name', '')!r} "
                             f"(its learned position embedding has max_seq_len={limit} positions), not {value}")
        return value

    @field_validator("data")
    @classmethod
    def _data(cls, value: Any, info: ValidationInfo) -> Any:
        """One Program trains on ``'synthetic'`` or ``'stdlib'`` (a vocabulary of at least 256); a list of
        Programs on documents (checked by :func:`~.mixed.launch_mixed`, which reads them)."""
        ctx = info.context or {}
        model = ctx.get("model")
        if ctx.get("mixed") or model is None:
            return value
        from ..data import dataset_for  # lazy: torch (data)

        try:
            dataset_for(value, model.vocab_size)
        except ValueError as e:
            text = str(e)
            raise ValueError(text[len("data "):] if text.startswith("data must") else text) from None
        return value

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: Any) -> Any:
        """A :class:`~hspmd_sdk.runtime.lr_schedule.Schedule`, its dict or its kind name (checked as one)."""
        if value is None:
            return value
        from ..lr_schedule import schedule_json

        try:
            schedule_json(value)
        except ValidationError as e:
            raise ValueError("; ".join(f"{'.'.join(map(str, err['loc'])) or 'kind'}: {err['msg']}"
                                       for err in e.errors())) from None
        return value

    @field_validator("hold_at")
    @classmethod
    def _holds(cls, value: list[int], info: ValidationInfo) -> list[int]:
        """A hold is at a step the run has (``0 <= step < steps``)."""
        steps = info.data.get("steps")
        late = [s for s in value if steps is not None and s >= steps]
        if late:
            raise ValueError(f"must be steps of this run (0..{steps - 1}), not {late[0]}")
        return value

    @field_validator("straggler")
    @classmethod
    def _straggler(cls, value: Any) -> Any:
        if value is None or isinstance(value, (bool, StragglerWatch)):
            return value
        raise ValueError(f"must be True, False, None or a StragglerWatch, not {value!r}")

    @field_validator("grow_back")
    @classmethod
    def _grow_back(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or value is False:
            return value
        if not (value is True or isinstance(value, GrowBack)):
            raise ValueError(f"must be True, False, None or a GrowBack, not {value!r}")
        if not info.data.get("elastic"):
            raise ValueError("grows the job back after failures it survived: it needs elastic=True")
        return value

    @field_validator("cost")
    @classmethod
    def _cost(cls, value: Any) -> Any:
        if value is None or isinstance(value, CostModel):
            return value
        raise ValueError(f"must be a hspmd_sdk.planner.CostModel or None, not {type(value).__name__}")


def position_limit(model: "ModelSpec | None") -> int | None:
    """The longest sequence ``model`` can embed: the rows of the position table that a learned position embedding
    (``embedding(positions(x), table)`` in its defined graph) reads, or ``None`` when positions are computed
    (RoPE: Llama takes sequences longer than its ``max_seq_len``) or the model has no graph."""
    if model is None:
        return None
    try:
        graph = graph_of(model)
    except Exception:  # noqa: BLE001 - a model without a graph: the plan checks report it
        return None
    limits = []
    for node in graph.nodes:
        if node.kind != "positions":
            continue
        for use in graph.consumers(node.outputs[0]):
            if use.kind != "embedding" or use.inputs[0] != node.outputs[0]:
                continue
            table = use.inputs[1]
            while graph.producer(table).is_reshard:
                table = graph.producer(table).inputs[0]
            rows = graph.tensors[table].shape[0]
            if isinstance(rows, int):
                limits.append(rows)
    return min(limits) if limits else None


def check_run_options(model: "ModelSpec | None" = None, *, mixed: bool = False, what: str = "training run",
                      **options: Any) -> RunConfig:
    """Validate the launch options ``options`` (keywords of ``launch``) as a :class:`RunConfig` for ``model`` (a
    model config, or ``None`` to skip the model's checks); ``mixed``: for a list of candidate Programs.

    Raises :class:`~hspmd_sdk.errors.PlanValidationError` naming every bad option at once: the option (field path),
    what is allowed and the value given; an unknown option and an option of mixed-length training given for one
    Program (or the reverse) are problems too."""
    problems: list[tuple[str, str]] = []
    fields = RunConfig.model_fields
    wrong_form = sorted(k for k in options if k in MIXED_OPTIONS) if not mixed else []
    for k in wrong_form:
        problems.append((k, f"is an option of mixed-length training (a list of candidate Programs), not of one "
                            f"Program; leave it out (got {options.pop(k)!r})"))
    try:
        config = RunConfig.model_validate(options, context={"model": model, "mixed": mixed})
    except ValidationError as e:
        problems += _problems(e, options, fields)
    if problems:
        raise PlanValidationError(_dedupe(problems), what=what)
    return config


def _problems(err: ValidationError, options: Mapping[str, Any], fields: Mapping[str, Any]
              ) -> list[tuple[str, str]]:
    """``(option path, reason)`` of each pydantic error of validating a mapping of options (each error is at an
    option: ``RunConfig`` has no model-wide validator): the value given and what the option allows."""
    import difflib

    out = []
    for e in err.errors(include_url=False):
        loc = e["loc"]
        name = str(loc[0])
        path = name + "".join(f"[{p}]" for p in loc[1:] if isinstance(p, int))
        if e["type"] == "extra_forbidden":
            near = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; the options are {sorted(fields)}"
            out.append((name, f"is not an option of launch{hint}"))
        elif e["type"] == "value_error":  # a validator's ValueError: its message, which says what is allowed
            out.append((path, e["msg"].removeprefix("Value error, ")))
        else:  # the option's value as given (pydantic's input may be converted: Int's numpy integer to int)
            value = options.get(name, e["input"]) if path == name else e["input"]
            out.append((path, f"must be {fields[name].description}, not {value!r}"))
    return out


def _dedupe(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One problem per option path (a union's branches each report the same bad value)."""
    seen: dict[str, str] = {}
    for path, reason in problems:
        seen.setdefault(path, reason)
    return list(seen.items())
