"""The checksum stage: after the capture, off the guard's path, before any tier.

A shard counts as captured once its bytes are in its host block; its crc32c is computed
afterwards from that block. These tests hold the checksum stage back (or break it) and check
what a user sees: the guard and ``captured()`` do not wait for it, a tensor changed meanwhile
does not reach the snapshot, no tier gets a shard or a manifest without its checksum, and a
failing checksum fails the snapshot cleanly.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import lazyckpt
from lazyckpt import ConfigurationError, ShardState, SnapshotFailedError
from lazyckpt._capture.cpu import ChecksumPool, block_checksum
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.gating import hold_checksums

SMALL: dict[str, Any] = {"shard_size": 1 << 16, "pack_bytes": 4096, "retry_backoff": 0.001}


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 256, generator=g), "b": torch.randn(100, generator=g)}


async def test_captured_and_the_guard_resolve_before_the_checksums(tmp_path: Path) -> None:
    file_tier = FaultyTier(FileTier(tmp_path / "f"))
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), file_tier], **SMALL) as ckpt:
        held = hold_checksums(ckpt)
        handle = await ckpt.snapshot(state(1), step=1)
        await asyncio.wait_for(handle.captured(), 10)
        await asyncio.wait_for(ckpt.wait_captured(), 10)  # what the guard waits for
        assert handle.state() == "captured"
        assert held.done == 0 and held.started >= 1
        engine = ckpt._core.engine
        flight = engine.flights[1]
        assert ShardState.COPIED in flight.states
        assert ShardState.ON_HOST not in flight.states
        assert engine.metrics()["shards_in_flight"].get("COPIED", 0) >= 1
        # no tier has seen a shard or a manifest yet
        assert file_tier.calls["put_shard"] == 0 and file_tier.calls["commit"] == 0
        assert await ckpt.steps() == []
        held.gate.set()
        await asyncio.wait_for(handle.committed(), 10)
        assert held.done == len(flight.manifest.shards)
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "f")]) as fresh:
        restored = await fresh.restore(step=1)
    assert torch.equal(restored["w"], state(1)["w"])


def test_the_optimizer_step_goes_on_while_the_checksums_wait() -> None:
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with lazyckpt.SyncCheckpointer([HostMemoryTier(8 << 20)], **SMALL) as ckpt:
        held = hold_checksums(ckpt)
        ckpt.guard(opt)
        model(torch.randn(4, 64)).sum().backward()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        handle = ckpt.snapshot({"model": model}, step=1)
        handle.wait("captured", timeout=10)
        done = threading.Event()

        def step() -> None:
            opt.step()  # the guard's pre-hook runs here
            done.set()

        stepper = threading.Thread(target=step)
        stepper.start()
        assert done.wait(10), "the guard waited for the checksums"
        stepper.join()
        assert held.done == 0
        held.gate.set()
        handle.wait("committed", timeout=10)
        restored = ckpt.restore(step=1)
    for key, value in expected.items():
        assert torch.equal(restored["model"][key], value), key
    assert not torch.equal(model.weight.detach(), expected["weight"])


async def test_a_tensor_changed_after_captured_does_not_reach_the_snapshot(
    tmp_path: Path,
) -> None:
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(8 << 20), FileTier(tmp_path / "f")], **SMALL
    ) as ckpt:
        held = hold_checksums(ckpt)
        live = state(1)
        before = {k: v.clone() for k, v in live.items()}
        handle = await ckpt.snapshot(live, step=1)
        await asyncio.wait_for(handle.captured(), 10)
        for t in live.values():
            t.mul_(-3).add_(7)  # the optimizer step, before any checksum is done
        assert held.done == 0
        held.gate.set()
        await asyncio.wait_for(handle.committed(), 10)  # no ImmutabilityViolationError
        manifest = await ckpt.tiers[1].read_manifest(1)
        from_host = await ckpt.restore(step=1)  # verifies every shard's checksum
    assert all(s.crc32c is not None for s in manifest.shards)
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "f")]) as fresh:
        from_file = await fresh.restore(step=1)
        report = await fresh.verify(step=1)
    for key, value in before.items():
        assert torch.equal(from_host[key], value), key
        assert torch.equal(from_file[key], value), key
        assert not torch.equal(live[key], value)
    assert report.ok


@pytest.mark.parametrize("with_file", [False, True])
async def test_a_failing_checksum_fails_the_snapshot_and_leaks_no_block(
    tmp_path: Path, with_file: bool
) -> None:
    tiers: list[Any] = [HostMemoryTier(8 << 20)]
    if with_file:
        tiers.append(FaultyTier(FileTier(tmp_path / "f")))
    async with lazyckpt.Checkpointer(tiers, **SMALL) as ckpt:
        held = hold_checksums(ckpt, fail_at=2)
        handle = await ckpt.snapshot(state(1), step=1)
        await asyncio.wait_for(handle.captured(), 10)  # every shard was copied
        held.gate.set()
        with pytest.raises(SnapshotFailedError) as info:
            await asyncio.wait_for(handle.committed(), 10)
        assert info.group_contains(OSError, match="checksum thread lost")
        assert handle.state() == "failed"
        engine = ckpt._core.engine
        await asyncio.wait_for(asyncio.wrap_future(engine.loop.submit(engine.drain())), 10)
        arena = engine.arena.stats()
        assert (arena.held, arena.evictable) == (0, 0)
        assert await ckpt.steps() == []
        if with_file:
            assert tiers[1].calls["commit"] == 0
            assert await tiers[1].steps() == []
        # the next snapshot is whole again
        engine.checksums = held.real
        await (await ckpt.snapshot(state(2), step=2)).committed()
        assert await ckpt.steps() == [2]
        assert torch.equal((await ckpt.restore(step=2))["w"], state(2)["w"])


async def test_a_failing_checksum_is_reported_by_the_next_snapshot() -> None:
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(8 << 20)], on_failure="raise", **SMALL
    ) as ckpt:
        held = hold_checksums(ckpt, fail_at=1)
        await ckpt.snapshot(state(1), step=1)
        held.gate.set()
        await asyncio.wait_for(
            asyncio.wrap_future(ckpt._core.engine.loop.submit(ckpt._core.engine.drain())), 10
        )
        with pytest.raises(SnapshotFailedError, match="step 1"):
            await ckpt.snapshot(state(2), step=2)


async def test_checksum_pool_checksums_a_block() -> None:
    arena = lazyckpt.HostArena(1 << 20, pinned=False)
    arena.allocate_memory()
    block = arena.try_allocate(12345)
    assert block is not None
    block.tensor().copy_(torch.randint(0, 256, (12345,), dtype=torch.uint8))
    pool = ChecksumPool(2)
    try:
        crc = await pool.checksum(block)
    finally:
        pool.close()
    assert crc == block_checksum(block) == crc32c.crc32c(bytes(block.memoryview()))
    with pytest.raises(ConfigurationError):
        ChecksumPool(0)
    with pytest.raises(ConfigurationError):
        ChecksumPool(1, niceness=-1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
async def test_checksum_threads_run_at_a_lower_priority() -> None:
    import os

    pool = ChecksumPool(1, niceness=5)
    try:
        loop = asyncio.get_running_loop()
        theirs = await loop.run_in_executor(
            pool._pool, lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        )
    finally:
        pool.close()
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert theirs == min(19, ours + 5)


def test_checksum_threads_is_an_option() -> None:
    with lazyckpt.SyncCheckpointer([HostMemoryTier(1 << 20)], checksum_threads=3, **SMALL) as c:
        assert c._core.engine.checksums.threads == 3
        c.snapshot(state(1), step=1).wait()
        assert torch.equal(c.restore()["w"], state(1)["w"])
    with pytest.raises(ConfigurationError, match="checksum_threads"):
        lazyckpt.SyncCheckpointer([HostMemoryTier(1 << 20)], checksum_threads=0)


async def test_an_error_after_the_capture_leaks_no_block(tmp_path: Path) -> None:
    # something fails between a shard's capture and its first tier (here the hook at
    # checksum.done) while other shards still wait for their checksums: the snapshot fails,
    # every block goes back, and the Checkpointer still closes and works
    from lazyckpt import hooks

    def explode(point: str) -> None:
        if point == "checksum.done":
            raise RuntimeError("injected after the checksum")

    ckpt = lazyckpt.Checkpointer([HostMemoryTier(8 << 20), FileTier(tmp_path / "f")], **SMALL)
    await ckpt.open()
    try:
        held = hold_checksums(ckpt)
        hooks.set_hook(explode)
        handle = await ckpt.snapshot(state(1), step=1)
        await handle.captured()
        held.gate.set()
        with pytest.raises(SnapshotFailedError):
            await handle.committed()
        hooks.set_hook(None)
        engine = ckpt._core.engine
        await asyncio.wrap_future(engine.loop.submit(engine.drain()))
        assert engine.arena.stats().held == 0
        await (await ckpt.snapshot(state(2), step=2)).committed()
    finally:
        hooks.set_hook(None)
        await ckpt.aclose()


# -- the batched CPU path: a batch of shards per capture job and per checksum job ------------


def wide_state(step: int) -> dict[str, Any]:
    """Large tensors cut into many 64 KiB shards, and small ones packed with gaps."""
    g = torch.Generator().manual_seed(step)
    out: dict[str, Any] = {f"w{k}": torch.randn(128, 256, generator=g) for k in range(6)}
    out.update({f"b{k}": torch.randn(37 + k, generator=g) for k in range(20)})
    out["ids"] = torch.arange(1000, dtype=torch.int64) * step
    return out


def count_batches(ckpt: lazyckpt.Checkpointer) -> dict[str, list[int]]:
    """Wrap the engine's batch calls, recording how many shards each one carried."""
    engine = ckpt._core.engine
    seen: dict[str, list[int]] = {"capture": [], "checksum": []}
    capture_batch, checksums_many = engine.capture.capture_batch, engine.checksums.checksums_many

    async def counted_capture(jobs: Any) -> None:
        seen["capture"].append(len(jobs))
        await capture_batch(jobs)

    async def counted_checksums(blocks: Any, digests: Any) -> Any:
        seen["checksum"].append(len(blocks))
        return await checksums_many(blocks, digests)

    engine.capture.capture_batch = counted_capture
    engine.checksums.checksums_many = counted_checksums
    return seen


