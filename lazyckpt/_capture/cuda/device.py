"""The device behind a seam, and the waiting primitives of the CUDA path.

Everything here that touches CUDA goes through :class:`DeviceRuntime`, so that the logic of
the capture, the guard and the device restore (ordering, bounds, polling, fences) runs
against a fake device in tests. Nothing ever blocks a thread on the device: an event is
polled (:func:`wait_for_event`) with a back-off, between sleeps that leave the event loop
free.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import torch

from ..._errors import ConfigurationError

__all__ = [
    "DeviceRuntime",
    "EventLike",
    "InflightWindow",
    "PollOptions",
    "Sleep",
    "StreamLike",
    "TorchCudaRuntime",
    "in_pool",
    "wait_all_regardless",
    "wait_for_event",
]

Sleep = Callable[[float], Awaitable[None]]
_T = TypeVar("_T")


@dataclass(frozen=True)
class PollOptions:
    """How the scheduler polls a CUDA event: ``first_s``, then each delay ``factor`` times the
    last, up to ``max_s``.

    The event loop's timer sets the real granularity: the default selector loop rounds a
    sleep up to the next millisecond (epoll's timeout unit) and uvloop runs a sub-millisecond
    timer on its next iteration, so the first few polls come either a little later or a
    little sooner than asked; the back-off still bounds the polls to about one per ``max_s``
    once a copy runs long.
    """

    first_s: float = 50e-6
    max_s: float = 2e-3
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not (0 < self.first_s <= self.max_s and math.isfinite(self.max_s)):
            raise ConfigurationError(
                f"poll delays need 0 < first_s <= max_s < inf, got {self.first_s}, {self.max_s}"
            )
        if not (self.factor >= 1 and math.isfinite(self.factor)):
            raise ConfigurationError(f"poll factor must be at least 1, got {self.factor}")

    def delays(self) -> Iterator[float]:
        """The sleeps between two polls, forever."""
        delay = self.first_s
        while True:
            yield delay
            delay = min(self.max_s, delay * self.factor)


class EventLike(Protocol):
    """What the scheduler needs of a CUDA event (``torch.cuda.Event`` has it)."""

    def query(self) -> bool: ...

    def record(self, stream: Any) -> None: ...


class StreamLike(Protocol):
    """What the scheduler needs of a CUDA stream (``torch.cuda.Stream`` has it)."""

    def wait_event(self, event: Any) -> None: ...

    def wait_stream(self, stream: Any) -> None: ...


async def wait_for_event(
    event: EventLike, poll: PollOptions | None = None, sleep: Sleep | None = None
) -> int:
    """Wait until ``event.query()`` is true, polling with back-off; return the queries made.

    Never blocks the thread: between two queries the coroutine sleeps, so the event loop
    (and the GIL) stay free for everything else.
    """
    delays = (poll or PollOptions()).delays()
    nap = sleep or asyncio.sleep
    queries = 1
    while not event.query():
        await nap(next(delays))
        queries += 1
    return queries


async def wait_all_regardless(
    events: Sequence[EventLike], poll: PollOptions | None, sleep: Sleep | None
) -> None:
    """Wait for every event even if cancelled meanwhile, then re-raise the cancellation.

    Used where memory is handed back after the copies: a block or a source released while a
    DMA still runs would be reused under it.
    """
    cancelled = False
    for event in events:
        while True:
            try:
                await wait_for_event(event, poll, sleep)
                break
            except asyncio.CancelledError:
                cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def in_pool(
    pool: concurrent.futures.Executor | None, fn: Callable[..., _T], *args: Any
) -> _T:
    """``fn(*args)`` on a pool thread. A cancelled caller still waits for the thread to end
    before re-raising: it reads or writes memory that is handed back once the caller ends."""
    future = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([future])
        raise


class InflightWindow:
    """At most ``limit`` holders at a time, admitted strictly in arrival order.

    ``asyncio.Semaphore`` would bound the count too, but capture order matters here (a
    snapshot's copies go on the stream in shard order, and one snapshot's before the next),
    so a newcomer never overtakes a waiter. Engine loop only; not thread-safe.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ConfigurationError(f"the in-flight limit must be at least 1, got {limit}")
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(not w.done() for w in self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting behind everyone who came first."""
        if self.held < self.limit and not self.waiting:
            self._take()
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot, then cancelled
                self.release()
            raise

    def release(self) -> None:
        """Give a slot back; the oldest waiter gets it."""
        if self.held <= 0:
            raise RuntimeError("in-flight window released more often than acquired")
        self.held -= 1
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._take()
                waiter.set_result(None)
                return

    def _take(self) -> None:
        self.held += 1
        self.peak = max(self.peak, self.held)


# -- the device, behind a seam --------------------------------------------------------------


class DeviceRuntime(Protocol):
    """The CUDA calls the scheduler makes, behind one seam so that its logic (ordering,
    bounds, polling, fences) can run against a fake device in tests."""

    def is_device(self, tensor: torch.Tensor) -> bool:
        """True for a tensor this runtime copies with the device's DMA engines."""
        ...

    def device_of(self, tensor: torch.Tensor) -> int:
        """The device index of such a tensor."""
        ...

    def current_device(self) -> int | None:
        """The calling thread's device, or None when the device was never used."""
        ...

    def current_stream(self, device: int) -> StreamLike:
        """The calling thread's current stream on ``device``."""
        ...

    def side_stream(self, device: int) -> StreamLike:
        """A new stream on ``device`` for the copies."""
        ...

    def new_event(self) -> EventLike: ...

    def using(self, stream: StreamLike) -> contextlib.AbstractContextManager[object]:
        """Make ``stream`` current on the calling thread for the ``with`` block."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` on the current stream without waiting for it."""
        ...

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor the device can copy from asynchronously (pinned)."""
        ...


class TorchCudaRuntime:
    """:class:`DeviceRuntime` on ``torch.cuda``."""

    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def device_of(self, tensor: torch.Tensor) -> int:
        index = tensor.device.index
        return torch.cuda.current_device() if index is None else index

    def current_device(self) -> int | None:
        # a process that never touched CUDA holds no CUDA tensor; asking would create a context
        initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        return torch.cuda.current_device() if initialized else None

    def current_stream(self, device: int) -> StreamLike:
        return torch.cuda.current_stream(device)

    def side_stream(self, device: int) -> StreamLike:
        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def new_event(self) -> EventLike:
        return torch.cuda.Event()  # type: ignore[no-untyped-call]

    def using(self, stream: StreamLike) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(cast(torch.cuda.Stream, stream))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
