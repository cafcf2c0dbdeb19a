"""A training run as one typed value (SPEC §13): :class:`TrainConfig`, a strict Pydantic model in sections.

========================  ===========================================================================================
section                   fields
========================  ===========================================================================================
``run``                   ``steps``, ``seed``, ``seq_len``, ``global_batch``, ``precision``, ``device``, ``recompute``,
                          ``init``
``data``                  ``path``, ``tokens_per_step``, ``context``, ``lookahead``, ``packing``
``optimizer``             ``kind`` (adam, adamw), ``lr``, ``betas``, ``eps``, ``weight_decay``, ``decay`` (which parameters weight decay
                          applies to: ``"matrices"``, those of 2+ dimensions, or ``"all"``)
``schedule``              a :class:`~.lr_schedule.Schedule` (``kind``, ``warmup_steps``, ``decay_steps``,
                          ``stable_steps``, ``min_lr_factor``)
``clip``                  ``max_norm``
``eval``                  ``every``, ``batches``
``checkpoint``            ``dir``, ``every``, ``keep``, ``async``, ``resume_from``
``reconfigure``           ``elastic``, ``straggler``, ``grow_back``
``launcher``              ``timeout_s``, ``heartbeat_s``, ``stall_s``, ``log_dir``, ``tensorboard``, ``progress``,
                          ``profile``, ``echo``, ``resource_check``
``plan``                  ``model``, ``strategy``, ``cluster`` (what ``hspmd train FILE.toml`` trains, and where)
========================  ===========================================================================================

Every field has a default (``TrainConfig()`` is a valid run of 100 steps); the types and ranges are those of
:class:`~.control.run_config.RunConfig` (:mod:`.config_types`: nothing is rounded or parsed).  Unknown keys and bad
values raise :class:`~hspmd_sdk.errors.PlanValidationError` listing every problem as ``(dotted field path,
reason)``, e.g. ``("optimizer.lrr", "is not a field of [optimizer]; did you mean 'lr'?")``.

Files: :meth:`TrainConfig.from_file` reads TOML or JSON (by suffix); :meth:`~TrainConfig.to_toml` and
:meth:`~TrainConfig.to_json` write a config that reads back equal.  TOML has no ``null``: a ``None`` field is left
out (its default is ``None``), except ``launcher.stall_s``, whose ``None`` (no stall detection) is written ``false``.

The flat keywords of ``launch`` (:data:`FLAT_KEYWORDS`, e.g. ``lr`` for ``optimizer.lr``, ``checkpoint_dir`` for
``checkpoint.dir``) fill the same fields: :meth:`TrainConfig.from_launch_kwargs`, its inverse
:meth:`~TrainConfig.launch_kwargs`, and :meth:`~TrainConfig.merged` (keywords over a config; a keyword and a
config field set to different values for the same thing is an error).  Runtime objects (a Transport, a
StragglerWatch or GrowBack instance, a FailurePolicy, a CostModel, token arrays or Documents as data, a state dict
as ``init``) are not config fields: they stay keywords of ``launch``.

The sections' models and :data:`SECTIONS` are :mod:`.train_sections`' (importable from here too); this module
holds the config as a whole: reading and writing it, the flat keywords, and errors by dotted path.

Pure Pydantic: importing this module loads neither torch nor either side of the runtime.
"""
from __future__ import annotations

import difflib
import json
import re
import sys
import textwrap
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import PlanValidationError, format_path
from .lr_schedule import Schedule
from .train_sections import (SECTIONS, SEED_LIMIT, CheckpointSection, ClipSection, DataSection, EvalSection,
                             LauncherSection, OptimizerSection, PlanSection, ReconfigureSection, RunSection)

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["TrainConfig", "RunSection", "DataSection", "OptimizerSection", "ClipSection", "EvalSection",
           "CheckpointSection", "ReconfigureSection", "LauncherSection", "PlanSection", "FLAT_KEYWORDS",
           "template_toml", "SECTIONS", "SEED_LIMIT"]

