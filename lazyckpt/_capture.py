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
import hashlib
import os
import re
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import crc32c
import torch

from ._arena import Block
from ._errors import ConfigurationError, ImmutabilityViolationError
from ._manifest import Manifest, Segment, ShardMeta
from ._options import CheckpointerOptions, compile_patterns
from ._tree import TensorRef

__all__ = [
    "CaptureBackend",
    "CaptureJob",
    "ChecksumPool",
    "CpuCapture",
    "EagerPolicy",
    "VerifyingCapture",
    "block_checksum",
    "block_digest",
    "check_versions",
    "default_checksum_threads",
    "optimizer_pointers",
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


def source_view(job: CaptureJob, seg: Segment) -> torch.Tensor:
    """The part of a source tensor that a segment covers (a view; no copy except for the
    rare non-contiguous tensor split flat)."""
    return job.manifest.tensor_part(seg, job.refs[seg.tensor].tensor.detach())


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
    for lo, hi in job.manifest.segment_gaps(job.shard):  # so that every byte is defined
        dest[lo:hi].zero_()
    for seg in job.shard.segments:
        job.manifest.shard_part(seg, dest).copy_(source_view(job, seg))
    check_versions(job)


def block_checksum(block: Block) -> int:
    """The crc32c of a block's bytes (a shard's, padding included). Blocking; the ``crc32c``
    package releases the GIL."""
    return crc32c.crc32c(block.memoryview())


def block_digest(block: Block) -> str:
    """The 128-bit content digest of a block's bytes, as incremental snapshots compare them:
    SHA-256 truncated to 128 bits, in hex. Blocking; ``hashlib`` releases the GIL.

    A cryptographic hash, not the crc32c: two different shards have the same crc32c with
    probability 2**-32, far too likely over millions of shard comparisons, and a crc32c
    collision is easy to make on purpose. SHA-256 is chosen over BLAKE2b for speed: x86
    (SHA-NI) and ARMv8 cores hash it in hardware, about twice BLAKE2b's rate here.
    """
    return hashlib.sha256(block.memoryview()).hexdigest()[:32]


def block_checksums(block: Block, digest: bool) -> tuple[int, str | None]:
    """The crc32c of a block and, with ``digest``, its :func:`block_digest`. Blocking."""
    crc = block_checksum(block)
    return crc, block_digest(block) if digest else None


def default_checksum_threads() -> int:
    """Half the cores, at most 8: a few cores' crc32c keep up with a device-to-host link
    (the figures: ``docs/design.md``, "Figures behind choices in the code"); the other half
    is left to training and I/O."""
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

    async def checksums(self, block: Block, digest: bool) -> tuple[int, str | None]:
        """The crc32c of the shard in ``block`` and, with ``digest``, its content digest
        (incremental snapshots), in one pass of the pool. Cancelling it as :meth:`checksum`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, block_checksums, block, digest)

    async def checksum_bytes(self, data: memoryview) -> int:
        """The crc32c of ``data`` (a shard read back from a tier, for a restore or a
        re-fetch): the ``Checksum`` the readers of ``_fetch`` take. Cancelling it leaves
        the thread to finish reading; it writes nothing."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, crc32c.crc32c, data)

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


# -- eager copies at snapshot() ----------------------------------------------------------------


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _pointer(t: Any) -> int | None:
    """The data pointer of a tensor, or of a DTensor's local chunk (None if it has none)."""
    if type(t) in _PLAIN:  # the usual case, without the slower lookups below
        return int(t.data_ptr())
    local = getattr(t, "_local_tensor", None)  # a DTensor: its chunk is what a ref holds
    if isinstance(local, torch.Tensor):
        t = local
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return int(t.data_ptr())
    except RuntimeError:  # a tensor without storage (meta, some wrappers)
        return None


def optimizer_pointers(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """The data pointers of every tensor the optimizers own: their parameters and their
    state (momentum, moments, step counters). Only ``optimizer.step()`` changes these, and a
    guard holds every step until the capture is done, so they can be captured lazily."""
    found: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                ptr = _pointer(p)
                if ptr:
                    found.add(ptr)
        for per_param in opt.state.values():
            if not isinstance(per_param, dict):
                continue
            for v in per_param.values():
                # LBFGS keeps lists of tensors (its history) in its state
                for item in v if isinstance(v, list | tuple) else (v,):
                    ptr = _pointer(item)
                    if ptr:
                        found.add(ptr)
    return found


@dataclass(frozen=True)
class EagerPolicy:
    """Which tensors ``snapshot()`` copies at once instead of leaving them to the capture.

    A tensor is copied at ``snapshot()`` (*eager*) when its key matches ``eager``, or when
    it is not owned by a guarded optimizer, is at most ``eager_bytes`` and its key does not
    match ``lazy``. Every other tensor is captured lazily. Patterns are shell-style
    (``fnmatch``) over the tensor's key (``"model/bn1.running_mean"``).
    """

    eager_bytes: int = 1 << 20
    eager: Sequence[str] = ()
    lazy: Sequence[str] = ()
    _eager_re: re.Pattern[str] | None = field(init=False, repr=False, compare=False)
    _lazy_re: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the options' own checks, so these three are validated in one place
        checked = CheckpointerOptions(
            eager_bytes=self.eager_bytes, eager=cast(Any, self.eager), lazy=cast(Any, self.lazy)
        )
        object.__setattr__(self, "eager", checked.eager)
        object.__setattr__(self, "lazy", checked.lazy)
        object.__setattr__(self, "_eager_re", compile_patterns(checked.eager, "eager"))
        object.__setattr__(self, "_lazy_re", compile_patterns(checked.lazy, "lazy"))

    def choose(self, refs: Sequence[TensorRef], owned: set[int]) -> list[int]:
        """Indexes of the refs to copy now (aliases follow the tensor they alias)."""
        chosen: list[int] = []
        eager_re, lazy_re, limit = self._eager_re, self._lazy_re, self.eager_bytes
        picked = [False] * len(refs)
        for i, ref in enumerate(refs):
            if ref.alias_of is not None:
                pick = picked[ref.alias_of]
            elif eager_re is not None and eager_re.match(ref.key):
                pick = True
            elif lazy_re is not None and lazy_re.match(ref.key):
                pick = False
            else:
                t = ref.tensor
                pick = (
                    t.numel() * t.element_size() <= limit and t.data_ptr() not in owned
                )
            if pick:
                picked[i] = True
                chosen.append(i)
        return chosen


def copy_eager(refs: Sequence[TensorRef], chosen: Sequence[int]) -> int:
    """Replace the chosen refs' tensors by copies taken now; return the bytes copied.

    On a GPU the copy is a device-side clone on the current stream: it is ordered after
    whatever wrote the tensor and before whatever changes it next, so it needs no wait. The
    copy has no other reference, so its capture can be as lazy as any other tensor's.
    """
    copied = 0
    for i in chosen:
        ref = refs[i]
        if ref.alias_of is not None:
            ref.tensor = refs[ref.alias_of].tensor
        else:
            ref.tensor = ref.tensor.detach().clone()
            copied += ref.tensor.numel() * ref.tensor.element_size()
        ref.copied = True
        try:
            ref.version = ref.tensor._version
        except (RuntimeError, AttributeError):  # a copy made in inference mode has none
            ref.version = None
    return copied


# -- verifying sources after their capture -------------------------------------------------


def _crc_of(t: torch.Tensor) -> int:
    """crc32c of a tensor's elements in row-major order (copied to the host if needed)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if flat.numel() == 0:
        return 0
    return int(crc32c.crc32c(flat.view(torch.uint8).numpy().data))


@dataclass
class _Pending:
    total: int
    done: int = 0
    failed: bool = False
    # (shard's segment, crc of the captured bytes) for every segment captured so far
    seen: list[tuple[CaptureJob, int, int]] = field(default_factory=list)


class VerifyingCapture:
    """Wraps a capture backend and checks, once the last shard of a snapshot is captured,
    that every source tensor still holds the bytes that were captured from it.

    A write that does not bump the version counter (through ``.data``, a numpy view, a
    custom kernel) is invisible to the version check. Re-reading each source after the whole
    snapshot is captured catches such a write that landed after part of the snapshot was
    copied: the torn case, where the snapshot would mix bytes from before and after it. A
    write that landed before the copy of everything it touched is read as the new value
    (consistent, but later than ``snapshot()``) and cannot be told from the original.
    Costs one more read and checksum of every captured byte, on the guard's path.
    """

    def __init__(self, inner: CaptureBackend, threads: int = 1) -> None:
        self.inner = inner
        self._pending: dict[int, _Pending] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="lazyckpt-verify"
        )

    async def capture(self, job: CaptureJob) -> None:
        step = job.manifest.step
        pending = self._pending.get(step)
        if pending is None:
            pending = self._pending[step] = _Pending(len(job.manifest.shards))
        loop = asyncio.get_running_loop()
        try:
            await self.inner.capture(job)
            crcs = await loop.run_in_executor(self._pool, _segment_crcs, job)
            pending.seen.extend((job, k, crc) for k, crc in enumerate(crcs))
        except BaseException:
            pending.failed = True
            raise
        finally:
            pending.done += 1
            last = pending.done == pending.total
            if last:
                del self._pending[step]
        if last and not pending.failed:
            found = await loop.run_in_executor(self._pool, _first_changed, pending.seen)
            if found is not None:
                raise ImmutabilityViolationError.changed_bytes(found, step)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.inner.close()


def _segment_crcs(job: CaptureJob) -> list[int]:
    view = job.block.memoryview()
    out = []
    for seg in job.shard.segments:
        nbytes = job.manifest.segment_nbytes(seg)
        out.append(int(crc32c.crc32c(view[seg.offset : seg.offset + nbytes])))
    return out


def _first_changed(seen: Sequence[tuple[CaptureJob, int, int]]) -> str | None:
    for job, k, crc in seen:
        seg = job.shard.segments[k]
        if _crc_of(source_view(job, seg)) != crc:
            return job.refs[seg.tensor].key
    return None
