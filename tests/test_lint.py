"""The code passes the project's linters, as ``make lint`` runs them (ruff, and mypy with
the settings in pyproject.toml), inside the suite: a typing error fails ``make test`` and
CI like a failing test does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )


def test_ruff_finds_nothing() -> None:
    found = _run("ruff", "check", "lazyckpt", "tiers", "tests", "examples", "bench")
    assert found.returncode == 0, found.stdout + found.stderr


@pytest.mark.timeout(600)
def test_mypy_finds_nothing() -> None:
    """About 40 s with a cold cache on the 2-vCPU machine, a few seconds warm."""
    found = _run("mypy")
    assert found.returncode == 0, found.stdout + found.stderr
