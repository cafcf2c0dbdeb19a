"""``python -m hspmd_sdk.cli ...``: the same program as the ``hspmd`` script."""
from __future__ import annotations

import sys

from .entry import main

if __name__ == "__main__":
    sys.exit(main())
