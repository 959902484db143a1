"""Draining on demand and on a preemption notice.

``drain()`` waits until every snapshot in flight has gone as far down the chain as it can
(each shard moves tier by tier in chain order, so the fastest durable tier has it first)
and says what reached where, as a :class:`DrainReport`.

A :class:`PreemptionHandler` turns a scheduler's notice (SIGTERM from Slurm or Kubernetes,
SIGUSR1 and the like) into a drain: it stops new snapshots, drains for at most the grace
period, logs which step is durable on which tier, and then lets the signal take its usual
course: the handler that was installed before it runs, or the default action (for SIGTERM:
the process ends) is taken by sending the signal again with the default disposition.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from .._errors import ConfigurationError

__all__ = ["DrainReport", "PreemptionHandler"]

log = logging.getLogger("lazyckpt")

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


@dataclass(frozen=True)
class DrainReport:
    """What a drain achieved, for the snapshots in flight while it ran.

    Attributes:
        reached: step -> the tiers (chain order) it is committed on.
        failed: step -> the tiers it failed on (the handle and the log say why).
        pending: step -> the tiers it had not reached when the timeout ran out.
        durable: durable tier name -> the newest step this Checkpointer committed there
            (``None``: none yet), counting earlier snapshots too.
        skipped: step -> the tiers whose cadence did not take it (not a failure).
        emergency: step -> the tiers an emergency copy of it was committed on (the
            newest snapshot, written to the tiers whose cadence skipped it; see
            ``emergency_tiers``).
        timed_out: the timeout ran out before every snapshot was done.
        seconds: how long the drain took.
    """

    reached: dict[int, tuple[str, ...]] = field(default_factory=dict)
    failed: dict[int, tuple[str, ...]] = field(default_factory=dict)
    pending: dict[int, tuple[str, ...]] = field(default_factory=dict)
    durable: dict[str, int | None] = field(default_factory=dict)
    skipped: dict[int, tuple[str, ...]] = field(default_factory=dict)
    emergency: dict[int, tuple[str, ...]] = field(default_factory=dict)
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """Every snapshot reached every tier: nothing failed, nothing is left pending."""
        return not self.failed and not self.pending

    def summary(self) -> str:
        """One line: the newest durable step per tier, and what did not make it."""
        parts = [
            f"{tier}: step {step}" if step is not None else f"{tier}: none"
            for tier, step in self.durable.items()
        ]
        text = "newest durable step per tier: " + (", ".join(parts) or "no durable tier")
        if self.emergency:
            text += f"; emergency copy of {_steps(self.emergency)}"
        if self.pending:
            text += f"; not reached in time: {_steps(self.pending)}"
        if self.failed:
            text += f"; failed: {_steps(self.failed)}"
        return text + f" ({self.seconds:.2f} s)"


def _steps(found: dict[int, tuple[str, ...]]) -> str:
    return ", ".join(f"step {s} on {list(t)}" for s, t in sorted(found.items()))


class PreemptionHandler:
    """Installs itself for ``signals`` in the main thread and, on one of them, calls
    ``on_signal(signum)`` (which stops snapshots and drains) and then chains on.

    Args:
        signals: the signals to handle.
        on_signal: called in the main thread with the signal's number; its errors are
            logged, never raised (the signal must still take its course).
    """

    def __init__(self, signals: tuple[signal.Signals, ...], on_signal: Callable[[int], None]) -> None:
        self.signals = signals
        self._on_signal = on_signal
        self._previous: dict[signal.Signals, _Handler] = {}

    def install(self) -> None:
        """Install for every signal, remembering the handler it replaces."""
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ConfigurationError(
                "preemption_signals needs the Checkpointer to be opened in the main thread "
                "(Python runs signal handlers only there); open it there, or leave "
                "preemption_signals empty and call drain() yourself"
            )
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Give every signal its previous handler back, unless someone replaced ours since
        (theirs may chain to ours; ours then only passes the signal on)."""
        previous, self._previous = self._previous, {}
        if not previous:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "lazyckpt: closed outside the main thread, so its preemption handler for %s "
                "stays installed (it now only passes the signal on)",
                [s.name for s in previous],
            )
            self._previous = previous
            self._on_signal = _nothing
            return
        for sig, old in previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, old if old is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        try:
            self._on_signal(signum)
        except Exception:  # the signal must still take its course
            log.exception("lazyckpt: draining on signal %d failed", signum)
        self._chain(signum, frame)

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        old = self._previous.get(signal.Signals(signum), signal.SIG_DFL)
        if callable(old):
            old(signum, frame)
            return
        if old == signal.SIG_IGN:
            return
        # the default action (for SIGTERM: terminate): restore it and deliver the signal
        # again; POSIX delivers a signal a thread sends itself before kill() returns
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        signal.signal(signum, self._handle)  # a default action that did not end the process


def _nothing(_signum: int) -> None:
    pass
