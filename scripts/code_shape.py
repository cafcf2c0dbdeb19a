"""The package's shape, the figures issue 23 asks for: lines per folder, the largest files, the longest functions,
imports inside functions (the package's own, and third-party ones), the places that start worker processes, and
the wire forms of a Program.  Read from the source with ``ast``; prints a Markdown report.

    python scripts/code_shape.py            # the report
"""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hspmd_sdk"

#: Calls that start an operating-system process running a worker (or the agent / fork server that runs them).
STARTERS = {"Popen", "create_subprocess_exec", "create_process", "fork", "spawnv", "execvp", "execv"}


def _files() -> list[Path]:
    return sorted(f for f in ROOT.rglob("*.py") if "__pycache__" not in f.parts)


def _folder(f: Path) -> str:
    rel = f.relative_to(ROOT.parent)
    return str(rel.parent)


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _inner_imports(tree: ast.AST) -> tuple[int, int]:
    """(package imports, third-party imports) inside function bodies, each statement once."""
    seen: set[int] = set()
    own = other = 0
    for fn in _functions(tree):
        for node in ast.walk(fn):
            if id(node) in seen or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            seen.add(id(node))
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hspmd_sdk")):
                own += 1
            elif isinstance(node, ast.Import) and any(a.name.startswith("hspmd_sdk") for a in node.names):
                own += 1
            else:
                other += 1
    return own, other


def main() -> None:
    lines: Counter[str] = Counter()
    files: list[tuple[int, str]] = []
    funcs: list[tuple[int, str]] = []
    own_by: Counter[str] = Counter()
    other_by: Counter[str] = Counter()
    starters: list[str] = []
    for f in _files():
        text = f.read_text()
        n = text.count("\n")
        rel = str(f.relative_to(ROOT.parent))
        lines[_folder(f)] += n
        files.append((n, rel))
        tree = ast.parse(text)
        for fn in _functions(tree):
            funcs.append((fn.end_lineno - fn.lineno + 1, f"{rel}:{fn.lineno} {fn.name}"))
        own, other = _inner_imports(tree)
        own_by[_folder(f)] += own
        other_by[_folder(f)] += other
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in STARTERS:
                    starters.append(f"{rel}:{node.lineno} {name}")
    total = sum(lines.values())
    print(f"## Lines per folder ({total} in all)\n\n| folder | lines | share | imports inside functions "
          "(package / third-party) |\n|---|---|---|---|")
    for folder, n in sorted(lines.items(), key=lambda kv: -kv[1]):
        print(f"| `{folder}` | {n} | {n / total:.0%} | {own_by[folder]} / {other_by[folder]} |")
    print(f"\nImports inside functions: {sum(own_by.values())} of the package's own, "
          f"{sum(other_by.values())} third-party.\n")
    print("## Largest files\n")
    for n, rel in sorted(files, reverse=True)[:5]:
        print(f"- `{rel}`: {n} lines")
    print("\n## Longest functions\n")
    for n, where in sorted(funcs, reverse=True)[:5]:
        print(f"- `{where}`: {n} lines")
    print("\n## Calls that start a process\n")
    for s in starters:
        print(f"- `{s}`")


if __name__ == "__main__":
    main()
