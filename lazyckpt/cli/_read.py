"""Reading a snapshot back: shards in order with their checksums checked, where a segment's
bytes sit in its tensor, and what a shard holds, for a person."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from .._errors import CorruptionError
from .._fetch import read_copy
from .._manifest import Manifest, ShardMeta
from .._tier import Tier


@dataclass
class ShardRead:
    """One shard read back from a tier: its bytes, or why they are not good."""

    shard: ShardMeta
    data: memoryview | None
    error: str | None = None


class ShardReader:
    """Reads shards of one snapshot in order, up to ``jobs`` ahead, checking each crc32c.

    Use as ``async with ShardReader(...) as reader: async for read in reader:``. A shard's
    buffer is reused once the loop moves on, so memory stays at ``jobs + 1`` shards however
    large the snapshot is. Missing, short or mismatching data comes back as a
    :class:`ShardRead` with ``error`` set (so ``verify`` can name every bad shard); a tier
    that cannot be reached raises its :class:`~lazyckpt.TierError`.
    """

    def __init__(
        self,
        tier: Tier,
        manifest: Manifest,
        shards: Sequence[ShardMeta] | None = None,
        *,
        jobs: int = 4,
    ) -> None:
        self.tier = tier
        self.manifest = manifest
        self._todo = collections.deque(manifest.shards if shards is None else shards)
        self._jobs = max(1, jobs)
        self._pending: collections.deque[tuple[asyncio.Task[ShardRead], bytearray]] = (
            collections.deque()
        )
        self._free: list[bytearray] = []
        self._held: bytearray | None = None

    async def __aenter__(self) -> ShardReader:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tasks = [task for task, _ in self._pending]
        for task in tasks:
            task.cancel()
        # The reads write into our buffers: wait until they have really stopped.
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pending.clear()

    def __aiter__(self) -> ShardReader:
        return self

    async def __anext__(self) -> ShardRead:
        if self._held is not None:
            self._free.append(self._held)
            self._held = None
        while self._todo and len(self._pending) < self._jobs:
            shard = self._todo.popleft()
            buffer = self._buffer(shard.length)
            task = asyncio.create_task(self._read(shard, buffer), name=f"read-{shard.index}")
            self._pending.append((task, buffer))
        if not self._pending:
            raise StopAsyncIteration
        task, buffer = self._pending.popleft()
        try:
            result = await task
        except BaseException:
            self._free.append(buffer)
            raise
        self._held = buffer
        return result

    def _buffer(self, length: int) -> bytearray:
        for i, candidate in enumerate(self._free):
            if len(candidate) >= length:
                return self._free.pop(i)
        return bytearray(length)

    async def _read(self, shard: ShardMeta, buffer: bytearray) -> ShardRead:
        view = memoryview(buffer)[: shard.length]
        try:
            # the one read-and-check every reader of a snapshot uses
            await read_copy(self.manifest, shard, self.tier, view)
        except CorruptionError as exc:
            return ShardRead(shard, None, str(exc))
        return ShardRead(shard, view)


def shard_contents(manifest: Manifest, shard: ShardMeta) -> list[str]:
    """What a shard holds, for a person: keys, the rows or elements of each, and aliases."""
    parts: list[str] = []
    for seg in shard.segments:
        meta = manifest.tensors[seg.tensor]
        if meta.mode == "rows":
            parts.append(f"{meta.key} rows {seg.start}:{seg.stop} of {meta.shape[0]}")
        elif meta.mode == "flat":
            parts.append(f"{meta.key} elements {seg.start}:{seg.stop} of {meta.numel}")
        else:
            parts.append(meta.key)
        parts.extend(
            f"{other.key} (the same tensor as {meta.key})"
            for other in manifest.tensors
            if other.alias_of == seg.tensor
        )
    return parts


def damage_keys(manifest: Manifest, shard: ShardMeta) -> list[str]:
    """Every key whose bytes are in ``shard``, tied keys included: what damage to it hurts."""
    keys = {manifest.tensors[seg.tensor].key for seg in shard.segments}
    keys.update(
        t.key for t in manifest.tensors for seg in shard.segments if t.alias_of == seg.tensor
    )
    return sorted(keys)
