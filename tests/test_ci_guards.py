"""CI runs everything (issue 48 item 6): a test whose environment is missing skips, visibly, outside CI and fails
in CI (``CI`` set) — the Slurm tests (tests/_needs.py) and tutorial 10 under nbval (tutorials/conftest.py) as the
browser, Node and sshd tests do.  Checked by running pytest on them with and without ``CI``, where this machine
cannot run a local Slurm (where it can, they run for real and there is nothing to guard)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _needs import skip_or_fail

from hspmd_sdk.testing.slurm import slurm_unavailable

REPO = Path(__file__).resolve().parents[1]


def test_skip_or_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    skip_or_fail(None, "x")  # nothing missing: nothing happens
    with pytest.raises(pytest.skip.Exception, match="no widget"):
        skip_or_fail("no widget", "the widget tests")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="the widget tests cannot run here: no widget; CI is set"):
        skip_or_fail("no widget", "the widget tests")


def _pytest(*args: str, ci: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=150)


@pytest.mark.timeout(320)
def test_without_slurm_the_slurm_tests_and_tutorial_10_skip_outside_ci_and_fail_in_ci() -> None:
    why = slurm_unavailable()
    if why is None:
        return  # a local Slurm runs here: the Slurm tests and the tutorial run for real
    tests = ["tests/test_slurm_cluster.py", "-k", "configured_nodes"]
    out = _pytest(*tests, ci=False)
    assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout[-2000:]
    out = _pytest(*tests, ci=True)
    assert out.returncode == 1 and "CI is set, so this is a failure" in out.stdout, out.stdout[-2000:]
    notebook = ["--nbval-lax", "tutorials/10_slurm.ipynb"]
    out = _pytest(*notebook, ci=False)
    assert out.returncode == 0 and "passed" not in out.stdout, out.stdout[-2000:]
    assert "skipped" in out.stdout and "10_slurm.ipynb needs a local Slurm cluster" in out.stdout, out.stdout[-2000:]
    out = _pytest(*notebook, "-x", ci=True)
    assert out.returncode == 1, out.stdout[-2000:]
    assert "SlurmLabError: this notebook needs a local Slurm cluster" in out.stdout, out.stdout[-3000:]
