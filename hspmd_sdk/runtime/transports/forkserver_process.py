"""The fork server's own process: ``python -m hspmd_sdk.runtime.transports.forkserver_process FD PAD`` (see :mod:`.forkserver`).

``FD``: its end of the launcher's socket.  ``PAD``: room on the command line, which each forked worker rewrites to
a fresh worker's (``python -m hspmd_sdk.runtime.workers.worker --rank R``)."""
from __future__ import annotations

import sys

from .forkserver import serve
from ..workers.worker import main

if __name__ == "__main__":
    serve(int(sys.argv[1]), main)
