"""Writing a snapshot's shards to a tier from the command line (``import``, ``copy``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import crc32c

from .._errors import CorruptionError
from .._manifest import Manifest, ShardMeta
from .._tier import Tier
from ._console import Console
from ._read import ShardReader, damage_keys


async def put_all(
    tier: Tier,
    manifest: Manifest,
    fill: Callable[[Manifest, ShardMeta, memoryview], None] | None,
    reader: ShardReader | None,
    ui: Console,
    label: str,
    jobs: int,
) -> list[int]:
    """Write every shard to ``tier`` (from ``fill`` or from ``reader``); their crc32c."""
    crcs = [0] * len(manifest.shards)
    with ui.progress(sum(s.length for s in manifest.shards), label) as bar:
        if reader is not None:
            async for read in reader:
                if read.error is not None or read.data is None:
                    keys = ", ".join(damage_keys(manifest, read.shard))
                    raise CorruptionError(
                        f"{reader.tier.name}: step {manifest.step}, shard {read.shard.index} "
                        f"({keys}): {read.error}; nothing was copied"
                    )
                await tier.put_shard(manifest, read.shard, read.data)
                crcs[read.shard.index] = read.shard.crc32c or 0
                bar.advance(read.shard.length)
            return crcs
        assert fill is not None
        sem = asyncio.Semaphore(max(1, jobs))

        async def one(shard: ShardMeta) -> None:
            async with sem:
                buffer = bytearray(shard.length)
                view = memoryview(buffer)
                await asyncio.to_thread(fill, manifest, shard, view)
                crcs[shard.index] = await asyncio.to_thread(crc32c.crc32c, view)
                await tier.put_shard(manifest, shard, view)
                bar.advance(shard.length)

        try:
            async with asyncio.TaskGroup() as tg:
                for shard in manifest.shards:
                    tg.create_task(one(shard))
        except ExceptionGroup as group:
            raise first_error(group) from None
    return crcs


def first_error(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first failure of a task group, so it is reported like any other error."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


@contextlib.asynccontextmanager
async def writing(tier: Tier, manifest: Manifest) -> AsyncIterator[None]:
    """``begin`` … ``commit`` on a tier; anything that stops it early aborts the step."""
    await tier.begin(manifest)
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.shield(tier.abort(manifest.step))
        raise
