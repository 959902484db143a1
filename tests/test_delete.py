"""``delete(step)``: a committed step goes from every tier; an in-flight one is refused."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

import lazyckpt
from lazyckpt import SnapshotInFlightError, SnapshotNotFoundError
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.gating import hold_captures
from helpers.ranks import launch_ranks, rank_results

SMALL = {"shard_size": 1 << 16, "pack_bytes": 4096}


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((300, 100), float(step))}


async def test_delete_removes_the_step_from_every_tier(tmp_path: Path) -> None:
    host, file = HostMemoryTier(8 << 20), FileTier(tmp_path / "file")
    async with lazyckpt.Checkpointer([host, file], **SMALL) as ckpt:
        for step in range(3):
            await (await ckpt.snapshot(state(step), step=step)).committed()
        assert await host.steps() == [0, 1, 2]
        await ckpt.delete(1)
        assert await host.steps() == [0, 2]
        assert await file.steps() == [0, 2]
        assert await ckpt.steps() == [0, 2]
        assert not (tmp_path / "file" / "step-000000000001").exists()
        with pytest.raises(SnapshotNotFoundError):
            await ckpt.restore(step=1)
        with pytest.raises(SnapshotNotFoundError, match="step 1 is not committed"):
            await ckpt.delete(1)
        assert torch.equal((await ckpt.restore(step=2))["w"], state(2)["w"])
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")]) as fresh:
        assert await fresh.steps() == [0, 2]


async def test_a_step_in_flight_is_refused_then_deletable(tmp_path: Path) -> None:
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(8 << 20), FileTier(tmp_path / "file")], **SMALL
    ) as ckpt:
        gate, release = hold_captures(ckpt)
        handle = await ckpt.snapshot(state(4), step=4)
        with pytest.raises(SnapshotInFlightError, match=r"step 4.*in flight"):
            await ckpt.delete(4)
        gate.set()
        release()
        await handle.committed()
        await ckpt.delete(4)
        assert await ckpt.steps() == []


async def test_deleting_the_newest_step_allows_a_rollback(tmp_path: Path) -> None:
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(8 << 20), FileTier(tmp_path / "file")], **SMALL
    ) as ckpt:
        for step in (1, 2, 3):
            await (await ckpt.snapshot(state(step), step=step)).committed()
        with pytest.raises(lazyckpt.ConfigurationError, match="not newer"):
            await ckpt.snapshot(state(3), step=3)
        await ckpt.delete(3)
        await ckpt.delete(2)
        await (await ckpt.snapshot(state(20), step=2)).committed()
        assert await ckpt.steps() == [1, 2]
        assert torch.equal((await ckpt.restore())["w"], state(20)["w"])


async def test_delete_racing_a_retention_pass_on_the_same_step(tmp_path: Path) -> None:
    # retention (keep_last=1) deletes step 0 once step 1 commits; the user deletes step 0
    # at the same moment: one of them deletes it, neither fails
    slow = FaultyTier(FileTier(tmp_path / "file", keep_last=1))
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), slow], **SMALL) as ckpt:
        await (await ckpt.snapshot(state(0), step=0)).committed()
        slow.delay_s = 0.05  # every tier call (listing, deleting) takes a while now
        await (await ckpt.snapshot(state(1), step=1)).committed()
        await ckpt.delete(0)
        await (await ckpt.snapshot(state(2), step=2)).committed()
        await ckpt.delete(2)
        assert not {0, 2} & set(await ckpt.steps())
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")]) as fresh:
        assert 0 not in await fresh.steps() and 2 not in await fresh.steps()


async def test_a_tier_that_cannot_delete_is_reported_and_the_others_still_delete(
    tmp_path: Path,
) -> None:
    faulty = FaultyTier(FileTier(tmp_path / "file"))
    host = HostMemoryTier(8 << 20)
    async with lazyckpt.Checkpointer([host, faulty], retries=0, **SMALL) as ckpt:
        await (await ckpt.snapshot(state(0), step=0)).committed()
        faulty.break_("delete")
        with pytest.raises(lazyckpt.TierBrokenError, match="'file'"):
            await ckpt.delete(0)
        assert await host.steps() == []
        assert await faulty.steps() == [0]
        faulty.heal()
        await ckpt.delete(0)
        assert await ckpt.steps() == []


def test_sync_delete(tmp_path: Path) -> None:
    with lazyckpt.SyncCheckpointer(
        [HostMemoryTier(8 << 20), FileTier(tmp_path / "file")], **SMALL
    ) as ckpt:
        for step in range(2):
            ckpt.snapshot(state(step), step=step).wait()
        ckpt.delete(0)
        assert ckpt.steps() == [1]
        with pytest.raises(lazyckpt.ConfigurationError, match="non-negative"):
            ckpt.delete(-1)


def test_delete_on_two_ranks(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    worker = Path(__file__).parent / "helpers" / "dist_worker.py"
    assert launch_ranks(worker, ["delete", str(root), str(out)], 2) == [0, 0]
    for r in rank_results(out).values():
        assert r["errors"] == []
        assert r["in_flight_refused"]
        assert r["steps"] == [0, 2, 3]
        assert r["restored_step"] == 3 and r["restored_ok"]
    assert not (root / "step-000000000001").exists()
    assert (root / "step-000000000003" / "manifest.json").exists()


async def test_delete_lets_the_event_loop_run(tmp_path: Path) -> None:
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(8 << 20), FileTier(tmp_path / "file")], **SMALL
    ) as ckpt:
        await (await ckpt.snapshot(state(0), step=0)).committed()
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await ckpt.delete(0)
        ticker.cancel()
        assert ticks > 0
