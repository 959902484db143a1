"""Storage that misbehaves: full, flaky, broken, hung, slow; busy pipelines; retention."""

from __future__ import annotations

import asyncio
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import (
    DeadlineExceededError,
    SnapshotFailedError,
    SnapshotSkippedError,
    SnapshotSkippedWarning,
    TierBrokenError,
    TierFullError,
    UnsupportedStateError,
)
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.gating import hold_captures

SMALL: dict[str, Any] = {"shard_size": 1 << 16, "pack_bytes": 4096, "retry_backoff": 0.001}


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 256, generator=g), "step": step}


async def test_full_device_fails_that_snapshot_only(tmp_path: Path) -> None:
    faulty = FaultyTier(FileTier(tmp_path / "f"))
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), faulty], **SMALL) as ckpt:
        await (await ckpt.snapshot(state(1), step=1)).committed()
        faulty.capacity_bytes = faulty.bytes_written + (100 << 10)  # room for less than one
        handle = await ckpt.snapshot(state(2), step=2)
        await handle.captured()  # training is not held up
        with pytest.raises(SnapshotFailedError) as info:
            await handle.committed()
        assert info.group_contains(TierFullError)
        assert faulty.calls["put_shard"] < 20  # a full device is not retried forever
        faulty.capacity_bytes = None  # space is back
        await (await ckpt.snapshot(state(3), step=3)).committed()
        assert await faulty.steps() == [1, 3]
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "f")]) as fresh:
        for step in (1, 3):
            assert torch.equal((await fresh.restore(step=step))["w"], state(step)["w"])
        assert not (tmp_path / "f" / "step-000000000002").exists()  # partial data removed


async def test_transient_errors_are_retried(tmp_path: Path) -> None:
    faulty = FaultyTier(FileTier(tmp_path / "f"))
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), faulty], retries=3, **SMALL) as ckpt:
        faulty.fail_next("put_shard", 2)
        faulty.fail_next("commit", 1)
        await (await ckpt.snapshot(state(1), step=1)).committed()
    assert faulty.calls["commit"] == 2


async def test_retries_run_out_then_the_error_is_reported(tmp_path: Path) -> None:
    faulty = FaultyTier(FileTier(tmp_path / "f"))
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), faulty], retries=1, **SMALL) as ckpt:
        faulty.fail_next("commit", 2)
        handle = await ckpt.snapshot(state(1), step=1)
        with pytest.raises(SnapshotFailedError) as info:
            await handle.committed()
        assert info.group_contains(TierBrokenError)
        assert await ckpt.steps() == []  # a failed snapshot is not listed, not even from memory
        assert await faulty.steps() == []


async def test_unseen_failure_is_raised_by_aclose(tmp_path: Path) -> None:
    faulty = FaultyTier(FileTier(tmp_path / "f"))
    with pytest.raises(SnapshotFailedError):
        async with lazyckpt.Checkpointer(
            [HostMemoryTier(8 << 20), faulty], retries=0, on_failure="raise", **SMALL
        ) as ckpt:
            faulty.break_("put_shard")
            await ckpt.snapshot(state(1), step=1)


async def test_a_hung_tier_does_not_hang_training_or_close(tmp_path: Path) -> None:
    faulty = FaultyTier(FileTier(tmp_path / "f"))
    faulty.hang("put_shard")
    errors: list[BaseException] = []
    try:
        async with lazyckpt.Checkpointer(
            [HostMemoryTier(8 << 20), faulty], deadline=0.2, retries=1, **SMALL
        ) as ckpt:
            handle = await ckpt.snapshot(state(1), step=1)
            await asyncio.wait_for(handle.captured(), 30)
            with pytest.raises(SnapshotFailedError) as info:
                await asyncio.wait_for(handle.committed(), 30)
            assert info.group_contains(DeadlineExceededError)
            faulty.heal()
    except BaseException as exc:  # pragma: no cover - shown if close hangs or raises
        errors.append(exc)
    assert not errors


async def test_when_busy_skip_drops_and_counts(tmp_path: Path) -> None:
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(8 << 20), FileTier(tmp_path / "f")], when_busy="skip", **SMALL
    ) as ckpt:
        gate, _release = hold_captures(ckpt)
        first = await ckpt.snapshot(state(1), step=1)
        with pytest.warns(SnapshotSkippedWarning, match="step 2 skipped") as caught:
            second = await ckpt.snapshot(state(2), step=2)
        assert second.skipped and second.state() == "skipped"
        with pytest.raises(SnapshotSkippedError):
            await second.committed()
        gate.set()
        await first.committed()
        assert ckpt.metrics()["snapshots_skipped"] == 1
        # the warning points at the line that called snapshot(), not into lazyckpt
        assert [w.filename for w in caught] == [__file__]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            await (await ckpt.snapshot(state(3), step=3)).committed()  # not busy: not skipped


