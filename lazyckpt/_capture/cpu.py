"""Capture backends: how a shard's bytes get from the source tensors into a host block;
and the checksum stage that follows them.

The engine calls ``await backend.capture(job)``; it returns once the shard's bytes are in
its block and no copy writes there any more. This is the seam where the CUDA path plugs in
(``_capture.cuda``: a side-stream device-to-host copy whose completion event the scheduler
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
import ctypes
import hashlib
import os
import re
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, runtime_checkable

import crc32c
import torch

from .._errors import ConfigurationError, ImmutabilityViolationError
from .._format.entries import Segment, ShardMeta
from .._format.manifest import Manifest
from .._format.walk import TensorRef
from .._options import CheckpointerOptions, compile_patterns
from .._tiering.arena import Block

__all__ = [
    "BatchCapture",
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


@runtime_checkable
class BatchCapture(Protocol):
    """A backend that also copies several shards in one go (one pool job, one wake-up of
    the engine loop), which is what keeps the pipeline's takes of the interpreter lock few
    per GiB (see :meth:`CpuCapture.capture_batch`)."""

    async def capture_batch(self, jobs: Sequence[CaptureJob]) -> None: ...


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
    copy_into_blocks([job])


def copy_into_blocks(jobs: Sequence[CaptureJob]) -> None:
    """Copy every segment of several shards into their blocks, zero the bytes between the
    segments, then check each shard's version counters. Blocking.

    A launch-bound training thread pays for every time this thread takes the interpreter
    lock back (docs/design.md, "Staying out of the training thread's way"), and a torch
    view costs two to six such takes (the call releases the lock, and the view's Python
    object is referenced and released from inside it). So a segment of a plain contiguous
    CPU tensor is copied by address, with no torch call: a small one (up to
    :data:`_LOCKED_COPY_BYTES`) by a memoryview assignment, which keeps the lock for the
    few microseconds of its ``memcpy``; a larger one by one ``memmove`` that releases it
    (one for the consecutive chunks of a tensor that land in consecutive blocks). Every other segment (a device tensor, a subclass, a non-contiguous tensor, a complex
    or negated view, a shape that no longer matches the manifest: whatever the address
    arithmetic cannot vouch for) is copied as before, by torch, in one
    ``torch._foreach_copy_`` for the batch, which also raises what torch raises.
    """
    dests: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    moves: list[list[int]] = []  # [dest, source, bytes]: lock-free copies, adjacent ones joined
    for job in jobs:
        block = job.block
        view = block.memoryview()
        base = _address(block)
        for lo, hi in job.manifest.segment_gaps(job.shard):  # so that every byte is defined
            _zero(view, base, lo, hi)
        for seg in job.shard.segments:
            nbytes = job.manifest.segment_nbytes(seg)
            if not nbytes:
                continue
            src = _source_address(job, seg, nbytes)
            if src is None:  # torch copies it (and raises what it raises)
                dest = block.tensor()
                dests.append(job.manifest.shard_part(seg, dest))
                srcs.append(source_view(job, seg))
            elif nbytes <= _LOCKED_COPY_BYTES:
                view[seg.offset : seg.offset + nbytes] = _bytes_at(src, nbytes)
            elif (
                moves
                and moves[-1][0] + moves[-1][2] == base + seg.offset
                and moves[-1][1] + moves[-1][2] == src
            ):
                moves[-1][2] += nbytes  # the next rows of a tensor, into the next block
            else:
                moves.append([base + seg.offset, src, nbytes])
    for dest_address, src_address, nbytes in moves:
        ctypes.memmove(dest_address, src_address, nbytes)
    if dests:
        torch._foreach_copy_(dests, srcs)
    for job in jobs:
        check_versions(job)


# Up to this many bytes a segment is copied without releasing the interpreter lock: a few
# microseconds of memcpy, less than what handing the lock over and back costs the training
# thread; above it, one lock-free memmove.
_LOCKED_COPY_BYTES = 64 << 10
_ZEROS = bytes(_LOCKED_COPY_BYTES)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_BY_ADDRESS_MODES = ("pack", "rows", "flat")


def _address(block: Block) -> int:
    """The address of a block's first byte (the arena's tensor is contiguous)."""
    return int(block.arena.tensor.data_ptr()) + block.offset


def _zero(view: memoryview, base: int, lo: int, hi: int) -> None:
    n = hi - lo
    if n <= _LOCKED_COPY_BYTES:
        view[lo:hi] = _ZEROS[:n]
    else:
        ctypes.memset(base + lo, 0, n)


def _bytes_at(address: int, nbytes: int) -> memoryview:
    """A read-only byte view of ``nbytes`` at ``address`` (no copy, no torch call)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _source_address(job: CaptureJob, seg: Segment, nbytes: int) -> int | None:
    """The address of a segment's bytes in its source tensor, where copying them by
    address gives exactly what ``copy_`` of :func:`source_view` would; else None.

    Only attribute reads here (``data_ptr``, ``shape``, ``dtype``, ``is_contiguous``,
    ``_base``), none of which releases the interpreter lock; ``is_neg()`` does, so it is
    asked of views only (the negative bit is set by making a view).
    """
    t = job.refs[seg.tensor].tensor
    meta = job.manifest.tensors[seg.tensor]
    if (
        type(t) not in _PLAIN_TYPES
        or meta.mode not in _BY_ADDRESS_MODES
        or t.device.type != "cpu"
        or t.layout != torch.strided
        or t.dtype != meta.torch_dtype
        or t.dtype.is_complex  # a conjugate view's bytes are not its values
        or tuple(t.shape) != meta.shape
        or not t.is_contiguous()
        or (t._base is not None and t.is_neg())
    ):
        return None
    offset, length = job.manifest.segment_span(seg)
    if length != nbytes or offset + length > meta.nbytes:
        return None
    address = int(t.data_ptr())
    return address + offset if address else None


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


def blocks_checksums(blocks: Sequence[Block], digests: Sequence[bool]) -> list[tuple[int, str | None]]:
    """:func:`block_checksums` of several blocks, one after the other. Blocking."""
    return [block_checksums(b, d) for b, d in zip(blocks, digests, strict=True)]


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

    async def checksums_many(
        self, blocks: Sequence[Block], digests: Sequence[bool]
    ) -> list[tuple[int, str | None]]:
        """:meth:`checksums` of several blocks in one job on one pool thread: one wake-up
        of the engine loop for the lot (each crc32c and digest releases the interpreter
        lock). Cancelling it as :meth:`checksum`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, blocks_checksums, list(blocks), list(digests))

    async def checksum_bytes(self, data: memoryview) -> int:
        """The crc32c of ``data`` (a shard read back from a tier, for a restore or a
        re-fetch): the ``Checksum`` the readers of ``_restore.fetch`` take. Cancelling it leaves
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

    async def capture_batch(self, jobs: Sequence[CaptureJob]) -> None:
        """Copy several shards in one pool job (see :func:`copy_into_blocks`)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, copy_into_blocks, list(jobs))

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
