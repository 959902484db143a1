"""The public API end to end, on CPU: laziness, restore, errors, fallback."""

from __future__ import annotations

import asyncio
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import (
    CheckpointerClosedError,
    ConfigurationError,
    CorruptionError,
    ImmutabilityViolationError,
    SnapshotFailedError,
    SnapshotNotFoundError,
    UnsupportedStateError,
)
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.gating import hold_captures

SMALL = {"shard_size": 1 << 16, "pack_bytes": 4096}


def chain(tmp_path: Path, capacity: int = 8 << 20) -> list[lazyckpt.Tier]:
    return [HostMemoryTier(capacity), FileTier(tmp_path / "file")]


def all_dtypes_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(64, 48, generator=g)
    state: dict[str, Any] = {
        "f64": base.double(),
        "f32": base,
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "c64": torch.complex(base, -base),
        "c128": torch.complex(base.double(), base.double()),
        "bool": base > 0,
        "u8": (base * 40).to(torch.uint8),
        "i8": (base * 40).to(torch.int8),
        "i16": (base * 900).to(torch.int16),
        "i32": (base * 1e6).to(torch.int32),
        "i64": (base * 1e9).to(torch.int64),
        "u16": (base.abs() * 900).to(torch.uint16),
        "u32": (base.abs() * 1e6).to(torch.uint32),
        "u64": (base.abs() * 1e9).to(torch.uint64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "view": base.t()[5:40:2],  # non-contiguous
        "big": torch.randn(700, 300, generator=g),  # several chunk shards
        "big_view": torch.randn(300, 700, generator=g).t(),  # non-contiguous and chunked
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            state[name] = base.to(getattr(torch, name))
    return state


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b or (a != a and b != b)


async def test_round_trip_every_dtype_bit_exact(tmp_path: Path) -> None:
    state = all_dtypes_state()
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        handle = await ckpt.snapshot(state, step=1)
        await handle.committed()
        from_host = await ckpt.restore()
    assert_same(state, from_host)
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")]) as fresh:
        assert await fresh.steps() == [1]
        assert_same(state, await fresh.restore(step=1))


async def test_plain_values_round_trip(tmp_path: Path) -> None:
    values = {
        "int_keys": {1: "a", 2: ("b", None)},
        "floats": [0.1, float("inf"), -0.0],
        "bytes": b"\x00\xff",
        "nested": {"t": (1, [2, {"x": True}])},
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
    }
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        await (await ckpt.snapshot(values, step=0)).committed()
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")]) as fresh:
        restored = await fresh.restore()
    assert restored == values
    assert type(restored["nested"]["t"]) is tuple


async def test_snapshot_copies_no_bytes_until_later(tmp_path: Path) -> None:
    """snapshot() records references only: a change right after it is caught, not saved."""
    t = torch.zeros(2048, 256)
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        gate, _release = hold_captures(ckpt)
        handle = await ckpt.snapshot({"t": t}, step=1)
        t.add_(1)  # the training loop mutating before the capture ran
        gate.set()
        with pytest.raises(SnapshotFailedError) as info:
            await handle.committed()
        assert info.group_contains(ImmutabilityViolationError)
        assert "'t'" in str(info.value.exceptions[0])
        assert await ckpt.steps() == []


async def test_immutability_violation_raised_by_next_snapshot(tmp_path: Path) -> None:
    t = torch.zeros(4096, 512)
    async with lazyckpt.Checkpointer(
        chain(tmp_path, 64 << 20), on_failure="raise", **SMALL
    ) as ckpt:
        gate, release = hold_captures(ckpt)
        await ckpt.snapshot({"t": t}, step=1)
        t.mul_(2)
        gate.set()
        release()
        with pytest.raises(SnapshotFailedError):
            await ckpt.wait_captured()
        # reported once: the next snapshot goes through
        handle = await ckpt.snapshot({"t": t}, step=2)
        await handle.committed()
        assert await ckpt.steps() == [2]


async def test_guard_makes_the_optimizer_wait(tmp_path: Path) -> None:
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    async with lazyckpt.Checkpointer(chain(tmp_path, 32 << 20), **SMALL) as ckpt:
        ckpt.guard(opt)
        for step in range(5):
            model(torch.randn(8, 512)).sum().backward()
            opt.step()
            opt.zero_grad()
            await ckpt.snapshot({"model": model, "optim": opt}, step=step)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")]) as fresh:
        assert await fresh.steps() == [0, 1, 2, 3, 4]
        restored = await fresh.restore()
    assert_same(expected, restored["model"])
    assert restored["optim"]["param_groups"][0]["lr"] == 0.1


async def test_capture_progresses_while_the_trainer_blocks_its_loop(tmp_path: Path) -> None:
    """The engine runs on its own thread: a trainer that never awaits still gets captures."""
    state = {"w": torch.randn(1024, 1024)}
    async with lazyckpt.Checkpointer(chain(tmp_path, 16 << 20), **SMALL) as ckpt:
        handle = await ckpt.snapshot(state, step=1)
        deadline = time.monotonic() + 60
        # Busy "forward/backward" that blocks this event loop and never awaits.
        while handle.state() == "capturing" and time.monotonic() < deadline:
            torch.mm(torch.randn(64, 64), torch.randn(64, 64))
        assert handle.state() in ("captured", "committed")
        await handle.committed()


async def test_restore_into_keeps_identity_and_loads_stateful(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 32)).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        await (await ckpt.snapshot({"model": model, "optim": opt, "epoch": 3}, step=7)).committed()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        params_before = [p for p in model.parameters()]
        live: dict[str, Any] = {"model": model, "optim": opt, "epoch": 0}
        result = await ckpt.restore(into=live)
    assert result is live and live["epoch"] == 3
    assert [p for p in model.parameters()] == params_before  # same objects
    assert_same(saved, {k: v for k, v in model.state_dict().items()})
    assert opt.state_dict()["state"][0]["exp_avg"].shape == (64, 32)


async def test_map_location_and_tied_tensors(tmp_path: Path) -> None:
    emb = torch.randn(100, 16)
    state = {"embed": emb, "head": emb, "other": emb.clone()}
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
        restored = await ckpt.restore(map_location="cpu")
    assert restored["embed"] is restored["head"]
    assert restored["other"] is not restored["embed"]
    assert torch.equal(restored["head"], emb)


async def test_state_larger_than_the_arena_streams_through(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(256, 256) for i in range(12)}  # 3 MiB
    arena = 512 << 10
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(arena), FileTier(tmp_path / "file")], shard_size=1 << 16, pack_bytes=4096
    ) as ckpt:
        for step in range(3):
            await (await ckpt.snapshot(state, step=step)).committed()
        metrics = ckpt.metrics()
        assert metrics["arena"]["peak"] <= metrics["arena"]["capacity"]
        assert metrics["arena"]["waits"] > 0  # backpressure happened
        restored = await ckpt.restore()
    assert_same(state, restored)