#: The flat keywords of ``launch`` and the field each fills (a dotted path; ``schedule`` is the whole section: a
#: :class:`~.lr_schedule.Schedule`, a dict of its fields, or a kind string).  ``run.global_batch`` and ``plan.*``
#: have no keyword: they choose the Program, which ``launch`` is given.
FLAT_KEYWORDS: Mapping[str, str] = MappingProxyType({
    "steps": "run.steps", "seed": "run.seed", "seq_len": "run.seq_len", "precision": "run.precision",
    "device": "run.device", "recompute": "run.recompute", "init": "run.init",
    "data": "data.path", "tokens_per_step": "data.tokens_per_step", "context": "data.context",
    "lookahead": "data.lookahead", "packing": "data.packing",
    "lr": "optimizer.lr", "betas": "optimizer.betas", "eps": "optimizer.eps",
    "weight_decay": "optimizer.weight_decay", "decay": "optimizer.decay", "optimizer": "optimizer.kind",
    "schedule": "schedule", "max_norm": "clip.max_norm", "eval_every": "eval.every", "eval_batches": "eval.batches",
    "checkpoint_dir": "checkpoint.dir", "checkpoint_every": "checkpoint.every", "keep": "checkpoint.keep",
    "checkpoint_async": "checkpoint.async", "resume_from": "checkpoint.resume_from",
    "elastic": "reconfigure.elastic", "straggler": "reconfigure.straggler", "grow_back": "reconfigure.grow_back",
    "timeout_s": "launcher.timeout_s", "heartbeat_s": "launcher.heartbeat_s", "stall_s": "launcher.stall_s",
    "log_dir": "launcher.log_dir", "tensorboard": "launcher.tensorboard", "progress": "launcher.progress",
    "profile": "launcher.profile", "echo": "launcher.echo", "resource_check": "launcher.resource_check",
})


