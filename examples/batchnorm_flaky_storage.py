"""A BatchNorm conv net trained with SGD momentum, OneCycleLR and a GradScaler, snapshotted
every step through a file tier that fails every third commit.

What it shows:

- the guard never costs a training step: every optimizer, scaler and scheduler step runs,
  whatever the storage does; failed snapshots are logged once each and counted;
- BatchNorm's running statistics (changed by every forward pass) are copied at
  ``snapshot()``, so no snapshot fails because of them;
- a failed snapshot is never listed; resuming from the middle of the run in a fresh
  process reproduces the losses bit for bit;
- ``delete(step)`` removes a committed step from every tier.

Run: ``python examples/batchnorm_flaky_storage.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lazyckpt
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

STEPS = 12


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


def build() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(3, 8), Block(8, 16, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return {
        "model": model,
        "optim": opt,
        "sched": torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS),
        "scaler": torch.amp.GradScaler("cpu", init_scale=1024.0),
    }


def train_step(run: dict[str, Any], step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    loss = nn.functional.cross_entropy(run["model"](x), y)
    run["scaler"].scale(loss).backward()
    run["scaler"].step(run["optim"])  # calls optim.step(): the guard holds it, never raises
    run["scaler"].update()
    run["sched"].step()
    run["optim"].zero_grad()
    return float(loss.item())


class FlakyFile(FaultyTier):
    """A file tier whose every third commit fails (a flaky network file system)."""

    async def commit(self, manifest: Any) -> None:
        if self.calls["commit"] % 3 == 2:
            self.fail_next("commit")
        await super().commit(manifest)


async def train(root: Path) -> None:
    run = build()
    steps_taken = [0]
    run["optim"].register_step_post_hook(lambda *_: steps_taken.__setitem__(0, steps_taken[0] + 1))
    flaky = FlakyFile(FileTier(root), name="file")
    losses = []
    async with lazyckpt.Checkpointer([HostMemoryTier(32 << 20), flaky], retries=0) as ckpt:
        ckpt.guard(run["optim"])
        handles = []
        for step in range(STEPS):
            losses.append(train_step(run, step))
            handles.append(await ckpt.snapshot({**run, "step": step}, step=step))
            await handles[-1].reached("host")
        failed = []
        for h in handles:
            try:
                await h.committed()
            except lazyckpt.SnapshotFailedError:
                failed.append(h.step)
        committed = await flaky.steps()
        await ckpt.delete(committed[0])
        print(f"optimizer steps: {steps_taken[0]} of {STEPS}")
        print(f"failed snapshots: {failed} (metrics: {ckpt.metrics()['snapshots_failed']})")
        print(f"committed on the file tier: {committed}; deleted step {committed[0]}")
    (root / "losses.txt").write_text("\n".join(repr(v) for v in losses))


def resume(root: Path) -> None:
    """In a fresh process: restore the middle committed step and train to the end."""
    losses = [float(v) for v in (root / "losses.txt").read_text().split()]

    async def restore() -> tuple[dict[str, Any], int]:
        run = build()
        async with lazyckpt.Checkpointer([FileTier(root)]) as ckpt:
            steps = await ckpt.steps()
            step = steps[len(steps) // 2]
            await ckpt.restore(step=step, into={**run, "step": 0})
        return run, step

    run, step = asyncio.run(restore())
    after = [train_step(run, s) for s in range(step + 1, STEPS)]
    same = after == losses[step + 1 :]
    print(f"resumed after step {step}: losses identical bit for bit: {same}")
    if not same:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resume", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resume:
        resume(args.resume)
        return
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        asyncio.run(train(root))
        subprocess.run([sys.executable, __file__, "--resume", str(root)], check=True)


if __name__ == "__main__":
    main()
