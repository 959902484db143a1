"""The scheduler: moves every shard of every snapshot through the tiers, on the engine loop.

One ``Engine`` belongs to one Checkpointer. Everything here runs on the engine's own loop
thread (``_engine.loop.EngineLoop``) except the few methods marked *any thread*, which only touch
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
checksum is known. Each shard state change goes through the state table (``_tiering.states``); the
flow never decides a rule itself. When the last shard reaches a tier, that tier commits the
snapshot's manifest. On a host-only chain the host tier is the last one: a snapshot takes
its arena space whole and counts as committed only if the host tier keeps it.

Every task belongs to the engine's task group; failures are recorded on the flight, raised
from its handle, logged once, and queued for the failure policy (``on_failure="raise"``:
the next ``snapshot()``, ``wait_captured()`` or ``aclose()`` raises it; never the guard).

Incremental snapshots (``incremental=True`` or ``"versions"``; ``_engine.incremental`` holds the
bases, pins and skipped captures, docs/design.md the reasons): before a shard's put on a tier that supports
references, the flow asks whether the tier's newest committed step holds the same bytes;
if so the manifest refers to them and nothing is written. In ``"versions"`` mode a shard
whose tensors did not change since its last capture skips its capture too.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TypeVar

import torch

from .._capture.cpu import CaptureBackend, ChecksumPool, CpuCapture
from .._capture.cuda import CudaCapture
from .._distributed.coordinator import Coordinator, distributed_context
from .._distributed.placement import join_peers
from .._errors import (
    CheckpointerClosedError,
    ConfigurationError,
    CoordinationError,
    LazyCkptError,
    SnapshotFailedError,
    TierFullError,
    TierSkippedError,
)
from .._format.manifest import LayoutOptions, Manifest
from .._options import CheckpointerOptions
from .._tiering.arena import Block, HostArena
from .._tiering.calls import call_tier
from .._tiering.interface import StepInfo, SupportsStaging, Tier
from .._tiering.states import StateTable, build_table
from .cadence import Cadences
from .commit import _Commits
from .emergency import _Emergency
from .flight import Flight, SnapshotStats, Stage
from .flows import _BATCH_BYTES as _BATCH_BYTES
from .flows import _Flows
from .incremental import Increments
from .loop import EngineLoop
from .records import _Records, _step

__all__ = ["Engine"]

log = logging.getLogger("lazyckpt")
T = TypeVar("T")


class Engine(_Flows, _Commits, _Records, _Emergency):
    """See the module docstring. Built by the Checkpointer; not public. Its parts: the
    shard flows (``_engine.flows``), commits, coordination and retention
    (``_engine.commit``), finishing and metrics (``_engine.records``)."""

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
        # which durable stages take each snapshot (Checkpointer(cadence=...))
        self.cadences = Cadences(options, self.stages, host=self.host is not None)
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
        self.increments = Increments(options.incremental, self.stages)
        self.flights: dict[int, Flight] = {}
        # the last flights that finished, newest last: what an emergency copy starts from
        self.finished: list[Flight] = []
        self._copied: set[tuple[int, int]] = set()  # (step, stage) emergency copies made
        self.protected: dict[int, int] = {}  # step -> restores in progress
        self._lock = threading.Lock()
        self._arena_ready = asyncio.Lock()  # bound to the engine loop at its first use
        self._unreported: list[LazyCkptError] = []
        self._pending_captures: list[Flight] = []  # any thread, under _lock
        self._tg: asyncio.TaskGroup | None = None
        self._main_done: concurrent.futures.Future[None] | None = None
        self._stop: asyncio.Event | None = None
        # per durable stage (by its index): its turn on the tier, and its retention passes
        self._tier_sems: dict[int, asyncio.Semaphore] = {}
        self._retention_locks: dict[int, asyncio.Lock] = {}
        self._retention_queued: dict[int, bool] = {}
        # per durable stage: what retention judges each committed step by (StepInfo)
        self._infos: dict[int, dict[int, StepInfo]] = {}
        self._retention_deferred: set[int] = set()  # stages whose pass kept a step back
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
                None,
                # the schedule's channel only where a cadence needs one
                partial(
                    Coordinator,
                    self.rank,
                    self.world_size,
                    len(self.durable),
                    timeout,
                    **({"schedule": True} if self.cadences.any else {}),
                ),
            )
        if self.host is not None:
            # the host tier's memory is a tier: it is there from the open on
            await loop.run_in_executor(None, self.arena.allocate_memory)
        # the private staging arena waits for the first snapshot (_ensure_arena): an open
        # that only restores, lists or verifies allocates and pre-faults nothing
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
                await self._final_copies()
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

    async def _final_copies(self) -> None:
        """At close: the emergency copies of the newest snapshot (the run's last state
        would otherwise stay on the tiers a finished job loses with its node)."""
        if not self.cadences.emergency:
            return
        try:
            await self.emergency_copies()
        except Exception as exc:  # the copy's own failure is recorded on its flight
            log.warning("lazyckpt: the emergency copy at close failed: %s", exc)

    # -- errors (any thread) ---------------------------------------------------------------

    def take_unreported(self) -> list[LazyCkptError]:
        with self._lock:
            errors, self._unreported = self._unreported, []
        return errors

    def take_unreported_steps(self) -> list[tuple[int, LazyCkptError]]:
        """The unreported failures of snapshots (those with a step), taken, with their
        steps; the others (a retention pass's, say) stay for the failure policy."""
        with self._lock:
            steps = [(_step_of(e), e) for e in self._unreported]
            self._unreported = [e for step, e in steps if step is None]
        return [(step, e) for step, e in steps if step is not None]

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

    def steps_in_flight(self) -> list[int]:
        """The steps submitted and not finished, read without taking any lock: a finalizer
        may call it on a thread that holds ``_lock`` (the collector runs anywhere)."""
        steps = {f.step for f in list(self._pending_captures) if not f.captured.done()}
        with contextlib.suppress(RuntimeError):  # the engine thread changed it meanwhile
            steps.update(list(self.flights))
        return sorted(steps)

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
        deciding = None
        if flight.takes is None:  # the ranks agree on a cadence by time, in snapshot order
            deciding = self._tg.create_task(self._agree_stages(flight))
        self.flights[flight.step] = flight
        for queue in self._queues[1:]:
            queue.put_nowait(flight)
        self._tg.create_task(
            self._run_flight(flight, deciding), name=f"lazyckpt-step-{flight.step}"
        )

    def plan_stages(self, flight: Flight) -> None:
        """Decide which durable stages take a snapshot (``snapshot()``'s thread, before it
        is submitted): from its step, or from this process's clock for a cadence by time.
        Where the ranks must agree on that (several ranks, a cadence by time), only this
        rank's proposal is recorded; :meth:`_agree_stages` decides on the engine loop."""
        cadences = self.cadences
        host = self.host is not None
        if not cadences.any:
            flight.decide(cadences.always, self.table, host=host)
            return
        due = cadences.propose(flight.step, flight.t_taken)
        if cadences.timed and self.coordinator is not None:
            flight.proposal = due
            return
        takes = cadences.takes(due)
        flight.decide(takes, cadences.table(takes), host=host)

    async def _agree_stages(self, flight: Flight) -> None:
        """Agree with the other ranks which cadenced tiers take ``flight`` (any rank that
        found one due makes every rank take it). One ``all_reduce`` on the schedule's own
        channel, issued in snapshot order. On failure the snapshot fails before its capture
        and goes nowhere."""
        coordinator = self.coordinator
        assert coordinator is not None and coordinator.schedule is not None
        cadences = self.cadences
        cadenced = sorted(cadences.by_stage)
        flags = [1 if flight.proposal.get(k) else 0 for k in cadenced]
        host = self.host is not None
        try:
            got = await coordinator.maximum(
                coordinator.schedule, [flight.step, -flight.step, *flags]
            )
            if got[0] != -got[1]:
                raise CoordinationError(
                    f"ranks are snapshotting different steps (from {-got[1]} to {got[0]}): "
                    "every rank must snapshot the same steps in the same order"
                )
            takes = cadences.agreed([bool(v) for v in got[2:]], flight.t_taken)
        except Exception as exc:
            flight.decide(frozenset(), cadences.table(frozenset()), host=False)
            self._fail(flight, 0, exc)
            return
        flight.decide(takes, cadences.table(takes), host=host)

    # -- the flight ------------------------------------------------------------------------

    async def _guarded(
        self,
        stage: int,
        what: str,
        call: Callable[[], Awaitable[T]],
        *,
        retry: bool = True,
        scale: int = 1,
    ) -> T:
        """Run a tier operation of a stage through :func:`call_tier`, under the options
        (``scale``: the operations it does at once, see :func:`call_tier`)."""
        return await call_tier(
            self.stage_names[stage], what, call, self.options, retry=retry, scale=scale
        )

    def _fail(self, flight: Flight, stage: int, exc: Exception) -> None:
        if flight.failed_from is None or stage < flight.failed_from:
            flight.failed_from = stage
        # one error once: a batch's failed put_shards reaches each of its shards' flows
        if not isinstance(exc, asyncio.CancelledError) and not any(e is exc for e in flight.errors):
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

    async def _ensure_arena(self) -> None:
        """Allocate and pre-fault the private staging arena, once, before the first flight
        takes a block of it (off the loop: it faults in every page)."""
        if self.arena.allocated:
            return
        async with self._arena_ready:
            if not self.arena.allocated:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, self.arena.allocate_memory)

    async def _run_flight(
        self, flight: Flight, deciding: asyncio.Task[None] | None = None
    ) -> None:
        m = flight.manifest
        try:
            if deciding is not None:
                await deciding
            if flight.kept_mode:  # its blocks are given back in step order
                bisect.insort(self._kept_queue, flight, key=_step)
            self._skipped_stages(flight)
            if self._failed_at(flight, 0):
                return
            await self._ensure_arena()
            if self.increments.digesting:
                self.increments.choose_bases(flight)
                self.increments.fingerprint(flight)
                if self.increments.mode == "versions":
                    self.increments.plan_uncaptured(flight)
            async with asyncio.TaskGroup() as tg:
                # each durable tier prepares the step beside the capture, never in front of
                # it: the guard waits for captures only, so a tier whose begin() is slow or
                # hangs must not hold training up; a shard waits for it before its put
                flight.begun = {
                    k: tg.create_task(self._begin(flight, k, self.tier_of(k)), name=f"lazyckpt-begin-{k}")
                    for k in flight.stages
                }
                if flight.kept_mode:
                    await self._run_kept(flight, tg)
                else:
                    await self._run_streamed(flight, tg)
                if not m.shards:
                    tg.create_task(self._commit_empty(flight))
        except Exception as exc:  # a bug in the engine: fail the snapshot loudly
            self._fail(flight, 0, exc)
        finally:
            await self._finish(flight)

    def _skipped_stages(self, flight: Flight) -> None:
        """The awaitables of the tiers whose cadence skips ``flight`` raise
        :class:`TierSkippedError` from now on (they would otherwise never resolve)."""
        for k in self._durable_stages():
            if flight.takes is not None and k in flight.takes:
                continue
            name = self.stage_names[k]
            fut = flight.reached[name]
            if not fut.done():
                fut.set_exception(
                    TierSkippedError(
                        f"step {flight.step} is not written to tier {name!r}: its cadence "
                        f"({self.cadences.by_stage.get(k, 'none')}) skips it",
                        step=flight.step,
                        tier=name,
                    )
                )

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
        for k in flight.stages:
            if await flight.begun[k]:
                await self._commit(flight, k)


def _default_capture(options: CheckpointerOptions) -> CaptureBackend:
    if torch.cuda.is_available():
        return CudaCapture(cpu_threads=options.capture_threads)
    return CpuCapture(options.capture_threads)


def _step_of(error: LazyCkptError) -> int | None:
    """The step a failure belongs to, None for one that is no snapshot's."""
    step = getattr(error, "step", None)
    return step if isinstance(step, int) and step >= 0 else None
