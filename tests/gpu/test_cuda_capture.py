"""The CUDA capture path on a real device: side-stream copies into the pinned arena.

Every test here needs a GPU and a CUDA build of torch; without them the module is skipped.
``bench/gpu_check.py`` runs them first on a GPU machine. Races are made likely on purpose:
``torch.cuda._sleep`` holds the compute stream so that a copy that forgot to wait for it, or
an optimizer step that forgot to wait for the copy, reads or writes the wrong values.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import ImmutabilityViolationError, SnapshotFailedError
from lazyckpt._capture.cuda import CudaCapture, stream_guard_hook
from lazyckpt._restore.device import restore_into
from lazyckpt._restore.restore import read_manifest
from tiers import FileTier, HostMemoryTier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (a GPU and a CUDA build of torch)"
    ),
]

MiB = 1 << 20
SHARDS = {"shard_size": 4 * MiB, "pack_bytes": 64 * 1024}
_CYCLES_PER_MS: list[float] = []


def hold_stream(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` milliseconds of GPU time."""
    if not _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS.append(20_000_000 / max(start.elapsed_time(end), 1e-3))
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS[0]))


def install_guard(ckpt: lazyckpt.SyncCheckpointer, optimizer: Any, mode: str) -> Any:
    """``ckpt.guard(optimizer, mode=mode)``, or the same hook installed by hand where the
    Checkpointer does not take a mode."""
    if "mode" in inspect.signature(ckpt.guard).parameters:
        return ckpt.guard(optimizer, mode=mode)
    if mode == "cpu":
        return ckpt.guard(optimizer)
    core = ckpt._core
    engine = core.engine
    assert isinstance(engine.capture, CudaCapture)
    return optimizer.register_step_pre_hook(
        stream_guard_hook(
            engine.capture,
            engine.pending_captures,
            raise_unreported=engine.raise_unreported,
            closing=lambda: core._closing,
        )
    )


@pytest.fixture
def host_only() -> Iterator[lazyckpt.SyncCheckpointer]:
    with lazyckpt.SyncCheckpointer([HostMemoryTier(1 << 30, keep_last=1)], **SHARDS) as ckpt:
        yield ckpt


def failure_causes(exc: BaseException) -> list[BaseException]:
    found: list[BaseException] = [exc]
    for inner in getattr(exc, "exceptions", ()):
        found += failure_causes(inner)
    return found


def test_the_engine_captures_through_the_pinned_cuda_path(
    host_only: lazyckpt.SyncCheckpointer,
) -> None:
    engine = host_only._core.engine
    assert isinstance(engine.capture, CudaCapture)
    assert engine.arena.pinned and engine.arena.tensor.is_pinned()


