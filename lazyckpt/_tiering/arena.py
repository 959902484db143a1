"""The host arena: one pre-allocated, pre-faulted, page-aligned buffer, handed out in blocks.

Allocating host memory on the fly costs several times more in page faults than copying into
memory already touched (the figures: ``docs/design.md``, "Figures behind choices in the
code"), and an unbounded staging area is the most common
complaint about asynchronous checkpointing (host memory blowing up). So the arena is
allocated once, touched once, and every capture waits for a block of it: that wait *is* the
backpressure.

Blocks are 4 KiB aligned (O_DIRECT writers and DMA engines want that). A block is

- *held* while someone uses it (a capture writing into it, a tier reading from it);
- *evictable* once its bytes are durable elsewhere or belong to a snapshot that the host
  tier merely keeps for fast restore: the arena reclaims evictable blocks, oldest first,
  when an allocation does not fit, calling the block's ``on_evict`` first;
- free.

All methods run on the engine's event loop thread; nothing here is thread-safe on purpose.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import mmap
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._errors import ConfigurationError

__all__ = ["ArenaStats", "Block", "HostArena"]

PAGE = 4096


def _align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


# cudaHostRegisterPortable: the pages count as pinned for every CUDA context of the process
_REGISTER_PORTABLE = 1


def _context_device() -> contextlib.AbstractContextManager[object]:
    """Make current, on this (worker) thread, a device that already has a CUDA context, so
    that registering creates no new context on device 0 of a rank that uses another GPU.
    With no context anywhere yet, nothing is changed."""
    try:
        has_context = getattr(torch._C, "_cuda_hasPrimaryContext")  # noqa: B009
        for index in range(torch.cuda.device_count()):
            if has_context(index):
                return torch.cuda.device(index)
    except Exception:  # no CUDA build or an older torch: the default device it is
        pass
    return contextlib.nullcontext()


def host_register(address: int, nbytes: int) -> str | None:
    """Page-lock ``[address, address + nbytes)`` for the CUDA driver; None on success, else
    why not. Copies to and from the range are then asynchronous DMA, as with pin_memory."""
    try:
        with _context_device():
            status = _cudart().cudaHostRegister(address, nbytes, _REGISTER_PORTABLE)
    except Exception as exc:  # no CUDA build, or a driver without the call
        return f"{type(exc).__name__}: {exc}"
    code = int(status[0] if isinstance(status, tuple) else status)
    return None if code == 0 else f"cudaHostRegister returned {code}"


def caching_pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of pinned memory from torch's caching host allocator, touched once."""
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    t.fill_(0)
    return t


def host_unregister(address: int) -> None:
    """Undo :func:`host_register` (before the range is unmapped)."""
    with contextlib.suppress(Exception), _context_device():  # closing must not fail on it
        _cudart().cudaHostUnregister(address)


@dataclass(eq=False)
class Block:
    """A piece of the arena: ``[offset, offset + length)``; ``extent`` is the aligned size."""

    arena: HostArena
    offset: int
    length: int
    extent: int
    held: int = 1
    evictable: bool = False
    freed: bool = False
    on_evict: Callable[[Block], None] | None = field(default=None, repr=False)

    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the block's bytes (no copy)."""
        return self.arena.tensor[self.offset : self.offset + self.length]

    def memoryview(self) -> memoryview:
        """A writable memoryview of the block's bytes (no copy)."""
        return self.arena.view[self.offset : self.offset + self.length]


@dataclass(frozen=True)
class ArenaStats:
    capacity: int
    held: int
    evictable: int
    peak_held: int
    waits: int
    evictions: int


