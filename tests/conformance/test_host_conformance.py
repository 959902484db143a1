from __future__ import annotations

from collections.abc import Callable

import pytest

from lazyckpt import Tier
from lazyckpt.testing import TierTests
from tiers import HostMemoryTier


class TestHostMemoryTier(TierTests):
    persistent = False
    one_writer = False  # each instance is its own memory: there is no shared location
    honours_readonly = False

    @pytest.fixture
    def make_tier(self) -> Callable[[], Tier]:
        return lambda: HostMemoryTier(8 << 20)
