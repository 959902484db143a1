from __future__ import annotations

from collections.abc import Callable

import pytest

from lazyckpt import Tier
from lazyckpt.testing import TierTests
from tiers import HostMemoryTier


class TestHostMemoryTier(TierTests):
    persistent = False

    @pytest.fixture
    def make_tier(self) -> Callable[[], Tier]:
        return lambda: HostMemoryTier(8 << 20)
