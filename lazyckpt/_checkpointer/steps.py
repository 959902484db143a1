"""The operations on committed steps both facades share: restore (eager, lazy or
resharding), verify, list and delete, each run on the engine loop (:class:`_StepOps`, a
part of ``_checkpointer.core._Core``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from .._capture.optimizers import hook_installed
from .._engine.scheduler import Engine
from .._errors import (
    ConfigurationError,
    LazyCkptError,
    SnapshotInFlightError,
    SnapshotNotFoundError,
)
from .._format.walk import TensorRef
from .._options import CheckpointerOptions
from .._restore.fetch import committed_steps
from .._restore.lazy import LazyRestores
from .._restore.reshard import needs_resharding, read_base_manifest, restore_resharded
from .._restore.restore import restore_lazily, restore_state
from .._restore.verify import VerifyReport, verify_step

__all__ = ["_StepOps"]

log = logging.getLogger("lazyckpt")


class _StepOps:
    """Restore, verify, list and delete committed steps (engine loop); ``_Core`` sets the
    attributes declared here."""

    engine: Engine
    options: CheckpointerOptions
    lazy: LazyRestores
    _guards: list[tuple[torch.optim.Optimizer, Any]]
    _last_step: int | None
    _watched: list[TensorRef]

    async def restore_on_engine(
        self,
        step: int | None,
        into: Any,
        map_location: torch.device | str | None,
        lazy: bool = False,
    ) -> Any:
        if step is not None and (type(step) is not int or step < 0):
            raise ConfigurationError(f"step must be a non-negative int or None, got {step!r}")
        if type(lazy) is not bool:
            raise ConfigurationError(f"lazy must be True or False, got {lazy!r}")
        deferred = self.lazy.targets(into, self._guarded()) if lazy else {}
        # a restore writes tensors in place: the versions the last snapshot recorded for
        # the tensors watched until the guard's wait mean nothing any more (_core._changing)
        self._watched = []
        await self.lazy.settle()  # one restore at a time into the same optimizers
        if step is None and self.engine.coordinator is not None:
            agreed = await self.steps_on_engine()  # all ranks restore the same step
            if not agreed:
                raise SnapshotNotFoundError("no step is committed on every rank")
            step = agreed[-1]

        rank, world = self.engine.rank, self.engine.world_size
        checksum = self.engine.checksums.checksum_bytes  # the pool's, not the default executor
        manifest, sources = await read_base_manifest(self.engine.tiers, step, rank, world)
        protected = self.engine.protected
        protected[manifest.step] = protected.get(manifest.step, 0) + 1
        handed_over = False
        try:
            reshard = needs_resharding(manifest, into, rank, world)
            coordinator = self.engine.coordinator
            if coordinator is not None and any(m.placements is not None for m in manifest.tensors):
                # the resharding restore exchanges shards between ranks, so every rank
                # takes it where any rank needs it (a rank that wrote every replicated
                # chunk itself needs nothing from the others, but they need it). Only a
                # step holding distributed tensors asks: the ranks of a plain per-rank
                # state (DeepSpeed's files) restore on their own, as many times as each
                # wants
                (anyone,) = await coordinator.maximum(0, [int(reshard)])
                reshard = bool(anyone)
            if reshard:
                resharded = await restore_resharded(
                    manifest,
                    sources,
                    self.engine.tiers,
                    rank=rank,
                    world_size=world,
                    into=into,
                    map_location=map_location,
                    allow_pickle=self.options.allow_pickle,
                    checksum=checksum,
                    exchange=self.engine.coordinator,
                )
                self.lazy.forget(into)
                return resharded
            if deferred:
                rest = await restore_lazily(
                    manifest,
                    sources,
                    into=into,
                    deferred=set(deferred),
                    map_location=map_location,
                    allow_pickle=self.options.allow_pickle,
                    checksum=checksum,
                )
                if rest is not None:
                    step = manifest.step
                    self.lazy.start(step, rest, deferred.values(), lambda: self._unprotect(step))
                    handed_over = True  # the rest of the restore unprotects the step
                    return into
            restored = await restore_state(
                manifest,
                sources,
                into=into,
                map_location=map_location,
                allow_pickle=self.options.allow_pickle,
                checksum=checksum,
            )
            self.lazy.forget(into)  # a failed lazy restore into these optimizers is over
            return restored
        finally:
            if not handed_over:
                self._unprotect(manifest.step)

    def _guarded(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose guard is still installed (the user may have removed one)."""
        return [opt for opt, handle in self._guards if hook_installed(opt, handle)]

    def _unprotect(self, step: int) -> None:
        protected = self.engine.protected
        protected[step] -= 1
        if not protected[step]:
            del protected[step]
            self.engine.retry_retention()  # a pass may have kept it back meanwhile

    async def verify_on_engine(self, step: int | None) -> VerifyReport:
        if step is not None and (type(step) is not int or step < 0):
            raise ConfigurationError(f"step must be a non-negative int or None, got {step!r}")
        return await verify_step(
            self.engine.tiers, step, checksum=self.engine.checksums.checksum_bytes
        )

    async def steps_on_engine(self) -> list[int]:
        listing = await committed_steps(self.engine.tiers)  # a tier that is down is skipped
        mine = sorted({s for steps in listing.values() for s in steps})
        if self.engine.coordinator is None:
            return mine
        everyone = await self.engine.coordinator.gather(0, mine)
        return sorted(set.intersection(*(set(part) for part in everyone)))

    async def delete_on_engine(self, step: int) -> None:
        """Delete a committed ``step`` on every tier (engine loop); see
        :meth:`Checkpointer.delete`."""
        if type(step) is not int or step < 0:
            raise ConfigurationError(f"step must be a non-negative int, got {step!r}")
        engine = self.engine
        busy = ""
        flight = engine.flights.get(step)
        # a flight whose last stage resolved is only tidying up: it is no longer in flight
        if flight is not None and not flight.reached[engine.stage_names[-1]].done():
            busy = "still in flight; await its handle's committed() first"
        elif step in engine.protected:
            busy = "being restored; delete it once the restore returned"
        listing = await asyncio.gather(*(t.steps() for t in engine.tiers), return_exceptions=True)
        held = [
            t.name for t, steps in zip(engine.tiers, listing, strict=True)
            if not isinstance(steps, BaseException) and step in steps
        ]
        if engine.coordinator is not None:
            # every rank decides the same: the same step, nobody busy, somebody holds it
            everyone = await engine.coordinator.gather(0, (step, busy, bool(held)))
            if len({s for s, _, _ in everyone}) != 1:
                raise ConfigurationError(
                    f"ranks asked to delete different steps ({sorted({s for s, _, _ in everyone})}); "
                    "every rank must call delete() with the same step, together"
                )
            busy = busy or next((b for _, b, _ in everyone if b), "")
            found = any(h for _, _, h in everyone)
        else:
            found = bool(held)
        if busy:
            raise SnapshotInFlightError(f"step {step} cannot be deleted: it is {busy}")
        if not found:
            raise SnapshotNotFoundError(
                f"step {step} is not committed on any tier "
                f"({', '.join(t.name for t in engine.tiers)}); nothing to delete"
            )
        errors: list[Exception] = []
        for stage in engine.stages:
            if stage.tier is None:  # the private staging arena keeps no snapshot
                continue
            try:
                await engine.delete_on_tier(stage.tier, stage.index, step)
            except Exception as exc:
                errors.append(exc)
        if engine.coordinator is not None:
            # nobody returns before every rank (rank 0 with the shared records) is through
            oks = await engine.coordinator.gather(0, not errors)
            failed = [r for r, ok in enumerate(oks) if not ok]
            if failed and not errors:
                errors.append(
                    LazyCkptError(f"rank(s) {failed} could not delete step {step}; see their logs")
                )
        if step == self._last_step:  # deleting the newest step lets a rollback reuse it
            listing = await asyncio.gather(
                *(t.steps() for t in engine.tiers), return_exceptions=True
            )
            remaining = [s for got in listing if not isinstance(got, BaseException) for s in got]
            self._last_step = max([*remaining, *engine.flights], default=None)
        for other in errors[1:]:
            log.warning("deleting step %d: %s", step, other, extra={"step": step})
        if errors:
            raise errors[0]
