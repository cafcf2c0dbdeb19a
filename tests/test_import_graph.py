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
KNOWN_CYCLES = {
    # core: the op registry and the graph builder; the plan model and the strategy -> plan translation
    ("hspmd_sdk.core.graph", "hspmd_sdk.core.ops"),
    ("hspmd_sdk.core.plan", "hspmd_sdk.core.strategy_plan"),
    # a model family's config, graph and reference module
    ("hspmd_sdk.models.llama.config", "hspmd_sdk.models.llama.graph", "hspmd_sdk.models.llama.reference"),
    ("hspmd_sdk.models.gpt.config", "hspmd_sdk.models.gpt.graph", "hspmd_sdk.models.gpt.reference"),
    ("hspmd_sdk.planner.mixed", "hspmd_sdk.planner.mixed_sim"),
    ("hspmd_sdk.cli", "hspmd_sdk.planner.cli"),
    ("hspmd_sdk.viz._canvas_view", "hspmd_sdk.viz._editor_ui", "hspmd_sdk.viz._editor_view", "hspmd_sdk.viz.editor"),
}

#: The runtime split by side, as the processes are (ARCHITECTURE.md, milestone 3).  Every runtime module is on
#: exactly one side (a new module must be placed); the worker side imports nothing of the launcher side.
WORKER_SIDE = {"worker_entry", "session", "mixed_worker", "checkpoint_worker", "executor", "kernels", "comm",
               "buckets", "switch_exec", "params", "liveness", "worker", "cp_attention", "devices", "store"}
LAUNCHER_SIDE = {"launcher", "train", "mixed", "runs", "start", "job", "controller", "faults", "run_config",
                 "preflight", "progress", "grow", "growback", "tensorboard", "timeline", "slurm_reaper", "profile", "overhead"}
#: what both sides read: the protocol's values, the launch spec, the data, checkpoints' files, metrics, traces,
#: and the single-device references (called beside a launch)
SHARED = {"protocol", "spec", "data", "metrics", "trace", "checkpoint", "checkpoint_io", "checkpoint_plan",
          "checkpoint_lock", "reference"}
TRANSPORTS = {"transport", "ssh", "agent", "hosts", "slurm", "forkserver", "forkserver_process"}
#: The runtime's imports of the viz, each a notebook convenience on a launcher-side value (still to be removed: the
#: list may only shrink): ``job.dashboard()`` builds the dashboard widget; ``Timeline.figure()`` takes the
#: simulator's event colours.
RUNTIME_TO_VIZ = {("hspmd_sdk.runtime.job", "hspmd_sdk.viz.dashboard"),
                  ("hspmd_sdk.runtime.timeline", "hspmd_sdk.viz._style")}


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
    # runtime/train.py imports .mixed inside launch_training only
    assert "hspmd_sdk.runtime.mixed" in edges["hspmd_sdk.runtime.train"]
    # a cycle through a function-level import is a cycle
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}


def test_core_imports_nothing_else_of_the_package() -> None:
    bad = sorted((m, t) for m, ts in import_graph().items() if _top(m) == "core"
                 for t in ts if _top(t) not in ("core", "errors", "_lazy"))
    assert bad == []


def test_the_planner_imports_nothing_of_the_runtime_the_viz_or_the_command_line() -> None:
    # planner.cli is command-line code (``hspmd plan``), not the planner: it is the command line's to import
    bad = sorted((m, t) for m, ts in import_graph().items() if _top(m) == "planner" and m != "hspmd_sdk.planner.cli"
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
    runtime = {m.rpartition(".")[2] for m in import_graph() if m.startswith("hspmd_sdk.runtime.")}
    sides = [WORKER_SIDE, LAUNCHER_SIDE, SHARED, TRANSPORTS]
    assert runtime == set().union(*sides), "place the new runtime module(s) on a side"
    assert sum(len(s) for s in sides) == len(runtime)  # none on two sides


def test_the_worker_side_imports_nothing_of_the_launcher_side_or_the_transports() -> None:
    """A worker's modules reach the launcher only through the protocol's values (and the launch spec)."""
    edges = import_graph()
    bad = sorted((m, t) for m in edges if m.rpartition(".")[2] in WORKER_SIDE and m.startswith("hspmd_sdk.runtime.")
                 for t in edges[m] if t.startswith("hspmd_sdk.runtime.")
                 and t.rpartition(".")[2] in LAUNCHER_SIDE | TRANSPORTS)
    assert bad == []
    shared = sorted((m, t) for m in edges if m.rpartition(".")[2] in SHARED and m.startswith("hspmd_sdk.runtime.")
                    for t in edges[m] if t.startswith("hspmd_sdk.runtime.") and t.rpartition(".")[2] in LAUNCHER_SIDE)
    assert shared == []  # what both sides read depends on neither side's machinery


def test_the_runtime_imports_nothing_of_the_viz_or_the_command_line() -> None:
    found = {(m, t) for m, ts in import_graph().items() if _top(m) == "runtime"
             for t in ts if _top(t) == "viz" or t.startswith("hspmd_sdk.cli")}
    assert found - RUNTIME_TO_VIZ == set()
    assert RUNTIME_TO_VIZ - found == set(), "gone: take them off RUNTIME_TO_VIZ"
    assert all(m in ("hspmd_sdk.runtime.job", "hspmd_sdk.runtime.timeline") for m, _ in found)  # launcher side only
