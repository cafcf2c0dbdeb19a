"""The package's import graph (issue 23), imports inside functions included, read from the source with ``ast``.

Imports by a string count too (issue 47): ``importlib.import_module("x")`` and ``__import__("x")`` with a literal
name, a call with a literal name to a helper of the same module that hands its parameter to ``import_module`` (the
way ``cli.py`` once loaded ``cli_ssh``: ``_lazy("hspmd_sdk.cli_ssh", ...)``), and ``"module:function"`` entry
strings (``"hspmd_sdk.runtime.workers.worker_entry:train_entry"``); a loop that imports each of a tuple of literals
(``for name in MODULES: import_module(name)``) imports each.  A name a package exports lazily
(``lazy_exports(__name__, {"launch": ".control.train"}, ...)``, :mod:`hspmd_sdk._lazy`) is an import of its module by
whoever takes the name from the package: ``from hspmd_sdk.runtime import launch``, or ``hspmd_sdk.runtime.launch``
after ``import hspmd_sdk``, is an edge to ``hspmd_sdk.runtime.control.train`` (the package itself imports it only
for the one who asks, so the package gets no edge of its own).  Module names handed to another process
(``python -m ...``) and what a function that runs in a process of its own imports (:data:`OTHER_PROCESS`: the fork
server's preloads, checked by a test of their own) are not imports of this process's modules.

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

#: Functions that run in a process of their own, not in the one that imports their module: what they import is
#: that process's (module -> function).  The fork server's ``serve`` runs in ``python -m ...forkserver_process``
#: and preloads what its forked workers will use; :func:`test_the_fork_server_preloads_the_worker_side` checks it.
OTHER_PROCESS = {"hspmd_sdk.runtime.transports.forkserver": "serve"}

#: Launcher-side modules the fork server still preloads into the process its workers are forked from (issue 47):
#: ``control.train`` was the training entry's home before the runtime was split by side (the entry is
#: ``workers.worker_entry`` now).  The list may only shrink.
KNOWN_PRELOAD_STRAYS: set[str] = set()

#: The runtime split by side, as the processes are (ARCHITECTURE.md, milestone 3), one folder a side: the
#: launcher's (``runtime/control``), the worker's (``runtime/workers``), the transports (``runtime/transports``) and
#: checkpoints (``runtime/checkpoints``); what both sides read (the protocol's values, the launch spec, the data,
#: metrics, traces, the single-device references) stays at ``runtime/``'s top.
SIDE_FOLDERS = ("control", "workers", "transports", "checkpoints")
SHARED = {"protocol", "spec", "data", "metrics", "trace", "reference", "config_types", "lr_schedule", "train_config",
          "train_sections"}


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


def _looped_literals(tree: ast.Module) -> dict[str, list[str]]:
    """Loop variables over string literals, ``for name in ("a", "b")`` or over a module-level tuple or list of them
    (``for name in _REPLAN_MODULES``): variable -> the literals (what ``import_module(name)`` in the loop imports)."""
    constants = {t.id: node.value for node in getattr(tree, "body", ()) if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) and isinstance(node.target, ast.Name):
            seq = constants.get(node.iter.id) if isinstance(node.iter, ast.Name) else node.iter
            if isinstance(seq, (ast.Tuple, ast.List)):
                out.setdefault(node.target.id, []).extend(v for v in map(_literal, seq.elts) if v)
    return out


#: ``"package.module:function"``, the form of a worker entry or a registered class.
ENTRY_STRING = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+:[A-Za-z_]\w*")


def _string_imports(tree: ast.AST, package: str) -> list[str]:
    """The modules a module's source names as strings to import: ``import_module``/``__import__`` of a literal
    (relative to the ``package`` argument, or to the module's own package), or of a loop variable over literals
    (:func:`_looped_literals`), a literal handed to one of its own loader helpers (:func:`_loaders`), and
    ``"module:function"`` entry strings."""
    loaders = _loaders(tree)
    looped = _looped_literals(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            position = None
            if _is_import_call(node):
                position = 0
            elif isinstance(node.func, ast.Name) and node.func.id in loaders:
                position = loaders[node.func.id]
            arg = node.args[position] if position is not None and len(node.args) > position else None
            names = [_literal(arg)] if _literal(arg) else []
            if isinstance(arg, ast.Name) and _is_import_call(node):
                names = looped.get(arg.id, [])
            for name in names:
                if name.startswith("."):
                    anchor = _literal(node.args[1]) if _is_import_call(node) and len(node.args) > 1 else None
                    base = (anchor or package).split(".")
                    level = len(name) - len(name.lstrip("."))
                    name = ".".join(base[: len(base) - level + 1] + [name.lstrip(".")])
                out.append(name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ENTRY_STRING.fullmatch(node.value):
            out.append(node.value.partition(":")[0])
    return out


def _resolve(name: str, anchor: str) -> str:
    """``name`` (``".x"``, ``"..x"`` or absolute) relative to the package ``anchor``."""
    if not name.startswith("."):
        return name
    base = anchor.split(".")
    level = len(name) - len(name.lstrip("."))
    return ".".join(base[: len(base) - level + 1] + ([name.lstrip(".")] if name.lstrip(".") else []))


def _lazy_exports(tree: ast.Module, package: str) -> dict[str, str]:
    """The names a package's ``__init__`` exports lazily, ``name -> module``: the mapping handed to
    ``lazy_exports(__name__, MAPPING, ...)`` (a dict literal, or a module-level name bound to one), its module
    paths resolved against the package."""
    assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and len(node.args) >= 2 and (
                isinstance(node.func, ast.Name) and node.func.id == "lazy_exports"
                or isinstance(node.func, ast.Attribute) and node.func.attr == "lazy_exports"):
            mapping = node.args[1]
            if isinstance(mapping, ast.Name):
                mapping = assigned.get(mapping.id)
            if isinstance(mapping, ast.Dict):
                for k, v in zip(mapping.keys, mapping.values):
                    if _literal(k) and _literal(v):
                        out[_literal(k)] = _resolve(_literal(v), package)  # type: ignore[arg-type]
    return out


def _dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]`` (``None`` for anything but names and attributes)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _lazy_imports(tree: ast.AST, package: str, mods: dict[str, Path], lazy: dict[str, dict[str, str]]) -> set[str]:
    """The modules a module reaches through packages' lazy exports: ``from P import name`` and ``P.name`` (after
    ``import P``, ``import P as p`` or ``from Q import P``; a binding counts anywhere in the module) where ``P``
    exports ``name`` lazily."""
    out: set[str] = set()
    bound: dict[str, str] = {}  # a name bound in the module -> the package module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    bound[a.asname] = a.name
                else:
                    bound[a.name.partition(".")[0]] = a.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve("." * node.level + (node.module or ""), package) if node.level else node.module or ""
            for a in node.names:
                if target in lazy and a.name in lazy[target]:
                    out.add(lazy[target][a.name])
                if f"{target}.{a.name}" in mods:
                    bound[a.asname or a.name] = f"{target}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = _dotted(node)
            if not parts or parts[0] not in bound:
                continue
            full = bound[parts[0]].split(".") + parts[1:]
            for i in range(1, len(full)):
                package_name = ".".join(full[:i])
                if package_name in lazy and full[i] in lazy[package_name]:
                    out.add(lazy[package_name][full[i]])
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source (``from x import y`` counts module
    ``x.y`` when that is a module, else ``x``), by a statement or by a string (:func:`_string_imports`)."""
    return {m: set(ts) for m, ts in _read_graph(root).items()}  # a copy: the tests share one reading


