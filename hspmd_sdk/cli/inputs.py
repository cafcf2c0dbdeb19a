"""Reading the command line's inputs: argument types with bounds, files, output paths; and the one-line model
description every command prints.

Every reader turns bad input into :class:`~hspmd_sdk.errors.PlanValidationError` (files) or
``argparse.ArgumentTypeError`` (argument values), naming what and where, so that the CLI prints one ``error:``
line and never a traceback.  Shared by the subcommands of :mod:`hspmd_sdk.cli`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

from ..core.cluster import MAX_RANKS, Cluster, format_count
from ..errors import PlanValidationError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: Bounds of the sizes the CLI accepts (far above any real run; they keep a typo from running for hours).
MAX_STEPS = 10**9
MAX_SAMPLES = 1 << 24  # global batch, micro-batches
MAX_TOKENS = 1 << 24  # a sequence
MAX_SEED = (1 << 63) - 1
MAX_SECONDS = 10**7


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip()) if len(text) <= 40 else None
        except ValueError:
            value = None
        if value is None:
            raise argparse.ArgumentTypeError(f"{_short(text)} is not an integer")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {low}..{high}")
        return value
    parse.__name__ = "integer"
    return parse


def number_above(low: float, *, inclusive: bool = False, high: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite number ``> low`` (``>= low`` when ``inclusive``) and ``<= high``."""
    def parse(text: str) -> float:
        try:
            value = float(text) if len(text) <= 60 else math.nan
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_short(text)} is not a number") from None
        ok = math.isfinite(value) and (value >= low if inclusive else value > low) and value <= high
        if not ok:
            bound = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if math.isfinite(high) else "")
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, not {_short(text)}")
        return value
    parse.__name__ = "number"
    return parse


def add_fault_arguments(p: argparse.ArgumentParser) -> None:
    """``--timeout``, ``--stall``, ``--heartbeat``, ``--no-resource-check`` (``run`` and ``launch``)."""
    p.add_argument("--timeout", type=number_above(0, high=MAX_SECONDS), default=120.0, metavar="S",
                   help="collective and rendezvous timeout in seconds (default 120)")
    p.add_argument("--stall", type=number_above(0, high=MAX_SECONDS), default=30.0, metavar="S",
                   help="name a rank as hung when it stays out of communication this long while its peers wait "
                        "for it (default 30; a rank that stops beating is named after 10 heartbeats)")
    p.add_argument("--heartbeat", type=number_above(0, high=60), default=1.0, metavar="S",
                   help="heartbeat period of workers, agents and launcher (default 1)")
    p.add_argument("--no-resource-check", action="store_true",
                   help="start even if the memory estimate or the ranks exceed what the hosts have")


def _short(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def resolve_file(name: str) -> Path:
    """A path that exists, or a packaged example by file name (``.json`` optional)."""
    try:
        path = Path(name)
        if path.exists():
            return path
        for candidate in (EXAMPLES / name, EXAMPLES / f"{name}.json"):
            if candidate.is_file() and candidate.parent == EXAMPLES:
                return candidate
    except (OSError, ValueError):  # a name too long for the file system, an embedded NUL
        pass
    raise PlanValidationError([(_short(name).strip("'"), "no such file (nor a packaged example; `hspmd examples` "
                                                         "lists them)")], what="input")


def read_text(path: Path, *, what: str = "input") -> str:
    """The text of a file: UTF-8, else a clear error (a binary file, a folder, no permission)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PlanValidationError([(str(path), f"not UTF-8 text (byte {e.start}): a binary file?")],
                                  what=what) from None
    except OSError as e:
        raise PlanValidationError([(str(path), f"cannot read: {e.strerror or e}")], what=what) from None


def read_json(path: Path, *, what: str = "input") -> Any:
    """The JSON document in a file; every way it can be bad is a :class:`PlanValidationError` naming the file."""
    text = read_text(path, what=what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanValidationError([(str(path), f"not valid JSON: line {e.lineno} column {e.colno}: {e.msg}")],
                                  what=what) from None
    except RecursionError:
        raise PlanValidationError([(str(path), "JSON nested too deeply")], what=what) from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise PlanValidationError([(str(path), f"not usable JSON: {e}")], what=what) from None


def check_output(path: str, option: str = "-o/--output") -> Path:
    """``path`` can be written (its folder exists and is writable): checked *before* the work that fills it."""
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise PlanValidationError([(option, f"{path} is a folder; give a file name")], what="arguments")
    if not folder.is_dir():
        raise PlanValidationError([(option, f"folder {folder} does not exist")], what="arguments")
    if not os.access(folder, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise PlanValidationError([(option, f"cannot write {path} (permission denied)")], what="arguments")
    return out


def write_output(path: Path, text: str, option: str = "-o/--output") -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise PlanValidationError([(option, f"cannot write {path}: {e.strerror or e}")], what="arguments") from None


def example_context(path: Path) -> dict[str, Any]:
    """For a packaged example strategy, its model, cluster and global batch from ``examples/index.json``."""
    index = path.resolve().parent / "index.json"
    if not index.is_file():
        return {}
    try:
        entry = json.loads(index.read_text()).get("strategies", {}).get(path.name, {})
    except (OSError, ValueError, AttributeError):
        return {}
    return entry if isinstance(entry, dict) else {}


def load_cluster(text: str) -> Any:
    """A cluster from a JSON path, a packaged example name, or ``KIND:COUNT,...``."""
    if ":" in text and not Path(text).exists() and "{" not in text:
        counts: dict[str, int] = {}
        for part in text.split(","):
            kind, _, n = part.partition(":")
            kind, n = kind.strip(), n.strip()
            if not kind or not (n.isdigit() and len(n) <= 7):
                raise PlanValidationError([("--cluster", f"cannot read {part[:60]!r}: write KIND:COUNT, e.g. "
                                                         f"H800:16,H20:32 (a count 1..{MAX_RANKS})")],
                                          what="arguments")
            if kind in counts:
                raise PlanValidationError([("--cluster", f"{kind} is given twice")], what="arguments")
            counts[kind] = int(n)
        return Cluster.mixed(counts)
    return Cluster.load(resolve_file(text))


def describe_model(model: Any) -> str:
    """``tiny: 4 layers, hidden 64, 197K parameters`` (parameter counts in K/M/B, as every display writes them)."""

    hidden = getattr(model, "hidden_size", None)
    return (f"{getattr(model, 'name', type(model).__name__)}: {model.num_layers} layers"
            + (f", hidden {hidden}" if hidden else "") + f", {format_count(model.param_count())} parameters")
