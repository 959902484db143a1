"""How a Checkpointer ends, which both facades share: close, drain, the preemption
signal's drain and the close at interpreter exit of one its owner never closed
(:class:`_Lifecycle`, a part of ``_core._Core``)."""

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

from ._engine import Engine
from ._errors import ConfigurationError, SnapshotFailedError
from ._lazy import LazyRestores
from ._options import CheckpointerOptions
from ._preemption import DrainReport, PreemptionHandler

__all__ = ["_Lifecycle"]

log = logging.getLogger("lazyckpt")


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
