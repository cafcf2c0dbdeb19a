# Sourced by the README's commands: create/refresh .venv and install hspmd_sdk with the extras named in $EXTRAS.
EXTRAS="${EXTRAS:-dev}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
stamp=".venv/.installed-$EXTRAS-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  # torch first, pinned: the CPU wheel on this kind of machine; an unpinned torch would pull a CUDA build.
  # A phase line before each step: the first set-up takes a minute or more and pip -q prints nothing meanwhile.
  { echo "setting up .venv: upgrading pip ..." >&2 && python -m pip install -q --upgrade pip \
    && echo "setting up .venv: installing torch 2.13.0 (CPU build, ~200 MB) ..." >&2 \
    && python -m pip install -q "torch==2.13.0" \
    && echo "setting up .venv: installing hspmd_sdk[$EXTRAS] and its dependencies ..." >&2 \
    && python -m pip install -q -e ".[$EXTRAS]" \
    && echo "setting up .venv: done" >&2; } 2>&1 | { grep --line-buffered -v -e "is ignored: it is neither" -e "^  " || true; }
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "installation failed" >&2; return 1 2>/dev/null || exit 1; }
  touch "$stamp"
fi
