"""One rank of the 2-D mesh kill soak, for tests/test_layouts_soak.py.

``layouts_soak_worker.py MODE ROOT OUT STEPS`` on 4 gloo ranks, the HSDP 2x2 layout of
``layouts_worker.py`` (``fully_shard`` on a 2-D mesh, plus an expert weight sharded over a
sub-mesh) trained with AdamW on data that is a pure function of the step, so the state
after step s is the same in every run that reaches s.

Modes:

- ``reference``: train steps 1..STEPS without a Checkpointer, uninterrupted; rank 0 saves
  every step's full tensors (model, experts, optimizer state) to ``OUT/reference.pt``;
- ``train``: open ROOT (a FileTier keeping its last KEEP steps), restore the newest step it
  lists (none: start from the initial weights), write ``OUT/started<rank>``, then train and
  snapshot every step, with the guard on, up to the newest listed step + STEPS. The test
  kills the whole job somewhere in there (from outside, or at a crash point);
- ``check``: list ROOT's steps and restore every one of them into a model and optimizer built
  from another seed on the same layout; rank 0 saves each step's full tensors to
  ``OUT/restored.pt``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lazyckpt
from tiers import FileTier

if __package__ in (None, ""):  # run as a script: make the helpers package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.layouts_worker import OPTIONS, build, full, model_full, train_step
from helpers.ranks import end_rank

KEEP = 3  # the training tier's retention: the kills land in its deletes too
LAYOUT = "hsdp"


def full_state(
    model: torch.nn.Module, optim: torch.optim.Optimizer, extra: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Every tensor of the training state, whole: the model's, the experts', the optimizer's."""
    out = model_full(model, extra)
    for index, slots in optim.state_dict()["state"].items():
        for name, value in slots.items():
            out[f"optim/{index}/{name}"] = full(value).detach().clone()
    return out


def setup(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any], Any]:
    model, extra, dp = build(LAYOUT, seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), extra, dp


async def reference(root: Path, out: Path, steps: int) -> dict[str, Any]:
    model, optim, extra, dp = setup(seed=1)
    states = {}
    for step in range(1, steps + 1):
        train_step(model, optim, step, dp)
        states[step] = full_state(model, optim, extra)
    if dist.get_rank() == 0:
        torch.save(states, out / "reference.pt")
    return {"steps": steps}


async def train(root: Path, out: Path, steps: int) -> dict[str, Any]:
    model, optim, extra, dp = setup(seed=1)
    async with lazyckpt.Checkpointer([FileTier(root, keep_last=KEEP)], **OPTIONS) as ckpt:
        listed = await ckpt.steps()
        newest = listed[-1] if listed else 0
        if newest:
            train_step(model, optim, 0, dp)  # the optimizer's state exists, to be overwritten
            await ckpt.restore(newest, into={"model": model, "optim": optim, **extra})
        (out / f"started{dist.get_rank()}").write_text(str(newest))
        t0 = time.monotonic()
        ckpt.guard(optim)
        for step in range(newest + 1, newest + steps + 1):
            train_step(model, optim, step, dp)
            await ckpt.snapshot({"model": model, "optim": optim, **extra}, step=step)
        await ckpt.drain()
    return {"resumed_from": newest, "last": newest + steps, "seconds": time.monotonic() - t0}


async def check(root: Path, out: Path, steps: int) -> dict[str, Any]:
    model, optim, extra, dp = setup(seed=99)
    train_step(model, optim, 0, dp)  # the optimizer's state exists, to be overwritten
    restored = {}
    async with lazyckpt.Checkpointer([FileTier(root)], **OPTIONS) as ckpt:
        listed = await ckpt.steps()
        for step in listed:
            await ckpt.restore(step, into={"model": model, "optim": optim, **extra})
            restored[step] = full_state(model, optim, extra)
    if dist.get_rank() == 0:
        torch.save(restored, out / "restored.pt")
    return {"listed": listed}


MODES = {"reference": reference, "train": train, "check": check}


def main() -> None:
    mode, root, out, steps = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    result = asyncio.run(MODES[mode](root, out, steps))
    result["rank"] = rank
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_rank()


if __name__ == "__main__":
    main()