async def test_cpu_shards_are_copied_and_checksummed_by_batches(tmp_path: Path) -> None:
    file_tier = FaultyTier(FileTier(tmp_path / "f"))
    async with lazyckpt.Checkpointer([HostMemoryTier(16 << 20), file_tier], **SMALL) as ckpt:
        seen = count_batches(ckpt)
        handle = await ckpt.snapshot(wide_state(1), step=1)
        await asyncio.wait_for(handle.committed(), 30)
        assert handle.stats is not None
        shards = handle.stats.shards
        assert shards > 8
        # every shard exactly once, in fewer jobs than shards
        assert sum(seen["capture"]) == sum(seen["checksum"]) == shards
        assert len(seen["capture"]) < shards and len(seen["checksum"]) < shards
        assert file_tier.calls["put_shard"] == shards  # the tiers still go shard by shard
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "f")]) as fresh:
        restored = await fresh.restore(step=1)
    for key, value in wide_state(1).items():
        assert torch.equal(restored[key], value), key


async def test_a_failing_batch_checksum_fails_the_snapshot_and_leaks_no_block(
    tmp_path: Path,
) -> None:
    file_tier = FaultyTier(FileTier(tmp_path / "f"))
    async with lazyckpt.Checkpointer([HostMemoryTier(16 << 20), file_tier], **SMALL) as ckpt:
        engine = ckpt._core.engine
        real = engine.checksums.checksums_many

        async def broken(blocks: Any, digests: Any) -> Any:
            raise OSError("checksum thread lost")

        engine.checksums.checksums_many = broken
        handle = await ckpt.snapshot(wide_state(1), step=1)
        with pytest.raises(SnapshotFailedError) as info:
            await asyncio.wait_for(handle.committed(), 30)
        assert info.group_contains(OSError, match="checksum thread lost")
        await asyncio.wait_for(asyncio.wrap_future(engine.loop.submit(engine.drain())), 10)
        arena = engine.arena.stats()
        assert (arena.held, arena.evictable) == (0, 0)
        assert file_tier.calls["put_shard"] == 0 and file_tier.calls["commit"] == 0
        assert await ckpt.steps() == []
        engine.checksums.checksums_many = real  # the next snapshot is whole again
        await asyncio.wait_for((await ckpt.snapshot(wide_state(2), step=2)).committed(), 30)
        assert await ckpt.steps() == [2]


async def test_a_source_changed_before_its_batch_is_copied_fails_the_snapshot(
    tmp_path: Path,
) -> None:
    """The version check follows the copy of the whole batch, as it followed each shard's."""
    async with lazyckpt.Checkpointer([HostMemoryTier(16 << 20)], **SMALL) as ckpt:
        engine = ckpt._core.engine
        capture_batch = engine.capture.capture_batch
        values = wide_state(1)
        values["big"] = torch.randn(512, 1024)  # over eager_bytes: captured lazily

        async def change_then_copy(jobs: Any) -> None:
            values["big"].add_(1.0)  # in place: its version counter moves
            await capture_batch(jobs)

        engine.capture.capture_batch = change_then_copy
        handle = await ckpt.snapshot(values, step=1)
        with pytest.raises(SnapshotFailedError) as info:
            await asyncio.wait_for(handle.committed(), 30)
        assert info.group_contains(lazyckpt.ImmutabilityViolationError)
        await asyncio.wait_for(asyncio.wrap_future(engine.loop.submit(engine.drain())), 10)
        assert engine.arena.stats().held == 0
