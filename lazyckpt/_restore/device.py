"""Restoring straight into device tensors: verified host copies, then host-to-device
copies on a side stream per device, their completion polled."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import cast

import torch

from .._capture.cuda.device import (
    DeviceRuntime,
    EventLike,
    PollOptions,
    Sleep,
    StreamLike,
    TorchCudaRuntime,
    in_pool,
    wait_all_regardless,
)
from .._errors import first_error
from .._format.entries import Segment, ShardMeta
from .._format.manifest import Manifest
from .._tiering.interface import Tier
from .fetch import Checksum, lend_verified, thread_checksum

__all__ = ["restore_into"]


def _host_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(src)


async def restore_into(
    manifest: Manifest,
    sources: Sequence[Tier],
    targets: Sequence[torch.Tensor | None],
    *,
    concurrency: int = 4,
    runtime: DeviceRuntime | None = None,
    poll: PollOptions | None = None,
    sleep: Sleep | None = None,
    checksum: Checksum = thread_checksum,
) -> None:
    """Fill ``targets[i]`` (tensor ``i`` of the manifest; None: skip it) in place.

    Each shard is read from the first tier of ``sources`` with a copy whose crc32c matches
    (``checksum`` computes it), falling back tier by tier (``_restore.fetch.lend_verified``). A tier
    that lends its blocks (:class:`SupportsBlockRead`, the pinned host arena) is read without
    copying; others are read into a pinned bounce buffer.
    Device targets are then filled by host-to-device copies on a side stream per device that
    first waits for the current stream (on this thread) of that device, and this coroutine
    returns once those copies are complete (polled, never blocking): whatever the caller
    issues next sees the restored values. Work on other streams that still uses the targets
    must be synchronized by the caller first.

    Raises :class:`CorruptionError` when no tier holds a good copy of some shard. Cancelling
    it may leave the targets partly restored; it returns only once no copy runs.
    """
    rt: DeviceRuntime = runtime if runtime is not None else TorchCudaRuntime()
    streams: dict[int, StreamLike] = {}
    # a flat-split tensor that is not contiguous has no writable flat view: fill a twin
    twins: dict[int, torch.Tensor] = {}
    work: list[torch.Tensor | None] = list(targets)
    for i, meta in enumerate(manifest.tensors):
        target = targets[i] if i < len(targets) else None
        if target is not None and meta.mode == "flat" and not target.is_contiguous():
            twins[i] = torch.empty(meta.shape, dtype=meta.torch_dtype, device=target.device)
            work[i] = twins[i]

    def stream_for(device: int) -> StreamLike:
        if device not in streams:
            streams[device] = rt.side_stream(device)
        return streams[device]

    def enqueue(
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], events: list[EventLike]
    ) -> None:
        by_device: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dst, src in pairs:
            by_device.setdefault(rt.device_of(dst), []).append((dst, src))
        for device, group in by_device.items():
            stream = stream_for(device)
            producer = rt.current_stream(device)
            event = rt.new_event()
            with rt.using(stream):
                stream.wait_stream(producer)
                try:
                    for dst, src in group:
                        rt.copy(dst, src)
                finally:
                    event.record(stream)
                    events.append(event)

    async def scatter(segs: Sequence[Segment], data: torch.Tensor) -> None:
        device_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        host_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for seg in segs:
            target = work[seg.tensor]
            assert target is not None
            pair = (manifest.tensor_part(seg, target), manifest.shard_part(seg, data))
            (device_pairs if rt.is_device(target) else host_pairs).append(pair)
        events: list[EventLike] = []
        try:
            enqueue(device_pairs, events)
            if host_pairs:
                await in_pool(None, _host_copies, host_pairs)
        finally:
            await wait_all_regardless(events, poll, sleep)

    problems: list[Exception] = []

    async def one(shard: ShardMeta) -> None:
        segs = [s for s in shard.segments if s.tensor < len(work) and work[s.tensor] is not None]
        if not segs:
            return
        async with lend_verified(
            manifest, shard, sources, buffer=rt.host_buffer, checksum=checksum, problems=problems
        ) as data:
            await scatter(segs, data)

    sem = asyncio.Semaphore(max(1, concurrency))

    async def bounded(shard: ShardMeta) -> None:
        async with sem:
            await one(shard)

    try:
        async with asyncio.TaskGroup() as tg:
            for shard in manifest.shards:
                tg.create_task(bounded(shard))
    except ExceptionGroup as group:
        raise first_error(group) from None
    if twins:
        pairs = [(cast(torch.Tensor, targets[i]), twin) for i, twin in twins.items()]
        device_pairs = [p for p in pairs if rt.is_device(p[0])]
        events: list[EventLike] = []
        try:
            enqueue(device_pairs, events)
            _host_copies([p for p in pairs if not rt.is_device(p[0])])
        finally:
            await wait_all_regardless(events, poll, sleep)
