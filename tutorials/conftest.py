"""The tutorials under nbval (``pytest --nbval-lax tutorials``).

``10_slurm.ipynb`` brings up a real Slurm on this machine, which needs root and Debian's ``slurm-wlm`` and
``munge``.  Where it cannot (:func:`hspmd_sdk.testing.slurm.slurm_unavailable` says why), its cells are skipped,
visibly, with that reason, instead of running a first cell that stops the notebook; in CI (``CI`` set, as CI
services set it) nothing is skipped: the notebook runs, its first cell raises the reason, and the run fails, as
every other test that cannot run in CI does (tests/_needs.py)."""
from __future__ import annotations

import os

import pytest

SLURM_NOTEBOOK = "10_slurm.ipynb"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cells = [item for item in items if item.path.name == SLURM_NOTEBOOK]
    if not cells or os.environ.get("CI"):
        return
    from hspmd_sdk.testing.slurm import slurm_unavailable

    why = slurm_unavailable()
    if why:
        skip = pytest.mark.skip(reason=f"tutorials/{SLURM_NOTEBOOK} needs a local Slurm cluster: {why}")
        for item in cells:
            item.add_marker(skip)
