"""Shared fixtures for the test suite."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings

# The test machines are small and shared: a property test must fail on a wrong answer, never
# because one example ran slower than hypothesis's default 200 ms deadline.
settings.register_profile(
    "lazyckpt", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("lazyckpt")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
