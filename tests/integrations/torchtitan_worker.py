"""One rank of the torchtitan manager's FSDP2 test: ``python torchtitan_worker.py SCENARIO
FOLDER OUT`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (gloo).

``save`` trains an FSDP2 model with torchtitan's containers for 4 steps, saving every 2
through :class:`LazyCheckpointManager`; rank 0 also writes the full tensors after step 4
(``expected.pt``). ``load`` builds the same model sharded over whatever world size it runs
with, loads the latest step and compares. ``hf`` trains the tiny Llama of ``titan_llama.py``
sharded by FSDP2 with ``last_save_in_hf`` (rank 0 writes the trained weights in Hugging Face
names to ``expected_hf.pt``), then loads the Hugging Face directory it wrote into a freshly
initialised, sharded model with ``initial_load_in_hf`` and compares. Each rank writes
``rank<N>.json``.
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


def main() -> None:
    scenario, folder, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    warnings.simplefilter("ignore")  # torchdata's and torch's notices, not under test
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if scenario == "hf":
        result = {"rank": rank, "world": world, **hf_scenario(folder, out, rank, world)}
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        end_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 5))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
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
    # torchtitan's dataloader refuses another data-parallel degree: leave it out, as its
    # own DCP manager needs too
    excluded = ["dataloader"] if scenario == "load" else []
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
    if scenario == "save":
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
    else:
        result["loaded"] = manager.load()
        expected = torch.load(out / "expected.pt", weights_only=True)
        got = {
            "model": {k: full(v) for k, v in model.state_dict().items()},
            "optimizer": {k: full(v) for k, v in optimizers.state_dict().items()},
        }
        result["differ"] = sorted(
            f"{part}/{k}"
            for part in expected
            for k, v in expected[part].items()
            if not (
                torch.equal(got[part][k], v) if isinstance(v, torch.Tensor) else got[part][k] == v
            )
        )
        result["step"] = train_state.step
        result["lr_epoch"] = lr_schedulers.state_dict()["last_epoch"]
    manager.close()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_rank()


if __name__ == "__main__":
    main()
