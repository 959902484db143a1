"""The public API: :class:`Checkpointer` (async), :class:`SyncCheckpointer`, :class:`SnapshotHandle`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any, Literal, TypeVar

import torch

from ._cuda import CudaCapture, GuardMode, resolve_guard_mode, stream_guard_hook
from ._dtensor import (
    SupportsRankManifests,
    assign_writers,
    needs_resharding,
    read_base_manifest,
    restore_resharded,
)
from ._engine import Engine, EngineOptions, Flight, SnapshotStats
from ._errors import (
    CheckpointerClosedError,
    ConfigurationError,
    LazyCkptError,
    SnapshotFailedError,
    SnapshotNotFoundError,
)
from ._manifest import LayoutOptions, Manifest, plan_layout
from ._restore import VerifyReport, committed_steps, restore_state, verify_step
from ._tier import SupportsStaging, Tier
from ._tree import TensorRef, walk_state

__all__ = [
    "Checkpointer",
    "SnapshotHandle",
    "SnapshotInFlightError",
    "SnapshotSkippedError",
    "SnapshotSkippedWarning",
    "SyncCheckpointer",
]

T = TypeVar("T")
log = logging.getLogger("lazyckpt")


class SnapshotSkippedWarning(UserWarning):
    """A snapshot was dropped because the pipeline was busy (``when_busy="skip"``)."""


class SnapshotSkippedError(LazyCkptError):
    """Raised by the awaitables of a skipped snapshot's handle: it was never taken."""


class SnapshotInFlightError(LazyCkptError):
    """``delete(step)`` was asked for a step that is still on its way through the tiers
    (or being restored). Await its handle's ``committed()`` (or the restore) first."""


