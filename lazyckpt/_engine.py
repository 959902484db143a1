"""The scheduler: moves every shard of every snapshot through the tiers, on the engine loop.

One ``Engine`` belongs to one Checkpointer. Everything here runs on the engine's own loop
thread (``_loop.EngineLoop``) except the few methods marked *any thread*, which only touch
thread-safe futures and a lock.

A snapshot in flight is a :class:`Flight`. Its coroutine starts each durable tier's
``begin`` for the step, allocates an arena block for each shard in order (waiting when the
arena is full: backpressure), and starts one *shard flow* per shard: capture into the
block, then checksum the block, then put on each durable tier in chain order, each put
waiting for that tier's ``begin``. On the CPU path the shards that got their blocks together
(up to 64 MiB) are copied in one pool job and checksummed in one more before their flows
go on to the tiers: fewer takes of the interpreter lock per GiB, which is what a
launch-bound training thread pays for (see "The host stage" below). Nothing a tier does is in front of a capture, so a slow
or hung tier holds training up only once the arena is full. The snapshot counts as
captured (the guard lets the optimizer go on) once every shard is copied; the checksums
follow on a pool of their own, off that critical path, and no tier sees a shard before its
checksum is known. Each shard state change goes through the state table (``_state``); the
flow never decides a rule itself. When the last shard reaches a tier, that tier commits the
snapshot's manifest. On a host-only chain the host tier is the last one: a snapshot takes
its arena space whole and counts as committed only if the host tier keeps it.

Every task belongs to the engine's task group; failures are recorded on the flight, raised
from its handle, logged once, and queued for the failure policy (``on_failure="raise"``:
the next ``snapshot()``, ``wait_captured()`` or ``aclose()`` raises it; never the guard).

Incremental snapshots (``incremental=True`` or ``"versions"``; ``_incremental`` holds the
bases, pins and skipped captures, docs/design.md the reasons): before a shard's put on a tier that supports
references, the flow asks whether the tier's newest committed step holds the same bytes;
if so the manifest refers to them and nothing is written. In ``"versions"`` mode a shard
whose tensors did not change since its last capture skips its capture too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import torch

from . import hooks
from ._arena import Block, HostArena
from ._capture import BatchCapture, CaptureBackend, CaptureJob, ChecksumPool, CpuCapture
from ._cuda import CudaCapture
from ._distributed import Coordinator, distributed_context
from ._errors import (
    CheckpointerClosedError,
    ConfigurationError,
    LazyCkptError,
    SnapshotFailedError,
    TierBrokenError,
    TierFullError,
)
from ._fetch import read_copy
from ._flight import Flight, SnapshotStats, Stage
from ._incremental import Increments
from ._loop import EngineLoop
from ._manifest import LayoutOptions, Manifest, ShardMeta
from ._options import CheckpointerOptions
from ._replica import join_peers
from ._state import Event, StateTable, advance, build_table
from ._tier import SupportsGlobalCommit, SupportsReferences, SupportsStaging, Tier
from ._tiercall import RetryPolicy, call_tier

__all__ = ["Engine", "Flight", "RetryPolicy", "SnapshotStats", "call_tier"]

log = logging.getLogger("lazyckpt")
T = TypeVar("T")
# the bytes one CPU capture job copies (see Engine._batch_limit)
_BATCH_BYTES = 64 << 20


class Engine:
    """See the module docstring. Built by the Checkpointer; not public."""

    def __init__(self, tiers: Sequence[Tier], options: CheckpointerOptions) -> None:
        tiers = list(tiers)
        if not tiers:
            raise ConfigurationError("a Checkpointer needs at least one tier")
        for t in tiers:
            if not isinstance(t, Tier):
                raise ConfigurationError(f"{t!r} is not a lazyckpt Tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"tier names must be unique, got {names}; pass name=...")
        self.options = options
        self.tiers = tiers
        self.host: Tier | None = tiers[0] if isinstance(tiers[0], SupportsStaging) else None
        # the same object, typed for the staging calls (adopt, evicted, forget)
        self.staging: SupportsStaging | None = (
            tiers[0] if isinstance(tiers[0], SupportsStaging) else None
        )
        self.durable: list[Tier] = tiers[1:] if self.host is not None else tiers
        # a host-only chain: the host tier is where snapshots end, so a snapshot counts as
        # committed only if the arena keeps it whole (see _run_kept)
        self.host_last = self.host is not None and not self.durable
        for t in self.durable:
            if isinstance(t, SupportsStaging):
                raise ConfigurationError(
                    f"{t!r} is a host-memory tier; it can only be the first tier of the chain"
                )
        self.table: StateTable = build_table([t.level for t in self.durable])
        # the chain's stages, indexed from 0 everywhere: 0 is the host stage (the host tier,
        # or the engine's private staging arena), 1.. the durable tiers in chain order
        self.stages: list[Stage] = [Stage(0, self.host.name if self.host else "<staging>", self.host)]
        self.stages += [Stage(k, t.name, t) for k, t in enumerate(self.durable, 1)]
        self.stage_names: list[str] = [stage.name for stage in self.stages]
        # the stages that are a tier of the chain (what a handle's reached() may name)
        self.tier_names: list[str] = [stage.name for stage in self.stages if stage.tier is not None]
        if self.staging is not None:
            self.arena: HostArena = self.staging.arena
        else:
            self.arena = HostArena(options.staging_bytes)
        # the shard layout: the defaults of shard_size and pack_bytes depend on the arena
        self.layout: LayoutOptions = options.layout(self.arena.capacity)
        if self.arena.capacity < self.layout.shard_size:
            raise ConfigurationError(
                f"the host arena ({self.arena.capacity} bytes) is smaller than one shard "
                f"({self.layout.shard_size} bytes); raise capacity_bytes or lower shard_size"
            )
        self.loop = EngineLoop(use_uvloop=options.use_uvloop)  # started by open()
        self.capture: CaptureBackend = _default_capture(options)
        self.checksums = ChecksumPool(options.checksum_threads)
        # incremental snapshots: bases, pins and skipped captures (_incremental)
        self.increments = Increments(options.incremental, self.stages, host_only=self.host_last)
        self.flights: dict[int, Flight] = {}
        self.protected: dict[int, int] = {}  # step -> restores in progress
        self._lock = threading.Lock()
        self._unreported: list[LazyCkptError] = []
        self._pending_captures: list[Flight] = []  # any thread, under _lock
        self._tg: asyncio.TaskGroup | None = None
        self._main_done: concurrent.futures.Future[None] | None = None
        self._stop: asyncio.Event | None = None
        # per durable stage (by its index): its turn on the tier, and its retention passes
        self._tier_sems: dict[int, asyncio.Semaphore] = {}
        self._retention_locks: dict[int, asyncio.Lock] = {}
        self._retention_queued: dict[int, bool] = {}
        self._kept_order: asyncio.Lock | None = None
        self._kept_queue: list[Flight] = []  # host-only chain: started flights, step order
        self.closed = False
        self.opened = False
        self.skipped = 0
        self.failed = 0  # snapshots that failed (on any stage), for metrics
        self.rank = 0
        self.world_size = 1
        self.coordinator: Coordinator | None = None
        self._queues: list[asyncio.Queue[Flight]] = []
        self._coordinators: list[asyncio.Task[None]] = []
        self.history: list[SnapshotStats] = []
        self.tier_bytes: dict[str, int] = dict.fromkeys(self.stage_names, 0)
        self.tier_seconds: dict[str, float] = dict.fromkeys(self.stage_names, 0.0)
        self.tier_reused: dict[str, int] = dict.fromkeys(self.stage_names, 0)

    def _durable_stages(self) -> range:
        """The indexes of the durable stages (1.. in chain order)."""
        return range(1, len(self.stages))

    def tier_of(self, stage: int) -> Tier:
        """The tier of a stage (stage 0 has one only with a host tier)."""
        tier = self.stages[stage].tier
        if tier is None:
            raise AssertionError(f"stage {stage} is the private staging arena, not a tier")
        return tier

    # -- life cycle (any thread) -----------------------------------------------------------

    async def open(self) -> None:
        """Allocate the arena, open the tiers, start the task group (engine loop)."""
        loop = asyncio.get_running_loop()
        context = distributed_context(self.options.distributed)
        if context is not None:
            self.rank, self.world_size = context
            self._check_distributed()
            for t in self.tiers:
                t.bind(self.rank, self.world_size)
            # a peer may legitimately spend a tier operation's every attempt between two
            # collectives (rank 0's commit_global on ZarrTier, say): wait that long for it
            timeout = self.options.retry_window()
            self.coordinator = await loop.run_in_executor(
                None, Coordinator, self.rank, self.world_size, len(self.durable), timeout
            )
        await loop.run_in_executor(None, self.arena.allocate_memory)
        await asyncio.gather(*(t.open() for t in self.tiers))
        if self.coordinator is not None:
            # tiers that keep replicas on other ranks meet their peers (_replica)
            await join_peers(self.tiers, partial(self.coordinator.gather, 0))
            await self.coordinator.barrier()  # nobody writes before every rank cleaned up
        self._tier_sems = {
            k: asyncio.Semaphore(self.options.io_concurrency) for k in self._durable_stages()
        }
        # retention: one pass at a time per tier; a pass not yet listing covers new commits
        self._retention_locks = {k: asyncio.Lock() for k in self._durable_stages()}
        self._retention_queued = dict.fromkeys(self._durable_stages(), False)
        self._kept_order = asyncio.Lock()
        started = asyncio.Event()
        self._stop = asyncio.Event()

        async def main() -> None:
            assert self._stop is not None
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                if self.coordinator is not None:
                    self._queues = [asyncio.Queue() for _ in self.stage_names]
                    self._coordinators = [
                        tg.create_task(self._coordinate(k), name=f"lazyckpt-coordinate-{k}")
                        for k in self._durable_stages()
                    ]
                started.set()
                await self._stop.wait()

        task = loop.create_task(main())
        self._main_task = task
        await started.wait()
        self.opened = True

    async def drain(self) -> None:
        """Wait until every flight is done (engine loop)."""
        while self.flights:
            await next(iter(self.flights.values())).done.wait()

    async def close(self) -> None:
        """Drain, stop the task group, close the tiers (engine loop). Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.opened:
                await self.drain()
        finally:
            if self._stop is not None:
                self._stop.set()
                for task in self._coordinators:  # they wait forever for more flights
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await self._main_task
            if self.coordinator is not None:
                self.coordinator.close()
            results = await asyncio.gather(
                *(t.aclose() for t in self.tiers), return_exceptions=True
            )
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.capture.close)
            await loop.run_in_executor(None, self.checksums.close)
            if self.host is None:
                self.arena.release_memory()
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]

    # -- errors (any thread) ---------------------------------------------------------------

    def take_unreported(self) -> list[LazyCkptError]:
        with self._lock:
            errors, self._unreported = self._unreported, []
        return errors

    def raise_unreported(self) -> None:
        errors = self.take_unreported()
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise SnapshotFailedError(
                f"{len(errors)} snapshots failed", errors, step=-1, tiers=self.stage_names
            )

    def mark_reported(self, flight: Flight) -> None:
        with self._lock:
            flight.reported = True
            self._unreported = [e for e in self._unreported if getattr(e, "step", None) != flight.step]

    # -- submitting (any thread) -----------------------------------------------------------

    def pending_captures(self) -> list[Flight]:
        with self._lock:
            return list(self._prune_captured())

    def _prune_captured(self) -> list[Flight]:
        """Drop finished captures (under ``_lock``): a finished flight kept in this list would
        keep its snapshot's tensors alive."""
        self._pending_captures = [f for f in self._pending_captures if not f.captured.done()]
        return self._pending_captures

    def busy_for(self, manifest: Manifest) -> bool:
        """Would this snapshot have to wait? (any thread; an estimate, read without locks)

        Busy means: a capture is still running, or the arena cannot take the snapshot now
        without waiting for slower tiers, or, for a snapshot larger than the arena, any
        earlier snapshot is still in flight.
        """
        if self.pending_captures():
            return True
        needed = sum((s.length + 4095) // 4096 * 4096 for s in manifest.shards)
        stats = self.arena.stats()
        if needed > stats.capacity:
            return bool(self.flights)
        return stats.capacity - stats.held < needed

    def submit(self, flight: Flight) -> None:
        """Hand a planned snapshot to the engine loop; returns at once."""
        with self._lock:
            self._prune_captured().append(flight)  # here too, not only when a guard asks
        self.loop.call_soon(self._start_flight, flight)

    def _start_flight(self, flight: Flight) -> None:
        if self._tg is None or self.closed:
            self._finish_failed(flight, CheckpointerClosedError("the Checkpointer was closed"), 0)
            return
        self.flights[flight.step] = flight
        if self.host_last:
            self._kept_queue.append(flight)
        for queue in self._queues[1:]:
            queue.put_nowait(flight)
        self._tg.create_task(self._run_flight(flight), name=f"lazyckpt-step-{flight.step}")

    # -- the flight ------------------------------------------------------------------------

    async def _guarded(
        self, stage: int, what: str, call: Callable[[], Awaitable[T]], *, retry: bool = True
    ) -> T:
        """Run a tier operation of a stage through :func:`call_tier`, under the options."""
        return await call_tier(self.stage_names[stage], what, call, self.options, retry=retry)

    def _fail(self, flight: Flight, stage: int, exc: Exception) -> None:
        if flight.failed_from is None or stage < flight.failed_from:
            flight.failed_from = stage
        if not isinstance(exc, asyncio.CancelledError):
            flight.errors.append(exc)
        # one warning per failed snapshot comes from _finish; the details are info
        log.info(
            "snapshot of step %d failed on %s: %s",
            flight.step,
            self.stage_names[stage],
            exc,
            extra={"step": flight.step, "tier": self.stage_names[stage]},
        )

    def _failed_at(self, flight: Flight, stage: int) -> bool:
        return flight.failed_from is not None and stage >= flight.failed_from

    async def _run_flight(self, flight: Flight) -> None:
        if self.increments.digesting:
            self.increments.choose_bases(flight)
            self.increments.fingerprint(flight)
            if self.increments.mode == "versions":
                self.increments.plan_uncaptured(flight)
        m = flight.manifest
        try:
            async with asyncio.TaskGroup() as tg:
                # each durable tier prepares the step beside the capture, never in front of
                # it: the guard waits for captures only, so a tier whose begin() is slow or
                # hangs must not hold training up; a shard waits for it before its put
                flight.begun = {
                    k: tg.create_task(self._begin(flight, k, self.tier_of(k)), name=f"lazyckpt-begin-{k}")
                    for k in self._durable_stages()
                }
                if self.host_last:
                    await self._run_kept(flight, tg)
                else:
                    await self._run_streamed(flight, tg)
                if not m.shards:
                    tg.create_task(self._commit_empty(flight))
        except Exception as exc:  # a bug in the engine: fail the snapshot loudly
            self._fail(flight, 0, exc)
        finally:
            await self._finish(flight)

    async def _run_streamed(self, flight: Flight, tg: asyncio.TaskGroup) -> None:
        """Start the shard flows of a snapshot that streams through the arena: each batch's
        first shard may wait for room (backpressure); the shards that fit now go with it,
        up to the batch bound (see :meth:`_batch_limit`)."""
        m = flight.manifest
        limit = self._batch_limit()
        i = 0
        while i < len(m.shards) and not self._failed_at(flight, 0):
            if i in flight.uncaptured:
                tg.create_task(self._uncaptured_flow(flight, i))
                i += 1
                continue
            batch = [(i, await self.arena.allocate(m.shards[i].length))]
            size = m.shards[i].length
            i += 1
            while i < len(m.shards) and i not in flight.uncaptured:
                if size + m.shards[i].length > limit:
                    break
                more = self.arena.try_allocate(m.shards[i].length)
                if more is None:
                    break
                batch.append((i, more))
                size += m.shards[i].length
                i += 1
            self._start_host_stage(flight, tg, batch)

    async def _begin(self, flight: Flight, stage: int, tier: Tier) -> bool:
        """``tier.begin`` for the flight; False (the flight failed on that tier) if it failed."""
        try:
            await self._guarded(stage, "begin", partial(tier.begin, flight.manifest))
        except Exception as exc:
            self._fail(flight, stage, exc)
            return False
        return True

    async def _run_kept(self, flight: Flight, tg: asyncio.TaskGroup) -> None:
        """Start the shard flows of a snapshot on a host-only chain.

        There the arena is the snapshot's only home, so it must hold all of it at once: a
        snapshot larger than the arena fails before anything is evicted, and the blocks are
        taken together (one snapshot after the other, in step order) and held until the
        host tier committed the snapshot, so no other snapshot evicts part of it meanwhile.
        Older committed snapshots are evicted, oldest first, to make room for it.
        """
        m = flight.manifest
        assert self.host is not None and self._kept_order is not None
        sizes = [shard.length for shard in m.shards]
        needed = sum((n + 4095) // 4096 * 4096 for n in sizes)
        if needed > self.arena.capacity:
            self._fail(
                flight,
                0,
                TierFullError(
                    f"step {flight.step} needs {needed} bytes of host memory but the host "
                    f"tier holds {self.arena.capacity} bytes, and it is the only tier: raise "
                    "its capacity_bytes, or add a durable tier after it (a snapshot larger "
                    "than the arena then streams through it)",
                    tier=self.host.name,
                ),
            )
            return
        async with self._kept_order:
            blocks = await self.arena.allocate_all(sizes)
        limit = self._batch_limit()
        batch: list[tuple[int, Block]] = []
        size = 0
        for i, block in enumerate(blocks):
            if batch and size + sizes[i] > limit:
                self._start_host_stage(flight, tg, batch)
                batch, size = [], 0
            batch.append((i, block))
            size += sizes[i]
        if batch:
            self._start_host_stage(flight, tg, batch)

    async def _commit_empty(self, flight: Flight) -> None:
        self._on_all_captured(flight)
        await self._on_all_checksummed(flight)
        for k in self._durable_stages():
            if await flight.begun[k]:
                await self._commit(flight, k)

    # -- the host stage: capture, then checksum ---------------------------------------------
    #
    # A launch-bound training thread pays for every time a pipeline thread takes the
    # interpreter lock, far more than for the bytes' work, which releases it (docs/design.md,
    # "Staying out of the training thread's way"). So where the capture backend copies a
    # batch of shards in one job (the CPU path), the shards that got their blocks together
    # are copied by one pool job and checksummed by one more: the engine loop wakes once per
    # batch for each, not once per shard. A backend without ``capture_batch`` (the CUDA
    # path, whose copies complete one event at a time, or a test's wrapper) gets one flow
    # per shard, as before.

    def _batch_limit(self) -> int:
        """The most bytes one capture job copies (0: one shard per flow). Large enough that
        the per-job cost is paid a few times per snapshot, small enough that checksums and
        writes start while later batches are still being copied."""
        if not isinstance(self.capture, BatchCapture) or not isinstance(self.checksums, ChecksumPool):
            return 0  # a stage that works one shard at a time (a test's stand-in)
        return max(self.layout.shard_size, _BATCH_BYTES)

    def _start_host_stage(
        self, flight: Flight, tg: asyncio.TaskGroup, batch: list[tuple[int, Block]]
    ) -> None:
        for i, block in batch:
            flight.blocks[i] = block
        if self._batch_limit():
            tg.create_task(self._batch_flow(flight, tg, batch))
        else:  # then a batch is one shard
            for i, block in batch:
                tg.create_task(self._shard_flow(flight, i, flight.manifest.shards[i], block))

    def _captured(self, flight: Flight, i: int) -> None:
        flight.states[i] = advance(self.table, flight.states[i], Event.CAPTURE_DONE)
        hooks.point("capture.done")
        flight.captured_count += 1
        if flight.captured_count == len(flight.manifest.shards):
            self._on_all_captured(flight)

    def _capture_failed(
        self, flight: Flight, batch: Sequence[tuple[int, Block]], exc: Exception
    ) -> None:
        self._fail(flight, 0, exc)
        for i, block in batch:
            self.arena.release(block)
            flight.states[i] = advance(self.table, flight.states[i], Event.FAIL)

    async def _shard_flow(self, flight: Flight, i: int, shard: ShardMeta, block: Block) -> None:
        t0 = time.perf_counter()
        try:
            await self.capture.capture(CaptureJob(flight.manifest, shard, flight.refs, block))
        except Exception as exc:
            self._capture_failed(flight, [(i, block)], exc)
            return
        self._captured(flight, i)
        digest = flight.hashing[i] if flight.hashing else False
        await self._persist(flight, i, shard, block, self._checksum(flight, block, digest), t0)

    async def _batch_flow(
        self, flight: Flight, tg: asyncio.TaskGroup, batch: list[tuple[int, Block]]
    ) -> None:
        """Capture a batch of shards in one job, checksum it in one more, then start each
        shard's way through the tiers."""
        m = flight.manifest
        t0 = time.perf_counter()
        capture = self.capture
        assert isinstance(capture, BatchCapture), "batches only for a batch-capable backend"
        try:
            await capture.capture_batch(
                [CaptureJob(m, m.shards[i], flight.refs, block) for i, block in batch]
            )
        except Exception as exc:
            self._capture_failed(flight, batch, exc)
            return
        handed = 0  # the blocks from here on belong to their shard's _persist
        try:
            for i, _ in batch:
                self._captured(flight, i)
            sums = await self._checksum_batch(flight, batch)
            loop = asyncio.get_running_loop()
            for k, (i, block) in enumerate(batch):
                ready: asyncio.Future[tuple[int, str | None] | None] = loop.create_future()
                ready.set_result(None if sums is None else sums[k])
                tg.create_task(self._persist(flight, i, m.shards[i], block, ready, t0))
                handed += 1
        finally:
            for _, block in batch[handed:]:  # cancelled before its shards were handed on
                self.arena.release(block)
                self.arena.discard(block)

    async def _persist(
        self,
        flight: Flight,
        i: int,
        shard: ShardMeta,
        block: Block,
        sums_of: Awaitable[tuple[int, str | None] | None],
        t0: float,
    ) -> None:
        """A captured shard: its checksum, the host tier, then each durable tier in turn."""
        m = flight.manifest
        # from here on this flow holds the block until a tier has it or the flow ends, however
        # it ends (a failed checksum, an error, the task group cancelling it): the finally
        # below gives it back
        adopted: Block | None = None
        holding = True
        try:
            sums = await sums_of
            if sums is None:
                flight.states[i] = advance(self.table, flight.states[i], Event.FAIL)
                return
            crc, flight.digests[i] = sums
            flight.crcs[i] = crc
            if self.increments.digesting:
                self.increments.record_capture(flight, i)
            flight.states[i] = advance(self.table, flight.states[i], Event.CHECKSUM_DONE)
            hooks.point("checksum.done")
            shard = replace(shard, crc32c=crc)
            self._count(0, shard.length, time.perf_counter() - t0)
            if self.staging is not None:
                self.staging.adopt(m, shard, block)
                adopted = block if self.host is not None else None
            flight.checksummed_count += 1
            if flight.checksummed_count == len(m.shards):
                await self._on_all_checksummed(flight)
            for k in self._durable_stages():
                tier = self.tier_of(k)
                if not await flight.begun[k] or self._failed_at(flight, k):
                    break
                try:
                    if self.increments.reuse(flight, k, i):
                        # the tier holds these very bytes already: the manifest refers to them
                        self.tier_reused[self.stage_names[k]] += shard.length
                    else:
                        # the turn on the tier first, then the block: a shard queued behind
                        # a slow tier holds no arena space it does not need yet
                        async with self._tier_sems[k]:
                            if not holding:
                                holding = self.arena.claim(block)
                                if not holding:  # evicted: read it back from the previous tier
                                    previous = k - 1  # the stage before: it holds the shard
                                    block = await self._refetch(
                                        flight,
                                        replace(shard, stored_in=flight.stored_in[previous].get(i)),
                                        previous,
                                    )
                                    holding = True
                            t0 = time.perf_counter()
                            data = block.memoryview()
                            await self._guarded(
                                k, f"put shard {i}", partial(tier.put_shard, m, shard, data)
                            )
                            self._count(k, shard.length, time.perf_counter() - t0)
                        hooks.point("tier.put.done")
                except Exception as exc:
                    self._fail(flight, k, exc)
                    break
                flight.states[i] = advance(self.table, flight.states[i], Event.PERSISTED)
                if k == 1:
                    # durable now: the arena may reclaim it (the host tier keeps it meanwhile)
                    self.arena.mark_evictable(block, self._host_evicted if adopted else None)
                if holding:
                    self._release(block, adopted)
                holding = False
                flight.persisted[k] += 1
                if flight.persisted[k] == len(m.shards):
                    await self._commit(flight, k)
        finally:
            if holding and adopted is not None and self.host_last:
                flight.kept.append(block)  # held until the host tier commits the snapshot
            elif holding:
                self._release(block, adopted)
            if adopted is None:  # nobody keeps staging blocks once the shard is through
                self.arena.discard(block)

    async def _checksum_batch(
        self, flight: Flight, batch: Sequence[tuple[int, Block]]
    ) -> list[tuple[int, str | None]] | None:
        """:meth:`_checksum` of each block of a captured batch, in one pool job; None once
        the snapshot failed."""
        if self._failed_at(flight, 0):
            return None
        blocks = [block for _, block in batch]
        digests = [bool(flight.hashing[i]) if flight.hashing else False for i, _ in batch]
        stage = self.checksums
        assert isinstance(stage, ChecksumPool), "batches only with a batch-capable stage"
        try:
            sums = await stage.checksums_many(blocks, digests)
        except Exception as exc:
            self._fail(flight, 0, exc)
            return None
        return None if self._failed_at(flight, 0) else sums

    async def _checksum(
        self, flight: Flight, block: Block, digest: bool
    ) -> tuple[int, str | None] | None:
        """The crc32c of a captured shard's block (and, with ``digest``, its content
        digest); None once the snapshot failed (on this checksum or any other shard's
        capture or checksum): no tier takes its shards then."""
        if self._failed_at(flight, 0):
            return None
        try:
            if digest:
                sums = await self.checksums.checksums(block, digest)
            else:
                sums = (await self.checksums.checksum(block), None)
        except Exception as exc:
            self._fail(flight, 0, exc)
            return None
        return None if self._failed_at(flight, 0) else sums

    async def _collect(self, tier: Tier, stage: int) -> None:
        if isinstance(tier, SupportsReferences):
            keep = self.increments.in_use(stage, self.flights.values())
            await self._guarded(stage, "collect unreferenced data", partial(tier.collect, keep))

    async def _uncaptured_flow(self, flight: Flight, i: int) -> None:
        """A shard not captured (see :meth:`Increments.plan_uncaptured`): every durable tier refers
        to the bytes its base holds; nothing is copied, checksummed or written."""
        m = flight.manifest
        flight.states[i] = advance(self.table, flight.states[i], Event.CAPTURE_DONE)
        flight.captured_count += 1
        if flight.captured_count == len(m.shards):
            self._on_all_captured(flight)
        flight.states[i] = advance(self.table, flight.states[i], Event.CHECKSUM_DONE)
        flight.checksummed_count += 1
        if flight.checksummed_count == len(m.shards):
            await self._on_all_checksummed(flight)
        for k in self._durable_stages():
            if not await flight.begun[k] or self._failed_at(flight, k):
                break
            self.tier_reused[self.stage_names[k]] += m.shards[i].length
            flight.states[i] = advance(self.table, flight.states[i], Event.PERSISTED)
            flight.persisted[k] += 1
            if flight.persisted[k] == len(m.shards):
                await self._commit(flight, k)

    def _release(self, block: Block, adopted: Block | None) -> None:
        """Drop the flow's hold; a block the host tier adopted stays for it, evictable."""
        if block is adopted and not block.evictable:
            self.arena.mark_evictable(block, self._host_evicted)
        self.arena.release(block)

    async def _refetch(self, flight: Flight, shard: ShardMeta, stage: int) -> Block:
        """Read an evicted shard back from the tier of ``stage`` into a new block, verified
        (``_fetch``), under that tier's deadline and retries."""
        tier = self.tier_of(stage)
        block = await self.arena.allocate(shard.length)

        async def read(source: Tier, out: memoryview) -> None:
            what = f"read shard {shard.index}"
            await self._guarded(stage, what, partial(source.read_shard, flight.manifest, shard, out))

        try:
            await read_copy(
                flight.manifest,
                shard,
                tier,
                block.memoryview(),
                checksum=self.checksums.checksum_bytes,
                read=read,
            )
        except BaseException:
            self.arena.release(block)
            raise
        return block

    def _host_evicted(self, block: Block) -> None:
        if self.staging is not None:
            self.staging.evicted(block)

    def _on_all_captured(self, flight: Flight) -> None:
        """Every shard is copied and the versions held: the tensors may change now."""
        if self._failed_at(flight, 0):
            return
        flight.stats.capture_s = time.perf_counter() - flight.t_submit
        # a flight may stay a long time behind a slow tier: it must not keep the state's
        # tensors alive meanwhile (every capture job has returned; none reads them again)
        flight.refs = ()
        if not flight.captured.done():
            flight.captured.set_result(None)

    async def _on_all_checksummed(self, flight: Flight) -> None:
        """Every shard is on the host with its checksum: the host stage is reached."""
        if self._failed_at(flight, 0):
            return
        if self.host is not None:
            await self._commit(flight, 0)
        else:
            self._resolve(flight, 0)

    async def _commit(self, flight: Flight, stage: int) -> None:
        if self._failed_at(flight, stage):
            return
        tier = self.host if stage == 0 else self.tier_of(stage)
        assert tier is not None
        manifest = flight.manifest.with_checksums(flight.crcs)
        if self.increments.digesting:
            manifest = manifest.with_digests(flight.digests)
            if stage > 0:
                manifest = manifest.with_references(flight.stored_in[stage])
        manifest = replace(manifest, extra={**manifest.extra, "tier": tier.describe()})
        flight.committed_as[stage] = manifest
        try:
            hooks.point("tier.commit.before")
            await self._guarded(stage, "commit", partial(tier.commit, manifest))
            hooks.point("tier.commit.after")
        except Exception as exc:
            if stage == 0 and not self.host_last:  # a convenience copy: its loss fails nothing
                log.info("host tier did not keep step %d: %s", flight.step, exc)
                self._resolve(flight, 0)
                return
            self._fail(flight, stage, exc)
            return
        if stage > 0 and self.coordinator is not None:
            flight.local_ok[stage] = True  # this rank's part; _coordinate decides the step
            return
        self.increments.new_base(flight, stage)
        self._resolve(flight, stage)
        self._retain(tier, stage)

    def _retain(self, tier: Tier, stage: int) -> None:
        if stage > 0 and (tier.retention.keep_last or tier.retention.keep_every):
            if self._retention_queued[stage]:
                return  # a pass that has not listed the steps yet will see this commit too
            self._retention_queued[stage] = True
            assert self._tg is not None
            self._tg.create_task(self._apply_retention(tier, stage))

    # -- distributed ------------------------------------------------------------------------

    def _check_distributed(self) -> None:
        if self.options.when_busy == "skip":
            raise ConfigurationError(
                'when_busy="skip" cannot be used with several ranks: ranks would skip '
                "different steps; use the default, when_busy=\"wait\""
            )
        for t in self.durable:
            if not isinstance(t, SupportsGlobalCommit):
                raise ConfigurationError(
                    f"{t!r} cannot hold snapshots of several ranks (no commit_global); "
                    "use it in single-process runs only"
                )

    async def _coordinate(self, stage: int) -> None:
        """Decide, with every other rank and in step order, whether each flight is
        committed on this stage's tier (see ``_distributed``)."""
        assert self.coordinator is not None
        tier = self.tier_of(stage)
        while True:
            flight = await self._queues[stage].get()
            try:
                await flight.settled.wait()
                ok = flight.local_ok[stage] and not self._failed_at(flight, stage)
                oks = await self.coordinator.agree(stage, flight.step, ok)
                wrote = False
                if all(oks):
                    try:
                        await self._guarded(
                            stage, "commit", partial(tier.commit_global, flight.step, self.world_size)  # type: ignore[attr-defined]
                        )
                        wrote = True
                    except Exception as exc:
                        self._fail(flight, stage, exc)
                # once a commit record was attempted (a failed write may still have landed),
                # a step that not every rank confirms is taken back, so no tier lists a step
                # whose handles failed
                try:
                    done = await self.coordinator.agree(stage, flight.step, wrote)
                except Exception:
                    if all(oks):
                        await self._uncommit(tier, stage, flight.step)
                    raise
                if all(done):
                    self.increments.new_base(flight, stage)
                    self._resolve(flight, stage)
                    self._retain(tier, stage)
                    continue
                if all(oks):
                    await self._uncommit(tier, stage, flight.step)
                if ok:
                    failed = [r for r, v in enumerate(oks if not all(oks) else done) if not v]
                    self._fail(
                        flight,
                        stage,
                        TierBrokenError(
                            f"step {flight.step} not committed: rank(s) {failed} failed", tier=tier.name
                        ),
                    )
            except Exception as exc:
                self._fail(flight, stage, exc)
            finally:
                flight.coordinated[stage].set()

    async def _uncommit(self, tier: Tier, stage: int, step: int) -> None:
        """The ranks did not all confirm the commit record of ``step``: delete the step on
        this tier, so that no tier lists a step whose handles failed (best effort; an
        uncommitted leftover is swept at the next open)."""
        try:
            await self._guarded(stage, f"un-commit step {step}", partial(tier.delete, step), retry=False)
        except Exception as exc:
            log.warning(
                "step %d: could not take back its commit on %s: %s", step, tier.name, exc,
                extra={"step": step, "tier": tier.name},
            )

    def _resolve(self, flight: Flight, stage: int) -> None:
        name = self.stage_names[stage]
        flight.stats.reached_s[name] = time.perf_counter() - flight.t_submit
        if stage == len(self.stage_names) - 1:  # before anyone waiting on it wakes up
            self._record(flight)
        fut = flight.reached[name]
        if not fut.done():
            fut.set_result(None)
        log.debug("step %d reached %s", flight.step, name, extra={"step": flight.step, "tier": name})

    async def _apply_retention(self, tier: Tier, stage: int) -> None:
        """One retention pass on a tier. Passes run one at a time per tier, so no two delete
        the same step at once, and each lists the steps only after every commit that asked
        for it."""
        try:
            async with self._retention_locks[stage]:
                self._retention_queued[stage] = False  # commits from now on need a new pass
                committed = await self._guarded(stage, "list", tier.steps)
                deleted = False
                for step in tier.retention.to_delete(committed):
                    # a step that flights in flight compare with stays until they are done
                    if step in self.protected or step in self.flights or step in self.increments.pins[stage]:
                        continue
                    hooks.point("retention.before_delete")
                    await self._delete(tier, stage, step)
                    deleted = True
                if deleted:
                    await self._collect(tier, stage)
        except Exception as exc:
            log.warning("retention on %s failed: %s", tier.name, exc, extra={"tier": tier.name})
            err = exc if isinstance(exc, LazyCkptError) else TierBrokenError(str(exc), tier=tier.name)
            with self._lock:
                self._unreported.append(err)

    async def delete_on_tier(self, tier: Tier, stage: int, step: int) -> None:
        """Delete ``step`` on one tier for ``Checkpointer.delete`` (engine loop): under the
        tier's retention lock, so no retention pass deletes it at the same time or lists it
        half deleted."""
        if stage == 0:
            await self._guarded(0, f"delete step {step}", partial(tier.delete, step))
            return
        async with self._retention_locks[stage]:
            await self._delete(tier, stage, step)
            await self._collect(tier, stage)

    async def _delete(self, tier: Tier, stage: int, step: int) -> None:
        """Delete a step on a durable tier (under its retention lock). No new flight takes
        it for a base meanwhile, and the flights that compare with it finish first."""
        removing = self.increments.removing[stage]
        removing.add(step)
        try:
            for flight in list(self.flights.values()):
                if any(s == stage and b.step == step for s, b in flight.pinned):
                    await flight.done.wait()
            await self._guarded(stage, f"delete step {step}", partial(tier.delete, step))
        finally:
            removing.discard(step)
            base = self.increments.bases[stage]
            if base is not None and base.step == step:
                self.increments.bases[stage] = None

    def _count(self, stage: int, nbytes: int, seconds: float = 0.0) -> None:
        name = self.stage_names[stage]
        self.tier_bytes[name] += nbytes
        self.tier_seconds[name] += seconds

    async def _finish(self, flight: Flight) -> None:
        try:
            if self.coordinator is not None:
                flight.settled.set()
                for event in flight.coordinated[1:]:
                    await event.wait()
            if flight.failed_from is not None:
                stages = range(max(1, flight.failed_from), len(self.stage_names))
                for k in stages:
                    with contextlib.suppress(Exception):
                        await asyncio.shield(
                            self._guarded(k, "abort", partial(self.tier_of(k).abort, flight.step))
                        )
                if flight.failed_from == 0 and self.staging is not None:
                    self.staging.forget(flight.step)
                if flight.failed_from >= 1 and self.host is not None and not self.host_last:
                    # the host tier's copy is a convenience: a snapshot that failed on a
                    # durable tier must not be listed (or restored) through it
                    with contextlib.suppress(Exception):
                        await asyncio.shield(
                            self._guarded(0, "drop failed", partial(self.host.delete, flight.step))
                        )
                failed = [self.stage_names[k] for k in range(flight.failed_from, len(self.stage_names))]
                error = SnapshotFailedError(
                    f"snapshot of step {flight.step} failed on {failed}: "
                    + "; ".join(str(e) for e in flight.errors[:3]),
                    flight.errors or [TierBrokenError("failed", tier=failed[0])],
                    step=flight.step,
                    tiers=failed,
                )
                self.failed += 1
                # one warning per snapshot, however many of its shards failed: the first
                # failure and a count of the others (each of them was logged at INFO)
                others = len(flight.errors) - 1
                log.warning(
                    "SNAPSHOT FAILED: step %d is not committed on %s (%d failed so far); "
                    "training goes on: %s%s",
                    flight.step, failed, self.failed,
                    flight.errors[0] if flight.errors else "no cause recorded",
                    f" (and {others} more failure{'s' if others > 1 else ''} of this snapshot)"
                    if others > 0 else "",
                    extra={"step": flight.step, "tier": failed[0]},
                )
                self._finish_failed(flight, error, flight.failed_from)
        finally:
            self.increments.unpin(flight)
            self._settle_kept(flight)
            self.flights.pop(flight.step, None)
            self._record(flight)
            flight.done.set()

    def _settle_kept(self, flight: Flight) -> None:
        """Give a host-only chain's snapshot blocks back: free at once if it failed;
        evictable once it is committed, in step order, so that the arena, which evicts
        the blocks made evictable first, always evicts the oldest committed snapshot
        first (snapshots may commit out of order)."""
        if not self.host_last:
            return
        flight.finished = True
        if flight.failed_from is not None:
            kept, flight.kept = flight.kept, []
            for block in kept:
                self.arena.release(block)
        while self._kept_queue and self._kept_queue[0].finished:
            done = self._kept_queue.pop(0)
            kept, done.kept = done.kept, []
            for block in kept:
                self._release(block, block)

    def _record(self, flight: Flight) -> None:
        if not flight.recorded:
            flight.recorded = True
            self.history.append(flight.stats)
            del self.history[:-1000]

    def _finish_failed(self, flight: Flight, error: LazyCkptError, stage: int) -> None:
        # queued before any waiter wakes: one woken by the futures below (wait_captured)
        # then finds the failure to report
        with self._lock:
            if not flight.reported:
                self._unreported.append(error)
        if stage == 0 and not flight.captured.done():
            flight.captured.set_exception(error)
        elif not flight.captured.done():
            flight.captured.set_result(None)
        for k, name in enumerate(self.stage_names):
            fut = flight.reached[name]
            if k >= stage and not fut.done():
                fut.set_exception(error)
        flight.done.set()

    # -- metrics ---------------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        states: dict[str, int] = {}
        for flight in list(self.flights.values()):
            for s in flight.states:
                states[s.name] = states.get(s.name, 0) + 1
        arena = self.arena.stats()
        return {
            "tiers": {
                name: {
                    "bytes": self.tier_bytes[name],
                    # incremental snapshots: bytes referred to instead of written
                    "reused_bytes": self.tier_reused[name],
                    "busy_s": self.tier_seconds[name],
                    "throughput_bytes_per_s": (
                        self.tier_bytes[name] / self.tier_seconds[name]
                        if self.tier_seconds[name]
                        else None
                    ),
                }
                for name in self.stage_names
            },
            "shards_in_flight": states,
            "snapshots_in_flight": len(self.flights),
            "snapshots_skipped": self.skipped,
            "snapshots_failed": self.failed,
            "capture_skipped_bytes": self.increments.uncaptured_bytes,
            "arena": {
                "capacity": arena.capacity,
                "held": arena.held,
                "evictable": arena.evictable,
                "peak": arena.peak_held,
                "waits": arena.waits,
                "evictions": arena.evictions,
            },
            "snapshots": [vars(s).copy() for s in self.history[-100:]],
        }


def _default_capture(options: CheckpointerOptions) -> CaptureBackend:
    if torch.cuda.is_available():
        return CudaCapture(cpu_threads=options.capture_threads)
    return CpuCapture(options.capture_threads)

