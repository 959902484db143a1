"""Shared fixtures for the test suite."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from lazyckpt.cli import main as cli_main

# the command line called in-process: (exit code, stdout, stderr)
Run = Callable[..., tuple[int, str, str]]

# The test machines are small and shared: a property test must fail on a wrong answer, never
# because one example ran slower than hypothesis's default 200 ms deadline.
settings.register_profile(
    "lazyckpt", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("lazyckpt")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    """``lazyckpt`` with these arguments, in this process: its exit code and what it
    printed on stdout and stderr."""

    def invoke(*argv: str | Path) -> tuple[int, str, str]:
        code = cli_main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke
