"""The CUDA path: side-stream device-to-host captures, polled events, the stream guard, and
restoring straight into device tensors.

Theory of operation
-------------------
``snapshot()`` runs on the training thread and calls :meth:`CudaCapture.mark_snapshot`, which
records an event on the stream that is current there: everything that stream ran before it
is what the snapshot must see. The engine thread later calls :meth:`CudaCapture.capture` for
each shard, in shard order. For the segments whose source is a CUDA tensor it

1. checks the version counters (*enqueue check*): unchanged means no in-place op on those
   tensors has been issued since ``snapshot()``, so every kernel that wrote them precedes
   the snapshot event;
2. waits for a slot in the device's in-flight window (a FIFO bound on copies enqueued and
   not yet seen complete), so copies go on the stream in shard order;
3. on the device's side stream: waits for the snapshot event, enqueues non-blocking copies
   straight into the shard's pinned arena block, records a completion event after them;
4. copies the shard's CPU-source segments (AdamW's step counters are CPU tensors) on a
   thread pool, and zeroes the alignment gaps; the shard is now *staged*;
5. polls its event with :func:`wait_for_event`: ``event.query()`` then ``asyncio.sleep``
   with a back-off from 50 µs to 2 ms. No thread ever blocks in ``synchronize()``. Events on
   one stream complete in order, so only the oldest copy of each device polls; the others
   wait for their turn on a future that the one before hands over;
6. checks the version counters again (*completion check*) unless a stream guard fenced the
   copy first (see below), and returns: the shard is captured. Its crc32c is not part of
   the capture: the engine's checksum stage (``_capture.ChecksumPool``) computes it from the
   pinned block afterwards, while the copies of the next shards run, so the guard never
   waits for a checksum.

Source tensors stay referenced by the copy's record until its event is seen complete. That,
not ``record_stream``, is what keeps the caching allocator from handing their memory to a
new tensor while the copy still reads it: the allocator can reuse a block only after its
last Python reference is gone, and ours goes after completion. ``record_stream`` would do it
too but makes every later free of that storage wait on the side stream's progress at free
time, which ties the allocator to our queue for the tensor's whole life; holding the
reference costs nothing we do not already hold (the snapshot keeps the tensors anyway).
The pinned block, likewise, goes back to the arena only after the event completes, even
when the capture fails or is cancelled: a DMA still writing into a reused block would
corrupt another shard.

The guard, two ways
-------------------
``cpu``: the optimizer step pre-hook blocks until every pending capture is done (the engine's
``wait_captured_blocking``). Simple; the CPU stalls only while a copy still runs.

``stream`` (:func:`stream_guard_hook`, :meth:`CudaCapture.fence`): the hook makes the
current stream of the training thread ``wait_event`` on the newest copy event of each device;
the CPU goes straight on to ``optimizer.step()`` and the GPU waits only if a copy is still
running. The optimizer then bumps the version counters on the CPU *before* the copies finish
on the GPU, so a completion check would fail every snapshot. The check moves to the fence:

- a mutation issued before the enqueue check is caught by it;
- a mutation issued after the enqueue and before the fence may run on the GPU while the
  copy reads (nothing orders them): the fence checks the counters of every copy not yet seen
  complete, and a changed one fails that shard's capture;
- a mutation issued after the fence, on the stream that was current at the fence (or on a
  stream ordered after it), runs after the copy on the GPU: it cannot tear the snapshot, so a
  fenced copy skips its completion check.

The fence can only order copies that exist, so it first waits (on the CPU) until every shard
of every pending snapshot is staged. That is normally long done when the optimizer step
comes (enqueueing takes microseconds per shard); it waits only under arena backpressure,
which is the same wait the ``cpu`` guard would do. CPU-source segments are part of staging,
so their copies are finished before the optimizer can change them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, cast

import crc32c
import torch

from ._arena import Block
from ._capture import CaptureJob, source_view
from ._errors import (
    ConfigurationError,
    CorruptionError,
    ImmutabilityViolationError,
    TierError,
)
from ._manifest import Manifest, Segment, ShardMeta, TensorMeta
from ._state import RestoreEvent, RestoreState, advance_restore
from ._tier import SupportsBlockRead, Tier
from ._tree import TensorRef

__all__ = [
    "CudaCapture",
    "DeviceRuntime",
    "EventLike",
    "GuardMode",
    "InflightWindow",
    "PendingCapture",
    "PollOptions",
    "StreamLike",
    "SupportsBlockRead",
    "TorchCudaRuntime",
    "resolve_guard_mode",
    "restore_into",
    "stream_guard_hook",
    "wait_for_event",
]

GuardMode = Literal["cpu", "stream"]
Sleep = Callable[[float], Awaitable[None]]
_T = TypeVar("_T")

# Bookkeeping kept per step (progress of its shards, its snapshot event) is bounded so that a
# snapshot that failed half way cannot make it grow over a long run.
_KEEP_STEPS = 256


# -- polling ------------------------------------------------------------------------------


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


async def _wait_all_regardless(
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


async def _in_pool(
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


# -- capture --------------------------------------------------------------------------------


def _violation(ref: TensorRef, step: int) -> ImmutabilityViolationError | None:
    if ref.version is None:
        return None
    found = ref.tensor._version
    if found == ref.version:
        return None
    return ImmutabilityViolationError(ref.key, step, ref.version, found)


def _first_violation(refs: Sequence[TensorRef], step: int) -> ImmutabilityViolationError | None:
    for ref in refs:
        found = _violation(ref, step)
        if found is not None:
            return found
    return None


def _segment_dest(job: CaptureJob, dest: torch.Tensor, seg: Segment) -> torch.Tensor:
    manifest = job.manifest
    nbytes = manifest.segment_nbytes(seg)
    meta = manifest.tensors[seg.tensor]
    return (
        dest[seg.offset : seg.offset + nbytes]
        .view(meta.torch_dtype)
        .view(manifest.segment_shape(seg))
    )


def _gaps(job: CaptureJob) -> list[tuple[int, int]]:
    """Byte ranges of the shard that no segment covers (pack alignment, the tail)."""
    spans = sorted(
        (seg.offset, seg.offset + job.manifest.segment_nbytes(seg)) for seg in job.shard.segments
    )
    gaps: list[tuple[int, int]] = []
    cursor = 0
    for lo, hi in spans:
        if lo > cursor:
            gaps.append((cursor, lo))
        cursor = max(cursor, hi)
    if cursor < job.shard.length:
        gaps.append((cursor, job.shard.length))
    return gaps


def _fill_host_part(
    job: CaptureJob, host_segs: Sequence[Segment], gaps: Sequence[tuple[int, int]]
) -> None:
    """Zero the gaps and copy the CPU-source segments (a pool thread; ``copy_`` releases
    the GIL). The device copies write other bytes of the same block meanwhile."""
    dest = job.block.tensor()
    for lo, hi in gaps:
        dest[lo:hi].zero_()
    for seg in host_segs:
        _segment_dest(job, dest, seg).copy_(source_view(job, seg.tensor, seg.start, seg.stop))
    found = _first_violation([job.refs[s.tensor] for s in host_segs], job.manifest.step)
    if found is not None:
        raise found


@dataclass(eq=False)
class _Copy:
    """The device part of one shard on one device: its completion event, the references it
    reads (checked against their versions), and the views it keeps alive until done."""

    lane: _Lane
    event: EventLike
    refs: list[TensorRef]
    holds: list[torch.Tensor]
    step: int
    fenced: bool = False
    done: bool = False
    violation: ImmutabilityViolationError | None = None
    turn: asyncio.Future[None] | None = field(default=None, repr=False)


class _Lane:
    """One device: its side stream, its in-flight window, its copies in stream order."""

    def __init__(self, device: int, stream: StreamLike, limit: int) -> None:
        self.device = device
        self.stream = stream
        self.window = InflightWindow(limit)
        self.queue: collections.deque[_Copy] = collections.deque()  # under the capture's lock


@dataclass
class _Progress:
    total: int
    staged: int = 0
    finished: int = 0


class _GuardStats(Protocol):
    guard_s: float


class PendingCapture(Protocol):
    """A snapshot whose capture is not done yet, as the stream guard sees it (the engine's
    ``Flight`` is one)."""

    @property
    def manifest(self) -> Manifest: ...

    @property
    def captured(self) -> concurrent.futures.Future[None]: ...

    @property
    def stats(self) -> _GuardStats: ...


class CudaCapture:
    """Captures CUDA tensors with side-stream copies into the pinned arena (module docstring).

    Args:
        cpu_threads: pool threads that copy CPU-source segments and zero the gaps (the
            checksums are not computed here: see the module docstring).
        max_inflight: copies per device enqueued and not yet seen complete. Enough to keep
            the copy engine busy through one poll interval; a bound so that the stream queue
            and the events held stay small.
        poll: the polling back-off.
        runtime: the device calls; :class:`TorchCudaRuntime` unless testing.
        sleep: what the poller awaits between queries (``asyncio.sleep``).
    """

    def __init__(
        self,
        cpu_threads: int = 1,
        *,
        max_inflight: int = 32,
        poll: PollOptions | None = None,
        runtime: DeviceRuntime | None = None,
        sleep: Sleep | None = None,
    ) -> None:
        if cpu_threads < 1:
            raise ConfigurationError(f"cpu_threads must be at least 1, got {cpu_threads}")
        if max_inflight < 1:
            raise ConfigurationError(f"max_inflight must be at least 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self._runtime: DeviceRuntime = runtime if runtime is not None else TorchCudaRuntime()
        self._poll = poll or PollOptions()
        self._sleep = sleep
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=cpu_threads, thread_name_prefix="lazyckpt-capture"
        )
        # one lock for what the training thread (mark_snapshot, fence) and the engine thread
        # share; reentrant because a future's done-callback may run inside it
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._lanes: dict[int, _Lane] = {}
        self._progress: collections.OrderedDict[int, _Progress] = collections.OrderedDict()
        self._finished: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._marks: collections.OrderedDict[int, tuple[int, EventLike]] = collections.OrderedDict()

    # -- training thread ------------------------------------------------------------------

    def mark_snapshot(self, step: int) -> None:
        """Record, on the calling thread's current stream, the point a snapshot must see.

        Call it from ``snapshot()`` before the flight is submitted. Without it, a capture
        waits on the engine thread's current stream of the device instead (the default
        stream): right for a trainer on the default stream, and later than needed since it
        also waits for work issued after ``snapshot()``.
        """
        device = self._runtime.current_device()
        if device is None:
            return
        event = self._runtime.new_event()
        event.record(self._runtime.current_stream(device))
        with self._lock:
            self._marks[step] = (device, event)
            while len(self._marks) > _KEEP_STEPS:
                self._marks.popitem(last=False)

    def pending_events(self) -> list[tuple[int, EventLike]]:
        """The newest copy event of each device with copies not yet seen complete."""
        with self._lock:
            return [
                (lane.device, lane.queue[-1].event) for lane in self._lanes.values() if lane.queue
            ]

    def fence(self, pending: Sequence[PendingCapture]) -> int:
        """Order the calling thread's current streams after the pending captures' copies.

        Waits (CPU) until every shard of every pending snapshot is staged, checks the version
        counters of every copy not yet seen complete (a changed one fails its shard: it may
        have raced the copy), then makes the current stream of each device ``wait_event`` on
        that device's newest copy event. Returns how many streams were made to wait.
        """
        if not self._all_staged(pending):
            for flight in pending:  # wake the wait below when a snapshot fails half way
                flight.captured.add_done_callback(self._wake)
            with self._cond:
                self._cond.wait_for(lambda: self._all_staged(pending))
        waits: list[tuple[int, EventLike]] = []
        with self._lock:
            seen: dict[int, ImmutabilityViolationError | None] = {}
            for lane in self._lanes.values():
                for copy in lane.queue:
                    if copy.fenced:
                        continue
                    copy.fenced = True
                    for ref in copy.refs:
                        if id(ref) not in seen:
                            seen[id(ref)] = _violation(ref, copy.step)
                        if copy.violation is None:
                            copy.violation = seen[id(ref)]
                if lane.queue:
                    waits.append((lane.device, lane.queue[-1].event))
        for device, event in waits:
            self._runtime.current_stream(device).wait_event(event)
        return len(waits)

    def _wake(self, _future: object) -> None:
        with self._cond:
            self._cond.notify_all()

    def _all_staged(self, pending: Sequence[PendingCapture]) -> bool:
        with self._lock:
            for flight in pending:
                if flight.captured.done():
                    continue
                step = flight.manifest.step
                if step in self._finished:
                    continue
                progress = self._progress.get(step)
                if progress is None or progress.staged < progress.total:
                    return False
            return True

    # -- engine thread --------------------------------------------------------------------

    async def capture(self, job: CaptureJob) -> None:
        """Copy the shard into its block (see the module docstring).

        Raises :class:`ImmutabilityViolationError` if a source changed before its copy was
        ordered or complete. Returns (or raises, cancellation included) only once no copy
        writes into the block any more; the block's bytes are then final.
        """
        step = job.manifest.step
        self._begin(step, len(job.manifest.shards))
        staged = False
        admitted: list[_Lane] = []
        copies: list[_Copy] = []
        try:
            by_device: dict[int, list[Segment]] = {}
            host_segs: list[Segment] = []
            for seg in job.shard.segments:
                tensor = job.refs[seg.tensor].tensor
                if self._runtime.is_device(tensor):
                    by_device.setdefault(self._runtime.device_of(tensor), []).append(seg)
                else:
                    host_segs.append(seg)
            devices = sorted(by_device)  # one order for every shard: no deadlock across lanes
            for device in devices:
                found = _first_violation([job.refs[s.tensor] for s in by_device[device]], step)
                if found is not None:
                    raise found
            for device in devices:
                lane = self._lane(device)
                await lane.window.acquire()
                admitted.append(lane)
            violation: ImmutabilityViolationError | None = None
            try:
                for lane in admitted:
                    self._enqueue(job, lane, by_device[lane.device], copies)
                gaps = _gaps(job)
                if host_segs or gaps:
                    await _in_pool(self._pool, _fill_host_part, job, host_segs, gaps)
                self._mark_staged(step)
                staged = True
            finally:
                violation = await self._settle(copies)
                for lane in admitted:
                    lane.window.release()
                admitted.clear()
            if violation is not None:
                raise violation
        finally:
            for lane in admitted:
                lane.window.release()
            if not staged:
                self._mark_staged(step)
            self._mark_finished(step)

    def _lane(self, device: int) -> _Lane:
        lane = self._lanes.get(device)
        if lane is None:
            lane = _Lane(device, self._runtime.side_stream(device), self.max_inflight)
            with self._lock:
                self._lanes[device] = lane
        return lane

    def _enqueue(
        self, job: CaptureJob, lane: _Lane, segs: Sequence[Segment], out: list[_Copy]
    ) -> None:
        rt = self._runtime
        step = job.manifest.step
        with self._lock:
            mark = self._marks.get(step)
        # read before the side stream becomes current: it is the stream to wait on
        producer = (
            None if mark is not None and mark[0] == lane.device else rt.current_stream(lane.device)
        )
        refs = list({id(job.refs[s.tensor]): job.refs[s.tensor] for s in segs}.values())
        dest = job.block.tensor()
        holds: list[torch.Tensor] = []
        event = rt.new_event()
        with rt.using(lane.stream):
            if producer is not None:
                lane.stream.wait_stream(producer)
            else:
                assert mark is not None
                lane.stream.wait_event(mark[1])
            try:
                for seg in segs:
                    src = source_view(job, seg.tensor, seg.start, seg.stop)
                    rt.copy(_segment_dest(job, dest, seg), src)
                    holds.append(src)
            finally:
                # recorded even when an enqueue failed half way: what did go on the stream
                # must be waited for before the block is reused
                event.record(lane.stream)
                copy = _Copy(lane, event, refs, holds, step)
                with self._lock:
                    lane.queue.append(copy)
                out.append(copy)

    async def _settle(self, copies: Sequence[_Copy]) -> ImmutabilityViolationError | None:
        """Wait for every copy to complete, cancellation or not; the first violation."""
        cancelled = False
        for copy in copies:
            while not copy.done:
                try:
                    await self._complete(copy)
                except asyncio.CancelledError:
                    cancelled = True  # the DMA still writes into the block: wait all the same
        if cancelled:
            raise asyncio.CancelledError
        for copy in copies:
            if copy.violation is not None:
                return copy.violation
        return None

    async def _complete(self, copy: _Copy) -> None:
        lane = copy.lane
        loop = asyncio.get_running_loop()
        while lane.queue[0] is not copy:  # an older copy on this stream finishes first
            copy.turn = loop.create_future()
            await copy.turn
        try:
            await wait_for_event(copy.event, self._poll, self._sleep)
        except asyncio.CancelledError:
            raise
        except BaseException:  # the device failed: nothing more will complete here
            self._retire(copy, check=False)
            raise
        self._retire(copy, check=True)

    def _retire(self, copy: _Copy, *, check: bool) -> None:
        lane = copy.lane
        with self._lock:
            lane.queue.remove(copy)
            copy.done = True
            if check and not copy.fenced:
                copy.violation = _first_violation(copy.refs, copy.step)
            copy.holds.clear()
            head = lane.queue[0] if lane.queue else None
        if head is not None and head.turn is not None and not head.turn.done():
            head.turn.set_result(None)

    def _begin(self, step: int, total: int) -> None:
        with self._lock:
            if step not in self._progress and step not in self._finished:
                self._progress[step] = _Progress(total)
                while len(self._progress) > _KEEP_STEPS:
                    self._progress.popitem(last=False)

    def _mark_staged(self, step: int) -> None:
        with self._cond:
            progress = self._progress.get(step)
            if progress is not None:
                progress.staged += 1
                self._cond.notify_all()

    def _mark_finished(self, step: int) -> None:
        with self._cond:
            progress = self._progress.get(step)
            if progress is None:
                return
            progress.finished += 1
            if progress.finished >= progress.total:
                del self._progress[step]
                self._marks.pop(step, None)
                self._finished[step] = None
                while len(self._finished) > _KEEP_STEPS:
                    self._finished.popitem(last=False)
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread pool (the engine calls it after the last capture)."""
        self._pool.shutdown(wait=True)