class TrainConfig(BaseModel):
    """One training run in sections (see the module docstring); every field has a default.

    >>> cfg = TrainConfig.from_launch_kwargs(steps=20, lr=3e-3, schedule="cosine")
    >>> cfg.optimizer.lr, cfg.schedule.kind, cfg.launch_kwargs(changed_only=True)["lr"]
    (0.003, 'cosine', 0.003)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: RunSection = Field(default_factory=RunSection)
    data: DataSection = Field(default_factory=DataSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    schedule: Schedule = Field(default_factory=Schedule)
    clip: ClipSection = Field(default_factory=ClipSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    reconfigure: ReconfigureSection = Field(default_factory=ReconfigureSection)
    launcher: LauncherSection = Field(default_factory=LauncherSection)
    plan: PlanSection = Field(default_factory=PlanSection)

    @model_validator(mode="after")
    def _profiled_steps_in_the_run(self) -> "TrainConfig":
        """Each profiled step is a step of the run."""
        for i, step in enumerate(self.launcher.profile):
            if step >= self.run.steps:
                raise ValueError(f"launcher.profile[{i}]: step {step} is not a step of this run (run.steps = "
                                 f"{self.run.steps}: steps 0..{self.run.steps - 1})")
        return self

    # ---- reading -------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, *, what: str = "train config") -> "TrainConfig":
        """Validate nested sections (``{"optimizer": {"lr": 3e-3}, ...}``); a missing section or field takes its
        default.  Raises :class:`~hspmd_sdk.errors.PlanValidationError` naming every bad key by its dotted path."""
        if not isinstance(data, Mapping):
            raise PlanValidationError([("<root>", f"must be a table of sections ({', '.join(SECTIONS)}), not "
                                                  f"{type(data).__name__}")], what=what)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise PlanValidationError(_problems(e), what=what) from None

    @classmethod
    def from_toml(cls, text: str, *, what: str = "train config") -> "TrainConfig":
        """A config from TOML text (sections as tables: ``[optimizer]`` ``lr = 3e-3``)."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise PlanValidationError([("<root>", f"not valid TOML: {e}")], what=what) from None
        return cls.from_dict(data, what=what)

    @classmethod
    def from_json(cls, text: str, *, what: str = "train config") -> "TrainConfig":
        """A config from JSON text (an object of sections, as :meth:`to_json` writes)."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise PlanValidationError([("<root>", f"not valid JSON: {e}")], what=what) from None
        return cls.from_dict(data, what=what)

    @classmethod
    def from_file(cls, path: str | Path) -> "TrainConfig":
        """A config from a ``.toml`` or ``.json`` file (by suffix)."""
        path = Path(path)
        what = f"train config {path.name}"
        suffix = path.suffix.lower()
        if suffix not in (".toml", ".json"):
            raise PlanValidationError([(str(path), "a train config is a .toml or .json file; rename it or write "
                                                   "it as one ('hspmd train --template' prints a TOML one)")],
                                      what="train config")
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise PlanValidationError([(str(path), f"cannot be read: {e.strerror or e}")], what="train config") \
                from None
        except UnicodeDecodeError as e:
            raise PlanValidationError([(str(path), f"is not UTF-8 text: {e}")], what="train config") from None
        return cls.from_toml(text, what=what) if suffix == ".toml" else cls.from_json(text, what=what)

    # ---- writing -------------------------------------------------------------------------------------------
    def to_toml(self) -> str:
        """This config as TOML: one table a section, every field that is not ``None`` (``launcher.stall_s =
        false`` for its ``None``); :meth:`from_toml` reads it back equal."""
        data = self.model_dump(mode="json", by_alias=True)
        lines: list[str] = []
        for name, section in SECTIONS.items():
            lines.append(f"[{name}]")
            for key, value in data[name].items():
                if value is None:
                    if _field(section, key).default is None:
                        continue
                    value = False  # a None whose default is not None: the field takes false for it (stall_s)
                lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)

    def to_json(self, indent: int | None = 2) -> str:
        """This config as JSON (``None`` as ``null``); :meth:`from_json` reads it back equal."""
        return json.dumps(self.model_dump(mode="json", by_alias=True), indent=indent)

    # ---- the flat keywords of launch -----------------------------------------------------------------------
    @classmethod
    def from_launch_kwargs(cls, **flat: Any) -> "TrainConfig":
        """A config from the flat keywords of ``launch`` (:data:`FLAT_KEYWORDS`); the others take their defaults.

        Problems name the keyword given (``lr``, ``profile[0]``).  A keyword that is not one of a config (a
        runtime object such as ``transport=``, or a misspelling) is a problem too."""
        return cls().merged(flat)

    def launch_kwargs(self, *, changed_only: bool = False) -> dict[str, Any]:
        """The flat keywords of ``launch`` that say what this config says (:data:`FLAT_KEYWORDS`; ``schedule`` as a
        :class:`~.lr_schedule.Schedule`, ``betas`` as a tuple, paths as ``str``).

        ``changed_only=False`` (default): every keyword, ``None`` values included.  ``changed_only=True``: only
        those whose field differs from ``TrainConfig()``'s, and ``steps`` always.  Either way
        ``TrainConfig.from_launch_kwargs(**cfg.launch_kwargs()) == cfg`` for every ``cfg`` whose ``run.global_batch``
        and ``plan`` are at their defaults (they have no keyword)."""
        mine = self.model_dump(mode="python", by_alias=True)
        default = _default_dump() if changed_only else None
        out: dict[str, Any] = {}
        for key, path in FLAT_KEYWORDS.items():
            value = _get(mine, path)
            if default is not None and key != "steps" and value == _get(default, path):
                continue
            out[key] = Schedule.model_validate(value) if key == "schedule" else value
        return out

    def merged(self, flat: Mapping[str, Any]) -> "TrainConfig":
        """This config with the flat keywords ``flat`` of ``launch`` laid over it.

        A keyword whose field this config sets (is not at its default) to another value is an error: the same
        thing given twice, differently (``lr=3e-3`` over ``optimizer.lr = 1e-2``); the same value twice is not.
        Raises :class:`~hspmd_sdk.errors.PlanValidationError` naming each keyword (unknown ones included)."""
        problems: list[tuple[str, str]] = []
        given: dict[str, Any] = {}
        for key, value in flat.items():
            if key not in FLAT_KEYWORDS:
                problems.append((key, _unknown_keyword(key)))
            else:
                given[key] = _normalized(key, value)
        mine, default = self.model_dump(mode="python", by_alias=True), _default_dump()
        for key, value in list(given.items()):
            path = FLAT_KEYWORDS[key]
            current = _get(mine, path)
            if current != _get(default, path) and not _same(key, value, current):
                problems.append((key, f"is given twice: {key}={value!r} as a keyword and {path} = {current!r} in "
                                      "the config; give it in one place"))
                del given[key]
        for key, value in given.items():
            _set(mine, FLAT_KEYWORDS[key], value)
        try:
            merged = type(self).model_validate(mine)
        except ValidationError as e:
            problems += _flat_paths(_problems(e), given)
        if problems:
            raise PlanValidationError(problems, what="training run")
        return merged

    def updated(self, values: Mapping[str, Any]) -> "TrainConfig":
        """This config with fields replaced by dotted path (``cfg.updated({"run.steps": 50})``), validated as a
        whole: a command-line override.  An unknown path is an error naming it."""
        mine = self.model_dump(mode="python", by_alias=True)
        problems = [(path, "is not a field of a train config") for path in values if not _has(path)]
        if problems:
            raise PlanValidationError(problems, what="train config")
        for path, value in values.items():
            _set(mine, _canonical(path), value)
        try:
            return type(self).model_validate(mine)
        except ValidationError as e:
            raise PlanValidationError(_problems(e), what="train config") from None


# ---- helpers: paths into the nested dump ---------------------------------------------------------------------
def _field(section: type[BaseModel], key: str) -> "FieldInfo":
    """The field of ``section`` named ``key`` (by name or alias)."""
    for name, info in section.model_fields.items():
        if key in (name, info.alias):
            return info
    raise KeyError(key)


def _has(path: str) -> bool:
    """Whether the dotted ``path`` names a field (``run.steps``, ``checkpoint.async``) or a section."""
    head, _, key = path.partition(".")
    if head not in SECTIONS:
        return False
    if not key:
        return True
    try:
        _field(SECTIONS[head], key)
    except KeyError:
        return False
    return True


def _canonical(path: str) -> str:
    """A dotted field path with the field's alias as its key (``checkpoint.async_`` -> ``checkpoint.async``)."""
    head, _, key = path.partition(".")
    if not key:
        return head
    info = _field(SECTIONS[head], key)
    return f"{head}.{info.alias or key}"


