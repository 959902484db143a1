"""Per-iteration stall of a guarded training loop behind a slowed or a hung tier, against a
healthy chain and against no checkpointing at all.

    python bench/stall_slow_tier.py [--iters 20] [--state-mib 16] [--delay-ms 400]

A snapshot is taken every iteration, the worst case. The chains, each with a host tier
that has room for several snapshots:

- ``healthy``: host, file;
- ``slow``: host, file slowed by ``--delay-ms`` per call (``lazyckpt.testing.FaultyTier``);
- ``hung``: host, file, then a third (Zarr) tier whose begin, put, commit and abort never
  return; each call fails after ``--deadline`` seconds, without retries.

Each chain runs with ``when_busy="wait"`` and ``"skip"``. Per iteration it records the time
spent in the guarded ``optimizer.step()`` (the guard waits there for the previous
snapshot's capture) and in ``snapshot()``; the "stall" is their sum minus the same for a
loop without checkpointing. Failures that the library raises into the loop (the hung
tier's missed deadlines, reported by the next ``snapshot()`` or guard) are counted.
Runs alternate in order between repetitions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import lazyckpt
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier, ZarrTier

HUNG = ("begin", "put_shard", "commit", "abort")


def model_of(state_mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, state_mib // 4)  # 4 MiB of float32 weights per 1024x1024 layer
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(layers)))
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def chain(kind: str, root: Path, arena: int, delay_s: float) -> tuple[list[lazyckpt.Tier], FaultyTier | None]:
    host = HostMemoryTier(arena)
    if kind == "healthy":
        return [host, FileTier(root / "f", keep_last=2)], None
    if kind == "slow":
        slow = FaultyTier(FileTier(root / "f", keep_last=2))
        slow.delay_s = delay_s
        return [host, slow], slow
    hung = FaultyTier(ZarrTier(root / "z", keep_last=2))
    return [host, FileTier(root / "f", keep_last=2), hung], hung


async def one(kind: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    model, opt = model_of(args.state_mib)
    batch = torch.randn(32, 1024)
    guard_s: list[float] = []
    snapshot_s: list[float] = []
    raised = 0
    skipped = 0

    def train_step() -> None:
        model(batch).square().mean().backward()

    if kind == "none":
        for _ in range(args.warmup + args.iters):
            train_step()
            t0 = time.perf_counter()
            opt.step()
            guard_s.append(time.perf_counter() - t0)
            opt.zero_grad()
            snapshot_s.append(0.0)
        return summarize(kind, mode, guard_s[args.warmup :], snapshot_s[args.warmup :], 0, 0)

    with tempfile.TemporaryDirectory() as tmp:
        tiers, faulty = chain(kind, Path(tmp), args.arena_mib << 20, args.delay_ms / 1e3)
        options: dict[str, Any] = {"when_busy": mode, "shard_size": 4 << 20}
        if kind == "hung":
            options |= {"deadline": args.deadline, "retries": 0}
        ckpt = lazyckpt.Checkpointer(tiers, **options)
        await ckpt.open()
        if kind == "hung" and faulty is not None:
            for method in HUNG:
                faulty.hang(method)
        ckpt.guard(opt)
        try:
            for step in range(args.warmup + args.iters):
                train_step()
                t0 = time.perf_counter()
                try:
                    opt.step()
                except lazyckpt.LazyCkptError:
                    raised += 1
                t1 = time.perf_counter()
                opt.zero_grad()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", lazyckpt.SnapshotSkippedWarning)
                    try:
                        await ckpt.snapshot({"model": model, "optim": opt}, step=step)
                    except lazyckpt.LazyCkptError:
                        raised += 1
                t2 = time.perf_counter()
                if step >= args.warmup:
                    guard_s.append(t1 - t0)
                    snapshot_s.append(t2 - t1)
            skipped = ckpt.metrics()["snapshots_skipped"]
        finally:
            try:
                await ckpt.aclose()
            except lazyckpt.LazyCkptError:
                raised += 1
    return summarize(kind, mode, guard_s, snapshot_s, skipped, raised)


def summarize(
    kind: str, mode: str, guard_s: list[float], snapshot_s: list[float], skipped: int, raised: int
) -> dict[str, Any]:
    both = sorted(g + s for g, s in zip(guard_s, snapshot_s, strict=True))
    return {
        "chain": kind,
        "when_busy": mode,
        "iterations": len(both),
        "guard_median_ms": statistics.median(guard_s) * 1e3,
        "snapshot_median_ms": statistics.median(snapshot_s) * 1e3,
        "step_median_ms": statistics.median(both) * 1e3,
        "step_p90_ms": both[int(0.9 * (len(both) - 1))] * 1e3,
        "step_max_ms": both[-1] * 1e3,
        "skipped": skipped,
        "errors_raised": raised,
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = [("none", "-")] + [(k, m) for k in ("healthy", "slow", "hung") for m in ("wait", "skip")]
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for kind, mode in runs if rep % 2 == 0 else runs[::-1]:
            rows.append(await one(kind, mode, args))
            print(f"  done: {kind} {mode}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--state-mib", type=int, default=16)
    parser.add_argument("--arena-mib", type=int, default=1024)
    parser.add_argument("--delay-ms", type=float, default=400.0)
    parser.add_argument("--deadline", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # the hung tier fails every snapshot on it; one line each would bury the table
    logging.getLogger("lazyckpt").setLevel(logging.ERROR)
    rows = asyncio.run(main_async(args))
    base = statistics.median(r["step_median_ms"] for r in rows if r["chain"] == "none")
    print(f"{'chain':>8} {'when_busy':>9} {'guard med':>10} {'snapshot med':>13} "
          f"{'stall med':>10} {'step p90':>9} {'step max':>9} {'skipped':>8} {'raised':>7}")
    for r in rows:
        r["stall_median_ms"] = r["step_median_ms"] - base
        print(f"{r['chain']:>8} {r['when_busy']:>9} {r['guard_median_ms']:>8.1f}ms "
              f"{r['snapshot_median_ms']:>11.1f}ms {r['stall_median_ms']:>8.1f}ms "
              f"{r['step_p90_ms']:>7.0f}ms {r['step_max_ms']:>7.0f}ms {r['skipped']:>8} "
              f"{r['errors_raised']:>7}")
    if args.out:
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        args.out.write_text(json.dumps({"args": settings, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