def test_the_capture_sees_the_values_issued_before_snapshot(
    host_only: lazyckpt.SyncCheckpointer,
) -> None:
    x = torch.zeros(64 * MiB // 4, device="cuda")
    a = torch.randn(2048, 2048, device="cuda")
    hold_stream(150)
    x.fill_(3.0)  # still queued behind the hold when snapshot() returns
    handle = host_only.snapshot({"x": x}, step=1)
    for _ in range(20):  # compute keeps going on the stream while the copy runs
        a = torch.tanh(a @ a)
    handle.wait("captured", timeout=60)
    restored = host_only.restore(step=1)
    assert torch.equal(restored["x"], torch.full_like(restored["x"], 3.0))


@pytest.mark.parametrize("mode", ["cpu", "stream"])
def test_the_guard_keeps_the_snapshot_before_the_step(
    host_only: lazyckpt.SyncCheckpointer, mode: str
) -> None:
    model = torch.nn.Linear(4096, 4096, device="cuda")  # 64 MiB of weights
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    install_guard(host_only, opt, mode)
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    hold_stream(200)  # the copies wait for this; a step that does not wait for them races
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = host_only.snapshot({"model": model.state_dict()}, step=1)
    opt.step()
    after_step_state = handle.state()
    after = {k: v.clone() for k, v in model.state_dict().items()}
    handle.wait("committed", timeout=60)
    torch.cuda.synchronize()
    if mode == "cpu":
        assert after_step_state in ("captured", "committed")
    else:  # the CPU did not wait: the copies were still behind the hold
        assert after_step_state == "capturing"
    restored = host_only.restore(step=1)["model"]
    for key, value in before.items():
        assert torch.equal(restored[key], value.cpu()), key
        assert not torch.equal(after[key], value), key  # the step did change the weights


def test_a_change_without_the_guard_fails_the_snapshot(
    host_only: lazyckpt.SyncCheckpointer,
) -> None:
    x = torch.randn(32 * MiB // 4, device="cuda")
    hold_stream(150)
    handle = host_only.snapshot({"x": x}, step=1)
    x.mul_(2)  # in place, before the copy ran
    with pytest.raises(SnapshotFailedError) as info:
        handle.wait("captured", timeout=60)
    assert any(isinstance(e, ImmutabilityViolationError) for e in failure_causes(info.value))


def test_the_stream_guard_fails_a_change_issued_before_it(
    host_only: lazyckpt.SyncCheckpointer,
) -> None:
    model = torch.nn.Linear(2048, 2048, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    install_guard(host_only, opt, "stream")
    model(torch.randn(8, 2048, device="cuda")).sum().backward()
    hold_stream(150)
    handle = host_only.snapshot({"model": model.state_dict()}, step=1)
    with torch.no_grad():
        model.weight.add_(1.0)  # outside the guard, while the copy waits behind the hold
    with pytest.raises(SnapshotFailedError):
        opt.step()
        handle.wait("captured", timeout=60)
    torch.cuda.synchronize()


def test_restore_into_cuda_tensors_in_place(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024)
    ).cuda()
    odd = torch.randn(3000, 2, device="cuda").t()  # not contiguous
    state = {"model": model, "odd": odd}
    tiers = [HostMemoryTier(256 * MiB), FileTier(tmp_path / "file")]
    with lazyckpt.SyncCheckpointer(tiers, **SHARDS) as ckpt:
        ckpt.snapshot(state, step=7).wait("committed", timeout=60)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        expected_odd = odd.clone()
        pointers = [p.data_ptr() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
            odd.zero_()
        ckpt.restore(step=7, into=state)  # through the Checkpointer
        assert [p.data_ptr() for p in model.parameters()] == pointers
        for key, value in expected.items():
            assert torch.equal(model.state_dict()[key], value), key
        assert torch.equal(odd, expected_odd)

        # straight through restore_into: once from the host arena, once from the file
        engine = ckpt._core.engine

        async def from_tiers(sources: list[Any]) -> None:
            manifest, _, _ = await read_manifest(sources, 7)
            index = {meta.key: i for i, meta in enumerate(manifest.tensors)}
            targets: list[torch.Tensor | None] = [None] * len(manifest.tensors)
            for key, tensor in model.state_dict().items():
                targets[index[f"model/{key}"]] = tensor
            targets[index["odd"]] = odd
            await restore_into(manifest, sources, targets)

        for sources in ([tiers[0]], [tiers[1]]):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(-1.0)
                odd.fill_(-1.0)
            engine.loop.submit(from_tiers(sources)).result(timeout=60)
            for key, value in expected.items():
                assert torch.equal(model.state_dict()[key], value), (sources, key)
            assert torch.equal(odd, expected_odd)


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("mode", ["cpu", "stream"])
def test_pinned_memory_is_reused_with_no_growth(mode: str) -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8))).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    capacity = 256 * MiB
    with lazyckpt.SyncCheckpointer([HostMemoryTier(capacity, keep_last=2)], **SHARDS) as ckpt:
        install_guard(ckpt, opt, mode)
        seen: list[tuple[int, int]] = []
        for step in range(60):
            model(torch.randn(32, 1024, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            ckpt.snapshot({"model": model, "optim": opt}, step=step)
            if step in (10, 59):
                ckpt.wait_captured()
                torch.cuda.synchronize()
                seen.append((torch.cuda.memory_allocated(), _rss_bytes()))
        ckpt.wait_captured()
        arena = ckpt.metrics()["arena"]
        assert ckpt.steps()[-1] == 59
    (gpu_early, rss_early), (gpu_late, rss_late) = seen
    assert gpu_late == gpu_early  # no device memory held by captures between snapshots
    assert rss_late - rss_early < 64 * MiB  # host memory: the arena, allocated once
    assert arena["capacity"] == capacity and arena["peak"] <= capacity


def test_copies_poll_their_events_and_never_block_the_engine_loop(
    host_only: lazyckpt.SyncCheckpointer,
) -> None:
    engine = host_only._core.engine
    x = torch.randn(16 * MiB // 4, device="cuda")
    hold_stream(300)
    handle = host_only.snapshot({"x": x}, step=1)

    async def ticks(seconds: float) -> int:
        n = 0
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            n += 1
            await asyncio.sleep(0.001)
        return n

    # the engine loop keeps running while the copy waits behind the hold
    assert engine.loop.submit(ticks(0.1)).result(timeout=10) > 20
    assert handle.state() == "capturing"
    handle.wait("captured", timeout=60)
