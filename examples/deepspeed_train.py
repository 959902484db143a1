"""Train with DeepSpeed (ZeRO-1, on CPU) and checkpoint lazily through lazyckpt, then resume.

A small MLP learns a noisy function under DeepSpeed's engine, which saves checkpoints with
its own ``engine.save_checkpoint`` every few steps; the only change from a plain DeepSpeed
script is the one line that installs :class:`LazyCheckpointEngine`. The checkpoint's bytes
are copied while the next forward and backward passes run and written through host memory
to a local directory; DeepSpeed's ``latest`` file moves only once a checkpoint is durable.
Then a *fresh* engine (other initial weights) loads ``latest`` with
``engine.load_checkpoint``, as a new process would after a crash, and training continues
with exactly the same losses.

Runs on CPU (the example sets ``DS_ACCELERATOR=cpu`` when it is unset). The first run of
DeepSpeed on a machine compiles a small op, which takes a minute or two.
Run ``python examples/deepspeed_train.py --help`` for the knobs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

# DeepSpeed reads these when it is imported and initialized: a single CPU process
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
if "MASTER_PORT" not in os.environ:
    with socket.socket() as _s:
        _s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(_s.getsockname()[1])
for _name, _value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(_name, _value)

import deepspeed  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from lazyckpt.integrations.deepspeed import LazyCheckpointEngine  # noqa: E402
from tiers import FileTier, HostMemoryTier  # noqa: E402

CONFIG = {
    "train_batch_size": 32,
    # torch's Adam: DeepSpeed's CPU FusedAdam keeps Adam's bias correction in state global to
    # the process (updated by multiplication step after step, recomputed with pow() after a
    # jump), so no checkpoint engine can make its resumed run bit-identical on CPU
    "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    "zero_optimization": {"stage": 1},
    "steps_per_print": 1 << 30,
}


def make_engine(seed: int, width: int) -> Any:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    return engine


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)  # the data of a step is a function of the step
    x = torch.randn(32, 16, generator=g)
    return x, x.sin().sum(dim=1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=g)


def train_step(engine: Any, step: int) -> float:
    x, y = batch(step)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()  # commits the checkpoint saved after the previous step, if any
    return float(loss.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: temp)")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="lazyckpt-deepspeed-"))
    save_dir = root / "deepspeed"  # DeepSpeed's directory: 'latest' and small pointer files
    tiers_dir = root / "lazyckpt"  # where the bytes go

    deepspeed.init_distributed(dist_backend="gloo")
    engine = make_engine(seed=0, width=args.width)
    engine.checkpoint_engine = LazyCheckpointEngine([HostMemoryTier(64 << 20), FileTier(tiers_dir)])

    losses: dict[int, float] = {}
    saved_at = -1
    for step in range(args.steps):
        losses[step] = train_step(engine, step)
        if (step + 1) % args.every == 0 and step + 1 < args.steps:
            t0 = time.perf_counter()
            engine.save_checkpoint(str(save_dir), client_state={"next_step": step + 1})
            saved_at = step
            print(f"step {step:3d}  loss {losses[step]:.5f}  checkpoint: save_checkpoint "
                  f"returned in {1e3 * (time.perf_counter() - t0):.1f} ms")
    engine.destroy()  # commits what is pending and drains lazyckpt
    if saved_at < 0:
        print("no checkpoint was taken: make --every smaller than --steps")
        return
    print(f"'latest' names {(save_dir / 'latest').read_text()}, durable in {tiers_dir}")

    # a new process after a crash: other initial weights, the same one-line install
    fresh = make_engine(seed=1, width=args.width)
    fresh.checkpoint_engine = LazyCheckpointEngine([HostMemoryTier(64 << 20), FileTier(tiers_dir)])
    path, client_state = fresh.load_checkpoint(str(save_dir))
    start = client_state["next_step"]
    print(f"\nresumed from {path} at step {start} in a fresh engine")
    same = True
    for step in range(start, args.steps):
        again = train_step(fresh, step)
        same &= again == losses[step]
        print(f"  step {step:3d}  original {losses[step]:.6f}  resumed {again:.6f}  "
              f"{'same' if again == losses[step] else 'DIFFERENT'}")
    fresh.destroy()
    print("losses identical bit for bit" if same else "LOSSES DIFFER")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
