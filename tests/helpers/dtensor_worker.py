"""One rank of a DTensor test: ``python dtensor_worker.py SCENARIO ROOT OUT`` with RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT in the environment.

``save`` snapshots an FSDP2 model, its optimizer and plain DTensors (``Shard(0)``,
``Shard(1)``, ``Replicate``, a tensor marked ``Replicated``), then restores them on the same
world size; ``restore`` restores them onto whatever world size it runs with, into new
shardings. ``incremental`` snapshots four steps of a fine-tune (frozen DTensors, an adapter
that changes) incrementally, keeping the last two; ``incremental-restore`` restores the last
of them onto whatever world size it runs with. Rank 0 of ``save`` also writes the full tensors (``expected.pt``) for the test to
compare against. Each rank writes ``rank<N>.json``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import lazyckpt
from lazyckpt import Replicated
from lazyckpt._distributed.chunks import writer_of
from lazyckpt._format.walk import walk_state
from tiers import FileTier, HostMemoryTier

if __package__ in (None, ""):  # run as a script: make the helpers package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.ranks import end_rank

OPTIONS: dict[str, Any] = {"shard_size": 1 << 16, "deadline": 30.0, "retries": 0}
REPLICATED_KEYS = [f"rep/{i}" for i in range(8)]


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The global tensors every run shards (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(37, 24, generator=g),  # Shard(0): 37 rows do not split evenly
        "b": torch.randn(10, 1030, generator=g).to(torch.bfloat16),  # Shard(1)
        "c": torch.randn(64, 128, generator=g),  # Replicate: 32 KiB, its own shard
        "d": torch.randn(64, 128, generator=g),  # plain, marked Replicated: 32 KiB
    }


def model_of(seed: int, mesh: DeviceMesh) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same full weights on every rank before sharding
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 5))
    fully_shard(model, mesh=mesh)
    return model


def state_of(seed: int, mesh: DeviceMesh, *, dedup: bool = True) -> dict[str, Any]:
    full = full_tensors(seed)
    state: dict[str, Any] = {
        "a": distribute_tensor(full["a"], mesh, [Shard(0)]),
        "b": distribute_tensor(full["b"], mesh, [Shard(1)]),
        "c": distribute_tensor(full["c"], mesh, [Replicate()]),
        "d": Replicated(full["d"]),
        "rank_value": dist.get_rank(),
    }
    if not dedup:  # the same bytes, but as plain per-rank tensors: every rank writes them
        state["c"] = full["c"].clone()
        state["d"] = full["d"].clone()
    return state


def full_of(value: Any) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def compare(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ (bit for bit), or are missing."""
    return sorted(
        k
        for k in expected
        if k not in got
        or got[k].dtype != expected[k].dtype
        or not torch.equal(_bits(got[k]), _bits(expected[k]))
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def flat_full(state: dict[str, Any], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {k: full_of(state[k]) for k in ("a", "b", "c")}
    d = state["d"]
    out["d"] = d.value if isinstance(d, Replicated) else d
    for k, v in model.state_dict().items():
        out[f"model/{k}"] = full_of(v)
    return out


def data_bytes(root: Path, step: int) -> int:
    return sum(p.stat().st_size for p in (root / f"step-{step:012d}").glob("rank-*.data"))


def unsupported(mesh: DeviceMesh, world: int) -> list[str]:
    """What snapshot() refuses, by the class name of the error each raised."""
    found = []
    partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    cases: list[Any] = [partial]
    if world == 4:
        mesh2d = init_device_mesh("cpu", (2, 2))
        cases.append(distribute_tensor(torch.ones(4, 4), mesh2d, [Shard(0), Shard(1)]))
    for value in cases:
        try:
            walk_state({"x": value}, allow_pickle=False)
            found.append("accepted")
        except lazyckpt.UnsupportedStateError:
            found.append("UnsupportedStateError")
    return found


def versions(mesh: DeviceMesh) -> dict[str, bool]:
    """Whether a change made after snapshot() recorded a DTensor is visible to the check."""
    seen = {}
    for how in ("dtensor", "local"):
        d = distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)])
        _, (ref,) = walk_state({"x": d}, allow_pickle=False)
        if how == "dtensor":
            d.add_(1)  # bumps the DTensor's counter only
        else:
            d.to_local().add_(1)  # bumps the local tensor's counter only
        seen[how] = ref.tensor._version != ref.version
    return seen


