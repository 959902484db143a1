"""One rank of a multi-process test: ``python dist_worker.py SCENARIO ROOT OUT`` with RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT in the environment. Writes a JSON result."""

from __future__ import annotations

import asyncio
import errno
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lazyckpt
from lazyckpt import hooks
from tiers import FileTier, HostMemoryTier

if __package__ in (None, ""):  # run as a script: make the helpers package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.ranks import commit_each


def state_of(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(128, 96, generator=g), "bias": torch.randn(96, generator=g), "step": step}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


async def run(scenario: str, root: Path, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = {"rank": rank}
    chain = [HostMemoryTier(4 << 20), FileTier(root)]
    options: dict[str, Any] = {"shard_size": 1 << 14, "deadline": 8.0, "retries": 0}
    if scenario == "kill" and rank == 1:
        hooks.crash_at("file.commit.before_manifest", 3)  # during the commit of step 2
    if scenario == "fail" and rank == 1:
        calls = [0]

        def refuse(point: str) -> None:
            if point == "file.commit.before_manifest":
                calls[0] += 1
                if calls[0] == 3:  # this rank cannot commit its part of step 2
                    raise OSError(errno.EIO, "injected I/O error")

        hooks.set_hook(refuse)
    async with lazyckpt.Checkpointer(chain, **options) as ckpt:
        if scenario in ("commit", "kill", "fail"):
            steps = range(3 if scenario == "kill" else 4)
            result["errors"] = await commit_each(ckpt, ((s, state_of(rank, s)) for s in steps))
            if scenario == "kill":
                return result  # the peer is gone: no more collectives
        if scenario == "delete":
            result["errors"] = await commit_each(ckpt, ((s, state_of(rank, s)) for s in range(4)))
            await ckpt.delete(1)
            await ckpt.delete(3)  # the newest: step 3 may be taken again (a rollback)
            handle = await ckpt.snapshot(state_of(rank, 3), step=3)
            try:
                await ckpt.delete(3)
            except lazyckpt.SnapshotInFlightError:
                result["in_flight_refused"] = True
            await handle.committed()
        result["steps"] = await ckpt.steps()
        restored = await ckpt.restore()
        result["restored_step"] = restored["step"]
        result["restored_ok"] = same(restored, state_of(rank, restored["step"]))
        result["collectives"] = ckpt._core.engine.coordinator.collectives  # type: ignore[union-attr]
    return result


def main() -> None:
    scenario, root, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    result = asyncio.run(run(scenario, root, rank))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if scenario != "kill":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
