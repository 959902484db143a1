"""The engine's commits and what follows them: committing a flight's manifest on a stage,
the ranks' agreement on each step (distributed runs), retention passes, deleting a step
on a tier and collecting the data no step refers to any more (:class:`_Commits`, a part of
``_engine.scheduler.Engine``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from .. import hooks
from .._distributed.coordinator import Coordinator
from .._errors import ConfigurationError, LazyCkptError, TierBrokenError
from .._format.manifest import Manifest
from .._options import CheckpointerOptions
from .._tiering.interface import StepInfo, SupportsGlobalCommit, SupportsReferences, Tier
from .cadence import Cadences
from .flight import Flight
from .incremental import Increments

__all__ = ["_Commits"]

log = logging.getLogger("lazyckpt")
T = TypeVar("T")


class _Commits:
    """Commit, coordinate, retain and delete steps on the tiers (engine loop); ``Engine``
    sets the attributes declared here."""

    options: CheckpointerOptions
    durable: list[Tier]
    host: Tier | None
    host_last: bool
    cadences: Cadences
    increments: Increments
    stage_names: list[str]
    flights: dict[int, Flight]
    protected: dict[int, int]
    coordinator: Coordinator | None
    world_size: int
    _lock: threading.Lock
    _unreported: list[LazyCkptError]
    _tg: asyncio.TaskGroup | None
    _queues: list[asyncio.Queue[Flight]]
    _retention_locks: dict[int, asyncio.Lock]
    _retention_queued: dict[int, bool]
    _infos: dict[int, dict[int, StepInfo]]
    _retention_deferred: set[int]

    if TYPE_CHECKING:  # defined by Engine and its other parts

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
        def _record(self, flight: Flight) -> None: ...

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
        extra = {**manifest.extra, "tier": tier.describe()}
        retention = tier.retention.describe()
        if retention:  # what `lazyckpt ls` explains each step's keeping by
            extra["retention"] = retention
        cadence = self.cadences.by_stage.get(stage)
        if cadence is not None:
            extra["cadence"] = cadence.describe()
        if flight.emergency:
            extra["emergency"] = True
        manifest = replace(manifest, extra=extra)
        flight.committed_as[stage] = manifest
        try:
            hooks.point("tier.commit.before")
            await self._guarded(stage, "commit", partial(tier.commit, manifest))
            hooks.point("tier.commit.after")
        except Exception as exc:
            if stage == 0 and not flight.kept_mode:  # a convenience copy: its loss fails nothing
                log.info("host tier did not keep step %d: %s", flight.step, exc)
                self._resolve(flight, 0)
                return
            self._fail(flight, stage, exc)
            return
        if stage > 0 and self.coordinator is not None:
            flight.local_ok[stage] = True  # this rank's part; _coordinate decides the step
            return
        self._note_info(stage, manifest)
        self.increments.new_base(flight, stage)
        self._resolve(flight, stage)
        self._retain(tier, stage)

    def _note_info(self, stage: int, manifest: Manifest) -> None:
        """Keep what retention judges a step by, for a step this engine committed."""
        if stage > 0:
            self._infos.setdefault(stage, {})[manifest.step] = StepInfo.from_manifest(manifest)

    def _retain(self, tier: Tier, stage: int) -> None:
        if stage > 0 and tier.retention.describe():  # {}: it keeps everything
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
        committed on this stage's tier (see ``_distributed.coordinator``)."""
        assert self.coordinator is not None
        tier = self.tier_of(stage)
        while True:
            flight = await self._queues[stage].get()
            try:
                await flight.settled.wait()
                if flight.takes is None or stage not in flight.takes:
                    continue  # every rank skips it on this tier (the cadences agree)
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
                    committed = flight.committed_as[stage]
                    if committed is not None:
                        self._note_info(stage, committed)
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
        if stage == flight.last_stage:  # before anyone waiting on it wakes up
            self._record(flight)
        fut = flight.reached[name]
        if not fut.done():
            fut.set_result(None)
        if stage == flight.last_stage and not flight.committed.done():
            flight.committed.set_result(None)
        log.debug("step %d reached %s", flight.step, name, extra={"step": flight.step, "tier": name})

    async def _apply_retention(self, tier: Tier, stage: int) -> None:
        """One retention pass on a tier. Passes run one at a time per tier, so no two delete
        the same step at once, and each lists the steps only after every commit that asked
        for it."""
        try:
            async with self._retention_locks[stage]:
                self._retention_queued[stage] = False  # commits from now on need a new pass
                committed = await self._guarded(stage, "list", tier.steps)
                info = await self._step_info(tier, stage, committed)
                deleted = False
                for step in tier.retention.to_delete(committed, info):
                    # a step that flights in flight compare with stays until they are done
                    if step in self.protected or step in self.flights or step in self.increments.pins[stage]:
                        # asked again once that is over (retry_retention): a step whose
                        # own commit asked for this pass, say, is still in flight here
                        self._retention_deferred.add(stage)
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

    async def _step_info(
        self, tier: Tier, stage: int, committed: list[int]
    ) -> dict[int, StepInfo] | None:
        """What a retention by metric or by age judges each committed step by (None where
        the tier's retention needs none): from the manifests this engine committed there,
        or read once from the tier for steps committed before it opened (a step whose
        manifest cannot be read is left out: retention keeps what it cannot judge)."""
        if not tier.retention.needs_info():
            return None
        known = self._infos.setdefault(stage, {})
        for step in committed:
            if step in known:
                continue
            try:
                manifest = await self._guarded(stage, f"read manifest {step}", partial(tier.read_manifest, step))
            except LazyCkptError as exc:
                log.info("retention on %s: step %d not judged: %s", tier.name, step, exc)
                continue
            known[step] = StepInfo.from_manifest(manifest)
        for step in set(known) - set(committed):  # deleted meanwhile
            del known[step]
        return dict(known)

    def retry_retention(self) -> None:
        """Run the retention passes that kept a step back because it was still in flight,
        pinned or being restored (engine loop; after a flight ends or a restore lets go):
        with snapshots committing out of order, no later commit may come to ask."""
        if not self._retention_deferred or self._tg is None:
            return
        stages, self._retention_deferred = self._retention_deferred, set()
        for k in sorted(stages):
            try:
                self._retain(self.tier_of(k), k)
            except RuntimeError:  # the task group is shutting down: nothing runs any more
                return

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

    async def _collect(self, tier: Tier, stage: int) -> None:
        if isinstance(tier, SupportsReferences):
            keep = self.increments.in_use(stage, self.flights.values())
            await self._guarded(stage, "collect unreferenced data", partial(tier.collect, keep))