@functools.lru_cache(maxsize=None)
def _read_graph(root: Path) -> dict[str, frozenset[str]]:
    mods = _modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    trees = {m: ast.parse(f.read_text()) for m, f in mods.items()}
    for m, name in OTHER_PROCESS.items():
        for fn in _functions(trees.get(m), name):
            fn.body = [ast.Pass()]  # its imports are another process's (:data:`OTHER_PROCESS`)
    packages = {m: m if f.name == "__init__.py" else m.rpartition(".")[0] for m, f in mods.items()}
    lazy = {m: _lazy_exports(trees[m], m) for m, f in mods.items() if f.name == "__init__.py"}
    lazy = {m: names for m, names in lazy.items() if names}
    for m, f in mods.items():
        package, tree = packages[m], trees[m]
        for t in [*_string_imports(tree, package), *_lazy_imports(tree, package, mods, lazy)]:
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


def _functions(tree: ast.Module | None, name: str) -> list[ast.FunctionDef]:
    """The module-level functions ``name`` of ``tree``."""
    return [n for n in getattr(tree, "body", ()) if isinstance(n, ast.FunctionDef) and n.name == name]


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
        "c.py": "import importlib\n\nimportlib.import_module('.d', 'pkg')\n__import__('pkg.e')\n"
                "WARM = ('pkg.f', 'json')\n\n\ndef warm():\n    for name in WARM:\n"
                "        importlib.import_module(name)\n",
        "d.py": "from importlib import import_module\n\nE = import_module('.e', __package__)\n",
        "e.py": "ENTRY = 'pkg.f:main'\nNOT_AN_IMPORT = 'python -m pkg.c'\n",
        "f.py": "def main():\n    pass\n",
    }
    for name, text in sources.items():
        (pkg / name).write_text(text)
    edges = import_graph(pkg)
    assert edges == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.d", "pkg.e", "pkg.f"},
                     "pkg.d": {"pkg.e"}, "pkg.e": {"pkg.f"}, "pkg.f": set()}
    assert cycles(edges) == {("pkg.a", "pkg.b")}


