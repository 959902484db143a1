"""HostMemoryTier: the arena where captures land, and the fastest place to restore from."""

from __future__ import annotations

import asyncio

from lazyckpt.tier import (
    Block,
    CorruptionError,
    HostArena,
    Manifest,
    Retention,
    ShardMeta,
    SnapshotNotFoundError,
    StepInfo,
    Tier,
    TierClosedError,
    TierFullError,
    TierLevel,
    backend_errors,
)

__all__ = ["HostMemoryTier"]


class HostMemoryTier(Tier):
    """Host memory: pinned where CUDA exists, pre-faulted page-aligned memory otherwise.

    Captures are copied straight into this tier's arena (no second copy). Once a shard is
    durable on the next tier its block becomes reclaimable, but it stays until the arena
    needs the space, so the newest snapshots remain here for instant restore or rollback.
    A snapshot larger than the arena still checkpoints: its shards stream through to the
    next tier, and it is simply not kept here.

    As the only tier of a chain, this tier is where snapshots end: a snapshot counts as
    committed only once it is here whole. The arena then keeps the newest snapshots that fit,
    evicting the oldest (whole) to make room for a newer one; a snapshot larger than the
    arena fails with :class:`~lazyckpt.TierFullError` and evicts nothing.

    Args:
        capacity_bytes: the arena's size, allocated and touched once when the Checkpointer
            opens.
        pinned: page-locked memory; ``None`` = when CUDA is available.
        name: the tier's name (default ``"host"``).
        keep_last, keep_every: retention (see :class:`lazyckpt.Retention`); the arena's own
            eviction applies on top.
        retention: the whole retention policy as one :class:`lazyckpt.Retention` (which
            also holds ``keep_best`` and ``keep_within``), instead of ``keep_last`` and
            ``keep_every``.
    """

    level = TierLevel.HOST
    default_name = "host"

    def __init__(
        self,
        capacity_bytes: int = 1 << 30,
        *,
        pinned: bool | None = None,
        name: str | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        retention: Retention | None = None,
    ) -> None:
        super().__init__(
            name=name, keep_last=keep_last, keep_every=keep_every, retention=retention
        )
        self._arena = HostArena(capacity_bytes, pinned=pinned)
        self._blocks: dict[int, dict[int, Block]] = {}
        self._owner: dict[int, int] = {}  # id(block) -> step
        self._committed: dict[int, Manifest] = {}
        self._closed = False

    @property
    def arena(self) -> HostArena:
        return self._arena

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError("closed", tier=self.name)

    # -- staging (SupportsStaging) ---------------------------------------------------------

    def adopt(self, manifest: Manifest, shard: ShardMeta, block: Block) -> None:
        """Keep a captured block as part of ``manifest.step``."""
        self._blocks.setdefault(manifest.step, {})[shard.index] = block
        self._owner[id(block)] = manifest.step

    def evicted(self, block: Block) -> None:
        """The arena reclaimed ``block``: its snapshot is no longer whole here."""
        step = self._owner.pop(id(block), None)
        if step is not None:
            self.forget(step, keep=block)

    def forget(self, step: int, *, keep: Block | None = None) -> None:
        """Drop a snapshot from this tier and give its blocks back to the arena."""
        self._committed.pop(step, None)
        for block in self._blocks.pop(step, {}).values():
            self._owner.pop(id(block), None)
            if block is not keep:
                self._arena.discard(block)

    def borrow_shard(self, manifest: Manifest, shard: ShardMeta) -> Block | None:
        """The block holding ``shard``, held for the caller; None if it left host memory."""
        block = self._blocks.get(manifest.step, {}).get(shard.index)
        if block is None or block.length != shard.length or not self._arena.claim(block):
            return None
        return block

    def return_shard(self, block: Block) -> None:
        """Drop the hold :meth:`borrow_shard` took."""
        self._arena.release(block)

    # -- Tier ------------------------------------------------------------------------------

    async def open(self) -> None:
        self._check_open()
        if not self._arena.allocated:
            await asyncio.to_thread(self._arena.allocate_memory)

    async def begin(self, manifest: Manifest) -> None:
        self._check_open()
        self._blocks.setdefault(manifest.step, {})

    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        self._check_open()
        block = await self._arena.allocate(len(data))
        try:
            with backend_errors(self.name, f"copy shard {shard.index} of step {manifest.step}"):
                await asyncio.to_thread(block.memoryview().__setitem__, slice(None), data)
        except BaseException:
            self._arena.release(block)
            raise
        self.adopt(manifest, shard, block)
        self._arena.mark_evictable(block, self.evicted)
        self._arena.release(block)

    async def commit(self, manifest: Manifest) -> None:
        self._check_open()
        blocks = self._blocks.get(manifest.step, {})
        if manifest.extra.get("incremental") and any(
            s.index not in blocks for s in manifest.shards
        ) and not any(b.freed for b in blocks.values()):
            # incremental="versions" did not capture some shards: their bytes are only on
            # the durable tiers, so this tier cannot hold the step whole
            self.forget(manifest.step)
            raise TierFullError(
                f"step {manifest.step} is incremental and some of its shards were not "
                "captured into host memory; it is not kept here (the durable tiers have it)",
                tier=self.name,
            )
        if len(blocks) != len(manifest.shards) or any(b.freed for b in blocks.values()):
            self.forget(manifest.step)
            raise TierFullError(
                f"step {manifest.step} ({manifest.tensor_bytes} bytes) does not fit the "
                f"{self._arena.capacity} byte arena whole; it is not kept in memory. Raise "
                "capacity_bytes to keep snapshots of this size here",
                tier=self.name,
            )
        self._committed[manifest.step] = manifest
        info = None
        if self.retention.needs_info():
            info = {s: StepInfo.from_manifest(m) for s, m in self._committed.items()}
        for step in self.retention.to_delete(self._committed, info):
            self.forget(step)

    async def abort(self, step: int) -> None:
        if step not in self._committed:
            self.forget(step)

    async def steps(self) -> list[int]:
        self._check_open()
        return sorted(self._committed)

    async def read_manifest(self, step: int) -> Manifest:
        self._check_open()
        try:
            return self._committed[step]
        except KeyError:
            raise SnapshotNotFoundError(f"step {step} is not in tier {self.name!r}") from None

    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        self._check_open()
        block = self._blocks.get(manifest.step, {}).get(shard.index)
        if block is None or not self._arena.claim(block):
            raise CorruptionError(f"shard {shard.index} of step {manifest.step} left host memory")
        try:
            if block.length != len(out):
                raise CorruptionError(f"shard {shard.index}: host copy has the wrong length")
            src = block.memoryview()
            with backend_errors(self.name, f"read shard {shard.index} of step {manifest.step}"):
                if len(out) > (1 << 20):
                    await asyncio.to_thread(out.__setitem__, slice(None), src)
                else:
                    out[:] = src
        finally:
            self._arena.release(block)

    async def delete(self, step: int) -> None:
        self._check_open()
        self.forget(step)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for step in list(self._blocks):
            self.forget(step)
        self._arena.release_memory()
