"""Capture backends: how a shard's bytes get from the source tensors into a host block.

The engine calls ``await backend.capture(job)`` and gets the shard's crc32c back. This is
the seam where the CUDA path plugs in (``_cuda.py``: a side-stream device-to-host copy whose
completion event the scheduler polls); the CPU path copies in a bounded thread pool (torch's
``copy_`` releases the GIL).

Either way the checksum is computed piece by piece right after each piece is copied, while
it is still in cache: no second pass over the data. And either way the version counters are
checked *after* the copy: a tensor changed in place before its capture finished fails the
snapshot with :class:`ImmutabilityViolationError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import crc32c
import torch

from ._arena import Block
from ._errors import ImmutabilityViolationError
from ._manifest import Manifest, ShardMeta
from ._tree import TensorRef

__all__ = ["CaptureBackend", "CaptureJob", "CpuCapture", "check_versions", "source_view"]

PIECE_BYTES = 4 << 20


@dataclass
class CaptureJob:
    """One shard to capture: where its pieces come from and the block they go to."""

    manifest: Manifest
    shard: ShardMeta
    refs: Sequence[TensorRef]
    block: Block


class CaptureBackend(Protocol):
    """Copies a shard into host memory and returns its crc32c."""

    async def capture(self, job: CaptureJob) -> int: ...

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


def copy_into_block(job: CaptureJob) -> int:
    """Copy every segment of the shard into its block; return the crc32c. Blocking."""
    dest = job.block.tensor()
    view = job.block.memoryview()
    crc = 0
    cursor = 0
    for seg in job.shard.segments:
        if seg.offset > cursor:  # alignment gap in a pack: zero it so the bytes are defined
            dest[cursor : seg.offset].zero_()
            crc = crc32c.crc32c(view[cursor : seg.offset], value=crc)
        meta = job.manifest.tensors[seg.tensor]
        dtype = meta.torch_dtype
        shape = job.manifest.segment_shape(seg)
        nbytes = job.manifest.segment_nbytes(seg)
        src = source_view(job, seg.tensor, seg.start, seg.stop)
        out = dest[seg.offset : seg.offset + nbytes].view(dtype).view(shape)
        if len(shape) >= 1 and shape[0] > 1 and nbytes > PIECE_BYTES:
            row_bytes = nbytes // shape[0]
            rows = max(1, PIECE_BYTES // row_bytes)
            for r in range(0, shape[0], rows):
                out[r : r + rows].copy_(src[r : r + rows])
                lo = seg.offset + r * row_bytes
                hi = seg.offset + min(shape[0], r + rows) * row_bytes
                crc = crc32c.crc32c(view[lo:hi], value=crc)
        else:
            out.copy_(src)
            crc = crc32c.crc32c(view[seg.offset : seg.offset + nbytes], value=crc)
        cursor = seg.offset + nbytes
    if cursor < job.shard.length:
        dest[cursor : job.shard.length].zero_()
        crc = crc32c.crc32c(view[cursor : job.shard.length], value=crc)
    check_versions(job)
    return crc


class CpuCapture:
    """Copies on a bounded thread pool; right for CPU tensors (and a fallback for others)."""

    def __init__(self, threads: int = 1) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="lazyckpt-capture"
        )

    async def capture(self, job: CaptureJob) -> int:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, copy_into_block, job)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
