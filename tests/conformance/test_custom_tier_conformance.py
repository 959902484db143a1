"""The example third-party tier passes the same conformance suite as the built-ins."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from lazyckpt import Tier
from lazyckpt.testing import TierTests

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from custom_tier import _BUCKETS, DictStoreTier


class TestDictStoreTier(TierTests):
    # the toy example keeps it short: it neither locks its bucket nor offers read-only opens
    # (docs/tiers.md says how a real tier does both)
    one_writer = False
    honours_readonly = False

    @pytest.fixture
    def make_tier(self) -> Callable[[], Tier]:
        self.bucket = f"test-{uuid.uuid4().hex}"
        return lambda: DictStoreTier(self.bucket)

    async def stored_names(self) -> set[str]:
        return set(_BUCKETS.get(self.bucket, {}))

    async def raw_steps(self, tier: Tier) -> list[int]:
        # the oracle: a step is committed exactly when its manifest object exists
        return sorted(
            int(key.split("/")[0][len("step-") :])
            for key in _BUCKETS.get(self.bucket, {})
            if key.endswith("/manifest.json")
        )
