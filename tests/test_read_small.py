"""Small-file reads (manifests, commit records, markers) leave no file open when cancelled."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import aiofiles.threadpool
import pytest

from tiers._fs import read_small


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_read_small_reads_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(b"x" * 100_000)
    assert await read_small(path) == b"x" * 100_000
    with pytest.raises(FileNotFoundError):
        await read_small(tmp_path / "absent")


async def test_a_read_cancelled_while_opening_closes_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The open runs on an executor thread and completes even when the read is cancelled;
    the file it returns is closed, not left for the collector to report."""
    path = tmp_path / "manifest.json"
    path.write_bytes(b"{}")
    entered, release = threading.Event(), threading.Event()
    real_open = aiofiles.threadpool.sync_open

    def slow_open(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(10)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(aiofiles.threadpool, "sync_open", slow_open)
    before = _open_fds()
    task = asyncio.ensure_future(read_small(path))
    await asyncio.to_thread(entered.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    for _ in range(200):  # the open finishes, then its file is closed on the loop
        await asyncio.sleep(0.01)
        if _open_fds() <= before:
            break
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        gc.collect()
    assert _open_fds() <= before, "the file opened for a cancelled read is still open"
