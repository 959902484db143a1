"""How a Checkpointer ends, which both facades share: close, drain, the preemption
signal's drain, the close of one its owner dropped without closing it, and the close at
interpreter exit of one its owner never closed (:class:`_Lifecycle`, a part of
``_checkpointer.core._Core``).

A Checkpointer its owner drops while it is open (a helper function that opened one and
returned, ``del ckpt``) is closed when its facade is collected: the facade's finalizer
starts the drain and close on the engine loop, without waiting, and warns with a
``ResourceWarning``, as an unclosed file does. The core stays referenced (``_DROPPED``)
until that close is done, so the exit hook still finds it and waits for the drain for up
to ``exit_timeout`` seconds. Why the facade and not the core: the core is also held by the
guard's hook on the optimizer and by the preemption signal handler, so it may outlive its
facade for as long as the optimizer lives, and with it the engine's thread, tasks and
memory; the facade is held by its owner alone. Why not keep the facade alive while
snapshots are in flight instead: it would still leave an idle, dropped Checkpointer's
engine thread and open tiers behind, and its engine's tasks destroyed pending when the
engine is collected (the event loop's tracebacks at exit).
"""

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
from collections.abc import Callable
from typing import Any

import torch

from .._distributed.preemption import DrainReport, PreemptionHandler
from .._engine.scheduler import Engine
from .._errors import (
    ConfigurationError,
    LazyCkptError,
    SnapshotFailedError,
    TierSkippedError,
)
from .._options import CheckpointerOptions
from .._restore.lazy import LazyRestores

__all__ = ["_Lifecycle"]

log = logging.getLogger("lazyckpt")

# the Checkpointers whose owner dropped them open, until their close is done: held here so
# that the exit hook, which holds each weakly, still finds one whose drain is under way
_DROPPED: set[_Lifecycle] = set()


