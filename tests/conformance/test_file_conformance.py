from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from lazyckpt import Tier
from lazyckpt.testing import TierTests
from tiers import FileTier


class TestFileTier(TierTests):
    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> Callable[[], Tier]:
        self.root = tmp_path / "ckpt"
        return lambda: FileTier(self.root)

    async def raw_steps(self, tier: Tier) -> list[int]:
        return _listed(self.root)

    async def stored_names(self) -> set[str]:
        return {name for name, _ in _tree(self.root)} if self.root.exists() else set()

    async def plant_foreign(self) -> Callable[[], object]:
        # what a ZarrTier leaves: a root group and a committed step group
        (self.root / "step-000000000001").mkdir(parents=True)
        (self.root / "zarr.json").write_text('{"zarr_format":3,"node_type":"group"}')
        (self.root / "step-000000000001" / "zarr.json").write_text("{}")
        return lambda: _tree(self.root)

    async def missing_location(self) -> tuple[Tier, Callable[[], bool]]:
        where = self.root.parent / "missing" / "ckpt"
        return FileTier(where, readonly=True), (self.root.parent / "missing").exists


def _listed(root: Path) -> list[int]:
    """The oracle: a step is committed exactly when its manifest file exists."""
    if not root.exists():
        return []
    return sorted(
        int(name.split("-")[1])
        for name in os.listdir(root)
        if os.path.exists(root / name / "manifest.json")
    )


def _tree(root: Path) -> list[tuple[str, int]]:
    """Every file under ``root`` with its size: what must not change."""
    return sorted(
        (os.path.relpath(os.path.join(d, f), root), os.path.getsize(os.path.join(d, f)))
        for d, _, files in os.walk(root)
        for f in files
    )


class TestFileTierDirect(TestFileTier):
    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> Callable[[], Tier]:
        self.root = tmp_path / "ckpt"
        return lambda: FileTier(self.root, direct=True, piece_bytes=1 << 16)
