#!/usr/bin/env bash
# Mutation testing of core/, planner/ and the runtime's pure parts (issues 29 and 49), with mutmut 3.8.1.  NOT part
# of the test command (scripts/test.sh).
#
#   scripts/mutation.sh                 # every module (the files scripts/mutation/*.cfg), one after the other
#   scripts/mutation.sh bsr cost        # a subset: rerun one module after editing its file or its tests
#
# Each module is mutated in a copy of the project under $MUTATION_WORKDIR (default /tmp/hspmd_mutation/<module>),
# never in this working tree.  Its config, scripts/mutation/<module>.cfg, becomes that copy's setup.cfg: the
# [mutmut] section names the one file to mutate and the test files that cover it (mutmut then runs, for each
# mutant, only the tests that called the mutated function, in a process forked from a warm one), and the per-mutant
# CPU-time limit; an optional [select] section restricts the run to some functions.  In the copy, the file's
# decorated functions are rewritten so that mutmut mutates them too (scripts/mutation/undecorate.py), and every
# test starts with the SDK's lru_caches empty (a mutant behind a cache filled by the warm process is reached).
# A surviving mutant counts as equivalent only when a rule of scripts/mutation/equivalent.toml matches what it
# changes.  The table of every module run so far (mutants, killed, survived, equivalent, timeouts, time, the hash
# of the file mutated: a module whose file changed since is marked stale) is printed and written to
# benchmarks/results/mutation.md.
#
# Environment: MUTATION_WORKDIR (see above), MUTATION_JOBS (parallel mutants, default 1: a shared machine),
# MUTATION_KEEP=1 keeps the work copies; MUTATION_RESUME=1 reuses a kept copy (its verdicts stand, its tests are
# replaced by the current ones) and retests every mutant that was not killed: the check after adding tests.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || { echo "no .venv: run scripts/test.sh (or . scripts/_venv.sh) first" >&2; exit 1; }
if [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("mutmut"))' 2>/dev/null)" != 3.8.1 ]; then
  echo "installing mutmut 3.8.1 into .venv"
  "$PY" -m pip install -q "mutmut==3.8.1" 2>&1 | grep -v -e "is ignored: it is neither" || true
fi
WORK="${MUTATION_WORKDIR:-/tmp/hspmd_mutation}"
JOBS="${MUTATION_JOBS:-1}"
if [ $# -gt 0 ]; then modules=("$@"); else
  mapfile -t modules < <(cd scripts/mutation && ls *.cfg | sed 's/\.cfg$//')
fi
for m in "${modules[@]}"; do
  [ -f "scripts/mutation/$m.cfg" ] || { echo "unknown module '$m': no scripts/mutation/$m.cfg" >&2; exit 2; }
done
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONHASHSEED=0 HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-}"
for m in "${modules[@]}"; do
  dir="$WORK/$m"
  resume=0
  if [ "${MUTATION_RESUME:-0}" = 1 ] && [ -d "$dir/mutants" ]; then resume=1; fi
  if [ $resume = 1 ]; then
    # keep the verdicts; bring in the current tests and the rest of the current package (modules may have moved
    # since the copy was made); the mutated file stays as it was mutated
    only=$(sed -n 's/^only_mutate *= *//p' "scripts/mutation/$m.cfg")
    for d in "$dir" "$dir/mutants"; do
      rm -rf "$d/tests" && tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' -cf - tests | tar -C "$d" -xf -
      find "$d/hspmd_sdk" -name '*.py' ! -path "$d/$only" -delete
      tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' --exclude="$only" -cf - hspmd_sdk | tar -C "$d" -xf -
    done
  else
    rm -rf "$dir" && mkdir -p "$dir"
    # the package, the tests, pytest's config; no caches
    tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' -cf - hspmd_sdk tests pyproject.toml | tar -C "$dir" -xf -
    only=$(sed -n 's/^only_mutate *= *//p' "scripts/mutation/$m.cfg")
    sha256sum "$only" | cut -d' ' -f1 > "$dir/source.sha256"  # the file as written, before undecorating
    "$PY" scripts/mutation/undecorate.py "$dir/$only"
  fi
  for d in "$dir" "$dir/mutants"; do
    if [ -d "$d/tests" ]; then cat scripts/mutation/conftest_addition.py >> "$d/tests/conftest.py"; fi
  done
  cp "scripts/mutation/$m.cfg" "$dir/setup.cfg"
  mapfile -t select < <("$PY" scripts/mutation/summarize.py select "$dir/setup.cfg")
  echo "== $m: mutmut run ${select[*]:-(all functions)}$([ $resume = 1 ] && echo ' (resumed)')"
  start=$(date +%s)
  ( cd "$dir" && "$ROOT/.venv/bin/mutmut" run --max-children "$JOBS" "${select[@]}" > mutmut.log 2>&1 ) || {
    echo "mutmut failed for $m; the end of its log ($dir/mutmut.log):" >&2; tail -40 "$dir/mutmut.log" >&2; exit 1; }
  if [ $resume = 1 ]; then
    # verdicts kept from before the tests changed: test every mutant not killed again, by name
    mapfile -t again < <(cd "$dir" && "$PY" "$ROOT/scripts/mutation/summarize.py" pending)
    if [ ${#again[@]} -gt 0 ]; then
      echo "   retesting ${#again[@]} mutants not killed before"
      ( cd "$dir" && "$ROOT/.venv/bin/mutmut" run --max-children "$JOBS" "${again[@]}" >> mutmut.log 2>&1 ) || {
        echo "mutmut failed for $m; the end of its log ($dir/mutmut.log):" >&2; tail -40 "$dir/mutmut.log" >&2; exit 1; }
    fi
  fi
  end=$(date +%s)
  ( cd "$dir" && "$PY" "$ROOT/scripts/mutation/summarize.py" record "$m" $((end - start)) "$ROOT" )
  [ "${MUTATION_KEEP:-0}" = 1 ] || [ "${MUTATION_RESUME:-0}" = 1 ] || rm -rf "$dir"
done
"$PY" scripts/mutation/summarize.py table "$ROOT"
