"""A slow or hung tier behind the host tier: training waits for captures only.

The tiers here are slowed with the fault kit's gates (``hang`` until ``heal``), so each test
can look at the pipeline while a tier call is still blocked, instead of timing it.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import Manifest, ShardMeta, SnapshotSkippedWarning
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier, ZarrTier

SMALL: dict[str, Any] = {"shard_size": 1 << 16, "pack_bytes": 4096, "retry_backoff": 0.001}
SNAPSHOT = 256 << 10  # what state() holds: four shards of SMALL


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 256, generator=g), "step": step}


class CountingTier(FaultyTier):
    """A fault tier that also counts the ``begin`` and ``put_shard`` calls that returned."""

    def __init__(self, inner: lazyckpt.Tier) -> None:
        super().__init__(inner)
        self.finished: Counter[str] = Counter()

    async def begin(self, manifest: Manifest) -> None:
        await super().begin(manifest)
        self.finished["begin"] += 1

    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        await super().put_shard(manifest, shard, data)
        self.finished["put_shard"] += 1


def chain(root: Path, where: str) -> tuple[list[lazyckpt.Tier], CountingTier]:
    """Host, file[, zarr]: the tier under test right behind the host tier or third."""
    if where == "second":
        slow = CountingTier(FileTier(root / "f"))
        return [HostMemoryTier(8 << 20), slow], slow
    slow = CountingTier(ZarrTier(root / "z"))
    return [HostMemoryTier(8 << 20), FileTier(root / "f"), slow], slow


async def listed(tier: lazyckpt.Tier) -> list[int]:
    """The steps committed on a closed tier's location, read by a fresh Checkpointer."""
    async with lazyckpt.Checkpointer([tier]) as fresh:
        return await fresh.steps()


@pytest.mark.parametrize("where", ["second", "third"])
async def test_captured_does_not_wait_for_a_hung_begin(tmp_path: Path, where: str) -> None:
    tiers, slow = chain(tmp_path, where)
    slow.hang("begin")
    async with lazyckpt.Checkpointer(tiers, deadline=None, **SMALL) as ckpt:
        handles = []
        try:
            for step in range(3):
                handle = await ckpt.snapshot(state(step), step=step)
                await asyncio.wait_for(handle.captured(), 30)
                handles.append(handle)
            # every snapshot is captured while every begin on the slow tier is still blocked
            assert slow.calls["begin"] == 3 and slow.finished["begin"] == 0
            assert slow.calls["put_shard"] == 0
            assert [h.state() for h in handles] == ["captured"] * 3
        finally:
            slow.heal()  # the tier was only slow: everything goes through now
        for handle in handles:
            await handle.committed()
    again = FileTier(tmp_path / "f") if where == "second" else ZarrTier(tmp_path / "z")
    assert await listed(again) == [0, 1, 2]


def test_the_guard_never_waits_for_a_hung_tier(tmp_path: Path) -> None:
    tiers, slow = chain(tmp_path, "third")
    slow.hang("begin")
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    iterations = 4
    returned: list[tuple[int, int]] = []  # per guarded step: (begins called, begins returned)
    errors: list[BaseException] = []
    with lazyckpt.SyncCheckpointer(tiers, deadline=None, **SMALL) as ckpt:
        ckpt.guard(opt)

        def train() -> None:
            try:
                for step in range(iterations):
                    model(torch.randn(8, 64)).sum().backward()
                    opt.step()  # the guard: waits for the previous snapshot's capture
                    returned.append((slow.calls["begin"], slow.finished["begin"]))
                    ckpt.snapshot({"model": model, "optim": opt}, step=step)
                ckpt.wait_captured()
            except BaseException as exc:  # pragma: no cover - shown below
                errors.append(exc)

        trainer = threading.Thread(target=train)
        trainer.start()
        trainer.join(60)
        stalled = trainer.is_alive()
        slow.heal()
        trainer.join()
        assert not stalled and not errors
        assert returned == [(step, 0) for step in range(iterations)]
        assert slow.calls["begin"] == iterations and slow.finished["begin"] == 0
    assert slow.finished["begin"] == iterations  # and the tier got them all in the end


async def test_a_slow_tier_adds_nothing_to_captured(tmp_path: Path) -> None:
    tiers, slow = chain(tmp_path, "second")
    slow.delay_s = 0.25  # every call: begin, each put, commit
    async with lazyckpt.Checkpointer(tiers, **SMALL) as ckpt:
        seen = []
        for step in range(3):
            handle = await ckpt.snapshot(state(step), step=step)
            await handle.captured()
            seen.append((slow.calls["begin"], slow.finished["begin"]))
        assert [begun for begun, _ in seen] == [1, 2, 3]
        # each capture finished long before the begin of its own snapshot returned
        assert all(done < begun for begun, done in seen)
    assert await listed(FileTier(tmp_path / "f")) == [0, 1, 2]


