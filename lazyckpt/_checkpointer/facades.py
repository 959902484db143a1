"""The public API: :class:`Checkpointer` (async), :class:`SyncCheckpointer`, and
:class:`SnapshotHandle` (from ``_checkpointer.handle``). Both facades bridge to one ``_checkpointer.core._Core``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import torch

from .._capture.cuda import GuardMode
from .._distributed.preemption import DrainReport
from .._errors import (
    ConfigurationError,
    LocationInUseError,
)
from .._options import CheckpointerOptions
from .._restore.verify import VerifyReport
from .._tiering.interface import Tier
from .core import captures_done, make_core
from .handle import SnapshotHandle
from .holders import explain_in_use, forget, open_site, opened

__all__ = ["Checkpointer", "SyncCheckpointer"]

T = TypeVar("T")


class Checkpointer:
    """Lazy asynchronous checkpointing through a chain of storage tiers.

    ``snapshot()`` records references and returns; the bytes are copied to host memory in
    the background while training continues, then flow down the tiers. Use as
    ``async with Checkpointer(tiers=[...]) as ckpt:``; leaving the block drains every
    snapshot (each reaches its last tier or fails loudly) and closes the tiers.

    Args:
        tiers: the chain, fastest first: usually ``HostMemoryTier`` then ``FileTier`` and/or
            ``ZarrTier``. Without a host tier first, captures stage through a private arena
            of ``staging_bytes``.
        **options: the keyword arguments of :class:`CheckpointerOptions`, each documented
            there (``shard_size``, ``deadline``, ``when_busy``, ``on_failure``, ...). An
            unknown name or a bad value raises :class:`ConfigurationError` naming it.
    """

    def __init__(self, tiers: Sequence[Tier], **options: Any) -> None:
        self._core = make_core(tiers, options)

    @property
    def tiers(self) -> list[Tier]:
        """The chain of tiers, fastest first."""
        return list(self._core.engine.tiers)

    @property
    def options(self) -> CheckpointerOptions:
        """The options this Checkpointer was built with."""
        return self._core.options

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(self._core.engine.loop.submit(coro))

    async def open(self) -> Checkpointer:
        """Allocate the host arena, open every tier, clean up what a crash left behind."""
        with self._core._open_lock:
            if self._core.engine.opened:
                return self
        site = open_site()
        self._core.preemption.install()  # first: it refuses outside the main thread
        try:
            self._core.engine.loop.start()
            await self._call(self._core.open_on_engine())
        except LocationInUseError as exc:
            self._core.preemption.uninstall()
            explained = explain_in_use(exc, self._core)
            if explained is exc:
                raise
            raise explained from exc
        except BaseException:
            self._core.preemption.uninstall()
            raise
        opened(self._core, site)
        self._core.watch_owner(self)  # dropped without aclose(): closed when collected
        return self

    async def __aenter__(self) -> Checkpointer:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def snapshot(
        self, state: Any, *, step: int, metrics: Mapping[str, float] | None = None
    ) -> SnapshotHandle:
        """Record a snapshot of ``state`` at ``step`` and return without copying the bytes
        of the lazily captured tensors.

        ``state`` is a mapping of tensors, Stateful objects (``model``, ``optimizer``) and
        plain values. ``metrics`` (finite numbers by name, ``{"val_loss": 2.1}``) are
        kept in the manifest for retention by the best of them (``Retention(keep_best=
        KeepBest("val_loss", 3))``) and shown by ``lazyckpt ls``. Costs O(number of
        tensors), plus a copy of each small tensor that no
        guarded optimizer owns (see ``eager_bytes``). With ``on_failure="raise"``, raises
        the failure of an earlier snapshot that nobody has seen yet. It yields to the event
        loop, and under backpressure (``when_busy="wait"``) it waits here, cooperatively,
        until the earlier captures are done and the host arena has room. Cancelling it
        before it returns takes no snapshot.
        """
        previous = self._core._last_step
        prepared = self._core.prepare(state, step, metrics=metrics)
        if isinstance(prepared, SnapshotHandle):
            await asyncio.sleep(0)
            return prepared
        try:
            await self._core.wait_for_room(prepared)
            await asyncio.sleep(0)  # let the caller's other tasks run at least once
        except BaseException:
            self._core.withdraw(prepared, previous)
            raise
        return self._core.submit(prepared)

    async def wait_captured(self) -> None:
        """Wait until every pending capture is done (then the tensors may change). With
        ``on_failure="raise"``, raises a failure nobody has seen yet."""
        self._core.check_open()
        await captures_done(self._core.engine.pending_captures())
        self._core.report_failures()

    def guard(self, optimizer: Any, mode: GuardMode = "cpu", *, closure: bool | None = None) -> Any:
        """Make ``optimizer.step()`` wait for pending captures first (a step pre-hook).

        Returns the hook's handle (``.remove()`` undoes it). The guard only waits: it never
        raises into the step, so a failed snapshot never costs a training step (failures
        go to the handle, the log, ``metrics()`` and ``on_failure``).

        Args:
            optimizer: a ``torch.optim.Optimizer``, or a wrapper whose ``.optimizer`` chain
                leads to one (accelerate's ``AcceleratedOptimizer``, Lightning's
                ``LightningOptimizer``); anything else raises ConfigurationError.
            mode: ``"cpu"``: the calling thread blocks only while a capture is still
                running. ``"stream"`` (CUDA): the CPU never blocks; the optimizer's stream
                waits on the capture copies' events (``docs/gpu.md``); without CUDA it falls
                back to ``"cpu"``.
            closure: where a step given a closure (LBFGS; Lightning's automatic
                optimization runs forward and backward inside it) waits. ``None``/``True``:
                after the closure returns, before the update, so the forward and backward
                passes inside it overlap the capture. ``False``: before the closure runs.
        """
        return self._core.guard(optimizer, mode, closure)

    async def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        map_location: torch.device | str | None = None,
        lazy: bool = False,
    ) -> Any:
        """Restore a committed snapshot, bit for bit.

        Args:
            step: the step; ``None`` for the latest committed on any tier.
            into: a mapping of live tensors / Stateful objects to load into in place
                (tensors keep their device and identity); it is returned.
            map_location: device for new tensors (default CPU).
            lazy: return as soon as everything but the state of the optimizers in
                ``into`` that ``guard()`` watches is in place; their state streams in
                behind, while the first forward and backward passes run. Each guarded
                ``optimizer.step()`` (after the closure, with a closure) waits until its
                optimizer's state is loaded, and raises if that failed; ``snapshot()``
                and the next ``restore()`` wait for it too. Without such an optimizer in
                ``into``, or with device (CUDA) targets or resharding, the restore is
                eager. The result is bit for bit the eager one.

        Reads from the fastest tier holding the step, falling back tier by tier and shard
        by shard on corruption or loss. Cancelling it may leave ``into`` partly loaded.
        """
        self._core.check_open()
        await self.wait_captured()
        return await self._call(self._core.restore_on_engine(step, into, map_location, lazy))

    async def steps(self) -> list[int]:
        """Steps committed on at least one tier, ascending."""
        self._core.check_open()
        return await self._call(self._core.steps_on_engine())

    async def delete(self, step: int) -> None:
        """Delete the committed snapshot of ``step`` on every tier (the host tier included).

        Raises :class:`SnapshotInFlightError` while the step is still on its way through the
        tiers or being restored (await its handle first), :class:`SnapshotNotFoundError`
        when no tier holds it, and a tier's error when a tier could not delete it (the other
        tiers still did). Retention passes on a tier wait for it, and it for them. Deleting
        the newest step lets the next ``snapshot()`` use that step number again (a
        rollback). With several ranks, every rank calls it together with the same step;
        each tier deletes what its layout gives that rank to delete (the shared commit
        record on rank 0). Cancelling it may leave the step deleted on some tiers only.
        """
        self._core.check_open()
        await self._call(self._core.delete_on_engine(step))

    async def verify(self, step: int | None = None) -> VerifyReport:
        """Read every shard of ``step`` (default: the latest) on every tier that has it and
        check its checksum; report the damage per tier. Changes nothing."""
        self._core.check_open()
        return await self._call(self._core.verify_on_engine(step))

    async def drain(self, timeout: float | None = None) -> DrainReport:  # noqa: ASYNC109 (the drain runs on the engine loop, which is what the timeout bounds)
        """Make every snapshot taken so far durable on the chain's tiers and say what
        reached where.

        Waits until each snapshot in flight is committed on every tier (each shard moves
        down the chain in order, so the fastest durable tier has it first) or failed, for
        at most ``timeout`` seconds (``None``: no limit). Snapshots may still be taken
        meanwhile; those submitted before the drain ends are waited for too. Raises no
        snapshot's failure: the report lists it (and the failure policy still applies).
        Cancelling it only stops the waiting. With cadences (``cadence=``) it then writes
        the newest snapshot to the emergency tiers whose cadence skipped it
        (``report.emergency``); with several ranks every rank must then call it together.

        Returns:
            A :class:`DrainReport`: per step the tiers reached, failed and still pending,
            and per durable tier the newest step committed there.
        """
        self._core.check_open()
        return await self._call(self._core.drain_on_engine(timeout))

    def metrics(self) -> dict[str, Any]:
        """Bytes and throughput per tier, shards in flight, arena use, recent timings."""
        return self._core.engine.metrics()

    async def aclose(self) -> None:
        """Drain every snapshot, close the tiers, stop the engine. With
        ``on_failure="raise"``, raises any failure that was not yet reported. Idempotent. If
        cancelled, the drain goes on in the engine."""
        if self._core._closing:
            return
        self._core._closing = True
        try:
            self._core.engine.loop.start()  # never opened: the tiers are closed all the same
            # shielded: a cancelled caller must not cut the drain short and tear a commit
            await asyncio.shield(self._call(self._core.close_on_engine()))
        finally:
            forget(self._core)
            self._core.finish_close()


class SyncCheckpointer:
    """:class:`Checkpointer` for plain synchronous training loops (no event loop needed).

    Same arguments and operations: ``with SyncCheckpointer(tiers=[...]) as ckpt:``,
    ``ckpt.snapshot(state, step=N)``, ``ckpt.wait_captured()``, ``ckpt.guard(opt)``,
    ``ckpt.restore(...)``, ``ckpt.steps()``, ``ckpt.delete(step)``, ``ckpt.close()``.
    """

    def __init__(self, tiers: Sequence[Tier], **options: Any) -> None:
        self._core = make_core(tiers, options)

    @property
    def tiers(self) -> list[Tier]:
        """The chain of tiers, fastest first."""
        return list(self._core.engine.tiers)

    @property
    def options(self) -> CheckpointerOptions:
        """The options this Checkpointer was built with."""
        return self._core.options

    def _call(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        if self._core.engine.loop.in_loop_thread():
            raise ConfigurationError("SyncCheckpointer methods cannot run on the engine thread")
        return self._core.engine.loop.submit(fn()).result()

    def open(self) -> SyncCheckpointer:
        """See :meth:`Checkpointer.open`."""
        if not self._core.engine.opened:
            site = open_site()
            self._core.preemption.install()  # first: it refuses outside the main thread
            try:
                self._core.engine.loop.start()
                self._call(self._core.open_on_engine)
            except LocationInUseError as exc:
                self._core.preemption.uninstall()
                explained = explain_in_use(exc, self._core)
                if explained is exc:
                    raise
                raise explained from exc
            except BaseException:
                self._core.preemption.uninstall()
                raise
            opened(self._core, site)
            self._core.watch_owner(self)  # dropped without close(): closed when collected
        return self

    def __enter__(self) -> SyncCheckpointer:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def snapshot(
        self, state: Any, *, step: int, metrics: Mapping[str, float] | None = None
    ) -> SnapshotHandle:
        """See :meth:`Checkpointer.snapshot`; use ``handle.wait(stage)`` to block on it.
        Backpressure waits in the guard (or in the engine) instead."""
        return self._core.snapshot(state, step, metrics)

    def wait_captured(self) -> None:
        """See :meth:`Checkpointer.wait_captured`."""
        self._core.check_open()
        self._core.wait_captured_blocking()

    def guard(self, optimizer: Any, mode: GuardMode = "cpu", *, closure: bool | None = None) -> Any:
        """See :meth:`Checkpointer.guard`."""
        return self._core.guard(optimizer, mode, closure)

    def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        map_location: torch.device | str | None = None,
        lazy: bool = False,
    ) -> Any:
        """See :meth:`Checkpointer.restore`."""
        self._core.check_open()
        self._core.wait_captured_blocking()
        return self._call(lambda: self._core.restore_on_engine(step, into, map_location, lazy))

    def steps(self) -> list[int]:
        """See :meth:`Checkpointer.steps`."""
        self._core.check_open()
        return self._call(self._core.steps_on_engine)

    def delete(self, step: int) -> None:
        """See :meth:`Checkpointer.delete`."""
        self._core.check_open()
        self._call(lambda: self._core.delete_on_engine(step))

    def verify(self, step: int | None = None) -> VerifyReport:
        """See :meth:`Checkpointer.verify`."""
        self._core.check_open()
        return self._call(lambda: self._core.verify_on_engine(step))

    def drain(self, timeout: float | None = None) -> DrainReport:
        """See :meth:`Checkpointer.drain`."""
        self._core.check_open()
        return self._call(lambda: self._core.drain_on_engine(timeout))

    def metrics(self) -> dict[str, Any]:
        """See :meth:`Checkpointer.metrics`."""
        return self._core.engine.metrics()

    def close(self) -> None:
        """See :meth:`Checkpointer.aclose`."""
        if self._core._closing:
            return
        self._core._closing = True
        try:
            self._core.engine.loop.start()  # never opened: the tiers are closed all the same
            self._call(self._core.close_on_engine)
        finally:
            forget(self._core)
            self._core.finish_close()
