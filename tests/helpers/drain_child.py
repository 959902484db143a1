"""A training-like process for the preemption tests.

``python drain_child.py ROOT MODE`` snapshots step 1 (and waits until it is durable), then
snapshots step 2 and waits only until it is captured (as the guard does), prints
``captured`` and waits for SIGTERM from the parent. The durable tier is slow (every call
0.15 s), so step 2 is still on its way when the signal comes. MODE ``default`` leaves
SIGTERM's default action; ``previous`` installs a Python handler first, which the
Checkpointer's handler must chain to (it prints and exits with code 3). The state of a
step is :func:`state_of` (a pure function of it), for the parent to compare bit for bit.

MODE ``crash`` snapshots steps 1 to 3 through host memory, a node-local FileTier
(ROOT/local) and a ZarrTier standing for the parallel file system (ROOT/pfs), waits until
each is committed everywhere, then dies by SIGKILL (a crash: nothing is closed).

MODE ``cadence`` runs as ``default`` through host memory, a node-local FileTier
(ROOT/local) and a ZarrTier standing for the parallel file system (ROOT/pfs) whose cadence
(every 100 steps) skips steps 1 and 2: the preemption's drain must leave step 2 on the
parallel file system through an emergency copy.

With RANK and WORLD_SIZE in the environment (as torchrun sets them) it is one rank of
several (gloo on loopback); MODE ``restore`` then restores the latest step on every rank
and prints whether it is bit for bit the state of that step (``restore-pfs``: from ROOT/pfs).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

import lazyckpt
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier, ZarrTier


class SlowFileTier(FileTier):
    """A FileTier whose every shard write takes 0.15 s more (a busy parallel file system);
    unlike a FaultyTier it keeps FileTier's commit across ranks."""

    async def put_shard(self, manifest: Any, shard: Any, data: memoryview) -> None:
        await asyncio.sleep(0.15)
        await super().put_shard(manifest, shard, data)


def state_of(step: int, rank: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step + 1000 * rank)
    return {
        "model": {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)},
        "optim": {"exp_avg": torch.randn(512, 256, generator=g), "step": step},
        "step": step,
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def main(root: Path, mode: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    rank = int(os.environ.get("RANK", "0"))
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://")
        if mode in ("restore", "restore-pfs"):
            tier = FileTier(root) if mode == "restore" else ZarrTier(root / "pfs", name="pfs")
            with lazyckpt.SyncCheckpointer([tier]) as ckpt:
                restored = ckpt.restore()
                print(f"restored step {restored['step']}", same(restored, state_of(restored["step"], rank)), flush=True)
            dist.destroy_process_group()
            return
    if mode == "crash":
        chain = [HostMemoryTier(8 << 20), FileTier(root / "local", name="local"), ZarrTier(root / "pfs", name="pfs")]
        ckpt = lazyckpt.SyncCheckpointer(chain, shard_size=1 << 16).open()
        for step in (1, 2, 3):
            ckpt.snapshot(state_of(step), step=step).wait("committed")
        print("committed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "previous":

        def previous(signum: int, _frame: object) -> None:
            print(f"previous handler ran for {signal.Signals(signum).name}", flush=True)
            sys.exit(3)

        signal.signal(signal.SIGTERM, previous)
    if mode == "cadence":
        chain = [
            HostMemoryTier(8 << 20),
            FileTier(root / "local", name="local"),
            ZarrTier(root / "pfs", name="pfs"),
        ]
        with lazyckpt.SyncCheckpointer(
            chain,
            shard_size=1 << 16,
            preemption_signals=(signal.SIGTERM,),
            preemption_grace=30,
            cadence={"pfs": 100},
        ) as ckpt:
            ckpt.snapshot(state_of(1, rank), step=1).wait("committed")
            ckpt.snapshot(state_of(2, rank), step=2)
            ckpt.wait_captured()
            print("captured", flush=True)
            time.sleep(60)
            print("not preempted", flush=True)
        return
    slow: lazyckpt.Tier
    if "WORLD_SIZE" in os.environ:
        slow = SlowFileTier(root, name="file")
    else:
        slow = FaultyTier(FileTier(root), name="file")
        slow.delay_s = 0.15
    chain = [HostMemoryTier(8 << 20), slow]
    with lazyckpt.SyncCheckpointer(
        chain, shard_size=1 << 16, preemption_signals=(signal.SIGTERM,), preemption_grace=30
    ) as ckpt:
        ckpt.snapshot(state_of(1, rank), step=1).wait("committed")
        ckpt.snapshot(state_of(2, rank), step=2)
        ckpt.wait_captured()
        print("captured", flush=True)
        time.sleep(60)  # training would go on here; the signal ends it
        print("not preempted", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
