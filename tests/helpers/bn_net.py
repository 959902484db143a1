"""A small BatchNorm conv net and its training step (SGD with momentum, OneCycleLR and a
GradScaler), for the guard and failure-policy tests. Blocks written here: no torchvision."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class BNNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = ConvBlock(3, 8)
        self.block1 = ConvBlock(8, 16, 2)
        self.block2 = ConvBlock(16, 16)
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block1(self.stem(x)))
        out: torch.Tensor = self.head(x.mean(dim=(2, 3)))
        return out


class Trainer:
    """Model, optimizer, scheduler and scaler, built the same way every time."""

    def __init__(self, total_steps: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = BNNet()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(
            self.opt, max_lr=0.1, total_steps=total_steps
        )
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        self.optimizer_steps = 0
        self.opt.register_step_post_hook(self._count)

    def _count(self, *_args: Any) -> None:
        self.optimizer_steps += 1

    def state(self, step: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "optim": self.opt,
            "sched": self.sched,
            "scaler": self.scaler,
            "step": step,
        }

    def step(self, step: int) -> float:
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(8, 3, 16, 16, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        loss = nn.functional.cross_entropy(self.model(x), y)
        torch.autograd.backward(self.scaler.scale(loss))
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        self.opt.zero_grad()
        return float(loss.item())
