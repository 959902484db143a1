"""One training process of a resume test:
``python worker.py RECIPE ROOT OUT STEPS [RESUME_AT]``.

Without RESUME_AT: train STEPS steps from scratch with ``guard(optimizer)`` on, snapshot after
every step (host memory, then files under ROOT), wait for every commit, and write the losses
and every snapshot failure to OUT. With RESUME_AT: build the objects from another seed,
restore step RESUME_AT from ROOT into them, and train the steps after it. Under several
ranks (RANK, WORLD_SIZE in the environment) each rank writes ``OUT.rank<N>``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from recipes import RECIPES

import lazyckpt
from tiers import FileTier, HostMemoryTier

if __package__ in (None, ""):  # run as a script: make the helpers package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.ranks import end_rank

OPTIONS: dict[str, Any] = {"shard_size": 1 << 16, "deadline": 60.0}


async def train(recipe_name: str, root: Path, steps: int) -> dict[str, Any]:
    recipe = RECIPES[recipe_name](seed=0)
    losses: list[float] = []
    failures: list[str] = []
    handles = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with lazyckpt.Checkpointer(
            [HostMemoryTier(64 << 20), FileTier(root)], **OPTIONS
        ) as ckpt:
            ckpt.guard(recipe.optimizer)
            for step in range(steps):
                losses.append(recipe.step(step))
                try:
                    handles.append(await ckpt.snapshot(recipe.state(), step=step))
                except lazyckpt.LazyCkptError as exc:  # an earlier snapshot's failure
                    failures.append(f"snapshot({step}): {type(exc).__name__}: {exc}")
            for handle in handles:
                try:
                    await handle.committed()
                except lazyckpt.LazyCkptError as exc:
                    failures.append(f"step {handle.step}: {type(exc).__name__}: {exc!r}")
                if handle.state() != "committed":
                    failures.append(f"step {handle.step} ended {handle.state()!r}")
            committed = await ckpt.steps()
    failures += [
        f"warning: {w.category.__name__}: {w.message}"
        for w in caught
        if w.category.__module__.startswith("lazyckpt")
    ]
    return {"losses": losses, "failures": failures, "committed": committed}


async def resume(recipe_name: str, root: Path, steps: int, at: int) -> dict[str, Any]:
    recipe = RECIPES[recipe_name](seed=1)  # other weights: only the restore can make them right
    state = recipe.state()
    async with lazyckpt.Checkpointer([FileTier(root)], **OPTIONS) as ckpt:
        await ckpt.restore(at, into=state)
    recipe.loaded(state)
    losses = [recipe.step(step) for step in range(at + 1, steps)]
    return {"losses": losses}


def main() -> None:
    name, root, out, steps = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    at = int(sys.argv[5]) if len(sys.argv) > 5 else None
    torch.set_num_threads(1)  # the same kernels in both processes, and a fair share of the CPU
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        torch.distributed.init_process_group("gloo", init_method="env://")
        out = out.with_name(f"{out.name}.rank{torch.distributed.get_rank()}")
    try:
        result = asyncio.run(
            train(name, root, steps) if at is None else resume(name, root, steps, at)
        )
        out.write_text(json.dumps(result))
    except BaseException:
        if distributed:
            torch.distributed.destroy_process_group()
        raise
    if distributed:
        end_rank()


if __name__ == "__main__":
    main()
