"""The conformance suite fails the tiers it exists to catch.

Each test here runs one of ``TierTests``' checks against a tier with one defect (an
``open()`` that removes nothing, a ``delete`` that only un-commits, a ``commit_global`` that
writes nothing, ...) and expects it to fail; and a suite without its oracles fails rather
than passing unchecked. The suites below are named so pytest does not collect them.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Collection
from pathlib import Path

import crc32c
import pytest

from lazyckpt import CorruptionError
from lazyckpt.testing import TierTests
from lazyckpt.tier import Block, Manifest, ShardMeta, Tier
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from custom_tier import _BUCKETS, DictStoreTier


class _DictSuite(TierTests):
    """The suite over the example's bucket, with its oracles."""

    one_writer = False
    honours_readonly = False

    def __init__(self, cls: type[DictStoreTier]) -> None:
        self.bucket = f"test-{uuid.uuid4().hex}"
        self.make: Callable[[], Tier] = lambda: cls(self.bucket)

    async def stored_names(self) -> set[str]:
        return set(_BUCKETS.get(self.bucket, {}))

    async def raw_steps(self, tier: Tier) -> list[int]:
        return sorted(
            int(k.split("/")[0][len("step-") :])
            for k in _BUCKETS.get(self.bucket, {})
            if k.endswith("/manifest.json")
        )


class _KeepsLeftovers(DictStoreTier):  # type: ignore[misc]  # examples/ joins sys.path at run time
    async def open(self) -> None:
        """Removes nothing: what a crash left stays (listed by nobody, stored forever)."""


class _DeleteOnlyUncommits(DictStoreTier):  # type: ignore[misc]  # (as above)
    async def delete(self, step: int) -> None:
        self._objects.pop(f"{self._prefix(step)}manifest.json", None)


async def test_an_open_that_removes_nothing_fails() -> None:
    suite = _DictSuite(_KeepsLeftovers)
    with pytest.raises(AssertionError, match="open\\(\\) left what the dead writer wrote"):
        await suite.test_open_removes_uncommitted_leftovers(suite.make)


async def test_the_example_tier_passes_the_same_check() -> None:
    suite = _DictSuite(DictStoreTier)
    await suite.test_open_removes_uncommitted_leftovers(suite.make)


async def test_a_delete_that_only_uncommits_fails() -> None:
    suite = _DictSuite(_DeleteOnlyUncommits)
    with pytest.raises(AssertionError, match="delete left the step's data"):
        await suite.test_delete_removes_the_data(suite.make)


async def test_a_suite_without_its_oracles_fails() -> None:
    class NoOracles(TierTests):
        one_writer = False
        honours_readonly = False

    bucket = f"test-{uuid.uuid4().hex}"
    with pytest.raises(NotImplementedError, match="raw_steps"):
        await NoOracles().test_invisible_until_commit(lambda: DictStoreTier(bucket))
    with pytest.raises(NotImplementedError, match="stored_names"):
        await NoOracles().test_delete_removes_the_data(lambda: DictStoreTier(bucket))


class _FileSuite(TierTests):
    def __init__(self, root: Path) -> None:
        self.root = root

    async def stored_names(self) -> set[str]:
        return {str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()}

    async def raw_steps(self, tier: Tier) -> list[int]:
        return sorted(
            int(p.parent.name[len("step-") :]) for p in self.root.glob("step-*/manifest.json")
        )


class _NoGlobalCommit(FileTier):
    async def commit_global(self, step: int, world_size: int) -> None:
        """Writes no commit record: the step never becomes visible."""


class _OwnManifestOnly(FileTier):
    async def read_rank_manifest(self, step: int, rank: int) -> Manifest:
        return await super().read_rank_manifest(step, self.rank)  # ignores which rank


async def test_a_commit_global_that_writes_nothing_fails(tmp_path: Path) -> None:
    suite = _FileSuite(tmp_path / "ckpt")
    with pytest.raises(AssertionError):
        await suite.test_global_commit(lambda: _NoGlobalCommit(suite.root))


async def test_reading_only_ones_own_part_fails(tmp_path: Path) -> None:
    suite = _FileSuite(tmp_path / "ckpt")
    with pytest.raises(AssertionError):
        await suite.test_rank_manifests(lambda: _OwnManifestOnly(suite.root))


class _LendsTheWrongBlock(HostMemoryTier):
    def borrow_shard(self, manifest: Manifest, shard: ShardMeta) -> Block | None:
        others = [s for s in manifest.shards if s.index != shard.index and s.length == shard.length]
        return super().borrow_shard(manifest, others[0] if others else shard)


class _LendsAfterDelete(HostMemoryTier):
    async def delete(self, step: int) -> None:
        """Forgets nothing: a deleted step is still lent."""


class _HostSuite(TierTests):
    persistent = False
    one_writer = False
    honours_readonly = False


@pytest.mark.parametrize("cls", [_LendsTheWrongBlock, _LendsAfterDelete])
async def test_a_wrong_block_read_fails(cls: type[HostMemoryTier]) -> None:
    with pytest.raises(AssertionError):
        await _HostSuite().test_block_read(lambda: cls(8 << 20))


class _DeletesReferredData(FileTier):
    def _referenced_sync(self) -> set[int] | None:
        return set()  # deleting a step removes its data, whatever refers to it


class _IgnoresReferences(FileTier):
    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        from dataclasses import replace

        await super().read_shard(manifest, replace(shard, stored_in=None), out)


class _CollectsWhatIsKept(FileTier):
    async def collect(self, keep: Collection[int] = ()) -> list[int]:
        return await super().collect(())  # ignores what flights in flight still need


@pytest.mark.parametrize("cls", [_DeletesReferredData, _IgnoresReferences, _CollectsWhatIsKept])
async def test_a_tier_that_loses_referred_data_fails(cls: type[FileTier], tmp_path: Path) -> None:
    suite = _FileSuite(tmp_path / "ckpt")
    with pytest.raises((AssertionError, CorruptionError)):
        await suite.test_references_read_and_retention(lambda: cls(suite.root))


async def test_the_file_tier_passes_the_same_reference_check(tmp_path: Path) -> None:
    suite = _FileSuite(tmp_path / "ckpt")
    await suite.test_references_read_and_retention(lambda: FileTier(suite.root))


class _ChecksumTooEarly(DictStoreTier):  # type: ignore[misc]  # (as above)
    """Claims to checksum while reading, but checksums ``out`` before the bytes land."""

    read_alignment = 1

    async def read_shard_checksummed(
        self, manifest: Manifest, shard: ShardMeta, out: memoryview
    ) -> int:
        crc = crc32c.crc32c(out)
        await self.read_shard(manifest, shard, out)
        return crc


class _ChecksumOfTheRightBytes(DictStoreTier):  # type: ignore[misc]  # (as above)
    read_alignment = 1

    async def read_shard_checksummed(
        self, manifest: Manifest, shard: ShardMeta, out: memoryview
    ) -> int:
        await self.read_shard(manifest, shard, out)
        return crc32c.crc32c(out)


async def test_a_checksummed_read_that_does_not_checksum_the_bytes_fails() -> None:
    suite = _DictSuite(_ChecksumTooEarly)
    with pytest.raises(AssertionError, match="the returned crc32c is not the bytes' own"):
        await suite.test_checksummed_read(suite.make)


async def test_a_checksummed_read_of_the_bytes_passes() -> None:
    suite = _DictSuite(_ChecksumOfTheRightBytes)
    await suite.test_checksummed_read(suite.make)
