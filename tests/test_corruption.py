"""Damaged data and manifests, in any tier: always detected, never returned as good data."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lazyckpt
from lazyckpt import CorruptionError, LazyCkptError
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from custom_tier import _BUCKETS, DictStoreTier

SMALL: dict[str, Any] = {"shard_size": 1 << 14, "pack_bytes": 1024}
STEP = 4


def the_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(96, 80, generator=g),
        "b": torch.randn(80, generator=g).bfloat16(),
        "small": [torch.randn(9, generator=g) for _ in range(5)],
        "step": STEP,
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


async def write_copies(root: Path, bucket: str) -> None:
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(1 << 20), FileTier(root / "file"), DictStoreTier(bucket)], **SMALL
    ) as ckpt:
        await (await ckpt.snapshot(the_state(), step=STEP)).committed()


def damage_file(root: Path, kind: str, where: float, bits: int) -> None:
    step_dir = root / "file" / f"step-{STEP:012d}"
    target = step_dir / ("manifest.json" if kind.startswith("manifest") else "rank-00000.data")
    raw = bytearray(target.read_bytes())
    pos = min(len(raw) - 1, int(where * len(raw)))
    if kind.endswith("flip"):
        raw[pos] ^= bits
        target.write_bytes(raw)
    elif kind.endswith("truncate"):
        target.write_bytes(raw[:pos])
    else:
        target.unlink()


def damage_objects(bucket: str, where: float, bits: int) -> None:
    objects = _BUCKETS[bucket]
    keys = sorted(objects)
    key = keys[min(len(keys) - 1, int(where * len(keys)))]
    data = bytearray(objects[key])
    data[int(where * (len(data) - 1))] ^= bits
    objects[key] = bytes(data)


async def restore_from(root: Path, bucket: str | None) -> Any:
    chain: list[lazyckpt.Tier] = [FileTier(root / "file")]
    if bucket is not None:
        chain.append(DictStoreTier(bucket))
    async with lazyckpt.Checkpointer(chain) as ckpt:
        report = await ckpt.verify(STEP)
        try:
            return report, await ckpt.restore(step=STEP)
        except LazyCkptError as exc:
            return report, exc


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(
        ["data-flip", "data-truncate", "data-missing", "manifest-flip", "manifest-truncate"]
    ),
    where=st.floats(0, 1),
    bits=st.integers(1, 255),
    also_object=st.booleans(),
    object_where=st.floats(0, 1),
)
def test_damage_is_never_returned_as_data(
    kind: str, where: float, bits: int, also_object: bool, object_where: float
) -> None:
    root = Path(tempfile.mkdtemp())
    bucket = f"c-{uuid.uuid4().hex}"
    try:
        asyncio.run(write_copies(root, bucket))
        damage_file(root, kind, where, bits)
        if also_object:
            damage_objects(bucket, object_where, bits)
        # with the second tier: restore falls back shard by shard, or raises CorruptionError
        report, result = asyncio.run(restore_from(root, bucket))
        if isinstance(result, LazyCkptError):
            assert isinstance(result, CorruptionError | lazyckpt.SnapshotNotFoundError)
            assert also_object  # one good copy of every shard existed otherwise
        else:
            assert same(result, the_state())
        # the file tier alone: exact data, or a lazyckpt error; and verify agrees
        report, result = asyncio.run(restore_from(root, None))
        if isinstance(result, LazyCkptError):
            assert not report.ok or isinstance(result, lazyckpt.SnapshotNotFoundError)
        else:
            assert same(result, the_state())
    finally:
        shutil.rmtree(root, ignore_errors=True)
        _BUCKETS.pop(bucket, None)


async def test_verify_names_the_damage(tmp_path: Path) -> None:
    bucket = f"v-{uuid.uuid4().hex}"
    await write_copies(tmp_path, bucket)
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file"), DictStoreTier(bucket)]) as ckpt:
        assert (await ckpt.verify()).ok
        damage_file(tmp_path, "data-flip", 0.01, 0x10)
        report = await ckpt.verify()
        assert report.ok  # the object copy is whole
        assert report.damaged_tiers == ["file"]
        assert "'w'" in report.problems["file"][0]
        restored = await ckpt.restore()  # falls back for the damaged shard only
        assert same(restored, the_state())
    _BUCKETS.pop(bucket, None)


async def test_missing_everywhere_raises_corruption_naming_tensor(tmp_path: Path) -> None:
    bucket = f"m-{uuid.uuid4().hex}"
    await write_copies(tmp_path, bucket)
    damage_file(tmp_path, "data-flip", 0.01, 0x10)
    shard0 = next(k for k in _BUCKETS[bucket] if k.endswith("shard-0"))
    del _BUCKETS[bucket][shard0]
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file"), DictStoreTier(bucket)]) as ckpt:
        with pytest.raises(CorruptionError, match=r"shard 0 .*'w'.*tried \['file', 'dictstore'\]"):
            await ckpt.restore()
    _BUCKETS.pop(bucket, None)
