"""Capturing CUDA tensors: side-stream device-to-host copies into the pinned arena, their
completion events polled, and the fence the stream guard calls.

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
   the capture: the engine's checksum stage (``_capture.cpu.ChecksumPool``) computes it from the
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

The stream guard (``guard.py``) moves the completion check to :meth:`CudaCapture.fence`;
see there.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..._errors import ConfigurationError, ImmutabilityViolationError
from ..._format.entries import Segment
from ..._format.manifest import Manifest
from ..._format.walk import TensorRef
from ..cpu import CaptureJob, source_view
from .device import (
    DeviceRuntime,
    EventLike,
    InflightWindow,
    PollOptions,
    Sleep,
    StreamLike,
    TorchCudaRuntime,
    in_pool,
    wait_for_event,
)

__all__ = ["CudaCapture", "PendingCapture"]

# Bookkeeping kept per step (progress of its shards, its snapshot event) is bounded so that a
# snapshot that failed half way cannot make it grow over a long run.
_KEEP_STEPS = 256


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


def _fill_host_part(
    job: CaptureJob, host_segs: Sequence[Segment], gaps: Sequence[tuple[int, int]]
) -> None:
    """Zero the gaps and copy the CPU-source segments (a pool thread; ``copy_`` releases
    the GIL). The device copies write other bytes of the same block meanwhile."""
    dest = job.block.tensor()
    for lo, hi in gaps:
        dest[lo:hi].zero_()
    for seg in host_segs:
        job.manifest.shard_part(seg, dest).copy_(source_view(job, seg))
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
                gaps = job.manifest.segment_gaps(job.shard)
                if host_segs or gaps:
                    await in_pool(self._pool, _fill_host_part, job, host_segs, gaps)
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
                    src = source_view(job, seg)
                    rt.copy(job.manifest.shard_part(seg, dest), src)
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
