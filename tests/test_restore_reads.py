"""How a restore reads a FileTier: checksums computed while reading (crc32c_combine, every
way a piece can land), reads past the page cache for cold bytes, new tensors allocated at
the tier's read alignment, and the fallback to the next tier on a bad copy."""

from __future__ import annotations

import itertools
import os
import random
import warnings
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from helpers.datafiles import damage_data_file, drop_data_files
from hypothesis import given, settings
from hypothesis import strategies as st

import lazyckpt
import tiers.file.read as file_read
from lazyckpt import CorruptionError
from lazyckpt._tiering.interface import reads_checksummed
from lazyckpt.testing import build_snapshot
from lazyckpt.tier import SupportsChecksummedRead, TierLevel, crc32c_combine
from tiers import FileTier

SMALL = {"shard_size": 1 << 20, "pack_bytes": 64 << 10, "retries": 0}
ALIGN = 4096


def _warm(path: Path) -> None:
    """Read ``path`` through the page cache, leaving it cached."""
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass


def _needs_o_direct(root: Path) -> None:
    """Skip where this file system refuses O_DIRECT (tmpfs): the direct way cannot be taken
    there, and the tier reads through the cache instead (tested on its own below)."""
    probe = root / "probe"
    probe.write_bytes(b"x" * ALIGN)
    try:
        os.close(os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    finally:
        probe.unlink()
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this OS")


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32c_combine_is_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_crc32c_combine_of_long_pieces() -> None:
    data = os.urandom((8 << 20) + 12345)
    cut = [0, 4096, 3 << 20, 8 << 20, len(data)]
    pieces = [data[lo:hi] for lo, hi in itertools.pairwise(cut)]
    total = crc32c.crc32c(pieces[0])
    for piece in pieces[1:]:
        total = crc32c_combine(total, crc32c.crc32c(piece), len(piece))
    assert total == crc32c.crc32c(data)


async def _stored(root: Path, *, piece_bytes: int = ALIGN, **kw: object) -> tuple[
    FileTier, lazyckpt.Manifest, list[bytes]
]:
    """A committed step of a few shards of odd lengths (tails that are no whole block)."""
    manifest, payloads = build_snapshot(7, {"a": torch.randn(7001), "b": torch.randn(30, 111)})
    tier = FileTier(root, piece_bytes=piece_bytes, **kw)  # type: ignore[arg-type]
    await tier.open()
    await tier.begin(manifest)
    for shard, data in zip(manifest.shards, payloads, strict=True):
        await tier.put_shard(manifest, shard, memoryview(data))
    await tier.commit(manifest)
    return tier, await tier.read_manifest(7), payloads


@pytest.mark.parametrize("way", ["direct", "bounced", "cached", "buffered"])
async def test_checksummed_read_every_way(tmp_path: Path, way: str) -> None:
    """Each way a piece lands (straight from the disk into aligned memory, through the bounce
    buffer into unaligned memory, from the page cache, with read_direct=False) gives the
    stored bytes and their crc32c, pieces joined, tails included."""
    if way in ("direct", "bounced"):
        _needs_o_direct(tmp_path)
    tier, manifest, payloads = await _stored(tmp_path, read_direct=way != "buffered")
    try:
        assert isinstance(tier, SupportsChecksummedRead)
        assert tier.read_alignment == (1 if way == "buffered" else ALIGN)
        assert any(s.length % ALIGN for s in manifest.shards)  # a tail of no whole block
        for shard, expected in zip(manifest.shards, payloads, strict=True):
            assert shard.length > 2 * tier.piece_bytes  # several pieces, joined
            if way == "cached":  # a buffered read (a direct one leaves nothing cached)
                _warm(tier._data_path(manifest))
            else:
                drop_data_files(tmp_path)
            # aligned memory, or aligned plus 64 bytes (as PyTorch's allocator gives)
            raw = torch.zeros(shard.length + 2 * ALIGN, dtype=torch.uint8)
            skip = -raw.data_ptr() % ALIGN + (64 if way == "bounced" else 0)
            view = memoryview(raw.numpy()).cast("B")[skip : skip + shard.length]  # type: ignore[arg-type]
            assert _opens_direct(tier, manifest, shard) == (way in ("direct", "bounced"))
            crc = await tier.read_shard_checksummed(manifest, shard, view)
            assert bytes(view) == expected
            assert crc == crc32c.crc32c(expected) == shard.crc32c
    finally:
        await tier.aclose()


def _opens_direct(tier: FileTier, manifest: lazyckpt.Manifest, shard: lazyckpt.ShardMeta) -> bool:
    """Whether a read of ``shard`` now would read past the page cache (opens O_DIRECT)."""
    path = tier._data_path(manifest)
    file = file_read.open_piece(path, shard.offset, shard.length, tier.read_direct)
    file.close()
    return file.direct_fd is not None


async def test_read_shard_fills_without_checksumming(tmp_path: Path) -> None:
    tier, manifest, payloads = await _stored(tmp_path)
    try:
        for shard, expected in zip(manifest.shards, payloads, strict=True):
            drop_data_files(tmp_path)
            buf = bytearray(shard.length)
            await tier.read_shard(manifest, shard, memoryview(buf))
            assert bytes(buf) == expected
    finally:
        await tier.aclose()


async def test_truncated_data_file_is_corruption_on_every_way(tmp_path: Path) -> None:
    tier, manifest, _ = await _stored(tmp_path)
    try:
        last = manifest.shards[-1]
        data = tier._data_path(manifest)
        os.truncate(data, last.offset + last.length - 100)
        for aligned in (True, False):
            drop_data_files(tmp_path)
            raw = torch.zeros(last.length + 2 * ALIGN, dtype=torch.uint8)
            skip = -raw.data_ptr() % ALIGN + (0 if aligned else 64)
            view = memoryview(raw.numpy()).cast("B")[skip : skip + last.length]  # type: ignore[arg-type]
            with pytest.raises(CorruptionError, match="truncated"):
                await tier.read_shard_checksummed(manifest, last, view)
    finally:
        await tier.aclose()


DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32,
]


