"""restore(lazy=True): the model is in place at once, the guarded optimizers' state streams
in behind, each guarded step waits for its optimizer's state; bit for bit an eager restore."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import ConfigurationError, CorruptionError, SyncCheckpointer
from lazyckpt.testing import FaultyTier
from tiers import FileTier

SHARD = 1 << 14


class GatedTier(FaultyTier):
    """Holds every read of a shard holding only optimizer state until ``gate`` is set."""

    def __init__(self, inner: lazyckpt.Tier) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.held = 0

    async def read_shard(self, manifest: Any, shard: Any, out: memoryview) -> None:
        keys = [manifest.tensors[s.tensor].key for s in shard.segments]
        if all(k.startswith("optim/") for k in keys):
            self.held += 1
            while not self.gate.is_set():  # noqa: ASYNC110 - set from another thread
                await asyncio.sleep(0.005)
        await super().read_shard(manifest, shard, out)


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(48, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, closure: bool = False) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 48, generator=g), torch.randn(32, 4, generator=g)

    def loss_fn() -> float:
        optim.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        torch.autograd.backward(loss)
        return float(loss.detach())

    if closure:
        optim.step(loss_fn)
    else:
        loss_fn()
        optim.step()


def checkpoint(root: Path) -> None:
    model, optim = make()
    for step in range(1, 4):
        train(model, optim, step)
    with SyncCheckpointer([FileTier(root)], shard_size=SHARD, pack_bytes=1024) as ckpt:
        ckpt.snapshot({"model": model, "optim": optim, "step": 3}, step=3).wait()


def flat(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    for st in optim.state.values():
        out += [v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v) for v in st.values()]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def resume(root: Path, lazy: bool, closure: bool, tier: lazyckpt.Tier | None = None) -> list[torch.Tensor]:
    model, optim = make(seed=1)  # different initial weights: everything must come from the checkpoint
    state = {"model": model, "optim": optim, "step": 0}
    with SyncCheckpointer([tier or FileTier(root)], shard_size=SHARD) as ckpt:
        ckpt.guard(optim)
        ckpt.restore(into=state, lazy=lazy)
        assert state["step"] == 3
        for step in range(4, 7):
            train(model, optim, step, closure=closure)
    return flat(model, optim)


@pytest.mark.parametrize("closure", [False, True])
def test_lazy_is_bit_for_bit_the_eager_restore(tmp_path: Path, closure: bool) -> None:
    checkpoint(tmp_path)
    eager = resume(tmp_path, lazy=False, closure=closure)
    lazy = resume(tmp_path, lazy=True, closure=closure)
    assert same(eager, lazy)
    # and not trivially: starting from the other weights without a restore differs
    model, optim = make(seed=1)
    for step in range(4, 7):
        train(model, optim, step)
    assert not same(eager, flat(model, optim))


@pytest.mark.parametrize("closure", [False, True])
def test_the_guard_holds_the_first_step_until_the_optimizer_state_is_in(
    tmp_path: Path, closure: bool
) -> None:
    checkpoint(tmp_path)
    eager = resume(tmp_path, lazy=False, closure=closure)
    gated = GatedTier(FileTier(tmp_path))
    model, optim = make(seed=1)
    state = {"model": model, "optim": optim, "step": 0}
    with SyncCheckpointer([gated], shard_size=SHARD) as ckpt:
        try:
            ckpt.guard(optim)
            ckpt.restore(into=state, lazy=True)  # returns with the optimizer's shards held
            assert state["step"] == 3
            assert not optim.state  # AdamW's state is not loaded yet ...
            stepped = threading.Event()

            def first_step() -> None:
                train(model, optim, 4, closure=closure)  # forward and backward run at once
                stepped.set()

            worker = threading.Thread(target=first_step)
            worker.start()
            assert not stepped.wait(0.3)  # ... so the guard holds the update
            assert not optim.state and gated.held > 0
        finally:
            gated.gate.set()
        worker.join(30)
        assert stepped.is_set() and optim.state
        for step in range(5, 7):
            train(model, optim, step, closure=closure)
    assert same(eager, flat(model, optim))


def test_snapshot_waits_for_a_lazy_restore(tmp_path: Path) -> None:
    checkpoint(tmp_path / "a")
    gated = GatedTier(FileTier(tmp_path / "a"))
    model, optim = make(seed=1)
    state = {"model": model, "optim": optim, "step": 0}
    with SyncCheckpointer([gated], shard_size=SHARD) as ckpt:
        ckpt.guard(optim)
        ckpt.restore(into=state, lazy=True)
        threading.Timer(0.2, gated.gate.set).start()
        ckpt.snapshot(state, step=4).wait()  # waits for the optimizer state, then takes it
        assert optim.state
    with SyncCheckpointer([FileTier(tmp_path / "a")]) as ckpt:
        saved = ckpt.restore(4)
    assert torch.equal(saved["optim"]["state"][0]["exp_avg"], optim.state[next(model.parameters())]["exp_avg"])


@contextlib.contextmanager
def failed_lazy_restore(
    tmp_path: Path,
) -> Iterator[tuple[SyncCheckpointer, GatedTier, torch.nn.Module, torch.optim.Optimizer]]:
    """A guarded optimizer whose lazy restore failed: every read of its state's shards
    broken once the model is in place; healed on the way out."""
    checkpoint(tmp_path)
    broken = GatedTier(FileTier(tmp_path))
    model, optim = make(seed=1)
    with SyncCheckpointer([broken], shard_size=SHARD) as ckpt:
        ckpt.guard(optim)
        ckpt.restore(into={"model": model, "optim": optim, "step": 0}, lazy=True)
        broken.break_("read_shard")
        broken.gate.set()
        try:
            yield ckpt, broken, model, optim
        finally:
            broken.heal()


def test_a_failed_lazy_restore_raises_from_the_guarded_step(tmp_path: Path) -> None:
    with failed_lazy_restore(tmp_path) as (_, _, model, optim):
        with pytest.raises(CorruptionError, match="no tier holds a good copy"):
            train(model, optim, 4)
        assert not optim.state  # the update did not run on state that was not restored


def test_a_failed_lazy_restore_refuses_snapshots_until_a_restore_loads_the_state(
    tmp_path: Path,
) -> None:
    """The state a failed lazy restore left half loaded is never snapshotted as a valid
    step: ``snapshot()`` raises the restore's error, as the guarded step does, until a
    restore loads the optimizer whole; then both work again."""
    with failed_lazy_restore(tmp_path) as (ckpt, broken, model, optim):
        state = {"model": model, "optim": optim, "step": 0}
        with pytest.raises(CorruptionError, match="no tier holds a good copy"):
            ckpt.snapshot(state, step=4)
        with pytest.raises(CorruptionError):  # and again: it is no passing failure
            ckpt.snapshot(state, step=4)
        assert ckpt.steps() == [3]
        broken.heal()
        ckpt.restore(into=state)  # eager, whole
        train(model, optim, 4)  # the guard lets the step run again
        ckpt.snapshot(state, step=4).wait()
        assert ckpt.steps() == [3, 4]


def test_a_new_optimizer_after_a_failed_lazy_restore_snapshots(tmp_path: Path) -> None:
    """The other way out of a failed lazy restore: a new optimizer, restored eagerly and
    guarded. Its snapshots are not refused for the old optimizer's failed restore."""
    with failed_lazy_restore(tmp_path) as (ckpt, broken, model, optim):
        with pytest.raises(CorruptionError):
            ckpt.snapshot({"model": model, "optim": optim, "step": 0}, step=4)
        broken.heal()
        fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = {"model": model, "optim": fresh, "step": 0}
        ckpt.restore(into=state)
        ckpt.guard(fresh)
        train(model, fresh, 4)
        ckpt.snapshot(state, step=4).wait()
        assert ckpt.steps() == [3, 4]


