#!/usr/bin/env bash
# The test command: installs the system tools the integration tests drive (Chromium for the editor's browser
# test, OpenSSH's sshd for the SSH-launch tests, as root Slurm and munge for the Slurm tests' own small cluster,
# which needs root and is skipped without), creates .venv with the SDK and its test extras, then runs the whole
# suite: unit, property and integration tests, and every tutorial notebook through nbval.
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
python -m pytest -q -p no:cacheprovider tests tutorials --nbval-lax "$@"
