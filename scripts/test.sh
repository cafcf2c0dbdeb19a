#!/usr/bin/env bash
# The test command: creates .venv, installs the SDK with its test extras, runs the whole suite
# (unit and property tests, then every tutorial notebook through nbval).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
python -m pytest -q -p no:cacheprovider tests tutorials --nbval-lax "$@"
