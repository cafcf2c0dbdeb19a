"""Make a module's decorated functions mutable by mutmut (issue 49, item 1), in a work copy only.

mutmut 3.8.1 leaves alone every function with a decorator other than a lone ``@staticmethod``/``@classmethod``
(``@property``, ``@cached_property``, ``@lru_cache``, pydantic's validators, ...): their bodies were never mutated.
This rewrites each such function of a module or class body into the undecorated function under another name and
the decoration as an assignment, which Python evaluates the same way::

    @lru_cache(maxsize=None)              def _deduce__undecorated(x):
    def _deduce(x):                  ->       ...
        ...                               _deduce = lru_cache(maxsize=None)(_deduce__undecorated)

(decorators apply bottom-up, as the ``@`` lines do).  The renamed function is a plain one, so mutmut mutates it;
its mutants are named ``..._deduce__undecorated__mutmut_N``.  ``python undecorate.py FILE`` rewrites FILE in
place and prints how many functions it rewrote; the source lines of everything else are kept as they were.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

SUFFIX = "__undecorated"
NATIVE = {"staticmethod", "classmethod"}  # a lone one of these mutmut handles itself


def _targets(tree: ast.Module) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    """The decorated functions directly in the module's or a (nested) class's body, each with the name its body
    gets: ``name__undecorated``, numbered when a scope has several of one name (a property's getter and setter)."""
    out = []

    def visit(body: list[ast.stmt]) -> None:
        seen: dict[str, int] = {}
        for node in body:
            if isinstance(node, ast.ClassDef):
                if not _is_protocol(node):  # a Protocol's members are its interface: a renamed body is a member
                    visit(node.body)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.decorator_list:
                lone = node.decorator_list[0] if len(node.decorator_list) == 1 else None
                if not (isinstance(lone, ast.Name) and lone.id in NATIVE):
                    seen[node.name] = seen.get(node.name, 0) + 1
                    n = seen[node.name]
                    out.append((node, f"{node.name}{SUFFIX}{n if n > 1 else ''}"))

    visit(tree.body)
    return out


def _is_protocol(node: ast.ClassDef) -> bool:
    """Whether the class derives from ``Protocol`` (``typing.Protocol`` / ``Protocol[...]``): its bodies are stubs,
    and ``isinstance`` against a runtime-checkable one checks every member, so ``name__undecorated`` would be a
    member no implementation has."""
    def named(b: ast.expr) -> str:
        b = b.value if isinstance(b, ast.Subscript) else b
        return b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")
    return any(named(b) == "Protocol" for b in node.bases)


def undecorate(source: str) -> tuple[str, int]:
    """``source`` with its decorated functions rewritten (see the module's text), and how many were."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    targets = _targets(tree)
    for node, name in sorted(targets, key=lambda t: t[0].lineno, reverse=True):  # bottom-up: lines stay valid
        first = min(d.lineno for d in node.decorator_list)
        if any(d.lineno == node.lineno for d in node.decorator_list):
            raise ValueError(f"line {node.lineno}: a decorator on the def's own line")
        indent = lines[node.lineno - 1][: len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())]
        wrapped = name
        for d in reversed(node.decorator_list):  # the innermost (last) applies first
            wrapped = f"({ast.get_source_segment(source, d)})({wrapped})"
        tail = lines[node.end_lineno - 1]
        if not tail.endswith("\n"):
            lines[node.end_lineno - 1] = tail + "\n"
        assign = f"{indent}{node.name} = {wrapped}\n"
        lines.insert(node.end_lineno, assign)
        def_line = lines[node.lineno - 1]
        keyword = "async def " if isinstance(node, ast.AsyncFunctionDef) else "def "
        at = def_line.index(keyword + node.name) + len(keyword)
        lines[node.lineno - 1] = def_line[:at] + name + def_line[at + len(node.name):]
        del lines[first - 1: node.lineno - 1]
    out = "".join(lines)
    ast.parse(out)  # still Python
    return out, len(targets)


if __name__ == "__main__":
    path = Path(sys.argv[1])
    text, n = undecorate(path.read_text())
    path.write_text(text)
    print(f"{path}: {n} decorated functions made mutable")
