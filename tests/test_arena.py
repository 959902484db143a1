"""The host arena: allocation, eviction, backpressure."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
import torch

from lazyckpt import Block, ConfigurationError, HostArena


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
    evicted: list[Block] = []
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


class _FakeCudart:
    """Records page-locking calls; ``status`` is what cudaHostRegister returns."""

    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.registered.append((address, nbytes, flags))
        return self.status

    def cudaHostUnregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeCudart:
    import torch

    from lazyckpt._tiering import arena as _arena

    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_arena, "_cudart", lambda: fake)
    return fake


def test_pinned_arena_page_locks_exactly_its_capacity_in_place(fake_cuda: _FakeCudart) -> None:
    capacity = 9 * (1 << 20) + 4096  # not a power of two: nothing may round it up
    arena = HostArena(capacity, pinned=True)
    arena.allocate_memory()
    address = arena.tensor.data_ptr()
    assert fake_cuda.registered == [(address, capacity, 1)]
    assert address % 4096 == 0 and arena.tensor.numel() == capacity
    assert int(arena.tensor.sum()) == 0  # touched and zeroed
    arena.release_memory()
    assert fake_cuda.unregistered == [address]  # unlocked before the mapping goes


def test_refused_page_lock_falls_back_to_the_caching_allocator(
    fake_cuda: _FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from lazyckpt._tiering import arena as _arena

    fake_cuda.status = 2  # cudaErrorMemoryAllocation
    asked: list[int] = []

    def fallback(nbytes: int) -> torch.Tensor:
        asked.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(_arena, "caching_pinned", fallback)
    arena = HostArena(1 << 20, pinned=True)
    with pytest.warns(ResourceWarning, match="returned 2"):
        arena.allocate_memory()
    assert asked == [1 << 20] and arena.tensor.numel() == 1 << 20
    arena.release_memory()
    assert fake_cuda.unregistered == []  # nothing was registered, nothing to undo


def test_unpinned_arena_registers_nothing(fake_cuda: _FakeCudart) -> None:
    arena = HostArena(1 << 20, pinned=False)
    arena.allocate_memory()
    arena.release_memory()
    assert fake_cuda.registered == [] and fake_cuda.unregistered == []


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_DONTFORK"), reason="Linux only")
def test_a_forked_child_gets_no_copy_of_the_pinned_arena(fake_cuda: _FakeCudart) -> None:
    # DataLoader workers are forked children: page-locked private pages would be copied
    # into each of them at fork time, so the pinned arena is left out of children
    import os
    import signal

    arena = HostArena(1 << 20, pinned=True)
    arena.allocate_memory()
    try:
        pid = os.fork()
        if pid == 0:  # the child: the arena's pages are not mapped here
            import faulthandler

            faulthandler.disable()  # the expected crash needs no traceback
            arena.view[0]
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
    finally:
        arena.release_memory()


async def test_allocate_all_takes_everything_or_nothing(arena: HostArena) -> None:
    other = await arena.allocate(32 << 10)  # someone else's, held
    kept = await arena.allocate(16 << 10)
    arena.mark_evictable(kept, None)
    arena.release(kept)
    # 48 KiB needed, 16 free + 16 evictable: waiting, holding nothing, evicting nothing
    waiter = asyncio.create_task(arena.allocate_all([16 << 10, 16 << 10, 16 << 10]))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    assert arena.stats().held == 32 << 10 and not kept.freed
    arena.release(other)
    blocks = await asyncio.wait_for(waiter, 5)
    assert [b.length for b in blocks] == [16 << 10] * 3 and arena.stats().held == 48 << 10
    assert not kept.freed  # there was room without it
    # 32 KiB more: nothing free, 16 evictable; refused, and the kept block stays
    assert arena.try_allocate_all([16 << 10, 16 << 10]) is None and not kept.freed
    arena.release(blocks[0])
    more = arena.try_allocate_all([16 << 10, 16 << 10])  # 16 free + 16 evictable
    assert more is not None and kept.freed


async def test_allocate_all_gives_back_a_part_when_the_space_is_fragmented(
    arena: HostArena,
) -> None:
    a, b, c, d = [await arena.allocate(16 << 10) for _ in range(4)]
    arena.release(b)  # free 16 KiB between two held blocks
    arena.mark_evictable(d, None)
    arena.release(d)
    # 48 KiB are free or evictable, but no 32 KiB run can be made while a and c are held
    assert arena.try_allocate_all([16 << 10, 32 << 10]) is None
    assert arena.stats().held == 32 << 10  # the 16 KiB taken on the way were given back
    arena.release(a)
    arena.release(c)
    got = arena.try_allocate_all([16 << 10, 32 << 10])
    assert got is not None and arena.stats().held == 48 << 10


async def test_allocate_all_refuses_more_than_the_arena(arena: HostArena) -> None:
    with pytest.raises(ConfigurationError, match="do not fit an arena"):
        arena.try_allocate_all([32 << 10, 32 << 10, 4096])


def test_an_open_that_only_reads_allocates_no_staging_arena(tmp_path: Path) -> None:
    """The private staging arena is allocated by the first snapshot, never by an open that
    restores, lists or verifies (a restarted job, the command line)."""
    from lazyckpt import SyncCheckpointer
    from tiers import FileTier

    state = {"w": torch.randn(256, 256)}
    with SyncCheckpointer([FileTier(tmp_path)]) as ckpt:
        assert not ckpt._core.engine.arena.allocated
        ckpt.snapshot(state, step=1).wait()
        assert ckpt._core.engine.arena.allocated
    with SyncCheckpointer([FileTier(tmp_path)]) as ckpt:
        assert ckpt.steps() == [1]
        assert torch.equal(ckpt.restore()["w"], state["w"])
        assert ckpt.verify().ok
        assert not ckpt._core.engine.arena.allocated
        ckpt.snapshot(state, step=2).wait()  # and a later snapshot still gets one
        assert ckpt._core.engine.arena.allocated
        assert torch.equal(ckpt.restore(step=2)["w"], state["w"])
