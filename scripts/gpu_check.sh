#!/usr/bin/env bash
# The GPU check (issue 26 item 6), one command for a machine with one or more NVIDIA GPUs, done within 8 minutes:
#   1. the equivalence tests on CUDA (pytest -m gpu tests/test_gpu.py: one GPU; with 2 GPUs DP2, TP2, CP2, PP2
#      over NCCL; with 4 a mixed TP2->TP1 plan and a CP2->CP1 plan; each against the single-device reference);
#   2. benchmarks/bench_gpu.py: one decoder layer's bf16 TFLOPS against the device's peak, and (2+ GPUs) a DP
#      plan's step time against torch DDP;
#   3. everything in benchmarks/results/gpu_check_<host>.json, and a readable summary on stdout.
# Exit status: pytest's when a test failed (1), 124 when the budget ran out, 3 when the benchmark failed, 2 when
# this machine cannot run the check (what is missing is said); 0 otherwise.
#
# Usage: scripts/gpu_check.sh [--cpu] [ARGS for bench_gpu.py...]
#   --cpu   on a machine without GPUs: the same steps as a smoke run (the tests skip, saying why; the benchmark
#           runs --device cpu --quick, gloo on 2 ranks); ARGS such as --json PATH go to bench_gpu.py.
# Environment: HSPMD_GPU_PYTHON=/path/to/python  use that interpreter as it is (no install; hspmd_sdk from this
#              checkout via PYTHONPATH); HSPMD_GPU_CHECK_BUDGET_S  the whole run's limit in seconds (default 480);
#              HSPMD_TORCH_INDEX_URL  the index to take the CUDA torch from in case d below (default: pip's
#              default index, whose torch 2.13.0 wheel is built for CUDA 13 and needs an NVIDIA driver >= 580; for
#              an older driver name the PyTorch index of a CUDA 12 build).
#
# Which Python (and so which torch): scripts/_venv.sh pins torch==2.13.0 into .venv, and on the development
# machines the pip configuration serves that pin as the CPU wheel (2.13.0+cpu); on an ordinary Linux machine the
# same pin from the default index is a CUDA build.  So, first that works:
#   a. HSPMD_GPU_PYTHON, when given (its torch must see the GPUs);
#   b. .venv, when its torch already sees the GPUs (the usual case after scripts/test.sh on a GPU machine);
#   c. a python3 on PATH whose torch sees the GPUs (a CUDA image's own torch, any version the SDK supports:
#      torch>=2.3,<=2.14.1): used as it is, hspmd_sdk from this checkout; when it lacks the SDK's few other
#      needs (pydantic, numpy, pytest, pytest-timeout) they go into build/gpu-venv, a venv that sees python3's
#      packages (--system-site-packages), so that no multi-GB torch is downloaded again;
#   d. otherwise .venv as scripts/_venv.sh makes it, with its torch replaced by the CUDA build of the same pin
#      (torch==2.13.0) from the default index, the machine's pip configuration (which may point at CPU wheels)
#      left out for that one install.
# The budget covers the install too: a first run that must download torch may run out of it (exit 124); pip
# keeps what it fetched and a second run starts where it stopped.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

cpu=0
if [ "${1:-}" = "--cpu" ]; then
  cpu=1
  shift
fi
budget=${HSPMD_GPU_CHECK_BUDGET_S:-480}
deadline=$(( $(date +%s) + budget ))
export PYTHONUNBUFFERED=1

left() { echo $(( deadline - $(date +%s) )); }

# run "$@" under what is left of the budget, less $1 seconds kept for the steps after it
bounded() {
  local keep=$1
  shift
  local limit=$(( $(left) - keep ))
  if [ "$limit" -le 0 ]; then
    echo "gpu_check: the ${budget} s budget is spent before: $*" >&2
    return 124
  fi
  timeout --kill-after=15 "$limit" "$@"
}

# bounded (keeping $1 seconds) "$@", a pip command, without pip's notes about unreachable local package folders
# (what scripts/_venv.sh drops too)
pip_bounded() {
  local keep=$1
  shift
  bounded "$keep" "$@" 2>&1 | { grep -v -e "is ignored: it is neither" -e "^  " || true; }
  return "${PIPESTATUS[0]}"
}

cuda_ok() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
missing_modules() {
  "$1" -c 'import importlib.util as u
print(" ".join(m for m in ("pydantic", "numpy", "pytest", "pytest_timeout") if u.find_spec(m) is None))' 2>/dev/null
}
torch_says() { "$1" -c 'import torch; print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}")' 2>&1 | tail -1; }

if [ "$cpu" = 0 ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi not found); run this on a GPU machine, or '$0 --cpu' for" \
         "the smoke run" >&2
    exit 2
  fi
  echo "== GPUs (nvidia-smi -L)"
  nvidia-smi -L || { echo "gpu_check: nvidia-smi -L failed: is the NVIDIA driver loaded?" >&2; exit 2; }
fi

# ---- the interpreter (see the header) ---------------------------------------------------------------------------
PY=""
if [ -n "${HSPMD_GPU_PYTHON:-}" ]; then
  PY=$HSPMD_GPU_PYTHON
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  why="HSPMD_GPU_PYTHON"
elif [ "$cpu" = 0 ] && [ -x .venv/bin/python ] && cuda_ok .venv/bin/python; then
  PY=.venv/bin/python
  why=".venv, whose torch sees the GPUs"