class HostArena:
    """A fixed pool of host memory. See the module docstring.

    Args:
        capacity_bytes: size of the pool.
        pinned: page-locked memory for fast device-to-host copies. ``None`` means "pinned
            when CUDA is available"; ``True`` without CUDA is a configuration error.
    """

    def __init__(self, capacity_bytes: int, *, pinned: bool | None = None) -> None:
        if capacity_bytes < PAGE:
            raise ConfigurationError(
                f"capacity_bytes must be at least {PAGE}, got {capacity_bytes}"
            )
        if pinned and not torch.cuda.is_available():
            raise ConfigurationError("pinned=True needs CUDA; this machine has none")
        self.capacity = _align(capacity_bytes)
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._mmap: mmap.mmap | None = None
        self._tensor: torch.Tensor | None = None
        self._registered: int | None = None  # address page-locked with cudaHostRegister
        self._view: memoryview | None = None
        # free extents as parallel sorted lists of (offset, length)
        self._free_offsets: list[int] = []
        self._free_lengths: list[int] = []
        self._evictable: OrderedDict[int, Block] = OrderedDict()
        self._held_bytes = 0
        self._evictable_bytes = 0
        self._peak_held = 0
        self._waits = 0
        self._evictions = 0
        self._waiters: list[asyncio.Future[None]] = []

    # -- life cycle ----------------------------------------------------------------------

    @property
    def allocated(self) -> bool:
        return self._tensor is not None

    def allocate_memory(self) -> None:
        """Allocate and pre-fault the pool (blocking; call it from a worker thread).

        The pool is an anonymous page-aligned mapping, touched once. When pinned, that same
        mapping is page-locked in place with ``cudaHostRegister`` (exactly ``capacity``
        bytes), rather than taken from torch's caching host allocator, which pins the next
        power of two of what is asked (a 9 GiB arena would pin 16 GiB). If the driver
        refuses the registration, the pool falls back to the caching allocator and says so.
        """
        if self._tensor is not None:
            return
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
        flags |= getattr(mmap, "MAP_POPULATE", 0)
        self._mmap = mmap.mmap(-1, self.capacity, flags=flags)
        t = torch.frombuffer(self._mmap, dtype=torch.uint8)
        t.fill_(0)  # touch every page now, not during the first capture
        if self.pinned:
            # a child forked later (DataLoader workers) must not get a copy of pinned pages:
            # the kernel copies page-locked private pages at fork time instead of sharing them
            dontfork = getattr(mmap, "MADV_DONTFORK", None)
            if dontfork is not None:
                self._mmap.madvise(dontfork)
            error = host_register(t.data_ptr(), self.capacity)
            if error is None:
                self._registered = t.data_ptr()
            else:
                warnings.warn(
                    f"page-locking the {self.capacity} byte arena in place failed ({error}); "
                    "using torch's pinned allocator instead, which rounds the size up to a "
                    "power of two",
                    ResourceWarning,
                    stacklevel=2,
                )
                del t
                self._unmap()
                t = caching_pinned(self.capacity)
        self._tensor = t
        self._view = memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
        self._free_offsets = [0]
        self._free_lengths = [self.capacity]

    def release_memory(self) -> None:
        """Give the pool back. Every block must be free or evictable."""
        if self._held_bytes:
            raise RuntimeError("arena released while blocks are held")  # an engine bug
        self._evictable.clear()
        if self._view is not None:
            self._view.release()
        self._tensor = None
        self._view = None
        if self._registered is not None:
            host_unregister(self._registered)
            self._registered = None
        self._unmap()

    def _unmap(self) -> None:
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # a view is still alive; GC unmaps it later
                self._mmap.close()
            self._mmap = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError("arena memory not allocated")
        return self._tensor

    @property
    def view(self) -> memoryview:
        if self._view is None:
            raise RuntimeError("arena memory not allocated")
        return self._view

    def stats(self) -> ArenaStats:
        return ArenaStats(
            capacity=self.capacity,
            held=self._held_bytes,
            evictable=self._evictable_bytes,
            peak_held=self._peak_held,
            waits=self._waits,
            evictions=self._evictions,
        )

    # -- allocation ----------------------------------------------------------------------

    def try_allocate(self, nbytes: int) -> Block | None:
        """A held block of ``nbytes`` now, evicting old evictable blocks if needed, or None."""
        extent = _align(max(nbytes, 1))
        if extent > self.capacity:
            raise ConfigurationError(
                f"a block of {nbytes} bytes does not fit an arena of {self.capacity} bytes; "
                "raise the host tier's capacity_bytes or lower the shard size"
            )
        while True:
            block = self._take(nbytes, extent)
            if block is not None:
                return block
            if not self._evictable:
                return None
            self._evict_oldest()

    async def allocate(self, nbytes: int) -> Block:
        """A held block of ``nbytes``; waits (backpressure) until one fits."""
        block = self.try_allocate(nbytes)
        if block is not None:
            return block
        self._waits += 1
        loop = asyncio.get_running_loop()
        while True:
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            block = self.try_allocate(nbytes)
            if block is not None:
                return block

    def try_allocate_all(self, sizes: list[int]) -> list[Block] | None:
        """Held blocks for every size in ``sizes`` at once, or None (nothing taken).

        Evictable blocks are reclaimed only when free plus evictable space could hold all of
        them; if the free space is still too fragmented once every evictable block is gone
        (others hold blocks in between), the blocks taken so far are given back.
        """
        extents = [_align(max(n, 1)) for n in sizes]
        if sum(extents) > self.capacity:
            raise ConfigurationError(
                f"{len(sizes)} blocks of {sum(extents)} bytes in all do not fit an arena of "
                f"{self.capacity} bytes"
            )
        free = self.capacity - self._held_bytes - self._evictable_bytes
        if free + self._evictable_bytes < sum(extents):
            return None  # evicting now would lose kept blocks and still not make room
        taken: list[Block] = []
        while True:
            for nbytes, extent in zip(sizes[len(taken) :], extents[len(taken) :], strict=True):
                block = self._take(nbytes, extent)
                if block is None:
                    break
                taken.append(block)
            if len(taken) == len(sizes):
                return taken
            if not self._evictable:
                for block in taken:  # quietly: waking the other waiters would only repeat this
                    self._held_bytes -= block.extent
                    self._free(block, notify=False)
                return None
            self._evict_oldest()

    async def allocate_all(self, sizes: list[int]) -> list[Block]:
        """Held blocks for every size in ``sizes``, all at once; waits until they fit.

        Taking them together means a caller never holds part of what it needs while waiting
        for the rest, so two callers that each need most of the arena cannot wait for each
        other forever.
        """
        blocks = self.try_allocate_all(sizes)
        if blocks is not None:
            return blocks
        self._waits += 1
        loop = asyncio.get_running_loop()
        while True:
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            blocks = self.try_allocate_all(sizes)
            if blocks is not None:
                return blocks

    def _evict_oldest(self) -> None:
        _, victim = self._evictable.popitem(last=False)
        self._evictions += 1
        self._evictable_bytes -= victim.extent
        victim.evictable = False
        if victim.on_evict is not None:
            victim.on_evict(victim)
        self._free(victim)

    def _take(self, nbytes: int, extent: int) -> Block | None:
        for i, length in enumerate(self._free_lengths):
            if length >= extent:
                offset = self._free_offsets[i]
                if length == extent:
                    del self._free_offsets[i]
                    del self._free_lengths[i]
                else:
                    self._free_offsets[i] = offset + extent
                    self._free_lengths[i] = length - extent
                self._held_bytes += extent
                self._peak_held = max(self._peak_held, self._held_bytes + self._evictable_bytes)
                return Block(self, offset, nbytes, extent)
        return None

    def _free(self, block: Block, *, notify: bool = True) -> None:
        block.freed = True
        i = bisect.bisect_left(self._free_offsets, block.offset)
        start, length = block.offset, block.extent
        # merge with the following extent
        if i < len(self._free_offsets) and self._free_offsets[i] == start + length:
            length += self._free_lengths[i]
            del self._free_offsets[i]
            del self._free_lengths[i]
        # merge with the preceding extent
        if i > 0 and self._free_offsets[i - 1] + self._free_lengths[i - 1] == start:
            self._free_lengths[i - 1] += length
        else:
            self._free_offsets.insert(i, start)
            self._free_lengths.insert(i, length)
        if notify:
            self._notify()

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- ownership -----------------------------------------------------------------------

    def release(self, block: Block) -> None:
        """Drop one hold. The last hold frees the block (or, if marked evictable, parks it)."""
        if block.freed or block.held <= 0:
            raise RuntimeError("block released twice")  # an engine bug
        block.held -= 1
        if block.held:
            return
        self._held_bytes -= block.extent
        if block.evictable:
            self._evictable[id(block)] = block
            self._evictable_bytes += block.extent
            self._notify()
        else:
            self._free(block)

    def mark_evictable(self, block: Block, on_evict: Callable[[Block], None] | None) -> None:
        """Let the arena reclaim this block once nobody holds it."""
        block.evictable = True
        block.on_evict = on_evict

    def claim(self, block: Block) -> bool:
        """Hold a block again (to read it); False if it was evicted meanwhile."""
        if block.freed:
            return False
        if block.held == 0:
            if id(block) in self._evictable:
                del self._evictable[id(block)]
                self._evictable_bytes -= block.extent
            self._held_bytes += block.extent
        block.held += 1
        return True

    def discard(self, block: Block) -> None:
        """Free an unheld evictable block now (its owner no longer wants it)."""
        if block.freed or block.held:
            block.evictable = False
            return
        if id(block) in self._evictable:
            del self._evictable[id(block)]
            self._evictable_bytes -= block.extent
        self._free(block)
