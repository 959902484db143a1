"""The crash child of :mod:`crash_child`, training under DeepSpeed (CPU accelerator, ZeRO-1,
gloo, world size 1) with :class:`~lazyckpt.integrations.deepspeed.LazyCheckpointEngine`.

Run as ``python crash_child_deepspeed.py ROOT STEPS WAIT``. It resumes from
``ROOT/ds``'s ``latest`` if there is one (as a restarted job does), then trains STEPS steps
and checkpoints after each one through lazyckpt (``wait`` is the engine's, ``durable`` or
``captured``). Before each checkpoint it saves the same state with DeepSpeed's default
engine under ``ROOT/ref``, so a checker can compare what lazyckpt loads for a tag, bit for
bit, with what ``torch.load`` reads for it.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
if "MASTER_PORT" not in os.environ:
    with socket.socket() as _s:
        _s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(_s.getsockname()[1])
for _k, _v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(_k, _v)

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine  # noqa: E402

from lazyckpt.integrations.deepspeed import LazyCheckpointEngine  # noqa: E402
from tiers import FileTier, HostMemoryTier  # noqa: E402

CONFIG = {
    "train_batch_size": 4,
    # torch's Adam: DeepSpeed's FusedAdam builds a C++ op on first use
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    "zero_optimization": {"stage": 1},
    "steps_per_print": 1 << 30,
}


def tiers(root: Path) -> list[Any]:
    return [HostMemoryTier(8 << 20), FileTier(root / "tiers", keep_last=4)]


def main(root: Path, steps: int, wait: str) -> None:
    save_dir, ref_dir = root / "ds", root / "ref"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=CONFIG
    )
    lazy = LazyCheckpointEngine(tiers(root), wait=wait)  # type: ignore[arg-type]
    engine.checkpoint_engine = lazy
    first = 0
    if (save_dir / "latest").exists():  # a restarted job resumes where the last one got to
        engine.load_checkpoint(str(save_dir))
        first = engine.global_steps
    print("opened", first, flush=True)
    torch_engine = TorchCheckpointEngine()
    for i in range(first, first + steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()  # commits the tag saved last (DeepSpeed's decoupled commit)
        tag = f"step{engine.global_steps}"
        # the reference first: a kill during it leaves no lazyckpt tag that needs it
        engine.checkpoint_engine = torch_engine
        engine.save_checkpoint(str(ref_dir), tag=tag, save_latest=False)
        engine.checkpoint_engine = lazy
        engine.save_checkpoint(str(save_dir), tag=tag)
        print("saved", tag, flush=True)
    engine.destroy()
    print("finished", flush=True)


def die_while_deepspeed_writes_latest() -> None:
    """SIGKILL this process the moment DeepSpeed's engine opens ``latest`` for writing
    (``open(path, "w")`` has truncated it, the tag is not written yet): the window a kill
    can land in whenever DeepSpeed itself writes ``latest``."""
    import builtins
    import signal

    import deepspeed.runtime.engine as ds_engine

    def dying_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = builtins.open(file, mode, *args, **kwargs)  # noqa: SIM115  # the caller closes it
        if str(file).endswith("latest") and "w" in mode:
            os.kill(os.getpid(), signal.SIGKILL)
        return handle

    ds_engine.open = dying_open  # shadows the builtin in that module


if __name__ == "__main__":
    if os.environ.get("LAZYCKPT_KILL_IN_LATEST"):
        die_while_deepspeed_writes_latest()
    deepspeed.init_distributed(dist_backend="gloo")
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
