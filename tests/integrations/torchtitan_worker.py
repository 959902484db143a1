"""One rank of the torchtitan manager's multi-rank tests: ``python torchtitan_worker.py
SCENARIO FOLDER OUT`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment
(gloo).

``save-LAYOUT`` trains a two-Linear MLP laid out as LAYOUT with torchtitan's containers for 4
steps, saving every 2 through :class:`LazyCheckpointManager`; rank 0 also writes the full
tensors after step 4 (``expected.pt``) and the data-parallel degree (``saved.json``).
``load-LAYOUT`` builds the same MLP laid out as LAYOUT over whatever world size it runs
with, loads the latest step through ``manager.load()`` (the dataloader too where the
data-parallel degree is the saved one, else excluded: torchtitan's refuses another degree),
compares every tensor, gathered, with ``expected.pt`` and, where the dataloader loaded,
checks that its next batch is the fifth. ``save`` and ``load`` are ``save-fsdp`` and
``load-fsdp``. Layouts:

- ``fsdp``: ``fully_shard`` over every rank (a 1-D mesh), any world size;
- ``hsdp``: ``fully_shard`` on a 2-D mesh (replicate 2 x shard 2), 4 ranks;
- ``fsdp_tp``: ``parallelize_module`` (colwise, rowwise) on the ``tp`` dimension, then
  ``fully_shard`` on ``dp`` (FSDP2 over tensor parallelism: strided shards), 4 ranks.

``hf`` trains the tiny Llama of ``titan_llama.py`` sharded by FSDP2 with ``last_save_in_hf``
(rank 0 writes the trained weights in Hugging Face names to ``expected_hf.pt``), then loads
the Hugging Face directory it wrote into a freshly initialised, sharded model with
``initial_load_in_hf`` and compares. Each rank writes ``rank<N>.json``.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

from lazyckpt.integrations.torchtitan import LazyCheckpointManager

if __package__ in (None, ""):  # run as a script: make the helpers package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.ranks import end_rank
from titan_llama import TitanLlama, TitanLlamaAdapter

STEPS = 4


class Batches(IterableDataset[torch.Tensor]):
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.position = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.position += 1
            yield torch.randn(12, generator=torch.Generator().manual_seed(self.position))

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value.clone() if isinstance(value, torch.Tensor) else value


def sharded_llama(seed: int, world: int) -> TitanLlama:
    """TitanLlama with each block and the whole sharded by FSDP2, as torchtitan shards it."""
    torch.manual_seed(seed)
    model = TitanLlama()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def hf_scenario(folder: str, out: Path, rank: int, world: int) -> dict[str, Any]:
    model = sharded_llama(0, world)
    optimizers = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})
        ],
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=STEPS
    )
    dataloader = ParallelAwareDataloader(
        Batches(rank), dp_rank=rank, dp_world_size=world, batch_size=4
    )
    train_state = TrainState()
    parts = {"model_parts": [model], "optimizers": optimizers, "lr_schedulers": lr_schedulers}
    manager = LazyCheckpointManager.Config(
        enable=True, folder="ckpt", interval=2, last_save_in_hf=True, hf_max_shard_bytes=48 << 10
    ).build(
        dataloader=dataloader,
        states={"train_state": train_state},
        sd_adapter=TitanLlamaAdapter(),
        base_folder=folder,
        **parts,
    )
    batches = iter(dataloader)
    while train_state.step < STEPS:
        train_state.step += 1
        model(next(batches)).square().mean().backward()
        manager.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        manager.save(train_state.step, last_step=train_state.step == STEPS)
    manager.close()
    trained = {k: full(v) for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(TitanLlamaAdapter().to_hf(trained), out / "expected_hf.pt")

    fresh = sharded_llama(1, world)
    loader = LazyCheckpointManager.Config(
        enable=True,
        folder="ckpt-loaded",
        initial_load_in_hf=True,
        initial_load_path=str(Path(folder) / "ckpt" / "hf" / f"step-{STEPS}"),
    ).build(
        dataloader=None,
        states={},
        sd_adapter=TitanLlamaAdapter(),
        base_folder=folder,
        model_parts=[fresh],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
    )
    loaded = loader.load()
    loader.close()
    got = fresh.state_dict()
    return {
        "loaded": loaded,
        "sharded": all(isinstance(v, DTensor) for v in got.values()),
        "differ": sorted(k for k, v in trained.items() if not torch.equal(full(got[k]), v)),
    }


def mlp(layout: str, rank: int, world: int) -> tuple[torch.nn.Module, int, int]:
    """The MLP, seeded alike everywhere, laid out as ``layout``; with this rank's
    data-parallel rank and the data-parallel degree."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 5))
    if layout == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        return model, rank, world
    if world != 4:
        raise SystemExit(f"the {layout} layout runs on 4 ranks, not {world}")
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
        return model, rank, world
    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model, mesh["dp"].get_local_rank(), mesh["dp"].size()
    raise SystemExit(f"unknown layout {layout}")


