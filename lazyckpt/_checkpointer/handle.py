"""A snapshot's handle: its progress, as awaitables per stage."""

from __future__ import annotations

import asyncio
import concurrent.futures

from .._engine.flight import Flight, SnapshotStats
from .._engine.scheduler import Engine
from .._errors import (
    ConfigurationError,
    LazyCkptError,
    SnapshotSkippedError,
    TierSkippedError,
)

__all__ = ["SnapshotHandle"]


class SnapshotHandle:
    """One snapshot's progress, as awaitables per stage.

    ``await captured()``: every shard is in host memory; the tensors may change now.
    ``await reached(tier)``: durable (committed) on that tier; :class:`TierSkippedError`
    when that tier's cadence does not take the step. ``await committed()``: committed on
    every tier that takes it (the whole chain, without cadences). Each raises :class:`SnapshotFailedError` if the snapshot
    failed at or before that stage. Cancelling one of them only stops the waiting; the
    snapshot goes on. The blocking :meth:`wait` serves synchronous code.
    """

    def __init__(self, engine: Engine, flight: Flight | None, step: int) -> None:
        self._engine = engine
        self._flight = flight
        self.step = step

    def __repr__(self) -> str:
        return f"<SnapshotHandle step={self.step} {self.state()}>"

    @property
    def skipped(self) -> bool:
        """True when the snapshot was dropped by ``when_busy="skip"``."""
        return self._flight is None

    @property
    def stats(self) -> SnapshotStats | None:
        """Timings so far (seconds): in ``snapshot()``, in the guard, to capture, per tier."""
        return None if self._flight is None else self._flight.stats

    def state(self) -> str:
        """A word for where the snapshot is: skipped, capturing, captured, committed, failed."""
        f = self._flight
        if f is None:
            return "skipped"
        last = f.committed
        if last.done():
            return "failed" if last.exception() else "committed"
        if f.captured.done():
            return "failed" if f.captured.exception() else "captured"
        return "capturing"

    def _future(self, stage: str) -> concurrent.futures.Future[None]:
        if self._flight is None:
            raise SnapshotSkippedError(f"the snapshot of step {self.step} was skipped (busy)")
        if stage == "captured":
            return self._flight.captured
        if stage == "committed":
            return self._flight.committed
        names = self._engine.tier_names
        if stage not in names:
            raise ConfigurationError(f"no tier named {stage!r}; tiers: {names}")
        return self._flight.reached[stage]

    async def _await(self, stage: str) -> None:
        fut = self._future(stage)
        try:
            # shielded: cancelling this wait must not cancel the snapshot's shared future
            await asyncio.shield(asyncio.wrap_future(fut))
        except TierSkippedError:
            raise  # not a failure: the snapshot's failures stay unreported
        except LazyCkptError:
            assert self._flight is not None
            self._engine.mark_reported(self._flight)
            raise

    async def captured(self) -> None:
        """Wait until every shard is in host memory."""
        await self._await("captured")

    async def reached(self, tier: str) -> None:
        """Wait until the snapshot is committed on ``tier`` (a tier's name).

        Raises:
            TierSkippedError: the tier's cadence does not take this step (at once, or as
                soon as the ranks agreed on it); nothing of it is written there.
            SnapshotFailedError: the snapshot failed at or before that tier.
        """
        await self._await(tier)

    async def committed(self) -> None:
        """Wait until the snapshot is committed on every tier that takes it (each tier
        whose cadence picks its step; the whole chain when no tier has a cadence)."""
        await self._await("committed")

    def wait(self, stage: str = "committed", timeout: float | None = None) -> None:
        """Block until ``stage`` ("captured", "committed" or a tier name) is reached."""
        fut = self._future(stage)
        try:
            fut.result(timeout)
        except TierSkippedError:
            raise
        except LazyCkptError:
            assert self._flight is not None
            self._engine.mark_reported(self._flight)
            raise

    def done(self) -> bool:
        """True once the snapshot is committed everywhere, or failed."""
        return self.state() in ("skipped", "committed", "failed")
