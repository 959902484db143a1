"""DurableLocalStore: zarr's own store conformance suite, and proof that every write is
synced (file data, the rename, every new directory)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from zarr.core.buffer import cpu, default_buffer_prototype
from zarr.testing.store import StoreTests

from lazyckpt import Checkpointer
from tiers import ZarrTier
from tiers.zarr.store import DurableLocalStore


class TestDurableLocalStore(StoreTests[DurableLocalStore, cpu.Buffer]):
    store_cls = DurableLocalStore
    buffer_cls = cpu.Buffer

    async def set(self, store: DurableLocalStore, key: str, value: cpu.Buffer) -> None:
        path = store.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(value.to_bytes())

    async def get(self, store: DurableLocalStore, key: str) -> cpu.Buffer:
        return self.buffer_cls.from_bytes((store.root / key).read_bytes())

    @pytest.fixture
    def store_kwargs(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": tmp_path / "store"}

    def test_store_repr(self, store: DurableLocalStore) -> None:
        assert repr(store) == f"DurableLocalStore('{store.root}')"

    def test_store_supports_writes(self, store: DurableLocalStore) -> None:
        assert store.supports_writes

    def test_store_supports_listing(self, store: DurableLocalStore) -> None:
        assert store.supports_listing

    async def test_keys_cannot_leave_the_root(self, store: DurableLocalStore) -> None:
        for key in ("../x", "/etc/x", "a/../../x", "a\0b", "a//b", "."):
            with pytest.raises(ValueError, match="invalid store key"):
                await store.set(key, self.buffer_cls.from_bytes(b"x"))
        assert list(store.root.parent.iterdir()) == [store.root]

    async def test_interrupted_writes_are_not_keys(self, store: DurableLocalStore) -> None:
        await store.set("a/b", self.buffer_cls.from_bytes(b"1"))
        (store.root / "a" / ".b.0123456789abcdef.tmp").write_bytes(b"half")
        assert [k async for k in store.list()] == ["a/b"]
        assert [k async for k in store.list_dir("a")] == ["b"]

    async def test_read_into_fills_a_caller_buffer(self, store: DurableLocalStore) -> None:
        await store.write_parts("k", [memoryview(b"abc"), memoryview(b"defg")])
        out = bytearray(5)
        assert await store.read_into("k", memoryview(out)) == 7
        assert out == b"abcde"
        got = await store.get("k", default_buffer_prototype())
        assert got is not None and got.to_bytes() == b"abcdefg"


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths passed to fsync/fdatasync while the test runs (Linux: resolved via /proc)."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name synced file descriptors")
    seen: list[str] = []

    def spy(real: Any) -> Any:
        def call(fd: int) -> None:
            seen.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        return call

    monkeypatch.setattr(os, "fsync", spy(os.fsync))
    monkeypatch.setattr(os, "fdatasync", spy(os.fdatasync))
    return seen


async def test_every_object_and_directory_is_synced(tmp_path: Path, synced: list[str]) -> None:
    root = tmp_path / "zarr"
    state = {"model": {"w": torch.randn(300, 100), "b": torch.randn(10)}, "step": 1}
    # retries=0: a commit that failed once must not pass unnoticed on a retry
    options: dict[str, Any] = {"staging_bytes": 1 << 20, "shard_size": 64 << 10, "retries": 0}
    async with Checkpointer([ZarrTier(root)], **options) as c:
        await (await c.snapshot(state, step=1)).committed()
    temp = re.compile(r"^\.(.+)\.[0-9a-f]{16}\.tmp$")
    data_synced = set()
    for path in synced:
        m = temp.match(os.path.basename(path))
        # metadata is synced under a temporary name before its rename; chunks, which nobody
        # reads before the commit, under their own
        data_synced.add(os.path.join(os.path.dirname(path), m.group(1)) if m else path)
    # the writer's lock file holds no data: it needs no sync (a crash releases it anyway)
    files = {
        str(Path(d, f)) for d, _, fs in os.walk(root) for f in fs if not f.endswith(".lock")
    }
    dirs = {d for d, _, _ in os.walk(root)}
    assert len(files) > 6
    assert files <= data_synced, sorted(files - data_synced)
    assert dirs <= set(synced), sorted(dirs - set(synced))
    # the commit index was the last object made durable
    last_file = next(p for p in reversed(synced) if temp.match(os.path.basename(p)))
    assert os.path.dirname(last_file) == str(root) and ".zarr.json." in last_file
