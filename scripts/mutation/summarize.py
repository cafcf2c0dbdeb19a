"""Helper of scripts/mutation.sh: reads a module's mutmut results and writes benchmarks/results/mutation.md.

  summarize.py select CFG              the [select] globs of a module config, one a line (none: all functions)
  summarize.py record MODULE SECONDS ROOT   (in the module's work copy) store its counts and survivors' diffs
  summarize.py pending                 (in a work copy) the mutants not killed whose function a test covers
  summarize.py table ROOT              print the table of every recorded module (and rewrite mutation.md)

The figures of every module run so far live in mutation.md itself (a JSON comment at its end), so a run of a
subset updates only its own rows.  Each row records the SHA-256 of the file it mutated: a module whose file has
changed since is marked stale in the table.  A survivor counts as equivalent only when a rule of
scripts/mutation/equivalent/*.toml matches it -- by where it is (file and function) and what it changes (its removed
and added lines), never by its number; the table says how many survivors each rule excused, and a rule that
excused none is listed as unused.  The score is killed / (mutants - equivalent), timeouts counting as killed (a
mutant that loops is detected).
"""
from __future__ import annotations

import configparser
import fnmatch
import hashlib
import json
import re
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", 37: "type check", -11: "killed",
          -9: "timeout", None: "not checked"}  # -9: the runner's SIGKILL after the CPU limit; -11: a crash
DATA_RE = re.compile(r"<!-- mutation-data (.*?) -->", re.S)
ORDER = ["annotation", "resolve", "bsr", "deduction", "switch", "specialize", "graph", "comm_ops", "program_json",
         "schedule", "cluster", "strategy", "strategy_plan", "memory", "cost", "mixed_cost", "simulator", "tp_comm",
         "run_config"]


RULES = Path("scripts") / "mutation" / "equivalent"  # *.toml: the rules, a file a module (common.toml: any)
DERIVED = ("survivors", "excused", "survived", "equivalent", "no_tests")  # judged anew from "lived" at each write


@dataclass(frozen=True)
class Rule:
    """A shape of mutant that cannot change behaviour, and why.  ``where``: ``FILE:FUNCTION`` globs (``FILE``
    relative to ``hspmd_sdk/``, ``FUNCTION`` as ``name`` or ``Class.name``); ``removed`` / ``added``: regular
    expressions one of the mutant's removed / added lines must contain (either may be left out, not both)."""

    id: str
    why: str
    where: tuple[str, ...]
    removed: str = ""
    added: str = ""

    def matches(self, file: str, function: str, diff: list[str]) -> bool:
        here = file.removeprefix("hspmd_sdk/") + ":" + function
        if not any(fnmatch.fnmatchcase(here, w) for w in self.where):
            return False
        gone = [ln[1:] for ln in diff if ln.startswith("-")]
        new = [ln[1:] for ln in diff if ln.startswith("+")]
        return ((not self.removed or any(re.search(self.removed, ln) for ln in gone))
                and (not self.added or any(re.search(self.added, ln) for ln in new)))


def rules(root: Path) -> list[Rule]:
    """The rules of ``scripts/mutation/equivalent/*.toml`` (``[[rule]]`` tables: id, why, where, removed, added)."""
    out = []
    for path in sorted((root / RULES).glob("*.toml")):
        for i, r in enumerate(tomllib.loads(path.read_text()).get("rule", [])):
            where = r.get("where")
            if not r.get("id") or not r.get("why") or not where or not (r.get("removed") or r.get("added")):
                raise SystemExit(f"{path}: rule {i + 1} ({r.get('id', 'no id')}) needs id, why, where and removed "
                                 "and/or added")
            out.append(Rule(r["id"], " ".join(r["why"].split()), tuple([where] if isinstance(where, str) else where),
                            r.get("removed", ""), r.get("added", "")))
    ids = [r.id for r in out]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{root / RULES}: rule ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    return out


