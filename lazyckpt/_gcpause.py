"""Holding the cyclic garbage collector off during the library's per-tensor bursts.

``snapshot()`` on a state of many tensors, and the parsing and rebuilding of a large
manifest, allocate a few container objects per tensor. Each allocation counts toward the
collector's thresholds, so a burst of 100,000 tensors triggers hundreds of collections,
and among them full ones, each of which traverses every object of the process (the
model's and the optimizer's included). The burst is then quadratic in effect: on a state of
100,000 tiny tensors the collection costs more than the snapshot itself (the figures:
``docs/design.md``, "Figures behind choices in the code").

Nothing these bursts allocate forms a reference cycle (reference counting frees what
dies), so the collector has nothing to find there. :func:`collector_paused` turns it off
for the burst and back on afterwards; the counts it accumulated meanwhile make it run once
at the next allocation, as often as its thresholds ask, never more.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block, if it was enabled; re-enable it after.

    A collector disabled by the caller stays disabled. Not reentrant across threads by
    design: the collector is process-wide, so a second thread's burst inside the first one
    simply finds it disabled and leaves it so.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
