"""Helper of scripts/mutation.sh: reads a module's mutmut results and writes benchmarks/results/mutation.md.

  summarize.py select CFG              the [select] globs of a module config, one a line (none: all functions)
  summarize.py record MODULE SECONDS ROOT   (in the module's work copy) store its counts and survivors' diffs
  summarize.py pending                 (in a work copy) the mutants not killed whose function a test covers
  summarize.py table ROOT              print the table of every recorded module (and rewrite mutation.md)

The figures of every module run so far live in mutation.md itself (a JSON comment at its end), so a run of a
subset updates only its own rows.  A survivor listed in scripts/mutation/equivalent.txt (``name  reason``) counts
as equivalent; the score is killed / (mutants - equivalent), timeouts counting as killed (a mutant that loops is
detected).
"""
from __future__ import annotations

import configparser
import json
import re
import sys
from collections import Counter
from pathlib import Path

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", 37: "type check", -11: "killed",
          -9: "timeout", None: "not checked"}  # -9: the runner's SIGKILL after the CPU limit; -11: a crash
DATA_RE = re.compile(r"<!-- mutation-data (.*?) -->", re.S)
ORDER = ["annotation", "resolve", "bsr", "deduction", "switch", "specialize", "cost", "mixed_cost"]


def _equivalent(root: Path) -> dict[str, str]:
    out = {}
    path = root / "scripts" / "mutation" / "equivalent.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, why = line.partition(" ")
            out[name] = why.strip()
    return out


def _load(root: Path) -> dict:
    md = root / "benchmarks" / "results" / "mutation.md"
    if md.exists():
        m = DATA_RE.search(md.read_text())
        if m:
            return json.loads(m.group(1))
    return {}


def select(cfg: str) -> None:
    p = configparser.ConfigParser()
    p.read(cfg)
    if p.has_option("select", "functions"):
        for g in p.get("select", "functions").split():
            print(g)


def pending() -> None:
    """Mutants of the work copy in the cwd not killed so far whose function some test covers (mutmut can only
    retest those by name)."""
    cfg = configparser.ConfigParser()
    cfg.read("setup.cfg")
    target = cfg.get("mutmut", "only_mutate").strip()
    codes = json.loads((Path("mutants") / (target + ".meta")).read_text())["exit_code_by_key"]
    covered = json.loads((Path("mutants") / "mutmut-stats.json").read_text())["tests_by_mangled_function_name"]
    for k, v in sorted(codes.items()):
        if STATUS.get(v, "suspicious") not in ("killed", "timeout") and covered.get(k.rpartition("__mutmut_")[0]):
            print(k)


