"""How the engine ends a flight and what it counts: aborting a failed snapshot on the
tiers and reporting it once, giving a host-only chain's blocks back in step order, the
history of finished snapshots, and the metrics (:class:`_Records`, a part of
``_engine.scheduler.Engine``)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from .._distributed.coordinator import Coordinator
from .._errors import LazyCkptError, SnapshotFailedError, TierBrokenError
from .._tiering.arena import Block, HostArena
from .._tiering.interface import SupportsStaging, Tier
from .flight import Flight, SnapshotStats
from .incremental import Increments

__all__ = ["_Records"]

log = logging.getLogger("lazyckpt")
T = TypeVar("T")
_FINISHED_KEPT = 8  # finished flights remembered for an emergency copy


def _step(flight: Flight) -> int:
    return flight.step


class _Records:
    """Finish flights, record them and report the engine's metrics (engine loop, and any
    thread for :meth:`metrics`); ``Engine`` sets the attributes declared here."""

    arena: HostArena
    host: Tier | None
    host_last: bool
    staging: SupportsStaging | None
    increments: Increments
    stage_names: list[str]
    flights: dict[int, Flight]
    finished: list[Flight]  # in step order
    coordinator: Coordinator | None
    history: list[SnapshotStats]
    tier_bytes: dict[str, int]
    tier_seconds: dict[str, float]
    tier_reused: dict[str, int]
    skipped: int
    failed: int
    _lock: threading.Lock
    _unreported: list[LazyCkptError]
    _kept_queue: list[Flight]

    if TYPE_CHECKING:  # defined by Engine and its other parts

        def tier_of(self, stage: int) -> Tier: ...
        async def _guarded(
            self,
            stage: int,
            what: str,
            call: Callable[[], Awaitable[T]],
            *,
            retry: bool = True,
            scale: int = 1,
        ) -> T: ...
        def _release(self, block: Block, adopted: Block | None) -> None: ...
        def retry_retention(self) -> None: ...

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
                stages = [k for k in flight.stages if k >= flight.failed_from]
                for k in stages:
                    with contextlib.suppress(Exception):
                        await asyncio.shield(
                            self._guarded(k, "abort", partial(self.tier_of(k).abort, flight.step))
                        )
                if flight.failed_from == 0 and self.staging is not None and not flight.emergency:
                    self.staging.forget(flight.step)
                if (
                    flight.failed_from >= 1
                    and self.host is not None
                    and not flight.kept_mode
                    and not flight.emergency  # the host tier's copy is the original's
                ):
                    # the host tier's copy is a convenience: a snapshot that failed on a
                    # durable tier must not be listed (or restored) through it
                    with contextlib.suppress(Exception):
                        await asyncio.shield(
                            self._guarded(0, "drop failed", partial(self.host.delete, flight.step))
                        )
                failed = [
                    self.stage_names[k]
                    for k in (0, *flight.stages)
                    if k >= flight.failed_from
                ]
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
            if not flight.emergency:  # what an emergency copy may start from
                flight.holds, flight.refs = [], ()
                bisect.insort(self.finished, flight, key=_step)  # they finish in any order
                del self.finished[:-_FINISHED_KEPT]
            self._record(flight)
            flight.done.set()
            self.retry_retention()

    def _settle_kept(self, flight: Flight) -> None:
        """Give a host-only chain's snapshot blocks back: free at once if it failed;
        evictable once it is committed, in step order, so that the arena, which evicts
        the blocks made evictable first, always evicts the oldest committed snapshot
        first (snapshots may commit out of order)."""
        if not flight.kept_mode:
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
        if not flight.committed.done():
            flight.committed.set_exception(error)
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