# -- the guard ------------------------------------------------------------------------------


def resolve_guard_mode(mode: str, capture: object) -> GuardMode:
    """Validate a guard mode; ``"stream"`` falls back to ``"cpu"`` without the CUDA capture
    (CPU tensors have no stream to order: only blocking is correct there)."""
    if mode not in ("cpu", "stream"):
        raise ConfigurationError(f"guard mode must be 'cpu' or 'stream', got {mode!r}")
    if mode == "stream" and isinstance(capture, CudaCapture):
        return "stream"
    return "cpu"


def stream_guard_hook(
    capture: CudaCapture,
    pending: Callable[[], Sequence[PendingCapture]],
    *,
    raise_unreported: Callable[[], None] | None = None,
    closing: Callable[[], bool] | None = None,
) -> Callable[[Any, Any, Any], None]:
    """An optimizer step pre-hook for the ``stream`` guard: fence the pending captures
    (:meth:`CudaCapture.fence`) instead of waiting for them.

    Args:
        capture: the engine's capture backend.
        pending: the snapshots whose capture is not done (``engine.pending_captures``).
        raise_unreported: raises a failure nobody has seen yet (``engine.raise_unreported``).
        closing: true once the Checkpointer is closing; the hook then does nothing.
    """

    def hook(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if closing is not None and closing():
            return
        t0 = time.perf_counter()
        flights = list(pending())
        if flights:
            capture.fence(flights)
        spent = time.perf_counter() - t0
        for flight in flights:
            flight.stats.guard_s += spent
        if raise_unreported is not None:
            raise_unreported()

    return hook


# -- restore --------------------------------------------------------------------------------


def _segment_target(target: torch.Tensor, meta: TensorMeta, seg: Segment) -> torch.Tensor:
    if meta.mode == "rows":
        return target[seg.start : seg.stop]
    if meta.mode == "flat":
        return target.view(-1)[seg.start : seg.stop]
    return target


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, writable, without a copy."""
    return t.numpy().data.cast("B")


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
) -> None:
    """Fill ``targets[i]`` (tensor ``i`` of the manifest; None: skip it) in place.

    Each shard is read from the first tier of ``sources`` with a copy whose crc32c matches,
    falling back tier by tier. A tier that lends its blocks (:class:`SupportsBlockRead`, the
    pinned host arena) is read without copying; others are read into a pinned bounce buffer.
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
            meta = manifest.tensors[seg.tensor]
            nbytes = manifest.segment_nbytes(seg)
            piece = data[seg.offset : seg.offset + nbytes].view(meta.torch_dtype)
            pair = (_segment_target(target, meta, seg), piece.view(manifest.segment_shape(seg)))
            (device_pairs if rt.is_device(target) else host_pairs).append(pair)
        events: list[EventLike] = []
        try:
            enqueue(device_pairs, events)
            if host_pairs:
                await _in_pool(None, _host_copies, host_pairs)
        finally:
            await _wait_all_regardless(events, poll, sleep)

    problems: list[Exception] = []

    async def one(shard: ShardMeta) -> None:
        segs = [s for s in shard.segments if s.tensor < len(work) and work[s.tensor] is not None]
        if not segs:
            return
        state = RestoreState.PENDING
        for tier in sources:
            state = advance_restore(state, RestoreEvent.START_READ)
            borrowed: Block | None = None
            try:
                if isinstance(tier, SupportsBlockRead):
                    borrowed = tier.borrow_shard(manifest, shard)
                if borrowed is not None:
                    data = borrowed.tensor()
                else:
                    data = rt.host_buffer(shard.length)
                    await tier.read_shard(manifest, shard, _bytes_of(data))
                view = _bytes_of(data)
                crc = await _in_pool(None, crc32c.crc32c, view)
                if crc != shard.crc32c:
                    raise CorruptionError(
                        f"tier {tier.name!r}: shard {shard.index} of step {manifest.step} "
                        "fails its checksum"
                    )
                state = advance_restore(state, RestoreEvent.CHECKSUM_OK)
                await scatter(segs, data)
                return
            except (CorruptionError, TierError) as exc:
                problems.append(exc)
                state = advance_restore(state, RestoreEvent.BAD_COPY)
            finally:
                if borrowed is not None:
                    cast(SupportsBlockRead, tier).return_shard(borrowed)
        advance_restore(state, RestoreEvent.NO_MORE_TIERS)
        raise CorruptionError(
            f"step {manifest.step}: no tier holds a good copy of shard {shard.index}; tried "
            f"{[t.name for t in sources]}: " + "; ".join(str(p) for p in problems[-3:])
        )

    sem = asyncio.Semaphore(max(1, concurrency))

    async def bounded(shard: ShardMeta) -> None:
        async with sem:
            await one(shard)

    try:
        async with asyncio.TaskGroup() as tg:
            for shard in manifest.shards:
                tg.create_task(bounded(shard))
    except ExceptionGroup as group:
        first: BaseException = group.exceptions[0]
        while isinstance(first, ExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    if twins:
        pairs = [(cast(torch.Tensor, targets[i]), twin) for i, twin in twins.items()]
        device_pairs = [p for p in pairs if rt.is_device(p[0])]
        events: list[EventLike] = []
        try:
            enqueue(device_pairs, events)
            _host_copies([p for p in pairs if not rt.is_device(p[0])])
        finally:
            await _wait_all_regardless(events, poll, sleep)
