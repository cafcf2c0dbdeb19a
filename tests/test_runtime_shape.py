"""The runtime by responsibility keeps its shape: no module of ``hspmd_sdk/runtime/`` over 600 lines and no function
there over 80 (its docstring included), as ``scripts/code_shape.py`` measures them.  A module or function that grows
past them is split by what it does (the executor's, the session's and the controller's parts are the pattern)."""
from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "hspmd_sdk" / "runtime"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


def _sources() -> list[Path]:
    return sorted(f for f in RUNTIME.rglob("*.py") if "__pycache__" not in f.parts)


def test_no_runtime_module_is_over_600_lines() -> None:
    long = {str(f.relative_to(RUNTIME)): n for f in _sources()
            if (n := len(f.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"runtime modules over {MAX_FILE_LINES} lines (split them by responsibility): {long}"


def test_no_runtime_function_is_over_80_lines() -> None:
    long = {}
    for f in _sources():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{f.relative_to(RUNTIME)}:{node.lineno} {node.name}"] = n
    assert not long, f"runtime functions over {MAX_FUNCTION_LINES} lines (extract named steps): {long}"
    assert len(_sources()) > 50  # the walk found the runtime