def same(a: Any, b: Any) -> bool:
    """Equal bit for bit (dtype and shape too) for tensors, equal otherwise."""
    if isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return bool(a == b)


def layout_of(state: dict[str, Any]) -> dict[str, str]:
    """Each distributed tensor's mesh and placements, to see that a load keeps them."""
    return {
        k: f"{tuple(v.device_mesh.shape)} {v.placements}"
        for k, v in state.items()
        if isinstance(v, DTensor)
    }


def main() -> None:
    scenario, folder, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    warnings.simplefilter("ignore")  # torchdata's and torch's notices, not under test
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if scenario == "hf":
        result = {"rank": rank, "world": world, **hf_scenario(folder, out, rank, world)}
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        end_rank()
    action, _, layout = scenario.partition("-")
    if action not in ("save", "load"):
        raise SystemExit(f"unknown scenario {scenario}")
    model, dp_rank, dp_world = mlp(layout or "fsdp", rank, world)
    optimizers = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})
        ],
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=STEPS
    )
    dataloader = ParallelAwareDataloader(
        Batches(rank), dp_rank=dp_rank, dp_world_size=dp_world, batch_size=4
    )
    train_state = TrainState()
    # torchtitan's dataloader refuses another data-parallel degree: leave it out then, as
    # its own DCP manager needs too
    excluded = []
    if action == "load":
        saved = json.loads((out / "saved.json").read_text())
        if saved["dp_world"] != dp_world:
            excluded.append("dataloader")
    manager = LazyCheckpointManager.Config(
        enable=True,
        folder="ckpt",
        interval=2,
        last_save_model_only=False,
        host_bytes=8 << 20,
        exclude_from_loading=excluded,
    ).build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=folder,
    )
    result: dict[str, Any] = {"rank": rank, "world": world}
    if action == "save":
        batches = iter(dataloader)
        while train_state.step < STEPS:
            train_state.step += 1
            model(next(batches)).square().mean().backward()
            manager.maybe_wait_for_staging()
            optimizers.step()
            lr_schedulers.step()
            optimizers.zero_grad()
            manager.save(train_state.step, last_step=train_state.step == STEPS)
        expected = {
            "model": {k: full(v) for k, v in model.state_dict().items()},
            "optimizer": {k: full(v) for k, v in optimizers.state_dict().items()},
        }
        result["steps"] = manager.checkpointer.steps()
        if rank == 0:
            torch.save(expected, out / "expected.pt")
            (out / "saved.json").write_text(json.dumps({"dp_world": dp_world}))
    else:
        before = {**layout_of(model.state_dict()), **layout_of(optimizers.state_dict())}
        result["loaded"] = manager.load()
        expected = torch.load(out / "expected.pt", weights_only=True)
        model_state, optimizer_state = model.state_dict(), optimizers.state_dict()
        result["layout_kept"] = before == {**layout_of(model_state), **layout_of(optimizer_state)}
        got = {
            "model": {k: full(v) for k, v in model_state.items()},
            "optimizer": {k: full(v) for k, v in optimizer_state.items()},
        }
        result["differ"] = sorted(
            f"{part}/{k}"
            for part in expected
            for k in expected[part].keys() | got[part].keys()
            if not (
                k in got[part] and k in expected[part] and same(got[part][k], expected[part][k])
            )
        )
        result["step"] = train_state.step
        result["lr_epoch"] = lr_schedulers.state_dict()["last_epoch"]
        result["dataloader_loaded"] = "dataloader" not in excluded
        if "dataloader" not in excluded:  # it goes on at the 5th batch of 4 samples
            positions = range(4 * STEPS + 1, 4 * STEPS + 5)
            want = torch.stack(
                [torch.randn(12, generator=torch.Generator().manual_seed(p)) for p in positions]
            )
            result["next_batch_resumes"] = torch.equal(next(iter(dataloader)), want)
    manager.close()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_rank()


if __name__ == "__main__":
    main()