def _get(data: Mapping[str, Any], path: str) -> Any:
    for part in path.split("."):
        data = data[part]
    return data


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *heads, last = path.split(".")
    for part in heads:
        data = data[part]
    data[last] = value


def _normalized(key: str, value: Any) -> Any:
    """A keyword's value as its field holds it, where ``launch`` takes more forms: ``profile=3`` -> ``[3]``,
    ``None`` -> ``[]``; ``schedule="cosine"`` -> ``{"kind": "cosine"}``, a Schedule -> its fields; a ``Path`` ->
    its ``str``; ``betas`` -> a tuple.  Anything else unchanged (validation judges it)."""
    if key == "profile":
        if value is None:
            return []
        if isinstance(value, int) and not isinstance(value, bool):
            return [value]
        return list(value) if isinstance(value, (list, tuple, range)) else value
    if key == "schedule":
        if value is None:
            return {}
        if isinstance(value, str):
            return {"kind": value}
        if isinstance(value, Schedule):
            return value.model_dump()
        return dict(value) if isinstance(value, Mapping) else value
    if key == "betas" and isinstance(value, list):
        return tuple(value)
    if isinstance(value, Path):
        return str(value)
    return value


def _same(key: str, value: Any, current: Any) -> bool:
    """Whether a keyword's (normalized) value says what the config's field says."""
    if key == "schedule" and isinstance(value, Mapping):
        try:
            return Schedule.model_validate(value).model_dump() == current
        except ValidationError:
            return False
    try:
        return bool(value == current)
    except Exception:  # noqa: BLE001 - an object without a plain == (an array): not the same
        return False


