"""Surviving a preemption: drain on SIGTERM, restart, resume from the fastest copy.

A scheduler (Slurm, Kubernetes, a spot-instance reclaim) sends SIGTERM and kills the job a
few seconds later. With ``preemption_signals=(signal.SIGTERM,)`` the Checkpointer's handler
stops taking snapshots, makes the ones already taken durable (node-local disk first, then
the shared file system), logs which step is durable where, and lets SIGTERM end the process.

Run it as ``python examples/preemption.py``: it starts the trainer in a child process,
preempts it with SIGTERM after a few steps, then restarts: the new job restores the newest
step lazily from the node-local tier (the fastest copy that survived; the host tier did
not), trains two more steps and checks that the model equals, bit for bit, a replay of the
same training without interruption.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import lazyckpt
from tiers import FileTier, HostMemoryTier, ZarrTier


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)  # the data of a step is a function of the step
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)
    optim.zero_grad()
    torch.autograd.backward(torch.nn.functional.mse_loss(model(x), y))
    optim.step()


def chain(root: Path) -> list[lazyckpt.Tier]:
    # host memory, then node-local disk (tmpfs or NVMe), then the shared file system
    return [
        HostMemoryTier(16 << 20),
        FileTier(root / "local", name="local", keep_last=2),
        ZarrTier(root / "shared", name="shared"),
    ]


def trainer(root: Path) -> None:
    """The preempted job: a snapshot every step, until SIGTERM ends it."""
    logging.basicConfig(level=logging.INFO, format="  trainer log: %(message)s")
    model, optim = make_model()
    with lazyckpt.SyncCheckpointer(
        chain(root), preemption_signals=(signal.SIGTERM,), preemption_grace=20
    ) as ckpt:
        ckpt.guard(optim)
        for step in range(1, 10_000):
            train_step(model, optim, step)
            ckpt.snapshot({"model": model, "optim": optim, "step": step}, step=step)
            print(f"step {step}", flush=True)
            time.sleep(0.05)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        child = subprocess.Popen(
            [sys.executable, __file__, "--train", str(root)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        for line in child.stdout:
            if line.strip() == "step 5":
                child.send_signal(signal.SIGTERM)  # the scheduler's notice
                break
        code = child.wait(timeout=60)
        if code >= 0:
            sys.exit(f"the trainer was not ended by the signal (exit code {code})")
        print(f"trainer ended by {signal.Signals(-code).name}")

        # the restarted job: same chain; the host tier is empty, the local tier survived.
        # lazy=True: restore() returns once the model is in place; AdamW's state (twice
        # the model) streams in while the first forward and backward run, and the guard
        # holds the first optimizer step until it is loaded
        model, optim = make_model()
        state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
        with lazyckpt.SyncCheckpointer(chain(root)) as ckpt:
            ckpt.guard(optim)
            ckpt.restore(into=state, lazy=True)
            step = state["step"]
            for s in range(step + 1, step + 3):  # two more steps after the restart
                train_step(model, optim, s)
        replay, replay_optim = make_model()
        for s in range(1, step + 3):
            train_step(replay, replay_optim, s)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), replay.parameters(), strict=True))
        print(f"resumed from step {step} (at least 5), two steps later: "
              f"{'bit for bit' if same and step >= 5 else 'MISMATCH'} the replayed training")
        if not same or step < 5:
            sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:
        trainer(Path(sys.argv[2]))
    else:
        main()
