"""A chain of one HostMemoryTier: "committed" means kept in memory, whole."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import Manifest, SnapshotFailedError, TierFullError
from tiers import HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.gating import hold_captures

SMALL: dict[str, Any] = {"shard_size": 1 << 16, "pack_bytes": 4096}
SNAPSHOT = 256 << 10  # what state() holds: four shards of SMALL


def state(step: int, rows: int = 256) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(rows, 256, generator=g), "step": step}


class RecordingHost(HostMemoryTier):
    """Records the steps whose commit the host tier accepted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accepted: list[int] = []

    async def commit(self, manifest: Manifest) -> None:
        await super().commit(manifest)
        self.accepted.append(manifest.step)


async def test_a_snapshot_larger_than_the_arena_fails_and_keeps_the_last_commit() -> None:
    capacity = 3 * SNAPSHOT
    async with lazyckpt.Checkpointer([HostMemoryTier(capacity)], **SMALL) as ckpt:
        await (await ckpt.snapshot(state(1), step=1)).committed()
        big = await ckpt.snapshot(state(2, rows=1024), step=2)  # 1 MiB
        with pytest.raises(SnapshotFailedError) as info:
            await big.committed()
        assert info.group_contains(TierFullError, match=f"needs {4 * SNAPSHOT} bytes")
        assert info.group_contains(TierFullError, match=f"holds {capacity} bytes")
        assert big.state() == "failed"
        assert await ckpt.steps() == [1]
        restored = await ckpt.restore(step=1)
        assert torch.equal(restored["w"], state(1)["w"])
        assert ckpt.metrics()["arena"]["evictions"] == 0
        # and the chain goes on
        await (await ckpt.snapshot(state(3), step=3)).committed()
        assert await ckpt.steps() == [1, 3]


def test_the_sync_handle_raises_too() -> None:
    with lazyckpt.SyncCheckpointer([HostMemoryTier(SNAPSHOT)], **SMALL) as ckpt:
        handle = ckpt.snapshot(state(1, rows=512), step=1)
        with pytest.raises(SnapshotFailedError) as info:
            handle.wait("committed", timeout=30)
        assert info.group_contains(TierFullError, match="only tier")
        assert ckpt.steps() == []


async def test_committed_means_kept_while_snapshots_overlap() -> None:
    # room for two and a half snapshots; six are asked for before any capture finishes, so
    # they compete for the arena: each one that says committed was kept whole when it did,
    # and the newest that fit stay. (`await snapshot()` waits, cooperatively, for the
    # earlier captures and for room: the six are asked for by six tasks.)
    host = RecordingHost(2 * SNAPSHOT + (128 << 10))
    async with lazyckpt.Checkpointer([host], **SMALL) as ckpt:
        gate, restore = hold_captures(ckpt)
        asking = [asyncio.create_task(ckpt.snapshot(state(step), step=step)) for step in range(6)]
        await asyncio.sleep(0.05)
        gate.set()
        restore()
        handles = await asyncio.gather(*asking)
        for handle in handles:
            await handle.committed()
        assert sorted(host.accepted) == list(range(6))
        kept = await ckpt.steps()
        assert kept == [4, 5]
        for step in kept:
            assert torch.equal((await ckpt.restore(step=step))["w"], state(step)["w"])
        assert ckpt.metrics()["arena"]["peak"] <= host.arena.capacity


async def test_retention_on_a_host_only_chain_keeps_the_newest() -> None:
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20, keep_last=2)], **SMALL) as ckpt:
        for step in range(5):
            await (await ckpt.snapshot(state(step), step=step)).committed()
        assert await ckpt.steps() == [3, 4]
