"""Holding a Checkpointer's captures back, so a test can act between snapshot() and the copy."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import lazyckpt


def hold_captures(ckpt: lazyckpt.Checkpointer) -> tuple[threading.Event, Callable[[], None]]:
    """Every capture of ``ckpt`` waits until the returned event is set; the returned function
    puts the real capture backend back."""
    engine = ckpt._core.engine
    real = engine.capture
    gate = threading.Event()

    class Held:
        async def capture(self, job: Any) -> int:
            await asyncio.to_thread(gate.wait)
            return await real.capture(job)

        def close(self) -> None:
            real.close()

    engine.capture = Held()

    def restore() -> None:
        engine.capture = real

    return gate, restore
