"""Shared pytest configuration."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "hspmd_sdk" / "examples"


@pytest.fixture
def examples_dir() -> Path:
    return EXAMPLES
