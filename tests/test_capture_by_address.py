"""The CPU capture copies segments of plain contiguous tensors by address, without a torch
call (each costs a launch-bound training thread takes of the interpreter lock): what it
copies must be exactly what torch's ``copy_`` copies, and whatever the address arithmetic
cannot vouch for must still go through torch."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch

from lazyckpt import HostArena, LayoutOptions, Manifest
from lazyckpt._capture import cpu as _capture
from lazyckpt._capture.cpu import CaptureJob, copy_into_blocks, source_view
from lazyckpt._format.manifest import plan_layout
from lazyckpt._format.walk import TensorRef, walk_state

SHARD = 256 << 10  # rows chunks above the locked-copy size, packs below it


def plan(state: dict[str, Any]) -> tuple[Manifest, list[TensorRef]]:
    tree, refs = walk_state(state, allow_pickle=False)
    manifest = plan_layout(1, tree, refs, LayoutOptions(shard_size=SHARD, pack_bytes=4096))
    return manifest, refs


def make_jobs(manifest: Manifest, refs: list[TensorRef], arena: HostArena) -> list[CaptureJob]:
    jobs = []
    for shard in manifest.shards:
        block = arena.try_allocate(shard.length)
        assert block is not None
        block.tensor().fill_(0xAB)  # stale bytes from an earlier use of the block
        jobs.append(CaptureJob(manifest, shard, refs, block))
    return jobs


def expected(job: CaptureJob) -> bytes:
    """The shard's bytes as torch's copy gives them: each piece's values, zeros between."""
    out = bytearray(job.shard.length)
    for seg in job.shard.segments:
        piece = source_view(job, seg).resolve_conj().resolve_neg().contiguous()
        raw = piece.reshape(-1).view(torch.uint8).numpy().tobytes()
        out[seg.offset : seg.offset + len(raw)] = raw
    return bytes(out)


def mixed_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(600, 256, generator=g)
    return {
        "rows": torch.randn(512, 300, generator=g),  # 600 KiB: rows chunks, memmove
        "flat": torch.randn(2, 100_000, generator=g),  # a row larger than a shard
        "param": torch.nn.Parameter(torch.randn(40, 40, generator=g)),  # packed
        "bias": torch.randn(10, generator=g),
        "codes": torch.arange(7, dtype=torch.int16),  # odd size: a gap after it
        "mask": torch.arange(9) % 2 == 0,
        "half": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "step": torch.tensor(3.0),  # zero-dimensional
        "empty": torch.zeros(0, 4),
        "window": big[100:400],  # a view, contiguous, not at its base's start: by address
        # what the address cannot vouch for, copied by torch
        "transposed": torch.randn(300, 200, generator=g).t(),
        "conj": torch.randn(20, dtype=torch.complex64, generator=g).conj(),
        "neg": torch._neg_view(torch.randn(30, generator=g)),
        "lr": 0.1,
    }


@pytest.fixture
def arena() -> HostArena:
    a = HostArena(16 << 20, pinned=False)
    a.allocate_memory()
    return a


def test_copies_by_address_are_what_torch_copies(
    arena: HostArena, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest, refs = plan(mixed_state())
    jobs = make_jobs(manifest, refs, arena)
    by_torch: list[str] = []
    real = _capture.source_view

    def spy(job: CaptureJob, seg: Any) -> torch.Tensor:
        by_torch.append(job.refs[seg.tensor].key)
        return real(job, seg)

    monkeypatch.setattr(_capture, "source_view", spy)
    copy_into_blocks(jobs)
    monkeypatch.undo()
    for job in jobs:
        assert bytes(job.block.memoryview()) == expected(job), f"shard {job.shard.index}"
    # both ways of copying by address ran, and only the three that need torch went there
    sizes = [manifest.segment_nbytes(s) for j in jobs for s in j.shard.segments]
    assert max(sizes) > _capture._LOCKED_COPY_BYTES >= min(s for s in sizes if s)
    assert sorted(set(by_torch)) == ["conj", "neg", "transposed"]


def test_a_source_whose_shape_changed_is_left_to_torch(arena: HostArena) -> None:
    manifest, refs = plan({"rows": torch.randn(512, 300)})
    jobs = make_jobs(manifest, refs, arena)
    # replaced by a smaller tensor after snapshot() planned it: the address arithmetic
    # would read past its end, so torch copies it and refuses the mismatch
    refs[0].tensor = torch.randn(100, 300)
    with pytest.raises(RuntimeError):
        copy_into_blocks(jobs)



def test_consecutive_chunks_into_consecutive_blocks_are_one_move(
    arena: HostArena, monkeypatch: pytest.MonkeyPatch
) -> None:
    # four 256 KiB chunks of one tensor (rows of 4 KiB), blocks taken one after the other
    manifest, refs = plan({"w": torch.randn(256, 1024), "v": torch.randn(64, 1024)})
    jobs = make_jobs(manifest, refs, arena)
    assert len(jobs) == 5
    moves: list[int] = []
    real = ctypes.memmove

    def spy(dest: int, src: int, n: int) -> Any:
        moves.append(n)
        return real(dest, src, n)

    monkeypatch.setattr(ctypes, "memmove", spy)
    copy_into_blocks(jobs)
    monkeypatch.undo()
    # the blocks follow each other, so do "w" and "v" in memory only by chance: at most two
    assert sum(moves) == (256 + 64) * 1024 * 4 and len(moves) <= 2
    for job in jobs:
        assert bytes(job.block.memoryview()) == expected(job)
