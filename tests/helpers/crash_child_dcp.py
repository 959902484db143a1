"""The crash child of :mod:`crash_child`, saving through PyTorch DCP: each step is a
``dcp.async_save`` with :class:`~lazyckpt.integrations.dcp.LazyStorageWriter`.

Run as ``python crash_child_dcp.py ROOT FIRST_STEP LAST_STEP``. It waits for each save's
``staging_completion`` only (as a training loop does before its next optimizer step), prints
``staged S`` then, and ``durable S`` when the save's ``upload_completion`` resolves, so a
checker knows which steps were promised durable before the process was killed.
"""

from __future__ import annotations

import sys
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path

from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

import lazyckpt
from lazyckpt.integrations.dcp import LazyStorageWriter
from tiers import FileTier, HostMemoryTier

if __package__ in (None, ""):  # run as a script: make the helpers package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.crash_child import SHARD, state_of

_print_lock = threading.Lock()


def say(line: str) -> None:
    with _print_lock:  # the durable lines come from DCP's threads
        print(line, flush=True)


def main(root: Path, first: int, last: int) -> None:
    # DCP warns that it runs without a process group, and that async_save is experimental
    warnings.simplefilter("ignore")
    chain = [HostMemoryTier(4 << 20), FileTier(root / "file", keep_last=3)]
    pending: list[Future[None]] = []
    with lazyckpt.SyncCheckpointer(chain, shard_size=SHARD, pack_bytes=4096) as ckpt:
        say("opened")
        for step in range(first, last):
            response = async_save(
                state_of(step), checkpoint_id=str(step), storage_writer=LazyStorageWriter(ckpt)
            )
            assert isinstance(response, AsyncSaveResponse)  # the writer stages: never a plain Future
            response.staging_completion.result()
            say(f"staged {step}")

            def durable(done: Future[None], step: int = step) -> None:
                if done.exception() is None:
                    say(f"durable {step}")

            response.upload_completion.add_done_callback(durable)
            pending.append(response.upload_completion)
        for done in pending:
            done.result()
    say("finished")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
