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

    async def raw_steps(self, tier: Tier) -> list[int] | None:
        return _listed(self.root)


def _listed(root: Path) -> list[int]:
    """The oracle: a step is committed exactly when its manifest file exists."""
    if not root.exists():
        return []
    return sorted(
        int(name.split("-")[1])
        for name in os.listdir(root)
        if os.path.exists(root / name / "manifest.json")
    )


class TestFileTierDirect(TestFileTier):
    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> Callable[[], Tier]:
        self.root = tmp_path / "ckpt"
        return lambda: FileTier(self.root, direct=True, piece_bytes=1 << 16)