def function_of(key: str) -> str:
    """The function a mutant of mutmut 3.8.1 is in: ``pkg.mod.x__top_op__mutmut_8`` -> ``_top_op``,
    ``pkg.mod.xǁCostModelǁsend_time__mutmut_3`` -> ``CostModel.send_time`` (an undecorated body,
    ``name__undecorated``, is the function ``name``)."""
    local = key.rpartition("__mutmut_")[0]
    local = local[local.index("xǁ"):] if "xǁ" in local else local.rpartition(".")[2]
    name = ".".join(local[2:].split("ǁ")) if local.startswith("xǁ") else local.removeprefix("x_")
    return re.sub(r"__undecorated\d*$", "", name)


def judge(rule_list: list[Rule], file: str, diffs: dict[str, list[str]]) -> dict[str, str]:
    """The id of the first rule that matches each mutant, for the mutants some rule matches."""
    out = {}
    for key, diff in diffs.items():
        for r in rule_list:
            if r.matches(file, function_of(key), diff):
                out[key] = r.id
                break
    return out


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
    survivors = sorted(k for k, s in status.items() if s in ("survived", "no tests", "suspicious"))
    changed = _diffs(target, survivors)
    c = Counter(status.values())
    with _locked(root):
        _record(root, module, target, status, survivors, changed, c, seconds, globs)


def _record(root: Path, module: str, target: str, status: dict, survivors: list, changed: dict, c: Counter,
            seconds: int, globs: list) -> None:
    data = _load(root)
    sha = Path("source.sha256").read_text().strip() if Path("source.sha256").exists() else ""
    data[module] = {"file": target, "sha256": sha, "mutants": len(status),
                    "killed": c["killed"], "timeout": c["timeout"], "untested": c["not checked"],
                    "other": sum(n for s, n in c.items() if s not in ("killed", "timeout", "survived", "no tests",
                                                                        "suspicious", "not checked")),
                    "seconds": seconds, "selected": globs,
                    "lived": {k: [status[k]] + changed[k][:8] for k in survivors}}
    _write(root, data)
    d = judged(root, data[module])
    print(f"{module}: {d['mutants']} mutants, {c['killed']} killed, {c['timeout']} timeouts, "
          f"{d['survived']} survived ({d['no_tests']} of them with no covering test), "
          f"{d['equivalent']} equivalent by rule, {seconds} s")


def judged(root: Path, d: dict, rule_list: list[Rule] | None = None) -> dict:
    """A module's record with its survivors judged by the current rules: ``survivors`` (not excused), ``excused``
    (name -> [rule id, the diff]) and the counts."""
    lived = d.get("lived", {})
    eq = judge(rules(root) if rule_list is None else rule_list, d["file"],
               {k: [ln for ln in v[1:]] for k, v in lived.items()})
    return dict(d, survivors={k: v for k, v in lived.items() if k not in eq},
                excused={k: [eq[k]] + v[1:] for k, v in lived.items() if k in eq},
                survived=len(lived) - len(eq), equivalent=len(eq),
                no_tests=sum(1 for k, v in lived.items() if v[0] == "no tests" and k not in eq))


def _row(name: str, d: dict, stale: bool = False) -> str:
    live = d["mutants"] - d["equivalent"] - d.get("untested", 0)
    score = (d["killed"] + d["timeout"]) / live * 100 if live else 100.0
    strict = d["killed"] / live * 100 if live else 100.0
    mark = " **stale**" if stale else ""
    return (f"| {name}{mark} | `{d['file']}` | {d['mutants']} | {d.get('untested', 0)} | {d['killed']} | "
            f"{d['timeout']} | {d['survived']} | {d['equivalent']} | {score:.1f}% | {strict:.1f}% | {d['seconds']} s |")


def is_stale(root: Path, d: dict) -> bool:
    """Whether the module's file changed since its run (or the run recorded no hash, or the file is gone)."""
    path = root / d["file"]
    return not d.get("sha256") or not path.exists() or file_hash(path) != d["sha256"]


