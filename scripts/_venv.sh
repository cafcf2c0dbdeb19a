# Sourced by the README's commands: create/refresh .venv and install hspmd_sdk with the extras named in $EXTRAS.
EXTRAS="${EXTRAS:-dev}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
stamp=".venv/.installed-$EXTRAS-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  # torch first, pinned: the CPU wheel on this kind of machine; an unpinned torch would pull a CUDA build.
  # A phase line before each step: the first set-up takes a minute or more and pip -q prints nothing meanwhile;
  # on a terminal a line under it counts the seconds (each phase line starts with \r and overwrites it).
  _venv_ticker=""
  if [ -t 2 ]; then
    ( t0=$SECONDS; while sleep 1; do printf '\r  ... %d s\033[K' $((SECONDS - t0)) >&2; done ) &
    _venv_ticker=$!
  fi
  { printf '\rsetting up .venv: upgrading pip ...\033[K\n' >&2 && python -m pip install -q --upgrade pip \
    && printf '\rsetting up .venv: installing torch 2.13.0 (CPU build, ~200 MB) ...\033[K\n' >&2 \
    && python -m pip install -q "torch==2.13.0" \
    && printf '\rsetting up .venv: installing hspmd_sdk[%s] and its dependencies ...\033[K\n' "$EXTRAS" >&2 \
    && python -m pip install -q -e ".[$EXTRAS]" \
    && printf '\rsetting up .venv: done\033[K\n' >&2; } 2>&1 | { grep --line-buffered -v -e "is ignored: it is neither" -e "^  " || true; }
  _venv_status=${PIPESTATUS[0]}
  if [ -n "$_venv_ticker" ]; then
    kill "$_venv_ticker" 2>/dev/null; wait "$_venv_ticker" 2>/dev/null; printf '\r\033[K' >&2
  fi
  [ "$_venv_status" -eq 0 ] || { echo "installation failed" >&2; return 1 2>/dev/null || exit 1; }
  unset _venv_ticker _venv_status
  touch "$stamp"
fi
