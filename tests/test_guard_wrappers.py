"""guard() with the optimizers frameworks hand out (accelerate's AcceleratedOptimizer,
Lightning's LightningOptimizer) and with closure optimizers (LBFGS; Lightning's automatic
optimization), where the wait belongs after the closure's forward and backward passes."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lazyckpt
from lazyckpt import ConfigurationError
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.bn_net import BNNet, Trainer
from helpers.gating import hold_captures

SMALL = {"shard_size": 1 << 16, "pack_bytes": 4096}


def chain(tmp_path: Path) -> list[lazyckpt.Tier]:
    return [HostMemoryTier(32 << 20), FileTier(tmp_path / "file")]


def record_waits(ckpt: Any, events: list[str]) -> None:
    """Log every wait of the (cpu) guard into ``events``."""
    core = ckpt._core
    real = core.wait_captured_blocking

    def waiting(**kwargs: Any) -> float:
        events.append("wait")
        return float(real(**kwargs))

    core.wait_captured_blocking = waiting


def step_is_held_by_the_guard(ckpt: lazyckpt.SyncCheckpointer, step: Any) -> bool:
    """With a capture held back, does ``step()`` (run on a thread) wait for it?"""
    gate, release = hold_captures(ckpt)  # type: ignore[arg-type]
    done = threading.Event()
    def target() -> None:
        step()
        done.set()

    thread = threading.Thread(target=target)
    thread.start()
    held = not done.wait(0.3)
    gate.set()
    release()
    thread.join(10)
    return held and done.is_set()


def test_accelerated_optimizer(tmp_path: Path) -> None:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    accelerator = Accelerator(cpu=True)
    model = BNNet()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert isinstance(opt, AcceleratedOptimizer)
    x = torch.randn(4, 3, 16, 16)

    def train_step() -> None:
        accelerator.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()

    with lazyckpt.SyncCheckpointer(chain(tmp_path), **SMALL) as ckpt:
        ckpt.guard(opt)
        assert len(opt.optimizer._optimizer_step_pre_hooks) == 1  # on the torch optimizer
        for step in range(4):
            train_step()
            handle = ckpt.snapshot({"model": model, "optim": opt}, step=step)
        handle.wait()
        handle = ckpt.snapshot({"model": model, "optim": opt}, step=4)
        assert step_is_held_by_the_guard(ckpt, train_step)
        handle.wait()
        assert ckpt.steps() == [0, 1, 2, 3, 4]
        assert ckpt.metrics()["snapshots_failed"] == 0


def test_lightning_optimizer_object(tmp_path: Path) -> None:
    from pytorch_lightning.core.optimizer import LightningOptimizer

    model = nn.Linear(8, 8)
    inner = torch.optim.AdamW(model.parameters())
    wrapped = LightningOptimizer(inner)
    with lazyckpt.SyncCheckpointer(chain(tmp_path), **SMALL) as ckpt:
        handle = ckpt.guard(wrapped)
        assert list(inner._optimizer_step_pre_hooks) == [handle.id]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")  # Lightning's advice about workers, loggers, ...
def test_lightning_trainer_waits_after_the_closure(tmp_path: Path) -> None:
    import pytorch_lightning as pl

    events: list[str] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = BNNet()

        def training_step(self, batch: Any, _index: int) -> torch.Tensor:
            events.append("forward")
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Snapshots(pl.Callback):
        def __init__(self, ckpt: lazyckpt.SyncCheckpointer) -> None:
            self.ckpt = ckpt
            self.handles: list[lazyckpt.SnapshotHandle] = []

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            from pytorch_lightning.core.optimizer import LightningOptimizer

            optimizer = module.optimizers()
            assert isinstance(optimizer, LightningOptimizer)
            self.ckpt.guard(optimizer)
            record_waits(self.ckpt, events)

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *_args: Any) -> None:
            state = {"model": module, "optim": trainer.optimizers[0]}
            self.handles.append(self.ckpt.snapshot(state, step=trainer.global_step))

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 3, 16, 16, generator=g), torch.randint(0, 10, (48,), generator=g)
    )
    with lazyckpt.SyncCheckpointer(chain(tmp_path), **SMALL) as ckpt:
        callback = Snapshots(ckpt)
        trainer = pl.Trainer(
            max_steps=6,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[callback],
            default_root_dir=tmp_path,
        )
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=8))
        for h in callback.handles:
            h.wait()
        assert ckpt.steps() == [1, 2, 3, 4, 5, 6]
        assert ckpt.metrics()["snapshots_failed"] == 0
    # each step: forward (inside the closure), then the guard's wait, then the update
    assert events == ["forward", "wait"] * 6


async def test_lbfgs_waits_after_its_first_closure_and_resumes_exactly(tmp_path: Path) -> None:
    events: list[str] = []

    def build() -> tuple[nn.Module, torch.optim.LBFGS]:
        torch.manual_seed(0)
        model = BNNet()
        return model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4)

    def run(model: nn.Module, opt: torch.optim.LBFGS, step: int) -> float:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)

        def closure() -> torch.Tensor:
            events.append("forward")
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            torch.autograd.backward(loss)
            return loss

        return float(opt.step(closure).detach())  # type: ignore[no-untyped-call]

    model, opt = build()
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        ckpt.guard(opt)
        record_waits(ckpt, events)
        losses = []
        for step in range(4):
            losses.append(run(model, opt, step))
            await ckpt.snapshot({"model": model, "optim": opt}, step=step)
        await ckpt.wait_captured()
        assert ckpt.metrics()["snapshots_failed"] == 0
        # the first wait comes after the first closure (forward and backward), not before
        assert events[:2] == ["forward", "wait"]
        fresh_model, fresh_opt = build()
        await ckpt.restore(step=1, into={"model": fresh_model, "optim": fresh_opt})
    assert [run(fresh_model, fresh_opt, s) for s in (2, 3)] == losses[2:]


def test_closure_false_waits_before_the_closure(tmp_path: Path) -> None:
    events: list[str] = []
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def closure() -> torch.Tensor:
        events.append("forward")
        loss: torch.Tensor = model(torch.ones(1, 4)).sum()
        torch.autograd.backward(loss)
        return loss

    with lazyckpt.SyncCheckpointer(chain(tmp_path), **SMALL) as ckpt:
        ckpt.guard(opt, closure=False)
        record_waits(ckpt, events)
        opt.step(closure)
    assert events == ["wait", "forward"]


def test_what_is_not_an_optimizer_is_refused_with_what_to_pass(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    with lazyckpt.SyncCheckpointer(chain(tmp_path), **SMALL) as ckpt:
        with pytest.raises(ConfigurationError, match=r"scaler\.step\(optimizer\)"):
            ckpt.guard(torch.amp.GradScaler("cpu"))
        with pytest.raises(ConfigurationError, match=r"AcceleratedOptimizer.*got Linear"):
            ckpt.guard(model)
        with pytest.raises(ConfigurationError, match="closure"):
            ckpt.guard(torch.optim.SGD(model.parameters()), closure="yes")  # type: ignore[arg-type]


async def test_a_gradscaler_step_is_guarded(tmp_path: Path) -> None:
    run = Trainer(4)
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        ckpt.guard(run.opt)
        run.step(0)
        gate, release = hold_captures(ckpt)
        await ckpt.snapshot(run.state(0), step=0)
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        def let_go() -> None:
            gate.set()
            release()

        loop.call_later(0.3, let_go)
        await asyncio.to_thread(run.step, 1)  # scaler.step(opt) -> opt.step(): waits
        assert time.monotonic() - started >= 0.25
        assert run.optimizer_steps == 2
