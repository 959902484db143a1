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
- :class:`~lazyckpt.tier.SupportsBatchPut`: a snapshot written with ``put_shards`` in
  batches (adjacent shards out of order, every other shard) reads back whole.

And for every tier: retention through a Checkpointer keeps exactly what the policy says,
``delete`` removes a step's data (not only its commit), and ``open()`` removes what a writer
that died before its commit left.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from .._errors import (
    ConfigurationError,
    CorruptionError,
    ForeignLocationError,
    LazyCkptError,
    LocationInUseError,
    SnapshotNotFoundError,
    TierError,
)
from .._format.manifest import Manifest
from .._tiering.interface import SupportsReferences, SupportsStaging, Tier
from ._capabilities import CapabilityTests
from ._oracle import build_snapshot
from ._suite import build_crc
from ._suite import sample_state as _sample_state

__all__ = ["TierTests"]


class TierTests(CapabilityTests):
    """Conformance tests every tier passes. See the module docstring."""

    # -- the tests ---------------------------------------------------------------------------

    async def test_identity(self, make_tier: Callable[[], Tier]) -> None:
        tier = make_tier()
        assert isinstance(tier, Tier)
        assert isinstance(tier.name, str) and tier.name
        assert "secret" not in repr(tier.describe()).lower()

    async def test_bind_hands_in_the_rank(self, make_tier: Callable[[], Tier]) -> None:
        tier = make_tier()
        assert (tier.rank, tier.world_size) == (0, 1)  # never bound: one process
        tier.bind(1, 2)
        assert (tier.rank, tier.world_size) == (1, 2)
        for rank, world_size in ((2, 2), (-1, 2), (0, 0)):
            with pytest.raises(ConfigurationError):
                tier.bind(rank, world_size)
        assert (tier.rank, tier.world_size) == (1, 2)

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
        from .._checkpointer.facades import Checkpointer

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

