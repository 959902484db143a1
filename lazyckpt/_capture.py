"""Capture backends: how a shard's bytes get from the source tensors into a host block;
and the checksum stage that follows them.

The engine calls ``await backend.capture(job)``; it returns once the shard's bytes are in
its block and no copy writes there any more. This is the seam where the CUDA path plugs in
(``_cuda.py``: a side-stream device-to-host copy whose completion event the scheduler
polls); the CPU path copies in a bounded thread pool (torch's ``copy_`` releases the GIL).
Either way the version counters are checked *after* the copy: a tensor changed in place
before its capture finished fails the snapshot with :class:`ImmutabilityViolationError`.

The crc32c is not part of the capture. The training loop waits (in the guard) for captures
only, so anything a capture does is on the training's critical path; the checksum is not
needed until a tier takes the shard. :class:`ChecksumPool` computes it afterwards, from the
host block (so a source changed after the capture cannot reach the checksum), on a pool of
its own: the checksum of one shard runs while the next shard is copied, on several threads
where a device-to-host link moves more than one core can checksum. On Linux the pool's
threads run at a lower scheduling priority (nice +10): where cores are idle (a GPU host)
that changes nothing, and where the copy or the training needs every core (a CPU-only
machine) the checksums wait for a free moment instead of slowing what the guard waits for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import crc32c
import torch

from ._arena import Block
from ._errors import ConfigurationError, ImmutabilityViolationError
from ._manifest import Manifest, ShardMeta
from ._tree import TensorRef

__all__ = [
    "CaptureBackend",
    "CaptureJob",
    "ChecksumPool",
    "CpuCapture",
    "block_checksum",
    "check_versions",
    "default_checksum_threads",
    "source_view",
]

@dataclass
class CaptureJob:
    """One shard to capture: where its pieces come from and the block they go to."""

    manifest: Manifest
    shard: ShardMeta
    refs: Sequence[TensorRef]
    block: Block


class CaptureBackend(Protocol):
    """Copies a shard into host memory (no checksum: :class:`ChecksumPool` does that)."""

    async def capture(self, job: CaptureJob) -> None: ...

    def close(self) -> None: ...


def source_view(job: CaptureJob, tensor_index: int, start: int, stop: int) -> torch.Tensor:
    """The part of a source tensor that a segment covers (a view; no copy except for the
    rare non-contiguous tensor split flat)."""
    meta = job.manifest.tensors[tensor_index]
    src = job.refs[tensor_index].tensor.detach()
    if meta.mode == "rows":
        return src[start:stop]
    if meta.mode == "flat":
        return src.reshape(-1)[start:stop]
    return src


def check_versions(job: CaptureJob) -> None:
    """Raise if any source tensor of the shard changed since ``snapshot()`` recorded it."""
    for seg in job.shard.segments:
        ref = job.refs[seg.tensor]
        if ref.version is None:
            continue
        found = ref.tensor._version
        if found != ref.version:
            raise ImmutabilityViolationError(ref.key, job.manifest.step, ref.version, found)


def copy_into_block(job: CaptureJob) -> None:
    """Copy every segment of the shard into its block and zero the bytes between them, then
    check the version counters. Blocking."""
    dest = job.block.tensor()
    cursor = 0
    for seg in job.shard.segments:
        if seg.offset > cursor:  # alignment gap in a pack: zero it so the bytes are defined
            dest[cursor : seg.offset].zero_()
        meta = job.manifest.tensors[seg.tensor]
        shape = job.manifest.segment_shape(seg)
        nbytes = job.manifest.segment_nbytes(seg)
        src = source_view(job, seg.tensor, seg.start, seg.stop)
        dest[seg.offset : seg.offset + nbytes].view(meta.torch_dtype).view(shape).copy_(src)
        cursor = seg.offset + nbytes
    if cursor < job.shard.length:
        dest[cursor : job.shard.length].zero_()
    check_versions(job)


def block_checksum(block: Block) -> int:
    """The crc32c of a block's bytes (a shard's, padding included). Blocking; the ``crc32c``
    package releases the GIL."""
    return crc32c.crc32c(block.memoryview())


def default_checksum_threads() -> int:
    """Half the cores, at most 8: crc32c runs at 10-20 GB/s per core, and a PCIe 5
    device-to-host copy moves about 50 GB/s; the other half is left to training and I/O."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _lower_priority(niceness: int) -> None:
    """Lower the calling thread's scheduling priority by ``niceness`` (Linux: the nice value
    is per thread there; elsewhere it is per process, so nothing is changed)."""
    if niceness <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # a sandbox may refuse; the checksums still run
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + niceness))


class ChecksumPool:
    """Computes shards' crc32c from their host blocks on a bounded pool of its own.

    Args:
        threads: pool threads; ``None``: :func:`default_checksum_threads`.
        niceness: how much lower than the process the pool's threads are scheduled (Linux
            only; 0: the same). See the module docstring.
    """

    def __init__(self, threads: int | None = None, *, niceness: int = 10) -> None:
        self.threads = default_checksum_threads() if threads is None else threads
        if self.threads < 1:
            raise ConfigurationError(f"checksum threads must be at least 1, got {threads}")
        if niceness < 0:
            raise ConfigurationError(f"niceness must not be negative, got {niceness}")
        self.niceness = niceness
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.threads,
            thread_name_prefix="lazyckpt-checksum",
            initializer=_lower_priority,
            initargs=(niceness,),
        )

    async def checksum(self, block: Block) -> int:
        """The crc32c of the shard in ``block``. Cancelling it leaves the thread to finish
        reading the block; it writes nothing."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, block_checksum, block)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CpuCapture:
    """Copies on a bounded thread pool; right for CPU tensors (and a fallback for others)."""

    def __init__(self, threads: int = 1) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="lazyckpt-capture"
        )

    async def capture(self, job: CaptureJob) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, copy_into_block, job)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
