"""One rank of the peer-replica tests: ``python peer_worker.py SCENARIO ROOT OUT`` with RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT in the environment. The first half of the
ranks play node "a", the others node "b"; each node has its own local tier and replica
directory under ROOT, and every rank shares ROOT/pfs, the slowest tier, whose reads are
counted. Writes a JSON result to OUT/rank<N>.json.

Scenarios: ``save`` snapshots steps 0..3 and waits for each commit; ``restore`` (a restarted
job) restores the newest step every rank agrees on and reports where the bytes came from.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lazyckpt
from lazyckpt import Manifest, ShardMeta, TierLevel
from tiers import FileTier, HostMemoryTier, PeerTier

if __package__ in (None, ""):  # run as a script: make the helpers package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.ranks import commit_each


class CountingFileTier(FileTier):
    """A FileTier that counts its reads (and can play the parallel file system's level)."""

    def __init__(self, *args: Any, level: TierLevel = TierLevel.LOCAL, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.level = level
        self.calls: Counter[str] = Counter()
        self.put_delay = 0.0

    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        await asyncio.sleep(self.put_delay)
        await super().put_shard(manifest, shard, data)

    async def read_manifest(self, step: int) -> Manifest:
        self.calls["read_manifest"] += 1
        return await super().read_manifest(step)

    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        self.calls["read_shard"] += 1
        await super().read_shard(manifest, shard, out)

    async def read_shard_checksummed(
        self, manifest: Manifest, shard: ShardMeta, out: memoryview
    ) -> int:
        self.calls["read_shard"] += 1  # a shard read all the same (a restore's usual one)
        return await super().read_shard_checksummed(manifest, shard, out)


def state_of(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {
        "w": torch.randn(256, 96, generator=g),  # six shards of 16 KiB
        "bias": torch.randn(96, generator=g),
        "step": step,
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


async def run(scenario: str, root: Path, rank: int, world: int) -> dict[str, Any]:
    node = "a" if rank < world // 2 else "b"
    local = CountingFileTier(root / f"node-{node}" / "local", name="local")
    peer = PeerTier(
        root / f"node-{node}" / "peer", node=node, address="127.0.0.1",
        timeout=10.0, linger=20.0, keep_last=2,
    )
    pfs = CountingFileTier(root / "pfs", name="pfs", level=TierLevel.PFS)
    # an arena of four shards and a slow parallel file system taking one shard at a time:
    # blocks already on the peer tier are evicted before the PFS took them, and the engine
    # reads them back from the peer tier (the tier before it)
    chain = [HostMemoryTier(64 << 10), local, peer, pfs]
    pfs.put_delay = 0.02 if scenario == "save" else 0.0
    options: dict[str, Any] = {
        "shard_size": 1 << 14, "deadline": 10.0, "retries": 1, "io_concurrency": 1,
    }
    result: dict[str, Any] = {"rank": rank, "node": node}
    async with lazyckpt.Checkpointer(chain, **options) as ckpt:
        result["holders"] = list(peer.holders)
        if scenario == "save":
            states = ((s, state_of(rank, s)) for s in range(4))
            result["errors"] = await commit_each(ckpt, states)
        result["steps"] = await ckpt.steps()
        if scenario == "restore":
            t0 = time.perf_counter()
            restored = await ckpt.restore()
            result["restore_s"] = time.perf_counter() - t0
            result["restored_step"] = restored["step"]
            result["restored_ok"] = same(restored, state_of(rank, restored["step"]))
        result["local_calls"] = dict(local.calls)
        result["pfs_calls"] = dict(pfs.calls)
        # let every rank finish reading from this one before it reports what it served
        await asyncio.to_thread(dist.barrier)
        result["served"] = dict(peer.served)
    return result


def main() -> None:
    scenario, root, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = asyncio.run(run(scenario, root, rank, world))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
