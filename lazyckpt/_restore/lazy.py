"""The lazy restores in progress: which guarded optimizers' state is still loading.

``restore(lazy=True)`` returns once everything but the guarded optimizers' state is in
place; that state loads in the background on the engine loop. :class:`LazyRestores` owns
those background loads: a guarded ``optimizer.step()`` waits for its optimizer's
(:meth:`LazyRestores.hold`), ``snapshot()`` waits for all of them
(:meth:`LazyRestores.wait_blocking`), and the next restore and closing wait on the engine
loop (:meth:`LazyRestores.settle`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch

from .._capture.optimizers import unwrap_optimizer
from .._errors import ConfigurationError

__all__ = ["LazyRestores"]

log = logging.getLogger("lazyckpt")


class LazyRestores:
    """The lazy restores of one Checkpointer (see the module docstring)."""

    def __init__(self) -> None:
        # per guarded optimizer (by id) the future of its state's restore
        self._restoring: dict[int, concurrent.futures.Future[None]] = {}
        # the optimizer each of those ids was taken from: an id can be reused once it dies
        self._owners: dict[int, weakref.ref[torch.optim.Optimizer]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # engine loop: the loads still running

    @staticmethod
    def targets(into: Any, guarded: Iterable[torch.optim.Optimizer]) -> dict[Any, torch.optim.Optimizer]:
        """The top-level entries of ``into`` that a lazy restore defers: the optimizers (or
        their wrappers) among ``guarded``, by key."""
        if not isinstance(into, Mapping):
            raise ConfigurationError(
                "restore(lazy=True) needs into= a mapping whose entries include the guarded "
                f"optimizers, got {type(into).__qualname__}"
            )
        live = {id(opt) for opt in guarded}
        return {key: opt for key, opt in _optimizers_by_key(into) if id(opt) in live}

    def hold(self, optimizer: torch.optim.Optimizer) -> None:
        """Block until ``optimizer``'s state is loaded (any thread but the engine's); raise
        if loading it failed: stepping on state that was not restored would corrupt
        training."""
        restoring = self._restoring.get(id(optimizer))
        if restoring is not None:
            restoring.result()

    def wait_blocking(self) -> None:
        """Block until every lazy restore has loaded its optimizers' state (any thread but
        the engine's); a failed one is not raised here (the guarded step raises it)."""
        pending = [f for f in self._restoring.values() if not f.done()]
        if pending:
            concurrent.futures.wait(pending)

    def raise_failed(self, state: Any) -> None:
        """Raise the error of a lazy restore that failed into an optimizer among
        ``state``'s top-level entries, if one did (any thread but the engine's). That
        optimizer's state is then partly the snapshot's and partly what was there before
        (damaged bytes included, when a checksum caught them after they landed), so a
        snapshot of it would commit that as a valid step. It stays so until a restore
        loads that optimizer whole (:meth:`forget`); a snapshot without it (a new
        optimizer built instead) is not refused."""
        if not self._restoring:
            return
        for opt in _optimizers_in(state):
            done = self._restoring.get(id(opt))
            owner = self._owners.get(id(opt))
            if (
                done is not None
                and owner is not None
                and owner() is opt
                and done.done()
                and not done.cancelled()
                and done.exception() is not None
            ):
                raise cast(BaseException, done.exception())

    def forget(self, into: Any) -> None:
        """A restore loaded ``into`` whole: a failed lazy restore of its optimizers (its
        top-level entries, as :meth:`targets` finds them) is over; their guard and
        ``snapshot()`` no longer raise its error."""
        if not self._restoring:
            return
        for opt in _optimizers_in(into):
            done = self._restoring.get(id(opt))
            if done is not None and done.done():
                self._drop(opt)

    def _drop(self, opt: torch.optim.Optimizer) -> None:
        del self._restoring[id(opt)]
        self._owners.pop(id(opt), None)

    async def settle(self) -> None:
        """Wait (engine loop) for the lazy restores still loading."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def start(
        self,
        step: int,
        rest: Callable[[], Awaitable[None]],
        optimizers: Iterable[torch.optim.Optimizer],
        finished: Callable[[], None],
    ) -> None:
        """Load the deferred optimizer state in the background (engine loop) with ``rest``;
        each optimizer's guard holds its step until it is done. ``finished`` runs once the
        load ended, however it ended."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        optimizers = list(optimizers)
        for opt in optimizers:
            self._restoring[id(opt)] = done
            self._owners[id(opt)] = weakref.ref(opt)

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
                        self._drop(opt)
            finally:
                finished()

        task = asyncio.get_running_loop().create_task(run(), name=f"lazyckpt-lazy-restore-{step}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _optimizers_by_key(entries: Any) -> Iterator[tuple[Any, torch.optim.Optimizer]]:
    """The top-level entries of a mapping that are optimizers (or their wrappers), unwrapped,
    with their keys; nothing for anything else."""
    if not isinstance(entries, Mapping):
        return
    for key, value in entries.items():
        try:
            yield key, unwrap_optimizer(value)
        except ConfigurationError:
            continue


def _optimizers_in(entries: Any) -> Iterator[torch.optim.Optimizer]:
    return (opt for _, opt in _optimizers_by_key(entries))
