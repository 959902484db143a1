"""A training-like process for the crash tests: snapshots a reproducible state every step.

Run as ``python crash_child.py ROOT TIER FIRST_STEP LAST_STEP [WAIT]`` (ROOT a directory, or
an S3 prefix ``s3://bucket/prefix``: see :func:`durable_tier`) where WAIT is
``captured`` (the default, as a guarded training loop does) or ``committed`` (each snapshot
is durable before the next step starts). The state of step s is a pure
function of s (see :func:`state_of`), so a checker in another process can rebuild exactly
what was snapshotted at any step and compare it bit for bit with what was restored.

With ``LAZYCKPT_CHILD_CADENCE`` set the chain is host memory, a node-local FileTier
(ROOT/file, every step) and a ZarrTier standing for the parallel file system (ROOT/zarr,
every 3rd step), each keeping its last 3 steps; closing writes the last step to the
parallel file system as an emergency copy when its cadence skipped it.

With ``LAZYCKPT_CHILD_INCREMENTAL`` set (``1`` or ``versions``) the snapshots are incremental
and the state is a fine-tune's (:func:`incremental_state_of`): frozen weights, the same
tensors at every step, beside a small part that changes.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import torch

import lazyckpt
from tiers import FileTier, HostMemoryTier

SHARD = 1 << 16


def state_of(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w1": torch.randn(256, 192, generator=g),
            "w2": torch.randn(192, 256, generator=g).to(torch.bfloat16),
            "norms": [torch.randn(64, generator=g) for _ in range(20)],
        },
        "optim": {"exp_avg": torch.randn(300, 100, generator=g), "step": step},
        "step": step,
    }


_FROZEN: dict[int, dict[str, torch.Tensor]] = {}
PHASE = 4  # the frozen weights change every PHASE steps (a new stage of the fine-tune)


def incremental_state_of(step: int) -> dict[str, Any]:
    """A fine-tune's state at ``step``: frozen weights, the same tensor objects for the
    steps of one phase in a process (the same bytes in every process), and adapters that
    change at every step. Every PHASE steps the frozen weights change, so the step that
    wrote the old ones is eventually referred to by nobody and its data collected."""
    phase = step // PHASE
    if phase not in _FROZEN:
        _FROZEN.clear()
        g = torch.Generator().manual_seed(4242 + phase)
        _FROZEN[phase] = {f"layer{i}": torch.randn(256, 192, generator=g) for i in range(3)}
    g = torch.Generator().manual_seed(step)
    return {
        "base": dict(_FROZEN[phase]),
        "adapter": {"a": torch.randn(64, 32, generator=g), "b": torch.randn(32, 64, generator=g)},
        "optim": {"exp_avg": torch.randn(300, 100, generator=g), "step": step},
        "step": step,
    }


def incremental_mode() -> bool | str:
    mode = os.environ.get("LAZYCKPT_CHILD_INCREMENTAL", "")
    return {"": False, "1": True}.get(mode, mode)


def durable_tier(root: Path | str, kind: str, **kwargs: Any) -> lazyckpt.Tier:
    """The durable tier of kind ``kind`` under ``root``: a directory, or an S3 prefix
    (``s3://bucket/prefix``, ZarrTier only), whose server and credentials come from the
    standard ``AWS_*`` environment variables, with a lease of ``LAZYCKPT_CHILD_LEASE``
    seconds where that is set (a killed writer's lease must run out before the next one
    opens: a short one keeps the kill tests quick)."""
    if isinstance(root, str) and root.startswith("s3://"):
        lease = os.environ.get("LAZYCKPT_CHILD_LEASE")
        if lease:
            kwargs.setdefault("lease_seconds", float(lease))
        return lazyckpt.load_tier(kind, f"{root}/{kind}", **kwargs)
    root = Path(root)
    if kind == "file":
        return FileTier(root / "file", **kwargs)
    return lazyckpt.load_tier(kind, str(root / kind), **kwargs)


async def main(root: Path | str, kind: str, first: int, last: int, wait: str) -> None:
    options: dict[str, Any] = {}
    if os.environ.get("LAZYCKPT_CHILD_CADENCE"):
        assert isinstance(root, Path)
        chain = [
            HostMemoryTier(4 << 20),
            FileTier(root / "file", name="local", keep_last=3),
            lazyckpt.load_tier("zarr", str(root / "zarr"), name="pfs", keep_last=3),
        ]
        options["cadence"] = {"pfs": 3}
    else:
        chain = [HostMemoryTier(4 << 20), durable_tier(root, kind, keep_last=3)]
    pause = float(os.environ.get("LAZYCKPT_CHILD_PAUSE", "0"))  # seconds between steps
    incremental = incremental_mode()
    make_state = incremental_state_of if incremental else state_of
    async with lazyckpt.Checkpointer(
        chain, shard_size=SHARD, pack_bytes=4096, incremental=incremental, **options
    ) as ckpt:
        print("opened", flush=True)
        for step in range(first, last):
            handle = await ckpt.snapshot(make_state(step), step=step)
            if wait == "committed":
                await handle.committed()
            else:
                await ckpt.wait_captured()  # as the guard would before the next optimizer step
            await asyncio.sleep(pause)
        if os.environ.get("LAZYCKPT_CHILD_HOLD"):  # stay the location's writer until told
            print("holding", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
    print("finished", flush=True)


if __name__ == "__main__":
    wait = sys.argv[5] if len(sys.argv) > 5 else "captured"
    where = sys.argv[1] if sys.argv[1].startswith("s3://") else Path(sys.argv[1])
    asyncio.run(main(where, sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), wait))
