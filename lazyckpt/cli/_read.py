"""Reading a snapshot back: shards in order with their checksums checked, where a segment's
bytes sit in its tensor, and what a shard holds, for a person."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from .._errors import ConfigurationError, CorruptionError
from .._format.entries import ShardMeta, TensorMeta
from .._format.manifest import Manifest
from .._restore.fetch import read_copy
from .._tiering.interface import SupportsRankManifests, Tier


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


def rank_label(manifest: Manifest) -> str:
    """``"rank R "`` for a part of a step several ranks wrote, else nothing (for messages)."""
    return f"rank {manifest.rank} " if manifest.world_size > 1 else ""


async def step_parts(tier: Tier, step: int, first: Manifest | None = None) -> list[Manifest]:
    """Every rank's manifest of a committed step, rank 0's first; one for a step a single
    process wrote. ``first`` is rank 0's, when already read.

    A command opens a location as rank 0 of 1, so ``read_manifest`` gives rank 0's part
    only: the other ranks' parts are read through ``read_rank_manifest``.

    Raises:
        ConfigurationError: the step was written by several ranks and the tier cannot read
            another rank's part (it lacks ``read_rank_manifest``).
        CorruptionError: a rank's manifest is missing or unreadable (the rank is named).
    """
    if first is None:
        first = await tier.read_manifest(step)
    world = first.world_size
    if world == 1:
        return [first]
    if not isinstance(tier, SupportsRankManifests):
        raise ConfigurationError(
            f"step {step} on {tier.name!r} was written by {world} ranks, and this tier cannot "
            "read the other ranks' parts (no read_rank_manifest): only rank 0's could be "
            "reached, so the command is refused rather than work on part of the step"
        )
    parts = [first]
    for rank in range(1, world):
        try:
            part = await tier.read_rank_manifest(step, rank)
        except CorruptionError as exc:
            raise CorruptionError(
                f"step {step}: the manifest of rank {rank} of {world} cannot be read: {exc}"
            ) from exc
        if part.world_size != world or part.rank != rank:
            raise CorruptionError(
                f"step {step}: rank {rank}'s manifest says rank {part.rank} of "
                f"{part.world_size}, but rank 0's says {world} ranks"
            )
        parts.append(part)
    return parts


def tensor_bytes(parts: Sequence[Manifest]) -> int:
    """Bytes of tensor data a step holds over all its ranks' parts: each rank's own, a
    tensor several ranks share counted once (its ``replica`` entries hold no bytes)."""
    return sum(
        t.nbytes for m in parts for t in m.tensors if t.alias_of is None and t.mode != "replica"
    )


def layout_of(meta: TensorMeta) -> str:
    """How a distributed tensor was laid out over the ranks, for a person: ``shard(0)``,
    ``replicate``; empty for a tensor each rank saved as its own."""
    return ",".join(meta.placements) if meta.placements else ""


def global_shape(meta: TensorMeta) -> tuple[int, ...]:
    """The shape of the whole tensor: the global one of a distributed tensor (a rank's
    manifest holds its chunk), else the tensor's own."""
    return meta.global_shape if meta.global_shape is not None else meta.shape
