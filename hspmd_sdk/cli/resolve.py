"""``hspmd resolve SRC DST --shape ...``: the communication that turns one annotation into another (§5), with its
time on a cluster (:data:`RESOLVE`)."""
from __future__ import annotations

import argparse

from pydantic import ValidationError

from ..core.annotation import Annotation
from ..core.resolve import itemsize_of, resolve
from ..errors import PlanValidationError
from .command import Command
from .inputs import load_cluster

__all__ = ["RESOLVE", "MAX_DIM", "MAX_ELEMENTS"]


def _resolve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="source annotation in the compact notation, e.g. \"[0,1] P2\"")
    p.add_argument("dst", help="destination annotation, e.g. \"[0,1] S0x2\"")
    p.add_argument("--shape", required=True, help="global tensor shape, comma separated (e.g. 64,64; each dim "
                                                   f"1..{MAX_DIM}, at most {MAX_ELEMENTS:.0e} elements)")
    p.add_argument("--dtype", default="float32", help="element type (float32, bfloat16, ...; default float32)")
    p.add_argument("--cluster", help="cluster JSON, packaged example or counts like H800:16,H20:16, for link classes "
                                     "and time estimates")


def _annotation(text: str, which: str) -> Annotation:
    """The annotation ``text`` (argument ``which``); its problems worded as every loader words them (no pydantic
    boilerplate)."""
    try:
        return Annotation(text)
    except ValidationError as e:
        raise PlanValidationError.from_pydantic(e, what="annotation", prefix=which) from None
    except (ValueError, TypeError) as e:  # the text itself cannot be read
        raise PlanValidationError([(which, str(e).splitlines()[-1].strip())], what="annotation") from None


def _resolve(args: argparse.Namespace) -> int:
    src, dst = _annotation(args.src, "SRC"), _annotation(args.dst, "DST")
    shape = _shape(args.shape)
    _check_dtype(args.dtype)
    cluster = load_cluster(args.cluster) if args.cluster else None
    plan = resolve(src, dst, shape, dtype=args.dtype, cluster=cluster)
    print(plan.render())
    if cluster is not None:
        print(f"  estimated time on {cluster}: {plan.estimated_time(cluster) * 1e3:.3f} ms")
    return 0


#: Bounds of a ``--shape``: each dimension, and all elements together (2**48: 1 PiB of fp32 values).
MAX_DIM = 1 << 40
MAX_ELEMENTS = float(1 << 48)


def _shape(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    if len(text) > 1000 or len(parts) > 16:
        raise PlanValidationError([("--shape", "at most 16 dimensions")], what="arguments")
    try:
        shape = tuple(int(x) for x in parts)
    except ValueError:
        raise PlanValidationError([("--shape", f"{text[:60]!r}: write integers separated by commas, e.g. 64,32")],
                                  what="arguments") from None
    bad = [d for d in shape if not 1 <= d <= MAX_DIM]
    if bad:
        raise PlanValidationError([("--shape", f"dimension {bad[0]} is out of range (1..{MAX_DIM})")],
                                  what="arguments")
    total = 1
    for d in shape:
        total *= d
    if total > MAX_ELEMENTS:
        raise PlanValidationError([("--shape", f"{total:.3g} elements is more than {MAX_ELEMENTS:.0e}")],
                                  what="arguments")
    return shape


def _check_dtype(dtype: str) -> None:
    try:
        itemsize_of(dtype)
    except (ValueError, TypeError, KeyError) as e:
        raise PlanValidationError([("--dtype", str(e))], what="arguments") from None


RESOLVE = Command("resolve the communication that turns one annotation into another (§5)", _resolve_arguments,
                  _resolve)
