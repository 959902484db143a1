"""What a restore leaves behind once it is over: nothing. Restored tensors are freed when
the caller drops them (no reader cache, bounce buffer, packed buffer, future or exception
keeps their storage), and a restore cancelled mid-read leaves no descriptor open."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.datafiles import damage_data_file, drop_data_files
from torch.multiprocessing.reductions import StorageWeakRef

import lazyckpt
import tiers.file.read as file_read
from lazyckpt.tier import TierLevel
from tiers import FileTier

SMALL = {"shard_size": 1 << 20, "pack_bytes": 64 << 10, "retries": 0}


def _state() -> dict[str, Any]:
    # chunked (1 MiB and more: aligned new tensors), packed (small), and in between
    return {
        "w": torch.randn(700, 1000),
        "v": torch.randn(300_000),
        "small": [torch.randn(50) for _ in range(40)],
    }


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list):
        return [t for v in state for t in _tensors(v)]
    return []


@pytest.mark.parametrize("way", ["new", "buffered", "into", "fallback"])
async def test_restored_tensors_are_freed_once_dropped(tmp_path: Path, way: str) -> None:
    """Every storage a restore handed out is freed when the caller drops the state, while
    the reader is still open: its bounce buffers, packed-shard buffers, read futures and
    the errors of a bad copy tried first hold none of them."""
    state = _state()
    roots = [tmp_path / "a", tmp_path / "b"] if way == "fallback" else [tmp_path / "a"]
    for root in roots:
        async with lazyckpt.Checkpointer([FileTier(root)], **SMALL) as ckpt:
            await (await ckpt.snapshot(state, step=1)).committed()
    if way == "fallback":
        damage_data_file(roots[0], 1)
    sources = [FileTier(r, readonly=True, read_direct=way != "buffered") for r in roots]
    if way == "fallback":
        sources[1].name = "b"
        sources[1].level = TierLevel.PFS
    drop_data_files(tmp_path)
    into = None
    if way == "into":  # PyTorch's allocator: not block-aligned, read through the bounce buffer
        into = {"w": torch.zeros(700, 1000), "v": torch.zeros(300_000),
                "small": [torch.zeros(50) for _ in range(40)]}
    async with lazyckpt.Checkpointer(sources) as reader:
        restored = await reader.restore(1, into=into)
        got = _tensors(restored)
        assert all(torch.equal(a, b) for a, b in zip(got, _tensors(state), strict=True))
        storages = [_weak_storage(t) for t in got]
        del restored, got, into
        # the future that woke this coroutine holds the result until it next yields to
        # the loop (asyncio keeps the handle it runs), and a reading thread lets go of its
        # last job's arguments when that job's future is done: a bounded wait, then
        # nothing may hold them
        for _ in range(100):
            await asyncio.sleep(0.01)
            gc.collect()
            alive = [i for i, s in enumerate(storages) if not s.expired()]  # type: ignore[no-untyped-call]
            if not alive:
                break
        assert alive == [], f"restored storages {alive} outlive the state ({way})"


def _weak_storage(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference to ``t``'s storage itself (the tensor object may die while a view
    of its storage, which a weak reference to the tensor would not see, lives on)."""
    return StorageWeakRef(t.untyped_storage())  # type: ignore[no-untyped-call]


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _described(fds: set[str]) -> dict[str, str]:
    """What each descriptor of ``fds`` still open refers to, for the failure message."""
    return {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in fds
            if os.path.exists(f"/proc/self/fd/{fd}")}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
async def test_a_restore_cancelled_mid_read_leaves_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelling a restore while its pieces are being read: each read job still closes the
    descriptors it opened, and closing the reader waits for them, so none is left open."""
    state = _state()
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
    drop_data_files(tmp_path)
    reading, release = threading.Event(), threading.Event()
    real = file_read._read_open

    def held(*args: Any) -> int:  # a slow disk: the read waits until the restore is cancelled
        reading.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(file_read, "_read_open", held)
    before = _open_fds()
    async with lazyckpt.Checkpointer([FileTier(tmp_path, readonly=True)]) as reader:
        task = asyncio.ensure_future(reader.restore(1))
        assert await asyncio.to_thread(reading.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
    gc.collect()
    leaked = _open_fds() - before
    assert not leaked, _described(leaked)