def _unknown_keyword(key: str) -> str:
    near = difflib.get_close_matches(key, list(FLAT_KEYWORDS), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return (f"is not a keyword of a train config{hint} (runtime objects such as transport, cost, policy or "
            "fault_injection are keywords of launch itself)")


# ---- helpers: pydantic errors as (dotted path, reason) -------------------------------------------------------
_HEAD = re.compile(r"^(?P<head>[A-Za-z_]\w*(?:\[\d+\]|\.[A-Za-z_]\w*)*): (?P<rest>.*)$", re.S)


def _problems(err: ValidationError) -> list[tuple[str, str]]:
    """``(dotted path, reason)`` of each pydantic error, one per path: unknown keys with the nearest field, bad
    values with what the field allows and the value given."""
    seen: dict[str, str] = {}
    for e in err.errors(include_url=False):
        path, info, section = _locate(tuple(e.get("loc", ())))
        kind = e["type"]
        if kind == "extra_forbidden":
            reason = _unknown_key(path, section)
        elif kind in ("value_error", "assertion_error"):
            reason = str(e.get("msg", "invalid")).split(", ", 1)[-1]
            m = _HEAD.match(reason)
            if m:  # a check over several fields names the one it is about
                path = f"{path}.{m['head']}" if path else m["head"]
                reason = m["rest"]
        elif kind in ("model_type", "model_attributes_type", "dict_type") and info is None:
            reason = f"must be a table of fields ([{path}] in TOML), not {e.get('input')!r}"
        else:
            allowed = info.description if info is not None and info.description else str(e.get("msg"))
            reason = f"must be {allowed}, not {e.get('input')!r}"
        seen.setdefault(path or "<root>", reason)
    return list(seen.items())


def _locate(loc: tuple[Any, ...]) -> tuple[str, Any, type[BaseModel] | None]:
    """The dotted path of a pydantic error location (union branches dropped), the field it ends at (``None`` for a
    section or an unknown key) and the model its last key was looked up in (``TrainConfig`` or a section)."""
    model: type[BaseModel] | None = TrainConfig
    owner: type[BaseModel] | None = None
    info = None
    parts: list[Any] = []
    for part in loc:
        if isinstance(part, int):
            parts.append(part)
            continue
        if model is None:
            continue  # a union branch's tag, a validator's name: not a place in the config
        owner = model
        try:
            info = _field(model, str(part))
        except KeyError:
            parts.append(part)  # an unknown key: its own name
            break
        parts.append(info.alias or part)
        model = SECTIONS.get(str(part)) if model is TrainConfig else None
        if model is not None:
            info = None
    return format_path(parts), info, owner


#: Keys of earlier versions, and what they are called now.
RENAMED = {"data.source": "path"}


def _unknown_key(path: str, section: type[BaseModel] | None) -> str:
    """Why ``path`` is not a key, with the nearest one."""
    key = path.rpartition(".")[2]
    if path in RENAMED:
        return f"was renamed: write {RENAMED[path]!r} (the same value)"
    if section is None or section is TrainConfig:
        names = list(SECTIONS)
        near = difflib.get_close_matches(key, names, n=1)
        return ("is not a section of a train config" + (f"; did you mean {near[0]!r}?" if near else "")
                + f" (the sections: {', '.join(names)})")
    names = [info.alias or name for name, info in section.model_fields.items()]
    head = path.rpartition(".")[0]
    near = difflib.get_close_matches(key, names, n=1)
    return (f"is not a field of [{head}]" + (f"; did you mean {near[0]!r}?" if near else "")
            + f" (its fields: {', '.join(names)})")


def _flat_paths(problems: list[tuple[str, str]], given: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Problems at the fields of keywords in ``given`` named by the keyword (``optimizer.lr`` -> ``lr``,
    ``launcher.profile[0]`` -> ``profile[0]``); ``schedule.*`` keeps its field names."""
    out = []
    for path, reason in problems:
        for key in given:
            field = FLAT_KEYWORDS[key]
            if key != "schedule" and (path == field or path.startswith(field + "[")):
                path = key + path[len(field):]
                break
        out.append((path, reason))
    return out


# ---- helpers: TOML text ----------------------------------------------------------------------------------------
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped; the rest as it is (UTF-8)."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    """A JSON-mode value (bool, int, finite float, str, list of them) as TOML that reads back equal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # shortest round-trip form: '0.001', '1e-08', '120.0' are TOML floats
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")  # the sections hold none


def template_toml() -> str:
    """A commented TOML config holding every default (what ``hspmd train --template`` prints): each field with
    what it means and what it allows; fields whose default is ``None`` commented out.  It reads back as
    ``TrainConfig()``."""
    default = TrainConfig().model_dump(mode="json", by_alias=True)
    lines = ["# An hspmd train config: every field at its default (a field whose default is None is commented out).",
             "# Run it with 'hspmd train FILE.toml'; a key that is not below is an error.", ""]
    for name, section in SECTIONS.items():
        lines += [f"# ---- {_HEADINGS[name]}", f"[{name}]"]
        for key, info in section.model_fields.items():
            key = info.alias or key
            lines += textwrap.wrap(f"{info.title or key}: {info.description}", 110, initial_indent="# ",
                                   subsequent_indent="#   ")
            value = default[name][key]
            lines.append(f"# {key} =" if value is None else f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


#: What each section is, for :func:`template_toml`.
_HEADINGS = MappingProxyType({
    "run": "the run: its length, seed, shapes, precision and device",
    "data": "the training data (tokens_per_step, context, lookahead, packing: mixed-length data)",
    "optimizer": "Adam or AdamW (torch.optim) and which parameters weight decay applies to",
    "schedule": "the learning-rate schedule: warmup step s < W at (s+1)/(W+1), then 'constant' 1, or a stable phase "
                "('wsd') and a 'linear'/'cosine'/'wsd' decay to min_lr_factor (hspmd_sdk.runtime.lr_schedule)",
    "clip": "gradient clipping by the global L2 norm",
    "eval": "the validation loss on the data's validation split, forward only",
    "checkpoint": "sharded checkpoints that load under any plan",
    "reconfigure": "graph switching on its own: failures, stragglers, growing back",
    "launcher": "timeouts, fault detection, logs, progress, profiling",
    "plan": "what 'hspmd train' trains and where: the model, the strategy, the cluster",
})


def _default_dump() -> dict[str, Any]:
    """``TrainConfig()`` as nested dicts (field aliases as keys), to compare fields with their defaults."""
    return TrainConfig().model_dump(mode="python", by_alias=True)
