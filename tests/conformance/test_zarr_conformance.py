"""ZarrTier passes the tier conformance suite on a local path and on S3 (SeaweedFS, loopback)."""

from __future__ import annotations

import json
import uuid
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

    async def raw_steps(self, tier: Tier) -> list[int]:
        index = self.root / "zarr.json"
        return _committed(index.read_bytes()) if index.exists() else []

    async def stored_names(self) -> set[str]:
        return {str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()}

    async def plant_foreign(self) -> Callable[[], object]:
        # what a FileTier leaves: its marker and a committed step directory
        step = self.root / "step-000000000001"
        step.mkdir(parents=True)
        (self.root / "lazyckpt-file.json").write_text('{"format":"lazyckpt-file","version":1}')
        (step / "manifest.json").write_text("{}")
        (step / "rank-00000.data").write_bytes(b"x" * 100)
        return lambda: sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*"))

    async def missing_location(self) -> tuple[Tier, Callable[[], bool]]:
        where = self.root.parent / "missing"
        return ZarrTier(where, readonly=True), where.exists


class TestZarrTierS3(TierTests):
    @pytest.fixture
    def make_tier(self, s3: S3Location) -> Callable[[], Tier]:
        self.location = s3
        return lambda: ZarrTier(s3.url, **s3.server.tier_options())

    async def plant_foreign(self) -> Callable[[], object]:
        client = self.location.server.client()
        bucket, prefix = self.location.server.bucket, self.location.prefix
        client.put_object(Bucket=bucket, Key=f"{prefix}/lazyckpt-file.json", Body=b"{}")
        client.put_object(
            Bucket=bucket, Key=f"{prefix}/step-000000000001/manifest.json", Body=b"{}"
        )
        return self.location.keys

    async def missing_location(self) -> tuple[Tier, Callable[[], bool]]:
        server = self.location.server
        bucket = f"missing-{uuid.uuid4().hex[:12]}"
        tier = ZarrTier(f"s3://{bucket}/run", readonly=True, **server.tier_options())

        def exists() -> bool:
            return bucket in {b["Name"] for b in server.client().list_buckets()["Buckets"]}

        return tier, exists

    async def stored_names(self) -> set[str]:
        return set(self.location.keys())

    async def raw_steps(self, tier: Tier) -> list[int]:
        client = self.location.server.client()
        key = f"{self.location.prefix}/zarr.json"
        stored = self.location.keys()
        if key not in stored:
            return []
        body = client.get_object(Bucket=self.location.server.bucket, Key=key)["Body"].read()
        return _committed(body)
