"""DeepSpeed scenarios in a process of their own: ``python deepspeed_worker.py SCENARIO ROOT``.

DeepSpeed initializes torch.distributed and global state, so each scenario runs in a fresh
process (world size 1, gloo, CPU accelerator) and prints one JSON line, prefixed ``RESULT``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
if "MASTER_PORT" not in os.environ:
    with socket.socket() as _s:
        _s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(_s.getsockname()[1])
for _k, _v in (("RANK", "0"), ("WORLD_SIZE", "1")):
    os.environ.setdefault(_k, _v)
os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # the ranks share one machine

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine  # noqa: E402

from lazyckpt.integrations.deepspeed import LazyCheckpointEngine  # noqa: E402
from lazyckpt.testing import FaultyTier  # noqa: E402
from tiers import FileTier, HostMemoryTier  # noqa: E402

CONFIG = {
    "train_batch_size": 4,
    # torch's Adam: DeepSpeed's CPU FusedAdam keeps its bias correction in process-global
    # state, which a resumed run does not reproduce bit for bit with any checkpoint engine
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
    "zero_optimization": {"stage": 1},
    "steps_per_print": 1 << 30,
}


def make_engine(seed: int) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=CONFIG
    )
    return engine


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    # each rank its own data (ZeRO-1 averages the ranks' gradients)
    g = torch.Generator().manual_seed(100 + i + 1000 * int(os.environ["RANK"]))
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def train(engine: Any, steps: range) -> list[float]:
    losses = []
    for i in steps:
        x, y = batch(i)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def latest(save_dir: Path) -> str | None:
    path = save_dir / "latest"
    return path.read_text() if path.exists() else None


def same(a: Any, b: Any) -> bool:
    """Equal as torch.load results, mappings compared as mappings."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if type(a).__module__.startswith("deepspeed"):  # config objects without __eq__
        return type(a) is type(b) and repr(a) == repr(b)
    return bool(a == b)


def resume(root: Path) -> dict[str, Any]:
    """Save through lazyckpt after 3 steps, go on 3 steps; then a fresh engine (other
    weights) loads the checkpoint and trains the same 3 steps."""
    save_dir, ref_dir = root / "ds", root / "ref"
    engine = make_engine(seed=0)
    engine.checkpoint_engine = LazyCheckpointEngine([HostMemoryTier(8 << 20), FileTier(root / "tiers")])
    train(engine, range(3))
    engine.save_checkpoint(str(save_dir), tag="t3")
    pending_before_step = engine.checkpoint_engine.get_commit_info() is not None
    latest_before_step = latest(save_dir)
    # the same state through DeepSpeed's default engine, to compare what load() returns
    lazy = engine.checkpoint_engine
    engine.checkpoint_engine = TorchCheckpointEngine()
    engine.save_checkpoint(str(ref_dir), tag="t3")
    engine.checkpoint_engine = lazy
    continued = train(engine, range(3, 6))
    latest_after = latest(save_dir)
    steps = lazy.checkpointer.steps()
    engine.destroy()

    fresh = make_engine(seed=1)
    loader = LazyCheckpointEngine([HostMemoryTier(8 << 20), FileTier(root / "tiers")])
    fresh.checkpoint_engine = loader
    path, _client = fresh.load_checkpoint(str(save_dir))
    resumed = train(fresh, range(3, 6))
    names = sorted(p.name for p in (save_dir / "t3").iterdir())
    identical = {
        name: same(loader.load(str(save_dir / "t3" / name)), torch.load(ref_dir / "t3" / name, weights_only=False))
        for name in names
    }
    # a file written by DeepSpeed's default engine is read with torch.load
    fallback = same(loader.load(str(ref_dir / "t3" / names[0])), torch.load(ref_dir / "t3" / names[0], weights_only=False))
    fresh.destroy()
    return {
        "continued": continued,
        "resumed": resumed,
        "loaded_path": path,
        "pending_before_step": pending_before_step,
        "latest_before_step": latest_before_step,
        "latest_after": latest_after,
        "steps": steps,
        "files": names,
        "identical": identical,
        "fallback": fallback,
        "pointer": json.loads((save_dir / "t3" / names[0]).read_text()),
    }


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def durable(root: Path) -> dict[str, Any]:
    """``latest`` while the durable tier holds the commit back, and after it failed."""
    errors = Errors()
    logging.getLogger("lazyckpt.deepspeed").addHandler(errors)
    save_dir = root / "ds"
    slow = FaultyTier(FileTier(root / "tiers"))
    engine = make_engine(seed=0)
    ckpt = LazyCheckpointEngine([HostMemoryTier(8 << 20), slow], retries=1, retry_backoff=0.01)
    engine.checkpoint_engine = ckpt
    out: dict[str, Any] = {}
    train(engine, range(2))
    engine.save_checkpoint(str(save_dir), tag="a")
    train(engine, range(2, 3))  # commits "a"
    out["latest_a"] = latest(save_dir)

    slow.hang("commit")
    engine.save_checkpoint(str(save_dir), tag="b")
    done = threading.Event()

    def one_step() -> None:
        train(engine, range(3, 4))  # its step() commits "b": blocks while the tier hangs
        done.set()

    worker = threading.Thread(target=one_step)
    worker.start()
    time.sleep(1.5)
    out["held_latest"] = latest(save_dir)
    out["held_step_returned"] = done.is_set()
    out["held_pointer_exists"] = (save_dir / "b" / "mp_rank_00_model_states.pt").exists()
    slow.heal()
    worker.join(60)
    out["latest_b"] = latest(save_dir)

    slow.break_("put_shard")
    engine.save_checkpoint(str(save_dir), tag="c")
    out["failed_losses"] = train(engine, range(4, 6))  # training goes on
    out["latest_after_failure"] = latest(save_dir)
    out["errors"] = list(errors.messages)
    slow.heal()
    engine.save_checkpoint(str(save_dir), tag="d")
    train(engine, range(6, 7))
    out["latest_d"] = latest(save_dir)
    out["steps"] = ckpt.checkpointer.steps()
    # the end of training without another step: destroy() commits "e" and writes latest
    engine.save_checkpoint(str(save_dir), tag="e")
    engine.destroy()
    out["latest_e"] = latest(save_dir)
    return out


