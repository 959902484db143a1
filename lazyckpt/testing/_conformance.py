"""The tier conformance suite: what every tier must do, checked the same way for all.

Subclass :class:`TierTests` in a test file and provide the ``make_tier`` fixture::

    from lazyckpt.testing import TierTests

    class TestMyTier(TierTests):
        @pytest.fixture
        def make_tier(self, tmp_path):
            self.root = tmp_path / "store"
            return lambda: MyTier(self.root)

        async def raw_steps(self, tier):      # committed steps, read without the tier's code
            ...

        async def stored_names(self):         # every file or object at the location
            ...

``make_tier()`` is called once per tier instance a test needs; two calls must give two
instances over the *same* storage (that is how persistence, crash cleanup and several
ranks are checked). Set ``persistent = False`` for a tier that forgets everything when
closed (host memory).

Oracles. A persistent tier's subclass must provide :meth:`TierTests.raw_steps` and
:meth:`TierTests.stored_names`, which read the backend without the tier's code: without
them the checks of commits, deletes and crash cleanup would only ask the tier about itself,
so the suite fails until they exist. :meth:`TierTests.crash` says how a writer dies (by
default it is closed, which a tier must not use to clean up).

A tier that supports incremental snapshots (:class:`~lazyckpt.tier.SupportsReferences`) is
also checked for references: a step that refers to an earlier step's shards reads them from
there, stays whole when that step is deleted, and :meth:`collect` removes the earlier data
only once nothing (no committed step, nothing in ``keep``) refers to it.

Locations are shared, so the suite also checks how a tier guards one (each a class flag, on
by default; a tier whose instances share no storage, like host memory, turns them off):

- ``one_writer``: a second instance opened for writing while the first is open fails with
  :class:`~lazyckpt.LocationInUseError`, and can open once the first is closed.
- ``honours_readonly``: an instance with ``readonly`` set opens beside a writer, sees its
  commits, refuses to write; :meth:`TierTests.missing_location` (then required) gives one
  over a location that does not exist, whose ``open()`` must raise
  :class:`~lazyckpt.SnapshotNotFoundError` and create nothing there.
- :meth:`TierTests.plant_foreign`: put at the location what another kind of store writes;
  opening it must then fail with :class:`~lazyckpt.ForeignLocationError` and change nothing.

Capabilities are checked where the tier has them (``isinstance`` with the protocols of
:mod:`lazyckpt.tier`), and skipped with the reason otherwise:

- :class:`~lazyckpt.tier.SupportsGlobalCommit`: two instances bound as ranks 0 and 1 write
  their parts; the step is invisible (to the tier and to the oracle) until
  ``commit_global``, visible to both after it, idempotent, and deleted whole.
- :class:`~lazyckpt.tier.SupportsRankManifests`: each rank reads the other's manifest and
  shards; a rank the step does not have is an error of lazyckpt's tree.
- :class:`~lazyckpt.tier.SupportsBlockRead`: a borrowed block holds the shard's bytes, and a
  step that is not there lends nothing.

And for every tier: retention through a Checkpointer keeps exactly what the policy says,
``delete`` removes a step's data (not only its commit), and ``open()`` removes what a writer
that died before its commit left.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, ClassVar

import pytest
import torch

from .._errors import (
    CorruptionError,
    ForeignLocationError,
    LazyCkptError,
    LocationInUseError,
    SnapshotNotFoundError,
    TierError,
)
from .._manifest import Manifest
from .._tier import (
    Retention,
    SupportsBlockRead,
    SupportsGlobalCommit,
    SupportsRankManifests,
    SupportsReferences,
    SupportsStaging,
    Tier,
)
from ._oracle import build_snapshot

__all__ = ["TierTests"]


def build_crc(data: bytes) -> int:
    import crc32c

    return int(crc32c.crc32c(data))


def _sample_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(300, 100, generator=g),  # several chunk shards
        "small": [torch.randn(7, generator=g), torch.arange(5, dtype=torch.int64)],
        "half": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "flag": torch.tensor([True, False, True]),
        "meta": {"lr": 0.1, "name": "run"},
    }


class TierTests:
    """Conformance tests every tier passes. See the module docstring."""

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

    # -- the tests ---------------------------------------------------------------------------

    async def test_identity(self, make_tier: Callable[[], Tier]) -> None:
        tier = make_tier()
        assert isinstance(tier, Tier)
        assert isinstance(tier.name, str) and tier.name
        assert "secret" not in repr(tier.describe()).lower()

    async def test_empty_lists_nothing(self, make_tier: Callable[[], Tier]) -> None:
        async with self.opened(make_tier) as tier:
            assert await tier.steps() == []
            with pytest.raises(SnapshotNotFoundError):
                await tier.read_manifest(3)

    async def test_round_trip(self, make_tier: Callable[[], Tier]) -> None:
        manifest, payloads = build_snapshot(5, _sample_state())
        assert len(manifest.shards) > 3
        async with self.opened(make_tier) as tier:
            await self.write(tier, manifest, payloads)
            assert await tier.steps() == [5]
            stored = await tier.read_manifest(5)
            assert stored.shards == manifest.shards
            assert [t.key for t in stored.tensors] == [t.key for t in manifest.tensors]
            assert await self.read_all(tier, stored) == payloads

    async def test_invisible_until_commit(self, make_tier: Callable[[], Tier]) -> None:
        manifest, payloads = build_snapshot(1, _sample_state())
        async with self.opened(make_tier) as tier:
            await tier.begin(manifest)
            for shard, data in zip(manifest.shards, payloads, strict=True):
                await tier.put_shard(manifest, shard, memoryview(data))
            assert await tier.steps() == []
            assert await self._raw(tier) in (None, [])
            await tier.commit(manifest)
            assert await tier.steps() == [1]
            assert await self._raw(tier) in (None, [1])

    async def test_abort_is_idempotent(self, make_tier: Callable[[], Tier]) -> None:
        kept, kept_payloads = build_snapshot(1, _sample_state(1))
        manifest, payloads = build_snapshot(2, _sample_state(2))
        async with self.opened(make_tier) as tier:
            await self.write(tier, kept, kept_payloads)
            await tier.begin(manifest)
            await tier.put_shard(manifest, manifest.shards[0], memoryview(payloads[0]))
            await tier.abort(2)
            await tier.abort(2)
            await tier.abort(99)
            assert await tier.steps() == [1]
            assert await self.read_all(tier, await tier.read_manifest(1)) == kept_payloads

    async def test_many_steps_sorted_and_delete(self, make_tier: Callable[[], Tier]) -> None:
        async with self.opened(make_tier) as tier:
            for step in (3, 10, 7):
                manifest, payloads = build_snapshot(step, _sample_state(step))
                await self.write(tier, manifest, payloads)
            assert await tier.steps() == [3, 7, 10]
            await tier.delete(7)
            assert await tier.steps() == [3, 10]
            with pytest.raises(SnapshotNotFoundError):
                await tier.read_manifest(7)
            manifest = await tier.read_manifest(10)
            assert await self.read_all(tier, manifest) == build_snapshot(10, _sample_state(10))[1]

    # -- incremental snapshots (SupportsReferences) ------------------------------------------

    async def _write_referring(
        self, tier: Tier, step: int, base: Manifest, payloads: list[bytes], changed: int
    ) -> tuple[Manifest, list[bytes]]:
        """Write ``step`` as an incremental snapshot of ``base``: only shard ``changed`` is
        written (with new bytes); every other shard refers to ``base``'s stored data."""
        new = list(payloads)
        new[changed] = bytes(b ^ 0xFF for b in payloads[changed])
        crcs = [s.crc32c or 0 for s in base.shards]
        crcs[changed] = build_crc(new[changed])
        manifest = replace(base.self_contained(), step=step).with_checksums(crcs)
        manifest = manifest.with_references(
            {
                s.index: base.step if s.stored_in is None else s.stored_in
                for s in base.shards
                if s.index != changed
            }
        )
        manifest = replace(manifest, extra={**manifest.extra, "incremental": True})
        await tier.begin(manifest)
        await tier.put_shard(manifest, manifest.shards[changed], memoryview(new[changed]))
        await tier.commit(manifest)
        return manifest, new

    async def test_references_read_and_retention(self, make_tier: Callable[[], Tier]) -> None:
        if not isinstance(make_tier(), SupportsReferences):
            pytest.skip("the tier does not store incremental snapshots")
        base, payloads = build_snapshot(1, _sample_state())
        async with self.opened(make_tier) as tier:
            assert isinstance(tier, SupportsReferences)
            await self.write(tier, base, payloads)
            second, second_payloads = await self._write_referring(tier, 2, base, payloads, 0)
            third, third_payloads = await self._write_referring(tier, 3, second, second_payloads, 1)
            assert third.references() == {1, 2}
            stored = await tier.read_manifest(3)
            assert stored.shards == third.shards
            assert await self.read_all(tier, stored) == third_payloads
            await tier.delete(1)  # steps 2 and 3 still read shards from its data
            await tier.delete(2)
            assert await tier.steps() == [3]
            assert await tier.collect() == []
            assert await self.read_all(tier, await tier.read_manifest(3)) == third_payloads
        async with self.opened(make_tier) as again:  # what a restart finds
            assert isinstance(again, SupportsReferences)
            assert await again.steps() == [3]
            assert await self.read_all(again, await again.read_manifest(3)) == third_payloads
            fourth, _ = build_snapshot(4, _sample_state(4))
            await self.write(again, fourth, build_snapshot(4, _sample_state(4))[1])
            await again.delete(3)
            assert await again.collect(keep=[1]) == [2]  # step 1 is still wanted by the caller
            assert await again.collect() == [1]
            assert await again.steps() == [4]

    async def test_values_only_snapshot(self, make_tier: Callable[[], Tier]) -> None:
        manifest, payloads = build_snapshot(4, {"epoch": 2, "names": ("a", "b")})
        assert not manifest.shards
        async with self.opened(make_tier) as tier:
            await self.write(tier, manifest, payloads)
            assert await tier.steps() == [4]
            assert (await tier.read_manifest(4)).tree == manifest.tree

    async def test_persists_across_instances(self, make_tier: Callable[[], Tier]) -> None:
        manifest, payloads = build_snapshot(8, _sample_state())
        async with self.opened(make_tier) as tier:
            await self.write(tier, manifest, payloads)
        async with self.opened(make_tier) as again:
            if not self.persistent:  # a volatile tier must not pretend to remember
                assert await again.steps() == []
                return
            assert await again.steps() == [8]
            assert await self.read_all(again, await again.read_manifest(8)) == payloads

    async def test_uncommitted_is_gone_after_reopen(self, make_tier: Callable[[], Tier]) -> None:
        manifest, payloads = build_snapshot(9, _sample_state())
        tier = make_tier()
        await tier.open()
        await tier.begin(manifest)
        await tier.put_shard(manifest, manifest.shards[0], memoryview(payloads[0]))
        await tier.aclose()  # as if the writer had died before the commit
        async with self.opened(make_tier) as again:
            assert await again.steps() == []
            await self.write(again, manifest, payloads)
            assert await again.steps() == [9]

    async def test_closed_tier_refuses(self, make_tier: Callable[[], Tier]) -> None:
        tier = make_tier()
        await tier.open()
        await tier.aclose()
        await tier.aclose()  # idempotent
        with pytest.raises(TierError):
            await tier.steps()

    async def test_errors_stay_in_the_tree(self, make_tier: Callable[[], Tier]) -> None:
        manifest, payloads = build_snapshot(2, _sample_state())
        async with self.opened(make_tier) as tier:
            await self.write(tier, manifest, payloads)
            with pytest.raises(LazyCkptError):
                await tier.read_manifest(12345)
            shard = manifest.shards[0]
            wrong = manifest.with_checksums([0] * len(manifest.shards))
            buf = bytearray(shard.length)
            try:  # a tier may read fine (the engine checks the crc) or refuse: both in the tree
                await tier.read_shard(wrong, wrong.shards[0], memoryview(buf))
            except LazyCkptError:
                pass
            except Exception as exc:  # pragma: no cover - the failure this test exists for
                pytest.fail(f"read_shard raised {exc!r}, outside lazyckpt's error tree")

    async def test_through_a_checkpointer(self, make_tier: Callable[[], Tier]) -> None:
        from .._checkpointer import Checkpointer

        state = _sample_state(3)
        tier = make_tier()
        options: dict[str, Any] = {"shard_size": 1 << 16, "pack_bytes": 4096}
        if not isinstance(tier, SupportsStaging):
            options["staging_bytes"] = 1 << 20
        async with Checkpointer([tier], **options) as ckpt:
            handle = await ckpt.snapshot(state, step=1)
            await handle.committed()
            restored = await ckpt.restore()
        for key in ("big", "half", "flag"):
            assert torch.equal(restored[key], state[key])
        assert restored["meta"] == state["meta"]

    async def test_short_read_is_corruption(self, make_tier: Callable[[], Tier]) -> None:
        manifest, payloads = build_snapshot(6, _sample_state())
        async with self.opened(make_tier) as tier:
            await self.write(tier, manifest, payloads)
            longer = manifest.shards[-1]
            # a shard that claims more bytes than were stored: the tier must notice
            bogus = replace(longer, length=longer.length + 4096)
            bogus_manifest = replace(
                manifest,
                shards=(*manifest.shards[:-1], bogus),
                stream_bytes=manifest.stream_bytes + 8192,
            )
            buf = bytearray(bogus.length)
            with pytest.raises((CorruptionError, TierError)):
                await tier.read_shard(bogus_manifest, bogus, memoryview(buf))

    # -- guarding a shared location ----------------------------------------------------------

    async def test_second_writer_is_refused(self, make_tier: Callable[[], Tier]) -> None:
        if not self.one_writer:
            pytest.skip("instances of this tier share no storage")
        manifest, payloads = build_snapshot(1, _sample_state())
        async with self.opened(make_tier) as first:
            second = make_tier()
            try:
                with pytest.raises(LocationInUseError):
                    await second.open()
            finally:
                await second.aclose()
            await self.write(first, manifest, payloads)  # the first goes on unharmed
        async with self.opened(make_tier) as again:  # free once the first is closed
            assert await again.steps() == [1]

    async def test_reader_beside_a_writer(self, make_tier: Callable[[], Tier]) -> None:
        if not self.honours_readonly:
            pytest.skip("this tier does not offer read-only opens")
        manifest, payloads = build_snapshot(2, _sample_state())
        async with self.opened(make_tier) as writer:
            await self.write(writer, manifest, payloads)
            reader = make_tier()
            reader.readonly = True
            await reader.open()
            try:
                assert await reader.steps() == [2]
                assert await self.read_all(reader, await reader.read_manifest(2)) == payloads
                later, _ = build_snapshot(3, _sample_state())
                with pytest.raises(LazyCkptError):
                    await reader.begin(later)
                with pytest.raises(LazyCkptError):
                    await reader.delete(2)
            finally:
                await reader.aclose()
            assert await writer.steps() == [2]

    async def test_reader_opened_mid_snapshot_changes_nothing(
        self, make_tier: Callable[[], Tier]
    ) -> None:
        """A reader that opens while the writer is half way through a snapshot neither lists
        nor sweeps it (to a reader it looks like a crash's leftover); the writer then
        commits it whole."""
        if not self.honours_readonly:
            pytest.skip("this tier does not offer read-only opens")
        first, first_payloads = build_snapshot(2, _sample_state())
        manifest, payloads = build_snapshot(3, _sample_state())
        async with self.opened(make_tier) as writer:
            await self.write(writer, first, first_payloads)
            await writer.begin(manifest)
            for shard, data in zip(manifest.shards, payloads, strict=True):
                await writer.put_shard(manifest, shard, memoryview(data))
            reader = make_tier()
            reader.readonly = True
            await reader.open()
            try:
                assert await reader.steps() == [2]
            finally:
                await reader.aclose()
            await writer.commit(manifest)
            assert await writer.steps() == [2, 3]
            assert await self.read_all(writer, await writer.read_manifest(3)) == payloads

    async def test_readonly_open_creates_nothing(self, make_tier: Callable[[], Tier]) -> None:
        if not self.honours_readonly:
            pytest.skip("this tier does not offer read-only opens")
        tier, exists = await self.missing_location()
        assert tier.readonly
        try:
            with pytest.raises(SnapshotNotFoundError):
                await tier.open()
        finally:
            await tier.aclose()
        assert not exists()

    async def test_foreign_location_is_refused(self, make_tier: Callable[[], Tier]) -> None:
        snapshot = await self.plant_foreign()
        if snapshot is None:
            pytest.skip("no other store could share this tier's location")
        before = snapshot()
        for readonly in (False, True):
            tier = make_tier()
            tier.readonly = readonly
            try:
                with pytest.raises(ForeignLocationError):
                    await tier.open()
            finally:
                await tier.aclose()
            assert snapshot() == before, "the tier changed a location it refused"

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
        from .._checkpointer import Checkpointer

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

    @staticmethod
    def _not_lent(tier: SupportsBlockRead, manifest: Manifest, what: str) -> None:
        lent = tier.borrow_shard(manifest, manifest.shards[0])
        if lent is not None:
            tier.return_shard(lent)  # the tier must still close cleanly after this failure
        assert lent is None, f"{what} lent a block"