async def save(root: Path, out: Path, rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    model = model_of(1, mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 12, generator=torch.Generator().manual_seed(5))).sum().backward()
    optim.step()
    state = state_of(2, mesh)
    rep = {
        k: distribute_tensor(torch.full((4,), 1.0), mesh, [Replicate()]) for k in REPLICATED_KEYS
    }
    result: dict[str, Any] = {"rank": rank}
    chain = [HostMemoryTier(8 << 20), FileTier(root)]
    async with lazyckpt.Checkpointer(chain, **OPTIONS) as ckpt:
        handle = await ckpt.snapshot({**state, "model": model, "optim": optim, "rep": rep}, step=1)
        await handle.committed()
        handle = await ckpt.snapshot(
            {**state_of(2, mesh, dedup=False), "model": model, "optim": optim, "rep": rep}, step=2
        )
        await handle.committed()
        result["steps"] = await ckpt.steps()
        expected = flat_full(state, model)
        optim_full = {
            f"optim/{i}/{name}": full_of(v)
            for i, s in optim.state_dict()["state"].items()
            for name, v in s.items()
        }
        # same world size: restore step 1 into fresh objects sharded the same way
        mesh_model = model_of(99, mesh)
        target = {**state_of(77, mesh), "model": mesh_model}
        target["d"] = Replicated(torch.zeros(64, 128))
        await ckpt.restore(1, into=target)
        result["same_world_mismatch"] = compare(flat_full(target, mesh_model), expected)
        result["rank_value"] = target["rank_value"]
    manifest = json.loads((root / "step-000000000001" / f"rank-{rank:05d}.json").read_text())
    result["modes"] = {t["key"]: t["mode"] for t in manifest["tensors"]}
    result["format_version"] = manifest["format_version"]
    result["unsupported"] = unsupported(mesh, world)
    result["versions"] = versions(mesh)
    if rank == 0:
        result["bytes_dedup"] = data_bytes(root, 1)
        result["bytes_plain"] = data_bytes(root, 2)
        result["writers"] = {k: writer_of(k, world) for k in ["c", "d", *REPLICATED_KEYS]}
        torch.save({**expected, **optim_full}, out / "expected.pt")
    return result


