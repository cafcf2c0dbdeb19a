"""What a user installs is what the tutorials and the README's examples import (issue 48 item 1).

The README tells users to ``pip install -e ".[extra,...]"``; every third-party module that a tutorial's code cells or
a README ``python`` block imports must come from a distribution among the core dependencies or those extras
(``hspmd_sdk[...]`` inside an extra resolved, as pip does).  Modules are read with ``ast`` (top-level names of
``import x`` / ``from x import y``, anywhere in the cell) and mapped to distributions with
``importlib.metadata.packages_distributions``; a module no distribution provides must be one the notebook writes
itself (``%%writefile name.py``).  The reference is the packaging metadata itself (pyproject.toml), not the code.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # Python 3.10: the same parser, as the tomli package (a core dependency there)
    tomllib = pytest.importorskip("tomli")
from packaging.requirements import Requirement  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SELF = "hspmd_sdk"
INSTALL = re.compile(r"pip install -e \"\.\[([\w,\s-]+)\]\"")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def allowed_distributions(extras: list[str]) -> set[str]:
    """The core dependencies and every requirement of ``extras``, ``hspmd_sdk[...]`` resolved recursively."""
    project = _pyproject()
    table = project.get("optional-dependencies", {})
    out = {_norm(Requirement(r).name) for r in project.get("dependencies", [])}
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        assert extra in table, f"the README names extra {extra!r}, which pyproject.toml does not define"
        for text in table[extra]:
            req = Requirement(text)
            if _norm(req.name) == _norm(SELF):
                todo.extend(req.extras)
            else:
                out.add(_norm(req.name))
    return out


def readme_extras() -> list[str]:
    """The extras of the README's user install line (``pip install -e ".[...]"``)."""
    found = INSTALL.findall((REPO / "README.md").read_text())
    assert found, "README.md has no `pip install -e \".[...]\"` line telling users what to install"
    assert len(set(found)) == 1, f"README.md names different extras in its install lines: {found}"
    return [x.strip() for x in found[0].split(",") if x.strip()]


def _imports(source: str) -> set[str]:
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    out = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def sources() -> dict[str, tuple[set[str], set[str]]]:
    """Where -> (top-level modules imported, modules written there with ``%%writefile``)."""
    out: dict[str, tuple[set[str], set[str]]] = {}
    for path in sorted((REPO / "tutorials").glob("*.ipynb")):
        cells = [("".join(c["source"])) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        written = {m.group(1) for c in cells for m in re.finditer(r"^%%writefile\s+(?:\S*/)?(\w+)\.py", c, re.M)}
        # a %%writefile cell's body is a module the tutorial runs: its imports count too; other cell magics do not
        code = [c.partition("\n")[2] if c.startswith("%%writefile") else c for c in cells
                if not c.startswith("%%") or c.startswith("%%writefile")]
        out[f"tutorials/{path.name}"] = (set().union(*(_imports(c) for c in code)), written)
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    out["README.md"] = (set().union(*(_imports(b) for b in blocks)), set())
    return out


def test_the_readme_install_line_covers_every_import_of_the_tutorials_and_readme() -> None:
    extras = readme_extras()
    allowed = allowed_distributions(extras)
    provides = packages_distributions()
    missing: list[str] = []
    for where, (modules, written) in sources().items():
        for mod in sorted(modules):
            if mod == SELF or mod in sys.stdlib_module_names or mod in written:
                continue
            dists = {_norm(d) for d in provides.get(mod, ())}
            if not dists:
                missing.append(f"{where}: imports {mod}, which no installed distribution provides")
            elif not dists & allowed:
                missing.append(f"{where}: imports {mod} (from {', '.join(sorted(dists))}), not in the core "
                               f"dependencies nor in the extras the README installs ({', '.join(extras)})")
    assert not missing, "\n".join(missing)


def test_the_extras_resolve_their_self_references() -> None:
    """``dev`` names the user extras through ``hspmd_sdk[...]``: resolved, it holds each of their packages."""
    table = _pyproject()["optional-dependencies"]
    dev = allowed_distributions(["dev"])
    for extra in readme_extras():
        assert {_norm(Requirement(r).name) for r in table[extra]} <= dev, extra
