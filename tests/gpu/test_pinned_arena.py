"""The pinned arena on a real device: page-locked in place, exactly its capacity.

Needs a GPU and a CUDA build of torch; skipped without them (``bench/gpu_check.py`` runs it).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lazyckpt import HostArena

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (a GPU and a CUDA build of torch)"
    ),
]

MiB = 1 << 20


def _caching_host_bytes() -> int:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return 0
    return int(stats().get("allocated_bytes.current", 0))


async def test_arena_is_page_locked_in_place_without_rounding() -> None:
    capacity = 9 * MiB + 4096  # torch's caching host allocator would pin 16 MiB for this
    before = _caching_host_bytes()
    arena = HostArena(capacity, pinned=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # the fallback would warn
        arena.allocate_memory()
    try:
        assert arena.tensor.is_pinned()
        assert arena.tensor.numel() == capacity
        assert _caching_host_bytes() - before < MiB  # not taken from the caching allocator
        src = torch.arange(2 * MiB, dtype=torch.int32, device="cuda")
        block = await arena.allocate(src.numel() * 4)
        out = block.tensor().view(torch.int32)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        assert torch.equal(out, src.cpu())
        arena.release(block)
    finally:
        arena.release_memory()
