"""The optimizer step pre-hook of the stream guard.

The guard, two ways
-------------------
``cpu``: the optimizer step pre-hook blocks until every pending capture is done (the engine's
``wait_captured_blocking``). Simple; the CPU stalls only while a copy still runs.

``stream`` (:func:`stream_guard_hook`, :meth:`CudaCapture.fence`): the hook makes the
current stream of the training thread ``wait_event`` on the newest copy event of each device;
the CPU goes straight on to ``optimizer.step()`` and the GPU waits only if a copy is still
running. The optimizer then bumps the version counters on the CPU *before* the copies finish
on the GPU, so a completion check would fail every snapshot. The check moves to the fence:

- a mutation issued before the enqueue check is caught by it;
- a mutation issued after the enqueue and before the fence may run on the GPU while the
  copy reads (nothing orders them): the fence checks the counters of every copy not yet seen
  complete, and a changed one fails that shard's capture;
- a mutation issued after the fence, on the stream that was current at the fence (or on a
  stream ordered after it), runs after the copy on the GPU: it cannot tear the snapshot, so a
  fenced copy skips its completion check.

The fence can only order copies that exist, so it first waits (on the CPU) until every shard
of every pending snapshot is staged. That is normally long done when the optimizer step
comes (enqueueing takes microseconds per shard); it waits only under arena backpressure,
which is the same wait the ``cpu`` guard would do. CPU-source segments are part of staging,
so their copies are finished before the optimizer can change them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ..._errors import ConfigurationError
from .capture import CudaCapture, PendingCapture

__all__ = ["GuardMode", "resolve_guard_mode", "stream_guard_hook"]

GuardMode = Literal["cpu", "stream"]


def resolve_guard_mode(mode: str, capture: object) -> GuardMode:
    """Validate a guard mode; ``"stream"`` falls back to ``"cpu"`` without the CUDA capture
    (CPU tensors have no stream to order: only blocking is correct there)."""
    if mode not in ("cpu", "stream"):
        raise ConfigurationError(f"guard mode must be 'cpu' or 'stream', got {mode!r}")
    if mode == "stream" and isinstance(capture, CudaCapture):
        return "stream"
    return "cpu"


def stream_guard_hook(
    capture: CudaCapture,
    pending: Callable[[], Sequence[PendingCapture]],
    *,
    raise_unreported: Callable[[], None] | None = None,
    closing: Callable[[], bool] | None = None,
) -> Callable[[Any, Any, Any], None]:
    """An optimizer step pre-hook for the ``stream`` guard: fence the pending captures
    (:meth:`CudaCapture.fence`) instead of waiting for them.

    Args:
        capture: the engine's capture backend.
        pending: the snapshots whose capture is not done (``engine.pending_captures``).
        raise_unreported: raises a failure nobody has seen yet (``engine.raise_unreported``).
        closing: true once the Checkpointer is closing; the hook then does nothing.
    """

    def hook(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if closing is not None and closing():
            return
        t0 = time.perf_counter()
        flights = list(pending())
        if flights:
            capture.fence(flights)
        spent = time.perf_counter() - t0
        for flight in flights:
            flight.stats.guard_s += spent
        if raise_unreported is not None:
            raise_unreported()

    return hook
