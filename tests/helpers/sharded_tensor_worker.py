"""One rank of a job holding torch's legacy ``ShardedTensor`` (FSDP1's sharded state dict),
for tests/test_foreign_tensors.py.

``python sharded_tensor_worker.py ROOT OUT`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. Rows split unevenly (11 over 2 ranks: 6 and 5). Writes OUT/rankN.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import empty
from torch.distributed._shard.sharding_spec import ChunkShardingSpec

import lazyckpt
from lazyckpt.integrations.dcp import LazyStorageReader, LazyStorageWriter
from tiers import FileTier

ROWS, COLS = 11, 6


def full() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3))


def sharded(dim: int, world: int, fill: torch.Tensor | None) -> Any:
    spec = ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = empty(spec, ROWS, COLS)
    if fill is not None:
        local = st.local_shards()[0]
        box = tuple(
            slice(o, o + n)
            for o, n in zip(local.metadata.shard_offsets, local.metadata.shard_sizes, strict=True)
        )
        local.tensor.copy_(fill[box])
    return st


def local_equals(st: Any, whole: torch.Tensor) -> bool:
    local = st.local_shards()[0]
    box = tuple(
        slice(o, o + n)
        for o, n in zip(local.metadata.shard_offsets, local.metadata.shard_sizes, strict=True)
    )
    return bool(torch.equal(local.tensor, whole[box]))


def main(root: Path, out: Path) -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    whole = full()
    result: dict[str, Any] = {"rank": rank}
    with lazyckpt.SyncCheckpointer([FileTier(root)]) as ckpt:
        state = {"model": {"w": sharded(0, world, whole)}, "step": 1}
        ckpt.snapshot(state, step=1).wait()
        same = {"model": {"w": sharded(0, world, None)}, "step": 0}
        ckpt.restore(1, into=same)
        result["into_same"] = local_equals(same["model"]["w"], whole)
        other = {"model": {"w": sharded(1, world, None)}, "step": 0}
        ckpt.restore(1, into=other)  # saved by rows, wanted by columns
        result["into_resharded"] = local_equals(other["model"]["w"], whole)
        plain = {"model": {"w": torch.zeros(ROWS, COLS)}, "step": 0}
        ckpt.restore(1, into=plain)
        result["into_full"] = bool(torch.equal(plain["model"]["w"], whole))
        dcp.save({"w": sharded(0, world, whole)}, storage_writer=LazyStorageWriter(ckpt, step=2))
        loaded = {"w": sharded(1, world, None)}
        dcp.load(loaded, storage_reader=LazyStorageReader(ckpt, step=2))
        result["dcp_resharded"] = local_equals(loaded["w"], whole)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
