"""The engine's host stage and each shard's way through the tiers: capture (one job per
batch on the CPU path, one flow per shard otherwise), checksum, the host tier, then each
durable tier in chain order, reading a shard evicted meanwhile back from the tier before
(:class:`_Flows`, a part of ``_engine.scheduler.Engine``; the module docstring of ``_engine.scheduler`` tells
the whole way)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from .. import hooks
from .._capture.cpu import BatchCapture, CaptureBackend, CaptureJob, ChecksumPool
from .._format.entries import ShardMeta
from .._format.manifest import LayoutOptions
from .._restore.fetch import read_copy
from .._tiering.arena import Block, HostArena
from .._tiering.interface import SupportsBatchPut, SupportsStaging, Tier, puts_batches
from .._tiering.states import Event, StateTable, advance
from .flight import Flight
from .incremental import Increments

__all__ = ["_BATCH_BYTES", "_Flows"]

T = TypeVar("T")
# the bytes one CPU capture job copies (see Engine._batch_limit)
_BATCH_BYTES = 64 << 20


class _PutGroup:
    """The shards of one capture batch on their way to the first durable tier: one
    ``put_shards`` call for those that get there (:class:`~lazyckpt._tiering.interface.SupportsBatchPut`).

    Each shard's flow either hands its data in (:meth:`put`, which returns once the call
    did) or leaves (:meth:`leave`: it failed, its bytes are reused, the stage failed, or
    the flow ended some other way). The last flow to hand its data in makes the call
    itself, and the others wake on their own futures in the loop turn it ends (a flow
    cancelled meanwhile cancels only its own); where the last one leaves instead, the call
    runs on a task of the flight's task group, since a leaving flow may be on its way out.
    """

    def __init__(
        self,
        stage: int,
        members: Sequence[int],
        call: Callable[[list[ShardMeta], list[memoryview]], Coroutine[Any, Any, None]],
        tg: asyncio.TaskGroup,
    ) -> None:
        self.stage = stage
        self.waiting = set(members)
        self.shards: list[ShardMeta] = []
        self.data: list[memoryview] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._started = False
        self._call = call
        self._tg = tg

    async def put(self, i: int, shard: ShardMeta, data: memoryview) -> None:
        """Hand a shard in; return once the call stored it, or raise what the call raised."""
        self.shards.append(shard)
        self.data.append(data)
        self.waiting.discard(i)
        if not self.waiting and not self._started:
            self._started = True
            await self._run()
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    def leave(self, i: int) -> None:
        """This member will not put (idempotent; a no-op once it has)."""
        if i not in self.waiting:
            return
        self.waiting.discard(i)
        if self.waiting or self._started:
            return
        self._started = True
        if not self.shards:
            return
        try:
            self._tg.create_task(self._run_for_others())
        except RuntimeError:  # the task group is shutting down: every flow is cancelled
            self._settle(None, cancel=True)

    async def _run(self) -> None:
        try:
            await self._call(self.shards, self.data)
        except Exception as exc:
            self._settle(exc)
            raise
        except BaseException:
            self._settle(None, cancel=True)
            raise
        self._settle(None)

    async def _run_for_others(self) -> None:
        # the waiting members have the error, and each fails the stage with it
        with contextlib.suppress(Exception):
            await self._run()

    def _settle(self, exc: Exception | None, *, cancel: bool = False) -> None:
        for waiter in self._waiters:
            if waiter.done():  # its flow was cancelled
                continue
            if cancel:
                waiter.cancel()
            elif exc is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(None)


class _Flows:
    """Capture, checksum and persist each shard of a flight (engine loop); ``Engine`` sets
    the attributes declared here."""

    arena: HostArena
    capture: CaptureBackend
    checksums: ChecksumPool
    host: Tier | None
    host_last: bool
    increments: Increments
    layout: LayoutOptions
    stage_names: list[str]
    staging: SupportsStaging | None
    table: StateTable
    tier_reused: dict[str, int]
    _tier_sems: dict[int, asyncio.Semaphore]

    if TYPE_CHECKING:  # defined by Engine and its other parts

        def _durable_stages(self) -> range: ...
        def tier_of(self, stage: int) -> Tier: ...
        def _fail(self, flight: Flight, stage: int, exc: Exception) -> None: ...
        def _failed_at(self, flight: Flight, stage: int) -> bool: ...
        async def _guarded(
            self,
            stage: int,
            what: str,
            call: Callable[[], Awaitable[T]],
            *,
            retry: bool = True,
            scale: int = 1,
        ) -> T: ...
        async def _commit(self, flight: Flight, stage: int) -> None: ...
        def _resolve(self, flight: Flight, stage: int) -> None: ...
        def _count(self, stage: int, nbytes: int, seconds: float = 0.0) -> None: ...

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
        flight.states[i] = advance(flight.table, flight.states[i], Event.CAPTURE_DONE)
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
            flight.states[i] = advance(flight.table, flight.states[i], Event.FAIL)

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
            group = self._put_group(flight, tg, batch)
            for k, (i, block) in enumerate(batch):
                ready: asyncio.Future[tuple[int, str | None] | None] = loop.create_future()
                ready.set_result(None if sums is None else sums[k])
                tg.create_task(self._persist(flight, i, m.shards[i], block, ready, t0, group))
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
        group: _PutGroup | None = None,
    ) -> None:
        """A captured shard: its checksum, the host tier, then each durable tier in turn
        (on ``group``'s stage, in one call with the other shards of its batch)."""
        m = flight.manifest
        # from here on this flow holds the block until a tier has it or the flow ends, however
        # it ends (a failed checksum, an error, the task group cancelling it): the finally
        # below gives it back
        adopted: Block | None = None
        holding = True
        try:
            sums = await sums_of
            if sums is None:
                flight.states[i] = advance(flight.table, flight.states[i], Event.FAIL)
                return
            crc, flight.digests[i] = sums
            flight.crcs[i] = crc
            if self.increments.digesting and not flight.emergency:
                self.increments.record_capture(flight, i)
            flight.states[i] = advance(flight.table, flight.states[i], Event.CHECKSUM_DONE)
            hooks.point("checksum.done")
            shard = replace(shard, crc32c=crc)
            self._count(0, shard.length, time.perf_counter() - t0)
            if self.staging is not None and not flight.emergency:
                self.staging.adopt(m, shard, block)
                adopted = block if self.host is not None else None
            flight.checksummed_count += 1
            if flight.checksummed_count == len(m.shards):
                await self._on_all_checksummed(flight)
            for pos, k in enumerate(flight.stages):
                tier = self.tier_of(k)
                if not await flight.begun[k] or self._failed_at(flight, k):
                    break
                try:
                    if self.increments.reuse(flight, k, i):
                        # the tier holds these very bytes already: the manifest refers to them
                        self.tier_reused[self.stage_names[k]] += shard.length
                        if group is not None:
                            group.leave(i)
                    elif group is not None and k == group.stage:
                        # the first durable stage: the block is still held (nothing could
                        # evict it before), and the batch goes down in one call
                        assert holding, "a batch's blocks are held until its first durable tier"
                        await group.put(i, shard, block.memoryview())
                        hooks.point("tier.put.done")
                    else:
                        # the turn on the tier first, then the block: a shard queued behind
                        # a slow tier holds no arena space it does not need yet
                        async with self._tier_sems[k]:
                            if not holding:
                                holding = self.arena.claim(block)
                                if not holding:  # evicted: read it back from the previous tier
                                    # the stage before that took the step holds it
                                    previous = flight.stages[pos - 1]
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
                flight.states[i] = advance(flight.table, flight.states[i], Event.PERSISTED)
                if pos == 0:
                    # durable now: the arena may reclaim it (the host tier keeps it meanwhile)
                    self.arena.mark_evictable(block, self._host_evicted if adopted else None)
                if holding:
                    self._release(block, adopted)
                holding = False
                flight.persisted[k] += 1
                if flight.persisted[k] == len(m.shards):
                    await self._commit(flight, k)
        finally:
            if group is not None:  # the batch's call must not wait for this flow
                group.leave(i)
            if holding and adopted is not None and flight.kept_mode:
                flight.kept.append(block)  # held until the host tier commits the snapshot
            elif holding:
                self._release(block, adopted)
            if adopted is None:  # nobody keeps staging blocks once the shard is through
                self.arena.discard(block)

    def _put_group(
        self, flight: Flight, tg: asyncio.TaskGroup, batch: Sequence[tuple[int, Block]]
    ) -> _PutGroup | None:
        """A :class:`_PutGroup` for a batch whose first durable tier takes batches; None
        where it does not (or the batch is one shard): then each shard puts on its own."""
        stages = flight.stages
        if len(batch) < 2 or not stages or not puts_batches(self.tier_of(stages[0])):
            return None
        k = stages[0]
        return _PutGroup(k, [i for i, _ in batch], partial(self._put_batch, flight, k), tg)

    async def _put_batch(
        self, flight: Flight, stage: int, shards: list[ShardMeta], data: list[memoryview]
    ) -> None:
        """One ``put_shards`` call for the shards of a batch that reached the tier (in
        stream order), under the tier's turn, its deadline (once per shard) and retries."""
        tier = self.tier_of(stage)
        assert isinstance(tier, SupportsBatchPut)
        order = sorted(range(len(shards)), key=lambda j: shards[j].offset)
        shards, data = [shards[j] for j in order], [data[j] for j in order]
        what = f"put shards {', '.join(str(s.index) for s in shards)}"
        async with self._tier_sems[stage]:
            t0 = time.perf_counter()
            await self._guarded(
                stage,
                what,
                partial(tier.put_shards, flight.manifest, shards, data),
                scale=len(shards),
            )
            self._count(stage, sum(s.length for s in shards), time.perf_counter() - t0)

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

    async def _uncaptured_flow(self, flight: Flight, i: int) -> None:
        """A shard not captured (see :meth:`Increments.plan_uncaptured`): every durable tier refers
        to the bytes its base holds; nothing is copied, checksummed or written."""
        m = flight.manifest
        flight.states[i] = advance(flight.table, flight.states[i], Event.CAPTURE_DONE)
        flight.captured_count += 1
        if flight.captured_count == len(m.shards):
            self._on_all_captured(flight)
        flight.states[i] = advance(flight.table, flight.states[i], Event.CHECKSUM_DONE)
        flight.checksummed_count += 1
        if flight.checksummed_count == len(m.shards):
            await self._on_all_checksummed(flight)
        for k in flight.stages:
            if not await flight.begun[k] or self._failed_at(flight, k):
                break
            self.tier_reused[self.stage_names[k]] += m.shards[i].length
            flight.states[i] = advance(flight.table, flight.states[i], Event.PERSISTED)
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
        (``_restore.fetch``), under that tier's deadline and retries."""
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
        if self.host is not None and not flight.emergency:
            await self._commit(flight, 0)
        else:  # an emergency copy was read back from a tier: the host tier has its own
            self._resolve(flight, 0)
