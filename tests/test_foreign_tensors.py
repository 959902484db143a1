"""Tensor types lazyckpt does not store are refused by name and type, with what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers.ranks import free_port

# a process of its own: the sharded tensor needs an initialized process group
SCRIPT = """
import os, sys, tempfile
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
from torch.distributed._shard.sharded_tensor import empty
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
import torch.distributed.checkpoint as dcp
import lazyckpt
from lazyckpt.integrations.dcp import LazyStorageWriter
from tiers import FileTier
st = empty(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 8, 4)
with lazyckpt.SyncCheckpointer([FileTier(tempfile.mkdtemp())]) as ckpt:
    try:
        ckpt.snapshot({"model": {"w": st}}, step=1)
    except lazyckpt.UnsupportedStateError as exc:
        print("snapshot:", exc)
    try:
        dcp.save({"model": {"w": st}}, storage_writer=LazyStorageWriter(ckpt, step=2))
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        print("dcp:", str(exc).replace(chr(10), " "))
    print("steps:", ckpt.steps())
dist.destroy_process_group()
os._exit(0)
"""


def test_a_sharded_tensor_is_refused_naming_its_key_and_type() -> None:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    lines = out.stdout.splitlines()
    snapshot = next(line for line in lines if line.startswith("snapshot:"))
    assert "'model/w' is a ShardedTensor" in snapshot
    assert "DTensor" in snapshot and "changed while" not in snapshot
    dcp_line = next(line for line in lines if line.startswith("dcp:"))
    assert "is a ShardedTensor" in dcp_line and "changed while" not in dcp_line
    assert "steps: []" in lines
