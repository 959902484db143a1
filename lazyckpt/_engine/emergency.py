"""Emergency copies: the newest snapshot, written to the tiers whose cadence skipped it
(:class:`_Emergency`, a part of ``_engine.scheduler.Engine``).

With ``Checkpointer(cadence=...)`` the newest steps may live only on the fast tiers (host
memory, node-local NVMe), which a preempted or finished job loses with its node. On a
preemption signal, ``drain()`` and ``close()``, the engine therefore copies the newest
snapshot that every rank finished to each *emergency tier* (``emergency_tiers``; by
default every tier with a cadence) that did not take it: it reads each shard back from
the fastest tier holding the step (the host tier, then the durable tiers in chain order,
falling back shard by shard), checks it against its crc32c, and runs it down those tiers
as a flight of its own, through the same puts, commit, agreement across ranks, retention
and abort-on-failure as any snapshot. The copy is self-contained (an incremental step's
references point at data of the tier it was read from, so every byte is written).

Across ranks the copy is of the same step on every rank, on the same tiers: the ranks
agree on the newest step all of them finished (the lowest of their newest), then on which
emergency tiers lack it, over the schedule's channel (``_distributed.coordinator``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from .. import hooks
from .._distributed.coordinator import Coordinator
from .._errors import CorruptionError, SnapshotNotFoundError
from .._format.entries import ShardMeta
from .._format.manifest import Manifest
from .._restore.fetch import read_copy
from .._tiering.arena import Block, HostArena
from .._tiering.interface import Tier
from .cadence import Cadences
from .flight import Flight

__all__ = ["_Emergency"]

log = logging.getLogger("lazyckpt")
T = TypeVar("T")


class _Emergency:
    """Emergency copies of the newest snapshot (engine loop); ``Engine`` sets the
    attributes declared here."""

    cadences: Cadences
    coordinator: Coordinator | None
    host: Tier | None
    arena: HostArena
    stage_names: list[str]
    flights: dict[int, Flight]
    finished: list[Flight]
    _tg: asyncio.TaskGroup | None
    _queues: list[asyncio.Queue[Flight]]
    _copied: set[tuple[int, int]]
    rank: int
    world_size: int

    if TYPE_CHECKING:  # defined by Engine and its other parts
        checksums: Any

        def tier_of(self, stage: int) -> Tier: ...
        def _durable_stages(self) -> range: ...
        async def drain(self) -> None: ...
        async def _ensure_arena(self) -> None: ...
        def _fail(self, flight: Flight, stage: int, exc: Exception) -> None: ...
        def _failed_at(self, flight: Flight, stage: int) -> bool: ...
        def _captured(self, flight: Flight, i: int) -> None: ...
        async def _begin(self, flight: Flight, stage: int, tier: Tier) -> bool: ...
        async def _finish(self, flight: Flight) -> None: ...
        async def _commit_empty(self, flight: Flight) -> None: ...
        def _persist(
            self,
            flight: Flight,
            i: int,
            shard: ShardMeta,
            block: Block,
            sums_of: Awaitable[tuple[int, str | None] | None],
            t0: float,
        ) -> Coroutine[Any, Any, None]: ...
        async def _guarded(
            self,
            stage: int,
            what: str,
            call: Callable[[], Awaitable[T]],
            *,
            retry: bool = True,
            scale: int = 1,
        ) -> T: ...

    async def emergency_copies(self) -> dict[int, tuple[str, ...]]:
        """Drain, then copy the newest finished snapshot to the emergency tiers that lack
        it; the step and the tiers its copy was committed on (``{}``: nothing to copy).
        Every rank must call it at the same point (a preemption signal reaches every
        rank; ``drain()``/``close()`` are called by every rank)."""
        if not self.cadences.emergency:
            return {}
        await self.drain()
        flight, targets = self._emergency_candidate()
        step = -1 if flight is None else flight.step
        emergency = sorted(self.cadences.emergency)
        if self.coordinator is not None:
            channel = self.coordinator.schedule
            assert channel is not None
            _high, neg_low = await self.coordinator.maximum(channel, [step, -step])
            step = -neg_low  # the newest step every rank finished
            if step < 0:
                return {}
            if flight is None or flight.step != step:
                flight = next((f for f in self.finished if f.step == step), None)
                targets = self._targets(flight) if flight is not None else set()
            flags = [1 if k in targets else 0 for k in emergency]
            got = await self.coordinator.maximum(channel, [step, -step, *flags])
            targets = {k for k, v in zip(emergency, got[2:], strict=True) if v}
        if step < 0 or not targets:
            return {}
        copy = await self._run_copy(step, flight, frozenset(targets))
        reached = tuple(
            self.stage_names[k]
            for k in copy.stages
            if copy.reached[self.stage_names[k]].done()
            and copy.reached[self.stage_names[k]].exception() is None
        )
        for k in copy.stages:
            if self.stage_names[k] in reached:
                self._copied.add((step, k))
        level = logging.WARNING if len(reached) < len(copy.stages) else logging.INFO
        log.log(
            level,
            "lazyckpt: emergency copy of step %d committed on %s%s",
            step,
            list(reached),
            "" if level == logging.INFO else f" (wanted on {[self.stage_names[k] for k in copy.stages]})",
            extra={"step": step},
        )
        return {step: reached}

    def _emergency_candidate(self) -> tuple[Flight | None, set[int]]:
        """The newest finished snapshot that some tier holds whole, and the emergency
        tiers that lack it."""
        for flight in reversed(self.finished):
            if self._sources(flight):
                return flight, self._targets(flight)
        return None, set()

    def _targets(self, flight: Flight) -> set[int]:
        taken = flight.takes or frozenset()
        return {
            k
            for k in self.cadences.emergency
            if k not in taken and (flight.step, k) not in self._copied
        }

    def _sources(self, flight: Flight) -> list[int]:
        """The stages holding ``flight`` whole, fastest first: the host tier (while its
        arena keeps it; a read that finds a shard evicted falls back), then the durable
        tiers it was committed on."""
        found = []
        for k in (0, *flight.stages):
            name = self.stage_names[k]
            fut = flight.reached[name]
            if k == 0 and self.host is None:
                continue
            if flight.committed_as[k] is None or not fut.done() or fut.exception() is not None:
                continue
            found.append(k)
        return found

    async def _run_copy(self, step: int, source: Flight | None, targets: frozenset[int]) -> Flight:
        """Run the emergency copy of ``step`` to ``targets`` as a flight of its own and
        wait for it; a rank without a source still runs it, failing, so that the ranks'
        agreements stay matched (and the step is committed nowhere new)."""
        sources = self._sources(source) if source is not None else []
        manifests = {k: m for k in sources if (m := source.committed_as[k]) is not None} if source else {}
        first = next(iter(manifests.values()), None)
        if first is None:  # this rank has nothing to copy from: a placeholder that fails
            base = Manifest(
                step=step, tree=None, tensors=(), shards=(), stream_bytes=0,
                rank=self.rank, world_size=self.world_size,
            )
        else:
            base = first.self_contained()
        copy = Flight(base, (), self.stage_names)
        copy.emergency = True
        copy.decide(targets, self.cadences.table(targets), host=False)
        copy.crcs = [s.crc32c or 0 for s in base.shards]
        copy.digests = [s.digest for s in base.shards]
        assert self._tg is not None
        self.flights[step] = copy
        for queue in self._queues[1:]:
            queue.put_nowait(copy)
        task = self._tg.create_task(
            self._copy_flight(copy, manifests, first is None), name=f"lazyckpt-emergency-{step}"
        )
        await asyncio.shield(task)
        return copy

    async def _copy_flight(
        self, copy: Flight, manifests: dict[int, Manifest], missing: bool
    ) -> None:
        m = copy.manifest
        try:
            if missing:  # nothing is begun: the abort that follows finds nothing
                self._fail(
                    copy,
                    0,
                    SnapshotNotFoundError(
                        f"step {copy.step}: this rank holds no copy of it to write an "
                        "emergency copy from"
                    ),
                )
                return
            await self._ensure_arena()
            async with asyncio.TaskGroup() as tg:
                copy.begun = {
                    k: tg.create_task(self._begin(copy, k, self.tier_of(k)))
                    for k in copy.stages
                }
                loop = asyncio.get_running_loop()
                for i, shard in enumerate(m.shards):
                    if self._failed_at(copy, 0):
                        break
                    t0 = time.perf_counter()
                    try:
                        block = await self._read_back(manifests, i)
                    except Exception as exc:
                        self._fail(copy, 0, exc)
                        break
                    copy.blocks[i] = block
                    hooks.point("emergency.shard.read")
                    self._captured(copy, i)
                    ready: asyncio.Future[tuple[int, str | None] | None] = loop.create_future()
                    ready.set_result((shard.crc32c or 0, shard.digest))
                    tg.create_task(self._persist(copy, i, shard, block, ready, t0))
                if not m.shards:
                    tg.create_task(self._commit_empty(copy))
        except Exception as exc:
            self._fail(copy, 0, exc)
        finally:
            await self._finish(copy)

    async def _read_back(self, manifests: dict[int, Manifest], i: int) -> Block:
        """Shard ``i`` read into a new arena block from the first source whose copy is
        good (verified against its crc32c), trying them fastest first."""
        length = next(iter(manifests.values())).shards[i].length
        block = await self.arena.allocate(length)
        errors: list[Exception] = []
        for k, manifest in manifests.items():
            shard = manifest.shards[i]
            tier = self.tier_of(k)

            async def read(source: Tier, out: memoryview, k: int = k, m: Manifest = manifest, s: ShardMeta = shard) -> None:
                await self._guarded(k, f"read shard {s.index}", partial(source.read_shard, m, s, out))

            try:
                await read_copy(
                    manifest, shard, tier, block.memoryview(),
                    checksum=self.checksums.checksum_bytes, read=read,
                )
                return block
            except Exception as exc:
                errors.append(exc)
        self.arena.release(block)
        raise CorruptionError(
            f"shard {i}: no tier holds a good copy for the emergency copy "
            f"({'; '.join(str(e) for e in errors) or 'no source'})"
        )