async def restore(root: Path, out: Path, rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    expected = torch.load(out.parent / "expected.pt")
    model = model_of(99, mesh)
    full = full_tensors(77)
    target: dict[str, Any] = {
        "a": distribute_tensor(full["a"], mesh, [Shard(1)]),  # saved as Shard(0)
        "b": distribute_tensor(full["b"], mesh, [Shard(0)]),  # saved as Shard(1)
        "c": distribute_tensor(full["c"], mesh, [Replicate()]),
        "d": Replicated(torch.zeros(64, 128)),
        "model": model,
    }
    result: dict[str, Any] = {"rank": rank}
    async with lazyckpt.Checkpointer([FileTier(root)], **OPTIONS) as ckpt:
        result["steps"] = await ckpt.steps()
        await ckpt.restore(1, into=target)
        wanted = {k: v for k, v in expected.items() if not k.startswith("optim/")}
        result["into_mismatch"] = compare(flat_full(target, model), wanted)
        plain = await ckpt.restore(1)  # no target: full tensors, assembled
        got = {k: plain[k] for k in ("a", "b", "c", "d")}
        got.update({f"model/{k}": v for k, v in plain["model"].items()})
        got.update(
            {
                f"optim/{i}/{name}": v
                for i, s in plain["optim"]["state"].items()
                for name, v in s.items()
            }
        )
        result["full_mismatch"] = compare(got, expected)
        result["rank_value"] = plain["rank_value"]
    return result


def adapter_of(step: int, mesh: DeviceMesh) -> DTensor:
    g = torch.Generator().manual_seed(100 + step)
    return distribute_tensor(torch.randn(16, 8, generator=g), mesh, [Shard(0)])


async def incremental_save(root: Path, out: Path, rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    frozen = state_of(2, mesh)
    result: dict[str, Any] = {"rank": rank, "written": []}
    options = {**OPTIONS, "incremental": True}
    async with lazyckpt.Checkpointer([FileTier(root, keep_last=2)], **options) as ckpt:
        for step in range(1, 5):
            state = {**frozen, "adapter": adapter_of(step, mesh)}
            await (await ckpt.snapshot(state, step=step)).committed()
            result["written"].append(ckpt.metrics()["tiers"]["file"]["bytes"])
    dist.barrier()  # every rank's retention is done (closing waits for it)
    async with lazyckpt.Checkpointer([FileTier(root, readonly=True)], **OPTIONS) as ckpt:
        result["steps"] = await ckpt.steps()
    manifest = json.loads((root / "step-000000000004" / f"rank-{rank:05d}.json").read_text())
    result["stored_in"] = sorted({s["stored_in"] for s in manifest["shards"] if "stored_in" in s})
    result["retired_data"] = (root / "step-000000000001" / f"rank-{rank:05d}.data").exists()
    expected = {k: full_of(frozen[k]) for k in ("a", "b", "c")}  # collectives: every rank
    expected["adapter"] = full_of(adapter_of(4, mesh))
    if rank == 0:
        torch.save(expected, out / "expected.pt")
    return result


async def incremental_restore(root: Path, out: Path, rank: int, world: int) -> dict[str, Any]:
    expected = torch.load(out.parent / "expected.pt")
    async with lazyckpt.Checkpointer([FileTier(root)], **OPTIONS) as ckpt:
        plain = await ckpt.restore(4)
    return {"rank": rank, "mismatch": compare({k: plain[k] for k in expected}, expected)}


async def one_replica(root: Path, out: Path, rank: int, world: int) -> dict[str, Any]:
    """One tensor marked ``Replicated``: one rank writes it, the others hold a replica
    entry, and the writer needs nothing from them; a restore on every rank (into new
    tensors and into live ones) must still take the same path everywhere."""
    g = torch.Generator().manual_seed(11)
    shared = torch.randn(32, 16, generator=g)
    own = torch.full((8,), float(rank))
    result: dict[str, Any] = {"rank": rank}
    async with lazyckpt.Checkpointer([FileTier(root)], **OPTIONS) as ckpt:
        handle = await ckpt.snapshot({"shared": Replicated(shared), "own": own}, step=1)
        await handle.committed()
        plain = await ckpt.restore()
        result["plain_ok"] = bool(torch.equal(plain["shared"], shared) and torch.equal(plain["own"], own))
        target = {"shared": Replicated(torch.zeros(32, 16)), "own": torch.zeros(8)}
        await ckpt.restore(1, into=target)
        value = target["shared"].value
        result["into_ok"] = bool(torch.equal(value, shared) and torch.equal(target["own"], own))
    manifest = json.loads((root / "step-000000000001" / f"rank-{rank:05d}.json").read_text())
    result["modes"] = {t["key"]: t["mode"] for t in manifest["tensors"]}
    return result


SCENARIOS = {
    "save": save,
    "restore": restore,
    "incremental": incremental_save,
    "one-replica": one_replica,
    "incremental-restore": incremental_restore,
}


def main() -> None:
    scenario, root, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    run = SCENARIOS[scenario]
    result = asyncio.run(run(root, out, rank, world))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_rank()


if __name__ == "__main__":
    main()
