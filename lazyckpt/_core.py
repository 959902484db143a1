"""What both Checkpointer facades share: the engine and the synchronous half of every
operation (:class:`_Core`). The facades (``_checkpointer``) only bridge to it: the async one
awaits the engine loop, the synchronous one blocks on it."""

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
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

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
from ._engine import Engine, Flight
from ._errors import (
    CheckpointerClosedError,
    ConfigurationError,
    LazyCkptError,
    SnapshotFailedError,
    SnapshotInFlightError,
    SnapshotNotFoundError,
    SnapshotSkippedWarning,
)
from ._gc import collector_paused
from ._handle import SnapshotHandle
from ._lazy import LazyRestores
from ._manifest import Manifest, plan_layout
from ._optimizers import hook_installed, optimizer_shape, unwrap_optimizer, wrap_closure
from ._options import CheckpointerOptions
from ._preemption import DrainReport, PreemptionHandler
from ._restore import VerifyReport, committed_steps, restore_lazily, restore_state, verify_step
from ._tier import Tier
from ._tree import KeyCache, TensorRef, walk_state

__all__ = ["_Core", "captures_done", "make_core"]

log = logging.getLogger("lazyckpt")


class _Core:
    """What both facades share: the engine and the synchronous half of every operation."""

    def __init__(self, tiers: Sequence[Tier], options: CheckpointerOptions) -> None:
        self.options = options
        self.preemption = PreemptionHandler(options.preemption_signals, self._on_preemption)
        self.preempted: int | None = None  # the signal that stopped snapshots
        self.policy = EagerPolicy(options.eager_bytes, options.eager, options.lazy)
        if isinstance(tiers, Tier) or not isinstance(tiers, Sequence):
            raise ConfigurationError("tiers must be a list of Tier objects, fastest first")
        self.engine = Engine(tiers, options)
        if options.verify_sources:
            self.engine.capture = VerifyingCapture(self.engine.capture, options.capture_threads)
        self._last_step: int | None = None
        self._closing = False
        self._open_lock = threading.Lock()
        self._guards: list[tuple[torch.optim.Optimizer, Any]] = []
        # the last plan: its signature, the manifest, and its tensor bytes (summed once)
        self._plan_cache: tuple[tuple[Any, ...], Manifest, int] | None = None
        self._keys = KeyCache()  # the state's key paths, kept from one snapshot to the next
        self._at_exit: Callable[[], None] | None = None
        self._owned_cache: tuple[tuple[Any, ...], set[int]] | None = None
        # lazy restores: per guarded optimizer (by id) the future of its state's restore,
        # and the engine-side tasks still loading (close and the next restore wait for them)
        self.lazy = LazyRestores()

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
        self.lazy.wait_blocking()  # a snapshot must not see half-loaded optimizer state
        with collector_paused():  # a few objects per tensor, none cyclic: see _gc.py
            tree, refs = walk_state(
                state, allow_pickle=self.options.allow_pickle, keys=self._keys
            )
            # before anything can change them: copy what a forward pass may change (see
            # EagerPolicy); on a GPU this is enqueued before the snapshot's mark below
            chosen = self.policy.choose(refs, self.owned_pointers())
            if chosen:
                copy_eager(refs, chosen)
            if [r for r in refs if r.dist is not None]:
                dedup = all(isinstance(t, SupportsRankManifests) for t in self.engine.durable)
                assign_writers(refs, self.engine.rank, self.engine.world_size, dedup)
            manifest, nbytes = self._plan(step, tree, refs)
        if self.options.when_busy == "skip" and self.engine.busy_for(manifest):
            self.engine.skipped += 1
            warnings.warn(
                f"snapshot of step {step} skipped: the pipeline is still busy with earlier "
                f"snapshots ({self.engine.skipped} skipped so far)",
                SnapshotSkippedWarning,
                stacklevel=stacklevel,
            )
            return SnapshotHandle(self.engine, None, step)
        flight = Flight(manifest, refs, self.engine.stage_names, nbytes)
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
        await captures_done(engine.pending_captures())
        delay = 0.0005
        while engine.flights and engine.busy_for(flight.manifest):
            await asyncio.sleep(delay)
            delay = min(0.01, delay * 2)

    def report_failures(self) -> None:
        """Apply the failure policy to the failures nobody has seen yet: raise them
        (``on_failure="raise"``), or drop them, since each was logged as it happened and is
        counted in ``metrics()["snapshots_failed"]`` (``"warn"``)."""
        if self.options.on_failure == "raise":
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
        live = [opt for opt, handle in self._guards if hook_installed(opt, handle)]
        if not live:
            return set()
        shape = tuple(optimizer_shape(opt) for opt in live)
        if self._owned_cache is None or self._owned_cache[0] != shape:
            self._owned_cache = (shape, optimizer_pointers(live))
        return self._owned_cache[1]

    def _plan(self, step: int, tree: Any, refs: list[TensorRef]) -> tuple[Manifest, int]:
        """The layout for this snapshot and its tensor bytes; reused from the previous one
        when every tensor has the same key, dtype, shape, aliasing and placement (the usual
        case: the same model and optimizer every step), since planning is most of
        ``snapshot()``'s cost."""
        # parallel tuples rather than one tuple per tensor: fewer objects for the collector
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
            fresh = replace(cached[1], step=step, tree=tree, pickled=pickled, created=time.time())
            return fresh, cached[2]
        manifest = plan_layout(
            step,
            tree,
            refs,
            self.engine.layout,
            pickled=pickled,
            rank=self.engine.rank,
            world_size=self.engine.world_size,
        )
        self._plan_cache = (signature, manifest, manifest.tensor_bytes)
        return manifest, self._plan_cache[2]

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
        if resolved == "stream" and self.options.verify_sources:
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
            self.lazy.hold(opt)
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
                wrapped = wrap_closure(args, kwargs, wait)
                if wrapped is not None:
                    return wrapped
            wait()
            return None

        handle = opt.register_step_pre_hook(hook)
        self._guards.append((opt, handle))
        return handle

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
                    checksum=checksum,
                )
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
            return await restore_state(
                manifest,
                sources,
                into=into,
                map_location=map_location,
                allow_pickle=self.options.allow_pickle,
                checksum=checksum,
            )
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

    async def close_on_engine(self) -> None:
        await self.lazy.settle()
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
        names = engine.tier_names
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
            name, len(self.engine.flights), self.options.preemption_grace,
        )
        future = self.engine.loop.submit(self.drain_on_engine(self.options.preemption_grace))
        try:
            # a little beyond the grace: the drain itself stops waiting at the grace
            report = future.result(self.options.preemption_grace + 1.0)
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
            self.engine.loop.submit(self.close_on_engine()).result(self.options.exit_timeout)
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
        if errors and self.options.on_failure == "warn":
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


async def captures_done(flights: Sequence[Flight]) -> None:
    """Wait, on the caller's loop, until these captures are done, failed or not. Cancelling
    the wait leaves the captures alone (``asyncio.wait`` cancels nothing, and nothing here
    cancels the engine's futures)."""
    if not flights:
        return
    waits = [asyncio.wrap_future(f.captured) for f in flights]
    for w in waits:
        w.add_done_callback(_retrieve)
    await asyncio.wait(waits)


def make_core(tiers: Sequence[Tier], options: dict[str, Any]) -> _Core:
    return _Core(tiers, CheckpointerOptions.from_kwargs(options))
