"""Trainer state beside the tensors: RNGs, numpy arrays and a dataclass, without pickle.

A small regression loop keeps what real trainers keep: a dataclass of counters and the best
loss so far, a numpy generator for augmentation, Python's ``random`` for sampling, a torch
generator for data, numpy's legacy global RNG state, and a numpy array of recent losses.
Every step is snapshotted; then fresh objects (other seeds) are restored in place from the
middle of the run and the rest is replayed, bit for bit.

    python examples/resume_trainer_state.py
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import lazyckpt
from tiers import FileTier, HostMemoryTier


@dataclass
class Progress:
    epoch: int = 0
    best_loss: float = float("inf")
    seen: list[int] = field(default_factory=list)


def make(seed: int) -> dict[str, Any]:
    """Everything the loop trains with, from a seed."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return {
        "model": model,
        "optim": torch.optim.AdamW(model.parameters(), lr=1e-2),
        "progress": Progress(),
        "augment": np.random.default_rng(seed),  # numpy Generator: restored in place
        "sampler": random.Random(seed),  # random.Random: restored in place
        "data": torch.Generator().manual_seed(seed),  # torch.Generator: restored in place
        "recent": np.zeros(16, dtype=np.float32),  # a numpy array: same dtype and shape back
    }


def step(s: dict[str, Any], i: int) -> float:
    x = torch.randn(16, 8, generator=s["data"])
    noise = torch.from_numpy(s["augment"].normal(0, 0.1, (16, 1)).astype(np.float32))
    y = x[:, :1] * 2 + noise
    keep = s["sampler"].sample(range(16), 12)
    weight = 1.0 + 0.1 * float(np.random.rand())  # the legacy global numpy RNG
    loss = torch.nn.functional.mse_loss(s["model"](x[keep]), y[keep]) * weight
    torch.autograd.backward(loss)
    s["optim"].step()
    s["optim"].zero_grad()
    value = float(loss.item())
    s["progress"].best_loss = min(s["progress"].best_loss, value)
    s["progress"].seen.append(i)
    s["recent"][i % 16] = value
    return value


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        await train_and_resume(Path(tmp) / "ckpt")


async def train_and_resume(root: Path) -> None:
    np.random.seed(0)  # the legacy global numpy RNG, saved through np.random.get_state()
    objects = make(seed=0)
    losses = []
    async with lazyckpt.Checkpointer([HostMemoryTier(64 << 20), FileTier(root)]) as ckpt:
        ckpt.guard(objects["optim"])
        for i in range(10):
            losses.append(step(objects, i))
            state = {**objects, "np_global": np.random.get_state()}
            await ckpt.snapshot(state, step=i)

    fresh = make(seed=123)  # other weights, other RNG states
    target = {**fresh, "np_global": np.random.get_state()}
    async with lazyckpt.Checkpointer([FileTier(root)]) as ckpt:
        await ckpt.restore(4, into=target)  # checks every key first; loads in place
    np.random.set_state(target["np_global"])
    assert fresh["progress"].seen == [0, 1, 2, 3, 4]
    replay = [step(fresh, i) for i in range(5, 10)]
    print(f"losses 5..9 uninterrupted: {losses[5:]}")
    print(f"losses 5..9 resumed:       {replay}")
    assert replay == losses[5:]
    assert fresh["recent"].dtype == np.float32
    print("resumed bit for bit")


if __name__ == "__main__":
    asyncio.run(main())