class SnapshotHandle:
    """One snapshot's progress, as awaitables per stage.

    ``await captured()``: every shard is in host memory; the tensors may change now.
    ``await reached(tier)``: durable (committed) on that tier. ``await committed()``:
    committed on the last tier. Each raises :class:`SnapshotFailedError` if the snapshot
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
        last = f.reached[self._engine.stage_names[-1]]
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
            return self._flight.reached[self._engine.stage_names[-1]]
        names = [n for n in self._engine.stage_names if not n.startswith("<")]
        if stage not in names:
            raise ConfigurationError(f"no tier named {stage!r}; tiers: {names}")
        return self._flight.reached[stage]

    async def _await(self, stage: str) -> None:
        fut = self._future(stage)
        try:
            # shielded: cancelling this wait must not cancel the snapshot's shared future
            await asyncio.shield(asyncio.wrap_future(fut))
        except LazyCkptError:
            assert self._flight is not None
            self._engine.mark_reported(self._flight)
            raise

    async def captured(self) -> None:
        """Wait until every shard is in host memory."""
        await self._await("captured")

    async def reached(self, tier: str) -> None:
        """Wait until the snapshot is committed on ``tier`` (a tier's name)."""
        await self._await(tier)

    async def committed(self) -> None:
        """Wait until the snapshot is committed on the last tier of the chain."""
        await self._await("committed")

    def wait(self, stage: str = "committed", timeout: float | None = None) -> None:
        """Block until ``stage`` ("captured", "committed" or a tier name) is reached."""
        fut = self._future(stage)
        try:
            fut.result(timeout)
        except LazyCkptError:
            assert self._flight is not None
            self._engine.mark_reported(self._flight)
            raise

    def done(self) -> bool:
        """True once the snapshot is committed everywhere, or failed."""
        return self.state() in ("skipped", "committed", "failed")


class _Core:
    """What both facades share: the engine and the synchronous half of every operation."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        shard_size: int | None,
        pack_bytes: int | None,
        allow_pickle: bool,
        capture_threads: int,
        checksum_threads: int | None,
        io_concurrency: int,
        deadline: float | None,
        retries: int,
        retry_backoff: float,
        when_busy: Literal["wait", "skip"],
        staging_bytes: int,
        use_uvloop: bool | None,
        distributed: bool | None,
    ) -> None:
        if isinstance(tiers, Tier) or not isinstance(tiers, Sequence):
            raise ConfigurationError("tiers must be a list of Tier objects, fastest first")
        if shard_size is None:
            # 16 MiB, or small enough that the arena holds at least four shards at once
            first = tiers[0] if tiers else None
            arena = first.arena.capacity if isinstance(first, SupportsStaging) else staging_bytes
            shard_size = max(4096, min(16 << 20, arena // 4 // 4096 * 4096))
        options = EngineOptions(
            layout=LayoutOptions(
                shard_size=shard_size,
                pack_bytes=min(1 << 20, shard_size // 4) if pack_bytes is None else pack_bytes,
            ),
            allow_pickle=allow_pickle,
            capture_threads=capture_threads,
            checksum_threads=checksum_threads,
            io_concurrency=io_concurrency,
            deadline=deadline,
            retries=retries,
            retry_backoff=retry_backoff,
            when_busy=when_busy,
            staging_bytes=staging_bytes,
            use_uvloop=use_uvloop,
            distributed=distributed,
        )
        self.engine = Engine(tiers, options)
        self.options = options
        self._last_step: int | None = None
        self._closing = False
        self._open_lock = threading.Lock()
        self._guards: list[Any] = []
        self._plan_cache: tuple[tuple[Any, ...], Manifest] | None = None

    def check_open(self) -> None:
        if self._closing or self.engine.closed:
            raise CheckpointerClosedError("the Checkpointer is closed")
        if not self.engine.opened:
            raise ConfigurationError(
                "the Checkpointer is not open: use 'async with Checkpointer(...)' "
                "(or 'with SyncCheckpointer(...)'), or call open() first"
            )

    async def open_on_engine(self) -> None:
        await self.engine.open()
        listing = await asyncio.gather(*(t.steps() for t in self.engine.tiers))
        committed = [s for steps in listing for s in steps]
        if self.engine.coordinator is not None:  # every rank must refuse the same steps
            everyone = await self.engine.coordinator.gather(0, committed)
            committed = [s for part in everyone for s in part]
        self._last_step = max(committed) if committed else None

    def snapshot(self, state: Any, step: int) -> SnapshotHandle:
        t0 = time.perf_counter()
        self.check_open()
        if type(step) is not int or step < 0:
            raise ConfigurationError(f"step must be a non-negative int, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ConfigurationError(
                f"step {step} is not newer than the newest snapshot ({self._last_step}); "
                "steps must increase. After a rollback, start a new directory or delete "
                "the newer snapshots first."
            )
        self.engine.raise_unreported()
        tree, refs = walk_state(state, allow_pickle=self.options.allow_pickle)
        if any(r.dist is not None for r in refs):
            dedup = all(isinstance(t, SupportsRankManifests) for t in self.engine.durable)
            assign_writers(refs, self.engine.rank, self.engine.world_size, dedup)
        manifest = self._plan(step, tree, refs)
        if self.options.when_busy == "skip" and self.engine.busy_for(manifest):
            self.engine.skipped += 1
            warnings.warn(
                f"snapshot of step {step} skipped: the pipeline is still busy with earlier "
                f"snapshots ({self.engine.skipped} skipped so far)",
                SnapshotSkippedWarning,
                stacklevel=3,
            )
            return SnapshotHandle(self.engine, None, step)
        flight = Flight(manifest, refs, self.engine.stage_names)
        self._last_step = step
        if isinstance(self.engine.capture, CudaCapture):
            self.engine.capture.mark_snapshot(step)  # the point on the stream it must see
        flight.stats.snapshot_s = time.perf_counter() - t0
        self.engine.submit(flight)
        return SnapshotHandle(self.engine, flight, step)

    def _plan(self, step: int, tree: Any, refs: list[TensorRef]) -> Manifest:
        """The layout for this snapshot; reused from the previous one when every tensor has
        the same key, dtype, shape, aliasing and placement (the usual case: the same model
        and optimizer every step), since planning is most of ``snapshot()``'s cost."""
        # parallel tuples rather than one tuple per tensor: fewer objects for the collector
        signature = (
            tuple(r.key for r in refs),
            tuple(r.tensor.dtype for r in refs),
            tuple(r.tensor.shape for r in refs),
            tuple(r.alias_of for r in refs),
            tuple(r.dist for r in refs),
        )
        pickled = self.options.allow_pickle and "$pickle" in _tags(tree)
        cached = self._plan_cache
        if cached is not None and cached[0] == signature:
            return replace(cached[1], step=step, tree=tree, pickled=pickled, created=time.time())
        manifest = plan_layout(
            step,
            tree,
            refs,
            self.options.layout,
            pickled=pickled,
            rank=self.engine.rank,
            world_size=self.engine.world_size,
        )
        self._plan_cache = (signature, manifest)
        return manifest

    def wait_captured_blocking(self) -> float:
        """Block until every pending capture is done; return the seconds waited."""
        t0 = time.perf_counter()
        pending = self.engine.pending_captures()
        if pending:
            concurrent.futures.wait([f.captured for f in pending])
        waited = time.perf_counter() - t0
        for f in pending:
            f.stats.guard_s += waited
        self.engine.raise_unreported()
        return waited

    def guard(self, optimizer: torch.optim.Optimizer, mode: GuardMode = "cpu") -> Any:
        self.check_open()
        if not hasattr(optimizer, "register_step_pre_hook"):
            raise ConfigurationError(
                f"guard() takes a torch optimizer, got {type(optimizer).__qualname__}"
            )

        def blocking(_opt: Any, _args: Any, _kwargs: Any) -> None:
            if not self._closing:
                self.wait_captured_blocking()

        hook: Callable[[Any, Any, Any], None] = blocking
        capture = self.engine.capture
        if resolve_guard_mode(mode, capture) == "stream" and isinstance(capture, CudaCapture):
            hook = stream_guard_hook(
                capture,
                self.engine.pending_captures,
                raise_unreported=self.engine.raise_unreported,
                closing=lambda: self._closing,
            )
        handle = optimizer.register_step_pre_hook(hook)
        self._guards.append(handle)
        return handle

    async def restore_on_engine(
        self, step: int | None, into: Any, map_location: torch.device | str | None
    ) -> Any:
        if step is not None and (type(step) is not int or step < 0):
            raise ConfigurationError(f"step must be a non-negative int or None, got {step!r}")
        if step is None and self.engine.coordinator is not None:
            agreed = await self.steps_on_engine()  # all ranks restore the same step
            if not agreed:
                raise SnapshotNotFoundError("no step is committed on every rank")
            step = agreed[-1]

        rank, world = self.engine.rank, self.engine.world_size
        manifest, sources = await read_base_manifest(self.engine.tiers, step, rank, world)
        protected = self.engine.protected
        protected[manifest.step] = protected.get(manifest.step, 0) + 1
        try:
            if needs_resharding(manifest, into, rank, world):
                return await restore_resharded(
                    manifest,
                    sources,
                    self.engine.tiers,
                    rank=rank,
                    world_size=world,
                    into=into,
                    map_location=map_location,
                    allow_pickle=self.options.allow_pickle,
                )
            return await restore_state(
                manifest,
                sources,
                into=into,
                map_location=map_location,
                allow_pickle=self.options.allow_pickle,
            )
        finally:
            protected[manifest.step] -= 1
            if not protected[manifest.step]:
                del protected[manifest.step]

    async def verify_on_engine(self, step: int | None) -> VerifyReport:
        if step is not None and (type(step) is not int or step < 0):
            raise ConfigurationError(f"step must be a non-negative int or None, got {step!r}")
        return await verify_step(self.engine.tiers, step)

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
        for stage, tier in enumerate(engine.tiers if engine.host else [None, *engine.tiers]):
            if tier is None:
                continue
            try:
                await engine.delete_on_tier(tier, stage, step)
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

    async def close_on_engine(self) -> None:
        await self.engine.close()

    def finish_close(self) -> None:
        for handle in self._guards:
            handle.remove()
        self._guards.clear()
        self.engine.loop.stop()
        errors = self.engine.take_unreported()
        if errors:
            if len(errors) == 1:
                raise errors[0]
            raise SnapshotFailedError(
                f"{len(errors)} snapshots failed", errors, step=-1, tiers=self.engine.stage_names
            )


def _tags(tree: Any) -> set[str]:
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            found.update(node)
            stack.extend(node.values())
    return found


_DEFAULTS: dict[str, Any] = {
    "shard_size": None,
    "pack_bytes": None,
    "allow_pickle": False,
    "capture_threads": 2,
    "checksum_threads": None,
    "io_concurrency": 4,
    "deadline": 300.0,
    "retries": 3,
    "retry_backoff": 0.05,
    "when_busy": "wait",
    "staging_bytes": 256 << 20,
    "use_uvloop": None,
    "distributed": None,
}


def _make_core(tiers: Sequence[Tier], options: dict[str, Any]) -> _Core:
    unknown = set(options) - set(_DEFAULTS)
    if unknown:
        raise ConfigurationError(
            f"unknown Checkpointer options: {sorted(unknown)}; known: {sorted(_DEFAULTS)}"
        )
    return _Core(tiers, **{**_DEFAULTS, **options})


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
        shard_size: the unit of copying and writing, in bytes (multiple of 4096). Default:
            16 MiB, or a quarter of the host arena if that is smaller.
        pack_bytes: tensors up to this size are packed together into shared shards
            (default: 1 MiB or a quarter of ``shard_size``, whichever is smaller).
        allow_pickle: store (and restore) values that are not plain data with pickle. Off by
            default: restoring then never runs code from a checkpoint.
        capture_threads: threads copying CPU tensors into host memory (default 2).
        checksum_threads: threads computing the shards' crc32c from host memory after the
            capture, off the guard's path, at a lower scheduling priority (``None``: half
            the cores, at most 8).
        io_concurrency: shards in flight per durable tier.
        deadline: seconds any single tier operation may take before it fails with
            :class:`DeadlineExceededError` (``None``: no deadline). Default 300.
        retries: how often a failed tier operation (a broken backend, a missed deadline) is
            retried, with exponential back-off from ``retry_backoff`` seconds, before the
            snapshot fails on that tier. A full tier is not retried.
        when_busy: ``"wait"`` applies backpressure (the guard waits); ``"skip"`` drops a
            snapshot that could not start at once (a capture is still running, or the host
            arena has no room for it until slower tiers drain), with a
            :class:`SnapshotSkippedWarning`.
        staging_bytes: size of the private arena when the chain has no host tier.
        use_uvloop: run the engine loop on uvloop (``None``: if installed).
        distributed: coordinate commits with the other ranks over torch.distributed
            (``None``: when it is initialized with more than one rank). Then every rank
            must open the Checkpointer, snapshot the same steps in the same order, and
            call ``steps()``/``restore()`` together; see ``docs/distributed.md``.
    """

    def __init__(self, tiers: Sequence[Tier], **options: Any) -> None:
        self._core = _make_core(tiers, options)

    @property
    def tiers(self) -> list[Tier]:
        return list(self._core.engine.tiers)

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(self._core.engine.loop.submit(coro))

    async def open(self) -> Checkpointer:
        """Allocate the host arena, open every tier, clean up what a crash left behind."""
        with self._core._open_lock:
            if self._core.engine.opened:
                return self
        await self._call(self._core.open_on_engine())
        return self

    async def __aenter__(self) -> Checkpointer:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def snapshot(self, state: Any, *, step: int) -> SnapshotHandle:
        """Record a snapshot of ``state`` at ``step`` and return without copying tensor bytes.

        ``state`` is a mapping of tensors, Stateful objects (``model``, ``optimizer``) and
        plain values. Costs O(number of tensors). Raises the failure of an earlier snapshot
        that nobody has seen yet. Cancelling it before it returns takes no snapshot.
        """
        return self._core.snapshot(state, step)

    async def wait_captured(self) -> None:
        """Wait until every pending capture is done (then the tensors may change)."""
        self._core.check_open()
        await asyncio.to_thread(self._core.wait_captured_blocking)

    def guard(self, optimizer: torch.optim.Optimizer, mode: GuardMode = "cpu") -> Any:
        """Make ``optimizer.step()`` wait for pending captures first (a step pre-hook).

        Returns the hook's handle (``.remove()`` undoes it). With ``mode="cpu"`` the calling
        thread blocks only while a capture is still running. With ``mode="stream"`` (CUDA)
        the CPU never blocks: the optimizer's stream waits on the capture copies' events,
        so the GPU waits only if a copy is still running (see ``docs/gpu.md``); without
        CUDA it falls back to ``"cpu"``.
        """
        return self._core.guard(optimizer, mode)

    async def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        map_location: torch.device | str | None = None,
    ) -> Any:
        """Restore a committed snapshot, bit for bit.

        Args:
            step: the step; ``None`` for the latest committed on any tier.
            into: a mapping of live tensors / Stateful objects to load into in place
                (tensors keep their device and identity); it is returned.
            map_location: device for new tensors (default CPU).

        Reads from the fastest tier holding the step, falling back tier by tier and shard
        by shard on corruption or loss. Cancelling it may leave ``into`` partly loaded.
        """
        self._core.check_open()
        await self.wait_captured()
        return await self._call(self._core.restore_on_engine(step, into, map_location))

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

    def metrics(self) -> dict[str, Any]:
        """Bytes and throughput per tier, shards in flight, arena use, recent timings."""
        return self._core.engine.metrics()

    async def aclose(self) -> None:
        """Drain every snapshot, close the tiers, stop the engine. Raises any failure that
        was not yet reported. Idempotent. If cancelled, the drain goes on in the engine."""
        if self._core._closing:
            return
        self._core._closing = True
        try:
            # shielded: a cancelled caller must not cut the drain short and tear a commit
            await asyncio.shield(self._call(self._core.close_on_engine()))
        finally:
            self._core.finish_close()


class SyncCheckpointer:
    """:class:`Checkpointer` for plain synchronous training loops (no event loop needed).

    Same arguments and operations: ``with SyncCheckpointer(tiers=[...]) as ckpt:``,
    ``ckpt.snapshot(state, step=N)``, ``ckpt.wait_captured()``, ``ckpt.guard(opt)``,
    ``ckpt.restore(...)``, ``ckpt.steps()``, ``ckpt.delete(step)``, ``ckpt.close()``.
    """

    def __init__(self, tiers: Sequence[Tier], **options: Any) -> None:
        self._core = _make_core(tiers, options)

    @property
    def tiers(self) -> list[Tier]:
        return list(self._core.engine.tiers)

    def _call(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        if self._core.engine.loop.in_loop_thread():
            raise ConfigurationError("SyncCheckpointer methods cannot run on the engine thread")
        return self._core.engine.loop.submit(fn()).result()

    def open(self) -> SyncCheckpointer:
        """See :meth:`Checkpointer.open`."""
        if not self._core.engine.opened:
            self._call(self._core.open_on_engine)
        return self

    def __enter__(self) -> SyncCheckpointer:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def snapshot(self, state: Any, *, step: int) -> SnapshotHandle:
        """See :meth:`Checkpointer.snapshot`; use ``handle.wait(stage)`` to block on it."""
        return self._core.snapshot(state, step)

    def wait_captured(self) -> None:
        """See :meth:`Checkpointer.wait_captured`."""
        self._core.check_open()
        self._core.wait_captured_blocking()

    def guard(self, optimizer: torch.optim.Optimizer, mode: GuardMode = "cpu") -> Any:
        """See :meth:`Checkpointer.guard`."""
        return self._core.guard(optimizer, mode)

    def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        map_location: torch.device | str | None = None,
    ) -> Any:
        """See :meth:`Checkpointer.restore`."""
        self._core.check_open()
        self._core.wait_captured_blocking()
        return self._call(lambda: self._core.restore_on_engine(step, into, map_location))

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

    def metrics(self) -> dict[str, Any]:
        """See :meth:`Checkpointer.metrics`."""
        return self._core.engine.metrics()

    def close(self) -> None:
        """See :meth:`Checkpointer.aclose`."""
        if self._core._closing:
            return
        self._core._closing = True
        try:
            self._call(self._core.close_on_engine)
        finally:
            self._core.finish_close()
