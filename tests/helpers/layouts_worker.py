"""One rank of a job laid out with torch's own parallelism APIs, for tests/test_layouts.py.

``layouts_worker.py SCENARIO LAYOUT ROOT OUT`` on 4 gloo ranks (or any world for ``fsdp``).
Layouts of a two-block MLP trained with AdamW:

- ``hsdp``: ``fully_shard`` on a 2-D mesh (replicate 2 x shard 2), plus an expert weight
  sharded over the mesh's shard dimension and replicated over the other;
- ``fsdp_tp``: ``parallelize_module`` (colwise, rowwise) on the ``tp`` dimension, then
  ``fully_shard`` on ``dp`` (FSDP2 over tensor parallelism: strided shards);
- ``pp``: two pipeline stages run by ``torch.distributed.pipelining`` (``PipelineStage``,
  ``ScheduleGPipe``, two microbatches), each stage ``fully_shard`` over its own pair of
  ranks, each rank holding only its stage's block (the full model's names kept);
- ``pp_plain``: the same two stages on 2 ranks, one stage each, nothing sharded (each
  rank's tensors are plain, under its own stage's names);
- ``fsdp``: ``fully_shard`` over every rank (a 1-D mesh), the target of other layouts;
- ``tp``: ``parallelize_module`` (colwise, rowwise) over every rank.

Scenarios: ``train`` snapshots every step with the guard on and records the losses of the
steps after the snapshot it resumes from; ``resume`` restores that snapshot into a model and
optimizer built from another seed on the same layout and trains on, recording the losses;
``reshard`` restores the model saved on another layout into this one and records whether
every full tensor matches.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import lazyckpt
from tiers import FileTier

if __package__ in (None, ""):  # run as a script: make the helpers package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.ranks import end_rank

RESUME_AT = 3  # the step resumed from: losses of steps 4 and 5 are compared
STEPS = 5
OPTIONS: dict[str, Any] = {"shard_size": 1 << 16, "deadline": 60.0}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(16, 32)
        self.w2 = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleDict({"0": Block(), "1": Block()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


def build(layout: str, seed: int) -> tuple[torch.nn.Module, dict[str, Any], Any]:
    """The model laid out, the extra distributed state, and the data parallel coordinate
    (which batch this rank sees)."""
    world = dist.get_world_size()
    model = Net(seed)
    extra: dict[str, Any] = {}
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, extra, dist.get_rank()
    if layout == "tp":  # tensor parallelism over every rank
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            parallelize_module(block, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        return model, extra, 0  # every rank sees the same batch
    if layout == "pp_plain":  # a pipeline stage per rank, nothing sharded: plain tensors
        stage = dist.get_rank()
        del model.layers[str(1 - stage)]
        pipe = PipelineStage(model, stage, 2, torch.device("cpu"))
        schedules[model] = (ScheduleGPipe(pipe, n_microbatches=2, loss_fn=_pipeline_loss), pipe)
        return model, extra, 0
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    if layout == "hsdp":
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        g = torch.Generator().manual_seed(seed + 1)
        experts = torch.randn(4, 8, 8, generator=g)  # sharded over "b", replicated over "a"
        extra["experts"] = distribute_tensor(experts, mesh, [Replicate(), Shard(0)])
        return model, extra, dist.get_rank()
    if layout == "fsdp_tp":
        for block in model.layers.values():
            parallelize_module(block, mesh["b"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
            fully_shard(block, mesh=mesh["a"])
        fully_shard(model, mesh=mesh["a"])
        return model, extra, mesh.get_coordinate()[0]  # the tp ranks see the same batch
    if layout == "pp":
        stage, dp = mesh.get_coordinate()
        del model.layers[str(1 - stage)]  # this stage's block only, under its full name
        fully_shard(model.layers[str(stage)], mesh=mesh["b"])
        # torch's own pipelining: stage 0 of each data-parallel pair sends its activations
        # to stage 1, which computes the loss, and the gradients come back
        pipe = PipelineStage(model, stage, 2, torch.device("cpu"), group=mesh["a"].get_group())
        schedules[model] = (ScheduleGPipe(pipe, n_microbatches=2, loss_fn=_pipeline_loss), pipe)
        return model, extra, dp
    raise SystemExit(f"unknown layout {layout}")


def batch(step: int, dp: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + dp))


def _pipeline_loss(out: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


# a pipeline stage's schedule and stage, by its model
schedules: dict[torch.nn.Module, tuple[ScheduleGPipe, PipelineStage]] = {}


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, dp: int) -> float:
    """One step; its loss (under pipelining, the last stage's mean over the microbatches,
    0.0 on the first stage, whose weights the last stage's losses depend on)."""
    optim.zero_grad()
    if model in schedules:
        schedule, stage = schedules[model]
        x = batch(step, dp)
        losses: list[torch.Tensor] = []
        if stage.is_first:
            schedule.step(x)
        else:
            schedule.step(target=torch.zeros_like(x), losses=losses)
        optim.step()
        return float(torch.stack([v.detach() for v in losses]).mean()) if losses else 0.0
    loss = model(batch(step, dp)).pow(2).mean()
    loss.backward()
    optim.step()
    return float(loss.detach().item())


def full(v: Any) -> torch.Tensor:
    return v.full_tensor() if isinstance(v, DTensor) else v


def model_full(model: torch.nn.Module, extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": full(v).detach().clone() for k, v in model.state_dict().items()}
    out.update({k: full(v).clone() for k, v in extra.items()})
    return out


async def train(layout: str, root: Path, out: Path) -> dict[str, Any]:
    model, extra, dp = build(layout, seed=1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: dict[int, float] = {}
    result: dict[str, Any] = {}
    async with lazyckpt.Checkpointer([FileTier(root)], **OPTIONS) as ckpt:
        ckpt.guard(optim)
        for step in range(1, STEPS + 1):
            losses[step] = train_step(model, optim, step, dp)
            handle = await ckpt.snapshot({"model": model, "optim": optim, **extra}, step=step)
            if step == RESUME_AT:
                await handle.committed()
                result["saved"] = {k: v.tolist() for k, v in model_full(model, extra).items()}
        await ckpt.drain()
        result["steps"] = await ckpt.steps()
    result["losses"] = {str(k): v for k, v in losses.items() if k > RESUME_AT}
    return result


async def resume(layout: str, root: Path, out: Path) -> dict[str, Any]:
    model, extra, dp = build(layout, seed=99)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optim, 0, dp)  # the optimizer's state exists, to be overwritten
    async with lazyckpt.Checkpointer([FileTier(root)], **OPTIONS) as ckpt:
        await ckpt.restore(RESUME_AT, into={"model": model, "optim": optim, **extra})
    losses = {
        str(step): train_step(model, optim, step, dp) for step in range(RESUME_AT + 1, STEPS + 1)
    }
    return {"losses": losses}


async def reshard(layout: str, root: Path, out: Path) -> dict[str, Any]:
    """Restore the model saved (on another layout) into this layout's model."""
    model, extra, _ = build(layout, seed=99)
    async with lazyckpt.Checkpointer([FileTier(root)], **OPTIONS) as ckpt:
        await ckpt.restore(RESUME_AT, into={"model": model, **extra})
    return {"restored": {k: v.tolist() for k, v in model_full(model, extra).items()}}


async def dcp_round_trip(layout: str, root: Path, out: Path) -> dict[str, Any]:
    """``dcp.save`` of this layout's model and optimizer through lazyckpt's storage writer,
    then ``dcp.load`` into a model and optimizer built from another seed, same layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lazyckpt.integrations.dcp import LazyStorageReader, LazyStorageWriter

    model, extra, dp = build(layout, seed=1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optim, 1, dp)
    saved = model_full(model, extra)
    msd, osd = get_state_dict(model, optim)
    with lazyckpt.SyncCheckpointer([FileTier(root)], **OPTIONS) as ckpt:
        dcp.save(
            {"model": msd, "optim": osd, **extra}, storage_writer=LazyStorageWriter(ckpt, step=1)
        )
    other, extra2, _ = build(layout, seed=99)
    optim2 = torch.optim.AdamW(other.parameters(), lr=1e-2)
    train_step(other, optim2, 1, dp)
    msd2, osd2 = get_state_dict(other, optim2)
    state = {"model": msd2, "optim": osd2, **extra2}
    with lazyckpt.SyncCheckpointer([FileTier(root)], **OPTIONS) as ckpt:
        dcp.load(state, storage_reader=LazyStorageReader(ckpt, step=1))
    set_state_dict(other, optim2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for k in extra2:
        extra2[k] = state[k]
    got = model_full(other, extra2)
    mismatch = [k for k in saved if not torch.equal(saved[k], got[k])]
    # and the losses of the next step agree
    return {
        "mismatch": mismatch,
        "saved": {k: v.tolist() for k, v in saved.items() if k.startswith("model/")},
        "next_loss": [train_step(model, optim, 2, dp), train_step(other, optim2, 2, dp)],
    }


async def dcp_load(layout: str, root: Path, out: Path) -> dict[str, Any]:
    """``dcp.load`` of the model ``dcp_round_trip`` saved (on another layout) into this
    layout's model, with torch's own state-dict helpers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from lazyckpt.integrations.dcp import LazyStorageReader

    model, extra, _ = build(layout, seed=99)
    state = {"model": get_model_state_dict(model)}
    with lazyckpt.SyncCheckpointer([FileTier(root)], **OPTIONS) as ckpt:
        dcp.load(state, storage_reader=LazyStorageReader(ckpt, step=1))
    set_model_state_dict(model, state["model"])
    return {"restored": {k: v.tolist() for k, v in model_full(model, extra).items()}}


async def refuse(layout: str, root: Path, out: Path) -> dict[str, Any]:
    """Restore the step saved on another layout into full tensors on every rank, rank 1's
    target for one of them the wrong shape: rank 1 refuses, and no rank may wait for it."""
    async with lazyckpt.Checkpointer([FileTier(root)], **OPTIONS) as ckpt:
        full = await ckpt.restore(RESUME_AT)
        target = {"model": {k: torch.zeros_like(v) for k, v in full["model"].items()}}
        if dist.get_rank() == 1:
            target["model"]["layers.0.w1.weight"] = torch.zeros(7, 3)
        try:
            await ckpt.restore(RESUME_AT, into=target)
        except lazyckpt.LazyCkptError as exc:
            loaded = any(v.any() for v in target["model"].values() if v.shape != (7, 3))
            return {"error": type(exc).__name__, "message": str(exc), "loaded": loaded}
    return {"error": None}


async def host_incremental(layout: str, root: Path, out: Path) -> dict[str, Any]:
    """Replicated DTensors that do not change, snapshotted incrementally through the host
    tier and a FileTier, restored at once in the same processes: the host tier's manifest
    of a step and the FileTier's differ (the FileTier's refers the unchanged shards to step
    1), and a rank reading another's shards must use the FileTier's."""
    from tiers import HostMemoryTier

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(1)
    frozen = {
        k: distribute_tensor(torch.randn(64, 128, generator=g), mesh, [Replicate()]) for k in "cdef"
    }
    chain = [HostMemoryTier(64 << 20), FileTier(root)]
    async with lazyckpt.Checkpointer(chain, incremental=True, **OPTIONS) as ckpt:
        for step in (1, 2):
            changing = distribute_tensor(torch.randn(16, 8, generator=g), mesh, [Shard(0)])
            await (await ckpt.snapshot({**frozen, "a": changing}, step=step)).committed()
        got = await ckpt.restore(2)
    return {"mismatch": [k for k in frozen if not torch.equal(full(got[k]), full(frozen[k]))]}


def ddp_state(seed: int) -> dict[str, Any]:
    """A data-parallel state: 16 MiB of weights identical on every rank, marked so."""
    g = torch.Generator().manual_seed(seed)
    weights = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(16)}
    return {"model": lazyckpt.Replicated(weights), "rank": dist.get_rank()}


def _read_bytes() -> int:
    """Bytes this process read through read(2)/pread(2) so far (page cache or not)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


async def ddp_save(layout: str, root: Path, out: Path) -> dict[str, Any]:
    async with lazyckpt.Checkpointer([FileTier(root)], **OPTIONS) as ckpt:
        await (await ckpt.snapshot(ddp_state(1), step=1)).committed()
    stored = sum(p.stat().st_size for p in (root / f"step-{1:012d}").glob("rank-*.data"))
    return {"stored": stored}


class CountingTier(FileTier):
    """A FileTier that records whose manifests this rank reads; with ``fail_first`` its
    first read of another rank's manifest fails (a reader that cannot read it)."""

    def __init__(self, *args: Any, fail_first: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.manifests_read: list[int] = []
        self.fail_first = fail_first

    async def read_rank_manifest(self, step: int, rank: int) -> Any:
        if self.fail_first and rank != dist.get_rank():
            self.fail_first = False
            raise lazyckpt.TierError(f"rank {rank}'s manifest: injected read failure")
        self.manifests_read.append(rank)
        return await super().read_rank_manifest(step, rank)


async def ddp_restore(layout: str, root: Path, out: Path) -> dict[str, Any]:
    target = ddp_state(99)
    # layout "flaky": rank 1 cannot read the first other rank's manifest it tries
    tier = CountingTier(root, fail_first=layout == "flaky" and dist.get_rank() == 1)
    async with lazyckpt.Checkpointer([tier], **OPTIONS) as ckpt:
        before = _read_bytes()
        await ckpt.restore(1, into=target)
        read = _read_bytes() - before
        coordinator = ckpt._core.engine.coordinator
        sent = coordinator.sent_bytes if coordinator is not None else 0
    expected = ddp_state(1)["model"].value
    got = target["model"].value
    return {
        "read": read,
        "sent": sent,
        "mismatch": [k for k in expected if not torch.equal(expected[k], got[k])],
        "rank_value": target["rank"],
        "manifests_read": tier.manifests_read,
    }


SCENARIOS = {
    "train": train,
    "resume": resume,
    "reshard": reshard,
    "dcp": dcp_round_trip,
    "dcp-load": dcp_load,
    "refuse": refuse,
    "host-incremental": host_incremental,
    "ddp-save": ddp_save,
    "ddp-restore": ddp_restore,
}


def main() -> None:
    scenario, layout, root, out = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    result = asyncio.run(SCENARIOS[scenario](layout, root, out))
    result["rank"] = rank
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_rank()


if __name__ == "__main__":
    main()