class _Lifecycle:
    """Close, drain, preemption and exit handling (``_Core`` sets the attributes declared
    here)."""

    engine: Engine
    options: CheckpointerOptions
    lazy: LazyRestores
    preemption: PreemptionHandler
    preempted: int | None
    _closing: bool
    _at_exit: Callable[[], None] | None
    _guards: list[tuple[torch.optim.Optimizer, Any]]
    # the finalizer of the facade that opened it (see the module's docstring), and the
    # close it started when the facade was collected open
    _owner_watch: weakref.finalize[Any, Any] | None = None
    _dropped_close: concurrent.futures.Future[None] | None = None

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
        copies: dict[int, tuple[str, ...]] = {}

        async def drain_and_copy() -> None:
            # the engine moves every shard down the chain in order, so waiting is all a
            # drain does: the fastest durable tier has each shard first; then the newest
            # snapshot goes to the tiers whose cadence skipped it (emergency_tiers)
            await engine.drain()
            copies.update(await engine.emergency_copies())

        try:
            await asyncio.wait_for(drain_and_copy(), timeout)
        except TimeoutError:
            timed_out = True
        # submitted meanwhile (from another thread); an emergency copy is reported apart
        watched.update({s: f for s, f in engine.flights.items() if not f.emergency})
        names = engine.tier_names
        reached: dict[int, tuple[str, ...]] = {}
        failed: dict[int, tuple[str, ...]] = {}
        pending: dict[int, tuple[str, ...]] = {}
        skipped: dict[int, tuple[str, ...]] = {}
        for step, flight in sorted(watched.items()):
            futures = [(n, flight.reached[n]) for n in names]
            got = tuple(n for n, f in futures if f.done() and f.exception() is None)
            bad = tuple(
                n
                for n, f in futures
                if f.done()
                and f.exception() is not None
                and not isinstance(f.exception(), TierSkippedError)
            )
            passed = tuple(
                n for n, f in futures if f.done() and isinstance(f.exception(), TierSkippedError)
            )
            left = tuple(n for n, f in futures if not f.done())
            reached[step] = got
            if passed:
                skipped[step] = passed
            if bad:
                failed[step] = bad
                engine.mark_reported(flight)
            if left:
                pending[step] = left
        # the failures of snapshots that ended before this drain and that nobody has seen
        # yet are listed too: the report hands every failure it lists over, so the failure
        # policy does not raise them again at the next snapshot(); a failure that belongs to
        # no snapshot (a retention pass's) is left to the policy
        for failed_step, error in engine.take_unreported_steps():  # others stay queued
            failed.setdefault(failed_step, tuple(getattr(error, "tiers", ())))
        failed = dict(sorted(failed.items()))
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
            skipped=skipped,
            emergency=copies,
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

    def watch_owner(self, owner: object) -> None:
        """Close this Checkpointer when ``owner`` (the facade, just opened) is collected
        before it is closed; see the module's docstring."""
        if self._owner_watch is not None:
            return
        watch = weakref.finalize(owner, self._owner_dropped)
        watch.atexit = False  # at exit the exit hook drains, before the executors stop
        self._owner_watch = watch

    def _owner_dropped(self) -> None:
        """The facade was collected while open (its finalizer: any thread, the engine's
        included, at any point the collector runs). Starts the drain and close on the
        engine loop without waiting for it, then warns."""
        self._owner_watch = None
        if self._closing or self.engine.closed or not self.engine.opened:
            return
        self._closing = True  # the guard's hook, still on the optimizer, waits no more
        in_flight = self._in_flight()
        _DROPPED.add(self)
        if threading.current_thread() is threading.main_thread():
            self.preemption.uninstall()  # elsewhere it stays: it only passes signals on
        # the guard hooks stay on their optimizers, doing nothing: removing one here could
        # change the optimizer's hook dict while the training thread iterates over it
        close = self.engine.loop.submit(self.close_on_engine())
        self._dropped_close = close
        close.add_done_callback(self._dropped_closed)
        # last: where warnings are errors (pytest), the exception must not stop the close
        warnings.warn(
            "a lazyckpt Checkpointer was dropped without being closed; closing it now"
            + (f", draining the snapshots of steps {in_flight}" if in_flight else "")
            + " (close it with 'async with', 'with' or aclose()/close())",
            ResourceWarning,
            stacklevel=1,  # the caller is the collector, wherever it ran
        )

    def _in_flight(self) -> list[int]:
        """The steps in flight, from any thread, taking no lock (see
        :meth:`Engine.steps_in_flight`): those the engine runs, and those submitted that its
        loop has not started yet (still capturing)."""
        return self.engine.steps_in_flight()

    def _dropped_closed(self, close: concurrent.futures.Future[None]) -> None:
        """The close of a dropped Checkpointer is done (engine thread, usually): stop the
        loop, and say what failed, since nobody is left to raise it to."""
        try:
            failed = None if close.cancelled() else close.exception()
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (at exit)
                self.engine.loop.stop()
            errors = self.engine.take_unreported()
            if failed is not None:
                log.warning(
                    "lazyckpt: closing a Checkpointer that was dropped without being closed "
                    "failed: %s",
                    failed,
                )
            if errors:
                _log_unseen("lazyckpt: a Checkpointer was dropped without being closed", errors)
        finally:
            _DROPPED.discard(self)

    def _close_dropped_at_exit(self, close: concurrent.futures.Future[None]) -> None:
        """At exit: wait for the close a dropped Checkpointer's finalizer started."""
        with contextlib.suppress(Exception):  # a failure is _dropped_closed's to log
            close.result(self.options.exit_timeout)
        if close.done():
            return  # _dropped_closed stops the loop and reports
        lost = self._in_flight()
        with contextlib.suppress(RuntimeError):
            self.engine.loop.stop()
        log.warning(
            "a lazyckpt Checkpointer was dropped without being closed and did not drain "
            "within exit_timeout (%s s); snapshots of steps %s were abandoned (close it "
            "with 'async with', 'with' or aclose()/close())",
            self.options.exit_timeout,
            lost,
        )

    def close_at_exit(self) -> None:
        if self._dropped_close is not None:
            self._close_dropped_at_exit(self._dropped_close)
            return
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
            _log_unseen("a lazyckpt Checkpointer was not closed before exit", errors)
        else:
            warnings.warn(
                "a lazyckpt Checkpointer was not closed; it was closed at exit (every "
                "snapshot drained)",
                ResourceWarning,
                stacklevel=1,
            )

    def finish_close(self) -> None:
        if self._owner_watch is not None:
            self._owner_watch.detach()  # closed by its owner: nothing left to do when dropped
            self._owner_watch = None
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


def _log_unseen(what: str, errors: list[LazyCkptError]) -> None:
    """Log failures nobody is left to raise to (the first three of them)."""
    log.warning(
        "%s; %d snapshot(s) failed unseen: %s",
        what,
        len(errors),
        "; ".join(str(e) for e in errors[:3]),
    )
