"""Reading stored shards back, verified: the one path every reader of a snapshot takes.

A restore (eager, lazy, resharding, or straight into device tensors), ``verify()``, the
engine's re-fetch of an evicted shard and the command line all read a shard the same way:
from one tier (:func:`read_copy`), or from the first of several tiers that holds a good
copy (:func:`read_verified`, or :func:`lend_verified` for a tier that lends its blocks),
checking its crc32c against the manifest (computed while reading, by a tier that can:
``SupportsChecksummedRead``). Which tier is tried next is the restore state
table's decision (``_tiering.states.RESTORE_TABLE``): PENDING, READING, then VERIFIED, or PENDING
again after a bad copy, or EXHAUSTED when no tier is left, which raises a
:class:`CorruptionError` naming the shard's tensors and every tier tried.

Where a step is found is decided here too: :func:`committed_steps` lists every tier,
:func:`find_step` picks the step (the latest when none is asked for, :func:`latest_step`)
and the tiers holding it, fastest first.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TypeVar, cast

import crc32c
import torch

from .._errors import CorruptionError, SnapshotNotFoundError, TierError
from .._format.entries import ShardMeta
from .._format.manifest import Manifest
from .._tiering.arena import Block
from .._tiering.interface import SupportsBlockRead, SupportsChecksummedRead, Tier, reads_checksummed
from .._tiering.states import RestoreEvent, RestoreState, advance_restore

__all__ = [
    "Checksum",
    "ReadShard",
    "byte_view",
    "check_copy",
    "committed_steps",
    "find_step",
    "latest_step",
    "lend_verified",
    "read_copy",
    "read_verified",
    "shard_keys",
    "thread_checksum",
]

_T = TypeVar("_T")

Checksum = Callable[[memoryview], Awaitable[int]]
"""Computes the crc32c of a shard's bytes off the event loop (the Checkpointer's checksum
pool; :func:`thread_checksum` for tools without one)."""

ReadShard = Callable[[Tier, memoryview], Awaitable[None]]
"""Reads one tier's copy of the shard into the buffer (the engine wraps ``read_shard`` in
its deadline and retries)."""


async def thread_checksum(data: memoryview) -> int:
    """The crc32c of ``data`` on a worker thread (``crc32c`` releases the GIL)."""
    return await asyncio.to_thread(crc32c.crc32c, data)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview, without a copy."""
    array = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]


def shard_keys(manifest: Manifest, shard: ShardMeta) -> str:
    """The keys a shard holds, for a message (the first four and a count)."""
    keys = [manifest.tensors[s.tensor].key for s in shard.segments]
    shown = ", ".join(repr(k) for k in keys[:4])
    return shown + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def check_copy(manifest: Manifest, shard: ShardMeta, crc: int, tier: str) -> None:
    """Raise :class:`CorruptionError` unless ``crc`` is the checksum the manifest records for
    ``shard`` (a manifest recording none is damaged: every committed shard has one)."""
    if shard.crc32c is None:
        raise CorruptionError(
            f"tier {tier!r}: shard {shard.index} of rank {manifest.rank}, step "
            f"{manifest.step} has no checksum in its manifest ({shard_keys(manifest, shard)})"
        )
    if crc != shard.crc32c:
        raise CorruptionError(
            f"tier {tier!r}: shard {shard.index} of rank {manifest.rank}, step "
            f"{manifest.step} fails its checksum: checksum mismatch (manifest "
            f"{shard.crc32c:08x}, data {crc:08x}; holds {shard_keys(manifest, shard)})"
        )


async def read_copy(
    manifest: Manifest,
    shard: ShardMeta,
    tier: Tier,
    out: memoryview,
    *,
    checksum: Checksum = thread_checksum,
    read: ReadShard | None = None,
) -> None:
    """Read ``tier``'s copy of ``shard`` into ``out`` (exactly ``shard.length`` bytes) and
    check it. Raises :class:`CorruptionError` for a bad or missing copy, the tier's
    :class:`TierError` when the tier fails.

    A tier that checksums while it reads (:class:`SupportsChecksummedRead`) returns the
    crc32c of the bytes as they landed in ``out``, piece by piece while they are in the
    cache: one pass over the bytes instead of two (where the class defining that read also
    defines the ``read_shard`` in effect: a subclass overriding ``read_shard`` alone keeps
    it in use). Any other tier's copy is checksummed
    afterwards by ``checksum``. A caller's own ``read`` (the engine's deadline and retries)
    takes the second way."""
    if read is not None:
        await read(tier, out)
    elif reads_checksummed(tier):
        assert isinstance(tier, SupportsChecksummedRead)
        crc = await tier.read_shard_checksummed(manifest, shard, out)
        check_copy(manifest, shard, crc, tier.name)
        return
    else:
        await tier.read_shard(manifest, shard, out)
    check_copy(manifest, shard, await checksum(out), tier.name)


