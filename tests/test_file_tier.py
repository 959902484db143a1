"""FileTier specifics beyond the conformance suite: O_DIRECT selection and its fallback."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import lazyckpt
import tiers._file as file_module
from lazyckpt import TierError
from tiers import FileTier, HostMemoryTier

SMALL = {"shard_size": 1 << 16, "pack_bytes": 4096, "retries": 0}


async def roundtrip(tier: FileTier) -> dict[str, torch.Tensor]:
    state = {"w": torch.randn(300, 77), "b": torch.randn(5)}
    async with lazyckpt.Checkpointer([HostMemoryTier(4 << 20), tier], **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
    async with lazyckpt.Checkpointer([FileTier(tier.root)]) as fresh:
        restored = await fresh.restore()
    for key in state:
        assert torch.equal(restored[key], state[key])
    return state


@pytest.mark.parametrize("direct", [None, True, False])
async def test_every_mode_round_trips(tmp_path: Path, direct: bool | None) -> None:
    await roundtrip(FileTier(tmp_path, direct=direct))
    data = tmp_path / "step-000000000001" / "rank-00000.data"
    manifest = lazyckpt.Manifest.from_json((data.parent / "manifest.json").read_bytes())
    assert data.stat().st_size == manifest.stream_bytes  # O_DIRECT padding truncated away


async def test_auto_falls_back_where_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(fd: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(file_module, "_probe_direct", refuse)
    await roundtrip(FileTier(tmp_path / "auto"))  # buffered, silently
    with pytest.raises(lazyckpt.SnapshotFailedError) as info:
        await roundtrip(FileTier(tmp_path / "forced", direct=True))
    assert info.group_contains(TierError)


async def test_delete_reports_real_failures_and_tolerates_a_vanished_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = FileTier(tmp_path / "f")
    async with lazyckpt.Checkpointer([HostMemoryTier(4 << 20), tier], **SMALL) as ckpt:
        for step in (1, 2):
            await (await ckpt.snapshot({"w": torch.randn(64, 64)}, step=step)).committed()
        real_unlink = os.unlink

        def failing_unlink(path: object, *args: object, **kwargs: object) -> None:
            if str(path).endswith(".data"):
                raise OSError(errno.EIO, "injected I/O error")
            real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "unlink", failing_unlink)
        with pytest.raises(TierError):
            await tier.delete(1)  # the data file could not go: reported, not hidden
        monkeypatch.setattr(os, "unlink", real_unlink)
        assert 1 not in await tier.steps()  # un-committed first, as always
        await tier.delete(1)  # the rest goes now
        await tier.delete(1)  # and a step already gone is no error
        assert not (tmp_path / "f" / "step-000000000001").exists()
        assert await tier.steps() == [2]


async def test_ranks_racing_to_remove_a_shared_step_get_a_warning_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = FileTier(tmp_path / "f")
    async with lazyckpt.Checkpointer([HostMemoryTier(4 << 20), tier], **SMALL) as ckpt:
        for step in (1, 2):
            await (await ckpt.snapshot({"w": torch.randn(8, 8)}, step=step)).committed()

        def racing(path: Path) -> None:
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(path))

        monkeypatch.setattr(file_module, "remove_tree", racing)
        with pytest.raises(TierError):
            await tier.delete(1)  # one process: a real failure, reported
        tier.world_size = 2  # several ranks sharing the directory: another may be removing it
        await tier.delete(2)
        assert "left files behind" in caplog.text
