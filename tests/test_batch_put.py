"""A capture batch goes down to the first durable tier in one ``put_shards`` call where the
tier offers it (``SupportsBatchPut``): the bytes, the durability and the failure handling
are a shard-by-shard put's."""

from __future__ import annotations

import asyncio
import mmap
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import SnapshotFailedError
from lazyckpt._tiering.interface import puts_batches
from lazyckpt.tier import Manifest, ShardMeta, TierBrokenError
from tiers import FileTier, HostMemoryTier
from tiers.file import io as _file_io

SMALL = {"shard_size": 64 << 10, "pack_bytes": 4096}


def wide_state(step: int) -> dict[str, Any]:
    """Large tensors cut into many 64 KiB shards, and small ones packed with gaps."""
    g = torch.Generator().manual_seed(step)
    out: dict[str, Any] = {f"w{k}": torch.randn(128, 256, generator=g) for k in range(6)}
    out.update({f"b{k}": torch.randn(37 + k, generator=g) for k in range(20)})
    out["ids"] = torch.arange(1000, dtype=torch.int64) * step
    return out


class CountingFileTier(FileTier):
    """Counts the shards and calls of each kind of put; ``fail`` breaks ``put_shards``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter[str] = Counter()
        self.batches: list[int] = []
        self.fail = 0

    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        self.calls["put_shard"] += 1
        await super().put_shard(manifest, shard, data)

    async def put_shards(
        self, manifest: Manifest, shards: Sequence[ShardMeta], data: Sequence[memoryview]
    ) -> None:
        self.calls["put_shards"] += 1
        if self.fail:
            self.fail -= 1
            raise TierBrokenError("the disk went away", tier=self.name)
        self.batches.append(len(shards))
        await super().put_shards(manifest, shards, data)


class SlowFileTier(FileTier):
    """Overrides put_shard alone (as a test's slow tier does): it must stay in use."""

    seen = 0

    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        type(self).seen += 1
        await super().put_shard(manifest, shard, data)


@pytest.mark.parametrize("direct", [False, None])
async def test_a_batch_is_written_in_one_call_and_restores_bit_for_bit(
    tmp_path: Path, direct: bool | None
) -> None:
    tier = CountingFileTier(tmp_path / "f", direct=direct)
    async with lazyckpt.Checkpointer([HostMemoryTier(16 << 20), tier], **SMALL) as ckpt:
        handle = await ckpt.snapshot(wide_state(1), step=1)
        await asyncio.wait_for(handle.committed(), 30)
        assert handle.stats is not None
        shards = handle.stats.shards
    assert tier.calls["put_shard"] == 0
    assert sum(tier.batches) == shards and len(tier.batches) < shards
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "f")]) as fresh:
        restored = await fresh.restore(step=1)
    for key, value in wide_state(1).items():
        assert torch.equal(restored[key], value), key


async def test_a_tier_overriding_put_shard_alone_gets_every_shard_through_it(
    tmp_path: Path,
) -> None:
    assert not puts_batches(SlowFileTier(tmp_path / "s"))
    assert puts_batches(FileTier(tmp_path / "f")) and puts_batches(CountingFileTier(tmp_path / "c"))
    SlowFileTier.seen = 0
    async with lazyckpt.Checkpointer([HostMemoryTier(16 << 20), SlowFileTier(tmp_path / "s")], **SMALL) as ckpt:
        handle = await ckpt.snapshot(wide_state(1), step=1)
        await asyncio.wait_for(handle.committed(), 30)
        assert handle.stats is not None
        assert SlowFileTier.seen == handle.stats.shards


async def test_a_failed_batch_put_is_retried_then_fails_the_snapshot_once(tmp_path: Path) -> None:
    tier = CountingFileTier(tmp_path / "f")
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(16 << 20), tier], retries=1, retry_backoff=0.001, **SMALL
    ) as ckpt:
        tier.fail = 1  # the retry of the whole call succeeds
        await asyncio.wait_for((await ckpt.snapshot(wide_state(1), step=1)).committed(), 30)
        assert await ckpt.steps() == [1]
        tier.fail = 10**6
        handle = await ckpt.snapshot(wide_state(2), step=2)
        with pytest.raises(SnapshotFailedError) as info:
            await asyncio.wait_for(handle.committed(), 30)
        # each failed call fails every shard of its batch, the error is reported once each
        errors = [e for e in info.value.exceptions if isinstance(e, TierBrokenError)]
        # (a batch's call fails each of its shards: one error per failed call and retry)
        assert 0 < len(errors) <= tier.calls["put_shards"] // 2
        engine = ckpt._core.engine
        await asyncio.wait_for(asyncio.wrap_future(engine.loop.submit(engine.drain())), 10)
        arena = engine.arena.stats()
        assert arena.held == 0
        assert await tier.steps() == [1]


def aligned(data: bytes) -> memoryview:
    """``data`` in page-aligned memory (as arena blocks are)."""
    size = (len(data) + 4095) // 4096 * 4096
    buf = mmap.mmap(-1, size)
    buf[: len(data)] = data
    return memoryview(buf)[: len(data)]


@pytest.mark.parametrize("direct", [False, True])
def test_pwrite_many_writes_runs_and_gaps_and_survives_short_writes(
    tmp_path: Path, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = torch.Generator().manual_seed(0)
    pieces = [torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).numpy().tobytes()
              for n in (8192, 4096, 12288, 4096, 5000)]
    # three adjacent, a hole, then two adjacent, the last of unaligned length (a stream's
    # tail: O_DIRECT takes it through the bounce buffer, alone)
    offsets = [0, 8192, 12288, 32768, 36864]
    views = [aligned(p) for p in pieces]
    flags = os.O_RDWR | os.O_CREAT
    if direct:
        if not hasattr(os, "O_DIRECT"):
            pytest.skip("no O_DIRECT on this OS")
        flags |= os.O_DIRECT
    real = os.pwritev
    short: list[int] = []

    def pwritev(fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        n = real(fd, bufs, offset)
        cut = min(n, 4096)  # a short write: the rest must follow
        short.append(cut)
        return cut

    monkeypatch.setattr(os, "pwritev", pwritev)
    try:
        fd = os.open(tmp_path / "data", flags, 0o644)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    try:
        _file_io.pwrite_many(fd, direct, views, offsets)
    finally:
        os.close(fd)
    assert short, "adjacent aligned buffers go through pwritev"
    found = (tmp_path / "data").read_bytes()
    for piece, at in zip(pieces, offsets, strict=True):
        assert found[at : at + len(piece)] == piece
    assert found[24576:32768] == bytes(8192)  # the hole stays a hole


async def test_a_batch_call_has_the_deadline_of_its_shards_together() -> None:
    from types import SimpleNamespace

    from lazyckpt import DeadlineExceededError
    from lazyckpt._tiering.calls import call_tier

    policy = SimpleNamespace(deadline=0.1, retries=0, retry_backoff=0.001)

    async def slow() -> str:
        await asyncio.sleep(0.25)
        return "stored"

    assert await call_tier("file", "put shards 1, 2, 3, 4", slow, policy, scale=4) == "stored"
    with pytest.raises(DeadlineExceededError, match="put shard 1"):
        await call_tier("file", "put shard 1", slow, policy)
