"""The public API: :class:`Checkpointer` (async), :class:`SyncCheckpointer`, :class:`SnapshotHandle`."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal, TypeVar

import torch

from ._capture import EagerPolicy, VerifyingCapture, copy_eager, optimizer_pointers
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
    SnapshotInFlightError,
    SnapshotNotFoundError,
    SnapshotSkippedError,
    SnapshotSkippedWarning,
)
from ._gc import collector_paused
from ._manifest import LayoutOptions, Manifest, plan_layout
from ._preemption import DrainReport, PreemptionHandler, check_signals
from ._restore import VerifyReport, committed_steps, restore_lazily, restore_state, verify_step
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
        on_failure: Literal["warn", "raise"],
        eager_bytes: int,
        eager: Sequence[str],
        lazy: Sequence[str],
        verify_sources: bool,
        exit_timeout: float,
        preemption_signals: Any,
        preemption_grace: float,
    ) -> None:
        if on_failure not in ("warn", "raise"):
            raise ConfigurationError(f"on_failure must be 'warn' or 'raise', got {on_failure!r}")
        if type(verify_sources) is not bool:
            raise ConfigurationError(f"verify_sources must be True or False, got {verify_sources!r}")
        if not exit_timeout >= 0:
            raise ConfigurationError(f"exit_timeout must be seconds >= 0, got {exit_timeout!r}")
        signals, self.preemption_grace = check_signals(preemption_signals, preemption_grace)
        self.preemption = PreemptionHandler(signals, self._on_preemption)
        self.preempted: int | None = None  # the signal that stopped snapshots
        self.policy = EagerPolicy(eager_bytes, eager, lazy)
        self.on_failure = on_failure
        self.verify_sources = verify_sources
        self.exit_timeout = exit_timeout
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
        if verify_sources:
            self.engine.capture = VerifyingCapture(self.engine.capture, capture_threads)
        self.options = options
        self._last_step: int | None = None
        self._closing = False
        self._open_lock = threading.Lock()
        self._guards: list[tuple[torch.optim.Optimizer, Any]] = []
        self._plan_cache: tuple[tuple[Any, ...], Manifest] | None = None
        self._at_exit: Callable[[], None] | None = None
        self._owned_cache: tuple[tuple[Any, ...], set[int]] | None = None
        # lazy restores: per guarded optimizer (by id) the future of its state's restore,
        # and the engine-side tasks still loading (close and the next restore wait for them)
        self._restoring: dict[int, concurrent.futures.Future[None]] = {}
        self._lazy_tasks: set[asyncio.Task[None]] = set()

    @property
    def cuda(self) -> CudaCapture | None:
        """The engine's CUDA capture backend, if it has one (under a VerifyingCapture too)."""
        capture = self.engine.capture
        if isinstance(capture, VerifyingCapture):
            capture = capture.inner
        return capture if isinstance(capture, CudaCapture) else None

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
        self._register_exit()
        listing = await asyncio.gather(*(t.steps() for t in self.engine.tiers))
        committed = [s for steps in listing for s in steps]
        if self.engine.coordinator is not None:  # every rank must refuse the same steps
            everyone = await self.engine.coordinator.gather(0, committed)
            committed = [s for part in everyone for s in part]
        self._last_step = max(committed) if committed else None

    def prepare(self, state: Any, step: int, stacklevel: int = 3) -> Flight | SnapshotHandle:
        """The synchronous half of ``snapshot()``: walk, copy the eager tensors, plan. Returns
        the flight to submit, or the handle of a skipped snapshot (whose warning points
        ``stacklevel`` frames up: at the caller of the public ``snapshot()``)."""
        t0 = time.perf_counter()
        self.check_open()
        if type(step) is not int or step < 0:
            raise ConfigurationError(f"step must be a non-negative int, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ConfigurationError(
                f"step {step} is not newer than the newest snapshot ({self._last_step}); "
                "steps must increase. After a rollback, start a new directory or delete "
                "the newer snapshots first (ckpt.delete(step))."
            )
        if self.preempted is not None:
            # draining for a preemption: a new snapshot could not become durable in time
            # and would only delay the exit; the trainer may still run a few steps
            self.engine.skipped += 1
            warnings.warn(
                f"snapshot of step {step} skipped: the job is being preempted (signal "
                f"{self.preempted}); the snapshots taken before it were drained",
                SnapshotSkippedWarning,
                stacklevel=stacklevel,
            )
            return SnapshotHandle(self.engine, None, step)
        self.report_failures()
        self.wait_restored_blocking()  # a snapshot must not see half-loaded optimizer state
        with collector_paused():  # a few objects per tensor, none cyclic: see _gc.py
            tree, refs = walk_state(state, allow_pickle=self.options.allow_pickle)
            # before anything can change them: copy what a forward pass may change (see
            # EagerPolicy); on a GPU this is enqueued before the snapshot's mark below
            chosen = self.policy.choose(refs, self.owned_pointers())
            if chosen:
                copy_eager(refs, chosen)
            if [r for r in refs if r.dist is not None]:
                dedup = all(isinstance(t, SupportsRankManifests) for t in self.engine.durable)
                assign_writers(refs, self.engine.rank, self.engine.world_size, dedup)
            manifest = self._plan(step, tree, refs)
        if self.options.when_busy == "skip" and self.engine.busy_for(manifest):
            self.engine.skipped += 1
            warnings.warn(
                f"snapshot of step {step} skipped: the pipeline is still busy with earlier "
                f"snapshots ({self.engine.skipped} skipped so far)",
                SnapshotSkippedWarning,
                stacklevel=stacklevel,
            )
            return SnapshotHandle(self.engine, None, step)
        flight = Flight(manifest, refs, self.engine.stage_names)
        self._last_step = step
        if self.cuda is not None:
            self.cuda.mark_snapshot(step)  # the point on the stream it must see
        flight.stats.snapshot_s = time.perf_counter() - t0
        return flight

    def submit(self, flight: Flight) -> SnapshotHandle:
        self.check_open()
        self.engine.submit(flight)
        return SnapshotHandle(self.engine, flight, flight.step)

    def withdraw(self, flight: Flight, previous: int | None) -> None:
        """A prepared snapshot that will not be submitted (its ``snapshot()`` was cancelled)."""
        if self._last_step == flight.step:
            self._last_step = previous

    def snapshot(self, state: Any, step: int) -> SnapshotHandle:
        prepared = self.prepare(state, step, stacklevel=4)
        if isinstance(prepared, SnapshotHandle):
            return prepared
        return self.submit(prepared)

    async def wait_for_room(self, flight: Flight) -> None:
        """Backpressure for ``await snapshot()``, on the caller's loop: wait (yielding) until
        the earlier captures are done and the arena has room for this snapshot, or nothing
        is left in flight that could make room. The engine would otherwise wait on its own
        thread, and the guard would then block the caller's thread (and loop) in the next
        optimizer step."""
        engine = self.engine
        await _captures_done(engine.pending_captures())
        delay = 0.0005
        while engine.flights and engine.busy_for(flight.manifest):
            await asyncio.sleep(delay)
            delay = min(0.01, delay * 2)

    def report_failures(self) -> None:
        """Apply the failure policy to the failures nobody has seen yet: raise them
        (``on_failure="raise"``), or drop them, since each was logged as it happened and is
        counted in ``metrics()["snapshots_failed"]`` (``"warn"``)."""
        if self.on_failure == "raise":
            self.engine.raise_unreported()
        else:
            self.engine.take_unreported()

    def owned_pointers(self) -> set[int]:
        """Data pointers of the tensors the guarded optimizers own (see EagerPolicy).

        Listing them costs about as much per tensor as the walk itself, so the set is kept
        while the optimizers' shape stays the same: the same ``state`` and ``param_groups``
        objects (``load_state_dict`` replaces both), the same number of parameters, of
        parameters with state and of state entries (an optimizer creates its state at its
        first step). An optimizer that swaps a state tensor for a new one without any of
        these changing leaves the new one out: it is then treated as not owned, which is
        safe (copied at ``snapshot()`` if small, version-checked if large)."""
        live = [opt for opt, handle in self._guards if _installed(opt, handle)]
        if not live:
            return set()
        shape = tuple(_optimizer_shape(opt) for opt in live)
        if self._owned_cache is None or self._owned_cache[0] != shape:
            self._owned_cache = (shape, optimizer_pointers(live))
        return self._owned_cache[1]

    def _plan(self, step: int, tree: Any, refs: list[TensorRef]) -> Manifest:
        """The layout for this snapshot; reused from the previous one when every tensor has
        the same key, dtype, shape, aliasing and placement (the usual case: the same model
        and optimizer every step), since planning is most of ``snapshot()``'s cost."""
        # parallel tuples rather than one tuple per tensor: fewer objects for the collector
        # (lists built by comprehensions: a generator would resume once per tensor)
        signature = (
            tuple([r.key for r in refs]),
            tuple([r.tensor.dtype for r in refs]),
            tuple([r.tensor.shape for r in refs]),
            tuple([r.alias_of for r in refs]),
            tuple([r.dist for r in refs]),
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

    def wait_captured_blocking(self, *, report: bool = True) -> float:
        """Block until every pending capture is done; return the seconds waited. With
        ``report``, then apply the failure policy."""
        t0 = time.perf_counter()
        pending = self.engine.pending_captures()
        if pending:
            concurrent.futures.wait([f.captured for f in pending])
        waited = time.perf_counter() - t0
        for f in pending:
            f.stats.guard_s += waited
        if report:
            self.report_failures()
        return waited

    def guard(
        self, optimizer: Any, mode: GuardMode = "cpu", closure: bool | None = None
    ) -> Any:
        self.check_open()
        opt = unwrap_optimizer(optimizer)
        if closure not in (None, True, False):
            raise ConfigurationError(f"closure must be None, True or False, got {closure!r}")
        resolved = resolve_guard_mode(mode, self.cuda)
        if resolved == "stream" and self.verify_sources:
            raise ConfigurationError(
                'verify_sources=True needs guard(mode="cpu"): with the stream guard the '
                "optimizer may legitimately change a source before its copy is seen "
                "complete, which the check would report as a violation"
            )
        fence: Callable[[Any, Any, Any], None] | None = None
        if resolved == "stream" and self.cuda is not None:
            fence = stream_guard_hook(
                self.cuda, self.engine.pending_captures, closing=lambda: self._closing
            )

        def wait() -> None:
            # a lazy restore still loading this optimizer's state holds its step; a failed
            # one raises: stepping on state that was not restored would corrupt training
            restoring = self._restoring.get(id(opt))
            if restoring is not None:
                restoring.result()
            # never raises into the optimizer step: a failed snapshot must not cost a
            # training step; failures go to the handle, the log, metrics and the policy
            if self._closing:
                return
            try:
                if fence is not None:
                    fence(None, (), {})
                else:
                    self.wait_captured_blocking(report=False)
            except Exception:
                log.exception("lazyckpt's guard failed to wait for the pending captures")

        def hook(_opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if closure is not False:
                wrapped = _wrap_closure(args, kwargs, wait)
                if wrapped is not None:
                    return wrapped
            wait()
            return None

        handle = opt.register_step_pre_hook(hook)
        self._guards.append((opt, handle))
        return handle

    def lazy_targets(self, into: Any) -> dict[Any, torch.optim.Optimizer]:
        """The top-level entries of ``into`` that a lazy restore defers: the optimizers
        (or their wrappers) that ``guard()`` watches, by key."""
        if not isinstance(into, Mapping):
            raise ConfigurationError(
                "restore(lazy=True) needs into= a mapping whose entries include the guarded "
                f"optimizers, got {type(into).__qualname__}"
            )
        live = {id(opt): opt for opt, handle in self._guards if _installed(opt, handle)}
        found: dict[Any, torch.optim.Optimizer] = {}
        for key, value in into.items():
            try:
                opt = unwrap_optimizer(value)
            except ConfigurationError:
                continue
            if id(opt) in live:
                found[key] = opt
        return found

    def wait_restored_blocking(self) -> None:
        """Block until every lazy restore has loaded its optimizers' state (any thread but
        the engine's); a failed one is not raised here (the guarded step raises it)."""
        pending = [f for f in self._restoring.values() if not f.done()]
        if pending:
            concurrent.futures.wait(pending)

    async def settle_lazy(self) -> None:
        """Wait (engine loop) for the lazy restores still loading."""
        while self._lazy_tasks:
            await asyncio.wait(set(self._lazy_tasks))

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
        deferred = self.lazy_targets(into) if lazy else {}
        await self.settle_lazy()  # one restore at a time into the same optimizers
        if step is None and self.engine.coordinator is not None:
            agreed = await self.steps_on_engine()  # all ranks restore the same step
            if not agreed:
                raise SnapshotNotFoundError("no step is committed on every rank")
            step = agreed[-1]

        rank, world = self.engine.rank, self.engine.world_size
        manifest, sources = await read_base_manifest(self.engine.tiers, step, rank, world)
        protected = self.engine.protected
        protected[manifest.step] = protected.get(manifest.step, 0) + 1
        handed_over = False
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
            if deferred:
                rest = await restore_lazily(
                    manifest,
                    sources,
                    into=into,
                    deferred=set(deferred),
                    map_location=map_location,
                    allow_pickle=self.options.allow_pickle,
                )
                if rest is not None:
                    self._start_lazy(manifest.step, rest, deferred.values())
                    handed_over = True  # the rest of the restore unprotects the step
                    return into
            return await restore_state(
                manifest,
                sources,
                into=into,
                map_location=map_location,
                allow_pickle=self.options.allow_pickle,
            )
        finally:
            if not handed_over:
                self._unprotect(manifest.step)

    def _unprotect(self, step: int) -> None:
        protected = self.engine.protected
        protected[step] -= 1
        if not protected[step]:
            del protected[step]

    def _start_lazy(
        self,
        step: int,
        rest: Callable[[], Awaitable[None]],
        optimizers: Iterable[torch.optim.Optimizer],
    ) -> None:
        """Load the deferred optimizer state in the background (engine loop); each
        optimizer's guard holds its step until it is done."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        optimizers = list(optimizers)
        for opt in optimizers:
            self._restoring[id(opt)] = done

        async def run() -> None:
            try:
                await rest()
            except BaseException as exc:
                log.error(
                    "lazyckpt: the lazy restore of step %d could not load the optimizer "
                    "state: %s; the guarded optimizer.step() raises it",
                    step, exc, extra={"step": step},
                )
                done.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                done.set_result(None)
                for opt in optimizers:  # loaded: nothing left for the guard to wait for
                    if self._restoring.get(id(opt)) is done:
                        del self._restoring[id(opt)]
            finally:
                self._unprotect(step)

        task = asyncio.get_running_loop().create_task(run(), name=f"lazyckpt-lazy-restore-{step}")
        self._lazy_tasks.add(task)
        task.add_done_callback(self._lazy_tasks.discard)

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
        await self.settle_lazy()
        await self.engine.close()

    async def drain_on_engine(self, timeout: float | None) -> DrainReport:  # noqa: ASYNC109
        """Wait (engine loop) until every snapshot in flight is done, for at most
        ``timeout`` seconds, and report what reached where; see :meth:`Checkpointer.drain`."""
        if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
            raise ConfigurationError(f"timeout must be seconds >= 0 or None, got {timeout!r}")
        engine = self.engine
        t0 = time.perf_counter()
        watched = dict(engine.flights)
        timed_out = False
        try:
            # the engine moves every shard down the chain in order, so waiting is all a
            # drain does: the fastest durable tier has each shard first
            await asyncio.wait_for(engine.drain(), timeout)
        except TimeoutError:
            timed_out = True
        watched.update(engine.flights)  # submitted meanwhile (from another thread)
        names = [n for n in engine.stage_names if not n.startswith("<")]
        reached: dict[int, tuple[str, ...]] = {}
        failed: dict[int, tuple[str, ...]] = {}
        pending: dict[int, tuple[str, ...]] = {}
        for step, flight in sorted(watched.items()):
            futures = [(n, flight.reached[n]) for n in names]
            got = tuple(n for n, f in futures if f.done() and f.exception() is None)
            bad = tuple(n for n, f in futures if f.done() and f.exception() is not None)
            left = tuple(n for n, f in futures if not f.done())
            reached[step] = got
            if bad:
                failed[step] = bad
            if left:
                pending[step] = left
        durable: dict[str, int | None] = {}
        for tier in engine.durable:
            steps = [s.step for s in engine.history if tier.name in s.reached_s]
            steps += [step for step, got in reached.items() if tier.name in got]
            durable[tier.name] = max(steps, default=None)
        return DrainReport(
            reached=reached,
            failed=failed,
            pending=pending,
            durable=durable,
            timed_out=timed_out,
            seconds=time.perf_counter() - t0,
        )

    def _on_preemption(self, signum: int) -> None:
        """The preemption handler's work (main thread): stop snapshots, drain within the
        grace period, log which step is durable where."""
        first = self.preempted is None
        self.preempted = signum
        name = _signal_name(signum)
        if self.engine.closed or not self.engine.opened:
            return
        log.warning(
            "lazyckpt: %s received: no new snapshots; draining %d in flight for up to %.0f s",
            name, len(self.engine.flights), self.preemption_grace,
        )
        future = self.engine.loop.submit(self.drain_on_engine(self.preemption_grace))
        try:
            # a little beyond the grace: the drain itself stops waiting at the grace
            report = future.result(self.preemption_grace + 1.0)
        except concurrent.futures.TimeoutError:
            log.warning("lazyckpt: %s: the drain did not answer within the grace period", name)
            return
        level = logging.WARNING if not report.complete else logging.INFO
        log.log(level, "lazyckpt: drained on %s%s: %s", name, "" if first else " (again)", report.summary())

    def _register_exit(self) -> None:
        """Close at interpreter exit a Checkpointer its owner never closed (the trainer
        raised before ``aclose()``): drain for up to ``exit_timeout`` seconds, then abandon
        what is left, with one warning instead of the event loop's complaints."""
        me = weakref.ref(self)

        def at_exit() -> None:
            core = me()
            if core is not None:
                core.close_at_exit()

        self._at_exit = at_exit
        # run at the start of interpreter shutdown, before concurrent.futures refuses new
        # work to its thread pools (which the drain needs): threading's exit hooks run
        # newest first, and concurrent.futures registered its own when it was imported
        register = getattr(threading, "_register_atexit", None)
        if register is None:  # pragma: no cover - every supported Python has it
            atexit.register(at_exit)
            return
        with contextlib.suppress(RuntimeError):  # already shutting down: nothing to add
            register(at_exit)

    def close_at_exit(self) -> None:
        if self._closing or self.engine.closed:
            return
        self._closing = True
        drained = False
        # at exit there is nobody left to raise to: a tier that fails to close is ignored
        with contextlib.suppress(Exception):
            self.engine.loop.submit(self.close_on_engine()).result(self.exit_timeout)
            drained = True
        lost = [] if drained else sorted(self.engine.flights)
        self.engine.loop.stop()
        errors = self.engine.take_unreported()
        if lost:
            log.warning(
                "a lazyckpt Checkpointer was not closed before exit; snapshots of steps %s "
                "were abandoned (close it with 'async with', 'with' or aclose()/close())",
                lost,
            )
        elif errors:
            log.warning(
                "a lazyckpt Checkpointer was not closed before exit; %d snapshot(s) failed "
                "unseen: %s",
                len(errors),
                "; ".join(str(e) for e in errors[:3]),
            )
        else:
            warnings.warn(
                "a lazyckpt Checkpointer was not closed; it was closed at exit (every "
                "snapshot drained)",
                ResourceWarning,
                stacklevel=1,
            )

    def finish_close(self) -> None:
        self.preemption.uninstall()
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)  # threading's hook is a no-op once closed
            self._at_exit = None
        for _opt, handle in self._guards:
            handle.remove()
        self._guards.clear()
        self.engine.loop.stop()
        errors = self.engine.take_unreported()
        if errors and self.on_failure == "warn":
            return  # each was logged when it happened; the handles raise them
        if errors:
            if len(errors) == 1:
                raise errors[0]
            raise SnapshotFailedError(
                f"{len(errors)} snapshots failed", errors, step=-1, tiers=self.engine.stage_names
            )


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


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


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # a failure is the handle's and the policy's to report


async def _captures_done(flights: Sequence[Flight]) -> None:
    """Wait, on the caller's loop, until these captures are done, failed or not. Cancelling
    the wait leaves the captures alone (``asyncio.wait`` cancels nothing, and nothing here
    cancels the engine's futures)."""
    if not flights:
        return
    waits = [asyncio.wrap_future(f.captured) for f in flights]
    for w in waits:
        w.add_done_callback(_retrieve)
    await asyncio.wait(waits)


def _optimizer_shape(opt: torch.optim.Optimizer) -> tuple[int, ...]:
    state = opt.state
    return (
        id(opt),
        id(state),
        id(opt.param_groups),
        sum(len(g["params"]) for g in opt.param_groups),
        len(state),
        sum(len(v) for v in state.values()),
    )


def _installed(opt: torch.optim.Optimizer, handle: Any) -> bool:
    """Is the guard's hook still on ``opt`` (the user may have removed it)?"""
    return handle.id in getattr(opt, "_optimizer_step_pre_hooks", {})


def unwrap_optimizer(obj: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind ``obj``: itself, or at the end of its ``.optimizer``
    chain (accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``,
    DeepSpeed's and similar wrappers, which all call the inner optimizer's ``step()``)."""
    found = obj
    for _ in range(16):
        inner = getattr(found, "optimizer", None)
        if inner is None or inner is found:
            break
        found = inner
    if isinstance(found, torch.optim.Optimizer) and hasattr(found, "register_step_pre_hook"):
        return found
    what = type(obj).__qualname__
    hint = (
        " For a GradScaler, pass the optimizer you give to scaler.step(optimizer)."
        if "Scaler" in what
        else ""
    )
    raise ConfigurationError(
        f"guard() needs the torch.optim.Optimizer whose step() updates the state, or a "
        f"wrapper with an .optimizer attribute leading to one (accelerate's "
        f"AcceleratedOptimizer, Lightning's LightningOptimizer); got {what}.{hint}"
    )


def _wrap_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any], wait: Callable[[], None]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """With a closure (LBFGS; Lightning runs forward and backward in one), the step pre-hook
    fires before the forward pass: waiting there would end the lazy window before it began.
    The closure is wrapped instead, so the wait happens after it returns, before the
    optimizer changes anything (every torch optimizer calls its closure first)."""
    # the hook sees step()'s arguments with the optimizer itself first
    first = 1 if args and isinstance(args[0], torch.optim.Optimizer) else 0
    if len(args) > first and callable(args[first]):
        fn, where = args[first], "args"
    elif callable(kwargs.get("closure")):
        fn, where = kwargs["closure"], "kwargs"
    else:
        return None

    def closure() -> Any:
        loss = fn()
        wait()
        return loss

    if where == "args":
        return (*args[:first], closure, *args[first + 1 :]), kwargs
    return args, {**kwargs, "closure": closure}


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
    "on_failure": "warn",
    "eager_bytes": 1 << 20,
    "eager": (),
    "lazy": (),
    "verify_sources": False,
    "exit_timeout": 10.0,
    "preemption_signals": (),
    "preemption_grace": 25.0,
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
        on_failure: what a failed snapshot does to training. ``"warn"`` (default): training
            goes on; one warning is logged per failed snapshot and
            ``metrics()["snapshots_failed"]`` counts it. ``"raise"``: in addition, the next
            ``snapshot()`` (or ``wait_captured()``, or closing) raises the failure nobody has
            seen yet. Either way the handle's awaitables raise it, no tier it failed on
            lists it, and the guard never raises into the optimizer step.
        eager_bytes: tensors up to this size (bytes, default 1 MiB) that no guarded
            optimizer owns are copied at ``snapshot()`` instead of lazily: module buffers
            that the forward pass updates (BatchNorm statistics), small frozen tensors, RNG
            states. See ``docs/design.md`` ("Which tensors are captured lazily").
        eager: key patterns (``fnmatch``, e.g. ``"model/ema.*"``) of tensors always copied
            at ``snapshot()``, whatever their size: large tensors changed outside the
            optimizer step.
        lazy: key patterns of tensors never copied at ``snapshot()`` (only ``eager`` wins
            over it): small tensors you know nothing changes before the guard.
        verify_sources: after the last shard of a snapshot is captured, checksum every
            source tensor again and fail the snapshot with ImmutabilityViolationError if
            one changed without its version counter moving (a write through ``.data`` or
            a numpy view). Costs one more read of every captured byte before the guard
            lets go; needs ``guard(mode="cpu")``. See ``docs/guarantees.md``.
        exit_timeout: a Checkpointer never closed (the trainer raised) is closed at
            interpreter exit: its pending snapshots get this many seconds to drain
            (default 10), then are abandoned with one warning.
        preemption_signals: signals announcing a preemption (e.g. ``(signal.SIGTERM,)``;
            SIGUSR1 and the like, as schedulers send them). On one of them the handler
            installed at ``open()`` (main thread only) stops taking snapshots (later
            ``snapshot()`` calls return a skipped handle, with a
            :class:`SnapshotSkippedWarning`), drains for at most ``preemption_grace``
            seconds, logs which step is durable on which tier, and then lets the signal
            take its usual course: the handler installed before it runs, or the default
            action (SIGTERM ends the process). Closing restores the previous handler.
            Default: none. See ``docs/guarantees.md`` ("Preemption").
        preemption_grace: seconds the preemption handler drains at most (default 25: most
            schedulers kill 30 s after the notice).
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
        self._core.preemption.install()  # first: it refuses outside the main thread
        try:
            await self._call(self._core.open_on_engine())
        except BaseException:
            self._core.preemption.uninstall()
            raise
        return self

    async def __aenter__(self) -> Checkpointer:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def snapshot(self, state: Any, *, step: int) -> SnapshotHandle:
        """Record a snapshot of ``state`` at ``step`` and return without copying the bytes
        of the lazily captured tensors.

        ``state`` is a mapping of tensors, Stateful objects (``model``, ``optimizer``) and
        plain values. Costs O(number of tensors), plus a copy of each small tensor that no
        guarded optimizer owns (see ``eager_bytes``). With ``on_failure="raise"``, raises
        the failure of an earlier snapshot that nobody has seen yet. It yields to the event
        loop, and under backpressure (``when_busy="wait"``) it waits here, cooperatively,
        until the earlier captures are done and the host arena has room. Cancelling it
        before it returns takes no snapshot.
        """
        previous = self._core._last_step
        prepared = self._core.prepare(state, step)
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
        await _captures_done(self._core.engine.pending_captures())
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
        Cancelling it only stops the waiting.

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
            self._core.preemption.install()  # first: it refuses outside the main thread
            try:
                self._call(self._core.open_on_engine)
            except BaseException:
                self._core.preemption.uninstall()
                raise
        return self

    def __enter__(self) -> SyncCheckpointer:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def snapshot(self, state: Any, *, step: int) -> SnapshotHandle:
        """See :meth:`Checkpointer.snapshot`; use ``handle.wait(stage)`` to block on it.
        Backpressure waits in the guard (or in the engine) instead."""
        return self._core.snapshot(state, step)

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
            self._call(self._core.close_on_engine)
        finally:
            self._core.finish_close()