def _write(root: Path, data: dict) -> None:
    rule_list = rules(root)
    notes = (root / "scripts" / "mutation" / "notes.md")
    out = ["# Mutation testing: core, planner and the runtime's pure parts", "",
           "Generated by `scripts/mutation.sh` (mutmut 3.8.1); the text between the table and the lists is "
           "`scripts/mutation/notes.md`.  Rerun one module: `scripts/mutation.sh MODULE` (the names: "
           "`scripts/mutation/*.cfg`).", "",
           "| module | file | mutants | not run | killed | timeouts | survived | equivalent | score "
           "| score, timeouts not counted | time |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    names = [n for n in ORDER if n in data] + sorted(n for n in data if n not in ORDER)
    data = {n: judged(root, data[n], rule_list) if "lived" in data[n] else data[n] for n in names}
    stale = [n for n in names if is_stale(root, data[n])]
    tot = {"mutants": 0, "untested": 0, "killed": 0, "timeout": 0, "survived": 0, "equivalent": 0, "seconds": 0}
    for n in names:
        out.append(_row(n, data[n], n in stale))
        for k in tot:
            tot[k] += data[n].get(k, 0)
    out.append(_row("**all**", dict(tot, file="")))
    out += ["", "score = (killed + timeouts) / (mutants - not run - equivalent); the next column counts killed "
            "only; *not run*: mutants a run stopped before testing (see the notes).  "
            + (f"**Stale** ({len(stale)}): the file changed after the module's run (its SHA-256 differs from the "
               f"one recorded): {', '.join(stale)}; rerun them." if stale else
               "No module is stale: every file is as it was when its row was measured (SHA-256 recorded)."), ""]
    if notes.exists():
        out += [notes.read_text().rstrip(), ""]
    for n in names:
        d = data[n]
        if d.get("selected"):
            out.append(f"- `{n}`: only the functions {', '.join('`' + g + '`' for g in d['selected'])} were mutated.")
    used = Counter(v[0] for n in names for v in data[n].get("excused", {}).values())
    out += ["", "## Equivalent mutants, by rule", "",
            "A survivor is excused only by a rule of `scripts/mutation/equivalent/*.toml`, matched by where it is "
            "and what it changes.", "", "| rule | where | mutants excused | why |", "|---|---|---|---|"]
    for r in rule_list:
        out.append(f"| `{r.id}` | {', '.join('`' + w + '`' for w in r.where)} | {used.get(r.id, 0)} | {r.why} |")
    unused = [r.id for r in rule_list if not used.get(r.id)]
    if unused:
        out += ["", f"Rules that excused no mutant in the recorded runs: {', '.join('`' + u + '`' for u in unused)}."]
    out.append("")
    for n in names:
        ex = data[n].get("excused", {})
        if ex:
            out.append(f"### {n} ({len(ex)})")
            for k, v in ex.items():
                out.append(f"- `{k.rpartition('.')[2]}` by `{v[0]}`: " + " / ".join(f"`{ln.strip()}`" for ln in v[1:7]))
            out.append("")
    out += ["## Surviving mutants", ""]
    for n in names:
        sv = data[n]["survivors"]
        if sv:
            out.append(f"### {n} ({len(sv)})")
            for k, v in sv.items():
                out.append(f"- `{k.rpartition('.')[2]}` ({v[0]}): " + " / ".join(f"`{ln.strip()}`" for ln in v[1:7]))
            out.append("")
    raw = {n: {k: v for k, v in d.items() if k not in DERIVED} if "lived" in d else d for n, d in data.items()}
    out += ["", "<!-- mutation-data " + json.dumps(raw, sort_keys=True) + " -->", ""]
    md = root / "benchmarks" / "results" / "mutation.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(out))


class _locked:
    """Holds ``benchmarks/results/mutation.lock`` (flock): runs of several modules at once record one at a time."""

    def __init__(self, root: Path) -> None:
        self.path = root / "benchmarks" / "results" / "mutation.lock"

    def __enter__(self) -> None:
        import fcntl

        self.f = open(self.path, "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def table(root: Path) -> None:
    with _locked(root):
        _table(root)


def _table(root: Path) -> None:
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
        names = [k for k, v in codes.items() if STATUS.get(v, "suspicious") in ("survived", "no tests")]
        diffs = _diffs(t, names)
        eqv = judge(rules(Path(sys.argv[2])), t, diffs) if len(sys.argv) > 2 else {}
        for k, v in diffs.items():
            print(f"## {k} ({STATUS.get(codes[k])}{', equivalent by ' + eqv[k] if k in eqv else ''})")
            print("\n".join(v))
    elif cmd == "pending":
        pending()
    elif cmd == "record":
        record(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
    elif cmd == "table":
        table(Path(sys.argv[2]))
    else:
        raise SystemExit(__doc__)
