"""The conformance checks of what a crash leaves, what delete and retention remove, and
of each optional capability (global commit, rank manifests, block reads, checksummed
reads), part of :class:`~lazyckpt.testing.TierTests`."""

from __future__ import annotations

import ctypes
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import crc32c
import pytest

from .._errors import LazyCkptError, SnapshotNotFoundError
from .._format.manifest import Manifest
from .._tiering.interface import (
    Retention,
    SupportsBatchPut,
    SupportsBlockRead,
    SupportsChecksummedRead,
    SupportsGlobalCommit,
    SupportsRankManifests,
    SupportsStaging,
    Tier,
)
from ._oracle import build_snapshot
from ._suite import TierSuite
from ._suite import sample_state as _sample_state

__all__ = ["CapabilityTests"]


class CapabilityTests(TierSuite):
    """Crash cleanup, delete, retention and the capability checks (see the module doc)."""

    # -- what a crash leaves, what delete and retention remove -----------------------------

    async def test_open_removes_uncommitted_leftovers(
        self, make_tier: Callable[[], Tier]
    ) -> None:
        """A writer dies half way through a snapshot; the next writer's ``open()`` removes
        every file or object it left, and nothing of the committed snapshot before it."""
        if not self.persistent:
            pytest.skip("nothing of this tier outlives its instance")
        kept, kept_payloads = build_snapshot(1, _sample_state(1))
        async with self.opened(make_tier) as first:
            await self.write(first, kept, kept_payloads)
        before = await self.stored_names()
        manifest, payloads = build_snapshot(2, _sample_state(2))
        dying = make_tier()
        await dying.open()
        await dying.begin(manifest)
        for shard, data in zip(manifest.shards, payloads, strict=True):
            await dying.put_shard(manifest, shard, memoryview(data))
        await self.crash(dying)
        leftovers = await self.stored_names() - before
        assert leftovers, (
            "the uncommitted snapshot left nothing behind after crash(), so open() cannot be "
            "checked: a writer that is killed never runs aclose(); override crash()"
        )
        async with self.opened(make_tier) as again:
            assert await again.steps() == [1]
            remaining = await self.stored_names() & leftovers
            assert not remaining, f"open() left what the dead writer wrote: {sorted(remaining)}"
            assert await self.read_all(again, await again.read_manifest(1)) == kept_payloads
        assert await self.raw_steps(make_tier()) == [1]

    async def test_delete_removes_the_data(self, make_tier: Callable[[], Tier]) -> None:
        """``delete`` un-commits a step and removes every file or object its snapshot
        added, leaving the others whole."""
        if not self.persistent:
            pytest.skip("nothing of this tier outlives its instance (the oracle has no view)")
        first, first_payloads = build_snapshot(3, _sample_state(3))
        doomed, doomed_payloads = build_snapshot(7, _sample_state(7))
        async with self.opened(make_tier) as tier:
            await self.write(tier, first, first_payloads)
            before = await self.stored_names()
            await self.write(tier, doomed, doomed_payloads)
            added = await self.stored_names() - before
            assert added, "committing a snapshot stored nothing the oracle can see"
            await tier.delete(7)
            await tier.delete(7)  # a second delete of the same step is done already
            assert await tier.steps() == [3]
            assert await self.raw_steps(tier) == [3]
            remaining = await self.stored_names() & added
            assert not remaining, f"delete left the step's data: {sorted(remaining)}"
            assert await self.read_all(tier, await tier.read_manifest(3)) == first_payloads

    async def test_retention_through_a_checkpointer(self, make_tier: Callable[[], Tier]) -> None:
        """With ``keep_last=2, keep_every=3``, seven snapshots leave steps 3, 6 and 7."""
        from .._checkpointer.facades import Checkpointer

        tier = make_tier()
        tier.retention = Retention(keep_last=2, keep_every=3)
        options: dict[str, Any] = {"shard_size": 1 << 16, "pack_bytes": 4096}
        if not isinstance(tier, SupportsStaging):
            options["staging_bytes"] = 1 << 20
        async with Checkpointer([tier], **options) as ckpt:
            for step in range(1, 8):
                handle = await ckpt.snapshot(_sample_state(step), step=step)
                await handle.committed()
            if not self.persistent:  # nothing to look at once it is closed
                assert await tier.steps() == [3, 6, 7]
        if self.persistent:
            async with self.opened(make_tier) as again:
                assert await again.steps() == [3, 6, 7]
                assert await self.raw_steps(again) == [3, 6, 7]
                manifest = await again.read_manifest(6)
                assert await self.read_all(again, manifest) == build_snapshot(
                    6, _sample_state(6), shard_size=1 << 16, pack_bytes=4096
                )[1]

    # -- capabilities ------------------------------------------------------------------------

    @asynccontextmanager
    async def two_ranks(
        self, make_tier: Callable[[], Tier], step: int
    ) -> AsyncIterator[tuple[list[Tier], list[Manifest], list[list[bytes]], set[str]]]:
        """Two instances bound as ranks 0 and 1 of 2 (opened in that order, as every rank
        waits for rank 0's open), each having committed its part of ``step``, not yet
        committed globally; and what the location held before they wrote (persistent tiers
        only, else empty)."""
        built = [
            build_snapshot(step, _sample_state(10 + r), rank=r, world_size=2) for r in (0, 1)
        ]
        async with self.opened(make_tier, 0, 2) as rank0, self.opened(make_tier, 1, 2) as rank1:
            tiers = [rank0, rank1]
            before = await self.stored_names() if self.persistent else set()
            for tier, (manifest, payloads) in zip(tiers, built, strict=True):
                await self.write(tier, manifest, payloads)
            yield tiers, [m for m, _ in built], [p for _, p in built], before

    async def test_batch_put(self, make_tier: Callable[[], Tier]) -> None:
        """``put_shards`` stores what ``put_shard`` of each would: a snapshot written in
        batches (adjacent shards, out of order, and one batch with a gap) reads back
        whole after its commit."""
        probe = make_tier()
        if not isinstance(probe, SupportsBatchPut):
            pytest.skip("this tier does not store several shards in one call")
        manifest, payloads = build_snapshot(5, _sample_state(5))
        n = len(manifest.shards)
        assert n >= 3, "the sample snapshot has too few shards to batch"
        batches = [[1, 0], list(range(2, n, 2)), list(range(3, n, 2))]
        async with self.opened(make_tier) as tier:
            assert isinstance(tier, SupportsBatchPut)
            await tier.begin(manifest)
            for batch in batches:
                if batch:
                    await tier.put_shards(
                        manifest,
                        [manifest.shards[i] for i in batch],
                        [memoryview(payloads[i]) for i in batch],
                    )
            await tier.commit(manifest)
            assert await tier.steps() == [5]
            assert await self.read_all(tier, await tier.read_manifest(5)) == payloads

    async def test_global_commit(self, make_tier: Callable[[], Tier]) -> None:
        """A step of two ranks is invisible until ``commit_global`` (every rank's part was
        committed), visible to both ranks after it, idempotent, and deleted whole."""
        probe = make_tier()
        if not isinstance(probe, SupportsGlobalCommit):
            pytest.skip("this tier does not support snapshots of several ranks")
        async with self.two_ranks(make_tier, 5) as (tiers, manifests, payloads, before):
            for tier in tiers:
                assert await tier.steps() == [], "a rank's part alone made the step visible"
            assert await self._raw(tiers[0]) in (None, [])
            for tier in tiers:  # the engine calls it on every rank once they agreed
                assert isinstance(tier, SupportsGlobalCommit)
                await tier.commit_global(5, 2)
            for tier, manifest, expected in zip(tiers, manifests, payloads, strict=True):
                assert await tier.steps() == [5]
                stored = await tier.read_manifest(5)
                assert (stored.rank, stored.world_size) == (manifest.rank, 2)
                assert stored.shards == manifest.shards
                assert await self.read_all(tier, stored) == expected
            assert await self._raw(tiers[0]) in (None, [5])
            for tier in tiers:  # a retry after a lost reply
                assert isinstance(tier, SupportsGlobalCommit)
                await tier.commit_global(5, 2)
            assert await tiers[1].steps() == [5]
            added = await self.stored_names() - before if self.persistent else set()
            assert added or not self.persistent, "the two ranks stored nothing the oracle sees"
            for tier in tiers:  # rank 0 removes the shared record; the others their part
                await tier.delete(5)
            for tier in tiers:
                assert await tier.steps() == []
                with pytest.raises(SnapshotNotFoundError):
                    await tier.read_manifest(5)
            if self.persistent:
                assert await self.raw_steps(tiers[0]) == []
                remaining = await self.stored_names() & added
                assert not remaining, f"delete left the step's parts: {sorted(remaining)}"

    async def test_rank_manifests(self, make_tier: Callable[[], Tier]) -> None:
        """Any rank reads any rank's part: its manifest and, with it, its shards."""
        probe = make_tier()
        if not isinstance(probe, SupportsRankManifests):
            pytest.skip("this tier does not read other ranks' parts")
        single, single_payloads = build_snapshot(2, _sample_state(2))
        async with self.opened(make_tier) as tier:
            await self.write(tier, single, single_payloads)
            assert isinstance(tier, SupportsRankManifests)
            # a step of one process has one manifest, whichever rank asks
            for rank in (0, 1):
                got = await tier.read_rank_manifest(2, rank)
                assert got.shards == single.shards
                assert await self.read_all(tier, got) == single_payloads
        if not isinstance(probe, SupportsGlobalCommit):
            return
        async with self.two_ranks(make_tier, 6) as (tiers, manifests, payloads, _):
            for tier in tiers:
                assert isinstance(tier, SupportsGlobalCommit)
                await tier.commit_global(6, 2)
            for reader in tiers:
                assert isinstance(reader, SupportsRankManifests)
                for rank in (0, 1):
                    got = await reader.read_rank_manifest(6, rank)
                    assert (got.rank, got.world_size) == (rank, 2)
                    assert got.shards == manifests[rank].shards
                    assert await self.read_all(reader, got) == payloads[rank]
                with pytest.raises(LazyCkptError):
                    await reader.read_rank_manifest(6, 3)

    async def test_block_read(self, make_tier: Callable[[], Tier]) -> None:
        """A borrowed block holds exactly the shard's bytes; a step that is not there (never
        written, or deleted) lends nothing."""
        probe = make_tier()
        if not isinstance(probe, SupportsBlockRead):
            pytest.skip("this tier does not lend its blocks")
        manifest, payloads = build_snapshot(4, _sample_state(4))
        async with self.opened(make_tier) as tier:
            assert isinstance(tier, SupportsBlockRead)
            await self.write(tier, manifest, payloads)
            stored = await tier.read_manifest(4)
            for shard, expected in zip(stored.shards, payloads, strict=True):
                block = tier.borrow_shard(stored, shard)
                assert block is not None, f"shard {shard.index} of a committed step is not lent"
                try:
                    assert block.length == shard.length
                    assert bytes(block.memoryview()) == expected
                finally:
                    tier.return_shard(block)
            other, _ = build_snapshot(40, _sample_state(4))
            self._not_lent(tier, other, "a step never written")
            await tier.delete(4)
            self._not_lent(tier, stored, "a deleted step")

    async def test_checksummed_read(self, make_tier: Callable[[], Tier]) -> None:
        """A tier that checksums while reading returns the crc32c of exactly the bytes it
        put in ``out`` (the stored ones), into memory at its read alignment and into memory
        that is not (64 bytes off, as PyTorch's allocator places a tensor)."""
        probe = make_tier()
        if not isinstance(probe, SupportsChecksummedRead):
            pytest.skip("this tier does not checksum while reading")
        align = probe.read_alignment
        assert type(align) is int and align >= 1, f"read_alignment {align!r} is no alignment"
        manifest, payloads = build_snapshot(5, _sample_state(5))
        async with self.opened(make_tier) as tier:
            assert isinstance(tier, SupportsChecksummedRead)
            await self.write(tier, manifest, payloads)
            stored = await tier.read_manifest(5)
            for shard, expected in zip(stored.shards, payloads, strict=True):
                for skip in (0, 64):
                    room = bytearray(shard.length + 2 * align + 64)
                    at = _address(room)
                    start = -at % align + skip
                    out = memoryview(room)[start : start + shard.length]
                    crc = await tier.read_shard_checksummed(stored, shard, out)
                    assert bytes(out) == expected, f"shard {shard.index}: wrong bytes"
                    assert crc == crc32c.crc32c(expected), (
                        f"shard {shard.index}: the returned crc32c is not the bytes' own"
                    )
                    assert not any(room[:start]) and not any(room[start + shard.length :]), (
                        f"shard {shard.index}: bytes written outside out"
                    )

    @staticmethod
    def _not_lent(tier: SupportsBlockRead, manifest: Manifest, what: str) -> None:
        lent = tier.borrow_shard(manifest, manifest.shards[0])
        if lent is not None:
            tier.return_shard(lent)  # the tier must still close cleanly after this failure
        assert lent is None, f"{what} lent a block"


def _address(buffer: bytearray) -> int:
    """Where ``buffer``'s bytes start in memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
