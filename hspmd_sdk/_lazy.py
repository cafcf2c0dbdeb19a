"""Lazy module attributes (PEP 562), so packages stay fast to import and pull in torch only when used."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any]
                 ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package`` whose public ``name`` lives in ``exports[name]``.

    Module paths may be relative to ``package`` (``".llama"``).  A resolved name is cached in ``namespace`` (the
    package's globals), so each is imported once.
    """
    names = sorted(exports)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return names

    return names, __getattr__, __dir__