def _diffs(target: str, names: list[str]) -> dict[str, list[str]]:
    """The changed lines of each mutant: its function in the mutated copy against the original (``mutmut show``
    without a process per mutant)."""
    import ast
    import difflib

    src = (Path("mutants") / target).read_text()
    lines = src.splitlines()
    funcs = {n.name: "\n".join(lines[n.lineno - 1:n.end_lineno]) for n in ast.walk(ast.parse(src))
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    out = {}
    for k in names:
        local = k.rpartition(".")[2] if "ǁ" not in k else k[k.index("xǁ"):]
        base = local.rpartition("__mutmut_")[0]
        a = funcs.get(base + "__mutmut_orig", "").splitlines()
        b = funcs.get(local, "").splitlines()
        b = [ln.replace(local, base + "__mutmut_orig", 1) if i == 0 else ln for i, ln in enumerate(b)]
        out[k] = [ln for ln in difflib.unified_diff(a, b, lineterm="", n=0)
                  if ln[:1] in "+-" and not ln.startswith(("---", "+++"))]
    return out


def record(module: str, seconds: int, root: Path) -> None:
    cfg = configparser.ConfigParser()
    cfg.read("setup.cfg")
    target = cfg.get("mutmut", "only_mutate").strip()
    meta = json.loads((Path("mutants") / (target + ".meta")).read_text())
    codes = meta["exit_code_by_key"]
    globs = cfg.get("select", "functions").split() if cfg.has_option("select", "functions") else []
    if globs:  # only the selected functions were run: count only those
        import fnmatch
        codes = {k: v for k, v in codes.items() if any(fnmatch.fnmatch(k, g) for g in globs)}
    status = {k: STATUS.get(v, "suspicious") for k, v in codes.items()}
    eq = _equivalent(root)
    survivors = sorted(k for k, s in status.items() if s in ("survived", "no tests", "suspicious"))
    changed = _diffs(target, [k for k in survivors if k not in eq])
    diffs = {k: [status[k]] + v[:6] for k, v in changed.items()}
    c = Counter(status.values())
    data = _load(root)
    data[module] = {"file": target, "mutants": len(status), "killed": c["killed"], "timeout": c["timeout"],
                    "survived": sum(1 for k in survivors if k not in eq),
                    "equivalent": sum(1 for k in survivors if k in eq),
                    "no_tests": sum(1 for k in survivors if status[k] == "no tests" and k not in eq),
                    "untested": c["not checked"],
                    "other": sum(n for s, n in c.items() if s not in ("killed", "timeout", "survived", "no tests",
                                                                        "suspicious", "not checked")),
                    "seconds": seconds, "selected": globs, "survivors": diffs,
                    "stale_equivalents": []}
    _write(root, data)
    print(f"{module}: {len(status)} mutants, {c['killed']} killed, {c['timeout']} timeouts, "
          f"{data[module]['survived']} survived ({data[module]['no_tests']} of them with no covering test), "
          f"{data[module]['equivalent']} equivalent, {seconds} s")


def _row(name: str, d: dict) -> str:
    live = d["mutants"] - d["equivalent"] - d.get("untested", 0)
    score = (d["killed"] + d["timeout"]) / live * 100 if live else 100.0
    strict = d["killed"] / live * 100 if live else 100.0
    return (f"| {name} | `{d['file']}` | {d['mutants']} | {d.get('untested', 0)} | {d['killed']} | {d['timeout']} | "
            f"{d['survived']} | {d['equivalent']} | {score:.1f}% | {strict:.1f}% | {d['seconds']} s |")


def _write(root: Path, data: dict) -> None:
    eq = _equivalent(root)
    notes = (root / "scripts" / "mutation" / "notes.md")
    out = ["# Mutation testing: core and the planners' cost functions", "",
           "Generated by `scripts/mutation.sh` (mutmut 3.8.1); the text between the table and the lists is "
           "`scripts/mutation/notes.md`.", "",
           "| module | file | mutants | not run | killed | timeouts | survived | equivalent | score | score, timeouts not counted | time |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    names = [n for n in ORDER if n in data] + sorted(n for n in data if n not in ORDER)
    tot = {"mutants": 0, "untested": 0, "killed": 0, "timeout": 0, "survived": 0, "equivalent": 0, "seconds": 0}
    for n in names:
        out.append(_row(n, data[n]))
        for k in tot:
            tot[k] += data[n].get(k, 0)
    out.append(_row("**all**", dict(tot, file="")))
    out += ["", "score = (killed + timeouts) / (mutants - not run - equivalent); the next column counts killed "
            "only; *not run*: mutants a run stopped before testing (see the notes).", ""]
    if notes.exists():
        out += [notes.read_text().rstrip(), ""]
    for n in names:
        d = data[n]
        if d.get("selected"):
            out.append(f"- `{n}`: only the functions {', '.join('`' + g + '`' for g in d['selected'])} were mutated.")
    out += ["", "## Surviving mutants judged equivalent", ""]
    for n in names:
        mod = d_mod = data[n]["file"].removesuffix(".py").replace("/", ".")
        mine = [(k, v) for k, v in eq.items() if k.startswith(d_mod + ".")]
        if mine:
            out.append(f"### {n} ({len(mine)})")
            out += [f"- `{k.removeprefix(mod + '.')}`: {v}" for k, v in mine]
            out.append("")
    out += ["## Surviving mutants not judged equivalent", ""]
    for n in names:
        sv = data[n]["survivors"]
        if sv:
            out.append(f"### {n} ({len(sv)})")
            for k, v in sv.items():
                out.append(f"- `{k}` ({v[0]}): " + " / ".join(f"`{ln.strip()}`" for ln in v[1:]))
            out.append("")
    out += ["", "<!-- mutation-data " + json.dumps(data, sort_keys=True) + " -->", ""]
    md = root / "benchmarks" / "results" / "mutation.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(out))


def table(root: Path) -> None:
    data = _load(root)
    if not data:
        print("no results yet")
        return
    _write(root, data)
    text = (root / "benchmarks" / "results" / "mutation.md").read_text()
    print("\n".join(ln for ln in text.splitlines() if ln.startswith("|")))
    print(f"(written to {root / 'benchmarks' / 'results' / 'mutation.md'})")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "select":
        select(sys.argv[2])
    elif cmd == "show":  # in a work copy: the survivors' diffs so far
        cfg = configparser.ConfigParser()
        cfg.read("setup.cfg")
        t = cfg.get("mutmut", "only_mutate").strip()
        codes = json.loads((Path("mutants") / (t + ".meta")).read_text())["exit_code_by_key"]
        eqv = _equivalent(Path(sys.argv[2])) if len(sys.argv) > 2 else {}
        names = [k for k, v in codes.items() if STATUS.get(v, "suspicious") in ("survived", "no tests") and k not in eqv]
        for k, v in _diffs(t, names).items():
            print(f"## {k} ({STATUS.get(codes[k])})")
            print("\n".join(v))
    elif cmd == "pending":
        pending()
    elif cmd == "record":
        record(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
    elif cmd == "table":
        table(Path(sys.argv[2]))
    else:
        raise SystemExit(__doc__)
