"""Two writers of one process on one location: the error says that this process holds it,
where the holding Checkpointer was opened, and how to let go of it or read beside it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from lazyckpt import Checkpointer, LocationInUseError, SyncCheckpointer
from lazyckpt._checkpointer.holders import explain_in_use
from tiers import FileTier, HostMemoryTier, ZarrTier


def writer(root: Path) -> SyncCheckpointer:
    return SyncCheckpointer([HostMemoryTier(4 << 20), FileTier(root)])


def test_the_error_names_where_the_holder_was_opened(tmp_path: Path) -> None:
    first = writer(tmp_path).open()
    line = sys._getframe().f_lineno - 1
    first.snapshot({"w": torch.arange(4.0)}, step=1).wait("committed")
    second = SyncCheckpointer([FileTier(tmp_path)])
    with pytest.raises(LocationInUseError) as caught:
        second.open()
    error = caught.value
    message = str(error)
    assert message.startswith(f"{tmp_path} is already opened by this process")
    assert f"opened at {__file__}:{line} in test_the_error_names_where_the_holder_was_opened" in (
        message
    )
    assert "close()" in message and "FileTier(path, readonly=True)" in message
    assert error.location == str(tmp_path)
    assert error.holder is not None and error.holder["pid"] == os.getpid()
    cause = error.__cause__
    assert isinstance(cause, LocationInUseError) and "lock" in str(cause)  # the tier's own

    # reading beside it needs no lock
    with SyncCheckpointer([FileTier(tmp_path, readonly=True)]) as reader:
        assert reader.steps() == [1]
        assert torch.equal(reader.restore(1)["w"], torch.arange(4.0))
    first.close()
    with second:  # the holder closed: the same Checkpointer opens now
        assert second.steps() == [1]


async def test_an_async_checkpointer_names_the_coroutine_that_opened_it(tmp_path: Path) -> None:
    async with Checkpointer([FileTier(tmp_path)], staging_bytes=1 << 20):
        line = sys._getframe().f_lineno - 1
        with pytest.raises(LocationInUseError) as caught:
            async with Checkpointer([FileTier(str(tmp_path) + "/")], staging_bytes=1 << 20):
                pass
    assert f"opened at {__file__}:{line} in test_an_async_checkpointer" in str(caught.value)


def test_a_zarr_location_held_by_this_process(tmp_path: Path) -> None:
    with (
        SyncCheckpointer([ZarrTier(tmp_path / "z")], staging_bytes=1 << 20),
        pytest.raises(LocationInUseError, match="already opened by this process: a Check"),
    ):
        SyncCheckpointer([ZarrTier(tmp_path / "z")], staging_bytes=1 << 20).open()


async def test_a_tier_opened_on_its_own_is_named_as_such(tmp_path: Path) -> None:
    tier = FileTier(tmp_path)
    await tier.open()
    try:
        with pytest.raises(LocationInUseError, match="by none of the Checkpointers it has open"):
            SyncCheckpointer([FileTier(tmp_path)]).open()
    finally:
        await tier.aclose()


def test_another_process_keeps_the_tiers_message() -> None:
    error = LocationInUseError(
        "it is being written by process 1", location="/x", holder={"pid": 1, "host": "h"}
    )
    assert explain_in_use(error, None) is error
    unknown = LocationInUseError("it is held", location="/x", holder=None)
    assert explain_in_use(unknown, None) is unknown
