"""The crash child of :mod:`crash_child`, saving through Lightning's checkpoint plugin
:class:`~lazyckpt.integrations.lightning.LazyCheckpointIO` the way ``ModelCheckpoint`` does
with ``save_top_k=K`` (the K newest) and ``save_last=True``: each step ``step=S.ckpt`` (if
K > 0) and ``last.ckpt``, and the file of step S-K removed.

Run as ``python crash_child_lightning.py ROOT FIRST_STEP LAST_STEP K``; the pointer files
go to ``ROOT/ckpts``, the steps to the tiers under ``ROOT/tiers``.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from lazyckpt.integrations.lightning import LazyCheckpointIO
from tiers import FileTier, HostMemoryTier

if __package__ in (None, ""):  # run as a script: make the helpers package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.crash_child import SHARD, state_of


def checkpoint_of(step: int) -> dict[str, Any]:
    """What the Trainer would hand the plugin at ``step`` (a pure function of it)."""
    state = state_of(step)
    return {"global_step": step, "epoch": 0, "state_dict": state["model"], "optim": state["optim"]}


def main(root: Path, first: int, last: int, keep: int) -> None:
    warnings.simplefilter("ignore")  # used outside a Trainer: each save waits for its capture
    folder = root / "ckpts"
    io = LazyCheckpointIO(
        [HostMemoryTier(4 << 20), FileTier(root / "tiers")], shard_size=SHARD, pack_bytes=4096
    )
    with io:
        print("opened", flush=True)
        for step in range(first, last):
            if keep:
                io.save_checkpoint(checkpoint_of(step), folder / f"step={step}.ckpt")
            io.save_checkpoint(checkpoint_of(step), folder / "last.ckpt")
            if keep and (folder / f"step={step - keep}.ckpt").exists():
                io.remove_checkpoint(folder / f"step={step - keep}.ckpt")
            print("saved", step, flush=True)
            time.sleep(float(os.environ.get("LAZYCKPT_CHILD_PAUSE", "0")))  # between steps
    print("finished", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
