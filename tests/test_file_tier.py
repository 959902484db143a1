"""FileTier specifics beyond the conformance suite: O_DIRECT selection and its fallback."""

from __future__ import annotations

import errno
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