elif [ "$cpu" = 0 ] && command -v python3 >/dev/null 2>&1 && cuda_ok python3; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  need=$(missing_modules python3)
  if [ -z "$need" ]; then
    PY=$(command -v python3)
    why="python3 on PATH, whose torch sees the GPUs"
  else
    echo "== python3's torch sees the GPUs; build/gpu-venv (seeing python3's packages) gets: $need"
    [ -x build/gpu-venv/bin/python ] || python3 -m venv --system-site-packages build/gpu-venv || exit 2
    pkgs=()
    for m in $need; do
      case $m in
        pydantic) pkgs+=("pydantic>=2.11,<3") ;;
        pytest_timeout) pkgs+=("pytest-timeout>=2.3") ;;
        *) pkgs+=("$m") ;;
      esac
    done
    pip_bounded 300 build/gpu-venv/bin/python -m pip install -q "${pkgs[@]}" \
      || { echo "gpu_check: could not install ${pkgs[*]} into build/gpu-venv (offline? carry them as wheels)" >&2
           exit 2; }
    PY=build/gpu-venv/bin/python
    why="build/gpu-venv over python3's CUDA torch"
  fi
else
  # d. .venv the way scripts/test.sh makes it: on a GPU machine with a light extra (the check needs no notebook
  #    or browser tools), with --cpu with test.sh's own (dev: the venv a developer already has)
  [ "$cpu" = 1 ] && extras=${EXTRAS:-dev} || extras=${EXTRAS:-hf}
  EXTRAS=$extras bounded 300 bash -c '. scripts/_venv.sh' || { echo "gpu_check: scripts/_venv.sh failed" >&2; exit 2; }
  PY=.venv/bin/python
  missing=$(missing_modules "$PY")
  if [ -n "$missing" ]; then
    pip_bounded 300 "$PY" -m pip install -q "pytest>=8" "pytest-timeout>=2.3" || exit 2
  fi
  why=".venv (scripts/_venv.sh)"
  if [ "$cpu" = 0 ] && ! cuda_ok "$PY"; then
    echo "== .venv has $(torch_says "$PY"), which sees no GPU: installing the CUDA build of torch==2.13.0"
    # '===' compares the version string exactly: the CPU wheel's "2.13.0+cpu" does not satisfy it (it does
    # satisfy '==2.13.0'), so pip replaces it (and puts it back should the install fail); without the machine's
    # pip configuration the default index's 2.13.0 is the CUDA build, with its nvidia-* libraries.  A PyTorch
    # index labels its builds (2.13.0+cu126): there '==2.13.0', reinstalled.
    how=("torch===2.13.0")
    [ -n "${HSPMD_TORCH_INDEX_URL:-}" ] && how=(--index-url "$HSPMD_TORCH_INDEX_URL" --force-reinstall "torch==2.13.0")
    pip_bounded 300 env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
      "$PY" -m pip install -q "${how[@]}"
    rc=$?
    [ "$rc" = 0 ] || { echo "gpu_check: installing torch==2.13.0 failed (exit $rc)" >&2; exit "$rc"; }
    why=".venv with the CUDA build of torch==2.13.0"
  fi
fi
if [ "$cpu" = 0 ] && ! cuda_ok "$PY"; then
  echo "gpu_check: $PY has $(torch_says "$PY"), which cannot use the GPUs nvidia-smi lists; install a CUDA" \
       "build of torch there, or point HSPMD_GPU_PYTHON at an interpreter whose torch can" >&2
  exit 2
fi
missing=$(missing_modules "$PY")
if [ -n "$missing" ]; then
  echo "gpu_check: $PY lacks the Python modules: $missing" >&2
  exit 2
fi
echo "== python: $PY ($why): $(torch_says "$PY"); $(( $(left) )) s of the ${budget} s budget left"

# ---- 1. the equivalence tests -------------------------------------------------------------------------------------
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
junit="$work/gpu_tests.xml"
echo "== pytest -m gpu tests/test_gpu.py"
# xunit1: the JUnit file keeps each test's record_property figures (the JSON reads them from there)
bounded 150 "$PY" -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_gpu.py --junitxml="$junit" \
  -o junit_family=xunit1
tests_rc=$?
[ "$tests_rc" = 124 ] && echo "gpu_check: the tests ran out of the budget" >&2

# ---- 2. the figures, with the tests' outcome ----------------------------------------------------------------------
bench_args=(--junit "$junit" --tests-rc "$tests_rc")
[ "$cpu" = 1 ] && bench_args+=(--device cpu --quick)
echo "== benchmarks/bench_gpu.py ${bench_args[*]} $*"
bounded 5 "$PY" benchmarks/bench_gpu.py "${bench_args[@]}" "$@"
bench_rc=$?

if [ "$tests_rc" != 0 ]; then
  echo "gpu_check: FAILED: the equivalence tests (pytest exit $tests_rc)" >&2
  exit "$tests_rc"
fi
if [ "$bench_rc" != 0 ]; then
  echo "gpu_check: FAILED: benchmarks/bench_gpu.py (exit $bench_rc)" >&2
  [ "$bench_rc" = 124 ] && exit 124
  exit 3
fi
echo "gpu_check: done in $(( budget - $(left) )) s"