def test_the_graph_reader_sees_names_taken_from_a_package_that_exports_them_lazily(tmp_path: Path) -> None:
    """``lazy_exports`` (:mod:`hspmd_sdk._lazy`) imports a module when its name is taken from the package: that is
    an edge of the module taking it (by ``from P import name`` or ``P.name``), not of the package."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "from ._lazy import lazy_exports\n\n"
                       "__all__, __getattr__, __dir__ = lazy_exports(__name__, {'run': 'pkg.b'}, globals())\n",
        "_lazy.py": "def lazy_exports(package, exports, namespace):\n    return [], None, None\n",
        "sub/__init__.py": "from .._lazy import lazy_exports\n\n_EXPORTS = {'Thing': '.c', 'other': '..d'}\n"
                           "__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())\n",
        "sub/c.py": "", "d.py": "", "e.py": "",
        "a.py": "def go():\n    from . import run\n\n    return run\n",  # from the package: pkg.b
        "b.py": "import pkg.sub\n\n\ndef run():\n    return pkg.sub.Thing\n",  # P.name after import P: pkg.sub.c
        "f.py": "from pkg import sub as s\nfrom .sub import other\n\nX = s.other\n",  # pkg.d, twice
        "g.py": "import pkg\n\nV = pkg.__name__\n",  # not a lazy name: only the package
    }
    for name, text in sources.items():
        (pkg / name).write_text(text)
    edges = import_graph(pkg)
    assert edges == {"pkg": {"pkg._lazy"}, "pkg._lazy": set(), "pkg.sub": {"pkg._lazy"}, "pkg.sub.c": set(),
                     "pkg.d": set(), "pkg.e": set(), "pkg.a": {"pkg", "pkg.b"}, "pkg.b": {"pkg.sub", "pkg.sub.c"},
                     "pkg.f": {"pkg.sub", "pkg.d"}, "pkg.g": {"pkg"}}
    # and on the package itself: the editor launches through the runtime's lazy ``launch``
    assert "hspmd_sdk.runtime.control.train" in import_graph()["hspmd_sdk.viz.editor"]


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


def test_the_fork_server_preloads_the_worker_side() -> None:
    """What a function of :data:`OTHER_PROCESS` imports is left out of the graph, and checked here instead: the
    fork server's process is the one its workers are forked from, so it preloads the worker side (and torch), not
    the launcher's or the transports' modules -- but for :data:`KNOWN_PRELOAD_STRAYS`, which must shrink."""
    module = "hspmd_sdk.runtime.transports.forkserver"
    tree = ast.parse(_modules()[module].read_text())
    (serve,) = _functions(tree, OTHER_PROCESS[module])
    alone = ast.Module(body=[n for n in tree.body if isinstance(n, ast.Assign)] + [serve], type_ignores=[])
    preloads = set(_string_imports(alone, module.rpartition(".")[0]))
    assert "hspmd_sdk.runtime.workers.worker" in preloads and "torch" in preloads  # the reader sees the loop
    strays = {m for m in preloads if _side(m) in ("control", "transports")}
    assert strays - KNOWN_PRELOAD_STRAYS == set(), f"the fork server preloads launcher-side modules: {strays}"
    assert KNOWN_PRELOAD_STRAYS - strays == set(), "these preloads are gone: take them off KNOWN_PRELOAD_STRAYS"
    # and the import graph does not see them: the launcher never runs serve
    assert "hspmd_sdk.runtime.control.train" not in import_graph()[module]


def test_the_runtime_imports_nothing_of_the_viz_or_the_command_line() -> None:
    found = sorted((m, t) for m, ts in import_graph().items() if _top(m) == "runtime"
                   for t in ts if _top(t) in ("viz", "cli"))
    assert found == []