async def test_flipped_byte_falls_back_then_raises(tmp_path: Path) -> None:
    state = {"w": torch.randn(512, 256)}
    async with lazyckpt.Checkpointer(chain(tmp_path, 32 << 20), **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
        data = tmp_path / "file" / "step-000000000001" / "rank-00000.data"
        raw = bytearray(data.read_bytes())
        raw[1000] ^= 0x40
        data.write_bytes(raw)
        # the host copy is still good: restore succeeds from it
        assert_same(state, await ckpt.restore())
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")]) as fresh:
        with pytest.raises(CorruptionError, match="'w'"):
            await fresh.restore()


async def test_host_copy_corrupt_falls_back_to_file(tmp_path: Path) -> None:
    state = {"w": torch.randn(512, 256)}
    host = HostMemoryTier(32 << 20)
    async with lazyckpt.Checkpointer([host, FileTier(tmp_path / "file")], **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
        block = host._blocks[1][0]
        block.tensor()[10] ^= 0xFF
        assert_same(state, await ckpt.restore())


async def test_sync_checkpointer(tmp_path: Path) -> None:
    def train() -> None:
        model = torch.nn.Linear(16, 16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with lazyckpt.SyncCheckpointer(chain(tmp_path), **SMALL) as ckpt:
            ckpt.guard(opt)
            for step in range(3):
                model(torch.randn(4, 16)).sum().backward()
                opt.step()
                handle = ckpt.snapshot({"model": model}, step=step)
            handle.wait("committed")
            assert ckpt.steps() == [0, 1, 2]
            restored = ckpt.restore()
            assert torch.equal(restored["model"]["weight"], model.weight)

    await asyncio.to_thread(train)


async def test_retention_keep_last(tmp_path: Path) -> None:
    file = FileTier(tmp_path / "file", keep_last=2)
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), file], **SMALL) as ckpt:
        for step in range(5):
            await (await ckpt.snapshot({"x": torch.full((10,), float(step))}, step=step)).committed()
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")]) as fresh:
        assert await fresh.steps() == [3, 4]


