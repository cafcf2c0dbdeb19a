"""Skipping a test whose environment is missing, visibly, everywhere but in CI (``CI`` set, as CI services set it),
where a test that cannot run is a failure: CI must run everything (the browser, Node, sshd and Slurm tests)."""
from __future__ import annotations

import os

import pytest


def skip_or_fail(why: str | None, what: str) -> None:
    """Nothing when ``why`` is ``None``; else skip with ``why``, or fail in CI naming ``what`` could not run."""
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what} cannot run here: {why}; CI is set, so this is a failure", pytrace=False)
    pytest.skip(why)
