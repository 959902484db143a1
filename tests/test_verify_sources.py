"""Writes that bypass the version counter (through ``.data`` or a numpy view) are invisible
to the version check: a torn snapshot commits and verifies. ``verify_sources=True`` catches
one that lands while the snapshot is being captured."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import ImmutabilityViolationError, SnapshotFailedError
from lazyckpt._capture.cpu import VerifyingCapture
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.bn_net import Trainer

SMALL = {"shard_size": 1 << 16, "pack_bytes": 4096}


class WriteAfterFirstShard:
    """A capture backend that, once the first shard is copied, writes into the source
    through a numpy view (no version bump), as a careless data pipeline would."""

    def __init__(self, real: Any, target: torch.Tensor) -> None:
        self.real = real
        self.target = target
        self.written: asyncio.Event | None = None

    async def capture(self, job: Any) -> None:
        if self.written is None:
            self.written = asyncio.Event()
        if job.shard.index > 0:  # the other shards are copied after the write
            await self.written.wait()
            await self.real.capture(job)
            return
        await self.real.capture(job)
        self.target.numpy()[:] += 1.0
        self.written.set()

    def close(self) -> None:
        self.real.close()


def install(ckpt: lazyckpt.Checkpointer, target: torch.Tensor) -> None:
    engine = ckpt._core.engine
    if isinstance(engine.capture, VerifyingCapture):
        engine.capture.inner = WriteAfterFirstShard(engine.capture.inner, target)
    else:
        engine.capture = WriteAfterFirstShard(engine.capture, target)


@pytest.mark.parametrize("verify", [False, True])
async def test_a_write_through_a_numpy_view_mid_capture(tmp_path: Path, verify: bool) -> None:
    w = torch.zeros(512, 256)  # 512 KiB: eight shards, captured lazily
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(16 << 20), FileTier(tmp_path / "f")],
        verify_sources=verify,
        lazy=("w",),
        capture_threads=1,
        **SMALL,
    ) as ckpt:
        install(ckpt, w)
        handle = await ckpt.snapshot({"w": w}, step=1)
        if verify:
            with pytest.raises(SnapshotFailedError) as info:
                await handle.committed()
            assert info.group_contains(ImmutabilityViolationError, match=r"'w'.*\.data")
            assert await ckpt.steps() == []
            return
        # without the check the torn snapshot commits, and even verifies
        await handle.committed()
        report = await ckpt.verify(1)
        assert report.ok
        restored = (await ckpt.restore(step=1))["w"]
    assert bool((restored == 0).any()) and bool((restored == 1).any())


async def test_a_guarded_training_loop_passes_the_check(tmp_path: Path) -> None:
    run = Trainer(6)
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(16 << 20), FileTier(tmp_path / "f")], verify_sources=True, **SMALL
    ) as ckpt:
        ckpt.guard(run.opt)
        for step in range(6):
            run.step(step)
            handle = await ckpt.snapshot(run.state(step), step=step)
        await handle.committed()
        assert await ckpt.steps() == list(range(6))
        assert ckpt.metrics()["snapshots_failed"] == 0


def test_verify_sources_is_validated(tmp_path: Path) -> None:
    with pytest.raises(lazyckpt.ConfigurationError, match="verify_sources"):
        lazyckpt.Checkpointer([FileTier(tmp_path)], verify_sources="yes")
