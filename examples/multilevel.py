"""Multi-level checkpointing: every step to fast tiers, every tenth to slow storage.

A run snapshots a small model every step. Host memory and a node-local disk take every
snapshot; a "parallel file system" (a ZarrTier here, on a local folder; S3 or Lustre in a
real run) takes every 10th (``cadence={"pfs": 10}``) and keeps the best three by the
validation loss passed with each snapshot, plus the newest. When the run ends, ``close()``
also copies its last step to the parallel file system (an emergency copy, as on a
preemption), so a job restarted on another node loses nothing.

Run it as ``python examples/multilevel.py [--steps 35]``: it trains, prints which tier
holds which step and why the slow tier keeps each one, then restores the newest step from
the slow tier alone (the node-local copies are gone with the node) and checks it bit for
bit against the model's final state.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import lazyckpt
from lazyckpt import KeepBest, Retention
from tiers import FileTier, HostMemoryTier, ZarrTier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=35)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 64, generator=g), torch.randn(256, 1, generator=g)
    x_val, y_val = torch.randn(64, 64, generator=g), torch.randn(64, 1, generator=g)

    with tempfile.TemporaryDirectory() as root:
        local, pfs = Path(root) / "nvme", Path(root) / "pfs"
        chain = [
            HostMemoryTier(capacity_bytes=16 << 20),
            FileTier(local, name="nvme", keep_last=3),
            ZarrTier(pfs, name="pfs", retention=Retention(keep_last=1, keep_best=KeepBest("val_loss", 3))),
        ]
        with lazyckpt.SyncCheckpointer(chain, cadence={"pfs": 10}) as ckpt:
            ckpt.guard(optim)
            for step in range(1, args.steps + 1):
                batch = slice((step * 32) % 256, (step * 32) % 256 + 32)
                loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
                loss.backward()
                optim.step()
                optim.zero_grad()
                with torch.no_grad():
                    val = torch.nn.functional.mse_loss(model(x_val), y_val).item()
                handle = ckpt.snapshot(
                    {"model": model, "optim": optim, "step": step}, step=step, metrics={"val_loss": val}
                )
            handle.wait("nvme")
            try:
                handle.wait("pfs")
            except lazyckpt.TierSkippedError as exc:
                print(f"step {handle.step}: {exc}")
        # closed: the last step was copied to the parallel file system
        final = {k: v.clone() for k, v in model.state_dict().items()}
        print("\n$ lazyckpt ls", pfs.name)
        subprocess.run([sys.executable, "-m", "lazyckpt", "ls", str(pfs)], check=True)

        with lazyckpt.SyncCheckpointer([ZarrTier(pfs, readonly=True)]) as slow:
            steps = slow.steps()
            restored = slow.restore()
        assert steps[-1] == args.steps, steps
        same = all(torch.equal(final[k], restored["model"][k]) for k in final)
        print(f"\nrestored step {restored['step']} from the slow tier alone: bit for bit {same}")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