def captured(root: Path) -> dict[str, Any]:
    """wait="captured": step() does not wait for the held durable tier; latest moves later."""
    save_dir = root / "ds"
    slow = FaultyTier(FileTier(root / "tiers"))
    engine = make_engine(seed=0)
    ckpt = LazyCheckpointEngine([HostMemoryTier(8 << 20), slow], wait="captured")
    engine.checkpoint_engine = ckpt
    out: dict[str, Any] = {}
    train(engine, range(2))
    slow.hang("commit")
    engine.save_checkpoint(str(save_dir), tag="a")
    t0 = time.perf_counter()
    train(engine, range(2, 4))  # the first step() commits "a": captured, not yet durable
    out["steps_returned_s"] = time.perf_counter() - t0
    out["held_latest"] = latest(save_dir)
    slow.heal()
    deadline = time.monotonic() + 60
    while latest(save_dir) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    out["latest_a"] = latest(save_dir)
    engine.destroy()
    return out


def ranks(root: Path) -> dict[str, Any]:
    """Two ranks: save through lazyckpt (a shared file tier), go on; a fresh engine on each
    rank loads (rank 1 reads rank 0's model states) and trains the same steps."""
    save_dir = root / "ds"
    engine = make_engine(seed=0)
    engine.checkpoint_engine = LazyCheckpointEngine([HostMemoryTier(8 << 20), FileTier(root / "tiers")])
    train(engine, range(3))
    engine.save_checkpoint(str(save_dir), tag="t3")
    continued = train(engine, range(3, 6))
    steps = engine.checkpoint_engine.checkpointer.steps()
    engine.destroy()
    fresh = make_engine(seed=1)
    fresh.checkpoint_engine = LazyCheckpointEngine([HostMemoryTier(8 << 20), FileTier(root / "tiers")])
    path, _ = fresh.load_checkpoint(str(save_dir))
    resumed = train(fresh, range(3, 6))
    fresh.destroy()
    return {
        "rank": int(os.environ["RANK"]),
        "loaded_path": path,
        "continued": continued,
        "resumed": resumed,
        "steps": steps,
        "latest": latest(save_dir),
        "files": sorted(p.name for p in (save_dir / "t3").iterdir()),
    }


if __name__ == "__main__":
    scenario, root = sys.argv[1], Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    result = {"resume": resume, "durable": durable, "captured": captured, "ranks": ranks}[scenario](root)
    print("RESULT " + json.dumps(result))
    if scenario == "ranks":
        (root / f"rank{result['rank']}.json").write_text(json.dumps(result))
