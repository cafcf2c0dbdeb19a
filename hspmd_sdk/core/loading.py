"""Loading pydantic models from user input (dict, JSON text, file path) with path-precise errors."""
from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ..errors import PlanValidationError

__all__ = ["load_model", "read_json_text"]

M = TypeVar("M", bound=BaseModel)

def read_json_text(data: str | Path, *, what: str) -> str:
    """JSON text from ``data``: a string starting with ``{`` is JSON itself, anything else is a file path.

    A missing or unreadable file raises :class:`PlanValidationError` naming the path.
    """
    if isinstance(data, str) and data.lstrip().startswith("{"):
        return data
    path = Path(data)
    try:
        return path.read_text()
    except (OSError, ValueError) as e:  # ValueError: embedded NUL and similar
        reason = "no such file" if isinstance(e, FileNotFoundError) else f"cannot read: {e}"
        raise PlanValidationError([(str(data)[:200] or "<empty path>", f"{reason} (expected a {what} JSON "
                                                                       "file or JSON text)")], what=what) from None


def load_model(cls: type[M], data: Any, *, what: str) -> M:
    """Validate ``data`` (an instance, dict, JSON text, ``Path`` or path string) as ``cls``.

    Raises :class:`PlanValidationError` whose problems are ``(field path, reason)``.
    """
    if isinstance(data, cls):
        return data
    try:
        if isinstance(data, (str, Path)):
            return cls.model_validate_json(read_json_text(data, what=what))
        if isinstance(data, (bytes, bytearray)):
            return cls.model_validate_json(data)
        return cls.model_validate(data)
    except ValidationError as e:
        raise PlanValidationError.from_pydantic(e, what=what) from None
