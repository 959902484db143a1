"""Incremental snapshots: bytes written, stall and storage of a snapshot every iteration.

Two fine-tunes, each snapshotted after every optimizer step into a file tier that keeps the
last 10 snapshots (``keep_last=10``), behind a host-memory tier:

- ``lora``: a frozen base of ``--base-mib`` MiB (float32 weights, the same tensors every
  step) and low-rank adapters with their Adam state, about 1 % of the base. Each iteration
  runs a real Adam step on the adapters, then stands in for the forward and backward pass
  through the frozen base with ``--compute-ms`` of waiting (a GPU's work, which a CPU-only
  machine cannot run at this size in a short benchmark).
- ``full``: a full fine-tune of a model of ``--full-mib`` MiB of weights and Adam state: every
  tensor changes at every step (an in-place update of each, as an optimizer makes).

Methods, on the same state and loop, one after the other in one process:

- ``lazyckpt``: ``incremental=False``, every shard written at every snapshot;
- ``incremental``: ``incremental=True``, every shard captured, compared by crc32c and a
  128-bit digest, only the changed ones written;
- ``versions``: ``incremental="versions"``, shards whose tensors kept their version counter
  and storage are not even captured;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` with its default stager, one
  save in flight (DCP's recommendation), the oldest step directories removed beyond 10.

Reported per method: the bytes each tier received per snapshot (the first snapshot, and the
mean of the later ones, also as a fraction of the state), the stall (the time the loop is
blocked: in ``snapshot()`` and in the guard before the next optimizer step, or in
``async_save`` and waiting for the previous save), the iteration time, and the storage the
location takes after the last snapshot (allocated blocks: a sparse file's holes take none).

    python bench/incremental.py                  # 256 MiB base, 30 snapshots per method
    python bench/incremental.py --base-mib 1024 --snapshots 100
    python bench/incremental.py --quick          # seconds: for the test suite
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import REPO, MiB, loadavg, machine_info, scratch_dir, summarize

import lazyckpt
from tiers import FileTier, HostMemoryTier

KEEP_LAST = 10
METHODS = ("lazyckpt", "incremental", "versions", "dcp_async")


class Workload:
    """A training state and the step that changes it."""

    name = ""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def step(self) -> None:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in _tensors(self.state))


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return []


class LoRA(Workload):
    """A frozen base with rank-16 adapters on every layer, trained by Adam."""

    name = "lora"

    def __init__(self, base_mib: int, compute_ms: float, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        width = 2048
        layers = max(1, base_mib * MiB // (width * width * 4))
        self.compute_s = compute_ms / 1000
        self.base = {
            f"layer{i}.weight": torch.randn(width, width, generator=g) for i in range(layers)
        }
        rank = max(1, round(0.01 * width / 2 / 3))  # adapters + 2 Adam moments ~ 1 % of base
        self.adapters = torch.nn.ParameterDict(
            {
                f"layer{i}_{ab}": torch.nn.Parameter(
                    torch.randn(*((width, rank) if ab == "a" else (rank, width)), generator=g)
                    * 0.01
                )
                for i in range(layers)
                for ab in ("a", "b")
            }
        )
        self.optim = torch.optim.Adam(self.adapters.parameters(), lr=1e-3)
        self.x = torch.randn(8, width, generator=g)
        self.step()  # Adam's state exists from the first snapshot on
        self.state = {"base": self.base, "adapters": self.adapters, "optim": self.optim}

    @property
    def nbytes(self) -> int:
        adapters = sum(p.nbytes for p in self.adapters.parameters())
        return sum(t.nbytes for t in self.base.values()) + 3 * adapters

    def step(self) -> None:
        time.sleep(self.compute_s)  # the forward and backward through the base, elsewhere
        loss = sum(
            ((self.x @ self.adapters[f"layer{i}_a"]) @ self.adapters[f"layer{i}_b"]).square().mean()
            for i in range(len(self.base))
        )
        assert isinstance(loss, torch.Tensor)
        torch.autograd.backward(loss)
        self.optim.step()
        self.optim.zero_grad()


class FullFineTune(Workload):
    """Every tensor changes at every step: weights and both Adam moments."""

    name = "full"

    def __init__(self, full_mib: int, compute_ms: float, seed: int = 1) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        width = 1024
        per = max(1, full_mib * MiB // (3 * width * width * 4))
        self.compute_s = compute_ms / 1000
        self.state = {
            part: {f"layer{i}": torch.randn(width, width, generator=g) for i in range(per)}
            for part in ("weights", "exp_avg", "exp_avg_sq")
        }

    def step(self) -> None:
        time.sleep(self.compute_s)
        with torch.no_grad():
            for t in _tensors(self.state):
                t.mul_(0.999).add_(1e-3)


def allocated_bytes(root: Path) -> int:
    """Bytes the files under ``root`` take on disk."""
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


class ByteCounter:
    """The bytes each tier of a Checkpointer received so far, read between snapshots."""

    def __init__(self, ckpt: lazyckpt.SyncCheckpointer) -> None:
        self.ckpt = ckpt
        self.last = {"host": 0, "file": 0}

    def take(self) -> dict[str, int]:
        tiers = self.ckpt.metrics()["tiers"]
        now = {name: tiers[name]["bytes"] for name in self.last}
        delta = {name: now[name] - self.last[name] for name in now}
        self.last = now
        return delta


def lazy_method(mode: bool | str) -> Callable[[Workload, Path, int], dict[str, Any]]:
    def run(work: Workload, root: Path, snapshots: int) -> dict[str, Any]:
        arena = (work.nbytes * 2 + 64 * MiB) // 4096 * 4096
        chain = [HostMemoryTier(capacity_bytes=arena), FileTier(root, keep_last=KEEP_LAST)]
        stalls, iters = [], []
        with lazyckpt.SyncCheckpointer(chain, incremental=mode) as ckpt:
            counter = ByteCounter(ckpt)
            for step in range(snapshots):
                t0 = time.perf_counter()
                work.step()
                t1 = time.perf_counter()
                handle = ckpt.snapshot(work.state, step=step)
                ckpt.wait_captured()  # what the guard does before the next optimizer step
                t2 = time.perf_counter()
                stalls.append(t2 - t1)
                iters.append(t2 - t0)
                if step == 0:  # the first snapshot's bytes on their own (off the clock)
                    handle.wait()
                    first = counter.take()
            ckpt.drain()
            rest = counter.take()
            metrics = ckpt.metrics()
        later = max(1, snapshots - 1)
        return {
            "stalls": stalls,
            "iters": iters,
            "first": first,
            "later_mean": {name: rest[name] / later for name in rest},
            "file_reused_bytes": metrics["tiers"]["file"]["reused_bytes"],
            "capture_skipped_bytes": metrics["capture_skipped_bytes"],
        }

    return run


def dcp_method(work: Workload, root: Path, snapshots: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict_saver import async_save

    stalls, iters, sizes = [], [], []
    upload: Any = None
    for step in range(snapshots):
        t0 = time.perf_counter()
        work.step()
        t1 = time.perf_counter()
        if upload is not None:
            upload.result()  # one save in flight at most
            sizes.append(allocated_bytes(root / f"step-{step - 1}"))
            old = root / f"step-{step - 1 - KEEP_LAST}"
            if old.exists():  # keep_last, as the other methods' tier does
                shutil.rmtree(old)
        upload = async_save(_plain(work.state), checkpoint_id=str(root / f"step-{step}"))
        t2 = time.perf_counter()
        stalls.append(t2 - t1)
        iters.append(t2 - t0)
    upload.result()
    sizes.append(allocated_bytes(root / f"step-{snapshots - 1}"))
    old = root / f"step-{snapshots - 1 - KEEP_LAST}"
    if old.exists():
        shutil.rmtree(old)
    later = sizes[1:] or sizes
    return {
        "stalls": stalls,
        "iters": iters,
        "first": {"file": sizes[0]},
        "later_mean": {"file": sum(later) / len(later)},
    }


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """The state as DCP takes it: state_dict() of modules and optimizers."""
    return {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}


def measure(work: Workload, method: str, snapshots: int, tmp: str | None) -> dict[str, Any]:
    modes: dict[str, bool | str] = {"lazyckpt": False, "incremental": True, "versions": "versions"}
    runner = dcp_method if method == "dcp_async" else lazy_method(modes[method])
    with scratch_dir(tmp, f"incr-{work.name}-{method}-") as root:
        t0 = time.perf_counter()
        raw = runner(work, root, snapshots)
        wall = time.perf_counter() - t0
        storage = allocated_bytes(root)
    state = work.nbytes
    out: dict[str, Any] = {
        "snapshots": snapshots,
        "wall_s": wall,
        "stall_s": summarize(raw["stalls"][1:]),  # the first includes one-time setup
        "first_stall_s": raw["stalls"][0],
        "iteration_s": summarize(raw["iters"][1:]),
        "storage_bytes": storage,
        "storage_over_state": storage / state,
        "bytes_per_snapshot": {},
    }
    for tier, first in raw["first"].items():
        later = raw["later_mean"][tier]
        out["bytes_per_snapshot"][tier] = {
            "first": first,
            "later_mean": later,
            "later_over_state": later / state,
        }
    for key in ("file_reused_bytes", "capture_skipped_bytes"):
        if key in raw:
            out[key] = raw[key]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-mib", type=int, default=256, help="LoRA: frozen base size")
    parser.add_argument("--full-mib", type=int, default=192, help="full fine-tune: state size")
    parser.add_argument("--snapshots", type=int, default=30, help="snapshots per method")
    parser.add_argument("--compute-ms", type=float, default=100.0, help="stand-in compute/step")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--workloads", default="lora,full")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--tmp", default=None, help="where the locations are written")
    args = parser.parse_args(argv)
    if args.quick:
        args.base_mib, args.full_mib, args.snapshots, args.compute_ms = 16, 12, 4, 10.0
    methods = [m for m in args.methods.split(",") if m]
    result: dict[str, Any] = {
        "benchmark": "incremental",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "loadavg_before": loadavg(),
        "args": vars(args),
        "keep_last": KEEP_LAST,
        "workloads": {},
    }
    for name in args.workloads.split(","):
        work: Workload = (
            LoRA(args.base_mib, args.compute_ms)
            if name == "lora"
            else FullFineTune(args.full_mib, args.compute_ms)
        )
        entry: dict[str, Any] = {"state_bytes": work.nbytes, "methods": {}}
        for method in methods:
            entry["methods"][method] = measure(work, method, args.snapshots, args.tmp)
            m = entry["methods"][method]
            print(
                f"{name:5s} {method:12s} stall {m['stall_s']['median'] * 1e3:8.1f} ms  "
                f"file/snapshot {m['bytes_per_snapshot']['file']['later_mean'] / MiB:9.2f} MiB "
                f"({m['bytes_per_snapshot']['file']['later_over_state']:.2%} of state)  "
                f"storage {m['storage_bytes'] / MiB:9.1f} MiB",
                flush=True,
            )
        result["workloads"][name] = entry
    result["loadavg_after"] = loadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    tag = "quick" if args.quick else f"{args.base_mib}mib-{args.snapshots}"
    path = out / f"incremental-{result['machine']['slug']}-{tag}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
