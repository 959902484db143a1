"""The scheduling logic of the CUDA capture path, on a fake device.

``_capture.cuda.CudaCapture`` reaches the device only through a ``DeviceRuntime``. The fake one here
defers every "device" copy until its event completes (as a DMA would) and completes events
in stream order, only when the test allows it. So these tests run anywhere and check what a
GPU run relies on: polling with back-off and never blocking, the in-flight bound and the
order of copies, both version checks, the stream-guard fence, cancellation, and restoring
into device tensors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import crc32c
import pytest
import torch

import lazyckpt
from lazyckpt import (
    ConfigurationError,
    CorruptionError,
    HostArena,
    ImmutabilityViolationError,
    LayoutOptions,
    Manifest,
    ShardMeta,
)
from lazyckpt._capture.cpu import CaptureJob, CpuCapture, block_checksum
from lazyckpt._capture.cuda import (
    CudaCapture,
    InflightWindow,
    PollOptions,
    in_pool,
    resolve_guard_mode,
    stream_guard_hook,
    wait_for_event,
)
from lazyckpt._format.manifest import plan_layout
from lazyckpt._format.walk import TensorRef, walk_state
from lazyckpt._restore.device import restore_into
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.gating import HeldChecksums

# -- the fake device ------------------------------------------------------------------------


class FakeStream:
    def __init__(self, device: int, name: str) -> None:
        self.device = device
        self.name = name
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.events: list[FakeEvent] = []
        self.log: list[tuple[str, Any]] = []

    def wait_event(self, event: Any) -> None:
        self.log.append(("wait_event", event))

    def wait_stream(self, stream: Any) -> None:
        self.log.append(("wait_stream", stream))

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}:{self.device}>"


class FakeEvent:
    def __init__(self, rt: FakeRuntime) -> None:
        self.rt = rt
        self.ops: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.stream: FakeStream | None = None
        self.complete = False
        self.queries = 0

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        self.ops, stream.pending = stream.pending, []
        stream.events.append(self)
        if stream.name == "side":
            self.rt.copy_events.append(self)

    def query(self) -> bool:
        self.queries += 1
        if self.complete:
            return True
        if self.queries <= self.rt.polls_before_done or not self.rt.may_complete():
            return False
        assert self.stream is not None
        for earlier in self.stream.events:  # a stream runs its work in order
            earlier.run()
            if earlier is self:
                break
        return True

    def run(self) -> None:
        if not self.complete:
            for dst, src in self.ops:
                dst.copy_(src)  # the "DMA" reads the source now, not at enqueue
            self.ops = []
            self.complete = True
            self.rt.completed += 1

    def synchronize(self) -> None:
        raise AssertionError("a thread blocked on a device event")

    wait = synchronize


class FakeRuntime:
    """A device whose copies happen when their event completes, and only when allowed."""

    def __init__(self, *, eager: bool = False) -> None:
        self.eager = eager  # copy at enqueue (the data is right whenever the event is seen)
        self.devices: dict[int, int] = {}
        self.budget: int | None = None  # events that may still complete (None: any)
        self.polls_before_done = 0
        self.device_now: int | None = 0
        self.compute: dict[int, FakeStream] = {}
        self.sides: list[FakeStream] = []
        self.copy_events: list[FakeEvent] = []
        self.copied: list[torch.Tensor] = []
        self.completed = 0
        self._tls = threading.local()

    def to_device(self, t: torch.Tensor, device: int = 0) -> torch.Tensor:
        self.devices[t.untyped_storage().data_ptr()] = device
        return t

    def may_complete(self) -> bool:
        if self.budget is None:
            return True
        if self.budget <= 0:
            return False
        self.budget -= 1
        return True

    @property
    def outstanding(self) -> int:
        return sum(not e.complete for e in self.copy_events)

    # DeviceRuntime
    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.devices

    def device_of(self, tensor: torch.Tensor) -> int:
        return self.devices[tensor.untyped_storage().data_ptr()]

    def current_device(self) -> int | None:
        return self.device_now

    def current_stream(self, device: int) -> FakeStream:
        current = getattr(self._tls, "current", None)
        if current is not None and current.device == device:
            return current
        return self.compute.setdefault(device, FakeStream(device, "compute"))

    def side_stream(self, device: int) -> FakeStream:
        stream = FakeStream(device, "side")
        self.sides.append(stream)
        return stream

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    @contextlib.contextmanager
    def using(self, stream: FakeStream) -> Iterator[object]:
        previous = getattr(self._tls, "current", None)
        self._tls.current = stream
        try:
            yield stream
        finally:
            self._tls.current = previous

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        current = getattr(self._tls, "current", None)
        assert current is not None and current.name == "side", "a copy off the side stream"
        if self.eager:
            dst.copy_(src)
        else:
            current.pending.append((dst, src))
        self.copied.append(src)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


@dataclass
class FakeFlight:
    manifest: Manifest
    captured: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    stats: Any = field(default_factory=lambda: SimpleNamespace(guard_s=0.0))


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Let the loop run until ``predicate()`` holds (fail after ``within`` seconds)."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - the state changes on other threads too
            await asyncio.sleep(0.001)


async def settle_loop(seconds: float = 0.05) -> None:
    """Let the loop run for a while (pollers poll, copies that may complete do)."""
    for _ in range(max(1, round(seconds / 0.002))):
        await asyncio.sleep(0.002)


def plan(
    state: dict[str, Any], step: int = 1, shard_size: int = 8192, pack_bytes: int = 1024
) -> tuple[Manifest, list[TensorRef]]:
    tree, refs = walk_state(state, allow_pickle=False)
    manifest = plan_layout(
        step, tree, refs, LayoutOptions(shard_size=shard_size, pack_bytes=pack_bytes)
    )
    return manifest, refs


@pytest.fixture
async def rt() -> AsyncIterator[FakeRuntime]:
    runtime = FakeRuntime()
    yield runtime
    # torn down on the test's loop before it closes: a failed test must not leave captures
    # polling for a copy that the fake device would never complete
    runtime.budget = None
    await settle_loop(0.05)


@pytest.fixture
def arena() -> HostArena:
    a = HostArena(4 << 20, pinned=False)
    a.allocate_memory()
    return a  # tests keep blocks held at the end; the memory goes with the object


@pytest.fixture
def capture(rt: FakeRuntime) -> Iterator[CudaCapture]:
    c = CudaCapture(runtime=rt)
    yield c
    c.close()


def make_jobs(manifest: Manifest, refs: list[TensorRef], arena: HostArena) -> list[CaptureJob]:
    jobs = []
    for shard in manifest.shards:
        block = arena.try_allocate(shard.length)
        assert block is not None
        block.tensor().fill_(0xAB)  # stale bytes from an earlier use of the block
        jobs.append(CaptureJob(manifest, shard, refs, block))
    return jobs


def mixed_state(rt: FakeRuntime) -> dict[str, Any]:
    return {
        "rows": rt.to_device(torch.randn(64, 96)),  # 24 KiB: row chunks
        "flat": rt.to_device(torch.randn(3, 5000)),  # a row larger than a shard: flat chunks
        "bias": rt.to_device(torch.randn(10)),  # packed
        "codes": rt.to_device(torch.arange(7, dtype=torch.int16)),  # packed, odd size
        "step": torch.tensor(3.0),  # a CPU tensor in the same pack (AdamW's step)
        "host": torch.randn(40, 40),  # a CPU chunk
        "half": rt.to_device(torch.randn(33, 17).to(torch.bfloat16)),
        "lr": 0.1,
    }


# -- polling --------------------------------------------------------------------------------


def test_poll_delays_grow_from_50us_to_a_2ms_cap() -> None:
    delays = list(itertools.islice(PollOptions().delays(), 9))
    assert delays == pytest.approx(
        [50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 2e-3, 2e-3, 2e-3]
    )
    custom = list(itertools.islice(PollOptions(first_s=1e-3, max_s=4e-3, factor=3).delays(), 4))
    assert custom == pytest.approx([1e-3, 3e-3, 4e-3, 4e-3])


@pytest.mark.parametrize(
    "kwargs",
    [{"first_s": 0.0}, {"first_s": 5e-3, "max_s": 1e-3}, {"factor": 0.5}, {"max_s": float("inf")}],
)
def test_poll_options_refuse_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        PollOptions(**kwargs)


class CountdownEvent:
    def __init__(self, not_ready: int) -> None:
        self.not_ready = not_ready
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.not_ready

    def record(self, stream: Any) -> None:
        raise AssertionError("not recorded here")

    def synchronize(self) -> None:
        raise AssertionError("a thread blocked on a device event")


async def test_wait_for_event_sleeps_between_queries_with_back_off() -> None:
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)
        await asyncio.sleep(0)

    event = CountdownEvent(not_ready=7)
    queries = await wait_for_event(event, PollOptions(), sleep)
    assert queries == 8 == event.queries
    assert slept == pytest.approx([50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 2e-3])
    assert await wait_for_event(CountdownEvent(not_ready=0), PollOptions(), sleep) == 1
    assert len(slept) == 7  # a finished event costs one query and no sleep


async def test_waiting_for_an_event_leaves_the_loop_free() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    flow = asyncio.create_task(ticker())
    try:
        await wait_for_event(CountdownEvent(not_ready=6), PollOptions(first_s=1e-3, max_s=1e-3))
    finally:
        flow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flow
    assert ticks >= 6


# -- the in-flight window ---------------------------------------------------------------------


async def test_inflight_window_admits_in_arrival_order_and_bounds_holders() -> None:
    window = InflightWindow(2)
    admitted: list[int] = []
    peak = 0

    async def worker(i: int, gate: asyncio.Event) -> None:
        nonlocal peak
        await window.acquire()
        admitted.append(i)
        peak = max(peak, window.held)
        await gate.wait()
        window.release()

    gates = [asyncio.Event() for _ in range(6)]
    flows = [asyncio.create_task(worker(i, gates[i])) for i in range(6)]
    await settle_loop()
    assert admitted == [0, 1]
    gates[1].set()
    await settle_loop()
    assert admitted == [0, 1, 2]
    for gate in gates:
        gate.set()
    await asyncio.gather(*flows)
    assert admitted == list(range(6))
    assert peak == window.peak == 2
    assert window.held == 0


async def test_a_cancelled_waiter_does_not_leak_a_slot() -> None:
    window = InflightWindow(1)
    await window.acquire()
    waiter = asyncio.create_task(window.acquire())
    await settle_loop(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    window.release()
    assert window.held == 0
    await asyncio.wait_for(window.acquire(), 1)
    assert window.held == 1
    with pytest.raises(ConfigurationError):
        InflightWindow(0)


async def test_pool_work_outlives_a_cancelled_caller() -> None:
    """Thread work writes into a block that goes back to the arena once the capture ends:
    a cancelled capture must not end before its thread does."""
    release = threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        flow = asyncio.create_task(in_pool(pool, release.wait, 10))
        await settle_loop(0.05)
        flow.cancel()
        await settle_loop(0.05)
        assert not flow.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(flow, 5)
        assert await in_pool(pool, sum, [1, 2, 3]) == 6
    finally:
        pool.shutdown()


# -- capture ----------------------------------------------------------------------------------


async def test_capture_writes_the_same_bytes_as_the_cpu_path(
    arena: HostArena, rt: FakeRuntime
) -> None:
    rt.polls_before_done = 3
    manifest, refs = plan(mixed_state(rt))
    kinds = {s.kind for s in manifest.shards}
    modes = {t.mode for t in manifest.tensors}
    assert kinds == {"pack", "chunk"} and {"rows", "flat", "pack"} <= modes
    jobs = make_jobs(manifest, refs, arena)
    cpu_jobs = make_jobs(manifest, refs, arena)
    capture = CudaCapture(runtime=rt, max_inflight=2)
    cpu = CpuCapture()
    try:
        await asyncio.gather(*(capture.capture(j) for j in jobs))
        for j in cpu_jobs:
            await cpu.capture(j)
    finally:
        capture.close()
        cpu.close()
    for job, ref_job in zip(jobs, cpu_jobs, strict=True):
        assert bytes(job.block.memoryview()) == bytes(ref_job.block.memoryview())
        assert block_checksum(job.block) == block_checksum(ref_job.block)
    device_keys = {k for k in ("rows", "flat", "bias", "codes", "half")}
    assert len(rt.copied) == sum(
        1 for s in manifest.shards for seg in s.segments if refs[seg.tensor].key in device_keys
    )
    assert all(not e.ops and e.complete for e in rt.copy_events)


async def test_the_capture_returns_only_once_the_copy_is_complete(
    arena: HostArena, rt: FakeRuntime, capture: CudaCapture
) -> None:
    rt.budget = 0
    t = rt.to_device(torch.randn(16, 128))  # 8 KiB: one chunk
    manifest, refs = plan({"t": t})
    (job,) = make_jobs(manifest, refs, arena)
    flow = asyncio.create_task(capture.capture(job))
    await settle_loop(0.1)
    assert not flow.done()
    (event,) = rt.copy_events
    assert event.queries >= 3  # polled, again and again, without blocking
    assert bytes(job.block.memoryview()[:16]) == b"\xab" * 16  # the "DMA" has not run
    rt.budget = None
    await asyncio.wait_for(flow, 5)
    assert block_checksum(job.block) == crc32c.crc32c(t.numpy().tobytes())


async def test_copies_in_flight_are_bounded_and_enqueued_in_shard_order(
    arena: HostArena, rt: FakeRuntime
) -> None:
    rt.budget = 0
    t = rt.to_device(torch.arange(12 * 2048, dtype=torch.float32).reshape(12 * 4, 512))
    manifest, refs = plan({"t": t})
    assert len(manifest.shards) == 12
    jobs = make_jobs(manifest, refs, arena)
    capture = CudaCapture(runtime=rt, max_inflight=3)
    try:
        flows = [asyncio.create_task(capture.capture(j)) for j in jobs]
        await settle_loop()
        assert len(rt.copy_events) == 3 and rt.outstanding == 3
        most = 0
        while not all(flow.done() for flow in flows):
            rt.budget = 1  # let one copy finish
            await until(lambda: rt.budget == 0 or all(flow.done() for flow in flows))
            await settle_loop(0.01)
            most = max(most, rt.outstanding)
            assert rt.outstanding <= 3
        await asyncio.gather(*flows)
    finally:
        capture.close()
    assert most == 3
    starts = [int(src[0, 0].item()) for src in rt.copied]
    assert starts == sorted(starts) and len(starts) == 12


async def test_a_tensor_changed_before_its_copy_is_enqueued_fails_at_once(
    arena: HostArena, rt: FakeRuntime, capture: CudaCapture
) -> None:
    t = rt.to_device(torch.randn(16, 128))
    manifest, refs = plan({"t": t})
    (job,) = make_jobs(manifest, refs, arena)
    t.mul_(2)
    with pytest.raises(ImmutabilityViolationError, match="'t'"):
        await capture.capture(job)
    assert rt.copied == []


async def test_a_tensor_changed_while_its_copy_runs_fails_the_capture(
    arena: HostArena, rt: FakeRuntime, capture: CudaCapture
) -> None:
    rt.budget = 0
    t = rt.to_device(torch.randn(16, 128))
    manifest, refs = plan({"t": t})
    (job,) = make_jobs(manifest, refs, arena)
    flow = asyncio.create_task(capture.capture(job))
    await until(lambda: len(rt.copy_events) == 1)
    t.add_(1)  # no guard: the optimizer would race the copy
    rt.budget = None
    with pytest.raises(ImmutabilityViolationError, match="'t'"):
        await asyncio.wait_for(flow, 5)
    lane = capture._lanes[0]
    assert lane.window.held == 0 and not lane.queue


async def test_a_changed_cpu_source_fails_the_capture_too(
    arena: HostArena, rt: FakeRuntime, capture: CudaCapture
) -> None:
    host = torch.randn(40, 40)
    manifest, refs = plan({"host": host})
    (job,) = make_jobs(manifest, refs, arena)
    host.add_(1)
    with pytest.raises(ImmutabilityViolationError, match="'host'"):
        await capture.capture(job)


async def test_the_copy_waits_for_the_snapshot_event_when_marked(
    arena: HostArena, rt: FakeRuntime, capture: CudaCapture
) -> None:
    t = rt.to_device(torch.randn(16, 128))
    manifest, refs = plan({"t": t}, step=5)
    capture.mark_snapshot(5)
    (mark,) = rt.compute[0].events
    (job,) = make_jobs(manifest, refs, arena)
    await capture.capture(job)
    (side,) = rt.sides
    assert side.log[0] == ("wait_event", mark)

    manifest, refs = plan({"t": t}, step=6)  # not marked: wait for the whole stream
    (job,) = make_jobs(manifest, refs, arena)
    await capture.capture(job)
    assert side.log[-1] == ("wait_stream", rt.compute[0])
    assert capture._marks == {}  # dropped once its step is captured


async def test_mark_snapshot_does_nothing_before_the_device_is_used(
    rt: FakeRuntime, capture: CudaCapture
) -> None:
    rt.device_now = None
    capture.mark_snapshot(1)
    assert rt.compute == {} and capture._marks == {}


async def test_a_cancelled_capture_returns_only_after_its_copy_completes(
    arena: HostArena, rt: FakeRuntime, capture: CudaCapture
) -> None:
    rt.budget = 0
    t = rt.to_device(torch.randn(16, 128))
    manifest, refs = plan({"t": t})
    (job,) = make_jobs(manifest, refs, arena)
    flow = asyncio.create_task(capture.capture(job))
    await until(lambda: len(rt.copy_events) == 1)
    flow.cancel()
    await settle_loop()
    assert not flow.done()  # the block is still a DMA target: it must not be reused yet
    rt.budget = None
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(flow, 5)
    assert rt.outstanding == 0
    assert capture._lanes[0].window.held == 0


async def test_bookkeeping_stays_bounded_over_many_snapshots(
    arena: HostArena, rt: FakeRuntime, capture: CudaCapture
) -> None:
    t = rt.to_device(torch.randn(8, 8))
    for step in range(1, 301):
        manifest, refs = plan({"t": t}, step=step)
        capture.mark_snapshot(step)
        (job,) = make_jobs(manifest, refs, arena)
        await capture.capture(job)
        arena.release(job.block)
    assert capture._progress == {} and capture._marks == {}
    assert len(capture._finished) <= 256
    assert not capture._lanes[0].queue


# -- the stream guard ---------------------------------------------------------------------------


async def start_all(capture: CudaCapture, jobs: list[CaptureJob]) -> list[asyncio.Task[None]]:
    return [asyncio.create_task(capture.capture(j)) for j in jobs]


async def test_the_fence_orders_the_compute_stream_without_waiting_for_the_copy(
    arena: HostArena, rt: FakeRuntime, capture: CudaCapture
) -> None:
    rt.budget = 0
    t = rt.to_device(torch.randn(48, 128))  # three chunks
    step_count = torch.tensor(1.0)  # a CPU tensor the optimizer bumps too
    manifest, refs = plan({"t": t, "step": step_count})
    jobs = make_jobs(manifest, refs, arena)
    flight = FakeFlight(manifest)
    flows = await start_all(capture, jobs)
    await until(lambda: len(rt.copy_events) == 3)
    t0 = time.perf_counter()
    waited = await asyncio.to_thread(capture.fence, [flight])
    assert time.perf_counter() - t0 < 1.0 and waited == 1
    assert rt.compute[0].log == [("wait_event", rt.copy_events[-1])]
    device_flows = [
        flow for flow, job in zip(flows, jobs, strict=True) if job.shard.kind == "chunk"
    ]
    assert not any(flow.done() for flow in device_flows)  # the CPU went on, the copies run
    t.add_(0)  # the optimizer step, issued after the fence: the GPU runs it after the copy
    step_count.add_(1)
    rt.budget = None
    await asyncio.wait_for(asyncio.gather(*flows), 5)
    assert all(flow.done() and flow.exception() is None for flow in flows)


async def test_a_change_issued_before_the_fence_still_fails_the_snapshot(
    arena: HostArena, rt: FakeRuntime, capture: CudaCapture
) -> None:
    rt.budget = 0
    t = rt.to_device(torch.randn(16, 128))
    manifest, refs = plan({"t": t})
    jobs = make_jobs(manifest, refs, arena)
    (flow,) = await start_all(capture, jobs)
    await until(lambda: len(rt.copy_events) == 1)
    t.add_(0)  # issued after the copy was enqueued, before the fence: it may race
    await asyncio.to_thread(capture.fence, [FakeFlight(manifest)])
    rt.budget = None
    with pytest.raises(ImmutabilityViolationError, match="'t'"):
        await asyncio.wait_for(flow, 5)


async def test_the_fence_waits_until_every_shard_of_a_pending_snapshot_is_staged(
    arena: HostArena, rt: FakeRuntime, capture: CudaCapture
) -> None:
    rt.budget = 0
    t = rt.to_device(torch.randn(48, 128))
    manifest, refs = plan({"t": t})
    jobs = make_jobs(manifest, refs, arena)
    flight = FakeFlight(manifest)
    first = asyncio.create_task(capture.capture(jobs[0]))
    await until(lambda: len(rt.copy_events) == 1)
    fencing = asyncio.create_task(asyncio.to_thread(capture.fence, [flight]))
    await settle_loop(0.2)
    assert not fencing.done()  # two shards have no copy to wait on yet
    rest = await start_all(capture, jobs[1:])
    assert await asyncio.wait_for(fencing, 5) == 1
    assert rt.compute[0].log == [("wait_event", rt.copy_events[-1])]
    assert len(rt.copy_events) == 3
    rt.budget = None
    await asyncio.gather(first, *rest)

    # a snapshot that failed before all its shards started must not hold the fence
    manifest2, _ = plan({"t": t}, step=2)
    failed = FakeFlight(manifest2)
    fencing = asyncio.create_task(asyncio.to_thread(capture.fence, [failed]))
    await settle_loop(0.1)
    assert not fencing.done()
    failed.captured.set_exception(RuntimeError("capture failed"))
    assert await asyncio.wait_for(fencing, 5) == 0


async def test_stream_guard_hook_fences_from_an_optimizer_step(
    arena: HostArena, rt: FakeRuntime
) -> None:
    rt.budget = 0
    t = rt.to_device(torch.randn(16, 128))
    manifest, refs = plan({"t": t})
    jobs = make_jobs(manifest, refs, arena)
    flight = FakeFlight(manifest)
    capture = CudaCapture(runtime=rt)
    reported: list[int] = []
    closing = False
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.5)
    handle = opt.register_step_pre_hook(
        stream_guard_hook(
            capture,
            lambda: [flight],
            raise_unreported=lambda: reported.append(1),
            closing=lambda: closing,
        )
    )
    try:
        (flow,) = await start_all(capture, jobs)
        await until(lambda: len(rt.copy_events) == 1)
        param.grad = torch.ones(3)
        await asyncio.to_thread(opt.step)
        assert rt.compute[0].log == [("wait_event", rt.copy_events[0])]
        assert flight.stats.guard_s > 0 and reported == [1]
        assert torch.equal(param.detach(), torch.full((3,), 0.5))
        closing = True
        await asyncio.to_thread(opt.step)
        assert len(rt.compute[0].log) == 1 and reported == [1]
        rt.budget = None
        await asyncio.wait_for(flow, 5)
    finally:
        handle.remove()
        capture.close()


def test_stream_guard_with_the_engine_keeps_each_snapshot_before_its_step() -> None:
    """The hook on a real Checkpointer: its flights, its errors, an optimizer that bumps the
    version counters before the copies are seen complete."""
    rt = FakeRuntime(eager=True)
    model = torch.nn.Linear(64, 64)
    for p in model.parameters():
        rt.to_device(p)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with lazyckpt.SyncCheckpointer(
        [HostMemoryTier(8 << 20)], shard_size=8192, pack_bytes=1024, eager_bytes=0
    ) as ckpt:
        engine = ckpt._core.engine
        engine.capture.close()
        capture = CudaCapture(runtime=rt)
        engine.capture = capture
        opt.register_step_pre_hook(
            stream_guard_hook(
                capture, engine.pending_captures, raise_unreported=engine.raise_unreported
            )
        )
        expected = []
        for step in range(1, 4):
            model(torch.randn(4, 64)).sum().backward()
            rt.budget = 0  # no copy is seen complete before the optimizer step
            capture.mark_snapshot(step)
            handle = ckpt.snapshot({"model": model, "optim": opt}, step=step)
            expected.append({k: v.clone() for k, v in model.state_dict().items()})
            opt.step()  # bumps every version counter while the copies are still "running"
            opt.zero_grad()
            assert handle.state() == "capturing"
            assert rt.compute[0].log[-1] == ("wait_event", rt.copy_events[-1])
            assert handle.stats is not None and handle.stats.guard_s > 0
            rt.budget = None
            handle.wait("committed", timeout=10)
        restored = ckpt.restore(step=3)
    for key, value in expected[-1].items():
        assert torch.equal(restored["model"][key], value), key
    assert not torch.equal(model.weight, expected[-1]["weight"])


def test_guard_mode_resolution() -> None:
    capture = CudaCapture(runtime=FakeRuntime())
    cpu = CpuCapture()
    try:
        assert resolve_guard_mode("stream", capture) == "stream"
        assert resolve_guard_mode("cpu", capture) == "cpu"
        assert resolve_guard_mode("stream", cpu) == "cpu"  # CPU tensors: only blocking is safe
        with pytest.raises(ConfigurationError, match="'cpu' or 'stream'"):
            resolve_guard_mode("gpu", capture)
    finally:
        capture.close()
        cpu.close()
    with pytest.raises(ConfigurationError):
        CudaCapture(runtime=FakeRuntime(), max_inflight=0)


# -- restore ----------------------------------------------------------------------------------


class BytesTier:
    """Holds shards as bytes; ``corrupt`` flips a byte of every shard it returns."""

    def __init__(self, name: str, shards: dict[int, bytes], corrupt: bool = False) -> None:
        self.name = name
        self.shards = shards
        self.corrupt = corrupt
        self.reads = 0

    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        self.reads += 1
        data = bytearray(self.shards[shard.index])
        if self.corrupt:
            data[0] ^= 0xFF
        out[:] = data


class LendingTier:
    """Lends arena blocks like the host-memory tier would."""

    def __init__(self, name: str, arena: HostArena, shards: dict[int, bytes]) -> None:
        self.name = name
        self.arena = arena
        self.blocks = {}
        for index, data in shards.items():
            block = arena.try_allocate(len(data))
            assert block is not None
            block.memoryview()[:] = data
            self.blocks[index] = block
        self.lent = 0
        self.returned = 0

    def borrow_shard(self, manifest: Manifest, shard: ShardMeta) -> Any:
        block = self.blocks.get(shard.index)
        if block is None or not self.arena.claim(block):
            return None
        self.lent += 1
        return block

    def return_shard(self, block: Any) -> None:
        self.returned += 1
        self.arena.release(block)

    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        raise AssertionError("a lending tier is not copied from")


async def captured_shards(
    manifest: Manifest, refs: list[TensorRef], arena: HostArena
) -> tuple[Manifest, dict[int, bytes]]:
    cpu = CpuCapture()
    try:
        jobs = make_jobs(manifest, refs, arena)
        for j in jobs:
            await cpu.capture(j)
        crcs = [block_checksum(j.block) for j in jobs]
    finally:
        cpu.close()
    shards = {j.shard.index: bytes(j.block.memoryview()) for j in jobs}
    for j in jobs:
        arena.release(j.block)
    return manifest.with_checksums(crcs), shards


async def test_restore_fills_device_and_host_targets_in_place_from_a_good_copy(
    arena: HostArena, rt: FakeRuntime
) -> None:
    source = mixed_state(FakeRuntime())
    manifest, refs = plan(source)
    manifest, shards = await captured_shards(manifest, refs, arena)
    targets: list[torch.Tensor | None] = []
    for meta in manifest.tensors:
        fresh = torch.zeros(meta.shape, dtype=meta.torch_dtype)
        targets.append(fresh if meta.key == "host" else rt.to_device(fresh))
    pointers = [t.data_ptr() for t in targets if t is not None]
    bad = BytesTier("bad", shards, corrupt=True)
    good = BytesTier("good", shards)
    rt.budget = 0
    flow = asyncio.create_task(
        restore_into(manifest, [bad, good], targets, runtime=rt, concurrency=64)
    )
    await until(lambda: len(rt.copy_events) == len(manifest.shards) - 1)  # "host" has no copy
    await settle_loop()
    assert not flow.done()  # it returns only once the device copies are complete
    rt.budget = None
    await asyncio.wait_for(flow, 5)
    assert bad.reads == good.reads == len(manifest.shards)
    for meta, target in zip(manifest.tensors, targets, strict=True):
        assert target is not None
        assert torch.equal(target, source[meta.key]), meta.key
    assert [t.data_ptr() for t in targets if t is not None] == pointers
    assert all(side.log and side.log[0][0] == "wait_stream" for side in rt.sides)


async def test_restore_from_a_lending_tier_returns_each_block_after_its_copy(
    arena: HostArena, rt: FakeRuntime
) -> None:
    source = {"a": torch.randn(48, 128), "b": torch.randn(5)}
    manifest, refs = plan(source)
    manifest, shards = await captured_shards(manifest, refs, arena)
    lending = LendingTier("host", arena, shards)
    targets = [rt.to_device(torch.zeros(m.shape, dtype=m.torch_dtype)) for m in manifest.tensors]
    rt.budget = 0
    flow = asyncio.create_task(
        restore_into(manifest, [lending], targets, runtime=rt, concurrency=64)
    )
    await until(lambda: len(rt.copy_events) == len(manifest.shards))
    await settle_loop()
    assert lending.lent == len(manifest.shards) and lending.returned == 0
    rt.budget = None
    await asyncio.wait_for(flow, 5)
    assert lending.returned == lending.lent
    assert torch.equal(targets[0], source["a"]) and torch.equal(targets[1], source["b"])


async def test_restore_into_a_non_contiguous_flat_split_target(
    arena: HostArena, rt: FakeRuntime
) -> None:
    source = {"wide": torch.randn(2, 5000)}  # rows of 20 KB > 8 KiB shards: flat chunks
    manifest, refs = plan(source)
    assert manifest.tensors[0].mode == "flat"
    manifest, shards = await captured_shards(manifest, refs, arena)
    storage = rt.to_device(torch.zeros(5000, 2))
    target = storage.t()  # same shape as the source, not contiguous
    await restore_into(manifest, [BytesTier("t", shards)], [target], runtime=rt)
    assert torch.equal(target, source["wide"])


async def test_restore_names_the_shard_no_tier_holds_intact(
    arena: HostArena, rt: FakeRuntime
) -> None:
    manifest, refs = plan({"a": torch.randn(16, 128)})
    manifest, shards = await captured_shards(manifest, refs, arena)
    target = rt.to_device(torch.zeros(16, 128))
    with pytest.raises(CorruptionError, match="no tier holds a good copy of shard 0"):
        await restore_into(manifest, [BytesTier("x", shards, corrupt=True)], [target], runtime=rt)


# -- the checksum stage after a CUDA capture ---------------------------------------------------


def cuda_checkpointer(rt: FakeRuntime, **kwargs: Any) -> lazyckpt.SyncCheckpointer:
    ckpt = lazyckpt.SyncCheckpointer(
        [HostMemoryTier(8 << 20), *kwargs.pop("durable", [])],
        shard_size=8192,
        pack_bytes=1024,
        retry_backoff=0.001,
        eager_bytes=0,  # every tensor through the (fake) device path under test
        **kwargs,
    )
    engine = ckpt._core.engine
    engine.capture.close()
    engine.capture = CudaCapture(runtime=rt)
    return ckpt


@pytest.mark.parametrize("mode", ["cpu", "stream"])
def test_the_guard_does_not_wait_for_checksums_after_a_cuda_capture(
    tmp_path: Path, mode: str
) -> None:
    """Both guards let the optimizer step go once the copies are complete; a parameter
    changed then, before any checksum, does not reach the snapshot."""
    rt = FakeRuntime()
    model = torch.nn.Linear(64, 64)
    for p in model.parameters():
        rt.to_device(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with cuda_checkpointer(rt, durable=[FileTier(tmp_path / "f")]) as ckpt:
        engine = ckpt._core.engine
        capture = engine.capture
        assert isinstance(capture, CudaCapture)
        held = HeldChecksums(engine.checksums)
        engine.checksums = held
        ckpt.guard(opt, mode=mode)
        model(torch.randn(4, 64)).sum().backward()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        rt.budget = 0
        capture.mark_snapshot(1)
        handle = ckpt.snapshot({"model": model}, step=1)
        time.sleep(0.1)
        assert handle.state() == "capturing"  # the "DMA" has not run
        rt.budget = None
        handle.wait("captured", timeout=10)
        assert capture._progress == {} and not capture._lanes[0].queue
        assert held.done == 0
        t0 = time.perf_counter()
        opt.step()  # the guard: nothing pending, whatever the checksums do
        assert time.perf_counter() - t0 < 5
        assert not rt.compute.get(0) or not rt.compute[0].log  # nothing left to fence
        opt.zero_grad()
        held.gate.set()
        handle.wait("committed", timeout=10)
        assert handle._flight is not None
        assert held.done == len(handle._flight.manifest.shards)
        restored = ckpt.restore(step=1)
    for key, value in expected.items():
        assert torch.equal(restored["model"][key], value), key
    assert not torch.equal(model.weight.detach(), expected["weight"])
    with lazyckpt.SyncCheckpointer([FileTier(tmp_path / "f")]) as fresh:
        from_file = fresh.restore(step=1)
    for key, value in expected.items():
        assert torch.equal(from_file["model"][key], value), key


def test_a_failing_checksum_after_a_cuda_capture_fails_cleanly(tmp_path: Path) -> None:
    rt = FakeRuntime()
    t = rt.to_device(torch.randn(48, 128))  # three chunks
    durable = FaultyTier(FileTier(tmp_path / "f"))
    with cuda_checkpointer(rt, durable=[durable]) as ckpt:
        engine = ckpt._core.engine
        capture = engine.capture
        assert isinstance(capture, CudaCapture)
        held = HeldChecksums(engine.checksums, fail_all=True)
        engine.checksums = held
        capture.mark_snapshot(1)
        handle = ckpt.snapshot({"t": t}, step=1)
        handle.wait("captured", timeout=10)  # every copy completed; nothing checksummed
        held.gate.set()
        with pytest.raises(lazyckpt.SnapshotFailedError) as info:
            handle.wait("committed", timeout=10)
        assert info.group_contains(OSError, match="checksum thread lost")
        engine.loop.submit(engine.drain()).result(10)
        arena = engine.arena.stats()
        assert (arena.held, arena.evictable) == (0, 0)
        assert rt.outstanding == 0 and capture._lanes[0].window.held == 0
        assert durable.calls["put_shard"] == 0 and durable.calls["commit"] == 0
        assert ckpt.steps() == []
        engine.checksums = held.real  # the checksums work again: so does the next snapshot
        capture.mark_snapshot(2)
        ckpt.snapshot({"t": t}, step=2).wait("committed", timeout=10)
        assert torch.equal(ckpt.restore(step=2)["t"], t)