async def test_when_busy_skip_when_the_arena_is_held_by_a_slow_tier(tmp_path: Path) -> None:
    faulty = FaultyTier(FileTier(tmp_path / "f"))
    capacity = 384 << 10  # room for one snapshot of 256 KiB, not two
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(capacity), faulty], when_busy="skip", **SMALL
    ) as ckpt:
        faulty.hang("put_shard")
        first = await ckpt.snapshot(state(1), step=1)
        await first.captured()  # captured, but stuck on its way to the file tier
        with pytest.warns(SnapshotSkippedWarning, match="busy"):
            second = await ckpt.snapshot(state(2), step=2)
        assert second.skipped
        faulty.heal()
        await first.committed()
        await (await ckpt.snapshot(state(3), step=3)).committed()
        assert await faulty.steps() == [1, 3]


async def test_when_busy_wait_bounds_memory_under_a_slow_tier(tmp_path: Path) -> None:
    faulty = FaultyTier(FileTier(tmp_path / "f"))
    faulty.delay_s = 0.02
    capacity = 192 << 10  # three shards; each snapshot has four
    async with lazyckpt.Checkpointer([HostMemoryTier(capacity), faulty], **SMALL) as ckpt:
        for step in range(6):
            await ckpt.snapshot(state(step), step=step)
            await ckpt.wait_captured()
        metrics = ckpt.metrics()
    assert metrics["arena"]["peak"] <= capacity
    assert metrics["arena"]["waits"] > 0


async def test_retention_keep_last_and_keep_every(tmp_path: Path) -> None:
    tier = FileTier(tmp_path / "f", keep_last=2, keep_every=5)
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), tier], **SMALL) as ckpt:
        for step in range(12):
            await (await ckpt.snapshot({"x": torch.full((4,), float(step))}, step=step)).committed()
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "f")]) as fresh:
        assert await fresh.steps() == [0, 5, 10, 11]


class SlowListingTier(FileTier):
    """Lists steps slowly (as a loaded store does) and records the deletes it serves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deleting: set[int] = set()
        self.overlaps = 0
        self.deleted: list[int] = []

    async def steps(self) -> list[int]:
        found = await super().steps()
        await asyncio.sleep(0.05)
        return found

    async def delete(self, step: int) -> None:
        self.overlaps += bool(self.deleting)
        self.deleting.add(step)
        try:
            await asyncio.sleep(0.02)
            await super().delete(step)
            self.deleted.append(step)
        finally:
            self.deleting.discard(step)


async def test_retention_passes_never_overlap_or_delete_a_step_twice(tmp_path: Path) -> None:
    # commits come faster than a retention pass lists the steps: the passes must queue up
    # (one at a time per tier), coalesce, and still leave only the newest steps
    tier = SlowListingTier(tmp_path / "f", keep_last=1)
    options = {**SMALL, "retries": 0}
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), tier], **options) as ckpt:
        for step in range(8):
            await (await ckpt.snapshot({"x": torch.full((4,), float(step))}, step=step)).committed()
    assert tier.overlaps == 0
    assert sorted(tier.deleted) == sorted(set(tier.deleted)) == list(range(7))
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "f")]) as fresh:
        assert await fresh.steps() == [7]


def test_retention_policy_never_deletes_the_newest() -> None:
    policy = lazyckpt.Retention(keep_last=1, keep_every=100)
    assert policy.to_delete([3, 7, 200, 9]) == [3, 7, 9]
    assert lazyckpt.Retention().to_delete([1, 2]) == []


async def test_state_changed_while_being_walked(tmp_path: Path) -> None:
    class Shifty(dict[str, Any]):
        def items(self) -> Any:
            for k, v in super().items():
                self[k + "x"] = v  # another thread mutating it while snapshot() walks it
                yield k, v

    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), FileTier(tmp_path / "f")], **SMALL) as ckpt:
        with pytest.raises(UnsupportedStateError, match="changed while"):
            await ckpt.snapshot({"s": Shifty(a=torch.zeros(2), b=torch.zeros(3))}, step=1)
        await (await ckpt.snapshot({"ok": torch.zeros(2)}, step=2)).committed()
        assert await ckpt.steps() == [2]


async def test_many_keys(tmp_path: Path) -> None:
    state = {f"p{i}": torch.full((3,), float(i)) for i in range(20_000)}
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), FileTier(tmp_path / "f")]) as ckpt:
        handle = await ckpt.snapshot(state, step=1)
        await handle.committed()
        assert handle.stats is not None and handle.stats.shards == 1  # packed: one shard
        restored = await ckpt.restore()
    assert torch.equal(restored["p19999"], state["p19999"])
