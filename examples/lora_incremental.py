"""Fine-tuning low-rank adapters on a frozen base, snapshotted every step, incrementally.

The base model's weights never change; only the adapters and their optimizer state do. With
``incremental=True`` each snapshot after the first writes only the shards whose bytes changed
(checked by crc32c and a 128-bit digest), and its manifest refers to the stored copy of the
frozen weights. ``keep_last=5`` keeps five steps; the step that wrote the base is retired
(its data kept, no longer listed) for as long as a kept step refers to it. Every kept step
restores on its own, bit for bit.

Run it as ``python examples/lora_incremental.py [--mode versions]``. ``--mode versions`` also
skips capturing the frozen weights (their version counters do not move); see
docs/guarantees.md for what that mode trusts.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import torch

import lazyckpt
from tiers import FileTier, HostMemoryTier


class LoRALinear(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``x @ A @ B``."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(width, rank) * 0.01)
        self.b = torch.nn.Parameter(torch.zeros(rank, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a @ self.b  # type: ignore[no-any-return]


def make_model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(LoRALinear(width, rank=4) for _ in range(layers)))


def retired(root: Path) -> list[str]:
    """The step directories kept only because kept steps refer to their data."""
    return sorted(p.parent.name for p in root.glob("step-*/retired"))


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


async def main(mode: bool | str, steps: int, width: int, layers: int) -> None:
    model = make_model(width, layers)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=1e-3)
    root = Path(tempfile.mkdtemp(prefix="lora-"))
    chain = [HostMemoryTier(256 << 20), FileTier(root, keep_last=5)]
    expected = {}
    async with lazyckpt.Checkpointer(chain, incremental=mode) as ckpt:
        ckpt.guard(optim)
        for step in range(steps):
            x = torch.randn(32, width, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad()
            handle = await ckpt.snapshot({"model": model, "optim": optim, "step": step}, step=step)
            expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
            if step == 0:
                # a snapshot is compared with the newest step committed on the tier when its
                # shards get there: here the steps take milliseconds, so let the first one,
                # which writes the frozen base, become durable before the next ones follow
                await handle.committed()
        await ckpt.drain()
        file = ckpt.metrics()["tiers"]["file"]
        state = sum(t.nbytes for t in model.state_dict().values())
        print(f"state: {state / 2**20:.1f} MiB of weights, {sum(p.numel() for p in trainable)} trainable values")
        print(
            f"written to the file tier: {file['bytes'] / 2**20:.1f} MiB for {steps} snapshots "
            f"({file['reused_bytes'] / 2**20:.1f} MiB referred to instead of written)"
        )
    # closed: retention is done; a new Checkpointer (as a restarted job would open) restores
    print(f"on disk with keep_last=5: {disk_bytes(root) / 2**20:.1f} MiB")
    async with lazyckpt.Checkpointer([FileTier(root, readonly=True)]) as reader:
        kept = await reader.steps()
        print(f"kept steps: {kept}; retired: {await asyncio.to_thread(retired, root)}")
        for step in kept:
            fresh = make_model(width, layers)
            fresh_optim = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad])
            await reader.restore(step=step, into={"model": fresh, "optim": fresh_optim, "step": 0})
            same = all(torch.equal(v, expected[step][k]) for k, v in fresh.state_dict().items())
            assert same, f"step {step} differs"
        print(f"every kept step restored bit for bit ({len(kept)} steps)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["true", "versions"], default="true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(main(True if args.mode == "true" else "versions", args.steps, args.width, args.layers))