def test_lazy_without_a_guarded_optimizer_is_eager(tmp_path: Path) -> None:
    checkpoint(tmp_path)
    gated = GatedTier(FileTier(tmp_path))
    gated.gate.set()
    model, optim = make(seed=1)
    with SyncCheckpointer([gated], shard_size=SHARD) as ckpt:
        ckpt.restore(into={"model": model, "optim": optim, "step": 0}, lazy=True)
        assert optim.state  # nothing guarded: loaded before restore() returned
        with pytest.raises(ConfigurationError, match="lazy"):
            ckpt.restore(into={"model": model, "optim": optim}, lazy=1)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="mapping"):
            ckpt.restore(into=[model], lazy=True)


async def test_async_lazy_restore(tmp_path: Path) -> None:
    checkpoint(tmp_path)
    eager = resume(tmp_path, lazy=False, closure=False)
    model, optim = make(seed=1)
    state = {"model": model, "optim": optim, "step": 0}
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], shard_size=SHARD) as ckpt:
        ckpt.guard(optim)
        await ckpt.restore(into=state, lazy=True)
        for step in range(4, 7):
            await asyncio.to_thread(train, model, optim, step)
    assert same(eager, flat(model, optim))


def test_a_lazy_restore_maps_compiled_keys_like_an_eager_one(tmp_path: Path) -> None:
    # a snapshot of a compiled model (keys under "_orig_mod.") restores lazily into the plain
    # model, as an eager restore does
    model, optim = make()
    for step in range(1, 3):
        train(model, optim, step)
    compiled = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    with SyncCheckpointer([FileTier(tmp_path)], shard_size=SHARD, pack_bytes=1024) as ckpt:
        ckpt.snapshot({"model": compiled, "optim": optim}, step=2).wait()
    fresh, fresh_optim = make(seed=1)
    with SyncCheckpointer([FileTier(tmp_path)], shard_size=SHARD, pack_bytes=1024) as ckpt:
        ckpt.guard(fresh_optim)
        ckpt.restore(step=2, into={"model": fresh, "optim": fresh_optim}, lazy=True)
        train(fresh, fresh_optim, 3)  # the guarded step waits for the optimizer state
    train(model, optim, 3)
    assert same(flat(fresh, fresh_optim), flat(model, optim))
