"""ZarrTier passes the tier conformance suite on a local path and on S3 (moto, loopback)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest_s3 import S3Location, s3, s3_server

from lazyckpt import Tier
from lazyckpt.testing import TierTests
from tiers import ZarrTier

__all__ = ["s3", "s3_server"]  # the fixtures, imported for pytest


def _committed(root_document: bytes) -> list[int]:
    """The oracle: a step is committed exactly when the root group's index lists it."""
    return sorted(json.loads(root_document)["attributes"]["lazyckpt"]["committed"])


class TestZarrTierPath(TierTests):
    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> Callable[[], Tier]:
        self.root = tmp_path / "zarr"
        return lambda: ZarrTier(self.root)

    async def raw_steps(self, tier: Tier) -> list[int] | None:
        index = self.root / "zarr.json"
        return _committed(index.read_bytes()) if index.exists() else []


class TestZarrTierS3(TierTests):
    @pytest.fixture
    def make_tier(self, s3: S3Location) -> Callable[[], Tier]:
        self.location = s3
        return lambda: ZarrTier(s3.url, **s3.server.tier_options())

    async def raw_steps(self, tier: Tier) -> list[int] | None:
        client = self.location.server.client()
        key = f"{self.location.prefix}/zarr.json"
        stored = self.location.keys()
        if key not in stored:
            return []
        body = client.get_object(Bucket=self.location.server.bucket, Key=key)["Body"].read()
        return _committed(body)
