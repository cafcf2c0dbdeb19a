"""The strict value types of the run options, shared by :class:`~.control.run_config.RunConfig` (the flat keywords of
``launch``) and :class:`~.train_config.TrainConfig` (the same options in sections): integers are integers, flags
are ``bool``, numbers are finite, paths are ``str`` or ``pathlib.Path``.  Nothing is rounded or parsed:
``steps=2.5``, ``steps="3"`` and ``steps=True`` are refused.

Pure Pydantic: importing it loads neither torch nor either side of the runtime.
"""
from __future__ import annotations

import numbers
from pathlib import Path
from typing import Annotated, Any, Union

from pydantic import AfterValidator, BeforeValidator, Field, Strict

__all__ = ["Int", "Bool", "Number", "PathLike", "PathText"]


def _integral(value: Any) -> Any:
    """A numpy (or other ``numbers.Integral``) integer as an ``int``; anything else unchanged, for the strict check
    (a ``bool`` stays a ``bool`` and is refused)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


#: A whole number: ``int`` or a numpy integer; never a bool, a float or a string.
Int = Annotated[int, BeforeValidator(_integral), Strict()]
#: A flag: ``True`` or ``False`` only.
Bool = Annotated[bool, Strict()]
#: A finite real number (``int`` or ``float``; never a bool or a string).
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]
#: A path: ``str`` or ``pathlib.Path``.
PathLike = Union[Annotated[str, Strict()], Path]


def _path_text(value: str | Path) -> str:
    """``value`` as a ``str``, unless it is empty (an empty path names no file)."""
    text = str(value)
    if not text:
        raise ValueError("must be a non-empty path (str or Path), not ''")
    return text


#: A path given as ``str`` or ``pathlib.Path`` and kept as its non-empty ``str`` (a config that is written to a
#: file and read back is the same value).
PathText = Annotated[PathLike, AfterValidator(_path_text)]