def _state_of_every_dtype() -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():  # complex32 is "experimental" to PyTorch
        warnings.simplefilter("ignore", UserWarning)
        for dtype in DTYPES:
            name = str(dtype).removeprefix("torch.")
            for label, numel in (("big", (3 << 20) // dtype.itemsize + 7), ("small", 333)):
                raw = torch.randint(0, 256, (numel * dtype.itemsize,), generator=gen)
                t = raw.to(torch.uint8).view(dtype)
                if dtype is torch.bool:
                    t = raw.to(torch.uint8).bool()[:numel]
                state[f"{name}.{label}"] = t.reshape(-1, 1) if label == "big" else t
    return state


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads of random bytes included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


# torch warns whenever it allocates a complex32 tensor (the snapshot's small copies do)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("read_direct", [True, False])
async def test_new_tensors_of_every_dtype_are_aligned_and_exact(
    tmp_path: Path, read_direct: bool
) -> None:
    """restore() into new tensors: every dtype comes back bit for bit; a tensor of 1 MiB or
    more starts at the tier's read alignment, its storage at most that much longer."""
    state = _state_of_every_dtype()
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
    drop_data_files(tmp_path)
    async with lazyckpt.Checkpointer([FileTier(tmp_path, read_direct=read_direct)]) as reader:
        restored = await reader.restore(1)
    align = ALIGN if read_direct else 1
    for key, t in state.items():
        got = restored[key]
        assert _same(got, t), key
        assert got.is_contiguous() and got.device.type == "cpu"
        nbytes = got.numel() * got.element_size()
        if nbytes >= 1 << 20:
            assert got.data_ptr() % align == 0, key
            assert got.untyped_storage().nbytes() - nbytes <= align, key


async def test_restore_into_existing_tensors_cold(tmp_path: Path) -> None:
    """into= targets from PyTorch's allocator (not block-aligned) are filled through the
    bounce buffer; an offset view of a bigger tensor too."""
    state = {"w": torch.randn(700, 1000), "b": torch.randn(10), "h": torch.randn(3, 5000)}
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
    big = torch.zeros(700 * 1000 + 16)
    into = {"w": big[16:].view(700, 1000), "b": torch.zeros(10), "h": torch.zeros(3, 5000)}
    drop_data_files(tmp_path)
    async with lazyckpt.Checkpointer([FileTier(tmp_path, readonly=True)]) as reader:
        out = await reader.restore(1, into=into)
    assert out is into
    for key in state:
        assert torch.equal(into[key], state[key])
    assert torch.equal(big[:16], torch.zeros(16))  # nothing written outside the target


@pytest.mark.parametrize("into", [False, True])
async def test_a_bad_copy_falls_back_to_the_next_tier(tmp_path: Path, into: bool) -> None:
    state = {"w": torch.randn(1000, 700), "small": torch.randn(100)}
    roots = [tmp_path / "first", tmp_path / "second"]
    for root in roots:
        async with lazyckpt.Checkpointer([FileTier(root)], **SMALL) as ckpt:
            await (await ckpt.snapshot(state, step=1)).committed()
    damage_data_file(roots[0], 1)
    drop_data_files(tmp_path)
    target = {k: torch.zeros_like(v) for k, v in state.items()} if into else None
    first, second = FileTier(roots[0], name="first"), FileTier(roots[1], name="second")
    second.level = TierLevel.PFS  # a chain of two file tiers: a local disk, then shared storage
    async with lazyckpt.Checkpointer([first, second]) as reader:
        restored = await reader.restore(1, into=target)
    for key in state:
        assert torch.equal(restored[key], state[key])
    drop_data_files(tmp_path)
    async with lazyckpt.Checkpointer([FileTier(roots[0])]) as only_bad:
        with pytest.raises(CorruptionError, match="checksum mismatch"):
            await only_bad.restore(1)


async def test_incremental_steps_read_cold_from_the_step_they_refer_to(tmp_path: Path) -> None:
    frozen = torch.randn(600, 1000)
    state = {"frozen": frozen, "moving": torch.zeros(300, 1000)}
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], incremental=True, **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
        state["moving"].add_(1)
        await (await ckpt.snapshot(state, step=2)).committed()
    plain = FileTier(tmp_path, readonly=True)
    await plain.open()
    try:
        manifest = await plain.read_manifest(2)
    finally:
        await plain.aclose()
    assert any(s.stored_in == 1 for s in manifest.shards)
    async with lazyckpt.Checkpointer([FileTier(tmp_path, readonly=True)]) as reader:
        for into in (None, {"frozen": torch.zeros_like(frozen), "moving": torch.zeros(300, 1000)}):
            drop_data_files(tmp_path)
            got = await reader.restore(2, into=into)
            assert torch.equal(got["frozen"], frozen)
            assert torch.equal(got["moving"], torch.ones(300, 1000))


async def test_packed_shards_reuse_their_buffers(tmp_path: Path) -> None:
    """Many packed shards (small tensors) restore bit for bit through the buffers a restore
    reuses shard after shard."""
    rng = random.Random(5)
    state = {f"t{i}": torch.randn(rng.randint(1, 4000)) for i in range(600)}
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
    drop_data_files(tmp_path)
    async with lazyckpt.Checkpointer([FileTier(tmp_path, readonly=True)]) as reader:
        restored = await reader.restore(1)
    for key, t in state.items():
        assert torch.equal(restored[key], t)


class _ReadHook(FileTier):
    """A user's FileTier that overrides ``read_shard`` only (to count, throttle or log)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads = 0

    async def read_shard(self, manifest: Any, shard: Any, out: memoryview) -> None:
        self.reads += 1
        await super().read_shard(manifest, shard, out)


async def test_a_subclass_overriding_read_shard_alone_keeps_every_read(tmp_path: Path) -> None:
    """The checksummed read is taken only where the class defining it also defines the
    read_shard in effect: a subclass's own read_shard is never bypassed, and the copy is
    still checked (the checksum computed after the read)."""
    state = {"w": torch.randn(1000, 700), "small": torch.randn(100)}
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
    hooked = _ReadHook(tmp_path)
    assert not reads_checksummed(hooked) and reads_checksummed(FileTier(tmp_path))
    async with lazyckpt.Checkpointer([hooked]) as reader:
        restored = await reader.restore(1)
        manifest = await hooked.read_manifest(1)
    assert hooked.reads == len(manifest.shards) > 1
    for key in state:
        assert torch.equal(restored[key], state[key])
    damage_data_file(tmp_path, 1)
    again = _ReadHook(tmp_path)
    async with lazyckpt.Checkpointer([again]) as reader:
        with pytest.raises(CorruptionError, match="checksum mismatch"):
            await reader.restore(1)
    assert again.reads >= 1
