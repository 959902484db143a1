"""Peak resident memory and stall under a tier too slow to keep up, with when_busy="wait"
and when_busy="skip", side by side (each mode in its own fresh process, alternating).

    python bench/slow_tier_rss.py [--snapshots 40] [--state-mib 64] [--delay-ms 40]

The file tier is wrapped in lazyckpt.testing.FaultyTier with a per-call delay, so it cannot
drain one snapshot before the next is requested. "wait" must hold memory at the arena and
stall at the guard; "skip" must hold memory at the arena and drop snapshots instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any


def vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


async def one(mode: str, snapshots: int, state_mib: int, delay_ms: float) -> dict[str, Any]:
    import torch

    import lazyckpt
    from lazyckpt.testing import FaultyTier
    from tiers import FileTier, HostMemoryTier

    state = {f"w{i}": torch.randn(state_mib * 2**20 // 4 // 16) for i in range(16)}
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rss_before = vm("VmRSS")
    stalls: list[float] = []
    with tempfile.TemporaryDirectory() as root:
        slow = FaultyTier(FileTier(Path(root) / "f", keep_last=2))
        slow.delay_s = delay_ms / 1000
        arena = 2 * state_mib << 20
        async with lazyckpt.Checkpointer(
            [HostMemoryTier(arena), slow], when_busy=mode, shard_size=4 << 20
        ) as ckpt:
            rss_open = vm("VmRSS")
            ckpt.guard(opt)
            for step in range(snapshots):
                for _ in range(3):  # a little "training" between snapshots
                    model(torch.randn(64, 512)).sum().backward()
                t0 = time.perf_counter()
                opt.step()  # the guard waits here for the previous capture
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", lazyckpt.SnapshotSkippedWarning)
                    await ckpt.snapshot({"state": state, "model": model}, step=step)
                stalls.append(time.perf_counter() - t0)
            metrics = ckpt.metrics()
    return {
        "mode": mode,
        "state_mib": state_mib,
        "arena_mib": arena >> 20,
        "snapshots": snapshots,
        "skipped": metrics["snapshots_skipped"],
        "rss_before_open_mib": rss_before / 2**20,
        "rss_after_open_mib": rss_open / 2**20,
        "peak_rss_mib": vm("VmHWM") / 2**20,
        "arena_peak_mib": metrics["arena"]["peak"] / 2**20,
        "stall_median_ms": statistics.median(stalls) * 1e3,
        "stall_total_s": sum(stalls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshots", type=int, default=40)
    parser.add_argument("--state-mib", type=int, default=64)
    parser.add_argument("--delay-ms", type=float, default=40.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--child", choices=["wait", "skip"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.child:
        result = asyncio.run(one(args.child, args.snapshots, args.state_mib, args.delay_ms))
        print(json.dumps(result))
        return
    rows = []
    for rep in range(args.reps):
        for mode in ("wait", "skip") if rep % 2 == 0 else ("skip", "wait"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--snapshots", str(args.snapshots),
                 "--state-mib", str(args.state_mib), "--delay-ms", str(args.delay_ms)],
                capture_output=True, text=True, check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'mode':>5} {'state':>7} {'arena':>7} {'skipped':>8} {'RSS open':>9} {'peak RSS':>9} "
          f"{'arena peak':>11} {'stall med':>10} {'stall total':>12}")
    for r in rows:
        print(f"{r['mode']:>5} {r['state_mib']:>5}Mi {r['arena_mib']:>5}Mi {r['skipped']:>8} "
              f"{r['rss_after_open_mib']:>7.0f}Mi {r['peak_rss_mib']:>7.0f}Mi "
              f"{r['arena_peak_mib']:>9.0f}Mi {r['stall_median_ms']:>8.1f}ms {r['stall_total_s']:>10.2f}s")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
