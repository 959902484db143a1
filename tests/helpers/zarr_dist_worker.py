"""One rank of a multi-process ZarrTier test: ``python zarr_dist_worker.py SCENARIO LOCATION
OUT`` with RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT in the environment (and
the S3 settings in the standard ``AWS_*`` variables when LOCATION is ``s3://...``). Each rank
writes ``OUT/rank<N>.json``.

- ``save``: four steps of per-rank state through host memory and a ZarrTier keeping the last
  two, then restores the newest and the older kept one.
- ``kill``: a ZarrTier alone; rank 1 SIGKILLs itself while committing step 2.
- ``restore``: restores the newest step every rank agrees on.
- ``dtensor``: an FSDP2 model, its Adam state and plain DTensors (``Shard(0)``, ``Shard(1)``,
  ``Replicate``), restored on the same ranks into other shardings; rank 0 writes the full
  tensors to ``OUT/expected.pt``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lazyckpt
from lazyckpt import hooks
from tiers import HostMemoryTier, ZarrTier

if __package__ in (None, ""):  # run as a script: make the helpers package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.ranks import commit_each, end_rank

# The deadline only bounds a hang: on a loaded machine a tier operation or a collective may
# take seconds, and a short one fails healthy steps.
OPTIONS: dict[str, Any] = {
    "shard_size": 1 << 14,
    "pack_bytes": 2048,
    "deadline": 60.0,
    "retries": 0,
}


def state_of(rank: int, step: int) -> dict[str, Any]:
    """What rank ``rank`` snapshots at ``step``: chunked, packed, bfloat16 and plain values."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {
        "w": torch.randn(128, 96, generator=g),  # several chunk shards
        "bias": torch.randn(96, generator=g),  # packed
        "half": torch.randn(40, 33, generator=g).to(torch.bfloat16),
        "step": step,
        "rank": rank,
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    if isinstance(b, dict):
        return isinstance(a, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in b)
    return bool(a == b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


async def save(location: str, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = {"rank": rank}
    chain = [HostMemoryTier(4 << 20), ZarrTier(location, keep_last=2)]
    async with lazyckpt.Checkpointer(chain, **OPTIONS) as ckpt:
        for step in range(4):
            handle = await ckpt.snapshot(state_of(rank, step), step=step)
            await handle.committed()
    # a fresh Checkpointer over the ZarrTier alone: every byte comes from the store
    async with lazyckpt.Checkpointer(
        [ZarrTier(location)], staging_bytes=1 << 20, **OPTIONS
    ) as ckpt:
        result["zarr_steps"] = await ckpt.steps()
        newest = await ckpt.restore()
        older = await ckpt.restore(2)
    result["restored_step"] = newest["step"]
    result["restored_ok"] = same(newest, state_of(rank, 3)) and same(older, state_of(rank, 2))
    return result


async def kill(location: str, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = {"rank": rank}
    if rank == 1:
        hooks.crash_at("tier.commit.before", 3)  # committing its part of step 2
    # rank 0 learns of the dead rank from its closed connection at once; the deadline bounds
    # how long it would wait for one that hangs instead
    options = {**OPTIONS, "deadline": 20.0}
    async with lazyckpt.Checkpointer(
        [ZarrTier(location)], staging_bytes=1 << 20, **options
    ) as ckpt:
        result["errors"] = await commit_each(ckpt, ((s, state_of(rank, s)) for s in range(3)))
    return result


async def restore(location: str, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = {"rank": rank}
    async with lazyckpt.Checkpointer(
        [ZarrTier(location)], staging_bytes=1 << 20, **OPTIONS
    ) as ckpt:
        result["steps"] = await ckpt.steps()
        restored = await ckpt.restore()
    result["restored_step"] = restored["step"]
    result["restored_ok"] = same(restored, state_of(rank, restored["step"]))
    return result


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {
        "a": torch.randn(37, 24, generator=g),  # Shard(0): 37 rows do not split evenly
        "b": torch.randn(10, 1030, generator=g).to(torch.bfloat16),  # Shard(1)
        "c": torch.randn(64, 128, generator=g),  # Replicate: written by one rank only
    }


async def dtensor(location: str, out: Path, rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def model_of(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)  # the same full weights on every rank before sharding
        model = torch.nn.Sequential(
            torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 5)
        )
        fully_shard(model, mesh=mesh)
        return model

    def full_of(value: Any) -> torch.Tensor:
        return value.full_tensor() if isinstance(value, DTensor) else value

    model = model_of(1)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 12, generator=torch.Generator().manual_seed(5))).sum().backward()
    optim.step()
    full = full_tensors()
    state = {
        "a": distribute_tensor(full["a"], mesh, [Shard(0)]),
        "b": distribute_tensor(full["b"], mesh, [Shard(1)]),
        "c": distribute_tensor(full["c"], mesh, [Replicate()]),
        "model": model,
        "optim": optim,
    }
    result: dict[str, Any] = {"rank": rank}
    async with lazyckpt.Checkpointer(
        [ZarrTier(location)], staging_bytes=1 << 20, **OPTIONS
    ) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
        result["steps"] = await ckpt.steps()
        # the same ranks, other shardings: rank r needs the other rank's chunks too
        fresh = model_of(99)
        zeros = {k: torch.zeros_like(v) for k, v in full.items()}
        target = {
            "a": distribute_tensor(zeros["a"], mesh, [Shard(1)]),
            "b": distribute_tensor(zeros["b"], mesh, [Shard(0)]),
            "c": distribute_tensor(zeros["c"], mesh, [Replicate()]),
            "model": fresh,
        }
        await ckpt.restore(1, into=target)
    expected = {**full, **{f"model/{k}": full_of(v) for k, v in model.state_dict().items()}}
    got = {k: full_of(target[k]) for k in ("a", "b", "c")}
    got.update({f"model/{k}": full_of(v) for k, v in fresh.state_dict().items()})
    result["mismatch"] = sorted(k for k in expected if not same(got.get(k), expected[k]))
    optim_full = {
        f"optim/{i}/{name}": full_of(v)
        for i, s in optim.state_dict()["state"].items()
        for name, v in s.items()
    }
    if rank == 0:
        torch.save({**expected, **optim_full}, out / "expected.pt")
    return result


def main() -> None:
    scenario, location, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    if scenario == "save":
        result = asyncio.run(save(location, rank))
    elif scenario == "kill":
        result = asyncio.run(kill(location, rank))
    elif scenario == "restore":
        result = asyncio.run(restore(location, rank))
    else:
        result = asyncio.run(dtensor(location, out, rank, world))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if scenario != "kill":
        end_rank()


if __name__ == "__main__":
    main()