async def test_a_hung_tier_behind_a_healthy_one_holds_no_arena_space(tmp_path: Path) -> None:
    # room for about three snapshots; the hung tier is fed the shards four at a time
    # (io_concurrency): the others wait for their turn without holding a block
    tiers, slow = chain(tmp_path, "third")
    tiers[0] = HostMemoryTier(3 * SNAPSHOT + (64 << 10))
    slow.hang("put_shard")
    snapshots = 8
    async with lazyckpt.Checkpointer(tiers, deadline=None, **SMALL) as ckpt:
        handles = []
        try:
            for step in range(snapshots):
                handle = await ckpt.snapshot(state(step), step=step)
                await asyncio.wait_for(handle.captured(), 30)
                await asyncio.wait_for(handle.reached(tiers[1].name), 30)
                handles.append(handle)
            assert slow.finished["put_shard"] == 0
            assert ckpt.metrics()["arena"]["peak"] <= 3 * SNAPSHOT + (64 << 10)
        finally:
            slow.heal()
        for handle in handles:
            await handle.committed()  # evicted shards are read back from the file tier
    assert await listed(ZarrTier(tmp_path / "z")) == list(range(snapshots))
    async with lazyckpt.Checkpointer([ZarrTier(tmp_path / "z")]) as fresh:
        for step in (0, snapshots - 1):
            assert torch.equal((await fresh.restore(step=step))["w"], state(step)["w"])


async def test_skip_skips_nothing_while_the_arena_has_room(tmp_path: Path) -> None:
    tiers, slow = chain(tmp_path, "second")
    slow.hang("begin")
    async with lazyckpt.Checkpointer(tiers, when_busy="skip", deadline=None, **SMALL) as ckpt:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", SnapshotSkippedWarning)
                handles = []
                for step in range(4):
                    handle = await ckpt.snapshot(state(step), step=step)
                    await asyncio.wait_for(handle.captured(), 30)
                    handles.append(handle)
            assert not any(h.skipped for h in handles)
            assert slow.finished["begin"] == 0
        finally:
            slow.heal()
        for handle in handles:
            await handle.committed()
        assert ckpt.metrics()["snapshots_skipped"] == 0


@pytest.mark.parametrize("mode", ["wait", "skip"])
async def test_a_full_arena_waits_or_skips_at_once(tmp_path: Path, mode: Any) -> None:
    # room for one snapshot: the first holds the arena until the hung tier takes it
    faulty = CountingTier(FileTier(tmp_path / "f"))
    tiers = [HostMemoryTier(SNAPSHOT + (64 << 10)), faulty]
    faulty.hang("begin")
    async with lazyckpt.Checkpointer(tiers, when_busy=mode, deadline=None, **SMALL) as ckpt:
        try:
            first = await ckpt.snapshot(state(1), step=1)
            await asyncio.wait_for(first.captured(), 30)
            if mode == "skip":
                with pytest.warns(SnapshotSkippedWarning, match="step 2 skipped"):
                    second = await ckpt.snapshot(state(2), step=2)
                assert second.skipped
            else:
                # backpressure: `await snapshot()` itself waits (cooperatively) for room
                asking = asyncio.ensure_future(ckpt.snapshot(state(2), step=2))
                done, _ = await asyncio.wait({asking}, timeout=0.3)
                assert not done
        finally:
            faulty.heal()
        await first.committed()
        if mode == "wait":
            second = await asking
            await second.captured()
            await second.committed()
    assert await listed(FileTier(tmp_path / "f")) == ([1] if mode == "skip" else [1, 2])



async def test_a_snapshot_held_up_by_a_tier_does_not_keep_the_tensors_alive(tmp_path: Path) -> None:
    tiers, slow = chain(tmp_path, "second")
    slow.hang("put_shard")
    async with lazyckpt.Checkpointer(tiers, deadline=None, **SMALL) as ckpt:
        try:
            tensor = torch.randn(256, 256)
            gone = weakref.ref(tensor)
            handle = await ckpt.snapshot({"w": tensor}, step=1)
            await asyncio.wait_for(handle.captured(), 30)
            del tensor
            gc.collect()
            assert gone() is None  # the training may drop or replace it: the copy is enough
        finally:
            slow.heal()
        await handle.committed()
