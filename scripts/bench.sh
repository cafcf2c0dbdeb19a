#!/usr/bin/env bash
# The benchmarks: every script in benchmarks/, each printing its figures against its named peer.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev . scripts/_venv.sh
for b in benchmarks/bench_*.py; do
  echo "== $b"
  python "$b"
done
