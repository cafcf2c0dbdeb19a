#!/usr/bin/env bash
# The main job: a local, embedded default that needs no cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=planner . scripts/_venv.sh
hspmd demo "$@"