async def test_chain_without_host_stages_privately(tmp_path: Path) -> None:
    state = {"w": torch.randn(300, 300)}
    async with lazyckpt.Checkpointer(
        [FileTier(tmp_path / "file")], staging_bytes=1 << 20, **SMALL
    ) as ckpt:
        await (await ckpt.snapshot(state, step=3)).committed()
        assert_same(state, await ckpt.restore(step=3))


async def test_memory_stays_flat_over_many_snapshots(tmp_path: Path) -> None:
    state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    capacity = 1 << 20
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(capacity), FileTier(tmp_path / "file", keep_last=1)], **SMALL
    ) as ckpt:
        for step in range(200):
            await ckpt.snapshot(state, step=step)
            await ckpt.wait_captured()
        metrics = ckpt.metrics()
    assert metrics["arena"]["peak"] <= capacity


# -- bad input ---------------------------------------------------------------------------------


async def test_bad_inputs_get_typed_errors(tmp_path: Path) -> None:
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        with pytest.raises(UnsupportedStateError, match="mapping"):
            await ckpt.snapshot([torch.zeros(1)], step=1)  # type: ignore[arg-type]
        with pytest.raises(UnsupportedStateError, match=r"sparse|layout"):
            await ckpt.snapshot({"s": torch.eye(3).to_sparse()}, step=1)
        with pytest.raises(UnsupportedStateError, match="quantized"):
            with warnings.catch_warnings():  # quantized dtypes are deprecated upstream
                warnings.simplefilter("ignore")
                q = torch.quantize_per_tensor(torch.rand(4), 0.1, 0, torch.quint8)
            await ckpt.snapshot({"q": q}, step=1)
        with pytest.raises(UnsupportedStateError, match="meta"):
            await ckpt.snapshot({"m": torch.empty(3, device="meta")}, step=1)
        with pytest.raises(UnsupportedStateError, match=r"'obj'.*allow_pickle"):
            await ckpt.snapshot({"obj": object()}, step=1)
        with pytest.raises(ConfigurationError, match="non-negative"):
            await ckpt.snapshot({}, step=-1)
        with pytest.raises(ConfigurationError, match="non-negative"):
            await ckpt.snapshot({}, step=True)  # type: ignore[arg-type]
        await (await ckpt.snapshot({"a": 1}, step=5)).committed()
        with pytest.raises(ConfigurationError, match="not newer"):
            await ckpt.snapshot({"a": 1}, step=5)
        with pytest.raises(ConfigurationError, match="not newer"):
            await ckpt.snapshot({"a": 1}, step=4)
        with pytest.raises(SnapshotNotFoundError):
            await ckpt.restore(step=99)
        with pytest.raises(ConfigurationError, match="no tier named"):
            h = await ckpt.snapshot({"a": 2}, step=6)
            await h.reached("nvme")
    with pytest.raises(CheckpointerClosedError):
        await ckpt.snapshot({}, step=10)


def test_bad_configuration(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="at least one tier"):
        lazyckpt.Checkpointer([])
    with pytest.raises(ConfigurationError, match="unique"):
        lazyckpt.Checkpointer([FileTier(tmp_path / "a"), FileTier(tmp_path / "b")])
    with pytest.raises(ConfigurationError, match="first tier"):
        lazyckpt.Checkpointer([FileTier(tmp_path / "a"), HostMemoryTier(1 << 20)])
    with pytest.raises(ConfigurationError, match="smaller than one shard"):
        lazyckpt.Checkpointer([HostMemoryTier(1 << 20), FileTier(tmp_path)], shard_size=4 << 20)
    with pytest.raises(ConfigurationError, match="unknown Checkpointer options"):
        lazyckpt.Checkpointer([FileTier(tmp_path)], shardsize=1)
    with pytest.raises(ConfigurationError, match="multiple of 4096"):
        lazyckpt.Checkpointer([FileTier(tmp_path)], shard_size=1000)
    with pytest.raises(ConfigurationError, match="name"):
        FileTier(tmp_path, name="bad name/")
    with pytest.raises(ConfigurationError, match="keep_last"):
        FileTier(tmp_path, keep_last=0)


