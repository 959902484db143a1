"""The host arena: allocation, eviction, backpressure."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from lazyckpt import ConfigurationError, HostArena


@pytest.fixture
def arena() -> HostArena:
    a = HostArena(64 << 10)
    a.allocate_memory()
    return a


async def test_blocks_are_page_aligned_and_disjoint(arena: HostArena) -> None:
    blocks = [await arena.allocate(n) for n in (1, 5000, 4096, 10000)]
    assert all(b.tensor().data_ptr() % 4096 == 0 for b in blocks)
    spans = sorted((b.offset, b.offset + b.extent) for b in blocks)
    assert all(a1 <= b0 for (_, a1), (b0, _) in itertools.pairwise(spans))
    assert len(blocks[1].memoryview()) == 5000


async def test_free_coalesces(arena: HostArena) -> None:
    blocks = [await arena.allocate(16 << 10) for _ in range(4)]
    for b in (blocks[1], blocks[0], blocks[3], blocks[2]):
        arena.release(b)
    whole = arena.try_allocate(64 << 10)
    assert whole is not None and whole.offset == 0


async def test_backpressure_waits_for_space(arena: HostArena) -> None:
    first = await arena.allocate(48 << 10)
    waiter = asyncio.create_task(arena.allocate(32 << 10))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    arena.release(first)
    block = await asyncio.wait_for(waiter, 5)
    assert block.length == 32 << 10
    assert arena.stats().waits == 1


async def test_eviction_oldest_first_with_callback(arena: HostArena) -> None:
    evicted = []
    a = await arena.allocate(32 << 10)
    b = await arena.allocate(32 << 10)
    for blk in (a, b):
        arena.mark_evictable(blk, evicted.append)
        arena.release(blk)
    assert arena.claim(b)  # in use again: not a candidate
    c = await arena.allocate(16 << 10)
    assert evicted == [a] and a.freed and not b.freed
    assert not arena.claim(a)
    arena.release(b)
    arena.release(c)


async def test_oversized_request_is_a_configuration_error(arena: HostArena) -> None:
    with pytest.raises(ConfigurationError, match="does not fit"):
        await arena.allocate(1 << 20)


def test_pinned_without_cuda_is_refused() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the refusal only applies without it")
    with pytest.raises(ConfigurationError, match="CUDA"):
        HostArena(1 << 20, pinned=True)
