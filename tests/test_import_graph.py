"""The package's import graph (issue 23), imports inside functions included, read from the source with ``ast``.

Imports by a string count too (issue 47): ``importlib.import_module("x")`` and ``__import__("x")`` with a literal
name, a call with a literal name to a helper of the same module that hands its parameter to ``import_module`` (the
way ``cli.py`` once loaded ``cli_ssh``: ``_lazy("hspmd_sdk.cli_ssh", ...)``), and ``"module:function"`` entry
strings (``"hspmd_sdk.runtime.workers.worker_entry:train_entry"``).  Module names handed to another process
(``python -m ...``, the fork server's preloads) and lazy package exports are not imports of this process's modules.

* ``core`` imports nothing of the package but ``errors`` (and the lazy-export helper);
* ``planner`` imports nothing of ``runtime``, ``viz`` or the command line (profiling is the runtime's: it hands
  the planner a ``CostModel`` value);
* no import cycle appears beyond the ones listed in ``KNOWN_CYCLES`` (each still to be removed: the list may only
  shrink; a cycle that is gone must be taken off it, so the list stays true).
"""
from __future__ import annotations

import ast
import functools
import re
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



def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _is_import_call(node: ast.AST) -> bool:
    """``import_module(...)``, ``importlib.import_module(...)`` or ``__import__(...)``."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id in ("import_module", "__import__")
            or isinstance(f, ast.Attribute) and f.attr == "import_module")


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _loaders(tree: ast.AST) -> dict[str, int]:
    """The functions of a module that import the module one of their parameters names (in their body or a function
    nested in it): function name -> that parameter's position."""
    out = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            for call in ast.walk(fn):
                if _is_import_call(call) and call.args and isinstance(call.args[0], ast.Name) \
                        and call.args[0].id in params:
                    out[fn.name] = params.index(call.args[0].id)
    return out


#: ``"package.module:function"``, the form of a worker entry or a registered class.
ENTRY_STRING = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+:[A-Za-z_]\w*")


def _string_imports(tree: ast.AST, package: str) -> list[str]:
    """The modules a module's source names as strings to import: ``import_module``/``__import__`` of a literal
    (relative to the ``package`` argument, or to the module's own package), a literal handed to one of its own
    loader helpers (:func:`_loaders`), and ``"module:function"`` entry strings."""
    loaders = _loaders(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            position = None
            if _is_import_call(node):
                position = 0
            elif isinstance(node.func, ast.Name) and node.func.id in loaders:
                position = loaders[node.func.id]
            name = _literal(node.args[position]) if position is not None and len(node.args) > position else None
            if name:
                if name.startswith("."):
                    anchor = _literal(node.args[1]) if _is_import_call(node) and len(node.args) > 1 else None
                    base = (anchor or package).split(".")
                    level = len(name) - len(name.lstrip("."))
                    name = ".".join(base[: len(base) - level + 1] + [name.lstrip(".")])
                out.append(name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ENTRY_STRING.fullmatch(node.value):
            out.append(node.value.partition(":")[0])
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source (``from x import y`` counts module
    ``x.y`` when that is a module, else ``x``), by a statement or by a string (:func:`_string_imports`)."""
    return {m: set(ts) for m, ts in _read_graph(root).items()}  # a copy: the tests share one reading


@functools.lru_cache(maxsize=None)
def _read_graph(root: Path) -> dict[str, frozenset[str]]:
    mods = _modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        tree = ast.parse(f.read_text())
        for t in _string_imports(tree, package):
            while t not in mods and "." in t:
                t = t.rpartition(".")[0]
            if t in mods and t != m:
                edges[m].add(t)
        for node in ast.walk(tree):
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
    return {m: frozenset(ts) for m, ts in edges.items()}


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


def test_the_graph_reader_sees_imports_by_string(tmp_path: Path) -> None:
    """A module loaded by a string is an edge: the loop ``cli.py`` -> ``cli_ssh`` (by ``_lazy("...cli_ssh", ...)``)
    -> ``cli.main`` (by an import statement) was one the statement-only reader could not see."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    sources = {
        "__init__.py": "",
        # the old cli.py's way: a helper importing the module its parameter names, called with a literal
        "a.py": "def _lazy(module, name):\n    def call(*args):\n        import importlib\n\n"
                "        return getattr(importlib.import_module(module), name)(*args)\n    return call\n\n\n"
                "RUN = _lazy('pkg.b', 'run')\n",
        "b.py": "def run():\n    from .a import RUN\n\n    return RUN\n",
        "c.py": "import importlib\n\nimportlib.import_module('.d', 'pkg')\n__import__('pkg.e')\n",
        "d.py": "from importlib import import_module\n\nE = import_module('.e', __package__)\n",
        "e.py": "ENTRY = 'pkg.f:main'\nNOT_AN_IMPORT = 'python -m pkg.c'\n",
        "f.py": "def main():\n    pass\n",
    }
    for name, text in sources.items():
        (pkg / name).write_text(text)
    edges = import_graph(pkg)
    assert edges == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.d", "pkg.e"},
                     "pkg.d": {"pkg.e"}, "pkg.e": {"pkg.f"}, "pkg.f": set()}
    assert cycles(edges) == {("pkg.a", "pkg.b")}


def test_the_command_line_is_one_package_and_its_entry_point_is_there() -> None:
    """``hspmd_sdk/cli/`` holds the whole command line (no ``cli_*.py`` beside it); the console scripts of
    pyproject.toml name a module of the package and a callable in it."""
    import importlib
    import tomllib

    mods = _modules()
    assert sorted(m for m in mods if m.startswith("hspmd_sdk.cli_")) == []
    scripts = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"hspmd": "hspmd_sdk.cli:main"}
    for entry in scripts.values():
        module, _, name = entry.partition(":")
        assert module in mods, entry
        assert callable(getattr(importlib.import_module(module), name)), entry


def test_core_imports_nothing_else_of_the_package() -> None:
    bad = sorted((m, t) for m, ts in import_graph().items() if _top(m) == "core"
                 for t in ts if _top(t) not in ("core", "errors", "_lazy"))
    assert bad == []


def test_the_planner_imports_nothing_of_the_runtime_the_viz_or_the_command_line() -> None:
    bad = sorted((m, t) for m, ts in import_graph().items() if _top(m) == "planner"
                 for t in ts if _top(t) in ("runtime", "viz", "cli"))
    assert bad == []


def test_no_new_import_cycle() -> None:
    found = cycles(import_graph())
    assert found - KNOWN_CYCLES == set(), f"new import cycle(s): {sorted(found - KNOWN_CYCLES)}"
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
                   for t in ts if _top(t) in ("viz", "cli"))
    assert found == []
