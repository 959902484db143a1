"""The engine's own event loop, on a thread of its own.

The pipeline must progress while the training thread computes and never awaits: a trainer
whose forward/backward blocks its own event loop for a second must still find its capture
done at the guard. So all orchestration runs on this loop (uvloop when installed and not
disabled), and the public coroutines bridge to it with ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["EngineLoop"]

T = TypeVar("T")
log = logging.getLogger("lazyckpt")
_LEFTOVER_S = 5.0  # how long stopping waits for abandoned tasks to finish cancelling


def _quiet(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    log.debug("engine loop, stopping: %s", context.get("message"))


def _new_loop(use_uvloop: bool | None) -> asyncio.AbstractEventLoop:
    if use_uvloop is not False:
        try:
            import uvloop
        except ImportError:
            if use_uvloop:
                raise
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class EngineLoop:
    """An event loop running forever on a daemon thread, from :meth:`start` until :meth:`stop`.

    Building one starts nothing: the Checkpointer starts it in ``open()``, so a Checkpointer
    that is built and never opened owns no thread.
    """

    def __init__(self, *, use_uvloop: bool | None = None, name: str = "lazyckpt-engine") -> None:
        self._use_uvloop = use_uvloop
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (:meth:`start` first)."""
        if self._loop is None:
            raise RuntimeError("the engine loop is not started")
        return self._loop

    def start(self) -> None:
        """Start the loop's thread and wait until it runs (idempotent)."""
        if self._thread is not None:
            return
        self._loop = _new_loop(self._use_uvloop)
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(self._loop, ready), name=self._name, daemon=True
        )
        self._thread.start()
        ready.wait()

    def _run(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            self._cancel_leftovers(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    @staticmethod
    def _cancel_leftovers(loop: asyncio.AbstractEventLoop) -> None:
        """Cancel and await whatever still runs when the loop stops (a Checkpointer stopped
        without draining: abandoned at exit, or its close interrupted), so that no task is
        destroyed pending and no task's error is printed when it is collected."""
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if not tasks:
            return
        # what the loop would still report (a task given up below, an error nobody awaited)
        # goes to the log at debug level: the Checkpointer has said what was lost
        loop.set_exception_handler(_quiet)
        for task in tasks:
            task.cancel()
        # bounded: a cancelled flight still tries to abort its uncommitted files
        loop.run_until_complete(asyncio.wait(tasks, timeout=_LEFTOVER_S))
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved, so it is not reported when collected

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the engine loop; the future is safe to wait on from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        """Stop the loop and join its thread (idempotent; nothing to do if never started)."""
        thread, loop = self._thread, self._loop
        if thread is not None and loop is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            if not self.in_loop_thread():
                thread.join()
