#!/usr/bin/env bash
# The test command: installs the system tools the integration tests drive (Chromium for the editor's browser
# test, OpenSSH's sshd for the SSH-launch tests, as root Slurm and munge for the Slurm tests' own small cluster,
# which needs root and is skipped without it, failed in CI), creates .venv with the SDK and its test extras,
# installs the widgets' build tools (npm ci in widgets/, when Node is there), then runs the whole suite: unit,
# property and integration tests (the widgets' JavaScript tests among them), and every tutorial notebook through
# nbval.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
if [ "$(id -u)" = 0 ]; then
  { [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ]; } || need+=(slurm-wlm)
  [ -x /usr/sbin/munged ] || need+=(munge)
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing ${need[*]} (Debian packages)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "missing ${need[*]}: run 'sudo apt-get install -y ${need[*]}' first" >&2
    exit 1
  fi
fi
. scripts/_venv.sh
# the widgets' front ends (widgets/): esbuild for their build and tests (tests/test_widgets.py), installed again
# whenever package-lock.json is newer than node_modules; without Node those tests are skipped (failed in CI)
if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
  if [ ! -d widgets/node_modules ] || [ widgets/package-lock.json -nt widgets/node_modules ]; then
    npm ci --prefix widgets --no-audit --no-fund --loglevel=error >/dev/null \
      || echo "npm ci in widgets/ failed: tests/test_widgets.py will skip (fail in CI)" >&2
  fi
fi
python -m pytest -q -p no:cacheprovider tests tutorials --nbval-lax "$@"
