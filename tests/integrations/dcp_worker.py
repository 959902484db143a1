"""One rank of the DCP backend's FSDP2 test: ``python dcp_worker.py SCENARIO ROOT OUT`` with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (gloo on loopback).

``save`` trains an FSDP2 model with AdamW for two steps and saves it with
``dcp.async_save`` through lazyckpt (step 1), then once more with ``dcp.save`` after a third
step (step 2); rank 0 also writes the full tensors of step 1 (``expected.pt``). ``load``
builds the same model sharded over whatever world size it runs with, loads step 1 with
``dcp.load`` and compares the full tensors. Each rank writes ``rank<N>.json``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save, save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import lazyckpt
from lazyckpt.integrations.dcp import LazyStorageReader, LazyStorageWriter
from tiers import FileTier, HostMemoryTier

if __package__ in (None, ""):  # run as a script: make the helpers package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.ranks import end_rank


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same full weights everywhere before sharding
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 5))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 12, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def full(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: full(v) for k, v in state.items()}
    if isinstance(state, list):
        return [full(v) for v in state]
    if isinstance(state, DTensor):
        return state.full_tensor()
    return state.clone() if isinstance(state, torch.Tensor) else state  # the optimizer's
    # step counters are updated in place


def flat(state: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for k, v in items:
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict | list):
            out.update(flat(v, key))
        else:
            out[key] = v
    return out


def dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def main() -> None:
    scenario, root, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    warnings.simplefilter("ignore")  # DCP warns about its experimental async path
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(world)
    # DCP's background thread runs its collectives on a group of its own, as torchtitan does:
    # FSDP's all-gathers on the default group go on meanwhile
    dcp_group = dist.new_group(backend="gloo")
    result: dict[str, Any] = {"rank": rank, "world": world}
    tiers = [HostMemoryTier(16 << 20), FileTier(root)]
    with lazyckpt.SyncCheckpointer(tiers, shard_size=1 << 16, deadline=60.0) as ckpt:
        if scenario == "save":
            train(model, opt, 0)
            train(model, opt, 1)
            state = dcp_state(model, opt)
            response = async_save(
                state,
                checkpoint_id="1",
                storage_writer=LazyStorageWriter(ckpt),
                process_group=dcp_group,
            )
            result["response"] = type(response).__name__
            assert isinstance(response, AsyncSaveResponse)
            response.staging_completion.result()
            expected = full(dcp_state(model, opt))
            train(model, opt, 2)  # changes the tensors while step 1 may still be uploading
            response.upload_completion.result()
            save(
                dcp_state(model, opt),
                checkpoint_id="2",
                storage_writer=LazyStorageWriter(ckpt),
                process_group=dcp_group,
            )
            result["steps"] = ckpt.steps()
            if rank == 0:
                torch.save(expected, out / "expected.pt")
        else:
            state = dcp_state(model, opt)
            reader = LazyStorageReader(ckpt)
            load(state, checkpoint_id="1", storage_reader=reader, process_group=dcp_group)
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            loaded = flat(full(dcp_state(model, opt)))
            expected = flat(torch.load(out / "expected.pt", weights_only=True))
            result["keys"] = sorted(loaded) == sorted(expected)
            result["differ"] = sorted(
                k
                for k in expected
                if not (
                    torch.equal(loaded[k], expected[k])
                    if isinstance(expected[k], torch.Tensor)
                    else loaded[k] == expected[k]
                )
            )
            result["steps"] = ckpt.steps()
            plain = ckpt.restore(1)  # the same step through lazyckpt's own API
            result["restored_keys"] = sorted(plain)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_rank()


if __name__ == "__main__":
    main()
