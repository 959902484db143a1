"""An integration's Checkpointer across runs (``lazyckpt.integrations._lifetime``): released
at a run's end, reopened on fresh copies of the tiers; no framework needed."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lazyckpt import SyncCheckpointer
from lazyckpt.integrations._lifetime import Lifetime, copy_tiers
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier


def test_copies_share_nothing_and_get_locks_of_their_own(tmp_path: Path) -> None:
    inner = FileTier(tmp_path, keep_last=3)
    chain = [HostMemoryTier(4 << 20), FaultyTier(inner)]
    chain[1].delay_s = 0.5
    host, faulty = copy_tiers(chain)
    assert isinstance(host, HostMemoryTier) and host.arena is not chain[0].arena
    assert host.arena.capacity == chain[0].arena.capacity
    assert isinstance(faulty, FaultyTier) and faulty.delay_s == 0.5
    copied = faulty.inner
    assert isinstance(copied, FileTier) and copied is not inner
    assert copied.root == inner.root and copied.retention == inner.retention
    assert copied._root_fd_lock is not inner._root_fd_lock
    assert isinstance(copied._root_fd_lock, type(threading.Lock()))
    assert faulty.calls is not chain[1].calls


def test_released_and_reopened_on_copies(tmp_path: Path) -> None:
    life = Lifetime([HostMemoryTier(4 << 20), FileTier(tmp_path)], {})
    assert life.current is None
    first = life.open()
    assert life.open() is first and life.current is first
    first.snapshot({"w": torch.ones(3)}, step=1).wait("committed")
    life.release()
    assert life.current is None
    assert [s["step"] for s in life.metrics()["snapshots"]] == [1]  # the closed one's
    with SyncCheckpointer([FileTier(tmp_path)]) as other:  # the location is free
        other.snapshot({"w": torch.zeros(3)}, step=2).wait("committed")
    second = life.open()
    assert second is not first and second.tiers[1] is not first.tiers[1]
    assert second.steps() == [1, 2]
    assert life.metrics()["snapshots"] == []  # the new one's
    life.close()
    life.close()  # idempotent


class Uncopyable(FileTier):
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError("holds a connection")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("holds a connection")


def test_a_chain_that_cannot_be_copied_stays_open_until_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    life = Lifetime([Uncopyable(tmp_path)], {"staging_bytes": 1 << 20})
    with caplog.at_level(logging.INFO, logger="lazyckpt.integrations"):
        ckpt = life.open()
    assert "cannot be copied" in caplog.text
    life.release()  # nothing to reopen it on: it stays open
    assert life.current is ckpt and ckpt.steps() == []
    life.close()
