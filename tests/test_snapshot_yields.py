"""``await ckpt.snapshot()`` is a good asyncio citizen: it yields to the event loop, and under
backpressure it waits cooperatively instead of blocking the caller's loop."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch

import lazyckpt
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.gating import hold_captures

SMALL = {"shard_size": 1 << 16, "pack_bytes": 4096}


class Ticker:
    def __init__(self) -> None:
        self.ticks = 0
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0)

    def stop(self) -> None:
        self.task.cancel()


async def test_a_ticker_runs_during_awaited_snapshots(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(8 << 20), FileTier(tmp_path / "f", keep_last=2)], **SMALL
    ) as ckpt:
        ticker = Ticker()
        for step in range(50):
            before = ticker.ticks
            await ckpt.snapshot(state, step=step)
            assert ticker.ticks > before  # every snapshot() let the ticker run
        ticker.stop()


async def test_backpressure_waits_cooperatively_and_cancelling_takes_no_snapshot(
    tmp_path: Path,
) -> None:
    w = torch.randn(512, 256)
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(8 << 20), FileTier(tmp_path / "f")], lazy=("w",), **SMALL
    ) as ckpt:
        gate, release = hold_captures(ckpt)
        await ckpt.snapshot({"w": w}, step=1)  # its capture is held back
        ticker = Ticker()
        second = asyncio.ensure_future(ckpt.snapshot({"w": w}, step=2))
        await asyncio.sleep(0.3)
        assert not second.done()  # waiting for the earlier capture, on this loop
        assert ticker.ticks > 100  # ... without blocking it
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        third = asyncio.ensure_future(ckpt.snapshot({"w": w}, step=2))  # step 2 is free
        gate.set()
        release()
        handle = await asyncio.wait_for(third, 10)
        await handle.committed()
        ticker.stop()
        assert await ckpt.steps() == [1, 2]


async def test_a_full_arena_is_waited_for_on_the_callers_loop(tmp_path: Path) -> None:
    slow = FaultyTier(FileTier(tmp_path / "f"))
    slow.delay_s = 0.05
    state = {"w": torch.randn(256, 256)}  # 256 KiB; the arena holds two snapshots
    async with lazyckpt.Checkpointer([HostMemoryTier(512 << 10), slow], **SMALL) as ckpt:
        ticker = Ticker()
        handles, inside = [], 0
        for step in range(6):
            before = ticker.ticks
            handles.append(await ckpt.snapshot(state, step=step))
            inside += ticker.ticks - before
        waited = ckpt.metrics()["arena"]["waits"]
        for h in handles:
            await h.committed()
        ticker.stop()
        assert ckpt.metrics()["arena"]["peak"] <= 512 << 10
        # the snapshots waited for room inside snapshot(), with the loop running, not in
        # the engine (where a guard would then block the loop in the optimizer step)
        assert inside > 50
        assert waited == 0
