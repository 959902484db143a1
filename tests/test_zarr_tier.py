"""ZarrTier: round trips on a path and on S3, plain-zarr readability, few objects, commits
that a failure never half-makes, fallback from a damaged faster tier."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
import zarr.api.asynchronous as za
from conftest_s3 import (
    S3Location,
    indexed_group,
    s3,
    s3_server,
    step_group,
    stored_groups,
)
from zarr.abc.store import Store
from zarr.codecs import Crc32cCodec
from zarr.core.buffer import Buffer
from zarr.storage import MemoryStore, WrapperStore

import lazyckpt
from lazyckpt import (
    Checkpointer,
    ConfigurationError,
    CorruptionError,
    SnapshotFailedError,
    SyncCheckpointer,
    TierError,
)
from lazyckpt.testing import build_snapshot
from tiers import FileTier, HostMemoryTier, ZarrTier
from tiers.zarr.dtype import storage_dtype
from tiers.zarr.layout import node_name, plan_snapshot

__all__ = ["s3", "s3_server"]  # the fixtures, imported for pytest

SMALL = {"shard_size": 64 << 10, "pack_bytes": 4 << 10}
# torch warns whenever it allocates a complex32 tensor, which restoring one does
COMPLEX32_WARNS = pytest.mark.filterwarnings(
    "ignore:ComplexHalf support is experimental:UserWarning"
)

_DTYPE_NAMES = (
    "float64 float32 float16 bfloat16 complex128 complex64 complex32 bool uint8 int8 int16 "
    "int32 int64 uint16 uint32 uint64 float8_e4m3fn float8_e5m2 float8_e4m3fnuz "
    "float8_e5m2fnuz float8_e8m0fnu"
)
DTYPES = [d for d in _DTYPE_NAMES.split(" ") if isinstance(getattr(torch, d, None), torch.dtype)]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A tensor of arbitrary bit patterns (NaNs, infinities, subnormals and all)."""
    n = int(np.prod(shape)) if shape else 1
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    with warnings.catch_warnings():  # complex32 says it is experimental; bytes are bytes
        warnings.simplefilter("ignore", UserWarning)
        return raw.view(dtype).reshape(shape)


def every_dtype_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    state: dict[str, Any] = {"model": {}, "meta": {"epoch": 3, "name": "run"}}
    for name in DTYPES:
        dt = getattr(torch, name)
        state["model"][name] = {
            "big": random_bits((97, 300), dt, g),  # several row chunks, a short last one
            "small": random_bits((3, 5), dt, g),  # packed
            "scalar": random_bits((), dt, g),  # 0-dim
            "empty": random_bits((0, 4), dt, g),
        }
    state["model"]["wide"] = random_bits((2, 40_000), torch.float32, g)  # a row > a shard
    state["model"]["transposed"] = random_bits((120, 90), torch.float32, g).t()
    state["model"]["sliced"] = random_bits((200, 64), torch.float16, g)[::3]
    state["model"]["tied"] = state["model"]["float32"]["big"]
    return state


def assert_bit_exact(restored: Any, original: Any, key: str = "") -> None:
    if isinstance(original, torch.Tensor):
        assert isinstance(restored, torch.Tensor), key
        assert restored.dtype == original.dtype and restored.shape == original.shape, key
        a = restored.detach().reshape(-1).contiguous().view(torch.uint8)
        b = original.detach().reshape(-1).contiguous().view(torch.uint8)
        assert torch.equal(a, b), f"{key} differs"
    elif isinstance(original, dict):
        assert set(restored) == set(original), key
        for k in original:
            assert_bit_exact(restored[k], original[k], f"{key}/{k}")
    else:
        assert restored == original, key


@pytest.fixture(params=["path", "s3"])
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., ZarrTier]:
    """A ZarrTier factory over one location: a directory, or a prefix on the S3 server."""
    if request.param == "path":
        return lambda **kw: ZarrTier(tmp_path / "zarr", **kw)
    loc: S3Location = request.getfixturevalue("s3")
    return lambda **kw: ZarrTier(loc.url, **loc.server.tier_options(), **kw)


