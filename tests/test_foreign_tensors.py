"""Torch's legacy ``ShardedTensor`` (FSDP1's ``SHARDED_STATE_DICT``, accelerate's FSDP1
default) is stored from its local shards' metadata, as a DTensor's chunk is, and comes back
resharded; what lazyckpt cannot describe is refused by name, with what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers.ranks import free_port, launch_ranks, rank_results

WORKER = Path(__file__).parent / "helpers" / "sharded_tensor_worker.py"


def test_a_sharded_tensor_is_stored_and_restored_on_any_layout(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    launch_ranks(WORKER, [str(root), str(out)], 2, timeout=150)
    found = rank_results(out)
    assert sorted(found) == [0, 1]
    for rank, r in found.items():
        assert r == {
            "rank": rank,
            "into_same": True,
            "into_resharded": True,
            "into_full": True,
            "dcp_resharded": True,
        }
    # one process, no process group: the whole tensor, assembled from both ranks' shards
    script = (
        "import sys, torch, lazyckpt\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from sharded_tensor_worker import full\n"
        "from tiers import FileTier\n"
        "with lazyckpt.SyncCheckpointer([FileTier(sys.argv[1], readonly=True)]) as c:\n"
        "    print(torch.equal(c.restore(1)['model']['w'], full()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(root), str(WORKER.parent)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.stdout.strip() == "True", done.stderr[-2000:]


# a process of its own: the sharded tensor needs an initialized process group
SEVERAL_SHARDS = """
import tempfile
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
from torch.distributed._shard.sharded_tensor import empty
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
import lazyckpt
from tiers import FileTier
spec = EnumerableShardingSpec([
    ShardMetadata([0, 0], [4, 4], "rank:0/cpu"), ShardMetadata([4, 0], [4, 4], "rank:0/cpu"),
])
st = empty(spec, 8, 4)
with lazyckpt.SyncCheckpointer([FileTier(tempfile.mkdtemp())]) as ckpt:
    try:
        ckpt.snapshot({"model": {"w": st}}, step=1)
    except lazyckpt.UnsupportedStateError as exc:
        print("snapshot:", exc)
    print("steps:", ckpt.steps())
dist.destroy_process_group()
"""


def test_a_sharded_tensor_of_several_local_shards_is_refused_naming_its_key() -> None:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    out = subprocess.run(
        [sys.executable, "-c", SEVERAL_SHARDS], capture_output=True, text=True, env=env, timeout=120
    )
    lines = out.stdout.splitlines()
    snapshot = next((line for line in lines if line.startswith("snapshot:")), out.stderr[-2000:])
    assert "'model/w' has 2 local shards" in snapshot and "DTensor" in snapshot
    assert "steps: []" in lines