async def _first_good(
    manifest: Manifest,
    shard: ShardMeta,
    sources: Sequence[Tier],
    attempt: Callable[[Tier], Awaitable[_T]],
    problems: list[Exception],
) -> _T:
    """What ``attempt`` returns for the first tier of ``sources`` with a good copy; the
    restore state table decides when to try the next tier and when to give up."""
    remaining = iter(sources)
    state = RestoreState.PENDING
    tier: Tier | None = None
    found: _T | None = None
    while True:
        if state is RestoreState.VERIFIED:
            return cast(_T, found)
        if state is RestoreState.EXHAUSTED:
            tried = [t.name for t in sources]
            raise CorruptionError(
                f"step {manifest.step}: no tier holds a good copy of shard {shard.index} of "
                f"rank {manifest.rank} ({shard_keys(manifest, shard)}); tried {tried}"
                + (": " + "; ".join(str(p) for p in problems[-3:]) if problems else "")
            )
        if state is RestoreState.PENDING:
            tier = next(remaining, None)
            event = RestoreEvent.NO_MORE_TIERS if tier is None else RestoreEvent.START_READ
        else:  # READING
            assert tier is not None
            try:
                found = await attempt(tier)
                event = RestoreEvent.CHECKSUM_OK
            except (CorruptionError, TierError) as exc:
                problems.append(exc)
                event = RestoreEvent.BAD_COPY
        state = advance_restore(state, event)


async def read_verified(
    manifest: Manifest,
    shard: ShardMeta,
    sources: Sequence[Tier],
    out: memoryview,
    *,
    checksum: Checksum = thread_checksum,
    problems: list[Exception] | None = None,
    read: ReadShard | None = None,
) -> Tier:
    """Fill ``out`` with the first copy of ``shard`` whose crc32c matches, trying the tiers
    of ``sources`` in order; return the tier it came from.

    Each bad copy or failing tier is appended to ``problems``. Raises
    :class:`CorruptionError` when no tier has a good copy.
    """
    found = [] if problems is None else problems

    async def attempt(tier: Tier) -> Tier:
        await read_copy(manifest, shard, tier, out, checksum=checksum, read=read)
        return tier

    return await _first_good(manifest, shard, sources, attempt, found)


@contextlib.asynccontextmanager
async def lend_verified(
    manifest: Manifest,
    shard: ShardMeta,
    sources: Sequence[Tier],
    *,
    buffer: Callable[[int], torch.Tensor],
    checksum: Checksum = thread_checksum,
    problems: list[Exception] | None = None,
) -> AsyncIterator[torch.Tensor]:
    """``async with``: the bytes of the first good copy of ``shard`` among ``sources``, as a
    uint8 tensor, for the block of the ``with`` statement.

    A tier that lends its blocks (:class:`SupportsBlockRead`: the host tier's pinned arena)
    is read without a copy, and its block is given back when the block of the ``with``
    statement ends; any other tier is read into ``buffer(shard.length)`` (a contiguous
    uint8 CPU tensor). Raises :class:`CorruptionError` when no tier has a good copy.
    """
    found = [] if problems is None else problems

    async def attempt(tier: Tier) -> tuple[torch.Tensor, Block | None, Tier]:
        borrowed = tier.borrow_shard(manifest, shard) if isinstance(tier, SupportsBlockRead) else None
        try:
            if borrowed is not None:
                data = borrowed.tensor()
                check_copy(manifest, shard, await checksum(byte_view(data)), tier.name)
            else:
                data = buffer(shard.length)
                await read_copy(manifest, shard, tier, byte_view(data), checksum=checksum)
        except BaseException:
            if borrowed is not None:
                cast(SupportsBlockRead, tier).return_shard(borrowed)
            raise
        return data, borrowed, tier

    data, borrowed, lender = await _first_good(manifest, shard, sources, attempt, found)
    try:
        yield data
    finally:
        if borrowed is not None:
            cast(SupportsBlockRead, lender).return_shard(borrowed)


async def committed_steps(tiers: Sequence[Tier]) -> dict[str, list[int]]:
    """Committed steps per tier; a tier that fails to list is left out."""
    results = await asyncio.gather(*(t.steps() for t in tiers), return_exceptions=True)
    listing: dict[str, list[int]] = {}
    for tier, result in zip(tiers, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result
            continue
        listing[tier.name] = result
    return listing


def latest_step(steps: Iterable[int], where: str) -> int:
    """The newest of ``steps``; :class:`SnapshotNotFoundError` naming ``where`` if none."""
    newest = max(steps, default=None)
    if newest is None:
        raise SnapshotNotFoundError(f"no committed snapshot on {where}")
    return newest


async def find_step(tiers: Sequence[Tier], step: int | None) -> tuple[int, list[Tier]]:
    """``step`` (the latest committed on any tier when None) and the tiers that list it as
    committed, fastest first. Raises :class:`SnapshotNotFoundError` when none does."""
    listing = await committed_steps(tiers)
    everywhere = sorted({s for steps in listing.values() for s in steps})
    if step is None:
        step = latest_step(everywhere, f"any tier ({[t.name for t in tiers]})")
    holders = [t for t in tiers if step in listing.get(t.name, [])]
    if not holders:
        raise SnapshotNotFoundError(
            f"step {step} is not committed on any tier; committed steps: {everywhere[-10:]}"
        )
    return step, holders