# -- round trips ------------------------------------------------------------------------------


@COMPLEX32_WARNS
async def test_every_dtype_round_trips_from_zarr_alone(make_tier: Callable[..., ZarrTier]) -> None:
    state = every_dtype_state()
    async with Checkpointer([HostMemoryTier(8 << 20), make_tier()], **SMALL) as ckpt:
        handle = await ckpt.snapshot(state, step=10)
        await handle.committed()
    # a fresh Checkpointer with nothing but the ZarrTier: every byte comes from it
    async with Checkpointer([make_tier()], staging_bytes=1 << 20, **SMALL) as ckpt:
        assert await ckpt.steps() == [10]
        restored = await ckpt.restore()
    assert_bit_exact(restored, state)
    assert restored["model"]["tied"] is restored["model"]["float32"]["big"]


async def test_restore_in_place_keeps_tensors(make_tier: Callable[..., ZarrTier]) -> None:
    state = {"w": torch.randn(300, 70), "b": torch.randn(7)}
    async with Checkpointer([make_tier()], staging_bytes=1 << 20, **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
        live = {"w": torch.zeros(300, 70), "b": torch.zeros(7)}
        w = live["w"]
        await ckpt.restore(into=live)
    assert live["w"] is w
    assert torch.equal(live["w"], state["w"]) and torch.equal(live["b"], state["b"])


async def test_many_snapshots_and_retention(make_tier: Callable[..., ZarrTier]) -> None:
    async with Checkpointer([make_tier(keep_last=2)], staging_bytes=1 << 20, **SMALL) as ckpt:
        for step in range(1, 5):
            state = {"w": torch.full((50, 50), float(step)), "s": torch.tensor(step)}
            await (await ckpt.snapshot(state, step=step)).committed()
    tier = make_tier()
    await tier.open()
    try:
        assert await tier.steps() == [3, 4]
        kept = [await indexed_group(tier._store, s) for s in (3, 4)]
        assert await stored_groups(tier._store) == kept
    finally:
        await tier.aclose()


# -- plain zarr ---------------------------------------------------------------------------------


def test_plain_zarr_reads_tensors_back(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {
        "model": {
            "layer.weight": torch.randn(400, 128, generator=g).to(torch.bfloat16),
            "layer.bias": torch.randn(128, generator=g),
            "norm": torch.randn(16, generator=g).half(),
        }
    }
    with SyncCheckpointer([ZarrTier(tmp_path)], staging_bytes=1 << 20, **SMALL) as ckpt:
        ckpt.snapshot(state, step=100).wait()

    # What docs/zarr.md shows: plain zarr, no lazyckpt, sync API outside any event loop.
    root = zarr.open_group(tmp_path, mode="r")
    snap = root[f"step-{root.attrs['lazyckpt']['committed'][-1]:012d}"]
    arr = snap["tensors/model/layer.weight"]
    weight = torch.from_numpy(arr[:]).view(getattr(torch, arr.attrs["lazyckpt"]["dtype"]))
    assert torch.equal(weight, state["model"]["layer.weight"])

    blob = snap["packed"]
    entry = blob.attrs["lazyckpt"]["index"]["model/layer.bias"]
    raw = blob[entry["offset"] : entry["offset"] + entry["nbytes"]]
    bias = raw.view(entry["data_type"]).reshape(entry["shape"])
    assert np.array_equal(bias, state["model"]["layer.bias"].numpy())

    assert snap.attrs["lazyckpt"]["arrays"]["model/layer.weight"] == "tensors/model/layer.weight"
    assert arr.dtype == np.uint16 and arr.attrs["lazyckpt"]["dtype"] == "bfloat16"
    assert [c.to_dict()["name"] for c in arr.metadata.codecs][-1] == "crc32c"


def test_plain_zarr_detects_a_damaged_chunk(tmp_path: Path) -> None:
    state = {"w": torch.randn(300, 100)}
    with SyncCheckpointer([ZarrTier(tmp_path)], staging_bytes=1 << 20, **SMALL) as ckpt:
        ckpt.snapshot(state, step=1).wait()
    chunk = tmp_path / "step-000000000001" / "tensors" / "w" / "c" / "1" / "0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x40
    chunk.write_bytes(bytes(data))
    arr = zarr.open_array(tmp_path, path="step-000000000001/tensors/w", mode="r")
    with pytest.raises(ValueError, match="checksum"):
        arr[:]
    with (
        SyncCheckpointer([ZarrTier(tmp_path)], staging_bytes=1 << 20, **SMALL) as ckpt,
        pytest.raises(CorruptionError),
    ):
        ckpt.restore()


@pytest.mark.parametrize("name", DTYPES)
async def test_metadata_matches_what_zarr_writes(name: str) -> None:
    # Our zarr.json documents are written by hand (one PUT each, no probing); they must be
    # what zarr itself would write for the same array.
    state = {"t": random_bits((40, 7), getattr(torch, name), torch.Generator().manual_seed(0))}
    manifest, _ = build_snapshot(1, state, shard_size=4096, pack_bytes=0)
    store = MemoryStore()
    tier = ZarrTier(store)
    await tier.open()
    try:
        await tier.begin(manifest)
    finally:
        await tier.aclose()
    ours = json.loads(
        (await store.get("step-000000000001/tensors/t/zarr.json", _proto())).to_bytes()
    )
    meta = manifest.tensors[0]
    reference = MemoryStore()
    await za.create_array(
        store=reference,
        name="t",
        shape=meta.shape,
        chunks=(meta.chunk, *meta.shape[1:]),
        dtype=storage_dtype(meta),
        compressors=[Crc32cCodec()],
        filters=None,
        fill_value=0,
    )
    theirs = json.loads((await reference.get("t/zarr.json", _proto())).to_bytes())
    ours.pop("attributes")
    theirs.pop("attributes")
    assert ours == theirs


def _proto() -> Any:
    from zarr.core.buffer import default_buffer_prototype

    return default_buffer_prototype()


# -- few objects --------------------------------------------------------------------------------


def _objects(tmp_path: Path, loc: S3Location | None, step: int) -> list[str]:
    """Every object of ``step``'s group, in the group its root index names."""
    if loc is not None:
        prefix, listed = f"{loc.prefix}/{loc.group(step)}/", loc.keys()
        return [k for k in listed if k.startswith(prefix)]
    root = tmp_path / "zarr"
    group = step_group(json.loads((root / "zarr.json").read_text()), step)
    return [
        str(Path(d, f).relative_to(root)) for d, _, files in os.walk(root / group) for f in files
    ]


async def test_thousand_small_tensors_are_a_handful_of_objects(
    make_tier: Callable[..., ZarrTier], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    g = torch.Generator().manual_seed(3)
    state = {f"layer{i}.norm": torch.randn(256, generator=g) for i in range(1000)}
    async with Checkpointer([make_tier()], staging_bytes=8 << 20) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
        restored = await ckpt.restore()
    assert_bit_exact(restored, state)
    loc = request.getfixturevalue("s3") if "s3" in request.fixturenames else None
    objects = _objects(tmp_path, loc, 1)
    # group zarr.json, packed/zarr.json and one shard object per 16 MiB of packed tensors
    assert 0 < len(objects) <= 4, objects


# -- commits that failures never half-make ------------------------------------------------------


class FailingStore(WrapperStore[Store]):
    """Fails every write whose key matches ``when`` (a backend that breaks mid-snapshot)."""

    def __init__(self, store: Store, when: Callable[[str], bool]) -> None:
        super().__init__(store)
        self.when = when
        self.failures = 0

    async def set(self, key: str, value: Buffer) -> None:
        if self.when(key):
            self.failures += 1
            raise OSError(5, "I/O error (injected)")
        await self._store.set(key, value)


@COMPLEX32_WARNS
async def test_killed_upload_leaves_no_committed_snapshot(
    make_tier: Callable[..., ZarrTier],
) -> None:
    manifest, payloads = build_snapshot(4, every_dtype_state())
    writer = make_tier()
    await writer.open()
    await writer.begin(manifest)
    for shard, data in list(zip(manifest.shards, payloads, strict=True))[::2]:
        await writer.put_shard(manifest, shard, memoryview(data))
    await writer.aclose()  # the writer dies here: no commit
    reader = make_tier()
    await reader.open()
    try:
        assert await reader.steps() == []
        assert await stored_groups(reader._store) == []  # open() removed what the crash left
    finally:
        await reader.aclose()


@pytest.mark.parametrize(
    "fails",
    [
        pytest.param(lambda k: k.endswith("/w/c/1/0"), id="a-chunk"),
        pytest.param(lambda k: k.endswith("packed/c/0"), id="a-pack-shard"),
        pytest.param(lambda k: k.endswith("000000000002/zarr.json"), id="the-group"),
        pytest.param(lambda k: k == "zarr.json", id="the-commit-index"),
    ],
)
async def test_failed_write_commits_nothing(tmp_path: Path, fails: Callable[[str], bool]) -> None:
    from tiers.zarr.store import DurableLocalStore

    root = tmp_path / "z"
    good = {"w": torch.randn(300, 100), "b": torch.randn(10)}
    async with Checkpointer([ZarrTier(root)], staging_bytes=1 << 20, **SMALL) as ckpt:
        await (await ckpt.snapshot(good, step=1)).committed()
    store = FailingStore(DurableLocalStore(root), fails)
    async with Checkpointer([ZarrTier(store)], staging_bytes=1 << 20, **SMALL) as ckpt:
        handle = await ckpt.snapshot({"w": torch.randn(300, 100), "b": torch.randn(10)}, step=2)
        with pytest.raises(SnapshotFailedError) as info:
            await handle.committed()
        assert any(isinstance(e, TierError) for e in info.value.exceptions)
        assert isinstance(info.value.exceptions[0].__cause__, OSError)
        assert store.failures >= 1
        assert await ckpt.steps() == [1]
        restored = await ckpt.restore()  # the last good snapshot is intact
    assert_bit_exact(restored, good)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000000001"]


# -- fallback -----------------------------------------------------------------------------------


@COMPLEX32_WARNS
async def test_restore_falls_back_to_zarr_when_the_file_copy_is_damaged(
    make_tier: Callable[..., ZarrTier], tmp_path: Path
) -> None:
    state = every_dtype_state()
    local = tmp_path / "nvme"
    async with Checkpointer([FileTier(local), make_tier()], staging_bytes=1 << 20, **SMALL) as c:
        await (await c.snapshot(state, step=7)).committed()
    data = local / "step-000000000007" / "rank-00000.data"
    with data.open("r+b") as f:
        for offset in (10, data.stat().st_size // 2, data.stat().st_size - 5000):
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    async with Checkpointer([FileTier(local), make_tier()], staging_bytes=1 << 20, **SMALL) as c:
        restored = await c.restore()
    assert_bit_exact(restored, state)


# -- keys and configuration ---------------------------------------------------------------------


# Keys the core refuses (traversal, NUL) and keys it accepts that still need care on disk.
REFUSED = ["..", ".", "", "/abs", "a\0b"]
HOSTILE = ["__init__", "%", "%2F", "a b", "ünï", "x" * 400, "~", "zarr.json", ".zarray", "..."]
HOSTILE += ["c", "a/b", "a%b", "-"]


def test_node_names_stay_inside_their_group() -> None:
    names = [node_name(k) for k in REFUSED + HOSTILE]
    assert len(set(names)) == len(names)  # one-to-one
    for name in names:
        assert not name.startswith((".", "__")) and name != "zarr.json" and name
        assert "/" not in name and "\0" not in name and len(name.encode()) <= 200
        assert set(name) <= set(
            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-%~"
        )


async def test_hostile_keys_round_trip_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "inside" / "zarr"
    state = {k: torch.randn(300, 60) for k in HOSTILE}
    state["nested"] = {k: torch.randn(3) for k in HOSTILE}
    async with Checkpointer([ZarrTier(root)], staging_bytes=1 << 20, **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
        restored = await ckpt.restore()
    assert_bit_exact(restored, state)
    assert _all_inside(root)
    group = await za.open_group(root / "step-000000000001", mode="r")
    for key, path in group.attrs["lazyckpt"]["arrays"].items():
        assert (await group.getitem(path)).attrs["lazyckpt"]["key"] == key


def _all_inside(root: Path) -> bool:
    top = {p.name for p in root.parent.iterdir()}
    real = root.resolve()
    inside = all(
        Path(d, f).resolve().is_relative_to(real) for d, _, files in os.walk(root) for f in files
    )
    return top == {"zarr"} and inside


@COMPLEX32_WARNS
def test_plan_puts_every_shard_somewhere() -> None:
    manifest, _ = build_snapshot(3, every_dtype_state())
    plan = plan_snapshot(manifest, 64 << 10)
    assert len(plan.targets) == len(manifest.shards)
    assert len({t.key for t in plan.targets}) == len(manifest.shards)


async def test_refuses_a_foreign_zarr_hierarchy(tmp_path: Path) -> None:
    await za.group(store=tmp_path / "theirs", attributes={"owner": "someone else"})
    tier = ZarrTier(tmp_path / "theirs")
    with pytest.raises(ConfigurationError, match="did not write"):
        await tier.open()
    await tier.aclose()


def test_constructor_checks_its_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError):
        ZarrTier("gs://bucket/run")
    with pytest.raises(ConfigurationError):
        ZarrTier(tmp_path, secret_access_key="x")
    with pytest.raises(ConfigurationError):
        ZarrTier(tmp_path, pack_chunk_bytes=1000)
    with pytest.raises(ConfigurationError):
        ZarrTier(tmp_path, concurrency=0)
    with pytest.raises(ConfigurationError, match="allow_http"):
        ZarrTier("s3://b/p", endpoint_url="http://127.0.0.1:9", allow_http=False)
    assert ZarrTier(f"file://{tmp_path}").describe()["location"] == str(tmp_path)


def test_registered_as_a_plugin(tmp_path: Path) -> None:
    tier = lazyckpt.load_tier("zarr", tmp_path)
    assert isinstance(tier, ZarrTier) and tier.name == "zarr"
    assert tier.level is lazyckpt.TierLevel.PFS


_CHILD = """
import asyncio, hashlib, json, sys
import lazyckpt
from tiers import ZarrTier

async def main():
    async with lazyckpt.Checkpointer([ZarrTier(sys.argv[1])], staging_bytes=1 << 20) as ckpt:
        state = await ckpt.restore()
    print(json.dumps({k: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
                      for k, t in state["model"].items()}))

import torch
asyncio.run(main())
"""


def test_a_fresh_process_restores_from_zarr_alone(tmp_path: Path) -> None:
    import hashlib
    import subprocess
    import sys

    g = torch.Generator().manual_seed(5)
    model = {
        "w": torch.randn(500, 300, generator=g).bfloat16(),
        "b": torch.randn(300, generator=g),
        "n": random_bits((40, 40), torch.float8_e5m2, g),
    }
    with SyncCheckpointer([HostMemoryTier(8 << 20), ZarrTier(tmp_path)], **SMALL) as ckpt:
        ckpt.snapshot({"model": model, "step": 9}, step=9).wait()
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    expected = {
        k: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
        for k, t in model.items()
    }
    assert json.loads(child.stdout.strip().splitlines()[-1]) == expected