class Thing:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Thing)


async def test_pickle_refused_unless_allowed_on_both_sides(tmp_path: Path) -> None:
    async with lazyckpt.Checkpointer(chain(tmp_path), allow_pickle=True, **SMALL) as ckpt:
        await (await ckpt.snapshot({"thing": Thing()}, step=1)).committed()
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")]) as fresh:
        with pytest.raises(UnsupportedStateError, match="allow_pickle"):
            await fresh.restore()
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")], allow_pickle=True) as fresh:
        assert (await fresh.restore())["thing"] == Thing()


async def test_failed_tier_is_reported_not_swallowed(tmp_path: Path) -> None:
    from lazyckpt.testing import FaultyTier

    faulty = FaultyTier(FileTier(tmp_path / "file"))
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), faulty], **SMALL) as ckpt:
        faulty.break_("put_shard")
        handle = await ckpt.snapshot({"w": torch.randn(100, 100)}, step=1)
        await handle.reached("host")  # the host stage is unaffected
        with pytest.raises(SnapshotFailedError) as info:
            await handle.committed()
        assert info.value.tiers == ("file",)
        faulty.heal()
        good = await ckpt.snapshot({"w": torch.randn(100, 100)}, step=2)
        await good.committed()
        assert await faulty.steps() == [2]


async def test_finished_snapshots_keep_no_tensor_alive_without_a_guard(tmp_path: Path) -> None:
    # a trainer that never installs a guard nor waits for captures: the engine must still
    # let go of each snapshot's tensors once it is through
    import gc
    import weakref

    async with lazyckpt.Checkpointer(
        [HostMemoryTier(8 << 20), FileTier(tmp_path / "f")], **SMALL
    ) as ckpt:
        first = torch.randn(64, 64)
        gone = weakref.ref(first)
        handle = await ckpt.snapshot({"w": first}, step=0)
        await handle.committed()
        del first, handle
        for step in range(1, 6):
            await (await ckpt.snapshot({"w": torch.randn(64, 64)}, step=step)).committed()
        gc.collect()
        assert gone() is None
        assert len(ckpt._core.engine._pending_captures) <= 1


async def test_a_checkpointer_dropped_open_drains_closes_and_warns(tmp_path: Path) -> None:
    # its owner lets go of it without aclose(): the snapshot in flight still commits, the
    # tiers close (the location's lock is free again), and a ResourceWarning says so
    import gc

    from lazyckpt.testing import FaultyTier

    slow = FaultyTier(FileTier(tmp_path / "file"))
    slow.delay_s = 0.1
    ckpt = lazyckpt.Checkpointer([HostMemoryTier(8 << 20), slow], **SMALL)
    await ckpt.open()
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt.guard(opt)
    handle = await ckpt.snapshot({"model": model, "optim": opt}, step=3)
    engine = ckpt._core.engine
    thread = engine.loop._thread
    assert thread is not None
    with pytest.warns(ResourceWarning, match=r"dropped without being closed.*steps \[3\]"):
        del ckpt
        gc.collect()
    await handle.committed()
    await asyncio.to_thread(thread.join, 30)
    assert not thread.is_alive() and engine.closed
    model(torch.randn(2, 64)).sum().backward()
    opt.step()  # the guard left on the optimizer waits for nothing now
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")]) as again:
        assert await again.steps() == [3]


def test_a_checkpointer_closed_by_its_owner_is_not_closed_again_when_dropped(
    tmp_path: Path,
) -> None:
    import gc

    with lazyckpt.SyncCheckpointer([FileTier(tmp_path / "file")]) as ckpt:
        ckpt.snapshot({"w": torch.ones(4)}, step=0)
    core = ckpt._core
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ResourceWarning
        del ckpt
        gc.collect()
    assert core._owner_watch is None and core._dropped_close is None
