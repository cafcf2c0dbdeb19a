"""The package's import graph (issue 23), imports inside functions included, read from the source with ``ast``.

* ``core`` imports nothing of the package but ``errors`` (and the lazy-export helper);
* ``planner`` imports nothing of ``runtime``, ``viz`` or the command line (profiling is the runtime's: it hands
  the planner a ``CostModel`` value);
* no import cycle appears beyond the ones listed in ``KNOWN_CYCLES`` (each still to be removed: the list may only
  shrink; a cycle that is gone must be taken off it, so the list stays true).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hspmd_sdk"

#: Import cycles that exist today, by their sorted module sets.  The goal is none.
KNOWN_CYCLES: set[tuple[str, ...]] = set()

#: The runtime split by side, as the processes are (ARCHITECTURE.md, milestone 3), one folder a side: the
#: launcher's (``runtime/control``), the worker's (``runtime/workers``), the transports (``runtime/transports``) and
#: checkpoints (``runtime/checkpoints``); what both sides read (the protocol's values, the launch spec, the data,
#: metrics, traces, the single-device references) stays at ``runtime/``'s top.
SIDE_FOLDERS = ("control", "workers", "transports", "checkpoints")
SHARED = {"protocol", "spec", "data", "metrics", "trace", "reference", "config_types", "lr_schedule", "train_config"}


def _side(module: str) -> str:
    """``control``/``workers``/``transports``/``checkpoints``, ``shared`` for runtime/'s top, '' outside it."""
    parts = module.split(".")
    if parts[:2] != ["hspmd_sdk", "runtime"] or len(parts) < 3:
        return ""
    return parts[2] if parts[2] in SIDE_FOLDERS else "shared"



def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source (``from x import y`` counts module
    ``x.y`` when that is a module, else ``x``)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for t in names:
                while t not in mods and "." in t:
                    t = t.rpartition(".")[0]
                if t in mods and t != m:
                    edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.add(tuple(sorted(comp)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_graph_reader_sees_imports_inside_functions() -> None:
    edges = import_graph()
    # runtime/control/train.py imports .mixed inside launch only
    assert "hspmd_sdk.runtime.control.mixed" in edges["hspmd_sdk.runtime.control.train"]
    # a cycle through a function-level import is a cycle
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}


def test_core_imports_nothing_else_of_the_package() -> None:
    bad = sorted((m, t) for m, ts in import_graph().items() if _top(m) == "core"
                 for t in ts if _top(t) not in ("core", "errors", "_lazy"))
    assert bad == []


def test_the_planner_imports_nothing_of_the_runtime_the_viz_or_the_command_line() -> None:
    bad = sorted((m, t) for m, ts in import_graph().items() if _top(m) == "planner"
                 for t in ts if _top(t) in ("runtime", "viz") or t == "hspmd_sdk.cli")
    assert bad == []


def test_no_new_import_cycle() -> None:
    found = cycles(import_graph())
    assert found - KNOWN_CYCLES == set(), "new import cycle(s)"
    assert KNOWN_CYCLES - found == set(), "these cycles are gone: take them off KNOWN_CYCLES"


def test_nothing_of_the_product_imports_the_test_helpers() -> None:
    bad = sorted((m, t) for m, ts in import_graph().items() if _top(m) != "testing"
                 for t in ts if _top(t) == "testing")
    assert bad == []


def test_every_runtime_module_is_on_one_side() -> None:
    """Each module lives in its side's folder; runtime/'s top holds only what both sides read."""
    runtime = [m for m in import_graph() if m.startswith("hspmd_sdk.runtime.")]
    top = {m.rpartition(".")[2] for m in runtime if _side(m) == "shared"} - set(SIDE_FOLDERS)
    assert top == SHARED, "runtime/'s top is for what both sides read: place the new module(s) in a side's folder"
    assert {_side(m) for m in runtime} == set(SIDE_FOLDERS) | {"shared"}


def test_the_worker_side_imports_nothing_of_the_launcher_side_or_the_transports() -> None:
    """A worker's modules reach the launcher only through the protocol's values (and the launch spec)."""
    edges = import_graph()
    bad = sorted((m, t) for m in edges if _side(m) == "workers" for t in edges[m]
                 if _side(t) in ("control", "transports"))
    assert bad == []
    # what both sides read depends on neither side's machinery; checkpoints' files on nothing of the launcher
    shared = sorted((m, t) for m in edges if _side(m) in ("shared", "checkpoints") for t in edges[m]
                    if _side(t) in ("control", "transports"))
    assert shared == []


def test_the_runtime_imports_nothing_of_the_viz_or_the_command_line() -> None:
    found = sorted((m, t) for m, ts in import_graph().items() if _top(m) == "runtime"
                   for t in ts if _top(t) == "viz" or t.startswith("hspmd_sdk.cli"))
    assert found == []
