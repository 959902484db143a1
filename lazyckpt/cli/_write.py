"""Writing a snapshot to a tier from the command line (``import``, ``copy``).

Every call on the tier (``begin``, each ``put_shard``, ``commit``, ``abort``) goes through the
engine's own :func:`~lazyckpt._tiering.calls.call_tier`, so a command writes under the same deadline,
retries and error translation as a Checkpointer with default options does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import TypeVar

import crc32c

from .._errors import CorruptionError, first_error
from .._format.entries import ShardMeta
from .._format.manifest import Manifest
from .._options import CheckpointerOptions
from .._tiering.calls import RetryPolicy, call_tier
from .._tiering.interface import Tier
from ._console import Console
from ._read import ShardReader, damage_keys

T = TypeVar("T")

# A Checkpointer's defaults: a command is as patient with a tier as training is.
DEFAULT_POLICY: RetryPolicy = CheckpointerOptions()


class SnapshotWrite:
    """One snapshot being written to a tier; made by :func:`writing`.

    Attributes:
        tier: the tier written to.
        manifest: the snapshot's plan (its ``step`` is the one written).
        policy: the deadline and retries of every call on the tier.
    """

    def __init__(self, tier: Tier, manifest: Manifest, policy: RetryPolicy) -> None:
        self.tier = tier
        self.manifest = manifest
        self.policy = policy

    async def call(self, what: str, call: Callable[[], Awaitable[T]], *, retry: bool = True) -> T:
        """Run one operation on the tier under the policy (see ``call_tier``)."""
        return await call_tier(self.tier.name, what, call, self.policy, retry=retry)

    async def put(self, shard: ShardMeta, data: memoryview) -> None:
        """Store one shard's bytes (retried on a transient failure)."""
        await self.call(
            f"put shard {shard.index} of step {self.manifest.step}",
            partial(self.tier.put_shard, self.manifest, shard, data),
        )

    async def commit(self, manifest: Manifest) -> None:
        """Make the step visible, with ``manifest`` (the plan with checksums and extras)."""
        await self.call(f"commit step {manifest.step}", partial(self.tier.commit, manifest))


@contextlib.asynccontextmanager
async def writing(
    tier: Tier, manifest: Manifest, policy: RetryPolicy = DEFAULT_POLICY
) -> AsyncIterator[SnapshotWrite]:
    """``begin`` … ``commit`` on a tier; anything that stops it early aborts the step."""
    write = SnapshotWrite(tier, manifest, policy)
    await write.call(f"begin step {manifest.step}", partial(tier.begin, manifest))
    try:
        yield write
    except BaseException:
        # shielded: an interrupted command still removes what it wrote
        with contextlib.suppress(Exception):
            await asyncio.shield(
                write.call(f"abort step {manifest.step}", partial(tier.abort, manifest.step))
            )
        raise


async def delete_step(tier: Tier, step: int, policy: RetryPolicy = DEFAULT_POLICY) -> None:
    """Un-commit, then remove, a step (``gc``, a copy that read back wrong), as the engine's
    retention deletes: under the deadline, with retries."""
    await call_tier(tier.name, f"delete step {step}", partial(tier.delete, step), policy)


async def put_all(
    write: SnapshotWrite,
    fill: Callable[[Manifest, ShardMeta, memoryview], None] | None,
    reader: ShardReader | None,
    ui: Console,
    label: str,
    jobs: int,
) -> list[int]:
    """Write every shard (from ``fill`` or from ``reader``); their crc32c.

    ``fill`` copies a shard's bytes into a buffer (blocking; run on a thread), up to ``jobs``
    shards at once. ``reader`` reads them from another tier, checked: a damaged shard stops
    the write with :class:`CorruptionError` before anything is committed.
    """
    manifest = write.manifest
    crcs = [0] * len(manifest.shards)
    with ui.progress(sum(s.length for s in manifest.shards), label) as bar:
        if reader is not None:
            async for read in reader:
                if read.error is not None or read.data is None:
                    keys = ", ".join(damage_keys(manifest, read.shard))
                    who = f", rank {manifest.rank}" if manifest.world_size > 1 else ""
                    raise CorruptionError(
                        f"{reader.tier.name}: step {manifest.step}{who}, shard {read.shard.index} "
                        f"({keys}): {read.error}; the step was not copied"
                    )
                await write.put(read.shard, read.data)
                crcs[read.shard.index] = read.shard.crc32c or 0
                bar.advance(read.shard.length)
            return crcs
        if fill is None:
            raise TypeError("put_all needs fill or reader")
        sem = asyncio.Semaphore(max(1, jobs))

        async def one(shard: ShardMeta) -> None:
            async with sem:
                buffer = bytearray(shard.length)
                view = memoryview(buffer)
                await asyncio.to_thread(fill, manifest, shard, view)
                crcs[shard.index] = await asyncio.to_thread(crc32c.crc32c, view)
                await write.put(shard, view)
                bar.advance(shard.length)

        try:
            async with asyncio.TaskGroup() as tg:
                for shard in manifest.shards:
                    tg.create_task(one(shard))
        except ExceptionGroup as group:
            raise first_error(group) from None
    return crcs
