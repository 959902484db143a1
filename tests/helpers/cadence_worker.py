"""One rank of a job whose tiers have cadences, for tests/test_cadence.py.

``python cadence_worker.py ROOT OUT MODE`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (gloo on loopback). Every rank snapshots steps 1..12 through a node-local
FileTier (ROOT/local) and a ZarrTier (ROOT/pfs) and writes OUT/rank-N.json: per step,
which tiers its handle reached and which it skipped, and the drain's emergency copy.

MODE ``timed``: the parallel file system's cadence is by time (0.25 s), and the ranks'
clocks disagree on purpose (rank 0 pauses 0.05 s between steps, rank 1 0.11 s), so
without an agreement they would take different steps. MODE ``every``: a cadence of every
5 steps, then ``drain()`` writes step 12 to the PFS as an emergency copy.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lazyckpt
from tiers import FileTier, ZarrTier


def state_of(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step + 1000 * rank)
    return {"w": torch.randn(64, 64, generator=g), "step": step}


def main(root: Path, out: Path, mode: str) -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    if mode == "timed":
        cadence: lazyckpt.Cadence = lazyckpt.Cadence(seconds=0.25)
    else:
        cadence = lazyckpt.Cadence(every=5)
    chain = [FileTier(root / "local", name="local"), ZarrTier(root / "pfs", name="pfs")]
    result: dict[str, Any] = {"steps": {}}
    with lazyckpt.SyncCheckpointer(chain, shard_size=1 << 16, cadence={"pfs": cadence}) as ckpt:
        handles = []
        for step in range(1, 13):
            handles.append(ckpt.snapshot(state_of(step, rank), step=step))
            time.sleep(0.05 if rank == 0 else 0.11)
        for h in handles:
            h.wait("committed")
            got = {}
            for tier in ("local", "pfs"):
                try:
                    h.wait(tier)
                    got[tier] = "reached"
                except lazyckpt.TierSkippedError:
                    got[tier] = "skipped"
            result["steps"][str(h.step)] = got
        report = ckpt.drain()
        result["emergency"] = {str(k): list(v) for k, v in report.emergency.items()}
    with lazyckpt.SyncCheckpointer([ZarrTier(root / "pfs", name="pfs")]) as pfs:
        steps = pfs.steps()
        restored = pfs.restore(steps[-1])
        result["pfs_steps"] = steps
        result["restored_ok"] = bool(
            torch.equal(restored["w"], state_of(steps[-1], rank)["w"])
        )
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
