"""One rank of the torchtitan manager's FSDP2 test: ``python torchtitan_worker.py SCENARIO
FOLDER OUT`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (gloo).

``save`` trains an FSDP2 model with torchtitan's containers for 4 steps, saving every 2
through :class:`LazyCheckpointManager`; rank 0 also writes the full tensors after step 4
(``expected.pt``). ``load`` builds the same model sharded over whatever world size it runs
with, loads the latest step and compares. Each rank writes ``rank<N>.json``.
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


def main() -> None:
    scenario, folder, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    warnings.simplefilter("ignore")  # torchdata's and torch's notices, not under test
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
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
