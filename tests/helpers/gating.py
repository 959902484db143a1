"""Holding a Checkpointer's captures or checksums back, so a test can act between the stages."""

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


class HeldChecksums:
    """Wraps the engine's checksum stage: every checksum waits for ``gate``; ``fail_at``
    (a count of checksums started) makes that one raise instead, ``fail_all`` every one."""

    def __init__(self, real: Any, *, fail_at: int | None = None, fail_all: bool = False) -> None:
        self.real = real
        self.gate = threading.Event()
        self.started = 0
        self.done = 0
        self.fail_at = fail_at
        self.fail_all = fail_all

    async def checksum(self, block: Any) -> int:
        self.started += 1
        mine = self.started
        await asyncio.to_thread(self.gate.wait, 30)
        if self.fail_all or mine == self.fail_at:
            raise OSError("checksum thread lost")
        crc = int(await self.real.checksum(block))
        self.done += 1
        return crc

    async def checksum_bytes(self, data: memoryview) -> int:
        """Checksums of shards read back (a restore, a re-fetch) are not held."""
        return int(await self.real.checksum_bytes(data))

    def close(self) -> None:
        self.real.close()


def hold_checksums(ckpt: lazyckpt.Checkpointer | lazyckpt.SyncCheckpointer, **kwargs: Any) -> HeldChecksums:
    """Put a :class:`HeldChecksums` in front of ``ckpt``'s checksum stage and return it."""
    engine = ckpt._core.engine
    held = HeldChecksums(engine.checksums, **kwargs)
    engine.checksums = held
    return held
