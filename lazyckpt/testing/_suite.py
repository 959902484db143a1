"""What the conformance suite stands on: the hooks a tier's test class provides (the
``make_tier`` fixture, the oracles, the switches) and the helpers every check uses. See
:mod:`lazyckpt.testing._conformance` for how to use the suite."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import crc32c
import pytest
import torch

from .._format.manifest import Manifest
from .._tiering.interface import Tier

__all__ = ["TierSuite", "build_crc", "sample_state"]


def build_crc(data: bytes) -> int:
    """The crc32c of ``data``, as a shard's checksum."""
    return int(crc32c.crc32c(data))


def sample_state(seed: int = 0) -> dict[str, Any]:
    """A small state of every kind a tier stores (chunk shards, packed tensors, bfloat16,
    bool, plain values), different for each ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(300, 100, generator=g),  # several chunk shards
        "small": [torch.randn(7, generator=g), torch.arange(5, dtype=torch.int64)],
        "half": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "flag": torch.tensor([True, False, True]),
        "meta": {"lr": 0.1, "name": "run"},
    }


class TierSuite:
    """The hooks and helpers of :class:`~lazyckpt.testing.TierTests` (no tests here)."""

    pytestmark: ClassVar[list[Any]] = [pytest.mark.asyncio]
    persistent: ClassVar[bool] = True
    one_writer: ClassVar[bool] = True
    honours_readonly: ClassVar[bool] = True

    @pytest.fixture
    def make_tier(self) -> Callable[[], Tier]:
        raise NotImplementedError("subclasses provide a make_tier fixture")

    async def raw_steps(self, tier: Tier) -> list[int]:
        """Committed steps, read from the backend without the tier's code (the oracle of
        every commit and delete check). Required for a persistent tier."""
        raise NotImplementedError(
            f"{type(self).__name__} must override raw_steps(tier): the committed steps read "
            "from the backend without the tier's code, or the commit checks check nothing"
        )

    async def stored_names(self) -> set[str]:
        """Every file or object at the location ``make_tier`` uses (paths or keys), read
        without the tier's code: what delete and crash cleanup must remove is checked with
        it. Required for a persistent tier."""
        raise NotImplementedError(
            f"{type(self).__name__} must override stored_names(): every file or object at "
            "the tier's location, or the cleanup checks check nothing"
        )

    async def crash(self, tier: Tier) -> None:
        """Make ``tier`` (mid-snapshot) stop as a killed writer would: release what the OS
        releases at exit (locks) and nothing else. The default closes it; a tier whose
        ``aclose()`` removes uncommitted data overrides this (or crash cleanup cannot be
        checked, and the cleanup test says so)."""
        await tier.aclose()

    async def plant_foreign(self) -> Callable[[], object] | None:
        """Put what another kind of store writes at the location ``make_tier`` uses, and
        return a function whose result must not change when the tier refuses to open there
        (a listing, say); ``None`` for a tier without a location another store could share."""
        return None

    async def missing_location(self) -> tuple[Tier, Callable[[], bool]]:
        """A read-only instance of the tier over a location that does not exist, and a
        function that says whether that location exists now. Required with
        ``honours_readonly``."""
        raise NotImplementedError(
            f"{type(self).__name__} must override missing_location() (honours_readonly is "
            "set): a read-only instance over a location that does not exist"
        )

    async def _raw(self, tier: Tier) -> list[int] | None:
        """The oracle's steps; ``None`` for a volatile tier (nothing outside it to read)."""
        return await self.raw_steps(tier) if self.persistent else None

    @asynccontextmanager
    async def opened(
        self, make_tier: Callable[[], Tier], rank: int = 0, world_size: int = 1
    ) -> AsyncIterator[Tier]:
        tier = make_tier()
        if world_size > 1:
            tier.bind(rank, world_size)
        await tier.open()
        try:
            yield tier
        finally:
            await tier.aclose()

    async def write(self, tier: Tier, manifest: Manifest, payloads: list[bytes]) -> None:
        await tier.begin(manifest)
        order = list(range(len(payloads)))
        random.Random(manifest.step).shuffle(order)
        await asyncio.gather(
            *(tier.put_shard(manifest, manifest.shards[i], memoryview(payloads[i])) for i in order)
        )
        await tier.commit(manifest)

    async def read_all(self, tier: Tier, manifest: Manifest) -> list[bytes]:
        out = []
        for shard in manifest.shards:
            buf = bytearray(shard.length)
            await tier.read_shard(manifest, shard, memoryview(buf))
            out.append(bytes(buf))
        return out
