"""The one read path: a shard's verified bytes from the first tier with a good copy."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import lazyckpt
from lazyckpt import CorruptionError, Manifest, SnapshotNotFoundError, Tier
from lazyckpt._restore.fetch import find_step, latest_step, lend_verified, read_verified
from lazyckpt.testing import FaultyTier, build_snapshot
from lazyckpt.tier import SupportsChecksummedRead
from tiers import FileTier, HostMemoryTier

STATE = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7)}


async def _write(tier: Tier, manifest: Manifest, payloads: list[bytes], *, flip: int | None = None) -> None:
    """Commit ``manifest`` on ``tier``, the shard ``flip`` with one byte changed."""
    await tier.begin(manifest)
    for shard, data in zip(manifest.shards, payloads, strict=True):
        body = bytearray(data)
        if shard.index == flip:
            body[0] ^= 0xFF
        await tier.put_shard(manifest, shard, memoryview(body))
    await tier.commit(manifest)


async def test_the_first_good_copy_wins_and_every_bad_one_is_named(tmp_path: Path) -> None:
    manifest, payloads = build_snapshot(3, STATE)
    bad = FileTier(tmp_path / "bad", name="bad")
    down = FaultyTier(FileTier(tmp_path / "down", name="down"))
    good = FileTier(tmp_path / "good", name="good")
    for tier in (bad, down, good):
        await tier.open()
    try:
        await _write(bad, manifest, payloads, flip=0)
        await _write(down, manifest, payloads)
        await _write(good, manifest, payloads)
        down.break_("read_shard")
        shard = manifest.shards[0]
        out = bytearray(shard.length)
        problems: list[Exception] = []
        source = await read_verified(manifest, shard, [bad, down, good], memoryview(out), problems=problems)
        assert source is good
        assert bytes(out) == payloads[0]
        assert len(problems) == 2
        assert "fails its checksum" in str(problems[0]) and "'bad'" in str(problems[0])
        assert isinstance(problems[1], lazyckpt.TierError) and problems[1].tier == "down"
        # no tier left with a good copy: one error naming the shard, its keys and every tier
        with pytest.raises(CorruptionError, match=r"no tier holds a good copy of shard 0") as info:
            await read_verified(manifest, shard, [bad, down], memoryview(out))
        assert "'w'" in str(info.value) and "['bad', 'down']" in str(info.value)
    finally:
        for tier in (bad, down, good):
            await tier.aclose()


async def test_a_lent_block_goes_back_after_the_read_and_after_a_bad_copy(tmp_path: Path) -> None:
    manifest, payloads = build_snapshot(4, STATE)
    host = HostMemoryTier(1 << 20)
    disk = FileTier(tmp_path)
    for tier in (host, disk):
        await tier.open()
    try:
        await _write(host, manifest, payloads)
        await _write(disk, manifest, payloads)
        shard = manifest.shards[0]
        held = host.arena.stats().held
        async with lend_verified(
            manifest, shard, [host, disk], buffer=lambda n: torch.empty(n, dtype=torch.uint8)
        ) as data:
            assert bytes(data.numpy()) == payloads[0]
            assert host.arena.stats().held > held  # lent: held while the block runs
        assert host.arena.stats().held == held
        # the host copy is damaged: its block goes back and the file tier's copy is read
        block = host.borrow_shard(manifest, shard)
        assert block is not None
        block.tensor()[0] ^= 0xFF
        host.return_shard(block)
        problems: list[Exception] = []
        async with lend_verified(
            manifest,
            shard,
            [host, disk],
            buffer=lambda n: torch.empty(n, dtype=torch.uint8),
            problems=problems,
        ) as data:
            assert bytes(data.numpy()) == payloads[0]
        assert host.arena.stats().held == held
        assert len(problems) == 1 and "fails its checksum" in str(problems[0])
    finally:
        for tier in (host, disk):
            await tier.aclose()


async def test_the_latest_step_and_where_it_is(tmp_path: Path) -> None:
    a, b = FileTier(tmp_path / "a", name="a"), FileTier(tmp_path / "b", name="b")
    for tier in (a, b):
        await tier.open()
    try:
        with pytest.raises(SnapshotNotFoundError, match="no committed snapshot on any tier"):
            await find_step([a, b], None)
        for step, tiers in ((1, [a, b]), (2, [b])):
            manifest, payloads = build_snapshot(step, STATE)
            for tier in tiers:
                await _write(tier, manifest, payloads)
        assert await find_step([a, b], None) == (2, [b])
        assert await find_step([a, b], 1) == (1, [a, b])
        with pytest.raises(SnapshotNotFoundError, match="step 7 is not committed"):
            await find_step([a, b], 7)
    finally:
        for tier in (a, b):
            await tier.aclose()
    assert latest_step([3, 9, 4], "here") == 9
    with pytest.raises(SnapshotNotFoundError, match="no committed snapshot on here"):
        latest_step([], "here")


@pytest.mark.parametrize("fused", [True, False])
def test_restore_and_verify_checksum_on_the_checksum_pool(tmp_path: Path, fused: bool) -> None:
    """A tier that checksums while reading (FileTier) leaves the checksum pool idle; any
    other tier's copies are checksummed on the pool, one call per shard read."""
    weights = torch.randn(20_000)
    tier: Tier = FileTier(tmp_path) if fused else FaultyTier(FileTier(tmp_path))
    assert isinstance(tier, SupportsChecksummedRead) == fused
    with lazyckpt.SyncCheckpointer([tier], shard_size=1 << 14) as ckpt:
        ckpt.snapshot({"w": weights}, step=1).wait()
        pool = ckpt._core.engine.checksums
        calls = 0
        real = pool.checksum_bytes

        async def counting(data: memoryview) -> int:
            nonlocal calls
            calls += 1
            return await real(data)

        pool.checksum_bytes = counting  # type: ignore[method-assign]
        restored = ckpt.restore()
        report = ckpt.verify()
    assert torch.equal(restored["w"], weights)
    assert report.ok and report.shards > 1
    # one checksum per shard read by the restore, one per shard read by verify()
    assert calls == (0 if fused else 2 * report.shards)


def test_the_engine_thread_starts_at_open_and_ends_at_close(tmp_path: Path) -> None:
    def engine_threads() -> int:
        return sum(t.name == "lazyckpt-engine" for t in threading.enumerate())

    before = engine_threads()
    ckpt = lazyckpt.SyncCheckpointer([FileTier(tmp_path)])
    assert engine_threads() == before  # building one starts nothing
    ckpt.open()
    assert engine_threads() == before + 1
    ckpt.close()
    assert engine_threads() == before
    never_opened = lazyckpt.SyncCheckpointer([FileTier(tmp_path / "other")])
    never_opened.close()  # closing one never opened is fine, and leaves no thread behind
    assert engine_threads() == before
